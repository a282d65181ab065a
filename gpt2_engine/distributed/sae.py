"""`gpt2 sae dashboard --ray`: a feature dashboard's corpus spread over Ray actors that each load the model once.

The driver reads and tokenizes the corpus as the local command does (the windows run across documents and files, so
they are a sequence only one reader can cut) and hands numbered batches to the actors, a few in flight per actor, so
its memory stays bounded too. Each actor keeps its own part of the dashboard (inspect/sae.py's Dashboard, whose top-N
key orders by activation, then corpus position); the parts are merged at the end with Dashboard.absorb, which gives
exactly the local run's dashboard however the batches were spread. Ray Core actors rather than Ray Data: a part stays
in its actor until the end, instead of every batch shipping its F x N candidate contexts back to the driver.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from collections.abc import Callable

from ..core.errors import GPT2EngineError
from ..interp.sae import SAE, check_saes
from ..inspect.sae import Dashboard, DashboardSettings, DashboardWorker, corpus_batches
from ..options import ModelOptions, load_model


class DashboardActor:
    """A Ray actor: the model and the SAE loaded once, a part of the dashboard kept."""

    def __init__(self, options: ModelOptions, sae_path: str, hook: str | None, settings: DashboardSettings) -> None:
        self.worker = DashboardWorker(load_model(options), SAE.load(sae_path, hook_name=hook), settings)

    def add(self, first: int, windows: list[list[int]]) -> int:
        return self.worker.add(first, windows)

    def part(self) -> dict:
        return self.worker.dash.state()


def dashboard_on_ray(args: argparse.Namespace, model, sae: SAE, paths: list[str], settings: DashboardSettings,
                     progress: Callable[[int], None] | None = None) -> Dashboard:
    """The dashboard of `paths` computed by --workers actors of --threads threads each, merged exactly; `model` is
    the driver's (its tokenizer cuts the windows; the page's logit effects need its weights anyway)."""
    try:
        import ray
        from ray.util import ActorPool
    except ImportError:
        raise GPT2EngineError("--ray needs Ray: pip install 'gpt2-engine[distributed]' (ray[serve,data])") from None
    check_saes(sae, model.config)
    ray.init(address=args.address, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False,
             ignore_reinit_error=True)
    threads = args.threads or 1
    free = int(ray.available_resources().get("CPU", 0))
    workers = args.workers or max(1, free // threads)
    if workers * threads > free:  # actors that cannot be placed would wait for ever
        raise GPT2EngineError(f"--workers {workers} x --threads {threads} need {workers * threads} CPUs; the Ray "
                              f"cluster has {free} free (fewer workers or threads, or a larger cluster)")
    options = dataclasses.replace(ModelOptions.from_args(args), threads=threads)
    actor = ray.remote(num_cpus=threads)(DashboardActor)
    actors = [actor.remote(options, str(args.sae), args.hook, settings) for _ in range(workers)]
    pool = ActorPool(actors)
    in_flight, limit = 0, 2 * workers  # a batch queued behind each one running: the driver holds a few at most
    for first, batch in corpus_batches(model.tokenizer, paths, settings, sae.config.prepend_bos):
        if in_flight == limit:
            done = pool.get_next_unordered()
            in_flight -= 1
            if progress is not None:
                progress(done)
        pool.submit(lambda a, job: a.add.remote(*job), (first, batch))
        in_flight += 1
    while pool.has_next():
        done = pool.get_next_unordered()
        if progress is not None:
            progress(done)
    dash = Dashboard(settings)
    for state in ray.get([a.part.remote() for a in actors]):
        part = Dashboard(settings)
        part.restore(state, model.tokenizer.n_vocab, from_start=False)
        dash.absorb(part)
    for a in actors:  # their CPUs go back to the cluster now, not when the driver exits
        ray.kill(a)
    return dash

