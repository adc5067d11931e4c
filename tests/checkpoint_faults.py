"""Fault injection for checkpoints: kill -9 a checkpointing training run at random moments (inside steps, inside
saves, between them), run the same command again, and check that it resumes from the latest complete checkpoint
and ends bit-identical to an uninterrupted run (final weights and optimizer state, and the losses from the resumed
step on).

    python tests/checkpoint_faults.py --target llm --kills 20 --json out/faults_llm.json
    python tests/checkpoint_faults.py --target fsdp --kills 6 --json out/faults_fsdp.json    # one rank killed
    python tests/checkpoint_faults.py --target fsdp --restarts --kills 4    # torchrun --max-restarts 1 resumes

Targets: ``llm`` is ``python -m recipes.llm_finetune --size tiny --mode full --variants ipex-int8-sib`` (bf16
split weights, int8 optimizer state, the step inside backward); ``fsdp`` is ``torchrun --nproc_per_node 2 -m
recipes.fsdp_train --state-dtype int8 --step-in-backward`` with one rank killed (torchrun then stops the other;
with ``--restarts`` torchrun runs with ``--max-restarts 1`` and its restarted workers resume, in the same launch);
``mlp`` is a small loop of this file's own (tests/test_checkpoint_faults.py uses it: it starts in seconds). Every
process started here is in a session of its own, and only those are killed.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESUMED = re.compile(r"checkpoints: resumed from (\S+) at step (\d+)")
MODES = ("in_save", "in_step", "after_save", "early")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(target: str, ckdir: Path, out: Path, steps: int, every: int,
            publish_delay: float = 0.0, restarts: int = 0) -> tuple[list[str], Path]:
    """The command line of one run of ``target`` and the folder its step-N checkpoints go to; ``restarts``
    (fsdp): torchrun's --max-restarts."""
    py = [sys.executable, "-W", "ignore"]
    flags = ["--checkpoint-dir", str(ckdir), "--checkpoint-every", str(every), "--steps", str(steps)]
    if target == "llm":
        return py + ["-m", "recipes.llm_finetune", "--size", "tiny", "--mode", "full", "--variants", "ipex-int8-sib",
                     "--batch-size", "2", "--seq-len", "64", "--corpus-mib", "1", "--no-progress", "--out",
                     str(out)] + flags, ckdir / "ipex-int8-sib"
    if target == "fsdp":
        return py + ["-m", "torch.distributed.run", "--max-restarts", str(restarts), "--nproc_per_node", "2",
                     "--master_addr", "127.0.0.1",
                     "--master_port", str(_port()), "-m", "recipes.fsdp_train", "--hidden", "64", "--layers", "1",
                     "--heads", "2", "--seq-len", "32", "--batch-size", "2", "--state-dtype", "int8",
                     "--step-in-backward", "--no-progress", "--json", str(out / "metrics.json"), "--plot",
                     str(out / "plot.png")] + flags, ckdir
    return py + [str(Path(__file__).resolve()), "--worker", "--json", str(out / "metrics.json"),
                 "--publish-delay", str(publish_delay)] + flags, ckdir


def _losses(target: str, out: Path) -> tuple[int, list[float]]:
    data = json.loads((out / "metrics.json").read_text())
    first = data["runs"][0].get("first_step", data.get("first_step", 0))
    return first, data["runs"][0]["losses"]


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    with open(log, "w") as f:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def finish(proc: subprocess.Popen, log: Path, timeout: float) -> str:
    """Wait for a run to end; its output. Raises if it fails."""
    try:
        proc.wait(timeout=timeout)
    finally:
        stop(proc)
    text = log.read_text()
    if proc.returncode != 0:
        raise RuntimeError(f"run exited {proc.returncode}:\n{text[-3000:]}")
    return text


def stop(proc: subprocess.Popen) -> None:
    """SIGKILL the session of a process started here (its children with it), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def folders(ckdir: Path) -> dict[str, bool]:
    """Every entry of the checkpoint folder: name -> complete (checked here, not with the library: a step-N folder
    with DCP's .metadata and a marker naming step N)."""
    out = {}
    if ckdir.is_dir():
        for d in sorted(ckdir.iterdir()):
            m = re.fullmatch(r"step-(\d+)", d.name)
            marker = d / "CHECKPOINT_COMPLETE.json"
            ok = bool(m) and (d / ".metadata").is_file() and marker.is_file() and \
                json.loads(marker.read_text() or "{}").get("step") == int(m.group(1))
            out[d.name] = ok
    return out


def _wait_for(proc, ckdir: Path, name: str, deadline: float) -> bool:
    while time.monotonic() < deadline and proc.poll() is None:
        if (ckdir / name).exists():
            return True
        time.sleep(0.001)
    return False


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie not yet reaped counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def _restarted(proc: subprocess.Popen, ranks: list[int], deadline: float) -> bool:
    """Wait for every one of ``ranks`` to exit (torchrun stops the survivor after one was killed); whether torchrun
    then starts new ranks. The checkpoint folder is as the old ranks left it until the new ones have imported
    torch and resumed, seconds later."""
    while not all(_gone(r) for r in ranks) and time.monotonic() < deadline:
        time.sleep(0.01)
    while proc.poll() is None and time.monotonic() < deadline:
        if set(_children(proc.pid)) - set(ranks):
            return True
        time.sleep(0.01)
    return False


def inject(target: str, proc: subprocess.Popen, ckdir: Path, mode: str, k: int, step_s: float,
           first_ckpt_s: float, rng: random.Random, restart: bool = False) -> dict:
    """Kill ``proc`` at a moment of kind ``mode`` around the checkpoint of step ``k``; what happened. With
    ``restart`` (torchrun --max-restarts) one rank is killed and torchrun left running: this returns once every
    rank of that attempt has exited, before the restarted ranks can touch the checkpoint folder."""
    t0 = time.monotonic()
    deadline = t0 + 600
    while restart and len(_children(proc.pid)) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)  # the ranks are started: the victim is one of them, never torchrun itself
    if mode == "early":  # at a random moment before the first save starts (start-up, the first steps)
        hit = not _wait_for(proc, ckdir, f"step-{k}.tmp", t0 + rng.uniform(0, first_ckpt_s))
    elif mode == "in_save":
        hit = _wait_for(proc, ckdir, f"step-{k}.tmp", deadline)
        time.sleep(rng.uniform(0, 0.03))
    else:
        hit = _wait_for(proc, ckdir, f"step-{k}", deadline)
        time.sleep(rng.uniform(0, 0.05) if mode == "after_save" else rng.uniform(0, 3 * step_s))
    killed = proc.poll() is None
    victim = proc.pid
    if target == "fsdp":  # one rank: torchrun's worker
        ranks = _children(proc.pid)
        victim = rng.choice(ranks) if ranks else proc.pid
    if killed:
        os.kill(victim, signal.SIGKILL)
    if restart:
        return {"mode": mode, "k": k, "trigger_seen": hit, "killed": killed, "after_s": round(time.monotonic() - t0, 3),
                "victim": "rank", "restarted_by_torchrun": killed and _restarted(proc, ranks, deadline)}
    if target == "fsdp":
        try:
            proc.wait(timeout=120)  # torchrun notices the dead rank and stops the other
        except subprocess.TimeoutExpired:
            pass
    stop(proc)
    return {"mode": mode, "k": k, "trigger_seen": hit, "killed": killed, "after_s": round(time.monotonic() - t0, 3),
            "victim": "rank" if target == "fsdp" else "process"}


def trial(target: str, i: int, work: Path, ref: dict, args, rng: random.Random) -> dict:
    """One kill and the resume after it."""
    ckroot, out = work / f"ck{i}", work / f"out{i}"
    out.mkdir(parents=True)
    cmd, ckdir = command(target, ckroot, out, args.steps, args.every, args.publish_delay, args.restarts)
    mode = args.modes[i % len(args.modes)]
    k = args.every if mode == "early" else rng.choice(range(args.every, args.steps, args.every))
    proc = start(cmd, out / "killed.log")
    record = inject(target, proc, ckdir, mode, k, ref["step_s"], ref["first_ckpt_s"], rng, bool(args.restarts))
    seen = folders(ckdir)
    complete = [int(n.split("-")[1]) for n, ok in seen.items() if ok]
    expected = max(complete, default=0)
    if args.restarts:  # torchrun's restarted ranks resume in the same launch
        text = finish(proc, out / "killed.log", timeout=900)
    else:
        cmd, _ = command(target, ckroot, out, args.steps, args.every, args.publish_delay)  # a new torchrun port
        text = finish(start(cmd, out / "resumed.log"), out / "resumed.log", timeout=900)
    found = RESUMED.search(text)
    resumed = int(found.group(2)) if found else 0
    resumed_folder = Path(found.group(1)).name if found else None
    first, losses = _losses(target, out)
    final = load_final(ckdir, args.steps)
    record.update(folders_at_kill=seen, killed_inside_save=any(n.endswith(".tmp") for n in seen),
                  expected_resume_step=expected, resumed_step=resumed, resumed_folder=resumed_folder,
                  resumed_folder_was_complete=resumed_folder is None or seen.get(resumed_folder, False),
                  losses_from_resumed_step_equal=first == resumed and losses == ref["losses"][resumed:],
                  final_weights_bit_identical=_same(final["model"], ref["final"]["model"]),
                  final_optimizer_state_bit_identical=_same(final["optim"]["state"], ref["final"]["optim"]["state"]))
    record["ok"] = all(record[key] for key in ("resumed_folder_was_complete", "losses_from_resumed_step_equal",
                                                "final_weights_bit_identical", "final_optimizer_state_bit_identical")
                       ) and resumed == expected and record.get("restarted_by_torchrun", True)
    return record


def load_final(ckdir: Path, steps: int) -> dict:
    """The final checkpoint loaded with plain torch: DCP's dcp_to_torch_save, then torch.load."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(ckdir / f"step-{steps}", Path(tmp) / "final.pt")
        return torch.load(Path(tmp) / "final.pt", weights_only=False)


def _same(a, b) -> bool:
    import torch

    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def reference(target: str, work: Path, args) -> dict:
    """The uninterrupted run (checkpointing as the killed ones do): its losses, final checkpoint, timings."""
    out = work / "reference"
    out.mkdir(parents=True)
    cmd, ckdir = command(target, work / "ck_reference", out, args.steps, args.every, args.publish_delay)
    t0 = time.monotonic()
    proc = start(cmd, out / "run.log")
    first_ckpt = _wait_for(proc, ckdir, f"step-{args.every}", t0 + 900) and time.monotonic() - t0
    finish(proc, out / "run.log", timeout=900)
    first, losses = _losses(target, out)
    data = json.loads((out / "metrics.json").read_text())["runs"][0]
    step_s = sorted(data["step_times_s"])[len(data["step_times_s"]) // 2]
    return {"losses": losses, "final": load_final(ckdir, args.steps), "step_s": step_s,
            "first_ckpt_s": first_ckpt or 10.0, "wall_s": time.monotonic() - t0}


def run(target: str, kills: int, steps: int, every: int, seed: int, work: Path, publish_delay: float = 0.0,
        restarts: int = 0, modes: tuple = MODES) -> dict:
    """The reference run, then ``kills`` trials (kill kinds taken in turn from ``modes``); the report.
    ``publish_delay`` (``mlp`` only): seconds each save waits after DCP wrote everything (``.metadata`` included)
    and before it is published: a kill inside the save then lands in its most delicate moment. ``restarts``
    (``fsdp`` only): torchrun's --max-restarts; the killed launch's restarted ranks resume, no second launch."""
    if restarts and target != "fsdp":
        raise ValueError("restarts: torchrun restarts ranks of the fsdp target only")
    args = argparse.Namespace(steps=steps, every=every, publish_delay=publish_delay, restarts=restarts, modes=modes)
    rng = random.Random(seed)
    t0 = time.monotonic()
    ref = reference(target, work, args)
    trials = [trial(target, i, work, ref, args, rng) for i in range(kills)]
    return {"target": target, "command": " ".join(command(target, Path("DIR"), Path("OUT"), steps, every,
                                                           restarts=restarts)[0][3:]),
            "steps": steps, "every": every, "seed": seed, "kills": kills, "restarts": restarts,
            "killed": sum(t["killed"] for t in trials),
            "killed_inside_save": sum(t["killed_inside_save"] for t in trials),
            "all_ok": all(t["ok"] for t in trials), "reference_wall_s": round(ref["wall_s"], 1),
            "reference_losses": ref["losses"], "wall_s": round(time.monotonic() - t0, 1), "trials": trials}


def worker(args) -> None:
    """The ``mlp`` target: a small model, optimize(bf16, int8 state, step_in_backward), AdamW with warm-up,
    checkpointing each ``--checkpoint-every`` steps."""
    import torch

    import ipex_train
    from ipex_train.checkpoint import Checkpointer, _folders

    if args.publish_delay:
        publish = _folders.publish

        def slow_publish(*a, **k):
            time.sleep(args.publish_delay)
            return publish(*a, **k)

        _folders.publish = slow_publish

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 64)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = ipex_train.optimize(model, opt, dtype=torch.bfloat16, inplace=True, optimizer_state_dtype="int8",
                                     step_in_backward=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    gen = torch.Generator().manual_seed(1)
    ckpt = Checkpointer(args.checkpoint_dir, model, opt, sched, every=args.checkpoint_every)
    resumed = ckpt.resume()
    start_step = 0 if resumed is None else resumed.step
    if resumed is not None:
        gen.set_state(resumed.data_state)
        print(f"checkpoints: resumed from {resumed.path} at step {resumed.step}", flush=True)
    losses, times = [], []
    for step in range(start_step, args.steps):
        t = time.perf_counter()
        x = torch.randn(32, 64, generator=gen)
        loss = torch.nn.functional.mse_loss(model(x), x.flip(1))
        loss.backward()
        opt.step()
        sched.step()
        time.sleep(0.01)  # a step long enough to be killed inside
        losses.append(loss.item())
        times.append(time.perf_counter() - t)
        ckpt.maybe_save(step + 1, gen.get_state())
    ckpt.maybe_save(args.steps, gen.get_state(), final=True)
    ckpt.close()
    Path(args.json).write_text(json.dumps({"runs": [{"first_step": start_step, "losses": losses,
                                                     "step_times_s": times or [0.0]}]}))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", choices=["llm", "fsdp", "mlp"], default="llm")
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--steps", type=int, default=None, help="default: 24 (llm, mlp), 12 (fsdp)")
    parser.add_argument("--every", type=int, default=None, help="steps between checkpoints (default: 4, fsdp 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--restarts", action="store_true",
                        help="fsdp: torchrun --max-restarts 1 restarts the ranks after the kill (no second launch)")
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint-dir", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint-every", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--publish-delay", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    steps = args.steps or (12 if args.target == "fsdp" else 24)
    every = args.every or (3 if args.target == "fsdp" else 4)
    with tempfile.TemporaryDirectory(prefix="checkpoint_faults_") as work:
        report = run(args.target, args.kills, steps, every, args.seed, Path(work), restarts=int(args.restarts))
    summary = {k: v for k, v in report.items() if k not in ("trials", "reference_losses")}
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0 if report["all_ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
