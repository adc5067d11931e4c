"""The native compute policy's routing of Hugging Face BERT-style intermediate blocks (BertIntermediate and every
class with its very forward) and ViT-style MLPs (ViTMLP and kin) to ipex_train.bias_gelu.gelu_with_bias_grad (torch's
GEMM with its bias and torch's GELU forward, the kernel's one-pass backward); the op's own numerics are in
tests/test_bias_gelu.py.

Routed against unrouted: the same small BERT (and ViT), trained 3 SGD steps under optimize(bf16, "native") from the same
weights and batch, dropout 0. The forwards are the same ops; the backward's GELU derivative is the kernel's (fp32
inside, rounded once; torch's bf16 gelu_backward has its own erf) and the bias gradient an fp32 sum of unrounded values
(torch sums the bf16 gradient). Losses agree within 1% per step and every parameter after 3 steps within 5% of the
larger of its largest magnitude and 20x its largest change, plus 1e-6 (as the other routes' tests: bf16 weights round
a slightly different update differently).
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
from transformers.models.bert.modeling_bert import BertIntermediate  # noqa: E402
from transformers.models.vit.modeling_vit import ViTMLP  # noqa: E402

BF16 = torch.bfloat16
OURS = "ipex_train.gelu_with_bias_grad"
OURS_BACKWARD = "ipex_train.bias_gelu_backward"
LAYERS = 2


def _config(act="gelu"):
    return transformers.BertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                                   num_attention_heads=4, vocab_size=100, max_position_embeddings=64,
                                   hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, hidden_act=act,
                                   attn_implementation="sdpa")


def _bert(head=False):
    torch.manual_seed(0)
    config = _config()
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
    return [m for m in model.modules() if isinstance(m, BertIntermediate)]


@native
@pytest.mark.parametrize("head", [False, True], ids=["BertModel-bf16-input", "BertForMaskedLM-fp32-input"])
def test_routed_trains_as_unrouted(head, monkeypatch):
    # BertForMaskedLM's residual stream is fp32 (tied fp32 embeddings, see test_add_norm_route.py): its intermediate
    # blocks take fp32 input, which optimize()'s pre-hook on dense casts to bf16 and the routed forward likewise.
    base = _bert(head=head)
    start = copy.deepcopy(base.state_dict())
    model, opt = optimized(base)
    assert len(_blocks(model)) == LAYERS and all("forward" in vars(m) for m in _blocks(model))
    with OpNames() as ops:
        routed = _train(model, opt, steps=1)
    assert ops.names.count(OURS) == LAYERS and ops.names.count(OURS_BACKWARD) == LAYERS
    gelus = 1 if head else 0  # the masked-LM head's transform: not an intermediate block
    assert ops.names.count("aten.gelu") == gelus and ops.names.count("aten.gelu_backward") == gelus
    routed += _train(model, opt, steps=2)
    ref_base = _bert(head=head)
    ref_base.load_state_dict(start)
    monkeypatch.setattr(cp._bias_gelu, "routable", lambda module: False)
    ref_model, ref_opt = optimized(ref_base)
    assert not any("forward" in vars(m) for m in _blocks(ref_model))
    with OpNames() as ops:
        unrouted = _train(ref_model, ref_opt, steps=1)
    assert OURS not in ops.names and "aten.gelu" in ops.names
    unrouted += _train(ref_model, ref_opt, steps=2)
    assert_trained_alike(routed, unrouted, model, ref_model, start)


def _vit_config():
    return transformers.ViTConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                                  num_attention_heads=4, image_size=32, patch_size=8, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, attn_implementation="sdpa")


PIXELS = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
VIT_TARGET = torch.randn(2, 17, 64, generator=torch.Generator().manual_seed(3))


def _vit_train(model, opt, steps):
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = (model(pixel_values=PIXELS).last_hidden_state.float() - VIT_TARGET).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@native
def test_routed_vit_trains_as_unrouted(monkeypatch):
    # ViT's MLPs take the fp32 output of its (fp32) layernorm_after: fc1's input cast applies, then fc2 as a module.
    torch.manual_seed(0)
    base = transformers.ViTModel(_vit_config(), add_pooling_layer=False).train()
    start = copy.deepcopy(base.state_dict())
    model, opt = optimized(base)
    mlps = [m for m in model.modules() if isinstance(m, ViTMLP)]
    assert len(mlps) == LAYERS and cp.routed_modules(model).get("bias_gelu") == LAYERS
    with OpNames() as ops:
        routed = _vit_train(model, opt, 1)
    assert ops.names.count(OURS) == LAYERS and ops.names.count(OURS_BACKWARD) == LAYERS
    assert "aten.gelu" not in ops.names
    routed += _vit_train(model, opt, 2)
    torch.manual_seed(0)
    ref_base = transformers.ViTModel(_vit_config(), add_pooling_layer=False).train()
    ref_base.load_state_dict(start)
    monkeypatch.setattr(cp._bias_gelu, "routable", lambda module: False)
    ref_model, ref_opt = optimized(ref_base)
    unrouted = _vit_train(ref_model, ref_opt, 3)
    assert_trained_alike(routed, unrouted, model, ref_model, start)


@native
def test_routed_modules_counts_the_route():
    model, _ = optimized(_bert())
    assert cp.routed_modules(model) == {"add_norm": 2 * LAYERS, "bias_gelu": LAYERS}  # no layer is 512 wide


def _block_and_input(dtype=BF16, act="gelu"):
    torch.manual_seed(0)
    block = BertIntermediate(_config(act)).train().to(dtype)
    return block, (torch.randn(2, 5, 64) * 2).to(dtype).requires_grad_()


def _routed_call(block, x):
    handle = cp.attach(block, "native")
    try:
        with OpNames() as ops:
            out = block(x)
    finally:
        handle.remove()
    return out, OURS in ops.names


@native
@pytest.mark.parametrize("dtype", [BF16, torch.float32], ids=str)
def test_routed_block_matches_unrouted_block(dtype):
    block, x = _block_and_input(dtype)
    ref = block(x)
    g = torch.randn_like(ref)
    ref.backward(g)
    ref_grads = [t.grad.clone() for t in (x, block.dense.weight, block.dense.bias)]
    for t in (x, block.dense.weight, block.dense.bias):
        t.grad = None
    out, fused = _routed_call(block, x)
    out.backward(g)
    # The forward is the class's (the bias in the GEMM, torch's GELU); the backward's GELU derivative is the kernel's
    # (fp32 inside, rounded once), the bias gradient its fp32 sum rounded once.
    assert fused and out.dtype == ref.dtype == dtype and torch.equal(out, ref)
    tol = 2**-7 if dtype == BF16 else 1e-5
    for ours, theirs in zip((x.grad, block.dense.weight.grad, block.dense.bias.grad), ref_grads):
        assert (ours.float() - theirs.float()).abs().max().item() <= tol * theirs.float().abs().max().item()


@native
@pytest.mark.parametrize("case", ["dense_hook", "act_hook", "dense_pre_hook", "global_hook", "autocast", "fp16",
                                  "act_replaced"])
def test_fallbacks_compute_as_the_class(case):
    block, x = _block_and_input(torch.float16 if case == "fp16" else torch.float32)
    ref_block = copy.deepcopy(block)
    handles = []
    if case == "dense_hook":
        handles = [m.dense.register_forward_hook(lambda mod, a, o: o * 2) for m in (block, ref_block)]
    elif case == "dense_pre_hook":
        handles = [m.dense.register_forward_pre_hook(lambda mod, a: (a[0] * 2,)) for m in (block, ref_block)]
    elif case == "act_hook":
        handles = [m.intermediate_act_fn.register_forward_hook(lambda mod, a, o: o + 1) for m in (block, ref_block)]
    elif case == "global_hook":
        handles = [torch.nn.modules.module.register_module_forward_hook(lambda mod, a, o: None)]
    try:
        with torch.autocast("cpu", dtype=BF16, enabled=case == "autocast"):
            ref = ref_block(x)
            handle = cp.attach(block, "native")
            if case == "act_replaced":  # after routing: the activation is no longer an exact GELU
                block.intermediate_act_fn = ref_block.intermediate_act_fn = torch.nn.GELU(approximate="tanh")
                ref = ref_block(x)
            try:
                with OpNames() as ops:
                    out = block(x)
            finally:
                handle.remove()
    finally:
        for h in handles:
            h.remove()
    assert OURS not in ops.names
    assert torch.equal(out, ref)


def test_routable_classes(monkeypatch):
    config = _config()
    assert cp.routes_bias_gelu(BertIntermediate(config))
    from transformers.models.electra.modeling_electra import ElectraIntermediate
    from transformers.models.roberta.modeling_roberta import RobertaIntermediate

    assert cp.routes_bias_gelu(RobertaIntermediate(config)) and cp.routes_bias_gelu(ElectraIntermediate(config))
    # GELU's tanh approximation and the Python erf form are not taken; neither is another activation.
    for act in ("gelu_new", "gelu_pytorch_tanh", "gelu_python", "relu", "silu"):
        assert not cp.routes_bias_gelu(BertIntermediate(_config(act))), act
    block = BertIntermediate(config)
    block.intermediate_act_fn = torch.nn.GELU()
    assert cp.routes_bias_gelu(block)
    block.intermediate_act_fn = torch.nn.GELU(approximate="tanh")
    assert not cp.routes_bias_gelu(block)
    # A dense layer without a bias, or not a plain nn.Linear: not routed.
    block = BertIntermediate(config)
    block.dense = torch.nn.Linear(64, 128, bias=False)
    assert not cp.routes_bias_gelu(block)
    block.dense = torch.nn.Identity()
    assert not cp.routes_bias_gelu(block)
    # ViT-style MLPs (fc1, activation_fn, fc2): routed over an exact GELU; CLIP's quick_gelu, SigLIP's tanh GELU not.
    assert cp.routes_bias_gelu(ViTMLP(_vit_config()))
    from transformers.models.clip.modeling_clip import CLIPMLP
    from transformers.models.siglip.modeling_siglip import SiglipMLP

    small = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4)
    assert not cp.routes_bias_gelu(CLIPMLP(transformers.CLIPVisionConfig(**small)))
    assert not cp.routes_bias_gelu(SiglipMLP(transformers.SiglipVisionConfig(**small)))
    # A transformers release whose forwards are other code: not routed.
    monkeypatch.setattr(cp._bias_gelu, "_SHAPES", {})
    cp._bias_gelu._KNOWN.clear()
    try:
        assert not cp.routes_bias_gelu(BertIntermediate(config)) and not cp.routes_bias_gelu(ViTMLP(_vit_config()))
    finally:
        monkeypatch.undo()
        cp._bias_gelu._KNOWN.clear()


def test_checked_digests_are_the_installed_forwards():
    # The digests pin transformers 5.24's code; this fails (and the route stands aside) when the installed one differs.
    from ipex_train.compute_policy._source import digest

    assert cp._bias_gelu._SHAPES[digest(BertIntermediate.forward)] == ("dense", "intermediate_act_fn", None)
    assert cp._bias_gelu._SHAPES[digest(ViTMLP.forward)] == ("fc1", "activation_fn", "fc2")


@native
def test_detach_restores_and_attach_again():
    model, _ = optimized(_bert())
    detach_restores_and_attach_again(model, _blocks(model), cp.routes_bias_gelu, OURS,
                                     lambda m: m(input_ids=IDS).last_hidden_state)


def test_emulated_policy_does_not_route():
    emulated_does_not_route(_bert(), _blocks, lambda m, o: _train(m, o, steps=1), OURS)


@native
def test_routed_block_compiles_without_graph_break():
    block, x = _block_and_input()
    x = x.detach()
    handle = cp.attach(block, "native")
    try:
        torch._dynamo.reset()
        assert torch._dynamo.explain(block)(x).graph_break_count == 0
        out = torch.compile(block, fullgraph=True)(x)
        assert torch.equal(out, block(x))
    finally:
        handle.remove()
