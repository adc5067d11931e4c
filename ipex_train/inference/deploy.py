"""The one export entry point: ``backend`` picks TorchScript (the seed flow, jit.py) or AOTInductor (aoti.py)."""
from __future__ import annotations

from torch import nn

from .aoti import AOTIConfig, export_package
from .jit import _as_args, export_torchscript

BACKENDS = ("torchscript", "aoti")


def export(model, example_inputs, *, backend="torchscript", path=None, config=None, warmup=2, freeze=True,
           check_trace=True):
    """Export an eval-mode ``model`` for deployment, run on ``example_inputs`` (a tensor or a tuple of them).

    backend="torchscript" (default, the seed flow): trace + freeze + ``warmup`` calls under oneDNN Graph fusion;
    returns the torch.jit.ScriptModule (also saved to ``path`` when given). ``freeze``/``check_trace``/``warmup``
    are its options (see export_torchscript).

    backend="aoti": torch.export + AOTInductor with freezing into the package ``path`` (``*.pt2``), which
    ``torch._inductor.aoti_load_package(path)`` loads in a process without ipex_train; returns the path.
    ``config`` (an AOTIConfig) sets dtype (fp32/bf16), dynamic dims and capture options; by default the batch dim
    is dynamic, and the sequence of token ids (integer inputs of rank 2), except in models with convolutions,
    which compile for the example's shapes. The package refuses other shapes with a RuntimeError naming them
    (checks compiled in), and returns a tuple of tensors where the model returns a transformers ModelOutput.
    An int8 package comes from the graph ipex_train.quantization.convert(prepared, backend="pt2e",
    example_inputs=...) returns. RuntimeError names what failed when torch.export cannot capture the model
    (backend="torchscript" traces such models).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if model.training:
        raise ValueError("model is in training mode; call model.eval() before export (capture would bake in "
                         "dropout and batch statistics)")
    if backend == "torchscript":
        if config is not None:
            raise ValueError("config is an AOTIConfig for backend='aoti'; backend='torchscript' takes warmup, "
                             "freeze and check_trace")
        scripted = export_torchscript(model, example_inputs, warmup=warmup, freeze=freeze, check_trace=check_trace)
        if path is not None:
            scripted.save(path)
        return scripted
    if path is None:
        raise ValueError("backend='aoti' needs path, the .pt2 package file to write")
    args = _as_args(example_inputs)
    return export_package(model, args, path, AOTIConfig() if config is None else config)
