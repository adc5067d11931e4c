"""ipex_train.lora (one autograd node for a LoRA linear) against an fp32 reference and peft; its routing of peft's
``lora.Linear`` by the native compute policy, and every call the route must leave to peft.

Tolerances, bf16 tensors, against the formula in fp32 autograd on the same bf16 values, relative to the reference's
largest magnitude: the output within 2**-7 (the base product is rounded to bf16 once and the sum once more; peft
rounds after lora_B, after ``* scaling`` and after ``+``); grad_x within 2**-7 (the same two roundings);
grad_weight, grad_bias, grad_lora_a, grad_lora_b within 2**-7 (one bf16 rounding of an fp32-accumulated matmul, plus
one of the (tokens x r) ``grad_h * scaling`` for grad_lora_a and of the product for grad_lora_b). Measured 2**-8 at
worst. peft's own bf16 ops are held to the same reference within 2**-6 (they round more; measured 2**-7.3), and the
routed layer against peft's unrouted one within 2**-6. fp32 tensors: within 2e-6 of a float64 reference (a few fp32
ulps of the matmuls' sums; measured ~3e-7).
"""
import io
import pickle

import pytest
import torch

import ipex_train
import ipex_train.compute_policy as cp
import ipex_train.lora as fused
from ipex_train.lora import lora_linear

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

BF16 = torch.bfloat16


def _tensors(dtype, bias=True, shape=(3, 40, 48), out=56, r=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    w = torch.randn(out, shape[-1], generator=g) / shape[-1] ** 0.5
    b = torch.randn(out, generator=g) if bias else None
    a = torch.randn(r, shape[-1], generator=g) / shape[-1] ** 0.5
    bb = torch.randn(out, r, generator=g) / r ** 0.5
    gy = torch.randn(*shape[:-1], out, generator=g)
    return [t if t is None else t.to(dtype) for t in (x, w, b, a, bb, gy)]


def _run(fn, x, w, b, a, bb, gy, scaling, dtype=None):
    leaves = [t if t is None else t.detach().to(dtype or t.dtype).requires_grad_() for t in (x, w, b, a, bb)]
    y = fn(*leaves, scaling)
    y.backward(gy.to(y.dtype))
    return [y.detach()] + [t if t is None else t.grad for t in leaves]


def _formula(x, w, b, a, bb, scaling):
    y = x @ w.t() + (0 if b is None else b)
    return y + (x @ a.t()) @ bb.t() * scaling


def _rel(got, ref):
    return ((got.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


@pytest.mark.parametrize("shape", [(3, 40, 48), (7, 48), (48,), (1, 1, 48)])
@pytest.mark.parametrize("bias", [True, False])
def test_bf16_against_fp32_reference_and_peft_formula(shape, bias):
    x, w, b, a, bb, gy = _tensors(BF16, bias, shape)
    got = _run(lora_linear, x, w, b, a, bb, gy, 2.0)
    ref = _run(_formula, x, w, b, a, bb, gy, 2.0, dtype=torch.float32)
    unfused = _run(_formula, x, w, b, a, bb, gy, 2.0)  # peft's ops in bf16
    names = ["y", "grad_x", "grad_weight", "grad_bias", "grad_lora_a", "grad_lora_b"]
    for name, g, r, u in zip(names, got, ref, unfused):
        if r is None:
            assert g is None
            continue
        assert g.dtype == BF16 and g.shape == r.shape, name
        assert _rel(g, r) <= 2 ** -7, name
        assert _rel(u, r) <= 2 ** -6, name


def test_fp32_against_float64():
    x, w, b, a, bb, gy = _tensors(torch.float32)
    got = _run(lora_linear, x, w, b, a, bb, gy, 0.5)
    ref = _run(_formula, x, w, b, a, bb, gy, 0.5, dtype=torch.float64)
    for g, r in zip(got, ref):
        assert g.dtype == torch.float32 and _rel(g, r) <= 2e-6


def test_only_requested_grads_and_no_grad():
    x, w, b, a, bb, gy = _tensors(BF16)
    a = a.requires_grad_()
    y = lora_linear(x, w, b, a, bb, 2.0)
    y.backward(gy)
    assert a.grad is not None and a.grad.shape == a.shape
    with torch.no_grad():
        assert torch.equal(lora_linear(x, w, b, a, bb, 2.0), y.detach())
    with torch.inference_mode():
        assert torch.equal(lora_linear(x, w, b, a, bb, 2.0), y.detach())


def test_validation():
    x, w, b, a, bb, _ = _tensors(BF16)
    with pytest.raises(ValueError, match="one dtype"):
        lora_linear(x.float(), w, b, a, bb, 2.0)
    with pytest.raises(ValueError, match="lora_b"):
        lora_linear(x, w, b, a, bb.t(), 2.0)
    with pytest.raises(TypeError, match="scaling"):
        lora_linear(x, w, b, a, bb, True)
    assert fused.supports(x, w, None, a, bb) and not fused.supports(x.half(), w.half(), None, a.half(), bb.half())


# --------------------------------------------------------------------------- routing of peft's lora.Linear


@pytest.fixture
def calls(monkeypatch):
    """How many times the fused Function ran."""
    count = [0]
    apply = fused._LoraLinear.apply

    def counting(*args):
        count[0] += 1
        return apply(*args)

    monkeypatch.setattr(fused._LoraLinear, "apply", counting)
    return count


def _peft_mlp(dtype=BF16, seed=0, **config):
    torch.manual_seed(seed)
    base = torch.nn.Sequential(torch.nn.Linear(48, 56), torch.nn.ReLU(), torch.nn.Linear(56, 40, bias=False))
    config = {"r": 8, "lora_alpha": 16, "target_modules": ["0", "2"], "init_lora_weights": False, **config}
    model = peft.get_peft_model(base, peft.LoraConfig(**config)).to(dtype)
    return model


def _lora_layers(model):
    return [m for m in model.modules() if isinstance(m, peft.tuners.lora.Linear)]


def _x(dtype=BF16, shape=(4, 48)):
    return torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)


def test_routed_layer_against_fp32_and_peft(calls):
    model = _peft_mlp()
    layer = _lora_layers(model)[0]
    handle = cp.attach(model, "native")
    assert all("forward" in vars(m) for m in _lora_layers(model)) and not cp.routes_lora(layer)
    x, gy = _x(shape=(2, 9, 48)).requires_grad_(), _x(shape=(2, 9, 56))
    w, bias = layer.base_layer.weight, layer.base_layer.bias
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    got = _run(lambda x_, *_: layer(x_), x, w, bias, a, b, gy, None)
    assert calls[0] == 1
    ref = _run(_formula, x, w, bias, a, b, gy, layer.scaling["default"], dtype=torch.float32)
    assert _rel(got[0], ref[0]) <= 2 ** -7 and _rel(got[1], ref[1]) <= 2 ** -7
    grads = {n: p.grad for n, p in layer.named_parameters() if p.grad is not None}
    ref_grads = {"base_layer.weight": ref[2], "base_layer.bias": ref[3], "lora_A.default.weight": ref[4],
                 "lora_B.default.weight": ref[5]}
    assert grads.keys() == {"lora_A.default.weight", "lora_B.default.weight"}  # peft froze the base
    for n, g in grads.items():
        assert g.dtype == BF16 and _rel(g, ref_grads[n]) <= 2 ** -7, n
    # peft's own forward on the same module (route removed): the same within bf16 rounding.
    handle.remove()
    assert all("forward" not in vars(m) and cp.routes_lora(m) for m in _lora_layers(model))
    layer.zero_grad(set_to_none=True)
    unfused = _run(lambda x_, *_: layer(x_), x, w, bias, a, b, gy, None)
    assert calls[0] == 1
    assert _rel(got[0], unfused[0]) <= 2 ** -6 and _rel(got[1], unfused[1]) <= 2 ** -6
    for n, p in layer.named_parameters():
        if p.grad is not None:
            assert _rel(grads[n], p.grad) <= 2 ** -6, n


def _fallback_cases():
    def adapter_names(model, layer):
        return {"adapter_names": ["default"] * 4}

    def disabled(model, layer):
        layer.enable_adapters(False)

    def merged(model, layer):
        layer.merge()

    def two_adapters(model, layer):
        model.add_adapter("other", peft.LoraConfig(r=4, target_modules=["0", "2"], init_lora_weights=False))
        model.to(BF16)
        layer.set_adapter(["default", "other"])

    def absent_adapter(model, layer):
        layer._active_adapter = ["missing"]

    def dropout_training(model, layer):
        layer.lora_dropout["default"] = torch.nn.Dropout(0.5)

    def fan_in_fan_out(model, layer):
        layer.fan_in_fan_out = True

    def adapter_dtype(model, layer):
        layer.lora_A.float()
        layer.lora_B.float()

    def base_hook(model, layer):
        layer.base_layer.register_forward_hook(lambda mod, args, out: out * 2)

    def adapter_pre_hook(model, layer):
        layer.lora_A["default"].register_forward_pre_hook(lambda mod, args: (args[0] * 0,))

    return {f.__name__: f for f in (adapter_names, disabled, merged, two_adapters, absent_adapter, dropout_training,
                                    fan_in_fan_out, adapter_dtype, base_hook, adapter_pre_hook)}


FALLBACKS = _fallback_cases()


@pytest.mark.parametrize("case", sorted(FALLBACKS))
def test_fallbacks_run_peft_forward(case, calls):
    model = _peft_mlp().train()
    layer = _lora_layers(model)[0]
    cp.attach(model, "native")
    kwargs = FALLBACKS[case](model, layer) or {}
    x = _x()
    torch.manual_seed(3)
    got = layer(x, **kwargs)
    torch.manual_seed(3)
    ref = type(layer).forward(layer, x, **kwargs)
    assert calls[0] == 0
    assert torch.equal(got, ref)


@pytest.mark.parametrize("config", [{"use_dora": True}, {"lora_bias": True}])
def test_variant_and_adapter_bias_fall_back(config, calls):
    model = _peft_mlp(**config)
    cp.attach(model, "native")
    x = _x()
    out = model(x)
    assert calls[0] == 0
    cp.attached(model).remove()
    assert torch.equal(out, model(x))


@pytest.mark.parametrize("context", ["autocast", "emulated", "global_hook"])
def test_contexts_fall_back(context, calls):
    model = _peft_mlp()
    cp.attach(model, "native")
    x = _x()
    if context == "autocast":
        scope = torch.autocast("cpu", dtype=BF16)
    elif context == "emulated":
        scope = cp.emulated_bf16()
    else:
        scope = torch.nn.modules.module.register_module_forward_hook(lambda mod, args, out: None)
    with scope:
        model(x)
    if context == "global_hook":
        scope.remove()
    assert calls[0] == 0
    model(x)
    assert calls[0] == 2


def test_eval_dropout_fp32_and_extra_args_routing(calls):
    model = _peft_mlp(lora_dropout=0.5).eval()
    cp.attach(model, "native")
    model(_x())
    assert calls[0] == 2  # dropout in eval mode is the identity
    fp32 = _peft_mlp(torch.float32)
    cp.attach(fp32, "native")
    fp32(_x(torch.float32))
    assert calls[0] == 4
    emulated = _peft_mlp()
    cp.attach(emulated, "emulated")
    assert all("forward" not in vars(m) for m in _lora_layers(emulated))


def test_pickle_save_and_state_dict_keys():
    model = _peft_mlp()
    keys = list(model.state_dict())
    handle = cp.attach(model, "native")
    assert list(model.state_dict()) == keys
    x = _x()
    copy = pickle.loads(pickle.dumps(model))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    handle.remove()
    assert all("forward" not in vars(m) for m in _lora_layers(model))
    # As for RMSNorm: pickle stores the instance's forward as getattr(module, "forward"), which on loading finds the
    # class's, so a copy runs peft's own forward (exactly).
    out = model(x)
    assert torch.equal(copy(x), out) and torch.equal(loaded(x), out)


# --------------------------------------------------------------------------- optimize(bf16) on a peft Llama


def _llama_lora(checkpointing):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=50,
                                      attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config).to(BF16)
    if checkpointing:
        model.activation_checkpointing_enable()  # transformers' name for gradient_checkpointing_enable()
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets)).train()


def _train(routed, checkpointing, step_in_backward, steps=6):
    model = _llama_lora(checkpointing)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, optimizer = ipex_train.optimize(model, optimizer, dtype=BF16, bf16_compute="native",
                                           step_in_backward=step_in_backward or None)
    layers = _lora_layers(model)
    assert len(layers) == 14 and all("forward" in vars(m) for m in layers)
    if not routed:
        for m in layers:
            del m.forward
    ids = torch.randint(0, 50, (2, 24), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()  # under step_in_backward the step ran in backward; this closes it
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("checkpointing, step_in_backward", [(False, False), (True, False), (False, True)])
def test_optimized_llama_trains_like_peft(checkpointing, step_in_backward, calls):
    losses = _train(True, checkpointing, step_in_backward)
    # 14 layers per forward, again in each recomputation under checkpointing.
    assert calls[0] == 6 * 14 * (2 if checkpointing else 1)
    reference = _train(False, checkpointing, step_in_backward)
    assert calls[0] == 6 * 14 * (2 if checkpointing else 1)
    assert losses[-1] < losses[0] - 0.05
    for got, ref in zip(losses, reference):
        assert abs(got - ref) <= 2e-2 * abs(ref)


def test_routed_layers_compile_without_graph_break(calls):
    model = _peft_mlp()
    cp.attach(model, "native")
    x = _x()
    ref = model(x)
    torch._dynamo.reset()
    assert torch._dynamo.explain(model)(x).graph_break_count == 0
    out = torch.compile(model, backend="aot_eager")(x)  # traces the Function forward and backward; no codegen
    assert torch.equal(out, ref)
    out.float().sum().backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_" in n)


def test_tensor_subclass_falls_back(calls):
    class Tagged(torch.Tensor):
        pass

    model = _peft_mlp()
    cp.attach(model, "native")
    x = _x().as_subclass(Tagged)
    out = model(x)
    assert calls[0] == 0 and not fused.supports(x, *[torch.ones(1)] * 4)
    cp.attached(model).remove()
    assert torch.equal(out, model(x))
