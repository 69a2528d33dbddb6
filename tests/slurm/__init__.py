"""The test SLURM harness (cluster.py); a package so tests import it as ``slurm.cluster``."""
