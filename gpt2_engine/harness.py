"""The engine as a model of EleutherAI's lm-evaluation-harness: `EngineLM`, an `lm_eval` LM that `gpt2 eval` hands to
`lm_eval.simple_evaluate` (this module needs the `[eval]` extra: `pip install 'gpt2-engine[eval]'`).

It does what lm-eval's own `hf` model does, request for request, so that the metrics are the same:
- loglikelihood: context and continuation tokenized by lm-eval's TemplateLM (its trailing-space rule), the input
  (context + continuation)[-(max_length + 1):][:-1] as hf truncates it, and the continuation's log-probability and
  whether greedy decoding would produce it (every continuation token the argmax);
- loglikelihood_rolling: lm-eval's disjoint rolling windows of max_length tokens after <|endoftext|>;
- generate_until: the context's last max_length - max_gen_toks tokens, greedy unless the task samples, cut at the
  first stop string (lm-eval's postprocessing).

Where it differs is the work done. Loglikelihood requests run one prompt at a time through the prefix cache
(runtime/prefix.py), sorted so that requests sharing a context (a multiple-choice question's choices, a few-shot
preamble) come together: a context's whole blocks run once, and each continuation runs only the rest.
Generations run through the engine loop, continuously batched in `slots` sequences.
"""

from __future__ import annotations

from typing import Any

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from .api import GPT2
from .core.errors import GenerationError
from .core.model import KVCache
from .interp.spec import Steering, check_steering
from .interp.steering import check_scoring
from .runtime.generate import Generation
from .runtime.prefix import DEFAULT_CAPACITY_MB, PrefixCache, prefill
from .runtime.requests import GenerationSettings
from .runtime.sampling import SamplingParams

GENERATION_KWARGS = "until, max_gen_toks (or max_new_tokens), do_sample, temperature, top_p, top_k, num_beams 1"

MAX_GEN_TOKS = 256  # lm-eval's default for generate_until tasks that set none (hf's max_gen_toks)
SLOTS = 8  # sequences generated together


def stop_sequences(until: Any, eos: str) -> list[str]:
    """A task's `until` (a string or a list of strings) as lm-eval's hf model takes it, eos among them."""
    if not (until is None or isinstance(until, str) or
            isinstance(until, list) and all(isinstance(s, str) for s in until)):
        raise GenerationError(f"until is {until!r:.60}; expected a string or a list of strings")
    return handle_stop_sequences(until, eos=eos)


def sampling_params(gen_kwargs: dict[str, Any]) -> SamplingParams:
    """The sampling keys of a task's generation kwargs (taken out of it), as hf reads them: greedy unless do_sample
    or a temperature says otherwise; one beam only."""
    if gen_kwargs.pop("num_beams", 1) != 1:
        raise GenerationError("num_beams other than 1; the engine does not run beam search")
    do_sample = gen_kwargs.pop("do_sample", None)
    if do_sample not in (None, True, False):
        raise GenerationError(f"do_sample is {do_sample!r:.60}; expected true or false")
    temperature = gen_kwargs.pop("temperature", 0.0)
    if do_sample is False or (do_sample is None and temperature == 0.0):
        temperature = 0.0
    return SamplingParams(temperature=temperature, top_p=gen_kwargs.pop("top_p", 1.0),
                          top_k=gen_kwargs.pop("top_k", 0) or 0)


class EngineLM(TemplateLM):
    """A loaded GPT2 as an lm-eval model (see the module docstring). `prefix_cache_mb` None: no prefix cache."""

    def __init__(self, model: GPT2, *, prefix_cache_mb: float | None = DEFAULT_CAPACITY_MB, slots: int = SLOTS,
                 seed: int = 1234, steering: tuple[Steering, ...] = ()) -> None:
        """`steering`: edits on every position of every request (lm-eval's steered model; `gpt2 eval --steer`)."""
        super().__init__()
        self.model, self.slots, self.seed = model, slots, seed
        self.steering = check_steering(steering, model.config)
        self.max_length = model.config.n_positions
        self.max_gen_toks = MAX_GEN_TOKS
        self.prefix = None if prefix_cache_mb is None else PrefixCache(model.config, prefix_cache_mb)
        self.view = KVCache.allocate(model.config, 1, self.max_length)  # [n_layer, 1, nh, L, hs]

    # --- what TemplateLM needs ----------------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.model.tokenizer.eot_id

    @property
    def tokenizer_name(self) -> str:
        return "gpt2"

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        # <|endoftext|> in a text is the special token, as hf's GPT-2 tokenizer reads it; GPT-2 adds no others
        return self.model.tokenizer.encode(string, allow_special=True)

    def tok_decode(self, tokens: list[int]) -> str:
        return self.model.tokenizer.decode(tokens)

    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        """(cache key, context ids, continuation ids) -> (log p(continuation | context), is it the greedy one)."""
        check_scoring(self.steering)
        order = sorted(range(len(requests)), key=lambda i: requests[i][1] + requests[i][2])  # shared contexts together
        results: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
        for i in tqdm(order, desc="loglikelihood", disable=disable_tqdm):
            key, context, continuation = requests[i]
            results[i] = self._continuation(context, continuation)
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, results[i])
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood, summed over lm-eval's disjoint windows of max_length tokens."""
        windows, owners = [], []
        for n, (string,) in enumerate(req.args for req in requests):
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owners.append(n)
        totals = [0.0] * len(requests)
        for n, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)):
            totals[n] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Each (context, gen_kwargs) request's generation, cut at its stop strings; requests with the same
        generation settings run together in the engine loop."""
        eos = self.tok_decode([self.eot_token_id])
        groups: dict[tuple, list[int]] = {}
        plans = []
        for n, req in enumerate(requests):
            context, gen_kwargs = req.args
            settings, until = self._settings(dict(gen_kwargs), eos, getattr(req, "task_name", None))
            plans.append((context, settings, until))
            groups.setdefault((settings, tuple(until)), []).append(n)
        results = [""] * len(requests)
        bar = tqdm(total=len(requests), desc="generate_until", disable=disable_tqdm)
        for (settings, until), members in groups.items():
            room = self.max_length - settings.max_new_tokens
            prompts = [self.tok_encode(plans[n][0])[-room:] for n in members]
            run = Generation(self.model.weights, self.model.config, self.model.tokenizer, prompts, settings,
                             slots=self.slots)
            for n, completion in zip(members, run.run()):
                results[n] = postprocess_generated_text(generation=completion.text, stop=list(until),
                                                        think_end_token=None)
                self.cache_hook.add_partial("generate_until", requests[n].args, results[n])
                bar.update(1)
        bar.close()
        return results

    # --- internals ------------------------------------------------------------------------------------------------

    def _continuation(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """One request: the prompt through the prefix cache, scored; the last continuation token from the next-token
        logits (hf feeds every token but the last)."""
        whole = (context + continuation)[-(self.max_length + 1):]
        fed, n = whole[:-1], len(continuation)
        done = prefill(self.model.weights, self.model.config, self.view, fed, scored=True, top=1, prefix=self.prefix,
                       steering=self.steering)
        last = torch.log_softmax(done.logits.double(), -1)  # [V]
        logprob = float(done.stats.logprob[len(fed) - n :].double().sum()) + float(last[whole[-1]])  # targets of cont
        greedy = bool((done.stats.rank[len(fed) - n :] == 0).all()) and int(done.logits.argmax()) == whole[-1]
        return logprob, greedy

    def _settings(self, gen_kwargs: dict[str, Any], eos: str, task: str | None = None) -> tuple[GenerationSettings,
                                                                                               list[str]]:
        """A task's generation kwargs as the engine's settings, and its stop strings (eos among them, as hf's);
        GenerationError, naming the task and the key, for a value of the wrong type or out of range, or an option
        the engine does not run (the value came from the task file, not from a flag)."""
        try:
            return self._read_settings(gen_kwargs, eos)
        except GenerationError as e:
            where = f"task {task!r} generation_kwargs" if task else "the task's generation_kwargs"
            raise GenerationError(f"{where}: {e}", param=e.param) from None

    def _read_settings(self, gen_kwargs: dict[str, Any], eos: str) -> tuple[GenerationSettings, list[str]]:
        """_settings without the task named in its errors."""
        until = stop_sequences(gen_kwargs.pop("until", None), eos)
        given = "max_gen_toks" in gen_kwargs or "max_new_tokens" in gen_kwargs
        max_gen_toks = gen_kwargs.pop("max_gen_toks", self.max_gen_toks)
        max_gen_toks = gen_kwargs.pop("max_new_tokens", max_gen_toks)  # hf's generate takes it over max_gen_toks
        if isinstance(max_gen_toks, bool) or not isinstance(max_gen_toks, int) or max_gen_toks < 1:
            raise GenerationError(f"max_gen_toks is {max_gen_toks!r:.60}; expected a positive integer")
        if given and max_gen_toks >= self.max_length:  # the task's: no room left for the prompt
            raise GenerationError(f"max_gen_toks is {max_gen_toks:,}; expected fewer than the context of "
                                  f"{self.max_length:,} tokens, which the prompt shares")
        sampling = sampling_params(gen_kwargs)
        if gen_kwargs:
            raise GenerationError(f"{', '.join(sorted(gen_kwargs))[:200]}: not run by the engine; expected "
                                  f"{GENERATION_KWARGS}")
        stops = tuple(s for s in until if s != eos)  # <|endoftext|> itself ends a sequence (finish reason eos)
        return GenerationSettings(max_new_tokens=max_gen_toks, sampling=sampling, stop=stops, seed=self.seed,
                                  steering=self.steering), until
