"""The LightningModule, data and runs of tests/test_lightning.py, and the rank side of its DDP test (spawned
processes, gloo on 127.0.0.1; each rank writes its results to a file)."""
from __future__ import annotations

import os
import pickle
import traceback
import warnings
from pathlib import Path

import lightning as L
import spawn_ranks
import torch
from torch import nn

from ipex_train.integrations.lightning import IpexTrainPrecision

VOCAB, SEQ, WIDTH, CLASSES = 32, 8, 32, 4


class Net(L.LightningModule):
    """Embedding -> Linear + GELU -> LayerNorm -> mean over tokens -> Linear: every kind of layer optimize() keeps
    fp32 (LayerNorm) or converts (Embedding, Linear); AdamW with a StepLR schedule."""

    def __init__(self, lr: float = 1e-2, step_size: int = 2):
        super().__init__()
        torch.manual_seed(0)
        self.lr, self.step_size = lr, step_size
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.mlp = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, CLASSES)
        self.losses: list[float] = []

    def forward(self, ids):
        return self.head(self.norm(torch.nn.functional.gelu(self.mlp(self.embed(ids)))).mean(1))

    def training_step(self, batch, batch_idx):
        ids, y = batch
        loss = torch.nn.functional.cross_entropy(self(ids).float(), y)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=self.step_size, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def data(n: int = 32) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return torch.utils.data.TensorDataset(ids, ids[:, 0] % CLASSES)


def loader(batch: int, n: int = 32, rank: int = 0, world: int = 1) -> torch.utils.data.DataLoader:
    """Batches of ``batch`` rows in order; with ``world`` > 1, rank ``rank``'s share of each global batch of
    ``batch * world`` rows (its own contiguous block), so the ranks' steps together see one process's."""
    rows = torch.arange(n).view(-1, world, batch)[:, rank].reshape(-1)
    return torch.utils.data.DataLoader(torch.utils.data.Subset(data(n), rows.tolist()), batch_size=batch,
                                       shuffle=False)


def trainer(plugin, **kw) -> L.Trainer:
    """A quiet CPU Trainer (no logger, progress bar or summary; checkpoints only when asked)."""
    base = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                enable_checkpointing=False, plugins=[plugin] if plugin is not None else None)
    return L.Trainer(**{**base, **kw})


def fit(precision: str, batch: int, steps: int, rank: int = 0, world: int = 1, **kw) -> dict[str, torch.Tensor]:
    """Train a fresh Net for ``steps`` steps of ``batch`` rows with the plugin (as rank ``rank`` of ``world``);
    its final fp32 state_dict and its losses."""
    module = Net()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on dataloader workers
        trainer(IpexTrainPrecision(precision), max_steps=steps, **kw).fit(module, loader(batch, rank=rank,
                                                                                          world=world))
    out = {k: v.clone() for k, v in module.state_dict().items()}
    out["losses"] = torch.tensor(module.losses)
    return out


def _rank_main(rank: int, world: int, port: int, batch: int, steps: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0")
    torch.set_num_threads(1)
    from lightning.pytorch.strategies import DDPStrategy

    results = {}
    try:
        for precision in ("32", "bf16"):
            strategy = DDPStrategy(process_group_backend="gloo")
            results[precision] = fit(precision, batch, steps, rank, world, devices=world, strategy=strategy,
                                     use_distributed_sampler=False)
    except Exception:
        results["traceback"] = traceback.format_exc()
    with open(Path(out) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(results, f)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def spawn(world: int, batch: int, steps: int, out: Path, timeout: float = 240) -> list[dict]:
    """Run :func:`fit` (fp32, then bf16) in ``world`` fresh DDP ranks with ``batch`` rows each; each rank's
    results. Ranks still running after ``timeout`` seconds are killed."""
    return spawn_ranks.spawn(_rank_main, (batch, steps), world, out, timeout, "Lightning DDP")
