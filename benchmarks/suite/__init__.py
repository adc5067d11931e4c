"""The benchmarks ``python -m benchmarks`` runs (each also runs alone: ``python -m benchmarks.suite.<name>``)."""
