"""Benchmark scripts (run as `python -m benchmarks.<name>`); results under benchmarks/results/."""
