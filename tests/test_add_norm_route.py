"""The native compute policy's routing of Hugging Face post-norm output blocks (BertSelfOutput, BertOutput, ...) to
ipex_train.add_norm; the op's own numerics are in tests/test_add_norm.py.

Routed against unrouted: the same small BERT, trained 3 SGD steps under optimize(bf16, "native") from the same
weights and batch, dropout 0. The routed blocks compute dropout + add + LayerNorm in fp32 and round once; torch's
bf16 ops round the same values at each step, and in its mixed-dtype LayerNorm the statistics are fp32 too, so
losses agree within 1% per step (measured 1e-5) and every parameter after 3 steps within 5% of the larger of its
largest magnitude and 20x its largest change over the steps, plus 1e-6 (measured 3e-3: bf16 weights round a
slightly different update differently; the attention key biases, whose gradient is zero in exact arithmetic, hold
~1e-9 of rounding noise that differs by as much, which the 1e-6 covers).
"""
import copy

import pytest
import torch
from op_names import OpNames
from route_checks import (
    assert_trained_alike,
    detach_restores_and_attach_again,
    emulated_does_not_route,
    native,
    optimized,
    train,
)

import ipex_train.compute_policy as cp

transformers = pytest.importorskip("transformers")
from transformers.models.bert.modeling_bert import BertOutput, BertSelfOutput  # noqa: E402

BF16 = torch.bfloat16
OURS = "ipex_train.add_layer_norm_forward"
OURS_BACKWARD = "ipex_train.add_layer_norm_backward"
LAYERS = 2


def _config(dropout=0.0):
    return transformers.BertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                                   num_attention_heads=4, vocab_size=100, max_position_embeddings=64,
                                   hidden_dropout_prob=dropout, attention_probs_dropout_prob=0.0,
                                   attn_implementation="sdpa")


def _bert(dropout=0.0, head=False):
    torch.manual_seed(0)
    config = _config(dropout)
    model = transformers.BertForMaskedLM(config) if head else transformers.BertModel(config, add_pooling_layer=False)
    return model.train()


IDS = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(0))
TARGET = torch.randn(2, 24, 64, generator=torch.Generator().manual_seed(1))


def _loss(model):
    if isinstance(model, transformers.BertForMaskedLM):
        return model(input_ids=IDS, labels=IDS).loss
    return (model(input_ids=IDS).last_hidden_state.float() - TARGET).pow(2).mean()


def _train(model, opt, steps=3):
    return train(model, opt, _loss, steps)


def _blocks(model):
    return [m for m in model.modules() if isinstance(m, (BertSelfOutput, BertOutput))]


@native
@pytest.mark.parametrize("head", [False, True], ids=["BertModel-bf16-residual", "BertForMaskedLM-fp32-residual"])
def test_routed_trains_as_unrouted(head, monkeypatch):
    # BertModel's embeddings are bf16 under optimize, so the residual stream is bf16; BertForMaskedLM ties its word
    # embeddings to the fp32 decoder, so the residual stream is fp32 and meets bf16 dense outputs.
    base = _bert(head=head)
    start = copy.deepcopy(base.state_dict())
    model, opt = optimized(base)
    assert len(_blocks(model)) == 2 * LAYERS and all("forward" in vars(m) for m in _blocks(model))
    with OpNames() as ops:
        routed = _train(model, opt, steps=1)
    assert ops.names.count(OURS) == 2 * LAYERS and ops.names.count(OURS_BACKWARD) == 2 * LAYERS
    routed += _train(model, opt, steps=2)
    ref_base = _bert(head=head)
    ref_base.load_state_dict(start)
    monkeypatch.setattr(cp._add_norm, "routable", lambda module: False)
    ref_model, ref_opt = optimized(ref_base)
    assert not any("forward" in vars(m) for m in _blocks(ref_model))
    with OpNames() as ops:
        unrouted = _train(ref_model, ref_opt, steps=1)
    assert OURS not in ops.names
    unrouted += _train(ref_model, ref_opt, steps=2)
    assert_trained_alike(routed, unrouted, model, ref_model, start)


@native
def test_dropout_routed_model_trains():
    model, opt = optimized(_bert(dropout=0.1), lr=0.02)
    torch.manual_seed(0)
    with OpNames() as ops:
        losses = _train(model, opt, steps=1)
    assert ops.names.count(OURS) == 2 * LAYERS and ops.names.count(OURS_BACKWARD) == 2 * LAYERS
    losses += _train(model, opt, steps=7)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < 0.9 * losses[0]
    # Dropout is on: the same batch twice gives different outputs in training, the same in eval.
    with torch.no_grad():
        a, b = (model(input_ids=IDS).last_hidden_state for _ in range(2))
        assert not torch.equal(a, b)
        model.eval()
        a, b = (model(input_ids=IDS).last_hidden_state for _ in range(2))
        assert torch.equal(a, b)


def _block_and_inputs(dtype=BF16):
    torch.manual_seed(0)
    block = BertSelfOutput(_config(0.0)).train()
    h = torch.randn(2, 5, 64).to(dtype)
    res = torch.randn(2, 5, 64).to(dtype)
    return block, h, res


def _routed_call(block, h, res):
    handle = cp.attach(block, "native")
    try:
        with OpNames() as ops:
            out = block(h, res)
    finally:
        handle.remove()
    return out, OURS in ops.names


@native
def test_routed_block_matches_unrouted_block():
    block, h, res = _block_and_inputs()
    block.to(BF16).LayerNorm.float()  # optimize keeps norms fp32
    ref = block(h, res)
    out, fused = _routed_call(block, h, res)
    assert fused and out.dtype == ref.dtype == BF16
    assert (out.float() - ref.float()).abs().max().item() <= 2**-6 * ref.float().abs().max().item()


@native
@pytest.mark.parametrize("case", ["norm_hook", "dropout_hook", "global_hook", "autocast", "fp16", "p_one"])
def test_fallbacks_compute_as_the_class(case):
    block, h, res = _block_and_inputs(torch.float16 if case == "fp16" else torch.float32)
    if case == "fp16":  # dense runs, then the class's remaining ops (the kernel takes bf16 and fp32)
        block.half()
    ref_block = copy.deepcopy(block)
    handles = []
    if case == "norm_hook":
        handles = [m.LayerNorm.register_forward_hook(lambda mod, a, o: o * 2) for m in (block, ref_block)]
    elif case == "dropout_hook":
        handles = [m.dropout.register_forward_pre_hook(lambda mod, a: None) for m in (block, ref_block)]
    elif case == "global_hook":
        handles = [torch.nn.modules.module.register_module_forward_hook(lambda mod, a, o: None)]
    elif case == "p_one":
        block.dropout.p = ref_block.dropout.p = 1.0
    try:
        with torch.autocast("cpu", dtype=BF16, enabled=case == "autocast"):
            ref = ref_block(h, res)
            out, fused = _routed_call(block, h, res)
    finally:
        for handle in handles:
            handle.remove()
    assert not fused
    assert torch.equal(out, ref)


def test_routable_classes():
    config = _config()
    assert cp.routes_add_norm(BertSelfOutput(config)) and cp.routes_add_norm(BertOutput(config))
    from transformers.models.roberta.modeling_roberta import RobertaOutput, RobertaSelfOutput

    assert cp.routes_add_norm(RobertaSelfOutput(config)) and cp.routes_add_norm(RobertaOutput(config))
    # Same forward, but its own LayerNorm class: not routed.
    from transformers.models.deberta.modeling_deberta import DebertaSelfOutput

    assert not cp.routes_add_norm(DebertaSelfOutput(transformers.DebertaConfig(hidden_size=64)))
    # Submodules replaced: not routed.
    block = BertSelfOutput(config)
    block.dropout = torch.nn.Identity()
    assert not cp.routes_add_norm(block)
    block = BertSelfOutput(config)
    block.LayerNorm = torch.nn.RMSNorm(64)
    assert not cp.routes_add_norm(block)
    # A LayerNorm without bias is still routed (the op takes bias=None).
    block = BertSelfOutput(config)
    block.LayerNorm = torch.nn.LayerNorm(64, bias=False)
    assert cp.routes_add_norm(block)


@native
def test_detach_restores_and_attach_again():
    model, _ = optimized(_bert())
    detach_restores_and_attach_again(model, _blocks(model), cp.routes_add_norm, OURS,
                                     lambda m: m(input_ids=IDS).last_hidden_state)


def test_emulated_policy_does_not_route():
    emulated_does_not_route(_bert(), _blocks, lambda m, o: _train(m, o, steps=1), OURS)


@native
def test_routed_block_compiles_without_graph_break():
    block, h, res = _block_and_inputs()
    block.to(BF16).LayerNorm.float()
    handle = cp.attach(block, "native")
    try:
        torch._dynamo.reset()
        assert torch._dynamo.explain(block)(h, res).graph_break_count == 0
        out = torch.compile(block, fullgraph=True)(h, res)
        assert torch.equal(out, block(h, res))
    finally:
        handle.remove()


@native
def test_gradient_checkpointing_recomputes_the_same_dropout():
    # Checkpointing re-runs each layer in backward with torch's generator restored: the routed blocks draw the same
    # seeds, so the same masks, and the gradients equal those without checkpointing.
    def grads(checkpointing):
        model = _bert(dropout=0.2)
        if checkpointing:
            model.gradient_checkpointing_enable()
        model, _ = optimized(model)
        torch.manual_seed(5)
        with OpNames() as ops:
            _loss(model).backward()
        assert ops.names.count(OURS) == 2 * LAYERS * (2 if checkpointing else 1)
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain, checkpointed = grads(False), grads(True)
    assert plain.keys() == checkpointed.keys()
    for name, g in plain.items():
        torch.testing.assert_close(checkpointed[name], g, rtol=1e-3, atol=1e-6, msg=name)
