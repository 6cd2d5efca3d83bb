"""Benchmarks that print figures (not part of the test run); see bench/README.md."""
