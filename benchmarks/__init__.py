"""Benchmarks and GPU checks of the pipeline, run as modules: ``python -m benchmarks.NAME``."""
