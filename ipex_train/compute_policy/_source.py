"""How a route recognizes the code it reproduces: a hash of a function's source as a docstring-free syntax tree, so
that a route checked against one transformers release stands aside (the class's forward runs) wherever the code
differs, whatever the class is called, while formatting, comments and docstrings do not matter."""
from __future__ import annotations

import ast
import hashlib
import inspect
import textwrap


def digest(fn) -> str | None:
    """sha256 (first 16 hex digits) of ``ast.unparse`` of ``fn``'s source with its functions' docstrings dropped;
    None where its source cannot be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return None
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return hashlib.sha256(ast.unparse(tree).encode()).hexdigest()[:16]
