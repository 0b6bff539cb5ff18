"""The package's import graph runs one way: no import circle, lazy (function-level) imports included,
and at most two imports from a lower layer to a higher one (docs/architecture.md).

The graph is read from the source with `ast`, so an import inside a function counts as much as one
at the top of a module: a lazy import may defer start-up cost, it may not hide a circle.
Mutation checks: adding `def _late(): from relpos_cli.cli import app` to relpos_cli/settings.py made
test_no_import_circle fail (settings -> cli -> jobs ... -> config -> settings); adding a function that
imports relpos_cli.inspect and relpos_cli.sample to relpos_cli/terminal.py (ground) made
test_at_most_two_upward_imports fail (3 upward imports); test_a_lazy_import_that_closes_a_circle_is_found
makes the first mutation on a copy of the package each run.
"""

from __future__ import annotations

import ast
import shutil
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "relpos_cli"

# Layers from the ground up: a module imports from its own layer (without a circle) or from lower
# ones. A name ending in "." stands for every module of that subpackage.
LAYERS: list[tuple[str, list[str]]] = [
    ("ground: no relpos imports but each other", [
        "relpos_cli", "errors", "atomic", "console", "registry", "compile_cache", "terminal", "interrupt",
        "sweep_signals", "renamed", "rope_options", "intervals"]),
    ("schema and run-dir layout", ["settings", "config", "results", "rundir", "logs", "requeue"]),
    ("data, position schemes, model, checkpoint, W&B sink", [
        "tokenizers", "data", "fingerprint", "tasks", "tasks.", "positions", "positions.", "families", "families.",
        "kernels", "kernels.", "attention", "model", "sampled_positions", "precision", "extension", "distributed",
        "checkpoint", "tracking", "plots"]),
    ("one run: train, evaluate, report, inspect, sample, import", [
        "lineage", "train", "evaluate", "report", "eval_task", "inspect", "sample", "importing", "tables",
        "lm_eval_model"]),
    ("many runs: find, load, label, summarise, compare", ["runs", "compare_accuracy", "compare"]),
    ("command line: sweep jobs, completion, commands", ["jobs", "completion", "cli", "__main__"]),
]
MAX_UPWARD = 2


def module_names(package: Path) -> dict[str, Path]:
    """relpos_cli.x.y -> its file, for every module of the package (a package is its __init__)."""
    names = {}
    for path in package.rglob("*.py"):
        parts = path.with_suffix("").relative_to(package.parent).parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def import_graph(package: Path) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(eager, lazy) edges between the package's modules: lazy = an import inside a function or block."""
    names = module_names(package)
    eager, lazy = defaultdict(set), defaultdict(set)
    for name, path in names.items():
        here = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = here.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
                # `from relpos_cli.positions import rope` imports the module relpos_cli.positions.rope
                candidates = [f"{base}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                candidates = [a.name for a in node.names]
            else:
                continue
            for candidate in candidates:
                parts = candidate.split(".")
                while parts and ".".join(parts) not in names:
                    parts.pop()
                target = ".".join(parts)
                if target and target != name:
                    (lazy if node.col_offset > 0 else eager)[name].add(target)
    return eager, lazy


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def layer_of(module: str) -> int:
    short = module.removeprefix("relpos_cli.") if module != "relpos_cli" else module
    for level, (_, members) in enumerate(LAYERS):
        if short in members or any(m.endswith(".") and short.startswith(m) for m in members):
            return level
    raise KeyError(module)


def all_edges(package: Path = PACKAGE) -> dict[str, set[str]]:
    eager, lazy = import_graph(package)
    return {m: eager.get(m, set()) | lazy.get(m, set()) for m in module_names(package)}


def upward(edges: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, targets in edges.items() for b in targets if layer_of(b) > layer_of(a))


def test_every_module_has_a_layer():
    missing = []
    for module in module_names(PACKAGE):
        try:
            layer_of(module)
        except KeyError:
            missing.append(module)
    assert not missing, f"place these modules in LAYERS (tests/test_layers.py) and docs/architecture.md: {missing}"


def test_no_import_circle():
    found = circles(all_edges())
    assert not found, f"import circles (lazy imports included): {found}"


def test_at_most_two_upward_imports():
    found = upward(all_edges())
    assert len(found) <= MAX_UPWARD, f"{len(found)} imports from a lower layer to a higher one: {found}"


def test_a_lazy_import_that_closes_a_circle_is_found(tmp_path):
    """The checker sees function-level imports: one added to a copy of the package closes a circle."""
    copy = tmp_path / "relpos_cli"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "conf"))
    settings = copy / "settings.py"
    settings.write_text(settings.read_text() + "\n\ndef _late():\n    from relpos_cli.cli import app\n\n    return app\n")
    edges = all_edges(copy)
    assert any({"relpos_cli.settings", "relpos_cli.cli"} <= set(c) for c in circles(edges))
    assert "relpos_cli.settings -> relpos_cli.cli" in upward(edges)
