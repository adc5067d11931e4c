"""ipex_train.quantization: int8 numerics against fp32 (digits, ResNet-50, BERT-style, HF BERT), control flow,
fusion, optimize() composition, new shapes, deployment in a fresh process, the no-VNNI saturation trap, the recipe."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from int8_helpers import Residual, cos, int8_layers, quantize, residual_data
from torch import nn

import ipex_train
from benchmarks.common.inference_models import BertStyleEncoder, resnet50
from ipex_train import quantization as q

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def digits():
    from recipes.quantize_int8 import train_fp32

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny steps: one thread is faster, above all on a shared machine
    try:
        return train_fp32(seed=0, epochs=3, image_size=8)
    finally:
        torch.set_num_threads(threads)


def test_digits_int8_top1_within_half_a_point(digits):
    from recipes.quantize_int8 import accuracy, calibrate_and_convert

    model, (x_train, _), (x_test, y_test) = digits
    _, int8 = calibrate_and_convert(model, x_train[:256], 64)
    assert len(int8_layers(int8)) == 4  # three conv(+relu) and the classifier run int8
    fp32_acc, int8_acc = accuracy(model, x_test, y_test), accuracy(int8, x_test, y_test)
    assert fp32_acc > 0.9
    assert abs(int8_acc - fp32_acc) <= 0.005, (fp32_acc, int8_acc)


def test_resnet50_cosine_and_everything_int8():
    torch.manual_seed(0)
    model = resnet50()
    x = torch.randn(2, 3, 64, 64)
    prepared, int8 = quantize(model, x[:1], [torch.randn(2, 3, 64, 64) for _ in range(2)])
    summary = int8.qconf_summary()
    assert sum(e["type"] == "add" for e in summary) == 16  # every bottleneck's residual add
    assert all(e["post_op"] == "relu" for e in summary if e["type"] == "add")
    assert q.fp32_ops(int8, x) == []  # no conv, add, pool or flatten fell back to fp32
    with torch.no_grad():
        assert cos(int8(x), model(x)) >= 0.999


def test_bert_style_encoder_cosine():
    torch.manual_seed(0)
    model = BertStyleEncoder(layers=2, d_model=128, heads=4, ffn=512).eval()
    x = torch.randn(2, 32, 128)
    _, int8 = quantize(model, x[:1], [torch.randn(4, 32, 128) for _ in range(2)])
    assert len(int8_layers(int8)) == 12
    fp32 = q.fp32_ops(int8, x)
    assert "fp32 call: matmul x4" in fp32 and "fp32 call: softmax x2" in fp32  # attention stays fp32
    with torch.no_grad():
        assert cos(int8(x), model(x)) >= 0.99


def test_huggingface_bert_quantizes():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()
    ids = torch.randint(0, 100, (2, 16))
    mask = torch.ones_like(ids)
    _, int8 = quantize(model, {"input_ids": ids[:1], "attention_mask": mask[:1]},
                        [(torch.randint(0, 100, (2, 16)),) for _ in range(2)])
    assert len(int8_layers(int8)) == 2 * 6 + 1  # Q, K, V, attention output, FFN in/out per layer, pooler
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).last_hidden_state
        got = int8(input_ids=ids, attention_mask=mask).last_hidden_state
    assert not got.is_quantized
    assert cos(got, want) >= 0.99


class Branchy(nn.Module):
    """Data-dependent control flow: a loop whose trip count and a branch that depend on the input's values."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        for _ in range(int(x.abs().mean() * 3) + 1):
            x = torch.relu(self.a(x))
        if x.sum() > 0:
            x = self.b(x) + x
        return self.c(x)


class TwoWay(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.a(x) if x.mean() > 0 else self.c(torch.relu(self.b(x)))


def test_branch_never_calibrated_stays_fp32_and_runs():
    torch.manual_seed(0)
    model = TwoWay().eval()
    pos = [torch.rand(4, 8) + 0.1 for _ in range(2)]
    neg = -torch.rand(4, 8) - 0.1
    # The example input takes the b/c branch (so it numbers them first); calibration only ever takes a.
    prepared, int8 = quantize(model, neg, pos)
    assert prepared.ops() == ["0: b (linear)", "1: c (linear)", "2: a (linear)"]
    assert q.fp32_ops(int8) == ["b (linear): never ran during calibration",
                                "c (linear): never ran during calibration"]
    with torch.no_grad():
        assert cos(int8(pos[1]), model(pos[1])) >= 0.999
        torch.testing.assert_close(int8(neg), model(neg))  # the other branch runs fp32


def test_control_flow_model_quantizes():
    torch.manual_seed(0)
    model = Branchy().eval()
    calib = [torch.randn(8, 16) * s for s in (0.5, 1.0, 2.0)]
    prepared, int8 = quantize(model, calib[0], calib)
    summary = [(e["name"], e["post_op"]) for e in int8.qconf_summary()]
    assert summary == [("a", "relu"), ("b", None), ("b+add", None), ("c", None)]
    with torch.no_grad():
        for scale in (0.3, 1.0, 3.0):  # different loop counts
            x = torch.randn(8, 16) * scale
            assert cos(int8(x), model(x)) >= 0.99


def test_residual_inplace_add_relu_fused_and_correct():
    torch.manual_seed(0)
    model = Residual().eval()
    data = residual_data()
    prepared, int8 = quantize(model, data[0], data)
    kinds = {e["name"]: (e["type"], e["post_op"]) for e in int8.qconf_summary()}
    assert kinds == {"conv1": ("conv2d", "relu"), "conv2": ("conv2d", None), "conv2+add": ("add", "relu"),
                     "fc": ("linear", None)}
    assert q.fp32_ops(int8, data[0]) == []
    with torch.no_grad():
        assert cos(int8(data[1]), model(data[1])) >= 0.999


def test_threads_run_one_converted_model_concurrently():
    import threading

    torch.manual_seed(0)
    model = Residual().eval()
    data = residual_data()
    _, int8 = quantize(model, data[0], data)
    with torch.no_grad():
        want = [int8(x) for x in data]
    got = [None] * len(data)

    def run(i):
        with torch.no_grad():
            for _ in range(5):
                got[i] = int8(data[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(data))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for g, w in zip(got, want):
        assert torch.equal(g, w)


class StatementAdd(nn.Module):
    """``out.add_(x)`` as a statement: the in-place result must land in ``out`` itself."""

    def __init__(self):
        super().__init__()
        self.conv0, self.conv = nn.Conv2d(8, 8, 1), nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        y = self.conv0(x)
        out = self.conv(y)
        out.add_(y)
        return torch.relu(out)


def test_statement_inplace_add_writes_in_place():
    torch.manual_seed(0)
    model = StatementAdd().eval()
    data = residual_data()
    _, int8 = quantize(model, data[0], data)
    assert [e["name"] for e in int8.qconf_summary()] == ["conv0", "conv", "conv+add"]
    with torch.no_grad():
        assert cos(int8(data[1]), model(data[1])) >= 0.999


@pytest.mark.parametrize("conv,shape", [(nn.Conv1d, (2, 4, 12)), (nn.Conv3d, (2, 4, 5, 6, 6))])
def test_conv1d_conv3d_with_relu(conv, shape):
    torch.manual_seed(0)
    model = nn.Sequential(conv(4, 8, 3, padding=1), nn.ReLU(), conv(8, 4, 3)).eval()
    x = torch.randn(shape)
    _, int8 = quantize(model, x, [torch.randn(shape) for _ in range(2)])
    assert [e["post_op"] for e in int8.qconf_summary()] == ["relu", None]
    assert len(int8_layers(int8)) == 2
    with torch.no_grad():
        assert cos(int8(x), model(x)) >= 0.999


def test_composes_with_optimize_fold_and_dropout():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.5),
                          nn.Conv2d(8, 8, 3, padding=1))
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-1, 1)
            m.running_var.uniform_(0.5, 2)
    model.eval()
    data = residual_data()
    optimized = ipex_train.optimize(model, sample_input=data[0])
    assert not any(isinstance(m, (nn.BatchNorm2d, nn.Dropout)) for m in optimized.modules())
    _, int8 = quantize(optimized, data[0], data)
    assert [e["post_op"] for e in int8.qconf_summary()] == ["relu", None]
    with torch.no_grad():
        assert cos(int8(data[1]), model(data[1])) >= 0.999


def test_new_batch_size_and_sequence_length():
    torch.manual_seed(0)
    cnn = Residual().eval()
    data = residual_data()
    _, int8 = quantize(cnn, data[0][:1], data)
    with torch.no_grad():
        for batch in (1, 3, 7):
            x = torch.relu(torch.randn(batch, 8, 8, 8))
            assert cos(int8(x), cnn(x)) >= 0.995
    enc = BertStyleEncoder(layers=1, d_model=64, heads=4, ffn=128).eval()
    _, int8 = quantize(enc, torch.randn(1, 16, 64), [torch.randn(2, 16, 64)])
    with torch.no_grad():
        for batch, seq in ((1, 16), (3, 5), (2, 40)):
            x = torch.randn(batch, seq, 64)
            assert cos(int8(x), enc(x)) >= 0.99


_LOAD = """
import sys, torch
model = torch.jit.freeze(torch.jit.load(sys.argv[1]).eval())
x, want = torch.load(sys.argv[2])
with torch.no_grad():
    got = model(x)
assert "ipex_train" not in sys.modules
torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
print("ok", torch.backends.quantized.engine)
"""


def test_trace_freeze_save_load_in_a_fresh_process(tmp_path):
    torch.manual_seed(0)
    model = Residual().eval()
    data = residual_data()
    _, int8 = quantize(model, data[0], data)
    with torch.no_grad():
        traced = torch.jit.freeze(torch.jit.trace(int8, data[0]))
        want = int8(data[1])
        torch.testing.assert_close(traced(data[1]), want, rtol=0, atol=0)
    kinds = {n.kind() for n in traced.graph.nodes()}
    assert {"quantized::conv2d_relu", "quantized::add_relu_out", "quantized::linear"} <= kinds
    assert not any(k.startswith("ipex_train") for k in kinds)
    traced.save(tmp_path / "int8.pt")
    torch.save((data[1], want), tmp_path / "io.pt")
    proc = subprocess.run([sys.executable, "-c", _LOAD, str(tmp_path / "int8.pt"), str(tmp_path / "io.pt")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("ok")


_SATURATION = """
import logging, torch
from torch import nn
from ipex_train import quantization as q
logging.basicConfig(level=logging.WARNING)
# Every product is 255 x 127 after quantization: the int16 pair sums of a CPU without VNNI saturate.
def worst(bits):
    err = 0.0
    for layer, x in ((nn.Linear(64, 4), torch.full((2, 64), 2.0)), (nn.Conv1d(64, 4, 1), torch.full((2, 64, 3), 2.0))):
        with torch.no_grad():
            layer.weight.fill_(0.5)
            layer.bias.zero_()
        p = q.prepare(layer.eval(), q.QConfig(weight_bits=bits), example_inputs=x)
        p(x)
        with torch.no_grad():
            got, want = q.convert(p)(x), layer(x)
        err = max(err, (got - want).abs().max().item() / want.abs().max().item())
    return round(err, 4)
print("saturate", q.pair_sums_saturate(), "auto", worst(None), "8bit", worst(8))
"""


def test_no_vnni_saturation_is_avoided():
    # oneDNN capped at AVX2 runs the VPMADDUBSW kernels of CPUs without VNNI, so the trap is reproduced on any CPU.
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", _SATURATION], capture_output=True, text=True, timeout=120,
                          env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    words = proc.stdout.split()
    assert words[:2] == ["saturate", "True"], proc.stdout
    auto, eight = float(words[3]), float(words[5])
    assert auto <= 0.02, proc.stdout  # 7-bit weights: exact products, only rounding error
    assert eight >= 0.3, proc.stdout  # forcing 8 bits shows the trap this guards against
    assert proc.stderr.count("weights are quantized to 7 bits") == 1


def test_recipe_smoke(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "recipes.quantize_int8", "--epochs", "1", "--image-size", "8",
                           "--calib-batches", "1", "--no-progress", "--out", str(tmp_path), "--deploy", "torchscript"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "metrics.json").read_text())
    deployed = data["results"]["int8 reloaded (fresh process)"]
    assert deployed["ipex_train_imported"] is False and 0 <= deployed["accuracy"] <= 1
    assert json.loads((tmp_path / "qconf.json").read_text())[0]["name"] == "features.0"
    assert (tmp_path / "quantize_int8.png").read_bytes()[:4] == b"\x89PNG"


def test_recipe_smoke_aoti_deploy(tmp_path):
    """The recipe's AOTInductor deploy: the int8 .pt2 package reloads in a fresh process without ipex_train and
    keeps the eager int8 model's accuracy (the same qconf summary decides both)."""
    proc = subprocess.run([sys.executable, "-m", "recipes.quantize_int8", "--epochs", "2", "--image-size", "8",
                           "--calib-batches", "1", "--no-progress", "--out", str(tmp_path), "--deploy", "aoti"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "metrics.json").read_text())["results"]
    deployed = results["int8 AOTInductor (fresh process)"]
    assert deployed["ipex_train_imported"] is False
    assert abs(deployed["accuracy"] - results["int8 eager"]["accuracy"]) <= 0.03
    assert (tmp_path / "digits_int8.pt2").stat().st_size > 0
