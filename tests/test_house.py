"""The package's shape: its import graph -- every `import` of a braidtrain module, at module level
and inside functions, read from the source with ast (nothing is imported) -- has no cycle, and
the lower layers import nothing above them (docs/architecture.md, "Layers and data flow"): model
code imports neither the layout nor parallel/, the processes' layer (collective/) nothing of the model."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "braidtrain"

# a part of braidtrain -> the parts it may import (besides itself); parts not named may import any
# part, as long as no cycle forms
MAY_IMPORT = {
    "errors": set(),
    "collective": {"errors"},
    "model": {"errors"},
    "parallel": {"errors", "collective", "model"},
    "layout": {"errors", "model", "parallel"},
    "io": {"errors", "collective", "model", "parallel"},
    "plan": {"errors", "config", "layout", "model", "parallel"},
}


def module_name(path: Path) -> str:
    parts = ["braidtrain", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str]) -> set[str]:
    """The braidtrain modules `path` imports anywhere in it (`from braidtrain.x import y`: the module
    braidtrain.x.y if there is one, else braidtrain.x)."""
    tree = ast.parse(path.read_text(), str(path))
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
    return {m for m in found if m in modules and m != here}


def graph() -> dict[str, set[str]]:
    files = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(f) for f in files}
    return {module_name(f): imports(f, modules) for f in files}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path [a, b, ..., a], or None."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(edges.get(m, ())):
            if state.get(n) == "open":
                return stack[stack.index(n):] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        state[m] = "done"
        stack.pop()
        return None

    for m in sorted(edges):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def part(module: str) -> str:
    """braidtrain.model.gpt2 -> model; braidtrain.layout -> layout."""
    return module.split(".")[1] if "." in module else module


def test_no_import_cycle():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_lower_layers_import_nothing_above_them():
    wrong = [f"{m} imports {n}" for m, targets in graph().items() for n in sorted(targets)
             if part(m) in MAY_IMPORT and part(n) != part(m) and part(n) not in MAY_IMPORT[part(m)]]
    assert not wrong, "; ".join(wrong)


def test_the_checks_see_what_they_look_for():
    """The graph has the edges the rules read (module and function level, `from x import module`),
    and a planted cycle and a planted upward import are caught."""
    g = graph()
    assert "braidtrain.train" in g["braidtrain.cli"]  # (a function-level import: cli.train)
    assert "braidtrain.plan.command" in g["braidtrain.cli"]  # (`from braidtrain.plan import command`)
    assert "braidtrain.model.protocol" in g["braidtrain.model.gpt2"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "d": {"a"}}) is None
    assert part("braidtrain.model.gpt2") == "model" and "parallel" not in MAY_IMPORT["model"]


def test_the_linter_sees_every_python_file(tmp_path):
    """`make test` lints with `ruff check .`; every tracked .py file is in what ruff reads. (ruff's
    default exclude list skips folders named dist, build, venv...: a package named so was never
    linted.) The planted case, in a scratch tree: a file under a `dist/` folder is not read."""
    import subprocess
    import sys

    def linted(root):
        out = subprocess.run([sys.executable, "-m", "ruff", "check", "--show-files", "."], cwd=root,
                             capture_output=True, text=True, check=True).stdout.split()
        return {str(Path(p).resolve().relative_to(Path(root).resolve())) for p in out if p.endswith(".py")}

    root = PACKAGE.parent
    tracked = set(subprocess.run(["git", "ls-files", "*.py"], cwd=root, capture_output=True, text=True,
                                 check=True).stdout.split())
    assert len(tracked) > 100, "git lists no tracked files: run the tests in a checkout"
    missing = sorted(tracked - linted(root))
    assert not missing, f"ruff does not check {missing}: rename the folder or include it in pyproject.toml"
    for f in ("pkg/dist/probe.py", "pkg/ok.py"):
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("x = 1\n")
    assert linted(tmp_path) == {"pkg/ok.py"}, "ruff now reads dist/: this check's premise changed"
