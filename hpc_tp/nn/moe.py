"""Mixture-of-Experts MLP: a router sends each token to its top-k experts (Switch / GShard).

    probs = softmax(x W_router)                  W_router [H, E], replicated
    top-k experts per token; gates = their probs (renormalised to sum 1 when k > 1, unless
        ``normalize_top_k`` is off: Qwen2-MoE keeps the softmax probabilities as they are)
    y = sum over kept choices of gate * expert_e(x)
      (+ sigmoid(x w_shared) * shared_expert(x)  with a shared expert, Qwen2-MoE)

Experts are plain ``ParallelMLP`` s, so each is tensor-parallel inside over the tp group (its
ranks hold the same tokens and route them alike); they are spread over the expert-parallel
group with all-to-all dispatch and combine (``tensor_parallel/experts.py``, which also states
the capacity rule). Each expert is its own set of parameters named by its global index
(``experts.<e>.fc1.weight`` ...), stored at its full logical shape, so a checkpoint loads at any
ep and any tp. The shared expert is a dense tensor-parallel MLP every rank runs on its own tokens,
and its gate vector ``shared_expert_gate`` [H] is replicated like the router.

Load balancing (Switch Transformer): ``aux = E * sum_e f_e P_e``, f_e the share of the group's
assignments routed to e (before dropping), P_e the mean router probability of e. As a sum over
tokens, ``aux_sum = coef * sum_t E * sum_e f_e p_te`` (= coef * tokens * aux), it is scaled like
the cross entropy's token sum: backward adds ``loss_scale * coef * E * f_e`` to dL/dp_te. The
model sets ``loss_scale`` (1 / global token count) before backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from .. import backend
from ..comm.base import Communicator
from ..kernels import blas
from ..kernels import functional as F
from ..module import Module, ModuleList, Parameter, param_buffer, replicated
from ..tensor_parallel.experts import ExpertDispatcher
from ..tensor_parallel.mappings import SEQUENCE_AXIS, GatherFromTensorParallel, Identity, ScatterToTensorParallel
from .mlp import ParallelMLP


def is_expert_parameter(name: str) -> bool:
    """Expert weights differ across the ep group: their gradients are summed over the expert
    data-parallel group (``ProcessGrid.expert_dp``), not the whole dp group."""
    return ".experts." in name or name.startswith("experts.")


@dataclass
class MoEStats:
    """Counted over the forwards since the last reset (the same on every rank of an ep group;
    a forward rerun by activation recomputation is not counted again)."""

    forwards: int = 0
    assignments: int = 0  # token-choices routed
    dropped: int = 0  # of those, over capacity
    aux: float = 0.0  # sum of the per-forward load-balancing loss (without its coefficient)
    load: object = None  # [E] assignments routed to each expert (before dropping)


class LocalExperts(ModuleList):
    """This rank's experts, named by their global index."""

    def __init__(self, experts, first: int):
        super().__init__(experts)
        self.first = first

    def named_parameters(self, prefix: str = ""):
        for i, m in enumerate(self.items):
            yield from m.named_parameters(f"{prefix}{self.first + i}.")


class MoEContext(NamedTuple):
    """What ``MoEMLP.forward`` keeps for backward (and ``aux_sum``)."""

    shape: tuple  # the input's
    xs: object  # the input's tokens [N, hidden]
    probs: object  # router probabilities [N, E]
    choices: object  # top-k expert ids [N, k]
    chosen: object  # their probabilities [N, k]
    gates: object  # the weights their outputs are summed with [N, k]
    share: object  # f_e: each expert's share of the group's assignments [E]
    plan: object  # the dispatcher's DispatchPlan
    y_rows: object  # the experts' outputs, one row per kept assignment
    expert_ctxs: list  # each local expert's own context
    shared: object  # (its output [N, H], its scale [N, 1], its context) or None: no shared expert


class MoEMLP(Module):
    def __init__(
        self,
        hidden: int,
        ffn_hidden: int,
        num_experts: int,
        top_k: int,
        comm: Communicator,
        ep_comm: Communicator | None = None,
        capacity_factor: float = 1.25,
        aux_loss_coef: float = 0.01,
        activation: str = "gelu_tanh",
        bias: bool = True,
        dtype="float64",
        sequence_parallel: bool = False,
        shared_expert_ffn_hidden: int = 0,
        normalize_top_k: bool = True,
    ):
        self.num_experts, self.top_k, self.aux_loss_coef = num_experts, top_k, aux_loss_coef
        self.normalize_top_k = normalize_top_k and top_k > 1
        # Inside a sequence-parallel block the input is a sequence shard [B, T/tp, H], but the experts
        # are tensor-parallel: every tp rank must route and feed them the same tokens. The shards are
        # all-gathered in (backward keeps this rank's shard of the input gradient, which the experts'
        # f has already summed over tp) and the replicated output is cut back to this rank's shard
        # (backward all-gathers the output gradient). The bytes are those of the all-reduce plain tp
        # does before this layer; the layer keeps its gathered input, so its own activations are not
        # divided by tp.
        sharded = sequence_parallel and comm.size > 1
        self._gather_sequence = GatherFromTensorParallel(comm, SEQUENCE_AXIS) if sharded else Identity()
        self._scatter_sequence = ScatterToTensorParallel(comm, SEQUENCE_AXIS) if sharded else Identity()
        self._dispatcher = ExpertDispatcher(num_experts, ep_comm, capacity_factor)
        self.router = Parameter(
            param_buffer((hidden, num_experts), dtype), replicated((hidden, num_experts), comm.size)
        )
        self.experts = LocalExperts(
            [
                ParallelMLP(hidden, ffn_hidden, comm, activation, bias, dtype)
                for _ in range(self._dispatcher.local_experts)
            ],
            self._dispatcher.first_expert,
        )
        # The shared expert sees the gathered tokens like the routed ones, so it is not sequence-parallel itself.
        self.shared_expert = self.shared_expert_gate = None
        if shared_expert_ffn_hidden:
            self.shared_expert = ParallelMLP(hidden, shared_expert_ffn_hidden, comm, activation, bias, dtype)
            self.shared_expert_gate = Parameter(param_buffer(hidden, dtype), replicated((hidden,), comm.size))
        self.loss_scale = 1.0
        self.stats = MoEStats()
        self.count_stats = True
        self.dropless = False  # inference keeps every token's choices (GPTModel.infer)

    def route(self, xs):
        """Router probabilities [N, E], top-k choices [N, k] (ties go to the lower expert id),
        the chosen probabilities and the gates."""
        xp = backend.xp_of(xs)
        probs = F.softmax_forward(blas.matmul(xs, self.router.data))
        # Sorted as float32 (exact for the half types): cupy cannot sort bfloat16.
        choices = xp.argsort(-probs.astype("float32", copy=False), axis=1, kind="stable")[:, : self.top_k]
        chosen = xp.take_along_axis(probs, choices, axis=1)
        gates = chosen / chosen.sum(axis=1, keepdims=True) if self.normalize_top_k else chosen
        return probs, choices, chosen, gates

    def forward(self, x):
        x = self._gather_sequence.forward(x)
        xp = backend.xp_of(x)
        xs = x.reshape(-1, x.shape[-1])
        probs, choices, chosen, gates = self.route(xs)
        plan = self._dispatcher.plan(choices, probs, self.dropless)
        inputs = self._dispatcher.dispatch(xs[plan.token], plan)
        results = [e.forward(v) for e, v in zip(self.experts, inputs)]
        expert_ctxs = [c for _, c in results]
        y_rows = self._dispatcher.combine([y for y, _ in results], plan, xs.shape[1], xs.dtype)
        y = xp.zeros_like(xs)
        F.scatter_add_rows(y, plan.token, gates[plan.token, plan.choice][:, None] * y_rows)
        shared = None
        if self.shared_expert is not None:
            out, shared_ctx = self.shared_expert.forward(xs)
            scale = 1.0 / (1.0 + xp.exp(-blas.matmul(xs, self.shared_expert_gate.data.reshape(-1, 1))))
            y += scale * out
            shared = (out, scale, shared_ctx)
        share = xp.asarray(plan.assignments / (plan.group_tokens * self.top_k))  # f_e
        if self.count_stats:
            self._count(plan, float(self.num_experts * share @ xp.asarray(plan.group_prob_sum / plan.group_tokens)))
        ctx = MoEContext(x.shape, xs, probs, choices, chosen, gates, share, plan, y_rows, expert_ctxs, shared)
        return self._scatter_sequence.forward(y.reshape(x.shape)), ctx

    def _count(self, plan, aux: float):
        stats = self.stats
        stats.forwards += 1
        stats.assignments += int(plan.assignments.sum())
        stats.dropped += plan.dropped
        stats.aux += aux
        stats.load = plan.assignments.copy() if stats.load is None else stats.load + plan.assignments

    def aux_sum(self, ctx) -> float:
        """This rank's share of the scaled load-balancing loss, ``coef * sum_t E * sum_e f_e p_te``;
        summed over the ep group it is ``coef * tokens * aux``."""
        return float(self.aux_loss_coef * self.num_experts * (ctx.probs.sum(axis=0) @ ctx.share))

    def backward(self, dy, ctx):
        shape, xs, probs, choices, chosen, gates, share, plan, y_rows, expert_ctxs, shared = ctx
        xp = backend.xp_of(dy)
        d = self._scatter_sequence.backward(dy).reshape(-1, shape[-1])
        d_rows = d[plan.token]
        dgates = xp.zeros_like(gates)
        dgates[plan.token, plan.choice] = (d_rows * y_rows).sum(axis=1)
        d_inputs = self._dispatcher.dispatch(d_rows * gates[plan.token, plan.choice][:, None], plan)
        d_expert_in = [e.backward(g, c) for e, g, c in zip(self.experts, d_inputs, expert_ctxs)]
        dx = xp.zeros_like(xs)
        F.scatter_add_rows(dx, plan.token, self._dispatcher.combine(d_expert_in, plan, xs.shape[1], xs.dtype))
        if shared is not None:  # y += s * out with s = sigmoid(x w): ds/dz = s (1 - s)
            out, scale, shared_ctx = shared
            dz = (d * out).sum(axis=1) * (scale * (1.0 - scale))[:, 0]
            blas.matmul(xs.T, dz[:, None], out=self.shared_expert_gate.grad.reshape(-1, 1), accumulate=True)
            dx += self.shared_expert.backward(d * scale, shared_ctx)
            dx += dz[:, None] * self.shared_expert_gate.data[None, :]
        if self.normalize_top_k:  # through gates = chosen / sum(chosen)
            total = chosen.sum(axis=1, keepdims=True)
            dchosen = dgates / total - (dgates * chosen).sum(axis=1, keepdims=True) / total**2
        else:
            dchosen = dgates
        dprobs = xp.zeros_like(probs)
        dprobs[xp.arange(probs.shape[0])[:, None], choices] = dchosen  # a token's k experts are distinct
        dprobs += (self.loss_scale * self.aux_loss_coef * self.num_experts) * share[None, :]
        dlogits = F.softmax_backward(dprobs, probs)
        blas.matmul(xs.T, dlogits, out=self.router.grad, accumulate=True)
        blas.matmul(dlogits, self.router.data.T, out=dx, accumulate=True)
        return self._gather_sequence.backward(dx.reshape(shape))


def feed_forward(cfg, comm: Communicator, layer_id: int, ep_comm: Communicator | None, dtype):
    """The MLP of block ``layer_id``: a MoE layer where ``cfg.is_moe_layer`` says so, else dense."""
    if not cfg.is_moe_layer(layer_id):
        return ParallelMLP(
            cfg.hidden,
            cfg.ffn_hidden,
            comm,
            cfg.activation,
            cfg.bias,
            dtype,
            sequence_parallel=cfg.sequence_parallel,
            quantize=cfg.quantize,
            lora=cfg.lora(),
        )
    return MoEMLP(
        cfg.hidden,
        cfg.expert_ffn_hidden,
        cfg.num_experts,
        cfg.top_k,
        comm,
        ep_comm,
        cfg.capacity_factor,
        cfg.aux_loss_coef,
        cfg.activation,
        cfg.bias,
        dtype,
        sequence_parallel=cfg.sequence_parallel,
        shared_expert_ffn_hidden=cfg.shared_expert_ffn_hidden,
        normalize_top_k=cfg.normalize_top_k,
    )
