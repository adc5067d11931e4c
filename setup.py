"""Builds ipex_train._C from kernels_cpu/ against the torch already installed.

Install with `pip install --no-build-isolation .` (or -e .): an isolated build environment would download a second
torch just to compile against it.
"""
import glob
import os

from setuptools import setup
from setuptools.command.build_py import build_py

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

# ipex_train.xpu compiles the SYCL kernels at run time from kernels_xpu/ and the kernels_cpu headers they include.
# A wheel (a non-editable install) carries copies of them in ipex_train/_sources; an editable install reads the tree.
SYCL_SOURCES = sorted(
    ["kernels_xpu/rtc/steps.cpp", "kernels_xpu/host/module.cpp", "kernels_cpu/src/kernel_abi.h",
     "kernels_cpu/src/optimizers.h", "kernels_cpu/src/step_args.h"]
    + [os.path.relpath(f, HERE).replace(os.sep, "/")
       for f in glob.glob(os.path.join(HERE, "kernels_cpu", "include", "**", "*.h"), recursive=True)]
)


class BuildPyWithSyclSources(build_py):
    """build_py that also copies SYCL_SOURCES into the built package, under ipex_train/_sources."""

    def run(self):
        super().run()
        if self.editable_mode:
            return
        for rel in SYCL_SOURCES:
            dst = os.path.join(self.build_lib, "ipex_train", "_sources", *rel.split("/"))
            self.mkpath(os.path.dirname(dst))
            self.copy_file(os.path.join(HERE, *rel.split("/")), dst)


setup(
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True), "build_py": BuildPyWithSyclSources},
)
