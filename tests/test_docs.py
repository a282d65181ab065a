"""The README and docs/ say what the engine does: their examples run, their commands parse, their links resolve.

- Every ```console block is a shell session: each `$ COMMAND` line runs in bash (`gpt2` is this interpreter's
  command line), and the lines after it, up to the next `$`, are what it must print (stdout and stderr together). A
  shown line ending in `...` matches any printed line that begins with the rest, and `...` alone any number of
  lines: text that depends on the trained checkpoint's training run, which is made on the machine that runs the
  tests. A command shown failing (`gpt2 ...: error:`) must exit non-zero, the others zero.
- Every ```python block of the README runs as it is.
- Every `gpt2 ...` line of a ```sh block, on any page, is accepted by the `gpt2` parser: no page shows a flag or a
  subcommand that does not exist.
- Every relative link of every page points at a file of the checkout.

The examples run in a directory of their own, where `weights/` is the trained test checkpoint
(scripts/train_fixture.py), so that `gpt2 generate "..."` finds a model as it does in a checkout with the official
weights, and `corpus.txt` holds a few lines of text.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpt2_engine.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")
COMMAND_SECONDS = 300  # one example command: a model load and a short run, under a busy 2-core machine's load
CORPUS = ("Return the number of items in the list.\n\nRaise KeyError when the key is missing.\n\n"
          "Open the file and return a stream. The default value of the mode is 'r'.\n")


def blocks(page: Path, language: str) -> list[tuple[int, str]]:
    """(first line number, text) of every fenced block of a page in `language`."""
    text = page.read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start()) + 2, m.group(2)) for m in FENCE.finditer(text) if m.group(1) == language]


def params(pages: list[Path], language: str) -> list:
    return [pytest.param(body, id=f"{page.relative_to(ROOT)}:{line}") for page in pages
            for line, body in blocks(page, language)]


def sessions(body: str) -> list[tuple[str, list[str]]]:
    """A console block as (command, the lines shown after it) pairs."""
    out: list[tuple[str, list[str]]] = []
    for line in body.rstrip("\n").split("\n"):
        if line.startswith("$ "):
            out.append((line[2:], []))
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
def place(tmp_path_factory: pytest.TempPathFactory, trained_dir: Path) -> Path:
    """The examples' working directory: weights/ (the trained checkpoint) and corpus.txt."""
    here = tmp_path_factory.mktemp("examples")
    shutil.copytree(trained_dir, here / "weights")
    (here / "corpus.txt").write_text(CORPUS, encoding="utf-8")
    return here


def environment() -> dict[str, str]:
    """`gpt2` on PATH (this interpreter's bin/), this checkout's package, no colour, no network."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}", "NO_COLOR": "1",
           "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "COLUMNS": "120"}
    env.pop("FORCE_COLOR", None)
    return env


@pytest.mark.parametrize("body", params([README], "console"))
def test_the_readme_sessions_print_what_they_show(body: str, place: Path) -> None:
    for command, shown in sessions(body):
        proc = subprocess.run(["bash", "-c", command], cwd=place, env=environment(), capture_output=True, text=True,
                              timeout=COMMAND_SECONDS)
        text = (proc.stdout + proc.stderr).rstrip("\n")
        printed = text.split("\n") if text.strip() else []
        assert matches(shown, printed), f"$ {command}\nshown:\n" + "\n".join(shown) + "\nprinted:\n" + text
        fails = any(re.match(r"gpt2 [\w-]+: error: ", line) for line in shown)
        assert (proc.returncode != 0) == fails, f"$ {command}: exit {proc.returncode}\n{proc.stderr}"


@pytest.mark.parametrize("body", params([README], "python"))
def test_the_readme_python_runs(body: str, place: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", body], cwd=place, env=environment(), capture_output=True, text=True,
                          timeout=COMMAND_SECONDS)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def gpt2_lines(body: str) -> list[str]:
    """The `gpt2 ...` commands of a shell block, their comments dropped and continued lines joined."""
    out, pending = [], ""
    for line in body.split("\n"):
        line = pending + line
        pending = ""
        if line.rstrip().endswith("\\"):
            pending = line.rstrip()[:-1] + " "
            continue
        words = line.split("#")[0] if "#" in line and not line.lstrip().startswith("#") else line
        if words.lstrip().startswith("gpt2 "):
            out.append(words.strip())
    return out


SHELL_ONLY = re.compile(r"\$'|\$\(|[|<>;&]")  # the shell's own quoting, substitutions, pipes and redirections


@pytest.mark.parametrize("body", params(PAGES, "sh"))
def test_every_gpt2_command_shown_parses(body: str) -> None:
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
