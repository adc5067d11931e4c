"""AOTInductor export: torch.export capture + Inductor ahead-of-time compilation (with freezing) into a ``.pt2``
package that plain torch loads (``torch._inductor.aoti_load_package(path)``), no ipex_train or Python model code
needed. This is the current torch route on the CPU; TorchScript (jit.py) is deprecated in torch 2.14.

What the package holds: the compiled C++ for the captured graph, with weights folded as constants (freezing lets
Inductor pre-pack them for oneDNN and fuse conv/linear with their post-ops). bf16 packages take fp32 (or bf16)
inputs and cast them inside, as the TorchScript bf16 export does, and return bf16. int8: pass the graph that
ipex_train.quantization.convert(prepared, backend="pt2e", ...) returns; Inductor lowers its quantize/dequantize
pattern to oneDNN int8 kernels (qconv/qlinear with fused post-ops and residual adds).

Graph passes (graph_passes.py), on the captured graph before Inductor compiles it, each with an AOTIConfig switch:
linears sharing their input fused into one GEMM (attention's Q/K/V), and attention's softmax written out so that
Inductor keeps the attention matmuls as oneDNN GEMMs instead of its CPU flash attention kernel.

Dynamic shapes: by default dim 0 (the batch) of every tensor input is marked torch.export.Dim.AUTO, and dim 1 too
(the sequence) of integer or bool inputs of rank 2 (token ids, attention masks): a dim stays dynamic unless the
model specialises it (a reshape to a fixed batch, or an example of size 1, which torch.export
always specialises). One exception, models with convolutions: they compile for the example's shapes, because
Inductor pre-packs convolution weights for oneDNN only when the input shape is static; with a symbolic batch it
packs fp32/bf16 weights at run time on every call, and int8 ones (torchao's x86 lowering) for no input shape, which
oneDNN then re-orders when it runs (ResNet-50 batch 16, int8: 0.63-0.67x the static package in three processes,
0.98x in a fourth; fp32/bf16: 0.96-0.97x). AOTIConfig(dynamic_dims=(0,)) asks for a dynamic batch there anyway.
AOTIConfig.dynamic_dims applies one rule to every input; AOTIConfig.dynamic_shapes is handed to torch.export as is
when the automatic rule does not fit. The dims that ended up dynamic, why, and the shapes the package takes are
logged at INFO.

Input checks (input_checks.py): every package refuses, in its compiled code, inputs of shapes, dtypes or strides it
was not compiled for, with a RuntimeError naming the given and expected shapes (torch's package would return a
wrong-shaped result or abort). Outputs: a model returning a container torch alone cannot rebuild (a transformers
ModelOutput) is exported returning the tuple of its tensors, so the package loads with torch alone.

Self-check: the package is loaded once after compiling and run on a copy of example_inputs against the model (cosine of
each output >= 0.99: a miscompile check, not a precision one). A dynamic-shape package that fails it is
recompiled with static shapes, with a warning (torch 2.14.1 miscompiles int8 convolutions with one input channel
for a dynamic batch); a static one that fails raises RuntimeError.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import os
import traceback
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_leaves, tree_map

from . import input_checks
from .graph_passes import fuse_shared_input_linears, write_out_attention_softmax

_log = logging.getLogger("ipex_train")

DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class AOTIConfig:
    """Settings of export(..., backend="aoti").

    Args:
        dtype: torch.float32 (default) or torch.bfloat16 (weights and compute in bf16; fp32 inputs are cast inside).
            Must stay float32 for an int8 graph from quantization.convert(backend="pt2e"), which fixes its dtypes.
        dynamic_dims: dims marked torch.export.Dim.AUTO on every tensor input ((0,): batch; (0, 1): batch and
            sequence of token ids; (): fully static). None (default): per input, (0, 1) for integer or bool
            tensors of rank 2 (token ids, attention masks), (0,) for other tensors, and () everywhere for a model
            with convolutions (see the module docstring: their weights are pre-packed only for static shapes).
        dynamic_shapes: handed to torch.export.export as is (overrides dynamic_dims).
        strict: torch.export's strict (TorchDynamo) capture; False (torch's default) traces more Python.
        freezing: Inductor's freezing (weights as constants, pre-packed for oneDNN); keep it on for inference.
        inductor_configs: further torch._inductor.config options for aoti_compile_and_package.
        fuse_linears: fuse linears that read the same tensor (attention's Q/K/V) into one GEMM over concatenated
            weights, split after (graph_passes.fuse_shared_input_linears; exact). False keeps them apart.
        write_out_softmax: write attention's softmax (a last-dim softmax whose result multiplies V) out as
            exp / sum (graph_passes.write_out_attention_softmax), so that Inductor keeps the two matmuls as oneDNN
            batched GEMMs instead of replacing the block with its CPU flash attention kernel (slower at BERT
            sizes). False leaves the softmax to Inductor.
        check_inputs: compile input checks into the package (input_checks.py): a call with shapes, dtypes or
            strides the package was not compiled for raises RuntimeError naming the given and expected shapes
            (without them torch's package returns a wrong-shaped result or aborts the process). Keep it on;
            False exists to measure what the checks cost.
    """

    dtype: torch.dtype = torch.float32
    dynamic_dims: tuple | None = None
    dynamic_shapes: object = None
    strict: bool = False
    freezing: bool = True
    inductor_configs: dict = field(default_factory=dict)
    fuse_linears: bool = True
    write_out_softmax: bool = True
    check_inputs: bool = True

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"AOTIConfig: dtype must be torch.float32 or torch.bfloat16, got {self.dtype!r}")
        dims = self.dynamic_dims
        if dims is not None and (not isinstance(dims, tuple) or not all(type(d) is int and d >= 0 for d in dims)):
            raise TypeError(f"AOTIConfig: dynamic_dims must be None or a tuple of non-negative ints, got {dims!r}")
        for name in ("strict", "freezing", "fuse_linears", "write_out_softmax", "check_inputs"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"AOTIConfig: {name} must be a bool, got {type(getattr(self, name)).__name__}")
        if not isinstance(self.inductor_configs, dict):
            raise TypeError(f"AOTIConfig: inductor_configs must be a dict, got "
                            f"{type(self.inductor_configs).__name__}")


def dynamic_shapes_for(args: tuple, dims: tuple):
    """torch.export dynamic_shapes marking ``dims`` of every tensor in ``args`` as Dim.AUTO (dims past a tensor's
    rank are skipped)."""
    auto = torch.export.Dim.AUTO
    return tree_map(lambda t: {d: auto for d in dims if d < t.dim()} if isinstance(t, torch.Tensor) else None,
                    tuple(args))


def default_dynamic_shapes(model: nn.Module, args: tuple):
    """The dynamic_shapes AOTIConfig(dynamic_dims=None) gives torch.export: batch and sequence of integer or bool
    inputs of rank 2 (token ids, attention masks), the batch of other tensors; every shape static for a model
    with convolutions (default_dynamic_dims)."""
    if not default_dynamic_dims(model):
        return dynamic_shapes_for(args, ())
    return token_aware_shapes(args)


def token_aware_shapes(args: tuple):
    """torch.export dynamic_shapes marking batch and sequence (dims 0 and 1) of integer or bool inputs of rank 2
    (token ids, attention masks) and the batch of other tensors as Dim.AUTO."""
    auto = torch.export.Dim.AUTO

    def dims(t):
        if not isinstance(t, torch.Tensor):
            return None
        token_like = t.dim() == 2 and not t.is_floating_point() and not t.is_complex()
        return {d: auto for d in ((0, 1) if token_like else (0,)) if d < t.dim()}
    return tree_map(dims, tuple(args))


DEFAULT_DIMS_WHY = "default: batch, and sequence of integer inputs of rank 2"


# Output containers a package's output spec can hold and still load with torch alone.
_BUILTIN_OUTPUTS = (tuple, list, dict)


def needs_flat_outputs(out) -> bool:
    """Whether ``out`` holds a container type torch alone cannot rebuild when it loads a package (a transformers
    ModelOutput, a namedtuple, a dataclass registered with pytree)."""
    if isinstance(out, torch.Tensor) or out is None:
        return False
    if type(out) not in _BUILTIN_OUTPUTS:
        return True
    return any(needs_flat_outputs(v) for v in (out.values() if isinstance(out, dict) else out))


class _Deployed(nn.Module):
    """What export captures: ``model`` on inputs cast to ``dtype`` (a bf16 copy takes fp32 inputs, as the
    TorchScript bf16 export does), its outputs flattened to a tuple of tensors when ``flatten``."""

    def __init__(self, model: nn.Module, dtype=None, flatten=False):
        super().__init__()
        self.model, self.dtype, self.flatten = model, dtype, flatten

    def forward(self, *args):
        if self.dtype is not None:
            args = tree_map(lambda t: t.to(self.dtype) if isinstance(t, torch.Tensor) and t.is_floating_point()
                            else t, args)
        out = self.model(*args)
        return tuple(tree_leaves(out)) if self.flatten else out


def capture(model: nn.Module, args: tuple, *, dynamic_shapes=None, dynamic_dims=(0,), strict=False):
    """torch.export.export of ``model`` (eval, no_grad) on ``args``; RuntimeError naming what failed."""
    shapes = dynamic_shapes if dynamic_shapes is not None else dynamic_shapes_for(args, dynamic_dims)
    if isinstance(model, _Deployed):
        shapes = (shapes,)  # its forward(*args) takes the inputs as one tuple argument
    try:
        with torch.no_grad():
            return torch.export.export(model, args, dynamic_shapes=shapes, strict=strict)
    except Exception as e:  # torch.export raises many types; all mean "cannot capture"
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise RuntimeError(f"torch.export (strict={strict}) could not capture {type(model).__name__}: "
                           f"{type(e).__name__}: {first}{_model_frame(e)}") from e


def _model_frame(error: BaseException) -> str:
    """" (at file.py:line in fn)" for the innermost traceback frame outside torch, i.e. the model code torch.export
    was running when it failed; "" when there is none."""
    torch_dir = os.path.dirname(torch.__file__)
    frames = [f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith(torch_dir)
              and not f.filename.startswith(os.path.dirname(__file__))]
    return f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""


def apply_passes(ep, args, config: AOTIConfig, *, dynamic_dims=(0,), dynamic_shapes=None):
    """``ep`` after the graph passes ``config`` asks for (graph_passes: linears sharing their input fused,
    attention softmax written out), re-captured with the same dynamic shapes (``dynamic_shapes``, else
    config.dynamic_shapes, else ``dynamic_dims`` on every input) so that Inductor gets an ExportedProgram; ``ep``
    itself when no pass changed anything."""
    gm = ep.module()
    fused = fuse_shared_input_linears(gm) if config.fuse_linears else {}
    softmaxes = write_out_attention_softmax(gm) if config.write_out_softmax else 0
    if not fused and not softmaxes:
        return ep
    _log.info("ipex_train.inference.export(backend='aoti'): %d groups of linears sharing their input fused, %d "
              "attention softmaxes written out", len(fused), softmaxes)
    # ep.module() takes the inputs positionally (also for _Deployed, whose forward packs them in one tuple)
    shapes = dynamic_shapes if dynamic_shapes is not None else config.dynamic_shapes \
        if config.dynamic_shapes is not None else dynamic_shapes_for(args, dynamic_dims)
    with torch.no_grad():
        return torch.export.export(gm, tuple(args), dynamic_shapes=shapes, strict=False)


def dynamic_dims_of(ep) -> list[str]:
    """The symbolic input dims of an ExportedProgram, as "input0[0]" strings."""
    found, i = [], 0
    for node in ep.graph.nodes:
        if node.op == "placeholder" and node.name in ep.graph_signature.user_inputs:
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                found += [f"input{i}[{d}]" for d, s in enumerate(val.shape) if not isinstance(s, int)]
            i += 1
    return found


def export_package(model: nn.Module, args: tuple, path, config: AOTIConfig) -> str:
    """Capture ``model`` with torch.export and compile it into the AOTInductor package ``path``; returns the path.

    ``model`` is left unchanged (a bf16 export converts a copy)."""
    if not isinstance(config, AOTIConfig):
        raise TypeError(f"config must be an ipex_train.inference.AOTIConfig, got {type(config).__name__}")
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path).endswith(".pt2"):
        raise ValueError(f"path must be a file name ending in .pt2 (the AOTInductor package), got {path!r}")
    eager_int8 = next((name for name, m in model.named_modules() if type(m).__module__.startswith(
        "torch.ao.nn.quantized")), None)
    if eager_int8 is not None:
        raise TypeError(f"model runs torch's eager int8 kernels ({eager_int8 or 'the model'} is a "
                        f"{type(model.get_submodule(eager_int8)).__name__}), which torch.export cannot capture: "
                        "deploy it with backend='torchscript', or lower the calibrated PreparedModel for Inductor "
                        "with ipex_train.quantization.convert(prepared, backend='pt2e', example_inputs=...)")
    if config.dtype != torch.float32 and isinstance(model, torch.fx.GraphModule) and _has_quantize_ops(model):
        raise ValueError("config.dtype must stay torch.float32 for an int8 graph (its quantize/dequantize ops fix "
                         "every dtype)")
    model, reference = _deployed(model, args, config)
    shapes, why = _dynamic_shapes(model, args, config)
    ep = _captured(model, args, config, shapes)
    dims = dynamic_dims_of(ep)
    inputs = input_checks.expected_shapes(ep)
    _log.info("ipex_train.inference.export(backend='aoti'): dynamic input dims %s (%s); the package takes %s; %s",
              ", ".join(dims) or "none", why, inputs, "other shapes raise RuntimeError" if config.check_inputs
              else "input checks off (AOTIConfig(check_inputs=False)): other shapes are not refused")
    path = _compile(ep, os.fspath(path), config, _hint(dims, why), inputs)
    bad = _self_check(path, reference, args)
    if bad and dims:
        # Seen with torch 2.14.1: int8 convolutions with one input channel compiled for a dynamic batch write
        # channels-last output where the rest of the code reads contiguous; static shapes compile correctly.
        msg = (f"ipex_train.inference.export(backend='aoti'): the package compiled with dynamic dims "
               f"{', '.join(dims)} does not reproduce the model ({bad}); recompiling with static shapes")
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
        _log.warning(msg)
        ep = _captured(model, args, config, dynamic_shapes_for(args, ()))
        why = "recompiled static: the dynamic package did not reproduce the model"
        path = _compile(ep, path, config, _hint([], why), input_checks.expected_shapes(ep))
        bad = _self_check(path, reference, args)
    if bad:
        raise RuntimeError(f"ipex_train.inference.export(backend='aoti'): the compiled package {path} does not "
                           f"reproduce the model on example_inputs ({bad}); use backend='torchscript'")
    return path


def _deployed(model: nn.Module, args: tuple, config: AOTIConfig):
    """The module export captures (a bf16 copy taking fp32 inputs, outputs flattened when torch alone could not
    rebuild them) and its eager outputs on ``args``, the reference of the package's self-check."""
    dtype = None if config.dtype == torch.float32 else config.dtype
    deployed = _Deployed(copy.deepcopy(model).to(dtype) if dtype else model, dtype)
    deployed.training = False  # the model is in eval already; .eval() recurses into int8 graphs, which refuse it
    with torch.no_grad():
        out = deployed(*args)
    if needs_flat_outputs(out):
        deployed.flatten = True
        names = ", ".join(keystr(p).strip("[]'.") for p, _ in tree_flatten_with_path(out)[0])
        _log.info("ipex_train.inference.export(backend='aoti'): the model returns a %s: the package returns its "
                  "tensors as a tuple (%s), so that it loads with torch alone", type(out).__name__, names)
        out = tuple(tree_leaves(out))
    return (deployed if dtype or deployed.flatten else model), out


def _dynamic_shapes(model: nn.Module, args: tuple, config: AOTIConfig):
    """torch.export dynamic_shapes for ``config`` and why they are what they are (for the log and the docs)."""
    if config.dynamic_shapes is not None:
        return config.dynamic_shapes, "AOTIConfig.dynamic_shapes"
    if config.dynamic_dims is not None:
        return dynamic_shapes_for(args, config.dynamic_dims), f"AOTIConfig(dynamic_dims={config.dynamic_dims})"
    if not default_dynamic_dims(model):
        return dynamic_shapes_for(args, ()), _CONV_STATIC
    return default_dynamic_shapes(model, args), DEFAULT_DIMS_WHY


_CONV_STATIC = ("default for models with convolutions: static shapes, which Inductor pre-packs their weights "
                "for; AOTIConfig(dynamic_dims=(0,)) for a dynamic batch")


def _hint(dims: list, why: str) -> str:
    """The end of the packages' input-check message: how to export for other shapes."""
    if dims:
        return (f"Its dynamic dims: {', '.join(dims)}; export with another "
                "ipex_train.inference.AOTIConfig(dynamic_dims=...) for other shapes.")
    reason = " (models with convolutions compile for the example's shape by default)" if why == _CONV_STATIC else ""
    return (f"The package has static shapes{reason}: export with "
            "ipex_train.inference.AOTIConfig(dynamic_dims=(0,)) to serve other batch sizes.")


def _captured(model, args, config, shapes):
    ep = capture(model, args, dynamic_shapes=shapes, strict=config.strict)
    ep = apply_passes(ep, args, config, dynamic_shapes=shapes)
    keep_inputs_unwritten(ep)
    return ep


def _compile(ep, path: str, config: AOTIConfig, hint: str, inputs: str) -> str:
    """AOTInductor-compile ``ep`` into the package ``path``, with the input checks when config.check_inputs."""
    metadata = {"ipex_train.inputs": inputs, "ipex_train.input_checks": "on" if config.check_inputs else "off",
                **config.inductor_configs.get("aot_inductor.metadata", {})}
    options = {"freezing": config.freezing, **config.inductor_configs, "aot_inductor.metadata": metadata}
    checks = input_checks.compiled_in(hint) if config.check_inputs else contextlib.nullcontext()
    with torch.no_grad(), checks:
        path = torch._inductor.aoti_compile_and_package(ep, package_path=path, inductor_configs=options)
    if config.check_inputs and not input_checks.verify(path):
        raise RuntimeError("ipex_train.inference.export(backend='aoti'): this torch's AOTInductor no longer "
                           f"generates code through the hook the input checks use, so {path} would not refuse "
                           "wrong shapes; AOTIConfig(check_inputs=False) builds it without them")
    return path


def keep_inputs_unwritten(ep) -> None:
    """In an int8 graph, rewrite every ``add(a, x)`` of a user input ``x`` as ``sub(a, neg(x))`` (in place in ``ep``;
    the same value bit for bit: IEEE negation is exact).

    torchao's x86 lowering (0.18) fuses ``linear(...) + other`` into qlinear_pointwise.binary with the "sum" post-op,
    which accumulates into ``other``'s buffer; when ``other`` is a graph input, the compiled code (torch.compile and
    AOTInductor alike) writes the result into the caller's tensor (an encoder layer's ``x + out_proj(ctx)``). A
    clone of the input does not help: Inductor drops it as a no-op before lowering. The sub is not matched, so the
    linear writes its own buffer and one pointwise kernel adds the input."""
    graph = ep.graph_module.graph
    if not any(node.op == "call_function" and "quantize_per" in str(node.target) for node in graph.nodes):
        return
    user_inputs = {node for node in graph.nodes if node.op == "placeholder"
                   and node.name in set(ep.graph_signature.user_inputs)}
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.add.Tensor or node.kwargs:
            continue
        a, b = node.args
        if b not in user_inputs:
            a, b = b, a
        if b not in user_inputs or not isinstance(a, torch.fx.Node):
            continue
        with graph.inserting_before(node):
            negated = graph.call_function(torch.ops.aten.neg.default, (b,))
            negated.meta.update(b.meta)
            sub = graph.call_function(torch.ops.aten.sub.Tensor, (a, negated))
            sub.meta.update(node.meta)
        node.replace_all_uses_with(sub)
        graph.erase_node(node)
    ep.graph_module.recompile()


def _self_check(path, reference, args, min_cosine=0.99):
    """None when the package at ``path`` matches the model's outputs ``reference`` on ``args`` (cosine of every
    output >= min_cosine, a check for a miscompiled package, not for precision) and leaves its inputs as they
    were, else what differed."""
    package = torch._inductor.aoti_load_package(path)
    copies = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, args)
    with torch.no_grad():
        got, want = tree_leaves(package(*copies)), tree_leaves(reference)
    for i, (a, b) in enumerate(zip(tree_leaves(copies), tree_leaves(args))):
        if isinstance(a, torch.Tensor) and not torch.equal(a, b):
            return f"input {i} was modified in place by the package"
    for i, (a, b) in enumerate(zip(got, want)):
        if a.shape != b.shape:
            return f"output {i} has shape {tuple(a.shape)}, expected {tuple(b.shape)}"
        if a.is_floating_point() and a.numel():
            cos = torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()
            if not cos >= min_cosine:
                return f"output {i} cosine similarity {cos:.4f} < {min_cosine}"
    return None


def default_dynamic_dims(model: nn.Module) -> tuple:
    """The dims AOTIConfig(dynamic_dims=None) marks dynamic: the batch, but none for a model with convolutions
    (Conv modules, or convolution calls in a GraphModule such as quantization.convert(backend="pt2e") returns),
    whose weights Inductor pre-packs for oneDNN only when the input shape is static."""
    convs = any(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules())
    if not convs and isinstance(model, torch.fx.GraphModule):
        convs = any(node.op == "call_function" and node.target in _CONVOLUTIONS for node in model.graph.nodes)
    return () if convs else (0,)


_CONVOLUTIONS = (torch.ops.aten.conv1d.default, torch.ops.aten.conv2d.default, torch.ops.aten.conv3d.default)


def _has_quantize_ops(gm: torch.fx.GraphModule) -> bool:
    return any(node.op == "call_function" and "quantize_per" in str(node.target) for node in gm.graph.nodes)

