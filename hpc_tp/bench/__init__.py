"""Benchmarks: communication (``comm``) and training-step timings, run by ``hpc-tp bench``."""
