"""StreamedTensor: a checkpoint tensor whose data exists only while the checkpoint handles it.

A distributed optimizer holds each state as pieces spread over its data-parallel group, yet a
checkpoint holds it whole, in its parameter's shape. Gathering every state at once would need the
room the sharding saved; a streamed tensor makes its data on demand instead, one at a time:

- ``save_checkpoint`` calls ``fetch(failed)`` once per save on every rank, in the order of the
  ``tensors`` dict, whether or not this rank writes it (a fetch may be a collective over a group
  of ranks: each rank of the group must pass the same streamed tensors in the same order). It
  returns this rank's local array (``partition.local_shape``), used while the tensor is written
  and dropped before the next one is fetched, or None where the fetch gathers it to another rank
  of its group: only the group's first rank may be handed it, the one the checkpoint writes from
  (its writers are the first dp ranks; a writer handed None fails the save).
  ``failed`` says this rank's save has failed already (a write, or an earlier fetch). A fetch
  that is a collective first agrees with its group whether any rank failed, this one included
  (``collective.first_failed``: one scalar all-reduce); if one did, nothing moves and it raises on
  every rank of the group (``PeerFailure``, or a rank's own error where its part of the fetch
  failed before the collective), so no rank waits for a peer that will not come. After a failure
  the remaining tensors are still fetched, with ``failed=True`` (each collective fetch is still
  matched: an agreement, no data), then the save fails on every rank.
- ``load_checkpoint`` calls ``store(local)`` once per load, with this rank's local array (a host
  array of ``partition.local_shape`` and ``dtype``, padding zero), where an ordinary tensor is
  written in place. No collective in it: every rank reads the file itself. After each tensor (or each few) the
  ranks agree whether any failed (a read, a store), and if one did no rank reads another.

Without MPI or h5py, so that the optimizer can make them without importing the writer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..module import Partition


@dataclass(frozen=True)
class StreamedTensor:
    partition: Partition
    dtype: object  # the stored dtype (a numpy dtype or its name)
    fetch: Callable[[bool], object]
    store: Callable[[object], None]
