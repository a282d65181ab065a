"""Builds the native kernels (gpt2_engine/core/kernels/*.cpp) at install, as the package's extension module
gpt2_engine.core.kernels._native; the package's metadata is in pyproject.toml.

The module is compiled against the torch it will run with, so torch goes in first and pip builds in the environment
that holds it (an isolated build environment would hold another torch, or none):

    pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu   # the CPU build
    pip install --no-build-isolation .        # or -e . for a checkout you edit: the module lands in the checkout
"""

from __future__ import annotations

import platform
import runpy
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

KERNELS = Path("gpt2_engine", "core", "kernels")  # relative: setuptools takes sources relative to this folder
# sources.py, read by its path: importing the package would import torch and the rest of the engine
SPEC = runpy.run_path(str(Path(__file__).resolve().parent / KERNELS / "sources.py"))

NO_TORCH = ("gpt2-engine: the native kernels are compiled against the torch they will run with, and this build "
            "sees no torch: install torch first (the CPU build: pip install torch --index-url "
            "https://download.pytorch.org/whl/cpu), then this package with pip install --no-build-isolation "
            "(an isolated build environment holds no torch)")


class NeedsTorch(build_ext):
    """build_ext where torch cannot be imported: fails with what to do, so that metadata and the sdist still build."""

    def run(self) -> None:
        raise SystemExit(NO_TORCH)


def torch_build() -> type[build_ext]:
    """torch's BuildExtension, compiling with torch's flags and the kernels' alone, as the build at first use does."""
    from torch.utils.cpp_extension import BuildExtension

    class Build(BuildExtension):
        def build_extensions(self) -> None:
            # Python's own compile flags (sysconfig's CFLAGS: -g, -fwrapv, -DNDEBUG, -Wall, maybe -flto) are for
            # CPython's C code, and torch puts them before the kernels' own (-fwrapv forbids the optimizations that
            # assume signed loop counters never overflow); compiler_so_cxx is the C++ one of newer setuptools
            for name in ("compiler_so", "compiler_so_cxx"):
                if command := getattr(self.compiler, name, None):
                    keep = [flag for flag in command[1:] if flag in ("-fPIC", "-pthread")]
                    self.compiler.set_executable(name, [command[0], *keep])
            super().build_extensions()

    return Build


def kernels() -> tuple[list[Extension], type[build_ext]]:
    """The extension module and the command that builds it."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        # the kernels are AVX2/AVX-512 code; elsewhere the engine runs on torch's kernels (kernels/__init__.py)
        return [], build_ext
    sources = [str(KERNELS / name) for name in SPEC["SOURCES"]]
    try:
        import torch
        from torch.utils.cpp_extension import CppExtension
    except ImportError:
        return [Extension(SPEC["MODULE"], sources)], NeedsTorch
    # the id goes in as a bare token (module.cpp makes it a string): torch's ninja build would drop quotes
    defines = [("GPT2_ENGINE_BUILD", SPEC["build_id"](Path(__file__).resolve().parent / KERNELS, torch.__version__))]
    return [CppExtension(SPEC["MODULE"], sources, define_macros=defines, extra_compile_args=list(SPEC["CFLAGS"]),
                         extra_link_args=list(SPEC["LDFLAGS"]))], torch_build()


EXTENSIONS, BUILD = kernels()
setup(ext_modules=EXTENSIONS, cmdclass={"build_ext": BUILD})
