"""Scheduler with no model: a fake runner returns deterministic tokens."""
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.sampling_params import SamplingParams

EOS = 0


def make(num_blocks=64, block_size=4, max_num_seqs=8, max_tokens_per_step=64, max_model_len=1000):
    return Scheduler(max_num_seqs, max_tokens_per_step, max_model_len, num_blocks, block_size, {EOS})


def fake_tokens(batch):
    """A token per sampled sequence that depends only on its tokens (so recompute is invisible)."""
    return [1 + sum(s.token_ids) % 97 for s in batch.sampling_seqs]


def run(sched, max_steps=10_000):
    batches = []
    while not sched.is_finished():
        batch = sched.schedule()
        batches.append(batch)
        sched.postprocess(batch, fake_tokens(batch))
        assert len(batches) < max_steps
    return batches


def params(n=4, **kw):
    return SamplingParams(temperature=0, max_tokens=n, **kw)


def test_prefill_then_decode_and_finish_by_length():
    sched = make()
    seqs = [Sequence([5] * 6, params(3)), Sequence([7] * 3, params(3))]
    for s in seqs:
        sched.add(s)
    batches = run(sched)
    assert batches[0].is_prefill and batches[0].num_new_tokens == [6, 3]
    assert all(not b.is_prefill and b.num_new_tokens == [1, 1] for b in batches[1:])
    assert [s.num_completion_tokens for s in seqs] == [3, 3]
    assert all(s.finish_reason == "length" and s.status == SequenceStatus.FINISHED for s in seqs)
    assert sched.block_manager.num_free_blocks == 64


def test_eos_stops_unless_ignored():
    sched = make()
    a, b = Sequence([1], params(5)), Sequence([1], params(5, ignore_eos=True))
    for s in (a, b):
        sched.add(s)
    batch = sched.schedule()
    sched.postprocess(batch, [EOS, EOS])
    assert a.finish_reason == "stop" and not b.is_finished
    assert list(sched.running) == [b]


def test_chunked_prefill_respects_token_budget():
    sched = make(max_tokens_per_step=5)
    long, short = Sequence(list(range(1, 13)), params(2)), Sequence([3, 3], params(2))
    sched.add(long)
    sched.add(short)
    batches = run(sched)
    prefills = [b for b in batches if b.is_prefill]
    assert [b.num_new_tokens for b in prefills[:3]] == [[5], [5], [2, 2]]
    assert all(b.num_tokens <= 5 for b in batches)
    assert long.num_completion_tokens == 2 and short.num_completion_tokens == 2
    # Chunking must not change what is computed: same tokens as one big prefill.
    ref = make()
    ref_long, ref_short = Sequence(list(range(1, 13)), params(2)), Sequence([3, 3], params(2))
    ref.add(ref_long)
    ref.add(ref_short)
    run(ref)
    assert long.token_ids == ref_long.token_ids and short.token_ids == ref_short.token_ids


def test_decode_batch_limited_by_max_num_seqs():
    sched = make(max_num_seqs=2)
    seqs = [Sequence([i + 1] * 3, params(2)) for i in range(5)]
    for s in seqs:
        sched.add(s)
    batches = run(sched)
    assert all(len(b.seqs) <= 2 for b in batches)
    assert all(s.num_completion_tokens == 2 for s in seqs)


def test_preemption_when_blocks_run_out_gives_same_tokens():
    sched = make(num_blocks=6, block_size=4)
    seqs = [Sequence([i + 2] * 7, params(9)) for i in range(3)]   # each grows to 16 tokens = 4 blocks
    for s in seqs:
        sched.add(s)
    preempted = False
    while not sched.is_finished():
        batch = sched.schedule()
        sched.postprocess(batch, fake_tokens(batch))
        preempted |= any(s.status == SequenceStatus.WAITING and s.num_completion_tokens for s in seqs)
        used = sum(1 for b in sched.block_manager.blocks if b.ref_count)
        assert used + sched.block_manager.num_free_blocks == 6
    assert preempted
    ref = make(num_blocks=64)
    refs = [Sequence([i + 2] * 7, params(9)) for i in range(3)]
    for s in refs:
        ref.add(s)
    run(ref)
    assert [s.token_ids for s in seqs] == [s.token_ids for s in refs]
    assert sched.block_manager.num_free_blocks == 6


def test_prefix_cache_hit_skips_computed_tokens():
    sched = make(block_size=4)
    a = Sequence(list(range(1, 11)), params(1))
    sched.add(a)
    run(sched)
    b = Sequence(list(range(1, 9)) + [50, 51], params(1))
    sched.add(b)
    batch = sched.schedule()
    assert batch.is_prefill and batch.num_new_tokens == [2]   # 8 cached tokens reused
    sched.postprocess(batch, fake_tokens(batch))


def test_sequence_that_outgrows_the_cache_stops_with_length():
    sched = make(num_blocks=2, block_size=4)
    seq = Sequence([3] * 7, params(50, ignore_eos=True))
    sched.add(seq)
    run(sched)
    assert seq.finish_reason == "length" and seq.num_tokens >= 8
    assert sched.block_manager.num_free_blocks == 2


def test_max_model_len_stops_with_length():
    sched = make(max_model_len=10)
    seq = Sequence([4] * 8, params(50, ignore_eos=True))
    sched.add(seq)
    run(sched)
    assert seq.num_tokens == 10 and seq.finish_reason == "length"
