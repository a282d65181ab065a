"""lm-eval tasks on local files (`dataset_path: json`), built from the standard library's docstrings: what the tests
and `make bench-eval` run, and the README's example of a task that needs no Hub.

- `rolling`: loglikelihood_rolling over whole docstrings (word and byte perplexity, bits per byte), as wikitext;
- `choice`: multiple choice of 4 endings after a shared context (the context's next words against other
  docstrings' words), as hellaswag;
- `fewshot`: a multiple-choice question after `shots` fixed worked examples (first_n: the same preamble for every
  document, as MMLU's dev examples are);
- `generate`: greedy generate_until a newline, scored by exact match.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from train_fixture import unseen


def _write(directory: Path, name: str, rows: list[dict], yaml: str, train: list[dict] | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    files = f"test: {directory / f'{name}.jsonl'}"
    if train is not None:
        (directory / f"{name}_train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train), encoding="utf-8")
        files += f"\n    train: {directory / f'{name}_train.jsonl'}"
    path = directory / f"{name}.yaml"
    path.write_text(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    {files}\n"
                    f"test_split: test\n{yaml}", encoding="utf-8")
    return path


def words(text: str, lo: int, hi: int) -> str:
    return " ".join(text.split()[lo:hi])


def rolling(directory: Path, docs: int = 6, max_words: int = 200, name: str = "local_rolling") -> Path:
    """Docstrings of at most `max_words` words: one window each for the test checkpoint's 512 positions, because
    lm-eval windows hf at max_length tokens but its API models at max_length - 1, so longer texts would be cut
    differently by the two routes."""
    rows = [{"text": t} for t in unseen() if len(t.split()) <= max_words][:docs]
    return _write(directory, name, rows, """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
""")


def _choices(texts: list[str], context_words: int, rng: random.Random) -> list[dict]:
    rows = []
    for i, t in enumerate(texts):
        others = [texts[(i + k) % len(texts)] for k in (1, 2, 3)]
        right = words(t, context_words, context_words + 6)
        endings = [right] + [words(o, context_words, context_words + 6) for o in others]
        rng.shuffle(endings)
        rows.append({"context": words(t, 0, context_words), "endings": endings, "label": endings.index(right)})
    return rows


CHOICE_YAML = """output_type: multiple_choice
doc_to_text: "{{context}}"
doc_to_choice: "{{endings}}"
doc_to_target: "{{label}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def choice(directory: Path, docs: int = 8, context_words: int = 40, name: str = "local_choice") -> Path:
    texts = [t for t in unseen() if len(t.split()) >= context_words + 6][:docs]
    return _write(directory, name, _choices(texts, context_words, random.Random(0)), CHOICE_YAML)


def long_choice(directory: Path, docs: int = 200, context_tokens: int = 400, ending_tokens: int = 8,
                name: str = "local_long_choice") -> Path:
    """Multiple choice after ~`context_tokens`-token contexts: consecutive windows of the unseen docstrings, each
    followed by its true next tokens or the next tokens of three other windows (make bench-eval's shared contexts)."""
    from gpt2_engine.core.tokenizer import load_tokenizer

    enc = load_tokenizer()
    stream = enc.encode(" ".join(unseen()))
    step = context_tokens + ending_tokens
    texts = [enc.decode(stream[i : i + step]) for i in range(0, len(stream) - step, step)][:docs]
    rows, rng = [], random.Random(2)
    for i, t in enumerate(texts):
        ids = enc.encode(t)
        ending = lambda j: enc.decode(enc.encode(texts[j])[context_tokens:])  # noqa: E731
        endings = [ending(i)] + [ending((i + k) % len(texts)) for k in (1, 2, 3)]
        right = endings[0]
        rng.shuffle(endings)
        rows.append({"context": enc.decode(ids[:context_tokens]), "endings": endings, "label": endings.index(right)})
    return _write(directory, name, rows, CHOICE_YAML)


def fewshot(directory: Path, docs: int = 8, shots: int = 5, context_words: int = 20, name: str = "local_fewshot") -> Path:
    texts = [t for t in unseen() if len(t.split()) >= context_words + 6]
    rng = random.Random(1)
    train, test = _choices(texts[:shots], context_words, rng), _choices(texts[shots : shots + docs], context_words, rng)
    return _write(directory, name, test, CHOICE_YAML + f"""fewshot_split: train
num_fewshot: {shots}
fewshot_delimiter: "\\n\\n"
fewshot_config:
  sampler: first_n
""", train)


def generate(directory: Path, docs: int = 6, context_words: int = 12, name: str = "local_generate") -> Path:
    rows = [{"prompt": words(t, 0, context_words), "target": " " + words(t, context_words, context_words + 3)}
            for t in unseen()[:docs]]
    return _write(directory, name, rows, """output_type: generate_until
doc_to_text: "{{prompt}}"
doc_to_target: "{{target}}"
target_delimiter: ""
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
""")
