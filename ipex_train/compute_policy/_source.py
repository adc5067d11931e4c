"""Which code a route reproduces: a hash of a function's source that ignores formatting, comments and docstrings,
so that a route can check at run time that the installed transformers still has the code it was written against."""
from __future__ import annotations

import ast
import hashlib
import inspect
import textwrap


def digest(fn) -> str | None:
    """The hash (sha256, first 16 hex digits) of ``fn``'s source as a docstring-free syntax tree (``ast.unparse``);
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
