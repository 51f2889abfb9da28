"""Would the decode GEMMs gain from having their weights in L2 before they start? A probe on one GPU,
at Qwen3-0.6B's shapes, outside the engine.

A layer's decode kernels are qkv GEMM, q/k norm + rotary + store, attention, o GEMM (+ residual),
gate_up GEMM, SiLU-and-mul, down GEMM (+ residual). Every GEMM reads weights that no kernel has
touched since the previous step (28 layers x 31.5 MB, far more than the 50 MB L2), and at decode
batch sizes cuBLAS is bound by latency, not by the bytes. The small kernels between the GEMMs use
little DRAM bandwidth; a bulk L2 prefetch (cp.async.bulk.prefetch.L2, sm_90) issued from them could
fetch the next GEMMs' weights while they run.

Here a graph of 28 layers of [qkv GEMM, small kernel A, o addmm, gate_up GEMM, SiLU-and-mul, down
addmm] (A stands in for q/k + attention: a SiLU-and-mul over [M, 4096]) is timed, per layer, as:
  none:   no prefetch;
  fused:  A prefetches o and gate_up's weights, SiLU-and-mul down's and the next layer's qkv
          (cp.async.bulk.prefetch.L2, chunks of at least 4 KB);
  lines:  as fused, by a prefetch.global.L2 per 128-byte line from every thread (no bulk copy engine);
  kernel: the same prefetches from a separate kernel launched just before A and SiLU-and-mul;
  sideN:  the same prefetches from a kernel of N programs on a side stream (a parallel branch of the
          graph), forked just before A and SiLU-and-mul and joined at the end of the step;
  hot:    every layer uses layer 0's weights (they stay in L2): the most prefetching could give.
Attention's K/V traffic is absent, so at large batches this is an upper bound.

    PYTHONPATH=. python benchmarks/l2_prefetch_probe.py [--batches 8 32 128 256]
"""
import argparse
import functools

import torch
import triton
import triton.language as tl

from bench_timing import graph_ms

LAYERS = 28
HIDDEN, QKV, Q, INTER = 1024, 4096, 2048, 3072


@triton.jit
def _prefetch(ptr, nbytes, chunk, pid, LANES: tl.constexpr):
    # lane j of program pid prefetches bytes [(pid * LANES + j) * chunk, + chunk) of ptr into L2
    off = (pid * LANES + tl.arange(0, LANES)).to(tl.int64) * chunk
    size = tl.minimum(nbytes - off, chunk).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; "
        "mov.u32 $0, 0; }",
        "=r,l,r", [ptr.to(tl.pointer_type(tl.int8)) + off, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_lines(ptr, nbytes, pid, nprog, LANES: tl.constexpr):
    # per-thread prefetch.global.L2 of every 128-byte line, lines strided over all programs' lanes
    base = ptr.to(tl.pointer_type(tl.int8))
    for start in range(0, tl.cdiv(nbytes, 128 * nprog * LANES)):
        off = ((start * nprog + pid) * LANES + tl.arange(0, LANES)).to(tl.int64) * 128
        ok = (off < nbytes).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
            "=r,l,r", [base + off, ok], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _silu_pf_kernel(x_ptr, out_ptr, D: tl.constexpr, BLOCK: tl.constexpr, p0, n0, c0, p1, n1, c1,
                    PREFETCH: tl.constexpr, LANES: tl.constexpr):
    row, col = tl.program_id(0), tl.program_id(1)
    pid = row * tl.num_programs(1) + col
    if PREFETCH == 1:
        _prefetch(p0, n0, c0, pid, LANES)
        _prefetch(p1, n1, c1, pid, LANES)
    if PREFETCH == 2:
        nprog = tl.num_programs(0) * tl.num_programs(1)
        _prefetch_lines(p0, n0, pid, nprog, LANES)
        _prefetch_lines(p1, n1, pid, nprog, LANES)
    cols = col * BLOCK + tl.arange(0, BLOCK)
    gate = tl.load(x_ptr + row * 2 * D + cols).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * D + D + cols).to(tl.float32)
    tl.store(out_ptr + row * D + cols, (gate / (1 + tl.exp(-gate)) * up).to(tl.bfloat16))


@triton.jit
def _pf_kernel(p0, n0, c0, p1, n1, c1, LANES: tl.constexpr):
    _prefetch(p0, n0, c0, tl.program_id(0), LANES)
    _prefetch(p1, n1, c1, tl.program_id(0), LANES)


def prefetch_args(pf, programs: int, lanes: int) -> list:
    """(pointer, bytes, chunk) for each tensor in pf, its bytes split over programs x lanes."""
    args = []
    for t in pf:
        nbytes = t.numel() * t.element_size()
        args += [t, nbytes, max(4096, -(-nbytes // (programs * lanes) // 16) * 16)]
    return args


def silu(x, out, pf, mode, lanes=128):
    m, d = out.shape
    block = 1024
    grid = (m, d // block)
    if mode == "kernel":
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        _pf_kernel[(sms,)](*prefetch_args(pf, sms, lanes), LANES=lanes, num_warps=4)
    _silu_pf_kernel[grid](x, out, d, block, *prefetch_args(pf, grid[0] * grid[1], lanes),
                          PREFETCH={"fused": 1, "lines": 2}.get(mode, 0), LANES=lanes, num_warps=4)


def layer_weights(hot: bool, gen):
    def layer():   # qkv, o, gate_up, down: [out, in]
        return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
                for n, k in ((QKV, HIDDEN), (HIDDEN, Q), (2 * INTER, HIDDEN), (HIDDEN, INTER))]
    first = layer()
    return [first if hot or i == 0 else layer() for i in range(LAYERS)]


SIDE = None


def side_prefetch(pf, ctas, lanes=128):
    """A prefetch kernel of `ctas` programs on a side stream, after the main stream's work so far;
    the main stream goes on without waiting for it."""
    global SIDE
    SIDE = SIDE or torch.cuda.Stream()
    SIDE.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(SIDE):
        _pf_kernel[(ctas,)](*prefetch_args(pf, ctas, lanes), LANES=lanes, num_warps=4)


def step(weights, mode, bufs):
    h, attn_in, attn_out, act = bufs
    ctas = int(mode[4:]) if mode.startswith("side") else 0
    for i, (wqkv, wo, wgu, wd) in enumerate(weights):
        nxt = weights[(i + 1) % LAYERS][0]
        torch.matmul(h, wqkv.t())
        if ctas:
            side_prefetch((wo, wgu), ctas)
        silu(attn_in, attn_out, (wo, wgu), mode)
        h.addmm_(attn_out, wo.t())
        gu = torch.matmul(h, wgu.t())
        if ctas:
            side_prefetch((wd, nxt), ctas)
        silu(gu, act, (wd, nxt), mode)
        h.addmm_(act, wd.t())
    if ctas:
        torch.cuda.current_stream().wait_stream(SIDE)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32, 128, 256])
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    cold, hot = layer_weights(False, gen), layer_weights(True, gen)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    print("us per layer (median of 30 timed replays of a 28-layer graph, / 28)")
    modes = ("none", "fused", "lines", "kernel", "side8", "side32", "side132", "hot")
    print(f"{'M':>4} " + " ".join(f"{k:>8}" for k in modes) + "  fused/none lines/none")
    for m in args.batches:
        bufs = (torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16),
                torch.randn(m, 2 * Q, device="cuda", dtype=torch.bfloat16),
                torch.empty(m, Q, device="cuda", dtype=torch.bfloat16),
                torch.empty(m, INTER, device="cuda", dtype=torch.bfloat16))
        row = {}
        for name in modes:
            weights, mode = (hot, "none") if name == "hot" else (cold, name)
            bufs[0].normal_()
            row[name] = graph_ms(functools.partial(step, weights, mode, bufs), calls=1, timings=30,
                                 warmup=5) * 1e3 / LAYERS
        print(f"{m:4d} " + " ".join(f"{row[k]:8.2f}" for k in modes)
              + f"  {row['fused'] / row['none']:10.3f} {row['lines'] / row['none']:10.3f}")


if __name__ == "__main__":
    main()
