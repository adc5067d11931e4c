"""Reduced-byte optimizer state (bf16 with stochastic rounding, block-wise int8): the kernels against the plain
PyTorch reference, the formats' properties, state_dict round trips, the option and its errors.

Tolerances: the kernels step from exactly the decoded state the reference starts from, so params match the
reference as the fp32 kernels do (rtol 1e-5); a stored bf16 value is one of the two bf16 neighbours of the
reference's fp32 value (stochastic rounding); int8 codes are within one code of the reference state encoded in
Python (fp32 rounding differences in the new state can cross a rounding midpoint), and the block scales (absmax)
within 1e-5.
"""
from __future__ import annotations

import copy
import functools
import zlib

import pytest
import torch
import torch.nn as nn
from test_kernels import CASES, make_group, op_kind, reference_state, reference_step, to_storage, working

import ipex_train
from ipex_train.base import ops as _ops
from ipex_train.optim import functional as F
from ipex_train.optim import fused, registry
from ipex_train.optim import state_formats as sf

FORMATS = {"bf16": torch.bfloat16, "int8": "int8"}
SHAPES = ((4096,), (67, 71), (75_013,), (17,))  # whole blocks; a partial block, 2-D; several chunks; small (fp32)
STATE_CASES = [(k, n, o) for k, n, o in CASES if not (k == "sgd" and n == "no_momentum")
               and not (k == "lars" and "no_momentum" in n)]


def _params(layout: str, seed: int) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    gen = torch.Generator().manual_seed(seed)
    return [to_storage(layout, torch.randn(s, generator=gen)) for s in SHAPES]


def _bf16_neighbours_hold(stored: torch.Tensor, ref: torch.Tensor) -> bool:
    """Whether each stored value is within one bf16 step of the reference (a neighbour of it), give or take the
    fp32 rounding of the new state itself (1e-7 absolute: values that cancel to ~0 differ there as in fp32)."""
    _, exponent = torch.frexp(ref)
    ulp = torch.ldexp(torch.ones_like(ref), exponent - 8)  # |ref| in [2^(e-1), 2^e): bf16 steps of 2^(e-8)
    return bool(((stored - ref).abs() <= ulp * (1 + 1e-4) + 1e-7).all())


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("layout", ["fp32", "split_bf16"])  # the master layouts advance alike (loops.h)
@pytest.mark.parametrize("kind,name,overrides", STATE_CASES, ids=[f"{k}-{n}" for k, n, _ in STATE_CASES])
def test_kernel_matches_reference(kind, name, overrides, layout, fmt):
    # One kernel variant here; test_variants_bit_identical holds the others to the same bits.
    check_against_reference(kind, name, overrides, layout, fmt)


def check_against_reference(kind, name, overrides, layout, fmt, step_fn=fused.fused_step, place=lambda t: t):
    """Two steps of ``step_fn`` (``fused.fused_step`` or the SYCL one) with ``fmt`` state against the reference,
    within the module docstring's tolerances; ``place`` puts the stored params, aux and grads where ``step_fn`` takes
    them (USM for the SYCL step)."""
    group = make_group(kind, name, **overrides)
    group[sf.GROUP_KEY] = FORMATS[fmt]
    entry = registry.get(op_kind(kind))
    # A fixed seed per case: Python's str hash changes per process. Some draws put an L2-decayed grad within
    # a few ulps of cancelling (|g + wd*p| ~ eps), where fp32 FMA vs separate rounding moves the update ~1e-4.
    stored = [(place(p), None if a is None else place(a))
              for p, a in _params(layout, seed=zlib.crc32(f"{kind}/{name}".encode()) % 1000)]
    params = [p for p, _ in stored]
    aux = [a for _, a in stored]
    state: dict = {p: {} for p in params}
    ref_state = reference_state(op_kind(kind), group, [working(layout, p, a) for p, a in stored])
    gen = torch.Generator().manual_seed(1)
    for step in range(2):
        w_ref = [working(layout, p, a).clone() for p, a in stored]
        grads = [place(torch.randn(p.shape, generator=gen).to(p.dtype)) for p in params]
        # The reference starts each step from the state the kernel stored (the first from the initial state as
        # the kernel stores it: Adagrad's initial_accumulator_value need not be a bf16 value).
        for spec in entry.state:
            if ref_state.get(spec.key) and ref_state[spec.key][0] is not None:
                ref_state[spec.key] = [
                    sf.decode(state[p][spec.key] if step else
                              sf.convert(t.float(), p, sf.wanted(group, p), spec.signed), p)
                    for p, t in zip(params, ref_state[spec.key])]
        w_before = [w.clone() for w in w_ref]
        step_fn(registry.get(op_kind(kind)), group, state, params, aux, grads)
        reference_step(op_kind(kind), group, w_ref, [g.float() for g in grads], ref_state)
        for i, p in enumerate(params):
            if kind == "lamb" and p.numel() >= sf.MIN_NUMEL:
                # Lamb's second pass reads the moments as stored, i.e. rounded: its update is as close to the
                # reference's as the stored state is to the exact one.
                # bf16: every element within 1%; int8: 99% within 10% (small second moments are coarse on the
                # fourth-power map, and Adam-style directions m / sqrt(v) do not shrink with them).
                ref_update = w_ref[i] - w_before[i]
                err = (working(layout, p, aux[i]) - w_before[i] - ref_update).abs()
                top = float(ref_update.abs().max())
                if fmt == "bf16":
                    assert bool((err <= 0.01 * (ref_update.abs() + top)).all())
                else:
                    assert float((err <= 0.1 * (ref_update.abs() + top)).float().mean()) >= 0.99
            else:
                torch.testing.assert_close(working(layout, p, aux[i]), w_ref[i], rtol=1e-5, atol=1e-6)
            for spec in entry.state:
                if not ref_state.get(spec.key):
                    continue
                got, ref = state[p][spec.key], ref_state[spec.key][i].float()
                if p.numel() < sf.MIN_NUMEL:
                    assert got.dtype == torch.float32
                    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
                elif fmt == "bf16":
                    assert got.dtype == torch.bfloat16
                    assert _bf16_neighbours_hold(got.float(), ref), (spec.key, i)
                else:
                    assert got.dtype == (torch.int8 if spec.signed else torch.uint8)
                    want = sf.encode(ref, p, sf.StateFormat.INT8, spec.signed)
                    nb = 4 * -(-p.numel() // sf.Q8_BLOCK)
                    torch.testing.assert_close(got[:nb].view(torch.float32), want[:nb].view(torch.float32),
                                               rtol=1e-5, atol=1e-30)
                    diff = (got[nb:].int() - want[nb:].int()).abs()
                    assert int(diff.max()) <= 1 and float(diff.float().mean()) < 0.01, (spec.key, i)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("kind", ["adam", "adagrad", "lamb", "sgd", "lars"])
def test_variants_bit_identical(kind, fmt):
    variants = _ops.supported_kernel_variants()
    if len(variants) < 2:
        pytest.skip("this CPU runs only one kernel variant")
    group = make_group(kind, "default")
    group[sf.GROUP_KEY] = FORMATS[fmt]
    before = _ops.kernel_variant()
    results = {}
    try:
        for v in variants:
            _ops.set_kernel_variant(v)
            params = [p for p, _ in _params("split_bf16", 3)]
            aux = [a for _, a in _params("split_bf16", 3)]
            g = dict(group)
            state: dict = {p: {} for p in params}
            gen = torch.Generator().manual_seed(2)
            for _ in range(3):
                grads = [torch.randn(p.shape, generator=gen).to(p.dtype) for p in params]
                fused.fused_step(registry.get(kind), g, state, params, aux, grads)
            results[v] = [t.view(torch.uint8) if t.dtype != torch.uint8 else t
                          for p, a in zip(params, aux) for t in [p, a, *state[p].values()] if t.dim() > 0]
    finally:
        _ops.set_kernel_variant(before)
    first, *rest = variants
    for v in rest:
        for a, b in zip(results[first], results[v]):
            assert torch.equal(a, b), (first, v)


@pytest.mark.parametrize("signed", [True, False])
def test_int8_encode_decode_encode_is_exact(signed):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(10_000, generator=gen) * torch.logspace(-8, 3, 10_000)[torch.randperm(10_000, generator=gen)]
    x[:300] = 0.0  # an all-zero block and zeros in others
    if not signed:
        x = x.abs()
    p = torch.empty(100, 100)
    q = sf.encode(x.view(100, 100), p, sf.StateFormat.INT8, signed)
    back = sf.decode(q, p)
    assert torch.equal(sf.encode(back, p, sf.StateFormat.INT8, signed), q)
    # The map's resolution: within half a code step of the fourth-power grid around each value.
    scale = back.view(-1)[256:512].abs().max()
    assert float(scale) == float(x[256:512].abs().max())
    err = (back.view(-1) - x).abs() / x.abs().clamp_min(1e-30)
    big = x.abs() > 0.05 * x.abs().max()
    assert float(err[big].max()) < 0.15


@pytest.mark.parametrize("fmt,signed", [(sf.StateFormat.BF16, True), (sf.StateFormat.INT8, True),
                                        (sf.StateFormat.INT8, False)])
def test_fresh_zero_state_is_the_encoding_of_zeros(fmt, signed):
    # Fresh state is made in its format directly (no fp32 temporaries at the first step); it must be what encoding
    # fp32 zeros gives, bit for bit.
    p = torch.empty(70, 300).t()  # column-major: the layout a state tensor follows
    got = sf.zeros(p, fmt, signed)
    want = sf.encode(torch.zeros_like(p), p, fmt, signed)
    assert got.dtype == want.dtype and got.shape == want.shape and got.stride() == want.stride()
    if fmt == "int8":  # compare the codes bit for bit
        got, want = got.view(torch.uint8), want.view(torch.uint8)
    assert torch.equal(got, want)


def test_kernel_int8_state_reencodes_to_the_same_codes():
    # A step with lr=0 and grads of zero from momentum=1 state leaves momentum unchanged: the kernel must store
    # exactly the codes it read (its encode(decode(q)) == q).
    p = torch.randn(10_000)
    buf = sf.encode(torch.randn(10_000) * torch.logspace(-6, 2, 10_000), p, sf.StateFormat.INT8, True)
    before = buf.clone()
    F.sgd([p], [torch.zeros_like(p)], [buf], lr=0.0, momentum=1.0)
    assert torch.equal(buf, before)


@pytest.mark.parametrize("signed", [True, False])
def test_kernel_int8_encode_matches_python_bits(signed):
    # The kernels encode new state with whole vectors and the elements after the last one singly; both must give
    # the Python reference's bits on every kernel variant. SGD's momentum from a zero buffer stores the grad itself
    # (signed); Adagrad's sum from zero stores grad * grad (unsigned, the same fp32 product as here).
    gen = torch.Generator().manual_seed(4)
    n = 4 * sf.Q8_BLOCK + 37  # whole blocks, then a partial block with a partial vector
    g = torch.randn(n, generator=gen) * torch.logspace(-8, 3, n)[torch.randperm(n, generator=gen)]
    g[:sf.Q8_BLOCK] = 0.0  # an all-zero block
    g[300] = -0.0
    g[2 * sf.Q8_BLOCK + 5] = float("nan")  # a NaN block
    g[3 * sf.Q8_BLOCK + 9] = float("inf")  # an Inf block
    want = sf.encode(g if signed else g * g, torch.empty(n), sf.StateFormat.INT8, signed)
    before = _ops.kernel_variant()
    try:
        for v in _ops.supported_kernel_variants():
            _ops.set_kernel_variant(v)
            p, state = torch.zeros(n), sf.encode(torch.zeros(n), torch.empty(n), sf.StateFormat.INT8, signed)
            if signed:
                F.sgd([p], [g], [state], lr=0.0, momentum=0.5)
            else:
                F.adagrad([p], [g], [state], [torch.tensor(0.0)], lr=0.0)
            assert torch.equal(state, want), v
    finally:
        _ops.set_kernel_variant(before)


def _in_unit_blocks(r: torch.Tensor) -> torch.Tensor:
    """Values ``r`` in [0, 1] laid out in int8 blocks that each start with 1.0: scale 1, so each code is that of r."""
    per = sf.Q8_BLOCK - 1
    r = torch.cat([r, torch.zeros(-r.numel() % per)]).view(-1, per)
    return torch.cat([torch.ones(r.shape[0], 1), r], dim=1).view(-1)


def _q8_boundaries(signed: bool) -> torch.Tensor:
    """The fp32 bits of the smallest r in [0, 1] of each code 1..L of the Python reference: a binary search over the
    bit patterns (the code never decreases with r)."""
    top = 127 if signed else 255
    k = torch.arange(1, top + 1)
    lo, hi = torch.zeros(top, dtype=torch.int32), torch.full((top,), 0x3F800000, dtype=torch.int32)
    for _ in range(31):
        mid = lo + (hi - lo) // 2
        x = _in_unit_blocks(mid.view(torch.float32))
        codes = sf.encode(x, x, sf.StateFormat.INT8, signed)[4 * (x.numel() // sf.Q8_BLOCK):]
        got = codes.view(-1, sf.Q8_BLOCK)[:, 1:].reshape(-1)[:top].long()
        hi, lo = torch.where(got >= k, mid, hi), torch.where(got >= k, lo, mid + 1)
    assert torch.equal(lo, hi)
    return lo


@pytest.mark.parametrize("signed", [True, False])
def test_kernel_int8_codes_match_python_bits_near_every_code_boundary(signed):
    # A code moves at a boundary when a square root is an ulp off (torch's fp32 sqrt was, on this machine, for a
    # fifth of all values): every value within 12 ulps of every code boundary, zero, one, subnormals and a million
    # random values in [0, 1] must get the reference's code, on every kernel variant.
    gen = torch.Generator().manual_seed(5)
    near = (_q8_boundaries(signed).unsqueeze(1) + torch.arange(-12, 13, dtype=torch.int32)).view(-1)
    rand_bits = torch.randint(0, 0x3F800001, (1 << 19,), generator=gen, dtype=torch.int32)
    r = torch.cat([near.view(torch.float32), rand_bits.view(torch.float32), torch.rand(1 << 19, generator=gen),
                   torch.tensor([0.0, 1.0, 1e-45, 1e-40, 1.2e-38, 0.5, 0.9999999])])
    x = _in_unit_blocks(r)
    if signed:
        x = torch.where(torch.rand(x.shape, generator=gen) < 0.5, -x, x)
    want = sf.encode(x, x, sf.StateFormat.INT8, signed)
    before = _ops.kernel_variant()
    try:
        for v in _ops.supported_kernel_variants():
            _ops.set_kernel_variant(v)
            got = _ops.q8_encode(x, signed)
            assert torch.equal(got, want), (v, int((got != want).sum()))
    finally:
        _ops.set_kernel_variant(before)


@pytest.mark.parametrize("signed", [True, False])
def test_kernel_int8_decode_matches_python_bits(signed):
    # The C++ decode (what checkpoints use) against the torch-op reference, bit for bit, on every kernel variant:
    # every code of every block, partial last blocks, a zero block, a NaN scale, strided (channels-last) params,
    # and the same bits at 1 and 2 threads.
    gen = torch.Generator().manual_seed(7)
    codes = torch.arange(-127 if signed else 0, 128 if signed else 256, dtype=torch.int32)
    before, threads = _ops.kernel_variant(), torch.get_num_threads()
    try:
        for n in (1, 255, 256, 257, 4096 + 17, 3 * 256 * 1024 + 5):
            x = torch.randn(n, generator=gen) if signed else torch.rand(n, generator=gen)
            x[: min(n, codes.numel())] = codes[: min(n, codes.numel())].float() / 200
            if n > 600:
                x[256:512] = 0.0
                x[600] = float("nan")
            q = sf.encode(x, x, sf.StateFormat.INT8, signed)
            want = sf.decode_reference(q, x).view(torch.int32)
            nan = torch.isnan(want.view(torch.float32))
            for v in _ops.supported_kernel_variants():
                _ops.set_kernel_variant(v)
                for t in (1, 2):
                    torch.set_num_threads(t)
                    got = sf.decode(q, x)
                    assert torch.equal(torch.isnan(got), nan), (n, v, t)
                    assert torch.equal(got.view(torch.int32)[~nan], want[~nan]), (n, v, t)
        p = torch.empty(2, 8, 16, 32).to(memory_format=torch.channels_last)
        x = torch.randn(p.shape, generator=gen).to(memory_format=torch.channels_last)
        q = sf.encode(x.abs() if not signed else x, p, sf.StateFormat.INT8, signed)
        got = sf.decode(q, p)
        assert got.stride() == p.stride()
        assert torch.equal(got, sf.decode_reference(q, p))
    finally:
        _ops.set_kernel_variant(before)
        torch.set_num_threads(threads)


def test_kernel_int8_decode_names_bad_arguments():
    q = torch.zeros(4 + 10, dtype=torch.int8)
    with pytest.raises(ValueError, match="packed has 14 bytes; 11 elements take 15"):
        _ops.q8_decode(q, torch.empty(11))
    with pytest.raises(TypeError, match="out has dtype"):
        _ops.q8_decode(q, torch.empty(10, dtype=torch.float64))
    with pytest.raises(TypeError, match="packed has dtype"):
        _ops.q8_decode(q.float(), torch.empty(10))


def test_stochastic_rounding_is_unbiased_and_reproducible():
    # SGD momentum with a zero buffer and momentum 0.5 stores buf = grad: one rounding of each grad value.
    g = torch.randn(4096, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).float()
    lo = g.to(torch.bfloat16).float()
    draws = []
    for key in range(200):
        p = torch.zeros(4096)
        buf = torch.zeros(4096, dtype=torch.bfloat16)
        F.sgd([p], [g], [buf], lr=0.0, momentum=0.5, state_key=key)
        draws.append(buf.float())
    d = torch.stack(draws)
    # The other neighbour of g (above lo when g is exactly representable: sign(0) would make a NaN direction).
    direction = torch.where(g >= lo, float("inf"), float("-inf")).to(torch.bfloat16)
    up = torch.nextafter(lo.to(torch.bfloat16), direction).float()
    assert bool(((d == lo) | (d == up)).all())  # always one of the two neighbours
    ulp = (up - lo).abs().clamp_min(1e-30)
    mean_err = ((d.mean(0) - g) / ulp)
    assert abs(float(mean_err.mean())) < 0.01  # unbiased overall
    assert float(mean_err.abs().max()) < 0.5  # per element: 200 draws of a Bernoulli, 4.5+ sigma
    # Per element too: the mean of 200 draws is ~0.02 ulp off on average (a Bernoulli's spread / sqrt(200)), where
    # round-to-nearest (which passes the two checks above: its errors, below half an ulp, cancel across elements)
    # errs a quarter ulp.
    rtn_err = ((lo - g) / ulp)
    assert float(rtn_err.abs().mean()) > 0.2
    assert float(mean_err.abs().mean()) < 0.06
    p, buf = torch.zeros(4096), torch.zeros(4096, dtype=torch.bfloat16)
    F.sgd([p], [g], [buf], lr=0.0, momentum=0.5, state_key=7)
    assert torch.equal(buf.float(), draws[7])  # reproducible from the key


@pytest.mark.parametrize("key", [0, 7, 2**40 + 3, 2**63 - 1])
def test_python_bf16_stochastic_encoding_matches_the_kernel_bits(key):
    """encode_bf16_stochastic (the FSDP2 Lamb/Lars shard step's bf16 state) draws the kernels' random bits: SGD
    momentum 0.5 from a zero buffer stores one rounding of each grad value, bit for bit the same."""
    g = torch.randn(5000, generator=torch.Generator().manual_seed(1)) * 1e-3
    g[:3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    buf = torch.zeros(5000, dtype=torch.bfloat16)
    F.sgd([torch.zeros(5000)], [g], [buf], lr=0.0, momentum=0.5, state_key=key)
    mine = sf.encode_bf16_stochastic(g, sf.param_key(key, 0))
    assert torch.equal(mine.view(torch.int16), buf.view(torch.int16))


def test_round_to_nearest_stalls_where_stochastic_rounding_does_not():
    # A momentum buffer decaying by 0.1% per step (momentum 0.999, zero grads): bf16 round-to-nearest keeps it
    # where it is (the change is below half a bf16 step), stochastic rounding follows 0.999^t on average.
    steps = 1000
    start = torch.full((4096,), 1.0) + torch.rand(4096) * 0.5
    buf = start.to(torch.bfloat16)
    p, g = torch.zeros(4096), torch.zeros(4096)
    for t in range(steps):
        F.sgd([p], [g], [buf], lr=0.0, momentum=0.999, dampening=1.0, state_key=t)
    rtn = start.to(torch.bfloat16)
    for _ in range(steps):
        rtn = (rtn.float() * 0.999).to(torch.bfloat16)
    exact = start.to(torch.bfloat16).float() * 0.999 ** steps
    assert torch.equal(rtn, start.to(torch.bfloat16))  # stalled
    assert abs(float(buf.float().mean() / exact.mean()) - 1) < 0.01


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def _train(model, opt, steps=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(16, 64, generator=gen), torch.randint(0, 10, (16,), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x).float(), y).backward()
        opt.step()


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_state_dict_is_fp32_and_round_trips_exactly(fmt, dtype):
    base = _mlp()
    model, opt = ipex_train.optimize(base, torch.optim.AdamW(base.parameters(), lr=1e-2), dtype=dtype,
                                     optimizer_state_dtype=FORMATS[fmt])
    _train(model, opt)
    big = model[0].weight  # 8192 elements: reduced; the biases keep fp32 state
    assert sf.public(sf.format_of(opt.state[big]["exp_avg"])) == FORMATS[fmt]
    assert opt.state[model[0].bias]["exp_avg"].dtype == torch.float32
    sd = opt.state_dict()
    for entry in sd["state"].values():
        assert all(v.dtype == torch.float32 for v in entry.values())
    assert opt.state_dict()["state"][0]["exp_avg"].shape == big.shape
    # vanilla torch loads it
    vanilla = _mlp()
    torch.optim.AdamW(vanilla.parameters(), lr=1e-2).load_state_dict(copy.deepcopy(sd))
    # a fresh optimized pair loads it back into exactly the same reduced state and steps alike
    base2 = _mlp()
    model2, opt2 = ipex_train.optimize(base2, torch.optim.AdamW(base2.parameters(), lr=1e-2), dtype=dtype,
                                       optimizer_state_dtype=FORMATS[fmt])
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(copy.deepcopy(sd))
    for p, p2 in zip(model.parameters(), model2.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][key], opt2.state[p2][key]), key
    _train(model, opt, seed=5)
    _train(model2, opt2, seed=5)
    for p, p2 in zip(model.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(p, p2)


def test_per_group_fp32_and_lamb_lars_option():
    model = _mlp()
    opt = torch.optim.Adam([{"params": model[0].parameters(), "state_dtype": torch.float32},
                            {"params": model[2].parameters()}], lr=1e-3)
    model, opt = ipex_train.optimize(model, opt, optimizer_state_dtype="int8")
    _train(model, opt)
    assert opt.state[model[0].weight]["exp_avg"].dtype == torch.float32
    assert opt.state[model[2].weight]["exp_avg"].dtype == torch.float32  # 1280 elements: small, fp32
    lin = nn.Linear(100, 100)
    lamb = ipex_train.optim.Lamb(lin.parameters(), state_dtype=torch.bfloat16)
    lars = ipex_train.optim.Lars(nn.Linear(100, 100).parameters(), state_dtype="int8")
    for o in (lamb, lars):
        for p in o.param_groups[0]["params"]:
            p.grad = torch.randn_like(p)
        o.step()
    assert lamb.state[lin.weight]["exp_avg"].dtype == torch.bfloat16
    assert lars.state[lars.param_groups[0]["params"][0]]["momentum_buffer"].dtype == torch.int8
    assert lamb.state_dict()["state"][0]["exp_avg"].dtype == torch.float32


@pytest.mark.parametrize("value", ["fp8", torch.float16, 8, torch.int8])
def test_bad_option_values_name_the_option(value):
    model = _mlp()
    with pytest.raises(ValueError, match="optimizer_state_dtype"):
        ipex_train.optimize(model, torch.optim.AdamW(model.parameters()), optimizer_state_dtype=value)
    with pytest.raises(ValueError, match="optimizer_state_dtype"):
        ipex_train.OptimizeConfig(optimizer_state_dtype=value)
    with pytest.raises(ValueError, match="state_dtype"):
        ipex_train.optim.Lamb(model.parameters(), state_dtype=value)


def test_reduced_state_needs_the_fused_step():
    model = _mlp()
    with pytest.raises(ValueError, match="fused step"):
        ipex_train.optimize(model, torch.optim.AdamW(model.parameters()), fuse_update_step=False,
                            optimizer_state_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="fused step"):
        ipex_train.optimize(model, torch.optim.RMSprop(model.parameters()), optimizer_state_dtype="int8")
    lamb = ipex_train.optim.Lamb(model.parameters(), state_dtype="int8", fused=False)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with pytest.raises(RuntimeError, match="state_dtype"):
        lamb.step()


def test_config_round_trips_the_option():
    config = ipex_train.OptimizeConfig(optimizer_state_dtype="bf16")
    assert config.optimizer_state_dtype is torch.bfloat16
    assert ipex_train.OptimizeConfig.from_env({}, **config.to_dict()) == config
    assert ipex_train.OptimizeConfig.from_env({"IPEX_TRAIN_OPTIMIZER_STATE_DTYPE": "int8"}).optimizer_state_dtype \
        == "int8"



# ---------------------------------------------------------------------------------------------------------------
# Real data: scikit-learn's digits (shipped with it), an MLP whose three weight matrices (16k, 64k, 2.5k elements)
# have reduced state and whose biases keep fp32 state; 6 epochs, cosine LR, against the fp32-state run.
# Four initialisations: with the init alone one run's final loss moves by up to ~1% against its fp32-state twin
# (measured, AdamW int8 state: -0.28%, +1.20%, -0.17%, -0.21% for seeds 0-3), so the target (within 1%) is held
# by the mean over seeds, where a systematic bias shows: the square-law first-moment map this format had before
# gave Lamb +1.36%, +0.89%, +0.54%, +1.62% (mean +1.10%, failing).

DIGITS_SEEDS = (0, 1, 2, 3)


@functools.cache  # the fp32-state run is shared by both formats
def _digits_run(opt_name: str, state_dtype, seed: int) -> tuple[float, float, frozenset]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x, y = torch.tensor(d.data, dtype=torch.float32) / 16.0, torch.tensor(d.target)
    train, test = train_test_split(range(len(y)), test_size=0.25, random_state=0, stratify=d.target)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    if opt_name == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2)
    elif opt_name == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    else:
        opt = ipex_train.optim.Lamb(model.parameters(), lr=5e-3, weight_decay=1e-2)
    model, opt = ipex_train.optimize(model, opt, optimizer_state_dtype=state_dtype)
    epochs, batch = 6, 32
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs * (len(train) // batch + 1))
    gen = torch.Generator().manual_seed(1)
    xtr, ytr = x[train], y[train]
    for _ in range(epochs):
        for b in torch.randperm(len(ytr), generator=gen).split(batch):
            opt.zero_grad()
            nn.functional.cross_entropy(model(xtr[b]), ytr[b]).backward()
            opt.step()
            sched.step()
    with torch.no_grad():
        loss = float(nn.functional.cross_entropy(model(xtr), ytr))
        acc = 100 * float((model(x[test]).argmax(1) == y[test]).float().mean())
    return loss, acc, frozenset(t.dtype for st in opt.state.values() for k, t in st.items() if k != "step")


_DIGITS_CASES = [pytest.param(o, f, id=f"{o}-{f}") for o in ("adamw", "sgd", "lamb") for f in FORMATS]


@pytest.mark.parametrize("opt_name,fmt", _DIGITS_CASES)
def test_digits_reduced_state_matches_fp32_state(opt_name, fmt):
    runs = [(_digits_run(opt_name, None, s), _digits_run(opt_name, FORMATS[fmt], s)) for s in DIGITS_SEEDS]
    # The weight matrices' state is reduced (the biases' fp32): a run that kept fp32 state would match trivially.
    reduced = {torch.bfloat16} if fmt == "bf16" else {torch.int8} | ({torch.uint8} if opt_name != "sgd" else set())
    assert all(dtypes == {torch.float32} | reduced for _, (_, _, dtypes) in runs), runs[0][1][2]
    rel = [loss / loss32 - 1 for (loss32, _, _), (loss, _, _) in runs]
    assert abs(sum(rel) / len(rel)) <= 0.01, rel
    assert all(abs(acc - acc32) <= 0.5 for (_, acc32, _), (_, acc, _) in runs), runs


@functools.cache  # the fp32-state run is shared by both formats
def _transformer_lamb_run(state_dtype) -> tuple[float, float, set]:
    """recipes.transformer_lamb's task and model, small (2 layers of 64), bf16 weights, Lamb, 30 steps (still
    learning fast: loss ~0.25 from ln 4, where a wrong state shows; trained to ~0.01, losses differ by a few % with
    any change): the mean loss of the last 10 steps, the held-out accuracy, and the first-moment state dtypes."""
    from recipes.transformer_lamb import CountTask, EncoderClassifier

    torch.manual_seed(0)
    task = CountTask(vocab=32, seq_len=32, classes=4, planted=6)
    model = EncoderClassifier(32, 32, 4, d_model=64, layers=2, heads=4)
    opt = ipex_train.optim.Lamb(model.parameters(), lr=5e-3, weight_decay=1e-2)
    model, opt = ipex_train.optimize(model, opt, dtype=torch.bfloat16, optimizer_state_dtype=state_dtype)
    gen, losses = torch.Generator().manual_seed(1), []
    for _ in range(30):
        x, y = task.sample(32, gen)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    x, y = task.sample(512, torch.Generator().manual_seed(2))
    model.eval()
    with torch.no_grad():
        acc = 100 * float((model(x).float().argmax(1) == y).float().mean())
    return sum(losses[-10:]) / 10, acc, {s["exp_avg"].dtype for s in opt.state.values()}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_transformer_lamb_reduced_state_matches_fp32_state(fmt):
    loss32, acc32, _ = _transformer_lamb_run(None)
    loss, acc, dtypes = _transformer_lamb_run(FORMATS[fmt])
    assert dtypes == {torch.float32, torch.bfloat16 if fmt == "bf16" else torch.int8}  # big weights reduced
    assert loss32 < 0.5 * 1.386  # it learnt (ln 4 at chance): a comparison of two untrained runs would say nothing
    assert abs(loss / loss32 - 1) <= 0.01, (loss, loss32)
    assert abs(acc - acc32) <= 0.5, (acc, acc32)
