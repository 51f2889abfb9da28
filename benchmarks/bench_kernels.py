"""Time the attention kernels on one GPU at Qwen3-0.6B shapes (16 query heads, 8 KV heads, head_dim 128,
bf16).

Decode is memory bound (also measured with mixed contexts and the engine's table width, as bench.py's
decode runs it): its figure of merit is bytes moved (K+V of every context, q, out) per second, as
a fraction of the H200's 4.8 TB/s and of a plain device-to-device copy measured here. `--fp8` times
decode over an FP8 (e4m3) cache instead: one byte per K/V value, so the same context moves half the
bytes (`--sweep tiles_fp8` its tile sizes).
Prefill is compute bound: TFLOP/s of causal attention.
q/k RMSNorm + rotary + KV store: the fused kernel in a CUDA graph.
RMSNorm, RMSNorm fused with the residual add, SiLU-and-mul (hidden 1024, intermediate 3072): the
Triton kernels against eager torch (kernels/reference.py), in CUDA graphs; bytes are one read of
the inputs and one write of the outputs.
Sampling (vocab 151936, bf16 logits, T=0.6): the fused Gumbel-max kernel against the sampler's torch
path (which converts to fp32 first); its bytes are one read of the bf16 logits.
`--gemv`: the skinny decode GEMM (kernels/gemv.py) against cuBLAS at the Qwen3-8B projections' shapes
and 1-4 rows, every config of GEMV_SWEEP, each call on its own copy of W (more than L2 holds), in CUDA
graphs; prints the gemv.CONFIGS entries where it beats cuBLAS by 3% or more.

    PYTHONPATH=. python benchmarks/bench_kernels.py [--json PATH] [--fp8 | --gemv]
"""
import argparse
import contextlib
import json
import statistics
from functools import partial

import torch
import triton
import triton.testing

from nanovllm.engine.decode_graphs import longest_first
from nanovllm.kernels import KERNELS, paged_decode_attention, prefill_attention
from nanovllm.kernels.decode_attention import paged_decode_attention_triton
from nanovllm.kernels.norm_act import add_rms_norm_triton, rms_norm_triton, silu_and_mul_triton
from nanovllm.kernels.qk_norm_rope import qk_norm_rope_store_triton
from nanovllm.kernels.reference import add_rms_norm_ref, rms_norm_ref, silu_and_mul_ref
from nanovllm.kernels.sampling import gumbel_max_sample
from nanovllm.layers.rotary_embedding import RotaryEmbedding
from nanovllm.layers.sampler import Sampler, SamplingTensors
from nanovllm.utils import roofline

H, HKV, D, BLOCK = 16, 8, 128, 256
PEAK_BW = 4.8e12


def triton_ms(fn, graph=False):
    """Triton's median ms of fn (in a CUDA graph with graph=True): this script's own timing."""
    bench = triton.testing.do_bench_cudagraph if graph else triton.testing.do_bench
    return bench(fn, rep=200, return_mode="median")


# The timing the probe scripts share (prefill_attn_probe.py, step_parts.py, fp8_gemm_probe.py): CUDA
# events around back-to-back calls, medians.
def median_ms(fn, calls: int = 10, timings: int = 25, warmup: int = 3) -> float:
    """Median over `timings` of the mean time in ms of `calls` back-to-back calls of fn (CUDA events
    on the current stream), after `warmup` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(timings):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def graph_ms(fn, calls: int = 10, timings: int = 25, warmup: int = 3) -> float:
    """Median ms per call of fn, `calls` calls recorded in one CUDA graph (fn runs once before the
    capture, to compile its kernels and allocate), the graph timed by median_ms."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return median_ms(graph.replay, calls=1, timings=timings, warmup=warmup) / calls


def kv_cache_pair(num_blocks, fp8):
    """Random K and V caches [num_blocks, BLOCK, HKV, D], bf16 or FP8, and the scales the kernel takes."""
    k_cache = torch.randn(num_blocks, BLOCK, HKV, D, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    if not fp8:
        return k_cache, v_cache, {}
    scales = dict(k_scale=torch.ones(1, device="cuda"), v_scale=torch.ones(1, device="cuda"))
    return k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn), scales


def decode_case(batch, ctx, fn, graph=False, fp8=False):
    blocks = -(-ctx // BLOCK)
    k_cache, v_cache, scales = kv_cache_pair(batch * blocks, fp8)
    tables = torch.randperm(batch * blocks, device="cuda").int().view(batch, blocks)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, H, D, device="cuda", dtype=torch.bfloat16)
    ms = triton_ms(lambda: fn(q, k_cache, v_cache, tables, lens, D ** -0.5, **scales), graph=graph)
    nbytes = batch * ctx * HKV * D * 2 * k_cache.element_size() + 2 * q.numel() * 2
    return ms, nbytes / (ms * 1e-3)


def launch_order(lens: torch.Tensor) -> torch.Tensor:
    """The engine's launch order for these context lengths (decode_graphs.longest_first), as an
    int32 tensor on their device."""
    return torch.tensor(longest_first(lens.tolist()), dtype=torch.int32, device=lens.device)


def mixed_decode_case(batch, num_splits=None, lo=100, hi=2048, table_blocks=16, seed=0, fp8=False):
    """As the engine runs bench.py's decode: contexts spread over [lo, hi], launched longest first,
    block tables as wide as the CUDA graphs' (max_model_len 4096 / 256), inside a CUDA graph.
    num_splits None: the kernel's own choice (choose_num_splits)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (batch,), device="cuda", generator=gen, dtype=torch.int32)
    k_cache, v_cache, scales = kv_cache_pair(batch * table_blocks, fp8)
    tables = torch.randperm(batch * table_blocks, device="cuda").int().view(batch, table_blocks)
    q = torch.randn(batch, H, D, device="cuda", dtype=torch.bfloat16)
    order = launch_order(lens)

    def decode():
        return paged_decode_attention_triton(q, k_cache, v_cache, tables, lens, D ** -0.5,
                                             num_splits=num_splits, order=order, **scales)
    decode()   # compile (or fail to) outside the graph capture
    ms = triton_ms(decode, graph=True)
    nbytes = int(lens.sum()) * HKV * D * 2 * k_cache.element_size() + 2 * q.numel() * 2
    return ms, nbytes / (ms * 1e-3)


def prefill_case(num_seqs, seq_len):
    total = num_seqs * seq_len
    q = torch.randn(total, H, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(total, HKV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    cu = torch.arange(0, total + 1, seq_len, dtype=torch.int32, device="cuda")
    ms = triton_ms(lambda: prefill_attention(q, k, v, None, None, cu, cu, seq_len, seq_len, None, D ** -0.5))
    flops = 4 * num_seqs * seq_len * seq_len / 2 * H * D  # QK^T and PV, causal half
    return ms, flops / (ms * 1e-3)


def qk_norm_rope_case(num_tokens):
    qkv = torch.randn(num_tokens, (H + 2 * HKV) * D, device="cuda", dtype=torch.bfloat16)
    q_w, k_w = (torch.rand(D, device="cuda", dtype=torch.bfloat16) + 0.5 for _ in range(2))
    cos_sin = RotaryEmbedding(D, 40960, 1e6).cos_sin_cache.cuda()
    positions = torch.randint(0, 40960, (num_tokens,), device="cuda")
    blocks = num_tokens // BLOCK + 2
    slots = torch.randperm(blocks * BLOCK, device="cuda")[:num_tokens].int()
    k_cache = torch.zeros(blocks, BLOCK, HKV, D, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)

    def fused():
        qk_norm_rope_store_triton(qkv, q_w, k_w, 1e-6, cos_sin, positions, slots, k_cache, v_cache, H, HKV, D)
    fused()   # compile outside the capture
    # bytes: read qkv; write q, k and the cache's k and v rows
    return triton_ms(fused, graph=True), 2 * num_tokens * D * ((H + 2 * HKV) + (H + 3 * HKV))


HIDDEN, INTER = 1024, 3072


def norm_act_case(op, num_tokens, triton_kernel):
    """One of rms_norm, add_rms_norm, silu_and_mul at Qwen3-0.6B's sizes, in a CUDA graph."""
    x = torch.randn(num_tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    weight = torch.rand(HIDDEN, device="cuda", dtype=torch.bfloat16) + 0.5
    gate_up = torch.randn(num_tokens, 2 * INTER, device="cuda", dtype=torch.bfloat16)
    cases = {   # op: (triton, eager torch, bytes read and written)
        "rms_norm": (lambda: rms_norm_triton(x, weight, 1e-6), lambda: rms_norm_ref(x, weight, 1e-6),
                     2 * 2 * x.numel()),
        "add_rms_norm": (lambda: add_rms_norm_triton(x, residual, weight, 1e-6),
                         lambda: add_rms_norm_ref(x, residual, weight, 1e-6), 4 * 2 * x.numel()),
        "silu_and_mul": (lambda: silu_and_mul_triton(gate_up), lambda: silu_and_mul_ref(gate_up),
                         3 * 2 * num_tokens * INTER),
    }
    fast, eager, nbytes = cases[op]
    fn = fast if triton_kernel else eager
    fn()   # compile outside the capture
    return triton_ms(fn, graph=True), nbytes


def sampling_case(n, fused, vocab=151936):
    logits = torch.randn(n, vocab, device="cuda", dtype=torch.bfloat16)
    temps = torch.full((n,), 0.6, device="cuda")
    seeds = torch.arange(n, device="cuda")
    if fused:
        ms = triton_ms(lambda: gumbel_max_sample(logits, temps, seeds))
    else:
        sampler = Sampler()
        params = SamplingTensors(temperatures=temps, all_greedy=False)
        ms = triton_ms(lambda: sampler.sample(logits, params))
    return ms, logits.numel() * 2 / (ms * 1e-3)


@contextlib.contextmanager
def knobs(module, **values):
    """Set a kernel module's tuning constants (read at every call) inside a with block only."""
    saved = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def sweep(json_path, which):
    """% of copy bandwidth of decode attention (contexts 100-2048, graph table width) per batch and
    split count, with the split count choose_num_splits gives at each PROGRAMS_PER_SM; then the
    sampler's time per batch and chunk count."""
    from nanovllm.kernels import decode_attention, sampling
    copy_bw = roofline.measure_copy_bandwidth(nbytes=4 << 30)
    splits = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
    rows = []
    if which in ("all", "decode"):
        print("decode mixed ctx 100-2048, % of copy bandwidth; "
              "auto splits at PROGRAMS_PER_SM = 2 / 8 / 16 / 32")
        print("batch " + "".join(f"{s:>7d}" for s in splits) + "   auto(2,8,16,32)")
        for batch in (256, 192, 128, 96, 64, 48, 32, 16, 8, 4, 1):
            fractions = []
            for num_splits in splits:
                ms, bw = mixed_decode_case(batch, num_splits)
                fractions.append(bw / copy_bw)
                rows.append(dict(case=f"mixed decode b={batch} splits={num_splits}", ms=ms,
                                 of_copy=bw / copy_bw))
            auto = []
            for per_sm in (2, 8, 16, 32):
                with knobs(decode_attention, PROGRAMS_PER_SM=per_sm):
                    auto.append(decode_attention.choose_num_splits(
                        batch, HKV, 16 * BLOCK, decode_attention.BLOCK_N, torch.device("cuda")))
            print(f"{batch:5d} " + "".join(f"{f:7.1%}" for f in fractions) + f"   {auto}")
    if which == "tiles":
        shapes = [(32, 2), (32, 4), (64, 2), (64, 4), (64, 8), (128, 4), (128, 8)]
        print("decode mixed ctx 100-2048, % of copy bandwidth, auto splits, by (BLOCK_N, NUM_WARPS)")
        print("batch " + "".join(f"{str(s):>10}" for s in shapes))
        for batch in (256, 128, 64, 32, 16, 8):
            fractions = []
            for block_n, warps in shapes:
                with knobs(decode_attention, BLOCK_N=block_n, NUM_WARPS=warps):
                    ms, bw = mixed_decode_case(batch)
                fractions.append(bw / copy_bw)
                rows.append(dict(case=f"mixed decode b={batch} block_n={block_n} warps={warps}", ms=ms,
                                 of_copy=bw / copy_bw))
            print(f"{batch:5d} " + "".join(f"{f:10.1%}" for f in fractions))
    if which == "tiles_fp8":
        # decode_attention.FP8_BLOCK_N x FP8_NUM_WARPS; a tile too large for shared memory shows as n/a
        shapes = [(64, 1), (64, 4), (128, 4), (128, 8), (256, 8), (64, 2), (32, 2), (32, 1)]
        print("FP8 decode mixed ctx 100-2048, % of copy bandwidth, auto splits, by (block_n, num_warps)")
        print("batch " + "".join(f"{f'{n}x{w}':>12}" for n, w in shapes))
        for batch in (256, 128, 64, 16):
            cells = []
            for block_n, warps in shapes:
                try:
                    with knobs(decode_attention, FP8_BLOCK_N=block_n, FP8_NUM_WARPS=warps):
                        ms, bw = mixed_decode_case(batch, fp8=True)
                except triton.runtime.errors.OutOfResources:
                    cells.append(f"{'n/a':>12}")
                    continue
                cells.append(f"{bw / copy_bw:12.1%}")
                rows.append(dict(case=f"fp8 mixed decode b={batch} block_n={block_n} warps={warps}", ms=ms,
                                 of_copy=bw / copy_bw))
            print(f"{batch:5d} " + "".join(cells))
    if which == "stages":
        print("decode mixed ctx 100-2048, % of copy bandwidth, auto splits, by NUM_STAGES 2 / 3 / 4")
        for batch in (256, 128, 64, 32, 8):
            fractions = []
            for stages in (2, 3, 4):
                with knobs(decode_attention, NUM_STAGES=stages):
                    ms, bw = mixed_decode_case(batch)
                fractions.append(bw / copy_bw)
                rows.append(dict(case=f"mixed decode b={batch} stages={stages}", ms=ms, of_copy=bw / copy_bw))
            print(f"{batch:5d} " + "".join(f"{f:7.1%}" for f in fractions))
    if which in ("all", "sampler"):
        print("sampler (T=0.6, vocab 151936) ms per chunk count")
        chunk_counts = (1, 2, 4, 8, 16, 38, None)
        print("n     " + "".join(f"{c or 'auto':>8}" for c in chunk_counts) + "   auto with one knob changed")
        for n in (256, 128, 64, 16, 1):
            logits = torch.randn(n, 151936, device="cuda", dtype=torch.bfloat16)
            temps, seeds = torch.full((n,), 0.6, device="cuda"), torch.arange(n, device="cuda")
            times = [triton_ms(partial(gumbel_max_sample, logits, temps, seeds, num_chunks=c), graph=True)
                     for c in chunk_counts]
            rows += [dict(case=f"sample n={n} chunks={c or 'auto'}", ms=ms)
                     for c, ms in zip(chunk_counts, times)]
            variants = {}   # the default against one knob changed at a time
            for name, knob, value in (("warps=4", "NUM_WARPS", 4), ("warps=16", "NUM_WARPS", 16),
                                      ("exact log", "FAST_LOG", False), ("philox-7", "PHILOX_ROUNDS", 7)):
                with knobs(sampling, **{knob: value}):
                    variants[name] = triton_ms(partial(gumbel_max_sample, logits, temps, seeds), graph=True)
                rows.append(dict(case=f"sample n={n} {name}", ms=variants[name]))
            print(f"{n:5d} " + "".join(f"{ms:8.4f}" for ms in times) + "  " +
                  "  ".join(f"{name} {ms:.4f}" for name, ms in variants.items()))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(dict(copy_bytes_per_s=copy_bw, results=rows), f, indent=1)


def fp8_decode(json_path):
    """Decode over an FP8 cache: batch 256 x context 1024 (bf16 beside it), then bench.py's mixed contexts."""
    copy_bw = roofline.measure_copy_bandwidth(nbytes=4 << 30)
    rows = []
    print(f"device copy {copy_bw / 1e12:.2f} TB/s; bytes: K+V at 1 byte (FP8) or 2 (bf16) per value, q, out")
    print(f"{'case':44s} {'ms':>9s} {'TB/s':>7s} {'of 4.8':>7s} {'of copy':>8s}")
    def uniform(batch, ctx, fp8):
        return decode_case(batch, ctx, paged_decode_attention_triton, True, fp8)
    cases = [(f"decode {'fp8' if fp8 else 'bf16'} graph b={batch} ctx={ctx}", uniform,
              dict(batch=batch, ctx=ctx, fp8=fp8))
             for batch, ctx, fp8 in [(256, 1024, True), (256, 1024, False), (1, 4096, True)]]
    cases += [(f"decode fp8 mixed ctx 100-2048 b={batch}", mixed_decode_case, dict(batch=batch, fp8=True))
              for batch in (256, 128, 64, 16)]
    for label, case, kwargs in cases:
        ms, bw = case(**kwargs)
        rows.append(dict(case=label, ms=ms, bytes_per_s=bw, of_peak=bw / PEAK_BW, of_copy=bw / copy_bw))
        print(f"{label:44s} {ms:9.4f} {bw / 1e12:7.2f} {bw / PEAK_BW:7.1%} {bw / copy_bw:8.1%}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(dict(copy_bytes_per_s=copy_bw, results=rows), f, indent=1)


GEMV_SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
GEMV_SWEEP = ([("dot", bn, bk, 4, st) for bn in (16, 32, 64) for bk in (128, 256) for st in (3, 5)]
              + [("fma", bn, bk, 4, st) for bn in (4, 8, 16) for bk in (256, 512) for st in (1, 3)])


def graph_us_per_call(calls: list, replays: int = 10) -> float:
    """Median microseconds per call of `calls` recorded into one CUDA graph."""
    for call in calls:
        call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(times)


def gemv_sweep(path: str | None):
    """--gemv: each shape x rows, cuBLAS (addmm_ into C for o and down, as the residual add runs) and
    every config; the winners as gemv.CONFIGS entries."""
    from nanovllm.kernels.gemv import gemv
    torch.manual_seed(0)
    rows, configs = [], {}
    for name, (n, k) in GEMV_SHAPES.items():
        copies = max(2, -(-400_000_000 // (n * k * 2)))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        for m in (1, 2, 4):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            c = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) if name in ("o", "down") else None
            if c is None:
                cublas = graph_us_per_call([partial(torch.nn.functional.linear, x, w) for w in weights])
            else:
                cublas = graph_us_per_call([partial(c.addmm_, x, w.t()) for w in weights])
            want = x.float() @ weights[0].float().t() + (0 if c is None else c.float())
            timed = []
            for config in GEMV_SWEEP:
                got = gemv(x, weights[0], None if c is None else c.clone(), config).float()
                if (got - want).abs().max() > 2e-2 * want.abs().max():
                    raise AssertionError(f"gemv {config} is wrong at {name} M={m}")
                timed.append((graph_us_per_call([partial(gemv, x, w, None if c is None else c.clone(), config)
                                                 for w in weights]), config))
            us, config = min(timed)
            nbytes = n * k * 2
            print(f"{name:8s} M={m} N={n:6d} K={k:6d}: cuBLAS {cublas:7.2f} us ({nbytes / cublas / 1e3:5.0f} "
                  f"GB/s), best {us:7.2f} us ({nbytes / us / 1e3:5.0f} GB/s) {config}, {cublas / us:.3f}x",
                  flush=True)
            rows.append(dict(shape=name, n=n, k=k, m=m, cublas_us=cublas, us=us, config=config))
            if us < 0.97 * cublas:
                configs[(n, k, m)] = config
        del weights
        torch.cuda.empty_cache()
    print("gemv.CONFIGS =", configs)
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--sweep", choices=["all", "decode", "sampler", "stages", "tiles", "tiles_fp8"],
                        help="only a sweep: decode split counts, sampler chunks and knobs, decode K/V "
                             "pipelining depth (stages) or decode tile size x warps (tiles, tiles_fp8)")
    parser.add_argument("--fp8", action="store_true",
                        help="only decode, over an FP8 cache (and bf16 to compare)")
    parser.add_argument("--gemv", action="store_true",
                        help="only the skinny decode GEMM against cuBLAS (see above)")
    args = parser.parse_args()
    if args.gemv:
        return gemv_sweep(args.json)
    if args.sweep:
        return sweep(args.json, args.sweep)
    if args.fp8:
        return fp8_decode(args.json)
    copy_bw = roofline.measure_copy_bandwidth(nbytes=4 << 30)
    rows = []
    print(f"kernels: {KERNELS}; device copy {copy_bw / 1e12:.2f} TB/s")
    print(f"{'case':40s} {'ms':>9s} {'TB/s':>7s} {'of 4.8':>7s} {'of copy':>8s}")
    decode_cases = [("triton", paged_decode_attention_triton, False),
                    ("backend", paged_decode_attention, False),
                    ("triton+graph", paged_decode_attention_triton, True)]
    for batch, ctx in [(256, 1024), (1, 1024), (1, 4096)]:
        for name, fn, graph in decode_cases:
            ms, bw = decode_case(batch, ctx, fn, graph)
            label = f"decode {name} b={batch} ctx={ctx}"
            rows.append(dict(case=label, ms=ms, bytes_per_s=bw, of_peak=bw / PEAK_BW, of_copy=bw / copy_bw))
            print(f"{label:40s} {ms:9.4f} {bw / 1e12:7.2f} {bw / PEAK_BW:7.1%} {bw / copy_bw:8.1%}")
    # Contexts that differ leave SMs idle at the end of a launch: does splitting more pay?
    for batch, splits in [(256, None), (256, 2), (128, None), (128, 2), (128, 4), (64, None), (64, 2),
                          (64, 4), (16, None), (16, 8)]:
        ms, bw = mixed_decode_case(batch, splits)
        label = f"decode mixed ctx 100-2048 b={batch} splits={splits or 'auto'}"
        rows.append(dict(case=label, ms=ms, bytes_per_s=bw, of_peak=bw / PEAK_BW, of_copy=bw / copy_bw))
        print(f"{label:40s} {ms:9.4f} {bw / 1e12:7.2f} {bw / PEAK_BW:7.1%} {bw / copy_bw:8.1%}")
    ms, flops = prefill_case(16, 1024)
    rows.append(dict(case="prefill 16x1024", ms=ms, flops_per_s=flops))
    print(f"{'prefill 16 x 1024 tokens':40s} {ms:9.4f}   {flops / 1e12:.1f} TFLOP/s")
    for num_tokens in (256, 16384):
        ms, nbytes = qk_norm_rope_case(num_tokens)
        label = f"qk norm+rope+store fused T={num_tokens}"
        bw = nbytes / (ms * 1e-3)
        rows.append(dict(case=label, ms=ms, bytes_per_s=bw, of_peak=bw / PEAK_BW, of_copy=bw / copy_bw))
        print(f"{label:40s} {ms:9.4f} {bw / 1e12:7.2f} {bw / PEAK_BW:7.1%} {bw / copy_bw:8.1%}")
    for op in ("rms_norm", "add_rms_norm", "silu_and_mul"):
        for num_tokens in (256, 16384):
            for triton_kernel in (True, False):
                ms, nbytes = norm_act_case(op, num_tokens, triton_kernel)
                label = f"{op} {'triton' if triton_kernel else 'torch'} T={num_tokens}"
                bw = nbytes / (ms * 1e-3)
                rows.append(dict(case=label, ms=ms, bytes_per_s=bw, of_peak=bw / PEAK_BW,
                                 of_copy=bw / copy_bw))
                print(f"{label:40s} {ms:9.4f} {bw / 1e12:7.2f} {bw / PEAK_BW:7.1%} {bw / copy_bw:8.1%}")
    for n, fused in [(256, True), (256, False), (1, True)]:
        ms, bw = sampling_case(n, fused)
        label = f"sample {'fused' if fused else 'torch'} n={n} vocab=151936"
        rows.append(dict(case=label, ms=ms, bytes_per_s=bw, of_peak=bw / PEAK_BW, of_copy=bw / copy_bw))
        print(f"{label:40s} {ms:9.4f} {bw / 1e12:7.2f} {bw / PEAK_BW:7.1%} {bw / copy_bw:8.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(backend=KERNELS, copy_bytes_per_s=copy_bw, results=rows), f, indent=1)


if __name__ == "__main__":
    main()
