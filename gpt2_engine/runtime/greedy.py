"""Greedy generation with a KV cache: what the runtime does, for one sequence, without batching, sampling, stop
strings or streaming. The third file of the reading path, after core/numpy_ref.py and core/model.py.

    from gpt2_engine import GPT2
    from gpt2_engine.runtime.greedy import greedy

    model = GPT2.from_pretrained("weights")
    ids = greedy(model.weights, model.config, model.tokenizer.encode("Hello, my dog is"), 20)
    print(model.tokenizer.decode(ids))

The prompt runs once through the model and leaves its keys and values in a preallocated cache (`prefill`); each new
token then runs alone at its own position, attending to every cached position before it (`decode_one_token`), so a
step costs one token's work instead of the whole sequence's. gpt-fast splits its generate.py the same way.
"""

from __future__ import annotations

import torch

from ..core.config import GPT2Config
from ..core.model import KVCache, forward
from ..core.weights import GPT2Weights


def prefill(w: GPT2Weights, config: GPT2Config, cache: KVCache, prompt: list[int]) -> torch.Tensor:
    """The prompt's T tokens through the model, their keys and values written at positions [0, T) of `cache`: the
    logits after its last token [V]."""
    logits = forward(w, config, torch.tensor([prompt]), cache=cache, start=0)  # [1, T, V]
    return logits[0, -1]


def decode_one_token(w: GPT2Weights, config: GPT2Config, cache: KVCache, token: int, position: int) -> torch.Tensor:
    """One token at `position`: its key and value written there, its query attending to positions [0, position]:
    the logits after it [V]."""
    logits = forward(w, config, torch.tensor([[token]]), cache=cache, start=position)  # [1, 1, V]
    return logits[0, -1]


@torch.inference_mode()
def greedy(w: GPT2Weights, config: GPT2Config, prompt: list[int], max_new_tokens: int,
           eot: int | None = None) -> list[int]:
    """The argmax continuation of `prompt` (token ids): up to max_new_tokens ids, ending before `eot` if it comes."""
    if not prompt or max_new_tokens < 0 or len(prompt) + max_new_tokens - 1 > config.n_positions:
        raise ValueError(f"greedy: a non-empty prompt and prompt + max_new_tokens - 1 <= {config.n_positions} "
                         f"positions, got {len(prompt)} tokens and max_new_tokens {max_new_tokens}")
    if max_new_tokens == 0:
        return []
    cache = KVCache.allocate(config, 1, len(prompt) + max_new_tokens - 1)  # the last new token is never fed back
    logits = prefill(w, config, cache, prompt)  # [V]
    out: list[int] = []
    for position in range(len(prompt), len(prompt) + max_new_tokens):
        token = int(logits.argmax())  # the first of equal maxima, as the engine's sampler
        if token == eot:
            break
        out.append(token)
        if len(out) == max_new_tokens:
            break
        logits = decode_one_token(w, config, cache, token, position)  # [V]
    return out

# Next: runtime/loop.py, the engine's loop, which does this for many sequences at once: each step it asks the
# scheduler for a plan, has the runner execute it, and hands the results back. (speculative.py is this file's
# speculative twin, gpt-fast's draft-and-verify in one function.)
