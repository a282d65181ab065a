"""`gpt2 serve --ray`: the same FastAPI app (serve/app.py) as a Ray Serve deployment with N replicas.

Each replica loads the model and runs its own engine thread with its own KV-cache slots, exactly as `gpt2 serve` does
on one machine; Ray Serve's proxy spreads requests over the replicas. A replica is given at most `--parallel`
requests at a time (max_ongoing_requests follows the slots), so they decode together at once; the rest wait in Ray's
router, which holds up to `--max-queue` of them and answers 503 (Ray's plain-text body, with Retry-After) beyond.
A request of n > 1 sequences can still fill a replica's own waiting queue, which answers 429 as the single server.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import sys
import threading
from typing import Any

from ..core.errors import GPT2EngineError
from ..options import ModelOptions, load_model
from ..serve.app import ServeError, ServerSettings, ServerState, build_app
from ..serve.async_engine import EngineSettings, start_engine

APP_NAME = "gpt2"


def ray_modules() -> tuple[Any, Any]:
    """(ray, ray.serve), or a one-line error naming the extra to install."""
    try:
        import ray
        from ray import serve
    except ImportError:
        raise GPT2EngineError("--ray needs Ray: pip install 'gpt2-engine[distributed]' (ray[serve,data])") from None
    return ray, serve


class Replica:
    """One replica: the model, its engine thread and the app over them (built after the constructor, by Ray)."""

    def __init__(self, options: ModelOptions, engine_settings: EngineSettings, settings: ServerSettings) -> None:
        from ray import serve

        replica = serve.get_replica_context().replica_id.unique_id
        model = load_model(options)  # loaded before Ray marks the replica ready: no 503-while-loading here
        engine = start_engine(model, engine_settings, [path for _, path in settings.adapters])
        self.state = ServerState(ServerSettings(**{**settings.__dict__, "replica": replica}), model=model, engine=engine)

    def __serve_build_asgi_app__(self):
        return build_app(self.state)

    def check_health(self) -> None:
        """Ray restarts a replica whose engine thread has died."""
        engine = self.state.engine
        if engine is None or not engine.alive():
            raise RuntimeError("the engine thread is not running")


def deployment(args: argparse.Namespace, settings: ServerSettings):
    """The bound Ray Serve application: Replica behind ingress, with the replica count and request limits."""
    _, serve = ray_modules()
    threads = args.threads or 1
    options: dict[str, Any] = {
        "max_ongoing_requests": args.parallel,
        "max_queued_requests": args.max_queue,
        "ray_actor_options": {"num_cpus": threads},
        "health_check_period_s": 2,
    }
    if args.replicas == "auto":
        options["autoscaling_config"] = {"min_replicas": 1, "max_replicas": args.max_replicas or 4,
                                         "target_ongoing_requests": args.parallel}
    else:
        options["num_replicas"] = int(args.replicas)
    model_options = dataclasses.replace(ModelOptions.from_args(args), threads=threads)
    cls = serve.deployment(name="GPT2Replica")(serve.ingress()(Replica))
    return cls.options(**options).bind(model_options, EngineSettings.from_args(args), settings)


def check_replicas(args: argparse.Namespace) -> None:
    if args.replicas == "auto":
        if args.max_replicas is not None and args.max_replicas < 1:
            raise ServeError(f"--max-replicas must be at least 1, got {args.max_replicas}")
        return
    if not args.replicas.isdigit() or int(args.replicas) < 1:
        raise ServeError(f"--replicas: expected a positive number or 'auto', got {args.replicas!r}")
    if args.max_replicas is not None:
        raise ServeError("--max-replicas goes with --replicas auto")


def run_ray_serve(args: argparse.Namespace, settings: ServerSettings) -> int:
    """Start (or join) Ray, deploy, print the address, and serve until SIGINT or SIGTERM."""
    check_replicas(args)
    ray, serve = ray_modules()
    ray.init(address=args.address, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False,
             ignore_reinit_error=True)
    stop = threading.Event()
    try:  # Ctrl-C while deploying ends as "interrupted" (exit 130), after the cleanup below
        serve.start(http_options={"host": args.host, "port": args.port}, logging_config={"log_level": "WARNING"})
        serve.run(deployment(args, settings), name=APP_NAME, route_prefix="/")
        replicas = args.replicas if args.replicas != "auto" else f"1..{args.max_replicas or 4} (auto)"
        print(f"gpt2 serve: ready on Ray: {args.weights} as {settings.model_name!r}, {replicas} replica(s) of "
              f"{args.parallel} slots, http://{args.host}:{args.port}/", file=sys.stderr, flush=True)
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        try:
            stop.wait()
        except KeyboardInterrupt:  # Ctrl-C while serving: a normal stop, as uvicorn's
            pass
    finally:
        serve.shutdown()  # the replicas end their in-flight streams with an error chunk as they stop
        ray.shutdown()
    return 0
