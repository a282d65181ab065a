"""Native kernels and the CPU facts that choose them.

decode.cpp holds float32/bfloat16 matmuls for decode-sized inputs whose results do not depend on the number of rows;
packed.cpp the same matmuls on float32/bfloat16 weights with packed exponents (core/packed.py), to the same bits;
quant.cpp the blockwise int8/int6/int4 matmul with integer dot products; attention.cpp one decode step's attention
over many cache slots, and a prompt's causal attention; block.cpp a whole block (and the final layer norm with the
head) of a decode-sized pass as one call on those kernels, and each row's greedy pick (argmax and logsumexp) the
sampler reads; training.cpp the optimizer's one-pass AdamW update; lora.cpp the per-row LoRA term of multi-adapter
passes (see their headers); module.cpp binds them all as one Python module. sources.py lists them with their
compiler flags. They are built at install (setup.py, by torch's cpp_extension) into this package's extension module
`_native`, which decode_kernels() imports; where that module is missing (a checkout run without installing it) or
cannot be used (built for another torch, or from other sources than those here), one line says why and jit.py builds
the same sources at first use into torch's extension cache. The pure-torch paths in projection.py stay the reference
and the fallback: if no module can be had, one warning line says so and the model runs on torch's kernels (correct;
float32 decoding is then not batch-invariant, and the quantized reference is slow).
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from ..errors import one_line
from . import jit
from .sources import CFLAGS, LDFLAGS, MODULE, SOURCES, build_id

HERE = Path(__file__).resolve().parent
# what running without the native kernels means, said in the one warning line
FALLBACK = "same results, but float32 decoding is not batch-invariant and int8/int4 are much slower"


@dataclass(frozen=True)
class CPU:
    """What the CPU can do, from /proc/cpuinfo (Linux); all False where that cannot be read."""

    model: str
    avx2: bool
    avx512: bool  # AVX-512 F
    avx512_bf16: bool
    amx: bool  # AMX tiles with bf16
    avx512_vnni: bool  # AVX-512 VNNI (vpdpbusd) with BW: the integer dot products of the quantized kernels
    vendor: str = ""  # vendor_id: AuthenticAMD, GenuineIntel, ...
    avx512_vbmi: bool = False  # AVX-512 VBMI (vpermb) with BW: packed.cpp's AVX-512 decoder

    @property
    def bf16_matmul(self) -> bool:
        """Whether bfloat16 GEMMs beat float32 ones here (oneDNN on AMX tiles or AVX512-BF16 dot products); on AVX2
        alone torch's bf16 GEMM is about 7x slower than float32."""
        return self.amx or self.avx512_bf16

    @property
    def panels(self) -> bool:
        """Whether decode.cpp reads float32 and bfloat16 projections faster in panels (weights.PanelMatrix) than as
        plain (K, N) matrices. On AMD's cores the hardware prefetchers follow a pass's stream per weight row badly and
        panels, read in address order, won (a Zen 3 EPYC, whole batch-1 decode: bfloat16 1.08x, float32 1.09-1.19x;
        batch 8: 0.98x, 1.10x); an Intel Xeon (AVX-512, BF16) read the plain bfloat16 matrices at 94% of its memory rate
        and panels at 0.68x of that, float32 the same either way at one row and plain faster at 8
        (docs/benchmarks.md). Zen 4 is taken to be as the other Zen cores: not measured."""
        return self.vendor == "AuthenticAMD" and self.avx2

    @property
    def packed_decode(self) -> bool:
        """Whether packed.cpp decodes packed exponents (core/packed.py) on this CPU's own instruction set: AVX-512 with
        VBMI, or AVX2 where there is no AVX-512. An AVX-512 CPU without VBMI would decode with AVX2, whose head reduces
        its lanes otherwise than the AVX-512 head the plain layout runs there: not the same bits, so not offered."""
        return self.avx512_vbmi if self.avx512 else self.avx2

    @property
    def best_isa(self) -> str | None:
        return "avx512" if self.avx512 else "avx2" if self.avx2 else None

    def summary(self) -> str:
        caps = [name for name, have in (("AVX2", self.avx2), ("AVX-512", self.avx512),
                                        ("AVX512-VNNI", self.avx512_vnni),
                                        ("AVX512-BF16", self.avx512_bf16), ("AMX", self.amx)) if have]
        return f"{self.model} ({', '.join(caps) or 'no AVX2'})"


@functools.cache
def cpu() -> CPU:
    """This machine's CPU (read once per process)."""
    model, vendor, flags = "unknown CPU", "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown CPU":
                model = value.strip()
            elif key.strip() == "vendor_id" and not vendor:
                vendor = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return CPU(model, {"avx2", "fma", "f16c"} <= flags, "avx512f" in flags, "avx512_bf16" in flags,
               "amx_bf16" in flags and "amx_tile" in flags, {"avx512_vnni", "avx512bw"} <= flags, vendor,
               {"avx512vbmi", "avx512bw"} <= flags)


def installed() -> tuple[ModuleType | None, str | None]:
    """The module built at install, or None and why it cannot be used (None where it is simply not there: a checkout
    run without installing it). It is checked before it is imported: a module once imported stays, and its pybind11
    classes would then clash with those of the build at first use."""
    import torch  # the module links against torch's libraries (and its libgomp): they load first

    spec = importlib.util.find_spec(MODULE)
    if spec is None or spec.origin is None:
        return None, None
    # a wheel ships the sources beside the module, unchanged; edited in a checkout, or torch changed, the id differs
    if all((HERE / name).exists() for name in SOURCES) and \
            build_id(HERE, torch.__version__).encode() not in Path(spec.origin).read_bytes():
        return None, f"{spec.origin} was built from other sources than those in {HERE} or against another torch"
    try:
        return importlib.import_module(MODULE), None
    except (ImportError, OSError) as e:  # e.g. an undefined symbol
        return None, f"the native kernels built at install do not load ({one_line(e)})"


@functools.cache
def decode_kernels() -> ModuleType | None:
    """The native kernels: the module built at install, else the same sources built at first use; None (after one
    warning line) where neither can be had or this CPU cannot run them."""
    if cpu().best_isa is None:
        print("gpt2-engine: warning: this CPU lacks AVX2, FMA or F16C; the model runs on torch's kernels "
              f"({FALLBACK})", file=sys.stderr)
        return None
    native, why = installed()
    if native is not None:
        return native
    if why:
        print(f"gpt2-engine: warning: {why}; building them from the sources instead", file=sys.stderr, flush=True)
    try:
        return jit.build("gpt2_engine_kernels", [HERE / name for name in SOURCES], CFLAGS, LDFLAGS,
                         what="the native kernels, once for this checkout (a minute or two)")
    except Exception as e:  # noqa: BLE001 - any build failure means: use the fallback, and say so once
        reason = one_line(e)
        print(f"gpt2-engine: warning: the native kernels could not be built ({reason}); the model runs on torch's "
              f"kernels ({FALLBACK})", file=sys.stderr)
        return None


def training_kernels() -> ModuleType | None:
    """The compiled module for the optimizer's AdamW update (training.cpp, built with the others); None where it
    cannot be built, and the optimizer then runs its torch reference."""
    return decode_kernels()
