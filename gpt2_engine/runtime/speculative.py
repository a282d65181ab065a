"""Speculative greedy decoding for one sequence, as gpt-fast's generate.py writes it: a cheap draft model proposes k
tokens one at a time, the target checks all of them in one pass, and the longest prefix it agrees with is kept,
plus one token of the target's own. For greedy decoding the result is exactly the target's greedy continuation:
every kept token is the target's argmax at its position. The engine's loop does the same for many sequences at once
(scheduler.py plans the verify passes, speculation.py holds the acceptance rule for sampling too, drafters.py the
drafters); this is the whole idea in one function.

Both models run on ModelRunners with one cache slot each (slot 0), so a pass's rows get the same bits however many
share it (runner.py): the target's verify pass gives each row the logits decoding it alone would.

    from gpt2_engine import GPT2
    from gpt2_engine.core.quantize import quantize_weights
    from gpt2_engine.runtime.runner import ModelRunner

    model = GPT2.from_pretrained("weights")
    prompt = model.tokenizer.encode("Hello, my dog is")
    n = len(prompt) + 64 - 1  # positions: the last new token is never fed back
    target = ModelRunner(model.weights, model.config, slots=1, max_len=n)
    draft = ModelRunner(quantize_weights(model.weights, "int4"), model.config, slots=1, max_len=n)
    ids = speculative_greedy(target, draft, prompt, 64, eot=model.tokenizer.eot_id)
"""

from __future__ import annotations

import torch

from .plan import Segment
from .runner import ModelRunner


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """[n, V] -> each row's argmax (the first of equal maxima, as the engine's sampler)."""
    return logits.argmax(dim=-1).tolist()


@torch.inference_mode()
def speculative_greedy(target: ModelRunner, draft: ModelRunner, prompt: list[int], max_new_tokens: int,
                       k: int = 4, eot: int | None = None) -> list[int]:
    """The target's greedy continuation of `prompt`: up to max_new_tokens ids, ending before `eot` if it comes (as
    greedy.py), drafted k tokens at a time by `draft`. Both runners' slot 0 must hold len(prompt) + max_new_tokens - 1
    positions."""
    if not prompt or max_new_tokens < 1 or k < 1:
        raise ValueError(f"speculative_greedy: a prompt, max_new_tokens >= 1 and k >= 1, got {len(prompt)} tokens, "
                         f"max_new_tokens {max_new_tokens}, k {k}")
    out = argmax_rows(target.run([Segment(0, 0, prompt)]))  # the first token, from the prompt's last row
    draft.run([Segment(0, 0, prompt)])  # the draft model's cache holds the prompt too
    pos = len(prompt)  # where out[-1] goes: fed to neither model yet
    while len(out) < max_new_tokens and eot not in out:
        # draft: up to k tokens, each fed back to the draft model in its own pass; never one past the last token
        # asked for, whose row would be fed only to give a token that is not wanted (as the scheduler's limit)
        guesses, token = [], out[-1]
        for i in range(min(k, max_new_tokens - len(out) - 1)):
            token = argmax_rows(draft.run([Segment(0, pos + i, [token])]))[0]
            guesses.append(token)
        # verify: out[-1] and the guesses in one pass of the target, every row's logits
        rows = [out[-1], *guesses]
        truth = argmax_rows(target.run([Segment(0, pos, rows, outputs=len(rows))]))  # [k + 1]
        n = 0
        while n < len(guesses) and guesses[n] == truth[n]:
            n += 1
        out += guesses[:n] + [truth[n]]  # the agreed guesses, then the target's own next token
        if guesses and n == len(guesses):  # all kept: the draft model has not fed its last guess yet
            draft.run([Segment(0, pos + n, [guesses[-1]])])
        pos += n + 1  # keys and values past pos in either cache are stale and get overwritten
    return out[: out.index(eot)] if eot in out else out
