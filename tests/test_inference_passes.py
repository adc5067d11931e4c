"""Graph passes of the export/int8 paths: linears sharing one input fused into one GEMM (exact in fp32, per-channel
int8 scales kept), wired into export(backend="aoti") and convert(backend="pt2e") with a switch to turn it off."""
import copy
import json
import math
import zipfile

import pytest
import torch
from int8_helpers import calibrated
from torch import nn

from ipex_train import compute_policy, inference, quantization
from ipex_train.inference.graph_passes import fuse_shared_input_linears, write_out_attention_softmax

_LINEAR = torch.ops.aten.linear.default


class Attention(nn.Module):
    """Q/K/V projections of one input (Q without bias, so a mixed group stays unfused), softmax attention."""

    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value, self.out = (nn.Linear(d, d) for _ in range(4))
        self.gate = nn.Linear(d, d, bias=False)

    def forward(self, x):
        b, s, d = x.shape

        def split(t):
            return t.view(b, s, self.heads, d // self.heads).transpose(1, 2)

        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        attn = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // self.heads), dim=-1)
        ctx = (attn @ v).transpose(1, 2).reshape(b, s, d)
        return self.out(ctx) - self.gate(x)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(Attention(), Attention()).eval()


def _linears(gm):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is _LINEAR)


def _count_in_package_graph(model, x, **config):
    ep = inference.aoti.apply_passes(inference.aoti.capture(model, (x,)), (x,), inference.AOTIConfig(**config))
    return _linears(ep.graph_module), ep


def _ops(gm, *targets):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target in targets)


def _package_code(path):
    with zipfile.ZipFile(path) as z:
        return "".join(z.read(n).decode(errors="ignore") for n in z.namelist() if n.endswith(".cpp"))


def test_fuse_shared_input_linears_is_exact_and_counts_gemms():
    model, x = _model(), torch.randn(3, 8, 32)
    auto = torch.export.Dim.AUTO
    gm = torch.export.export(model, (x,), dynamic_shapes=({0: auto, 1: auto},)).module()
    assert _linears(gm) == 10
    fused = fuse_shared_input_linears(gm)
    # Q/K/V (bias) fused per layer; the bias-free gate reads the same x but is kept apart
    assert fused == {"0.query_key_value": ["0.query", "0.key", "0.value"],
                     "1.query_key_value": ["1.query", "1.key", "1.value"]}
    assert _linears(gm) == 6
    names = {name for name, _ in gm.named_parameters()}
    assert "0.query_key_value.weight" in names and not names & {"0.query.weight", "0.key.bias", "1.value.weight"}
    with torch.no_grad():
        for shape in ((3, 8, 32), (1, 5, 32)):
            xi = torch.randn(shape)
            torch.testing.assert_close(gm(xi), model(xi), atol=1e-6, rtol=1e-5)


def test_fuse_respects_allow_and_leaves_computed_weights():
    model, x = _model(), torch.randn(2, 4, 32)
    gm = torch.export.export(model, (x,)).module()
    assert fuse_shared_input_linears(gm, allow=lambda names: "1.query" not in names) == {
        "0.query_key_value": ["0.query", "0.key", "0.value"]}
    assert _linears(gm) == 8


def test_write_out_attention_softmax_matches_fp32_and_leaves_other_softmaxes():
    model, x = _model(), torch.randn(3, 8, 32)
    auto = torch.export.Dim.AUTO
    gm = torch.export.export(model, (x,), dynamic_shapes=({0: auto, 1: auto},)).module()
    softmax = (torch.ops.aten.softmax.int,)
    assert _ops(gm, *softmax) == 2
    assert write_out_attention_softmax(gm) == 2
    assert _ops(gm, *softmax) == 0 and _ops(gm, torch.ops.aten.exp.default) == 2
    with torch.no_grad():
        for shape in ((3, 8, 32), (2, 13, 32)):
            xi = torch.randn(shape)
            torch.testing.assert_close(gm(xi), model(xi), atol=1e-5, rtol=1e-5)
    # fp32 scores in a bf16 graph: the probabilities come back in bf16 for the second matmul
    gm = torch.export.export(copy.deepcopy(model).bfloat16(), (x.bfloat16(),)).module()
    assert write_out_attention_softmax(gm, scores_dtype=torch.float32) == 2
    with torch.no_grad():
        torch.testing.assert_close(gm(x.bfloat16()).float(), model(x), atol=0.05, rtol=0.05)
    # a softmax that is a model output (no matmul after it) is not attention
    head = torch.export.export(nn.Sequential(nn.Linear(4, 4), nn.Softmax(-1)), (torch.randn(2, 4),)).module()
    assert write_out_attention_softmax(head) == 0


def test_aoti_export_runs_the_passes_by_default_and_config_turns_them_off(tmp_path):
    model, x = _model(), torch.randn(2, 8, 32)
    fused, ep = _count_in_package_graph(model, x)
    unfused, plain = _count_in_package_graph(model, x, fuse_linears=False, write_out_softmax=False)
    assert (fused, unfused) == (6, 10)
    assert _ops(ep.graph_module, torch.ops.aten.softmax.int) == 0
    assert _ops(plain.graph_module, torch.ops.aten.softmax.int) == 2
    assert inference.aoti.dynamic_dims_of(ep) == ["input0[0]"]
    for name in ("fuse_linears", "write_out_softmax"):
        with pytest.raises(TypeError, match=name):
            inference.AOTIConfig(**{name: 1})
    path = inference.export(model, x, backend="aoti", path=tmp_path / "m.pt2")
    off = inference.export(model, x, backend="aoti", path=tmp_path / "off.pt2",
                           config=inference.AOTIConfig(write_out_softmax=False))
    # Inductor turns the captured attention into its flash kernel; the written-out softmax keeps two GEMMs
    assert "scaled_dot_product" not in _package_code(path) and "scaled_dot_product" in _package_code(off)
    package = torch._inductor.aoti_load_package(str(path))
    with torch.no_grad():
        for b in (1, 4):
            xi = torch.randn(b, 8, 32)
            torch.testing.assert_close(package(xi), model(xi), atol=1e-5, rtol=1e-4)


def test_aoti_bf16_export_fuses_and_tracks_fp32(tmp_path):
    model, x = _model(), torch.randn(2, 8, 32)
    path = inference.export(model, x, backend="aoti", path=tmp_path / "m.pt2",
                            config=inference.AOTIConfig(dtype=torch.bfloat16))
    package = torch._inductor.aoti_load_package(str(path))
    with torch.no_grad():
        xi = torch.randn(4, 8, 32)
        out, ref = package(xi), model(xi)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=0.03, rtol=0.05)


def _cos(a, b):
    return nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


def _int8_linears(gm):
    """(int8 linears, fp32 linears) of a pt2e graph: a linear reading a dequantized weight is int8."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is _LINEAR]
    q = sum(1 for n in nodes if "dequantize" in str(getattr(n.args[1], "target", "")))
    return q, len(nodes) - q


def test_int8_pt2e_fuses_qkv_with_per_channel_scales_and_tracks_fp32():
    model, x = _model(), torch.randn(2, 8, 32)
    prepared = calibrated(model, x)
    fused = quantization.convert(prepared, backend="pt2e", example_inputs=x)
    unfused = quantization.convert(prepared, backend="pt2e", example_inputs=x, fuse_linears=False)
    assert _int8_linears(fused) == (6, 0) and _int8_linears(unfused) == (10, 0)
    scales = [n for n in fused.graph.nodes if n.op == "get_attr" and "scale" in n.target]
    per_channel = sorted(getattr(fused, n.target).numel() for n in scales)
    assert 96 in per_channel  # the fused Q/K/V weight: one scale per output channel of the three layers
    with torch.no_grad():
        for b in (2, 5):
            xi = torch.randn(b, 8, 32)
            ref, a, u = model(xi), fused(xi), unfused(xi)
            assert _cos(a, ref) > 0.999
            assert _cos(a, ref) >= _cos(u, ref) - 2e-4  # the same int8 numerics, within noise
            torch.testing.assert_close(a, u, atol=0.05, rtol=0.1)
    with pytest.raises(TypeError, match="fuse_linears"):
        quantization.convert(prepared, backend="pt2e", example_inputs=x, fuse_linears="yes")


def test_int8_pt2e_does_not_fuse_layers_with_different_input_quantization(tmp_path):
    model, x = _model(), torch.randn(2, 8, 32)
    prepared = calibrated(model, x)
    summary = prepared.qconf_summary()
    for e in summary:
        if e["name"] == "0.key":
            e["inputs_quantized"] = [False]  # key stays fp32: 0's Q/K/V cannot share one int8 GEMM
    (tmp_path / "q.json").write_text(json.dumps(summary))
    prepared.load_qconf_summary(str(tmp_path / "q.json"))
    graph = quantization.convert(prepared, backend="pt2e", example_inputs=x)
    assert _int8_linears(graph) == (7, 1)  # layer 0: q, v, out, gate int8 + key fp32; layer 1: qkv, out, gate


def test_int8_fused_graph_packages_and_tracks_fp32(tmp_path):
    model, x = _model(), torch.randn(2, 8, 32)
    graph = quantization.convert(calibrated(model, x), backend="pt2e", example_inputs=x)
    path = inference.export(graph, x, backend="aoti", path=tmp_path / "int8.pt2")
    assert "scaled_dot_product" not in _package_code(path)
    package = torch._inductor.aoti_load_package(str(path))
    with torch.no_grad():
        for b in (1, 3):
            xi = torch.randn(b, 8, 32)
            out = package(xi.clone())
            assert _cos(out, model(xi)) > 0.999
            torch.testing.assert_close(out, graph(xi), atol=0.05, rtol=0.05)


def _matmul_operand_dtypes(gm):
    """Per attention matmul of a graph, the dtypes of its two operands (a cast's target dtype, else the tensor's)."""
    def dtype(node):
        return node.kwargs["dtype"] if node.target is torch.ops.aten._to_copy.default else node.meta["val"].dtype

    return [tuple(dtype(a) for a in n.args[:2]) for n in gm.graph.nodes
            if n.op == "call_function" and n.target is torch.ops.aten.matmul.default]


@pytest.mark.parametrize("native", [True, False])
def test_int8_pt2e_bf16_attention_default_follows_the_cpu(native, monkeypatch):
    model, x = _model(), torch.randn(2, 8, 32)
    prepared = calibrated(model, x)
    monkeypatch.setattr(compute_policy, "cpu_has_native_bf16", lambda features=None: native)
    default = quantization.convert(prepared, backend="pt2e", example_inputs=x)
    want = [(torch.bfloat16, torch.bfloat16) if native else (torch.float32, torch.float32)] * 4
    assert _matmul_operand_dtypes(default) == want


def test_int8_pt2e_bf16_attention_runs_the_matmuls_in_bf16_and_tracks_fp32(tmp_path):
    model, x = _model(), torch.randn(2, 8, 32)
    prepared = calibrated(model, x)
    default = quantization.convert(prepared, backend="pt2e", example_inputs=x)
    off = quantization.convert(prepared, backend="pt2e", example_inputs=x, bf16_attention=False)
    on = quantization.convert(prepared, backend="pt2e", example_inputs=x, bf16_attention=True)
    # The default follows the CPU: bf16 matmuls where it has bf16 arithmetic, fp32 ones elsewhere.
    assert default.code == (on if compute_policy.cpu_has_native_bf16() else off).code
    # the switch off leaves pt2e's graph as it was: no bf16 anywhere, fp32 matmuls
    assert not [n for n in off.graph.nodes if n.kwargs.get("dtype") == torch.bfloat16]
    assert _matmul_operand_dtypes(off) == [(torch.float32, torch.float32)] * 4
    assert _matmul_operand_dtypes(on) == [(torch.bfloat16, torch.bfloat16)] * 4  # Q K^T and P V of both layers
    softmaxes = [n for n in on.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.softmax.int]
    assert [n.args[0].meta["val"].dtype for n in softmaxes] == [torch.float32] * 2  # softmax stays fp32
    with torch.no_grad():
        for b in (2, 5):
            xi = torch.randn(b, 8, 32)
            ref, a, u = model(xi), on(xi), off(xi)
            assert a.dtype == torch.float32
            assert _cos(a, ref) > 0.999
            torch.testing.assert_close(a, u, atol=0.05, rtol=0.05)
    # export's softmax pass sees the attention through the bf16 cast of the probabilities
    assert write_out_attention_softmax(on) == 2
    with torch.no_grad():
        assert _cos(on(x), model(x)) > 0.999
    with pytest.raises(TypeError, match="bf16_attention"):
        quantization.convert(prepared, backend="pt2e", example_inputs=x, bf16_attention=1)
