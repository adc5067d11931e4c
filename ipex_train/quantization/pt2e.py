"""INT8 for Inductor: a prepared model's qconf summary lowered as a torchao pt2e quantize/dequantize graph.

torchao's pt2e flow does the graph work: torch.export capture, X86InductorQuantizer's annotation (which
tensors get quantize/dequantize pairs so that Inductor's oneDNN lowering fuses conv/linear with relu, residual
adds and requantisation), prepare_pt2e (observers on the annotated edges) and convert_pt2e (observers become
quantize/dequantize ops, weights int8 constants). ipex_train replaces calibration: every observer gets its
scale and zero point from the summary (the observers' result, or a JSON file from load_qconf_summary), so the
JSON still decides them. How the summary maps:

* a Conv/Linear entry with inputs_quantized false: the layer is left fp32 (set_module_name_qconfig(name, None));
* weight_scales and weight_quant_range: the layer's weight quantization (zero point 0; a per-tensor scale is
  repeated on every channel of the quantizer's per-channel scheme, which computes the same);
* output_scales/output_zero_points of a Conv/Linear (after its fused relu) or of an add (after its relu): the
  quantize/dequantize pair on that tensor, also through max-pooling, average pooling and flatten/reshape, which
  keep their input's scale as ipex_train's eager kernels do;
* input_scales/input_zero_points: tensors no quantized op produced (the model input, an add written in place
  or with outputs_quantized false), from the Conv/Linear that reads them.
Before the quantizer runs, linears that read the same tensor with the same input scale (attention's Q/K/V) are
fused into one (inference.graph_passes), the fused weight keeping each layer's per-channel scales (fuse_entries).
Dims: by default those export(backend="aoti") makes dynamic, batch and sequence of token ids (integer inputs of
rank 2) and the batch of other inputs, except when a convolution is quantized (static shapes, as export compiles
such graphs by default: Inductor pre-packs int8 convolution weights only for a static input shape); logged at INFO.
Kept fp32 whatever the summary says, when dims are dynamic: convolutions with one input channel (torch 2.14.1's
Inductor writes their int8 output in the wrong layout for a dynamic batch; they are cheap in fp32). Not mapped:
post_op (Inductor fuses every relu it can), inputs_quantized of an add (Inductor decides whether the add fuses into
the conv), and dtypes (uint8 activations, int8 weights: the only ones both take). A tensor the quantizer annotates
but no summary entry describes stops the lowering: convert() then falls back to the eager int8 model, naming the
tensor.
"""
from __future__ import annotations

import functools
import logging
import warnings

import torch
from torch import nn

from ..inference.aoti import DEFAULT_DIMS_WHY, capture, dynamic_dims_of, dynamic_shapes_for, token_aware_shapes
from ..inference.graph_passes import attention_matmuls_in, fuse_shared_input_linears
from ..inference.input_checks import expected_shapes

_log = logging.getLogger("ipex_train")

_CONV_LINEAR = {torch.ops.aten.conv1d.default, torch.ops.aten.conv2d.default, torch.ops.aten.conv3d.default,
                torch.ops.aten.linear.default}
_ADD = {torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor}
# Ops that keep their input's quantization (ipex_train's eager int8 runs them on the int8 tensor as is).
_KEEP_SCALE = {torch.ops.aten.relu.default, torch.ops.aten.relu_.default, torch.ops.aten.max_pool2d.default,
               torch.ops.aten.adaptive_avg_pool2d.default, torch.ops.aten.avg_pool2d.default,
               torch.ops.aten.flatten.using_ints, torch.ops.aten.reshape.default, torch.ops.aten.view.default,
               torch.ops.aten.mean.dim}


class LoweringError(RuntimeError):
    """The summary cannot be lowered to a pt2e graph (capture failed, or a tensor has no summary entry)."""


def lower(model: nn.Module, summary: list[dict], args: tuple, dynamic_shapes=None, dynamic_dims=None,
          fuse_linears=True, bf16_attention=True):
    """The converted pt2e GraphModule of ``model`` (the prepared fp32 copy, hooks removed) with the summary's
    scales; LoweringError naming what failed. ``dynamic_dims`` and ``dynamic_shapes`` None: batch and sequence
    of integer inputs of rank 2 (token ids) and the batch of other inputs dynamic, as export(backend="aoti")'s
    default, unless the summary quantizes a convolution (static shapes, as export compiles such graphs).
    ``fuse_linears``: linears reading the same tensor with the same int8 input quantization (attention's Q/K/V)
    become one int8 GEMM over the concatenated weights before the quantizer runs (see fuse_entries).
    ``bf16_attention``: the attention's two fp32 batched matmuls (scores, context) run in bf16 in the converted
    graph, the softmax in fp32 (graph_passes.attention_matmuls_in)."""
    from torchao.quantization.pt2e import move_exported_model_to_eval
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    shapes, why = _dynamic_shapes(summary, args, dynamic_shapes, dynamic_dims)
    kept = [e["name"] for e in summary if e["type"].startswith("conv") and all(e["inputs_quantized"])
            and model.get_submodule(e["name"]).in_channels == 1] if dynamic_shapes or dynamic_dims else []
    if kept:
        _log.info("ipex_train.quantization.convert(backend='pt2e'): %s kept fp32 (one input channel: torch 2.14.1 "
                  "Inductor miscompiles such int8 convolutions for a dynamic batch)", ", ".join(kept))
    entries = {e["name"]: e for e in summary}
    errors = []
    for strict in (True, False):  # strict first: non-strict capture breaks X86InductorQuantizer on reused modules
        try:
            ep = capture(model, args, dynamic_shapes=shapes, strict=strict)
            gm = ep.module()
            fused = fuse_shared_input_linears(gm, functools.partial(_same_quantization, entries)) \
                if fuse_linears else {}
            prepared = prepare_pt2e(gm, _quantizer(summary, kept))
            break
        except Exception as e:  # noqa: BLE001 -- capture and annotation raise many types; each means "try the next"
            errors.append(str(e) if isinstance(e, RuntimeError) else f"prepare_pt2e (strict={strict}): "
                          f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
    else:
        raise LoweringError("; ".join(errors))
    _log.info("ipex_train.quantization.convert(backend='pt2e'): dynamic input dims %s (%s); the graph takes %s",
              ", ".join(dynamic_dims_of(ep)) or "none", why, expected_shapes(ep))
    if fused:
        _log.info("ipex_train.quantization.convert(backend='pt2e'): %d groups of linears sharing their input fused "
                  "into one int8 GEMM each", len(fused))
    _set_qparams(prepared, {**entries, **fuse_entries(entries, fused, model)})
    converted = move_exported_model_to_eval(convert_pt2e(prepared))
    if bf16_attention:
        _log.info("ipex_train.quantization.convert(backend='pt2e'): %d attention matmuls run in bf16",
                  attention_matmuls_in(converted))
    for m in converted.modules():  # captured from an eval model; the flag says so (exported modules refuse .eval())
        m.training = False
    return converted


def _dynamic_shapes(summary, args, dynamic_shapes, dynamic_dims):
    """torch.export dynamic_shapes for convert()'s arguments and why (for the log): as export(backend="aoti")
    decides them by default, batch and sequence of token ids (integer inputs of rank 2) and the batch of other
    inputs, but static shapes when a convolution is quantized (Inductor pre-packs int8 convolution weights only
    for a static input shape)."""
    if dynamic_shapes is not None:
        return dynamic_shapes, "dynamic_shapes"
    if dynamic_dims is not None:
        return dynamic_shapes_for(args, dynamic_dims), f"dynamic_dims={dynamic_dims}"
    if any(e["type"].startswith("conv") and all(e["inputs_quantized"]) for e in summary):
        return dynamic_shapes_for(args, ()), ("default with an int8 convolution: static shapes, which Inductor "
                                              "pre-packs its weights for; dynamic_dims=(0,) for a dynamic batch")
    return token_aware_shapes(args), DEFAULT_DIMS_WHY


def _same_quantization(entries, names) -> bool:
    """Whether the layers ``names`` may run as one GEMM: all in the summary, all int8 with the same input scale,
    zero point and weight range, or all fp32."""
    es = [entries.get(n) for n in names]
    if any(e is None for e in es):
        return False
    if not all(all(e["inputs_quantized"]) for e in es):
        return not any(all(e["inputs_quantized"]) for e in es)
    key = {(tuple(e["input_scales"]), tuple(e["input_zero_points"]), tuple(e["weight_quant_range"])) for e in es}
    return len(key) == 1


def fuse_entries(entries: dict, fused: dict, model: nn.Module) -> dict:
    """Summary entries of the fused layers: the first member's, with the members' weight scales concatenated per
    output channel (a per-tensor scale repeated on each of its layer's channels), so every output channel keeps
    the scale it had in its own layer. Fused fp32 layers have no weight scales."""
    out = {}
    for name, members in fused.items():
        scales = []
        for m in members:
            s = entries[m]["weight_scales"][0] if entries[m]["weight_scales"] else []
            scales += s * model.get_submodule(m).weight.shape[0] if len(s) == 1 else list(s)
        out[name] = {**entries[members[0]], "name": name, "weight_scales": [scales] if scales else []}
    return out


def _quantizer(summary, kept_fp32):
    import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer as xiq

    quantizer = xiq.X86InductorQuantizer()
    quantizer.set_global(xiq.get_default_x86_inductor_quantization_config())
    for e in summary:
        if e["type"] != "add" and (not all(e["inputs_quantized"]) or e["name"] in kept_fp32):
            quantizer.set_module_name_qconfig(e["name"], None)
    return quantizer


@functools.cache
def _fixed_observer():
    """The observer class whose result is given (scale/zero point per tensor or per channel, quant range);
    an ObserverBase, which is how convert_pt2e recognises observers. Built on first use: torchao loads lazily."""
    from torchao.quantization.pt2e.observer import ObserverBase

    class FixedQParams(ObserverBase):
        def __init__(self, like, scale, zero_point, quant_min, quant_max):
            super().__init__(dtype=like.dtype, is_dynamic=False)
            self.qscheme, self.ch_axis = like.qscheme, getattr(like, "ch_axis", 0)
            self.quant_min, self.quant_max = quant_min, quant_max
            self.register_buffer("scale", torch.tensor(scale, dtype=torch.float).reshape(-1))
            self.register_buffer("zero_point", torch.tensor(zero_point, dtype=torch.int64).reshape(-1))

        def forward(self, x):
            return x

        def calculate_qparams(self):
            return self.scale, self.zero_point

    return FixedQParams


def _layer_name(node):
    """The module name of a conv/linear call, from its weight (get_attr "layer1.0.conv1.weight")."""
    weight = node.args[1]
    while weight.op == "call_module":  # through the weight observer
        weight = weight.args[0]
    return weight.target.rsplit(".", 1)[0] if weight.op == "get_attr" else None


def _root(node):
    """The node that computed this tensor's values, past observers and ops that keep the scale."""
    while node.op == "call_module" or (node.op == "call_function" and node.target in _KEEP_SCALE):
        node = node.args[0]
    return node


def _producer_entry(node, entries):
    """The summary entry whose int8 output is this tensor, or None."""
    root = _root(node)
    if root.op != "call_function":
        return None
    if root.target in _CONV_LINEAR:
        e = entries.get(_layer_name(root))
    elif root.target in _ADD:
        parents = []
        for a in root.args[:2]:
            a = _root(a)
            parents.append(_layer_name(a) if a.op == "call_function" and a.target in _CONV_LINEAR else None)
        e = next((e for e in entries.values() if e["type"] == "add" and [f and f.removesuffix(".output0")
                  for f in e["inputs_flow"]] == parents), None)
    else:
        return None
    return e if e is not None and all(e["outputs_quantized"]) and all(e["inputs_quantized"]) else None


def _consumer_entry(observer_node, entries):
    """The entry of the first Conv/Linear reading this tensor, through ops that keep its scale; or None."""
    frontier, seen = [observer_node], set()
    while frontier:
        node = frontier.pop(0)
        for user in node.users:
            if user in seen:
                continue
            seen.add(user)
            if user.op == "call_function" and user.target in _CONV_LINEAR and user.args[0] is node:
                e = entries.get(_layer_name(user))
                if e is not None and all(e["inputs_quantized"]):
                    return e
            elif user.op == "call_module" or (user.op == "call_function" and user.target in _KEEP_SCALE):
                frontier.append(user)
    return None


def _set_qparams(gm, entries):
    fixed = _fixed_observer()
    for node in list(gm.graph.nodes):
        obs = getattr(gm, node.target) if node.op == "call_module" else None
        if obs is None or not hasattr(obs, "calculate_qparams"):
            continue
        src = node.args[0]
        if src.op == "get_attr":
            e = entries.get(src.target.rsplit(".", 1)[0])
            if e is None or not e["weight_scales"]:
                raise LoweringError(f"weight {src.target} has no Conv/Linear entry in the qconf summary")
            lo, hi = e["weight_quant_range"]
            scales = e["weight_scales"][0]
            if len(scales) == 1:  # per-tensor weights: the same scale on every channel of the per-channel scheme
                scales = scales * gm.get_parameter(src.target).shape[0]
            new = fixed(obs, scales, [0] * len(scales), lo, hi)
        else:
            e = _producer_entry(src, entries)
            if e is not None:
                scale, zp = e["output_scales"][0], e["output_zero_points"][0]
            else:
                e = _consumer_entry(node, entries)
                if e is None:
                    raise LoweringError(f"the quantizer quantizes tensor {src.name} ({src.target}), which no qconf "
                                        "summary entry produces or reads")
                scale, zp = e["input_scales"][0], e["input_zero_points"][0]
            new = fixed(obs, [scale], [zp], obs.quant_min, obs.quant_max)
        setattr(gm, node.target, new)


def fallback_warning(reason: str) -> None:
    """Say that convert(backend="pt2e") returned the eager int8 model instead, and why."""
    msg = (f"ipex_train.quantization.convert(backend='pt2e'): {reason}. Returning the eager int8 model (deploy it "
           "with ipex_train.inference.export(..., backend='torchscript'))")
    warnings.warn(msg, RuntimeWarning, stacklevel=3)
    _log.warning(msg)

