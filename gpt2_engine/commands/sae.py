"""`gpt2 sae features | eval | dashboard`: sparse autoencoders (SAELens's or OpenAI's files) on the engine."""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

from ..interp.sae import SAE, check_saes
from ..documents import expand_paths, read_text
from ..formats.files import check_not_an_input
from ..inspect.sae import (STATE, DashboardSettings, build_dashboard, corpus_windows, dashboard_data, feature_acts,
                           parse_features, prompt_ids, write_dashboard)
from ..options import ModelOptions, UsageError, add_model_options, load_model, positive_int, progress_bar


MAX_TOP = 1000  # contexts kept per feature: the dashboard holds features x top of them in memory


def dashboard_top(text: str) -> int:
    """--top: a positive integer up to MAX_TOP (1e9 asked for a tensor of 800 GB)."""
    value = positive_int(text)
    if value > MAX_TOP:
        raise argparse.ArgumentTypeError(f"{text}: at most {MAX_TOP:,}")
    return value


def load(args: argparse.Namespace):
    sae = SAE.load(args.sae, hook_name=args.hook)
    model = load_model(ModelOptions.from_args(args))
    check_saes(sae, model.config)
    return model, sae


def run_features(args: argparse.Namespace) -> int:
    prompt = read_text("-", sys.stdin.buffer) if args.prompt == "-" else args.prompt
    if not prompt:
        raise UsageError("the prompt is empty; expected text (or '-' to read it from stdin)")
    model, sae = load(args)
    ids = prompt_ids(model, sae, prompt)
    if len(ids) > model.config.n_positions:
        raise UsageError(f"the prompt is {len(ids)} tokens; this model reads at most {model.config.n_positions}")
    f = feature_acts(model, sae, torch.tensor([ids]))[0]  # [T, d_sae]
    top = f.topk(min(args.top, sae.d_sae), dim=-1)
    rows = [{"token": model.tokenizer.token_text(t), "id": t, "active": int((f[i] != 0).sum()),
             "features": [[int(j), round(float(v), 4)] for j, v in zip(top.indices[i], top.values[i]) if v > 0]}
            for i, t in enumerate(ids)]
    if args.json:
        print(json.dumps({"sae": repr(sae), "tokens": rows}, ensure_ascii=False))
        return 0
    if sae.config.prepend_bos:
        print("(<|endoftext|> first: the SAE was trained on prompts that began with it)", file=sys.stderr)
    width = max(len(repr(r["token"])) for r in rows)
    for r in rows:
        feats = "  ".join(f"#{j} {v:.2f}" for j, v in r["features"]) or "-"
        print(f"{repr(r['token']):<{width}}  {r['active']:>5} active  {feats}")
    return 0


def windows_of(args: argparse.Namespace, model, sae) -> torch.Tensor:
    windows = corpus_windows(model.tokenizer, expand_paths(args.data), args.context, sae.config.prepend_bos)
    ids = list(itertools.islice((w for w in windows if len(w) == args.context), args.max_windows))
    if not ids:
        raise UsageError(f"the data holds fewer than {args.context} tokens; expected at least one window of --context")
    return torch.tensor(ids)


def run_eval(args: argparse.Namespace) -> int:
    model, sae = load(args)
    if args.context > model.config.n_positions:
        raise UsageError(f"--context {args.context} exceeds this model's {model.config.n_positions} positions")
    ids = windows_of(args, model, sae)
    t0 = time.perf_counter()
    with progress_bar(args.quiet, total=ids.shape[0], unit="window", desc="sae eval") as bar:
        metrics = model.evaluate_sae(sae, ids, batch_size=args.batch_size, progress=bar.update)
    density = torch.tensor(metrics.pop("feature_density"))
    metrics["dead_features"] = int((density == 0).sum())
    metrics["dense_features"] = int((density > 0.1).sum())
    if args.json:
        print(json.dumps({"sae": repr(sae), **metrics, **({"feature_density": density.tolist()} if args.density else {})}))
        return 0
    print(f"{sae!r} on {metrics['tokens']:,} tokens ({ids.shape[0]} windows of {args.context}) in "
          f"{time.perf_counter() - t0:.1f} s")
    for key, value in metrics.items():
        if key != "tokens":
            print(f"  {key:<22} {value:.6g}" if isinstance(value, float) else f"  {key:<22} {value}")
    return 0


def run_dashboard(args: argparse.Namespace) -> int:
    if not args.ray and (args.address is not None or args.workers is not None):
        raise UsageError("--address and --workers need --ray")
    if args.workers is not None and args.workers < 1:
        raise UsageError(f"--workers must be at least 1, got {args.workers}")
    model, sae = load(args)
    if args.context > model.config.n_positions:
        raise UsageError(f"--context {args.context} exceeds this model's {model.config.n_positions} positions")
    settings = DashboardSettings(parse_features(args.features, sae.d_sae), args.top, args.context, args.batch_size)
    paths = expand_paths(args.data)
    for name in (STATE, "dashboard.json", "dashboard.html"):  # a corpus file named like an output would be replaced
        check_not_an_input(args.out / name, [Path(p) for p in paths], "--out")
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with progress_bar(args.quiet, unit="window", desc="sae dashboard") as bar:
        if args.ray:
            from ..distributed.sae import dashboard_on_ray

            dash = dashboard_on_ray(args, model, sae, paths, settings, progress=bar.update)
        else:
            def notice(line: str) -> None:  # above the bar, where one is drawn
                bar.write(f"gpt2 sae dashboard: {line}", file=sys.stderr)

            dash = build_dashboard(model, sae, paths, settings, args.out, progress=bar.update,
                                   notice=None if args.quiet else notice)
    written = write_dashboard(dashboard_data(model, sae, dash), args.out)
    if not args.quiet:
        print(f"{len(settings.features)} features over {dash.tokens:,} tokens in {time.perf_counter() - t0:.1f} s; "
              f"wrote {', '.join(p.name for p in written)} to {args.out}/", file=sys.stderr)
    return 0


def add_sae_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sae", required=True, metavar="PATH",
                   help="SAELens's SAE directory (cfg.json + sae_weights.safetensors) or OpenAI's .pt state dict")
    p.add_argument("--hook", metavar="NAME",
                   help="the hook point the SAE reads, e.g. blocks.6.hook_resid_post (required for OpenAI's files, "
                        "which do not record it; overrides SAELens's cfg.json)")
    add_model_options(p, lora=False)


def add_sae(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sae", help="sparse autoencoders: features of a prompt, eval metrics, feature dashboards",
                       description="Sparse autoencoders (SAELens's or OpenAI's format) spliced into the engine at "
                                   "their hook point, presenting the activations of the model the SAE was trained on.")
    cmds = p.add_subparsers(dest="sae_command", metavar="SAE_COMMAND", required=True)

    f = cmds.add_parser("features", help="each token's top features and activations",
                        epilog="example:\n  gpt2 sae features 'The cat sat on the mat' --sae saes/blocks.6.hook_resid_pre",
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    f.add_argument("prompt", help="the prompt text ('-' reads stdin)")
    add_sae_options(f)
    f.add_argument("--top", type=positive_int, default=5, help="features per token (default 5)")
    f.add_argument("--json", action="store_true", help="print JSON instead of the table")
    f.set_defaults(run=run_features)

    e = cmds.add_parser("eval", help="SAELens's eval metrics over text (reconstruction, sparsity, CE and KL)",
                        epilog="example:\n  gpt2 sae eval corpus/ --sae saes/blocks.6.hook_resid_pre --json",
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    e.add_argument("data", nargs="+", help="text files, .jsonl files ({\"text\": ...} per line) or folders of them")
    add_sae_options(e)
    e.add_argument("--context", type=positive_int, default=128, help="tokens per window (default 128)")
    e.add_argument("--max-windows", type=positive_int, default=256, help="at most this many windows (default 256)")
    e.add_argument("--batch-size", type=positive_int, default=8, help="windows per pass (default 8)")
    e.add_argument("--json", action="store_true", help="print the metrics as JSON")
    e.add_argument("--density", action="store_true", help="with --json: every feature's density too")
    e.add_argument("--quiet", action="store_true", help="no progress bar")
    e.set_defaults(run=run_eval)

    d = cmds.add_parser("dashboard", help="per-feature top contexts, histograms, densities and logit effects",
                        description="Stream a corpus through the model up to the SAE's hook and write, per feature, "
                                    "its top activating contexts, an activation histogram, its density and its "
                                    "decoder direction's logit effect, as dashboard.json and a self-contained "
                                    "dashboard.html. Memory is bounded by the features kept, not the corpus; a "
                                    "killed run resumes from OUT/state.pt.",
                        epilog="example:\n  gpt2 sae dashboard corpus/ --sae saes/blocks.6.hook_resid_pre --features 0-99 --out dash/",
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    d.add_argument("data", nargs="+", help="text files, .jsonl files or folders of them")
    add_sae_options(d)
    d.add_argument("--out", type=Path, required=True, metavar="DIR", help="where dashboard.json/.html and the state go")
    d.add_argument("--features", default="0-99", metavar="LIST", help="'all' or e.g. '0,5,10-19' (default 0-99)")
    d.add_argument("--top", type=dashboard_top, default=20,
                   help=f"top activating contexts per feature, at most {MAX_TOP:,} (default 20)")
    d.add_argument("--context", type=positive_int, default=128, help="tokens per window (default 128)")
    d.add_argument("--batch-size", type=positive_int, default=8, help="windows per pass (default 8)")
    d.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    ray = d.add_argument_group("scaling out on Ray (pip install 'gpt2-engine[distributed]')")
    ray.add_argument("--ray", action="store_true",
                     help="spread the corpus over Ray actors that each load the model once; their parts merge to "
                          "exactly the local result (not resumable: a killed --ray run starts again)")
    ray.add_argument("--address", metavar="ADDR",
                     help="a running Ray cluster to join (e.g. 10.0.0.1:6379; default: start Ray on this machine)")
    ray.add_argument("--workers", type=int, metavar="N",
                     help="actors (default: the cluster's CPUs divided by --threads)")
    d.set_defaults(run=run_dashboard)
