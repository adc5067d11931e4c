"""Reduced-byte optimizer state: the formats, their option values, and fp32 <-> reduced conversions.

A param group's ``state_dtype`` key (set for every group by ``optimize(..., optimizer_state_dtype=...)``, or by
the ``state_dtype`` argument of :class:`~ipex_train.optim.Lamb`/:class:`~ipex_train.optim.Lars`) picks how the fused
steps store that group's state:

* ``None`` / ``torch.float32``: fp32 (today's behaviour; fp64 parameters always keep fp64 state).
* ``torch.bfloat16``: a bf16 tensor shaped like the parameter (2 bytes per element). The kernels round each new
  value stochastically (unbiased; random bits from a hash of the group's ``state_seed``, its step count, the
  parameter's position in the call and the element index), so small updates are not lost on average.
* ``"int8"``: a packed 1-D tensor, per block of 256 elements one fp32 scale (the block's absmax) then one code per
  element (2.03 bytes per element for two moments), on a fourth-power map (value = scale * (code / levels)^4):
  int8 codes (127 levels each side) for signed state (first moments, momentum), uint8 codes (255 levels) for
  non-negative state (second moments).

Parameters with fewer than :data:`MIN_NUMEL` elements (biases, norms) keep fp32 state. The C++ side is
kernels_cpu/include/ipex_train/state_codec.h; :func:`encode` and :func:`decode` give the same bits as its int8
encoding (bf16 state is encoded here with round-to-nearest, which is lossless for a value that came from bf16).
``state_dict()`` returns every state as fp32 (:func:`fp32_state_dict`), loadable by vanilla torch.optim; loading
an fp32 state re-encodes it in the loading optimizer's own formats (:func:`restore_settings`), and a reduced state
survives save -> load bit for bit (bf16 -> fp32 -> bf16 is exact; for int8, ``encode(decode(q)) == q``).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..base import ops as _ops
from ..base.choices import (
    STATE_FORMATS_ACCEPTED,
    StateFormat,
    StateFormatOrNone,
    parse_state_format,
    public_state_format,
)

GROUP_KEY = "state_dtype"
SEED_KEY = "state_seed"
ROUNDS_KEY = "state_rounds"  # fused steps taken by the group with bf16 state (part of the rounding key)
MIN_NUMEL = 4096
Q8_BLOCK = 256  # kQ8Block in state_codec.h
# StateCodec in state_codec.h by state tensor dtype (the SYCL host takes it per tensor; fp32/fp64 state is 0).
CODECS = {torch.bfloat16: 1, torch.int8: 2, torch.uint8: 3}



Format = StateFormatOrNone
ACCEPTED = STATE_FORMATS_ACCEPTED
parse = parse_state_format
public = public_state_format


def bytes_per_element(fmt: StateFormat, numel: int) -> float:
    """Bytes per element of a state tensor of ``numel`` elements stored in ``fmt``."""
    return 2 if fmt is StateFormat.BF16 else packed_bytes(numel) / numel


def wanted(group: dict[str, Any], p: Tensor) -> Format:
    """The state format of parameter ``p`` in ``group``: the group's, unless ``p`` is small or not float32-based."""
    fmt = parse(group.get(GROUP_KEY), f"param group key {GROUP_KEY!r}")
    if fmt is None or p.dtype == torch.float64 or p.numel() < MIN_NUMEL:
        return None
    return fmt


def format_of(t: Tensor) -> Format:
    """The format a state tensor is stored in."""
    if t.dtype == torch.bfloat16:
        return StateFormat.BF16
    if t.dtype in (torch.int8, torch.uint8):
        return StateFormat.INT8
    return None


def packed_bytes(numel: int) -> int:
    """Bytes of the packed int8 state of a parameter of ``numel`` elements."""
    return 4 * _blocks(numel) + numel


@torch.library.register_fake("ipex_train::q8_encode")
def _q8_encode_fake(x: Tensor, signed: bool) -> Tensor:
    return x.new_empty(packed_bytes(x.numel()), dtype=torch.int8 if signed else torch.uint8)


def fits(t: Tensor, p: Tensor) -> bool:
    """Whether ``t`` is reduced-byte state of the right dtype and shape for the float32-based parameter ``p``."""
    if t.dtype == torch.bfloat16:
        return t.shape == p.shape
    return t.dtype in (torch.int8, torch.uint8) and t.dim() == 1 and t.numel() == packed_bytes(p.numel())


# fl(1/127) and fl(1/255): a code q decodes as scale * (|q| * inv)^4 (state_codec.h).
_INV = {s: torch.tensor(1.0, dtype=torch.float32) / (127.0 if s else 255.0) for s in (True, False)}


def _blocks(numel: int) -> int:
    return -(-numel // Q8_BLOCK)


def _flat(t: Tensor) -> Tensor:
    """The elements of a dense tensor in memory order (the order the kernels index them)."""
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def encode(x: Tensor, p: Tensor, fmt: Format, signed: bool) -> Tensor:
    """fp32 state ``x`` of parameter ``p`` in format ``fmt`` (``signed``: int8 codes, else uint8 for state that is
    never negative)."""
    if fmt is None:
        return x
    like = torch.empty_like(p, dtype=torch.float32).copy_(x)  # p's memory order
    if fmt is StateFormat.BF16:
        return like.to(torch.bfloat16)
    flat = _flat(like)
    n, nb = flat.numel(), _blocks(flat.numel())
    blocks = torch.zeros(nb * Q8_BLOCK, dtype=torch.float32)
    blocks[:n] = flat
    blocks = blocks.view(nb, Q8_BLOCK)
    scale = blocks.abs().amax(dim=1)  # NaN propagates, as in the kernel
    inv = (1.0 / torch.where(scale > 0, scale, 1.0)).unsqueeze(1)
    r = (blocks.abs() if signed else torch.where(blocks > 0, blocks, 0.0)) * inv
    r = torch.where(r < 1.0, r, 1.0)  # NaN (a NaN scale) -> the largest code
    # The kernels' correctly rounded fp32 sqrt: torch's fp32 sqrt is not on every build (here a fifth of the values
    # were an ulp off, which moves the codes right at a boundary); float64's, rounded to fp32, is.
    root = r.double().sqrt().float().double().sqrt().float()
    y = root * (127.0 if signed else 255.0)
    q = (y + 0.5).to(torch.int32)
    out = torch.empty(4 * nb + n, dtype=torch.int8 if signed else torch.uint8)
    out[: 4 * nb].view(torch.float32).copy_(scale)
    out[4 * nb:] = (torch.where(torch.signbit(blocks), -q, q) if signed else q).reshape(-1)[:n].to(out.dtype)
    return out


_M32, _M64 = 0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF
_WEYL = 0x9E3779B1  # kWeyl in state_codec.h


def _fmix32(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def _mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def param_key(call_key: int, index: int) -> int:
    """The rounding key of the parameter at position ``index`` of a step with key ``call_key`` (param_key in
    state_codec.h)."""
    return _mix64(call_key ^ _mix64((index + 0x9E3779B97F4A7C15) & _M64))


def encode_bf16_stochastic(x: Tensor, key: int) -> Tensor:
    """fp32 ``x`` (dense) as bf16 state, rounded stochastically with the random bits the kernels draw for a state
    tensor stepped with rounding key ``key`` (:func:`param_key`): unbiased, so small moment updates are kept on
    average where round-to-nearest would drop them."""
    # random_base(key, 0) and random16 of state_codec.h, for tensors of fewer than 2**31 elements.
    base = _fmix32((key & _M32) + _fmix32(key >> 32 & _M32) & _M32)
    flat = _flat(x.contiguous())
    r = (torch.arange(flat.numel(), dtype=torch.int64) * _WEYL + base).bitwise_and_(_M32).bitwise_right_shift_(16)
    u = flat.view(torch.int32).to(torch.int64).bitwise_and_(_M32)
    bits = (u + r).bitwise_right_shift_(16)
    bits = torch.where(torch.isnan(flat), u.bitwise_right_shift(16).bitwise_or_(0x40), bits)
    bits = torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16)
    return bits.view(torch.bfloat16).view(x.shape)


def zeros(p: Tensor, fmt: Format, signed: bool) -> Tensor:
    """Zero state of float32-based parameter ``p`` in reduced format ``fmt``: what ``encode`` gives for fp32 zeros
    (all-zero bytes: scale 0 and code 0), without encode's fp32 temporaries, which at the first step of a large
    model would be allocated and freed once per state tensor."""
    if fmt is StateFormat.BF16:
        return torch.zeros_like(p, dtype=torch.bfloat16, memory_format=torch.preserve_format)
    return torch.zeros(packed_bytes(p.numel()), dtype=torch.int8 if signed else torch.uint8)


def decode(t: Tensor, p: Tensor) -> Tensor:
    """State tensor ``t`` of parameter ``p`` as fp32, shaped and laid out like ``p``."""
    fmt = format_of(t)
    out = torch.empty_like(p, dtype=torch.float32)
    if fmt is None or fmt is StateFormat.BF16:
        return out.copy_(t)
    if type(t) is Tensor and type(out) is Tensor and t.device.type == "cpu" and t.is_contiguous():
        # The steps' own decoding (bit for bit :func:`decode_reference`), ~10x faster: a checkpoint of int8 state
        # decodes it on the training thread.
        _ops.q8_decode(t, _flat(out))
        return out
    return decode_reference(t, p, out)


def decode_reference(t: Tensor, p: Tensor, out: Tensor | None = None) -> Tensor:
    """int8 state ``t`` of ``p`` decoded with plain torch ops (into ``out`` when given): the reference the C++
    decoding is tested against, and the path for tensors the C++ op does not take."""
    out = torch.empty_like(p, dtype=torch.float32) if out is None else out
    signed = t.dtype == torch.int8
    n, nb = p.numel(), _blocks(p.numel())
    scale = t[: 4 * nb].view(torch.float32)
    q = torch.zeros(nb * Q8_BLOCK, dtype=torch.int32)
    q[:n] = t[4 * nb:].to(torch.int32)
    q = q.view(nb, Q8_BLOCK)
    u = q.abs().to(torch.float32) * _INV[signed]
    mag = ((u * u) * (u * u)) * scale.unsqueeze(1)
    _flat(out).copy_((torch.where(q < 0, -mag, mag) if signed else mag).reshape(-1)[:n])
    return out


def convert(t: Tensor, p: Tensor, fmt: Format, signed: bool) -> Tensor:
    """State tensor ``t`` of ``p`` in format ``fmt`` (``t`` itself when it already is)."""
    have = format_of(t)
    if have is fmt and (have is not StateFormat.INT8 or (t.dtype == torch.int8) == signed):
        return t
    return encode(decode(t, p) if have is not None else t, p, fmt, signed)


_ABSENT = object()


def own_settings(groups: list[dict[str, Any]]) -> list[tuple[Any, Any]]:
    """Each group's ``state_dtype`` and ``state_seed`` as set on this optimizer (or absent), for
    :func:`restore_settings` after ``load_state_dict``, whose torch implementation replaces the group dicts with the
    checkpoint's."""
    return [(g.get(GROUP_KEY, _ABSENT), g.get(SEED_KEY, _ABSENT)) for g in groups]


def restore_settings(groups: list[dict[str, Any]], settings: list[tuple[Any, Any]]) -> None:
    """After a load: each group keeps its own ``state_dtype`` (set or absent), whatever the checkpoint's groups say,
    because the checkpoint holds fp32 state and the format is how this optimizer stores it (loading a vanilla
    torch checkpoint into an int8-state optimizer gives int8 state, an int8 checkpoint into an fp32-state one fp32
    state); its ``state_seed`` is the checkpoint's when that has one (a resumed run draws as the saved one would),
    else its own."""
    for g, (fmt, seed) in zip(groups, settings):
        if fmt is _ABSENT:
            g.pop(GROUP_KEY, None)
        else:
            g[GROUP_KEY] = fmt
        if seed is not _ABSENT:
            g.setdefault(SEED_KEY, seed)


def rounding_key(group: dict[str, Any]) -> int:
    """The stochastic-rounding key of this step of ``group`` (counts the group's steps with reduced state)."""
    rounds = int(group.get(ROUNDS_KEY, 0)) + 1
    group[ROUNDS_KEY] = rounds
    seed = int(group.get(SEED_KEY, 0))
    return ((seed & 0x7FFFFFFF) << 32 | (rounds & 0xFFFFFFFF))


def call_key(group: dict[str, Any]) -> int:
    """The ``state_key`` argument of one fused call for ``group`` (CPU or SYCL): :func:`rounding_key` when the group
    keeps reduced-byte state, else 0."""
    return rounding_key(group) if parse(group.get(GROUP_KEY), f"param group key {GROUP_KEY!r}") is not None else 0


def fp32_state_dict(optimizer: torch.optim.Optimizer, packed: dict[str, Any]) -> dict[str, Any]:
    """``packed`` (torch's ``Optimizer.state_dict()`` of ``optimizer``) with every reduced state tensor as fp32."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = {}
    for index, entry in packed["state"].items():
        if any(isinstance(v, Tensor) and format_of(v) is not None for v in entry.values()):
            p = params[index]
            entry = {k: decode(v, p) if isinstance(v, Tensor) and format_of(v) is not None else v
                     for k, v in entry.items()}
        state[index] = entry
    return {**packed, "state": state}
