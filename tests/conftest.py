"""Shared fixtures: running a test under each kernel variant this CPU supports."""
import pytest

from ipex_train import _ops

VARIANTS = _ops.supported_kernel_variants()


@pytest.fixture(params=VARIANTS)
def variant(request):
    """Switch the kernels to one supported variant for the test, then restore the one in effect before (which is
    the IPEX_TRAIN_KERNEL choice when that is set, so the rest of the suite keeps running under it)."""
    before = _ops.kernel_variant()
    _ops.set_kernel_variant(request.param)
    yield request.param
    _ops.set_kernel_variant(before)
