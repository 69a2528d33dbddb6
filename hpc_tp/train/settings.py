"""What a training run is asked to do: one dataclass that ``hpc-tp train`` fills from its flags and
tests fill directly. ``check`` rejects impossible values with one line naming the value."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..backend import resolve_dtype
from ..errors import ConfigError
from ..paths import check_output_file, check_output_folder
from ..recompute import recompute_mode

DTYPES = ("float32", "float64", "float16", "bfloat16")  # the half ones: mixed precision (train/mixed_precision.py)
DEMO_SEQ_LEN = 16  # the demo task's rows ("99+99=198\n" plus eos) need 10 tokens


@dataclass
class TrainSettings:
    model: str = "demo"
    model_overrides: dict = field(default_factory=dict)  # e.g. {"dropout": 0.1}: win over the preset/JSON
    tp: int = 1
    pp: int = 1
    dp: int | None = None  # None: world / (tp * pp)
    ep: int = 1  # expert-parallel size (MoE): carved out of dp, must divide dp and num_experts
    pp_layers: str | None = None  # e.g. "3,2,3": blocks per stage (default: balanced by a cost estimate)
    schedule: str = "1f1b"
    # Model chunks per pipeline rank: > 1 runs 1F1B interleaved (pipeline/schedules.py). None: 1, or under
    # --plan auto the planner's choice; a number under --plan auto limits the planner to that V.
    virtual_stages: int | None = None
    plan: str | None = None  # "auto": tp, pp, dp, micro-batch, recompute, schedule and V from hpc_tp.plan
    plan_cluster: str = "cpu-2core"  # the planner's cluster preset
    recompute: str = "none"  # "none", "selective" or "full" (hpc_tp.recompute); True/False: full/none
    micro_batch: int | None = None  # None: the whole dp share at pp=1; 2*pp micro-batches at pp>1
    global_batch: int = 64
    seq_len: int | None = None  # None: 16 for the demo task, the model's max_seq_len for a corpus
    steps: int = 2000
    lr: float = 2e-3  # the embedded task: 96.6-99.2% held-out over seeds 0-4 (3e-3 was erratic: 81.4-99.2%)
    warmup: int | None = None  # None: a tenth of the steps, at most 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    clip_grad: float = 1.0
    distributed_optimizer: bool = False  # ZeRO-1: AdamW states sharded over dp (train/distributed_optim.py)
    seed: int = 0
    dtype: str = "float32"
    device: str = "cpu"  # "cuda": cupy, one GPU per node-local rank
    # The step with its host values as device scalars, captured as a CUDA graph (train/captured_step.py).
    # Off unless asked: no card has run it yet, and the eager step is the one measured.
    cuda_graph: bool = False
    data: str = "demo"
    tokenizer: str | None = None  # None: bytes, or the --init checkpoint's tokenizer
    chat_template: str | None = None  # a Jinja file for --data CHATS.jsonl (default: the tokenizer's own)
    eval_split: float = 0.0  # conversations held out of --data CHATS.jsonl, for heldout_loss
    init: str | None = None  # start from a checkpoint's weights (its config and tokenizer), fresh optimizer
    cache_dir: str = "io/cache"
    log: str | None = None
    save: str | None = None
    save_every: int = 0  # 0: save only at the end (and when stopped by a signal)
    keep: int = 3
    resume: bool = False
    eval_every: int = 0  # 0: evaluate the demo task only at the end
    eval_problems: int = 500
    samples: int = 5
    progress: bool = True
    comm_timeout: float = 0.0  # seconds a collective may block before the job is aborted (0: no watchdog)
    debug_collectives: bool = False  # every rank of a group checks that it calls the same collective
    max_bad_steps: int = 0  # non-finite steps in a row before rolling back to the last checkpoint (0: never)

    def check(self):
        positive = {
            "micro-batch": 1 if self.micro_batch is None else self.micro_batch,
            "ep": self.ep,
            "virtual-stages": self.chunks,
            "global-batch": self.global_batch,
            "steps": self.steps,
            "eval-problems": self.eval_problems,
        }
        for flag, value in positive.items():
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"--{flag} {value!r}: expected a positive integer")
        for flag, value in {
            "save-every": self.save_every,
            "eval-every": self.eval_every,
            "samples": self.samples,
            "warmup": self.warmup_steps,
            "seed": self.seed,
            "max-bad-steps": self.max_bad_steps,
            "keep": self.keep,
        }.items():
            if not isinstance(value, int) or value < 0:
                raise ConfigError(f"--{flag} {value!r}: expected an integer >= 0")
        if self.warmup_steps > self.steps:
            raise ConfigError(f"--warmup {self.warmup} is more than --steps {self.steps}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype {self.dtype!r}: expected one of {', '.join(DTYPES)}")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"--device {self.device!r}: expected cpu or cuda")
        resolve_dtype(self.dtype)  # bfloat16 without ml_dtypes: one clear line
        if self.plan not in (None, "auto"):
            raise ConfigError(f"--plan {self.plan!r}: expected auto")
        self.recompute = recompute_mode(self.recompute)  # the boolean spelling becomes its mode
        if self.schedule not in ("1f1b", "gpipe"):
            raise ConfigError(f"--schedule {self.schedule!r}: expected 1f1b or gpipe")
        if self.chunks > 1 and self.schedule != "1f1b":
            raise ConfigError(
                f"--virtual-stages {self.virtual_stages} runs the interleaved 1F1B schedule: "
                f"use --schedule 1f1b, not {self.schedule}"
            )
        if not 0 < self.lr < math.inf:  # also false for nan: a nan or inf rate makes every weight nan
            raise ConfigError(f"--lr {self.lr!r}: expected a finite number > 0")
        for flag, value in {
            "clip-grad": self.clip_grad,
            "weight-decay": self.weight_decay,
            "min-lr-ratio": self.min_lr_ratio,
        }.items():
            if not 0 <= value < math.inf:
                raise ConfigError(f"--{flag} {value!r}: expected a finite number >= 0")
        if self.resume and not self.save:
            raise ConfigError("--resume needs --save DIR (the folder it resumes from)")
        if not isinstance(self.comm_timeout, (int, float)) or not 0 <= self.comm_timeout < float("inf"):
            raise ConfigError(f"--comm-timeout {self.comm_timeout!r}: expected seconds >= 0 (0: no watchdog)")
        if self.seq_len is not None and (not isinstance(self.seq_len, int) or self.seq_len < 1):
            raise ConfigError(f"--seq-len {self.seq_len!r}: expected a positive integer")
        if not 0 <= self.eval_split < 1:
            raise ConfigError(f"--eval-split {self.eval_split!r}: expected a fraction in [0, 1)")
        if self.eval_split and not self.chats:
            raise ConfigError(f"--eval-split holds out conversations of a chats .jsonl, not of --data {self.data}")
        self._check_outputs()

    def _check_outputs(self):
        """Where the run writes, checked before it trains: a bad path would otherwise end it after the work."""
        if self.log is not None:
            check_output_file(self.log, "--log")
        if (
            self.data not in (None, "demo") and not self.chats
        ) or self.comm_timeout:  # a corpus's tokens, the watchdog's files
            check_output_folder(self.cache_dir, "--cache-dir")
        if self.save is not None:
            check_output_folder(self.save, "--save")
            if not self.resume:
                _check_no_earlier_run(self.save)

    @property
    def chats(self) -> bool:
        """Whether --data is conversations (supervised fine-tuning, ``train.chats``) rather than text."""
        return str(self.data).endswith(".jsonl")

    @property
    def chunks(self) -> int:
        """Model chunks per pipeline rank: ``virtual_stages``, 1 where it was not given."""
        return 1 if self.virtual_stages is None else self.virtual_stages

    @property
    def warmup_steps(self) -> int:
        return min(100, self.steps // 10) if self.warmup is None else self.warmup

    def micro_batch_for(self, dp: int, pp: int) -> int:
        """Sequences per micro-batch: ``--micro-batch``, or by default each dp rank's whole share at
        pp=1 (fewest collectives) and 2*pp micro-batches at pp>1 (a small pipeline bubble).
        The global batch must split into whole micro-batches on every data-parallel rank."""
        share, wanted = self.global_batch // dp, 1 if pp == 1 else 2 * pp
        if self.micro_batch is None and not self.global_batch % dp and not share % wanted:
            return share // wanted
        micro = self.micro_batch or max(1, share // wanted)
        if self.global_batch % (micro * dp):
            raise ConfigError(
                f"--global-batch {self.global_batch} is not divisible by --micro-batch {micro} x dp {dp} = {micro * dp}"
            )
        count = self.global_batch // (micro * dp)
        if self.chunks > 1 and count % pp:
            raise ConfigError(
                f"--global-batch {self.global_batch} / (--micro-batch {micro} x dp {dp}) = {count} "
                f"micro-batches per step: the interleaved schedule (--virtual-stages "
                f"{self.virtual_stages}) needs a multiple of --pp {pp}"
            )
        return micro

    def to_dict(self) -> dict:
        return asdict(self)


def _check_no_earlier_run(save: str):
    """A run without --resume starts at step 0: saved into the folder of an earlier run (--init's
    checkpoint or its root included), it would overwrite that run's checkpoints and could move its
    ``latest`` back to an older step."""
    from ..checkpoint.format import MASTER, latest_checkpoint, step_folders  # here: h5py would slow `hpc-tp --help`

    folder = Path(save)
    latest = folder if (folder / MASTER).is_file() else latest_checkpoint(folder)
    if latest is not None or step_folders(folder):
        held = f" (latest: {latest.name})" if latest is not None else ""
        raise ConfigError(
            f"--save {save} already holds checkpoints{held}: pass --resume to continue that run, or --save a new folder"
        )
