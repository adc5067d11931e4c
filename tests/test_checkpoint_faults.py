"""kill -9 inside a checkpoint save and inside a training step, then resume: the bounded version of
tests/checkpoint_faults.py (its small ``mlp`` target: bf16 split weights, int8 optimizer state, step_in_backward),
whose full runs (the LLM fine-tune recipe, 2-rank FSDP2) are reported in docs/checkpoints.md; and torchrun's own
restart of 2 FSDP2 ranks after one was killed. Only processes these tests start (each in a session of its own) are
killed. ~40-60 s each, the store test ~10 s."""
import checkpoint_faults as F


def test_kill_inside_a_save_and_inside_a_step_then_resume(tmp_path):
    # Each save waits 0.5 s between DCP's last write (.metadata) and its publication: the kill inside the save
    # lands there (a folder with every file and the metadata, but no marker and not renamed).
    report = F.run("mlp", kills=2, steps=12, every=4, seed=1, work=tmp_path, publish_delay=0.5)
    modes = [t["mode"] for t in report["trials"]]
    assert modes == ["in_save", "in_step"], modes
    for t in report["trials"]:
        assert t["killed"] and t["trigger_seen"], t
        assert t["resumed_step"] == t["expected_resume_step"], t
        assert t["resumed_folder_was_complete"], t
        assert t["losses_from_resumed_step_equal"], t
        assert t["final_weights_bit_identical"] and t["final_optimizer_state_bit_identical"], t
    # The kill inside the save left its unfinished folder, which the resume did not take.
    inside = report["trials"][0]
    assert inside["killed_inside_save"], inside
    assert (inside["folders_at_kill"][f"step-{inside['k']}.tmp"]) is False
    assert inside["resumed_step"] < inside["k"], inside


def test_torchrun_restart_resumes_after_a_rank_is_killed(tmp_path):
    """torchrun --max-restarts 1, one of the 2 FSDP2 ranks SIGKILLed after a checkpoint: torchrun restarts both
    ranks in the same launch, which resume from the latest complete checkpoint and end bit-identical to the
    uninterrupted run (the restarted ranks' gloo group once failed to connect: stale addresses in torchrun's
    store). ~60-80 s (two torchrun launches)."""
    report = F.run("fsdp", kills=1, steps=6, every=3, seed=0, work=tmp_path, restarts=1, modes=("in_step",))
    (t,) = report["trials"]
    assert t["killed"] and t["trigger_seen"] and t["restarted_by_torchrun"], t
    assert t["resumed_step"] == t["expected_resume_step"] in (3, 6), t  # 6: the kill landed in the last save
    assert t["losses_from_resumed_step_equal"], t
    assert t["final_weights_bit_identical"] and t["final_optimizer_state_bit_identical"], t


_RANK = """
import os, sys, time, torch, torch.distributed as dist
from recipes.fsdp_train import init_process_group
time.sleep(float(sys.argv[1]))
init_process_group()
t = torch.ones(1)
dist.all_reduce(t)
open(sys.argv[2], "w").write(str(t.item()))
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    time.sleep(120)  # killed here, as torchrun's first attempt is
dist.destroy_process_group()
"""


def test_restarted_ranks_connect_despite_the_previous_attempts_keys(tmp_path):
    """torchrun keeps one TCPStore for the whole job; the ranks it restarts find there the gloo addresses the
    killed attempt's ranks published under the same key names. With plain init_process_group("gloo") a restarted
    rank connects to those dead addresses ("Gloo connectFullMesh failed ... Connection refused") or hangs;
    recipes.fsdp_train keys each attempt apart. Here: the store hosted by the test as torchrun's agent hosts it,
    attempt 0's two ranks SIGKILLed after an all_reduce, attempt 1's rank 0 starting 3 s after its rank 1."""
    import datetime
    import os
    import subprocess
    import sys
    import time

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def attempt(n: int, late0: float) -> list:
        procs = []
        for rank in (0, 1):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(store.port), TORCHELASTIC_USE_AGENT_STORE="True", PYTHONPATH=root,
                       TORCHELASTIC_RESTART_COUNT=str(n), OMP_NUM_THREADS="1")
            procs.append(subprocess.Popen([sys.executable, "-c", _RANK, str(late0 if rank == 0 else 0),
                                           str(tmp_path / f"a{n}r{rank}")], env=env, cwd=tmp_path,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        try:
            deadline = time.monotonic() + 60
            while n == 0 and not all((tmp_path / f"a0r{r}").exists() for r in (0, 1)):
                assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "attempt 0 failed"
                time.sleep(0.05)
            for p in procs if n == 0 else ():
                p.kill()
            for p in procs:
                p.communicate(timeout=60)
            return [p.returncode for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()

    assert attempt(0, 0) == [-9, -9]
    assert len(store.list_keys()) >= 2  # the killed attempt's gloo addresses stay in the store
    assert attempt(1, 3.0) == [0, 0]
    assert [(tmp_path / f"a1r{r}").read_text() for r in (0, 1)] == ["2.0", "2.0"]
