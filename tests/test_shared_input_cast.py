"""One cast of an fp32 input for the projections that read it (compute_policy._swap.shared_input_cast), as the
native policy's rotary (q/k/v) and SwiGLU (gate/up) routes use it on a Llama whose RMSNorms optimize() keeps fp32.

The forward is unchanged bit for bit (each projection receives the very cast its hook would have made). Backward,
the projections' input gradients add in bf16 before one cast back, as on a bf16 stream, instead of each being cast
to fp32 and added there: the gradients then differ by bf16 rounding, within 2^-6 of each tensor's largest magnitude
here (measured 6.7e-3 at most, two layers).
"""
import contextlib
from unittest import mock

import pytest
import torch
from route_checks import native

import ipex_train
from ipex_train.compute_policy import _rope, _swiglu
from ipex_train.compute_policy._swap import shared_input_cast
from ipex_train.precision.casts import register_input_casts

transformers = pytest.importorskip("transformers")

BF16 = torch.bfloat16
LAYERS = 2
IDS = torch.randint(0, 96, (2, 21), generator=torch.Generator().manual_seed(0))


def _projections(*dtypes):
    torch.manual_seed(0)
    mods = torch.nn.ModuleList(torch.nn.Linear(8, 4).to(d) for d in dtypes)
    register_input_casts(mods)
    return mods


def test_one_cast_of_the_dtype_each_hook_would_cast_to():
    mods = _projections(BF16, BF16, BF16)
    x = torch.randn(3, 8)
    h = shared_input_cast(mods, x)
    assert h.dtype == BF16 and torch.equal(h, x.to(BF16))
    assert torch.equal(mods[0](h), mods[0](x))  # the hook passes the shared cast through: the same output


@pytest.mark.parametrize("case", ["already_bf16", "integer", "mixed_dtypes", "other_hook", "no_hook"])
def test_left_as_is_where_the_hooks_would_not_cast_alike(case):
    x = torch.randn(3, 8)
    mods = _projections(BF16, BF16)
    if case == "already_bf16":
        x = x.to(BF16)
    elif case == "integer":
        x = torch.arange(8).reshape(1, 8)
    elif case == "mixed_dtypes":
        mods = _projections(BF16, torch.float16)
    elif case == "other_hook":
        mods[1].register_forward_pre_hook(lambda module, args: None)
    elif case == "no_hook":
        mods = torch.nn.ModuleList(torch.nn.Linear(8, 4).to(BF16) for _ in range(2))
    assert shared_input_cast(mods, x) is x


def _llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    return ipex_train.optimize(model, opt, dtype=BF16, bf16_compute="native")[0]


def _step(model, shared: bool):
    """Logits, the casts of (batch, seq, hidden) fp32 activations in the forward, and the parameters' grads."""
    def as_is(modules, x):
        return x

    model.zero_grad(set_to_none=True)
    with contextlib.ExitStack() as stack:
        if not shared:
            stack.enter_context(mock.patch.object(_rope, "shared_input_cast", as_is))
            stack.enter_context(mock.patch.object(_swiglu, "shared_input_cast", as_is))
        with torch.profiler.profile(record_shapes=True) as prof:
            logits = model(input_ids=IDS).logits
        logits.float().pow(2).mean().backward()
    casts = sum(e.count for e in prof.key_averages(group_by_input_shape=True)
                if e.key == "aten::_to_copy" and e.input_shapes and e.input_shapes[0] == [2, 21, 64])
    return logits, casts, {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


@native
def test_llama_casts_each_norm_output_once_with_the_same_forward():
    model = _llama()
    norm = model.model.layers[0].input_layernorm
    assert norm.weight.dtype == torch.float32  # why there is an fp32 activation to cast on a bf16 stream
    logits, casts, grads = _step(model, shared=True)
    ref_logits, ref_casts, ref_grads = _step(model, shared=False)
    # Per layer: q/k/v cast one norm output 3 times and gate/up the other twice, unshared; once each, shared.
    assert ref_casts == 5 * LAYERS + 1 and casts == 2 * LAYERS + 1  # + 1: the final norm's output into lm_head
    assert torch.equal(logits, ref_logits)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        ref = ref_grads[name]
        assert (g - ref).abs().max() <= 2 ** -6 * ref.abs().max() + 1e-6, name
