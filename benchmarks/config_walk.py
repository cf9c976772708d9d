"""The static walk of `config` from the training entry point: where the config travels, read
from the source with `ast` (nothing runs), and how often it climbs back up the layers.

    python benchmarks/config_walk.py            the walk, then its counts
    python benchmarks/config_walk.py --counts   the counts only

Definition. The walk starts at tx_jax/runner/loop.py:train_and_evaluate and follows, in source
order and depth first, every call one of whose arguments is the config or a part of it: the
name `config`, a name bound from it (`cfg = config.train`, `d, t = config.data, config.train`),
an attribute, subscript or method call on one of those (`config.model`, `c.data.get("x")`,
`config["train"]`), any `X.config` (`run.config`), and in a callee each parameter that one
such argument was passed to. The callee is resolved to a function defined in tx_jax through the
module's imports (a package's re-exports followed), its own top-level functions, module
attributes (`sizing.size_run`), methods of a class named where it is called
(`ModelConfig.from_config`, `self.method` in the class, a class called: its __init__ or
__post_init__). Calls through values whose class is not known (`run.strategy.x(config)`) are
not followed. Each function is visited once, the first time it is reached; the sequence of
visits is the walk, each visit a "stay" in its file. A climb back up is a step from one stay to
the next whose file is in a higher layer than the previous stay's (tests/test_imports.py's
order; runner/ is one layer).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from test_imports import RANK, layer_of  # noqa: E402

PACKAGE = ROOT / "tx_jax"
START = ("tx_jax.runner.loop", "train_and_evaluate")


@dataclasses.dataclass(frozen=True)
class Stay:
    module: str
    function: str  # 'f' or 'Class.method'

    @property
    def layer(self) -> str:
        return layer_of(self.module)

    @property
    def file(self) -> str:
        return module_file(self.module).relative_to(ROOT).as_posix()


def module_file(module: str) -> pathlib.Path | None:
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


class Module:
    """One tx_jax module read: its functions, classes and what its names import."""

    def __init__(self, name: str, path: pathlib.Path):
        self.name = name
        self.tree = ast.parse(path.read_text(), str(path))
        self.functions: dict[str, ast.FunctionDef] = {}
        self.classes: dict[str, dict[str, ast.FunctionDef]] = {}
        self.imports: dict[str, tuple[str, str | None]] = {}  # name -> (module, attr or None)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in self.tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                self.functions[node.name] = node
            elif isinstance(node, ast.ClassDef):
                self.classes[node.name] = {
                    n.name: n
                    for n in node.body
                    if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
                }
        for node in ast.walk(self.tree):  # lazy imports inside functions too
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("tx_jax") and a.asname:
                        self.imports[a.asname] = (a.name, None)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                if not base.startswith("tx_jax"):
                    continue
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    target = (sub, None) if module_file(sub) else (base, a.name)
                    self.imports[a.asname or a.name] = target


class Walker:
    def __init__(self):
        self.aliases: dict[str, list[Stay]] = {}
        self.modules: dict[str, Module] = {}
        self.seen: set[Stay] = set()
        self.walk: list[Stay] = []

    def module(self, name: str) -> Module | None:
        if name not in self.modules:
            path = module_file(name)
            if path is None:
                return None
            self.modules[name] = Module(name, path)
        return self.modules[name]

    def definition(self, module: str, name: str, depth: int = 0):
        """('function', module, name) or ('class', module, name) or ('module', name, None)
        for `name` as `module` sees it (imports and re-exports followed), or None."""
        mod = self.module(module)
        if mod is None or depth > 10:
            return None
        if name in mod.functions:
            return ("function", module, name)
        if name in mod.classes:
            return ("class", module, name)
        if name in mod.imports:
            target, attr = mod.imports[name]
            if attr is None:
                return ("module", target, None)
            return self.definition(target, attr, depth + 1)
        if module_file(f"{module}.{name}"):
            return ("module", f"{module}.{name}", None)
        return None

    def resolve(self, module: str, cls: str | None, func: ast.expr) -> list[Stay]:
        """The tx_jax functions a call of `func` in `module` (inside class `cls`) runs."""
        if isinstance(func, ast.Name) and func.id in self.aliases:
            return self.aliases[func.id]
        if isinstance(func, ast.Name):
            found = self.definition(module, func.id)
        elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            if func.value.id in ("self", "cls") and cls:
                methods = self.module(module).classes.get(cls, {})
                return [Stay(module, f"{cls}.{func.attr}")] if func.attr in methods else []
            owner = self.definition(module, func.value.id)
            if owner is None:
                return []
            if owner[0] == "module":
                found = self.definition(owner[1], func.attr)
            elif owner[0] == "class":
                methods = self.module(owner[1]).classes[owner[2]]
                return [Stay(owner[1], f"{owner[2]}.{func.attr}")] if func.attr in methods else []
            else:
                return []
        else:
            return []
        if found is None or found[0] == "module":
            return []
        kind, where, name = found
        if kind == "function":
            return [Stay(where, name)]
        methods = self.module(where).classes[name]
        return [Stay(where, f"{name}.{m}") for m in ("__init__", "__post_init__") if m in methods]

    def node(self, stay: Stay) -> ast.FunctionDef:
        mod = self.module(stay.module)
        if "." in stay.function:
            cls, name = stay.function.split(".")
            return mod.classes[cls][name]
        return mod.functions[stay.function]

    def visit(self, stay: Stay, carried: dict[str, bool]) -> None:
        """Walk `stay` once; `carried`: its parameters given the config (True: a part of it,
        False: a holder of it)."""
        if stay in self.seen:
            return
        self.seen.add(stay)
        self.walk.append(stay)
        cls = stay.function.split(".")[0] if "." in stay.function else None
        fn = self.node(stay)
        names = Names({p for p, part in carried.items() if part} | {"config"})
        # a name that holds the config (`run`, read as `run.config`) carries it as a whole
        names.holders = {p for p, part in carried.items() if not part} | reads_config(fn)
        outer, self.aliases = self.aliases, {}
        for statement in fn.body:
            self.statement(stay, cls, statement, names)
        self.aliases = outer

    def statement(self, stay: Stay, cls: str | None, node: ast.AST, names: Names) -> None:
        """Follow the calls in `node` in source order; bind names assigned from the config."""
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda):
            return  # a nested definition runs when called, not here
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            self.statement(stay, cls, node.value, names)
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                self.bind(target, node.value, names)
                if isinstance(target, ast.Name):  # `prepare = a.f if x else b.g`: f and g
                    options = (
                        [node.value.body, node.value.orelse]
                        if isinstance(node.value, ast.IfExp)
                        else [node.value]
                    )
                    found = [s for o in options for s in self.resolve(stay.module, cls, o)]
                    if found:
                        self.aliases[target.id] = self.aliases.get(target.id, []) + found
            return
        if isinstance(node, ast.Call):
            for child in [node.func, *node.args, *(k.value for k in node.keywords)]:
                self.statement(stay, cls, child, names)
            params = self.carried_params(stay.module, cls, node, names)
            for callee, carried in params:
                self.visit(callee, carried)
            return
        for child in ast.iter_child_nodes(node):
            self.statement(stay, cls, child, names)

    def bind(self, target: ast.expr, value: ast.expr, names: Names) -> None:
        if isinstance(target, ast.Name) and is_config(value, names):
            names.add(target.id)
        elif isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple):
            for t, v in zip(target.elts, value.elts):
                self.bind(t, v, names)

    def carried_params(self, module, cls, call: ast.Call, names):
        """(callee, its parameters that receive the config: True for a part of it, False for a
        holder) for each callee of `call` that is given the config, a part of it, or a value
        it reads the config from (a parameter `p` read as `p.config`: `build_run(sized)`)."""
        out = []
        for callee in self.resolve(module, cls, call.func):
            fn = self.node(callee)
            params = [a.arg for a in [*fn.args.posonlyargs, *fn.args.args]]
            if "." in callee.function and params and params[0] in ("self", "cls"):
                params = params[1:]
            holders = reads_config(fn)
            given = [(params[i] if i < len(params) else None, a) for i, a in enumerate(call.args)]
            given += [(k.arg, k.value) for k in call.keywords if k.arg]
            carried = {}
            for param, arg in given:
                if param is not None and is_config(arg, names, whole=False):
                    carried[param] = True
                elif param is not None and (is_config(arg, names) or param in holders):
                    carried[param] = False
            if carried:
                out.append((callee, carried))
        return out


def reads_config(fn: ast.FunctionDef) -> set[str]:
    """The names `fn` reads the config from (`run` of `run.config`)."""
    return {
        n.value.id
        for n in ast.walk(fn)
        if isinstance(n, ast.Attribute) and n.attr == "config" and isinstance(n.value, ast.Name)
    }


class Names(set):
    """The names that are the config or a part of it, and `holders`: those that hold it
    (`run`: `run.config` is the config, `run.strategy` is not a part of it)."""

    holders: set[str] = frozenset()


def is_config(node: ast.expr, names: Names, whole: bool = True) -> bool:
    """Whether `node` is the config or a part of it (see the module's docstring); `whole`:
    a holder itself counts (it is passed, config and all)."""
    if isinstance(node, ast.Name):
        return node.id in names or whole and node.id in getattr(names, "holders", ())
    if isinstance(node, ast.Attribute):
        return node.attr == "config" or is_config(node.value, names, whole=False)
    if isinstance(node, ast.Subscript):
        return is_config(node.value, names, whole=False)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return node.func.attr in ("get", "to_dict") and is_config(node.func.value, names, False)
    if isinstance(node, ast.Starred):
        return is_config(node.value, names, whole)
    if isinstance(node, ast.IfExp):  # `a if unset else config`
        return is_config(node.body, names, whole) or is_config(node.orelse, names, whole)
    return False


def config_walk(start: tuple[str, str] = START) -> list[Stay]:
    walker = Walker()
    walker.visit(Stay(*start), {})
    return walker.walk


def climbs(walk: list[Stay]) -> list[tuple[Stay, Stay]]:
    """The steps from one stay to the next that go to a higher layer."""
    return [(a, b) for a, b in zip(walk, walk[1:]) if RANK[b.layer] > RANK[a.layer]]


def counts(walk: list[Stay]) -> dict[str, int]:
    return {
        "stays": len(walk),
        "files": len({s.module for s in walk}),
        "climbs": len(climbs(walk)),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--counts", action="store_true", help="print the counts only")
    args = parser.parse_args(argv)
    walk = config_walk()
    if not args.counts:
        up = {b for _, b in climbs(walk)}
        for i, stay in enumerate(walk, 1):
            mark = "  ^ climb" if stay in up and i > 1 else ""
            print(f"{i:3d} {stay.file}:{stay.function} ({stay.layer}){mark}")
    c = counts(walk)
    print(f"{c['stays']} stays in {c['files']} files, {c['climbs']} climbs back up")


if __name__ == "__main__":
    main()
