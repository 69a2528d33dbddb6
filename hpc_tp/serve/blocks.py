"""Which blocks of a paged KV cache each sequence holds, and the prefix cache over them.

The device memory (``kv_cache.PagedKVCache``) is one pool of units of ``block_size`` slots; this is
the host's bookkeeping over their numbers. Every rank of a tp group keeps its own copy and makes the
same calls in the same order (each rank holds its own heads of every unit), so the copies agree
without a number ever being sent.

- Layer kinds (``PagedLayout``): the layers that share a sliding window (or have none) are one kind,
  with one block table a sequence. A unit holds ``group`` layers' K/V for a block's tokens (``group``
  the greatest common divisor of the kinds' layer counts), so a kind of n layers takes n / group
  units for each of its blocks: with no window, or one window in every layer, that is one unit a
  block, the unit every layer's K/V; Gemma 3 12B's 40 local layers and 8 global make units of 8
  layers, 5 a local block and 1 a global one, each kind its own table.
- One pool for every kind, not one each: a sequence's kinds need units in a ratio that changes with
  its length (the same at 500 tokens, 5 local units to 1 global; at 8K a windowed kind holds only its
  window), so any fixed split of ``--kv-cache-memory`` would leave one kind's part idle while the
  other preempts. One free list and one LRU over units keep admission ("are there units for this
  prompt") and preemption ("too few units: the youngest gives back all it holds") as with one kind.
- A ``Sequence`` (one request's K/V) has a block table per kind: its slot s lies in block
  ``tables[kind][s // size]`` at ``s % size``. It takes a block when it reaches one's first slot:
  memory follows the tokens held.
- Unit 0 is scratch: never handed out, it takes the padding of a batched prefill, which nobody reads,
  and stands in a windowed kind's table for the blocks given back.
- A windowed kind gives back each block that falls wholly out of its window as the sequence goes on
  (``written``), so it holds at most its window, the tokens of a prefill chunk and a block: a long
  request on a model with global layers holds the whole context only in the global kind's blocks.
- Prefix caching, as vLLM's automatic prefix caching: a full block is named by its tokens and the name
  of the block before it (a hash chain), so a name stands for every token from slot 0 to the block's
  end; each kind has its own block of a name. A prompt whose first blocks have names the cache holds
  shares those blocks: its tables point at them and their reference counts grow. A global kind must
  hold every block of the prefix; a windowed kind only those its window sees from the prefix's end,
  the only ones it takes. A windowed block given back stays cached, unreferenced, until evicted (being
  released early, it is among the first), so a chat's next turn still finds its whole prefix while
  the global blocks and the window's last ones are cached. A partly filled block is never shared,
  since its owner goes on writing in it: a prompt that continues into one (a chat's next turn, after
  the last answer's unfinished block) gets a copy of it in each kind (copy-on-write) and prefills only
  the rest.
- A block no sequence references keeps its K/V, and its place in the cache, while it holds tokens a
  prompt may continue: it is evictable, and once too few free units are left the least recently
  released is reused first (LRU). Without prefix caching a released block is simply free.

Names are Python's hash of (the previous name, the block's tokens), deterministic for ints on every
rank; a lookup also compares the block's own tokens, so only two different prefixes whose names
collide before the block could be mistaken for each other (vLLM's chained hashes have the same
property).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from itertools import accumulate

import numpy

from ..errors import ConfigError

SCRATCH = 0  # the unit padding is written to, and a given-back block's stand-in


class PagedLayout:
    """How the layers of sliding ``windows`` (one a layer, 0: none) share a paged cache of blocks of
    ``block_size`` slots, prefilled ``chunk_tokens`` at a time at most: the kinds (one a window, in
    increasing order), the units a block of each kind takes, and each layer's lane."""

    def __init__(self, windows: list[int], block_size: int, chunk_tokens: int = 1):
        if not (isinstance(block_size, int) and block_size >= 1):
            raise ConfigError(f"--kv-block-size {block_size}: expected an integer >= 1")
        self.size, self.chunk = block_size, chunk_tokens
        self.windows = sorted(set(windows))
        counts = [windows.count(w) for w in self.windows]
        self.group = math.gcd(*counts)  # layers a unit holds: the pool's leading axis
        self.units = [n // self.group for n in counts]  # units a block of each kind takes
        self.lanes = sum(self.units)  # block tables spelled out in units, each kind's in turn
        first, seen = [0, *accumulate(self.units)], [0] * len(counts)
        self.lane_of = []  # each layer's lane: its kind's j-th layer in the kind's (j // group)-th
        for w in windows:
            kind = self.windows.index(w)
            self.lane_of.append(first[kind] + seen[kind] // self.group)
            seen[kind] += 1

    def places(self, layer_ids) -> list[tuple[int, int]]:
        """(index on a pool's leading axis, lane) of each layer of ``layer_ids`` (a pipeline stage's,
        or every one): the layers of a lane that the pool holds take indices 0, 1, ..., so that a
        stage's pool holds only its own layers' K/V of each unit."""
        places, seen = [], {}
        for layer in layer_ids:
            lane = self.lane_of[layer]
            places.append((seen.get(lane, 0), lane))
            seen[lane] = seen.get(lane, 0) + 1
        return places

    @classmethod
    def of(cls, cfg, block_size: int, chunk_tokens: int = 1) -> PagedLayout:
        return cls([cfg.window_of(i) for i in range(cfg.n_layers)], block_size, chunk_tokens)

    def blocks_for(self, slots: int) -> int:
        return -(-slots // self.size)

    def cap(self, kind: int) -> int | None:
        """The most blocks kind ``kind`` holds for a sequence (None: every one): its window's last
        positions before a prefill chunk and the chunk, wherever they fall in their blocks."""
        window = self.windows[kind]
        if not window:
            return None
        return (window - 1 + self.chunk + self.size - 2) // self.size + 1

    def units_for(self, slots: int) -> int:
        """The most units a sequence of ``slots`` slots holds at once."""
        return self._units_in(self.blocks_for(slots))

    def _units_in(self, blocks: int) -> int:
        return sum(m * min(blocks, self.cap(k) or blocks) for k, m in enumerate(self.units))

    def most_slots(self, units: int) -> int | None:
        """The most slots one sequence may reach in ``units`` units (None: any number, every kind
        windowed and their windows fitting)."""
        caps = [self.cap(k) for k in range(len(self.windows))]
        if all(caps) and self._units_in(max(caps)) <= units:
            return None
        low, high = 0, units + max(cap or 0 for cap in caps)
        while low < high:  # the most blocks whose units fit
            mid = (low + high + 1) // 2
            low, high = (mid, high) if self._units_in(mid) <= units else (low, mid - 1)
        return low * self.size


class Sequence:
    """One request's K/V: a block table of each of ``kinds`` kinds, and (with prefix caching) the
    tokens the filled slots hold and the name of each full block's chain."""

    def __init__(self, kinds: int = 1):
        self.tables: list[list[int]] = [[] for _ in range(kinds)]  # each kind's blocks (their first units)
        self.dropped = [0] * kinds  # each kind's leading blocks given back: out of its window
        self.length = 0  # slots filled
        self.tokens: list[int] = []  # their token ids (prefix caching only)
        self.names: list[int] = []  # the chain's name after each full block (prefix caching only)


class BlockManager:
    """``units`` units (unit 0 scratch) of ``layout``, handed to ``Sequence``s a block at a time."""

    def __init__(self, units: int, layout: PagedLayout, prefix_caching: bool = True):
        self.layout, self.size, self.prefix_caching = layout, layout.size, prefix_caching
        kinds = len(layout.windows)
        # A block is named by its first unit, whose entries below describe it.
        self.members = numpy.zeros((units, max(layout.units)), dtype=numpy.int64)  # its units
        self.kind = [0] * units
        self.refs = [0] * units
        self.free: deque[int] = deque(range(1, units))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced, holding tokens: oldest first
        self.evictable_units = 0
        self.tokens: list[list[int]] = [[] for _ in range(units)]  # each block's tokens (prefix caching)
        self.parent: list[int | None] = [None] * units  # the name of the chain before each block
        self.name: list[int | None] = [None] * units  # a full block's name, where it is the one named so
        self.named: list[dict[int, int]] = [{} for _ in range(kinds)]  # per kind: name -> the full block
        self.children: list[dict] = [{} for _ in range(kinds)]  # per kind: chain name -> blocks following it

    @property
    def usable(self) -> int:
        return len(self.refs) - 1

    def available(self) -> int:
        """Units a sequence could take now: the free ones and the evictable blocks'."""
        return len(self.free) + self.evictable_units

    def blocks_for(self, slots: int) -> int:
        return self.layout.blocks_for(slots)

    def slots(self, seq: Sequence, count: int):
        """``seq``'s first ``count`` slots' indices in the pool's flat slot axis, a row for each lane
        (unit u's slots are u * size .. u * size + size - 1), int64 [lanes, count]."""
        blocks = self.blocks_for(count)
        units = numpy.concatenate(
            [self.members[table[:blocks], :m] for table, m in zip(seq.tables, self.layout.units)], axis=1
        ).T
        return (units[:, :, None] * self.size + numpy.arange(self.size)).reshape(len(units), -1)[:, :count]

    def admit(self, seq: Sequence, ids: list[int], limit: int) -> list[tuple[int, int]]:
        """Start empty ``seq`` on the longest prefix of ``ids[:limit]`` whose blocks the cache holds
        (its ``length`` the tokens found): every block of a global kind, and of a windowed kind those
        its window sees from the prefix's end; returns the (source, copy) units whose K/V the caller
        copies, where a partly filled block was copied."""
        if not self.prefix_caching:
            return []
        names, found, best = [], [], 0  # each full block's name and its block of every kind (None: not cached)
        missing = [-1] * len(seq.tables)  # each kind's last full block not cached
        while (len(names) + 1) * self.size <= limit:
            piece = ids[len(names) * self.size : (len(names) + 1) * self.size]
            names.append(hash((names[-1] if names else None, tuple(piece))))
            blocks = [named.get(names[-1]) for named in self.named]
            blocks = [b if b is not None and self.tokens[b] == piece else None for b in blocks]
            if any(b is None and not w for b, w in zip(blocks, self.layout.windows)):
                break  # a global kind needs every block
            missing = [len(found) if b is None else m for b, m in zip(blocks, missing)]
            found.append(blocks)
            if all(m < self._first_seen(k, len(found) * self.size) for k, m in enumerate(missing)):
                best = len(found)
        seq.names = names[:best]
        for kind, table in enumerate(seq.tables):
            seq.dropped[kind] = min(self._first_seen(kind, best * self.size), best)
            table += [SCRATCH] * seq.dropped[kind]  # out of its window: not taken
            for blocks in found[seq.dropped[kind] : best]:
                self._take(blocks[kind])
                table.append(blocks[kind])
        pos = best * self.size
        shared, copies = self._continue(seq, seq.names[-1] if seq.names else None, ids[pos:limit])
        seq.length = pos + shared
        seq.tokens = ids[: seq.length]
        self._slide(seq)
        return copies

    def _continue(self, seq: Sequence, name: int | None, rest: list[int]) -> tuple[int, list[tuple[int, int]]]:
        """Where every kind holds a partly filled block after chain ``name`` whose first tokens are
        ``rest``'s, a copy of each appended to ``seq``'s tables: (tokens shared, the units to copy).
        Fewer than a block's tokens: a full copy would need the name the prefix found stopped short of."""
        rest = rest[: self.size - 1]
        matches = [self._longest_continuation(kind, name, rest) for kind in range(len(seq.tables))]
        shared = min(count for _, count in matches)
        if not shared:
            return 0, []
        sources = [source for source, _ in matches]
        for source in sources:
            self._take(source)  # not evicted for its own copy
        copies = []
        if self.available() >= sum(self.layout.units):
            for kind, (table, source) in enumerate(zip(seq.tables, sources)):
                (copy,) = self._allocate(kind)
                table.append(copy)
                self._record(copy, kind, name, rest[:shared])
                m = self.layout.units[kind]
                copies += zip(self.members[source, :m].tolist(), self.members[copy, :m].tolist())
        for source in sources:
            self.release_block(source)
        return (shared, copies) if copies else (0, [])

    def _longest_continuation(self, kind: int, name: int | None, rest: list[int]) -> tuple[int | None, int]:
        """(block, count): of kind ``kind``'s blocks after chain ``name``, the one whose first tokens
        match the most of ``rest``, and how many (0: none matches)."""
        best, source = 0, None
        for block in self.children[kind].get(name, ()):
            held = self.tokens[block]
            shared = next((i for i, (a, b) in enumerate(zip(held, rest)) if a != b), min(len(held), len(rest)))
            if shared > best:
                best, source = shared, block
        return source, best

    def reserve(self, seq: Sequence, slots: int) -> bool:
        """Blocks for ``seq``'s first ``slots`` slots; False (and nothing taken) where too few units
        are left."""
        needed = [max(0, self.blocks_for(slots) - len(table)) for table in seq.tables]
        if sum(n * m for n, m in zip(needed, self.layout.units)) > self.available():
            return False
        for kind, (table, n) in enumerate(zip(seq.tables, needed)):
            table += self._allocate(kind, n)
        return True

    def written(self, seq: Sequence, tokens: list[int]):
        """``tokens``' K/V are now in ``seq``'s next slots (its blocks reserved): with prefix caching
        each block they fill gets its name, and a partly filled one records them for a prompt that
        may continue it; then each windowed kind gives back the blocks its window has passed."""
        start = seq.length
        seq.length += len(tokens)
        if self.prefix_caching:
            seq.tokens.extend(tokens)
            for first in range(start - start % self.size, seq.length, self.size):
                index, stop = first // self.size, min(first + self.size, seq.length)
                parent = seq.names[-1] if seq.names else None
                name = hash((parent, tuple(seq.tokens[first:stop]))) if stop - first == self.size else None
                for kind, table in enumerate(seq.tables):
                    block = table[index]
                    self._record(block, kind, parent, seq.tokens[max(first, start) : stop])
                    if name is not None and name not in self.named[kind]:
                        self.named[kind][name], self.name[block] = block, name
                if name is not None:
                    seq.names.append(name)
        self._slide(seq)

    def _first_seen(self, kind: int, length: int) -> int:
        """The first block of kind ``kind`` that a query after ``length`` slots sees."""
        window = self.layout.windows[kind]
        return max(0, length - window + 1) // self.size if window else 0

    def _slide(self, seq: Sequence):
        """Each windowed kind's blocks wholly before its window's first slot given back, their table
        entries the scratch unit: nothing reads them again."""
        for kind, table in enumerate(seq.tables):
            while seq.dropped[kind] < min(self._first_seen(kind, seq.length), len(table)):
                self.release_block(table[seq.dropped[kind]])
                table[seq.dropped[kind]] = SCRATCH
                seq.dropped[kind] += 1

    def release(self, seq: Sequence):
        """Every block of ``seq`` given back, its last first (the least likely to be shared: the
        first evicted), and ``seq`` empty."""
        for index in reversed(range(max(map(len, seq.tables), default=0))):
            for table, dropped in zip(seq.tables, seq.dropped):
                if dropped <= index < len(table):
                    self.release_block(table[index])
        seq.__init__(len(seq.tables))

    def release_block(self, block: int):
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if self.tokens[block]:
                self.evictable[block] = None
                self.evictable_units += self.layout.units[self.kind[block]]
            else:
                self.free.extend(self._units(block))

    def _units(self, block: int) -> list[int]:
        return self.members[block, : self.layout.units[self.kind[block]]].tolist()

    def _take(self, block: int):
        if self.refs[block] == 0:
            del self.evictable[block]
            self.evictable_units -= self.layout.units[self.kind[block]]
        self.refs[block] += 1

    def _allocate(self, kind: int, count: int = 1) -> list[int]:
        """``count`` blocks of kind ``kind`` from free units, evicting the least recently released
        blocks while too few are free (the caller has checked that enough are available). The units
        are dealt out column by column, so that where they are free in a run each layer's K/V of
        consecutive blocks lie in consecutive units, as one kind's would: the decode kernel reads a
        row's window in streams, not a unit here and there."""
        m = self.layout.units[kind]
        while len(self.free) < m * count:
            block, _ = self.evictable.popitem(last=False)
            self.evictable_units -= self.layout.units[self.kind[block]]
            self.free.extend(self._units(block))
            self._forget(block)
        units = [self.free.popleft() for _ in range(m * count)]
        blocks = units[:count]
        for i, block in enumerate(blocks):
            self.members[block, :m], self.kind[block], self.refs[block] = units[i::count], kind, 1
        return blocks

    def _record(self, block: int, kind: int, parent: int | None, tokens: list[int]):
        if not self.tokens[block]:
            self.parent[block] = parent
            self.children[kind].setdefault(parent, {})[block] = None
        self.tokens[block].extend(tokens)

    def _forget(self, block: int):
        """An evicted block's place in the prefix cache dropped: it is about to hold other tokens."""
        children = self.children[self.kind[block]]
        if self.name[block] is not None:
            del self.named[self.kind[block]][self.name[block]]
        siblings = children[self.parent[block]]
        del siblings[block]
        if not siblings:
            del children[self.parent[block]]
        self.tokens[block], self.parent[block], self.name[block] = [], None, None
