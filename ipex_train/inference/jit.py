"""TorchScript export through the oneDNN Graph (LLGA) fuser: trace + freeze + warm-up.

The oneDNN Graph fuser rewrites a frozen TorchScript graph into prim::oneDNNFusionGroup nodes (conv/linear with
their eltwise/binary post-ops, BN already folded by freezing). It acts on the profiling runs: the first call of a
scripted module records shapes, the next one optimises the graph, and only then are groups formed, each guarded
by a prim::oneDNNFusionGuard on the exact input shapes/strides it was compiled for.

Fusion switch. torch's switch (torch.jit.enable_onednn_fusion) is global and off by default; TorchScript's
profiling executor consults it when a scripted module is called (its groups are formed on the second call at a
shape). ipex_train keeps its own setting, on by default (IPEX's "graph optimizations are enabled by default"):
enable_onednn_fusion(flag) sets it and torch's switch at once; IPEX_TRAIN_ONEDNN_FUSION=0 turns the default off
without code changes (1 or unset: on). What reads it:
* optimize(model.eval(), ...) (inference) calls enable_torchscript_fusion(): when the setting is on and torch's
  switch is off, it turns torch's switch on and logs that at INFO on the "ipex_train" logger, so the user's own
  torch.jit.trace + torch.jit.freeze fuse as in IPEX's graph-optimization flow. It stays on for the process
  (modules traced later must still fuse when called); enable_onednn_fusion(False) turns it back off. optimize() for
  training never touches it. With the setting off, optimize() leaves torch's switch as it is.
* export() and load() turn torch's switch to the setting for their own trace/warm-up calls and restore the value
  they found afterwards.

Dynamic shapes. A call whose input shape (or strides) differs from the warm-up fails the group guards and runs
each group's fallback graph; outputs stay correct (tested). What the fallback costs depends on torch's global
switch at the time of the call (checked with ONEDNN_VERBOSE):
* off (torch's default; export() restores the value it found): the fallback runs the plain TorchScript ops,
  unfused, on every call at the new shape; no compile cost, no fusion gain;
* on (enable_onednn_fusion(True), or after optimize() of an inference model): the fallback re-specialises: it is
  profiled on the first call at the new shape; on the second its oneDNN partitions are compiled and run fused, and
  it stays fused afterwards.
Measured by ``python -m benchmarks.suite.bench_inference --quick``, two runs (2026-11-22, torch 2.14.1, 2 AVX2 cores
shared with other jobs, so +-50%): ResNet-50 exported at batch 1 (steady 0.7-1.2 s/call), then called at batch 2
(eager 3.0-4.3 s): switch off: first four calls 1.0-2.9 s each, steady 1.8-1.9 s; switch on: first call 1.5-3.7 s,
second (partition compile) 3.3-12 s, then 0.8-1.6 s, steady 1.0 s. So re-specialisation costs about two slow calls
per new shape, the compiling one several times a normal call, and then recovers the fused speed; with the switch
off a new shape settles at unfused-TorchScript speed. For serving a few fixed shapes, export once per shape or
turn the switch on; shapes beyond the second were not measured.

Deprecation. torch 2.14 warns that torch.jit.trace/freeze/load are deprecated; export() and load() silence those
warnings for their own calls and keep this flow working while TorchScript ships. When TorchScript goes, ipex_train
will offer the same entry point on torch.export: export the folded, dropout-free model with torch.export.export,
then compile it with inductor (torch._inductor.aoti_compile_and_package for a saved artefact, torch.compile in
process), whose CPU backend fuses conv/linear post-ops through oneDNN itself; the folding and dropout passes of
this package stay as they are because they work on eager modules.
"""
import contextlib
import logging
import warnings

import torch
from torch import nn

from ..base import envvars as _envvars
from ..base import options as _options

_log = logging.getLogger("ipex_train")

FUSION_ENV = _envvars.ONEDNN_FUSION.name
_choice = None  # set by enable_onednn_fusion(); None: FUSION_ENV, else on


def enable_onednn_fusion(enabled):
    """Turn oneDNN Graph fusion of TorchScript modules on or off: ipex_train's setting (read by optimize() for
    inference, export() and load()) and torch's global switch ``torch.jit.enable_onednn_fusion``, at once."""
    global _choice
    if not isinstance(enabled, bool):
        raise _options.OptionTypeError(f"enable_onednn_fusion: enabled must be a bool, got {type(enabled).__name__}")
    _choice = enabled
    torch.jit.enable_onednn_fusion(enabled)


def onednn_fusion_enabled():
    """ipex_train's fusion setting: the last enable_onednn_fusion() call, else IPEX_TRAIN_ONEDNN_FUSION (a switch:
    0/1, true/false, ...), else True. Raises ValueError for another value of the variable."""
    if _choice is not None:
        return _choice
    return _envvars.ONEDNN_FUSION.read() is not False


def enable_torchscript_fusion():
    """What optimize() does for an inference model: turn torch's global switch on when ipex_train's setting is on
    and the switch is off, logged at INFO."""
    if onednn_fusion_enabled() and not torch.jit.onednn_fusion_enabled():
        torch.jit.enable_onednn_fusion(True)
        _log.info("ipex_train.optimize: turned torch.jit.enable_onednn_fusion on (process-wide), so models traced "
                  "and frozen with torch.jit fuse conv/linear and their post-ops into oneDNN Graph groups; "
                  "ipex_train.enable_onednn_fusion(False) turns it off (%s=0 keeps optimize() from turning it on)",
                  FUSION_ENV)


@contextlib.contextmanager
def _fusion_scope():
    """torch's switch set to ipex_train's setting, TorchScript deprecation warnings silenced; both restored."""
    before = torch.jit.onednn_fusion_enabled()
    torch.jit.enable_onednn_fusion(onednn_fusion_enabled())
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"`torch\.jit\.\w+` is deprecated")
            yield
    finally:
        torch.jit.enable_onednn_fusion(before)


def _as_args(example_inputs):
    args = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else example_inputs
    if (isinstance(args, (tuple, list)) and args
            and all(isinstance(leaf, torch.Tensor) for leaf in torch.utils._pytree.tree_leaves(args))):
        return tuple(args)
    raise TypeError("example_inputs must be a tensor or a non-empty tuple of positional inputs made of tensors, "
                    f"got {example_inputs!r:.80}")


def _warm_up(scripted, args, warmup):
    # The profiling executor records shapes on the first call and optimises (fuses) on the next one.
    for _ in range(warmup):
        scripted(*args)


def export_torchscript(model, example_inputs, *, warmup=2, freeze=True, check_trace=True):
    """Trace ``model`` (eval mode) on ``example_inputs``, freeze it, and run ``warmup`` calls under oneDNN Graph
    fusion (unless onednn_fusion_enabled() is False); returns the torch.jit.ScriptModule.

    Folding and dropout removal are separate passes (fold_conv_bn, fold_linear_bn, replace_dropout) to run on the
    eager model first; freezing folds the remaining BatchNorms it can prove. ``warmup`` must be at least 2 for
    the groups to be formed here rather than on the caller's first calls (where torch's global switch decides).
    ``check_trace`` re-runs the model to catch data-dependent control flow baked into the trace.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if model.training:
        raise ValueError("model is in training mode; call model.eval() before export (tracing would bake in "
                         "dropout and batch statistics)")
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be a non-negative int, got {warmup!r}")
    args = _as_args(example_inputs)
    with _fusion_scope(), torch.no_grad():
        scripted = torch.jit.trace(model, args, check_trace=check_trace)
        if freeze:
            scripted = torch.jit.freeze(scripted.eval())
        _warm_up(scripted, args, warmup)
    return scripted


def load(f, example_inputs, *, warmup=2, map_location=None):
    """torch.jit.load a module saved from export() and warm it up on ``example_inputs`` under oneDNN Graph fusion,
    so that the loaded module runs fused like the exported one (groups are formed at run time, never saved)."""
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be a non-negative int, got {warmup!r}")
    args = _as_args(example_inputs)
    with _fusion_scope(), torch.no_grad():
        scripted = torch.jit.load(f, map_location=map_location)
        _warm_up(scripted, args, warmup)
    return scripted


def _fusion_groups(graph):
    """[(group node kind, [op kinds inside, constants left out])] over graph and its nested blocks."""
    found = []
    for node in graph.nodes():
        if node.kind().startswith("prim::") and "FusionGroup" in node.kind():
            ops = [n.kind() for n in node.g("Subgraph").nodes() if n.kind() != "prim::Constant"]
            found.append((node.kind().split("_")[0], ops))
        for block in node.blocks():
            found.extend(_fusion_groups(block))
    return found


def _fusion_group_ops(line):
    """The op kinds of one fused_groups() line."""
    return line.split(": ", 1)[1].split(", ")


def fused_groups(scripted, example_inputs):
    """The fusion groups of ``scripted``'s optimised graph for ``example_inputs`` (what graph_for shows), one line
    per group: "prim::oneDNNFusionGroup: aten::_convolution, aten::relu". Runs the module once under no_grad
    (with torch's fusion switch as it is) so that a graph exists; empty when nothing was fused."""
    if not isinstance(scripted, torch.jit.ScriptModule):
        raise TypeError(f"scripted must be a torch.jit.ScriptModule, got {type(scripted).__name__}")
    args = _as_args(example_inputs)
    with torch.no_grad():
        scripted(*args)
        graph = scripted.graph_for(*args)
    return [f"{kind}: {', '.join(ops)}" for kind, ops in _fusion_groups(graph)]
