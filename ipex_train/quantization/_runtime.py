"""What a converted model runs: torch's quantized CPU modules for Conv/Linear, quantized::add(_relu) for residual
adds, and a TorchFunctionMode that routes int8 tensors through the rest of the model.

Activations between int8 ops stay int8 (torch quantized tensors, uint8 with a scale and zero point), so pooling,
reshapes and relu between them run torch's quantized kernels. The mode, active only inside QuantizedModel.forward,
sees every other torch call:

* an add whose two int8 inputs come from the producers calibration recorded runs quantized::add or add_relu
  (add_out/add_relu_out into the first input for ``a += b``);
* a relu on an int8 tensor whose producer already applied it returns that tensor (no second pass);
* any other call that receives int8 tensors gets them dequantized and runs in fp32 (softmax, layer_norm, the
  attention matmuls...), so code calibration never saw still runs; an in-place write into an int8 tensor that torch
  cannot do raises RuntimeError naming the op.

Everything the mode decides happens in Python around torch ops, so torch.jit.trace records only aten/quantized
ops: the traced graph needs no ipex_train code to load or run.
"""
from __future__ import annotations

import threading
import weakref
from collections import Counter

import torch
import torch.ao.nn.intrinsic.quantized as nniq
import torch.ao.nn.quantized as nnq
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from ._graph import ADD, METADATA, RELU, TRANSPARENT, inplace

# fp32 module class -> its quantized module class (post-op none, relu), and each quantized class's kernel.
QUANTIZED = {nn.Linear: (nnq.Linear, nniq.LinearReLU), nn.Conv1d: (nnq.Conv1d, nniq.ConvReLU1d),
             nn.Conv2d: (nnq.Conv2d, nniq.ConvReLU2d), nn.Conv3d: (nnq.Conv3d, nniq.ConvReLU3d)}
_KERNELS = {nnq.Linear: torch.ops.quantized.linear, nniq.LinearReLU: torch.ops.quantized.linear_relu,
            nnq.Conv1d: torch.ops.quantized.conv1d, nnq.Conv2d: torch.ops.quantized.conv2d,
            nnq.Conv3d: torch.ops.quantized.conv3d, nniq.ConvReLU1d: torch.ops.quantized.conv1d_relu,
            nniq.ConvReLU2d: torch.ops.quantized.conv2d_relu, nniq.ConvReLU3d: torch.ops.quantized.conv3d_relu}


class Int8Layer(nn.Module):
    """A Conv/Linear replaced by torch's quantized module (its relu fused when post_op is "relu")."""

    def __init__(self, name: str, qmodule: nn.Module, in_scale: float, in_zero_point: int, out_quantized: bool,
                 relu: bool, memory_format: torch.memory_format | None, rank: int | None):
        super().__init__()
        self.op_name, self.q, self.rank = name, qmodule, rank  # rank: a conv's batched input rank
        self.in_scale, self.in_zero_point = in_scale, in_zero_point
        self.out_quantized, self.relu, self.memory_format = out_quantized, relu, memory_format
        # The quantized module's own kernel (quantized::conv2d_relu, quantized::linear, ...), called directly: its
        # forward() only re-checks the input's rank, and this call is per layer per batch (batch-1 latency).
        self._kernel, self._linear = _KERNELS[type(qmodule)], isinstance(qmodule, nnq.Linear)

    def forward(self, x):
        with torch._C.DisableTorchFunction():  # the runtime mode must not dequantize this layer's own int8 calls
            # nn.ConvNd also takes an unbatched (C, ...) input; torch's quantized conv kernels take batched ones only
            unbatched = self.rank is not None and x.dim() == self.rank - 1
            if self.rank is not None and not unbatched and x.dim() != self.rank:
                raise ValueError(
                    f"int8 Conv{self.rank - 2}d {self.op_name!r}: input of shape {tuple(x.shape)}; accepted are "
                    f"{self.rank}-D batched (N, C, ...) and {self.rank - 1}-D unbatched (C, ...) inputs, as for "
                    f"torch.nn.Conv{self.rank - 2}d")
            if not x.is_quantized:
                x = Runtime.quantize(x, self.in_scale, self.in_zero_point)
            if unbatched:
                x = x.unsqueeze(0)
            if self.memory_format is not None and not x.is_contiguous(memory_format=self.memory_format):
                x = x.contiguous(memory_format=self.memory_format)  # channels-last: oneDNN's fast int8 layout
            q = self.q
            y = self._kernel(x, q._packed_params._packed_params if self._linear else q._packed_params, q.scale,
                             q.zero_point)
            if unbatched:
                y = y.squeeze(0)
            if not self.out_quantized:
                return y.dequantize()
        Runtime.tag(y, self.op_name, self.relu)
        return y

    def weight(self):
        """The int8 weight (a quantized tensor). A method, as on torch's quantized modules: model code that reads
        ``layer.weight.dtype`` to cast its activations (HuggingFace's T5-family feed-forward blocks) checks for a
        tensor first and leaves int8 layers alone."""
        return self.q.weight()

    def extra_repr(self):
        return f"{self.op_name!r}, relu={self.relu}, out_quantized={self.out_quantized}"


class AddPlan:
    """An int8 residual add: output scale and zero point, relu fused, output kept int8 or not."""

    def __init__(self, name: str, scale: float, zero_point: int, relu: bool, out_quantized: bool):
        self.name, self.scale, self.zero_point = name, scale, zero_point
        self.relu, self.out_quantized = relu, out_quantized

    def __call__(self, a, b, in_place: bool):
        if in_place:  # into a's own int8 storage, at a's scale (calibration made it cover the sum)
            return (torch.ops.quantized.add_relu_out if self.relu else torch.ops.quantized.add_out)(a, b, a)
        op = torch.ops.quantized.add_relu if self.relu else torch.ops.quantized.add
        y = op(a, b, self.scale, self.zero_point)
        return y if self.out_quantized else y.dequantize()


def _has_int8(args, kwargs) -> bool:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            if a.is_quantized:
                return True
        elif isinstance(a, (list, tuple)) and any(isinstance(t, torch.Tensor) and t.is_quantized for t in a):
            return True
    return False


def _dequantize(x):
    return x.dequantize() if isinstance(x, torch.Tensor) and x.is_quantized else x


def _adding(zero_or_nan):
    def apply(x):
        return x + zero_or_nan if isinstance(x, torch.Tensor) and x.is_floating_point() else x
    return apply


class Runtime(TorchFunctionMode):
    """The mode of one QuantizedModel forward. ``calls`` (a Counter), when given, counts the fp32 calls by name."""

    _local = threading.local()  # the active runtime per thread: torch's mode stack is per thread too

    def __init__(self, adds: dict[tuple, AddPlan], calls: Counter | None = None):
        super().__init__()
        self.adds, self.calls = adds, calls
        # id(int8 tensor) -> (weak reference, producer op name, relu already applied). A plain dict checked against
        # the weak reference: WeakIdKeyDictionary's Python-level keys cost more per lookup than the kernels of a
        # small layer at batch 1; a stale id (tensor freed, id reused) fails the identity check.
        self._flow: dict[int, tuple] = {}
        self.last = None  # (fp32 tensor, its version, scale, zero point, int8 tensor) of the last quantization
        # The sum of every tensor quantized in this forward (None before any): non-finite when one held NaN or
        # +-inf, which quantizing would clamp to finite codes. QuantizedModel adds sums - sums (0, or NaN) to its
        # outputs, so they are NaN as fp32's would have been. One cheap reduction per quantized tensor
        # (isfinite().any() cost 10-20x more here); tensor ops, not a Python branch: no synchronisation, and a
        # trace records it. A sum of finite values reaches float32's 3.4e38 only for values far past what any
        # accepted scale represents (255 * 2**42), which saturate.
        self.sums = None

    def __enter__(self):
        self.outer, Runtime._local.current = Runtime.active(), self
        return super().__enter__()

    def __exit__(self, *exc):
        Runtime._local.current = self.outer
        return super().__exit__(*exc)

    @staticmethod
    def active():
        """The runtime of the QuantizedModel forward running in this thread, or None."""
        return getattr(Runtime._local, "current", None)

    @staticmethod
    def quantize(x, scale: float, zero_point: int):
        """x quantized to uint8; layers reading one fp32 tensor with the same qparams (Q, K, V) share one pass."""
        rt = Runtime.active()
        key = (x._version, scale, zero_point)
        if rt is not None and rt.last is not None and rt.last[0] is x and rt.last[1:4] == key:
            return rt.last[4]
        q = torch.quantize_per_tensor(x, scale, zero_point, torch.quint8)
        if rt is not None:
            rt.last = (x, *key, q)
            total = x.sum()
            rt.sums = total if rt.sums is None else rt.sums.add_(total)
        return q

    @staticmethod
    def tag(y, name: str, relu: bool) -> None:
        """Record that int8 tensor ``y`` comes from op ``name`` (after its relu when ``relu``)."""
        rt = Runtime.active()
        if rt is not None:
            rt.set_tag(y, name, relu)

    def set_tag(self, y, name: str, relu: bool) -> None:
        """Tag int8 tensor ``y`` with its producer op for the rest of this forward."""
        self._flow[id(y)] = (weakref.ref(y), name, relu)

    def get_tag(self, t):
        """(producer op name, relu applied) of int8 tensor ``t``, or None."""
        entry = self._flow.get(id(t))
        return entry[1:] if entry is not None and entry[0]() is t else None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if not _has_int8(args, kwargs):
            if self.calls is not None and name not in METADATA and any(
                    isinstance(a, torch.Tensor) and a.is_floating_point() for a in args):
                self.calls[name] += 1
            return func(*args, **kwargs)
        if name in METADATA:
            return func(*args, **kwargs)
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        tag = self.get_tag(first) if first is not None else None
        if name in ADD and not kwargs and len(args) == 2:
            plan = self._add_plan(args)
            if plan is not None:
                y = plan(*args, in_place=inplace(name))
                if y.is_quantized:
                    self.set_tag(y, plan.name, plan.relu)
                return y
        if name in RELU and tag is not None and tag[1]:
            return first
        if (name in RELU or name in TRANSPARENT) and first is not None and first.is_quantized:
            y = func(*args, **kwargs)
            if tag is not None and isinstance(y, torch.Tensor) and y.is_quantized:
                self.set_tag(y, tag[0], name in RELU)
            return y
        if inplace(name) and first is not None and first.is_quantized:
            raise RuntimeError(f"ipex_train.quantization: in-place {name} on an int8 tensor produced by "
                               f"{tag[0] if tag else 'an int8 op'!r}, which int8 tensors do not support; set "
                               "outputs_quantized to false for that op in the qconf summary")
        if self.calls is not None:
            self.calls[name] += 1
        return func(*tree_map(_dequantize, args), **tree_map(_dequantize, kwargs))

    def _add_plan(self, args):
        a, b = args
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.is_quantized and b.is_quantized):
            return None
        ta, tb = self.get_tag(a), self.get_tag(b)
        if ta is None or tb is None or a.shape != b.shape:
            return None
        return self.adds.get((ta[0], tb[0]))


class QuantizedModel(nn.Module):
    """The int8 model convert() returns: ``model`` is the converted module tree; call this wrapper, which runs it
    under the runtime mode and hands back fp32 outputs. A call whose fp32 values entering int8 (the inputs, or
    the results of fp32 ops between int8 layers) hold a NaN or an infinity returns NaN in every floating output
    element: int8 codes cannot hold them, and a finite answer would hide the bad input."""

    def __init__(self, model: nn.Module, adds: dict[tuple, AddPlan], summary: list[dict], fp32: list[str]):
        super().__init__()
        self.model = model
        self._adds, self._summary, self._fp32 = adds, summary, fp32

    def forward(self, *args, **kwargs):
        runtime = Runtime(self._adds)
        with runtime:
            out = self.model(*args, **kwargs)
        out = tree_map(_dequantize, out)
        return out if runtime.sums is None else tree_map(_adding(runtime.sums - runtime.sums), out)

    def qconf_summary(self) -> list[dict]:
        """The qconf summary this model was converted from (what save_qconf_summary wrote or would write)."""
        return self._summary

    def fp32_calls(self, *args, **kwargs) -> Counter:
        """Run once on these inputs (no_grad) and count, by name, the torch calls that ran in fp32."""
        calls = Counter()
        with torch.no_grad(), Runtime(self._adds, calls):
            self.model(*args, **kwargs)
        return calls
