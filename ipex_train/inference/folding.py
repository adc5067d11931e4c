"""Fold eval-mode BatchNorm into the preceding Conv/Linear.

A (conv, bn) pair is folded only when it is proven that the BN consumes the conv output and nothing else does:

* without a sample input: a torch.fx symbolic trace of the model shows it (see graph_flow.py: each called once,
  the BN reads only the conv output, nothing else reads it); this folds every pair of torchvision's ResNets.
  When the model cannot be traced (input-dependent control flow, HuggingFace models), only pairs that are
  consecutive children of an nn.Sequential whose forward is the stock one are folded (the output goes straight
  from one to the other), each registered once in the model, with no hooks;
* with ``sample_input``: one forward pass (under no_grad, RNG state restored) records, for every tensor, which
  module produced it and how many torch calls consumed it. A pair is proven when each module ran once, the BN's
  input is the very tensor the conv returned, that tensor has exactly one consumer (the BN's batch_norm), and it
  is not among the model's outputs. A forward pass only sees the branch the sample takes: a model whose
  data-dependent control flow routes a conv output elsewhere on other inputs is out of reach of this check.

Linear + BatchNorm1d is folded only with a sample input: BatchNorm1d normalises dim 1, which is the Linear's
feature dim only for 2-D outputs, and only a forward pass shows the rank.

Candidates that cannot be proven are left untouched, reported in the returned list and in one short log line
(logger "ipex_train": the count and the first three); the remaining pairs are still folded. The model is modified
in place (the BN is replaced by nn.Identity, the conv/linear weight and bias are rewritten in the existing
Parameters); copying is the caller's decision.
"""
import logging
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from .graph_flow import GraphFlow, trace_flow

logger = logging.getLogger("ipex_train")

_CONV_BN = {nn.Conv1d: nn.BatchNorm1d, nn.Conv2d: nn.BatchNorm2d, nn.Conv3d: nn.BatchNorm3d}
_LINEAR_BN = {nn.Linear: nn.BatchNorm1d}
_LOGGED = 3  # skipped pairs named in the log line; the returned report lists every one

# Calls that read only a tensor's metadata: they do not consume its values, so folding cannot change them.
_METADATA = {"size", "dim", "stride", "numel", "is_contiguous", "is_floating_point", "__get__", "__len__"}


@dataclass
class _Pair:
    first: nn.Module
    bn: nn.Module
    first_name: str
    bn_name: str
    in_sequential: bool = False

    @property
    def label(self):
        return f"{self.first_name}+{self.bn_name}"


def fold_conv_bn(model, sample_input=None):
    """Fold every provable eval-mode Conv{1,2,3}d + BatchNorm{1,2,3}d pair of ``model`` in place.

    ``sample_input`` (a tensor, a tuple of positional arguments, or a dict of keyword arguments) lets pairs
    outside nn.Sequential be proven by one forward pass. Returns one line per candidate pair: "folded A+B" or
    "skipped A+B: reason".
    """
    return _fold(model, sample_input, _CONV_BN, needs_sample=False)


def fold_linear_bn(model, sample_input=None):
    """Fold every provable eval-mode Linear + BatchNorm1d pair of ``model`` in place.

    Needs ``sample_input`` (see fold_conv_bn) to see that the Linear output is 2-D; without it every candidate is
    reported as skipped. Returns one line per candidate pair: "folded A+B" or "skipped A+B: reason".
    """
    return _fold(model, sample_input, _LINEAR_BN, needs_sample=True)


def _fold(model, sample_input, kinds, needs_sample):
    if not isinstance(model, nn.Module) or isinstance(model, torch.jit.ScriptModule):
        raise TypeError(f"model must be an eager torch.nn.Module, got {type(model).__name__}")
    registrations = _registrations(model)
    candidates = _candidates(model, kinds)
    flow = _observe(model, sample_input, kinds) if sample_input is not None else None
    graph = None
    if flow is None and not needs_sample and any(type(m) in kinds.values() for m in model.modules()):
        graph = trace_flow(model)
    if isinstance(flow, _Flow):
        known = {p.label for p in candidates}
        candidates.extend(p for p in flow.pairs if p.label not in known)
    elif isinstance(graph, GraphFlow):
        candidates.extend(_traced_pairs(model, graph, kinds, {p.label for p in candidates}))
    proven, skipped = {}, {}
    for pair in candidates:
        reason = _verdict(pair, flow, graph, needs_sample)
        if reason:
            skipped[pair.label] = reason
        else:
            proven[pair.label] = pair
    report = _fold_proven(proven, registrations, skipped)
    if skipped:
        first = list(skipped.items())[:_LOGGED]
        logger.info("BatchNorm folding left %d pair(s) unfolded%s: %s%s", len(skipped),
                    ", first" if len(skipped) > _LOGGED else "",
                    "; ".join(f"{label} ({reason})" for label, reason in first),
                    "; the returned report lists all" if len(skipped) > _LOGGED else "")
    return report


def _verdict(pair, flow, graph, needs_sample) -> str | None:
    """Why ``pair`` cannot be proven to fold (None: proven), from the observed flow, the traced graph, or the
    registration order alone."""
    if isinstance(flow, _Flow):
        return flow.verdict(pair)
    if isinstance(graph, GraphFlow):
        return graph.verdict(pair.first_name, pair.bn_name, pair.in_sequential)
    if pair.in_sequential and not needs_sample:
        return None
    if flow is not None:
        return flow
    if needs_sample:
        return "needs sample_input to check the Linear output is 2-D"
    return f"{graph}; pass sample_input to prove the data flow"


def _fold_proven(proven, registrations, skipped) -> list[str]:
    """Fold every proven pair that can be folded (its BatchNorm replaced by Identity); the others go to
    ``skipped``. Returns the report lines, folded then skipped."""
    report = []
    for label, pair in proven.items():
        reason = _unfoldable(pair, registrations)
        if reason:
            skipped[label] = reason
            continue
        _fold_pair(pair.first, pair.bn)
        for parent, name in registrations[id(pair.bn)]:
            setattr(parent, name, nn.Identity())
        report.append(f"folded {label}")
    report.extend(f"skipped {label}: {reason}" for label, reason in skipped.items())
    return report


def _traced_pairs(model, graph, kinds, known):
    """Compatible (first, bn) pairs the traced graph connects that registration order did not already list."""
    modules = dict(model.named_modules())
    firsts = {name for name, m in modules.items() if type(m) in kinds}
    pairs = []
    for first_name, bn_name in graph.producer_pairs(firsts):
        pair = _Pair(modules[first_name], modules[bn_name], first_name, bn_name)
        if pair.label not in known and _compatible(pair.first, pair.bn, kinds):
            known.add(pair.label)
            pairs.append(pair)
    return pairs


def _registrations(model):
    """id(module) -> [(parent, attribute name)] over every place a module is registered (shared ones twice)."""
    found = {}
    for parent in model.modules():
        for name, child in parent.named_children():
            found.setdefault(id(child), []).append((parent, name))
    return found


def _candidates(model, kinds):
    """Type-compatible pairs adjacent in registration order under one parent; in_sequential marks the ones whose
    adjacency already proves the data flow."""
    names = {id(m): n for n, m in model.named_modules()}
    pairs = []
    for parent in model.modules():
        children = list(parent.named_children())
        stock_sequential = isinstance(parent, nn.Sequential) and type(parent).forward is nn.Sequential.forward
        for (_, a), (_, b) in zip(children, children[1:]):
            if _compatible(a, b, kinds):
                pairs.append(_Pair(a, b, names[id(a)], names[id(b)], stock_sequential))
    return pairs


def _compatible(first, bn, kinds):
    bn_type = kinds.get(type(first))
    if bn_type is None or type(bn) is not bn_type:
        return False
    features = first.out_channels if isinstance(first, nn.modules.conv._ConvNd) else first.out_features
    return bn.num_features == features


def _unfoldable(pair, registrations):
    """Why this proven pair still cannot be folded safely, or None."""
    first, bn = pair.first, pair.bn
    if bn.training:
        return "BatchNorm is in training mode"
    if bn.running_mean is None or bn.running_var is None:
        return "BatchNorm has no running statistics (track_running_stats=False)"
    if len(registrations[id(first)]) != 1 or len(registrations[id(bn)]) != 1:
        return "a module of the pair is registered more than once (shared)"
    for m in (first, bn):
        if m._forward_hooks or m._forward_pre_hooks:
            return f"{type(m).__name__} has forward hooks, which would see different values"
    if parametrize.is_parametrized(first):
        return f"{type(first).__name__} weight is parametrized"
    return None


def _fold_pair(first, bn):
    """Rewrite first's weight/bias so that first(x) == bn(first(x)) for the eval-mode bn."""
    with torch.no_grad():
        weight = first.weight
        # Computed in float64 so the folded fp32 weights stay within rounding of the unfolded model.
        scale = bn.running_var.double().add(bn.eps).rsqrt()
        if bn.weight is not None:
            scale = scale * bn.weight.double()
        bias = first.bias.double() if first.bias is not None else torch.zeros_like(scale)
        bias = (bias - bn.running_mean.double()) * scale
        if bn.bias is not None:
            bias = bias + bn.bias.double()
        shape = (-1,) + (1,) * (weight.dim() - 1)
        weight.copy_((weight.double() * scale.reshape(shape)).to(weight.dtype))
        if first.bias is None:
            first.bias = nn.Parameter(bias.to(weight.dtype), requires_grad=weight.requires_grad)
        else:
            first.bias.copy_(bias.to(first.bias.dtype))


class _Flow:
    """What one forward pass showed: per module its calls, inputs and outputs; per tensor its consumers."""

    def __init__(self):
        self.calls = {}        # id(module) -> number of calls
        self.first_input = {}  # id(module) -> first positional input of its (last) call
        self.output = {}       # id(module) -> output of its (last) call
        self.consumers = {}    # id(tensor) -> number of torch calls reading its values
        self.model_outputs = set()
        self.keep = []         # holds every tensor seen so that ids stay unique during the pass
        self.pairs = []

    def verdict(self, pair):
        """None when the pass proves the pair, else the reason it does not."""
        first, bn = id(pair.first), id(pair.bn)
        if self.calls.get(first, 0) == 0 and self.calls.get(bn, 0) == 0 and pair.in_sequential:
            return None  # not exercised by the sample; the Sequential proves it
        if self.calls.get(first, 0) != 1 or self.calls.get(bn, 0) != 1:
            return "a module of the pair did not run exactly once on sample_input"
        out = self.output[first]
        if self.first_input[bn] is not out:
            return "BatchNorm input is not the output of the preceding layer"
        if self.consumers.get(id(out), 0) != 1 or id(out) in self.model_outputs:
            return "the layer output is also used elsewhere (e.g. a residual add)"
        if out.dim() != (pair.first.weight.dim() if isinstance(pair.first, nn.modules.conv._ConvNd) else 2):
            return f"the layer output is {out.dim()}-D, which the BatchNorm does not normalise per feature"
        return None


class _ConsumerCounter(TorchFunctionMode):
    def __init__(self, flow):
        super().__init__()
        self.flow = flow

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]
        if outputs or getattr(func, "__name__", "") not in _METADATA:
            for t in inputs:
                self.flow.consumers[id(t)] = self.flow.consumers.get(id(t), 0) + 1
        self.flow.keep.extend(inputs + outputs)
        return result


def _observe(model, sample_input, kinds):
    """Run model once on sample_input, recording the data flow; returns a _Flow or the reason it could not run."""
    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training for m in model.modules()):
        # A forward pass would update the running statistics of training-mode BatchNorms: never touch them.
        return "model has BatchNorm in training mode; sample run skipped"
    if isinstance(sample_input, dict):
        args, kwargs = (), sample_input
    elif isinstance(sample_input, (tuple, list)):
        args, kwargs = tuple(sample_input), {}
    else:
        args, kwargs = (sample_input,), {}
    flow = _Flow()
    watched = [m for m in model.modules() if type(m) in kinds or type(m) in kinds.values()]
    names = {id(m): n for n, m in model.named_modules()}

    def pre_hook(module, inputs):
        flow.calls[id(module)] = flow.calls.get(id(module), 0) + 1
        flow.first_input[id(module)] = inputs[0] if inputs else None

    def post_hook(module, inputs, output):
        flow.output[id(module)] = output

    handles = [h for m in watched for h in (m.register_forward_pre_hook(pre_hook),
                                             m.register_forward_hook(post_hook))]
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]), _ConsumerCounter(flow):
            out = model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    flow.model_outputs = {id(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)}
    producers = {id(flow.output[id(m)]): m for m in watched if type(m) in kinds and id(m) in flow.output}
    for bn in watched:
        first = producers.get(id(flow.first_input.get(id(bn))))
        if first is not None and _compatible(first, bn, kinds):
            flow.pairs.append(_Pair(first, bn, names[id(first)], names[id(bn)]))
    return flow
