"""scripts/bench_llamacpp.py's llama-bench runs: a row whose run dies by a signal on llama.cpp's native build (its AMX
path on this project's AMX Xeons) moves to the build without AMX for good, every other row stays on the native build,
and a run that fails without a signal stops the benchmark with one line. llama-bench is played by shell scripts."""

from __future__ import annotations

from pathlib import Path

import pytest

import bench_llamacpp

# a llama-bench that dies by SIGILL on any prefill (-p N > 0), counting its runs, and gives tok/s on decodes
NATIVE = """#!/bin/sh
ulimit -c 0  # no core file from the SIGILL
echo run >> "$(dirname "$0")/runs"
case " $* " in *" -p 0 "*) echo '[{"avg_ts": 150.5}]' ;; *) kill -ILL $$ ;; esac
"""
WITHOUT_AMX = """#!/bin/sh
echo '[{"avg_ts": 900.25}]'
"""
FAILING = """#!/bin/sh
echo "error: failed to load model 'x.gguf'" >&2
exit 1
"""


def llama_bench(tmp_path: Path, name: str, script: str) -> Path:
    """A directory holding `script` as its llama-bench."""
    bin_dir = tmp_path / name
    bin_dir.mkdir()
    exe = bin_dir / "llama-bench"
    exe.write_text(script)
    exe.chmod(0o755)
    return bin_dir


def test_a_row_that_dies_on_the_native_build_runs_on_the_build_without_amx_and_the_others_stay(tmp_path):
    native = llama_bench(tmp_path, "native", NATIVE)
    without = llama_bench(tmp_path, "noamx", WITHOUT_AMX)
    built = []
    rows = bench_llamacpp.LlamaRows(native, 2, fallback=lambda: built.append(1) or without)
    model = tmp_path / "model-q8_0.gguf"
    assert rows(model, 0, 128) == 150.5  # decode: the native build
    assert rows(model, 512, 0) == 900.25  # prefill died there: the build without AMX
    assert rows.died == {("model-q8_0.gguf", 512, 0)}
    assert rows(model, 512, 0) == 900.25  # and stays there: the native build is not tried again
    assert rows(model, 0, 128) == 150.5
    assert (native / "runs").read_text().count("run") == 3  # decode, the dying prefill, decode
    assert len(built) == 2  # asked for each prefill (llamacpp() builds once and then only finds the binaries)


def test_a_row_that_dies_on_both_builds_stops_the_benchmark_in_one_line(tmp_path):
    native = llama_bench(tmp_path, "native", NATIVE)
    rows = bench_llamacpp.LlamaRows(native, 2, fallback=lambda: native)
    with pytest.raises(SystemExit) as e:
        rows(tmp_path / "model-q4_0.gguf", 512, 0)
    assert str(e.value) == ("bench-llamacpp: llama-bench pp512 tg0 on model-q4_0.gguf died (signal 4) on llama.cpp "
                            "built without AMX too")


def test_a_llama_bench_run_that_fails_without_a_signal_stops_the_benchmark_in_one_line(tmp_path):
    rows = bench_llamacpp.LlamaRows(llama_bench(tmp_path, "native", FAILING), 2,
                                    fallback=lambda: pytest.fail("a failure that is not a signal must not fall back"))
    with pytest.raises(SystemExit) as e:
        rows(tmp_path / "model-f32.gguf", 0, 128)
    assert str(e.value) == ("bench-llamacpp: llama-bench on model-f32.gguf (pp0 tg128) failed (exit 1): "
                            "error: failed to load model 'x.gguf'")


def test_the_servers_amx_probe_is_a_short_prefill_that_dies_or_runs(tmp_path):
    """--serve's llama-server batches, so it takes the build without AMX where a prefill dies on the native one."""
    model = tmp_path / "model-q8_0.gguf"
    assert bench_llamacpp.amx_runs(llama_bench(tmp_path, "native", NATIVE), model, 2) is False
    assert bench_llamacpp.amx_runs(llama_bench(tmp_path, "noamx", WITHOUT_AMX), model, 2) is True
    with pytest.raises(SystemExit, match="failed \\(exit 1\\): error: failed to load model 'x.gguf'$"):
        bench_llamacpp.amx_runs(llama_bench(tmp_path, "broken", FAILING), model, 2)
