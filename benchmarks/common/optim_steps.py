"""The optimizer steps bench_step and bench_state time: ipex_train's fused step over a storage layout
(:class:`OurStep`) and torch's ``fused=True`` fp32 optimizer (:class:`TorchStep`) over the same parameter count, with
the rows' optimizers, layouts and hyper-parameters."""
from __future__ import annotations

from collections import defaultdict

import torch

from ipex_train.base import ops as _ops
from ipex_train.optim import _layouts, fused, registry

ROOF_BYTES_PER_ELEMENT = 12  # the bandwidth roof a.add_(b): read a, read b, write a
TARGET_ROOF = 0.90  # share of that roof each row is held to

# Rows: every registered optimizer, and AdamW (Adam's kernel with decoupled weight decay, its own torch baseline).
OPTIMIZERS = registry.NAMES[:2] + ("adamw",) + registry.NAMES[2:]
KIND = {o: "adam" if o == "adamw" else o for o in OPTIMIZERS}
LAYOUTS = ("fp32", "split_bf16", "bf16_master", "fp16_master", "fp64")
DEFAULT_LAYOUTS = LAYOUTS[:4]

# Hyper-parameters of each row (torch.optim's classes get the same values in torch's fused baseline); the class is
# the registry's, AdamW's for the AdamW row.
HYPER = {"sgd": dict(lr=1e-2, momentum=0.9), "adam": dict(lr=1e-3), "adamw": dict(lr=1e-3, weight_decay=1e-2),
         "adagrad": dict(lr=1e-2), "lamb": dict(lr=1e-3, weight_decay=1e-2), "lars": dict(lr=0.1, momentum=0.9)}
# torch fused fp32 optimizer each of ours is compared with (torch has no Lamb or Lars)
BASELINE = {o: {"lamb": "adam", "lars": "sgd"}.get(o, o) for o in OPTIMIZERS}


def optimizer_class(opt: str) -> type:
    """The optimizer class of row ``opt``."""
    return torch.optim.AdamW if opt == "adamw" else registry.get(opt).optimizer_class


def state_tensors(opt: str) -> int:
    """How many state tensors per parameter row ``opt`` keeps with its hyper-parameters."""
    group = optimizer_class(opt)([torch.zeros(1)], **HYPER[opt]).param_groups[0]
    return sum(s.present(group) for s in registry.get(KIND[opt]).state)


def parse_size(text: str) -> int:
    """'10M' -> 10_000_000; also K and G suffixes, or a plain integer."""
    text = text.strip().upper()
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)



def fmt_size(n: int) -> str:
    return f"{n / 1e6:g}M" if n >= 10**6 else str(n)




def sizes(n: int, tensors: int) -> list[int]:
    base = n // tensors
    return [base + (1 if i < n % tensors else 0) for i in range(tensors)]


def _group(opt: str) -> dict:
    group = dict(optimizer_class(opt)([torch.zeros(1)], **HYPER[opt]).param_groups[0])
    del group["params"]
    return group


class OurStep:
    """One fused step of ``opt`` over ``n`` parameters stored as ``layout`` (state created on the first call)."""

    def __init__(self, opt: str, layout: str, n: int, tensors: int):
        self.kind, self.group = KIND[opt], _group(opt)
        grad_dtype = _layouts.BY_NAME[layout].grad
        self.params, self.aux, self.grads = [], [], []
        for k in sizes(n, tensors):
            w = torch.empty(k, dtype=torch.float64 if layout == "fp64" else torch.float32).normal_()
            if layout in ("fp32", "fp64"):
                p, a = w, None
            elif layout == "split_bf16":
                p, a = _ops.split_bf16(w)
            else:
                p, a = w.to(grad_dtype), w
            self.params.append(p)
            self.aux.append(a)
            self.grads.append(torch.empty(k, dtype=grad_dtype).normal_(std=1e-2))
        self.state = defaultdict(dict)

    def __call__(self) -> None:
        fused.fused_step(registry.get(self.kind), self.group, self.state, self.params, self.aux, self.grads)


class TorchStep:
    """One step of torch's ``fused=True`` fp32 optimizer over ``n`` parameters."""

    def __init__(self, opt: str, n: int, tensors: int):
        self.params = []
        for k in sizes(n, tensors):
            p = torch.empty(k).normal_()
            p.grad = torch.empty(k).normal_(std=1e-2)
            self.params.append(p)
        self.opt = optimizer_class(opt)(self.params, fused=True, **HYPER[opt])

    def __call__(self) -> None:
        self.opt.step()
