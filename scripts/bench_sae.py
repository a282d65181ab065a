#!/usr/bin/env python3
"""SAE feature dashboards: the engine's `gpt2 sae dashboard` work against SAELens + TransformerLens doing the same
(activations at the hook -> encode -> top-N per feature), on GPT-2-small's shape with a res-jb-sized SAE.

    python scripts/bench_sae.py [--windows 128] [--context 128] [--features 0-999] [--rounds 3]

The SAE: sae-lens's standard SAE at blocks.6.hook_resid_pre, d_sae 24,576 (the size of gpt2-small-res-jb), recording
center_writing_weights=True as res-jb's do, with sae-lens's random initial weights (the time does not depend on
them), written once to .cache/bench-sae/. The reference is how sae-lens's users compute feature activations: HookedSAETransformer loaded with
the SAE's options, run_with_cache(names_filter=[hook], stop_at_layer=7), sae.encode, then the same top-N merge as the
engine's (inspect/sae.py's Dashboard), on ids tokenized in advance. The engine runs build_dashboard on the corpus
file itself (tokenizing, and saving its state, as the command does). Alternating rounds, medians; the table names
the CPU. Peak memory: the engine's dashboard in a child process on the corpus and on four times it.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS))
import fixtures  # noqa: E402
import sae_reference  # noqa: E402

from gpt2_engine import GPT2, SAE  # noqa: E402
from gpt2_engine.core.kernels import cpu  # noqa: E402
from gpt2_engine.inspect.sae import Dashboard, DashboardSettings, build_dashboard, corpus_windows, parse_features  # noqa: E402

HOOK, LAYER, D_SAE = "blocks.6.hook_resid_pre", 6, 24576
CACHE = SCRIPTS.parent / ".cache" / "bench-sae"


def write_sae(d_in: int) -> Path:
    """sae-lens's standard SAE at HOOK, saved by sae-lens (once)."""
    dest = CACHE / f"sae-{d_in}-{D_SAE}"
    if dest.is_dir():
        return dest
    from sae_lens.saes.sae import SAEMetadata
    from sae_lens.saes.standard_sae import StandardSAE, StandardSAEConfig

    torch.manual_seed(0)
    config = StandardSAEConfig(d_in=d_in, d_sae=D_SAE)
    config.metadata = SAEMetadata(hook_name=HOOK, model_from_pretrained_kwargs={"center_writing_weights": True},
                                  prepend_bos=True)
    sae = StandardSAE(config)
    with torch.no_grad():
        sae.b_enc.fill_(-0.5)  # a sparse-ish random SAE
    tmp = Path(tempfile.mkdtemp(dir=CACHE.parent, prefix=".bench-sae-"))
    sae.save_model(tmp)
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp.rename(dest)
    return dest


def write_corpus(windows: int, context: int, tokenizer, scale: int = 1) -> Path:
    """The standard library's docstrings, repeated to at least windows x context tokens (x scale)."""
    ids = sae_reference.docstring_ids(tokenizer, windows * scale, context)
    path = CACHE / f"corpus-{windows * scale}x{context}.txt"
    if not path.is_file():
        CACHE.mkdir(parents=True, exist_ok=True)
        path.write_text(tokenizer.decode(ids.view(-1).tolist()), encoding="utf-8")
    return path


def engine_run(model: GPT2, sae: SAE, corpus: Path, settings: DashboardSettings) -> tuple[float, int]:
    with tempfile.TemporaryDirectory() as out:
        t = time.perf_counter()
        dash = build_dashboard(model, sae, [str(corpus)], settings, Path(out))
        return time.perf_counter() - t, dash.tokens


def reference_run(tl, ref_sae, batches: list[torch.Tensor], settings: DashboardSettings) -> tuple[float, int]:
    dash = Dashboard(settings)
    index = torch.tensor(settings.features)
    t = time.perf_counter()
    with torch.no_grad():
        for ids in batches:
            _, cache = tl.run_with_cache(ids, names_filter=[HOOK], stop_at_layer=LAYER + 1)
            dash.add(ids, ref_sae.encode(cache[HOOK])[..., index])
    return time.perf_counter() - t, dash.tokens


def peak_memory(weights: Path, sae: Path, corpus: Path, settings: DashboardSettings) -> float:
    """MiB: the peak RSS of a child process that runs the engine's dashboard on `corpus`."""
    code = (f"import sys, torch; sys.path.insert(0, {str(SCRIPTS)!r}); torch.set_num_threads(2)\n"
            f"from pathlib import Path; import tempfile\n"
            f"from gpt2_engine import GPT2, SAE\nfrom gpt2_engine.inspect.sae import DashboardSettings, build_dashboard\n"
            f"m = GPT2.from_pretrained({str(weights)!r}); s = SAE.load({str(sae)!r})\n"
            f"build_dashboard(m, s, [{str(corpus)!r}], DashboardSettings(**{settings.__dict__!r}), "
            f"Path(tempfile.mkdtemp()))\n"
            f"print([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return int(out.strip().splitlines()[-1]) / 1024


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--windows", type=int, default=128, help="windows of the corpus per run (default 128)")
    p.add_argument("--context", type=int, default=128, help="tokens per window (default 128)")
    p.add_argument("--features", default="0-999", help="features on the dashboard (default 0-999)")
    p.add_argument("--top", type=int, default=20, help="top contexts per feature (default 20)")
    p.add_argument("--batch-size", type=int, default=8, help="windows per pass (default 8)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds; medians (default 3)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory runs")
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    weights = fixtures.ensure("small")
    model = GPT2.from_pretrained(weights)
    sae_dir = write_sae(model.config.n_embd)
    sae = SAE.load(sae_dir)
    settings = DashboardSettings(parse_features(args.features, D_SAE), args.top, args.context, args.batch_size)
    corpus = write_corpus(args.windows, args.context, model.tokenizer)

    from sae_lens import SAE as LensSAE
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(weights, dtype=torch.float32).eval()
    tl = sae_reference.tl_model(hf, center_writing_weights=True)
    ref_sae = LensSAE.load_from_disk(sae_dir).eval()
    windows = list(corpus_windows(model.tokenizer, [str(corpus)], args.context, sae.config.prepend_bos))
    batches: list[list[list[int]]] = []
    for w in windows:  # batches as build_dashboard makes them: a shorter last window goes alone
        if not batches or len(batches[-1]) == args.batch_size or len(w) != len(batches[-1][0]):
            batches.append([])
        batches[-1].append(w)
    batches = [torch.tensor(b) for b in batches]
    engine_run(model, sae, corpus, settings)  # warm up both
    reference_run(tl, ref_sae, batches[:1], settings)
    ours, theirs = [], []
    for _ in range(args.rounds):
        seconds, tokens = engine_run(model, sae, corpus, settings)
        ours.append(tokens / seconds)
        seconds, ref_tokens = reference_run(tl, ref_sae, batches, settings)
        theirs.append(ref_tokens / seconds)
    assert tokens == ref_tokens, (tokens, ref_tokens)
    a, b = statistics.median(ours), statistics.median(theirs)
    print(f"# {cpu().summary()}, {args.threads} threads, torch {torch.__version__}")
    print(f"# GPT-2-small shape, SAE d_sae {D_SAE:,} at {HOOK} (center_writing_weights), {len(settings.features)} "
          f"features, top {args.top}; {tokens:,} tokens in windows of {args.context}, batch {args.batch_size}; "
          f"{args.rounds} alternating rounds, medians")
    print("| run | tokens/s | vs reference |")
    print("|---|---|---|")
    print(f"| gpt2-engine sae dashboard | {a:,.0f} | {a / b:.2f}x |")
    print(f"| SAELens + TransformerLens (run_with_cache, stop_at_layer, encode, same top-N) | {b:,.0f} | 1.00x |")
    if not args.no_memory:
        big = write_corpus(args.windows, args.context, model.tokenizer, scale=4)
        small_mib, big_mib = (peak_memory(weights, sae_dir, c, settings) for c in (corpus, big))
        print(f"peak RSS of the engine's dashboard: {small_mib:,.0f} MiB on {tokens:,} tokens, {big_mib:,.0f} MiB on "
              f"four times that")
    return 0


if __name__ == "__main__":
    sys.exit(main())
