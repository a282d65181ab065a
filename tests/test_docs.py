"""The README and docs/ say what the engine does: their examples run, their links resolve.

- Every fenced block of every page either runs here or says why not in its info string (```sh not run: REASON):
  no example escapes silently. Those that do not run still have each `gpt2 ...` line (or `$ gpt2 ...` line) accepted
  by the `gpt2` parser: no page shows a flag or a subcommand that does not exist.
- A ```console block is a shell session: each `$ COMMAND` line runs in bash (`gpt2` is this interpreter's command
  line), and the lines after it, up to the next `$`, are what it must print (stdout and stderr together). A shown line
  ending in `...` matches any printed line that begins with the rest, a `...` inside a line any text there, and `...`
  alone any number of lines: text that depends on the trained checkpoint's training run, which is made on the machine
  that runs the tests, or on timings. A command shown failing (`gpt2 ...: error:`) must exit non-zero, the others zero.
- The ```pycon blocks of a page are one doctest (Python's doctest, ELLIPSIS and NORMALIZE_WHITESPACE), run in page
  order in one namespace, so a page loads its model once. A ```python block runs as it is.
- Every relative link of every page points at a file of the checkout.

The examples run in a directory of their own (the working directory of the sessions and doctests): `weights/` is the
trained test checkpoint (scripts/train_fixture.py), so that `gpt2 generate "..."` finds a model as it does in a
checkout with the official weights; `saes/` the SAEs sae-lens made on it (scripts/sae_reference.py; `topk-mlp`,
`standard-resid`, `openai-topk.pt`, ...); `notes/` two text files and `corpus.txt` their text; `corpus.jsonl` the same
documents as JSON lines; `happy.pt` a direction of the residual stream's width (the topk SAE's feature 77 decoder
row). Blocks that talk to `127.0.0.1:8000` (or `localhost:8000`) are sent to one `gpt2 serve` the test starts on a
free port of 127.0.0.1 on those weights, with `--sae topk=saes/topk-mlp --steering-vector happy=happy.pt`: the port
is substituted for 8000; the server is stopped at the end.
"""
from __future__ import annotations

import doctest
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import THREADS, gpt2_serve
from gpt2_engine.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)([^\n]*)\n(.*?)^```", re.S | re.M)
RUN = ("console", "pycon", "python")  # the kinds of block this file executes
NOT_RUN = re.compile(r"\bnot run: \S")  # an info string saying why a block is not executed
SERVED = re.compile(r"(127\.0\.0\.1|localhost):8000")  # the port the pages show, where the test's server listens
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")
COMMAND_SECONDS = 300  # one example command: a model load and a short run, under a busy 2-core machine's load
NOTES = {"lists.txt": "Return the number of items in the list.\n\nRaise KeyError when the key is missing.\n",
         "files.txt": "Open the file and return a stream. The default value of the mode is 'r'.\n"}
CORPUS = "\n".join(NOTES.values())


def fenced(page: Path) -> list[tuple[int, str, str, str]]:
    """(first line number, language, the rest of the info string, text) of every fenced block of a page."""
    text = page.read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start()) + 2, *m.groups()) for m in FENCE.finditer(text)]


def blocks(page: Path, language: str) -> list[tuple[int, str]]:
    """(first line number, text) of every fenced block of a page in `language` that runs."""
    return [(line, body) for line, lang, info, body in fenced(page) if lang == language and not NOT_RUN.search(info)]


def params(pages: list[Path], language: str) -> list:
    """A block per page and line; a session that trains a model is marked long (make test-long runs it)."""
    return [pytest.param(body, id=f"{page.relative_to(ROOT)}:{line}",
                         marks=[pytest.mark.long] if re.search(r"^\$ gpt2 finetune ", body, re.M) else [])
            for page in pages for line, body in blocks(page, language)]


def sessions(body: str) -> list[tuple[str, list[str]]]:
    """A console block as (command, the lines shown after it) pairs; a command ending in `\\` goes on to the next line."""
    out: list[tuple[str, list[str]]] = []
    for line in body.rstrip("\n").split("\n"):
        if line.startswith("$ "):
            out.append((line[2:], []))
        elif out and not out[-1][1] and out[-1][0].endswith("\\"):
            out[-1] = (f"{out[-1][0]}\n{line}", [])
        elif not out:
            raise AssertionError(f"a console block's lines come after a `$ ` command: {line!r}")
        else:
            out[-1][1].append(line)
    return out


def matches(shown: list[str], printed: list[str]) -> bool:
    """Whether `printed` is what `shown` says, line by line, with `...` as the module docstring says."""
    if not shown:
        return not printed
    head, rest = shown[0], shown[1:]
    if head.strip() == "...":
        return any(matches(rest, printed[i:]) for i in range(len(printed) + 1))
    if not printed:
        return False
    line = printed[0].rstrip()
    parts = head.rstrip().split("...")  # a `...` inside a line stands for any text there
    same = re.fullmatch(".*?".join(map(re.escape, parts)), line, re.S) is not None
    return same and matches(rest, printed[1:])


@pytest.fixture(scope="module")
def place(tmp_path_factory: pytest.TempPathFactory, trained_dir: Path, saes_dir: Path) -> Path:
    """The examples' working directory, as the module docstring says."""
    import json

    import torch
    from safetensors.torch import load_file

    here = tmp_path_factory.mktemp("examples")
    shutil.copytree(trained_dir, here / "weights")
    shutil.copytree(saes_dir, here / "saes")
    (here / "notes").mkdir()
    for name, text in NOTES.items():
        (here / "notes" / name).write_text(text, encoding="utf-8")
    (here / "corpus.txt").write_text(CORPUS, encoding="utf-8")
    lines = [json.dumps({"text": text}) for text in CORPUS.split("\n\n")]
    (here / "corpus.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    torch.save(load_file(here / "saes/topk-mlp/sae_weights.safetensors")["W_dec"][77].clone(), here / "happy.pt")
    return here


@pytest.fixture(scope="module")
def server(place: Path):
    """One `gpt2 serve` on the examples' weights, SAE and vector: its address, for the pages' 127.0.0.1:8000."""
    args = ("--weights", "weights", "--sae", "topk=saes/topk-mlp", "--steering-vector", "happy=happy.pt")
    with gpt2_serve(*args, "--threads", str(THREADS), cwd=place) as (url, _):
        yield url.removeprefix("http://")


def served(body: str, request: pytest.FixtureRequest) -> str:
    """A block with the test server's address in place of 127.0.0.1:8000, started at the first block that needs it."""
    return SERVED.sub(request.getfixturevalue("server"), body) if SERVED.search(body) else body


def environment() -> dict[str, str]:
    """`gpt2` on PATH (this interpreter's bin/), this checkout's package, no colour, no network."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}", "NO_COLOR": "1",
           "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "COLUMNS": "120"}
    env.pop("FORCE_COLOR", None)
    return env


@pytest.mark.parametrize("body", params(PAGES, "console"))
def test_the_sessions_print_what_they_show(body: str, place: Path, request: pytest.FixtureRequest) -> None:
    for command, shown in sessions(served(body, request)):
        proc = subprocess.run(["bash", "-c", command], cwd=place, env=environment(), capture_output=True, text=True,
                              timeout=COMMAND_SECONDS)
        text = (proc.stdout + proc.stderr).rstrip("\n")
        printed = text.split("\n") if text.strip() else []
        assert matches(shown, printed), f"$ {command}\nshown:\n" + "\n".join(shown) + "\nprinted:\n" + text
        fails = any(re.match(r"gpt2 [\w-]+: error: ", line) for line in shown)
        assert (proc.returncode != 0) == fails, f"$ {command}: exit {proc.returncode}\n{proc.stderr}"


@pytest.mark.parametrize("body", params(PAGES, "python"))
def test_the_python_runs(body: str, place: Path, request: pytest.FixtureRequest) -> None:
    proc = subprocess.run([sys.executable, "-c", served(body, request)], cwd=place, env=environment(),
                          capture_output=True, text=True, timeout=COMMAND_SECONDS)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p, "pycon")], ids=lambda p: str(p.relative_to(ROOT)))
def test_the_python_sessions_print_what_they_show(page: Path, place: Path, request: pytest.FixtureRequest,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(place)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report: list[str] = []
    globs: dict = {}
    for line, body in blocks(page, "pycon"):
        test = doctest.DocTestParser().get_doctest(served(body, request), globs, page.name, str(page), line - 1)
        runner.run(test, out=report.append, clear_globs=False)
        globs = test.globs  # the page's blocks share one namespace, as a doctest file's do
    assert runner.failures == 0, "".join(report)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_block_runs_or_says_why_not(page: Path) -> None:
    silent = [f"{page.relative_to(ROOT)}:{line} ```{lang}{info}" for line, lang, info, _ in fenced(page)
              if lang not in RUN and not NOT_RUN.search(info)]
    assert not silent, f"blocks neither run nor tagged `not run: REASON`: {silent}"


def gpt2_lines(body: str) -> list[str]:
    """The `gpt2 ...` commands of a shell block (or a session's `$ gpt2 ...`), their comments dropped and continued
    lines joined."""
    out, pending = [], ""
    for line in body.split("\n"):
        line = pending + line.removeprefix("$ ")
        pending = ""
        if line.rstrip().endswith("\\"):
            pending = line.rstrip()[:-1] + " "
            continue
        words = line.split("#")[0] if "#" in line and not line.lstrip().startswith("#") else line
        if words.lstrip().startswith("gpt2 "):
            out.append(words.strip())
    return out


SHELL_ONLY = re.compile(r"\$'|\$\(|[|<>;&]")  # the shell's own quoting, substitutions, pipes and redirections


@pytest.mark.parametrize("body", [pytest.param(body, id=f"{page.relative_to(ROOT)}:{line}") for page in PAGES
                                  for line, _, info, body in fenced(page) if NOT_RUN.search(info)])
def test_every_gpt2_command_not_run_parses(body: str) -> None:
    parser = build_parser()
    for command in gpt2_lines(body):
        words = shlex.split(SHELL_ONLY.split(command)[0]) if SHELL_ONLY.search(command) else shlex.split(command)
        try:
            parser.parse_args(words[1:])
        except SystemExit as e:
            pytest.fail(f"`{command}` is refused by the parser (exit {e.code})")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    broken = [target for target, _ in LINK.findall(text)
              if "://" not in target and not target.startswith("mailto:") and not (page.parent / target).exists()]
    assert not broken, f"{page.relative_to(ROOT)} links to missing files: {broken}"


def test_the_matcher() -> None:
    assert matches(["a", "b..."], ["a", "bcd"]) and not matches(["a", "b"], ["a", "bcd"])
    assert matches(["a", "...", "z"], ["a", "x", "y", "z"]) and matches(["...", "z"], ["z"])
    assert not matches(["a"], ["a", "b"]) and not matches(["a", "b"], ["a"])
    assert matches(["load ... | prompt 4 tokens | ..."], ["load 0.2 s | prompt 4 tokens | 10 new"])
    assert not matches(["load ... | prompt 4 tokens"], ["load 0.2 s | prompt 5 tokens"])
    assert gpt2_lines("gpt2 a --b \\\n  --c   # note\n# gpt2 x\nmake y") == ["gpt2 a --b    --c"]
    assert gpt2_lines("$ gpt2 a\nprinted") == ["gpt2 a"]
    assert sessions("$ a \\\n  b\nout\n$ c") == [("a \\\n  b", ["out"]), ("c", [])]
