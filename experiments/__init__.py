"""Experiments: jobs run on the emulated network — the demo, the benchmarks, and the launcher they use."""
