"""scripts/download_weights.py with the real huggingface_hub client against a loopback imitation of the Hub."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import assert_same_weights
from hub_server import FakeHub, repo_from_directory

from gpt2_engine import GPT2

ROOT = Path(__file__).resolve().parent.parent
REPO = "test-org/tiny-gpt2"
FILES = ("config.json", "generation_config.json", "model.safetensors", "vocab.json", "merges.txt")


def download(endpoint: str, tmp_path: Path, *args: str, offline: bool = False) -> subprocess.CompletedProcess:
    """Run the download script as a user would, with HF_ENDPOINT (read by huggingface_hub at import) set."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=endpoint, HF_HOME=str(tmp_path / "hf-home"), HF_HUB_DISABLE_TELEMETRY="1",
               HF_HUB_DISABLE_PROGRESS_BARS="1")
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "download_weights.py"), *args], env=env,
                          capture_output=True, text=True, timeout=300)


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    return proc.stderr.strip().splitlines()[-1]


@pytest.fixture()
def hub(tiny_dir: Path):
    with FakeHub(repo_from_directory(REPO, tiny_dir, FILES)) as h:
        yield h


def test_clean_download_then_loads(hub: FakeHub, tmp_path: Path, tiny_model: GPT2) -> None:
    dest = tmp_path / "weights"
    proc = download(hub.endpoint, tmp_path, "--repo", REPO, "--dest", str(dest))
    assert proc.returncode == 0, proc.stderr
    assert "model.safetensors: downloaded" in proc.stdout and "sha256 verified" in proc.stdout
    assert f"config.json: downloaded ({len(hub.repo.files['config.json'])} bytes, git-sha1 verified)" in proc.stdout
    assert "GPT-2 with 2 layers, 4 heads, 64 channels" in proc.stdout
    assert f'next: gpt2 generate "Hello, my dog is" --weights {dest}' in proc.stdout
    for name in FILES:
        assert (dest / name).read_bytes() == hub.repo.files[name]
    assert_same_weights(GPT2.from_pretrained(dest).weights, tiny_model.weights)


def test_second_run_downloads_nothing(hub: FakeHub, tmp_path: Path) -> None:
    dest = tmp_path / "weights"
    assert download(hub.endpoint, tmp_path, "--repo", REPO, "--dest", str(dest)).returncode == 0
    proc = download(hub.endpoint, tmp_path, "--repo", REPO, "--dest", str(dest))
    assert proc.returncode == 0, proc.stderr
    assert "nothing downloaded" in proc.stdout and "model.safetensors: already in place" in proc.stdout
    assert hub.gets("model.safetensors") == 1 and hub.gets("vocab.json") == 1


@pytest.mark.slow
def test_connection_cut_mid_file_then_rerun_completes(hub: FakeHub, tmp_path: Path) -> None:
    dest = tmp_path / "weights"
    hub.behaviour.cut_file, hub.behaviour.cut_after, hub.behaviour.cuts_left = "model.safetensors", 100_000, 100
    line = one_line_error(download(hub.endpoint, tmp_path, "--repo", REPO, "--dest", str(dest)))
    assert "model.safetensors" in line and "re-run" in line
    assert not (dest / "model.safetensors").exists()  # nothing partial under the final name
    assert hub.gets("model.safetensors") >= 2  # the client retried within the call, and was cut every time

    hub.behaviour.cuts_left = 0
    proc = download(hub.endpoint, tmp_path, "--repo", REPO, "--dest", str(dest))
    assert proc.returncode == 0, proc.stderr
    assert (dest / "model.safetensors").read_bytes() == hub.repo.files["model.safetensors"]
    assert "config.json: already in place" in proc.stdout  # what the first run finished is kept


def test_corrupted_bytes_of_the_right_size_are_detected_and_removed(hub: FakeHub, tmp_path: Path) -> None:
    dest = tmp_path / "weights"
    hub.behaviour.corrupt = {"model.safetensors"}
    line = one_line_error(download(hub.endpoint, tmp_path, "--repo", REPO, "--dest", str(dest)))
    good = hub.repo.etag("model.safetensors")
    assert line.startswith("gpt2 download: error: model.safetensors: downloaded file has sha256 ")
    assert f"expected {good}; removed it (re-run to try again)" in line
    assert not (dest / "model.safetensors").exists()


@pytest.mark.slow
def test_official_repo_is_checked_against_pinned_hashes(tiny_dir: Path, tmp_path: Path) -> None:
    with FakeHub(repo_from_directory("openai-community/gpt2", tiny_dir, FILES)) as h:
        line = one_line_error(download(h.endpoint, tmp_path, "--repo", "gpt2", "--dest", str(tmp_path / "w")))
    # the BPE files are the official ones; the random config.json is not
    assert "config.json: downloaded file has sha256" in line
    assert "expected the official 0daed7749b4f02b8f76240d5444551d7b08712dab4d0adb8239c56ba823bb7b4" in line


@pytest.mark.slow
def test_repo_without_safetensors_gets_pytorch_bin(tiny_dir: Path, tmp_path: Path, tiny_model: GPT2) -> None:
    names = ("config.json", "pytorch_model.bin", "vocab.json", "merges.txt")
    with FakeHub(repo_from_directory(REPO, tiny_dir, names)) as h:
        proc = download(h.endpoint, tmp_path, "--repo", REPO, "--dest", str(tmp_path / "w"))
    assert proc.returncode == 0, proc.stderr
    assert "pytorch_model.bin: downloaded" in proc.stdout
    assert_same_weights(GPT2.from_pretrained(tmp_path / "w").weights, tiny_model.weights)


@pytest.mark.slow
def test_unknown_repo(hub: FakeHub, tmp_path: Path) -> None:
    line = one_line_error(download(hub.endpoint, tmp_path, "--repo", "test-org/nope", "--dest", str(tmp_path / "w")))
    assert line == f"gpt2 download: error: repository test-org/nope not found on {hub.endpoint} (or it is private: log in first)"


@pytest.mark.slow
def test_unknown_revision(hub: FakeHub, tmp_path: Path) -> None:
    line = one_line_error(download(hub.endpoint, tmp_path, "--repo", REPO, "--revision", "v9", "--dest", str(tmp_path / "w")))
    assert line == f"gpt2 download: error: revision 'v9' not found in {REPO}"


@pytest.mark.slow
def test_missing_file_in_repo(tiny_dir: Path, tmp_path: Path) -> None:
    with FakeHub(repo_from_directory(REPO, tiny_dir, ("config.json", "model.safetensors", "vocab.json"))) as h:
        line = one_line_error(download(h.endpoint, tmp_path, "--repo", REPO, "--dest", str(tmp_path / "w")))
    assert line == f"gpt2 download: error: file merges.txt not found in {REPO}@main"


@pytest.mark.slow
def test_server_down(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    dest = tmp_path / "w"
    line = one_line_error(download(endpoint, tmp_path, "--repo", REPO, "--dest", str(dest)))
    assert line.startswith(f"gpt2 download: error: cannot reach {endpoint}: ")
    assert line.endswith(f"; copy the files into {dest} or set HF_ENDPOINT")
    assert not dest.exists()  # the folder it made for the download is gone again: nothing arrived
    (tmp_path / "kept").mkdir()
    one_line_error(download(endpoint, tmp_path, "--repo", REPO, "--dest", str(tmp_path / "kept")))
    assert (tmp_path / "kept").is_dir()  # a folder the user made stays


@pytest.mark.slow
def test_a_malformed_repo_id_is_a_usage_error_before_any_request(hub: FakeHub, tmp_path: Path) -> None:
    dest = tmp_path / "w"
    for repo in ("../../etc", "a/b/c", "owner/name.git"):  # the Hub was reported unreachable, before
        line = one_line_error(download(hub.endpoint, tmp_path, "--repo", repo, "--dest", str(dest)))
        assert line == f"gpt2 download: error: --repo '{repo}' is not a Hub repo id (expected 'name' or 'owner/name')"
    assert hub.behaviour.requests == [] and not dest.exists()


@pytest.mark.slow
def test_unwritable_destination(hub: FakeHub, tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    dest = tmp_path / "a-file" / "weights"
    line = one_line_error(download(hub.endpoint, tmp_path, "--repo", REPO, "--dest", str(dest)))
    assert line == f"gpt2 download: error: cannot write into {dest}: Not a directory"
    assert hub.behaviour.requests == []  # refused before any transfer


@pytest.mark.slow
def test_offline_mode_uses_what_is_there_without_a_request(hub: FakeHub, tmp_path: Path) -> None:
    dest = tmp_path / "w"
    line = one_line_error(download(hub.endpoint, tmp_path, "--repo", REPO, "--dest", str(dest), offline=True))
    assert "offline (HF_HUB_OFFLINE is set)" in line and "copy the files into" in line
    assert not dest.exists()
    assert download(hub.endpoint, tmp_path, "--repo", REPO, "--dest", str(dest)).returncode == 0
    before = len(hub.behaviour.requests)
    proc = download(hub.endpoint, tmp_path, "--repo", REPO, "--dest", str(dest), offline=True)
    assert proc.returncode == 0 and "offline: using the files already in" in proc.stdout
    assert len(hub.behaviour.requests) == before
