#!/usr/bin/env python3
"""The memory ceiling the decode kernels read against (`make bench-memory`; `make bench-llamacpp` prints it too).

    python scripts/bench_memory.py [--threads 2] [--gib 1] [--passes 5] [--rounds 3]

A STREAM-like read (scripts/memory_read.cpp): T threads each sum their contiguous part of a float32 buffer far
larger than the last-level cache, with native loads of each width this CPU has (32 bytes AVX2, 64 AVX-512), plain or
non-temporal (vmovntdqa), with software prefetch 0 / 512 / 2,048 / 8,192 bytes ahead, on 4 KB pages and (where the
kernel gives transparent huge pages, as the engine's matrices get them: core/pages.py) on 2 MB pages. Every variant
runs --passes timed passes, best kept, and the variants alternate for --rounds rounds (a shared host's bandwidth
moves by the minute: the table is the median round's best per variant). The ceiling is the best variant's median:
the rate a decode step that reads each weight once could reach on these threads.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS.parent))
from gpt2_engine.core.kernels import cpu, jit  # noqa: E402
from gpt2_engine.core.pages import huge_pages_available, move_to_huge_pages  # noqa: E402

AHEAD = (0, 512, 2048, 8192)  # prefetch distances, bytes


@dataclass(frozen=True)
class Ceiling:
    """The measured read ceiling: GB/s, the variant that reached it, and every variant's median."""

    gbs: float
    variant: str
    key: tuple[int, int, bool, bool]  # (load width in bytes, prefetch distance, non-temporal, 2 MB pages)
    threads: int
    table: dict[str, float]

    def header(self) -> str:
        return f"memory read ceiling {self.gbs:.1f} GB/s on {self.threads} threads ({self.variant})"


def kernel():
    """memory_read.cpp, built at first use as the engine's fallback builds its kernels (never waiting on the lock of a
    killed build)."""
    return jit.build("gpt2_engine_memory_read", [SCRIPTS / "memory_read.cpp"], ["-O3", "-fopenmp"], ["-fopenmp"],
                     what="the memory read kernel (scripts/memory_read.cpp)")


def buffer(gib: float, huge: bool = False) -> torch.Tensor:
    """A 64-byte aligned float32 buffer of `gib` GiB, written once (so its pages exist before they are timed); with
    `huge`, moved onto 2 MB pages as the engine moves its matrices (core/pages.py)."""
    n = int(gib * 2**30) // 4
    raw = torch.ones(n + 16)
    off = (-raw.data_ptr() % 64) // 4
    buf = raw[off : off + n]
    if huge:
        move_to_huge_pages([buf])
    return buf


Variant = tuple[int, int, bool, bool]  # (load width in bytes, prefetch distance, non-temporal, 2 MB pages)


def variant_name(v: Variant) -> str:
    return (f"{v[0] * 8}-bit {'non-temporal' if v[2] else 'plain'} loads, prefetch {v[1]} B ahead, "
            f"{'2 MB' if v[3] else '4 KB'} pages")


def read_rate(mod, buf: torch.Tensor, v: Variant, threads: int, passes: int) -> float:
    """GB/s of the best of `passes` reads of `buf` with variant `v`; a read that did not sum all of it (the buffer
    holds ones: whole steps per thread, nearly all) means the kernel skipped loads, and ends the benchmark."""
    gbs, total = mod.read_rate(buf, *v[:3], threads, passes)
    if not 0.999 <= total / (passes * buf.numel()) <= 1.0:
        raise SystemExit(f"bench-memory: the {variant_name(v)} read summed {total:.0f}, expected about "
                         f"{passes * buf.numel()}: the kernel skipped loads")
    return gbs


def measure(threads: int = 2, gib: float = 1.0, passes: int = 5, rounds: int = 3) -> Ceiling:
    """Every variant, alternating, `rounds` rounds of `passes` passes each: medians of the per-round bests."""
    mod = kernel()
    bufs = {huge: buffer(gib, huge) for huge in ((False, True) if huge_pages_available() else (False,))}
    widths = [32] + ([64] if cpu().avx512 else [])
    variants: list[Variant] = [(w, a, nt, huge) for huge in bufs for w in widths for nt in (False, True) for a in AHEAD]
    seen: dict[Variant, list[float]] = {v: [] for v in variants}
    for _ in range(rounds):
        for v in variants:
            seen[v].append(read_rate(mod, bufs[v[3]], v, threads, passes))
    medians = {v: statistics.median(rates) for v, rates in seen.items()}
    best = max(medians, key=medians.get)
    return Ceiling(medians[best], variant_name(best), best, threads, {variant_name(v): m for v, m in medians.items()})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2, help="reading threads (default 2, as the decode benchmarks)")
    p.add_argument("--gib", type=float, default=1.0, help="buffer size in GiB (default 1; keep it far above the L3)")
    p.add_argument("--passes", type=int, default=5, help="timed passes per variant per round, best kept (default 5)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds; medians (default 3)")
    args = p.parse_args()
    if not 1 <= args.threads <= 256 or args.gib <= 0 or args.passes < 1 or args.rounds < 1:
        p.error("--threads in [1, 256], --gib > 0, --passes and --rounds >= 1")
    c = measure(args.threads, args.gib, args.passes, args.rounds)
    print(f"# {cpu().summary()}, {args.threads} threads, {args.gib:g} GiB buffer, best of {args.passes} passes, "
          f"medians of {args.rounds} alternating rounds")
    print(f"# {c.header()}")
    print("| read | GB/s |")
    print("|---|---|")
    for name, gbs in c.table.items():
        print(f"| {name} | {gbs:.1f}{' (ceiling)' if name == c.variant else ''} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
