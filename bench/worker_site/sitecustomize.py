"""Bench only: on PYTHONPATH of the `voxbatch worker` processes an A/B run starts (bench/switches.py),
so the switches in BENCH_SWITCHES are set in them; Python imports this at every start."""

from bench.switches import apply_from_env

apply_from_env()
