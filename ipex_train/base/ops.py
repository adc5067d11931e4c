"""The one place Python reaches the C++ kernels.

Importing this module loads ``ipex_train._C``, whose TORCH_LIBRARY block registers the ``torch.ops.ipex_train``
ops, and gives each op a fake (meta) implementation so ``torch.compile`` and FakeTensor tracing can see through
it. Kernel-variant (ISA) selection also lives here (``IPEX_TRAIN_KERNEL`` is applied through it by
:func:`ipex_train.base.envvars.apply_kernel_variable` at import).
"""
from __future__ import annotations

import torch

from .. import _C  # noqa: F401  (registers torch.ops.ipex_train)

ops = torch.ops.ipex_train


def cpu_features() -> dict[str, bool]:
    """ISA features of this CPU as the kernels see them (present only with OS support for their registers)."""
    pairs = (item.split("=") for item in ops.cpu_features().split(","))
    return {name: flag == "1" for name, flag in pairs}


def kernel_variant() -> str:
    """The kernel variant the fused steps run: ``"avx512"``, ``"avx2"`` or ``"scalar"``. Raises ValueError, as
    every kernel call does, while an ``IPEX_TRAIN_KERNEL`` value that cannot be honoured is in effect."""
    return ops.kernel_variant()


def set_kernel_variant(name: str) -> None:
    """Force a kernel variant (``"auto"`` restores the best one for this CPU); this replaces an
    ``IPEX_TRAIN_KERNEL`` choice, also one that could not be honoured.

    Raises ValueError for an unknown name and RuntimeError when this CPU lacks the variant's features.
    """
    if not isinstance(name, str):
        raise TypeError(f"set_kernel_variant: name must be a str, got {type(name).__name__}")
    ops.set_kernel_variant(name)


def supported_kernel_variants() -> list[str]:
    """The variants this CPU can run, best first (read without touching the variant in use)."""
    return list(ops.supported_kernel_variants())


def optimizer_names() -> list[str]:
    """The optimizers the kernels were built with (``torch.ops.ipex_train.<name>_step``), from the C++ list."""
    return list(ops.optimizer_names())


def _check_cpu(op: str, args) -> None:
    # A fake impl also serves as the Meta kernel: refuse real meta tensors (FakeTensors report "cpu").
    names = [a.name for a in getattr(ops, op).default._schema.arguments]
    for name, value in zip(names, args):
        is_list = isinstance(value, (list, tuple))
        for i, t in enumerate(value if is_list else [value]):
            if isinstance(t, torch.Tensor) and t.device.type != "cpu":
                where = f"{name}[{i}]" if is_list else name
                raise ValueError(f"ipex_train::{op}: {where} is on {t.device}; kernels_cpu takes CPU tensors only")


def _register_fakes() -> None:
    # The step ops only mutate their inputs, so their fake versions only check devices.
    for name in optimizer_names():
        op = f"{name}_step"
        torch.library.register_fake(f"ipex_train::{op}")(lambda *args, _op=op: _check_cpu(_op, args))

    @torch.library.register_fake("ipex_train::split_bf16")
    def _split_fake(src):
        return torch.empty_like(src, dtype=torch.bfloat16), torch.empty_like(src, dtype=torch.int16)

    @torch.library.register_fake("ipex_train::combine_bf16")
    def _combine_fake(top, residual):
        return torch.empty_like(top, dtype=torch.float32)

    @torch.library.register_fake("ipex_train::q8_decode")
    def _q8_decode_fake(packed, out):
        return None


_register_fakes()


def dropout_seed(p: float) -> torch.Tensor:
    """The seed of one call of a kernel with hash dropout (attention, add_norm), as a one-element int64 tensor (so
    that torch.compile keeps it in the graph): drawn from torch's default generator when ``p > 0`` (so
    ``torch.manual_seed`` makes the masks reproducible), else 0 without drawing."""
    if p > 0.0:
        return torch.randint(0, 2**62, (1,), dtype=torch.int64)
    return torch.zeros(1, dtype=torch.int64)


def split_bf16(src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split an fp32 tensor into its bf16 top (nearest, ties away from zero) and int16 residual.

    ``combine_bf16(*split_bf16(x))`` gives back the bits of ``x`` for every non-NaN value; NaN comes back as a
    quiet NaN of the same sign. The outputs keep ``src``'s memory format.
    """
    return ops.split_bf16(src)


def q8_encode(x: torch.Tensor, signed: bool) -> torch.Tensor:
    """The packed int8 optimizer state of a 1-D fp32 tensor as the current kernel variant's steps store it (fp32
    block scales, then int8 codes if ``signed``, else uint8): what ``optim.state_formats.encode`` gives, bit for bit
    (its fake, for tracing, is registered there: that module owns the packed size).
    """
    return ops.q8_encode(x, signed)


def q8_decode(packed: torch.Tensor, out: torch.Tensor) -> None:
    """Decode packed int8 optimizer state (fp32 block scales, then int8 or uint8 codes: what :func:`q8_encode`
    gives) into ``out``, a contiguous 1-D fp32 tensor of its element count, with the steps' own decoding:
    ``optim.state_formats.decode``'s values, bit for bit, at memory speed."""
    ops.q8_decode(packed, out)


def combine_bf16(top: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """Rebuild the exact fp32 tensor from a bf16 top and its int16 residual (inverse of :func:`split_bf16`)."""
    return ops.combine_bf16(top, residual)


def first_nonfinite(tensors: list[torch.Tensor]) -> int:
    """The index of the first of ``tensors`` (dense CPU tensors) holding a NaN or an Inf, or -1: one pass over their
    bits, parallel, the same answer at any thread count (kernels_cpu/src/nonfinite.cpp)."""
    return ops.first_nonfinite(tensors)


def emulated_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    scratch: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for an fp32 ``x`` and a 2-D bf16 ``weight`` (bias bf16 or None), computed in
    fp32 from the bf16 values and returned in fp32, as one autograd node (kernels_cpu/src/emulated_linear.cpp) that
    saves ``x`` and the bf16 weight. The weight is cast into ``scratch`` (a contiguous 1-D fp32 buffer, reused across
    calls) when it holds enough elements, else into a fresh tensor; the emulated compute policy's linear."""
    return ops.emulated_linear(x, weight, bias, scratch)

