"""Benchmarks that run on their own, outside the suite: ``python -m benchmarks.standalone.<name> --help``."""
