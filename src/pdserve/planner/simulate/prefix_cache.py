"""The simulator's prefix cache: which shared prefixes' KV each worker holds, and what the
router remembers of where it sent them.

pdserve's engine caches full KV blocks under chained hashes (common/block_hash.py,
engine/block_manager.py): a prompt admitted on a worker reuses the longest run of its leading
full blocks that the worker computed before, at most its length - 1 tokens (the last prompt
token is always computed, its logits give token 0), and computes the rest. The simulator knows
prompts by length, so a trace names the shared prefix each prompt starts with
(`TraceRequest.prefix_id`, `prefix_tokens`: P) and a cache holds prefix ids.

Rules (`PrefixTable`, `PrefixCache`):
- A prefix's entry is its full blocks: E = floor(P / block) x block tokens (`Cluster.block_tokens`,
  the engine's block size); a prefix shorter than a block is never cached. A prompt of N tokens
  reuses R = min(E, floor((N - 1) / block) x block) tokens of a cached entry (the blocks past E
  hold the prompt's own tokens, which no other prompt shares).
- A prompt admitted on a worker whose cache holds its prefix starts computed at R
  (`RequestRecord.prefilled` = R): its first chunk is Chunk(R, ...), so its tokens still attend
  over the cached prefix; one that misses computes from 0. Admission is the lookup (a hit
  refreshes the entry), as the engine's allocation is.
- A prefix enters a worker's cache (or is refreshed) once a prompt carrying it has computed at
  least E of its tokens there, at the end of that step (the engine hashes blocks after the
  step that computed them: two prompts of one prefix admitted into one step both miss), or when
  a decode worker receives a prompt's whole KV (the engine hashes received blocks too).
- Entries are kept least recently used first and cost E tokens each; their sum stays within
  the worker's KV capacity in tokens, the least recently used evicted first; an entry larger
  than the capacity is not kept.

The router's side (`RoutedPrefixes`, router/prefix_index.py): the prefix ids it routed to each
worker, whether or not that worker computed or still holds them; it counts a prompt's uncached
tokens there as N - R for a known prefix (the router's `_uncached`), which the split rule and
the prefill queues (Q_p, Q_d) use, and the `prefix` policy's scores.

Not modelled: a prefix half computed on a worker (a prompt admitted meanwhile misses it whole);
the KV a hit shares (a request still reserves prompt + output tokens); running requests' KV
competing with cached blocks (the engine evicts only free blocks, least recently freed first;
here the entries alone are bounded, by the whole KV capacity); suffix blocks, which no other
prompt shares; the router's bound of PREFIX_INDEX_BLOCKS blocks per worker (65,536: it forgets
nothing in a simulated trace).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.planner.simulate.metrics import RequestRecord
from pdserve.planner.simulate.trace import TraceRequest


@dataclass(frozen=True)
class PromptPrefix:
    """A prompt's shared prefix: its id, its entry's tokens E and what this prompt reuses of a
    cached entry, R (0 <= R <= E, both whole blocks)."""

    prefix_id: int
    entry_tokens: int
    reused_tokens: int

    def __post_init__(self) -> None:
        if self.prefix_id < 0 or not 0 <= self.reused_tokens <= self.entry_tokens:
            raise ValueError(f"a prompt prefix needs id >= 0 and 0 <= reused <= entry tokens, "
                             f"got {self}")


def whole_blocks(tokens: int, block_tokens: int) -> int:
    """`tokens` rounded down to whole blocks."""
    return tokens // block_tokens * block_tokens


class PrefixTable:
    """Each request's `PromptPrefix` (None: no shared prefix), by request index.

    Invariant: one prefix id has one prefix length over the whole trace (ValueError if not)."""

    def __init__(self, trace: Sequence[TraceRequest], block_tokens: int) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        lengths: dict[int, int] = {}
        rows: list[PromptPrefix | None] = []
        for i, r in enumerate(trace):
            if r.prefix_id is None:
                rows.append(None)
                continue
            if lengths.setdefault(r.prefix_id, r.prefix_tokens) != r.prefix_tokens:
                raise ValueError(f"request {i}: prefix {r.prefix_id} has {r.prefix_tokens} "
                                 f"tokens, but {lengths[r.prefix_id]} in an earlier request")
            entry = whole_blocks(r.prefix_tokens, block_tokens)
            reused = min(entry, whole_blocks(r.prompt_tokens - 1, block_tokens))
            rows.append(PromptPrefix(r.prefix_id, entry, reused))
        self.rows = tuple(rows)

    @classmethod
    def empty(cls) -> PrefixTable:
        return cls((), 1)

    def of(self, record: RequestRecord) -> PromptPrefix | None:
        """The prefix of request `record.index`; None: none, or not in this table."""
        return self.rows[record.index] if record.index < len(self.rows) else None


class PrefixCache:
    """The prefixes one worker holds (module docstring): prefix id -> entry tokens, least
    recently used first. Invariant: 0 <= used <= capacity, used = the entries' tokens."""

    def __init__(self, table: PrefixTable, capacity_tokens: int) -> None:
        if capacity_tokens < 0:
            raise ValueError(f"capacity_tokens must be >= 0, got {capacity_tokens}")
        self.table = table
        self.capacity = capacity_tokens
        self.entries: OrderedDict[int, int] = OrderedDict()
        self.used = 0

    @classmethod
    def disabled(cls) -> PrefixCache:
        """A cache that never holds anything (no table, no room)."""
        return cls(PrefixTable.empty(), 0)

    def peek(self, record: RequestRecord) -> int:
        """R: the prompt tokens of `record` this cache holds (0 on a miss); changes nothing."""
        prefix = self.table.of(record)
        if prefix is None or prefix.prefix_id not in self.entries:
            return 0
        return prefix.reused_tokens

    def take(self, record: RequestRecord) -> int:
        """`peek`, refreshing the entry on a hit (the prompt is admitted here)."""
        tokens = self.peek(record)
        if tokens:
            self.entries.move_to_end(self.table.of(record).prefix_id)  # type: ignore[union-attr]
        return tokens

    def computed(self, record: RequestRecord) -> None:
        """After a step: `record` has `prefilled` prompt tokens computed here; its prefix
        enters (or is refreshed) once they cover its entry."""
        prefix = self.table.of(record)
        if prefix is not None and record.prefilled >= prefix.entry_tokens:
            self._put(prefix)

    def received(self, record: RequestRecord) -> None:
        """`record`'s whole prompt KV arrived here: its prefix enters (or is refreshed)."""
        prefix = self.table.of(record)
        if prefix is not None:
            self._put(prefix)

    def _put(self, prefix: PromptPrefix) -> None:
        if not prefix.entry_tokens or prefix.entry_tokens > self.capacity:
            return
        if prefix.prefix_id in self.entries:
            self.entries.move_to_end(prefix.prefix_id)
            return
        while self.used + prefix.entry_tokens > self.capacity:
            self.used -= self.entries.popitem(last=False)[1]
        self.entries[prefix.prefix_id] = prefix.entry_tokens
        self.used += prefix.entry_tokens


class RoutedPrefixes:
    """The prefix ids the router sent to one worker (module docstring); it never forgets."""

    def __init__(self, table: PrefixTable, block_tokens: int) -> None:
        self.table = table
        self.block_tokens = block_tokens
        self.known: set[int] = set()

    def matched(self, record: RequestRecord) -> int:
        """R of `record` if its prefix was routed here, else 0."""
        prefix = self.table.of(record)
        return prefix.reused_tokens if prefix is not None and prefix.prefix_id in self.known \
            else 0

    def uncached(self, record: RequestRecord) -> int:
        """The prompt tokens the router counts as still to compute here."""
        return record.prompt_tokens - self.matched(record)

    def blocks(self, record: RequestRecord) -> int:
        """The leading blocks of the prompt the router believes this worker holds."""
        return self.matched(record) // self.block_tokens

    def add(self, record: RequestRecord) -> None:
        prefix = self.table.of(record)
        if prefix is not None:
            self.known.add(prefix.prefix_id)
