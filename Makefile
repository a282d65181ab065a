# gpt2-engine. On a fresh machine: `make generate PROMPT="..."` runs the engine, `make test` runs the tests.
# Each target installs what is missing first (a .venv in this directory).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
WEIGHTS ?= weights
PROMPT ?= Hello, my dog is
ARGS ?=
export PROMPT

.PHONY: install test generate weights compare bench bench-serve bench-inspect serve fixtures clean

install: $(STAMP)

# The CPU build of torch goes in first: a bare `torch` requirement would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

test: install
	$(PY) -m pytest

weights: install
	$(PY) scripts/download_weights.py --dest $(WEIGHTS) $(ARGS)

# Downloads the official weights only when $(WEIGHTS)/ holds none yet.
generate: install
	@test -f $(WEIGHTS)/model.safetensors -o -f $(WEIGHTS)/pytorch_model.bin || $(PY) scripts/download_weights.py --dest $(WEIGHTS)
	$(VENV)/bin/gpt2 generate "$$PROMPT" --weights $(WEIGHTS) $(ARGS)

compare: install
	$(VENV)/bin/gpt2 compare --weights $(WEIGHTS) $(ARGS)

bench: install
	$(PY) scripts/bench.py $(ARGS)

bench-serve: install
	$(PY) scripts/bench_serve.py $(ARGS)

bench-inspect: install
	$(PY) scripts/bench_inspect.py $(ARGS)

# An OpenAI-compatible server on 127.0.0.1:8000 (gpt2 serve --help for the options).
serve: install
	$(VENV)/bin/gpt2 serve --weights $(WEIGHTS) $(ARGS)

# The test checkpoints (random full-size, the small trained one, the 2-layer copier), built once into .cache/fixtures/.
fixtures: install
	$(PY) scripts/fixtures.py small
	$(PY) scripts/fixtures.py trained
	$(PY) scripts/fixtures.py induction

clean:
	rm -rf $(VENV) .pytest_cache bench-results *.egg-info .cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
