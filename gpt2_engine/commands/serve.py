"""`gpt2 serve`: load a checkpoint and serve it over HTTP (127.0.0.1:8000 unless told otherwise)."""

from __future__ import annotations

import argparse
import errno
import math
import signal
import socket
import sys
from pathlib import Path

from ..core.config import GPT2Config
from ..core.errors import GPT2EngineError
from ..core.model import KVCache
from ..core.pages import available_memory
from ..formats.checkpoints import checkpoint_config
from ..interp.steering import SteeringRegistry
from ..options import ModelOptions, add_force_option, add_model_options, load_model
from ..runtime.prefix import BLOCK_TOKENS, DEFAULT_CAPACITY_MB, block_mb, check_capacity
from ..serve.app import ServeError, ServerSettings, ServerState, build_app, http_protocol
from ..serve.async_engine import EngineSettings, start_engine
from ..serve.chat import load_template, plain_template


MAX_KEY_BYTES = 4096


def read_api_key(args: argparse.Namespace) -> str | None:
    if args.api_key and args.api_key_file:
        raise ServeError("give --api-key or --api-key-file, not both")
    if args.api_key is not None and not args.api_key.strip():  # an unset $KEY would serve without one, silently
        raise ServeError("--api-key is empty: give a key, or leave the flag out to serve without one")
    if args.api_key_file is None:
        key = args.api_key
    else:
        try:
            with open(args.api_key_file, "rb") as f:
                data = f.read(MAX_KEY_BYTES + 1)  # /dev/zero or a huge file: read no more than a key can be
            key = data.decode("utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ServeError(f"cannot read API key file {args.api_key_file}: {getattr(e, 'strerror', None) or e}") from None
        if len(data) > MAX_KEY_BYTES:
            raise ServeError(f"{args.api_key_file}: more than {MAX_KEY_BYTES:,} bytes; expected one line holding the key")
        if not key:
            raise ServeError(f"{args.api_key_file}: the API key file is empty")
    if key is not None and not key.isprintable():  # a header cannot carry a newline or a NUL: no client could send it
        raise ServeError("the API key holds a newline or another unprintable character; expected one line of text")
    return key


def check_options(args: argparse.Namespace) -> ServerSettings:
    """The server settings, after checking every option a user can get wrong."""
    for name in ("parallel", "max_queue", "max_body_bytes"):
        if getattr(args, name) < 1:
            raise ServeError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not args.queue_timeout > 0:  # nan too
        raise ServeError(f"--queue-timeout must be a positive number of seconds, got {args.queue_timeout}")
    if not args.model_name.strip():
        raise ServeError("--model-name is empty: expected the name clients ask for (default gpt2)")
    if not 0 <= args.port <= 65535:
        raise ServeError(f"--port must be in 0..65535, got {args.port}")
    if not args.weights.exists():
        raise ServeError(f"{args.weights}: weights directory does not exist (run `make weights`, or `make demo` offline, or pass --weights DIR)")
    config = readable_config(args.weights)
    check_prefix_cache(args, config)
    check_speculation(args)
    if config is not None:
        check_slots(args.parallel, config)
    template = load_template(args.chat_template) if args.chat_template is not None else plain_template()
    return ServerSettings(args.model_name, lora_adapters(args), read_api_key(args), tuple(args.cors_origin),
                          args.max_body_bytes, chat_template=template, steering=steering_registry(args))


def readable_config(weights: Path) -> GPT2Config | None:
    """The checkpoint's config where it reads, for the checks below; None where it does not (the load then says why,
    in its words)."""
    from ..formats.hf import CONFIG

    if not (weights.is_file() or (weights / CONFIG).is_file()):
        return None
    try:
        return checkpoint_config(weights)
    except GPT2EngineError:
        return None


def check_prefix_cache(args: argparse.Namespace, config: GPT2Config | None) -> None:
    """--prefix-cache-mb and --no-prefix-cache: one of them, and a bound that holds a block of this model."""
    mb = args.prefix_cache_mb
    if mb is not None and not 0 < mb < math.inf:  # nan too
        raise ServeError(f"--prefix-cache-mb must be a positive, finite number of MB, got {mb} (--no-prefix-cache "
                         "turns the cache off)")
    if mb is not None:
        try:
            check_capacity(mb, "--prefix-cache-mb")
        except GPT2EngineError as e:
            raise ServeError(str(e)) from None
    if mb is not None and args.no_prefix_cache:
        raise ServeError("--prefix-cache-mb and --no-prefix-cache contradict each other: give one")
    if mb is not None and config is not None:
        need = block_mb(config)
        if mb < need:
            raise ServeError(f"--prefix-cache-mb {mb} holds no block: a block of {BLOCK_TOKENS} tokens of this model "
                             f"takes {need:.2f} MB")


def check_slots(parallel: int, config: GPT2Config) -> None:
    """That --parallel slots of a whole context's KV cache fit in the memory this machine has (the cache is allocated
    whole when the model loads)."""
    per_slot = KVCache.nbytes(config, 1, config.n_positions)
    available = available_memory()
    if parallel * per_slot > available:
        raise ServeError(f"--parallel {parallel:,} needs a {parallel * per_slot / 1e9:,.1f} GB KV cache ({per_slot / 1e6:.0f} "
                         f"MB a slot); this machine has {available / 1e9:.1f} GB available, room for "
                         f"{available // per_slot:,} slots")


def check_speculation(args: argparse.Namespace) -> None:
    """--speculate and --draft-tokens, a draft checkpoint's config and tokenizer against the base's (its weights are
    read when the model loads)."""
    from ..core.tokenizer import load_tokenizer
    from ..runtime.drafters import check_draft_checkpoint
    from ..runtime.speculation import check_draft_tokens

    if args.speculate is None:
        if args.draft_tokens is not None:
            raise ServeError("--draft-tokens applies to speculative decoding: give --speculate too")
        return
    try:
        check_draft_tokens(args.draft_tokens, "--draft-tokens")
    except GPT2EngineError as e:
        raise ServeError(str(e)) from None
    if args.speculate in ("int4", "int8") and (args.quantize or args.dtype != "float32"):
        raise ServeError(f"--speculate {args.speculate} drafts with the float32 model quantized; this server runs "
                         f"{args.quantize or args.dtype} (use ngram or a draft checkpoint)")
    if args.speculate not in ("int4", "int8", "ngram"):
        try:
            check_draft_checkpoint(Path(args.speculate), checkpoint_config(args.weights),
                                   load_tokenizer(args.weights))
        except GPT2EngineError as e:
            raise ServeError(f"--speculate {args.speculate}: {e}") from None


def named(specs: list[str], flag: str, what: str) -> dict[str, str]:
    """NAME=PATH specs as a dict; one-line errors for a malformed or repeated name."""
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ServeError(f"{flag} {spec!r}: expected NAME=PATH (the name requests use, and {what})")
        if name.strip() in out:
            raise ServeError(f"{flag} {spec!r}: the name {name.strip()!r} is given twice")
        out[name.strip()] = path.strip()
    return out


def steering_registry(args: argparse.Namespace) -> SteeringRegistry:
    """The --sae and --steering-vector entries, each loaded and checked against the model's config now, so that a bad
    one is an error at the command line rather than at a request."""
    from ..interp.sae import SAE
    from ..formats.saes import SAEError
    from ..core.errors import SteeringError
    from ..formats.vectors import read_vector

    sae_paths = named(args.sae, "--sae", "an SAELens directory or OpenAI .pt file")
    vector_paths = named(args.steering_vector, "--steering-vector", "a .pt, .safetensors or .npy vector")
    if not sae_paths and not vector_paths:
        return SteeringRegistry()
    config = checkpoint_config(args.weights)
    saes, vectors = {}, {}
    for name, path in sae_paths.items():
        try:
            saes[name] = SAE.load(path)
            saes[name].check(config)
        except SAEError as e:
            raise ServeError(f"--sae {name}={path}: {e}") from None
    for name, path in vector_paths.items():
        try:
            vectors[name] = read_vector(path)
        except SteeringError as e:
            raise ServeError(f"--steering-vector {name}={path}: {e}") from None
        widths = {config.n_embd, config.mlp_width, config.head_size}
        if vectors[name].numel() not in widths:
            raise ServeError(f"--steering-vector {name}={path}: {vectors[name].numel()} values; a hook of this model "
                             f"is {config.n_embd} (residual), {config.mlp_width} (MLP) or {config.head_size} (a head) wide")
    return SteeringRegistry(saes, vectors)


def lora_adapters(args: argparse.Namespace) -> tuple[tuple[str, Path], ...]:
    """The --lora NAME=DIR adapters, each read and checked against the base's config now, so that a bad one is an
    error at the command line rather than a server that never becomes ready."""
    from ..core.lora import LoraError
    from ..formats.peft import check_base, load_adapter

    adapters: list[tuple[str, Path]] = []
    for spec in args.lora:
        name, sep, path = spec.partition("=")
        name = name.strip()
        if not sep or not name or not path:
            raise ServeError(f"--lora {spec!r}: expected NAME=DIR (the model id clients ask for, and a PEFT adapter "
                             "directory)")
        if name == args.model_name or name in (n for n, _ in adapters):
            raise ServeError(f"--lora {spec!r}: the model id {name!r} is already taken"
                             + (" by the base (--model-name)" if name == args.model_name else ""))
        adapters.append((name, Path(path)))
    if adapters:
        config = checkpoint_config(args.weights)
        for name, path in adapters:
            try:
                adapter = load_adapter(path, config)
                if not args.force:
                    check_base(adapter, path, args.weights)
            except LoraError as e:
                raise ServeError(f"--lora {name}={path}: {e}") from None
    return tuple(adapters)


def listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads: a port in use is refused at once, in one line."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart reuses a port in TIME_WAIT
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ServeError(f"--port {port}: {host}:{port} is already in use (another server?); stop it or choose "
                             "another --port") from None
        raise ServeError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})") from None
    return sock


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    settings = check_options(args)
    if args.ray:
        from ..distributed.serve import run_ray_serve

        return run_ray_serve(args, settings)
    if args.replicas != "1" or args.max_replicas is not None or args.address is not None:
        raise ServeError("--replicas, --max-replicas and --address need --ray")
    sock = listen(args.host, args.port)
    port = sock.getsockname()[1]  # --port 0: the one the system chose
    state = ServerState(settings)
    options, engine_settings = ModelOptions.from_args(args), EngineSettings.from_args(args)

    def load():
        model = load_model(options)
        engine = start_engine(model, engine_settings, [path for _, path in settings.adapters])
        served = "".join(f", {name!r} (LoRA {path})" for name, path in settings.adapters)
        print(f"gpt2 serve: ready: {args.weights} as {settings.model_name!r}{served}, {args.parallel} slots, "
              f"http://{args.host}:{port}/", file=sys.stderr, flush=True)
        return model, engine

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame) -> None:
            """SIGINT or SIGTERM: in-flight streams end with an error chunk, then a graceful stop and exit 0
            (uvicorn's own handler re-raises the signal once it has stopped, which ends the process with -15)."""
            if state.engine is not None:
                state.engine.stop()
            settings.chat_template.close()  # renders under way fail now, in OpenAI's shape, not at the grace timeout
            self.force_exit = self.should_exit and sig == signal.SIGINT  # a second Ctrl-C: now
            self.should_exit = True

        async def on_tick(self, counter: int) -> bool:
            """Also stop when the model failed to load or the engine has failed for good: the process exits
            non-zero, saying why, for the user or a supervisor."""
            if state.load_error is not None or (state.engine is not None and state.engine.failure is not None):
                return True
            return await super().on_tick(counter)

    config = uvicorn.Config(build_app(state, load), host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=5, http=http_protocol())
    with sock:
        Server(config).run(sockets=[sock])
    if state.load_error is not None:
        raise ServeError(f"the model failed to load: {state.load_error}")
    if state.engine is not None and state.engine.failure is not None:
        raise ServeError(state.engine.failure)
    return 0


def add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="serve the model over an OpenAI-compatible HTTP API",
        description="An OpenAI-compatible server with continuous batching: POST /v1/completions, "
                    "/v1/chat/completions (on a chat template), GET /v1/models, /health, /metrics, POST /tokenize, "
                    "/detokenize, and a playground page at /.",
        epilog="examples:\n  gpt2 serve --weights weights/\n  gpt2 serve --port 8080 --parallel 16 --api-key-file key.txt\n"
               "  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\\n"
               "       -d '{\"model\": \"gpt2\", \"prompt\": \"Hello\", \"max_tokens\": 20}'",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--model-name", default="gpt2", metavar="NAME", help="the model name clients ask for (default gpt2)")
    p.add_argument("--parallel", type=int, default=8, metavar="N", help="KV-cache slots: sequences decoded together (default 8)")
    p.add_argument("--max-queue", type=int, default=64, metavar="N",
                   help="sequences that may wait for a slot; beyond it requests get 429 (default 64)")
    p.add_argument("--queue-timeout", type=float, default=60.0, metavar="S",
                   help="seconds a sequence may wait for a slot before its request gets 503 (default 60)")
    p.add_argument("--api-key", metavar="KEY", help="require 'Authorization: Bearer KEY' on every route but /health")
    p.add_argument("--api-key-file", type=Path, metavar="FILE", help="read the API key from FILE (keeps it out of ps)")
    p.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="allow browser requests from ORIGIN (repeatable; CORS is off by default)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, metavar="N", help="largest request body (default 1 MiB)")
    p.add_argument("--chat-template", type=Path, metavar="FILE",
                   help="the Jinja chat template of /v1/chat/completions, in transformers' form (the template's text, "
                        "or a tokenizer_config.json holding one); default: a plain User:/Assistant: transcript for "
                        "a base model (docs/serving.md: chat)")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default warning)")
    ray = p.add_argument_group("scaling out on Ray (pip install 'gpt2-engine[distributed]')")
    ray.add_argument("--ray", action="store_true",
                     help="serve the same app as a Ray Serve deployment: replicas, each with its own engine and slots")
    ray.add_argument("--replicas", default="1", metavar="N|auto",
                     help="replicas with --ray: a number, or 'auto' to scale with the load (default 1)")
    ray.add_argument("--max-replicas", type=int, metavar="M", help="the most replicas --replicas auto may start (default 4)")
    ray.add_argument("--address", metavar="ADDR",
                     help="a running Ray cluster to join (e.g. 10.0.0.1:6379; default: start Ray on this machine)")
    p.add_argument("--speculate", metavar="DRAFTER",
                   help="speculative decoding while at most 2 sequences run: 'int4' or 'int8' (this model quantized "
                        "drafts), 'ngram' (prompt lookup) or a GPT-2 checkpoint directory with the same tokenizer; "
                        "greedy output is the same tokens as without, sampled output the same distribution")
    p.add_argument("--draft-tokens", type=int, metavar="K", help="tokens drafted per verify pass (default: adaptive)")
    p.add_argument("--lora", action="append", default=[], metavar="NAME=DIR",
                   help="also serve a LoRA adapter (PEFT's format) as model id NAME (repeatable): requests pick it with "
                        "\"model\": NAME, and requests for every adapter and the base share the batched passes")
    p.add_argument("--sae", action="append", default=[], metavar="NAME=DIR",
                   help="offer an SAE for steering as NAME (repeatable; SAELens directory or OpenAI .pt): a request's "
                        "\"steering\": [{\"sae\": NAME, \"feature\": N, \"coef\": X}] adds X times the feature's "
                        "decoder row, {..., \"clamp\": V} sets the feature to V; the playground has a slider")
    p.add_argument("--steering-vector", action="append", default=[], metavar="NAME=FILE",
                   help="offer a steering vector as NAME (repeatable; .pt, .safetensors or .npy): a request's "
                        "\"steering\": [{\"vector\": NAME, \"hook\": \"blocks.6.hook_resid_pre\", \"coef\": X}]")
    p.add_argument("--prefix-cache-mb", type=float, metavar="MB",
                   help=f"memory for cached prompt blocks (default {DEFAULT_CAPACITY_MB}): a prompt that starts with "
                        f"blocks of {BLOCK_TOKENS} tokens an earlier request computed reuses their keys and values "
                        "(least recently used blocks are evicted)")
    p.add_argument("--no-prefix-cache", action="store_true", help="recompute every prompt from its first token")
    add_model_options(p, lora=False)
    add_force_option(p)
    p.set_defaults(run=run_serve)
