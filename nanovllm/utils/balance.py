"""How data parallelism splits a batch of requests over replicas: by an estimate of each request's
work, the largest first to the least-loaded replica. The engine and the roofline share it."""
import heapq


def request_cost(prompt_tokens: int, max_tokens: int) -> int:
    """A request's prompt tokens (its prefill) plus, for each output token, the context computing it
    reads: the prompt and the output tokens before it."""
    return prompt_tokens + max_tokens * prompt_tokens + max_tokens * (max_tokens - 1) // 2


def assign_by_cost(costs: list[int], n: int) -> list[list[int]]:
    """Split request indices over n replicas so their summed costs are close: the largest request
    first to the least-loaded replica (LPT). Each replica's indices come back ascending."""
    heap = [(0, r) for r in range(n)]
    shares: list[list[int]] = [[] for _ in range(n)]
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        load, r = heapq.heappop(heap)
        shares[r].append(i)
        heapq.heappush(heap, (load + costs[i], r))
    return [sorted(s) for s in shares]
