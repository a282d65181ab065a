#!/usr/bin/env python3
"""The engine beside llama.cpp on the same weights, in one run (`make bench-llamacpp`).

    python scripts/bench_llamacpp.py [--rounds 3] [--formats f32,q8_0,q4_0,f16] [--layouts plain,packed] [--threads 2]
                                     [--weights DIR] [--serve]

llama.cpp is built once into the git-ignored cache from the source the `llama-cpp-python` sdist on PyPI ships
(`pip download --no-binary :all: --no-deps llama-cpp-python==VERSION`, then CMake on its vendor/llama.cpp: the
targets llama-bench, llama-quantize and llama-server; about 12 minutes on 2 cores). The checkpoint (default: the
full-size fixture) is converted with llama.cpp's own convert_hf_to_gguf.py to f32, after a copy without the
`h.N.attn.bias` buffers (its GPT-2 path does not expect them), then quantized by llama-quantize to q8_0, q4_0 and
f16.

llama.cpp's AMX path (q8_0 and q4_0 on Intel Xeons with AMX) decodes faster than its plain one there, but in this
version its prefill dies by SIGILL or SIGSEGV on this project's AMX Xeons (llama.cpp pull request 26954). A
llama-bench row that dies by a signal runs on a second build without AMX (-mno-amx-*, made once at the first death)
and is marked so in the table; every other row stays on the native build.

Rows, each format beside the engine's own (f32 / float32, q8_0 / int8, q4_0 / int4, f16 / bfloat16: the 16-bit
formats each engine has), alternating which runs first,
--rounds times, medians: decode at batch 1, 128 tokens after a one-token prompt (llama-bench's tg128; the engine's
generate_ids timed as t(129) - t(1)), and prefill of 512 tokens (llama-bench's pp512; the engine's prompt of 512
random ids to its first token). One table, the CPU and the memory read ceiling in its header (scripts/bench_memory.py:
the best read variant found once, then measured again in every round, alternating with the rows; median), ratio =
engine / llama.cpp. Decode rows also give the bytes a decode step reads, each engine's GB/s moved (those bytes x
tokens/s) and its share of the ceiling: llama.cpp's bytes are its file's tensors, the engine's its blocks' and head's,
each with one row of the embeddings it looks up.

The float formats run the engine in each of --layouts (weight_layout: "plain", as loaded, in panels where the CPU
reads those faster; "packed", with packed exponents, core/packed.py), both beside the same llama.cpp runs, the three
alternating. A packed row's GB/s are of its packed bytes, and (plain-equivalent) of the plain layout's bytes for the
same tokens/s: the rate at which it delivers the plain matrix's weights.

--serve: instead, `gpt2 serve` against `llama-server -np 8` on the same weights (each with --parallel / -np 8 and
2 threads), streaming clients of --requests requests x 64 greedy tokens (ignore_eos), 1 and 8 clients, alternating
(scripts/bench_serve.py's clients, a connection per request on both sides: llama-server drops kept-alive ones):
aggregate tokens/s, ratio = engine / llama.cpp.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import shutil
import socket
import statistics
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "llamacpp"
VERSION = "0.3.36"  # llama-cpp-python, whose sdist vendors the llama.cpp this benchmark builds
TARGETS = ("llama-bench", "llama-quantize", "llama-server")
# each llama.cpp format and the engine's counterpart: its name, GPT2.from_pretrained's arguments, gpt2 serve's flags
ENGINE_FORMAT = {"f32": ("float32", {}, ()),
                 "q8_0": ("int8", {"quantize": "int8"}, ("--quantize", "int8")),
                 "q4_0": ("int4", {"quantize": "int4"}, ("--quantize", "int4")),
                 "f16": ("bfloat16", {"dtype": "bfloat16"}, ("--dtype", "bfloat16"))}
ROWS = {"decode": (0, 128), "prefill": (512, 0)}  # each row's llama-bench (prompt, gen): tg128, pp512
FLOAT_FORMATS = ("f32", "f16")  # those the engine runs in each of --layouts
LAYOUTS = ("plain", "packed")


def run(cmd: list[str], log: Path | None = None, **kwargs) -> None:
    """Run a build step; on failure, say which and where its output is."""
    with open(log, "w") if log else open("/dev/null", "w") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, **kwargs)
    if done.returncode:
        raise SystemExit(f"bench-llamacpp: {' '.join(cmd[:3])} ... failed ({done.returncode}); see {log}")


def llamacpp(amx: bool = True) -> tuple[Path, Path]:
    """(the directory of the built binaries, llama.cpp's source tree), building them once. amx=False: a second build
    with the AMX instructions off (-mno-amx-*, which -march=native does not undo), for a CPU where llama.cpp's AMX
    path dies (amx_runs)."""
    src = CACHE / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
    bin_dir = CACHE / f"build-{VERSION}{'' if amx else '-noamx'}" / "bin"
    if all((bin_dir / t).is_file() for t in TARGETS):
        return bin_dir, src
    CACHE.mkdir(parents=True, exist_ok=True)
    if not src.is_dir():
        print(f"bench-llamacpp: fetching the llama-cpp-python {VERSION} sdist from PyPI ...", file=sys.stderr, flush=True)
        run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "--quiet",
             f"llama-cpp-python=={VERSION}", "-d", str(CACHE)], CACHE / "download.log")
        with tarfile.open(CACHE / f"llama_cpp_python-{VERSION}.tar.gz") as tar:
            tar.extractall(CACHE, filter="data")
    build = bin_dir.parent
    print(f"bench-llamacpp: building llama.cpp into {build} (once, about 12 minutes on 2 cores) ...", file=sys.stderr,
          flush=True)
    flags = [] if amx else [f"-DCMAKE_{lang}_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" for lang in ("C", "CXX")]
    run(["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
         "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DGGML_NATIVE=ON", *flags],
        CACHE / f"{build.name}.cmake.log")
    run(["cmake", "--build", str(build), "-j", "2", "--target", *TARGETS], CACHE / f"{build.name}.log")
    return bin_dir, src


def amx_runs(bin_dir: Path, model: Path, threads: int) -> bool:
    """Whether llama.cpp's AMX path (int8 tiles for q8_0 and q4_0, used from a batch of rows up) runs here: a short
    q8_0 prefill. In the llama.cpp of llama-cpp-python 0.3.36 it dies with SIGILL or SIGSEGV on kernels that enable
    the tile state per thread (XFD) and where the compiler drops its tile configuration from the stack (llama.cpp
    pull request 26954), as on this project's AMX Xeons."""
    try:
        llama_bench(bin_dir, model, threads, 64, 0)
    except LlamaDied:
        return False
    return True


def gguf_files(weights: Path, bin_dir: Path, src: Path) -> dict[str, Path]:
    """{format: GGUF file} of the checkpoint, each converted once into the cache: f32 by convert_hf_to_gguf.py, the
    others from it by llama-quantize (a format added since an earlier run is made from the f32 file already there)."""
    out = CACHE / "gguf" / weights.name
    files = {fmt: out / f"model-{fmt}.gguf" for fmt in ENGINE_FORMAT}
    if not files["f32"].is_file():
        convert_f32(weights, src, out, files["f32"])
    for fmt, path in files.items():
        if fmt != "f32" and not path.is_file():
            run([str(bin_dir / "llama-quantize"), str(files["f32"]), str(path), fmt.upper()], out / f"{fmt}.log")
    return files


def convert_f32(weights: Path, src: Path, out: Path, target: Path) -> None:
    """The checkpoint as an f32 GGUF, by llama.cpp's own converter, from a copy without the causal-mask buffers that
    its GPT-2 path does not expect."""
    from safetensors.torch import load_file, save_file

    plain = out / "hf"
    plain.mkdir(parents=True, exist_ok=True)
    tensors = load_file(weights / "model.safetensors")
    buffers = [k for k in tensors if k.split(".")[-2:] in (["attn", "bias"], ["attn", "masked_bias"])]  # not c_attn.bias
    save_file({k: v.contiguous() for k, v in tensors.items() if k not in buffers},
              plain / "model.safetensors", metadata={"format": "pt"})
    for f in weights.iterdir():
        if f.is_file() and f.suffix in (".json", ".txt"):
            shutil.copy(f, plain / f.name)
    env = {"PYTHONPATH": str(src / "gguf-py"), "PATH": "/usr/bin:/bin"}
    run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(plain), "--outtype", "f32", "--outfile", str(target)],
        out / "convert.log", env=env)
    shutil.rmtree(plain)


def engine_bytes(w, as_plain: bool = False) -> int:
    """Bytes a decode step of the engine reads: every block's tensors and the head's (quantized and packed forms as
    stored; as_plain: packed ones as their plain matrices), ln_f, and one row of each embedding."""
    from gpt2_engine.core.packed import PackedMatrix

    seen: set[int] = set()

    def size(obj) -> int:
        if as_plain and isinstance(obj, PackedMatrix):
            return obj.rows * obj.cols * obj.dtype.itemsize
        if isinstance(obj, torch.Tensor):
            if obj.data_ptr() in seen:
                return 0
            seen.add(obj.data_ptr())
            return obj.numel() * obj.element_size()
        if dataclasses.is_dataclass(obj):  # a PanelMatrix's plain matrix is what a GEMM reads, not decode
            return sum(size(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.name != "plain")
        if isinstance(obj, (tuple, list)):
            return sum(size(o) for o in obj)
        return 0

    # one row of each embedding; wte's is part of the head where they are one tensor
    wte_row = w.wte.shape[1] * w.wte.dtype.itemsize
    rows = (0 if w.head is w.wte else wte_row) + w.wpe[0].numel() * w.wpe.element_size()
    return size(w.blocks) + size(w.ln_f) + size(w.head) + rows


def gguf_bytes(path: Path) -> int:
    """Bytes a llama.cpp decode step reads from this GGUF: every tensor, but one row of position_embd, and one row of
    token_embd where an output matrix of its own is the head."""
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(path).tensors}
    total = 0
    for name, t in tensors.items():
        rows = int(t.shape[-1]) if len(t.shape) > 1 else 1  # gguf-py's shape is ggml's: ne0 first
        if name == "position_embd.weight" or (name == "token_embd.weight" and "output.weight" in tensors):
            total += int(t.n_bytes) // rows
        else:
            total += int(t.n_bytes)
    return total


class LlamaDied(Exception):
    """llama-bench killed by a signal (SIGILL, SIGSEGV): an instruction path of its build that this CPU does not run."""


def llama_bench(bin_dir: Path, model: Path, threads: int, prompt: int, gen: int) -> float:
    """tokens/s of one llama-bench run: pp{prompt} (gen 0) or tg{gen} (prompt 0), one repetition."""
    out = subprocess.run([str(bin_dir / "llama-bench"), "-m", str(model), "-t", str(threads), "-p", str(prompt),
                          "-n", str(gen), "-r", "1", "-o", "json"], capture_output=True, text=True)
    if out.returncode < 0:
        raise LlamaDied(f"signal {-out.returncode}")
    if out.returncode:
        tail = (out.stderr.strip().splitlines() or [""])[-1]
        raise SystemExit(f"bench-llamacpp: llama-bench on {model.name} (pp{prompt} tg{gen}) failed "
                         f"(exit {out.returncode}): {tail}")
    return float(json.loads(out.stdout)[0]["avg_ts"])


@dataclasses.dataclass
class LlamaRows:
    """llama-bench's runs on the native build, or, for a row whose run died there by a signal, on the build without
    AMX (made once, at the first such death): llama.cpp's AMX path decodes q8_0 faster than its plain one on this
    project's AMX Xeons, but its prefill dies (amx_runs), so each row gets the fastest build that runs it."""

    bin_dir: Path
    threads: int
    fallback: Callable[[], Path] = lambda: llamacpp(amx=False)[0]  # the build without AMX's binaries, built once
    died: set[tuple[str, int, int]] = dataclasses.field(default_factory=set)  # (file, prompt, gen) off the native

    def __call__(self, model: Path, prompt: int, gen: int) -> float:
        key = (model.name, prompt, gen)
        if key not in self.died:
            try:
                return llama_bench(self.bin_dir, model, self.threads, prompt, gen)
            except LlamaDied as e:
                self.died.add(key)
                print(f"bench-llamacpp: llama-bench pp{prompt} tg{gen} on {model.name} died ({e}); that row runs on "
                      "llama.cpp built without AMX", file=sys.stderr, flush=True)
        try:
            return llama_bench(self.fallback(), model, self.threads, prompt, gen)
        except LlamaDied as e:
            raise SystemExit(f"bench-llamacpp: llama-bench pp{prompt} tg{gen} on {model.name} died ({e}) on llama.cpp "
                             "built without AMX too") from None


def engine_decode(model, tokens: int) -> float:
    """tokens/s of greedy decoding after a one-token prompt: tokens / (t(tokens + 1) - t(1))."""
    def timed(n: int) -> float:
        t0 = time.perf_counter()
        model.generate_ids([464], max_new_tokens=n, temperature=0, ignore_eos=True)
        return time.perf_counter() - t0
    return tokens / (timed(tokens + 1) - timed(1))


def engine_prefill(model, tokens: int) -> float:
    """tokens/s of a prompt of `tokens` random ids to its first token."""
    ids = torch.randint(0, model.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    t0 = time.perf_counter()
    model.generate_ids(ids, max_new_tokens=1, temperature=0)
    return tokens / (time.perf_counter() - t0)


@contextlib.contextmanager
def llama_server(bin_dir: Path, model: Path, threads: int, parallel: int) -> Iterator[str]:
    """llama-server on a free 127.0.0.1 port, healthy and warmed up; its URL."""
    import httpx

    from bench_serve import one_client

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([str(bin_dir / "llama-server"), "-m", str(model), "-np", str(parallel), "-t", str(threads),
                             "-c", str(1024 * parallel), "--host", "127.0.0.1", "--port", str(port), "--no-webui"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"llama-server exited with {proc.returncode}"
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            time.sleep(0.2)  # polling for start-up, not timing anything
        one_client(url, 0, 1, 8)  # warm-up
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def serve_rows(args: argparse.Namespace, weights: Path, bin_dir: Path, files: dict[str, Path], machine: str) -> int:
    """gpt2 serve against llama-server -np 8 per format, 1 and 8 streaming clients, alternating; medians."""
    from bench_serve import measure, server

    from gpt2_engine.core.kernels import cpu

    if cpu().amx and not amx_runs(bin_dir, files["q8_0"], args.threads):  # llama-server batches: its prefill path
        print("bench-llamacpp: llama.cpp's AMX path died on this CPU (llama.cpp pull request 26954); "
              "llama-server built without AMX instead", file=sys.stderr, flush=True)
        bin_dir, _ = llamacpp(amx=False)
        machine += " built without AMX (its AMX path dies here)"
    runs: dict[tuple[str, int, str], list[float]] = {}
    for fmt in args.formats.split(","):
        flags = ENGINE_FORMAT[fmt][2]
        with llama_server(bin_dir, files[fmt], args.threads, 8) as llama_url, server(ROOT, weights, 8, flags) as url:
            for r in range(args.rounds):
                for n in (1, 8):
                    order = [("llama.cpp", llama_url), ("engine", url)]
                    for side, where in order if (r + n) % 2 == 0 else order[::-1]:
                        rate = measure(where, n, args.requests, 64, close=True)["tokens_per_s"]
                        runs.setdefault((fmt, n, side), []).append(rate)
                        print(f"  {fmt} {n} clients round {r + 1} {side}: {rate:.1f} tok/s", file=sys.stderr, flush=True)
    print(f"\ngpt2 serve vs llama-server -np 8 on {weights.name} ({machine}); streaming clients of {args.requests} "
          f"requests x 64 greedy tokens; medians of {args.rounds} alternating rounds, ratio = engine / llama.cpp")
    print("| format | clients | llama-server tok/s | gpt2 serve tok/s | ratio |")
    print("|---|---|---|---|---|")
    table = []
    for fmt in args.formats.split(","):
        for n in (1, 8):
            a, b = statistics.median(runs[fmt, n, "llama.cpp"]), statistics.median(runs[fmt, n, "engine"])
            table.append({"format": fmt, "clients": n, "llama.cpp": a, "engine": b, "ratio": b / a})
            print(f"| {fmt} / {ENGINE_FORMAT[fmt][0]} | {n} | {a:.1f} | {b:.1f} | {b / a:.2f}x |")
    out = args.out.with_name(args.out.stem + "-serve.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine, "weights": str(weights), "rows": table}, indent=2) + "\n")
    return 0


def table_rows(formats: list[str], engines: dict[str, list[str]], runs: dict, moved: dict, files: dict[str, Path],
               died: set[tuple[str, int, int]], ceiling: float) -> list[dict]:
    """Print the table's rows (medians of the rounds; a decode row's bytes and GB/s against the ceiling) and return
    them for the JSON file. died: the llama-bench rows that ran on the build without AMX (LlamaRows.died)."""
    table = []
    for fmt in formats:
        for row, label in (("decode", "decode tg128, batch 1"), ("prefill", "prefill pp512")):
            for side in engines[fmt]:
                a, b = statistics.median(runs[fmt, row, "llama.cpp"]), statistics.median(runs[fmt, row, side])
                name = ENGINE_FORMAT[fmt][0] + side.removeprefix("engine")
                no_amx = (files[fmt].name, *ROWS[row]) in died
                entry = {"format": fmt, "engine": name, "row": row, "llama.cpp": a, "engine_tps": b, "ratio": b / a,
                         "llama.cpp_build": "without AMX" if no_amx else "native",
                         "runs": {s: runs[fmt, row, s] for s in ("llama.cpp", side)}}
                rates = " | | | |"
                if row == "decode":
                    plain = moved[fmt, side, "plain"]
                    ga, gb, ge = moved[fmt] * a / 1e9, moved[fmt, side] * b / 1e9, plain * b / 1e9
                    entry |= {"bytes_per_token": {"llama.cpp": moved[fmt], "engine": moved[fmt, side],
                                                  "engine_plain": plain},
                              "gbs": {"llama.cpp": ga, "engine": gb, "engine_plain_equivalent": ge}}
                    rates = (f" {moved[fmt] / 1e6:.0f} / {moved[fmt, side] / 1e6:.0f} | "
                             f"{ga:.1f} ({ga / ceiling:.0%}) | {gb:.1f} ({gb / ceiling:.0%}) | "
                             f"{ge:.1f} ({ge / ceiling:.0%}) |")
                table.append(entry)
                print(f"| {fmt} / {name} | {label} | {a:.1f}{' (no AMX)' if no_amx else ''} | {b:.1f} | {b / a:.2f}x |"
                      f"{rates}")
    return table


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", type=Path, help="checkpoint directory (default: the full-size fixture)")
    p.add_argument("--formats", default="f32,q8_0,q4_0,f16",
                   help="llama.cpp formats, each beside the engine's own: f32 / float32, q8_0 / int8, q4_0 / int4, "
                        "f16 / bfloat16 (default: all four)")
    p.add_argument("--layouts", default="plain,packed",
                   help="the engine's weight layouts for f32 and f16 (weight_layout: plain, packed; default both)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--serve", action="store_true", help="the servers instead: gpt2 serve against llama-server -np 8")
    p.add_argument("--requests", type=int, default=4, help="requests per client with --serve (default 4)")
    p.add_argument("--out", type=Path, default=ROOT / ".cache" / "artifacts" / "bench-llamacpp.json")
    args = p.parse_args()
    if unknown := set(args.formats.split(",")) - set(ENGINE_FORMAT):
        p.error(f"--formats: unknown {', '.join(sorted(unknown))}; expected some of {', '.join(ENGINE_FORMAT)}")
    if unknown := set(args.layouts.split(",")) - set(LAYOUTS):
        p.error(f"--layouts: unknown {', '.join(sorted(unknown))}; expected some of {', '.join(LAYOUTS)}")
    sys.path.insert(0, str(ROOT / "scripts"))
    import fixtures

    from gpt2_engine import GPT2
    from gpt2_engine.core.kernels import cpu

    torch.set_num_threads(args.threads)
    weights = args.weights or fixtures.ensure("small")
    bin_dir, src = llamacpp()
    files = gguf_files(weights, bin_dir, src)
    machine = f"{cpu().summary()}, {args.threads} threads, torch {torch.__version__}, llama.cpp from llama-cpp-python {VERSION}"
    if args.serve:
        return serve_rows(args, weights, bin_dir, files, machine)
    llama = LlamaRows(bin_dir, args.threads)
    import bench_memory

    formats = args.formats.split(",")
    layouts = args.layouts.split(",")
    found = bench_memory.measure(args.threads, rounds=1)  # the best read variant, timed again in every round below
    width, ahead, nt, huge = found.key
    read = bench_memory.kernel()
    buf = bench_memory.buffer(1.0, huge)
    ceilings: list[float] = []
    runs: dict[tuple[str, str, str], list[float]] = {}
    moved = {fmt: gguf_bytes(files[fmt]) for fmt in formats}
    engines: dict[str, list[str]] = {}  # each format's engine sides: "engine" (plain), "engine packed"
    for fmt in formats:
        models = {}
        for layout in layouts if fmt in FLOAT_FORMATS else ["plain"]:
            side = "engine" if layout == "plain" else f"engine {layout}"
            kwargs = ENGINE_FORMAT[fmt][1] | ({"weight_layout": layout} if fmt in FLOAT_FORMATS else {})
            models[side] = GPT2.from_pretrained(weights, **kwargs)
            engine_decode(models[side], 8)  # kernels built and warm
            moved[fmt, side] = engine_bytes(models[side].weights)
            moved[fmt, side, "plain"] = engine_bytes(models[side].weights, as_plain=True)
        engines[fmt] = list(models)
        file = files[fmt]
        sides = {"llama.cpp": {row: lambda f=file, pg=pg: llama(f, *pg) for row, pg in ROWS.items()}}
        for side, model in models.items():
            sides[side] = {"decode": lambda m=model: engine_decode(m, 128),
                           "prefill": lambda m=model: engine_prefill(m, 512)}
        names = list(sides)
        for r in range(args.rounds):
            ceilings.append(read.read_rate(buf, width, ahead, nt, args.threads, 5)[0])
            for row in ("decode", "prefill"):
                for side in names[r % len(names):] + names[: r % len(names)]:  # each side first in turn
                    runs.setdefault((fmt, row, side), []).append(sides[side][row]())
                    print(f"  {fmt} {row} round {r + 1} {side}: {runs[fmt, row, side][-1]:.1f} tok/s", file=sys.stderr,
                          flush=True)
        del models, sides
    ceiling = statistics.median(ceilings)
    print(f"\nengine vs llama.cpp on {weights.name} ({machine}); memory read ceiling {ceiling:.1f} GB/s "
          f"({found.variant}; median of {len(ceilings)} measurements between the rounds, "
          f"{min(ceilings):.1f}-{max(ceilings):.1f}); medians of {args.rounds} alternating rounds, "
          "ratio = engine / llama.cpp; GB/s = bytes a decode step reads x tokens/s; plain-equivalent: the plain "
          "layout's bytes x the packed row's tokens/s; (no AMX): llama.cpp's native build died on that row, "
          "which ran on its build without AMX")
    print("| format | row | llama.cpp tok/s | engine tok/s | ratio | MB a token (llama.cpp / engine) "
          "| llama.cpp GB/s (of ceiling) | engine GB/s (of ceiling) | plain-equivalent GB/s (of ceiling) |")
    print("|---|---|---|---|---|---|---|---|---|")
    table = table_rows(formats, engines, runs, moved, files, llama.died, ceiling)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine, "weights": str(weights), "ceiling_gbs": ceiling,
                                    "ceilings": ceilings, "ceiling_read": found.variant, "rows": table}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
