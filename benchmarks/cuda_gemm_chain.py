"""Does programmatic dependent launch (PDL) take the fixed cost out of a chain of decode GEMMs?

cuda_gemm_probe.py's kernel issues the weight tiles of its first STAGES - 1 stages before
`griddepcontrol.wait` and calls `griddepcontrol.launch_dependents` right after it. Launched with
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (cuLaunchKernelEx), the next GEMM of the chain
starts while this one computes and its weights stream in before its input exists; launched
without it, the wait returns at once and the kernels run one after another as usual.

The chain is Qwen3-0.6B's four GEMMs a layer with their data dependencies (qkv; o on the first 2,048
columns of qkv plus the residual; gate_up; down on the first 3,072 columns of gate_up plus the
residual), 28 layers with distinct weights (cold in L2) in one CUDA graph, us a layer:
cuBLAS (mm / addmm), the CUDA kernels without PDL, with PDL, and with PDL and deeper rings (every
weight tile of a CTA in flight before the wait where shared memory allows). The configurations are
cuda_gemm_probe.py's fastest per shape and batch on the H200 (profiles/2026-12-02_cuda_gemm_probe.txt).
The PDL and plain chains must agree bit for bit, and both with cuBLAS's to a relative 2%.

    PYTHONPATH=. python benchmarks/cuda_gemm_chain.py [--batches 8 32 64 128 256]
"""
import argparse
import ctypes

import torch

from bench_timing import graph_ms
from cuda_gemm_probe import LAYERS, SHAPES, Gemm

BEST = {  # (BN, BM, WARPS_N, WARPS_M, STAGES, SPLITK) for qkv, o, gate_up, down
    8: [(64, 8, 4, 1, 4, 4), (64, 8, 4, 1, 4, 8), (64, 8, 4, 1, 4, 4), (64, 8, 4, 1, 4, 8)],
    32: [(64, 8, 4, 1, 4, 2), (128, 8, 8, 1, 4, 8), (64, 32, 4, 2, 4, 4), (128, 8, 8, 1, 4, 8)],
    64: [(64, 64, 4, 2, 4, 1), (64, 64, 4, 2, 4, 8), (64, 64, 4, 2, 4, 1), (64, 64, 4, 2, 4, 8)],
    128: [(64, 64, 4, 2, 4, 1), (64, 64, 4, 2, 4, 4), (64, 64, 2, 2, 4, 1), (64, 64, 4, 2, 4, 4)],
    256: [(64, 64, 4, 2, 4, 1), (64, 64, 4, 2, 4, 4), (64, 64, 2, 2, 4, 1), (64, 64, 4, 2, 4, 4)],
}


class LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class LaunchConfig(ctypes.Structure):
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_mem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


PROGRAMMATIC_STREAM_SERIALIZATION = 6
_PDL = LaunchAttribute(PROGRAMMATIC_STREAM_SERIALIZATION, b"", b"\x01")


def launch(gemm, pdl, x, w, out, r, ws, counters):
    """gemm's kernel through cuLaunchKernelEx, with the PDL attribute when pdl."""
    from torch.cuda._utils import _get_gpu_runtime_library
    (gx, gy, gz), threads = gemm.dims(x, w)
    values = [ctypes.c_void_p(a.data_ptr()) if isinstance(a, torch.Tensor) else ctypes.c_int(a)
              for a in gemm.args(x, w, out, r, ws, counters)]
    params = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values])
    config = LaunchConfig(gx, gy, gz, threads, 1, 1, gemm.smem, torch.cuda.current_stream().cuda_stream,
                          ctypes.pointer(_PDL), 1 if pdl else 0)
    res = _get_gpu_runtime_library().cuLaunchKernelEx(ctypes.byref(config), gemm.kernel.func, params, None)
    if res != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed: CUDA error {res}")


def deepen(cfg, K):
    """cfg with a ring deep enough for all of a CTA's K tiles (at most 8 stages)."""
    bn, bm, wn, wm, _, splitk, *rest = cfg
    return (bn, bm, wn, wm, min(8, K // splitk // 64 + 1), splitk, *rest)


def run_batch(m, weights, ws, counters):
    """us a layer by arm, and the CUDA chain's relative difference from cuBLAS's, at batch m."""
    dev = "cuda"
    h0 = torch.randn(m, 1024, device=dev, dtype=torch.bfloat16)
    h, h1 = torch.empty_like(h0), torch.empty_like(h0)
    qkv = torch.empty(m, 4096, device=dev, dtype=torch.bfloat16)
    gu = torch.empty(m, 6144, device=dev, dtype=torch.bfloat16)

    def cublas():
        h.copy_(h0)
        for wq, wo, wg, wd in zip(*weights):
            torch.mm(h, wq.t(), out=qkv)
            torch.addmm(h, qkv[:, :2048], wo.t(), out=h1)
            torch.mm(h1, wg.t(), out=gu)
            torch.addmm(h1, gu[:, :3072], wd.t(), out=h)

    def chain(gemms, pdl):
        def run():
            h.copy_(h0)
            for wq, wo, wg, wd in zip(*weights):
                launch(gemms[0], pdl, h, wq, qkv, None, ws, counters)
                launch(gemms[1], pdl, qkv[:, :2048], wo, h1, h, ws, counters)
                launch(gemms[2], pdl, h1, wg, gu, None, ws, counters)
                launch(gemms[3], pdl, gu[:, :3072], wd, h, h1, ws, counters)
        return run

    plain = [Gemm(cfg, residual) for cfg, (_, _, _, residual) in zip(BEST[m], SHAPES)]
    deep = [Gemm(deepen(cfg, K), residual) for cfg, (_, _, K, residual) in zip(BEST[m], SHAPES)]
    arms = {"cuBLAS": cublas, "CUDA": chain(plain, False), "CUDA+PDL": chain(plain, True),
            "CUDA+PDL deep": chain(deep, True)}
    outs = {}
    for name, fn in arms.items():
        fn()
        torch.cuda.synchronize()
        outs[name] = h.float().clone()
    ref = outs["cuBLAS"]
    for name in ("CUDA+PDL", "CUDA+PDL deep"):
        if not torch.equal(outs[name], outs["CUDA"]):
            print(f"M={m} {name}: differs from CUDA without PDL by "
                  f"{(outs[name] - outs['CUDA']).abs().max().item():.3g}")
    rel = ((outs["CUDA"] - ref).norm() / ref.norm()).item()
    if not rel < 0.02:
        print(f"M={m}: the CUDA chain differs from cuBLAS's by a relative {rel:.3g}")
    us = {name: graph_ms(fn, calls=3) * 1000 / LAYERS for name, fn in arms.items()}
    return us, rel


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=sorted(BEST))
    args = parser.parse_args()
    torch.manual_seed(0)
    dev = "cuda"
    weights = [[torch.randn(N, K, device=dev, dtype=torch.bfloat16) * (0.5 * K ** -0.5)
                for _ in range(LAYERS)] for _, N, K, _ in SHAPES]
    ws = torch.empty(8 * 256 * 6144, device=dev, dtype=torch.float32)
    counters = torch.zeros(4096, device=dev, dtype=torch.int32)
    rows = []
    for m in args.batches:
        us, rel = run_batch(m, weights, ws, counters)
        rows.append((m, us, rel))
        print(f"M={m:4d} " + "  ".join(f"{k} {v:6.2f}" for k, v in us.items()) + f"  (rel. diff {rel:.1e})",
              flush=True)
    print("\nus a layer (four GEMMs), 28 layers in one graph")
    print("   M   cuBLAS    CUDA  CUDA+PDL  PDL deep  best/cuBLAS")
    for m, us, _ in rows:
        best = min(us["CUDA"], us["CUDA+PDL"], us["CUDA+PDL deep"])
        print(f"{m:4d}  {us['cuBLAS']:7.2f} {us['CUDA']:7.2f}  {us['CUDA+PDL']:8.2f}  "
              f"{us['CUDA+PDL deep']:8.2f}  {us['cuBLAS'] / best:10.2f}x")


if __name__ == "__main__":
    main()
