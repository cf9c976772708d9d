"""The package's layers: imports go one way (down, or sideways into data/ and ops/), no cycles.

    config, paths, ops <- data, model <- training <- inference <- analysis, interop <- runner
        <- planning <- launch <- cli

A module may import its own layer and any layer to its left, never one to its right; only the
entry points (tx_jax/__main__.py, tx_jax/main.py) import cli/. The modules are read with `ast`,
every import counted, also those inside functions, so a lazy import cannot hide a cycle.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "tx_jax"
RANK = {
    "config": 0, "ops": 0, "paths": 0,
    "data": 1, "model": 1,
    "training": 2,
    "inference": 3,
    "analysis": 4, "interop": 4,
    "runner": 5,
    "planning": 6,
    "launch": 7,
    "cli": 8,
    "entry": 9, "api": 9,
}  # fmt: skip
ENTRY_POINTS = {"main", "__main__"}  # python -m tx_jax.main, python -m tx_jax


def layer_of(module: str) -> str:
    """'tx_jax.inference.restore' -> 'inference'; tx_jax/__main__.py and main.py -> 'entry'."""
    parts = module.split(".")[1:]
    if not parts:
        return "api"
    if len(parts) == 1 and parts[0] in ENTRY_POINTS:
        return "entry"
    return parts[0]


def module_path(module: str) -> pathlib.Path | None:
    """The file of a tx_jax module name (a package's __init__.py), or None."""
    base = PACKAGE.parent.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imports_of(path: pathlib.Path, module: str) -> set[str]:
    """tx_jax modules that `path` imports anywhere in its body ('from tx_jax.a import b' is
    tx_jax.a.b when that is a module, else tx_jax.a)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "tx_jax")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            if base.split(".")[0] != "tx_jax":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if module_path(sub) else base)
    return found - {module}


def package_graph() -> dict[str, set[str]]:
    graph = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        module = ".".join(parts)
        graph[module] = imports_of(path, module)
    return graph


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """One message per import that goes up, sideways between layers, or into cli/."""
    out = []
    for source, targets in sorted(graph.items()):
        a = layer_of(source)
        for target in sorted(targets):
            b = layer_of(target)
            if a == b or b == "api" and a in ("entry",):
                continue
            up = RANK[b] >= RANK[a]
            into_cli = b == "cli" and a != "entry"
            if up or into_cli:
                out.append(f"{_file(source)} ({a}) imports {_file(target)} ({b})")
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import cycle, each as the list of modules around it (found by depth-first search)."""
    found, state, stack = [], {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def _file(module: str) -> str:
    path = module_path(module)
    return str(path.relative_to(PACKAGE.parent)) if path else module


# ---------------------------------------------------------------------- the package


def test_every_module_belongs_to_a_known_layer():
    unknown = sorted(m for m in package_graph() if layer_of(m) not in RANK)
    assert not unknown, f"modules outside the layers {sorted(RANK)}: {unknown}"


def test_imports_go_one_way():
    violations = layer_violations(package_graph())
    assert not violations, "imports against the layer order:\n" + "\n".join(violations)


def test_no_import_cycles():
    found = cycles(package_graph())
    assert not found, "import cycles:\n" + "\n".join(
        " -> ".join(_file(m) for m in cycle) for cycle in found
    )


def test_no_library_module_imports_cli():
    graph = package_graph()
    bad = [
        f"{_file(s)} imports {_file(t)}"
        for s, ts in graph.items()
        for t in ts
        if layer_of(t) == "cli" and layer_of(s) not in ("cli", "entry")
    ]
    assert not bad, "\n".join(bad)


def readme_tree() -> set[str]:
    """The files and folders docs/design.md's Architecture tree lists, as paths under tx_jax/."""
    text = (PACKAGE.parent / "docs" / "design.md").read_text()
    block = text.split("## Architecture", 1)[1].split("```", 2)[1]
    listed, folder = set(), ""
    for line in block.splitlines()[1:]:
        indent = len(line) - len(line.lstrip())
        names = line.strip().split("  ")[0].split()
        if indent == 2 and names and names[0].endswith("/"):
            folder = names[0]
            listed.add(folder)
        elif indent == 2:
            folder = ""
        if indent in (2, 4):
            listed.update(folder * (indent == 4) + n for n in names if n.endswith(".py"))
    return listed


def test_readme_architecture_tree_matches_the_package():
    actual = {
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if p.name != "__init__.py" or p.parent == PACKAGE
    } | {f"{p.name}/" for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    listed = readme_tree()
    assert listed == actual, (
        f"in the package, not in docs/design.md: {sorted(actual - listed)}; "
        f"in docs/design.md, not in the package: {sorted(listed - actual)}"
    )


# ---------------------------------------------------------------------- the checker itself


def test_checker_names_both_files_of_an_upward_import():
    graph = {"tx_jax.model.layers": {"tx_jax.training.step"}, "tx_jax.training.step": set()}
    (message,) = layer_violations(graph)
    assert message == ("tx_jax/model/layers.py (model) imports tx_jax/training/step.py (training)")
    assert layer_violations({"tx_jax.model.layers": {"tx_jax.ops.matmul"}}) == []


@pytest.mark.parametrize(
    "source, target",
    [
        ("tx_jax.data.tasks", "tx_jax.model.transformer"),  # sideways between layers
        ("tx_jax.inference.restore", "tx_jax.cli.common"),  # a library module into cli/
        ("tx_jax", "tx_jax.cli.train"),  # the public API into cli/
        ("tx_jax.training.step", "tx_jax.runner.loop"),  # up
    ],
)
def test_checker_rejects(source, target):
    assert len(layer_violations({source: {target}})) == 1


def test_checker_finds_a_cycle_and_its_path():
    graph = {
        "tx_jax.inference.a": {"tx_jax.inference.b"},
        "tx_jax.inference.b": {"tx_jax.inference.c"},
        "tx_jax.inference.c": {"tx_jax.inference.a"},
        "tx_jax.inference.d": {"tx_jax.inference.a"},
    }
    assert cycles(graph) == [
        ["tx_jax.inference.a", "tx_jax.inference.b", "tx_jax.inference.c", "tx_jax.inference.a"]
    ]
    assert cycles({"tx_jax.inference.a": {"tx_jax.inference.b"}}) == []


def test_lazy_imports_count(tmp_path):
    """An import inside a function is still an import (it would hide a cycle otherwise)."""
    path = tmp_path / "m.py"
    path.write_text("def f():\n    from tx_jax.runner import loop\n")
    assert imports_of(path, "tx_jax.inference.m") == {"tx_jax.runner.loop"}
