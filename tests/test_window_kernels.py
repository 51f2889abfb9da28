"""Sliding windows and logit softcaps in the Triton decode and prefill kernels against the torch
reference, under the Triton interpreter on CPU (the `interp_` tests, re-run in a subprocess)."""
from types import SimpleNamespace

import pytest
import torch
from conftest import interp, run_interpreted_tests
from test_kernels import fp8_paged, make_paged
from test_triton_prefill import make_case

from nanovllm.kernels.reference import paged_decode_attention_ref, prefill_attention_ref
from nanovllm.layers.attention_backend import AttentionBackend
from nanovllm.utils.context import Context


def test_backend_reads_the_layers_fields_and_the_steps_metadata():
    # the engine's prefill kernel for plain layers; a layer with a window or a softcap past it (the
    # FlashAttention wrappers take neither); decode through the paged kernel with the layer's window
    args, _ = make_case([12], [0], 4, 2, 16, 16, "cpu")
    q, k, v, k_cache, v_cache, cu_q, cu_k = args[:7]
    k_cache, v_cache = k_cache.float().nan_to_num(), v_cache.float().nan_to_num()
    q, k, v = q.float(), k.float(), v.float()
    layer = SimpleNamespace(scale=0.25, sliding_window=0, logit_softcap=0.0, k_cache=k_cache, v_cache=v_cache,
                            k_scale=None, v_scale=None)
    meta = Context(is_prefill=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=12, max_seqlen_k=12)
    chosen = AttentionBackend(lambda *a: "the engine's kernel")
    assert chosen.forward(q, k, v, layer, meta) == "the engine's kernel"
    layer.sliding_window, layer.logit_softcap = 4, 1.5
    ref = prefill_attention_ref(q, k, v, None, None, cu_q, cu_k, 12, 12, None, 0.25, window=4, softcap=1.5)
    torch.testing.assert_close(chosen.forward(q, k, v, layer, meta), ref)
    table = torch.arange(k_cache.shape[0], dtype=torch.int32)[None]
    decode = Context(block_tables=table, context_lens=torch.tensor([5], dtype=torch.int32))
    ref = paged_decode_attention_ref(q[:1], k_cache, v_cache, table, decode.context_lens, 0.25, window=4,
                                     softcap=1.5)
    torch.testing.assert_close(chosen.forward(q[:1], None, None, layer, decode), ref)


def test_window_kernels_under_interpreter():
    run_interpreted_tests(__file__)


@interp
@pytest.mark.parametrize("window,softcap", [(5, 0.0), (0, 1.5), (20, 2.0), (1, 0.0)])
@pytest.mark.parametrize("block_size,num_splits,block_n", [(4, 1, 16), (16, 3, 16)])
def test_interp_decode_window_and_softcap(window, softcap, block_size, num_splits, block_n):
    # contexts shorter than, as long as, and several tiles longer than the window; a tile the window
    # starts inside of; more splits than the window's tiles (empty splits)
    from nanovllm.kernels.decode_attention import paged_decode_attention_triton
    lens = [0, 3, 20, 37, 50]
    k_cache, v_cache, tables = make_paged(lens, block_size, num_kv_heads=2, head_dim=16, seed=4)
    ctx = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), 4, 16, generator=torch.Generator().manual_seed(1)) * 3
    masks = dict(window=window, softcap=softcap)
    out = paged_decode_attention_triton(q, k_cache, v_cache, tables, ctx, 0.25, num_splits=num_splits,
                                        block_n=block_n, **masks)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, 0.25, **masks)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[1:], ref[1:], atol=1e-5, rtol=1e-5)


@interp
def test_interp_decode_fp8_window_and_softcap():
    from nanovllm.kernels.decode_attention import paged_decode_attention_triton
    lens = [5, 23, 40]
    k_scale, v_scale = torch.tensor([0.03]), torch.tensor([0.004])
    k8, v8, tables = fp8_paged(lens, 16, 2, 16, k_scale, v_scale, seed=6)
    ctx = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), 4, 16)
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    out = paged_decode_attention_triton(q, k8, v8, tables, ctx, 0.25, block_n=16, window=9, softcap=2.0,
                                        **scales)
    ref = paged_decode_attention_ref(q, k8, v8, tables, ctx, 0.25, k_scale, v_scale, window=9, softcap=2.0)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@interp
@pytest.mark.parametrize("window,softcap", [(8, 0.0), (0, 1.0), (21, 3.0)])
@pytest.mark.parametrize("q_lens,prefixes,fp8", [
    ([33, 16, 1], [0, 0, 0], False),   # new prompts, several windows long
    ([20, 7], [32, 45], False),        # chunks after earlier ones (from the pages) across window edges
    ([9, 18], [16, 0], True),          # an FP8 cache: every key from the pages
])
def test_interp_prefill_window_and_softcap(window, softcap, q_lens, prefixes, fp8):
    from nanovllm.kernels.triton_prefill import prefill_attention_triton
    args, (k_scale, v_scale) = make_case(q_lens, prefixes, 4, 2, 32, 16, "cpu", fp8)
    args[0] = args[0] * 4   # larger scores, so that the softcap bends them
    masks = dict(window=window, softcap=softcap)
    out = prefill_attention_triton(*args, None, k_scale, v_scale, **masks)
    ref = prefill_attention_ref(*args, k_scale, v_scale, **masks)
    assert not out.isnan().any()
    # the kernel rounds p to bf16 before p v (as FlashAttention does); the reference keeps fp32
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
