"""What a training run is asked to do: one dataclass that ``hpc-tp train`` fills from its flags and
tests fill directly. ``check`` rejects impossible values with one line naming the value."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..errors import ConfigError

DTYPES = ("float32", "float64")
DEMO_SEQ_LEN = 16  # the demo task's rows ("99+99=198\n" plus eos) need 10 tokens


@dataclass
class TrainSettings:
    model: str = "demo"
    model_overrides: dict = field(default_factory=dict)  # e.g. {"dropout": 0.1}: win over the preset/JSON
    tp: int = 1
    pp: int = 1
    dp: int | None = None  # None: world / (tp * pp)
    pp_layers: str | None = None  # e.g. "3,2,3": blocks per stage (default: balanced by a cost estimate)
    schedule: str = "1f1b"
    recompute: bool = False
    micro_batch: int = 16
    global_batch: int = 64
    seq_len: int | None = None  # None: 16 for the demo task, the model's max_seq_len for a corpus
    steps: int = 2000
    lr: float = 3e-3
    warmup: int | None = None  # None: a tenth of the steps, at most 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    clip_grad: float = 1.0
    seed: int = 0
    dtype: str = "float32"
    data: str = "demo"
    tokenizer: str | None = None  # None: bytes, or the --init checkpoint's tokenizer
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

    def check(self):
        positive = {"micro-batch": self.micro_batch, "global-batch": self.global_batch, "steps": self.steps,
                    "eval-problems": self.eval_problems}
        for flag, value in positive.items():
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"--{flag} {value!r}: expected a positive integer")
        for flag, value in {"save-every": self.save_every, "eval-every": self.eval_every, "samples": self.samples,
                            "warmup": self.warmup_steps, "seed": self.seed}.items():
            if not isinstance(value, int) or value < 0:
                raise ConfigError(f"--{flag} {value!r}: expected an integer >= 0")
        if self.warmup_steps > self.steps:
            raise ConfigError(f"--warmup {self.warmup} is more than --steps {self.steps}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype {self.dtype!r}: expected one of {', '.join(DTYPES)}")
        if self.schedule not in ("1f1b", "gpipe"):
            raise ConfigError(f"--schedule {self.schedule!r}: expected 1f1b or gpipe")
        if not self.lr > 0:
            raise ConfigError(f"--lr {self.lr!r}: expected a number > 0")
        if self.clip_grad < 0 or self.weight_decay < 0:
            raise ConfigError(f"--clip-grad {self.clip_grad} and --weight-decay {self.weight_decay} must be >= 0")
        if self.resume and not self.save:
            raise ConfigError("--resume needs --save DIR (the folder it resumes from)")
        if self.seq_len is not None and (not isinstance(self.seq_len, int) or self.seq_len < 1):
            raise ConfigError(f"--seq-len {self.seq_len!r}: expected a positive integer")

    @property
    def warmup_steps(self) -> int:
        return min(100, self.steps // 10) if self.warmup is None else self.warmup

    def check_batch(self, dp: int):
        """The global batch must split into whole micro-batches on every data-parallel rank."""
        if self.global_batch % (self.micro_batch * dp):
            raise ConfigError(f"--global-batch {self.global_batch} is not divisible by --micro-batch "
                              f"{self.micro_batch} x dp {dp} = {self.micro_batch * dp}")

    def to_dict(self) -> dict:
        return asdict(self)
