"""The block allocator of the paged KV cache: pure functions over an immutable ``BlockAllocator``.

The cache is cut into ``num_blocks`` blocks of ``block_size`` token slots. A request owns a
*block table* (the blocks holding its tokens, in order); slot ``block * block_size + offset``
holds the keys/values of the token at position ``table[position // block_size] * block_size +
position % block_size``.

Prefix caching, as vLLM does it: once a block is full, it is identified by a digest of (its
parent block's digest, its tokens), so equal digests mean equal token prefixes and the block's
keys/values can be shared. A chain may start from a ``salt`` (vLLM's ``cache_salt``): requests whose
keys differ for the same tokens (LongRoPE's long prompts, rotated by other factors) share blocks only
with requests of the same salt. Blocks are reference-counted; a request that ends releases its blocks,
and a full, registered block whose count drops to zero stays cached (its content intact) until
the allocator needs room, when it is evicted least-recently-released first. A new request's
prompt starts from the longest chain of cached blocks matching it.

Every function returns a new allocator and never mutates its argument, so the scheduler can try
an allocation and drop the attempt by dropping the new value (no rollback code). The state is
host-side bookkeeping: Python ints and tuples, no tensors.
"""

from __future__ import annotations

import dataclasses
import hashlib
from array import array
from collections.abc import Hashable, Mapping, Sequence
from types import MappingProxyType

from genfn.batching.records import replaced

__all__ = [
    "BlockAllocator",
    "RequestId",
    "acquire_prefix",
    "allocated_requests",
    "block_digest",
    "block_table",
    "blocks_needed",
    "check_invariants",
    "cached_block_count",
    "commit_full_blocks",
    "ensure_capacity",
    "evict_all",
    "evictable_blocks",
    "fork",
    "free_request",
    "held_only_by",
    "init_allocator",
    "match_prefix",
    "num_free_blocks",
    "ref_count",
    "rename",
    "truncate",
]

RequestId = Hashable

def _empty() -> Mapping:
    return MappingProxyType({})


def _frozen(mapping: dict) -> Mapping:
    return MappingProxyType(mapping)


def block_digest(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """Identity of a full block: a 128-bit digest of (parent digest, the block's token ids).

    A cryptographic digest, not Python's ``hash``, so that two different prefixes sharing a
    block (and so each other's keys/values) is not a matter of luck.
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(parent if parent is not None else b"root")
    h.update(array("q", tokens).tobytes())
    return h.digest()


@dataclasses.dataclass(frozen=True)
class BlockAllocator:
    """Immutable allocator state. Build it with ``init_allocator``; change it with this module's functions.

    ``free``: blocks that hold nothing worth keeping, taken first (front first).
    ``evictable``: cached blocks no request references, least recently released first.
    ``refs``: reference count of each block (how many block tables list it).
    ``digest_of``: each block's registered digest (``None`` when unregistered).
    ``cached``: digest -> block, for every registered block (referenced or evictable).
    ``tables``: request -> its block table.
    ``chains``: request -> the digests of the leading full blocks of its table registered so far.
    """

    num_blocks: int
    block_size: int
    free: tuple[int, ...]
    evictable: tuple[int, ...]
    refs: tuple[int, ...]
    digest_of: tuple[bytes | None, ...]
    cached: Mapping[bytes, int] = dataclasses.field(default_factory=_empty)
    tables: Mapping[RequestId, tuple[int, ...]] = dataclasses.field(default_factory=_empty)
    chains: Mapping[RequestId, tuple[bytes, ...]] = dataclasses.field(default_factory=_empty)

    def replace(self, **changes) -> BlockAllocator:
        return replaced(self, changes)


def init_allocator(num_blocks: int, block_size: int) -> BlockAllocator:
    """All ``num_blocks`` blocks free, no request, an empty prefix cache."""
    for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"`{name}` must be an int, got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"`{name}` must be >= 1, got {value}")
    return BlockAllocator(
        num_blocks=num_blocks,
        block_size=block_size,
        free=tuple(range(num_blocks)),
        evictable=(),
        refs=(0,) * num_blocks,
        digest_of=(None,) * num_blocks,
    )


# ----------------------------------------------------------------------------------------------
# Queries
# ----------------------------------------------------------------------------------------------


def num_free_blocks(alloc: BlockAllocator) -> int:
    """Blocks an allocation may take now: the free ones plus the evictable cached ones."""
    return len(alloc.free) + len(alloc.evictable)


def evictable_blocks(alloc: BlockAllocator) -> tuple[int, ...]:
    return alloc.evictable


def cached_block_count(alloc: BlockAllocator) -> int:
    """Registered blocks (shared or evictable): the size of the prefix cache."""
    return len(alloc.cached)


def ref_count(alloc: BlockAllocator, block: int) -> int:
    return alloc.refs[block]


def block_table(alloc: BlockAllocator, request_id: RequestId) -> tuple[int, ...]:
    """The request's blocks in token order (empty when it holds none)."""
    return alloc.tables.get(request_id, ())


def allocated_requests(alloc: BlockAllocator) -> tuple[RequestId, ...]:
    return tuple(alloc.tables)


def check_invariants(alloc: BlockAllocator) -> None:
    """Raise ``AssertionError`` unless the state is consistent: every block is exactly one of free,
    evictable (registered, unreferenced) or referenced; counts match the tables; the digest index
    and the blocks' digests agree. A debugging aid (tests run it after every transition)."""
    refs = [0] * alloc.num_blocks
    for table in alloc.tables.values():
        for block in table:
            refs[block] += 1
    assert tuple(refs) == alloc.refs, "reference counts differ from the block tables"
    free, evictable = set(alloc.free), set(alloc.evictable)
    assert len(free) == len(alloc.free) and len(evictable) == len(alloc.evictable), "a block is queued twice"
    referenced = {b for b in range(alloc.num_blocks) if refs[b]}
    assert not (free & evictable or free & referenced or evictable & referenced), "a block is in two states"
    assert free | evictable | referenced == set(range(alloc.num_blocks)), "a block leaked"
    assert all(alloc.digest_of[b] is not None for b in evictable), "an evictable block is unregistered"
    assert all(alloc.digest_of[b] is None for b in free), "a free block is still registered"
    registered = {b for b in range(alloc.num_blocks) if alloc.digest_of[b] is not None}
    assert {alloc.digest_of[b] for b in alloc.cached.values()} == set(alloc.cached), "digest index is stale"
    assert set(alloc.cached.values()) == registered, "a registered block is missing from the index"
    for request_id, chain in alloc.chains.items():
        assert len(chain) <= len(alloc.tables.get(request_id, ())), "a chain is longer than its table"


def held_only_by(alloc: BlockAllocator, request_ids) -> list[int]:
    """The blocks of ``request_ids``' tables that no other request holds (freed when they end)."""
    held: dict[int, int] = {}
    for request_id in request_ids:
        for block in block_table(alloc, request_id):
            held[block] = held.get(block, 0) + 1
    return [block for block, count in held.items() if alloc.refs[block] == count]


def blocks_needed(alloc: BlockAllocator, request_id: RequestId, num_tokens: int) -> int:
    """How many more blocks the request needs for its first ``num_tokens`` tokens to have slots."""
    wanted = -(-num_tokens // alloc.block_size)
    return max(0, wanted - len(block_table(alloc, request_id)))


def match_prefix(alloc: BlockAllocator, tokens: Sequence[int], salt: bytes | None = None) -> tuple[int, ...]:
    """The cached blocks holding the longest run of whole leading blocks of ``tokens`` (in ``salt``'s chains)."""
    size = alloc.block_size
    blocks = []
    parent = salt
    for start in range(0, len(tokens) - size + 1, size):
        digest = block_digest(parent, tokens[start:start + size])
        block = alloc.cached.get(digest)
        if block is None:
            break
        blocks.append(block)
        parent = digest
    return tuple(blocks)


# ----------------------------------------------------------------------------------------------
# Transitions
# ----------------------------------------------------------------------------------------------


def acquire_prefix(alloc: BlockAllocator, request_id: RequestId, tokens: Sequence[int],
                   max_tokens: int | None = None, salt: bytes | None = None) -> tuple[BlockAllocator, int]:
    """Start the request's table with the cached blocks matching ``tokens``; returns (alloc, tokens reused).

    At most ``max_tokens`` tokens are reused (whole blocks only): the caller keeps at least the
    last prompt token to compute, since its logits are needed. The request must hold no blocks yet.
    """
    if block_table(alloc, request_id):
        raise ValueError(f"request {request_id!r} already holds blocks; a prefix is acquired only at admission")
    limit = len(tokens) if max_tokens is None else min(len(tokens), max_tokens)
    blocks = match_prefix(alloc, tokens[:limit - limit % alloc.block_size], salt)
    if not blocks:
        return alloc, 0
    refs = list(alloc.refs)
    reused = set()
    for block in blocks:
        refs[block] += 1
        reused.add(block)
    evictable = tuple(b for b in alloc.evictable if b not in reused)
    chain = tuple(alloc.digest_of[b] for b in blocks)
    alloc = alloc.replace(
        refs=tuple(refs),
        evictable=evictable,
        tables=_frozen({**alloc.tables, request_id: blocks}),
        chains=_frozen({**alloc.chains, request_id: chain}),
    )
    return alloc, len(blocks) * alloc.block_size


def ensure_capacity(alloc: BlockAllocator, request_id: RequestId, num_tokens: int) -> BlockAllocator | None:
    """Grow the request's table so its first ``num_tokens`` tokens have slots; ``None`` if blocks run out.

    Free blocks go first; then evictable cached blocks, least recently released first, each
    losing its registration (its content is about to be overwritten).
    """
    need = blocks_needed(alloc, request_id, num_tokens)
    if need == 0:
        return alloc if request_id in alloc.tables else alloc.replace(
            tables=_frozen({**alloc.tables, request_id: ()}))
    if need > num_free_blocks(alloc):
        return None
    from_free = alloc.free[:need]
    evicted = alloc.evictable[:need - len(from_free)]
    refs = list(alloc.refs)
    for block in from_free + evicted:
        refs[block] = 1
    digest_of = alloc.digest_of
    cached = alloc.cached
    if evicted:
        digest_of = list(digest_of)
        cached = dict(cached)
        for block in evicted:
            del cached[digest_of[block]]
            digest_of[block] = None
        digest_of = tuple(digest_of)
        cached = _frozen(cached)
    return alloc.replace(
        free=alloc.free[len(from_free):],
        evictable=alloc.evictable[len(evicted):],
        refs=tuple(refs),
        digest_of=digest_of,
        cached=cached,
        tables=_frozen({**alloc.tables, request_id: block_table(alloc, request_id) + from_free + evicted}),
    )


def commit_full_blocks(alloc: BlockAllocator, request_id: RequestId, tokens: Sequence[int],
                       salt: bytes | None = None) -> BlockAllocator:
    """Register the request's blocks that ``tokens`` (its tokens whose keys/values are written) fill.

    Called after the forward that wrote them, so a registered block's content is always there
    for whoever matches it. A block whose digest is already cached elsewhere (two requests computed
    the same prefix at once) stays private to its request and is freed, not cached, at the end.
    """
    size = alloc.block_size
    table = block_table(alloc, request_id)
    chain = alloc.chains.get(request_id, ())
    full = min(len(tokens) // size, len(table))
    if full <= len(chain):
        return alloc
    digest_of = list(alloc.digest_of)
    cached = dict(alloc.cached)
    parent = chain[-1] if chain else salt
    new_chain = list(chain)
    for index in range(len(chain), full):
        digest = block_digest(parent, tokens[index * size:(index + 1) * size])
        block = table[index]
        if digest not in cached and digest_of[block] is None:
            cached[digest] = block
            digest_of[block] = digest
        new_chain.append(digest)
        parent = digest
    return alloc.replace(
        digest_of=tuple(digest_of),
        cached=_frozen(cached),
        chains=_frozen({**alloc.chains, request_id: tuple(new_chain)}),
    )


def free_request(alloc: BlockAllocator, request_id: RequestId, keep_cached: bool = True) -> BlockAllocator:
    """Release the request's blocks. Registered blocks nobody else references become evictable
    (kept for prefix reuse) unless ``keep_cached`` is false; the rest become free."""
    table = alloc.tables.get(request_id)
    if table is None:
        return alloc
    refs = list(alloc.refs)
    freed, parked = [], []
    # The last blocks of a sequence are the least likely to be shared, so they are released
    # first and evicted first (vLLM's order).
    for block in reversed(table):
        refs[block] -= 1
        if refs[block] == 0:
            (parked if keep_cached and alloc.digest_of[block] is not None else freed).append(block)
    digest_of, cached = alloc.digest_of, alloc.cached
    if not keep_cached:
        dropped = [b for b in freed if alloc.digest_of[b] is not None]
        if dropped:
            digest_of = list(digest_of)
            cached = dict(cached)
            for block in dropped:
                del cached[digest_of[block]]
                digest_of[block] = None
            digest_of, cached = tuple(digest_of), _frozen(cached)
    tables = dict(alloc.tables)
    del tables[request_id]
    chains = dict(alloc.chains)
    chains.pop(request_id, None)
    return alloc.replace(
        free=alloc.free + tuple(freed),
        evictable=alloc.evictable + tuple(parked),
        refs=tuple(refs),
        digest_of=digest_of,
        cached=cached,
        tables=_frozen(tables),
        chains=_frozen(chains),
    )


def fork(alloc: BlockAllocator, source: RequestId, target: RequestId, num_tokens: int
         ) -> tuple[BlockAllocator, int, tuple[int, int] | None]:
    """Start ``target``'s table as a copy-on-write fork of ``source``'s first ``num_tokens`` tokens
    (a beam continuing another beam); returns (alloc, tokens kept, copy).

    The full blocks are shared (their counts go up: nobody writes a full block again); the
    partial last block, which the next token is written into, gets a fresh block of ``target``'s
    own, and ``copy = (source's block, target's block)`` is the keys/values the caller copies.
    Without a block to spare, ``target`` keeps the full blocks only and the tokens kept stop at
    the block boundary (the caller recomputes the rest), as ``truncate`` does.
    """
    if block_table(alloc, target):
        raise ValueError(f"request {target!r} already holds blocks; a fork starts a table")
    size = alloc.block_size
    table = block_table(alloc, source)
    num_tokens = min(num_tokens, len(table) * size)
    full = num_tokens // size
    refs = list(alloc.refs)
    for block in table[:full]:
        refs[block] += 1
    alloc = alloc.replace(refs=tuple(refs), tables=_frozen({**alloc.tables, target: table[:full]}),
                          chains=_frozen({**alloc.chains, target: alloc.chains.get(source, ())[:full]}))
    if num_tokens == full * size:
        return alloc, num_tokens, None
    grown = ensure_capacity(alloc, target, num_tokens)
    if grown is None:
        return alloc, full * size, None
    return grown, num_tokens, (table[full], block_table(grown, target)[full])


def rename(alloc: BlockAllocator, names: Mapping[RequestId, RequestId]) -> BlockAllocator:
    """Move tables (and their prefix chains) to new request ids, all at once, so a table may move
    to an id that another table leaves (``{old: new}``)."""
    tables = {r: t for r, t in alloc.tables.items() if r not in names}
    chains = {r: c for r, c in alloc.chains.items() if r not in names}
    for old, new in names.items():
        if new in tables:
            raise ValueError(f"request {new!r} already holds blocks; a table cannot move onto it")
        if old in alloc.tables:
            tables[new] = alloc.tables[old]
        if old in alloc.chains:
            chains[new] = alloc.chains[old]
    return alloc.replace(tables=_frozen(tables), chains=_frozen(chains))


def truncate(alloc: BlockAllocator, request_id: RequestId, num_tokens: int) -> tuple[BlockAllocator, int]:
    """Keep only the blocks holding the request's first ``num_tokens`` tokens (a rewind: rejected
    draft tokens, a request cut back); returns (alloc, tokens kept).

    The block cut in the middle is about to be overwritten past the cut, so it leaves the prefix
    cache; if another request shares it, it is released instead (no copy here) and the tokens
    kept stop at the block boundary: the caller recomputes the rest.
    """
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"`num_tokens` must be an int >= 0, got {num_tokens!r}")
    size = alloc.block_size
    table = block_table(alloc, request_id)
    num_tokens = min(num_tokens, len(table) * size)
    keep = -(-num_tokens // size)
    digest_of, cached = alloc.digest_of, alloc.cached
    if num_tokens % size and alloc.digest_of[table[keep - 1]] is not None:
        cut = table[keep - 1]
        if alloc.refs[cut] > 1:
            keep -= 1
            num_tokens = keep * size
        else:
            digest_of = list(digest_of)
            cached = dict(cached)
            del cached[digest_of[cut]]
            digest_of[cut] = None
            digest_of, cached = tuple(digest_of), _frozen(cached)
    if keep == len(table) and digest_of is alloc.digest_of:
        return alloc, num_tokens
    chain = alloc.chains.get(request_id, ())[:num_tokens // size]
    # Release the dropped blocks as a scratch request's, so the accounting is free_request's.
    scratch = ("genfn.blocks.truncate", request_id)
    alloc = alloc.replace(digest_of=digest_of, cached=cached,
                          tables=_frozen({**alloc.tables, request_id: table[:keep], scratch: table[keep:]}),
                          chains=_frozen({**alloc.chains, request_id: chain}))
    return free_request(alloc, scratch), num_tokens


def evict_all(alloc: BlockAllocator) -> BlockAllocator:
    """Drop the prefix cache's unreferenced blocks (they become free, their content forgotten)."""
    if not alloc.evictable:
        return alloc
    digest_of = list(alloc.digest_of)
    cached = dict(alloc.cached)
    for block in alloc.evictable:
        del cached[digest_of[block]]
        digest_of[block] = None
    return alloc.replace(free=alloc.free + alloc.evictable, evictable=(), digest_of=tuple(digest_of),
                         cached=_frozen(cached))
