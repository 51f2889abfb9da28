"""Can a decode GEMM written in CUDA C++ (compiled at run time by NVRTC, which torch's CUDA wheels
ship) beat cuBLAS at decode batch sizes? Every Triton form tried for issue 23 (tiles, split-K,
persistent kernels; RESULTS.md) lost to cuBLAS there, and the notes named a kernel with explicit
async copies as the route left. This is its first measurement.

The kernel: y = x W^T (+ r), x [M, K] and W [N, K] bf16, fp32 accumulation, y bf16. The weight is
mma's A operand (16 output columns a tile) and the tokens its B operand (8 a tile), so a decode
batch of 8 fills a whole tile. Tiles of BN weight rows x BM tokens x 64 of K go through shared
memory by cp.async (16 bytes a copy, rows swizzled by 16-byte chunk so ldmatrix reads them without
bank conflicts) in a STAGES-deep ring, and mma.sync.m16n8k16 multiplies them. With SPLITK > 1 the
K range is cut in SPLITK slices, each CTA writes an fp32 partial, and the last CTA of a tile (an
atomic count) adds the partials in slice order (deterministic) and writes y. The first stages'
weight tiles are issued before `griddepcontrol.wait`, which matters only when the kernel is launched
with programmatic dependent launch (cuda_gemm_chain.py); launched plainly the wait returns at once.

Timed against cuBLAS (F.linear / addmm) at Qwen3-0.6B's four decode GEMMs, each over 28 distinct
weight sets in one CUDA graph (weights cold in L2, as in a decode step), us per GEMM; the outputs
are checked against cuBLAS's. Only a probe: the engine does not use it.

With --wgmma the tiles are multiplied by Hopper's warpgroup MMA instead (sm_90a: one warpgroup a
64 weight rows, all BM tokens as wgmma's N, both operands read from the same swizzled shared
memory through descriptors), the kernel otherwise the same.

    PYTHONPATH=. python benchmarks/cuda_gemm_probe.py [--batches 8 64 256] [--quick] [--wgmma]
    python benchmarks/cuda_gemm_probe.py --compile-only --nvrtc LIBNVRTC [--cuobjdump PATH]
"""
import argparse
import ctypes
import itertools
import os
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

LAYERS = 28
# (name, N, K, residual) at Qwen3-0.6B: qkv, o (+ residual), gate_up, down (+ residual)
SHAPES = [("qkv", 4096, 1024, False), ("o", 1024, 2048, True), ("gate_up", 6144, 1024, False),
          ("down", 1024, 3072, True)]

SOURCE = r"""
#define NT (32 * WARPS_N * WARPS_M)
#define WN (BN / WARPS_N)
#define WM (BM / WARPS_M)
#define FN (WN / 16)
#define FM (WM / 8)
#define BK 64
#define A_BYTES (BN * BK * 2)
#define STAGE_BYTES ((BN + BM) * BK * 2)

__device__ __forceinline__ unsigned swz(int row, int chunk) {
  return row * 128 + ((chunk ^ (row & 7)) << 4);
}
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(dst), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void ldsm_x4(unsigned* r, unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x2(unsigned* r, unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}
__device__ __forceinline__ void mma16816(float* c, const unsigned* a, const unsigned* b) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
               "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ float bf16_to_f32(unsigned short v) {
  return __uint_as_float(((unsigned)v) << 16);
}
__device__ __forceinline__ unsigned short f32_to_bf16(float v) {
  unsigned short r;
  asm("cvt.rn.bf16.f32 %0, %1;\n" : "=h"(r) : "f"(v));
  return r;
}
#if WGMMA
// wgmma's shared-memory matrix descriptor: start address, stride 1024 bytes between 8-row groups,
// 128-byte swizzle (the layout swz() writes)
__device__ __forceinline__ unsigned long long desc(unsigned addr) {
  return (unsigned long long)((addr & 0x3FFFF) >> 4) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32)
         | (1ull << 62);
}
WGMMA_FUNCTION
#endif
__device__ __forceinline__ float ld_cg(const float* p) {
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];\n" : "=f"(v) : "l"(p));
  return v;
}

__device__ __forceinline__ void load_w(unsigned sa, const unsigned short* __restrict__ W, int n0, int k0,
                                       int K, int tid) {
#pragma unroll
  for (int i = tid; i < BN * 8; i += NT) {
    const int row = i >> 3, ch = i & 7;
    cp_async16(sa + swz(row, ch), W + (size_t)(n0 + row) * K + k0 + ch * 8, 16);
  }
}
__device__ __forceinline__ void load_x(unsigned sb, const unsigned short* __restrict__ X, int m0, int k0,
                                       int M, int ldx, int tid) {
#pragma unroll
  for (int i = tid; i < BM * 8; i += NT) {
    const int row = i >> 3, ch = i & 7;
    const bool ok = m0 + row < M;
    cp_async16(sb + swz(row, ch), X + (size_t)(ok ? m0 + row : 0) * ldx + k0 + ch * 8, ok ? 16 : 0);
  }
}

extern "C" __global__ void __launch_bounds__(NT) nv_gemm(
    const unsigned short* __restrict__ X, const unsigned short* __restrict__ W,
    unsigned short* __restrict__ Y, const unsigned short* __restrict__ R,
    float* __restrict__ ws, int* __restrict__ counters, int M, int N, int K, int ldx) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ int s_last;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int warp_n = warp % WARPS_N, warp_m = warp / WARPS_N;
  const int n0 = blockIdx.x * BN, m0 = blockIdx.y * BM, split = blockIdx.z;
  const int k_len = K / SPLITK, k_begin = split * k_len, KT = k_len / BK;
  // 1024-byte aligned: wgmma reads the tiles as 128-byte-swizzled atoms of 8 rows
  const unsigned sbase = ((unsigned)__cvta_generic_to_shared(smem) + 1023) & ~1023u;

  float acc[FN][FM][4];
#pragma unroll
  for (int i = 0; i < FN; ++i)
#pragma unroll
    for (int j = 0; j < FM; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

  // The weight tiles of the first STAGES - 1 stages do not depend on the kernel before this one: with
  // programmatic dependent launch they are in flight before griddepcontrol.wait returns (without it
  // the wait returns at once).
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < KT) load_w(sbase + s * STAGE_BYTES, W, n0, k_begin + s * BK, K, tid);
    asm volatile("cp.async.commit_group;\n" ::);
  }
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::);
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s)
    if (s < KT) load_x(sbase + s * STAGE_BYTES + A_BYTES, X, m0, k_begin + s * BK, M, ldx, tid);
  asm volatile("cp.async.commit_group;\n" ::);
  for (int kt = 0; kt < KT; ++kt) {
    if (kt == 0) asm volatile("cp.async.wait_group 0;\n" ::);
    else asm volatile("cp.async.wait_group %0;\n" :: "n"(STAGES - 2));
#if WGMMA
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
    __syncthreads();
    const int nk = kt + STAGES - 1;
    if (nk < KT) {
      const unsigned st = sbase + (nk % STAGES) * STAGE_BYTES;
      load_w(st, W, n0, k_begin + nk * BK, K, tid);
      load_x(st + A_BYTES, X, m0, k_begin + nk * BK, M, ldx, tid);
    }
    asm volatile("cp.async.commit_group;\n" ::);
    const unsigned sa = sbase + (kt % STAGES) * STAGE_BYTES, sb = sa + A_BYTES;
#if WGMMA
    // warpgroup w / 4 multiplies its 64 weight rows by all BM tokens, 16 of K at a time; the
    // descriptors step 32 bytes along the swizzled rows
    const unsigned a_wg = sa + (warp >> 2) * 64 * 128;
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) WGMMA_CALL(acc, desc(a_wg + kk * 32), desc(sb + kk * 32));
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  }
#else
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      unsigned a[FN][4], b[FM][2];
#pragma unroll
      for (int i = 0; i < FN; ++i)
        ldsm_x4(a[i], sa + swz(warp_n * WN + i * 16 + (lane & 7) + ((lane >> 3) & 1) * 8,
                               kk * 2 + (lane >> 4)));
      if (FM == 1) {
        ldsm_x2(b[0], sb + swz(warp_m * WM + (lane & 7), kk * 2 + ((lane >> 3) & 1)));
      } else {
#pragma unroll
        for (int j = 0; j < FM / 2; ++j) {
          unsigned r[4];
          ldsm_x4(r, sb + swz(warp_m * WM + j * 16 + (lane & 7) + (lane >> 4) * 8,
                              kk * 2 + ((lane >> 3) & 1)));
          b[2 * j][0] = r[0]; b[2 * j][1] = r[1]; b[2 * j + 1][0] = r[2]; b[2 * j + 1][1] = r[3];
        }
      }
#pragma unroll
      for (int i = 0; i < FN; ++i)
#pragma unroll
        for (int j = 0; j < FM; ++j) mma16816(acc[i][j], a[i], b[j]);
    }
  }
#endif

  const int g = lane >> 2, t = lane & 3;
  if (SPLITK > 1) {
    float* mine = ws + (size_t)split * M * N;
#pragma unroll
    for (int i = 0; i < FN; ++i)
#pragma unroll
      for (int j = 0; j < FM; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int n = n0 + warp_n * WN + i * 16 + g + (e >> 1) * 8;
          const int tok = m0 + warp_m * WM + j * 8 + 2 * t + (e & 1);
          if (tok < M) mine[(size_t)tok * N + n] = acc[i][j][e];
        }
    __threadfence();
    __syncthreads();
    if (tid == 0) {
      const int tile = blockIdx.y * gridDim.x + blockIdx.x;
      const int last = atomicAdd(&counters[tile], 1) == SPLITK - 1;
      if (last) counters[tile] = 0;
      s_last = last;
    }
    __syncthreads();
    if (!s_last) return;
    __threadfence();
  }
#pragma unroll
  for (int i = 0; i < FN; ++i)
#pragma unroll
    for (int j = 0; j < FM; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int n = n0 + warp_n * WN + i * 16 + g + (e >> 1) * 8;
        const int tok = m0 + warp_m * WM + j * 8 + 2 * t + (e & 1);
        if (tok >= M) continue;
        float v = acc[i][j][e];
        if (SPLITK > 1) {
          v = 0.f;
          for (int s = 0; s < SPLITK; ++s) v += ld_cg(ws + ((size_t)s * M + tok) * N + n);
        }
        if (HAS_RES) v += bf16_to_f32(R[(size_t)tok * N + n]);
        Y[(size_t)tok * N + n] = f32_to_bf16(v);
      }
}
"""


def config_name(cfg) -> str:
    bn, bm, wn, wm, stages, splitk, *wg = cfg
    return f"{bn}x{bm} {'wgmma' if wg and wg[0] else f'w{wn}x{wm}'} s{stages} k{splitk}"


def _wgmma_function(bm: int) -> str:
    """wgmma_call: one m64n{bm}k16 wgmma of a warpgroup into acc[0][j][e] (the register order of
    wgmma's accumulator fragment, n8 block j, element e, matches mma.sync's per warp)."""
    n = bm // 2
    regs = ", ".join(f"%{i}" for i in range(n))
    outs = ", ".join(f'"+f"(acc[0][{i // 4}][{i % 4}])' for i in range(n))
    return (
        "__device__ __forceinline__ void wgmma_call(float (&acc)[1][FM][4], unsigned long long da,\n"
        "                                           unsigned long long db) {\n"
        f'  asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{n + 2}, 0;\\n"\n'
        f'               "wgmma.mma_async.sync.aligned.m64n{bm}k16.f32.bf16.bf16 "\n'
        f'               "{{{regs}}}, %{n}, %{n + 1}, "\n'
        '               "p, 1, 1, 0, 0;\\n}\\n"\n'
        f'               : {outs}\n'
        '               : "l"(da), "l"(db), "r"(1));\n'
        "}\n#define WGMMA_CALL(a, x, y) wgmma_call(a, x, y)\n")


def source(cfg, residual: bool) -> str:
    bn, bm, wn, wm, stages, splitk, *wg = cfg
    wg = bool(wg and wg[0])
    defines = dict(BN=bn, BM=bm, WARPS_N=wn, WARPS_M=wm, STAGES=stages, SPLITK=splitk, HAS_RES=int(residual),
                   WGMMA=int(wg))
    return ("".join(f"#define {k} {v}\n" for k, v in defines.items())
            + SOURCE.replace("WGMMA_FUNCTION", _wgmma_function(bm) if wg else ""))


def is_wgmma(cfg) -> bool:
    return len(cfg) > 6 and bool(cfg[6])


def valid(cfg, K: int) -> bool:
    bn, bm, wn, wm, stages, splitk, *_ = cfg
    if K % (splitk * 64) or K // splitk // 64 < 2:
        return False
    if is_wgmma(cfg):   # a warpgroup (4 warps) per 64 weight rows, all BM tokens in one wgmma
        return bn in (64, 128) and wn == bn // 16 and wm == 1 and bm % 8 == 0 and bm <= 256
    wn_rows, wm_toks = bn // wn, bm // wm
    return bn % wn == 0 and bm % wm == 0 and wn_rows % 16 == 0 and (wm_toks == 8 or wm_toks % 16 == 0)


def smem_bytes(cfg) -> int:
    bn, bm, _, _, stages, *_ = cfg
    return (bn + bm) * 64 * 2 * stages + 1024   # + the alignment to 1024 bytes


def candidates(m: int, quick: bool, wgmma: bool = False):
    out = []
    if wgmma:
        bms = sorted({min(256, max(8, -(-m // 8) * 8)), min(64, max(8, -(-m // 8) * 8)),
                      min(128, max(8, -(-m // 8) * 8))})
        for bm, bn, stages, splitk in itertools.product(bms, (64, 128), (3, 4), (1, 2, 4, 8)):
            cfg = (bn, bm, bn // 16, 1, stages, splitk, 1)
            if smem_bytes(cfg) <= 220 * 1024:
                out.append(cfg)
        return out
    bms = sorted({min(128, max(8, 1 << (m - 1).bit_length())), 64 if m >= 64 else 8})
    for bm, bn, (wn, wm), stages, splitk in itertools.product(
            bms, (64, 128), ((4, 1), (2, 2), (8, 1), (4, 2)), (3, 4) if not quick else (4,), (1, 2, 4, 8)):
        cfg = (bn, bm, wn, wm, stages, splitk)
        if bm // wm >= 8 and smem_bytes(cfg) <= 200 * 1024:
            out.append(cfg)
    return out


def nvrtc_compile(lib, src: str, arch: str = "90") -> bytes:
    """Compile src for sm_<arch> with the NVRTC library `lib` (a ctypes CDLL); the cubin bytes."""
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"nv_gemm.cu", 0, None, None) == 0
    opts = [f"--gpu-architecture=sm_{arch}".encode(), b"--std=c++17"]
    res = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    if res != 0:
        raise RuntimeError(f"NVRTC failed:\n{log.value.decode()}")
    if log.value.strip():
        print(f"NVRTC: {log.value.decode().strip()[:500]}")
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
    cubin = ctypes.create_string_buffer(size.value)
    assert lib.nvrtcGetCUBIN(prog, cubin) == 0
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return cubin.raw


def compile_only(args):
    lib = ctypes.CDLL(args.nvrtc)
    for cfg in [(128, 8, 4, 1, 4, 4), (64, 64, 2, 2, 4, 2), (128, 128, 2, 2, 4, 1), (128, 64, 4, 1, 3, 8),
                (64, 8, 4, 1, 4, 4, 1), (128, 128, 8, 1, 4, 1, 1), (64, 256, 4, 1, 4, 2, 1)]:
        cubin = nvrtc_compile(lib, source(cfg, residual=True), "90a" if is_wgmma(cfg) else "90")
        with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
            f.write(cubin)
        usage = ""
        if args.cuobjdump:
            usage = subprocess.run([args.cuobjdump, "-res-usage", f.name], capture_output=True,
                                   text=True).stdout
            usage = " ".join(line.strip() for line in usage.splitlines() if "REG" in line)
            if args.sass:
                sass = subprocess.run([args.cuobjdump, "-sass", f.name], capture_output=True,
                                      text=True).stdout
                print(sass[:args.sass])
        os.unlink(f.name)
        print(config_name(cfg), f"{len(cubin)} bytes", usage)


def nvrtc_torch(cfg, residual: bool):
    """(cubin, kernel name), compiled by the NVRTC library torch loads (its CUDA wheels depend on it)."""
    import torch
    from torch.cuda._utils import _get_gpu_rtc_library
    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}{minor}" + ("a" if is_wgmma(cfg) else "")   # wgmma is sm_90a's
    return nvrtc_compile(_get_gpu_rtc_library(), source(cfg, residual), arch), "nv_gemm"


class Gemm:
    """One compiled configuration, launched through torch's NVRTC loader (torch.cuda._compile_kernel's
    machinery: cuLaunchKernel on the current stream, so CUDA graphs capture it)."""

    def __init__(self, cfg, residual: bool, compiled=None):
        from torch.cuda._utils import _cuda_load_module
        self.cfg, self.residual = cfg, residual
        cubin, name = compiled or nvrtc_torch(cfg, residual)
        self.kernel = _cuda_load_module(cubin, [name])[name]
        self.smem = smem_bytes(cfg)
        self.kernel.set_shared_memory_config(self.smem)

    def dims(self, x, w) -> tuple[tuple[int, int, int], int]:
        """The grid and the threads a CTA for y = x w^T."""
        bn, bm, wn, wm, _, splitk, *_ = self.cfg
        return (w.shape[0] // bn, -(-x.shape[0] // bm), splitk), 32 * wn * wm

    @staticmethod
    def args(x, w, out, r, ws, counters) -> list:
        """nv_gemm's arguments, in its order (r None: no residual; the kernel then never reads it)."""
        return [x, w, out, r if r is not None else out, ws, counters, x.shape[0], w.shape[0], x.shape[1],
                x.stride(0)]

    def __call__(self, x, w, out, r, ws, counters):
        import torch
        grid, threads = self.dims(x, w)
        self.kernel(grid=grid, block=(threads, 1, 1), args=self.args(x, w, out, r, ws, counters),
                    shared_mem=self.smem, stream=torch.cuda.current_stream())


def time_case(weights, m, residual, gemms, ws, counters, graph_ms):
    """cuBLAS's us per GEMM and [(us, config)] of every gemm whose output matches it, fastest first."""
    import torch
    import torch.nn.functional as F
    N, K = weights[0].shape
    x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(m, N, device="cuda", dtype=torch.bfloat16) if residual else None
    out = torch.empty(m, N, device="cuda", dtype=torch.bfloat16)

    def cublas():
        for w in weights:
            if residual:
                torch.addmm(r, x, w.t(), out=out)
            else:
                torch.mm(x, w.t(), out=out)
    ref_us = graph_ms(cublas) * 1000 / LAYERS
    want = F.linear(x, weights[0]).float() + (r.float() if residual else 0)
    results = []
    for gemm in gemms:
        out.zero_()
        gemm(x, weights[0], out, r, ws, counters)
        err = (out.float() - want).abs().max().item()
        if not err <= 0.05 + 0.02 * want.abs().max().item():
            print(f"  M={m} N={N} K={K} {config_name(gemm.cfg)}: WRONG, max error {err:.4f}", flush=True)
            continue

        def ours(gemm=gemm):
            for w in weights:
                gemm(x, w, out, r, ws, counters)
        results.append((graph_ms(ours) * 1000 / LAYERS, config_name(gemm.cfg)))
    results.sort()
    return ref_us, results


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256])
    parser.add_argument("--quick", action="store_true", help="4 stages only")
    parser.add_argument("--wgmma", action="store_true", help="the wgmma (sm_90a) kernel instead of mma.sync")
    parser.add_argument("--top", type=int, default=3, help="configurations shown per case")
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--nvrtc", default="libnvrtc.so")
    parser.add_argument("--cuobjdump", default=None)
    parser.add_argument("--sass", type=int, default=0)
    args = parser.parse_args()
    if args.compile_only:
        return compile_only(args)

    import torch
    from bench_timing import graph_ms

    torch.manual_seed(0)
    dev = "cuda"
    table = []
    keys = {(cfg, residual) for _, N, K, residual in SHAPES for m in args.batches
            for cfg in candidates(m, args.quick, args.wgmma) if valid(cfg, K) and N % cfg[0] == 0}
    torch.cuda.init()
    start = time.perf_counter()
    with ThreadPoolExecutor(os.cpu_count()) as pool:
        cubins = dict(zip(keys, pool.map(lambda key: nvrtc_torch(*key), keys)))
    compiled = {key: Gemm(*key, cubins[key]) for key in keys}
    print(f"{len(keys)} configurations compiled in {time.perf_counter() - start:.1f} s", flush=True)
    ws = torch.empty(8 * 256 * 6144, device=dev, dtype=torch.float32)
    counters = torch.zeros(4096, device=dev, dtype=torch.int32)
    for name, N, K, residual in SHAPES:
        weights = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * K ** -0.5 for _ in range(LAYERS)]
        for m in args.batches:
            cfgs = [cfg for cfg in candidates(m, args.quick, args.wgmma) if valid(cfg, K) and N % cfg[0] == 0]
            ref_us, results = time_case(weights, m, residual, [compiled[(cfg, residual)] for cfg in cfgs],
                                        ws, counters, graph_ms)
            best = results[0] if results else (float("nan"), "-")
            table.append((name, m, ref_us, best[0], best[1]))
            shown = ", ".join(f"{c} {t:.2f}" for t, c in results[:args.top])
            print(f"{name:8s} M={m:4d} cuBLAS {ref_us:6.2f} us  ours best {best[0]:6.2f} "
                  f"({ref_us / best[0]:.2f}x)  [{shown}]", flush=True)
    print("\nshape    M     cuBLAS us  CUDA us  speed-up  config")
    for name, m, ref, best, cfg in table:
        print(f"{name:8s} {m:4d}  {ref:9.2f}  {best:7.2f}  {ref / best:7.2f}x  {cfg}")
    for m in args.batches:
        ref = sum(row[2] for row in table if row[1] == m)
        best = sum(row[3] for row in table if row[1] == m)
        print(f"four GEMMs a layer, M={m}: cuBLAS {ref:.2f} us, CUDA {best:.2f} us ({ref / best:.2f}x)")


if __name__ == "__main__":
    main()
