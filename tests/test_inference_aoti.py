"""AOTInductor export (ipex_train.inference.export(backend="aoti")) and the pt2e int8 lowering
(ipex_train.quantization.convert(backend="pt2e")): packages load in a fresh process with plain torch, at several
shapes. Each package compiles C++ (10-40 s here), so the models are tiny and the compiling tests few."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from aoti_helpers import call_fresh
from int8_helpers import calibrated
from torch import nn

from ipex_train import inference, quantization

# Loads the package with torch alone, runs it on each saved input, saves the outputs.
_LOAD = textwrap.dedent("""
    import sys, torch
    package = torch._inductor.aoti_load_package(sys.argv[1])
    inputs = torch.load(sys.argv[2])
    with torch.no_grad():
        outs = [package(*args) for args in inputs]
    assert "ipex_train" not in sys.modules
    torch.save(outs, sys.argv[3])
""")


def _run_fresh(package, inputs, tmp_path):
    """Outputs of ``package`` on each tuple in ``inputs``, computed in a fresh interpreter without ipex_train."""
    torch.save(inputs, tmp_path / "inputs.pt")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, "-c", _LOAD, str(package), str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt")],
                   check=True, cwd=tmp_path, env=env, timeout=300)
    return torch.load(tmp_path / "out.pt")


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.relu = nn.ReLU()
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.conv2(y) + y)  # residual add, the relu module reused (the strict-export trap)
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(y, 1), 1))


class TinyEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)

    def forward(self, ids):
        return self.layer(self.embed(ids))


def _cnn():
    torch.manual_seed(0)
    model = SmallCNN().eval()
    with torch.no_grad():
        model.bn1.running_mean.uniform_(-0.5, 0.5)
        model.bn1.running_var.uniform_(0.5, 1.5)
    return model


def _cos(a, b):
    return torch.nn.functional.cosine_similarity(a.flatten().float(), b.flatten().float(), dim=0).item()


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)], ids=["fp32", "bf16"])
def test_cnn_package_loads_fresh_at_several_batch_sizes(dtype, tol, tmp_path):
    model = _cnn()
    path = inference.export(model, torch.randn(2, 3, 12, 12), backend="aoti", path=tmp_path / "cnn.pt2",
                            config=inference.AOTIConfig(dtype=dtype, dynamic_dims=(0,)))
    assert model.conv1.weight.dtype == torch.float32  # the model itself is untouched
    inputs = [(torch.randn(b, 3, 12, 12),) for b in (1, 3, 7)]
    outs = _run_fresh(path, inputs, tmp_path)
    for (x,), out in zip(inputs, outs):
        assert out.dtype == dtype and out.shape == (x.shape[0], 5)
        with torch.no_grad():
            torch.testing.assert_close(out.float(), model(x), atol=tol, rtol=tol)


def test_encoder_package_with_dynamic_batch_and_sequence(tmp_path, caplog):
    torch.manual_seed(0)
    model = TinyEncoder().eval()
    config = inference.AOTIConfig(dynamic_dims=(0, 1))
    with caplog.at_level("INFO", logger="ipex_train"):
        path = inference.export(model, torch.randint(0, 50, (2, 8)), backend="aoti", path=tmp_path / "enc.pt2",
                                config=config)
    assert "dynamic input dims input0[0], input0[1]" in caplog.text
    inputs = [(torch.randint(0, 50, shape),) for shape in ((1, 5), (3, 8), (4, 17))]
    for (ids,), out in zip(inputs, _run_fresh(path, inputs, tmp_path)):
        with torch.no_grad():
            torch.testing.assert_close(out, model(ids), atol=1e-4, rtol=1e-4)


def test_int8_package_loads_fresh_and_tracks_fp32(tmp_path):
    model, x = _cnn(), torch.randn(2, 3, 12, 12)
    graph = quantization.convert(calibrated(model, x), backend="pt2e", example_inputs=x, dynamic_dims=(0,))
    assert isinstance(graph, torch.fx.GraphModule)
    path = inference.export(graph, x, backend="aoti", path=tmp_path / "int8.pt2",
                            config=inference.AOTIConfig(dynamic_dims=(0,)))
    inputs = [(torch.randn(b, 3, 12, 12),) for b in (1, 4)]
    for (xi,), out in zip(inputs, _run_fresh(path, inputs, tmp_path)):
        with torch.no_grad():
            ref = model(xi)
            assert _cos(out, ref) > 0.999
            torch.testing.assert_close(out, graph(xi), atol=0.05, rtol=0.05)  # the package is the lowered graph


def test_int8_conv_graph_defaults_to_static_shapes(tmp_path, caplog):
    """A model with convolutions (here an int8 graph) compiles for the example's batch by default (Inductor
    pre-packs convolution weights only for a static input shape); without convolutions the batch stays dynamic."""
    model, x = _cnn(), torch.randn(2, 3, 12, 12)
    prepared = calibrated(model, x)
    graph = quantization.convert(prepared, backend="pt2e", example_inputs=x)
    (placeholder,) = [n for n in graph.graph.nodes if n.op == "placeholder"]
    assert tuple(placeholder.meta["val"].shape) == (2, 3, 12, 12)  # no symbolic batch in the captured graph
    assert inference.aoti.default_dynamic_dims(graph) == ()
    with caplog.at_level("INFO", logger="ipex_train"):
        path = inference.export(graph, x, backend="aoti", path=tmp_path / "int8.pt2")
    assert "dynamic input dims none (default for models with convolutions: static shapes" in caplog.text
    assert "dynamic input dims none" in caplog.text
    (status, out), (status3, message) = call_fresh(path, [(x,), (torch.randn(3, 3, 12, 12),)], tmp_path)
    assert status == "ok"
    with torch.no_grad():
        assert _cos(out, model(x)) > 0.999
    # another batch is refused by the checks compiled into the package, naming the option that serves it
    assert status3 == "error" and "input 0 has shape (3, 3, 12, 12)" in message and "shape (2, 3, 12, 12)" in message
    assert "AOTIConfig(dynamic_dims=(0,))" in message
    # The fp32 model has convolutions too; models without keep the dynamic batch, fp32 or int8.
    assert inference.aoti.default_dynamic_dims(model) == ()
    torch.manual_seed(0)
    mlp, xm = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval(), torch.randn(3, 8)
    mlp_graph = quantization.convert(calibrated(mlp, xm), backend="pt2e", example_inputs=xm)
    assert any("quantize_per" in str(n.target) for n in mlp_graph.graph.nodes)
    assert inference.aoti.default_dynamic_dims(mlp_graph) == inference.aoti.default_dynamic_dims(mlp) == (0,)


def test_int8_one_input_channel_conv_package_keeps_dynamic_batch(tmp_path, caplog):
    """torch 2.14.1's Inductor miscompiles an int8 conv with one input channel for a dynamic batch (wrong output
    layout, garbage results): the lowering keeps that conv fp32 and the package stays right at every batch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 16, 3, padding=1),
                          nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10)).eval()
    x = torch.randn(8, 1, 8, 8)
    with caplog.at_level("INFO", logger="ipex_train"):
        graph = quantization.convert(calibrated(model, x), backend="pt2e", example_inputs=x, dynamic_dims=(0,))
    assert "0 kept fp32 (one input channel" in caplog.text
    path = inference.export(graph, x, backend="aoti", path=tmp_path / "one.pt2",
                            config=inference.AOTIConfig(dynamic_dims=(0,)))
    inputs = [(torch.randn(b, 1, 8, 8),) for b in (1, 8, 13)]
    for (xi,), out in zip(inputs, _run_fresh(path, inputs, tmp_path)):
        with torch.no_grad():
            assert _cos(out, model(xi)) > 0.999


def _graph_state(graph):
    return graph.code, {k: v.clone() for k, v in {**dict(graph.named_buffers()),
                                                  **dict(graph.named_parameters())}.items()}


def test_int8_json_round_trip_gives_the_identical_graph_and_json_decides_scales(tmp_path):
    model, x = _cnn(), torch.randn(2, 3, 12, 12)
    prepared = calibrated(model, x)
    prepared.save_qconf_summary(tmp_path / "q.json")
    code, state = _graph_state(quantization.convert(prepared, backend="pt2e", example_inputs=x))
    fresh = quantization.prepare(model, example_inputs=x)
    fresh.load_qconf_summary(tmp_path / "q.json")
    code2, state2 = _graph_state(quantization.convert(fresh, backend="pt2e", example_inputs=x))
    assert code == code2 and state.keys() == state2.keys()
    for k in state:
        torch.testing.assert_close(state[k], state2[k], atol=0, rtol=0)
    # An edited scale changes the graph: the JSON decides, not a re-calibration.
    summary = json.loads((tmp_path / "q.json").read_text())
    (conv2,) = [e for e in summary if e["name"] == "conv2"]
    conv2["weight_scales"][0] = [s * 2 for s in conv2["weight_scales"][0]]
    (tmp_path / "edited.json").write_text(json.dumps(summary))
    fresh.load_qconf_summary(tmp_path / "edited.json")
    _, state3 = _graph_state(quantization.convert(fresh, backend="pt2e", example_inputs=x))
    assert any(not torch.equal(state[k], state3[k]) for k in state)


def test_int8_layer_kept_fp32_by_the_json_has_no_quantize(tmp_path):
    model, x = _cnn(), torch.randn(2, 3, 12, 12)
    prepared = calibrated(model, x)
    prepared.save_qconf_summary(tmp_path / "q.json")
    summary = json.loads((tmp_path / "q.json").read_text())
    for e in summary:
        if e["name"] == "fc":
            e["inputs_quantized"] = [False]
    (tmp_path / "q.json").write_text(json.dumps(summary))
    prepared.load_qconf_summary(tmp_path / "q.json")
    graph = quantization.convert(prepared, backend="pt2e", example_inputs=x)
    (linear,) = [n for n in graph.graph.nodes if n.target is torch.ops.aten.linear.default]
    assert linear.args[1].op == "get_attr"  # an fp32 weight, no dequantize_per_channel
    (conv2,) = [n for n in graph.graph.nodes if n.target is torch.ops.aten.conv2d.default
                and n.args[1].op == "call_function"][-1:]
    assert "dequantize_per_channel" in str(conv2.args[1].target)


class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        y = self.conv(x)
        return y if y.sum() > 0 else -y  # data-dependent control flow: torch.export cannot capture it


def test_int8_pt2e_falls_back_to_eager_naming_the_failure(caplog):
    model, x = _Branchy().eval(), torch.randn(2, 3, 8, 8)
    prepared = calibrated(model, x)
    with pytest.warns(RuntimeWarning, match=r"torch\.export \(strict=True\) could not capture.*eager int8 model"):
        result = quantization.convert(prepared, backend="pt2e", example_inputs=x)
    assert isinstance(result, quantization.QuantizedModel)
    with torch.no_grad():
        assert _cos(result(x), model(x)) > 0.999


def test_aoti_export_errors_change_nothing(tmp_path):
    model = _cnn()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2, 3, 12, 12)
    with pytest.raises(ValueError, match="backend must be one of"):
        inference.export(model, x, backend="onnx")
    with pytest.raises(ValueError, match="needs path"):
        inference.export(model, x, backend="aoti")
    with pytest.raises(ValueError, match="ending in .pt2"):
        inference.export(model, x, backend="aoti", path=tmp_path / "m.so")
    with pytest.raises(ValueError, match="dtype must be"):
        inference.AOTIConfig(dtype=torch.float16)
    with pytest.raises(ValueError, match="config is an AOTIConfig"):
        inference.export(model, x, config=inference.AOTIConfig())
    with pytest.raises(RuntimeError, match=r"torch\.export \(strict=False\) could not capture _Branchy"):
        inference.export(_Branchy().eval(), torch.randn(2, 3, 8, 8), backend="aoti", path=tmp_path / "b.pt2")
    with pytest.raises(TypeError, match="needs example_inputs"):
        quantization.convert(calibrated(_cnn(), x), backend="pt2e")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not list(tmp_path.iterdir())


class _InputResidual(nn.Module):
    """Attention-like: the output projection of a matmul result, plus the model input itself."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.out = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        attn = torch.softmax(self.q(x) @ self.k(x).transpose(1, 2), -1)
        return x + self.out(attn @ x)


def test_int8_package_leaves_its_input_unchanged(tmp_path):
    """torchao's lowering fuses linear + add into a "sum" post-op that accumulates into the add's other operand;
    with the model input there, the compiled code would write into the caller's tensor: export copies it."""
    torch.manual_seed(0)
    model, x = _InputResidual().eval(), torch.randn(4, 8, 16)
    graph = quantization.convert(calibrated(model, x), backend="pt2e", example_inputs=x)
    path = inference.export(graph, x, backend="aoti", path=tmp_path / "res.pt2")
    package = torch._inductor.aoti_load_package(str(path))
    for xi in (x, torch.randn(2, 8, 16)):  # batch dynamic
        before = xi.clone()
        with torch.no_grad():
            out = package(xi)
            assert _cos(out, model(before)) > 0.999
        torch.testing.assert_close(xi, before, atol=0, rtol=0)


def _switch_encoder():
    """A HuggingFace SwitchTransformers encoder (mixture of experts, data-dependent routing) from a tiny config,
    returning its last hidden state; torch.export rejects it, strict and non-strict."""
    from transformers import SwitchTransformersConfig, SwitchTransformersEncoderModel

    class Hidden(nn.Module):
        def __init__(self):
            super().__init__()
            config = SwitchTransformersConfig(d_model=32, d_ff=64, num_layers=2, num_heads=2, d_kv=16,
                                              num_experts=4, vocab_size=100, encoder_sparse_step=1, use_cache=False)
            self.encoder = SwitchTransformersEncoderModel(config)

        def forward(self, ids):
            return self.encoder(ids).last_hidden_state

    torch.manual_seed(0)
    return Hidden().eval()


def test_int8_on_a_huggingface_model_torch_export_rejects(tmp_path):
    model = _switch_encoder()
    ids = torch.randint(0, 100, (2, 16))
    prepared = quantization.prepare(model, example_inputs=ids)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _ in range(3):
            prepared(torch.randint(0, 100, (2, 16), generator=g))
    int8 = quantization.convert(prepared)
    assert sum(type(m).__name__ == "Int8Layer" for m in int8.modules()) >= 10  # attention and expert linears
    with torch.no_grad():
        for other in (ids, torch.randint(0, 100, (3, 9), generator=g)):
            assert _cos(int8(other), model(other)) > 0.99
    # The Inductor lowering falls back to that eager int8 model, naming what torch.export failed on and where.
    with pytest.warns(RuntimeWarning, match=r"(?s)strict=True\) could not capture Hidden.*strict=False\) could not "
                                            r"capture Hidden.*modeling_switch_transformers\.py:\d+.*eager int8"):
        fallback = quantization.convert(prepared, backend="pt2e", example_inputs=ids)
    assert isinstance(fallback, quantization.QuantizedModel)
    with pytest.raises(RuntimeError, match=r"torch\.export \(strict=False\) could not capture Hidden: .*"
                                           r"modeling_switch_transformers\.py"):
        inference.export(model, ids, backend="aoti", path=tmp_path / "fp32.pt2")
    with pytest.raises(TypeError, match=r"eager int8 kernels .*backend='torchscript'.*backend='pt2e'"):
        inference.export(int8, ids, backend="aoti", path=tmp_path / "int8.pt2")
    assert not list(tmp_path.iterdir())
