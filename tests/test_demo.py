"""The demo model as a weights source: after the offline fallback, `gpt2 generate`, `gpt2 compare` and `gpt2 serve`
find it in a fresh checkout (no weights/, the Hub unreachable), by default and as `--weights demo`, from the
checkout's directory or any other, and in the user's cache ($XDG_CACHE_HOME/gpt2-engine/demo).

The demo model itself takes minutes to train (scripts/demo.py); these tests place the trained fixture where the
script's build would land, under the name the script gives it, and check everything after the build. A "checkout"
here is a temporary directory linking this one's package, scripts and pyproject.toml: the code under test, with a
.cache of its own."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from conftest import ROOT, SCRIPTS, THREADS, free_port, gpt2_serve

sys.path.insert(0, str(SCRIPTS))
import demo  # noqa: E402

PROMPT = "Return the"


def checkout(root: Path) -> Path:
    """`root` made a project checkout: this one's package, scripts and pyproject.toml linked, no .cache yet."""
    root.mkdir(parents=True, exist_ok=True)
    for name in ("gpt2_engine", "scripts", "pyproject.toml"):
        (root / name).symlink_to(ROOT / name)
    return root


def gpt2(*args: str, cwd: Path, package: Path | None = None, cache: Path | None = None) -> subprocess.CompletedProcess:
    """`python -m gpt2_engine ARGS` run in `cwd`, with the package of the checkout `package` (default: `cwd`'s own)
    and, if given, `cache` as the user's cache directory ($XDG_CACHE_HOME; torch's compiled kernels stay where they
    are)."""
    env = {**os.environ, "PYTHONPATH": str(package or cwd)}
    if cache is not None:
        from gpt2_engine.core.kernels import decode_kernels

        env["XDG_CACHE_HOME"] = str(cache)
        if (kernels := decode_kernels()) is not None:  # torch's extension cache is under it too, by default
            env["TORCH_EXTENSIONS_DIR"] = str(Path(kernels.__file__).parents[1])
    return subprocess.run([sys.executable, "-m", "gpt2_engine", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def project(trained_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh checkout whose demo model is built (the trained fixture), after `make generate`'s fallback."""
    root = checkout(tmp_path_factory.mktemp("project"))
    shutil.copytree(trained_dir, root / ".cache" / "demo" / f"model-{demo.demo_key()}")
    unreachable = f"http://127.0.0.1:{free_port()}"  # nothing listens there: the Hub cannot be reached
    env = {**os.environ, "HF_ENDPOINT": unreachable}
    env.pop("HF_HUB_OFFLINE", None)
    proc = subprocess.run([sys.executable, str(root / "scripts" / "demo.py"), "--weights", "weights"], cwd=root,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str((root / ".cache" / "demo" / f"model-{demo.demo_key()}").resolve())
    line, = proc.stderr.strip().splitlines()
    assert line.startswith("demo: the official weights could not be downloaded (cannot reach http://127.0.0.1:")
    assert line.endswith("using the demo model instead (make demo; docs/training.md: the demo model)")
    assert not (root / "weights").exists()  # the failed download leaves no empty folder behind
    assert os.readlink(root / ".cache" / "demo" / "latest") == f"model-{demo.demo_key()}"
    return root


def test_gpt2_generate_falls_back_to_the_demo_model_saying_so(project: Path, trained_dir: Path) -> None:
    expected = gpt2("generate", PROMPT, "-n", "12", "--temperature", "0", "--weights", str(trained_dir), cwd=project)
    by_default = gpt2("generate", PROMPT, "-n", "12", "--temperature", "0", cwd=project)
    by_name = gpt2("generate", PROMPT, "-n", "12", "--temperature", "0", "--weights", "demo", cwd=project)
    assert expected.returncode == by_default.returncode == by_name.returncode == 0
    assert by_default.stdout == by_name.stdout == expected.stdout != ""
    first = by_default.stderr.splitlines()[0]
    assert first == (f"gpt2 generate: weights/ holds no checkpoint; using the demo model "
                     f"(.cache/demo/model-{demo.demo_key()}; `make weights` downloads GPT-2's)")
    assert "demo model" not in by_name.stderr  # named, so nothing to explain


def test_the_demo_model_is_found_from_any_working_directory(project: Path, trained_dir: Path, tmp_path: Path) -> None:
    """A user who activates the venv and works elsewhere: the demo model is found from the package's checkout, not
    the working directory (which holds no weights/ either)."""
    expected = gpt2("generate", PROMPT, "-n", "12", "--temperature", "0", "--weights", str(trained_dir), cwd=project)
    by_name = gpt2("generate", PROMPT, "-n", "12", "--temperature", "0", "--weights", "demo", cwd=tmp_path,
                   package=project)
    by_default = gpt2("generate", PROMPT, "-n", "12", "--temperature", "0", cwd=tmp_path, package=project)
    assert by_name.returncode == by_default.returncode == 0, by_name.stderr + by_default.stderr
    assert by_name.stdout == by_default.stdout == expected.stdout != ""
    built = (project / ".cache" / "demo" / f"model-{demo.demo_key()}").resolve()
    assert by_default.stderr.splitlines()[0] == (f"gpt2 generate: weights/ holds no checkpoint; using the demo model "
                                                 f"({built}; `make weights` downloads GPT-2's)")


def test_the_demo_model_is_found_in_the_user_cache(project: Path, trained_dir: Path, tmp_path: Path) -> None:
    """A checkout without a build (or a package installed from a wheel) finds it in $XDG_CACHE_HOME/gpt2-engine/demo."""
    bare = checkout(tmp_path / "bare")
    cache = tmp_path / "xdg"
    (cache / "gpt2-engine" / "demo").mkdir(parents=True)
    (cache / "gpt2-engine" / "demo" / "latest").symlink_to(trained_dir, target_is_directory=True)
    expected = gpt2("generate", PROMPT, "-n", "6", "--temperature", "0", "--weights", str(trained_dir), cwd=project)
    out = gpt2("generate", PROMPT, "-n", "6", "--temperature", "0", "--weights", "demo", cwd=tmp_path, package=bare,
               cache=cache)
    assert out.returncode == 0, out.stderr
    assert out.stdout == expected.stdout != ""


def test_official_weights_in_weights_take_precedence_over_the_demo(project: Path, small_dir: Path,
                                                                    tmp_path: Path) -> None:
    root = checkout(tmp_path / "project")
    shutil.copytree(project / ".cache", root / ".cache", symlinks=True)
    (root / "weights").symlink_to(small_dir, target_is_directory=True)
    out = gpt2("generate", PROMPT, "-n", "4", "--temperature", "0", cwd=root)
    expected = gpt2("generate", PROMPT, "-n", "4", "--temperature", "0", "--weights", str(small_dir), cwd=root)
    assert out.returncode == 0 and out.stdout == expected.stdout
    assert "demo model" not in out.stderr


@pytest.mark.slow
def test_without_weights_or_demo_the_error_names_both_ways(tmp_path: Path) -> None:
    root = checkout(tmp_path / "fresh")
    out = gpt2("generate", PROMPT, cwd=root, cache=tmp_path / "xdg")
    assert out.returncode == 2
    assert out.stderr.strip() == ("gpt2 generate: error: weights: weights directory does not exist (run `make "
                                  "weights`, or `make demo` offline, or copy the official files there)")
    named = gpt2("generate", PROMPT, "--weights", "demo", cwd=tmp_path, package=root, cache=tmp_path / "xdg")
    assert named.returncode == 2
    assert named.stderr.strip() == (f"gpt2 generate: error: demo: the demo model is not built (looked in "
                                    f"{root}/.cache/demo/ and {tmp_path}/xdg/gpt2-engine/demo/; `make demo` builds it "
                                    "in the project's checkout)")


@pytest.mark.long
def test_gpt2_compare_checks_the_demo_model(project: Path) -> None:
    out = gpt2("compare", cwd=project)
    assert out.returncode == 0, out.stderr
    assert "comparisons within tolerance" in out.stdout
    assert out.stderr.startswith("gpt2 compare: weights/ holds no checkpoint; using the demo model")


def test_gpt2_serve_serves_the_demo_model(project: Path, trained_model) -> None:
    with gpt2_serve("--threads", str(THREADS), cwd=project) as (url, proc):
        r = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0}, timeout=60)
    assert r.status_code == 200
    assert r.json()["choices"][0]["text"] == trained_model.complete([PROMPT], max_new_tokens=8, temperature=0)[0].text


def test_the_python_api_names_the_demo_model(project: Path, trained_model, monkeypatch: pytest.MonkeyPatch,
                                             tmp_path: Path) -> None:
    from gpt2_engine import GPT2
    from gpt2_engine.formats import hf

    monkeypatch.setattr(hf, "demo_caches", lambda: [project / ".cache" / "demo"])  # this checkout's own left out
    monkeypatch.chdir(tmp_path)
    model = GPT2.from_pretrained("demo")
    assert model.complete([PROMPT], max_new_tokens=6, temperature=0)[0].token_ids == \
        trained_model.complete([PROMPT], max_new_tokens=6, temperature=0)[0].token_ids
