"""Benchmarks and the workloads they measure (shared with the tests)."""
