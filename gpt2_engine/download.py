"""Download a GPT-2 checkpoint from the Hugging Face Hub with huggingface_hub, and verify every byte of it.

huggingface_hub checks only a download's size. We check content: a weights file (stored with Git LFS) against the
sha256 the hub publishes as its ETag, a small file against its git blob sha1 (its ETag), and the official
openai-community/gpt2 files also against hashes pinned here. The endpoint comes from HF_ENDPOINT, offline mode from
HF_HUB_OFFLINE and a token from the usual huggingface_hub places, all read by huggingface_hub itself.
"""

from __future__ import annotations

import errno
import hashlib
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .core.errors import DownloadError, one_line
from .formats.hf import DEFAULT_WEIGHTS

SHORTHANDS = {name: f"openai-community/{name}" for name in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")}
OFFICIAL_REPO = "openai-community/gpt2"
# sha256 of the official openai-community/gpt2 files (revision 607a30d783dfa663caf39e06633721c8d4cfcd7e).
PINNED_SHA256 = {
    "model.safetensors": "248dfc3911869ec493c76e65bf2fcf7f615828b0254c12b473182f0f81d3a707",
    "pytorch_model.bin": "7c5d3f4b8b76583b422fcb9189ad6c89d5d97a094541ce8932dce3ecabde1421",
    "config.json": "0daed7749b4f02b8f76240d5444551d7b08712dab4d0adb8239c56ba823bb7b4",
    "generation_config.json": "ed0b32ac72c0f5f44a719abb2d7786ea5146c871f83717b7f2018065954de02b",
    "vocab.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    "merges.txt": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
}
WEIGHT_FILES = {"safetensors": "model.safetensors", "bin": "pytorch_model.bin"}
REQUIRED = ("config.json", "vocab.json", "merges.txt")
OPTIONAL = ("generation_config.json",)


@dataclass(frozen=True)
class RemoteFile:
    name: str
    size: int
    etag: str  # sha256 for an LFS file, the git blob sha1 otherwise

    @property
    def is_lfs(self) -> bool:
        return len(self.etag) == 64


def file_digests(path: Path) -> tuple[str, str]:
    """(sha256, git blob sha1) of a file, read once in 8 MiB chunks."""
    sha256 = hashlib.sha256()
    git_sha1 = hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    with path.open("rb") as f:
        while chunk := f.read(8 << 20):
            sha256.update(chunk)
            git_sha1.update(chunk)
    return sha256.hexdigest(), git_sha1.hexdigest()


def verify(path: Path, remote: RemoteFile | None, repo_id: str) -> str | None:
    """None when the file at `path` is the expected one, else why not (one line)."""
    if not path.is_file():
        return "missing"
    if remote is not None and path.stat().st_size != remote.size:
        return f"size {path.stat().st_size}, expected {remote.size}"
    sha256, git_sha1 = file_digests(path)
    if remote is not None:
        found, kind = (sha256, "sha256") if remote.is_lfs else (git_sha1, "git-sha1")
        if found != remote.etag:
            return f"{kind} {found}, expected {remote.etag}"
    pinned = PINNED_SHA256.get(path.name) if repo_id == OFFICIAL_REPO else None
    if pinned is not None and sha256 != pinned:
        return f"sha256 {sha256}, expected the official {pinned}"
    return None


def _endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def _translate(e: Exception, repo_id: str, revision: str, dest: Path, filename: str | None = None,
               transferring: bool = False) -> DownloadError:
    """A huggingface_hub / network / file-system exception as one line that says what to do."""
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{repo_id}@{revision}"
    hub = [(GatedRepoError, f"{where} is gated: accept its terms on the Hub and log in (huggingface-cli login)"),
           (RepositoryNotFoundError, f"repository {repo_id} not found on {_endpoint()} (or it is private: log in first)"),
           (RevisionNotFoundError, f"revision {revision!r} not found in {repo_id}")]
    for kind, message in hub:
        if isinstance(e, kind):
            return DownloadError(message)
    if isinstance(e, EntryNotFoundError) and not isinstance(e, LocalEntryNotFoundError):
        return DownloadError(f"file {filename} not found in {where}")
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return DownloadError(f"disk full while writing {filename or 'files'} into {dest}; free some space and re-run")
    if isinstance(e, PermissionError):
        return DownloadError(f"cannot write into {dest}: permission denied")
    if isinstance(e, HfHubHTTPError) and e.response is not None:
        return DownloadError(f"{_endpoint()} answered HTTP {e.response.status_code} for {filename or where}")
    reason = one_line(e.__cause__ or e) or type(e).__name__
    if transferring:
        return DownloadError(f"download of {filename} was interrupted ({reason}); re-run to fetch it again")
    return DownloadError(f"cannot reach {_endpoint()}: {reason}; copy the files into {dest} or set HF_ENDPOINT")


def check_repo_id(repo_id: str) -> None:
    """DownloadError unless `repo_id` has the form of a Hub repository id, before any request (huggingface_hub's own
    check would otherwise surface as an unreachable Hub)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise DownloadError(f"--repo {repo_id!r:.100} is not a Hub repo id (expected 'name' or 'owner/name')") from None


def check_destination(dest: Path) -> None:
    """Create `dest` if needed and prove that it is writable, before any transfer."""
    try:
        dest.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=dest, prefix=".write-test-"):
            pass
    except OSError as e:
        raise DownloadError(f"cannot write into {dest}: {e.strerror or e}") from None


def list_remote(repo_id: str, revision: str, fmt: str | None, dest: Path) -> list[RemoteFile]:
    """The files to fetch, with the size and ETag the hub reports for each."""
    from huggingface_hub import HfApi, get_hf_file_metadata, hf_hub_url

    def metadata(name: str) -> RemoteFile:
        try:
            meta = get_hf_file_metadata(hf_hub_url(repo_id, name, revision=revision))  # one HEAD, no retries
        except Exception as e:  # noqa: BLE001 - translated to one line
            raise _translate(e, repo_id, revision, dest, name) from None
        if meta.etag is None or meta.size is None:
            raise DownloadError(f"{_endpoint()} gave no ETag or size for {name}: cannot verify it")
        return RemoteFile(name, meta.size, meta.etag.strip('"').removeprefix("W/").strip('"'))

    config = metadata("config.json")  # first, because it fails fast when the hub cannot be reached
    try:
        names = set(HfApi().list_repo_files(repo_id, revision=revision))
    except Exception as e:  # noqa: BLE001
        raise _translate(e, repo_id, revision, dest) from None
    weights = WEIGHT_FILES[fmt or "safetensors"]
    if fmt is None and weights not in names:
        weights = WEIGHT_FILES["bin"]  # older repos have only the PyTorch pickle
    for name in (*REQUIRED, weights):
        if name not in names:
            raise DownloadError(f"file {name} not found in {repo_id}@{revision}")
    return [config] + [metadata(name) for name in (*REQUIRED[1:], *[n for n in OPTIONAL if n in names], weights)]


def download(repo_id: str = OFFICIAL_REPO, *, revision: str = "main", dest: Path = DEFAULT_WEIGHTS,
             fmt: str | None = None, log=print) -> list[str]:
    """Fetch and verify the checkpoint files into `dest`; return the names of the files actually downloaded. A
    destination this call created is removed again when it fails before any file arrived."""
    from huggingface_hub import constants

    repo_id = SHORTHANDS.get(repo_id, repo_id)
    check_repo_id(repo_id)
    created = not dest.exists()
    check_destination(dest)
    try:
        if constants.HF_HUB_OFFLINE:
            return _offline(repo_id, dest, fmt, log)
        return _fetch(repo_id, revision, dest, fmt, log)
    except BaseException:
        if created and not any(f.is_file() for f in dest.rglob("*")):  # nothing to resume from: leave no trace
            shutil.rmtree(dest, ignore_errors=True)
        raise


def _fetch(repo_id: str, revision: str, dest: Path, fmt: str | None, log) -> list[str]:
    """download()'s transfers: list, skip what is verified in place, fetch and verify the rest."""
    from huggingface_hub import hf_hub_download

    files = list_remote(repo_id, revision, fmt, dest)
    todo = [f for f in files if verify(dest / f.name, f, repo_id) is not None]
    for f in files:
        if f not in todo:
            log(f"{f.name}: already in place ({f.size:,} bytes, verified)")
    needed = sum(f.size for f in todo)
    free = shutil.disk_usage(dest).free
    if needed > free:
        raise DownloadError(f"not enough space in {dest}: {needed / 2**20:,.0f} MiB to download, {free / 2**20:,.0f} MiB free")
    for f in todo:
        try:
            # force_download: we decided above that the file there (if any) is not the right one
            hf_hub_download(repo_id, f.name, revision=revision, local_dir=dest, force_download=True)
        except Exception as e:  # noqa: BLE001
            raise _translate(e, repo_id, revision, dest, f.name, transferring=True) from None
        problem = verify(dest / f.name, f, repo_id)
        if problem is not None:
            (dest / f.name).unlink(missing_ok=True)
            (dest / ".cache" / "huggingface" / "download" / f"{f.name}.metadata").unlink(missing_ok=True)
            raise DownloadError(f"{f.name}: downloaded file has {problem}; removed it (re-run to try again)")
        log(f"{f.name}: downloaded ({f.size:,} bytes, {'sha256' if f.is_lfs else 'git-sha1'} verified)")
    if not todo:
        log(f"everything in {dest} is in place and verified: nothing downloaded")
    return [f.name for f in todo]


def _offline(repo_id: str, dest: Path, fmt: str | None, log) -> list[str]:
    """HF_HUB_OFFLINE=1: no request at all; check the files already in `dest` (pinned hashes where known)."""
    weights = [WEIGHT_FILES[fmt]] if fmt else list(WEIGHT_FILES.values())
    present = [w for w in weights if (dest / w).is_file()]
    missing = [n for n in REQUIRED if not (dest / n).is_file()] + ([] if present else [weights[0]])
    if missing:
        raise DownloadError(f"offline (HF_HUB_OFFLINE is set) and {dest} lacks {', '.join(missing)}; "
                            f"copy the files into {dest} or unset HF_HUB_OFFLINE")
    for name in (*REQUIRED, present[0]):
        problem = verify(dest / name, None, repo_id)
        if problem is not None:
            raise DownloadError(f"{dest / name}: {problem}")
    log(f"offline: using the files already in {dest}" + (" (sha256 verified)" if repo_id == OFFICIAL_REPO else ""))
    return []


def check_loads(dest: Path) -> str:
    """Load the checkpoint with the project's loader (every shape checked); a one-line summary of the model."""
    from .core.config import GPT2Config
    from .core.tokenizer import load_tokenizer
    from .formats.hf import load_weights
    from .core.weights import parameter_count

    config = GPT2Config.from_json(dest / "config.json")
    load_weights(dest, config)
    load_tokenizer(dest)
    return (f"GPT-2 with {config.n_layer} layers, {config.n_head} heads, {config.n_embd} channels "
            f"({parameter_count(config) / 1e6:.0f}M parameters)")
