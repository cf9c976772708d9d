"""Sizes a reader can hold (docs/design.md, "Architecture"): no module of tx_jax over
MAX_MODULE_LINES lines and no function or method over MAX_FUNCTION_LINES, both read with `ast`.
A failure lists every offender with its file, name and length.
"""

from __future__ import annotations

import ast
import pathlib
import textwrap
from collections.abc import Iterator

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "tx_jax"
MAX_MODULE_LINES = 550
MAX_FUNCTION_LINES = 90


def functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, int]]:
    """(qualified name, lines from its `def` to its last line) of every function and method in
    `tree`, nested ones included: 'f', 'Class.method', 'f.inner'."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            name = prefix + node.name
            yield name, node.end_lineno - node.lineno + 1
            yield from functions(node, name + ".")
        elif isinstance(node, ast.ClassDef):
            yield from functions(node, prefix + node.name + ".")
        else:  # a def inside an if, with or try block is still the module's or class's
            yield from functions(node, prefix)


def sizes() -> Iterator[tuple[str, str | None, int, int]]:
    """(file under tx_jax/, function or None for the module, lines, limit) of every module and
    function of the package."""
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        name = path.relative_to(PACKAGE).as_posix()
        yield name, None, len(source.splitlines()), MAX_MODULE_LINES
        for function, lines in functions(ast.parse(source, str(path))):
            yield name, function, lines, MAX_FUNCTION_LINES


def _listing(entries) -> str:
    return "\n".join(
        f"  tx_jax/{file}: {function or '(module)'} {lines} lines"
        for file, function, lines in entries
    )


def test_functions_are_named_and_measured_from_def_to_last_line():
    source = textwrap.dedent(
        """\
        class A:
            @staticmethod
            def method():
                def inner():
                    return 1

                return inner


        def f(
            x,
        ):
            return x
        """
    )
    assert dict(functions(ast.parse(source))) == {"A.method": 5, "A.method.inner": 2, "f": 4}


def test_no_module_or_function_is_over_its_limit():
    over = [(file, function, lines) for file, function, lines, limit in sizes() if lines > limit]
    assert not over, (
        f"over {MAX_MODULE_LINES} lines (module) or {MAX_FUNCTION_LINES} (function); split "
        f"them into parts that each do one thing:\n{_listing(over)}"
    )
