"""Benchmarks for ipex_train, run as ``python -m benchmarks.<name>`` from the repository root."""
