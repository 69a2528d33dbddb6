"""hpc_tp: an MPI tensor-parallel transformer engine.

Where tensor parallelism happens: ``hpc_tp.tensor_parallel`` (the f/g operators and the
column-, row- and vocab-parallel layers); ``hpc_tp.nn`` builds attention (split by heads)
and the MLP (column then row) from them; ``hpc_tp.grid`` makes the tp/pp/dp groups.

Imports run one way, downward, through these layers (tests/test_layering.py holds every import to it):

    errors < foundation < comm < launch < module < kernels < tensor_parallel < nn < models
    < pipeline/checkpoint/tokenizer < serve < plan < train < bench < cli

- foundation: ``backend`` (numpy or cupy), ``paths``, ``jsonl``, ``recompute`` (the modes), ``cuda_graph``
- comm: the Communicator interface, MPI and NCCL, the collective watchdog; launch: ``launch``
  (how the job was started and how it fails), ``grid`` (the tp/pp/dp groups), ``preemption``
- module: ``Module``, ``Parameter``, the gradient arena; kernels: array-level compute, no Modules
- serve < plan < train: the trainer asks the planner for a layout (``--plan auto``) and samples
  with the serving engine; bench measures steps with the trainer
- cli: ``hpc_tp.cli`` and each subcommand's module (``cli.COMMANDS``), ``plan.validate`` (what
  ``hpc-tp plan --validate`` runs) and ``bench.gpu_check`` (a program of its own): free to import
  anything below

Only comm/ and ``launch`` import mpi4py (and ``bench.comm``, which times MPI's own calls).
"""

__version__ = "0.1.0"
