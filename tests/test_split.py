"""split_bf16 / combine_bf16: lossless over every fp32 bit pattern, and the promised rounding of the bf16 top.

Rounding of the top: nearest, ties away from zero. With ties-to-even an even top would own 65537 fp32 patterns,
one too many for a 16-bit residual; ties away gives every top exactly the patterns [top<<16 - 0x8000,
top<<16 + 0x7FFF], so the residual always fits an int16. The top therefore equals torch's ``.to(torch.bfloat16)``
everywhere except at exact ties (low half 0x8000), where it is the neighbour further from zero.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ipex_train.base import ops as _ops

split, combine = _ops.split_bf16, _ops.combine_bf16


def from_bits(bits) -> torch.Tensor:
    """fp32 tensor with the given uint32 bit patterns."""
    return torch.from_numpy(np.asarray(bits, dtype=np.uint32).view(np.float32).copy())


def bits32(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def bits16(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF


def check_split(x: torch.Tensor) -> None:
    """Every property split/combine promise for the values in ``x``."""
    top, res = split(x)
    back = combine(top, res)
    nan = x.isnan()
    assert torch.equal(top.isnan(), nan) and torch.equal(back.isnan(), nan)
    # NaN: a NaN top of the same sign (the payload is not kept)
    assert torch.equal(torch.signbit(top[nan]), torch.signbit(x[nan]))
    assert torch.equal(torch.signbit(back[nan]), torch.signbit(x[nan]))
    # everything else: exact bits back, and the top is torch's cast except at exact ties
    ok = ~nan
    assert torch.equal(bits32(back[ok]), bits32(x[ok]))
    tie = (bits32(x) & 0xFFFF) == 0x8000
    plain = ok & ~tie
    assert torch.equal(bits16(top[plain]), bits16(x[plain].to(torch.bfloat16)))
    # ties: the bf16 neighbour away from zero, i.e. the upper half of the bits plus one, and residual -0x8000
    tied = ok & tie
    assert torch.equal(bits16(top[tied]), (bits32(x[tied]) >> 16) + 1)
    assert torch.all(res[tied] == -0x8000)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=64))
def test_lossless_for_any_bit_pattern(patterns):
    check_split(from_bits(patterns))


def test_lossless_for_uniform_random_bit_patterns(variant):
    # 3M patterns drawn uniformly over all 2^32: ~1.5% NaN, ~50 exact ties, and enough elements for the threaded path
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(-(2**31), 2**31, (3_000_000,), dtype=torch.int64, generator=gen).to(torch.int32)
    x = x.view(torch.float32)
    assert ((bits32(x) & 0xFFFF) == 0x8000).any()
    check_split(x)


def test_special_values(variant):
    values = {
        "+0": 0x00000000, "-0": 0x80000000, "+inf": 0x7F800000, "-inf": 0xFF800000,
        "min_subnormal": 0x00000001, "max_subnormal": 0x007FFFFF, "-min_subnormal": 0x80000001,
        "max_finite": 0x7F7FFFFF, "-max_finite": 0xFF7FFFFF, "one": 0x3F800000,
        "qnan": 0x7FC00000, "qnan_payload": 0x7FC12345, "snan": 0x7F800001, "-nan": 0xFFC00000,
        "nan_payload_low_only": 0x7F808000,
        "tie_even_top": 0x3F808000, "tie_odd_top": 0x3F818000, "-tie_even_top": 0xBF808000,
    }
    x = from_bits(list(values.values()))
    check_split(x)
    top, res = split(x)
    got = dict(zip(values, bits16(top).tolist()))
    assert got["-0"] == 0x8000  # -0 keeps its sign
    assert got["+inf"] == 0x7F80 and got["-inf"] == 0xFF80
    # max finite fp32 lies above the largest bf16 midpoint: its top is Inf, and the residual still restores it
    assert got["max_finite"] == 0x7F80 and got["-max_finite"] == 0xFF80
    assert got["max_subnormal"] == 0x0080  # rounds up to the smallest normal bf16
    assert got["min_subnormal"] == 0x0000
    # exact ties go away from zero, where torch's cast goes to even
    assert got["tie_even_top"] == 0x3F81 and got["-tie_even_top"] == 0xBF81
    assert bits16(from_bits([0x3F808000]).to(torch.bfloat16)).item() == 0x3F80
    assert got["tie_odd_top"] == 0x3F82
    # a NaN with payload bits only in the low half must still split to a NaN top, not to Inf
    assert got["nan_payload_low_only"] & 0x7F80 == 0x7F80 and got["nan_payload_low_only"] & 0x007F != 0


@pytest.mark.parametrize("make,dense", [
    (lambda x: x.contiguous(memory_format=torch.channels_last), True),
    (lambda x: x.transpose(1, 2), True),
    (lambda x: x[:, :, 1:, ::2], False),
], ids=["channels_last", "transposed", "sliced"])
def test_strided_inputs(make, dense, variant):
    x = make(torch.randn(2, 5, 7, 9))
    top, res = split(x)
    ref_top, ref_res = split(x.contiguous())
    assert torch.equal(top, ref_top) and torch.equal(res, ref_res)
    if dense:  # dense inputs keep their memory order; others come back contiguous
        assert top.stride() == x.stride() and res.stride() == x.stride()
    else:
        assert top.is_contiguous() and res.is_contiguous()
    back = combine(top, res)
    assert torch.equal(back, x) and back.stride() == top.stride()
    # combine also takes a top and residual of different memory orders
    assert torch.equal(combine(top.contiguous(), res), x)


def test_channels_last_preserved():
    x = torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last)
    top, res = split(x)
    assert top.is_contiguous(memory_format=torch.channels_last)
    assert res.is_contiguous(memory_format=torch.channels_last)
    assert combine(top, res).is_contiguous(memory_format=torch.channels_last)


def test_empty_and_scalar():
    for x in (torch.empty(0), torch.tensor(1.5)):
        top, res = split(x)
        assert top.shape == x.shape and torch.equal(combine(top, res), x)


@pytest.mark.parametrize("dtype", (torch.float64, torch.bfloat16, torch.float16, torch.int32))
def test_split_rejects_wrong_dtype(dtype):
    with pytest.raises(TypeError, match=r"src has dtype .*expected float32"):
        split(torch.zeros(4, dtype=dtype))


def test_combine_rejects_wrong_dtypes_and_shapes():
    top, res = split(torch.randn(4))
    with pytest.raises(TypeError, match=r"top has dtype Float; expected bfloat16"):
        combine(top.float(), res)
    with pytest.raises(TypeError, match=r"residual has dtype Int; expected int16"):
        combine(top, res.int())
    with pytest.raises(ValueError, match=r"residual has shape \[5\] but top has shape \[4\]"):
        combine(top, torch.zeros(5, dtype=torch.int16))
