"""Paged KV-cache blocks with reference counts and a prefix cache keyed by chained xxhash64.

Whole blocks are shared (by reference). A prompt's next tokens after its shared blocks can also match
the start of a block it cannot share: a block another prompt diverged from, or the last block of a
finished sequence. Those tokens' K/V rows are copied into the prompt's own fresh block (a "partial
hit", `KVCopy`), at least MIN_PARTIAL_HIT of them, so prefixes are reused to the token, not only in
whole blocks of 256."""
from array import array
from collections import OrderedDict
from typing import NamedTuple

import xxhash

from nanovllm.engine.state_slots import StateSlots


# The fewest tokens a partial hit copies (vLLM caches prefixes in blocks of 16 tokens).
MIN_PARTIAL_HIT = 16
# Copy sources kept per (chain key, first token), the newest: blocks after one shared system prompt
# all share a key, and a prompt's admission compares each (a bound on that host time).
MAX_SOURCES_PER_KEY = 32


class KVCopy(NamedTuple):
    """Copy K/V rows [0, num_tokens) of block src into block dst, in every layer, before the step."""
    src: int
    dst: int
    num_tokens: int


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def cache_slots(block_table: list[int], start: int, end: int, bs: int) -> list[int]:
    """KV-cache slots of token positions [start, end) of a sequence with this block table."""
    slots = []
    for i in range(start // bs, cdiv(end, bs)):
        base = block_table[i] * bs
        slots.extend(range(base + max(start, i * bs) - i * bs, base + min(end, (i + 1) * bs) - i * bs))
    return slots


def hash_block(token_ids: list[int], prefix_hash: int | None) -> int:
    """xxhash64 of a block's token ids, chained with the hash of the block before it."""
    h = xxhash.xxh64()
    if prefix_hash is not None:
        h.update(prefix_hash.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    return h.intdigest()


def common_prefix(a: list[int], b: list[int]) -> int:
    """The length of a's and b's common prefix (a binary search over slice comparisons, which run in C)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids", "copy_key")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: list[int] | None = None   # kept to confirm a hash hit; rows with valid K/V
        self.copy_key: tuple | None = None        # its key in copy_sources, while it is one


class BlockManager:
    """Invariants: a block is shared only through ref_count; a block whose count drops to zero goes
    to the free list but keeps its hash and tokens, so a later identical prefix can revive it until
    the block is handed out for other data (free blocks are reused least recently freed first).
    A model with per-sequence state (linear attention) also has state_slots: a sequence is given one
    with its blocks and gives it back with them."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_state_slots: int = 0):
        self.block_size = block_size
        # A cached block holds K/V but not the state that belongs to it: no prefix cache with state.
        assert not (num_state_slots and enable_prefix_caching)
        self.enable_prefix_caching = enable_prefix_caching
        self.state_slots = StateSlots(num_state_slots) if num_state_slots else None
        self.reset(num_blocks)

    def reset(self, num_blocks: int | None = None):
        """Every block free and unhashed, as at start-up. Built anew rather than repaired: after a
        failure part-way through a step (Ctrl-C between two lines here) no ref count, free list or
        hash is trusted, and a block whose K/V may be half-written must not stay in the prefix cache."""
        num_blocks = self.num_blocks if num_blocks is None else num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block_id: dict[int, int] = {}
        # Blocks a partial hit may copy from, by (the hash of the block before, or the adapter at a
        # sequence's start; the block's first token): full hashed blocks, and finished sequences' last
        # blocks (their computed rows).
        self.copy_sources: dict[tuple, OrderedDict[int, None]] = {}
        self.pending_copies: list[KVCopy] = []   # made by allocate; the next prefill step runs them
        if self.state_slots is not None:
            self.state_slots.reset()

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @staticmethod
    def _chain_key(seq, hashes: list[int]) -> tuple:
        """What the block after `hashes` follows: the last hash, or at the start the adapter (a prefix
        computed under one adapter, or the base model, None, is never reused under another)."""
        return ("hash", hashes[-1]) if hashes else ("adapter", seq.lora_int_id)

    def _cached_prefix(self, seq, partial: bool = True) -> tuple[list[int], list[int], tuple | None]:
        """Ids and hashes of the cached blocks that hold seq's leading full blocks, and (partial) the
        best partial hit after them: (source block, tokens), or None. At least one token is always left
        out, so a fully cached prompt still computes its last token: there must be logits to sample."""
        bs = self.block_size
        ids, hashes, h = [], [], seq.lora_int_id   # the hash chain starts from the adapter's id
        if not self.enable_prefix_caching or seq.skips_prefix_cache:
            return ids, hashes, None
        for i in range((seq.num_tokens - 1) // bs):
            tokens = seq.token_ids[i * bs:(i + 1) * bs]
            h = hash_block(tokens, h)
            block_id = self.hash_to_block_id.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            ids.append(block_id)
            hashes.append(h)
        start = len(ids) * bs
        wanted = seq.token_ids[start:min(start + bs, seq.num_tokens - 1)]
        if not partial or len(wanted) < MIN_PARTIAL_HIT:
            return ids, hashes, None
        best, best_len = None, 0
        for block_id in reversed(self.copy_sources.get((self._chain_key(seq, hashes), wanted[0]), ())):
            n = common_prefix(self.blocks[block_id].token_ids, wanted)
            if n > best_len:
                best, best_len = block_id, n
                if n == len(wanted):
                    break
        return ids, hashes, (best, best_len) if best_len >= MIN_PARTIAL_HIT else None

    def can_allocate(self, seq) -> bool:
        # a partial hit's block is a fresh one all the same: no need to look for it here
        cached, _, _ = self._cached_prefix(seq, partial=False)
        in_use = sum(1 for b in cached if self.blocks[b].ref_count > 0)
        if self.state_slots is not None and not self.state_slots.can_allocate():
            return False
        return cdiv(seq.num_tokens, self.block_size) - in_use <= self.num_free_blocks

    def allocate(self, seq):
        """Give seq blocks for all its tokens, reusing cached prefix blocks."""
        assert not seq.block_table
        cached, hashes, partial = self._cached_prefix(seq)
        for block_id in cached:
            self._ref(block_id)
        fresh = [self._take_free_block() for _ in range(cdiv(seq.num_tokens, self.block_size) - len(cached))]
        seq.block_table = cached + fresh
        seq.block_hashes = hashes
        if self.state_slots is not None:
            self.state_slots.allocate(seq)
        seq.num_computed_tokens = len(cached) * self.block_size
        if partial is not None:
            # The source may have been handed out just now (it was free): its rows are overwritten
            # only by a forward pass, and the copy runs before the step's forward pass. A later copy's
            # source may be an earlier one's destination: the copies run in this order.
            src, n = partial
            self.pending_copies.append(KVCopy(src, fresh[0], n))
            seq.num_computed_tokens += n
        if seq.num_cached_tokens is None:   # a preempted sequence's later hits are not prompt-cache hits
            seq.num_cached_tokens = seq.num_computed_tokens

    def deallocate(self, seq):
        self._keep_tail_as_copy_source(seq)
        # Free the tail first: it then is evicted before the (more shareable) head of the prompt (a
        # partial-hit source, the tail, goes first too).
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0
        if self.state_slots is not None:
            self.state_slots.free(seq)

    def _keep_tail_as_copy_source(self, seq):
        """The computed rows of seq's first block without a hash (its last full or partial one)
        become a partial-hit source when the sequence lets go of it, if it holds enough of them."""
        if not self.enable_prefix_caching:
            return
        i, bs = len(seq.block_hashes), self.block_size
        tokens = seq.token_ids[i * bs:min(seq.num_computed_tokens, len(seq.token_ids), (i + 1) * bs)]
        if i < len(seq.block_table) and len(tokens) >= MIN_PARTIAL_HIT:
            block = self.blocks[seq.block_table[i]]
            if block.ref_count == 1:   # not shared: nobody else writes it afterwards
                block.token_ids = tokens
                self._add_copy_source(block, self._chain_key(seq, seq.block_hashes))

    def _add_copy_source(self, block: Block, chain_key: tuple):
        self._drop_copy_source(block)
        block.copy_key = (chain_key, block.token_ids[0])
        sources = self.copy_sources.setdefault(block.copy_key, OrderedDict())
        sources[block.block_id] = None
        if len(sources) > MAX_SOURCES_PER_KEY:   # forget the oldest (the block itself stays cached)
            self.blocks[next(iter(sources))].copy_key = None
            sources.popitem(last=False)

    def _drop_copy_source(self, block: Block):
        if block.copy_key is not None:
            sources = self.copy_sources[block.copy_key]
            sources.pop(block.block_id, None)
            if not sources:
                del self.copy_sources[block.copy_key]
            block.copy_key = None

    def take_copies(self) -> list[KVCopy]:
        """The partial hits' copies made since the last call (the next step runs them first)."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def can_append(self, seq, num_drafts: int = 0) -> bool:
        """Can seq's newest token (the one decode computes next), and num_drafts draft tokens after
        it (speculative decoding), get slots?"""
        needed = cdiv(seq.num_tokens + num_drafts, self.block_size) - len(seq.block_table)
        return needed <= self.num_free_blocks

    def may_append(self, seq, num_drafts: int = 0):
        while len(seq.block_table) < cdiv(seq.num_tokens + num_drafts, self.block_size):
            seq.block_table.append(self._take_free_block())

    def free_rejected(self, seq):
        """After a verify step: give back the blocks past seq's tokens, which held only rejected
        drafts' rows (fresh, unshared and unhashed: they were taken by may_append for the drafts)."""
        keep = cdiv(seq.num_tokens, self.block_size)
        while len(seq.block_table) > keep:
            block = self.blocks[seq.block_table.pop()]
            assert block.ref_count == 1 and block.hash is None
            block.ref_count = 0
            self.free_block_ids[block.block_id] = None

    def register_computed(self, seq):
        """Hash the blocks that became full and computed (or launched: a later step that reads them
        runs after, in stream order), so later prompts can share them. A block that holds a pending
        token waits until its id is known."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        while len(seq.block_hashes) < min(seq.num_computed_tokens, len(seq.token_ids)) // bs:
            i = len(seq.block_hashes)
            tokens = seq.token_ids[i * bs:(i + 1) * bs]
            h = hash_block(tokens, seq.block_hashes[-1] if seq.block_hashes else seq.lora_int_id)
            block = self.blocks[seq.block_table[i]]
            block.hash, block.token_ids = h, tokens
            self.hash_to_block_id[h] = block.block_id
            self._add_copy_source(block, self._chain_key(seq, seq.block_hashes))
            seq.block_hashes.append(h)

    def _ref(self, block_id: int):
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_block_ids[block_id]
        block.ref_count += 1

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        assert block.ref_count == 0
        if block.hash is not None and self.hash_to_block_id.get(block.hash) == block_id:
            del self.hash_to_block_id[block.hash]   # its cached content is being overwritten
        self._drop_copy_source(block)
        block.hash, block.token_ids, block.ref_count = None, None, 1
        return block_id
