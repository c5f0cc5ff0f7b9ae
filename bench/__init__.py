"""Benchmarks: scripts that measure speed, memory and quality and print tables (never tests).

Run each from the repository root as a module, e.g. ``python -m bench.packing --help``; the
results and how they were obtained are in docs/benchmarks.md.
"""
