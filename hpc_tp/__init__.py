"""hpc_tp: an MPI tensor-parallel transformer engine.

Where tensor parallelism happens: ``hpc_tp.tensor_parallel`` (the f/g operators and the
column-, row- and vocab-parallel layers); ``hpc_tp.nn`` builds attention (split by heads)
and the MLP (column then row) from them; ``hpc_tp.grid`` makes the tp/pp/dp groups.
"""

__version__ = "0.1.0"
