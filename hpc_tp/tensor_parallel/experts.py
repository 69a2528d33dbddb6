"""Expert-parallel dispatch and combine: tokens travel to the rank that owns their expert and back.

The experts are spread over an expert-parallel (ep) group, ``num_experts / ep`` consecutive
experts per rank. Each rank routes its own tokens; ``plan`` agrees, with one small all-gather
of per-expert counts, on which assignments (token, k-th choice) every expert keeps and how
many rows travel between every pair of ranks. ``dispatch`` is one all-to-all of [ep, M, H]
(M: the largest number of rows any rank sends any other, so pieces are equal), ``combine``
the reverse all-to-all. Each is the other's adjoint, so backward reuses them.

Capacity, the same rule at every ep. An expert keeps at most
``capacity = ceil(capacity_factor * tokens * top_k / num_experts)`` assignments, where
``tokens`` counts the whole ep group's tokens of this micro-batch. Its queue is ordered by
choice (every first choice before any second choice, as in GShard), then by the token's place
in the group's batch (rank order, then row order on the rank). Assignments past capacity are
dropped: they contribute nothing to their token's output (the residual carries the token on).
Since the queue order depends only on the group's whole batch, ep=1 on the concatenated batch
drops exactly what ep=N drops. Inference plans ``dropless``: capacity is the group's token count,
so every assignment is kept and a token's output does not depend on the others in its batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy

from .. import backend
from ..comm.base import Communicator
from ..errors import ConfigError


@dataclass
class DispatchPlan:
    """One micro-batch's routing agreement; the numbers before ``token`` are the same on every ep rank."""

    capacity: int
    group_tokens: int  # tokens of the whole ep group
    assignments: object  # [E] assignments routed to each expert, over the group, before dropping
    group_prob_sum: object  # [E] router probabilities summed over the group's tokens
    dropped: int  # assignments over capacity, over the group
    rows_per_piece: int  # M: rows of each all-to-all piece
    token: object  # [A] this rank's kept assignments in send order: token row ...
    choice: object  # ... and which of its top-k choices
    send_index: object  # [A] flat row in the [ep * M] send buffer of each kept assignment
    expert_rows: list  # per local expert: flat rows of the [ep * M] receive buffer it takes


class ExpertDispatcher:
    def __init__(self, num_experts: int, ep_comm: Communicator | None, capacity_factor: float):
        self.ep = 1 if ep_comm is None else ep_comm.size
        if num_experts % self.ep:
            raise ConfigError(f"num_experts={num_experts} is not divisible by expert-parallel size {self.ep}")
        self.comm, self.num_experts, self.capacity_factor = ep_comm, num_experts, capacity_factor
        self.rank = 0 if ep_comm is None else ep_comm.rank
        self.local_experts = num_experts // self.ep
        self.first_expert = self.rank * self.local_experts

    def plan(self, choices, probs, dropless: bool = False) -> DispatchPlan:
        """``choices`` [N, k] expert ids of this rank's tokens, ``probs`` [N, E] router probabilities;
        ``dropless``: no capacity (an expert can be chosen by each token once, so by at most all of them)."""
        xp = backend.xp_of(probs)
        n, k = choices.shape
        E, ep = self.num_experts, self.ep
        flat = backend.to_numpy(choices).T.reshape(-1)  # choice-major: a = j * N + t
        counts = numpy.zeros((k, E), dtype=numpy.int64)
        numpy.add.at(counts, (numpy.repeat(numpy.arange(k), n), flat), 1)
        mine = numpy.concatenate([counts.ravel().astype(numpy.float64), backend.to_numpy(probs.sum(axis=0)), [n]])
        everyone = mine[None] if ep == 1 else backend.to_numpy(self.comm.all_gather(xp.asarray(mine)[None]))
        all_counts = everyone[:, : k * E].reshape(ep, k, E).round().astype(numpy.int64)
        group_tokens = int(everyone[:, -1].sum())
        capacity = group_tokens if dropless else math.ceil(self.capacity_factor * group_tokens * k / E)
        # Where each (rank, choice, expert) block starts in its expert's queue, and how much of it fits.
        per_choice = all_counts.sum(axis=0)  # [k, E]
        before_choice = numpy.cumsum(per_choice, axis=0) - per_choice  # earlier choices, all ranks
        before_rank = numpy.cumsum(all_counts, axis=0) - all_counts  # same choice, earlier ranks
        start = before_choice[None] + before_rank
        kept_counts = numpy.clip(capacity - start, 0, all_counts)  # [ep, k, E]
        # This rank's assignments: place inside its (choice, expert) block, then kept or not.
        block = numpy.repeat(numpy.arange(k), n) * E + flat
        order = numpy.argsort(block, kind="stable")
        place = numpy.empty_like(order)
        sorted_blocks = block[order]
        first_of_block = numpy.searchsorted(sorted_blocks, sorted_blocks, side="left")
        place[order] = numpy.arange(order.size) - first_of_block
        kept = place < kept_counts[self.rank].reshape(-1)[block]
        # Send order: by expert (so by destination rank), then choice, then token.
        kept_ids = numpy.nonzero(kept)[0]
        kept_ids = kept_ids[numpy.argsort(flat[kept_ids], kind="stable")]
        per_expert = kept_counts.sum(axis=1)  # [ep (source), E]
        sends = per_expert.reshape(ep, ep, self.local_experts).sum(axis=2)  # [source, destination]
        rows = int(sends.max(initial=0))
        dest = flat[kept_ids] // self.local_experts
        offset_in_piece = numpy.arange(kept_ids.size) - numpy.searchsorted(dest, dest, side="left")
        send_index = dest * rows + offset_in_piece
        device = backend.xp.asarray
        return DispatchPlan(
            capacity=capacity,
            group_tokens=group_tokens,
            assignments=per_choice.sum(axis=0),
            group_prob_sum=everyone[:, k * E : k * E + E].sum(axis=0),
            dropped=int(all_counts.sum() - kept_counts.sum()),
            rows_per_piece=rows,
            token=device(kept_ids % n),
            choice=device(kept_ids // n),
            send_index=device(send_index),
            expert_rows=[device(r) for r in self._expert_rows(per_expert, rows)],
        )

    def _expert_rows(self, per_expert, rows: int) -> list:
        """Rows of the receive buffer per local expert: from each source in rank order, whose
        piece lists this rank's experts one after another."""
        mine = per_expert[:, self.first_expert : self.first_expert + self.local_experts]  # [source, local expert]
        starts = numpy.cumsum(mine, axis=1) - mine
        return [
            numpy.concatenate(
                [source * rows + starts[source, e] + numpy.arange(mine[source, e]) for source in range(self.ep)]
            ).astype(numpy.int64)
            for e in range(self.local_experts)
        ]

    def _exchange(self, buffer, plan: DispatchPlan):
        if self.ep == 1:
            return buffer
        hidden = buffer.shape[-1]
        return self.comm.all_to_all(buffer.reshape(self.ep, plan.rows_per_piece, hidden)).reshape(-1, hidden)

    def dispatch(self, rows, plan: DispatchPlan) -> list:
        """Rows [A, H] of the kept assignments (send order) -> one [n_e, H] array per local expert."""
        xp = backend.xp_of(rows)
        send = xp.zeros((self.ep * plan.rows_per_piece, rows.shape[-1]), dtype=rows.dtype)
        send[plan.send_index] = rows
        received = self._exchange(send, plan)
        return [received[index] for index in plan.expert_rows]

    def combine(self, expert_rows: list, plan: DispatchPlan, hidden: int, dtype):
        """The adjoint of ``dispatch``: per-expert rows go back to the ranks and places they came from."""
        back = backend.xp.zeros((self.ep * plan.rows_per_piece, hidden), dtype=dtype)
        for index, values in zip(plan.expert_rows, expert_rows):
            back[index] = values
        return self._exchange(back, plan)[plan.send_index]
