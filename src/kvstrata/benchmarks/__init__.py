"""Benchmarks: each prints a human table, then one JSON object on its last line."""
