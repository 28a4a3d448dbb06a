"""The config-driven experiment behind scripts/run_forward.py and configs/*.py: the
config schema and its jit-compiled forward run (not a benchmark)."""
