"""The package's layers import downward only: no import cycle between its files, and nothing imports cli.py."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def imports(path: Path) -> set[str]:
    """Every module a file names in an import statement, anywhere in it (function bodies included)."""
    import ast

    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(max(node.level - 1, 0)):
                base = base.rpartition(".")[0]
            module = f"{base}.{node.module}" if node.level and node.module else (base if node.level else node.module)
            found.add(module)
            found |= {f"{module}.{a.name}" for a in node.names}
    return found


def graph() -> dict[str, set[str]]:
    files = sorted((ROOT / "gpt2_engine").rglob("*.py"))
    names = {".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): f for f in files}
    return {name: {m for m in imports(f) if m in names and m != name} for name, f in names.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as the modules along it (the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [node, nxt] if nxt in path else [node, nxt]
            if nxt not in state and (cycle := visit(nxt, path + [node])):
                return cycle
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node, [])):
            return cycle
    return None


def test_the_cycle_finder_finds_cycles() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycles_in_the_package() -> None:
    assert find_cycle(graph()) is None


def test_nothing_imports_the_command_line() -> None:
    assert [name for name, deps in graph().items() if "gpt2_engine.cli" in deps and name != "gpt2_engine.__main__"] == []
