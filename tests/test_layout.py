"""The house's layers, as a contract: each folder (or top-level module) of the package is a room on a layer, and
every import runs down to a lower layer or stays inside its room. Counted from the code's own import statements
(function bodies included), so a new arrow that runs back up fails here first.

    layer 1   core/                   the model: config, weight types, the math, quantized layouts, kernels
    layer 2   formats/                files: Hugging Face, nanoGPT, llm.c, GGUF, token shards, PEFT, SAE files
    layer 3   interp/                 hook names and caches, SAE math, steering
    layer 4   runtime/  train/        generation and serving; training (neither imports the other)
              documents.py download.py
    layer 5   api.py  serve/          the GPT2 facade; the server's library (routes, protocol, async engine)
    layer 6   options.py harness.py inspect/
    layer 7   distributed/            Ray (imports serve/ and options, never the commands)
    layer 8   commands/               one module per subcommand
    layer 9   cli.py                  the parser; nothing imports it
    layer 10  __main__.py
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def imports(path: Path, typing_only: bool = True) -> set[str]:
    """Every module a file names in an import statement, anywhere in it (function bodies included); typing_only
    False leaves out those under `if TYPE_CHECKING:`, which name types for the checker and run nothing."""
    import ast

    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped = set()
    if not typing_only:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
                skipped |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
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


def graph(typing_only: bool = True) -> dict[str, set[str]]:
    files = sorted((ROOT / "gpt2_engine").rglob("*.py"))
    names = {".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): f for f in files}
    return {name: {m for m in imports(f, typing_only) if m in names and m != name} for name, f in names.items()}


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


LAYERS = {
    "core": 1, "formats": 2, "interp": 3, "runtime": 4, "train": 4, "documents": 4, "download": 4, "api": 5,
    "serve": 5, "options": 6, "harness": 6, "inspect": 6, "distributed": 7, "commands": 8, "cli": 9, "__main__": 10,
}


def room(module: str) -> str:
    """The room a module stands in: its folder under gpt2_engine/, or itself at the top level."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def room_edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for name, deps in graph().items():
        if name == "gpt2_engine":  # the package's face hands names on from below; it is no room
            continue
        edges.setdefault(room(name), set()).update(room(d) for d in deps if room(d) not in (room(name), "__init__"))
    return edges


def floors(edges: dict[str, set[str]]) -> int:
    """The length of the longest chain of imports (a room with no import of another stands on floor 1)."""
    depth: dict[str, int] = {}

    def floor(node: str) -> int:
        if node not in depth:
            depth[node] = 1 + max((floor(d) for d in edges.get(node, ())), default=0)
        return depth[node]

    return max(floor(n) for n in edges)


def closure(start: str, typing_only: bool = True) -> set[str]:
    """Every module `start` imports, directly or through others."""
    edges, seen, todo = graph(typing_only), set(), [start]
    while todo:
        for dep in edges[todo.pop()]:
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_every_room_has_a_layer() -> None:
    assert set(room_edges()) <= set(LAYERS), set(room_edges()) - set(LAYERS)


def test_every_import_runs_down_a_layer() -> None:
    up = [f"{a} -> {b}" for a, deps in graph().items() for b in deps
          if a != "gpt2_engine" and room(a) != room(b) and room(b) != "__init__" and LAYERS[room(b)] >= LAYERS[room(a)]]
    assert up == []


def test_the_house_stands_on_at_most_ten_floors() -> None:
    assert floors({"a": {"b"}, "b": {"c"}, "c": set(), "d": set()}) == 3
    edges = room_edges()
    # the scripts stand on top of whatever rooms they import
    edges["scripts"] = {room(m) for f in (ROOT / "scripts").glob("*.py") for m in imports(f)
                        if m.startswith("gpt2_engine.") and room(m) in LAYERS}
    assert "core" in edges["scripts"]
    assert find_cycle(edges) is None
    assert floors(edges) <= 10


def test_core_imports_nothing_outside_core() -> None:
    assert {d for name, deps in graph().items() if room(name) == "core" for d in deps if room(d) != "core"} == set()


def test_runtime_and_train_do_not_import_each_other() -> None:
    edges = room_edges()
    assert "train" not in edges["runtime"] and "runtime" not in edges["train"]


def test_the_scheduler_imports_data_only() -> None:
    """The planner never loads a file, runs the model or builds the native kernels, not even through another module:
    what it imports at run time (types named for the checker under TYPE_CHECKING aside) is data and pure functions."""
    package = {".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
               for f in (ROOT / "gpt2_engine").rglob("*.py")}
    banned = {m for m in package if m.startswith(("gpt2_engine.formats", "gpt2_engine.interp"))} | {
        "gpt2_engine.runtime.runner", "gpt2_engine.runtime.rows", "gpt2_engine.runtime.drafters",
        "gpt2_engine.runtime.prefix", "gpt2_engine.runtime.requests", "gpt2_engine.core.model",
        "gpt2_engine.core.projection", "gpt2_engine.core.kernels", "gpt2_engine.core.weights",
        "gpt2_engine.core.pages", "gpt2_engine.core.lora", "gpt2_engine.core.quantize", "gpt2_engine.core.numpy_ref"}
    for planner in ("gpt2_engine.runtime.scheduler", "gpt2_engine.runtime.plan"):
        assert closure(planner, typing_only=False) & banned == set(), planner
    assert "gpt2_engine.interp.spec" in closure("gpt2_engine.runtime.plan")  # the types are named, for the checker
    assert "gpt2_engine.core.kernels" in closure("gpt2_engine.runtime.runner")  # the check has teeth


READING_PATH = ["gpt2_engine/core/numpy_ref.py", "gpt2_engine/core/model.py", "gpt2_engine/runtime/greedy.py"]


def test_the_reading_path_is_short_named_first_and_linked() -> None:
    """The README's first screen names the reading path in order, with its true size; each file names the next."""
    lines = [len((ROOT / f).read_text(encoding="utf-8").splitlines()) for f in READING_PATH]
    assert sum(lines) < 700
    first_screen = "\n".join((ROOT / "README.md").read_text(encoding="utf-8").splitlines()[:30])
    places = [first_screen.find(f"[`{f}`]") for f in READING_PATH]
    assert -1 not in places and places == sorted(places)
    assert f"Three files, {sum(lines)} lines in all" in first_screen
    assert "one sitting" not in (ROOT / "README.md").read_text(encoding="utf-8")
    for here, there in zip(READING_PATH, READING_PATH[1:]):
        tail = (ROOT / here).read_text(encoding="utf-8").rstrip().splitlines()[-3:]
        assert any(line.startswith("# Next:") and there.removeprefix("gpt2_engine/") in line for line in tail), here


ENGINE_PATH = ["gpt2_engine/runtime/greedy.py", "gpt2_engine/runtime/loop.py", "gpt2_engine/runtime/scheduler.py",
               "gpt2_engine/runtime/runner.py", "gpt2_engine/core/kernels/block.cpp"]


def test_the_reading_path_goes_on_into_the_engine() -> None:
    """From greedy.py the path goes on through how the engine really decodes: each file's last lines name the next
    (loop -> scheduler -> runner -> the native block), and the last says it is the end."""
    for here, there in zip(ENGINE_PATH, ENGINE_PATH[1:]):
        tail = (ROOT / here).read_text(encoding="utf-8").rstrip().splitlines()[-4:]
        assert any(line.lstrip("#/ ").startswith("Next:") and there.removeprefix("gpt2_engine/") in line
                   for line in tail), here
    last = (ROOT / ENGINE_PATH[-1]).read_text(encoding="utf-8").rstrip().splitlines()[-3:]
    assert any("end of the engine's reading path" in line for line in last)
