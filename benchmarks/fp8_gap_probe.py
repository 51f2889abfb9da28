"""Where does the FP8 decode kernel lose at medium batches? It reads half the bf16 kernel's bytes but
takes ~0.7 of its time at b = 32-128. This times, per batch, on bench.py's contexts (100-2048,
longest first, in a CUDA graph), kernels that read the same bytes as the FP8 cache:

  bf16 d128:          the bf16 kernel on the real cache (twice the bytes; its % of copy for reference);
  fp8 d128:           the FP8 kernel on the FP8 cache (the default: 64-token tiles, one warp, transposed);
  bf16 d64:           the bf16 kernel (its default tiles) on a bf16 cache of head_dim 64: FP8's bytes
                      per token, no e4m3 conversion, half the MMAs;
  bf16 d64 as fp8:    the same with FP8's tile shape (64 tokens, one warp, transposed);
  bf16 d64 splits x2: the default tiles with twice the split count.

If bf16 d64 reaches the copy rate and fp8 d128 does not, the e4m3 conversions and the larger dots
cost the difference; if bf16 d64 is as slow, the bytes per token are too few for the loop's
fixed work. Outputs of the head_dim-64 kernels are not checked (a timing stand-in only).

    PYTHONPATH=. python benchmarks/fp8_gap_probe.py [--batches 256 128 64 32 16]
"""
import argparse
import functools

import torch

from bench_kernels import knobs, launch_order
from bench_timing import graph_ms
from fp8_decode_sweep import BLOCK, H, HKV
from nanovllm.kernels import decode_attention
from nanovllm.kernels.decode_attention import choose_num_splits, paged_decode_attention_triton
from nanovllm.kernels.reference import quantize_fp8
from nanovllm.utils import roofline

WIDTH = 16   # block-table width of the engine's graphs (max_model_len 4096 / 256)
NAMES = ["bf16 d128", "fp8 d128", "bf16 d64", "bf16 d64 as fp8", "bf16 d64 splits x2"]


def time_variant(name, lens, tables, order, gen):
    """(ms a call in a CUDA graph, K/V bytes read) of variant `name` on these contexts."""
    batch, blocks = lens.shape[0], tables.numel()
    d = 64 if "d64" in name else 128
    q = torch.randn(batch, H, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(blocks, BLOCK, HKV, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(blocks, BLOCK, HKV, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    scales = {}
    if name.startswith("fp8"):
        one = torch.ones(1, device="cuda")
        k, v, scales = quantize_fp8(k, one), quantize_fp8(v, one), dict(k_scale=one, v_scale=one)
    splits = None
    if name.endswith("x2"):
        splits = 2 * choose_num_splits(batch, HKV, WIDTH * BLOCK, decode_attention.BLOCK_N, q.device)
    settings = dict(BLOCK_N=64, NUM_WARPS=1, TRANSPOSED=True) if name.endswith("as fp8") else {}
    call = functools.partial(paged_decode_attention_triton, q, k, v, tables, lens, d ** -0.5,
                             num_splits=splits, order=order, **scales)
    with knobs(decode_attention, **settings):
        ms = graph_ms(call)
    return ms, int(lens.sum()) * HKV * d * 2 * k.element_size()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[256, 128, 64, 32, 16])
    args = ap.parse_args()
    copy_bw = roofline.measure_copy_bandwidth("cuda")
    print(f"{torch.cuda.get_device_name()}  copy {copy_bw / 1e12:.2f} TB/s; us a call (% of copy)")
    print(f"{'batch':>5} " + " ".join(f"{n:>20s}" for n in NAMES))
    gen = torch.Generator(device="cuda").manual_seed(0)
    for batch in args.batches:
        lens = torch.randint(100, 2049, (batch,), device="cuda", generator=gen, dtype=torch.int32)
        tables = torch.randperm(batch * WIDTH, device="cuda", generator=gen).int().view(batch, WIDTH)
        row = []
        for name in NAMES:
            ms, nbytes = time_variant(name, lens, tables, launch_order(lens), gen)
            row.append(f"{ms * 1e3:9.1f} ({nbytes / (ms * 1e-3) / copy_bw:6.1%})")
        print(f"{batch:5d} " + " ".join(f"{r:>20s}" for r in row), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
