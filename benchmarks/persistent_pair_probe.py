"""Could a persistent kernel beat two cuBLAS calls in a row at decode batch sizes? A prototype of the
smallest case, at Qwen3-0.6B's shapes: o_proj with its residual add (h += a Wo^T, K = 2048, N = 1024)
then gate_up (g = h Wgu^T, K = 1024, N = 6144), as one kernel of one program per SM:

  1. every program asks L2 for the gate_up weight rows it will use (cp.async.bulk.prefetch.L2, one
     thread a tile), so they arrive while phase 1 runs;
  2. phase 1: 16-column tiles of h += a Wo^T, round-robin over the programs;
  3. a grid barrier (benchmarks/grid_barrier_probe.py's);
  4. phase 2: 16-column tiles of g = h Wgu^T.

Against today's two calls (addmm_ and matmul, cuBLAS), each over 28 distinct weight sets in one CUDA
graph (weights cold in L2, as in a decode step), us a layer; the outputs are checked against them.
Only a probe: the engine does not use it.

    PYTHONPATH=. python benchmarks/persistent_pair_probe.py [--batches 8 16 32 64]
"""
import argparse
import functools

import torch
import triton
import triton.language as tl

from bench_timing import graph_ms
from grid_barrier_probe import SPIN_LIMIT, grid_barrier

LAYERS = 28
HIDDEN, Q, INTER = 1024, 2048, 3072


@triton.jit
def _prefetch_rows(ptr, nbytes):
    """Thread 0 of the program asks L2 for [ptr, ptr + nbytes) (16-byte aligned, a multiple of 16)."""
    one = tl.zeros([1], dtype=tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .u32 t; .reg .pred p; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptr.to(tl.pointer_type(tl.int8)) + one, one + nbytes], dtype=tl.int32, is_pure=False,
        pack=1)


@triton.jit
def _tile(x_ptr, w_ptr, n0, M, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """x[:M] (M x K) times rows n0..n0+BN of w (N x K), transposed: a [BM, BN] fp32 tile."""
    rows = tl.arange(0, BM)[:, None]
    cols = n0 + tl.arange(0, BN)[None, :]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k in range(0, K, BK):
        ks = k + tl.arange(0, BK)
        # .cg: past L1, which may hold lines of h from before other programs wrote them
        x = tl.load(x_ptr + rows * K + ks[None, :], mask=rows < M, other=0.0, cache_modifier=".cg")
        w = tl.load(w_ptr + cols * K + ks[:, None])          # [BK, BN]
        acc = tl.dot(x, w, acc)
    return acc


@triton.jit
def _pair_kernel(a_ptr, wo_ptr, h_ptr, wgu_ptr, g_ptr, counter_ptr, failed_ptr, M,
                 Q: tl.constexpr, HIDDEN: tl.constexpr, N2: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr, PREFETCH: tl.constexpr, SPIN_LIMIT: tl.constexpr):
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    dtype = h_ptr.dtype.element_ty
    if PREFETCH:
        for t in range(pid, N2 // BN, nprog):
            _prefetch_rows(wgu_ptr + t * BN * HIDDEN, BN * HIDDEN * 2)
    rows = tl.arange(0, BM)[:, None]
    for t in range(pid, HIDDEN // BN, nprog):                  # phase 1: h += a Wo^T
        acc = _tile(a_ptr, wo_ptr, t * BN, M, Q, BM, BN, BK)
        cols = t * BN + tl.arange(0, BN)[None, :]
        h = tl.load(h_ptr + rows * HIDDEN + cols, mask=rows < M, other=0.0).to(tl.float32)
        tl.store(h_ptr + rows * HIDDEN + cols, (acc + h).to(dtype), mask=rows < M)
    grid_barrier(counter_ptr, failed_ptr, nprog, SPIN_LIMIT)
    for t in range(pid, N2 // BN, nprog):                      # phase 2: g = h Wgu^T
        acc = _tile(h_ptr, wgu_ptr, t * BN, M, HIDDEN, BM, BN, BK)
        cols = t * BN + tl.arange(0, BN)[None, :]
        tl.store(g_ptr + rows * N2 + cols, acc.to(dtype), mask=rows < M)


def pair_persistent(a, wo, h, wgu, g, counter, failed, programs, prefetch, bk, warps, stages):
    """One layer's pair; counter: [1] int32, zero before the call (each layer has its own)."""
    _pair_kernel[(programs,)](a, wo, h, wgu, g, counter, failed, a.shape[0], Q=Q, HIDDEN=HIDDEN, N2=2 * INTER,
                         BM=max(16, triton.next_power_of_2(a.shape[0])), BN=16, BK=bk, PREFETCH=prefetch,
                         SPIN_LIMIT=SPIN_LIMIT, num_warps=warps, num_stages=stages)


def pair_cublas(a, wo, h, wgu, g):
    h.addmm_(a, wo.t())
    torch.mm(h, wgu.t(), out=g)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--programs-per-sm", type=int, default=1,
                    help="programs a SM (all must be resident at once, or the barrier gives up)")
    ap.add_argument("--settings", nargs="+",
                    default=["pf128/4/3", "pf256/4/3", "pf128/2/4", "128/4/3", "256/4/3", "128/2/4"],
                    help="[pf]BK/warps/stages for the persistent kernel (pf: with the L2 prefetch)")
    args = ap.parse_args()
    programs = torch.cuda.get_device_properties(0).multi_processor_count * args.programs_per_sm
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [(torch.randn(HIDDEN, Q, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02,
                torch.randn(2 * INTER, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02)
               for _ in range(LAYERS)]
    counters = torch.zeros(LAYERS, dtype=torch.int32, device="cuda")   # one barrier counter a layer
    failed = torch.zeros(1, dtype=torch.int32, device="cuda")
    settings = [(text.startswith("pf"), *map(int, text.removeprefix("pf").split("/")))
                for text in args.settings]
    print(f"{torch.cuda.get_device_name()}  triton {triton.__version__}; us a layer (o addmm + gate_up), "
          f"{LAYERS} weight sets in one graph; {programs} programs")
    print(f"{'M':>3} {'cuBLAS':>8} " + " ".join(f"{('pf ' if p else '') + f'{bk}/{w}w/{s}s':>14}"
                                               for p, bk, w, s in settings))
    for m in args.batches:
        a = torch.randn(m, Q, device="cuda", dtype=torch.bfloat16, generator=gen)
        h0 = torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
        h, g = h0.clone(), torch.empty(m, 2 * INTER, device="cuda", dtype=torch.bfloat16)
        h_ref, g_ref = h0.clone(), torch.empty_like(g)
        pair_cublas(a, weights[0][0], h_ref, weights[0][1], g_ref)

        def cublas_all(a=a, h=h, g=g):
            for wo, wgu in weights:
                pair_cublas(a, wo, h, wgu, g)
        row = [graph_ms(cublas_all, calls=1, timings=20) * 1e3 / LAYERS]
        for p, bk, w, s in settings:
            h.copy_(h0)
            run = functools.partial(pair_persistent, failed=failed, programs=programs, prefetch=p, bk=bk,
                                    warps=w, stages=s)
            counters.zero_()
            run(a, weights[0][0], h, weights[0][1], g, counters[:1])
            torch.cuda.synchronize()
            err_h = ((h.float() - h_ref.float()).abs().max() / h_ref.float().abs().max()).item()
            err_g = ((g.float() - g_ref.float()).abs().max() / g_ref.float().abs().max()).item()
            if failed.item() or max(err_h, err_g) > 2e-2:
                raise SystemExit(f"M={m} {p, bk, w, s}: wrong (spin gave up {failed.item()}, "
                                 f"errors {err_h:.3g} {err_g:.3g})")

            def all_layers(run=run, a=a, h=h, g=g):
                counters.zero_()   # one memset for the 28 layers
                for i, (wo, wgu) in enumerate(weights):
                    run(a, wo, h, wgu, g, counters[i:i + 1])
            row.append(graph_ms(all_layers, calls=1, timings=20) * 1e3 / LAYERS)
        print(f"{m:3d} {row[0]:8.2f} " + " ".join(f"{t:14.2f}" for t in row[1:]), flush=True)


if __name__ == "__main__":
    main()
