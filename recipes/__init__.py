"""Training recipes: each runs as ``python -m recipes.NAME`` with --help for its flags."""
