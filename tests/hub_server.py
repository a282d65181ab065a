"""A small HTTP server on 127.0.0.1 that imitates the Hugging Face Hub for one repository (see HUB_PROTOCOL.md).

It serves what the real huggingface_hub client asks for: the model info and tree listings, and HEAD/GET of
`/{repo}/resolve/{revision}/{file}` with X-Repo-Commit, ETag / X-Linked-Etag, X-Linked-Size, Content-Length and
Range. Switches make it misbehave on purpose: corrupt bytes of the right size, or a connection cut mid-file.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

LFS_FILES = {"model.safetensors", "pytorch_model.bin"}


@dataclass
class FakeRepo:
    repo_id: str
    files: dict[str, bytes]
    commit: str = "0123456789abcdef0123456789abcdef01234567"
    revisions: tuple[str, ...] = ("main",)

    def etag(self, name: str) -> str:
        data = self.files[name]
        if name in LFS_FILES:
            return hashlib.sha256(data).hexdigest()
        return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Behaviour:
    corrupt: set[str] = field(default_factory=set)  # files served with one byte flipped (same size)
    cut_file: str | None = None  # a file whose first GET stops after cut_after bytes, resumed GETs after 0...
    cut_after: int = 0
    cuts_left: int = 0  # ...this many times
    requests: list[tuple[str, str]] = field(default_factory=list)  # (method, path) of every request


class FakeHub:
    """Start with `with FakeHub(repo) as hub:`; hub.endpoint is the HF_ENDPOINT to use."""

    def __init__(self, repo: FakeRepo) -> None:
        self.repo = repo
        self.behaviour = Behaviour()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def gets(self, name: str) -> int:
        """How many GET requests were made for file `name`."""
        return sum(1 for m, p in self.behaviour.requests if m == "GET" and p.endswith("/" + name) and "/resolve/" in p)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        return type("Handler", (HubHandler,), {"hub": self})


def repo_from_directory(repo_id: str, directory: Path, names: tuple[str, ...]) -> FakeRepo:
    return FakeRepo(repo_id, {n: (directory / n).read_bytes() for n in names if (directory / n).exists()})


class HubHandler(BaseHTTPRequestHandler):
    """The Hub's file and API routes, as huggingface_hub asks for them, over `hub`'s repo and behaviour."""

    protocol_version = "HTTP/1.1"
    hub: FakeHub  # set by FakeHub on a subclass of its own

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_GET(self) -> None:
        self._serve(body=True)

    def _error(self, code: int, error_code: str, message: str) -> None:
        data = json.dumps({"error": message}).encode()
        self.send_response(code)
        self.send_header("X-Error-Code", error_code)
        self.send_header("X-Error-Message", message)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(data)

    def _json(self, obj: object) -> None:
        data = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(data)

    def _serve(self, body: bool) -> None:
        path = unquote(urlparse(self.path).path)
        self.hub.behaviour.requests.append((self.command, path))
        repo = self.hub.repo
        if path.startswith("/api/models/"):
            return self._api(path[len("/api/models/") :])
        if "/resolve/" not in path:
            return self._error(404, "EntryNotFound", "not found")
        repo_id, rest = path.lstrip("/").split("/resolve/", 1)
        revision, _, name = rest.partition("/")
        if repo_id != repo.repo_id:
            return self._error(404, "RepoNotFound", f"Repository {repo_id} not found")
        if revision not in repo.revisions and revision != repo.commit:
            return self._error(404, "RevisionNotFound", f"Revision {revision} not found")
        if name not in repo.files:
            return self._error(404, "EntryNotFound", f"{name} does not exist")
        self._file(name, repo.files[name], body)

    def _file(self, name: str, data: bytes, body: bool) -> None:
        repo = self.hub.repo
        if name in self.hub.behaviour.corrupt:
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        start = 0
        rng = self.headers.get("Range")
        if rng and rng.startswith("bytes=") and rng.endswith("-"):
            start = int(rng[len("bytes=") : -1])
        self.send_response(206 if start else 200)
        self.send_header("X-Repo-Commit", repo.commit)
        etag = repo.etag(name)
        self.send_header("ETag", f'"{etag}"')
        if name in LFS_FILES:
            self.send_header("X-Linked-Etag", f'"{etag}"')
            self.send_header("X-Linked-Size", str(len(data)))
        self.send_header("Accept-Ranges", "bytes")
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.send_header("Content-Length", str(len(data) - start))
        self.end_headers()
        if not body:
            return
        b = self.hub.behaviour
        if b.cut_file == name and b.cuts_left > 0:
            b.cuts_left -= 1
            sent = b.cut_after if start == 0 else 0  # resumed requests get nothing: the peer is gone
            self.wfile.write(data[start : start + sent])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)  # the connection drops mid-file
            return
        self.wfile.write(data[start:])

    def _api(self, rest: str) -> None:
        repo = self.hub.repo
        for marker in ("/revision/", "/tree/"):
            if marker in rest:
                repo_id, revision = rest.split(marker, 1)
                break
        else:
            repo_id, marker, revision = rest, "/revision/", "main"
        if repo_id != repo.repo_id:
            return self._error(404, "RepoNotFound", f"Repository {repo_id} not found")
        revision = revision.split("/")[0]
        if revision not in repo.revisions and revision != repo.commit:
            return self._error(404, "RevisionNotFound", f"Revision {revision} not found")
        if marker == "/revision/":
            return self._json({"id": repo.repo_id, "modelId": repo.repo_id, "sha": repo.commit,
                               "siblings": [{"rfilename": n} for n in sorted(repo.files)]})
        entries = []
        for n in sorted(repo.files):
            entry = {"type": "file", "oid": repo.etag(n) if n not in LFS_FILES else "0" * 40,
                     "size": len(repo.files[n]), "path": n}
            if n in LFS_FILES:
                entry["lfs"] = {"oid": repo.etag(n), "size": len(repo.files[n]), "pointerSize": 134}
            entries.append(entry)
        return self._json(entries)
