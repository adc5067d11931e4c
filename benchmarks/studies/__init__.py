"""One-off studies: each answers one question and names, in its docstring, the docs section holding the answer."""
