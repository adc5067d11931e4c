"""Builds ipex_train._C from kernels_cpu/ against the torch already installed.

Install with `pip install --no-build-isolation .` (or -e .): an isolated build environment would download a second
torch just to compile against it.
"""
import glob
import os

from setuptools import setup

try:
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError as e:  # pragma: no cover - only hit by a misconfigured install
    raise SystemExit(
        "ipex_train builds its kernels against the installed torch: install torch first, then run "
        "`pip install --no-build-isolation .` (without --no-build-isolation pip hides torch from the build)"
    ) from e

HERE = os.path.dirname(os.path.abspath(__file__))

ext = CppExtension(
    name="ipex_train._C",
    sources=sorted(glob.glob(os.path.join("kernels_cpu", "src", "*.cpp"))),
    include_dirs=[os.path.join(HERE, "kernels_cpu", "include"), os.path.join(HERE, "kernels_cpu", "src")],
    # -ffp-contract=off: no fused multiply-adds the source did not ask for, so every ISA variant rounds alike.
    # -fno-math-errno: lets sqrt vectorize (errno is never read).
    # -fopenmp: at::parallel_for is a header template that runs serially unless the extension itself is built with
    # OpenMP (torch's own OpenMP runtime is the one linked).
    extra_compile_args=["-O3", "-fno-math-errno", "-ffp-contract=off", "-fopenmp"],
    extra_link_args=["-fopenmp"],
)

setup(
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
