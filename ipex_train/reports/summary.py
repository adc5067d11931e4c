"""What optimize() did to a model (and optimizer), read back from them: :func:`summary` and the INFO line.

Everything is computed by inspecting the returned model and optimizer (parameter dtypes, the modules that register
each parameter, the attached compute policy, the optimizer's fused kind), so the summary stays true whatever the
conversion rules are. The only thing recorded at optimize() time is the dtype asked for (an attribute of the
returned model), which the model cannot show when nothing could be converted.
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

import torch
from torch import nn

from ..base.dtensor import is_dtensor, local
from ..base.options import check_model_and_optimizer
from ..precision import record as _record
from ..precision.selection import LOW_PRECISION, matmul_units, owners
from ..training.optimizer import TrainingOptimizer, fused_entry, nonfinite_guard, sycl_backend, user_class

_log = logging.getLogger("ipex_train")

NOT_REQUESTED = "no low-precision dtype requested"
NORM = "normalisation layer"
NOT_MATMUL = "not a matmul-class module"
TIED = "tied with an fp32 module"
SIBLING = "its module keeps another parameter fp32"
FP64 = "float64, left as is"
SHARD = "FSDP2 fp32 shard (the master; its MixedPrecisionPolicy sets the compute dtype)"


@dataclass(frozen=True)
class KeptFp32:
    """One reason why parameters stayed fp32 (or fp64): how many tensors and elements, and the module classes
    that register them."""

    reason: str
    tensors: int
    elements: int
    modules: tuple[str, ...]


@dataclass(frozen=True)
class OptimizeSummary:
    """What optimize() did, as data. ``str()`` gives the one line optimize() logs at INFO.

    mode: "training" or "inference". dtype: the low-precision dtype asked for ("bfloat16"/"float16") or None.
    low_precision_tensors / low_precision_elements: parameters stored in bf16/fp16. kept: the other floating-point
    parameters grouped by reason. compute_policy: "native"/"emulated" when the bf16 compute policy is attached,
    else None. optimizer: the user's optimizer class name (training). fused_step: the fused kernel kind ("adam",
    "sgd", ...) the optimizer steps with, or None (its own step). sycl: the fused step runs on a SYCL queue.
    onednn_fusion: inference only, whether torch's TorchScript oneDNN Graph fusion switch is on.
    step_in_backward: training, each parameter is stepped inside backward (optimize(step_in_backward=True)).
    fp32_compute_convs: under the native policy, the depthwise convs it computes in fp32
    (:func:`ipex_train.compute_policy.slow_bf16_depthwise`). frozen_tensors / frozen_elements: parameters with
    requires_grad=False (a LoRA base model); frozen_without_truth_elements: those held in low precision without an
    fp32 truth (already bf16/fp16, or rounded with frozen_weights="low_precision"); frozen_weights: training, the
    optimize() option ("lossless" or "low_precision"). nonfinite_grads: training, the non-finite-gradient guard
    ("skip", "raise", or None when off); nonfinite_skipped_steps / nonfinite_skipped_parameters: the steps it
    skipped (and, with step_in_backward, the parameter steps). routed_modules: under the native policy, (route,
    modules) for each module route that runs some of the model's modules through a kernel of ours
    (:func:`ipex_train.compute_policy.routed_modules`: RMSNorm, add + norms, SwiGLU, rotary embedding, patch
    embedding, MultiheadAttention, bias + GELU, LoRA).
    """

    mode: str
    dtype: str | None
    low_precision_tensors: int
    low_precision_elements: int
    kept: tuple[KeptFp32, ...]
    compute_policy: str | None
    optimizer: str | None
    fused_step: str | None
    sycl: bool
    onednn_fusion: bool | None
    step_in_backward: bool = False
    fp32_compute_convs: int = 0
    frozen_tensors: int = 0
    frozen_elements: int = 0
    frozen_without_truth_elements: int = 0
    frozen_weights: str | None = None
    nonfinite_grads: str | None = None
    nonfinite_skipped_steps: int = 0
    nonfinite_skipped_parameters: int = 0
    routed_modules: tuple[tuple[str, int], ...] = ()

    @property
    def kept_tensors(self) -> int:
        """Parameters not in low precision."""
        return sum(k.tensors for k in self.kept)

    @property
    def kept_elements(self) -> int:
        """Elements of the parameters not in low precision."""
        return sum(k.elements for k in self.kept)

    def to_dict(self) -> dict:
        """The summary as plain dicts, lists and scalars (JSON-ready)."""
        data = asdict(self)
        data["kept"] = [dict(k, modules=list(k["modules"])) for k in data["kept"]]
        data["routed_modules"] = dict(self.routed_modules)
        return data

    def __str__(self) -> str:
        total = self.low_precision_elements + self.kept_elements
        share = (lambda n: f"{100 * n / total:.1f}%") if total else (lambda n: "0%")
        parts = [f"ipex_train.optimize ({self.mode}, dtype={self.dtype or 'float32'}): "
                 f"{self.low_precision_tensors} params {self.dtype or 'low precision'} "
                 f"({_count(self.low_precision_elements)} elements, {share(self.low_precision_elements)}), "
                 f"{self.kept_tensors} fp32 ({_count(self.kept_elements)}, {share(self.kept_elements)})"]
        if self.kept:
            parts[0] += ": " + ", ".join(f"{k.tensors} {k.reason} [{', '.join(k.modules)}]" for k in self.kept)
        parts.append(f"compute policy {self.compute_policy or 'none'}"
                     + (f" ({self.fp32_compute_convs} depthwise convs computed in fp32: oneDNN's bf16 backward is "
                        "slow for them)" if self.fp32_compute_convs else "")
                     + (" (modules routed to fused kernels: " + ", ".join(f"{n} {name}" for name, n in
                                                                        self.routed_modules) + ")"
                        if self.routed_modules else ""))
        if self.mode == "training":
            step = f"fused {self.fused_step} step" if self.fused_step else "own (unfused) step"
            parts.append(f"{self.optimizer}: {step}{' on SYCL' if self.sycl else ''}"
                         f"{' inside backward' if self.step_in_backward else ''}")
            if self.nonfinite_skipped_steps or self.nonfinite_skipped_parameters:
                parts.append(f"non-finite gradients: {self.nonfinite_skipped_steps} steps and "
                             f"{self.nonfinite_skipped_parameters} parameter steps skipped")
            if self.frozen_tensors:
                parts.append(f"frozen_weights={self.frozen_weights}: {self.frozen_tensors} frozen params "
                             f"({_count(self.frozen_elements)} elements), "
                             f"{_count(self.frozen_without_truth_elements)} of them stored without an fp32 truth")
        else:
            parts.append(f"TorchScript oneDNN fusion {'on' if self.onednn_fusion else 'off'}")
        return "; ".join(parts)


def _count(n: int) -> str:
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.2f}{suffix}"
    return str(n)


def _is_norm(m: nn.Module) -> bool:
    # torch's norms, and the many model libraries' own (LlamaRMSNorm, T5LayerNorm, ...) by name.
    norms = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.LocalResponseNorm)
    return isinstance(m, norms) or "norm" in type(m).__name__.lower()


def _reason(p: torch.Tensor, mods: list[nn.Module], units: dict[int, nn.Module], low: torch.dtype | None) -> str:
    if p.dtype == torch.float64:
        return FP64
    if is_dtensor(p):
        return SHARD
    if low is None:
        return NOT_REQUESTED
    if any(_is_norm(m) for m in mods):
        return NORM
    matmul = [id(m) in units for m in mods]
    if not any(matmul):
        return NOT_MATMUL
    if not all(matmul):
        return TIED
    return SIBLING


def summary(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> OptimizeSummary:
    """What optimize() did to ``model`` (and ``optimizer``, for training): pass what optimize() returned.

    Works on any model; for one optimize() did not return, it describes the model as it is.
    """
    from .. import compute_policy

    check_model_and_optimizer(model, optimizer, "summary()")
    masters = _record.masters(model)
    found = owners(model)
    low_dtypes = {p.dtype for p in found if p.dtype in LOW_PRECISION}
    if _record.has_dtype(model):
        low = _record.dtype(model)
    elif masters is not None:
        low = masters.dtype
    else:
        low = next(iter(low_dtypes)) if len(low_dtypes) == 1 else None
    units = matmul_units(model)
    low_tensors = low_elements = 0
    groups: dict[str, list] = {}
    for p, mods in found.items():
        if p.dtype in LOW_PRECISION:
            low_tensors += 1
            low_elements += local(p).numel()
        elif p.is_floating_point():
            g = groups.setdefault(_reason(p, mods, units, low), [0, 0, set()])
            g[0] += 1
            g[1] += local(p).numel()  # a rank counts its shards (FSDP2)
            g[2].update(type(m).__name__ for m in mods)
    kept = tuple(KeptFp32(r, n, e, tuple(sorted(mods))) for r, (n, e, mods) in
                 sorted(groups.items(), key=lambda item: -item[1][1]))
    handle = compute_policy.attached(model)
    training = optimizer is not None or masters is not None
    entry = fused_entry(optimizer) if optimizer is not None else None
    fused, sycl = (entry.name if entry is not None else None), sycl_backend(optimizer) is not None
    frozen = [p for p in found if not p.requires_grad]
    aux = masters.aux if masters is not None else {}
    return OptimizeSummary(
        mode="training" if training else "inference",
        dtype=str(low).replace("torch.", "") if low is not None else None,
        low_precision_tensors=low_tensors, low_precision_elements=low_elements, kept=kept,
        compute_policy=handle.policy if handle is not None else None,
        optimizer=user_class(optimizer).__name__ if optimizer is not None else None,
        fused_step=fused, sycl=sycl,
        onednn_fusion=None if training else torch.jit.onednn_fusion_enabled(),
        step_in_backward=isinstance(optimizer, TrainingOptimizer) and optimizer.step_in_backward,
        fp32_compute_convs=sum(map(compute_policy.slow_bf16_depthwise, model.modules()))
        if handle is not None and handle.policy == "native" else 0,
        routed_modules=tuple(compute_policy.routed_modules(model).items()) if handle is not None else (),
        frozen_tensors=len(frozen), frozen_elements=sum(local(p).numel() for p in frozen),
        frozen_without_truth_elements=sum(local(p).numel() for p in frozen
                                          if p.dtype in LOW_PRECISION and p not in aux),
        frozen_weights=(("low_precision" if masters.frozen_low_precision else "lossless")
                        if masters is not None else None),
        **_guard_fields(optimizer))


def _guard_fields(optimizer) -> dict:
    guard = nonfinite_guard(optimizer) if optimizer is not None else None
    if guard is None:
        return {}
    return dict(nonfinite_grads=guard.mode, nonfinite_skipped_steps=guard.skipped_steps,
                nonfinite_skipped_parameters=guard.skipped_parameters)
