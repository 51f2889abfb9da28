"""Replays bench.py's long workload (256 prompts of 4,000-8,000 tokens, 64 output tokens each) through
two step policies on the CPU, and counts their steps and the KV-cache bytes their decode tokens read:

- phases (nanovllm): a step is prompt chunks (within the token budget) while prompts wait and fit,
  else one decode token for every running sequence;
- budget (vLLM v1): the running sequences decode first in every step, and the waiting prompts' chunks
  fill the rest of the token budget.

A prompt takes its pages when it is admitted; a decode that needs a page preempts the newest running
sequence, which is prefilled again later (prompt and output so far). A decode token reads its whole
context: 2 (K and V) x layers x KV heads x head_dim x 2 bytes (bf16) a token.

    PYTHONPATH=. python benchmarks/schedule_replay.py [--pages 2526] [--budget 16384] [--bandwidth 3.07e12]
"""
import argparse
from collections import deque

from bench import long_workload

BYTES_PER_TOKEN = 2 * 28 * 8 * 128 * 2   # Qwen3-0.6B: 28 layers, 8 KV heads of 128, bf16


class Seq:
    def __init__(self, prompt_len: int, max_tokens: int):
        self.length, self.end = prompt_len, prompt_len + max_tokens   # tokens now, and when it stops
        self.to_prefill = prompt_len   # tokens to compute before it decodes
        self.computed = self.pages = 0


def replay(policy: str, prompt_lens: list[int], max_tokens: int, num_pages: int, page: int,
           budget: int, max_seqs: int = 512) -> dict:
    waiting, running = deque(Seq(n, max_tokens) for n in prompt_lens), deque()
    free = num_pages
    steps, read, recomputed = {"prefill": 0, "decode": 0, "mixed": 0}, {"decode": 0, "mixed": 0}, 0

    def decodes() -> list[Seq]:
        nonlocal free, recomputed
        batch = []
        while running:
            seq = running.popleft()
            need = -(-(seq.length + 1) // page) - seq.pages
            while need > free and running:   # the newest running sequence makes room
                victim = running.pop()
                free, recomputed = free + victim.pages, recomputed + victim.computed
                victim.pages = victim.computed = 0
                victim.to_prefill = victim.length
                waiting.appendleft(victim)
            if need > free:   # no running sequence left to preempt: it is preempted itself
                seq.to_prefill, free, recomputed = seq.length, free + seq.pages, recomputed + seq.computed
                seq.pages = seq.computed = 0
                waiting.appendleft(seq)
                break
            free -= need
            seq.pages += need
            batch.append(seq)
        running.extendleft(reversed(batch))
        return batch

    def chunks(room: int) -> list[tuple[Seq, int]]:
        nonlocal free
        out = []
        while waiting and room > 0 and len(running) < max_seqs:
            seq = waiting[0]
            if not seq.pages:
                need = -(-seq.to_prefill // page)
                if need > free:
                    break
                free, seq.pages = free - need, need
            n = min(seq.to_prefill - seq.computed, room)
            out.append((seq, n))
            room -= n
            if seq.computed + n < seq.to_prefill:
                break
            running.append(waiting.popleft())
        return out

    while waiting or running:
        if policy == "budget" and waiting and running:
            batch = decodes()
            prompts = chunks(budget - len(batch))
        else:
            prompts = chunks(budget)
            batch = [] if prompts else decodes()
        kind = "mixed" if batch and prompts else "decode" if batch else "prefill"
        steps[kind] += 1
        for seq, n in prompts:
            seq.computed += n
        for seq in batch:
            read[kind] += seq.length * BYTES_PER_TOKEN
            seq.computed += 1
        for seq in batch + [s for s, n in prompts if s.computed == s.to_prefill]:
            seq.length += 1   # the token sampled at the end of its prompt, or this step's
        for seq in [s for s in running if s.length >= s.end]:
            running.remove(seq)
            free += seq.pages
    return {"steps": steps, "read_bytes": read, "recomputed_tokens": recomputed}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--pages", type=int, default=2526, help="KV-cache pages (H100, 0.6B: 646,656 tokens)")
    p.add_argument("--page", type=int, default=256)
    p.add_argument("--budget", type=int, default=16384, help="max_num_batched_tokens")
    p.add_argument("--bandwidth", type=float, default=3.07e12, help="bytes/s the decode attention reads at")
    args = p.parse_args()
    prompts, params = long_workload(256, 0.6)
    lens, max_tokens = [len(x) for x in prompts], params[0].max_tokens
    for policy in ("phases", "budget"):
        r = replay(policy, lens, max_tokens, args.pages, args.page, args.budget)
        total = sum(r["read_bytes"].values())
        print(f"{policy:>7s}: steps {r['steps']}; decode reads {total / 1e12:.2f} TB "
              f"({total / args.bandwidth:.2f} s at {args.bandwidth / 1e12:.2f} TB/s), in decode-only steps "
              f"{r['read_bytes']['decode'] / total:.1%}; {r['recomputed_tokens']:,} tokens recomputed")


if __name__ == "__main__":
    main()
