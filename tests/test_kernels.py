"""The fused step kernels (torch.ops.ipex_train.*_step) against the plain PyTorch reference and torch.optim.

Every optimizer x storage layout x kernel variant runs several steps against ``ipex_train.optim._reference``; for
the 16-bit layouts the reference runs in fp32 on the fp32 working values (recombined split, or the master) with the
kernel's 16-bit grads upcast, so the only differences left are rounding-order ones.
"""
from __future__ import annotations

import collections
import random
import subprocess
import sys
import zlib

import pytest
import torch

from ipex_train.base import ops as _ops
from ipex_train.optim import _layouts, _reference, fused, registry

ops = torch.ops.ipex_train

LAYOUTS = tuple(_layouts.BY_NAME)
GRAD_DTYPE = {lay.name: lay.grad for lay in _layouts.LAYOUTS}
# Odd sizes leave vector tails; together they exceed the kernels' 64Ki-element threading threshold, and the last
# tensor alone spans three 32Ki-element chunks, so the threaded path runs in every test that uses them.
SHAPES = ((1,), (17,), (31, 33), (5, 7, 11), (75_013,))
SMALL_SHAPES = SHAPES[:-1]  # for edge-case tests, where the threaded path adds only time
STEPS = 5
# fp32 vs the reference: the two compute each element in the same order up to torch's own FMA use and the lamb/lars
# norms (one double sum in the reference, 16 double lane sums in the kernel), a few ulps after STEPS steps. fp64 is
# far tighter.
TOL = {"fp64": dict(rtol=1e-12, atol=1e-12)}
TOL_F32 = dict(rtol=1e-6, atol=1e-6)


def work_dtype(layout: str) -> torch.dtype:
    return torch.float64 if layout == "fp64" else torch.float32


def to_storage(layout: str, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(param, aux) holding working values ``w`` in ``layout``."""
    if layout in ("fp32", "fp64"):
        return w.clone(), None
    if layout == "split_bf16":
        return _ops.split_bf16(w)
    return w.to(GRAD_DTYPE[layout]), w.clone()


def working(layout: str, p: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
    """The fp32/fp64 value a stored parameter stands for."""
    if aux is None:
        return p
    if layout == "split_bf16":
        return _ops.combine_bf16(p, aux)
    return aux


# ---------------------------------------------------------------------------------------------------------------
# Hyper-parameters: each case is (optimizer, name, overrides); an override is a value or a function of the case's
# seeded random.Random. Everything not overridden is drawn at random from that same generator.

def _base_group(kind: str, rng: random.Random) -> dict:
    lr = rng.uniform(1e-3, 1e-1)
    if kind == "sgd":
        return dict(lr=lr, momentum=rng.uniform(0.5, 0.95), dampening=0.0, weight_decay=rng.uniform(1e-4, 1e-2),
                    nesterov=False, maximize=False)
    if kind in ("adam", "adamw"):
        return dict(lr=lr, betas=(rng.uniform(0.8, 0.95), rng.uniform(0.9, 0.999)), eps=rng.uniform(1e-8, 1e-6),
                    weight_decay=rng.uniform(1e-3, 1e-1), amsgrad=False, maximize=False,
                    decoupled_weight_decay=kind == "adamw")
    if kind == "adagrad":
        return dict(lr=lr, lr_decay=rng.uniform(0, 1e-1), weight_decay=rng.uniform(1e-4, 1e-2),
                    eps=rng.uniform(1e-10, 1e-8), initial_accumulator_value=0.0, maximize=False)
    if kind == "lamb":
        return dict(lr=lr, betas=(rng.uniform(0.8, 0.95), rng.uniform(0.9, 0.999)), eps=rng.uniform(1e-8, 1e-6),
                    weight_decay=rng.uniform(1e-3, 1e-1), bias_correction=True)
    assert kind == "lars"
    return dict(lr=lr, momentum=rng.uniform(0.5, 0.95), weight_decay=rng.uniform(1e-4, 1e-2),
                eeta=rng.uniform(1e-3, 1e-2), epsilon=rng.uniform(0, 1e-6))


def make_group(kind: str, name: str, **overrides) -> dict:
    rng = random.Random(zlib.crc32(f"{kind}/{name}".encode()))
    group = _base_group(kind, rng)
    group.update({k: v(rng) if callable(v) else v for k, v in overrides.items()})
    return group


CASES = [
    ("sgd", "momentum", {}),
    ("sgd", "nesterov", dict(nesterov=True)),
    ("sgd", "dampening", dict(dampening=lambda r: r.uniform(0.1, 0.9))),
    ("sgd", "no_momentum", dict(momentum=0.0)),
    ("sgd", "maximize_wd0", dict(maximize=True, weight_decay=0.0)),
    ("adam", "l2", {}),
    ("adam", "amsgrad", dict(amsgrad=True)),
    ("adam", "maximize_wd0", dict(maximize=True, weight_decay=0.0)),
    ("adamw", "decoupled", {}),
    ("adamw", "amsgrad_maximize", dict(amsgrad=True, maximize=True)),
    ("adagrad", "lr_decay", {}),
    ("adagrad", "initial_accumulator", dict(initial_accumulator_value=lambda r: r.uniform(0.1, 1.0))),
    ("adagrad", "maximize_wd0", dict(maximize=True, weight_decay=0.0)),
    ("lamb", "bias_correction", {}),
    ("lamb", "no_bias_correction", dict(bias_correction=False)),
    ("lamb", "wd0", dict(weight_decay=0.0)),
    ("lars", "default", {}),
    ("lars", "wd0_no_momentum", dict(weight_decay=0.0, momentum=0.0)),
]
CASE_IDS = [f"{k}-{n}" for k, n, _ in CASES]
KINDS = registry.NAMES + ("adamw",)  # every registered optimizer, and AdamW (Adam's kernel, decoupled decay)


def op_kind(kind: str) -> str:
    return "adam" if kind == "adamw" else kind


# ---------------------------------------------------------------------------------------------------------------
# Running the kernel (through fused.fused_step, the path the optimizers take) and the reference side by side


def reference_state(kind: str, group: dict, params: list[torch.Tensor]) -> dict[str, list]:
    """State as the reference functions expect it, created as torch.optim creates it."""
    n = len(params)
    zeros = lambda: [torch.zeros_like(p) for p in params]  # noqa: E731
    steps = lambda: [torch.tensor(0.0) for _ in params]  # noqa: E731
    if kind == "sgd":
        return {"momentum_buffer": [None] * n}
    if kind == "adam":
        return {"exp_avg": zeros(), "exp_avg_sq": zeros(),
                "max_exp_avg_sq": zeros() if group["amsgrad"] else [], "step": steps()}
    if kind == "adagrad":
        init = group["initial_accumulator_value"]
        return {"sum": [torch.full_like(p, init) for p in params], "step": steps()}
    if kind == "lamb":
        return {"exp_avg": zeros(), "exp_avg_sq": zeros(), "step": steps()}
    return {"momentum_buffer": zeros()}


def reference_step(kind: str, g: dict, params: list, grads: list, st: dict) -> None:
    """One step of the plain PyTorch reference, incrementing the step counters first as the kernels expect."""
    for s in st.get("step", []):
        s += 1
    if kind == "sgd":
        _reference.sgd(params, grads, st["momentum_buffer"], lr=g["lr"], momentum=g["momentum"],
                       dampening=g["dampening"], weight_decay=g["weight_decay"], nesterov=g["nesterov"],
                       maximize=g["maximize"])
    elif kind == "adam":
        _reference.adam(params, grads, st["exp_avg"], st["exp_avg_sq"], st["max_exp_avg_sq"], st["step"],
                        lr=g["lr"], beta1=g["betas"][0], beta2=g["betas"][1], weight_decay=g["weight_decay"],
                        eps=g["eps"], amsgrad=g["amsgrad"], maximize=g["maximize"],
                        decoupled_weight_decay=g["decoupled_weight_decay"])
    elif kind == "adagrad":
        _reference.adagrad(params, grads, st["sum"], st["step"], lr=g["lr"], lr_decay=g["lr_decay"],
                           weight_decay=g["weight_decay"], eps=g["eps"], maximize=g["maximize"])
    elif kind == "lamb":
        _reference.lamb(params, grads, st["exp_avg"], st["exp_avg_sq"], st["step"], lr=g["lr"], beta1=g["betas"][0],
                        beta2=g["betas"][1], weight_decay=g["weight_decay"], eps=g["eps"],
                        bias_correction=g["bias_correction"])
    else:
        _reference.lars(params, grads, st["momentum_buffer"], lr=g["lr"], momentum=g["momentum"],
                        weight_decay=g["weight_decay"], eeta=g["eeta"], epsilon=g["epsilon"])


class Run:
    """One parameter list in one layout, stepped by the fused kernel, with an fp32/fp64 reference alongside."""

    def __init__(self, kind: str, group: dict, layout: str, w0: list[torch.Tensor]):
        self.kind, self.group, self.layout = op_kind(kind), group, layout
        stored = [to_storage(layout, w) for w in w0]
        self.params = [p for p, _ in stored]
        self.aux = [a for _, a in stored]
        self.state = collections.defaultdict(dict)
        self.ref_params = [w.clone() for w in w0]
        self.ref_state = reference_state(self.kind, group, self.ref_params)

    def step(self, grads: list[torch.Tensor]) -> None:
        """One kernel step with ``grads`` rounded to the layout's grad dtype; the reference gets them upcast."""
        kgrads = [g.to(GRAD_DTYPE[self.layout]) for g in grads]
        fused.fused_step(registry.get(self.kind), self.group, self.state, self.params, self.aux, kgrads)
        reference_step(self.kind, self.group, self.ref_params, [g.to(work_dtype(self.layout)) for g in kgrads],
                       self.ref_state)

    def working(self) -> list[torch.Tensor]:
        return [working(self.layout, p, a) for p, a in zip(self.params, self.aux)]

    def kernel_state(self, key: str) -> list[torch.Tensor]:
        return [self.state[p][key] for p in self.params]

    def tensors(self) -> list[torch.Tensor]:
        """Everything the kernel wrote, for bitwise comparisons between variants."""
        out = list(self.params) + [a for a in self.aux if a is not None]
        for p in self.params:
            out += [t for _, t in sorted(self.state[p].items())]
        return out

    def check_against_reference(self) -> None:
        tol = TOL.get(self.layout, TOL_F32)
        for i, (w, r) in enumerate(zip(self.working(), self.ref_params)):
            torch.testing.assert_close(w, r, **tol, msg=lambda m, i=i: f"param {i}: {m}")
        for key, ref in self.ref_state.items():
            for i, r in enumerate(ref):
                if r is None:  # SGD without momentum keeps no buffer
                    assert key not in self.state[self.params[i]]
                elif key == "step":
                    assert float(self.state[self.params[i]][key]) == float(r)
                else:
                    torch.testing.assert_close(self.kernel_state(key)[i], r, **tol,
                                               msg=lambda m, key=key, i=i: f"{key}[{i}]: {m}")
        self.check_stored_rounding()

    def check_stored_rounding(self) -> None:
        """The stored 16-bit param is the rounding of the working value the layout promises."""
        if self.layout == "split_bf16":
            for p, a, w in zip(self.params, self.aux, self.working()):
                # the stored pair is the canonical split of the value it stands for
                top, res = _ops.split_bf16(w)
                assert torch.equal(top.view(torch.int16), p.view(torch.int16)) and torch.equal(res, a)
                # Away from exact ties (rare in random data) the top is torch's own round-to-nearest-even.
                not_tie = (w.view(torch.int32) & 0xFFFF) != 0x8000
                assert torch.equal(p[not_tie].view(torch.int16), w[not_tie].to(torch.bfloat16).view(torch.int16))
        elif self.layout in ("bf16_master", "fp16_master"):
            for p, a in zip(self.params, self.aux):
                assert torch.equal(p.view(torch.int16), a.to(p.dtype).view(torch.int16))


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``, for bit-for-bit comparisons (NaN payloads and the sign of zero included)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def random_params(layout: str, seed: int, shapes=SHAPES) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=work_dtype(layout)) for s in shapes]


def random_grads(layout: str, gen: torch.Generator, shapes=SHAPES) -> list[torch.Tensor]:
    return [torch.randn(s, generator=gen, dtype=work_dtype(layout)) for s in shapes]


def run_case(kind: str, name: str, overrides: dict, layout: str, steps: int = STEPS, shapes=SHAPES) -> Run:
    seed = zlib.crc32(f"{kind}/{name}/{layout}".encode())
    run = Run(kind, make_group(kind, name, **overrides), layout, random_params(layout, seed, shapes))
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        run.step(random_grads(layout, gen, shapes))
    return run


# ---------------------------------------------------------------------------------------------------------------
# Against the reference


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind,name,overrides", CASES, ids=CASE_IDS)
def test_matches_reference(kind, name, overrides, layout, variant):
    run_case(kind, name, overrides, layout).check_against_reference()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", KINDS)
def test_lr_zero_leaves_params_bit_identical(kind, layout, variant):
    run = Run(kind, make_group(kind, "lr0", lr=0.0), layout, random_params(layout, 7, SMALL_SHAPES))
    before = [t.clone() for t in run.params + [a for a in run.aux if a is not None]]
    gen = torch.Generator().manual_seed(8)
    for _ in range(STEPS):
        run.step(random_grads(layout, gen, SMALL_SHAPES))
    after = run.params + [a for a in run.aux if a is not None]
    for b, a in zip(before, after):
        assert torch.equal(bits(b), bits(a))
    run.check_against_reference()  # the state still moves, as the reference's does


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", KINDS)
def test_all_zero_params_and_grads_stay_zero(kind, layout, variant):
    group = make_group(kind, "zeros")
    run = Run(kind, group, layout, [torch.zeros(s, dtype=work_dtype(layout)) for s in SMALL_SHAPES])
    for _ in range(STEPS):
        run.step([torch.zeros(s, dtype=work_dtype(layout)) for s in SMALL_SHAPES])
    run.check_against_reference()
    for w in run.working():
        assert not w.any()
    if kind == "adagrad":
        for s in run.kernel_state("sum"):
            assert torch.all(s == group["initial_accumulator_value"])


@pytest.mark.parametrize("layout", ("fp32", "split_bf16"))
@pytest.mark.parametrize("kind", ("lamb", "lars"))
def test_two_pass_batches_match_reference(kind, layout):
    # Lamb and Lars run their two passes per batch of about 2^20 elements (ops.cpp, two_passes): these shapes make
    # a batch of two large params, then one of a tiny and a large one, then a last small one.
    shapes = ((600_000,), (700_000,), (10,), (1_100_000,), (3, 5))
    run_case(kind, "default" if kind == "lars" else "bias_correction", {}, layout, steps=2,
             shapes=shapes).check_against_reference()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ("lamb", "lars"))
def test_zero_initialised_tensor_moves_with_trust_ratio_one(kind, layout, variant):
    # A zero tensor (a fresh bias) has ||w|| = 0: the trust ratio / local lr is 1, so the first step is the plain
    # one, -lr * g / (|g| + eps) for Lamb (bias-corrected moments of one grad) and -lr * g for Lars.
    group = make_group(kind, "zero_init", weight_decay=0.0)
    shapes = ((37,), (75_013,))
    run = Run(kind, group, layout, [torch.zeros(s, dtype=work_dtype(layout)) for s in shapes])
    gen = torch.Generator().manual_seed(3)
    grads = [g.to(GRAD_DTYPE[layout]).to(work_dtype(layout)) for g in random_grads(layout, gen, shapes)]
    run.step(grads)
    run.check_against_reference()
    tol = TOL.get(layout, dict(rtol=1e-5, atol=1e-7))
    for w, g in zip(run.working(), grads):
        expected = -group["lr"] * g / (g.abs() + group["eps"]) if kind == "lamb" else -group["lr"] * g
        torch.testing.assert_close(w, expected, **tol)


@pytest.mark.parametrize("kind,name,overrides", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_variants_bit_identical(kind, name, overrides, layout):
    # The build uses -ffp-contract=off and the loops keep lane-wise partial sums, so every ISA variant must round
    # exactly alike.
    variants = _ops.supported_kernel_variants()
    if len(variants) < 2:
        pytest.skip("this CPU runs only one kernel variant")
    before = _ops.kernel_variant()
    results = {}
    try:
        for v in variants:
            _ops.set_kernel_variant(v)
            results[v] = run_case(kind, name, overrides, layout, steps=3, shapes=SMALL_SHAPES).tensors()
    finally:
        _ops.set_kernel_variant(before)
    first, *rest = variants
    for v in rest:
        for i, (a, b) in enumerate(zip(results[first], results[v])):
            assert torch.equal(bits(a), bits(b)), f"{first} vs {v}: tensor {i} differs"


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` whose data starts one element past an aligned allocation (so no vector store is aligned)."""
    return torch.empty(t.numel() + 1, dtype=t.dtype)[1:].view(t.shape).copy_(t)


@pytest.mark.parametrize("aligned", (True, False), ids=("aligned", "misaligned"))
@pytest.mark.parametrize("layout", ("bf16_master", "fp16_master"))
@pytest.mark.parametrize("kind", ("adam", "lamb"))
def test_large_groups_stream_16bit_params_to_the_same_bits(kind, layout, aligned):
    # A group of 2^22 elements or more has the vector variants write the master layouts' 16-bit params with
    # non-temporal stores (ops.cpp, kStreamMin); a param whose data is not vector-aligned keeps plain stores. Either
    # way the bits must be those of the scalar variant, which never streams (and which the tests above hold to the
    # reference; at 4M random elements a few ill-conditioned ones, where g + weight_decay * w nearly cancels next to
    # eps, amplify ulp-level differences from the reference beyond its tolerance, so that check is not repeated here).
    shapes = ((1 << 22) + 13,)  # alone over the threshold; the odd size leaves a per-element tail after the vectors

    def run():
        seed = zlib.crc32(f"{kind}/stream/{layout}".encode())
        r = Run(kind, make_group(kind, "stream"), layout, random_params(layout, seed, shapes))
        if not aligned:
            r.params = [_misaligned(p) for p in r.params]
        gen = torch.Generator().manual_seed(seed + 1)
        for _ in range(2):
            r.step(random_grads(layout, gen, shapes))
        return r

    runs = _in_each_variant(run)
    first = runs["scalar"]
    first.check_stored_rounding()
    for v, r in runs.items():
        for i, (a, b) in enumerate(zip(first.tensors(), r.tensors())):
            assert torch.equal(bits(a), bits(b)), f"{v}: tensor {i} differs"
    if not aligned:
        assert first.params[0].data_ptr() % 16 != 0


def _in_each_variant(fn) -> dict:
    before = _ops.kernel_variant()
    try:
        out = {}
        for v in _ops.supported_kernel_variants():
            _ops.set_kernel_variant(v)
            out[v] = fn()
        return out
    finally:
        _ops.set_kernel_variant(before)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
def test_every_16bit_grad_converts_alike(dtype):
    # All 65536 bit patterns of a 16-bit grad (subnormals, Inf, quiet and signaling NaNs with every payload) through
    # SGD with lr=1 from a zero master: master = 0 - grad exactly, and the param is the store of that. The vector
    # variants convert with instructions (F16C) or shuffles, the scalar one with convert.h's formulas: same bits.
    # 65536 is a whole number of vectors and chunks, so this runs in the vector loops, not the per-element tail.
    grad = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)

    def run():
        master = torch.zeros(grad.numel())
        param = torch.full_like(grad, 3.0)
        ops.sgd_step([param], [master], [grad], [], [], 1.0, 0.0, 0.0, 0.0, False, False)
        return master, param

    results = _in_each_variant(run)
    first = next(iter(results.values()))
    for v, (master, param) in results.items():
        assert torch.equal(bits(master), bits(first[0])), f"{v}: master differs"
        assert torch.equal(bits(param), bits(first[1])), f"{v}: param differs"
    master, param = first
    num = ~grad.isnan()
    expected = torch.zeros(int(num.sum())) - grad[num].float()  # exact widening; 0 - (+0) is +0
    assert torch.equal(bits(master[num]), bits(expected))
    assert torch.equal(bits(param[num]), bits(expected.to(dtype)))
    assert master[~num].isnan().all() and param[~num].isnan().all()
    quiet_bit = master[~num].view(torch.int32) & 0x00400000
    assert (quiet_bit != 0).all()  # NaNs come out quiet


def test_split_and_combine_bits_alike_in_every_variant():
    # Every sign/exponent with a spread of mantissas, the ties, and NaNs with payloads, through the split and
    # combine ops of each variant.
    gen = torch.Generator().manual_seed(5)
    hi = torch.arange(0, 1 << 16, dtype=torch.int64) << 16
    lows = torch.tensor([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=torch.int64)
    rand = torch.randint(0, 1 << 16, (1 << 16,), generator=gen, dtype=torch.int64)
    words = torch.cat([(hi[:, None] + lows[None, :]).reshape(-1), hi + rand])
    src = words.to(torch.int32).view(torch.float32)  # wraps to the int32 bit patterns

    results = _in_each_variant(lambda: (*_ops.split_bf16(src), _ops.combine_bf16(*_ops.split_bf16(src))))
    first = next(iter(results.values()))
    for v, out in results.items():
        for a, b, name in zip(out, first, ("top", "residual", "combined")):
            assert torch.equal(bits(a), bits(b)), f"{v}: {name} differs"
    num = ~src.isnan()
    assert torch.equal(bits(first[2][num]), bits(src[num]))


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
def test_master_store_rounds_like_torch(dtype, variant):
    # The param written from the master must be torch's round-to-nearest-even cast over the whole range:
    # subnormals, exact ties, overflow to Inf, NaN. The param starts as garbage so only the kernel's store decides.
    gen = torch.Generator().manual_seed(11)
    mags = torch.pow(10.0, torch.empty(50_000).uniform_(-45, 38, generator=gen))
    master = mags * torch.randn(50_000, generator=gen).sign()
    info = torch.finfo(dtype)
    specials = [0.0, -0.0, info.max, -info.max, info.tiny, info.smallest_normal / 2, float("nan"),
                1 + info.eps / 2, 1 + 1.5 * info.eps, -(1 + info.eps / 2)]  # the last three are exact ties
    if dtype == torch.float16:
        specials += [65519.0, 65520.0, -65520.0, 2.0**-24, 2.0**-25, 3 * 2.0**-25]
    master = torch.cat([master, torch.tensor(specials)])
    param = torch.full_like(master, 3.0, dtype=dtype)
    ops.sgd_step([param], [master], [torch.zeros_like(param)], [], [], 0.0, 0.0, 0.0, 0.0, False, False)
    expected = master.to(dtype)
    nan = expected.isnan()
    assert torch.equal(param.isnan(), nan)
    assert torch.equal(param[~nan].view(torch.int16), expected[~nan].view(torch.int16))


@pytest.mark.parametrize("kind", ("sgd", "adam", "adagrad"))
def test_inf_param_with_zero_weight_decay_matches_torch(kind):
    group = make_group(kind, "inf", weight_decay=0.0)
    run = Run(kind, group, "fp32", [torch.tensor([float("inf"), 1.0])])
    run.step([torch.tensor([0.5, 0.5])])
    assert torch.equal(run.params[0], run.ref_params[0])


# ---------------------------------------------------------------------------------------------------------------
# Against torch.optim's for-loop implementation

TORCH_CASES = {
    "sgd": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-3)),
    "sgd_nesterov_maximize": (torch.optim.SGD, dict(lr=0.05, momentum=0.8, nesterov=True, weight_decay=1e-3,
                                                    maximize=True)),
    "sgd_plain": (torch.optim.SGD, dict(lr=0.1)),
    "adam": (torch.optim.Adam, dict(lr=1e-2, weight_decay=1e-2)),
    "adam_amsgrad_maximize": (torch.optim.Adam, dict(lr=1e-2, betas=(0.8, 0.99), amsgrad=True, maximize=True)),
    "adam_decoupled": (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "adamw_amsgrad": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.05, amsgrad=True)),
    "adagrad": (torch.optim.Adagrad, dict(lr=0.1, lr_decay=1e-2, weight_decay=1e-3, initial_accumulator_value=0.1)),
    "adagrad_maximize": (torch.optim.Adagrad, dict(lr=0.1, eps=1e-8, maximize=True)),
}


@pytest.mark.parametrize("case", sorted(TORCH_CASES))
def test_fp32_matches_torch_optim(case, variant):
    cls, hp = TORCH_CASES[case]
    kind = {torch.optim.SGD: "sgd", torch.optim.Adagrad: "adagrad"}.get(cls, "adam")
    w0 = random_params("fp32", 21)
    theirs = [w.clone().requires_grad_() for w in w0]
    torch_opt = cls(theirs, foreach=False, **hp)
    ours = [w.clone() for w in w0]
    # An optimizer of the same class over our tensors holds the param group and state; the kernel steps them.
    holder = cls(ours, foreach=False, **hp)
    gen = torch.Generator().manual_seed(22)
    for _ in range(STEPS):
        grads = random_grads("fp32", gen)
        for p, g in zip(theirs, grads):
            p.grad = g.clone()
        torch_opt.step()
        fused.fused_step(registry.get(kind), holder.param_groups[0], holder.state, ours, [None] * len(ours), grads)
    # Relative 1e-6, plus an absolute 1e-6 for results that are small differences of O(1) terms (a momentum buffer
    # or a param near zero): torch's kernels fuse multiply-adds and ours do not, so such results carry a few ulps
    # of the O(1) operands (~1e-7 each), which is large relative to the result itself.
    tol = dict(rtol=1e-6, atol=1e-6)
    for mine, ref in zip(ours, theirs):
        torch.testing.assert_close(mine, ref.detach(), **tol)
        st_mine, st_ref = holder.state[mine], torch_opt.state[ref]
        assert sorted(st_mine) == sorted(st_ref)
        for key in st_ref:
            torch.testing.assert_close(st_mine[key], st_ref[key], **tol, msg=lambda m, key=key: f"{key}: {m}")


def test_split_bf16_training_tracks_fp32(variant):
    # Least squares trained with AdamW twice: fp32 by torch.optim, and split bf16 (bf16 forward/backward, fp32
    # working weights kept as top + residual) by the kernel. The split run must land within bf16 tolerance.
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(512, 24, generator=gen)
    y = x @ torch.randn(24, 3, generator=gen)
    w0 = 0.1 * torch.randn(24, 3, generator=gen)
    hp = dict(lr=5e-2, weight_decay=1e-2)

    w32 = w0.clone().requires_grad_()
    opt = torch.optim.AdamW([w32], foreach=False, **hp)
    top, res = _ops.split_bf16(w0)
    top.requires_grad_()
    state = collections.defaultdict(dict)
    group = dict(torch.optim.AdamW([w0.clone()], **hp).param_groups[0])
    xb, yb = x.bfloat16(), y.bfloat16()
    for _ in range(150):
        opt.zero_grad()
        ((x @ w32 - y) ** 2).mean().backward()
        opt.step()
        top.grad = None
        ((xb @ top - yb).float() ** 2).mean().backward()
        with torch.no_grad():
            fused.fused_step(registry.get("adam"), group, state, [top], [res], [top.grad])
    w_split = _ops.combine_bf16(top.detach(), res)
    loss0 = float(((x @ w0 - y) ** 2).mean())
    loss32 = float(((x @ w32.detach() - y) ** 2).mean())
    loss_split = float(((x @ w_split - y) ** 2).mean())
    assert loss32 < 0.05 * loss0 and loss_split < 0.05 * loss0
    torch.testing.assert_close(w_split, w32.detach(), rtol=2e-2, atol=2e-2)
    assert torch.equal(top.detach(), _ops.split_bf16(w_split)[0])


# ---------------------------------------------------------------------------------------------------------------
# Memory layouts: strided params, grads and states give the contiguous result and are updated in place


def call_op(kind: str, g: dict, params, aux, grads, states, steps) -> None:
    """Call the op directly with explicit state tensors (so the test controls their memory layout)."""
    if kind == "sgd":
        ops.sgd_step(params, aux, grads, states[0], [False] * len(params), g["lr"], g["momentum"], g["dampening"],
                     g["weight_decay"], g["nesterov"], g["maximize"])
    elif kind == "adam":
        ops.adam_step(params, aux, grads, states[0], states[1], states[2], steps, g["lr"], *g["betas"],
                      g["weight_decay"], g["eps"], True, g["maximize"], g["decoupled_weight_decay"])
    elif kind == "adagrad":
        ops.adagrad_step(params, aux, grads, states[0], steps, g["lr"], g["lr_decay"], g["weight_decay"], g["eps"],
                         g["maximize"])
    elif kind == "lamb":
        ops.lamb_step(params, aux, grads, states[0], states[1], steps, g["lr"], *g["betas"], g["weight_decay"],
                      g["eps"], g["bias_correction"])
    else:
        ops.lars_step(params, aux, grads, states[0], g["lr"], g["momentum"], g["weight_decay"], g["eeta"],
                      g["epsilon"])


N_STATES = {o.name: len(o.state) for o in registry.OPTIMIZERS}
SHAPE4 = (3, 6, 5, 7)


def _arrange(t: torch.Tensor, how: str) -> torch.Tensor:
    """A tensor equal to ``t`` (shape SHAPE4) stored as ``how`` says."""
    if how == "contiguous":
        return t.clone()
    if how == "channels_last":
        return t.clone(memory_format=torch.channels_last)
    if how == "transposed":  # dense, but not in row-major order
        return t.transpose(1, 3).contiguous().transpose(1, 3)
    assert how == "sliced"  # not dense: every other element of a bigger buffer
    big = torch.full((*t.shape[:-1], 2 * t.shape[-1]), 7.0, dtype=t.dtype)
    big[..., ::2] = t
    return big[..., ::2]


ARRANGEMENTS = {
    # every tensor the same way: the kernel walks memory directly
    "all_channels_last": dict(param="channels_last", grad="channels_last", state="channels_last"),
    "all_transposed": dict(param="transposed", grad="transposed", state="transposed"),
    # mixed orders or non-dense views: the kernel runs on copies and writes back into the originals
    "all_sliced": dict(param="sliced", grad="sliced", state="sliced"),
    "channels_last_param_only": dict(param="channels_last", grad="contiguous", state="contiguous"),
    "mixed": dict(param="transposed", grad="sliced", state="channels_last"),
}


@pytest.mark.parametrize("arrangement", sorted(ARRANGEMENTS))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", registry.NAMES)
def test_strided_tensors_match_contiguous(kind, layout, arrangement):
    how = ARRANGEMENTS[arrangement]
    group = make_group(kind, "strided")
    gen = torch.Generator().manual_seed(31)
    wdt = work_dtype(layout)
    w0 = torch.randn(SHAPE4, generator=gen, dtype=wdt)
    states0 = [torch.rand(SHAPE4, generator=gen, dtype=wdt) for _ in range(N_STATES[kind])]
    grads0 = [torch.randn(SHAPE4, generator=gen, dtype=wdt).to(GRAD_DTYPE[layout]) for _ in range(3)]

    def run(arr: dict):
        p, a = to_storage(layout, w0)
        p = _arrange(p, arr["param"])
        a = None if a is None else _arrange(a, arr["param"])
        states = [_arrange(s, arr["state"]) for s in states0]
        objs = [p] + ([a] if a is not None else []) + states
        ptrs = [t.data_ptr() for t in objs]
        state_lists = [[s] for s in states] + [[]] * (3 - len(states))
        steps = [torch.tensor(0.0)]
        for g in grads0:
            steps[0] += 1
            call_op(kind, group, [p], [a], [_arrange(g, arr["grad"])], state_lists, steps)
        assert [t.data_ptr() for t in objs] == ptrs  # the caller's tensors, not copies, hold the result
        return objs

    expected = run(dict(param="contiguous", grad="contiguous", state="contiguous"))
    got = run(how)
    if how["param"] == "channels_last":
        assert got[0].is_contiguous(memory_format=torch.channels_last)
    if kind in ("lamb", "lars"):
        # Norms are summed in memory order, so they may round differently: compare working values and states.
        n_store = len(expected) - len(states0)
        values = lambda objs: [working(layout, *(objs[:n_store] + [None])[:2])] + objs[n_store:]  # noqa: E731
        for i, (e, g) in enumerate(zip(values(expected), values(got))):
            torch.testing.assert_close(g, e, **TOL.get(layout, TOL_F32), msg=lambda m, i=i: f"tensor {i}: {m}")
    else:
        for i, (e, g) in enumerate(zip(expected, got)):
            assert torch.equal(bits(g), bits(e)), f"tensor {i} differs"
    if how["param"] == "sliced":
        base = got[0]._base
        untouched = torch.ones(base.shape, dtype=torch.bool)
        untouched[..., ::2] = False
        assert torch.all(base[untouched] == 7.0)  # write-back stayed inside the view


# ---------------------------------------------------------------------------------------------------------------
# Errors


def _adam(params, aux, grads, m, v, steps=None):
    steps = steps if steps is not None else [torch.tensor(1.0) for _ in params]
    ops.adam_step(params, aux, grads, m, v, [], steps, 1e-3, 0.9, 0.999, 0.0, 1e-8, False, False, False)


def _f32(n=2, shape=(4,)):
    return [torch.zeros(shape) for _ in range(n)]


@pytest.mark.parametrize("which,match", [
    ("grads", r"got 2 params but 1 grads"),
    ("aux", r"got 2 params but 1 aux entries"),
    ("exp_avgs", r"got 2 params but 1 exp_avgs"),
    ("exp_avg_sqs", r"got 2 params but 1 exp_avg_sqs"),
    ("state_steps", r"got 2 params but 1 state_steps"),
])
def test_list_length_mismatch(which, match):
    args = dict(params=_f32(), aux=[None, None], grads=_f32(), exp_avgs=_f32(), exp_avg_sqs=_f32(),
                state_steps=[torch.tensor(1.0)] * 2)
    args[which] = args[which][:1]
    with pytest.raises(ValueError, match=match):
        _adam(args["params"], args["aux"], args["grads"], args["exp_avgs"], args["exp_avg_sqs"], args["state_steps"])


def test_sgd_fresh_flags_length_mismatch():
    with pytest.raises(ValueError, match=r"got 2 params but 1 fresh_buffers"):
        ops.sgd_step(_f32(), [None, None], _f32(), _f32(), [True], 0.1, 0.9, 0.0, 0.0, False, False)


@pytest.mark.parametrize("param,aux,grad,state,exc,match", [
    (torch.float32, None, torch.float64, torch.float32, TypeError, r"grads\[1\] has dtype Double.*float32"),
    (torch.float32, None, torch.float32, torch.float64, TypeError, r"exp_avgs\[1\] has dtype Double"),
    (torch.float64, None, torch.float64, torch.float32, TypeError, r"exp_avgs\[1\] has dtype Float"),
    (torch.bfloat16, None, torch.bfloat16, torch.float32, TypeError, r"params\[1\] has dtype BFloat16.*aux\[1\]"),
    (torch.float16, torch.int16, torch.float16, torch.float32, TypeError, r"params\[1\] \(Half\) with aux\[1\]"),
    (torch.float32, torch.int16, torch.float32, torch.float32, TypeError, r"params\[1\] \(Float\) with aux\[1\]"),
    (torch.bfloat16, torch.int16, torch.float32, torch.float32, TypeError, r"grads\[1\] has dtype Float"),
    (torch.float16, torch.float32, torch.bfloat16, torch.float32, TypeError, r"grads\[1\] has dtype BFloat16"),
    # (bf16 state is reduced-byte state now, test_state_formats.py; fp16 state is still no layout's)
    (torch.bfloat16, torch.float32, torch.bfloat16, torch.float16, TypeError, r"exp_avgs\[1\] has dtype Half"),
])
def test_dtype_mismatch(param, aux, grad, state, exc, match):
    # parameter 0 is valid fp32; the bad one is parameter 1, so the message must name index 1
    params = [torch.zeros(4), torch.zeros(4, dtype=param)]
    auxs = [None, None if aux is None else torch.zeros(4, dtype=aux)]
    grads = [torch.zeros(4), torch.zeros(4, dtype=grad)]
    states = [torch.zeros(4), torch.zeros(4, dtype=state)]
    with pytest.raises(exc, match=match):
        _adam(params, auxs, grads, states, [s.clone() for s in states])


@pytest.mark.parametrize("which,match", [
    ("grad", r"grads\[1\] has shape \[5\] but params\[1\] has shape \[4\]"),
    ("aux", r"aux\[1\] has shape \[5\]"),
    ("state", r"exp_avg_sqs\[1\] has shape \[5\]"),
])
def test_shape_mismatch(which, match):
    params, grads = [torch.zeros(4, dtype=torch.bfloat16)] * 2, [torch.zeros(4, dtype=torch.bfloat16)] * 2
    auxs, m, v = [torch.zeros(4, dtype=torch.int16)] * 2, _f32(), _f32()
    bad = {"grad": (grads, torch.bfloat16), "aux": (auxs, torch.int16), "state": (v, torch.float32)}
    lst, dt = bad[which]
    lst[1] = torch.zeros(5, dtype=dt)
    with pytest.raises(ValueError, match=match):
        _adam(list(params), auxs, grads, m, v)


def test_step_not_incremented():
    with pytest.raises(ValueError, match=r"state_steps\[0\] is 0.*increment"):
        _adam(_f32(1), [None], _f32(1), _f32(1), _f32(1), [torch.tensor(0.0)])


def test_nesterov_needs_momentum_without_dampening():
    with pytest.raises(ValueError, match="nesterov"):
        ops.sgd_step(_f32(1), [None], _f32(1), _f32(1), [True], 0.1, 0.9, 0.5, 0.0, True, False)


@pytest.mark.parametrize("which", ("params", "grads"))
def test_non_cpu_tensor_rejected(which):
    params, grads = _f32(1), _f32(1)
    {"params": params, "grads": grads}[which][0] = torch.zeros(4, device="meta")
    with pytest.raises(ValueError, match=rf"{which}\[0\] is on meta"):
        _adam(params, [None], grads, _f32(1), _f32(1))


def test_sparse_grad_rejected():
    with pytest.raises(ValueError, match=r"grads\[0\] is sparse"):
        _adam(_f32(1), [None], [torch.zeros(4).to_sparse()], _f32(1), _f32(1))


def test_bad_kernel_variant_name():
    with pytest.raises(ValueError, match=r"unknown kernel variant 'sse9'.*avx2"):
        _ops.set_kernel_variant("sse9")
    with pytest.raises(TypeError, match="name must be a str"):
        _ops.set_kernel_variant(2)


def test_unsupported_kernel_variant():
    if "avx512" in _ops.supported_kernel_variants():
        pytest.skip("this CPU runs the avx512 variant")
    before = _ops.kernel_variant()
    with pytest.raises(RuntimeError, match=r"kernel variant 'avx512' needs CPU features this machine lacks: .*avx512f"):
        _ops.set_kernel_variant("avx512")
    assert _ops.kernel_variant() == before


def test_env_var_selects_variant_and_rejects_bad_names():
    code = "from ipex_train.base import ops as _ops; print(_ops.kernel_variant())"
    ok = subprocess.run([sys.executable, "-c", code], env={"IPEX_TRAIN_KERNEL": "scalar", "PATH": ""},
                        capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.strip() == "scalar", ok.stderr
    bad = subprocess.run([sys.executable, "-c", code], env={"IPEX_TRAIN_KERNEL": "sse9", "PATH": ""},
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "IPEX_TRAIN_KERNEL='sse9'" in bad.stderr
