"""AOTInductor packages at shapes other than the export's: each call computes the eager model's result or raises a
RuntimeError naming the given and expected shapes, never a wrong-shaped result and never an abort. Packages are
called in a fresh interpreter that has only torch (no ipex_train, no transformers), as a deployment would load
them; an abort there would show as a non-zero exit. Two tiny HF BERT packages are compiled per module (~30 s each)."""
import pytest
import torch
from aoti_helpers import call_fresh
from torch import nn

from ipex_train import inference
from ipex_train.inference import aoti, input_checks


def _bert():
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64)
    return BertModel(config).eval()


def _ids(batch, seq, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 100, (batch, seq), generator=g), torch.ones(batch, seq, dtype=torch.int64)


@pytest.fixture(scope="module")
def bert_packages(tmp_path_factory):
    """The tiny BERT exported at (4, 32) with ids and attention mask: with the default AOTIConfig, and with the
    sequence kept static (dynamic_dims=(0,))."""
    model, folder = _bert(), tmp_path_factory.mktemp("bert")
    example = _ids(4, 32)
    default = inference.export(model, example, backend="aoti", path=folder / "default.pt2")
    static_seq = inference.export(model, example, backend="aoti", path=folder / "static_seq.pt2",
                                  config=inference.AOTIConfig(dynamic_dims=(0,)))
    return model, default, static_seq


def _assert_matches(result, model, args):
    status, out = result
    assert status == "ok", out
    with torch.no_grad():
        ref = model(*args)
    assert isinstance(out, tuple) and len(out) == 2  # ModelOutput flattened: (last_hidden_state, pooler_output)
    for got, want in zip(out, (ref.last_hidden_state, ref.pooler_output)):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_default_bert_package_is_dynamic_in_batch_and_sequence(bert_packages, tmp_path):
    """Batch and sequence dynamic by default for token ids: other batch, longer and shorter sequences and (1, 1)
    compute the model's result, in a process that never imports transformers; past the position table (64) and
    a mask shorter than the ids are refused, naming the shapes."""
    model, package, _ = bert_packages
    good = [_ids(4, 32), _ids(2, 32, 1), _ids(4, 48, 2), _ids(4, 16, 3), _ids(1, 1, 4), _ids(3, 64, 5)]
    bad = [_ids(4, 65), (_ids(4, 32)[0], _ids(4, 16)[1])]
    results = call_fresh(package, good + bad, tmp_path)
    for args, result in zip(good, results):
        _assert_matches(result, model, args)
    (status, message), (status2, message2) = results[len(good):]
    assert status == "error" and "input 0 has shape (4, 65)" in message and "(any, 1..64)" in message
    assert "dim 1 is 65, expected at most 64" in message
    assert status2 == "error" and "input 1 has shape (4, 16)" in message2
    assert "dim 1 is 16, expected dim 1 of input 0's size 32" in message2
    metadata = torch._inductor.aoti_load_package(package).get_metadata()
    assert metadata["ipex_train.inputs"] == "input0 (any, 1..64) int64, input1 (any, 1..64) int64"
    assert metadata["ipex_train.input_checks"] == "on" and input_checks.verify(package)


def test_static_sequence_bert_package_refuses_other_sequences(bert_packages, tmp_path):
    """Sequence kept static: a longer sequence (a wrong-shaped result without checks) and a shorter one (an
    out-of-bounds read that aborted the process) raise RuntimeError naming both shapes; the batch stays dynamic."""
    model, _, package = bert_packages
    inputs = [_ids(4, 48), _ids(4, 16), _ids(2, 32, 1)]
    longer, shorter, other_batch = call_fresh(package, inputs, tmp_path)
    for (status, message), seq in ((longer, 48), (shorter, 16)):
        assert status == "error"
        assert f"input 0 has shape (4, {seq}) and dtype int64; the package was compiled for shape (any, 32)" \
            in message
        assert f"dim 1 is {seq}, expected 32" in message and "AOTIConfig(dynamic_dims=...)" in message
    _assert_matches(other_batch, model, inputs[2])


def test_int8_bert_package_defaults_to_dynamic_batch_and_sequence(tmp_path, caplog):
    """convert(backend="pt2e") keeps token ids dynamic in batch and sequence by default, as export does: the int8
    package of the tiny BERT built at (4, 32) with the defaults computes the int8 graph's result at other batches
    and shorter and longer sequences (in a process with torch alone), and refuses a sequence past the position
    table and a mask shorter than the ids, naming the shapes."""
    from int8_helpers import cos

    from ipex_train import quantization

    model, example = _bert(), _ids(4, 32)
    prepared = quantization.prepare(model, example_inputs=example)
    with torch.no_grad():
        for seed in range(10, 13):
            prepared(*_ids(4, 32, seed))
    with caplog.at_level("INFO", logger="ipex_train"):
        graph = quantization.convert(prepared, backend="pt2e", example_inputs=example)
        package = inference.export(graph, example, backend="aoti", path=tmp_path / "int8.pt2")
    assert isinstance(graph, torch.fx.GraphModule)
    assert sum("quantize_per_tensor" in str(n.target) for n in graph.graph.nodes) >= 4  # int8 linears
    assert ("convert(backend='pt2e'): dynamic input dims input0[0], input0[1], input1[0], input1[1] (default: "
            "batch, and sequence of integer inputs of rank 2); the graph takes input0 (any, 1..64) int64") \
        in caplog.text
    assert "export(backend='aoti'): dynamic input dims input0[0], input0[1], input1[0], input1[1]" in caplog.text
    good = [_ids(4, 32, 1), _ids(2, 32, 2), _ids(4, 48, 3), _ids(4, 16, 4), _ids(1, 1, 5), _ids(3, 64, 6),
            _ids(7, 5, 7)]
    bad = [_ids(4, 65), (_ids(4, 32)[0], _ids(4, 16)[1])]
    results = call_fresh(package, good + bad, tmp_path)
    for args, (status, out) in zip(good, results):
        assert status == "ok", out
        with torch.no_grad():
            fake_quant, ref = graph(*args), model(*args)
        for got, want, fp32 in zip(out, (fake_quant.last_hidden_state, fake_quant.pooler_output),
                                   (ref.last_hidden_state, ref.pooler_output)):
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, atol=0.05, rtol=0.05)  # the package is the lowered graph
            assert cos(got, fp32) > 0.999
    (status, message), (status2, message2) = results[len(good):]
    assert status == "error" and "input 0 has shape (4, 65)" in message and "dim 1 is 65, expected at most 64" \
        in message
    assert status2 == "error" and "input 1 has shape (4, 16)" in message2
    assert "dim 1 is 16, expected dim 1 of input 0's size 32" in message2


class _TinyCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 4, 3, padding=1), nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(torch.relu(self.conv(x)), 1), 1))


def test_static_cnn_package_refuses_other_batches_naming_the_option(tmp_path, caplog):
    """A CNN compiles for the example's batch by default: batch 2 and 8, another image size, a channels-last or a
    float64 input raise RuntimeError naming the shapes (and AOTIConfig(dynamic_dims=(0,)) for the batch)."""
    torch.manual_seed(0)
    model, x = _TinyCNN().eval(), torch.randn(4, 3, 8, 8)
    with caplog.at_level("INFO", logger="ipex_train"):
        path = inference.export(model, x, backend="aoti", path=tmp_path / "cnn.pt2")
    assert "dynamic input dims none (default for models with convolutions" in caplog.text
    assert "the package takes input0 (4, 3, 8, 8) float32; other shapes raise RuntimeError" in caplog.text
    assert input_checks.verify(path)
    inputs = [(x,), (torch.randn(2, 3, 8, 8),), (torch.randn(8, 3, 8, 8),), (torch.randn(4, 3, 9, 8),),
              (x.to(memory_format=torch.channels_last),), (x.double(),)]
    results = call_fresh(path, inputs, tmp_path)
    assert results[0][0] == "ok"
    with torch.no_grad():
        torch.testing.assert_close(results[0][1], model(x), atol=1e-4, rtol=1e-4)
    for (args,), (status, message) in zip(inputs[1:4], results[1:4]):
        assert status == "error"
        assert f"has shape {tuple(args.shape)} and dtype float32; the package was compiled for shape (4, 3, 8, 8)" \
            in message
        assert "AOTIConfig(dynamic_dims=(0,)) to serve other batch sizes" in message
    assert "dim 0 is 2, expected 4" in results[1][1] and "dim 2 is 9, expected 8" in results[3][1]
    assert results[4][0] == "error" and "its strides are (192, 1, 24, 3)" in results[4][1]
    assert "the package was compiled for strides (192, 64, 8, 1)" in results[4][1]
    assert results[5][0] == "error" and "and dtype float64" in results[5][1] and "is not float32" in results[5][1]


def test_default_dynamic_shapes_per_input():
    """Token ids and masks (integer or bool, rank 2): batch and sequence; float tensors: the batch; any model with
    convolutions: nothing (checked without compiling)."""
    auto = torch.export.Dim.AUTO
    args = (torch.zeros(2, 5, dtype=torch.int64), torch.ones(2, 5, dtype=torch.bool), torch.randn(2, 5, 8),
            torch.randn(2, 5))
    shapes = aoti.default_dynamic_shapes(nn.Linear(8, 8), args)
    assert shapes == ({0: auto, 1: auto}, {0: auto, 1: auto}, {0: auto}, {0: auto})
    assert aoti.default_dynamic_shapes(_TinyCNN(), args) == ({}, {}, {}, {})
    # convert(backend="pt2e") decides the same, static when its summary quantizes a convolution
    from ipex_train.quantization import pt2e

    linear, conv = [{"type": "linear", "inputs_quantized": [True]}], [{"type": "conv2d", "inputs_quantized": [True]}]
    assert pt2e._dynamic_shapes(linear, args, None, None)[0] == shapes
    assert pt2e._dynamic_shapes(conv, args, None, None)[0] == ({}, {}, {}, {})
    assert pt2e._dynamic_shapes(linear, args, None, (0,))[0] == ({0: auto},) * 4


def test_outputs_that_torch_alone_cannot_rebuild_are_flattened():
    from collections import namedtuple

    pair = namedtuple("pair", "a b")
    t = torch.zeros(1)
    assert not aoti.needs_flat_outputs(t) and not aoti.needs_flat_outputs((t, [t, {"k": t}]))
    assert aoti.needs_flat_outputs(pair(t, t)) and aoti.needs_flat_outputs((t, pair(t, t)))
    from transformers.modeling_outputs import BaseModelOutput
    assert aoti.needs_flat_outputs(BaseModelOutput(last_hidden_state=t))
