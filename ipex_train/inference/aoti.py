"""AOTInductor export: torch.export capture + Inductor ahead-of-time compilation (with freezing) into a ``.pt2``
package that plain torch loads (``torch._inductor.aoti_load_package(path)``), no ipex_train or Python model code
needed. This is the current torch route on the CPU; TorchScript (jit.py) is deprecated in torch 2.14.

What the package holds: the compiled C++ for the captured graph, with weights folded as constants (freezing lets
Inductor pre-pack them for oneDNN and fuse conv/linear with their post-ops). bf16 packages take fp32 (or bf16)
inputs and cast them inside, as the TorchScript bf16 export does, and return bf16. int8: pass the graph that
ipex_train.quantization.convert(prepared, backend="pt2e", ...) returns; Inductor lowers its quantize/dequantize
pattern to oneDNN int8 kernels (qconv/qlinear with fused post-ops and residual adds).

Dynamic shapes: by default dim 0 (the batch) of every tensor input is marked torch.export.Dim.AUTO: it stays
dynamic unless the model specialises it (a reshape to a fixed batch, or an example of size 1, which torch.export
always specialises). AOTIConfig.dynamic_dims=(0, 1) also frees the sequence dim of token inputs;
AOTIConfig.dynamic_shapes is handed to torch.export as is when the automatic rule does not fit. The dims that
ended up dynamic are logged at INFO.

Self-check: the package is loaded once after compiling and run on example_inputs against the model (cosine of
each output >= 0.99: a miscompile check, not a precision one). A dynamic-shape package that fails it is
recompiled with static shapes, with a warning (torch 2.14.1 miscompiles int8 convolutions with one input channel
for a dynamic batch); a static one that fails raises RuntimeError.
"""
from __future__ import annotations

import copy
import logging
import os
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

_log = logging.getLogger("ipex_train")

DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class AOTIConfig:
    """Settings of export(..., backend="aoti").

    Args:
        dtype: torch.float32 (default) or torch.bfloat16 (weights and compute in bf16; fp32 inputs are cast inside).
            Must stay float32 for an int8 graph from quantization.convert(backend="pt2e"), which fixes its dtypes.
        dynamic_dims: dims marked torch.export.Dim.AUTO on every tensor input ((0,): batch; (0, 1): batch and
            sequence of token ids; (): fully static).
        dynamic_shapes: handed to torch.export.export as is (overrides dynamic_dims).
        strict: torch.export's strict (TorchDynamo) capture; False (torch's default) traces more Python.
        freezing: Inductor's freezing (weights as constants, pre-packed for oneDNN); keep it on for inference.
        inductor_configs: further torch._inductor.config options for aoti_compile_and_package.
    """

    dtype: torch.dtype = torch.float32
    dynamic_dims: tuple = (0,)
    dynamic_shapes: object = None
    strict: bool = False
    freezing: bool = True
    inductor_configs: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"AOTIConfig: dtype must be torch.float32 or torch.bfloat16, got {self.dtype!r}")
        if not isinstance(self.dynamic_dims, tuple) or not all(type(d) is int and d >= 0 for d in self.dynamic_dims):
            raise TypeError(f"AOTIConfig: dynamic_dims must be a tuple of non-negative ints, got {self.dynamic_dims!r}")
        for name in ("strict", "freezing"):
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


class _CastInputs(nn.Module):
    """Runs a bf16 copy of the model on inputs cast to bf16 (as the TorchScript bf16 export takes fp32 inputs)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.model, self.dtype = model, dtype

    def forward(self, *args):
        return self.model(*tree_map(lambda t: t.to(self.dtype) if isinstance(t, torch.Tensor)
                                    and t.is_floating_point() else t, args))


def capture(model: nn.Module, args: tuple, *, dynamic_shapes=None, dynamic_dims=(0,), strict=False):
    """torch.export.export of ``model`` (eval, no_grad) on ``args``; RuntimeError naming what failed."""
    shapes = dynamic_shapes if dynamic_shapes is not None else dynamic_shapes_for(args, dynamic_dims)
    if isinstance(model, _CastInputs):
        shapes = (shapes,)  # its forward(*args) takes the inputs as one tuple argument
    try:
        with torch.no_grad():
            return torch.export.export(model, args, dynamic_shapes=shapes, strict=strict)
    except Exception as e:  # torch.export raises many types; all mean "cannot capture"
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise RuntimeError(f"torch.export (strict={strict}) could not capture {type(model).__name__}: "
                           f"{type(e).__name__}: {first}") from e


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
    if config.dtype != torch.float32 and isinstance(model, torch.fx.GraphModule) and _has_quantize_ops(model):
        raise ValueError("config.dtype must stay torch.float32 for an int8 graph (its quantize/dequantize ops fix "
                         "every dtype)")
    if config.dtype != torch.float32:
        model = _CastInputs(copy.deepcopy(model).to(config.dtype), config.dtype).eval()
    ep = capture(model, args, dynamic_shapes=config.dynamic_shapes, dynamic_dims=config.dynamic_dims,
                 strict=config.strict)
    dims = dynamic_dims_of(ep)
    _log.info("ipex_train.inference.export(backend='aoti'): dynamic input dims %s", ", ".join(dims) or "none")
    options = {"freezing": config.freezing, **config.inductor_configs}
    with torch.no_grad():
        path = torch._inductor.aoti_compile_and_package(ep, package_path=os.fspath(path), inductor_configs=options)
    bad = _self_check(path, model, args)
    if bad and dims:
        # Seen with torch 2.14.1: int8 convolutions with one input channel compiled for a dynamic batch write
        # channels-last output where the rest of the code reads contiguous; static shapes compile correctly.
        msg = (f"ipex_train.inference.export(backend='aoti'): the package compiled with dynamic dims "
               f"{', '.join(dims)} does not reproduce the model ({bad}); recompiling with static shapes")
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
        _log.warning(msg)
        ep = capture(model, args, dynamic_shapes=dynamic_shapes_for(args, ()), strict=config.strict)
        with torch.no_grad():
            path = torch._inductor.aoti_compile_and_package(ep, package_path=path, inductor_configs=options)
        bad = _self_check(path, model, args)
    if bad:
        raise RuntimeError(f"ipex_train.inference.export(backend='aoti'): the compiled package {path} does not "
                           f"reproduce the model on example_inputs ({bad}); use backend='torchscript'")
    return path


def _self_check(path, model, args, min_cosine=0.99):
    """None when the package at ``path`` matches ``model`` on ``args`` (cosine of every output >= min_cosine, a
    check for a miscompiled package, not for precision), else what differed."""
    package = torch._inductor.aoti_load_package(path)
    with torch.no_grad():
        got, want = tree_leaves(package(*args)), tree_leaves(model(*args))
    for i, (a, b) in enumerate(zip(got, want)):
        if a.shape != b.shape:
            return f"output {i} has shape {tuple(a.shape)}, expected {tuple(b.shape)}"
        if a.is_floating_point() and a.numel():
            cos = torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()
            if not cos >= min_cosine:
                return f"output {i} cosine similarity {cos:.4f} < {min_cosine}"
    return None


def _has_quantize_ops(gm: torch.fx.GraphModule) -> bool:
    return any(node.op == "call_function" and "quantize_per" in str(node.target) for node in gm.graph.nodes)

