"""No function or method body in the library (cegppo_trl/) is over 60 lines, docstring aside. Nested
functions are checked on their own and also count toward the function that holds them."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import cegppo_trl


MAX_BODY_LINES = 60
LIBRARY = Path(cegppo_trl.__file__).resolve().parent


def body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from the first statement after the docstring to the function's last line (`end_lineno`): blank lines
    and comments inside the body count, the signature, decorators and docstring do not."""
    body = node.body
    if ast.get_docstring(node, clean=False) is not None:
        body = body[1:]
    if not body:  # a function that is only a docstring
        return 0
    return node.end_lineno - body[0].lineno + 1  # type: ignore[operator]


def long_functions(source: str, filename: str, limit: int = MAX_BODY_LINES) -> list[str]:
    """`"file:line qualified.name (N lines)"` for each function or method of `source` whose body is over `limit`."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = getattr(child, "name", None)
            qualified = f"{prefix}{name}" if name else prefix
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = body_lines(child)
                if lines > limit:
                    found.append(f"{filename}:{child.lineno} {qualified} ({lines} lines)")
                visit(child, qualified + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, qualified + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source, filename=filename), "")
    return found


def test_no_library_function_body_is_over_60_lines():
    files = sorted(LIBRARY.rglob("*.py"))
    assert len(files) > 10, f"expected the package's modules under {LIBRARY}"
    offenders = [
        entry
        for path in files
        for entry in long_functions(path.read_text(encoding="utf-8"), str(path.relative_to(LIBRARY.parent)))
    ]
    assert not offenders, (
        f"function bodies over {MAX_BODY_LINES} lines (docstring aside); split them into named pieces:\n"
        + "\n".join(offenders)
    )


def _function_with_body(statements: int, docstring: bool = True, indent: str = "") -> str:
    doc = f'{indent}    """A docstring\n{indent}    over two lines."""\n' if docstring else ""
    body = "".join(f"{indent}    x{i} = {i}\n" for i in range(statements))
    return f"{indent}def f():\n{doc}{body}"


def test_the_check_counts_the_body_without_its_docstring():
    assert long_functions(_function_with_body(60), "ok.py") == []
    assert long_functions(_function_with_body(61), "long.py") == ["long.py:1 f (61 lines)"]
    assert long_functions(_function_with_body(61, docstring=False), "long.py") == ["long.py:1 f (61 lines)"]
    # A long docstring does not count; blank lines and comments inside the body do.
    padded = 'def g():\n    """' + "doc\n" * 100 + '    """\n    a = 1\n' + "\n    # why\n" * 30 + "    return a\n"
    assert long_functions(padded, "g.py") == ["g.py:1 g (62 lines)"]


def test_the_check_finds_methods_nested_functions_and_async_functions():
    source = "class Pool:\n" + _function_with_body(70, indent="    ").replace("def f", "def grade")
    assert long_functions(source, "pool.py") == ["pool.py:2 Pool.grade (70 lines)"]
    nested = textwrap.dedent(
        """
        def outer():
            def inner():
        """
    ) + "".join(f"        y{i} = {i}\n" for i in range(61))
    assert long_functions(nested, "n.py") == ["n.py:2 outer (62 lines)", "n.py:3 outer.inner (61 lines)"]
    assert long_functions(_function_with_body(61).replace("def f", "async def f"), "a.py") == ["a.py:1 f (61 lines)"]
