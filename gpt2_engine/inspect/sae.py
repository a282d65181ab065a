"""What an SAE's features respond to: per-token features of a prompt, and feature dashboards over a corpus.

A dashboard streams a corpus through the model up to the SAE's hook (the layers after it and the head are never
run), encodes each batch and keeps, per feature, its top-N activating tokens with the context around each, an
activation histogram on fixed log-spaced bins (so batches and resumed runs merge exactly) and its density; the
decoder direction's direct effect on the logits comes from the weights alone. Memory is bounded by the features
kept (F x N x CONTEXT), never by the corpus: the text is read and tokenized one file at a time, and the state is
saved atomically every few batches so that a killed run resumes where it stopped. A saved state is resumed only by
the run it belongs to, told by content (the weights' fingerprint, the SAE's digest, each corpus file's size and
mtime_ns, the settings), and only once each of its fields is checked: anything else is refused in one line.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from ..core.pages import check_batch_fits
from ..api import GPT2
from ..core.errors import GPT2EngineError
from ..formats.files import atomic_write, what_is
from ..formats.hf import weights_fingerprint
from ..formats.pickles import load_pickle
from ..interp.hooks import Recorder
from ..core.model import logits, residual_stream
from ..core.projection import as_float32
from ..interp.sae import SAE, Spliced, check_saes
from ..core.tokenizer import Tokenizer
from ..documents import file_stamps, read_documents
from .analysis import float64_head
from .report import parse_indices

BEFORE, AFTER = 12, 3  # tokens of context kept around each top activation
BINS = torch.logspace(-3, 3, 61)  # histogram edges of nonzero activations, 1e-3 .. 1e3: fixed, so runs merge exactly
STATE = "state.pt"


class StopForward(Exception):
    """Raised by the hook once the SAE's input is in hand: nothing after the hook needs computing."""


class CorpusEnded(GPT2EngineError):
    """corpus_batches was asked to skip more windows than the corpus holds (a saved count that is not its own)."""


def feature_acts(model: GPT2, sae: SAE, ids: torch.Tensor) -> torch.Tensor:
    """ids [B, T] -> [B, T, d_sae]: the SAE's feature activations, the forward stopped at its hook."""
    name = f"{sae.hook_name}.hook_sae_acts_post"
    spliced = Spliced(sae, model.weights, model.config, record=name.__eq__)

    def stop(a: torch.Tensor, hook: str) -> torch.Tensor:
        spliced(a, hook)
        raise StopForward

    try:
        model.run_with_hooks(ids, {sae.hook_name: stop})
    except StopForward:
        pass
    return spliced.seen[name]


def prompt_ids(model: GPT2, sae: SAE, text: str) -> list[int]:
    """The prompt's ids, after <|endoftext|> where the SAE was trained on prompts that began with it."""
    ids = model.tokenizer.encode(text, allow_special=True)
    eot = model.tokenizer.eot_id
    return [eot, *ids] if sae.config.prepend_bos and (not ids or ids[0] != eot) else ids


def corpus_windows(tokenizer: Tokenizer, paths: Sequence[str], context: int, bos: bool) -> Iterator[list[int]]:
    """Windows of `context` ids over the files in order, documents joined by <|endoftext|> (each window begins with
    it where `bos`); one file is read and tokenized at a time."""
    if context < 2:
        raise GPT2EngineError(f"--context: expected at least 2 tokens per window, got {context}")
    eot = tokenizer.eot_id
    body = context - 1 if bos else context
    pending: list[int] = []
    for path in paths:
        for _, doc in read_documents([path], sys.stdin.buffer):  # a .jsonl file's "text" fields, checked
            pending += tokenizer.encode(doc) + [eot]
            start = 0
            while len(pending) - start >= body:
                yield ([eot] if bos else []) + pending[start : start + body]
                start += body
            del pending[:start]  # once per document: slicing per window would copy a long document's ids over and over
    if len(pending) > 1:
        yield ([eot] if bos else []) + pending


@dataclass(frozen=True)
class DashboardSettings:
    features: tuple[int, ...]
    top: int = 20
    context: int = 128
    batch_size: int = 8


class Dashboard:
    """Per-feature top-N activations with their contexts, histograms and densities, merged batch by batch.

    The top N are chosen by a key that orders (activation descending, corpus position ascending) with no ties: the
    activation's float32 bits (monotonic for activations >= 0) above the position's complement. Identical activations,
    which a corpus with repeated text produces, are then kept in corpus order whatever the batching, so any split of
    the corpus (resumed runs, Ray workers) merges to exactly the single run's result."""

    def __init__(self, settings: DashboardSettings) -> None:
        F, N, W = len(settings.features), settings.top, BEFORE + 1 + AFTER
        self.settings = settings
        self.index = torch.tensor(settings.features)
        self.top_key = torch.full((F, N), -1, dtype=torch.int64)  # -1: an empty slot
        self.top_ids = torch.zeros((F, N, W), dtype=torch.int32)  # the tokens around each (-1: none)
        self.top_ctx = torch.zeros((F, N, W))  # the feature's activation at each of them
        self.hist = torch.zeros((F, len(BINS) + 1), dtype=torch.int64)
        self.fired = torch.zeros(F, dtype=torch.int64)
        self.tokens = 0
        self.windows = 0

    @property
    def top_acts(self) -> torch.Tensor:
        """[F, N] the top activations (-1 in empty slots)."""
        acts = (self.top_key >> 32).to(torch.int32).view(torch.float32)
        return torch.where(self.top_key < 0, -1.0, acts)

    def add(self, ids: torch.Tensor, acts: torch.Tensor, first_window: int | None = None) -> None:
        """ids [B, T], acts [B, T, F] (the dashboard's features, in its order) of the windows numbered
        first_window.. (default: the next ones) in the corpus."""
        B, T = ids.shape
        first = self.windows if first_window is None else first_window
        if (first + B) * self.settings.context > 0xFFFFFFFF:  # the key holds a position in 32 bits
            raise GPT2EngineError("a dashboard reads at most 4,294,967,295 tokens of corpus; split the corpus")
        a = acts.float().reshape(B * T, -1).T.contiguous().clamp(min=0)  # [F, B*T]
        self.fired += (a > 0).sum(-1)
        self.hist.scatter_add_(1, torch.bucketize(a, BINS), (a > 0).long())  # zeros counted in no bin
        pos = (first + torch.arange(B)[:, None]) * self.settings.context + torch.arange(T)  # [B, T] corpus positions
        key = (a.view(torch.int32).long() << 32) | (0xFFFFFFFF - pos.reshape(-1))  # [F, B*T]
        key, where = key.topk(min(self.settings.top, B * T), dim=-1)  # [F, k]
        pad_ids = torch.nn.functional.pad(ids, (BEFORE, AFTER), value=-1)  # [B, T + W - 1]
        pad_a = torch.nn.functional.pad(a.view(-1, B, T), (BEFORE, AFTER))  # [F, B, T + W - 1]
        b, t = where // T, where % T  # [F, k]
        span = t[..., None] + torch.arange(BEFORE + 1 + AFTER)  # [F, k, W] in padded coordinates
        ctx_ids = pad_ids[b[..., None], span].int()  # [F, k, W]
        ctx_a = pad_a[torch.arange(a.shape[0])[:, None, None], b[..., None], span]  # [F, k, W]
        self.merge(key, ctx_ids, ctx_a)
        self.tokens += B * T
        self.windows += B

    def merge(self, key: torch.Tensor, ctx_ids: torch.Tensor, ctx_a: torch.Tensor) -> None:
        """Keep the top N of the kept entries and these: key [F, k], their contexts [F, k, W]."""
        all_keys = torch.cat([self.top_key, key], dim=1)
        self.top_key, keep = all_keys.topk(self.settings.top, dim=-1)  # [F, N]
        gather = keep[..., None].expand(-1, -1, ctx_ids.shape[-1])
        self.top_ids = torch.cat([self.top_ids, ctx_ids], 1).gather(1, gather)
        self.top_ctx = torch.cat([self.top_ctx, ctx_a], 1).gather(1, gather)

    def absorb(self, other: Dashboard) -> None:
        """Merge another part of the same corpus into this one (exactly as if one run had seen both)."""
        self.merge(other.top_key, other.top_ids, other.top_ctx)
        self.hist += other.hist
        self.fired += other.fired
        self.tokens += other.tokens
        self.windows += other.windows

    FIELDS = ("top_key", "top_ids", "top_ctx", "hist", "fired", "tokens", "windows")

    def state(self) -> dict[str, Any]:
        """The fields that make this dashboard, as restore() takes them back."""
        return {name: getattr(self, name) for name in self.FIELDS}

    def restore(self, state: Mapping[str, Any], vocab: int, from_start: bool = True) -> None:
        """Take a state's fields once each is checked against this dashboard's settings and a vocabulary of `vocab`
        ids; ValueError naming the first that no run could have written (a damaged or edited file). `from_start`:
        the state's windows are the corpus's first (a saved run's, not a Ray actor's part), so its top positions lie
        within them."""
        check_tensors(state, self.settings)
        check_counts(state, self.settings, vocab, from_start)
        for name in self.FIELDS:
            setattr(self, name, state[name])


def check_tensors(state: Mapping[str, Any], settings: DashboardSettings) -> None:
    """ValueError naming the first of a state's tensors that is not of the dtype and shape Dashboard keeps."""
    F, N, W = len(settings.features), settings.top, BEFORE + 1 + AFTER
    expected = {"top_key": (torch.int64, [F, N]), "top_ids": (torch.int32, [F, N, W]),
                "top_ctx": (torch.float32, [F, N, W]), "hist": (torch.int64, [F, len(BINS) + 1]),
                "fired": (torch.int64, [F])}
    for name, (dtype, shape) in expected.items():
        t = state.get(name)
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.dtype != dtype or list(t.shape) != shape:
            found = f"{t.dtype} of shape {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} is {found}; expected {dtype} of shape {shape}")


def check_counts(state: Mapping[str, Any], settings: DashboardSettings, vocab: int, from_start: bool = True) -> None:
    """ValueError naming the first of a state's counts or values that no run could have written: counts that are
    negative or do not add up, positions past the windows read, token ids outside the vocabulary."""
    tokens, windows, C = state.get("tokens"), state.get("windows"), settings.context
    for name, value in (("tokens", tokens), ("windows", windows)):
        if type(value) is not int or value < 0:  # bool is no count
            raise ValueError(f"{name} is {value!r}; expected a count")
    # every window holds `context` tokens but the corpus's last, which holds fewer; positions fit the key's 32 bits
    if windows * C > 0xFFFFFFFF or not (tokens == windows == 0 or (windows - 1) * C < tokens <= windows * C):
        raise ValueError(f"{tokens:,} tokens in {windows:,} windows of at most {C}")
    hist, fired = state["hist"], state["fired"]
    if (hist < 0).any() or not torch.equal(hist.sum(-1), fired) or (fired > tokens).any():
        raise ValueError("hist and fired do not add up (negative counts, or more than the tokens read)")
    key = state["top_key"]
    position = 0xFFFFFFFF - (key & 0xFFFFFFFF)  # [F, N], where key >= 0; -1 is an empty slot
    if (key < -1).any() or from_start and ((key >= 0) & (position >= windows * C)).any():
        raise ValueError("top_key holds keys no run writes (below -1, or positions past the windows read)")
    ids = state["top_ids"]
    if ((ids < -1) | (ids >= vocab)).any():
        raise ValueError(f"top_ids holds ids outside the vocabulary of {vocab:,} (or -1, for none)")
    if not bool(((state["top_ctx"] >= 0) & torch.isfinite(state["top_ctx"])).all()):  # NaN is no activation
        raise ValueError("top_ctx holds negative or non-finite activations")


def logit_effects(model: GPT2, sae: SAE, features: Sequence[int], k: int = 10) -> list[dict[str, list] | None]:
    """Per feature, the tokens whose logits its decoder direction raises and lowers most, directly: the direction
    carried into the residual stream (through W_O for hook_z, W_out for mlp.hook_post), then ln_final's weight and
    the unembedding (the scale is the token's own, so this ranks tokens, as SAELens's and Neuronpedia's logit
    tables do). None where the hook has no direct path to the logits (q, k, v, the MLP's input, a layer norm)."""
    name = sae.hook_name
    point = name.split(".", 2)[-1]
    w = model.weights
    d = sae.W_dec[list(features)]  # [F, d_in]
    if point == "attn.hook_z" and sae.config.hook_head_index is None:
        d = d @ as_float32(w.blocks[int(name.split(".")[1])].attn_c_proj.weight)
    elif point == "mlp.hook_post":
        d = d @ as_float32(w.blocks[int(name.split(".")[1])].mlp_c_proj.weight)
    elif d.shape[-1] != model.config.n_embd or point.endswith("hook_normalized") or point.startswith(("attn.", "mlp.")):
        return [None] * len(features)
    effect = (d * w.ln_f.weight.float()) @ w.wte.float().T  # [F, V]
    up, down = effect.topk(k, dim=-1), (-effect).topk(k, dim=-1)
    text = model.tokenizer.token_text
    return [{"top": [[text(int(i)), round(float(v), 4)] for i, v in zip(up.indices[f], up.values[f])],
             "bottom": [[text(int(i)), round(-float(v), 4)] for i, v in zip(down.indices[f], down.values[f])]}
            for f in range(len(features))]


def run_record(model: GPT2, sae: SAE, paths: Sequence[str], settings: DashboardSettings) -> dict[str, Any]:
    """What a saved state belongs to, by content: the weights (their file's fingerprint, read whole, as adapters
    record their base's, and the dtype and quantization they run in), the SAE's digest, each corpus file's size and
    mtime_ns, and the settings. A model that is not its checkpoint's (built in memory, fine-tuned since, with an
    adapter) has no fingerprint, "": no state is resumed for it."""
    weights = weights_fingerprint(model.source) if model.source is not None and model.lora is None else ""
    return {"weights": weights, "dtype": str(model.dtype), "quantize": model.quantize, "sae": sae.digest,
            "corpus": file_stamps(paths), "settings": asdict(settings)}


def not_a_state(path: Path, what: str) -> GPT2EngineError:
    return GPT2EngineError(f"{path}: not a dashboard state of this run ({what}); delete it to start over")


def check_run(path: Path, saved: dict[str, Any], record: dict[str, Any]) -> None:
    """GPT2EngineError where the run a state records (`saved`) is not this one (`record`), naming what differs."""
    if set(saved) != set(record):
        raise not_a_state(path, f"its run records {sorted(map(str, saved))[:10]}; expected {sorted(record)}")
    again = f"give another --out, or delete {path} to start over"
    if not record["weights"]:
        raise GPT2EngineError(f"{path.parent}: holds a dashboard state ({path.name}), and this model is not its "
                              f"checkpoint's (built in memory, fine-tuned or with an adapter), so no state can be "
                              f"matched to it; {again}")
    names = {"weights": "model weights", "dtype": "dtype", "quantize": "quantization", "sae": "SAE",
             "corpus": "corpus files", "settings": "settings"}
    try:  # compared as JSON: an edited record's tensor or odd key is not compared as the values it stands for
        found = {key: json.dumps(value, sort_keys=True) for key, value in saved.items()}
    except (TypeError, ValueError, RecursionError):
        raise not_a_state(path, "its run record holds more than plain values") from None
    changed = [name for key, name in names.items() if found[key] != json.dumps(record[key], sort_keys=True)]
    if "settings" in changed and isinstance(saved["settings"], dict):  # named as the options that set them
        flags = [f"--{key.replace('_', '-')}" for key, value in record["settings"].items()
                 if json.dumps(saved["settings"].get(key)) != json.dumps(value)]
        changed[changed.index("settings")] = f"settings ({', '.join(flags)})" if flags else "settings"
    if changed:
        raise GPT2EngineError(f"{path.parent}: holds a dashboard of other inputs or settings ({path.name}: not this "
                              f"run's {', '.join(changed)}); {again}")


def restore_state(dash: Dashboard, path: Path, record: dict[str, Any], vocab: int) -> bool:
    """Restore `dash` from `path` where it holds a state of this run (`record`); False where there is none.
    GPT2EngineError, in one line, where it is a state of other inputs or settings, of an older version, or none."""
    kind = what_is(path)
    if kind is None:
        return False
    if kind != "a regular file":  # a FIFO would hang the reader, then be written into
        raise not_a_state(path, kind)
    try:
        state = load_pickle(path)  # tensors and plain values only: nothing in the file runs
    except ValueError as e:
        raise not_a_state(path, str(e)) from None
    if not isinstance(state, dict):
        raise not_a_state(path, f"a {type(state).__name__}, not a dict")
    if "key" in state and "run" not in state:
        raise GPT2EngineError(f"{path.parent}: holds a dashboard state of an older gpt2 sae dashboard ({path.name}), "
                              f"which cannot tell whether its inputs changed; give another --out, or delete {path} "
                              "to start over")
    if set(state) != {"run", *Dashboard.FIELDS} or not isinstance(state["run"], dict):
        raise not_a_state(path, f"its keys are {sorted(map(str, state))[:10]}; expected run, "
                                f"{', '.join(Dashboard.FIELDS)}")
    check_run(path, state["run"], record)
    try:
        dash.restore(state, vocab)
    except ValueError as e:
        raise not_a_state(path, str(e)) from None
    return True


def corpus_batches(tokenizer: Tokenizer, paths: Sequence[str], settings: DashboardSettings, bos: bool,
                   skip: int = 0) -> Iterator[tuple[int, list[list[int]]]]:
    """(the first window's number, up to batch_size windows of one length) over the corpus, from window `skip` on."""
    batch: list[list[int]] = []
    first, n = skip, -1
    for n, window in enumerate(corpus_windows(tokenizer, paths, settings.context, bos)):
        if n < skip:
            continue
        if batch and len(window) != len(batch[0]):  # the corpus's shorter last window goes alone
            yield first, batch
            first, batch = n, []
        batch.append(window)
        if len(batch) == settings.batch_size:
            yield first, batch
            first, batch = n + 1, []
    if batch:
        yield first, batch
    if skip > n + 1:
        raise CorpusEnded(f"it counts {skip:,} windows done; the corpus holds {n + 1:,}")


class DashboardWorker:
    """The model and the SAE (cut down to the dashboard's features where it can be), adding batches of windows to a
    Dashboard: the local command's one, or each Ray actor's part."""

    def __init__(self, model: GPT2, sae: SAE, settings: DashboardSettings) -> None:
        check_saes(sae, model.config)
        check_batch_fits(settings.batch_size, settings.context, model.config, extra_per_token=sae.d_sae)
        self.model, self.sae = model, sae
        self.part = sae.select(settings.features)  # only the features shown are encoded (not possible for topk)
        self.dash = Dashboard(settings)

    def add(self, first: int, windows: list[list[int]]) -> int:
        ids = torch.tensor(windows)
        if self.part is not None:
            acts = feature_acts(self.model, self.part, ids)
        else:
            acts = feature_acts(self.model, self.sae, ids)[..., self.dash.index]
        self.dash.add(ids, acts, first_window=first)
        return len(windows)


def build_dashboard(model: GPT2, sae: SAE, paths: Sequence[str], settings: DashboardSettings, out: Path,
                    progress: Callable[[int], None] | None = None, save_every: int = 16,
                    notice: Callable[[str], None] | None = None) -> Dashboard:
    """Stream the corpus into a Dashboard, resuming from out/state.pt where it is a state of this very run
    (run_record; one of other inputs or settings is refused, never resumed nor replaced); `notice` is told, in one
    line, that the run resumes."""
    worker = DashboardWorker(model, sae, settings)
    dash = worker.dash
    out.mkdir(parents=True, exist_ok=True)
    state_path = out / STATE
    record = run_record(model, sae, paths, settings)
    if restore_state(dash, state_path, record, model.tokenizer.n_vocab) and notice is not None:
        notice(f"resuming from {state_path}: {dash.windows:,} windows ({dash.tokens:,} tokens) already done")
    if progress is not None and dash.windows:
        progress(dash.windows)

    def save() -> None:
        atomic_write(state_path, lambda tmp: torch.save({"run": record, **dash.state()}, tmp))

    batches = corpus_batches(model.tokenizer, paths, settings, sae.config.prepend_bos, skip=dash.windows)
    try:
        for n, (first, batch) in enumerate(batches, start=1):
            done = worker.add(first, batch)
            if progress is not None:
                progress(done)
            if n % save_every == 0:
                save()
    except CorpusEnded as e:
        raise not_a_state(state_path, str(e)) from None
    save()
    return dash


def dashboard_data(model: GPT2, sae: SAE, dash: Dashboard) -> dict[str, Any]:
    """The dashboard as JSON-ready data: per feature its density, histogram, top contexts and logit effect."""
    text = model.tokenizer.token_text
    effects = logit_effects(model, sae, dash.settings.features)
    top_acts = dash.top_acts  # [F, N]
    features = []
    for i, f in enumerate(dash.settings.features):
        tops = []
        for n in range(dash.settings.top):
            if top_acts[i, n] <= 0:
                break
            ids = dash.top_ids[i, n].tolist()
            tops.append({"act": round(float(top_acts[i, n]), 4),
                         "tokens": [text(t) if t >= 0 else None for t in ids],
                         "acts": [round(float(v), 4) for v in dash.top_ctx[i, n]], "at": BEFORE})
        features.append({"feature": f, "density": float(dash.fired[i]) / max(dash.tokens, 1),
                         "max": round(float(top_acts[i, 0].clamp(min=0)), 4),
                         "histogram": {"edges": [float(f"{e:.4g}") for e in BINS.tolist()],
                                       "counts": dash.hist[i, 1:-1].tolist(), "above": int(dash.hist[i, -1]),
                                       "below": int(dash.hist[i, 0])},
                         "top": tops, "logits": effects[i]})
    return {"sae": repr(sae), "hook": sae.hook_name, "d_sae": sae.d_sae, "tokens": dash.tokens,
            "windows": dash.windows, "settings": asdict(dash.settings), "features": features}


def write_dashboard(data: dict[str, Any], out: Path) -> list[Path]:
    """dashboard.json and dashboard.html (self-contained: the data inline, no network) under `out`."""
    page = resources.files("gpt2_engine.inspect").joinpath("dashboard.html").read_text(encoding="utf-8")
    body = json.dumps(data, ensure_ascii=False)
    html = page.replace("/*DATA*/null", body.replace("</", "<\\/"))
    written = []
    for name, content in (("dashboard.json", body), ("dashboard.html", html)):
        atomic_write(out / name, lambda tmp, c=content: tmp.write_text(c, encoding="utf-8"))
        written.append(out / name)
    return written


def parse_features(text: str, d_sae: int) -> tuple[int, ...]:
    """'all', or a list like '0,5,10-19' -> feature indices, each checked against the SAE's width."""
    return tuple(range(d_sae)) if text == "all" else parse_indices(text, d_sae, "--features", "this SAE's features")


def feature_attribution(model: GPT2, sae: SAE, ids: Sequence[int], target: int, k: int = 10) -> dict[str, Any]:
    """Which of the SAE's features drive log p(target) after the prompt `ids`: for each token and feature,
    f * d log p(target) / d f, with the SAE spliced in and its reconstruction error added back as a constant, so that
    the forward is the plain model's and the gradient runs through the decoder alone (attribution patching, as sparse
    feature circuits estimate a feature's effect). Each feature's direct and indirect paths to the logit count; the
    estimate is first order. ln_f and the head run in float64, as gpt2 inspect's token attributions do."""
    check_saes(sae, model.config)
    batch = torch.tensor([list(ids)])  # [1, T]
    spliced = Spliced(sae, model.weights, model.config, leaf=True)
    with torch.inference_mode(False), torch.enable_grad():
        x = residual_stream(model.weights, model.config, batch, tap=Recorder(hooks={sae.hook_name: spliced}))[:, -1]
        last = logits(float64_head(model.weights), model.config, x.double())[0]  # [V]
        logprob = last[target] - torch.logsumexp(last, dim=-1)
        f = spliced.seen["leaf"]  # [1, T, d_sae]
        (grad,) = torch.autograd.grad(logprob, f)
    acts = f.detach()[0]  # [T, d_sae]
    attr = (acts * grad[0]).float()  # [T, d_sae]
    T = attr.shape[0]
    flat = attr.reshape(-1)
    order = flat.abs().topk(min(k, flat.numel())).indices
    text = model.tokenizer.token_text
    top = [{"position": int(i) // sae.d_sae, "token": text(int(ids[int(i) // sae.d_sae])), "feature": int(i) % sae.d_sae,
            "activation": round(float(acts.reshape(-1)[i]), 4), "attribution": round(float(flat[i]), 5)}
           for i in order if float(flat[i]) != 0]
    total = attr.sum(0)  # [d_sae]: each feature over every position
    by_feature = [{"feature": int(j), "attribution": round(float(total[j]), 5)}
                  for j in total.abs().topk(min(k, sae.d_sae)).indices if float(total[j]) != 0]
    return {"sae": repr(sae), "logprob": round(float(logprob.detach()), 5), "tokens": T, "top": top, "features": by_feature,
            "sum": round(float(attr.sum()), 5)}
