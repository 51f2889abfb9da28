"""The decode split kernel's machine code for the H200 (sm_90), without a GPU: compiles
`_decode_split_kernel` for a config (FP8 or bf16 cache, tile, warps, stages, a register cap) at
Qwen3-0.6B's shapes, with the 16-byte divisibility the engine's pointers and strides have (without
it Triton neither vectorises nor pipelines the loads, and the code is not the one that runs), and
prints registers, spills and the instruction mix of the main loop per warp and per context token.

    PYTHONPATH=. python benchmarks/decode_sass.py [--bf16] [--block-n 128] [--warps 4] [--stages 2]
                                                  [--maxnreg 168] [--head-dim 128] [--dump DIR]
(defaults: the kernel's own, decode_attention.FP8_BLOCK_N x FP8_NUM_WARPS or BLOCK_N x NUM_WARPS)

Needs Triton's bundled ptxas and cuobjdump (any CUDA wheel of triton has them). The main loop is
taken as the largest backward branch's body."""
import argparse
import collections
import os
import re
import subprocess
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanovllm.kernels import decode_attention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 16, 8, 128, 256


def compile_kernel(fp8: bool, block_n: int, warps: int, stages: int, maxnreg: int | None,
                   head_dim: int = HEAD_DIM):
    fn = decode_attention._decode_split_kernel
    kv = "*fp8e4nv" if fp8 else "*bf16"
    sig = dict(q_ptr="*bf16", k_cache_ptr=kv, v_cache_ptr=kv, block_tables_ptr="*i32",
               context_lens_ptr="*i32", order_ptr="*i32", out_ptr="*bf16", part_out_ptr="*fp32",
               part_lse_ptr="*fp32", k_scale_ptr="*fp32", v_scale_ptr="*fp32", scale_log2e="fp32")
    sig.update({name: "i32" for name in ("stride_qb", "stride_qh", "stride_kb", "stride_kt", "stride_kh",
                                         "stride_bt", "stride_ob", "stride_oh", "num_splits")})
    # BLOCK_G as paged_decode_attention_triton pads the group: to 8 for FP8's transposed dots, else 16
    const = dict(GROUP=HEADS // KV_HEADS, BLOCK_G=8 if fp8 else 16, HEAD_DIM=head_dim, BLOCK_D=head_dim,
                 BLOCK_SIZE=BLOCK_SIZE, BLOCK_N=block_n, DIRECT=False, DOT_FP32=False, PRECISION=None,
                 FP8=fp8, V_CVT_ASM=fp8 and block_n * head_dim >= 4 * 32 * warps, INTERPRETED=False,
                 ORDERED=True)
    missing = set(fn.arg_names) - set(sig) - set(const)
    if missing:
        raise SystemExit(f"the kernel has arguments this script does not know: {sorted(missing)}; update it")
    sig.update({name: "constexpr" for name in const})
    index = {name: (fn.arg_names.index(name),) for name in sig}
    aligned = [n for n, t in sig.items() if t.startswith("*") or n.startswith("stride_")]
    src = ASTSource(fn=fn, signature=sig, constexprs={index[k]: v for k, v in const.items()},
                    attrs={index[n]: [["tt.divisibility", 16]] for n in aligned})
    options = dict(num_warps=warps, num_stages=stages)
    if maxnreg:
        options["maxnreg"] = maxnreg
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bf16", action="store_true", help="the bf16 cache's kernel (default: FP8)")
    p.add_argument("--block-n", type=int)
    p.add_argument("--warps", type=int)
    p.add_argument("--stages", type=int)
    p.add_argument("--maxnreg", type=int, help="a register cap (default: none, as the kernel runs)")
    p.add_argument("--head-dim", type=int, default=HEAD_DIM, help="head_dim (Qwen3-0.6B: 128)")
    p.add_argument("--top", type=int, default=16, help="instruction kinds to list")
    p.add_argument("--dump", help="write the kernel's ttgir, ptx and sass here")
    args = p.parse_args()
    fp8 = not args.bf16
    block_n = args.block_n or (decode_attention.FP8_BLOCK_N if fp8 else decode_attention.BLOCK_N)
    warps = args.warps or (decode_attention.FP8_NUM_WARPS if fp8 else decode_attention.NUM_WARPS)
    stages = args.stages or decode_attention.NUM_STAGES
    maxnreg = args.maxnreg
    kernel = compile_kernel(fp8, block_n, warps, stages, maxnreg, args.head_dim)
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    cubin = "/tmp/decode_sass.cubin"
    with open(cubin, "wb") as f:
        f.write(kernel.asm["cubin"])
    usage = subprocess.run([os.path.join(tools, "cuobjdump"), "-res-usage", cubin], capture_output=True,
                           text=True).stdout
    sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", cubin], capture_output=True,
                          text=True).stdout
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
        for ext in ("ttgir", "ptx"):
            with open(os.path.join(args.dump, f"decode.{ext}"), "w") as f:
                f.write(kernel.asm[ext])
        with open(os.path.join(args.dump, "decode.sass"), "w") as f:
            f.write(sass)
    # instructions: (address, opcode); the main loop = the body of the longest backward branch
    address, predicate = r"/\*([0-9a-f]{4,})\*/\s+", r"(?:@!?U?P\w+\s+)?"
    code = [(int(a, 16), op) for a, op in re.findall(address + predicate + r"([A-Z][\w.]*)", sass)]
    branches = re.findall(address + predicate + r"BRA\s+(?:`\()?\.?\w*?\s*0x([0-9a-f]+)", sass)
    back = [(int(t, 16), int(a, 16)) for a, t in branches if int(t, 16) < int(a, 16)]
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    print(f"{'FP8' if fp8 else 'bf16'} cache, head_dim {args.head_dim}, tiles of {block_n} tokens x {warps} "
          f"warps, {stages} stages, register cap {maxnreg}; triton {triton.__version__}, sm_90")
    print(f"registers {regs.group(1) if regs else '?'}, stack (spills) {stack.group(1) if stack else '?'} "
          f"bytes, shared memory {kernel.metadata.shared} bytes")
    if not back:
        print("no loop found in the SASS")
        return
    start, end = max(back, key=lambda b: b[1] - b[0])
    loop = collections.Counter(op.split(".")[0] if not op.startswith(("HMMA", "F2FP", "LDG", "LDS", "STS"))
                               else op for a, op in code if start <= a <= end)
    total = sum(loop.values())
    print(f"main loop: {total} instructions per warp per tile = {total * warps / block_n:.1f} "
          "warp-instructions per context token (per KV head)")
    for op, n in loop.most_common(args.top):
        print(f"  {n:5d}  {op}")


if __name__ == "__main__":
    main()
