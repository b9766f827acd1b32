"""Benchmarks (``make bench-*``): report throughput and ratios, never assert timings."""
