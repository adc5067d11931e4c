"""What routes that reproduce a Hugging Face forward check at run time: that the class's code is the code the route
was written against (its syntax tree, docstrings dropped, hashed), so another transformers release with other code
there leaves the modules unrouted rather than computed by a formula the route does not match."""
from __future__ import annotations

import ast
import hashlib
import inspect
import textwrap


def digest(fn) -> str | None:
    """The hash (sha256, first 16 hex digits) of ``fn``'s source as a docstring-free syntax tree (``ast.unparse``,
    decorators included); None where its source cannot be read."""
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
