"""Benchmarks runnable as `hstu bench ...`."""
