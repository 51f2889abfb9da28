"""Could a persistent kernel beat two cuBLAS calls in a row at decode batch sizes? A prototype of the
smallest case, at Qwen3-0.6B's shapes: o_proj with its residual add (h += a Wo^T, K = 2048, N = 1024)
then gate_up (g = h Wgu^T, K = 1024, N = 6144), as one kernel of one program per SM:

  1. every program asks L2 for the gate_up weight rows it will use (cp.async.bulk.prefetch.L2, one
     thread a tile), so they arrive while phase 1 runs;
  2. phase 1: 16-column tiles of h += a Wo^T, round-robin over the programs;
  3. a grid barrier (benchmarks/grid_barrier_probe.py's);
  4. phase 2: 16-column tiles of g = h Wgu^T.

With a setting sN/..., phase 1 is split over K instead: N x 64 items of fp32 partials, which
phase 2 sums with h as it loads its x operand (the new h goes to a second buffer). With r/... or
re/... (_pair_regs_kernel), every weight slice is one register load and every SM works in both
phases: phase 1 as 128 K-half items whose second finisher adds the other's partial, phase 2 loading
the next slice while it multiplies the current one, and with re/ the first gate_up slice loaded at
the start, so its latency is paid during phase 1 and the barrier.

Against today's two calls (addmm_ and matmul, cuBLAS), each over 28 distinct weight sets in one CUDA
graph (weights cold in L2, as in a decode step), us a layer; the outputs are checked against them.
Only a probe: the engine does not use it.

    PYTHONPATH=. python benchmarks/persistent_pair_probe.py [--batches 8 16 32 64]
                                                            [--settings 256/4/4 s2/256/4/4 re/4/4]
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
def _tile(x_ptr, w_ptr, n0, M, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
          k0, KLEN: tl.constexpr):
    """x[:M] (M x K) times rows n0..n0+BN of w (N x K), transposed, over columns k0..k0+KLEN of both
    (all K, or a split of it): a [BM, BN] fp32 tile."""
    rows = tl.arange(0, BM)[:, None]
    cols = n0 + tl.arange(0, BN)[None, :]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k in range(k0, k0 + KLEN, BK):
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
        acc = _tile(a_ptr, wo_ptr, t * BN, M, Q, BM, BN, BK, 0, Q)
        cols = t * BN + tl.arange(0, BN)[None, :]
        h = tl.load(h_ptr + rows * HIDDEN + cols, mask=rows < M, other=0.0).to(tl.float32)
        tl.store(h_ptr + rows * HIDDEN + cols, (acc + h).to(dtype), mask=rows < M)
    grid_barrier(counter_ptr, failed_ptr, nprog, SPIN_LIMIT)
    for t in range(pid, N2 // BN, nprog):                      # phase 2: g = h Wgu^T
        acc = _tile(h_ptr, wgu_ptr, t * BN, M, HIDDEN, BM, BN, BK, 0, HIDDEN)
        cols = t * BN + tl.arange(0, BN)[None, :]
        tl.store(g_ptr + rows * N2 + cols, acc.to(dtype), mask=rows < M)


@triton.jit
def _w_slice(w_ptr, n0, k0, K: tl.constexpr, BN: tl.constexpr, KLEN: tl.constexpr, KC: tl.constexpr, valid):
    """Rows n0..n0+BN of w (N x K) over columns k0..k0+KLEN, transposed and cut into KC chunks of K:
    a [KC, KLEN / KC, BN] register tile (one load for all of it, so its bytes are in flight at once)."""
    ks = k0 + tl.arange(0, KC)[:, None, None] * (KLEN // KC) + tl.arange(0, KLEN // KC)[None, :, None]
    return tl.load(w_ptr + (n0 + tl.arange(0, BN)[None, None, :]) * K + ks, mask=valid, other=0.0)


@triton.jit
def _x_slice(x_ptr, M, k0, K: tl.constexpr, BM: tl.constexpr, KLEN: tl.constexpr, KC: tl.constexpr):
    """x[:M] (M x K, zero rows to BM) over columns k0..k0+KLEN, cut like _w_slice: [KC, BM, KLEN / KC].
    Loaded past L1 (.cg): other programs may have written it since this one last read it."""
    rows = tl.arange(0, BM)[None, :, None]
    ks = k0 + tl.arange(0, KC)[:, None, None] * (KLEN // KC) + tl.arange(0, KLEN // KC)[None, None, :]
    return tl.load(x_ptr + rows * K + ks, mask=rows < M, other=0.0, cache_modifier=".cg")


@triton.jit
def _chunked_dot(x, w):
    """sum over the chunks of x[c] @ w[c]: one short MMA chain a chunk (a warp each), not one long one."""
    return tl.sum(tl.dot(x, w), axis=0)


@triton.jit
def _pair_regs_kernel(a_ptr, wo_ptr, h_ptr, part_ptr, wgu_ptr, g_ptr, counter_ptr, failed_ptr, M,
                      Q: tl.constexpr, HIDDEN: tl.constexpr, N2: tl.constexpr, BM: tl.constexpr,
                      BN: tl.constexpr, KC: tl.constexpr, EARLY: tl.constexpr, PARTS: tl.constexpr,
                      SPIN_LIMIT: tl.constexpr):
    """Both phases as whole-slice register loads, every SM busy in both:
    phase 1 in 2 x HIDDEN / BN items (a K half of a BN-column tile); the second of an item's two
    halves to finish adds the other's fp32 partial (written to part [2, BM, HIDDEN]) and h, and
    writes h (a tile counter per column tile: counter_ptr[1 + t]);
    phase 2 in N2 / BN items of all K, x = h loaded once a program; with EARLY the program's first
    gate_up slice is loaded at the start, before phase 1 and the barrier, and each next slice
    while the current one is multiplied. PARTS (a bit mask: 1 phase 1, 2 the barrier, 4 phase 2; 7 in
    full) leaves parts out, to time the others."""
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    dtype = h_ptr.dtype.element_ty
    rows = tl.arange(0, BM)[:, None]
    tiles1: tl.constexpr = HIDDEN // BN
    half: tl.constexpr = Q // 2
    tiles2: tl.constexpr = N2 // BN
    if EARLY:
        w2 = _w_slice(wgu_ptr, pid * BN, 0, HIDDEN, BN, HIDDEN, KC, pid < tiles2)
    if pid < (2 * tiles1 if PARTS & 1 else 0):                 # phase 1: one item a program
        t = pid % tiles1
        s = pid // tiles1
        w = _w_slice(wo_ptr, t * BN, s * half, Q, BN, half, KC, pid < 2 * tiles1)
        acc = _chunked_dot(_x_slice(a_ptr, M, s * half, Q, BM, half, KC), w)
        cols = t * BN + tl.arange(0, BN)[None, :]
        tl.store(part_ptr + (s * BM + rows) * HIDDEN + cols, acc)
        tl.debug_barrier()
        if tl.atomic_add(counter_ptr + 1 + t, 1, sem="acq_rel", scope="gpu") == 1:   # the second half
            other = tl.load(part_ptr + ((1 - s) * BM + rows) * HIDDEN + cols, cache_modifier=".cg")
            h = tl.load(h_ptr + rows * HIDDEN + cols, mask=rows < M, other=0.0).to(tl.float32)
            tl.store(h_ptr + rows * HIDDEN + cols, (h + (acc + other)).to(dtype), mask=rows < M)
    if PARTS & 2:
        grid_barrier(counter_ptr, failed_ptr, nprog, SPIN_LIMIT)
    x = _x_slice(h_ptr, M, 0, HIDDEN, BM, HIDDEN, KC)
    if not EARLY:
        w2 = _w_slice(wgu_ptr, pid * BN, 0, HIDDEN, BN, HIDDEN, KC, pid < tiles2)
    for t in range(pid, tiles2 if PARTS & 4 else 0, nprog):    # phase 2: g = h Wgu^T
        w_next = _w_slice(wgu_ptr, (t + nprog) * BN, 0, HIDDEN, BN, HIDDEN, KC, t + nprog < tiles2)
        acc = _chunked_dot(x, w2)
        cols = t * BN + tl.arange(0, BN)[None, :]
        tl.store(g_ptr + rows * N2 + cols, acc.to(dtype), mask=rows < M)
        w2 = w_next


@triton.jit
def _h_plus_parts(h_ptr, part_ptr, rows, cols, M, HIDDEN: tl.constexpr, BM: tl.constexpr,
                  SPLIT: tl.constexpr):
    """h + the SPLIT fp32 partials of a Wo^T at [rows, cols] (cols: [1, n] column indices), in fp32."""
    x = tl.load(h_ptr + rows * HIDDEN + cols, mask=rows < M, other=0.0).to(tl.float32)
    for s in range(SPLIT):
        x += tl.load(part_ptr + (s * BM + rows) * HIDDEN + cols, cache_modifier=".cg")
    return x


@triton.jit
def _pair_splitk_kernel(a_ptr, wo_ptr, h_ptr, part_ptr, h_out_ptr, wgu_ptr, g_ptr, counter_ptr, failed_ptr, M,
                        Q: tl.constexpr, HIDDEN: tl.constexpr, N2: tl.constexpr, BM: tl.constexpr,
                        BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr, SPIN_LIMIT: tl.constexpr):
    """Phase 1 split over K: SPLIT x (HIDDEN / BN) items, each an fp32 partial of a Wo^T over Q / SPLIT
    columns, into part [SPLIT, BM, HIDDEN]; after the barrier every program sums h + the partials
    as it loads its x operand for gate_up, and programs 0..HIDDEN/BN-1 also write the new h (into
    h_out: h itself is still being read)."""
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    dtype = h_ptr.dtype.element_ty
    rows = tl.arange(0, BM)[:, None]
    tiles1: tl.constexpr = HIDDEN // BN
    klen: tl.constexpr = Q // SPLIT
    for item in range(pid, SPLIT * tiles1, nprog):             # phase 1: partials of a Wo^T
        t = item % tiles1
        s = item // tiles1
        acc = _tile(a_ptr, wo_ptr, t * BN, M, Q, BM, BN, BK, s * klen, klen)
        cols = t * BN + tl.arange(0, BN)[None, :]
        tl.store(part_ptr + (s * BM + rows) * HIDDEN + cols, acc)
    grid_barrier(counter_ptr, failed_ptr, nprog, SPIN_LIMIT)
    if pid < tiles1:                                           # the new residual stream
        cols = pid * BN + tl.arange(0, BN)[None, :]
        x = _h_plus_parts(h_ptr, part_ptr, rows, cols, M, HIDDEN, BM, SPLIT)
        tl.store(h_out_ptr + rows * HIDDEN + cols, x.to(dtype), mask=rows < M)
    for t in range(pid, N2 // BN, nprog):                      # phase 2: g = (h + sum of parts) Wgu^T
        cols = t * BN + tl.arange(0, BN)[None, :]
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k in range(0, HIDDEN, BK):
            ks = k + tl.arange(0, BK)
            x = _h_plus_parts(h_ptr, part_ptr, rows, ks[None, :], M, HIDDEN, BM, SPLIT)
            w = tl.load(wgu_ptr + cols * HIDDEN + ks[:, None])      # [BK, BN]
            acc = tl.dot(x.to(dtype), w, acc)
        tl.store(g_ptr + rows * N2 + cols, acc.to(dtype), mask=rows < M)


def pair_splitk(a, wo, h, part, h_out, wgu, g, counter, failed, programs, split, bk, warps, stages):
    """One layer's pair, phase 1 split over K; part: [split, BM, HIDDEN] fp32 scratch."""
    _pair_splitk_kernel[(programs,)](a, wo, h, part, h_out, wgu, g, counter, failed, a.shape[0], Q=Q,
                                     HIDDEN=HIDDEN, N2=2 * INTER, BM=part.shape[1], BN=16, BK=bk,
                                     SPLIT=split, SPIN_LIMIT=SPIN_LIMIT, num_warps=warps, num_stages=stages)


def pair_regs(a, wo, h, part, wgu, g, counter, failed, programs, early, warps, kc, parts):
    """One layer's pair, whole slices in registers; counter: [1 + HIDDEN / 16] int32, zero before the
    call; part: [2, BM, HIDDEN] fp32 scratch."""
    _pair_regs_kernel[(programs,)](a, wo, h, part, wgu, g, counter, failed, a.shape[0], Q=Q, HIDDEN=HIDDEN,
                                   N2=2 * INTER, BM=part.shape[1], BN=16, KC=kc, EARLY=early, PARTS=parts,
                                   SPIN_LIMIT=SPIN_LIMIT, num_warps=warps, num_stages=1)


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
                    help="[pf|sN/]BK/warps/stages for the persistent kernel (pf: with the L2 prefetch; "
                         "or r[e]/warps/chunks[/parts]: whole slices in registers, e: the first gate_up "
                         "slice loaded before phase 1, parts: _pair_regs_kernel's PARTS; "
                         "sN/: phase 1 split over K in N parts)")
    args = ap.parse_args()
    programs = torch.cuda.get_device_properties(0).multi_processor_count * args.programs_per_sm
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [(torch.randn(HIDDEN, Q, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02,
                torch.randn(2 * INTER, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02)
               for _ in range(LAYERS)]
    # a layer's barrier counter, then (the r settings) its phase-1 tile counters
    counters = torch.zeros(LAYERS, 1 + HIDDEN // 16, dtype=torch.int32, device="cuda")
    failed = torch.zeros(1, dtype=torch.int32, device="cuda")
    print(f"{torch.cuda.get_device_name()}  triton {triton.__version__}; us a layer (o addmm + gate_up), "
          f"{LAYERS} weight sets in one graph; {programs} programs")
    print(f"{'M':>3} {'cuBLAS':>8} " + " ".join(f"{text:>14}" for text in args.settings))
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
        for text in args.settings:
            split = int(text.split("/")[0][1:]) if text.startswith("s") else 0
            h.copy_(h0)
            if text.startswith("r"):
                part = torch.empty(2, max(16, triton.next_power_of_2(m)), HIDDEN, device="cuda",
                                   dtype=torch.float32)
                h_new = h
                run = functools.partial(pair_regs, part=part, failed=failed, programs=programs,
                                        early=text.startswith("re"), warps=int(text.split("/")[1]),
                                        kc=int(text.split("/")[2]), parts=int((text.split("/") + ["7"])[3]))
            elif split:
                bk, w, s = map(int, text.split("/")[-3:])
                part = torch.empty(split, max(16, triton.next_power_of_2(m)), HIDDEN, device="cuda",
                                   dtype=torch.float32)
                h_new = torch.empty_like(h)
                run = functools.partial(pair_splitk, part=part, h_out=h_new, failed=failed, programs=programs,
                                        split=split, bk=bk, warps=w, stages=s)
            else:
                bk, w, s = map(int, text.removeprefix("pf").split("/")[-3:])
                h_new = h   # updated in place
                run = functools.partial(pair_persistent, failed=failed, programs=programs,
                                        prefetch=text.startswith("pf"), bk=bk, warps=w, stages=s)
            counters.zero_()
            run(a, weights[0][0], h, wgu=weights[0][1], g=g, counter=counters[0])
            torch.cuda.synchronize()
            err_h = ((h_new.float() - h_ref.float()).abs().max() / h_ref.float().abs().max()).item()
            err_g = ((g.float() - g_ref.float()).abs().max() / g_ref.float().abs().max()).item()
            partial = text.startswith("r") and len(text.split("/")) > 3    # a timing of some parts only
            if not partial and (failed.item() or max(err_h, err_g) > 2e-2):
                print(f"M={m} {text}: wrong (spin gave up {failed.item()}, errors {err_h:.3g} {err_g:.3g})")
                failed.zero_()
                row.append(float("nan"))
                continue

            def all_layers(run=run, a=a, h=h, g=g):
                counters.zero_()   # one memset for the 28 layers
                for i, (wo, wgu) in enumerate(weights):
                    run(a, wo, h, wgu=wgu, g=g, counter=counters[i])
            row.append(graph_ms(all_layers, calls=1, timings=20) * 1e3 / LAYERS)
        print(f"{m:3d} {row[0]:8.2f} " + " ".join(f"{t:14.2f}" for t in row[1:]), flush=True)

if __name__ == "__main__":
    main()
