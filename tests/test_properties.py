"""Property-based tests of BlockManager and Scheduler with no model.

A fake runner stands in for the model. It keeps a fake KV cache (the token id written into every
slot), writes each step's tokens into the slots the block tables name, checks that every position a
sequence attends to holds that sequence's token, and returns a token that depends only on the
sequence's tokens. So a wrong block table, a prefix-cache hit on the wrong data or a recompute that
skips a token shows up as a failed check or as output that differs from a plain loop with no cache.
"""
from collections import Counter
from dataclasses import replace

import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanovllm.engine.block_manager import cdiv, hash_block
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.engine.stop_checker import StopChecker
from nanovllm.sampling_params import SamplingParams

VOCAB = 16
EOS = 0


def next_token(token_ids) -> int:
    """The fake model: a deterministic function of all the tokens so far (EOS now and then)."""
    return xxhash.xxh64(bytes(t % 256 for t in token_ids)).intdigest() % VOCAB


def reference(prompt: list[int], params: SamplingParams, max_model_len: int,
              stop_at: int | None = None) -> tuple[list[int], str]:
    """What a sequence must end with: a plain loop, no cache, no batching, no preemption."""
    tokens = list(prompt)
    while True:
        t = next_token(tokens)
        tokens.append(t)
        out = tokens[len(prompt):]
        if not params.ignore_eos and t == EOS:
            return out, "stop"
        if len(out) == stop_at:   # a stop string wins over a length limit reached by the same token
            return out, "stop"
        if len(out) >= params.max_tokens or len(tokens) >= max_model_len:
            return out, "length"


class StopAtLength(StopChecker):
    """Stands in for stop strings (no tokenizer): sequence stop_at's keys end by a "stop string"
    when their output reaches that many tokens."""

    def __init__(self, stop_at: dict[int, int], *args):
        super().__init__(*args)
        self.stop_at = stop_at

    def _stop_string(self, seq, counts):
        return "<stop string>" if seq.num_completion_tokens >= self.stop_at[seq.seq_id] else None


class FakeRunner:
    def __init__(self, num_blocks: int, block_size: int):
        self.bs = block_size
        self.kv = [None] * (num_blocks * block_size)   # kv[slot] = token id whose K/V the slot holds

    def slot(self, seq, pos: int) -> int:
        return seq.block_table[pos // self.bs] * self.bs + pos % self.bs

    def run(self, batch) -> list[int]:
        out = []
        for seq, n, samples in zip(batch.seqs, batch.num_new_tokens, batch.samples):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            assert 0 < n and end <= seq.num_tokens and len(seq.block_table) * self.bs >= end
            for pos in range(start, end):
                self.kv[self.slot(seq, pos)] = seq.token_ids[pos]
            # Attention reads every earlier position: all must hold this sequence's tokens.
            assert [self.kv[self.slot(seq, p)] for p in range(end)] == seq.token_ids[:end], \
                f"seq {seq.seq_id}: KV cache does not hold its tokens"
            if samples:
                out.append(next_token(seq.token_ids[:end]))
        return out

    def launch(self, batch) -> list[int]:
        """As run, for an engine one step ahead: a sequence's newest token may still be pending,
        known only to the runner (as the real one keeps it on the device)."""
        out, last = [], getattr(self, "last", {})
        for seq, n, samples in zip(batch.seqs, batch.num_new_tokens, batch.samples):
            tokens = seq.token_ids + ([last[seq.seq_id]] if seq.num_pending else [])
            assert seq.num_pending <= 1 and len(tokens) == seq.num_tokens
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            assert 0 < n and end <= seq.num_tokens and len(seq.block_table) * self.bs >= end
            for pos in range(start, end):
                self.kv[self.slot(seq, pos)] = tokens[pos]
            assert [self.kv[self.slot(seq, p)] for p in range(end)] == tokens[:end], \
                f"seq {seq.seq_id}: KV cache does not hold its tokens"
            if samples:
                out.append(next_token(tokens[:end]))
        self.last = {seq.seq_id: t for seq, t in zip(batch.sampling_seqs, out)}
        return out


def chain_hashes(token_ids: list[int], bs: int) -> dict[int, tuple]:
    """hash of block i (chained) -> the tokens of blocks 0..i, for each full block."""
    out, h = {}, None
    for i in range(len(token_ids) // bs):
        h = hash_block(token_ids[i * bs:(i + 1) * bs], h)
        out[h] = tuple(token_ids[:(i + 1) * bs])
    return out


def check_block_manager(sched: Scheduler, runner: FakeRunner, all_seqs: list[Sequence]):
    bm, bs = sched.block_manager, sched.block_manager.block_size
    live = list(sched.waiting) + list(sched.running)
    held = Counter(b for seq in live for b in seq.block_table)
    for block in bm.blocks:
        assert block.ref_count >= 0
        # A block's count is the number of queued sequences whose block table holds it.
        assert block.ref_count == held[block.block_id], f"block {block.block_id}"
        assert (block.ref_count == 0) == (block.block_id in bm.free_block_ids)
    used = sum(1 for b in bm.blocks if b.ref_count > 0)
    assert bm.num_free_blocks + used == bm.num_blocks
    for seq in all_seqs:
        if seq.is_finished:
            assert not seq.block_table and seq not in live
    for seq in live:
        assert len(set(seq.block_table)) == len(seq.block_table)
        assert seq.num_computed_tokens <= len(seq.block_table) * bs
        known = min(seq.num_computed_tokens, len(seq.token_ids))   # a pending token's id is not known here
        assert [runner.kv[runner.slot(seq, p)] for p in range(known)] == seq.token_ids[:known]
        expected = list(chain_hashes(seq.token_ids, bs))
        assert seq.block_hashes == expected[:len(seq.block_hashes)]
        assert len(seq.block_hashes) <= seq.num_computed_tokens // bs
        for i, h in enumerate(seq.block_hashes):
            assert bm.blocks[seq.block_table[i]].hash == h
    # The prefix map names only blocks whose stored tokens (and fake KV) are the hashed prefix's last block.
    known = {}
    for seq in all_seqs:
        known.update(chain_hashes(seq.token_ids, bs))
    for h, block_id in bm.hash_to_block_id.items():
        block = bm.blocks[block_id]
        assert block.hash == h and h in known
        assert block.token_ids == list(known[h][-bs:])
        assert runner.kv[block_id * bs:(block_id + 1) * bs] == block.token_ids


def check_batch(sched: Scheduler, batch):
    ids = [seq.seq_id for seq in batch.seqs]
    assert len(ids) == len(set(ids)), "a sequence scheduled twice in one step"
    assert len(batch.seqs) == len(batch.num_new_tokens)
    assert batch.num_tokens <= sched.max_num_batched_tokens
    assert len(batch.seqs) <= sched.max_num_seqs
    assert len(sched.running) <= sched.max_num_seqs
    for seq, samples in zip(batch.seqs, batch.samples):
        # Nothing is computed past the model's length, nor sampled past max_tokens (a sequence whose
        # pending token is its last is not scheduled again).
        assert seq.num_tokens <= sched.max_model_len
        assert not samples or seq.output_index < seq.sampling_params.max_tokens
    for seq in batch.seqs:
        assert not seq.is_finished
        assert seq.status == (SequenceStatus.RUNNING if seq in sched.running else SequenceStatus.WAITING)
    if not batch.is_prefill:
        assert all(n == 1 for n in batch.num_new_tokens)


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_model_len = draw(st.integers(4, 80))
    bases = draw(st.lists(st.lists(st.integers(1, VOCAB - 1), min_size=0, max_size=24),
                          min_size=1, max_size=3))
    requests = []
    for _ in range(draw(st.integers(1, 12))):
        prompt = draw(st.sampled_from(bases)) + draw(st.lists(st.integers(1, VOCAB - 1), max_size=12))
        prompt = (prompt or [1])[:max_model_len]
        params = SamplingParams(temperature=0, max_tokens=draw(st.integers(1, 12)),
                                ignore_eos=draw(st.booleans()))
        # (arrival step, prompt, params, output length at which a "stop string" ends it, or None)
        stop_at = draw(st.one_of(st.none(), st.integers(1, 12)))
        requests.append((draw(st.integers(0, 12)), prompt, params, stop_at))
    return dict(block_size=block_size, max_model_len=max_model_len, requests=requests,
                num_blocks=draw(st.integers(1, 40)), max_num_seqs=draw(st.integers(1, 8)),
                max_num_batched_tokens=draw(st.integers(1, 64)))


def run_workload(w: dict, run_ahead: bool = False) -> list[Sequence]:
    """run_ahead: drive the scheduler as the engine's async scheduling does: schedule and launch
    step N+1 (advance), then complete step N."""
    sched = Scheduler(w["max_num_seqs"], w["max_num_batched_tokens"], w["max_model_len"],
                      w["num_blocks"], w["block_size"], {EOS})
    runner = FakeRunner(w["num_blocks"], w["block_size"])
    pending = sorted(w["requests"], key=lambda r: r[0])
    seqs: list[Sequence] = []
    stop_at: dict[int, int] = {}
    sched.stop_checker = StopAtLength(stop_at, {EOS}, w["max_model_len"])
    reported: list[int] = []
    in_flight = None
    step = 0

    def complete(batch, tokens):
        return [seq.seq_id for seq in sched.complete(batch, tokens)]

    while pending or not sched.is_finished() or in_flight:
        while pending and pending[0][0] <= step:
            _, prompt, params, stop = pending.pop(0)
            seqs.append(Sequence(prompt, params if stop is None else replace(params, stop=["<stop string>"])))
            if stop is not None:
                stop_at[seqs[-1].seq_id] = stop
            sched.add(seqs[-1])
        batch = sched.schedule()
        check_batch(sched, batch)
        if run_ahead:
            launched = (batch, runner.launch(batch)) if batch.seqs else None
            if launched:
                sched.advance(batch)
            else:
                reported += [seq.seq_id for seq in batch.finished]
            if in_flight:
                reported += complete(*in_flight)
            in_flight = launched
        else:
            tokens = runner.run(batch)
            sched.advance(batch)
            reported += complete(batch, tokens)
        check_block_manager(sched, runner, seqs)
        step += 1
        assert step < 5000, "the scheduler stopped making progress"
    assert sched.block_manager.num_free_blocks == w["num_blocks"]
    # Every sequence is reported finished exactly once (also one that outgrew the whole cache).
    assert sorted(reported) == sorted(seq.seq_id for seq in seqs)
    return seqs


PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(workloads())
def test_scheduler_invariants_and_outputs_match_a_plain_loop(w):
    seqs = run_workload(w)
    bs, num_blocks = w["block_size"], w["num_blocks"]
    stops = [r[3] for r in sorted(w["requests"], key=lambda r: r[0])]
    for seq, stop_at in zip(seqs, stops):
        assert seq.is_finished
        ref, reason = reference(seq.prompt_token_ids, seq.sampling_params, w["max_model_len"], stop_at)
        # Computing a sequence of final length L needs K/V for its first L - 1 tokens.
        if cdiv(len(seq.prompt_token_ids) + len(ref) - 1, bs) <= num_blocks:
            assert (seq.completion_token_ids, seq.finish_reason) == (ref, reason)
        else:   # it can never fit in the whole cache: stopped early, never hangs
            assert seq.finish_reason == "length"
            assert seq.completion_token_ids == ref[:seq.num_completion_tokens]


@PROPERTY
@given(workloads())
def test_running_one_step_ahead_gives_the_same_outputs(w):
    """Async scheduling: sequences that end (EOS, length, stop strings) or are preempted while their
    next step is already launched; same tokens and reasons as one step at a time, same invariants."""
    ahead, plain = run_workload(w, run_ahead=True), run_workload(w)
    assert [(s.completion_token_ids, s.finish_reason) for s in ahead] == \
        [(s.completion_token_ids, s.finish_reason) for s in plain]
    assert all(s.num_pending == 0 for s in ahead)


@PROPERTY
@given(workloads())
def test_tiny_cache_gives_the_tokens_of_a_huge_cache(w):
    """Preemption and recompute are invisible: same tokens as with room for everything."""
    w["num_blocks"] = max(w["num_blocks"], cdiv(w["max_model_len"], w["block_size"]))   # everything fits
    small = run_workload(w)
    big = run_workload({**w, "num_blocks": 1000, "max_num_seqs": 64, "max_num_batched_tokens": 10_000})
    assert [s.completion_token_ids for s in small] == [s.completion_token_ids for s in big]
    assert [s.finish_reason for s in small] == [s.finish_reason for s in big]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(1, 3), min_size=1, max_size=20), min_size=1, max_size=20),
       st.integers(1, 30), st.sampled_from([1, 2, 4]), st.data())
def test_block_manager_allocate_free_in_any_order(prompts, num_blocks, block_size, data):
    """BlockManager alone: allocate when it says it can, free in a random order, reallocate; counts
    and the prefix map stay consistent, and a revived cached block holds the right tokens."""
    sched = Scheduler(64, 10_000, 1000, num_blocks, block_size, {EOS})
    bm, runner = sched.block_manager, FakeRunner(num_blocks, block_size)
    seqs = [Sequence(p, SamplingParams(temperature=0)) for p in prompts]
    for _round in range(2):
        for seq in seqs:
            if bm.can_allocate(seq):
                bm.allocate(seq)
                for pos in range(seq.num_computed_tokens, seq.num_tokens):   # "compute" the rest
                    runner.kv[runner.slot(seq, pos)] = seq.token_ids[pos]
                seq.num_computed_tokens = seq.num_tokens
                bm.register_computed(seq)
                sched.running.append(seq)
            check_block_manager(sched, runner, seqs)
        order = data.draw(st.permutations(list(sched.running)))
        for seq in order:
            sched.running.remove(seq)
            bm.deallocate(seq)
            check_block_manager(sched, runner, seqs)
        assert bm.num_free_blocks == num_blocks


def test_prefill_admits_up_to_max_num_seqs_in_one_step():
    """Regression: the admission check counted sequences admitted this step twice (they are in the
    batch and already in `running`), so a step took only about half of max_num_seqs."""
    sched = Scheduler(4, 10_000, 1000, 100, 4, {EOS})
    for _ in range(6):
        sched.add(Sequence([3, 4, 5], SamplingParams(temperature=0)))
    batch = sched.schedule()
    assert batch.is_prefill and len(batch.seqs) == 4 and len(sched.running) == 4


def test_decode_batch_respects_the_token_budget():
    """Regression: a decode step took max_num_seqs sequences even when max_num_batched_tokens was smaller."""
    sched = Scheduler(8, 3, 1000, 100, 4, {EOS})
    for _ in range(6):
        sched.add(Sequence([3], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)))
    runner = FakeRunner(100, 4)
    while not sched.is_finished():
        batch = sched.schedule()
        assert batch.num_tokens <= 3 and len(batch.seqs) <= 3
        sched.postprocess(batch, runner.run(batch))
