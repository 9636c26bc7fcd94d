"""Benchmarks: decode / verify / speculative cycle against their byte floors (`python -m bench.step`)."""
