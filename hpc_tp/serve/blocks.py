"""Which blocks of a paged KV cache each sequence holds, and the prefix cache over them.

The device memory (``kv_cache.PagedKVCache``) is one pool of blocks of ``block_size`` slots; this is
the host's bookkeeping over their numbers. Every rank of a tp group keeps its own copy and makes the
same calls in the same order (each rank holds its own heads of every block), so the copies agree
without a block number ever being sent.

- A ``Sequence`` (one request's K/V) has a block table: its slot s lies in block ``blocks[s // size]``
  at ``s % size``. It takes a block when it reaches one's first slot: memory follows the tokens held.
- Block 0 is scratch: never handed out, it takes the padding of a batched prefill, which nobody reads.
- Prefix caching, as vLLM's automatic prefix caching: a full block is named by its tokens and the name
  of the block before it (a hash chain), so a name stands for every token from slot 0 to the block's
  end. A prompt whose first blocks have names the cache holds shares those blocks: its table points at
  them and their reference counts grow. A partly filled block is never shared, since its owner goes
  on writing in it: a prompt that continues into one (a chat's next turn, after the last answer's
  unfinished block) gets a copy of it (copy-on-write) and prefills only the rest.
- Where every layer of the model has a sliding window, a sequence gives back the blocks that fell
  wholly out of the widest one as it goes on (``drop_before``), so a long request holds about a
  window's worth of blocks; a model with any global layer keeps them all.
- A block no sequence references keeps its K/V, and its place in the cache, while it holds tokens a
  prompt may continue: it is evictable, and once no free block is left the least recently released
  is reused first (LRU). Without prefix caching a released block is simply free.

Names are Python's hash of (the previous name, the block's tokens), deterministic for ints on every
rank; a lookup also compares the block's own tokens, so only two different prefixes whose names
collide before the block could be mistaken for each other (vLLM's chained hashes have the same
property).
"""

from __future__ import annotations

from collections import OrderedDict, deque

import numpy

SCRATCH = 0  # the block padding is written to


class Sequence:
    """One request's K/V: its block table, and (with prefix caching) the tokens the filled slots hold
    and the name of each full block's chain."""

    def __init__(self):
        self.blocks: list[int] = []
        self.length = 0  # slots filled
        self.tokens: list[int] = []  # their token ids (prefix caching only)
        self.names: list[int] = []  # the chain's name after each full block (prefix caching only)
        self.dropped = 0  # leading blocks given back: no layer's window reaches them any more

    def slots(self, size: int, count: int):
        """Its first ``count`` slots' indices in the pool's flat slot axis (block b's slots are
        b * size .. b * size + size - 1), an int64 array."""
        table = numpy.asarray(self.blocks, dtype=numpy.int64)
        return (table[:, None] * size + numpy.arange(size)).reshape(-1)[:count]


class BlockManager:
    """``blocks`` blocks of ``size`` slots (block 0 scratch), handed to ``Sequence``s."""

    def __init__(self, blocks: int, size: int, prefix_caching: bool = True):
        self.size, self.prefix_caching = size, prefix_caching
        self.refs = [0] * blocks
        self.free: deque[int] = deque(range(1, blocks))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced, holding tokens: oldest first
        self.tokens: list[list[int]] = [[] for _ in range(blocks)]  # each block's tokens (prefix caching)
        self.parent: list[int | None] = [None] * blocks  # the name of the chain before each block
        self.name: list[int | None] = [None] * blocks  # a full block's name, where it is the one named so
        self.named: dict[int, int] = {}  # name -> the full block holding it
        self.children: dict[int | None, dict[int, None]] = {}  # chain name -> blocks following it

    @property
    def usable(self) -> int:
        return len(self.refs) - 1

    def available(self) -> int:
        """Blocks a sequence could take now: the free ones and the evictable ones."""
        return len(self.free) + len(self.evictable)

    def blocks_for(self, slots: int) -> int:
        return -(-slots // self.size)

    def admit(self, seq: Sequence, ids: list[int], limit: int) -> tuple[int, int] | None:
        """Start empty ``seq`` on the longest cached prefix of ``ids[:limit]`` (its ``length`` the
        tokens found); returns (source, copy) where a partly filled block was copied, whose K/V the
        caller copies, else None."""
        if not self.prefix_caching:
            return None
        name, pos = None, 0
        while pos + self.size <= limit:
            piece = ids[pos : pos + self.size]
            key = hash((name, tuple(piece)))
            block = self.named.get(key)
            if block is None or self.tokens[block] != piece:
                break
            self._take(block)
            seq.blocks.append(block)
            seq.names.append(key)
            name, pos = key, pos + self.size
        source, shared = self._longest_continuation(name, ids[pos:limit])
        copy = None
        if shared:
            self._take(source)  # not evicted for its own copy
            copy = self._allocate()
            self.release_block(source)
        if copy is not None:
            seq.blocks.append(copy)
            self._record(copy, name, ids[pos : pos + shared])
            pos += shared
        seq.length, seq.tokens = pos, ids[:pos]
        return None if copy is None else (source, copy)

    def _longest_continuation(self, name: int | None, rest: list[int]) -> tuple[int | None, int]:
        """(block, count): of the blocks after chain ``name``, the one whose first tokens match the
        most of ``rest``, and how many (0: none matches)."""
        best, source = 0, None
        for block in self.children.get(name, ()):
            held = self.tokens[block]
            shared = next((i for i, (a, b) in enumerate(zip(held, rest)) if a != b), min(len(held), len(rest)))
            if shared > best:
                best, source = shared, block
        return source, best

    def reserve(self, seq: Sequence, slots: int) -> bool:
        """Blocks for ``seq``'s first ``slots`` slots; False (and nothing taken) where too few are left."""
        needed = self.blocks_for(slots) - len(seq.blocks)
        if needed > self.available():
            return False
        for _ in range(needed):
            seq.blocks.append(self._allocate())
        return True

    def written(self, seq: Sequence, tokens: list[int]):
        """``tokens``' K/V are now in ``seq``'s next slots (its blocks reserved): with prefix caching
        each block they fill gets its name, and a partly filled one records them for a prompt that
        may continue it."""
        start = seq.length
        seq.length += len(tokens)
        if not self.prefix_caching:
            return
        seq.tokens.extend(tokens)
        for first in range(start - start % self.size, seq.length, self.size):
            block, stop = seq.blocks[first // self.size], min(first + self.size, seq.length)
            parent = seq.names[-1] if seq.names else None
            self._record(block, parent, seq.tokens[max(first, start) : stop])
            if len(self.tokens[block]) == self.size:
                name = hash((parent, tuple(self.tokens[block])))
                seq.names.append(name)
                if name not in self.named:
                    self.named[name], self.name[block] = block, name

    def release(self, seq: Sequence):
        """Every block of ``seq`` given back, its last first (the least likely to be shared: the
        first evicted), and ``seq`` empty."""
        for block in reversed(seq.blocks[seq.dropped :]):
            self.release_block(block)
        seq.__init__()

    def drop_before(self, seq: Sequence, slot: int):
        """``seq``'s blocks wholly before slot ``slot`` given back, their table entries the scratch
        block: every layer's sliding window has passed them, so nothing reads them again."""
        while seq.dropped < min(slot // self.size, len(seq.blocks)):
            self.release_block(seq.blocks[seq.dropped])
            seq.blocks[seq.dropped] = SCRATCH
            seq.dropped += 1

    def release_block(self, block: int):
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if self.tokens[block]:
                self.evictable[block] = None
            else:
                self.free.append(block)

    def _take(self, block: int):
        if self.refs[block] == 0:
            del self.evictable[block]
        self.refs[block] += 1

    def _allocate(self) -> int | None:
        if self.free:
            block = self.free.popleft()
        elif self.evictable:
            block, _ = self.evictable.popitem(last=False)
            self._forget(block)
        else:
            return None
        self.refs[block] = 1
        return block

    def _record(self, block: int, parent: int | None, tokens: list[int]):
        if not self.tokens[block]:
            self.parent[block] = parent
            self.children.setdefault(parent, {})[block] = None
        self.tokens[block].extend(tokens)

    def _forget(self, block: int):
        """An evicted block's place in the prefix cache dropped: it is about to hold other tokens."""
        if self.name[block] is not None:
            del self.named[self.name[block]]
        siblings = self.children[self.parent[block]]
        del siblings[block]
        if not siblings:
            del self.children[self.parent[block]]
        self.tokens[block], self.parent[block], self.name[block] = [], None, None
