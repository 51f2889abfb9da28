"""benchmarks/schedule_replay.py, which docs/benchmarks.md cites for where the long workload's decode
reads fall: both policies run every sequence to its end, the token budget needs fewer decode-only
steps, and the decode tokens read the same bytes either way."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

from schedule_replay import BYTES_PER_TOKEN, replay  # noqa: E402


def test_both_policies_finish_and_read_the_same_bytes():
    lens = [700, 300, 1200, 50, 900, 400]
    runs = {p: replay(p, lens, 8, num_pages=80, page=32, budget=512) for p in ("phases", "budget")}
    phases, budget = runs["phases"], runs["budget"]
    assert phases["steps"]["mixed"] == 0 and budget["steps"]["mixed"] > 0
    assert budget["steps"]["decode"] < phases["steps"]["decode"]
    # no preemption here: each sequence's 7 decode tokens read its context, whichever step they run in
    assert not phases["recomputed_tokens"] and not budget["recomputed_tokens"]
    expected = sum(sum(n + i for i in range(1, 8)) for n in lens) * BYTES_PER_TOKEN   # tokens 2-8
    assert sum(phases["read_bytes"].values()) == sum(budget["read_bytes"].values()) == expected


def test_a_small_cache_preempts_and_still_finishes():
    # two sequences of 5 pages grow into a sixth each in 11 pages: one is preempted and recomputed
    for policy in ("phases", "budget"):
        r = replay(policy, [150, 150], 40, num_pages=11, page=32, budget=128)
        assert r["recomputed_tokens"] > 0 and r["steps"]["decode"] >= 39
