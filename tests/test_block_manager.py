"""BlockManager with no model: ref counts, prefix-hash reuse, eviction order."""
from nanovllm.engine.block_manager import MIN_PARTIAL_HIT, BlockManager, KVCopy, hash_block
from nanovllm.engine.sequence import Sequence

BS = 4


def seq_of(tokens):
    return Sequence(list(tokens))


def compute_all(bm: BlockManager, seq: Sequence):
    """What a prefill of the whole sequence does, as seen by the block manager."""
    seq.num_computed_tokens = seq.num_tokens
    bm.register_computed(seq)


def test_allocate_and_free_restores_all_blocks():
    bm = BlockManager(8, BS)
    seq = seq_of(range(10))                      # 3 blocks (4 + 4 + 2)
    assert bm.can_allocate(seq)
    bm.allocate(seq)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    assert all(bm.blocks[b].ref_count == 1 for b in seq.block_table)
    bm.deallocate(seq)
    assert bm.num_free_blocks == 8 and seq.block_table == [] and seq.num_computed_tokens == 0
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_can_allocate_counts_free_blocks():
    bm = BlockManager(3, BS)
    assert not bm.can_allocate(seq_of(range(13)))   # 4 blocks > 3
    assert bm.can_allocate(seq_of(range(12)))


def test_only_computed_full_blocks_are_hashed():
    bm = BlockManager(8, BS)
    seq = seq_of(range(10))
    bm.allocate(seq)
    assert bm.hash_to_block_id == {}               # nothing computed yet: nothing shareable
    seq.num_computed_tokens = 5
    bm.register_computed(seq)
    assert len(seq.block_hashes) == 1              # block 0 full and computed; block 1 not full
    compute_all(bm, seq)
    assert len(seq.block_hashes) == 2              # the partial third block is never hashed
    h0 = hash_block(list(range(4)), None)
    assert seq.block_hashes == [h0, hash_block(list(range(4, 8)), h0)]
    assert bm.hash_to_block_id[h0] == seq.block_table[0]


def test_prefix_hit_shares_blocks_and_ref_counts():
    bm = BlockManager(16, BS)
    a = seq_of(list(range(8)) + [100, 101])
    bm.allocate(a)
    compute_all(bm, a)
    b = seq_of(list(range(8)) + [200, 201, 202])
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2]  # the shared 8-token prefix
    assert b.block_table[2] != a.block_table[2]
    assert b.num_computed_tokens == 8
    assert [bm.blocks[x].ref_count for x in b.block_table[:2]] == [2, 2]
    bm.deallocate(a)
    assert [bm.blocks[x].ref_count for x in b.block_table[:2]] == [1, 1]
    bm.deallocate(b)
    assert bm.num_free_blocks == 16


def test_chain_hash_depends_on_prefix():
    bm = BlockManager(16, BS)
    a = seq_of([1, 2, 3, 4, 5, 6, 7, 8, 9])
    bm.allocate(a)
    compute_all(bm, a)
    b = seq_of([9, 9, 9, 9, 5, 6, 7, 8, 9])        # same second block, different first block
    bm.allocate(b)
    assert b.num_computed_tokens == 0 and not set(b.block_table) & set(a.block_table)


def test_fully_cached_prompt_keeps_last_block_to_compute():
    bm = BlockManager(16, BS)
    a = seq_of(range(8))                           # block aligned: 2 full blocks
    bm.allocate(a)
    compute_all(bm, a)
    b = seq_of(range(8))
    bm.allocate(b)
    # Every block is cached, but the last token must still be computed (there must be logits).
    assert b.num_computed_tokens == 4
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]


def test_freed_blocks_are_revived_by_hash():
    bm = BlockManager(4, BS)
    a = seq_of(range(9))
    bm.allocate(a)
    compute_all(bm, a)
    table = list(a.block_table)
    bm.deallocate(a)
    assert bm.num_free_blocks == 4                 # free, but still cached
    b = seq_of(list(range(8)) + [50])
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.block_table[:2] == table[:2] and b.num_computed_tokens == 8
    assert bm.num_free_blocks == 1


def test_hit_is_confirmed_by_token_ids():
    bm = BlockManager(8, BS)
    a = seq_of(range(5))
    bm.allocate(a)
    compute_all(bm, a)
    h = a.block_hashes[0]
    bm.blocks[bm.hash_to_block_id[h]].token_ids = [7, 7, 7, 7]   # a (simulated) hash collision
    b = seq_of(range(5))
    bm.allocate(b)
    assert b.num_computed_tokens == 0


def test_eviction_takes_least_recently_freed_and_drops_its_hash():
    bm = BlockManager(3, BS)
    a = seq_of(range(9))                           # blocks: [0..3], [4..7], [8]
    bm.allocate(a)
    compute_all(bm, a)
    bm.deallocate(a)                               # tail freed first -> evicted first
    c = seq_of([90] * 5)                           # needs 2 fresh blocks
    bm.allocate(c)
    assert a.block_hashes == [] and len(bm.hash_to_block_id) == 1
    # The surviving cached block is the prompt head, the most shareable one.
    bm.deallocate(c)
    b = seq_of(list(range(4)) + [1])
    bm.allocate(b)
    assert b.num_computed_tokens == 4


def test_append_takes_a_block_only_at_a_boundary():
    bm = BlockManager(4, BS)
    seq = seq_of(range(4))
    bm.allocate(seq)
    compute_all(bm, seq)
    seq.append_token(4)                            # 5th token needs a second block
    assert bm.can_append(seq)
    bm.may_append(seq)
    assert len(seq.block_table) == 2
    seq.num_computed_tokens = 5
    seq.append_token(5)
    bm.may_append(seq)
    assert len(seq.block_table) == 2               # still room in block 2


def test_cannot_append_when_no_block_is_free():
    bm = BlockManager(1, BS)
    seq = seq_of(range(4))
    bm.allocate(seq)
    compute_all(bm, seq)
    seq.append_token(4)
    assert not bm.can_append(seq)


# ---- partial hits: a prompt's tokens after its shared blocks copied from another block's start ----

PBS = 32   # blocks wide enough for MIN_PARTIAL_HIT (16) tokens


def finished(bm: BlockManager, tokens, computed=None) -> Sequence:
    """A sequence that computed `computed` of its tokens (all but the last, as a finished one has)
    and let go of its blocks."""
    seq = seq_of(tokens)
    bm.allocate(seq)
    seq.num_computed_tokens = len(tokens) - 1 if computed is None else computed
    bm.register_computed(seq)
    table = list(seq.block_table)
    bm.deallocate(seq)
    seq.block_table = table   # kept for the test's asserts
    return seq


def test_partial_hit_copies_a_finished_sequences_last_block():
    bm = BlockManager(16, PBS)
    a = finished(bm, range(61))                   # block 0 full; block 1 holds 28 computed rows
    b = seq_of(list(range(50)) + [999] * 10)      # shares 50 tokens: one block and 18 rows of the next
    bm.allocate(b)
    assert b.block_table[0] == a.block_table[0]
    assert b.num_computed_tokens == 50 and b.num_cached_tokens == 50
    assert bm.take_copies() == [KVCopy(a.block_table[1], b.block_table[1], 18)]
    assert bm.take_copies() == []                  # handed out once


def test_partial_hit_from_a_full_block_and_at_least_one_token_left():
    bm = BlockManager(16, PBS)
    a = finished(bm, range(100))                   # blocks 0-2 full and hashed
    b = seq_of(range(60))                          # a prefix of a: everything cached but its last token
    bm.allocate(b)
    assert b.num_computed_tokens == 59
    assert bm.take_copies() == [KVCopy(a.block_table[1], b.block_table[1], 27)]


def test_no_partial_hit_below_the_minimum_under_another_adapter_or_after_overwriting():
    from nanovllm.lora.request import LoRARequest
    bm = BlockManager(4, PBS)
    a = finished(bm, range(61))
    short = seq_of(list(range(32 + MIN_PARTIAL_HIT - 1)) + [999] * 5)   # 15 rows in common
    bm.allocate(short)
    assert short.num_computed_tokens == 32 and bm.take_copies() == []
    bm.deallocate(short)
    lora = Sequence(list(range(60)), lora_request=LoRARequest("x", 1, "/nowhere"))
    bm.allocate(lora)
    assert lora.num_computed_tokens == 0 and bm.take_copies() == []
    bm.deallocate(lora)
    filler = seq_of([7] * (4 * PBS))               # takes every block: a's rows are overwritten
    bm.allocate(filler)
    bm.deallocate(filler)
    assert a.block_table[1] not in {b for s in bm.copy_sources.values() for b in s}
    b = seq_of(list(range(50)) + [999] * 10)
    bm.allocate(b)
    assert b.num_computed_tokens == 0 and bm.take_copies() == []


def test_prefix_caching_off_makes_no_copies():
    bm = BlockManager(16, PBS, enable_prefix_caching=False)
    finished(bm, range(61))
    b = seq_of(list(range(50)) + [999] * 10)
    bm.allocate(b)
    assert b.num_computed_tokens == 0 and bm.take_copies() == [] and bm.copy_sources == {}


def test_copy_sources_per_key_are_capped_newest_first():
    from nanovllm.engine.block_manager import MAX_SOURCES_PER_KEY
    n = MAX_SOURCES_PER_KEY + 3
    bm = BlockManager(2 * n + 4, PBS)
    # n sequences whose second blocks share their first 20 tokens, then differ
    seqs = [finished(bm, list(range(PBS)) + list(range(100, 120)) + [1000 + i] * 10) for i in range(n)]
    (key, sources), = [(k, v) for k, v in bm.copy_sources.items() if k[1] == 100]
    assert list(sources) == [s.block_table[1] for s in seqs[-MAX_SOURCES_PER_KEY:]]
    bm.take_copies()   # the sequences' own partial hits on each other
    b = seq_of(list(range(PBS)) + list(range(100, 120)) + [1000 + n - 1] * 10)
    bm.allocate(b)   # the newest source matches all but the last token
    assert bm.take_copies() == [KVCopy(seqs[-1].block_table[1], b.block_table[1], 29)]
