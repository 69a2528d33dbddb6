"""Pipeline-parallel inference: a decoder cut into pp stages of tp ranks each, which the serving code
(``Engine``, ``ContinuousBatcher``) drives as it drives one ``GPTModel``.

Each stage builds and loads only its layers, split as training splits them
(``pipeline.build_stage``): the first stage embeds, the last holds the final norm and the LM head
(with tied embeddings its own copy of the embedding matrix, loaded from the checkpoint's one
tensor, as a training stage keeps it). Every rank of the replica's tp x pp group calls ``infer``
with the same arguments, broadcast from the group's rank 0 as at pp = 1, so every stage knows the
shape of each message and none travels:

    stage 0       embeds the tokens, runs its layers, sends the hidden states [B, T, H] to stage 1
    stage s       receives them from s - 1, runs its layers, sends them on to s + 1
    last stage    receives, runs its layers, the final norm and the head (logits gathered over tp);
                  its tp rank 0 sends the logits to the group's rank 0 (stage 0, tp rank 0), which samples

A stage's KV cache holds its own layers' K/V (the caches are sized from ``layers``); the block tables
of a paged cache are the same on every rank of the group, which makes the same calls on the same
broadcast inputs. Messages go over the pipeline's communicator (``grid.pp``: the ranks of one tp
position), in the order each pair of stages makes them, so one tag a kind is enough.

The stages run one after another: a decode step waits for every stage in turn (and a hop per stage),
where at pp = 1 it waits for one rank's layers; no micro-batches overlap the stages. On one node that
buys nothing but memory. It is the layout for a model no node can hold: tp inside a node, where its
two all-reduces a layer run on the node's links, and pp across nodes, where a decode step sends only
[B, 1, H] between stages and [B, V] back to the sampler.
"""

from __future__ import annotations

import time

from .. import backend

HIDDEN, LOGITS = 0, 1  # message tags on the pipeline's communicator


class PipelineStages:
    """``stage`` (this rank's part of the model, ``pipeline.build_stage``) and the other stages of
    ``grid``'s pipeline as one model: ``cfg``, ``dtype``, ``layers`` (this stage's, which its KV cache
    holds), ``comm`` (the replica's tp x pp group: control broadcasts, and its rank 0 samples) and
    ``infer``. Collective over the world (it makes the groups)."""

    def __init__(self, stage, grid):
        self.stage, self.cfg, self.dtype, self.layers = stage, stage.cfg, stage.dtype, stage.layers
        self.pp, self.first, self.last = grid.pp, grid.is_first_stage, grid.is_last_stage
        self.sends_logits = self.last and grid.coords.tp == 0
        self.comm = grid.world.split(color=grid.coords.dp, key=grid.coords.pp * grid.tp_size + grid.coords.tp)
        self._message_dtype = backend.xp.dtype(stage.dtype)  # hidden states and logits keep the model's dtype
        # time in receives from a neighbouring stage: wall, and the CPU that MPI's wait spins meanwhile
        self.wait_seconds = self.wait_cpu_seconds = 0.0

    def infer(self, ids, positions, key_mask, cache, all_positions: bool = False, last=None):
        """``GPTModel.infer`` through every stage, each writing its layers' K/V into its own ``cache``.
        Collective over ``comm``. Returns the logits on its rank 0 (the rank that samples), None on
        the others."""
        batch, tokens = ids.shape
        if self.first:
            x, _ = self.stage.embed_forward(ids, positions)
        else:
            x = self._receive((batch, tokens, self.cfg.hidden), self.pp.rank - 1, HIDDEN)
        x = self.stage.infer_blocks(x, positions, key_mask, cache)
        cache.advance(tokens)
        if not self.last:
            self._send(x, self.pp.rank + 1, HIDDEN)
        else:
            logits = self.stage.infer_logits(x, all_positions, last)  # every tp rank: the head gathers over tp
            if self.sends_logits:
                self._send(logits, 0, LOGITS)
        if self.comm.rank != 0:
            return None
        picked = batch if last is None else len(last)  # a mixed pass picks tokens of its one row
        shape = (batch, tokens, self.cfg.vocab_size) if all_positions else (picked, self.cfg.vocab_size)
        return self._receive(shape, self.pp.size - 1, LOGITS)

    def _receive(self, shape, source: int, tag: int):
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            return self.pp.recv(backend.xp.empty(shape, self._message_dtype), source, tag)
        finally:
            self.wait_seconds += time.perf_counter() - wall
            self.wait_cpu_seconds += time.process_time() - cpu

    def _send(self, x, dest: int, tag: int):
        if x.dtype != self._message_dtype:  # the receiver allocated for the model's dtype
            raise ValueError(f"pipeline message of {x.dtype}, the receiving stage expects {self._message_dtype}")
        self.pp.send(x, dest, tag)
