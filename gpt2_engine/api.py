"""The public API: `GPT2.from_pretrained(directory)`, then `model(ids)` for logits or `model.generate(prompt)`."""

from __future__ import annotations

import dataclasses
import functools
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from .formats.checkpoints import read_checkpoint
from .core.config import GPT2Config
from .core.errors import GenerationError, GPT2EngineError, WeightsError
from .interp.hooks import ActivationCache, Hook, NameFilter, Recorder, name_predicate
from .core.kernels import cpu
from .core.lora import LoraAdapter, LoraSettings, attach
from .formats.peft import check_base, load_adapter
from .core.model import forward
from .core.packing import LayoutError, Packing, check_layout, pack_weights, use_packed
from .core.pages import HugeArena, check_batch_fits, file_mapping, huge_pages_available
from .core.weights import matrices_on_huge_pages
from .core.quantize import FORMATS, quantize_weights
from .interp.sae import SAE, SAEMetrics, Spliced, check_saes, sae_point_names
from .interp.spec import Steering, check_steering
from .core.tokenizer import Tokenizer, load_tokenizer
from .formats.hf import (CONFIG, find_weights_file, load_weights, weights_directory, weights_fingerprint,
                         weights_from_tensors)
from .core.weights import GPT2Weights, on_device, panel_bytes
from .documents import expand_paths, read_documents
from .runtime.constraints import Grammars
from .runtime.drafters import Speculation, load_speculation
from .runtime.generate import Completion, Generation, two_samples
from .runtime.runner import ModelRunner
from .runtime.torch_runner import TorchRunners
from .runtime.requests import GenerationSettings, Prompt, encode_prompts
from .runtime.sampling import SamplingParams
from .runtime.scoring import Score, ScoreSettings, score_documents, token_logprobs
from .runtime.speculation import SpeculationPolicy, check_draft_tokens
from .train.step import trainable_copy
from .train.trainer import Base, Output, Started, Trainer, TrainResult, TrainSettings, record


def train_settings(settings: dict[str, Any]) -> TrainSettings:
    """finetune's keyword settings as TrainSettings; one that is not a field is named (not a constructor's
    TypeError)."""
    names = [f.name for f in dataclasses.fields(TrainSettings)]
    if unknown := sorted(set(settings) - set(names)):
        raise GPT2EngineError(f"finetune: no setting {unknown[0]!r}; expected TrainSettings' fields ({', '.join(names)})")
    return TrainSettings(**settings)


class GPT2:
    """A loaded GPT-2: config, weights and tokenizer, with a from-scratch forward pass."""

    def __init__(self, config: GPT2Config, weights: GPT2Weights, tokenizer: Tokenizer, *, dtype: torch.dtype,
                 device: torch.device, quantize: str | None = None, lora: LoraAdapter | None = None,
                 source: Path | None = None, runner: str = "native", packing: Packing | None = None) -> None:
        self.config = config
        self.weights = weights  # with `lora` attached, if given
        self.tokenizer = tokenizer
        self.dtype = dtype  # of the weight matrices; activations and layer norms are float32 (the KV cache too but
        # on the torch runner, where it takes the matrices' dtype: runtime/torch_runner.py)
        self.device = device
        # what executes generation's and the server's passes: the native CPU runner, or the torch runner on `device`
        # (its factory shares one device KV cache, and the steps captured on it, among the model's runs)
        self.runner_kind = runner
        self.runner: Callable[..., Any] = TorchRunners(weights, config) if runner == "torch" else ModelRunner
        self.quantize = quantize
        self.lora = lora
        self.source = source  # the checkpoint directory it was loaded from (None: built in memory)
        self.packing = packing  # what packing the float matrices' exponents made (None: not packed; core/packing.py)
        self._grammars: Grammars | None = None  # structured output's compiler, made on first use
        self.drafts: dict[str, Speculation] = {}  # draft models loaded for speculate=, by source

    @classmethod
    def from_pretrained(cls, directory: str | Path, *, dtype: torch.dtype | str = torch.float32,
                        device: torch.device | str = "cpu", quantize: str | None = None,
                        lora: str | Path | None = None, force: bool = False, runner: str | None = None,
                        weight_layout: str = "auto") -> GPT2:
        """Load the official-format checkpoint in `directory` (config.json, weights, BPE files); "demo": the demo model;
        or a checkpoint file of nanoGPT (ckpt.pt) or llm.c (its model .bin), told apart by content, with GPT-2's BPE.

        dtype: float32 (default) or bfloat16 weight matrices (bfloat16 is widened to float32 right before each
        matmul). quantize="int8" or "int4": the projections in blockwise int8 or int4 and the output head in int8,
        quantized now (core/quantize.py); the residual stream stays float32. lora: a LoRA adapter directory in
        PEFT's format (from `gpt2 finetune --lora` or peft's save_pretrained), applied on top of these weights in
        whatever format they are (core/lora.py); an adapter that records another base than `directory` is an
        error unless `force`. weight_layout: "packed" keeps the float32 or bfloat16 projections and head with packed
        exponents (core/packed.py: 0.875x or 0.75x the bytes, the same logits to the bit), "plain" as they are (in
        panels where the CPU reads those faster), "auto" (default) packed where this CPU reads that faster, measured
        once per process and model shape (core/packing.py); what packing made is `packing`.

        device="cuda" (or "cuda:N"): the model on an NVIDIA GPU, on the torch runner (runtime/torch_runner.py): the
        weights moved there once, the KV cache and every activation there, float32, bfloat16 or float16 matrices
        (dtype), decode steps replayed as CUDA graphs. runner: "native" (the CPU's default: the engine's own kernels)
        or "torch" (the default on a GPU; on the CPU, the same runner the GPU runs, on torch's CPU kernels).
        """
        if not isinstance(directory, (str, Path)):
            raise GPT2EngineError(f"directory: expected a checkpoint's path (or \"demo\"), got {type(directory).__name__}")
        directory, _ = weights_directory(Path(directory))
        device, runner = check_device(device, runner)
        dtype = parse_dtype(dtype, runner)
        check_load_options(dtype, quantize, device, runner, weight_layout)
        config, converted = read_config(directory)
        # the tokenizer first: it is quick to check, and its load's transient peak then sits below the weights'
        tokenizer = checked_tokenizer(directory, config, converted is not None)
        # the adapter read and checked before the weights: a bad adapter fails fast
        adapter = None if lora is None else read_adapter(Path(lora), config, directory, force)
        if runner == "torch":
            weights = device_weights(directory, config, converted, adapter, device, dtype)
            return cls(config, weights, tokenizer, dtype=dtype, device=device, lora=adapter, source=directory,
                       runner=runner)
        weights, packing = native_weights(directory, config, converted, dtype, quantize, weight_layout)
        if adapter is not None:
            weights = attach(weights, [adapter])
        return cls(config, weights, tokenizer, dtype=dtype, device=device, quantize=quantize, lora=adapter,
                   source=directory, packing=packing)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, V] (float32) for a LongTensor of token ids [B, T]."""
        return self.forward(ids)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, hidden_states: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Logits [B, T, V]; if `hidden_states` is a list, the output of each block is appended to it."""
        self.check_ids(ids)
        return forward(self.weights, self.config, ids.to(self.device), hidden_states=hidden_states)

    @torch.inference_mode()
    def run_with_cache(self, ids: torch.Tensor, names: NameFilter = None, *,
                       attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, ActivationCache]:
        """(logits [B, T, V], cache): the activations at every hook point `names` selects (a list of names or a
        predicate; None: all), named as in TransformerLens (interp/hooks.py). The logits are model(ids)'s bits.

        attention_mask [B, T] (1 for a token, 0 for padding) runs a left-padded batch: each row's positions count
        its own tokens only and no token attends to padding, so a row's activations equal its prompt's alone.
        """
        recorder = Recorder(name_predicate(names, self.config))
        logits = self.run_with_hooks(ids, {}, attention_mask=attention_mask, recorder=recorder)
        return logits, ActivationCache(recorder.activations, self, ids, attention_mask)

    @torch.inference_mode()
    def run_with_hooks(self, ids: torch.Tensor, hooks: dict[str, Hook], *, attention_mask: torch.Tensor | None = None,
                       recorder: Recorder | None = None) -> torch.Tensor:
        """Logits [B, T, V] with `hooks` {name: fn(activation, name)} applied during the forward: a function that
        returns a tensor replaces the activation there (patching, ablation); one that returns None only looks."""
        self.check_ids(ids)
        recorder = recorder or Recorder()
        name_predicate(list(hooks), self.config)  # a hook on a misspelt point would silently never run
        if (bad := next((name for name, fn in hooks.items() if not callable(fn)), None)) is not None:
            raise GPT2EngineError(f"hook on {bad}: expected a function fn(activation, name), got "
                                  f"{type(hooks[bad]).__name__}")
        recorder.hooks = hooks
        positions, key_mask = None, None
        if attention_mask is not None:
            check_attention_mask(attention_mask, ids)
            key_mask = attention_mask.to(self.device).bool()  # [B, T]
            positions = (key_mask.long().cumsum(-1) - 1).clamp(min=0)  # [B, T]: a left-padded row starts at position 0
        return forward(self.weights, self.config, ids.to(self.device), positions=positions, key_mask=key_mask, tap=recorder)

    @torch.inference_mode()
    def run_with_saes(self, ids: torch.Tensor, saes: SAE | Sequence[SAE], *, use_error_term: bool = False,
                      attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, V] with each SAE's reconstruction in place of the activation at its hook (SAELens's
        HookedSAETransformer.run_with_saes). use_error_term=True adds the reconstruction error back, so the logits
        are the plain model's while the SAE's features are computed (and can be cached, or edited by hooks)."""
        return self.run_with_cache_with_saes(ids, saes, use_error_term=use_error_term, names=[],
                                             attention_mask=attention_mask)[0]

    @torch.inference_mode()
    def run_with_cache_with_saes(self, ids: torch.Tensor, saes: SAE | Sequence[SAE], *, use_error_term: bool = False,
                                 names: NameFilter = None, attention_mask: torch.Tensor | None = None
                                 ) -> tuple[torch.Tensor, ActivationCache]:
        """(logits, cache) with the SAEs spliced in: the cache holds the model's hook points `names` selects and,
        by SAELens's names, each SAE's `{hook}.hook_sae_input`, `.hook_sae_acts_pre`, `.hook_sae_acts_post`,
        `.hook_sae_recons`, `.hook_sae_error` (with the error term) and `.hook_sae_output`. Those are in the space
        the SAE was trained in (its model options: interp/sae.py); the model's own points are the engine's."""
        saes = [sae.to(self.device) for sae in check_saes(saes, self.config)]
        extra = set(sae_point_names(saes))
        if names is None or callable(names):
            wanted = name_predicate(names, self.config)
        else:
            listed = [names] if isinstance(names, str) else list(names)
            model_points = name_predicate([n for n in listed if n not in extra], self.config)
            chosen = {n for n in listed if n in extra}
            wanted = lambda n: n in chosen or model_points(n)  # noqa: E731
        spliced = {sae.hook_name: Spliced(sae, self.weights, self.config, use_error_term, wanted) for sae in saes}
        recorder = Recorder(wanted)
        logits = self.run_with_hooks(ids, dict(spliced), attention_mask=attention_mask, recorder=recorder)
        for s in spliced.values():
            recorder.activations.update(s.seen)
        return logits, ActivationCache(recorder.activations, self, ids, attention_mask)

    @torch.inference_mode()
    def evaluate_sae(self, sae: SAE, ids: torch.Tensor, *, batch_size: int = 8,
                     progress: Callable[[int], None] | None = None) -> dict[str, Any]:
        """SAELens's eval metrics for `sae` over the windows ids [N, T], every token and next-token prediction:
        mse, explained_variance, l0, l1, cossim, ce_loss_without_sae / with_sae / with_ablation (the hook zeroed),
        ce_loss_score, kl_div_with_sae / with_ablation, kl_div_score, feature_density (per feature) and tokens.
        Three passes per batch: plain, spliced and ablated. `progress(n)` is told each batch's window count."""
        sae = check_saes(sae, self.config)[0].to(self.device)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:  # -1 ran no batch
            raise GPT2EngineError(f"batch_size: expected a positive integer, got {batch_size!r}")
        self.check_ids(ids, whole=False)  # run batch_size windows at a time: checked below
        check_batch_fits(min(batch_size, ids.shape[0]), ids.shape[-1], self.config, extra_per_token=3 * sae.d_sae)
        metrics = SAEMetrics(sae.d_in, sae.d_sae)
        keep = {f"{sae.hook_name}.{p}" for p in ("hook_sae_input", "hook_sae_acts_post", "hook_sae_output")}
        for i in range(0, ids.shape[0], batch_size):
            batch = ids[i : i + batch_size].to(self.device)
            plain = self.run_with_hooks(batch, {})
            spliced = Spliced(sae, self.weights, self.config, record=keep.__contains__)
            with_sae = self.run_with_hooks(batch, {sae.hook_name: spliced})
            seen = {k.rsplit(".", 1)[1]: v for k, v in spliced.seen.items()}
            ablated = self.run_with_hooks(batch, {sae.hook_name: Spliced(sae, self.weights, self.config,
                                                                         replace=torch.zeros_like)})
            x = seen["hook_sae_input"]
            metrics.add_tokens(x.reshape(-1, x.shape[-1]), seen["hook_sae_output"].reshape(-1, x.shape[-1]),
                               seen["hook_sae_acts_post"].reshape(-1, sae.d_sae))
            metrics.add_logits(batch, plain, with_sae, ablated)
            if progress is not None:
                progress(batch.shape[0])
        return metrics.result()

    @torch.inference_mode()
    def token_logprobs(self, ids: torch.Tensor, *, steering: Sequence[Steering] = ()) -> torch.Tensor:
        """[B, T] ids -> [B, T-1]: the log-probability of each next token given the ones before it; `steering`:
        edits on every position (Steering)."""
        self.check_ids(ids)
        if ids.shape[1] < 2:
            raise GPT2EngineError(f"ids: need at least 2 tokens to score a next token, got shape {list(ids.shape)}")
        return token_logprobs(self.weights, self.config, ids.to(self.device), check_steering(steering, self.config))

    def score(self, texts: Sequence[str], *, context: int | None = None, stride: int | None = None,
              bos: bool = True, batch_size: int = 8, prefix_cache_mb: float | None = None,
              steering: Sequence[Steering] = ()) -> list[Score]:
        """Score each text on its own (tokens, nll, ppl, bpb), in sliding windows; see runtime/scoring.py.
        `prefix_cache_mb`: texts that start alike (a shared preamble) reuse its keys and values (runtime/prefix.py);
        `steering`: edits on every position (Steering), as lm-eval's steered model scores."""
        if isinstance(texts, str):
            raise GPT2EngineError("texts: expected a list of strings, got one string (wrap it in a list)")
        if isinstance(texts, (Mapping, set, frozenset, bytes)):  # a dict would score its keys, a set in no order
            raise GPT2EngineError(f"texts: expected a list of strings, got a {type(texts).__name__}")
        context = context if context is not None else self.config.n_positions
        stride = stride if stride is not None else context // 2
        settings = ScoreSettings(context, stride, bos=bos, batch_size=batch_size, prefix_cache_mb=prefix_cache_mb,
                                 steering=check_steering(steering, self.config))
        return list(self.score_documents([(f"text{i}", t) for i, t in enumerate(texts)], settings))

    def score_documents(self, docs: Sequence[tuple[str, str]], settings: ScoreSettings,
                        progress: Callable[[int], Any] | None = None) -> Iterator[Score]:
        """Score (name, text) documents with explicit settings, in input order; `progress(n)` is told of every n
        tokens scored (gpt2 score and its Ray workers run this)."""
        for name, text in docs:
            if not isinstance(text, str):
                raise GPT2EngineError(f"{name}: expected the document's text as a string, got {type(text).__name__}")
        encoded = [(name, self.tokenizer.encode(text), len(text.encode("utf-8"))) for name, text in docs]
        return score_documents(self.weights, self.config, self.tokenizer.eot_id, encoded, settings, progress=progress)

    # --- generation: keyword arguments are GenerationSettings' and SamplingParams' fields ---------------------

    def settings(self, **kwargs: Any) -> GenerationSettings:
        """GenerationSettings from keyword arguments (max_new_tokens, temperature, top_k, top_p, seed, stop, ...)."""
        sampling_keys = {"temperature", "top_k", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                         "logit_bias"}
        allowed = sampling_keys | (set(GenerationSettings.__dataclass_fields__) - {"sampling"})
        if unknown := set(kwargs) - allowed:
            raise GenerationError(f"unknown generation option(s): {', '.join(sorted(unknown))}; expected {', '.join(sorted(allowed))}")
        sampling = SamplingParams(**{k: kwargs.pop(k) for k in sampling_keys & set(kwargs)})
        return GenerationSettings(sampling=sampling, **kwargs)

    def generation(self, prompt: Prompt, *, allow_special: bool = False, settings: GenerationSettings | None = None,
                   speculate: str | Path | None = None, draft_tokens: int | None = None, **kwargs: Any) -> Generation:
        """A generation run (iterate it to stream) over a prompt in any of the server's forms: a text, texts, token
        ids or lists of them; the settings as keyword arguments, or made already. `gpt2 generate` runs this.

        speculate: speculative decoding with a drafter: 'int4' or 'int8' (this model quantized), 'ngram' (prompt
        lookup) or a GPT-2 checkpoint directory with this tokenizer; draft_tokens: K, drafted tokens per verify
        pass (default: adaptive). Greedy output is the same token ids as without; sampled output has the same
        distribution (runtime/speculation.py). Loaded once per source and kept."""
        if settings is not None and kwargs:
            raise GenerationError("give settings= or keyword settings, not both")
        ids = encode_prompts(prompt, self.tokenizer, allow_special=allow_special)
        settings = settings or self.settings(**kwargs)
        spec = None
        if speculate is not None:
            spec = self.speculation(speculate, draft_tokens)
        elif draft_tokens is not None:
            raise GenerationError("draft_tokens applies to speculative decoding: give speculate= too", param="draft_tokens")
        return Generation(self.weights, self.config, self.tokenizer, ids, settings, spec,
                          grammars=self.grammars if settings.constraint is not None else None, runner=self.runner)

    @property
    def grammars(self) -> Grammars:
        """The compiler of structured-output constraints for this tokenizer, with its cache of compiled grammars."""
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.config.vocab_size)
        return self._grammars

    def speculation(self, source: str | Path, draft_tokens: int | None = None, max_running: int | None = None,
                    settle: int = 0) -> Speculation:
        """The Speculation of a drafter source (see generation()), its draft model loaded once per source;
        `max_running` and `settle`: Speculation's (the server's policy)."""
        check_draft_tokens(draft_tokens)
        key = str(source)
        if self.runner_kind == "torch" and key != "ngram":
            raise GenerationError(f"speculate={key!r}: a draft model runs on the native CPU runner; on the torch "
                                  f"runner (device={str(self.device)!r}) only 'ngram' (prompt lookup) drafts",
                                  param="speculate")
        if key not in self.drafts:
            self.drafts[key] = load_speculation(key, self.weights, self.config, self.tokenizer)
        return replace(self.drafts[key], policy=SpeculationPolicy(draft_tokens, max_running, settle))

    def complete(self, prompts: Prompt, *, allow_special: bool = False, **kwargs: Any) -> list[Completion]:
        """Completions (text, ids, logprobs, finish reason) for a batch of prompts; num_samples per prompt."""
        return self.generation(prompts, allow_special=allow_special, **kwargs).run()

    def generate(self, prompt: str | Sequence[str], **kwargs: Any) -> str | list[str]:
        """The generated text (without the prompt); a list for a list of prompts or num_samples > 1."""
        single = isinstance(prompt, str)
        completions = self.complete([prompt] if single else prompt, **kwargs)  # anything else: complete() says what
        texts = [c.text for c in completions]
        return texts[0] if single and len(texts) == 1 else texts

    def stream(self, prompt: str, *, allow_special: bool = False, **kwargs: Any) -> Iterator[str]:
        """The generated text of one prompt, piece by piece as it is produced (whole UTF-8 characters only)."""
        if not isinstance(prompt, str):
            raise GenerationError(f"prompt must be a string, got {type(prompt).__name__}", param="prompt")
        run = self.generation(prompt, allow_special=allow_special, **kwargs)
        if run.settings.num_samples != 1:
            raise GenerationError("stream() generates one sample; use complete() for num_samples > 1")
        for _, piece in run:
            yield piece

    def generate_ids(self, ids: Sequence[int], **kwargs: Any) -> list[int]:
        """The generated token ids (without the prompt) for a prompt given as token ids."""
        return self.generation([list(ids)], **kwargs).run()[0].token_ids

    def finetune(self, texts_or_paths: Sequence[str | Path], *, val: Sequence[str | Path] | None = None,
                 out: str | Path | None = None, resume: bool = False, overwrite: bool = False,
                 lora: LoraSettings | int | None = None, **settings: Any) -> TrainResult:
        """Fine-tune this model on texts (strings) or files (Paths: text, .jsonl, folders) with the engine's own
        backward and AdamW; afterwards the model holds the trained weights. `settings` are TrainSettings' fields
        (steps, epochs, lr, batch_size, context, ...); `out`: checkpoints as `gpt2 finetune --out` writes them
        (None: none). `lora` (a rank, or LoraSettings): train a LoRA adapter on the frozen weights instead, float32
        or quantized (QLoRA); afterwards the model carries it (model.lora). Same code as `gpt2 finetune`."""
        lora = self._trainable(lora)
        weights = self.weights if lora is not None else trainable_copy(self.weights, self.config)
        # the base, as gpt2 finetune records it: for the resume check, and in an adapter's files
        fingerprint = weights_fingerprint(self.source) if self.source is not None and self.lora is None else ""
        base = fingerprint + (f":{self.quantize}" if fingerprint and self.quantize else "")
        trainer = Trainer(weights, self.config, self.tokenizer, training_texts(texts_or_paths), train_settings(settings),
                          val_texts=None if val is None else training_texts(val),
                          base=Base(base, lora, str(self.source.resolve()) if lora and self.source else "",
                                    fingerprint if lora else ""),
                          output=Output(None if out is None else Path(out), resume, overwrite),
                          sampler=functools.partial(two_samples, config=self.config, tokenizer=self.tokenizer))
        history = []
        for event in trainer.run():
            if isinstance(event, Started) and event.warning:
                warnings.warn(event.warning, stacklevel=2)
            history.append(record(event))
        self.weights = trainer.weights
        if lora is not None:
            self.lora = trainer.adapter()
        else:
            self.source = None  # the weights are no longer the directory's
        return trainer.result(history)

    def _trainable(self, lora: LoraSettings | int | None) -> LoraSettings | None:
        """finetune's checks of what this model can train (full weights: float32; an adapter: float32 or quantized,
        none already attached); the adapter's settings."""
        if self.runner_kind == "torch":
            raise GPT2EngineError(f"finetune trains with the engine's CPU backward and optimizer; load the model on "
                                  f"the native CPU runner (not device={str(self.device)!r} / runner='torch') to train")
        if lora is not None:
            if self.lora is not None:
                raise GPT2EngineError("finetune(lora=...): the model already carries an adapter; load the base "
                                      "without lora= to train a new one")
            if self.dtype != torch.float32:
                raise GPT2EngineError("finetune(lora=...) trains on a float32 or quantized base, not bfloat16")
            return LoraSettings(r=lora) if isinstance(lora, int) else lora
        if self.quantize or self.dtype != torch.float32:
            raise GPT2EngineError("finetune trains float32 weights; load the model without quantize= or dtype= (or "
                                  "train a LoRA adapter on it: lora=R)")
        return None

    def check_ids(self, ids: torch.Tensor, whole: bool = True) -> None:
        """Raise GPT2EngineError unless `ids` is a [B, T] integer tensor of valid tokens that fits the context, and
        (`whole`: run in one pass) whose activations and logits fit in memory."""
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
            what = f"{ids.dtype} tensor of shape {list(ids.shape)}" if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise GPT2EngineError(f"ids: expected an integer tensor of shape [B, T], got {what}")
        if ids.layout != torch.strided or ids.device.type == "meta":  # sparse ids, or ids without values
            kind = "meta" if ids.device.type == "meta" else str(ids.layout).removeprefix("torch.")
            raise GPT2EngineError(f"ids: expected a dense tensor of token ids, got a {kind} one")
        B, T = ids.shape
        if B == 0 or T == 0:
            raise GPT2EngineError(f"ids: expected at least one token, got shape [{B}, {T}]")
        if T > self.config.n_positions:
            raise GPT2EngineError(f"ids: {T} tokens exceed the context length {self.config.n_positions}")
        if whole:
            check_batch_fits(B, T, self.config, extra_per_token=self.config.vocab_size, ids=True)  # and the logits
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.config.vocab_size:
            bad = lo if lo < 0 else hi
            raise GPT2EngineError(f"ids: token id {bad} is outside the vocabulary [0, {self.config.vocab_size})")


def check_attention_mask(mask: torch.Tensor, ids: torch.Tensor) -> None:
    """Raise GPT2EngineError unless `mask` is a [B, T] tensor like `ids` of 0s then 1s in each row (left padding, at
    least one token): a hole or a row of padding alone has no meaning in the forward, and would run silently."""
    if not isinstance(mask, torch.Tensor) or mask.layout != torch.strided or mask.device.type == "meta":
        what = type(mask).__name__ if not isinstance(mask, torch.Tensor) else f"{str(mask.layout).removeprefix('torch.')}" \
            f"{' meta' if mask.device.type == 'meta' else ''} tensor"
        raise GPT2EngineError(f"attention_mask: expected a dense tensor of 0s and 1s, got {what}")
    if mask.shape != ids.shape:
        raise GPT2EngineError(f"attention_mask: expected shape {list(ids.shape)} like ids, got {list(mask.shape)}")
    m = mask.detach().cpu()
    if m.is_complex() or not bool(((m == 0) | (m == 1)).all()):  # NaN, 0.5 or 2 would each mean something else
        raise GPT2EngineError("attention_mask: expected only 0s and 1s (1 for a token, 0 for padding)")
    m = m.to(torch.int8)  # [B, T]
    bad = (m[:, -1] == 0) | (m[:, 1:] < m[:, :-1]).any(dim=1)  # [B]: a row ending in padding, or with a hole
    if bool(bad.any()):
        row = int(bad.nonzero()[0])
        raise GPT2EngineError(f"attention_mask: row {row} is {m[row].tolist()[:16]}{'...' if m.shape[1] > 16 else ''}"
                              f"; expected left padding: 0s, then 1s up to the last position")


# --- from_pretrained's steps ------------------------------------------------------------------------------------

def check_load_options(dtype: torch.dtype, quantize: str | None, device: torch.device, runner: str,
                       weight_layout: str) -> None:
    """The load options that cannot go together, before anything is read: an unknown quantize format, quantizing
    other than float32 weights or for the torch runner, an unknown weight layout, packed weights on the torch runner."""
    if quantize not in (None, *FORMATS):
        raise GPT2EngineError(f"quantize: expected None, 'int8' or 'int4', got {quantize!r}")
    if quantize and dtype != torch.float32:
        raise GPT2EngineError(f"quantize={quantize!r} quantizes the float32 weights; do not combine it with "
                              f"dtype={str(dtype).removeprefix('torch.')}")
    if quantize and runner == "torch":
        raise GPT2EngineError(f"quantize={quantize!r} runs on the native CPU runner's int8/int4 kernels, which the "
                              f"torch runner (device={str(device)!r}) does not have; there, use "
                              "dtype='bfloat16' or 'float16'")
    check_layout(weight_layout)
    if weight_layout == "packed" and runner == "torch":
        raise LayoutError("weight_layout 'packed' is read by the native CPU runner's kernels; the torch runner "
                          f"(device={str(device)!r}) keeps plain matrices (leave weight_layout out, or give 'plain')")


def read_config(directory: Path) -> tuple[GPT2Config, dict[str, torch.Tensor] | None]:
    """(the config, None) of an official-format directory; (its config, its tensors by official name) of a nanoGPT or
    llm.c checkpoint file (formats/checkpoints.py), told apart by content."""
    if directory.is_file():
        return read_checkpoint(directory)
    find_weights_file(directory)  # a missing path or no weights: the loader's error, before the config's
    return GPT2Config.from_json(directory / CONFIG), None


def checked_tokenizer(directory: Path, config: GPT2Config, converted: bool) -> Tokenizer:
    """The checkpoint's tokenizer (GPT-2's own BPE for a converted checkpoint file), no larger than its vocabulary."""
    tokenizer = load_tokenizer(None if converted else directory)
    if tokenizer.n_vocab > config.vocab_size:
        raise WeightsError(f"{directory}: tokenizer has {tokenizer.n_vocab} tokens, more than vocab_size "
                           f"{config.vocab_size}")
    return tokenizer


def read_adapter(lora: Path, config: GPT2Config, directory: Path, force: bool) -> LoraAdapter:
    """The LoRA adapter in `lora`, checked against the config and (unless `force`) against the base it records."""
    adapter = load_adapter(lora, config)
    if not force:
        check_base(adapter, lora, directory)
    return adapter


def device_weights(directory: Path, config: GPT2Config, converted: dict[str, torch.Tensor] | None,
                   adapter: LoraAdapter | None, device: torch.device, dtype: torch.dtype) -> GPT2Weights:
    """The weights as the torch runner keeps them: the float32 file read, the adapter attached, then moved once."""
    if converted is not None:
        weights = weights_from_tensors(converted, config, directory)
    else:
        weights = load_weights(directory, config)
    if adapter is not None:
        weights = attach(weights, [adapter])
    weights = on_device(weights, device, dtype)
    warn_tf32(device, dtype)
    return weights


def native_weights(directory: Path, config: GPT2Config, converted: dict[str, torch.Tensor] | None, dtype: torch.dtype,
                   quantize: str | None, weight_layout: str) -> tuple[GPT2Weights, Packing | None]:
    """The weights as the native CPU runner keeps them, and what packing their exponents made (None: not packed).

    Quantizing or converting to bf16: the float32 pages of the file are not kept resident (released as read). Float32
    read in place stays in the file, but for what is made from it. Packed exponents (core/packing.py) where asked or
    measured faster: from float32 read in place (its matrices stay beside the units for GEMMs at no memory of the
    process's own) or bfloat16, never quantized. Otherwise the projections in panels where this CPU reads them faster
    (kernels.CPU.panels): bfloat16 ones always, float32 ones where read in place and not about to be quantized."""
    file = None if converted is not None else find_weights_file(directory)
    in_place = file is not None and not quantize and dtype == torch.float32
    packed = use_packed(weight_layout, dtype, not quantize and (dtype == torch.bfloat16 or in_place), config)
    panels = cpu().panels and (dtype == torch.bfloat16 or in_place) and not packed
    # the panels are written straight onto huge pages (core/pages.py), not made and then moved
    arena = HugeArena(panel_bytes(config, dtype)) if panels and huge_pages_available() else None
    weights = read_native(directory, config, converted, dtype, quantize, file, panels, arena)
    if packed:  # the units go onto huge pages as they are written (packing.pack_weights)
        return pack_weights(weights, config, file_mapping(weights.wte, file) if in_place else None)
    # what the loader made onto huge pages (core/pages.py); float32 read in place stays in the file but for the
    # panels made from it and the head
    if not in_place:
        matrices_on_huge_pages(weights, arena=arena)
    elif panels:
        matrices_on_huge_pages(weights, file, arena)
    return weights, None


def read_native(directory: Path, config: GPT2Config, converted: dict[str, torch.Tensor] | None, dtype: torch.dtype,
                quantize: str | None, file: Path | None, panels: bool, arena: HugeArena | None) -> GPT2Weights:
    """The weights read (or made from a converted checkpoint's tensors) in `dtype`, panels written into `arena`,
    quantized where asked; float32 read in place (`file`, not quantized) stays resident in the file."""
    alloc = None if arena is None else arena.take
    if converted is not None:
        weights = weights_from_tensors(converted, config, directory, dtype, panels=panels, alloc=alloc)
    else:
        in_place = file is not None and not quantize and dtype == torch.float32
        weights = load_weights(directory, config, dtype, resident=in_place, panels=panels, alloc=alloc)
    return quantize_weights(weights, quantize, file) if quantize else weights


def parse_dtype(dtype: torch.dtype | str, runner: str = "native") -> torch.dtype:
    """torch.float32 / torch.bfloat16 (and torch.float16 on the torch runner), or their names."""
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if isinstance(dtype, str):
        if dtype not in names:
            raise GPT2EngineError(f"dtype: expected one of {', '.join(names)}, got {dtype!r}")
        dtype = names[dtype]
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise GPT2EngineError(f"dtype: expected torch.float32, torch.bfloat16 or torch.float16, got {dtype}")
    if dtype == torch.float16 and runner != "torch":
        raise GPT2EngineError("dtype float16 runs on the torch runner (device='cuda', or runner='torch' on the CPU); "
                              "the native CPU runner reads float32 and bfloat16")
    return dtype


def check_device(device: torch.device | str, runner: str | None) -> tuple[torch.device, str]:
    """(the device, the runner): 'cpu' with the native runner unless runner='torch'; 'cuda' with the torch runner,
    where torch sees a CUDA GPU."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise GPT2EngineError(f"device: expected 'cpu' or 'cuda' (or 'cuda:N'), got {device!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise GPT2EngineError(f"device: expected 'cpu' or 'cuda' (or 'cuda:N'), got {str(device)!r}")
    if runner not in (None, "native", "torch"):
        raise GPT2EngineError(f"runner: expected 'native' or 'torch', got {runner!r}")
    if device.type == "cuda":
        if runner == "native":
            raise GPT2EngineError("runner 'native' is the engine's CPU kernels; on a GPU the model runs on the torch "
                                  "runner (leave runner out, or give runner='torch')")
        if not torch.cuda.is_available():
            raise GPT2EngineError(f"device {str(device)!r}: torch {torch.__version__} sees no CUDA GPU "
                                  "(torch.cuda.is_available() is False)")
        if (device.index or 0) >= torch.cuda.device_count():
            raise GPT2EngineError(f"device {str(device)!r}: there are {torch.cuda.device_count()} CUDA device(s)")
        return device, "torch"
    return device, runner or "native"


def warn_tf32(device: torch.device, dtype: torch.dtype) -> None:
    """One warning where float32 matmuls on a GPU would round their inputs to TF32 (torch's setting; off by
    default), which moves the logits ~1e-3 away from float32's."""
    if device.type == "cuda" and dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        warnings.warn("torch.backends.cuda.matmul.allow_tf32 is on: float32 matmuls round their inputs to TF32 "
                      "(10-bit mantissas), so the logits are not float32's; set it to False for float32 parity",
                      stacklevel=3)


def training_texts(items: Sequence[str | Path]) -> list[str]:
    """finetune's texts: strings as they are, Paths read as documents (text, .jsonl, folders)."""
    if isinstance(items, (str, Path)):
        raise GPT2EngineError("texts_or_paths: expected a list of texts or paths, got one (wrap it in a list)")
    found = []
    for item in items:
        if isinstance(item, Path):
            found += [text for _, text in read_documents(expand_paths([str(item)]), sys.stdin.buffer)]
        elif isinstance(item, str):
            found.append(item)
        else:
            raise GPT2EngineError(f"texts_or_paths: expected str or Path items, got {type(item).__name__}")
    return found
