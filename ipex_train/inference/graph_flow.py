"""Prove Conv + BatchNorm data flow without a sample input, from a torch.fx symbolic trace of the model.

A symbolic trace records every module call and every use of every value on the one path Python takes through
forward() (a trace of input-dependent control flow raises, and then nothing is proven here). A pair is proven
when, in that graph, the conv and the BatchNorm are each called exactly once, the BatchNorm's only input is the
conv's output, that output has no other user (no residual add reads it) and is not a graph output, and no
parameter or buffer of either module is read directly (get_attr) elsewhere. Tracing runs forward() with proxy
values: stock torch.nn modules are not entered, but Python code in the model's own forward methods runs once.
"""
import torch.fx
from torch import nn


class GraphFlow:
    """The call structure of one symbolic trace; ``verdict(pair)`` says whether it proves a (first, bn) pair."""

    def __init__(self, graph: torch.fx.Graph):
        self.calls = {}       # module FQN -> call_module nodes
        self.read_attrs = []  # get_attr targets (direct parameter/buffer reads)
        self.outputs = set()  # nodes returned by the graph
        for node in graph.nodes:
            if node.op == "call_module":
                self.calls.setdefault(node.target, []).append(node)
            elif node.op == "get_attr":
                self.read_attrs.append(node.target)
            elif node.op == "output":
                self.outputs.update(n for n in node.all_input_nodes)

    def producer_pairs(self, names):
        """(first FQN, bn FQN) for every BatchNorm call whose input is a call of a module named in ``names``."""
        found = []
        for target, nodes in self.calls.items():
            for node in nodes:
                src = node.args[0] if node.args else None
                if isinstance(src, torch.fx.Node) and src.op == "call_module" and src.target in names:
                    found.append((src.target, target))
        return found

    def verdict(self, first_name, bn_name, in_sequential=False):
        """None when the traced graph proves the pair, else the reason it does not. A pair of a stock nn.Sequential
        that the trace never calls stays proven by the Sequential."""
        first_calls, bn_calls = self.calls.get(first_name, []), self.calls.get(bn_name, [])
        if in_sequential and not first_calls and not bn_calls:
            return None
        if len(first_calls) != 1 or len(bn_calls) != 1:
            return "a module of the pair is not called exactly once in the traced forward"
        src, bn = first_calls[0], bn_calls[0]
        if bn.args[:1] != (src,) or len(bn.all_input_nodes) != 1:
            return "BatchNorm input is not the output of the preceding layer"
        if len(src.users) != 1 or src in self.outputs:
            return "the layer output is also used elsewhere (e.g. a residual add)"
        if any(t.startswith((first_name + ".", bn_name + ".")) for t in self.read_attrs):
            return "a parameter or buffer of the pair is read outside the module"
        return None


def trace_flow(model: nn.Module):
    """A GraphFlow from torch.fx.symbolic_trace(model), or the reason tracing failed (a short string)."""
    try:
        graph = torch.fx.Tracer().trace(model)
    except Exception as e:  # noqa: BLE001 -- any failure of symbolic tracing means "not proven", not an error
        first_line = str(e).splitlines()[0][:80] if str(e) else ""
        return f"torch.fx could not trace the model ({type(e).__name__}: {first_line})"
    return GraphFlow(graph)
