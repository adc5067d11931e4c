"""INT8 static post-training quantization that runs int8 kernels eagerly: prepare, calibrate, convert, deploy.

    prepared = ipex_train.quantization.prepare(model.eval(), default_static_qconfig, example_inputs=x)
    with torch.no_grad():
        for batch in calibration_batches:
            prepared(batch)
    prepared.save_qconf_summary("qconf.json")          # optional: the editable calibration result
    int8_model = ipex_train.quantization.convert(prepared)
    traced = torch.jit.freeze(torch.jit.trace(int8_model, x))
    traced.save("int8.pt")                              # deploy: torch.jit.load("int8.pt"), no ipex_train needed

Which kernels run, and why. Conv1d/2d/3d and Linear become torch's quantized CPU modules (torch.ao.nn.quantized
and .intrinsic.quantized: quantized::conv2d_relu, quantized::linear, ...) packed for the oneDNN engine, with
per-channel int8 weights and uint8 activations; a relu that only reads a layer's output is fused into it; residual
adds of two int8 tensors run quantized::add_relu / quantized::add; max-pooling, average pooling, flatten/reshape
and gelu run torch's quantized kernels on the int8 tensors between layers. Everything else (softmax, layer_norm,
the attention matmuls, whose few FLOPs do not repay quantizing their inputs) runs fp32 on dequantized inputs;
``fp32_ops()`` lists it. These are real int8 kernels in eager mode, so the converted model is fast without graph
capture, and torch.jit.trace records plain aten/quantized ops. Not used: the oneDNN Graph fuser (torch has no
quantize/dequantize mapping for it, so a quantize/dequantize reference graph ran its convolutions in fp32, measured
0.94x of fp32) and onednn::qconv_pointwise (its weights are MKLDNN tensors, which TorchScript cannot save).

Deprecation: torch 2.14 warns that torch.ao quantization and quantized tensors are deprecated in favour of
torchao's pt2e flow (torch.compile based; its X86InductorQuantizer needs strict torch.export capture on ResNet-50,
which convert(backend="pt2e") uses). The kernels used above still ship in torch 2.14; these warnings come from torch
at convert().

No torch.fx: prepare() finds the ops by running the model once under module hooks and a TorchFunctionMode
(see _graph.py), so data-dependent control flow and HuggingFace models quantize.

CPUs without VNNI: the int8 kernels saturate u8 x s8 pair sums to int16; prepare() measures this and then
quantizes weights to 7 bits, which keeps every product exact (see _kernels.py; QConfig.weight_bits overrides it).

Bad inputs (docs/quantization_bad_inputs.md): a NaN/inf in a calibration batch raises naming the op and the batch
(the batch is rolled back); scales outside [2**-42, 2**42] are refused by load_qconf_summary, save_qconf_summary
and convert() alike; a zero calibrated range warns; convs take unbatched inputs; a NaN/inf input gives NaN outputs.

Inductor: convert(prepared, backend="pt2e", example_inputs=x) lowers the same summary to a torchao pt2e
quantize/dequantize graph (pt2e.py) for torch.compile or ipex_train.inference.export(backend="aoti").

Dynamic shapes: the eager int8 model takes any batch size or sequence length; nothing is specialised to a shape
(benchmarks/suite/bench_int8.py times the first call at a new shape: within noise of the steady time here). A traced
model keeps the shapes its Python code computed from sizes (a reshape to (batch, seq, heads, dim)), as any trace
does.
"""
from ._api import PreparedModel, convert, fp32_ops, prepare
from ._kernels import pair_sums_saturate
from ._qconfig import QConfig, default_static_qconfig, symmetric_static_qconfig
from ._runtime import QuantizedModel

__all__ = ["prepare", "convert", "QConfig", "default_static_qconfig", "symmetric_static_qconfig", "PreparedModel",
           "QuantizedModel", "fp32_ops", "pair_sums_saturate"]
