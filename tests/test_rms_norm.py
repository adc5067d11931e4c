"""ipex_train.rms_norm against Hugging Face's LlamaRMSNorm and an fp32 reference; its routing by the native policy.

Forward: bit-identical to LlamaRMSNorm on bf16 and fp32 input (the kernel repeats torch's fp32 summation order for
the mean, on squares rounded to fp32 as torch's pow(2) rounds them, and every rounding of the module), checked with
torch.equal.

Gradients, bf16 input: against the same formula in fp32 autograd on the same bf16 values (no intermediate
rounding). The kernel computes them in fp32 and rounds grad_x to bf16 once: within 2**-7 relative to the reference's
largest magnitude (one bf16 rounding plus the forward's own rounding of x * rstd, which fp32 lacks; measured ~4e-3).
grad_weight sums over rows in fp32 the products with bf16(x * rstd), as the forward rounds it, and is rounded to the
weight's dtype once: within 2**-7 relative for a bf16 weight, 2**-8 for an fp32 one (measured ~2e-3).
HF's bf16 autograd rounds at every step and is looser: within 3%.

fp32 input: against the formula in float64 autograd on the same values. grad_x is computed in fp32 and stored in
fp32: within 2e-6 relative to the reference's largest magnitude (a few fp32 ulps of the row's dot product and of
rstd; measured ~2e-7). grad_weight sums fp32 products over rows in fp32: within 2e-6 relative for an fp32 weight
(measured ~2e-7), 2**-8 for a bf16 one (one bf16 rounding, at most 2**-8 relative; measured ~3e-3).
"""
import pickle

import pytest
import torch
from op_names import OpNames

import ipex_train
import ipex_train.compute_policy as cp
from ipex_train.base import ops as _ops
from ipex_train.rms_norm import rms_norm

transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402

BF16 = torch.bfloat16
OURS = "ipex_train.rms_norm_forward"


def _module(n, eps=1e-5, dtype=BF16, seed=0):
    torch.manual_seed(seed)
    m = LlamaRMSNorm(n, eps=eps)
    with torch.no_grad():
        m.weight.copy_(torch.randn(n) * 0.3 + 1.0)
    return m.to(dtype)


def _x(shape, seed=1, dtype=BF16):
    torch.manual_seed(seed)
    return (torch.randn(shape) * 2.0).to(dtype)


SHAPES = [(4, 256, 768), (1, 5), (3, 17), (2, 7, 100), (1, 1), (5, 4100)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("weight_dtype", [BF16, torch.float32])
@pytest.mark.parametrize("x_dtype", [BF16, torch.float32])
def test_forward_bit_identical_to_llama_rms_norm(shape, weight_dtype, x_dtype):
    m = _module(shape[-1], dtype=weight_dtype)
    x = _x(shape, dtype=x_dtype)
    ref = m(x)
    with OpNames() as ops:
        out = rms_norm(x, m.weight, m.variance_epsilon)
    assert ops.names == [OURS]  # the kernel, not a fallback to the formula
    assert out.dtype == ref.dtype == (BF16 if weight_dtype == x_dtype == BF16 else torch.float32)
    assert torch.equal(out, ref)


def _fp32_reference(x, w, eps, g):
    xr = x.detach().float().requires_grad_()
    wr = w.detach().float().requires_grad_()
    y = wr * (xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + eps))
    y.backward(g.float())
    return xr.grad, wr.grad


@pytest.mark.parametrize("shape", [(4, 256, 768), (1, 5), (3, 17), (130, 100), (1, 1)])
def test_grads_against_fp32_and_hugging_face(shape):
    m = _module(shape[-1])
    x = _x(shape).requires_grad_()
    torch.manual_seed(2)
    g = torch.randn(shape).to(BF16)
    rms_norm(x, m.weight, m.variance_epsilon).backward(g)
    gx, gw = x.grad, m.weight.grad
    assert gx.dtype == BF16 and gw.dtype == BF16
    rx, rw = _fp32_reference(x, m.weight, m.variance_epsilon, g)
    assert (gx.float() - rx).abs().max() <= 2**-7 * rx.abs().max() + 1e-6
    assert (gw.float() - rw).abs().max() <= 2**-7 * rw.abs().max() + 1e-6
    # Hugging Face's module in bf16 autograd: the same gradients up to its own roundings.
    x2 = x.detach().requires_grad_()
    m.weight.grad = None
    m(x2).backward(g)
    assert (x2.grad.float() - rx).abs().max() <= 3e-2 * rx.abs().max() + 1e-6
    assert (gx.float() - x2.grad.float()).abs().max() <= 3e-2 * rx.abs().max() + 1e-6
    assert (gw.float() - m.weight.grad.float()).abs().max() <= 3e-2 * rw.abs().max() + 1e-6


def test_fp32_weight_grads():
    m = _module(96, dtype=torch.float32)
    x = _x((33, 96)).requires_grad_()
    g = torch.randn(33, 96)
    rms_norm(x, m.weight, m.variance_epsilon).backward(g)
    assert m.weight.grad.dtype == torch.float32 and x.grad.dtype == BF16
    rx, rw = _fp32_reference(x, m.weight, m.variance_epsilon, g)
    assert (x.grad.float() - rx).abs().max() <= 2**-7 * rx.abs().max()
    assert (m.weight.grad - rw).abs().max() <= 2**-8 * rw.abs().max()


def test_weight_grad_deterministic_across_thread_counts():
    m = _module(64)
    x = _x((300, 64)).requires_grad_()
    g = torch.randn(300, 64).to(BF16)
    before = torch.get_num_threads()
    grads = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            m.weight.grad = None
            rms_norm(x, m.weight, 1e-6).backward(g)
            grads.append(m.weight.grad.clone())
    finally:
        torch.set_num_threads(before)
    assert torch.equal(grads[0], grads[1])


def _fp64_reference(x, w, eps, g):
    xr = x.detach().double().requires_grad_()
    wr = w.detach().double().requires_grad_()
    y = wr * (xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + eps))
    y.backward(g.double())
    return xr.grad, wr.grad


@pytest.mark.parametrize("shape", [(4, 256, 768), (1, 5), (3, 17), (130, 100), (1, 1)])
@pytest.mark.parametrize("weight_dtype", [BF16, torch.float32])
def test_fp32_input_grads_against_float64(shape, weight_dtype):
    m = _module(shape[-1], dtype=weight_dtype)
    x = _x(shape, dtype=torch.float32).requires_grad_()
    g = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    with OpNames() as ops:
        rms_norm(x, m.weight, m.variance_epsilon).backward(g)
    assert ops.names.count("ipex_train.rms_norm_backward") == 1
    assert x.grad.dtype == torch.float32 and m.weight.grad.dtype == weight_dtype
    rx, rw = _fp64_reference(x, m.weight, m.variance_epsilon, g)
    assert (x.grad.double() - rx).abs().max() <= 2e-6 * rx.abs().max() + 1e-7
    w_tol = 2e-6 if weight_dtype == torch.float32 else 2**-8
    assert (m.weight.grad.double() - rw).abs().max() <= w_tol * rw.abs().max() + 1e-7


def test_other_input_dtypes_fall_back_to_the_formula():
    m = _module(40, dtype=torch.float32)
    x = torch.randn(3, 40, dtype=torch.float16, requires_grad=True)
    with OpNames() as ops:
        out = rms_norm(x, m.weight, m.variance_epsilon)
        out.sum().backward()
    assert OURS not in ops.names
    assert torch.equal(out, m(x))


def test_bad_arguments_name_themselves():
    w = torch.ones(8, dtype=BF16)
    with pytest.raises(ValueError, match="weight must be 1-D"):
        rms_norm(torch.ones(2, 7, dtype=BF16), w)
    with pytest.raises(ValueError, match="eps"):
        rms_norm(torch.ones(2, 8, dtype=BF16), w, -1.0)
    with pytest.raises(TypeError, match="eps"):
        rms_norm(torch.ones(2, 8, dtype=BF16), w, "1e-6")
    with pytest.raises(TypeError, match="x and weight"):
        rms_norm([1.0] * 8, w)


@pytest.mark.parametrize("x_dtype", [BF16, torch.float32])
def test_kernel_variants_agree(variant, x_dtype):
    # Forward: the same exactly rounded operations in the same order on every ISA (no contracted FMAs): bit-identical.
    # Backward: the row dot product sums in each ISA's vector width; one ulp of x's dtype apart at most.
    m = _module(203)
    x = _x((40, 203), dtype=x_dtype).requires_grad_()
    g = torch.randn(40, 203).to(x_dtype)
    out = rms_norm(x, m.weight, 1e-5)
    out.backward(g)
    gx, gw = x.grad.clone(), m.weight.grad.clone()
    _ops.set_kernel_variant("scalar")
    try:
        x.grad = m.weight.grad = None
        ref = rms_norm(x, m.weight, 1e-5)
        ref.backward(g)
    finally:
        _ops.set_kernel_variant(variant)
    assert torch.equal(out, ref)
    rtol, atol = (2**-7, 1e-3) if x_dtype == BF16 else (1e-5, 1e-6)
    torch.testing.assert_close(gx, x.grad, rtol=rtol, atol=atol)
    torch.testing.assert_close(gw, m.weight.grad, rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("x_dtype", [BF16, torch.float32])
def test_torch_compile_full_graph(x_dtype):
    m = _module(48)
    x = _x((6, 48), dtype=x_dtype)

    def fn(x, w):
        return rms_norm(x, w, 1e-5) * 2

    torch._dynamo.reset()
    assert torch._dynamo.explain(fn)(x, m.weight).graph_break_count == 0
    compiled = torch.compile(fn, fullgraph=True)
    xs = x.requires_grad_()
    out = compiled(xs, m.weight)
    assert out.dtype == (BF16 if x_dtype == BF16 else torch.float32)
    assert torch.equal(out, fn(x, m.weight))
    out.float().sum().backward()
    assert xs.grad.dtype == x_dtype and m.weight.grad is not None


def test_routed_module_compiles_without_graph_break():
    m = _module(48)
    handle = cp.attach(m, "native")
    x = _x((6, 48))
    torch._dynamo.reset()
    assert torch._dynamo.explain(m)(x).graph_break_count == 0
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    out = torch.compile(m, backend=backend, fullgraph=True)(x)
    assert any("rms_norm_forward" in str(node.target) for gm in graphs for node in gm.graph.nodes)
    assert torch.equal(out, m(x))
    handle.remove()


def _llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=50,
                                      attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config).train()


def _optimized(model, policy):
    return ipex_train.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), dtype=BF16,
                               bf16_compute=policy)[0]


def _step(model):
    ids = torch.randint(0, 50, (2, 24), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item()


def test_llama_routed_under_native_and_detach_restores():
    model = _optimized(_llama(), "native")
    norms = [m for m in model.modules() if isinstance(m, LlamaRMSNorm)]
    assert len(norms) == 5 and all(cp.routes_rms_norm(m) is False for m in norms)  # already routed
    with OpNames() as ops:
        loss = _step(model)
    # The 2 post-attention norms run inside their decoder layer's fused residual add + RMSNorm (add_rms_norm route).
    assert ops.names.count(OURS) == 3 and ops.names.count("ipex_train.rms_norm_backward") == 3
    assert ops.names.count("ipex_train.add_rms_norm_forward") == 2
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    # Detached: the class's forward again (no instance attribute left), the same loss and gradients to bf16 rounding.
    cp.attached(model).remove()
    assert all("forward" not in vars(m) and cp.routes_rms_norm(m) for m in norms)
    model.zero_grad(set_to_none=True)
    with OpNames() as ops:
        ref = _step(model)
    assert OURS not in ops.names
    assert abs(loss - ref) <= 1e-2 * abs(ref)
    for n, p in model.named_parameters():
        if n in grads:
            err = (grads[n].float() - p.grad.float()).abs().max().item()
            assert err <= 0.1 * p.grad.float().abs().max().item() + 1e-3, n
    # Attached again: routed again; a pickled copy still runs.
    handle = cp.attach(model, "native")
    assert all("forward" in vars(m) for m in norms)
    copy = pickle.loads(pickle.dumps(model))
    assert torch.isfinite(copy(input_ids=torch.zeros(1, 4, dtype=torch.long)).logits.float()).all()
    handle.remove()


def test_llama_fed_fp32_embeddings_routes_fp32_norms():
    # As benchmarks/common/train_models.py's llama_s256: fp32 embeddings keep the residual stream fp32 and optimize
    # keeps the norm weights fp32, so every norm sees fp32 input: the kernel runs on it, forward and backward.
    model = _optimized(_llama(), "native")
    norms = [m for m in model.modules() if isinstance(m, LlamaRMSNorm)]
    assert all(m.weight.dtype == torch.float32 for m in norms)
    embeds = torch.randn(2, 24, 64, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, 50, (2, 24), generator=torch.Generator().manual_seed(0))
    seen = []
    hooks = [m.register_forward_pre_hook(lambda mod, args: seen.append(args[0].dtype)) for m in norms]

    def step():
        loss = model(inputs_embeds=embeds, labels=ids).loss
        loss.backward()
        return loss.item()

    with OpNames() as ops:
        loss = step()
    assert seen == [torch.float32] * 5
    # The hooks on the norms keep the decoder layers' add + RMSNorm route on the class's ops: all 5 norms run here.
    assert ops.names.count(OURS) == 5 and ops.names.count("ipex_train.rms_norm_backward") == 5
    assert "ipex_train.add_rms_norm_forward" not in ops.names
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for h in hooks:
        h.remove()
    # Only the norms' routing removed (the rest of the policy, which lets attention take mixed dtypes, stays).
    for m in norms:
        del m.forward
    model.zero_grad(set_to_none=True)
    with OpNames() as ops:
        ref = step()
    assert OURS not in ops.names
    # The norms' forward is the same bits; their gradients differ from torch's by fp32 rounding only.
    assert loss == ref
    for n, p in model.named_parameters():
        if n in grads:
            err = (grads[n].float() - p.grad.float()).abs().max().item()
            assert err <= 1e-2 * p.grad.float().abs().max().item() + 1e-4, n


def test_emulated_policy_does_not_route():
    model = _optimized(_llama(), "emulated")
    with OpNames() as ops:
        _step(model)
    assert OURS not in ops.names
    assert not any("forward" in vars(m) for m in model.modules() if isinstance(m, LlamaRMSNorm))


def test_gemma_style_norm_not_routed():
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    assert not cp.routes_rms_norm(GemmaRMSNorm(8))
    assert cp.routes_rms_norm(LlamaRMSNorm(8))
