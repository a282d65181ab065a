# gpt2-engine. On a fresh machine: `make generate PROMPT="..."` runs the engine (the demo model where the official
# weights cannot be downloaded), `make test` runs the tests.
# Each target installs what is missing first (a .venv in this directory).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
WEIGHTS ?=
# --weights only when WEIGHTS is given: gpt2's default is weights/, or the demo model while weights/ holds none
WEIGHTS_FLAG := $(if $(WEIGHTS),--weights $(WEIGHTS))
PROMPT ?= Hello, my dog is
ARGS ?=
export PROMPT

.PHONY: install lint test test-long test-fast test-avx2 generate demo weights compare bench bench-serve bench-inspect bench-sae bench-train bench-speculative bench-llamacpp bench-memory bench-eval check-gguf serve fixtures clean

install: $(STAMP)

# The CPU build of torch goes in first: a bare `torch` requirement would pull a multi-GB CUDA build. The package is
# then built against it (--no-build-isolation: an isolated build environment would hold another torch, or none),
# which compiles the native kernels into gpt2_engine/core/kernels/ (setup.py; ninja from the venv runs the compiles
# side by side; numpy spares torch's warning at the build's import), so that no command compiles them on first use.
# Edited kernel sources rebuild them here.
KERNELS := setup.py gpt2_engine/core/kernels/sources.py $(wildcard gpt2_engine/core/kernels/*.cpp)
$(STAMP): pyproject.toml $(KERNELS)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip setuptools
	$(PY) -m pip install --quiet torch==2.13.0 ninja numpy
	@echo "make: installing gpt2-engine and compiling its native kernels (a few minutes) ..."
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pip install --quiet --no-build-isolation -e '.[test]'
	touch $@

# ruff's lint checks, with the project's configuration (pyproject.toml's [tool.ruff]).
lint: install
	$(VENV)/bin/ruff check gpt2_engine tests scripts setup.py

# The suite but its longest reference runs (marked long: make test-long; CI runs both). The test checkpoints are
# built first, outside pytest, so that their progress shows. Two pytest-xdist workers, one torch thread each
# (tests/conftest.py), a test file each at a time: a file's module-scoped servers start once, and the Ray tests never
# start two clusters side by side (worksteal, which splits files, did, and a Serve proxy died).
test: install fixtures
	$(PY) -m pytest -n 2 --dist loadfile -m "not long" $(ARGS)

# The long runs: the quality targets of every format, 1,024-token parity, the ablation, Ray, lm-eval, the soak, the
# runs killed and resumed, the docs' training sessions.
test-long: install fixtures
	$(PY) -m pytest -n 2 --dist loadfile -m long $(ARGS)

# The inner loop: the unit tier, on random checkpoints written in seconds (no trained one is built), without the
# tests marked slow (the serving soak, lm-eval, Ray, the browser, the training runs killed and resumed, the long
# parity sweeps, the hostile-input corpus); see docs/architecture.md's Tests section.
test-fast: install
	$(PY) -m pytest -n 2 --dist loadfile -m "not slow and not trained and not long"

# `make test` as on a CPU with AVX2 only (a Zen 1/Zen 3 EPYC), on any CPU that also has AVX-512: the engine's
# AVX-512, VNNI, BF16 and AMX paths off in pytest's process (tests/conftest.py's --cpu-isa), torch's and oneDNN's
# kernels limited to AVX2 by their own settings in every process. Commands the tests start as processes of their
# own still take this CPU's paths. ARGS="-m long" runs the long tier so.
test-avx2: install fixtures
	ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 $(PY) -m pytest -n 2 --dist loadfile --cpu-isa avx2 -m "not long" $(ARGS)

weights: install
	$(PY) scripts/download_weights.py --dest $(or $(WEIGHTS),weights) $(ARGS)

# Downloads the official weights only when $(WEIGHTS)/ holds none yet; where they cannot be downloaded (offline), it
# says so in one line and uses the demo model (trained once, a few minutes, see `make demo`).
generate: install
	@dir=$$($(PY) scripts/demo.py --weights $(or $(WEIGHTS),weights)) && $(VENV)/bin/gpt2 generate "$$PROMPT" --weights "$$dir" $(ARGS)

# The demo model on purpose: a small GPT-2 trained from scratch by `gpt2 finetune --init` on the standard library's
# docstrings (built once into .cache/demo/), then a generation from it.
demo: install
	@dir=$$($(PY) scripts/demo.py) && $(VENV)/bin/gpt2 generate "$$PROMPT" --weights "$$dir" $(ARGS)

compare: install
	$(VENV)/bin/gpt2 compare $(WEIGHTS_FLAG) $(ARGS)

bench: install
	$(PY) scripts/bench.py $(ARGS)

# ARGS=--lora: clients spread over 4 LoRA adapters against an adapter-free server; ARGS="--speculate int4 --weights
# trained --clients 1,8": a server with speculative decoding against one without.
bench-serve: install
	$(PY) scripts/bench_serve.py $(ARGS)

# SAE feature dashboards against SAELens + TransformerLens doing the same work (about 5 minutes).
bench-sae: install
	$(PY) scripts/bench_sae.py $(ARGS)

bench-inspect: install
	$(PY) scripts/bench_inspect.py $(ARGS)

# lm-eval's requests through gpt2 serve with and without the prefix cache, and gpt2 eval against lm_eval --model hf,
# on local 400-token multiple-choice and 5-shot tasks (about 15 minutes).
bench-eval: install
	$(PY) scripts/bench_eval.py $(ARGS)

# A full training step of GPT-2 small against transformers + autograd + torch's AdamW, and a LoRA / QLoRA step
# against transformers + peft (about 25 minutes; ARGS="--lora-rows ''" for the full fine-tuning rows alone).
bench-train: install
	$(PY) scripts/bench_train.py --out .cache/artifacts/bench-train.json $(ARGS)

# Speculative decoding (int4, int8 and ngram drafters, adaptive K) against plain float32 decoding, batch 1, greedy,
# 256 new tokens, on the trained and the full-size checkpoints (about 15 minutes). The server's side:
# make bench-serve ARGS="--speculate int4 --weights trained --clients 1,8 --rounds 3".
bench-speculative: install
	$(PY) scripts/bench_speculative.py $(ARGS)

# gpt2 convert --to gguf checked by llama.cpp itself: the same greedy ids from the f32 files, q8_0/f16 agreement.
check-gguf: install
	$(PY) scripts/check_gguf.py $(ARGS)

# The engine beside llama.cpp on the same weights (f32 / q8_0 / q4_0 / f16 against float32 / int8 / int4 / bfloat16):
# decode tg128 and prefill pp512, alternating, with the memory read ceiling and each decode's GB/s; ARGS=--serve: gpt2 serve against llama-server -np 8, 1 and 8 clients.
# Builds llama.cpp once into .cache/llamacpp/ from the llama-cpp-python sdist on PyPI (about 12 minutes).
bench-llamacpp: install
	$(PY) scripts/bench_llamacpp.py $(ARGS)

# The memory read ceiling the decode rows are measured against: T threads streaming a 1 GiB buffer with each load
# width, plain or non-temporal, at several prefetch distances (about a minute; bench-llamacpp measures it too).
bench-memory: install
	$(PY) scripts/bench_memory.py $(ARGS)

# An OpenAI-compatible server on 127.0.0.1:8000 (gpt2 serve --help for the options).
serve: install
	$(VENV)/bin/gpt2 serve $(WEIGHTS_FLAG) $(ARGS)

# The test checkpoints (random full-size, the small trained one, the 2-layer copier), built once into .cache/fixtures/
# (several minutes on a fresh clone, with progress on stderr); afterwards a check of a few milliseconds.
fixtures: install
	@$(PY) scripts/fixtures.py small trained induction saes

clean:
	rm -rf $(VENV) .pytest_cache bench-results *.egg-info .cache build gpt2_engine/core/kernels/_native*.so
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
