"""Which quantized CPU engine packs the weights, and whether its int8 products saturate on this CPU.

Engine. torch packs a quantized layer's weights for the engine selected at packing time
(torch.backends.quantized.engine); the packed object then decides which kernels run. ipex_train packs with
"onednn" (measured faster here than "x86", which sends Linear to fbgemm: a 768x3072 linear at batch 16x128 took
41 ms vs 65 ms, a 3x3 128-channel conv 20 ms vs 31 ms), inside engine_scope(), which restores the global engine
afterwards. A saved TorchScript model re-packs its weights when loaded, under the loading process's engine (x86 by
default): it runs there with the same results, the speed being that engine's.

Saturation. Without VNNI, oneDNN (and fbgemm) compute u8 x s8 products with VPMADDUBSW, which adds adjacent pairs
into int16 with saturation: u8 255 x s8 127 twice is 64770 and comes back as 32767 (measured: a layer returning
1040 instead of 2080 with ONEDNN_MAX_CPU_ISA=AVX2 on a VNNI machine). A pair stays exact whenever
|w| <= 64 (2 x 255 x 64 = 32640), so where the probe below sees saturation, weights are quantized to 7 bits
([-64, 63]) and every uint8 activation stays exact: unlike 7-bit activations (torch's reduce_range), this also
holds for activations beyond the calibrated range.
"""
from __future__ import annotations

import contextlib
import functools
import logging

import torch

logger = logging.getLogger("ipex_train")

ENGINE = "onednn"


@contextlib.contextmanager
def engine_scope():
    """torch.backends.quantized.engine set to ENGINE for packing, restored afterwards."""
    before = torch.backends.quantized.engine
    torch.backends.quantized.engine = ENGINE
    try:
        yield
    finally:
        torch.backends.quantized.engine = before


@functools.cache
def pair_sums_saturate() -> bool:
    """Whether this CPU's int8 linear/conv kernels (packed by ENGINE) saturate u8 x s8 pair sums to int16.

    Measured rather than read from CPU flags, so that a capped oneDNN ISA (ONEDNN_MAX_CPU_ISA) counts too: a
    64-input linear and 1x1 conv with every activation 255 and weight 127 must return 64 x 255 x 127.
    """
    import torch.ao.nn.quantized as nnq

    with engine_scope(), torch.no_grad():
        exact = True
        for layer, shape in ((nnq.Linear(64, 1), (1, 64)), (nnq.Conv2d(64, 1, 1), (1, 64, 2, 2))):
            w = torch.full((1,) + tuple(shape[1:2]) + (1,) * (len(shape) - 2), 127, dtype=torch.int8)
            qw = torch._make_per_channel_quantized_tensor(w, torch.ones(1, dtype=torch.double),
                                                          torch.zeros(1, dtype=torch.long), 0)
            layer.set_weight_bias(qw, None)
            layer.scale, layer.zero_point = 64.0 * 255 * 127 / 200, 0
            x = torch._make_per_tensor_quantized_tensor(torch.full(shape, 255, dtype=torch.uint8), 1.0, 0)
            got = layer(x).int_repr().reshape(-1)[0].item()
            exact = exact and got == 200
    return not exact


_said = False


def weight_bits(requested: int | None) -> int:
    """The weight bit width to use: ``requested``, or 7 where pair sums saturate and 8 elsewhere (logged once)."""
    global _said
    if requested is not None:
        return requested
    if not pair_sums_saturate():
        return 8
    if not _said:
        _said = True
        logger.warning("ipex_train.quantization: this CPU's int8 kernels saturate u8 x s8 pair sums to int16 (no "
                       "VNNI; torch.cpu._is_vnni_supported()=%s); weights are quantized to 7 bits so that every "
                       "product stays exact", torch.cpu._is_vnni_supported())
    return 7
