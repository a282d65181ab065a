"""Shared fixtures: official-layout checkpoints, built once into the git-ignored .cache/fixtures/ (scripts/fixtures.py)
or, for the variants only these tests use, into pytest's temporary directory."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"
OFFICIAL_WEIGHTS = ROOT / "weights"
sys.path.insert(0, str(Path(__file__).parent))  # tests/hub_server.py
sys.path.insert(0, str(SCRIPTS))  # scripts/fixtures.py
import fixtures  # noqa: E402

# The machines have 2 cores: 2 threads, or 1 in each of `make test`'s 2 pytest-xdist workers (so that they do not
# oversubscribe the cores; the tests of thread-count invariance set their own counts). The servers the tests start
# take the same count, and the commands they start too (pytest_configure): a process of 2 threads started beside the
# other worker's test waits, at each parallel step, on the thread whose core that test holds, and the structured-output
# and server tests ran 5-13x slower in `make test` than alone.
THREADS = max(1, 2 // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
torch.set_num_threads(THREADS)


@pytest.fixture(autouse=True)
def torch_threads_restored() -> Iterator[None]:
    """Each test ends with the worker's torch thread count as it began: a command run in this process with --threads
    (gpt2 finetune's tests; in a module fixture, until its first test ends) sets torch's count for the process, and
    the tests after it, 2 threads beside the other worker, ran up to 13x slower (sampling and the structured-output
    steps waited on a thread without a core)."""
    yield
    if torch.get_num_threads() != THREADS:
        torch.set_num_threads(THREADS)


# Checkpoints trained on the machine that runs the tests (minutes on a fresh clone, scripts/fixtures.py): a test that
# reads one, directly or through another fixture, is marked `trained`, and `make test-fast` leaves it out.
TRAINED_FIXTURES = {"trained_dir", "induction_dir"}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cpu-isa", choices=("native", "avx2"), default="native",
                     help="avx2: run the engine's kernels as on a CPU with AVX2 only (its AVX-512, VNNI, BF16 and AMX "
                          "paths off in this process; `make test-avx2` also sets torch's ATEN_CPU_CAPABILITY and "
                          "oneDNN's ONEDNN_MAX_CPU_ISA for the commands the tests start)")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--cpu-isa") == "avx2":
        limit_to_avx2()
    # OpenMP's own variable, which torch reads, for the commands the tests start; not in pytest-xdist's controller,
    # whose environment the workers inherit (there THREADS is 2, and a worker's setdefault would keep it)
    if not getattr(config.option, "numprocesses", None) or hasattr(config, "workerinput"):
        os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))


def limit_to_avx2() -> None:
    """Every module's `cpu()` answers as an AVX2-only CPU would: the kernels take their paths by these flags (passed
    to each native call), so the AVX2 code runs here as it does on a Zen 1/Zen 3 EPYC."""
    from gpt2_engine.core import kernels

    original = kernels.cpu
    native = original()
    if not native.avx2:
        pytest.exit("--cpu-isa avx2: this CPU has no AVX2", returncode=4)
    limited = dataclasses.replace(native, avx512=False, avx512_bf16=False, avx512_vnni=False, avx512_vbmi=False,
                                  amx=False)

    def cpu() -> kernels.CPU:
        return limited

    for module in [m for name, m in sys.modules.items() if name.startswith("gpt2_engine")]:
        if getattr(module, "cpu", None) is original:
            module.cpu = cpu
    kernels.cpu = cpu  # for the modules imported from here on


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if TRAINED_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.trained)


def trained_only(request: pytest.FixtureRequest, name: str) -> str:
    """`name`, unless this run leaves the trained tests out (make test-fast) and a test not marked `trained` asked for
    it anyway (through request.getfixturevalue, which the marking above cannot see): then that test fails here rather
    than train a checkpoint in the quick tier. A parameter that names a trained fixture is marked as
    pytest.param("trained_model", marks=pytest.mark.trained)."""
    if "not trained" in (request.config.getoption("markexpr") or ""):
        pytest.fail(f"a test not marked `trained` asked for the {name} checkpoint under -m "
                    f"{request.config.getoption('markexpr')!r}: mark it (or its parameter) trained")
    return name


def make_fixture(directory: Path, *args: str) -> Path:
    """Run scripts/make_fixture.py as a user would."""
    subprocess.run([sys.executable, str(SCRIPTS / "make_fixture.py"), str(directory), *args], check=True,
                   stdout=subprocess.DEVNULL)
    return directory


def cli(*args: str) -> tuple[int, str]:
    """`gpt2 ARGS` in this process: (exit code, what it wrote on stderr)."""
    import contextlib
    import io

    from gpt2_engine.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, err.getvalue()


def run_pass(w, config, segments, cache) -> torch.Tensor:
    """One whole pass of the runner over `segments` on an explicit KV cache: the logits after each segment's last
    `outputs` rows [n, V] (ModelRunner.run, on a cache of the test's own)."""
    from gpt2_engine.runtime.runner import Pass

    p = Pass(w, config, cache, segments)
    while not p.done:
        p.run_block()
    return p.logits()


def engine(directory: Path):
    """The engine on a checkpoint directory, float32."""
    from gpt2_engine import GPT2

    return GPT2.from_pretrained(directory)


def reference(directory: Path, **kwargs):
    """The reference: transformers' GPT2LMHeadModel on the same files, float32, eval mode (kwargs: from_pretrained's,
    e.g. attn_implementation="eager", the one that returns attention weights)."""
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(directory, dtype=torch.float32, **kwargs).eval()


@pytest.fixture(scope="session")
def small_dir() -> Path:
    """Full GPT-2-small shape, random weights, official layout, model.safetensors. Read-only: tests copy to edit."""
    return fixtures.ensure("small")


@pytest.fixture(scope="session")
def trained_dir(request: pytest.FixtureRequest) -> Path:
    """The small GPT-2 trained on the standard library's docstrings (scripts/train_fixture.py). Read-only."""
    return fixtures.ensure(trained_only(request, "trained"))


@pytest.fixture(scope="session")
def trained_model(trained_dir: Path):
    return engine(trained_dir)


@pytest.fixture(scope="session")
def trained_hf_model(trained_dir: Path):
    return reference(trained_dir)


@pytest.fixture(scope="session")
def small_bin_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same weights as small_dir, as pytorch_model.bin only."""
    return make_fixture(tmp_path_factory.mktemp("small_bin"), "--format", "bin")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 layers, 4 heads, 64 channels, 128 positions; the full vocabulary. Both weight formats."""
    return make_fixture(tmp_path_factory.mktemp("tiny"), "--config", "tiny", "--format", "both")


@pytest.fixture(scope="session")
def model(small_dir: Path):
    return engine(small_dir)


@pytest.fixture(scope="session")
def hf_model(small_dir: Path):
    return reference(small_dir)


@pytest.fixture(scope="session")
def tiny_model(tiny_dir: Path):
    return engine(tiny_dir)


@pytest.fixture(scope="session")
def tiny_hf_model(tiny_dir: Path):
    return reference(tiny_dir)


def assert_same_weights(a, b) -> None:
    """Every parameter of two loaded GPT2Weights is bit-identical (the loaders read the same values)."""
    import dataclasses

    from gpt2_engine.core.packed import PackedMatrix
    from gpt2_engine.core.pages import FilePages
    from gpt2_engine.core.weights import PanelMatrix

    def leaves(obj, prefix=""):
        if isinstance(obj, torch.Tensor):
            yield prefix, obj
        elif obj is None or isinstance(obj, FilePages):  # GPT2Weights.wte_pages: unset, or where wte's rows are read
            return
        elif isinstance(obj, (PanelMatrix, PackedMatrix)):  # the matrix, whichever layout the loader chose here
            yield prefix, obj.matrix()
        elif isinstance(obj, tuple):
            for i, o in enumerate(obj):
                yield from leaves(o, f"{prefix}.{i}")
        else:
            for f in dataclasses.fields(obj):
                yield from leaves(getattr(obj, f.name), f"{prefix}.{f.name}")

    pairs = list(zip(leaves(a), leaves(b)))
    assert len(pairs) == len(list(leaves(a))) == len(list(leaves(b))) > 0
    for (name, x), (_, y) in pairs:
        assert torch.equal(x, y), name


def edited_copy(src: Path, dest: Path, edit: Callable[[dict[str, torch.Tensor]], None] | None = None) -> Path:
    """A copy of checkpoint `src` (config, BPE files, model.safetensors) with its tensors edited in place by `edit`."""
    from safetensors.torch import load_file, save_file

    dest.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "vocab.json", "merges.txt"):
        shutil.copyfile(src / name, dest / name)
    tensors = load_file(src / "model.safetensors")
    if edit is not None:
        edit(tensors)
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


@pytest.fixture(scope="session")
def saes_dir(trained_dir: Path) -> Path:
    """SAEs of every architecture, made by sae-lens on the trained checkpoint (scripts/sae_reference.py). Read-only."""
    return fixtures.ensure("saes")


@pytest.fixture(scope="session")
def induction_dir(request: pytest.FixtureRequest) -> Path:
    """The 2-layer GPT-2 trained to copy a repeated token run (scripts/train_induction.py). Read-only."""
    return fixtures.ensure(trained_only(request, "induction"))


CHROMIUM, DRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
ARTIFACTS = ROOT / ".cache" / "artifacts"  # screenshots of the browser tests, for a person to look at
NO_CHROMIUM = "Debian's chromium and chromium-driver are not installed (.ci/run installs them)"
needs_chromium = pytest.mark.skipif(not (CHROMIUM.exists() and DRIVER.exists()), reason=NO_CHROMIUM)


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory):
    """Headless Debian chromium through selenium (never a downloaded browser)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the console, for tests that read it
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", f"--user-data-dir={tmp_path_factory.mktemp('chromium')}"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(str(DRIVER)), options=options)
    driver.set_window_size(1100, 1000)
    yield driver
    driver.quit()


SERVER_START = 180  # seconds for `gpt2 serve` to load (the native kernels are built once per machine)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(condition: Callable[[], bool], what: str, seconds: float = 30) -> None:
    import time

    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)  # polling a condition, not timing anything


def healthy(url: str) -> bool:
    import httpx

    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


@contextlib.contextmanager
def gpt2_serve(*args: str, cwd: Path | None = None):
    """A real `gpt2 serve ARGS --port P` process on 127.0.0.1, healthy: yields (url, process); SIGTERM at the end,
    which must exit 0 without a traceback."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gpt2_engine", "serve", *args, "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: proc.poll() is not None or healthy(url), "the server to start", SERVER_START)
        assert proc.poll() is None, proc.stderr.read()
        yield url, proc
        proc.terminate()
        assert proc.wait(timeout=30) == 0  # a graceful stop on SIGTERM is a success, for a supervisor
        assert "Traceback" not in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="session")
def trained_server(trained_dir: Path):
    """One `gpt2 serve` on the trained checkpoint (127.0.0.1, 8 slots, THREADS threads) for every test that needs a
    plain server: started once for the session, stopped (SIGTERM, which must exit 0) at its end. Tests that need other
    options start their own."""
    with gpt2_serve("--weights", str(trained_dir), "--parallel", "8", "--threads", str(THREADS)) as (url, _):
        yield url
