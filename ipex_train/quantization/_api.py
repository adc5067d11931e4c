"""prepare() and convert(): the two entry points, and the PreparedModel calibration wrapper."""
from __future__ import annotations

import warnings

import torch
from torch import nn

from ..precision.record import copy_model
from . import _qconf_file
from ._graph import Graph, Recorder
from ._kernels import engine_scope, weight_bits
from ._qconfig import QConfig, default_static_qconfig
from ._runtime import QUANTIZED, AddPlan, Int8Layer, QuantizedModel


class PreparedModel(nn.Module):
    """A model ready for calibration: call it on calibration batches (eval mode, typically under no_grad), then
    pass it to convert(). ``model`` is the (BatchNorm-folded, dropout-free) copy being observed."""

    def __init__(self, model: nn.Module, graph: Graph, qconfig: QConfig, bits: int):
        super().__init__()
        self.model = model
        self._graph, self.qconfig, self.weight_bits = graph, qconfig, bits
        self.calibration_batches = 0
        self._loaded: list[dict] | None = None
        self._converted = False
        self.train(False)

    def forward(self, *args, **kwargs):
        if self._converted:
            raise RuntimeError("this prepared model was converted in place; calibrate a new prepare() result")
        before = self._graph.snapshot()
        try:
            with Recorder(self._graph, observe=True, discover=False, batch=self.calibration_batches + 1):
                out = self.model(*args, **kwargs)
        except BaseException:
            self._graph.restore(before)  # a batch that raised (a non-finite value, the model's own error) counts
            raise                        # for nothing: the user can skip it and go on
        self.calibration_batches += 1
        return out

    def qconf_summary(self) -> list[dict]:
        """The summary convert() will use: the loaded one, else one built from the observers (RuntimeError before
        any calibration batch). Warns (UserWarning) naming the ops whose calibrated range is a single value, such
        as all-zero calibration inputs: their scale is a floor value and every other value saturates."""
        if self._loaded is not None:
            return self._loaded
        if self.calibration_batches == 0:
            raise RuntimeError("no calibration batch has run through this prepared model: call it on calibration "
                               "data (or load_qconf_summary(path)) before convert() or save_qconf_summary()")
        flat = self._graph.zero_ranges()
        if flat:
            warnings.warn("ipex_train.quantization: calibration saw a single value (a zero range) at "
                          f"{', '.join(flat)}; the scale there is a floor value and any other value will saturate. "
                          "Calibrate on representative data, or set inputs_quantized to false for these ops in "
                          "the qconf summary to keep them fp32", UserWarning, stacklevel=2)
        return [_qconf_file.entry(op, self.qconfig, self.weight_bits) for op in self._graph.ops]

    def save_qconf_summary(self, qconf_summary) -> None:
        """Write the calibration result to the JSON file ``qconf_summary`` (IPEX's name). ValueError, and no
        file written, where the result is one load_qconf_summary would refuse (a scale out of range)."""
        summary = self.qconf_summary()
        _qconf_file.validate(summary, self._graph.ops, "save_qconf_summary")
        _qconf_file.save(summary, qconf_summary)

    def load_qconf_summary(self, qconf_summary) -> None:
        """Read a JSON summary saved by save_qconf_summary (possibly edited); convert() then uses it instead of the
        observers. A file that does not match this model raises ValueError naming the first mismatch and
        changes nothing."""
        self._loaded = _qconf_file.load(qconf_summary, self._graph.ops)

    def ops(self) -> list[str]:
        """One line per quantizable op: id, name, type."""
        return [f"{op.id}: {op.name} ({op.kind})" for op in self._graph.ops]


def _as_call(example_inputs):
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, dict) and example_inputs:
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)) and example_inputs:
        return tuple(example_inputs), {}
    raise TypeError("example_inputs must be a tensor, a non-empty tuple of positional inputs or a dict of keyword "
                    f"inputs, got {type(example_inputs).__name__}")


def prepare(model, qconfig=default_static_qconfig, example_inputs=None, inplace=False) -> PreparedModel:
    """Fold BatchNorms and remove dropouts (ipex_train.inference passes), record the model's quantizable ops by
    running it once on ``example_inputs``, and attach observers; returns the PreparedModel to calibrate.

    Args:
        model: an eager nn.Module in eval mode, on the CPU, in fp32.
        qconfig: a QConfig (default_static_qconfig, symmetric_static_qconfig or your own).
        example_inputs: one input batch: a tensor, a tuple of positional inputs or a dict of keyword inputs. Its
            forward pass fixes the op list (ids and names of the JSON summary); it is not a calibration batch.
        inplace: modify ``model`` itself (folding, observer hooks) instead of a deep copy.

    Raises TypeError/ValueError for bad arguments before anything is modified.
    """
    if not isinstance(model, nn.Module) or isinstance(model, torch.jit.ScriptModule):
        raise TypeError(f"prepare(): model must be an eager torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, (PreparedModel, QuantizedModel)):
        raise TypeError(f"prepare(): model is already a {type(model).__name__}; pass the fp32 model")
    if model.training:
        raise ValueError("prepare(): model is in training mode; call model.eval() first (calibration must see "
                         "BatchNorm running statistics and no dropout)")
    if not isinstance(qconfig, QConfig):
        raise TypeError(f"prepare(): qconfig must be an ipex_train.quantization.QConfig, got "
                        f"{type(qconfig).__name__}")
    if example_inputs is None:
        raise TypeError("prepare(): example_inputs is required (one input batch, to record the model's ops)")
    args, kwargs = _as_call(example_inputs)
    if not isinstance(inplace, bool):
        raise TypeError(f"prepare(): inplace must be a bool, got {type(inplace).__name__}")
    bad = [p for p in (*model.parameters(), *model.buffers()) if p.device.type != "cpu"]
    if bad:
        raise ValueError(f"prepare(): the model has tensors on {bad[0].device}; int8 runs on the CPU")
    if any(p.is_floating_point() and p.dtype != torch.float32 for p in model.parameters()):
        raise ValueError("prepare(): the model must be fp32 (calibrate the fp32 model, not a bf16 one)")
    bits = weight_bits(qconfig.weight_bits)
    if not inplace:
        model, _ = copy_model(model)
    from ..inference import fold_conv_bn, fold_linear_bn, replace_dropout

    sample = example_inputs if not isinstance(example_inputs, list) else tuple(example_inputs)
    fold_conv_bn(model, sample)
    fold_linear_bn(model, sample)
    replace_dropout(model)
    graph = Graph(model, qconfig)
    recorder = Recorder(graph, observe=False, discover=True)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]), recorder:
            model(*args, **kwargs)
    except BaseException:
        graph.remove_hooks(model)
        raise
    graph.number(recorder.seen)
    return PreparedModel(model, graph, qconfig, bits)


def convert(prepared, inplace=False, *, backend="eager", example_inputs=None, dynamic_dims=None,
            dynamic_shapes=None, fuse_linears=True, bf16_attention=None):
    """Build the int8 model from a calibrated (or summary-loaded) PreparedModel.

    backend="eager" (default): Conv/Linear ops whose summary entry has every input quantized become torch quantized
    modules (relu fused when post_op is "relu"); int8 residual adds run quantized::add/add_relu; everything else
    stays fp32. ``inplace`` reuses the prepared model's module tree (the prepared model cannot be used
    afterwards); by default it is copied. The result traces and freezes (torch.jit.trace + torch.jit.freeze) for
    torch.jit.save, or ipex_train.inference.export(..., backend="torchscript").

    backend="pt2e": the same summary lowered for Inductor as a torchao pt2e quantize/dequantize graph (a
    torch.fx.GraphModule; see pt2e.py for what maps), captured with torch.export on ``example_inputs`` (a tensor
    or a tuple of them; required) with ``dynamic_dims`` of every input dynamic (or ``dynamic_shapes`` as
    torch.export takes it); ``dynamic_dims`` None: what export(backend="aoti") makes dynamic by default, batch
    and sequence of token ids (integer or bool inputs of rank 2) and the batch of other inputs, or no dim when a
    convolution is quantized (Inductor pre-packs int8 convolution weights only for static shapes); the dims that
    became dynamic are logged at INFO. Compile it with torch.compile, or package it with
    ipex_train.inference.export(..., backend="aoti", path=...) using the same dynamic dims (its default follows
    the same rule). ``fuse_linears`` (pt2e only; default True): linears that read the same tensor with the same
    input scale (attention's Q/K/V) become one int8 GEMM over the concatenated weights, each output channel keeping
    its own weight scale; False keeps one GEMM per layer. ``bf16_attention`` (pt2e only): the
    attention's two batched matmuls (Q K^T, P V), which pt2e leaves in fp32, run in bf16 (softmax in fp32);
    False keeps them fp32; None (default): True on a CPU with bf16 arithmetic (avx512_bf16, AMX, avx_ne_convert),
    False elsewhere, where bf16 matmuls are slower than fp32 ones (decided where convert runs: pass it explicitly
    for a package built on one machine and served on another).
    When torch.export cannot capture the model (or the quantizer annotates a tensor no summary entry describes) it
    warns, naming what failed, and returns the eager int8 model instead. ``inplace`` must be False.

    The summary passes the same check as load_qconf_summary (ValueError naming the op and key, nothing changed),
    so a calibration that produced a scale the int8 kernels cannot use is refused here, not turned into NaNs.
    """
    if backend not in ("eager", "pt2e"):
        raise ValueError(f"convert(): backend must be 'eager' or 'pt2e', got {backend!r}")
    if backend == "pt2e":
        return _convert_pt2e(prepared, inplace, example_inputs, dynamic_dims, dynamic_shapes, fuse_linears,
                             bf16_attention)
    _check_eager(prepared, inplace)
    summary = prepared.qconf_summary()
    graph = prepared._graph
    _qconf_file.validate(summary, graph.ops, "convert()")
    model = prepared.model if inplace else copy_model(prepared.model)[0]
    with engine_scope(), torch.no_grad():
        layers, adds, fp32 = _int8_parts(model, graph, summary)
    graph.remove_hooks(model)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in layers:
                setattr(parent, name, layers[id(child)])
    model = layers.get(id(model), model)  # the model may itself be a single Conv/Linear
    if inplace:
        prepared._converted = True
    return QuantizedModel(model, adds, summary, fp32).eval()


def _check_eager(prepared, inplace) -> None:
    if isinstance(prepared, QuantizedModel):
        raise TypeError("convert(): prepared is already converted (a QuantizedModel); convert the PreparedModel "
                        "returned by prepare() once")
    if not isinstance(prepared, PreparedModel):
        raise TypeError(f"convert(): prepared must be the PreparedModel returned by prepare(), got "
                        f"{type(prepared).__name__}")
    if prepared._converted:
        raise RuntimeError("convert(): this prepared model was already converted in place")
    if not isinstance(inplace, bool):
        raise TypeError(f"convert(): inplace must be a bool, got {type(inplace).__name__}")
    if prepared.training or prepared.model.training:
        raise ValueError("convert(): the prepared model is in training mode; call .eval() on it")


def _int8_parts(model, graph, summary):
    """The int8 layers (by id of the module they replace), the int8 adds (by their input names) and the reasons
    the other ops stay fp32, for the summary ``summary`` of ``graph``."""
    layers, adds, fp32 = {}, {}, []
    for op, e in zip(graph.ops, summary):
        if not _qconf_file.int8(e):
            never = any(v is None for v in e["input_scales"])
            fp32.append(f"{op.name} ({op.kind}): " + ("never ran during calibration" if never
                                                       else "inputs_quantized is false in the summary"))
        elif op.module is None:
            key = tuple(f.removesuffix(".output0") for f in op.inputs_flow)
            adds[key] = AddPlan(op.name, e["output_scales"][0], e["output_zero_points"][0],
                                e["post_op"] == "relu", e["outputs_quantized"][0])
        else:
            source = model.get_submodule(op.name)
            reason = _unsupported(source)
            if reason:
                fp32.append(f"{op.name} ({op.kind}): {reason}")
            else:
                layers[id(source)] = _int8_layer(op, source, e)
    return layers, adds, fp32


def _convert_pt2e(prepared, inplace, example_inputs, dynamic_dims, dynamic_shapes, fuse_linears, bf16_attention):
    from . import pt2e

    if not isinstance(prepared, PreparedModel):
        raise TypeError(f"convert(): prepared must be the PreparedModel returned by prepare(), got "
                        f"{type(prepared).__name__}")
    if inplace is not False:
        raise ValueError("convert(): inplace must be False with backend='pt2e' (the graph is a new module)")
    if not isinstance(fuse_linears, bool):
        raise TypeError(f"convert(): fuse_linears must be a bool, got {type(fuse_linears).__name__}")
    if bf16_attention is None:
        from .. import compute_policy

        bf16_attention = compute_policy.cpu_has_native_bf16()
    elif not isinstance(bf16_attention, bool):
        raise TypeError(f"convert(): bf16_attention must be a bool or None, got {type(bf16_attention).__name__}")
    if example_inputs is None:
        raise TypeError("convert(): backend='pt2e' needs example_inputs (a tensor or a tuple of them) for "
                        "torch.export")
    args, kwargs = _as_call(example_inputs)
    if kwargs:
        raise TypeError("convert(): backend='pt2e' takes positional example_inputs (a tensor or a tuple), not a dict")
    if prepared._converted:
        raise RuntimeError("convert(): this prepared model was already converted in place")
    summary = prepared.qconf_summary()
    _qconf_file.validate(summary, prepared._graph.ops, "convert()")
    model, _ = copy_model(prepared.model)
    prepared._graph.remove_hooks(model)
    try:
        return pt2e.lower(model.eval(), summary, args, dynamic_shapes, dynamic_dims, fuse_linears,
                          bf16_attention)
    except pt2e.LoweringError as e:
        pt2e.fallback_warning(str(e))
    return convert(prepared)


_CHANNELS_LAST = {nn.Conv2d: torch.channels_last, nn.Conv3d: torch.channels_last_3d}
_BATCHED_RANK = {nn.Conv1d: 3, nn.Conv2d: 4, nn.Conv3d: 5}


def _unsupported(m: nn.Module) -> str | None:
    if isinstance(m, nn.modules.conv._ConvNd):
        if isinstance(m.padding, str):
            return f"padding={m.padding!r} (the quantized conv takes explicit padding)"
        if m.padding_mode != "zeros":
            return f"padding_mode={m.padding_mode!r}"
    if m.weight.dtype != torch.float32:
        return f"weight dtype {m.weight.dtype}"
    return None


def _int8_layer(op, m: nn.Module, e: dict) -> Int8Layer:
    relu = e["post_op"] == "relu"
    cls = QUANTIZED[type(m)][relu]
    if isinstance(m, nn.Linear):
        q = cls(m.in_features, m.out_features)
    else:
        q = cls(m.in_channels, m.out_channels, m.kernel_size, stride=m.stride, padding=m.padding,
                dilation=m.dilation, groups=m.groups)
    q.set_weight_bias(_quantize_weight(m.weight, e), None if m.bias is None else m.bias.detach().float())
    q.scale, q.zero_point = float(e["output_scales"][0]), int(e["output_zero_points"][0])
    return Int8Layer(op.name, q, float(e["input_scales"][0]), int(e["input_zero_points"][0]),
                     e["outputs_quantized"][0], relu, _CHANNELS_LAST.get(type(m)), _BATCHED_RANK.get(type(m)))


def _quantize_weight(weight: torch.Tensor, e: dict) -> torch.Tensor:
    """int8 weight from the summary's scales, clamped to its weight_quant_range (7 bits keep pair sums exact)."""
    lo, hi = e["weight_quant_range"]
    scales = torch.tensor(e["weight_scales"][0], dtype=torch.double)
    w = weight.detach().double()
    shape = (-1,) + (1,) * (w.dim() - 1)
    q = torch.clamp(torch.round(w / scales.reshape(shape) if len(scales) > 1 else w / scales), lo, hi)
    q = q.to(torch.int8)
    if len(scales) > 1:
        return torch._make_per_channel_quantized_tensor(q, scales, torch.zeros(len(scales), dtype=torch.long), 0)
    return torch._make_per_tensor_quantized_tensor(q, float(scales[0]), 0)


def fp32_ops(quantized: QuantizedModel, example_inputs=None) -> list[str]:
    """What stays fp32 in a converted model, one line each: the Conv/Linear/add ops kept fp32 and why, then, with
    ``example_inputs``, the torch calls that ran in fp32 on one forward pass, with their counts ("fp32 call:
    matmul x8")."""
    if not isinstance(quantized, QuantizedModel):
        raise TypeError(f"fp32_ops(): quantized must be a QuantizedModel from convert(), got "
                        f"{type(quantized).__name__}")
    lines = list(quantized._fp32)
    if example_inputs is not None:
        args, kwargs = _as_call(example_inputs)
        for name, n in sorted(quantized.fp32_calls(*args, **kwargs).items()):
            lines.append(f"fp32 call: {name} x{n}")
    return lines
