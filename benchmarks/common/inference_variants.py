"""Builders of the inference variants shared by bench_inference, bench_int8 and the studies: ipex_train's
TorchScript export, its AOTInductor packages (fp32, bf16, int8 through ipex_train.quantization), the stock torchao
pt2e int8 flow and torch.compile with freezing; :func:`build_each`, which builds them reporting failures, and
:func:`time_on`, their timing on one input."""
import atexit
import copy
import functools
import os
import shutil
import tempfile
import time

import torch

from ipex_train import inference, quantization

from .timing import Rounds, interleaved

_DIR: str | None = None  # made on the first package, removed when the process exits


def _package_dir() -> str:
    """The folder the AOTInductor packages of this process are written to (they stay there while it runs them)."""
    global _DIR
    if _DIR is None:
        _DIR = tempfile.mkdtemp(prefix="ipex_bench_aoti_")
        atexit.register(shutil.rmtree, _DIR, ignore_errors=True)
    return _DIR


def build_each(builders, built: dict, build_s: dict, skipped: dict) -> None:
    """Call each zero-argument builder of ``builders`` in turn into ``built[name]``, adding its seconds to
    ``build_s[name]``; one that raises is recorded in ``skipped[name]`` (its message) and the others still run."""
    for name, build in builders.items():
        start = time.perf_counter()
        try:
            built[name] = build()
        except Exception as e:  # noqa: BLE001 -- a variant that fails here is reported, the others still run
            skipped[name] = f"{type(e).__name__}: {e}"[:200]
            continue
        build_s[name] = build_s.get(name, 0.0) + time.perf_counter() - start


def time_on(fns, x, rounds, calls: int = 1, warmup: int = 1) -> Rounds:
    """Each ``fn(x)`` of ``fns`` timed in interleaved rounds under torch.no_grad() (see timing.interleaved)."""
    with torch.no_grad():
        return interleaved({name: functools.partial(fn, x) for name, fn in fns.items()}, rounds, calls,
                           warmup=warmup)


def channels_last(x):
    """``x`` in channels-last layout when it is a batch of images."""
    return x.contiguous(memory_format=torch.channels_last) if x.dim() == 4 else x


def ipex_train_export(model, x, dtype=torch.float32):
    """ipex_train's TorchScript path on a copy: fold conv/linear + BatchNorm, drop dropout, channels-last for a CNN,
    ``dtype`` weights, then ipex_train.inference.export; the returned callable converts its input likewise."""
    model = copy.deepcopy(model)
    sample = x[:1]  # the data-flow check needs one forward pass, not a full batch
    inference.fold_conv_bn(model, sample_input=sample)
    inference.fold_linear_bn(model, sample_input=sample)
    inference.replace_dropout(model)
    if x.dim() == 4:
        model = model.to(memory_format=torch.channels_last)
    model = model.to(dtype)
    scripted = inference.export(model, channels_last(x).to(dtype), check_trace=False)
    return lambda inp: scripted(channels_last(inp).to(dtype))


def aoti(model, x, dtype, passes=True):
    """ipex_train.inference.export(backend="aoti") at ``dtype``, loaded back with torch alone (fp32 input);
    ``passes=False`` turns off its graph passes (Q/K/V fusion, written-out attention softmax)."""
    path = os.path.join(_package_dir(), f"{id(model)}_{x.shape[0]}_{dtype}_{passes}.pt2".replace("torch.", ""))
    inference.export(model, x, backend="aoti", path=path, config=inference.AOTIConfig(
        dtype=dtype, fuse_linears=passes, write_out_softmax=passes))
    return torch._inductor.aoti_load_package(path)


def int8_aoti(prepared, x, dynamic=False, passes=True, bf16_attention=True):
    """A calibrated ipex_train PreparedModel lowered with convert(backend="pt2e") and packaged with AOTInductor;
    default dims (static for int8 convolutions), or the batch dynamic with ``dynamic``; ``passes=False`` turns
    off the graph passes (Q/K/V fusion in convert, written-out attention softmax in export); ``bf16_attention=False``
    keeps the attention matmuls in fp32 (convert's bf16_attention)."""
    dims = (0,) if dynamic else None
    graph = quantization.convert(prepared, backend="pt2e", example_inputs=x, dynamic_dims=dims, fuse_linears=passes,
                                 bf16_attention=bf16_attention)
    if not isinstance(graph, torch.fx.GraphModule):  # the fallback's warning says why
        raise TypeError(f"convert(backend='pt2e') fell back to the eager int8 model ({type(graph).__name__})")
    path = os.path.join(_package_dir(), f"int8_{id(prepared)}_{x.shape[0]}_{dynamic}_{passes}_{bf16_attention}.pt2")
    inference.export(graph, x, backend="aoti", path=path, config=inference.AOTIConfig(
        dynamic_dims=dims, fuse_linears=passes, write_out_softmax=passes))
    return torch._inductor.aoti_load_package(path)


def pt2e_compile(model, x, calib):
    """Stock torchao pt2e: strict torch.export, X86InductorQuantizer, calibration, convert, torch.compile with
    freezing (what a user would write without ipex_train)."""
    import torch._inductor.config as inductor_config
    import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer as xiq
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    quantizer = xiq.X86InductorQuantizer()
    quantizer.set_global(xiq.get_default_x86_inductor_quantization_config())
    with torch.no_grad():
        # Captured on a calibration batch with the batch dynamic: the timed batch differs (and may be 1, which
        # torch.export would specialise); torch.compile then specialises on the timed batch.
        graph = torch.export.export(copy.deepcopy(model), (calib[0],), strict=True,
                                    dynamic_shapes=({0: torch.export.Dim.AUTO},)).module()
        prepared = prepare_pt2e(graph, quantizer)
        for c in calib:
            prepared(c)
        converted = convert_pt2e(prepared)
        inductor_config.freezing = True
        compiled = torch.compile(converted)
        compiled(x)
    return compiled


def compile_freezing(model, x, dtype):
    """Stock torch.compile with Inductor freezing at ``dtype`` (input cast inside the call)."""
    import torch._inductor.config as inductor_config

    inductor_config.freezing = True
    compiled = torch.compile(copy.deepcopy(model).to(dtype))
    with torch.no_grad():
        compiled(x.to(dtype))
    return lambda inp: compiled(inp.to(dtype))
