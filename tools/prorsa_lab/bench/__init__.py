"""Benchmarks behind `prorsa bench`; modules here import nothing heavy at top level."""
