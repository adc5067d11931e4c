"""Passes on captured graphs (torch.export's ``ExportedProgram.module()``: ATen ops, weights as get_attr nodes),
run before Inductor compiles them (export(backend="aoti")) or before torchao's pt2e quantizer annotates them
(quantization.convert(backend="pt2e")).

fuse_shared_input_linears: linears that read the same tensor (an attention layer's Q, K and V projections) become
one linear over the concatenated weight and bias, whose output is split back along the last dim. One GEMM with
3x the output columns instead of three: fewer weight reads of the activation, one oneDNN call (and, in int8, one
quantize of the input). Exact: each output column is the same dot product as before.
"""
from __future__ import annotations

import operator
from collections.abc import Callable

import torch
from torch import nn

_LINEAR = torch.ops.aten.linear.default
_VIEW = torch.ops.aten.view.default


def _attr(node):
    return node if isinstance(node, torch.fx.Node) and node.op == "get_attr" else None


def _fusable(node, gm) -> bool:
    """A linear whose weight (and bias, if any) are 2-D / 1-D get_attr tensors of the graph module."""
    if node.op != "call_function" or node.target is not _LINEAR or node.kwargs:
        return False
    weight, bias = node.args[1], node.args[2] if len(node.args) > 2 else None
    if _attr(weight) is None or (bias is not None and _attr(bias) is None):
        return False
    return _fetch(gm, weight.target).dim() == 2


def _fetch(gm, target: str) -> torch.Tensor:
    owner, _, name = target.rpartition(".")
    return getattr(gm.get_submodule(owner) if owner else gm, name)


def _groups(gm) -> list[list[torch.fx.Node]]:
    """Linears sharing their input (and weight dtype, and whether they have a bias), in graph order."""
    by_key: dict = {}
    for node in gm.graph.nodes:
        if _fusable(node, gm):
            bias = node.args[2] if len(node.args) > 2 else None
            by_key.setdefault((node.args[0], _fetch(gm, node.args[1].target).dtype, bias is None), []).append(node)
    return [g for g in by_key.values() if len(g) > 1]


def layer_name(linear: torch.fx.Node) -> str:
    """The module name of a linear call, from its weight's attribute name ("layers.0.query")."""
    return linear.args[1].target.rpartition(".")[0]


def fuse_shared_input_linears(gm: torch.fx.GraphModule,
                              allow: Callable[[list[str]], bool] | None = None) -> dict[str, list[str]]:
    """Fuse, in place, every group of two or more ``aten.linear`` calls that read the same tensor into one linear
    over the concatenated weights (and biases) followed by a split of its last dim.

    ``gm`` is a torch.export graph module (ExportedProgram.module()) whose linear weights are get_attr nodes;
    linears whose weight is computed in the graph (an int8 graph's dequantize) are left alone. ``allow(names)``,
    given the member layers' names, may refuse a group. The fused weight is registered as
    ``<parent>.<member1>_<member2>_....weight`` (a new submodule of the members' common parent) so that its layer
    name says what it holds; members' weights nothing else reads are removed. Returns {fused layer name: member
    layer names}."""
    fused, members = {}, set()
    for group in _groups(gm):
        names = [layer_name(n) for n in group]
        parents = {name.rpartition(".")[0] for name in names}
        if len(parents) != 1 or (allow is not None and not allow(names)):
            continue
        parent = parents.pop()
        leaf = "_".join(name.rpartition(".")[2] for name in names)
        owner = gm.get_submodule(parent) if parent else gm
        if hasattr(owner, leaf):
            continue
        weights = [_fetch(gm, n.args[1].target) for n in group]
        biases = [_fetch(gm, n.args[2].target) for n in group] if len(group[0].args) > 2 and \
            group[0].args[2] is not None else None
        holder = nn.Module()
        holder.weight = nn.Parameter(torch.cat([w.detach() for w in weights]), requires_grad=False)
        if biases is not None:
            holder.bias = nn.Parameter(torch.cat([b.detach() for b in biases]), requires_grad=False)
        owner.add_module(leaf, holder)
        fused_name = f"{parent}.{leaf}" if parent else leaf
        members |= {a.target for n in group for a in n.args[1:] if a is not None}
        _rewrite(gm, group, fused_name, holder, [w.shape[0] for w in weights])
        fused[fused_name] = names
    if fused:
        _drop_unused_attrs(gm, members)
        gm.recompile()
    return fused


def _rewrite(gm, group, fused_name, holder, sizes):
    graph = gm.graph
    first = group[0]
    fake = torch._guards.detect_fake_mode([n.meta.get("val") for n in group])
    with graph.inserting_before(first):
        weight = graph.get_attr(f"{fused_name}.weight")
        bias = graph.get_attr(f"{fused_name}.bias") if hasattr(holder, "bias") else None
        linear = graph.call_function(_LINEAR, (first.args[0], weight, bias))
        split = graph.call_function(torch.ops.aten.split_with_sizes.default, (linear, sizes, -1))
        outs = [graph.call_function(operator.getitem, (split, i)) for i in range(len(group))]
    linear.meta.update({k: v for k, v in first.meta.items() if k != "val"})
    if fake is not None:
        with fake:
            for node, tensor in ((weight, holder.weight), (bias, getattr(holder, "bias", None))):
                if node is not None:
                    node.meta["val"] = fake.from_tensor(tensor)
            linear.meta["val"] = _LINEAR(first.args[0].meta["val"], weight.meta["val"],
                                         None if bias is None else bias.meta["val"])
            pieces = torch.ops.aten.split_with_sizes.default(linear.meta["val"], sizes, -1)
        split.meta["val"] = list(pieces)
    for node, out in zip(group, outs):
        # only the value: the linear's source/module metadata would make quantizers see the slice as a linear
        out.meta["val"] = node.meta.get("val")
        for user in list(node.users):
            # A slice of the fused output is strided: a view that merges its last dim needs reshape.
            if user.op == "call_function" and user.target is _VIEW:
                user.target = torch.ops.aten.reshape.default
        node.replace_all_uses_with(out)
        graph.erase_node(node)


def _drop_unused_attrs(gm, targets):
    """Remove the get_attr nodes of ``targets`` that nothing reads any more, and their tensors once no node does."""
    for node in list(gm.graph.nodes):
        if node.op == "get_attr" and node.target in targets and not node.users:
            gm.graph.erase_node(node)
    still = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for target in targets - still:
        owner, _, leaf = target.rpartition(".")
        delattr(gm.get_submodule(owner) if owner else gm, leaf)


_MATMULS = (torch.ops.aten.matmul.default, torch.ops.aten.bmm.default)
_SOFTMAX = (torch.ops.aten.softmax.int, torch.ops.aten._softmax.default)
_TO_COPY = torch.ops.aten._to_copy.default
# Ops between the scores matmul and the softmax that attention code writes (scale, additive mask).
_SCORE_OPS = (torch.ops.aten.div.Tensor, torch.ops.aten.mul.Tensor, torch.ops.aten.add.Tensor)


def _attention_softmaxes(gm) -> list[torch.fx.Node]:
    """Softmaxes over the last dim whose result is the left operand of a matmul (attention probabilities @ V)."""
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _SOFTMAX:
            continue
        val = node.args[0].meta.get("val")
        if val is None or node.args[1] not in (-1, val.dim() - 1):
            continue
        if node.target is torch.ops.aten.softmax.int and len(node.args) > 2 and node.args[2] is not None:
            continue  # an explicit output dtype: left as written
        if node.target is torch.ops.aten._softmax.default and node.args[2]:
            continue  # half_to_float: left as written
        if any(_left_of_matmul(node, u) for u in node.users):
            found.append(node)
    return found


def _left_of_matmul(node, user) -> bool:
    """Whether ``user`` multiplies ``node`` from the left, directly or through one dtype cast of it."""
    if user.op != "call_function":
        return False
    if user.target is _TO_COPY and set(user.kwargs) == {"dtype"}:
        return any(_left_of_matmul(user, u) for u in user.users)
    return user.target in _MATMULS and user.args[0] is node


def write_out_attention_softmax(gm: torch.fx.GraphModule, scores_dtype: torch.dtype | None = None) -> int:
    """Rewrite, in place, each softmax of attention scores (a last-dim softmax whose result is multiplied with V)
    as exp(s - max(s)) * (1 / sum(exp(s - max(s)))); returns how many.

    Why: Inductor recognises matmul -> scale -> softmax -> matmul and replaces it with its CPU flash attention
    kernel, which on short sequences runs well below the bf16 GEMM roof; written out, the two matmuls stay oneDNN
    batched GEMMs and Inductor fuses max, exp, sum and the product into one softmax kernel. ``scores_dtype``
    (e.g. torch.float32) computes the softmax in that dtype and casts the probabilities back; None keeps the
    scores' dtype (Inductor accumulates the sum in fp32 either way)."""
    aten = torch.ops.aten
    graph = gm.graph
    nodes = _attention_softmaxes(gm)
    for node in nodes:
        scores = node.args[0]
        dtype = scores.meta["val"].dtype
        with graph.inserting_before(node):
            s = scores if scores_dtype in (None, dtype) else graph.call_function(
                aten._to_copy.default, (scores,), {"dtype": scores_dtype})
            shifted = graph.call_function(aten.sub.Tensor, (s, graph.call_function(aten.amax.default,
                                                                                     (s, [-1], True))))
            e = graph.call_function(aten.exp.default, (shifted,))
            p = graph.call_function(aten.mul.Tensor, (e, graph.call_function(
                aten.reciprocal.default, (graph.call_function(aten.sum.dim_IntList, (e, [-1], True)),))))
            if s is not scores:
                p = graph.call_function(aten._to_copy.default, (p,), {"dtype": dtype})
        p.meta["val"] = node.meta.get("val")
        node.replace_all_uses_with(p)
        graph.erase_node(node)
    if nodes:
        gm.recompile()
    return len(nodes)


def _scores_matmul(node):
    """The matmul that computed the attention scores ``node``, through scaling and masking; or None."""
    while node.op == "call_function" and node.target in _SCORE_OPS:
        node = node.args[0]
    return node if node.op == "call_function" and node.target in _MATMULS else None


def attention_matmuls_in(gm: torch.fx.GraphModule, dtype: torch.dtype = torch.bfloat16) -> int:
    """Run, in place, the two fp32 batched matmuls of each attention (scores = Q K^T and context = P V, around a
    softmax found as write_out_attention_softmax finds it) in ``dtype``: their operands cast to ``dtype``, their
    results cast back to fp32, so the softmax still computes in fp32 and what follows (an int8 graph's next
    quantize) sees fp32 as before. Returns how many matmuls were rewritten.

    Why: an int8 (pt2e) graph keeps attention in fp32; in bf16 the matmuls run at the bf16 GEMM rate and Inductor
    fuses the casts into the neighbouring pointwise kernels."""
    graph = gm.graph
    matmuls = []
    for softmax in _attention_softmaxes(gm):
        context = [u for u in softmax.users if u.op == "call_function" and u.target in _MATMULS
                   and u.args[0] is softmax]
        matmuls += [m for m in (_scores_matmul(softmax.args[0]), *context) if m is not None and m not in matmuls]
    matmuls = [m for m in matmuls if m.meta.get("val") is not None and m.meta["val"].dtype == torch.float32]
    for mm in matmuls:
        with graph.inserting_before(mm):
            mm.args = tuple(graph.call_function(_TO_COPY, (a,), {"dtype": dtype}) for a in mm.args[:2])
        with graph.inserting_after(mm):
            back = graph.call_function(_TO_COPY, (mm,), {"dtype": torch.float32})
        back.meta["val"] = mm.meta["val"]
        for user in [u for u in mm.users if u is not back]:
            user.replace_input_with(mm, back)
    if matmuls:
        gm.recompile()
    return len(matmuls)
