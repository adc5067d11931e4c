"""Shared fixtures: running a test under each kernel variant this CPU supports; the activation dtype of a bf16
model here."""
import pytest
import torch

from ipex_train.base import ops as _ops

VARIANTS = _ops.supported_kernel_variants()


@pytest.fixture(params=VARIANTS)
def variant(request):
    """Switch the kernels to one supported variant for the test, then restore the one in effect before (which is
    the IPEX_TRAIN_KERNEL choice when that is set, so the rest of the suite keeps running under it)."""
    before = _ops.kernel_variant()
    _ops.set_kernel_variant(request.param)
    yield request.param
    _ops.set_kernel_variant(before)


@pytest.fixture
def bf16_activations():
    """The dtype optimize(dtype=bf16) leaves a converted layer's output in here: bf16 under the native compute policy,
    fp32 under the emulated one (bf16 weights computed against fp32 activations; CPUs without bf16 units)."""
    from ipex_train import compute_policy

    return torch.bfloat16 if compute_policy.resolve() == "native" else torch.float32
