"""Decode GEMM time against M at the Qwen3-8B shapes (bf16: a step's 36 layers of qkv / o / gate_up / down and the LM head in one CUDA graph, median of 7 replays), and what padding bench.py's decode batches to engine.decode_graphs.graph_batch_sizes costs against padding to multiples of 8 (vLLM's sizes). GPU only: PYTHONPATH=. python benchmarks/graph_pad_probe.py"""
import torch, statistics
torch.manual_seed(0)
dev = "cuda"
shapes = [(4096, 6144), (4096, 4096), (4096, 24576), (12288, 4096)]
ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.01 for k, n in shapes]
lm = torch.randn(151936, 4096, device=dev, dtype=torch.bfloat16) * 0.01
def t(m):
    xs = [torch.randn(m, k, device=dev, dtype=torch.bfloat16) for k, n in shapes]
    xl = torch.randn(m, 4096, device=dev, dtype=torch.bfloat16)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            for x, w in zip(xs, ws): torch.nn.functional.linear(x, w)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        for _ in range(36):
            for x, w in zip(xs, ws): torch.nn.functional.linear(x, w)
        torch.nn.functional.linear(xl, lm)
    times = []
    for _ in range(7):
        a = torch.cuda.Event(True); b = torch.cuda.Event(True)
        a.record(); g.replay(); b.record(); b.synchronize(); times.append(a.elapsed_time(b))
    return statistics.median(times)
res = {m: t(m) for m in list(range(96, 257, 8))}
for m, v in res.items(): print(f"M={m:4d} step(36 layers + lm_head) {v:7.3f} ms  per row {v/m*1000:6.1f} us")
# expected cost of the bench workload's decode batches under two padding schemes
import random
random.seed(0)
outs = [random.randint(100, 1024) for _ in range(256)]
def cost(sizes):
    tot = 0.0
    for step in range(1, 1025):
        b = sum(o > step for o in outs)
        if b < 96: continue
        p = next(s for s in sizes if s >= b)
        p8 = -(-p // 8) * 8
        tot += res[min(max(p8, 96), 256)]
    return tot
from nanovllm.engine.decode_graphs import graph_batch_sizes
ours = graph_batch_sizes(256)
eights = sorted(set(range(8, 257, 8)))
print(f"decode GEMM ms (batch>=96 steps): ours {cost(ours):.0f}  steps-of-8 {cost(eights):.0f}")
