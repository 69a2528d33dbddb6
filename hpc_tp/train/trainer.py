"""The training loop: one optimizer step per global batch, over tp x pp x dp ranks.

    global batch (sampler: a pure function of seed and step)
      -> this dp rank's contiguous chunk -> micro-batches (gradient accumulation)
      -> forward + backward of each, gradients of loss_sum / (global target-token count)
      -> data-parallel all-reduce of gradient sums (buckets; an MoE expert's over the dp ranks holding it)
      -> exact global grad norm, clipping, AdamW (states sharded like the parameters)

Dividing by the *global* token count before backward makes every layout sum the same terms:
tp=N, dp=M and any micro-batch split give the gradient of one process on the whole batch.
Dropout masks are keyed by (seed, step, global micro-batch index), never by rank.

Faults (see hpc_tp.comm.watchdog for hangs):
- A step whose loss or gradient is not finite anywhere is skipped on every rank alike (one reduced
  flag). After ``max_bad_steps`` such steps in a row the run rolls back to the last checkpoint and
  replays from there, bit for bit as a resume would; a second rollback to the same checkpoint, or
  none to roll back to, stops the run with ``NumericalFault``.
- A checkpoint is only written after a good step: one that falls due during a run of bad steps
  waits for the next good one, so a rollback never restores poisoned weights.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from .. import backend, cuda_graph
from ..checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from ..checkpoint.format import resolve_checkpoint
from ..comm import use_device
from ..comm.mpi import world as mpi_world
from ..comm.watchdog import WatchedCommunicator, watched
from ..errors import ConfigError
from ..grid import ProcessGrid, node_of_ranks
from ..models import load_config
from ..models.config import PRESETS, ModelConfig
from ..module import DEFAULT_BUCKET_BYTES, GradArena
from ..pipeline import (
    build_stage,
    parse_pp_layers,
    pipeline_forward_backward,
    sync_tied_embeddings,
    tied_copy_names,
    tied_names,
)
from ..plan import choose_layout
from ..plan.clusters import get_cluster
from ..plan.cost import Layout
from ..plan.placement import launch_cluster
from ..preemption import StopRequest
from ..serve.chat import read_template, template_for
from ..tensor_parallel.sequence_parallel import check_sequence_divisible
from ..tensor_parallel.vocab import IGNORE_INDEX
from ..tokenizer import load_tokenizer, load_tokenizer_dir, saved_files
from .captured_step import CapturedStep, check_capturable
from .chats import build_chat_datasets
from .data import DistributedSampler, TaskDataset, build_dataset, check_tokens
from .distributed_optim import ShardedAdamW
from .evaluate import heldout_accuracy
from .expert_parallel import check_expert_parallel, moe_metrics, moe_summary
from .grad_sync import ExpertAwareBucketer
from .metrics import MetricsLogger
from .mixed_precision import MixedPrecision
from .optim import AdamW, agree_finite, clip_coefficient
from .progress import Progress, format_duration
from .schedule import lr_at
from .settings import DEMO_SEQ_LEN, TrainSettings

# Settings a resumed run must share with the run that saved: they decide which samples each step sees.
SAME_ON_RESUME = ("seed", "global_batch", "data", "tokenizer")
GROUPS = ("tp", "pp", "dp", "ep", "expert_dp")  # the grid's communicators: their calls count as comm_s


class NumericalFault(ConfigError):
    """The run keeps producing non-finite losses or gradients and rolling back cannot help.
    A ConfigError, so ``hpc-tp`` prints it as one line: its cure is a setting (--lr, --clip-grad, data)."""


@dataclass
class TrainResult:
    records: list[dict] = field(default_factory=list)  # this run's per-step metrics
    accuracy: float | None = None  # demo task: held-out exact-answer accuracy at the end
    heldout_loss: float | None = None  # chats: the held-out conversations' assistant-token loss at the end
    samples: list = field(default_factory=list)  # [(prompt, completion, ok)]
    stopped_by: str | None = None  # the signal that ended the run early
    checkpoint: Path | None = None  # the last checkpoint written


class Trainer:
    def __init__(self, settings: TrainSettings, world=None):
        settings.check()
        self.settings = s = settings
        world = _watched_world(world, s)
        planned = bool(s.plan)
        if planned:  # builds the tokenizer and the model config on the way
            self.settings = s = self._planned(world)
        self.grid = grid = ProcessGrid(s.tp, s.pp, s.dp, world, ep=s.ep)
        for axis in GROUPS:  # reports name groups "tp [0, 1]" rather than "group [0, 1]"
            getattr(grid, axis).label = axis
        self.transports = use_device(s.device, grid)  # before any array: the backend, each group's transport
        self.micro_batch = s.micro_batch_for(grid.dp_size, grid.pp_size)
        self.is_main = grid.world.rank == 0
        if not planned:
            self.init_meta = load_checkpoint(s.init, {}, grid) if s.init else None
            self.tokenizer = self._tokenizer()
            self.cfg = self._model_config()
        check_expert_parallel(s.ep, self.cfg)
        if s.cuda_graph:  # before the data and the model are built
            check_capturable(s, self.cfg, grid)
        self.seq_len = self._seq_len()
        self.heldout = None  # the chats held out by --eval-split
        if s.chats:
            template = template_for(self.tokenizer, read_template(s.chat_template), s.chat_template)
            self.dataset, self.heldout = build_chat_datasets(
                s.data, self.tokenizer, template, s.seq_len, s.eval_split, s.seed, self.cfg.max_seq_len
            )
            self.seq_len = self.dataset.seq_len
        else:
            self.dataset = build_dataset(
                s.data, self.seq_len, self.tokenizer, s.cache_dir, rank=grid.world.rank, barrier=grid.world.barrier
            )
        if self.cfg.sequence_parallel:  # before any message goes
            check_sequence_divisible(self.seq_len, grid.tp_size)
        # The dp buckets sum gradients in place; with ZeRO the parameters are laid out beside them, so the
        # updated pieces are gathered straight into the parameters.
        with GradArena(DEFAULT_BUCKET_BYTES, params=s.distributed_optimizer) as self.grad_arena:
            self.model = self._build_model()
        self.params = self.model.trainable_state()  # LoRA: the adapters only; the frozen rest has no gradient
        # The tied embedding of pp > 1 is summed across stages after the dp sync: never sharded.
        self.bucketer = ExpertAwareBucketer(
            self.params,
            grid,
            self.grad_arena,
            whole=tied_names(self.model, grid),
            shard=s.distributed_optimizer and grid.dp_size > 1,
        )
        sharded = self.bucketer.sharded_names
        # float32 masters of half weights (the same parameters at float32/64; ZeRO's pieces hold the sharded ones)
        self.precision = MixedPrecision(self.params, s.dtype, sharded=sharded)
        if sharded:
            optimizer = ShardedAdamW(self.precision.master, self.bucketer, s.lr, weight_decay=s.weight_decay)
        else:
            optimizer = AdamW(self.precision.master, s.lr, weight_decay=s.weight_decay)
        self.optimizer = optimizer
        if s.init:
            load_checkpoint(s.init, self._init_tensors(), grid)
            self.precision.sync_model()
        self.tied_copies = tied_copy_names(self.model, grid)  # counted once, on the first stage
        self.sampler = DistributedSampler(len(self.dataset), s.global_batch, grid.coords.dp, grid.dp_size, s.seed)
        self.step = 0
        self.messages: list[str] = []
        # --cuda-graph: the step with its host values on the device, captured (train.captured_step)
        # unless HPC_TP_CUDA_GRAPHS=0 turns graphs off
        self.captured = CapturedStep(self, capture=cuda_graph.enabled()) if s.cuda_graph else None
        backend.release_free_memory()  # the parameters' first draws (full tensors, float64) are gone

    # -- set-up ------------------------------------------------------------------------------------------
    def _planned(self, world) -> TrainSettings:
        """The settings with the planner's fastest layout (hpc_tp.plan) for this world and model, its
        virtual stages included (only the asked V if --virtual-stages was given), on the launch's ranks per
        node and placement. The planner is arithmetic on what every rank holds once the nodes are
        gathered, so every rank reaches the same answer. Collective over ``world``."""

        s = self.settings
        if s.init:
            raise ConfigError(
                "--plan auto cannot read the --init checkpoint's model before the grid exists: "
                "give --tp/--pp/--dp with --init"
            )
        self.init_meta, self.tokenizer = None, self._tokenizer()
        self.cfg = self._model_config()
        # The launch's nodes: which ranks share one decides which groups cross the network.
        cluster, placement = launch_cluster(get_cluster(s.plan_cluster), node_of_ranks(world))
        choice = choose_layout(
            self.cfg,
            world.size,
            s.global_batch,
            self._seq_len(),
            cluster=cluster,
            ep=s.ep,
            distributed_optimizer=s.distributed_optimizer,
            virtual_stages=s.virtual_stages,
            placement=placement,
        )
        layout = {k: v for k, v in choice.items() if k != "reason"}
        planned = replace(s, plan=None, **layout)
        if world.rank == 0:
            print(
                f"--plan auto: {describe_layout(planned, self.cfg, choice['tp'], choice['pp'], choice['dp'])}: "
                f"{choice['reason']}",
                flush=True,
            )
        return planned

    def _tokenizer(self):
        s = self.settings
        if s.tokenizer is None and s.init:
            return load_tokenizer_dir(resolve_checkpoint(s.init))
        return load_tokenizer(s.tokenizer or "bytes")

    def _model_config(self) -> ModelConfig:
        s, vocab = self.settings, self.tokenizer.vocab_size
        overrides = dict(s.model_overrides)
        if self.init_meta is not None:  # the checkpoint's model, with --set overrides (e.g. dropout)
            cfg = ModelConfig.from_dict({**self.init_meta["config"], **overrides})
        else:
            if s.model in PRESETS:  # a preset is a shape; its vocabulary is the tokenizer's
                overrides.setdefault("vocab_size", vocab)
            cfg = load_config(s.model, **overrides)
        if cfg.family != "gpt":
            raise ConfigError(
                f"--model {s.model} is a {cfg.family} encoder: hpc-tp train trains decoder language models (family gpt)"
            )
        if cfg.quantize is not None:
            raise ConfigError(
                f"model config quantize={cfg.quantize!r}: quantized weights are for inference (generate, serve, "
                "eval); train from the float checkpoint they were converted from"
            )
        if cfg.vocab_size < vocab:
            raise ConfigError(
                f"model vocab_size {cfg.vocab_size} is smaller than the tokenizer's {vocab} (--tokenizer {s.tokenizer})"
            )
        return cfg

    def _seq_len(self) -> int:
        s, context = self.settings, self.cfg.max_seq_len
        if s.seq_len is None:
            return min(DEMO_SEQ_LEN, context) if s.data == "demo" else context
        if s.seq_len > context:
            raise ConfigError(
                f"--seq-len {s.seq_len} is longer than the model's context: max_seq_len {context} (--model {s.model})"
            )
        return s.seq_len

    def _build_model(self):
        s = self.settings
        layers = None if s.pp_layers is None else parse_pp_layers(s.pp_layers, self.cfg.n_layers, s.pp, s.chunks)
        return build_stage(
            self.cfg, self.grid, dtype=s.dtype, seed=s.seed, layers_per_stage=layers, virtual_stages=s.chunks
        )

    # -- one optimizer step ---------------------------------------------------------------------------
    def train_step(self) -> dict:
        s, grid = self.settings, self.grid
        started, comm_before = time.perf_counter(), self._comm_seconds()
        ids, targets = self.dataset.get(self.sampler.indices(self.step))
        lr = lr_at(self.step, s.lr, s.warmup_steps, s.steps, s.min_lr_ratio)
        if self.captured is None:
            values = self._eager_step(backend.xp.asarray(ids), backend.xp.asarray(targets), lr)
        else:
            values = self.captured.run(ids, targets, lr)
        self.model.zero_grad()
        self.step += 1
        elapsed = time.perf_counter() - started
        comm = self._comm_seconds() - comm_before
        return dict(
            step=self.step,
            loss=values.pop("loss"),
            lr=lr,
            **values,
            tokens_per_s=s.global_batch * self.seq_len / elapsed,
            step_s=elapsed,
            compute_s=elapsed - comm,
            comm_s=comm,
            **moe_metrics(self.model, grid),
        )

    def _eager_step(self, ids, targets, lr: float) -> dict:
        """The step launched from the host, which reads the token count, the loss, the norm and the
        finite flag back as it goes: loss, grad_norm, skipped, tokens and the loss scaler's fields."""
        s, grid = self.settings, self.grid
        tokens = grid.dp.all_reduce_scalar(float((targets != IGNORE_INDEX).sum()))
        check_tokens(tokens, self.step)
        loss_sum = self._forward_backward(ids, targets, self.precision.loss_scale / tokens)  # fp16: scaled grads
        loss = grid.dp.all_reduce_scalar(loss_sum) / tokens
        unscale = 1.0 / self.precision.loss_scale  # a power of two: unscaling inside the passes is exact
        norm = self.optimizer.grad_norm(grid, self.tied_copies, unscale)  # inf/NaN when a gradient is
        finite = agree_finite(grid, norm, loss)  # the loss is the same on every rank
        if finite:  # a step with an inf/NaN gradient is skipped on every rank alike
            self.optimizer.step(lr, grad_scale=unscale * clip_coefficient(norm, s.clip_grad))
        scaling = self.precision.record(finite, loss)  # before update() halves the scale
        self.precision.update(finite)  # half weights from the masters; fp16: the loss scale
        return dict(
            loss=loss, grad_norm=norm if finite else float("nan"), skipped=not finite, tokens=int(tokens), **scaling
        )

    def _forward_backward(self, ids, targets, scale, on_device: bool = False):
        """This dp rank's loss sum; gradients of ``scale * loss`` summed over the dp group, each
        bucket's all-reduce launched as soon as backward has finished its gradients. ``on_device``:
        the loss sum a 0-d device array (``scale`` may be one), for the captured step."""
        s, grid = self.settings, self.grid
        micro = self.micro_batch
        batches = [(ids[m : m + micro], targets[m : m + micro]) for m in range(0, len(ids), micro)]
        self.bucketer.start()
        loss_sum, _ = pipeline_forward_backward(
            self.model,
            batches,
            grid,
            scale,
            s.schedule,
            s.recompute,
            on_grads_final=lambda names: self.bucketer.mark_ready(*names),
            step=self.step,
            first_sample=grid.coords.dp * len(ids),
            on_device=on_device,
        )
        self.bucketer.finish()
        sync_tied_embeddings(self.model, grid)
        return loss_sum

    def _comm_seconds(self) -> float:
        return sum(getattr(self.grid, axis).seconds for axis in GROUPS)

    # -- evaluation -----------------------------------------------------------------------------------
    def heldout_loss(self) -> float | None:
        """Mean loss over the assistant tokens of the chats held out by --eval-split, dp replicas splitting
        them (None without them, and at pp > 1, with sequence or expert parallelism: layouts whose forward
        pass is the schedule's)."""
        if self.heldout is None or self.grid.pp_size > 1 or self.cfg.sequence_parallel or self.grid.ep_size > 1:
            return None
        mine = list(range(self.grid.coords.dp, len(self.heldout), self.grid.dp_size))
        loss, tokens = 0.0, 0
        with self.model.inference(), self.model.uncounted():
            for start in range(0, len(mine), self.micro_batch):
                ids, targets = self.heldout.get(mine[start : start + self.micro_batch])
                loss_sum, count, _ = self.model.forward(backend.xp.asarray(ids), backend.xp.asarray(targets))
                loss, tokens = loss + float(loss_sum), tokens + int(count)
        loss, tokens = self.grid.dp.all_reduce_scalar(loss), self.grid.dp.all_reduce_scalar(tokens)
        return loss / max(tokens, 1)

    def evaluate(self) -> tuple[float, list] | None:
        """Held-out accuracy on the demo task, decoded by the serving engine (None for a corpus, and for
        layouts the engine does not serve: pp > 1, sequence parallelism, expert parallelism)."""
        if (
            not isinstance(self.dataset, TaskDataset)
            or self.grid.pp_size > 1
            or self.cfg.sequence_parallel
            or self.grid.ep_size > 1
        ):
            return None
        with self.model.uncounted():  # decoded through GPTModel.infer, which never drops
            return heldout_accuracy(self.model, self.dataset.task, self.tokenizer, self.settings.eval_problems)

    # -- checkpoints ----------------------------------------------------------------------------------
    def checkpoint_tensors(self) -> dict:
        """What a checkpoint holds: the masters and the optimizer's states, whole; ZeRO's streamed
        (fetched and stored one at a time by the save and the load); and the frozen weights of LoRA
        as the model holds them, so that the checkpoint is the whole model."""
        return {**self._frozen(), **self.optimizer.masters(self.precision.master), **self.optimizer.state_tensors()}

    def _frozen(self) -> dict:
        return {name: p for name, p in self.model.state().items() if not p.trainable}

    def _init_tensors(self) -> dict:
        """What ``--init`` loads: every weight, but the adapters only from a checkpoint that has them
        (a base model starts LoRA with the adapters' own initialisation)."""
        adapters_saved = not self.cfg.lora_rank or self.init_meta["config"].get("lora_rank")
        masters = self.optimizer.masters(self.precision.master) if adapters_saved else {}
        return {**self._frozen(), **masters}

    def save(self) -> Path:
        s = self.settings
        meta = {
            "step": self.step,
            "config": self.cfg.to_dict(),
            "seq_len": self.seq_len,
            "optimizer": {"name": "adamw", "step_count": self.optimizer.step_count, **self.precision.state()},
            "train": s.to_dict(),
            "tokenizer": self.tokenizer.identity,
        }
        return save_checkpoint(
            s.save,
            self.step,
            self.checkpoint_tensors(),
            meta,
            self.grid,
            keep=s.keep,
            files=saved_files(self.tokenizer),
        )

    def resume(self) -> Path | None:
        """Continue from the latest checkpoint under ``--save`` (any layout saved it); None if there is none."""
        folder = latest_checkpoint(self.settings.save)
        if folder is not None:
            self._load(folder)
        return folder

    def _load(self, folder: Path):
        meta = load_checkpoint(folder, {}, self.grid)  # the header first: a clear error before any tensor
        # Sequence parallelism is a layout, not a model: a run may resume with it on or off.
        saved = replace(ModelConfig.from_dict(meta["config"]), sequence_parallel=self.cfg.sequence_parallel)
        if saved != self.cfg:
            changed = sorted(k for k, v in saved.to_dict().items() if self.cfg.to_dict().get(k) != v)
            raise ConfigError(
                f"checkpoint {folder} holds another model ({', '.join(changed)} differ): "
                f"resume with the same --model, or --save to a new folder"
            )
        for key in SAME_ON_RESUME:
            if meta["train"].get(key) != getattr(self.settings, key):
                raise ConfigError(
                    f"checkpoint {folder} was trained with {key}={meta['train'].get(key)!r}, "
                    f"this run asks {getattr(self.settings, key)!r}: the data order would change"
                )
        if meta["seq_len"] != self.seq_len:
            raise ConfigError(
                f"checkpoint {folder} was trained with --seq-len {meta['seq_len']}, this run asks {self.seq_len}"
            )
        load_checkpoint(folder, self.checkpoint_tensors(), self.grid)
        self.step = int(meta["step"])
        self.optimizer.step_count = int(meta["optimizer"]["step_count"])
        self.precision.sync_model()
        self.precision.load_state(meta["optimizer"])
        if self.captured is not None:  # the step's device scalars follow the loaded state
            self.captured.load_host_state()

    def roll_back(self, bad_steps: int) -> Path:
        """Back to the last checkpoint after ``bad_steps`` non-finite steps in a row (NumericalFault if
        there is none, or if the run already came back to it once and went bad again)."""
        s = self.settings
        folder = latest_checkpoint(s.save) if s.save else None
        what = f"{bad_steps} steps in a row with a non-finite loss or gradient (up to step {self.step})"
        if folder is None:
            raise NumericalFault(
                f"{what} and no checkpoint to roll back to (--save DIR --save-every N keeps "
                "one): lower --lr, raise --clip-grad or check the data"
            )
        if folder == self._rolled_back_to:
            raise NumericalFault(
                f"{what} again after rolling back to {folder}: the fault repeats, it is not "
                "transient; lower --lr, raise --clip-grad or check the data"
            )
        self._load(folder)
        self._rolled_back_to = folder
        self.say(f"{what}: rolled back to {folder}, step {self.step}")
        return folder

    _rolled_back_to = None

    # -- the collective watchdog ------------------------------------------------------------------------
    @property
    def watchdog(self):
        return self.grid.world.watchdog

    def _start_watchdog(self) -> Path | None:
        """The watchdog thread for the run (with --comm-timeout): status files in a folder of the cache
        dir, which every rank sees (corpora need it shared too); the folder, or None when there is no
        timeout. Not during the set-up: rank 0 may tokenize a corpus for hours while the others wait,
        and no timeout tells that from a hung file system."""
        if not self.settings.comm_timeout:
            return None
        world = self.grid.world
        run_id = world.bcast_object(f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}" if self.is_main else None)
        folder = Path(self.settings.cache_dir) / "watchdog" / run_id
        self.watchdog.start(folder)
        return folder

    # -- the whole run --------------------------------------------------------------------------------
    def run(self) -> TrainResult:
        """Train to ``steps`` (resuming, rolling back, stopping on a signal as the settings say)."""
        status_folder = self._start_watchdog()
        try:
            result = self._run()
        finally:
            self.watchdog.stop()
        if status_folder is not None:  # a clean end: nobody needs the ranks' last words
            self.grid.world.barrier()
            if self.is_main:
                shutil.rmtree(status_folder, ignore_errors=True)
        return result

    def _run(self) -> TrainResult:
        s, world = self.settings, self.grid.world
        result = TrainResult()
        if s.resume:
            folder = self.resume()
            self.say(
                f"resumed from {folder} at step {self.step}"
                if folder
                else f"no checkpoint under {s.save} yet: starting at step 0"
            )
        stop = StopRequest()
        world.barrier()  # every rank has its handlers before the line that says so
        self.say(f"training {self._describe()}; USR1/TERM: checkpoint and stop")
        started, start_step = time.monotonic(), self.step
        bad_in_row, save_due = 0, False
        progress = Progress(s.steps, enabled=self.is_main and s.progress, start_step=self.step)
        try:
            with MetricsLogger(s.log, world) as metrics, progress:
                self._say_to = progress.write
                while self.step < s.steps:
                    record = self.train_step()
                    if s.eval_every and self.step % s.eval_every == 0 and self.step < s.steps:
                        evaluation = self.evaluate()
                        if evaluation is not None:
                            record["heldout_accuracy"] = evaluation[0]
                        if (heldout := self.heldout_loss()) is not None:
                            record["heldout_loss"] = heldout
                    result.records.append(metrics.log(record))
                    progress.update(self.step, record["loss"], record["tokens_per_s"])
                    if not record.get("loss_scale_overflow"):  # fp16 scaling at work: neither bad nor good
                        bad_in_row = bad_in_row + 1 if record["skipped"] else 0
                    if s.max_bad_steps and bad_in_row >= s.max_bad_steps:
                        bad_step = self.step
                        self.roll_back(bad_in_row)
                        metrics.log({"step": self.step, "rolled_back_from": bad_step})
                        bad_in_row, save_due = 0, False
                        continue
                    result.stopped_by = stop.received or "a signal on another rank" if stop.agreed(world) else None
                    save_due = save_due or bool(s.save_every and self.step % s.save_every == 0)
                    if s.save and (save_due or result.stopped_by or self.step == s.steps) and not bad_in_row:
                        result.checkpoint, save_due = self.save(), False
                    if result.stopped_by:
                        kept = (
                            f"checkpoint {result.checkpoint}"
                            if result.checkpoint
                            else "the last step was not finite, so no checkpoint"
                            if s.save
                            else "no --save, progress lost"
                        )
                        self.say(f"stopped by {result.stopped_by} after step {self.step}: {kept}")
                        return result
                evaluation = self.evaluate()
                if evaluation is not None:
                    result.accuracy, result.samples = evaluation
                    metrics.log({"step": self.step, "heldout_accuracy": result.accuracy})
                if (heldout := self.heldout_loss()) is not None:
                    result.heldout_loss = heldout
                    metrics.log({"step": self.step, "heldout_loss": heldout})
        finally:
            stop.restore()
            self._say_to = None
        self._report(result, time.monotonic() - started, self.step - start_step)
        return result

    def _describe(self) -> str:
        g, cfg = self.grid, self.cfg
        lora = f", LoRA rank {cfg.lora_rank}: {cfg.lora_parameters() / 1e6:.2f}M trained" if cfg.lora_rank else ""
        return (
            f"{cfg.parameter_count() / 1e6:.2f}M parameters ({cfg.n_layers} layers, hidden {cfg.hidden}{lora}) "
            f"on {describe_layout(self.settings, cfg, g.tp_size, g.pp_size, g.dp_size)}, "
            f"{self.settings.dtype}, data {self.settings.data}, "
            f"global batch {self.settings.global_batch} x {self.seq_len} tokens{self._optimizer_note()}"
        )

    def _optimizer_note(self) -> str:
        if not self.settings.distributed_optimizer:
            return ""
        if isinstance(self.optimizer, ShardedAdamW):
            return f", AdamW sharded over dp={self.grid.dp_size} (ZeRO-1)"
        return ", plain AdamW (--distributed-optimizer has nothing to shard at dp=1)"

    def _report(self, result: TrainResult, seconds: float, steps: int):
        if result.records:
            self.say(f"{steps} steps in {format_duration(seconds)}, final loss {result.records[-1]['loss']:.4f}")
            if "moe_aux" in result.records[-1]:
                self.say(moe_summary(result.records[-1]))
        if result.accuracy is not None:
            shown = result.samples[: self.settings.samples]
            self.say(
                f"held-out accuracy {100 * result.accuracy:.1f}% on {len(result.samples)} problems never "
                f"seen in training"
            )
            for prompt, completion, ok in shown:
                self.say(f"  {prompt}{completion.rstrip()}   {'ok' if ok else 'WRONG'}")

    _say_to = None

    def say(self, message: str):
        """A line on rank 0 (above the progress bar while it runs)."""
        self.messages.append(message)
        if self.is_main:
            (self._say_to or (lambda m: print(m, flush=True)))(message)


def describe_layout(settings: TrainSettings, cfg: ModelConfig, tp: int, pp: int, dp: int) -> str:
    """The layout as ``hpc-tp plan`` prints it (schedule and V at pp > 1, ep, sp, recompute), and the
    micro-batches a step runs: ``tp=1 pp=2 dp=1 micro-batch=2 1f1b V=2, 4 micro-batches a step``.
    ZeRO-1 is left to the line's optimizer note."""
    micro = settings.micro_batch_for(dp, pp)
    count = settings.global_batch // (dp * micro)
    layout = Layout(
        tp,
        pp,
        dp,
        micro,
        settings.recompute,
        settings.schedule,
        cfg.sequence_parallel,
        settings.ep,
        virtual_stages=settings.chunks,
    )
    return f"{layout.describe()}, {count} micro-batch{'es' if count > 1 else ''} a step"


def _watched_world(world, settings: TrainSettings) -> WatchedCommunicator:
    """The run's world, every call named and numbered (what the exception hook and the watchdog report)."""
    if world is None:
        world = mpi_world()
    return watched(world, settings.comm_timeout, settings.debug_collectives)
