"""The Triton prefill attention kernel (kernels/triton_prefill.py) against the torch reference: under
the Triton interpreter on CPU (the `interp_` tests, re-run in a subprocess), and compiled on a GPU
(the `gpu_` tests, at the engine's tiles)."""
import time

import pytest
import torch

from conftest import interp, run_interpreted_tests
from nanovllm.kernels.reference import prefill_attention_ref, quantize_fp8

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def make_case(q_lens, prefixes, num_heads, num_kv_heads, head_dim, page, device, fp8=False, seed=0):
    """Sequences with prefixes[i] keys already in a paged cache and q_lens[i] new queries; the new
    tokens' K/V stored in the cache too, as the engine's store kernel leaves them. Returns the
    prefill_attention arguments (block_tables None when no sequence has a prefix)."""
    gen = torch.Generator().manual_seed(seed)
    k_lens = [p + n for p, n in zip(prefixes, q_lens)]
    blocks_per_seq = [-(-k // page) for k in k_lens]
    num_blocks = sum(blocks_per_seq) + 3
    dtype = torch.bfloat16

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    q = randn(sum(q_lens), num_heads, head_dim)
    k_new, v_new = randn(sum(q_lens), num_kv_heads, head_dim), randn(sum(q_lens), num_kv_heads, head_dim)
    cache_dtype = torch.float8_e4m3fn if fp8 else dtype
    # garbage (NaN) everywhere no key was stored: the kernel must never let it reach an output
    k_cache = torch.full((num_blocks, page, num_kv_heads, head_dim), float("nan")).to(cache_dtype)
    v_cache = k_cache.clone()
    k_scale = v_scale = None
    if fp8:
        k_scale, v_scale = torch.tensor([0.02]), torch.tensor([0.03])
    # shuffled physical blocks, padded with -1 as the runner pads its block tables
    order = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.full((len(q_lens), max(blocks_per_seq)), -1, dtype=torch.int32)
    new_at = 0
    for i, (prefix, k_len) in enumerate(zip(prefixes, k_lens)):
        ids = [order.pop() for _ in range(blocks_per_seq[i])]
        table[i, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
        keys = torch.cat([randn(prefix, num_kv_heads, head_dim), k_new[new_at:new_at + k_len - prefix]])
        values = torch.cat([randn(prefix, num_kv_heads, head_dim), v_new[new_at:new_at + k_len - prefix]])
        new_at += k_len - prefix
        for t in range(k_len):
            b, off = ids[t // page], t % page
            k_cache[b, off] = quantize_fp8(keys[t], k_scale) if fp8 else keys[t]
            v_cache[b, off] = quantize_fp8(values[t], v_scale) if fp8 else values[t]
    cu_q = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + k_lens).cumsum(0).to(torch.int32)
    paged = any(prefixes) or fp8
    args = [q, k_new, v_new, k_cache, v_cache, cu_q, cu_k, max(q_lens), max(k_lens),
            table if paged else None, head_dim ** -0.5]
    args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
    scales = [s.to(device) if s is not None else None for s in (k_scale, v_scale)]
    return args, scales


def check(q_lens, prefixes, num_heads, num_kv_heads, head_dim, page, device, fp8=False, tiles=None, tma=None):
    from nanovllm.kernels.triton_prefill import prefill_attention_triton
    args, (k_scale, v_scale) = make_case(q_lens, prefixes, num_heads, num_kv_heads, head_dim, page, device,
                                         fp8)
    out = prefill_attention_triton(*args, None, k_scale, v_scale, tiles=tiles, tma=tma)
    ref = prefill_attention_ref(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in args],
                                *[s.cpu() if s is not None else None for s in (k_scale, v_scale)])
    # The kernel rounds p to bf16 before p v (as FlashAttention does); the reference keeps fp32.
    diff = (out.float().cpu() - ref.float()).abs()
    assert out.dtype == ref.dtype and not out.isnan().any()
    torch.testing.assert_close(out.float().cpu(), ref.float(), atol=1e-2, rtol=2e-2)
    assert diff.mean() < 3e-3, diff.mean()


def test_triton_prefill_under_interpreter():
    run_interpreted_tests(__file__)


@interp
@pytest.mark.parametrize("q_lens,prefixes", [
    ([5], [0]),                 # one short prompt, one partial query tile
    ([33, 16, 1], [0, 0, 0]),   # several, a one-token prompt, tiles ending exactly on a boundary
    ([20, 7], [32, 45]),        # cached prefixes: a whole page, and one ending mid-page (chunked prefill)
    ([3, 40], [61, 0]),         # a prefix and none in one batch: the keys come from the pages for both
])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (2, 2)])
def test_interp_triton_prefill_matches_reference(q_lens, prefixes, num_heads, num_kv_heads):
    check(q_lens, prefixes, num_heads, num_kv_heads, 32, page=32, device="cpu")


@interp
def test_interp_triton_prefill_reads_an_fp8_cache():
    check([9, 18], [16, 0], 4, 2, 32, page=16, device="cpu", fp8=True)


@interp
@pytest.mark.parametrize("fp8", [False, True])
def test_interp_keys_through_tensor_descriptors(fp8):
    # the TMA path (Hopper's default): keys and values loaded through descriptors, rows past a
    # sequence's end (the next sequence's, or a page's NaN garbage) masked
    check([20, 7, 33], [32, 45, 0], 4, 2, 32, page=16, device="cpu", fp8=fp8, tma=True)


@interp
def test_interp_new_prompts_through_tensor_descriptors():
    # no cached prefix: the step reads only its own k, v (the pages' descriptors are theirs)
    check([20, 7, 33], [0, 0, 0], 4, 2, 32, page=16, device="cpu", tma=True)


@interp
def test_interp_triton_prefill_tiles_wider_than_a_page_never_cross_it():
    from nanovllm.kernels.triton_prefill import tiles_for
    assert tiles_for(128, 16, interpreted=False)[1] == 16   # BLOCK_N shrinks to the page
    assert tiles_for(128, None, interpreted=False, max_seqlen_q=4096)[1] == 128   # no page: as tuned
    check([40], [24], 2, 1, 16, page=16, device="cpu", tiles=(32, 16, 4, 1))


@interp
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_interp_compile_variants_runs_each_tile_once(kv_dtype, monkeypatch):
    from nanovllm.kernels import triton_prefill
    calls, real = [], triton_prefill.prefill_attention_triton
    monkeypatch.setattr(triton_prefill, "prefill_attention_triton",
                        lambda *a, **kw: calls.append((a[7], a[9] is not None)) or real(*a, **kw))
    monkeypatch.setattr(triton_prefill, "PARALLEL_COMPILE", True)   # threads only on CUDA
    wait = triton_prefill.compile_variants(4, 2, 32, 16, torch.bfloat16, kv_dtype, torch.device("cpu"))
    # head_dim 32: new short and long prompts share a tile, so that variant runs once
    assert calls == [(2, False), (2, True)]
    wait()


@pytest.mark.parametrize("forward_max_q,expected", [
    (0, [(2, False), ("long", False), (2, True)]),
    (16384, [(2, False), (2, True)]),        # the warm-up forward compiles the long prompts' variant
    (1000, [("long", False), (2, True)]),    # ... or the short ones'
])
def test_compile_variants_leaves_out_the_forwards_own(forward_max_q, expected, monkeypatch):
    from nanovllm.kernels import triton_prefill
    calls = []
    monkeypatch.setattr(triton_prefill, "prefill_attention_triton",
                        lambda *a, **kw: calls.append((a[7], a[9] is not None)))
    triton_prefill.compile_variants(16, 8, 128, 256, torch.bfloat16, torch.bfloat16, torch.device("cpu"),
                                    forward_max_q)()
    long = triton_prefill.SHORT_PROMPT + 1
    assert calls == [(long if q == "long" else q, paged) for q, paged in expected]


def test_in_threads_runs_every_call_and_raises_the_first_error():
    import threading

    from nanovllm.kernels.common import in_threads
    started, release, done = [], threading.Event(), []

    def call(i):
        started.append(i)
        release.wait(5)
        done.append(i)
    wait = in_threads([lambda i=i: call(i) for i in range(3)], torch.device("cpu"))
    deadline = time.monotonic() + 5
    while len(started) < 3 and time.monotonic() < deadline:   # all three run at once
        time.sleep(0.01)
    assert sorted(started) == [0, 1, 2] and not done
    release.set()
    wait()
    assert sorted(done) == [0, 1, 2]

    def fail():
        raise RuntimeError("compile failed")
    wait = in_threads([lambda: None, fail], torch.device("cpu"))
    with pytest.raises(RuntimeError, match="compile failed"):
        wait()


@GPU
def test_gpu_compile_variants_in_threads(monkeypatch):
    """PARALLEL_COMPILE: each variant runs in a thread of its own, on the engine's device."""
    import threading

    from nanovllm.kernels import triton_prefill
    seen, real = [], triton_prefill.prefill_attention_triton

    def record(*a, **kw):
        seen.append((threading.current_thread().name, torch.cuda.current_device(), a[7], a[9] is not None))
        return real(*a, **kw)
    monkeypatch.setattr(triton_prefill, "prefill_attention_triton", record)
    monkeypatch.setattr(triton_prefill, "PARALLEL_COMPILE", True)
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    wait = triton_prefill.compile_variants(16, 8, 128, 256, torch.bfloat16, torch.bfloat16, device)
    wait()
    torch.cuda.synchronize(device)
    assert sorted(s[2:] for s in seen) == sorted([(2, False), (triton_prefill.SHORT_PROMPT + 1, False),
                                                  (2, True)])
    assert all(name.startswith("nanovllm-compile") and index == device.index for name, index, *_ in seen)


@GPU
@pytest.mark.parametrize("q_lens,prefixes", [
    ([1000, 17, 300], [0, 0, 0]),
    ([700, 1, 2048], [256, 999, 300]),
    ([4096], [4096]),
])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(16, 8, 128), (32, 8, 128), (8, 2, 64)])
@pytest.mark.parametrize("tma", [None, False])   # None: the default (descriptors on Hopper)
def test_gpu_triton_prefill_matches_reference(q_lens, prefixes, num_heads, num_kv_heads, head_dim, tma):
    check(q_lens, prefixes, num_heads, num_kv_heads, head_dim, page=256, device="cuda", tma=tma)


@GPU
@pytest.mark.parametrize("tma", [None, False])
def test_gpu_triton_prefill_reads_an_fp8_cache(tma):
    check([500, 64], [300, 0], 16, 8, 128, page=256, device="cuda", fp8=True, tma=tma)


def test_a_tile_wider_than_the_page_is_refused():
    from nanovllm.kernels.triton_prefill import prefill_attention_triton
    args, scales = make_case([4], [16], 2, 1, 16, page=16, device="cpu")
    with pytest.raises(ValueError, match="must divide the cache page"):
        prefill_attention_triton(*args, None, *scales, tiles=(16, 32, 4, 1))
