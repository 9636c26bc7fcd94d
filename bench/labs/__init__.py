"""Experiments that shaped the engine: kernel variants, profiles and A/B runs (`python -m bench.labs.NAME`).

Not benchmarks of record (those are `bench/` itself); their findings are in docs/performance.md."""
