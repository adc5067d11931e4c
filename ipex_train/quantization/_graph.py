"""Calibration without torch.fx: which ops run int8, how tensors flow between them, and their observers.

Module ops are the Conv1d/2d/3d and Linear modules (exact types; a subclass may override forward), seen through
forward hooks. Functional ops are seen through a TorchFunctionMode active only inside PreparedModel.forward: every
torch call of the model passes through it, so Python control flow, HuggingFace models and anything else eager
PyTorch runs are recorded as they execute, branch by branch.

Tensors are tagged (weakly, by identity) with the op that produced them; quantization-transparent ops (pooling,
reshapes, relu: torch has quantized kernels for them that keep the scale) pass the tag on. From that flow:

* a residual add of two float tensors of one shape that both come from int8 ops is an op of its own (int8 add),
  named after its first producer (its inputs_flow holds both, which is how convert finds it again at run
  time). An in-place add
  (``out += identity``) writes into the int8 tensor of its first producer, so that producer's output observer
  also sees the sum: its scale then covers both, and the int8 add can write in place (quantized::add_out);
* an op whose raw output is read only by a relu (module or function), on every call, gets the relu fused
  (post_op "relu"); its output is then observed after the relu;
* an op whose output (or a view of it) is modified in place by a call int8 tensors do not support keeps fp32
  outputs.

The op list (ids, names, types) is fixed by prepare()'s pass over ``example_inputs``, in execution order (module
ops that did not run follow); calibration batches only update observers and the fusion checks. An add that first
appears on a later batch (another branch) stays fp32.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

MODULE_KINDS = {nn.Conv1d: "conv1d", nn.Conv2d: "conv2d", nn.Conv3d: "conv3d", nn.Linear: "linear"}
RELU = frozenset({"relu", "relu_"})
ADD = frozenset({"add", "__add__", "add_", "__iadd__"})  # Python's "a += b" arrives as add_
# Ops with QuantizedCPU kernels that keep the input's scale and zero point: an int8 tensor goes through them as is.
TRANSPARENT = frozenset({
    "max_pool1d", "max_pool2d", "max_pool3d", "_max_pool1d", "_max_pool2d", "_max_pool3d", "adaptive_avg_pool1d",
    "adaptive_avg_pool2d", "adaptive_avg_pool3d", "avg_pool2d", "avg_pool3d", "flatten", "view", "reshape",
    "transpose", "permute", "contiguous", "squeeze", "unsqueeze", "gelu", "hardtanh", "relu6", "__getitem__",
    "chunk", "split", "narrow", "expand"})
# Calls that only read metadata; they neither consume values nor make new tensors from them.
METADATA = frozenset({"size", "dim", "stride", "numel", "is_contiguous", "is_floating_point", "__get__", "__len__",
                      "__format__", "__repr__", "__hash__", "data_ptr", "element_size", "nelement", "__bool__"})


def inplace(name: str) -> bool:
    """Whether a torch call of this name writes into its first argument."""
    return (name.endswith("_") and not name.endswith("__")) or name.startswith("__i") or name == "__setitem__"


@dataclass(eq=False)
class Op:
    """One quantizable op of the model and what calibration learnt about it."""

    name: str
    kind: str                      # conv1d, conv2d, conv3d, linear, add
    n_inputs: int
    module: nn.Module | None = None
    id: int = -1
    calls: int = 0                 # calls during calibration batches
    inputs_flow: list = field(default_factory=list)
    in_obs: list = field(default_factory=list)
    out_obs: object = None
    relu_obs: object = None
    relu_fusable: bool | None = None   # None until the op ran
    mutated_in_place: bool = False

    def observers(self, qconfig):
        self.in_obs = [qconfig.activation_observer() for _ in range(self.n_inputs)]
        self.out_obs, self.relu_obs = qconfig.activation_observer(), qconfig.activation_observer()
        self.inputs_flow = [None] * self.n_inputs

    def summary_observers(self) -> list[tuple[str, object]]:
        """(label, observer) of what the summary entry's scales come from: each input, then the output (after
        the fused relu when there is one)."""
        out = ("output after its fused relu", self.relu_obs) if self.relu_fusable else ("output", self.out_obs)
        return [(f"input {k}", o) for k, o in enumerate(self.in_obs)] + [out]

    def state(self):
        """What a calibration batch changes in this op, copied (see Graph.snapshot)."""
        observers = [self.out_obs, self.relu_obs, *self.in_obs]
        return (self.calls, self.relu_fusable, self.mutated_in_place,
                [{k: b.clone() for k, b in o.named_buffers()} for o in observers])

    def restore(self, state) -> None:
        """Put back what state() copied."""
        self.calls, self.relu_fusable, self.mutated_in_place, buffers = state
        for o, saved in zip([self.out_obs, self.relu_obs, *self.in_obs], buffers):
            for k, b in saved.items():
                setattr(o, k, b)


@dataclass(eq=False)
class _Tag:
    op: Op
    consumers: list | None = None  # the calls reading the op's raw output; None past the raw output


class Graph:
    """The ops of one prepared model, their observers and data flow."""

    def __init__(self, model: nn.Module, qconfig):
        self.qconfig = qconfig
        self.ops: list[Op] = []
        self.adds: dict[tuple, Op] = {}
        self.by_module: dict[int, Op] = {}
        for name, m in model.named_modules():
            if type(m) in MODULE_KINDS and id(m) not in self.by_module:
                op = Op(name, MODULE_KINDS[type(m)], 1, m)
                op.observers(qconfig)
                self.by_module[id(m)] = op
        self.hooks = [h for op in self.by_module.values()
                      for h in (op.module.register_forward_pre_hook(self._pre_hook),
                                op.module.register_forward_hook(self._post_hook))]

    def add_op(self, key: tuple) -> Op:
        names = {op.name for op in self.ops}
        name = f"{key[0]}+add"
        k = 2
        while name in names:
            name, k = f"{key[0]}+add#{k}", k + 1
        op = Op(name, "add", 2)
        op.observers(self.qconfig)
        op.inputs_flow = [f"{k}.output0" for k in key]
        self.adds[key] = op
        self.ops.append(op)
        return op

    def number(self, first_seen: list[Op]) -> None:
        """Fix the op ids: execution order of the structure pass, then module ops that did not run."""
        ordered = list(dict.fromkeys(first_seen + [op for op in self.by_module.values()]))
        for i, op in enumerate(ordered):
            op.id = i
        self.ops = ordered

    def snapshot(self) -> list:
        """The calibration state of every op (observers, call counts, fusion checks), for restore()."""
        return [op.state() for op in self.ops]

    def restore(self, snapshot: list) -> None:
        """Undo the calibration batches run since snapshot() (a batch that raised must change nothing)."""
        for op, state in zip(self.ops, snapshot):
            op.restore(state)

    def zero_ranges(self) -> list[str]:
        """The observed tensors whose calibrated range is a single value (all-zero inputs, a constant channel):
        their scale falls back to the observer's floor and every other value saturates."""
        return [f"{op.name} ({op.kind}) {label}" for op in self.ops if op.calls
                for label, obs in op.summary_observers() if bool(obs.min_val == obs.max_val)]

    def remove_hooks(self, model: nn.Module) -> None:
        """Take this graph's hooks off ``model`` (the prepared model or a deep copy of it)."""
        keys = {h.id for h in self.hooks}
        for m in model.modules():
            for hooks in (m._forward_pre_hooks, m._forward_hooks):
                for k in keys & set(hooks):
                    del hooks[k]

    @staticmethod
    def _pre_hook(module, inputs):
        rec = Recorder.active()
        if rec is not None and inputs and isinstance(inputs[0], torch.Tensor):
            rec.module_input(rec.graph.by_module[id(module)], inputs[0])

    @staticmethod
    def _post_hook(module, inputs, output):
        rec = Recorder.active()
        if rec is not None and isinstance(output, torch.Tensor):
            rec.module_output(rec.graph.by_module[id(module)], output)


def _tensors(args):
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (t for t in a if isinstance(t, torch.Tensor))


def _float(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == torch.float32 and not t.is_quantized


class Recorder(TorchFunctionMode):
    """One forward pass of a prepared model: tags tensors with their producing op, feeds the observers
    (``observe``), and in the structure pass (``discover``) creates the add ops and numbers everything."""

    _local = threading.local()  # the recording pass per thread

    @staticmethod
    def active():
        """The recorder of the prepared-model forward running in this thread, or None."""
        return getattr(Recorder._local, "current", None)

    def __init__(self, graph: Graph, observe: bool, discover: bool, batch: int = 0):
        super().__init__()
        self.graph, self.observe, self.discover, self.batch = graph, observe, discover, batch
        self.flow = WeakIdKeyDictionary()
        self.raw: list[_Tag] = []
        self.seen: list[Op] = []

    def __enter__(self):
        if Recorder.active() is not None:
            raise RuntimeError("a prepared model is already calibrating in this thread (nested calls)")
        Recorder._local.current = self
        return super().__enter__()

    def __exit__(self, *exc):
        Recorder._local.current = None
        super().__exit__(*exc)
        if exc[0] is None:
            for tag in self.raw:
                tag.op.relu_fusable = tag.op.relu_fusable is not False and tag.consumers == ["relu"]

    def _ran(self, op: Op) -> None:
        if self.observe:
            op.calls += 1  # calibration calls: an op never observed has no scales and stays fp32
        if self.discover and op not in self.seen:
            self.seen.append(op)

    def _observe(self, obs, t, op: Op, label: str) -> None:
        if self.observe and _float(t):
            finite = torch.isfinite(t)
            if not bool(finite.all()):
                nan = int(torch.isnan(t).sum())
                raise ValueError(
                    f"ipex_train.quantization: calibration batch {self.batch} (after {self.batch - 1} accepted): "
                    f"{label} of op {op.name!r} "
                    f"({op.kind}) holds {nan} NaN and {int(finite.numel() - finite.sum()) - nan} infinite values; "
                    "a scale needs finite values. The batch was not recorded (the prepared model is as before "
                    "it): leave it out or clean it, then go on calibrating")
            obs(t.detach())

    def module_input(self, op: Op, x) -> None:
        self._observe(op.in_obs[0], x, op, "input 0")
        if self.discover:
            tag = self.flow.get(x)
            op.inputs_flow[0] = f"{tag.op.name}.output0" if tag is not None else None

    def module_output(self, op: Op, out) -> None:
        self._ran(op)
        self._observe(op.out_obs, out, op, "output")
        tag = _Tag(op, [])
        self.flow[out] = tag
        self.raw.append(tag)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in METADATA:
            return func(*args, **kwargs)
        tagged = [(t, self.flow.get(t)) for t in _tensors(args)]
        for _, tag in tagged:
            if tag is not None and tag.consumers is not None:
                tag.consumers.append("relu" if name in RELU else name)
        if name in ADD and not kwargs:
            op = self._add_op(args, inplace(name))
            if op is not None:
                return self._add(op, func, args, tagged[0][1] if inplace(name) else None)
        first = tagged[0][1] if tagged and tagged[0][0] is (args[0] if args else None) else None
        if first is not None and inplace(name) and name not in RELU:
            first.op.mutated_in_place = True
        result = func(*args, **kwargs)
        if first is not None and isinstance(result, torch.Tensor):
            if name in RELU and first.consumers is not None:
                self._observe(first.op.relu_obs, result, first.op, "output after its fused relu")
            if name in RELU or name in TRANSPARENT:
                self.flow[result] = _Tag(first.op)
        return result

    def _add_op(self, args, in_place: bool):
        if len(args) != 2 or not (_float(args[0]) and _float(args[1])) or args[0].shape != args[1].shape:
            return None
        ta, tb = self.flow.get(args[0]), self.flow.get(args[1])
        if ta is None or tb is None or (in_place and ta.consumers is None):
            return None  # an in-place add is int8 only into a producer's own output, not into a view of it
        key = (ta.op.name, tb.op.name)
        op = self.graph.adds.get(key)
        if op is None and self.discover:
            op = self.graph.add_op(key)
        return op

    def _add(self, op: Op, func, args, target: _Tag | None):
        for k, (obs, t) in enumerate(zip(op.in_obs, args)):
            self._observe(obs, t, op, f"input {k}")
        result = func(*args)
        if target is not None:
            self._observe(target.op.out_obs, result, target.op, "output (with the in-place add into it)")
        self.module_output(op, result)
        return result
