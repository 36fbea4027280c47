"""Benchmark scripts (run as `python -m benchmarks.<name>`); results under benchmarks/results/<topic>/,
and every results table in the docs generated from them by `python -m benchmarks.tables`."""
