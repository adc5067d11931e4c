"""The native compute policy's routing of Hugging Face Llama-family attention layers' rotary embedding to
ipex_train.rope; the op's own numerics are in tests/test_rope.py.

Routed against unrouted: the same small Llama under optimize(bf16, "native"), 3 SGD steps from the same weights and
batch. The routed layers round the rotated query and key once where torch's bf16 ops round three times, so losses
agree within 1% per step (measured ~1e-4) and the gradients of the first step within 10% of each tensor's largest
magnitude plus 1e-3 (bf16 rounding carried through two layers).
"""
import copy
import pickle

import pytest
import torch
from op_names import OpNames
from route_checks import native

import ipex_train
import ipex_train.compute_policy as cp
from ipex_train.compute_policy import _rope

transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import LlamaAttention  # noqa: E402

BF16 = torch.bfloat16
OURS = "ipex_train.rope_forward"
LAYERS = 2


def _llama(**overrides):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, attn_implementation="sdpa", **overrides)
    return transformers.LlamaForCausalLM(config).train()


def _optimized(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return ipex_train.optimize(model, opt, dtype=BF16, bf16_compute="native")


IDS = torch.randint(0, 96, (2, 21), generator=torch.Generator().manual_seed(0))


def _train(model, opt, steps=3):
    losses, first = [], None
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=IDS, labels=IDS).loss
        loss.backward()
        if first is None:
            first = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        losses.append(loss.item())
    return losses, first


def test_llama_attention_is_the_checked_code():
    # Fails when the installed transformers changed LlamaAttention.forward or its rotary helpers: then the route
    # stands aside (correct, but slower) until the new code is checked and _CHECKED updated.
    assert _rope.routable(LlamaAttention(_llama().config, 0))


@native
def test_routed_training_matches_unrouted():
    routed, opt = _optimized(_llama())
    layers = [m for m in routed.modules() if isinstance(m, LlamaAttention)]
    assert len(layers) == LAYERS and all("forward" in vars(m) for m in layers)
    with OpNames() as ops:
        losses, grads = _train(routed, opt, steps=1)
    assert ops.names.count(OURS) == LAYERS and ops.names.count("ipex_train.rope_backward") == LAYERS
    more, _ = _train(routed, opt, steps=2)
    losses += more

    plain, plain_opt = _optimized(_llama())
    cp.attached(plain).remove()
    orig = _rope.routable
    _rope.routable = lambda module: False
    try:
        handle = cp.attach(plain, "native")
    finally:
        _rope.routable = orig
    assert not any("forward" in vars(m) for m in plain.modules() if isinstance(m, LlamaAttention))
    with OpNames() as ops:
        ref_losses, ref_grads = _train(plain, plain_opt)
    assert OURS not in ops.names
    handle.remove()
    for got, ref in zip(losses, ref_losses):
        assert abs(got - ref) <= 1e-2 * abs(ref)
    for name, g in grads.items():
        r = ref_grads[name]
        assert (g - r).abs().max() <= 0.1 * r.abs().max() + 1e-3, name


@native
def test_generation_with_a_cache_matches_unrouted():
    model, _ = _optimized(_llama())
    model.eval()
    prompt = IDS[:1, :6]
    with torch.no_grad(), OpNames() as ops:
        routed = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert ops.names.count(OURS) >= LAYERS * 2  # prompt and every new token went through the kernel
    cp.attached(model).remove()
    with torch.no_grad():
        plain = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(routed, plain)


@native
@pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")
def test_calls_the_kernel_cannot_take_run_the_class():
    model, _ = _optimized(_llama())
    layer = next(m for m in model.modules() if isinstance(m, LlamaAttention))
    x = torch.randn(1, 5, 64).to(BF16)
    pe = model.model.rotary_emb(x, torch.arange(5)[None])
    with OpNames() as ops:
        out, _ = layer(x, position_embeddings=pe, attention_mask=None)
    assert OURS in ops.names
    with OpNames() as ops, torch.autocast("cpu", dtype=BF16):
        ref, _ = layer(x.float(), position_embeddings=model.model.rotary_emb(x.float(), torch.arange(5)[None]),
                       attention_mask=None)
    assert OURS not in ops.names
    with OpNames() as ops:  # the cache under its deprecated name: the class's own forward renames it
        layer(x, position_embeddings=pe, attention_mask=None, past_key_values=None)
    assert OURS not in ops.names
    fp32_tables = tuple(t.float() for t in pe)  # tables of another dtype: the class's own rotary ops
    with OpNames() as ops:
        mixed, _ = layer(x, position_embeddings=fp32_tables, attention_mask=None)
    assert OURS not in ops.names and mixed.shape == out.shape


def test_other_code_is_not_routed(monkeypatch):
    config = _llama().config
    layer = LlamaAttention(config, 0)
    assert cp.routes_rope(layer)

    class Custom(LlamaAttention):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    assert not cp.routes_rope(Custom(config, 0))  # another class (and another forward)
    monkeypatch.setattr(_rope, "_CHECKED", ("0" * 16,) * 3)
    _rope._checked.cache_clear()
    try:
        assert not cp.routes_rope(LlamaAttention(config, 0))  # other code than the one checked
    finally:
        monkeypatch.undo()
        _rope._checked.cache_clear()
    layer.forward = layer.forward  # an instance-level forward of someone else's
    assert not cp.routes_rope(layer)


@native
def test_detach_restores_and_pickled_copy_runs():
    model, _ = _optimized(_llama())
    layers = [m for m in model.modules() if isinstance(m, LlamaAttention)]
    copy_ = pickle.loads(pickle.dumps(model))
    assert torch.isfinite(copy_(input_ids=IDS[:1, :4]).logits.float()).all()
    deep = copy.deepcopy(model)
    assert torch.isfinite(deep(input_ids=IDS[:1, :4]).logits.float()).all()
    cp.attached(model).remove()
    assert all("forward" not in vars(m) and cp.routes_rope(m) for m in layers)


@native
def test_routed_model_compiles():
    model, _ = _optimized(_llama())
    eager = model(input_ids=IDS, labels=IDS).loss
    torch._dynamo.reset()
    with OpNames() as ops:
        loss = torch.compile(model)(input_ids=IDS, labels=IDS).loss
    loss.backward()
    assert "ipex_train.rope_forward" in ops.names
    assert abs(loss.item() - eager.item()) <= 1e-3 * abs(eager.item())
    layer = next(m for m in model.modules() if isinstance(m, LlamaAttention))
    assert layer.q_proj.weight.grad is not None
