"""Attention and KV-store kernels on CPU.

The torch references are checked against a naive per-query loop; the Triton kernels run under the
Triton interpreter against the references. TRITON_INTERPRET must be set before the kernel modules are
imported, and other test modules may import them first, so `test_triton_kernels_under_interpreter`
re-runs this file's `interp` tests in a subprocess with the variable set.
"""
import math

import pytest
import torch

from conftest import assert_nearly_equal, interp, run_interpreted_tests
from nanovllm.kernels import (KERNELS, paged_decode_attention, paged_kv_slots, prefill_attention,
                              qk_norm_rope_store, silu_and_mul)
from nanovllm.kernels.flash_prefill import gather_kv_varlen
from nanovllm.kernels.reference import (causal_mask, dequantize_kv, gather_paged_kv,
                                        paged_decode_attention_ref, prefill_attention_ref,
                                        qk_norm_rope_store_ref, quantize_fp8, store_kvcache_ref)
from nanovllm.layers.rotary_embedding import RotaryEmbedding


def naive_attention(q, k, v, scale):
    # q: [q_len, H, D]; k, v: [k_len, Hkv, D]; bottom-right causal, one query and one head at a time
    q_len, num_heads, _ = q.shape
    k_len, num_kv_heads, _ = k.shape
    out = torch.zeros(q.shape, dtype=torch.float64)
    for j in range(q_len):
        visible = k_len - q_len + j + 1
        for h in range(num_heads):
            kv = h // (num_heads // num_kv_heads)
            s = [float(q[j, h].double() @ k[t, kv].double()) * scale for t in range(visible)]
            m = max(s)
            w = [math.exp(x - m) for x in s]
            total = sum(w)
            for t in range(visible):
                out[j, h] += w[t] / total * v[t, kv].double()
    return out


def make_paged(lens, block_size, num_kv_heads, head_dim, seed=0, spare_blocks=3):
    """A shuffled paged cache holding sequences of the given lengths; unused table entries are -1."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [max(1, -(-n // block_size)) for n in lens]
    max_blocks = max(blocks_per_seq) + 1
    num_blocks = sum(blocks_per_seq) + spare_blocks
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(lens), max_blocks), -1, dtype=torch.int32)
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.int32)
    return k_cache, v_cache, tables


# ---- references against the naive loop ----

def test_causal_mask_is_bottom_right_aligned():
    mask = causal_mask(2, 5, "cpu")
    assert mask.tolist() == [[True, True, True, True, False], [True, True, True, True, True]]


def test_store_kvcache_ref_writes_slots_and_skips_padding():
    k_cache = torch.zeros(3, 4, 2, 8)
    v_cache = torch.zeros(3, 4, 2, 8)
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    store_kvcache_ref(key, value, k_cache, v_cache, torch.tensor([9, -1, 0], dtype=torch.int32))
    assert torch.equal(k_cache[2, 1], key[0]) and torch.equal(v_cache[0, 0], value[2])
    assert k_cache.count_nonzero() == 2 * key[0].numel()  # the -1 row went nowhere


@pytest.mark.parametrize("block_size", [4, 16])
def test_decode_ref_matches_naive_with_gqa(block_size):
    lens = [0, 1, 9, 2 * block_size + 1]
    k_cache, v_cache, tables = make_paged(lens, block_size, num_kv_heads=2, head_dim=8)
    q = torch.randn(len(lens), 6, 8)
    out = paged_decode_attention_ref(q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), 0.3)
    assert out.shape == q.shape
    assert torch.equal(out[0], torch.zeros_like(out[0]))  # context 0: zeros, not NaN
    for i, n in enumerate(lens[1:], start=1):
        k = gather_paged_kv(k_cache, tables[i], n)
        v = gather_paged_kv(v_cache, tables[i], n)
        expected = naive_attention(q[i:i + 1], k, v, 0.3)[0]
        torch.testing.assert_close(out[i].double(), expected, atol=1e-5, rtol=1e-5)


def test_prefill_ref_matches_naive_without_cache():
    q_lens = [3, 1, 7]
    cu = torch.tensor([0, 3, 4, 11], dtype=torch.int32)
    q, k, v = torch.randn(11, 4, 8), torch.randn(11, 2, 8), torch.randn(11, 2, 8)
    out = prefill_attention_ref(q, k, v, None, None, cu, cu, 7, 7, None, 0.5)
    for i in range(len(q_lens)):
        lo, hi = cu[i].item(), cu[i + 1].item()
        torch.testing.assert_close(out[lo:hi].double(), naive_attention(q[lo:hi], k[lo:hi], v[lo:hi], 0.5),
                                   atol=1e-5, rtol=1e-5)


def test_prefill_ref_reads_cached_prefix_from_pages():
    block_size, q_lens, k_lens = 4, [2, 5, 1], [9, 5, 4]  # prefix hit, no prefix, chunk ending a block
    k_cache, v_cache, tables = make_paged(k_lens, block_size, num_kv_heads=2, head_dim=8, seed=1)
    cu_q = torch.tensor([0, 2, 7, 8], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 14, 18], dtype=torch.int32)
    q = torch.randn(8, 4, 8)
    new_k = torch.cat([gather_paged_kv(k_cache, tables[i], k_lens[i])[-q_lens[i]:] for i in range(3)])
    new_v = torch.cat([gather_paged_kv(v_cache, tables[i], k_lens[i])[-q_lens[i]:] for i in range(3)])
    out = prefill_attention_ref(q, new_k, new_v, k_cache, v_cache, cu_q, cu_k, 5, 9, tables, 0.5)
    for i in range(3):
        lo, hi = cu_q[i].item(), cu_q[i + 1].item()
        k = gather_paged_kv(k_cache, tables[i], k_lens[i])
        v = gather_paged_kv(v_cache, tables[i], k_lens[i])
        torch.testing.assert_close(out[lo:hi].double(), naive_attention(q[lo:hi], k, v, 0.5),
                                   atol=1e-5, rtol=1e-5)


def test_gather_kv_varlen_concatenates_each_sequence():
    k_lens = [5, 1, 12]
    k_cache, v_cache, tables = make_paged(k_lens, 4, num_kv_heads=2, head_dim=8, seed=2)
    cu_k = torch.tensor([0, 5, 6, 18], dtype=torch.int32)
    k, v = gather_kv_varlen(k_cache, v_cache, paged_kv_slots(tables, cu_k, 18, block_size=4))
    assert torch.equal(k, torch.cat([gather_paged_kv(k_cache, tables[i], n) for i, n in enumerate(k_lens)]))
    assert torch.equal(v, torch.cat([gather_paged_kv(v_cache, tables[i], n) for i, n in enumerate(k_lens)]))


def test_kernels_switch_reads_its_variable_and_the_deprecated_one(caplog):
    from nanovllm.kernels.backend import choose_kernels
    assert choose_kernels({"NANOVLLM_KERNELS": "torch"}) == "torch"
    with pytest.raises(ValueError, match="NANOVLLM_KERNELS='cuda': use one of triton, torch"):
        choose_kernels({"NANOVLLM_KERNELS": "cuda"})
    with caplog.at_level("WARNING", logger="nanovllm.kernels.backend"):
        assert choose_kernels({"NANOVLLM_ATTENTION_BACKEND": "torch"}) == "torch"
    assert [r.getMessage() for r in caplog.records] == [
        "NANOVLLM_ATTENTION_BACKEND is deprecated: set NANOVLLM_KERNELS=torch instead"]
    with pytest.raises(ValueError, match="NANOVLLM_ATTENTION_BACKEND='x'"):
        choose_kernels({"NANOVLLM_ATTENTION_BACKEND": "x"})
    caplog.clear()
    # the new name wins, and then the old one is not read
    assert choose_kernels({"NANOVLLM_KERNELS": "torch", "NANOVLLM_ATTENTION_BACKEND": "x"}) == "torch"
    assert not caplog.records


def test_backend_on_cpu_tensors_is_the_reference():
    assert KERNELS in ("triton", "torch")
    lens = [3, 6]
    k_cache, v_cache, tables = make_paged(lens, 4, num_kv_heads=2, head_dim=8)
    ctx = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(2, 4, 8)
    assert torch.equal(paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.3),
                       paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, 0.3))
    cu = torch.tensor([0, 3, 9], dtype=torch.int32)
    qp, kp, vp = torch.randn(9, 4, 8), torch.randn(9, 2, 8), torch.randn(9, 2, 8)
    assert torch.equal(prefill_attention(qp, kp, vp, k_cache, v_cache, cu, cu, 6, 6, None, 0.3),
                       prefill_attention_ref(qp, kp, vp, k_cache, v_cache, cu, cu, 6, 6, None, 0.3))


def qk_case(num_tokens, num_heads, num_kv_heads, head_dim, dtype=torch.float32, norm=True, seed=0):
    """Arguments of qk_norm_rope_store after head_dim: qkv, weights, eps, cos/sin, positions, slots
    (some -1), and a random paged cache (block size 4) with room to spare."""
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen) * 2).to(dtype)
    weights = [(torch.rand(head_dim, generator=gen) + 0.5).to(dtype) if norm else None for _ in range(2)]
    cos_sin = RotaryEmbedding(head_dim, 4096, 10000.0).cos_sin_cache
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen)
    num_blocks = num_tokens // 4 + 3
    slots = torch.randperm(num_blocks * 4, generator=gen)[:num_tokens].int()
    slots[1::3] = -1
    k_cache = torch.randn(num_blocks, 4, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, 4, num_kv_heads, head_dim, generator=gen).to(dtype)
    return [qkv, *weights, 1e-6, cos_sin, positions, slots, k_cache, v_cache]


def test_qk_norm_rope_store_ref_is_the_layers_path():
    # The reference is the layers' own ops: q/k RMSNorm per head, then rotary, then the store.
    from nanovllm.layers.layernorm import RMSNorm
    qkv, q_w, k_w, eps, cos_sin, positions, slots, k_cache, v_cache = qk_case(6, 4, 2, 16)
    q, k, v = qk_norm_rope_store_ref(qkv, q_w, k_w, eps, cos_sin, positions, slots, k_cache, v_cache,
                                     4, 2, 16)
    norm = RMSNorm(16, eps)
    norm.weight.data = q_w
    q_normed = norm(qkv[:, :64].reshape(-1, 16)).view(6, 4, 16)
    norm.weight.data = k_w
    k_normed = norm(qkv[:, 64:96].reshape(-1, 16)).view(6, 2, 16)
    rope = RotaryEmbedding(16, 4096, 10000.0)
    q_ref, k_ref = rope(positions, q_normed, k_normed)
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref) and torch.equal(v, qkv[:, 96:].view(6, 2, 16))
    keep = slots >= 0
    assert torch.equal(k_cache.view(-1, 2, 16)[slots[keep].long()], k[keep])
    assert torch.equal(v_cache.view(-1, 2, 16)[slots[keep].long()], v[keep])


def test_qk_norm_rope_store_on_cpu_is_the_reference_and_skips_an_empty_cache():
    args = qk_case(5, 4, 2, 16)
    k_ref, v_ref = args[-2].clone(), args[-1].clone()
    q, k, v = qk_norm_rope_store(*args, 4, 2, 16)
    q_ref, kk_ref, _ = qk_norm_rope_store_ref(*args[:-2], k_ref, v_ref, 4, 2, 16)
    assert torch.equal(q, q_ref) and torch.equal(k, kk_ref) and torch.equal(args[-2], k_ref)
    # The warm-up run: no cache bound yet and no slot mapping.
    empty = torch.tensor([])
    q2, k2, _ = qk_norm_rope_store(*args[:6], None, empty, empty, 4, 2, 16)
    assert torch.equal(q2, q) and torch.equal(k2, k)


def test_triton_kernels_under_interpreter():
    run_interpreted_tests(__file__)


# ---- Triton kernels under the interpreter (fp32, tiny shapes) ----

@interp
@pytest.mark.parametrize("block_size,num_splits,block_n",
                         [(4, 1, 16), (4, 3, 16), (16, 2, 16), (16, None, 32)])
def test_interp_decode_matches_reference(block_size, num_splits, block_n):
    # block_size 4 < block_n: a tile spans blocks; 16 % 16 == 0: one block per tile.
    from nanovllm.kernels.decode_attention import paged_decode_attention_triton
    lens = [0, 1, block_size + 1, 3 * block_size - 1]  # empty padding row, one token, block crossings
    k_cache, v_cache, tables = make_paged(lens, block_size, num_kv_heads=2, head_dim=16, seed=3)
    tables[0].fill_(-1)  # a padding row's table may hold anything
    ctx = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), 4, 16)
    out = paged_decode_attention_triton(q, k_cache, v_cache, tables, ctx, 0.25,
                                        num_splits=num_splits, block_n=block_n)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, 0.25)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[1:], ref[1:], atol=1e-5, rtol=1e-5)


def test_choose_num_splits_aims_at_programs_per_sm_and_caps(monkeypatch):
    from nanovllm.kernels import decode_attention as da
    monkeypatch.setattr(da, "num_sms", lambda device: 132)
    monkeypatch.setattr(da, "PROGRAMS_PER_SM", 4)
    cpu = torch.device("cpu")
    # 32 sequences x 8 KV heads = 256 programs a split: 4 a SM (528) needs 3 splits
    assert da.choose_num_splits(32, 8, 4096, 64, cpu) == 3
    assert da.choose_num_splits(256, 8, 4096, 64, cpu) == 1
    # capped by 4 tiles of the longest context the table holds, and by 32
    assert da.choose_num_splits(1, 8, 512, 64, cpu) == 2
    assert da.choose_num_splits(1, 1, 1 << 20, 64, cpu) == 32


@interp
def test_interp_decode_more_splits_than_tiles():
    from nanovllm.kernels.decode_attention import paged_decode_attention_triton
    lens = [2, 20]  # with 8 splits of 16-token tiles most splits are empty
    k_cache, v_cache, tables = make_paged(lens, 4, num_kv_heads=1, head_dim=32, seed=4)
    ctx = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(2, 3, 32)  # 3 query heads on one KV head: a group padded to 16
    out = paged_decode_attention_triton(q, k_cache, v_cache, tables, ctx, 0.2, num_splits=8, block_n=16)
    torch.testing.assert_close(out, paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, 0.2),
                               atol=1e-5, rtol=1e-5)


@interp
@pytest.mark.parametrize("fp8", [False, True])
def test_interp_decode_launch_order_changes_nothing_but_the_order(fp8):
    # order: the rows in the order their programs start (the engine's: longest context first). Every
    # row must still get its own attention, exactly as without an order.
    from nanovllm.kernels.decode_attention import paged_decode_attention_triton
    lens = [3, 0, 37, 12, 20]
    scales = dict(k_scale=torch.tensor([0.03]), v_scale=torch.tensor([0.004])) if fp8 else {}
    if fp8:
        k_cache, v_cache, tables = fp8_paged(lens, 8, 2, 16, scales["k_scale"], scales["v_scale"], seed=8)
    else:
        k_cache, v_cache, tables = make_paged(lens, 8, num_kv_heads=2, head_dim=16, seed=8)
    ctx = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), 4, 16)
    order = torch.tensor([2, 4, 3, 0, 1], dtype=torch.int32)
    for splits in (1, 2):
        plain = paged_decode_attention_triton(q, k_cache, v_cache, tables, ctx, 0.25, num_splits=splits,
                                              block_n=16, **scales)
        ordered = paged_decode_attention_triton(q, k_cache, v_cache, tables, ctx, 0.25, num_splits=splits,
                                                block_n=16, order=order, **scales)
        assert torch.equal(ordered, plain)
        ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, 0.25, *scales.values())
        torch.testing.assert_close(ordered[ctx > 0], ref[ctx > 0], atol=1e-5, rtol=1e-5)


@interp
@pytest.mark.parametrize("block_size", [4, 16])
def test_interp_decode_head_dim_below_16_is_padded(block_size):
    # tl.dot needs K >= 16: a head_dim of 8 (tiny test models) runs on a padded, masked tile (FP8's
    # whole tiles, loaded without a token mask, too: the FP8 test over group sizes and head dims).
    from nanovllm.kernels.decode_attention import paged_decode_attention_triton
    lens = [5, 40]
    k_cache, v_cache, tables = make_paged(lens, block_size, num_kv_heads=2, head_dim=8, seed=5)
    ctx = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(2, 2, 8)
    out = paged_decode_attention_triton(q, k_cache, v_cache, tables, ctx, 0.3, num_splits=2, block_n=16)
    torch.testing.assert_close(out, paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, 0.3),
                               atol=1e-5, rtol=1e-5)


def check_qk_norm_rope_store(args, num_heads, num_kv_heads, head_dim, **scale_rows):
    """The Triton kernel against the reference: outputs, and the cache written exactly at the
    slots of the rows that are not -1, untouched elsewhere. scale_rows: norm_of, norm_eps."""
    from nanovllm.kernels.qk_norm_rope import qk_norm_rope_store_triton
    *inputs, k_cache, v_cache = args
    slots = inputs[6]
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    q_ref, kk_ref, v_view_ref = qk_norm_rope_store_ref(*inputs, k_ref, v_ref, num_heads, num_kv_heads,
                                                       head_dim, **scale_rows)
    k_out, v_out = k_cache.clone(), v_cache.clone()
    q, k, v = qk_norm_rope_store_triton(*inputs, k_out, v_out, num_heads, num_kv_heads, head_dim,
                                        **scale_rows)
    assert q.shape == (len(slots), num_heads, head_dim) and k.shape == (len(slots), num_kv_heads, head_dim)
    assert_nearly_equal(q, q_ref)
    assert_nearly_equal(k, kk_ref)
    if scale_rows:   # v scaled by rstd: its own tensor, rounded as the reference rounds it
        assert_nearly_equal(v, v_view_ref)
        assert_nearly_equal(v_out, v_ref)
        return
    assert torch.equal(v, v_view_ref)
    written = torch.zeros(k_cache.shape[0] * k_cache.shape[1], dtype=torch.bool)
    written[slots[slots >= 0].long()] = True
    flat = lambda c: c.view(-1, num_kv_heads, head_dim)  # noqa: E731
    assert torch.equal(flat(k_out)[~written], flat(k_cache)[~written])
    assert torch.equal(flat(v_out)[~written], flat(v_cache)[~written])
    assert torch.equal(flat(k_out)[slots[slots >= 0].long()], k[slots >= 0])   # the kernel's own k, exactly
    assert_nearly_equal(k_out, k_ref)
    assert torch.equal(v_out, v_ref)


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("num_tokens,num_heads,num_kv_heads", [(3, 4, 2), (40, 4, 2), (9, 2, 2)])
def test_interp_qk_norm_rope_store_matches_reference(dtype, norm, num_tokens, num_heads, num_kv_heads):
    # decode-like and prefill-like token counts; GQA and as many KV heads as query heads
    args = qk_case(num_tokens, num_heads, num_kv_heads, 16, dtype, norm)
    check_qk_norm_rope_store(args, num_heads, num_kv_heads, 16)


@interp
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(3, 1, 24), (2, 1, 8), (4, 2, 128)])
def test_interp_qk_norm_rope_store_odd_shapes(num_heads, num_kv_heads, head_dim):
    # head counts and half head_dims that are not powers of two fill a masked tile; Qwen3's head_dim
    check_qk_norm_rope_store(qk_case(5, num_heads, num_kv_heads, head_dim, torch.bfloat16, seed=1),
                             num_heads, num_kv_heads, head_dim)


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [True, False])
def test_interp_qk_norm_rope_store_scales_rows_by_the_folded_norms_rstd(dtype, norm):
    # norm_of: the input RMSNorm folded into qkv_proj; q, k and v times rstd(norm_of) first.
    args = qk_case(7, 4, 2, 16, dtype, norm)
    h = (torch.randn(7, 24, generator=torch.Generator().manual_seed(2)) * 30).to(dtype)   # hidden 24
    check_qk_norm_rope_store(args, 4, 2, 16, norm_of=h, norm_eps=1e-6)


@interp
# fp8_scales: an FP8 GEMM's row / column scales applied first (bf16 only, as fp8_linear_unscaled leaves them)
@pytest.mark.parametrize("dtype,fp8_scales", [(torch.float32, False), (torch.bfloat16, False),
                                              (torch.bfloat16, True)])
@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("min_block", [1024, 16])   # 16: several column blocks a row (32 scaled)
@pytest.mark.parametrize("whole_rows", [False, True])   # True: a program walks its row's blocks
def test_interp_silu_and_mul_matches_reference(dtype, scaled, min_block, whole_rows, fp8_scales, monkeypatch):
    from nanovllm.kernels import norm_act
    from nanovllm.kernels.norm_act import silu_and_mul_triton
    from nanovllm.kernels.reference import silu_and_mul_ref
    monkeypatch.setattr(norm_act, "SILU_BLOCK", min_block)
    monkeypatch.setattr(norm_act, "SILU_WHOLE_ROWS", 0 if whole_rows else 1 << 30)
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(5, 2 * 40, generator=g) * 3).to(dtype)
    scale_rows = dict(norm_of=(torch.randn(5, 24, generator=g) * 20).to(dtype), eps=1e-6) if scaled else {}
    if fp8_scales:   # x the unscaled product; the reference takes it scaled as fp8_gemm.scale_out does
        from nanovllm.kernels.fp8_gemm import scale_out
        scales = torch.rand(5, 1, generator=g) / 50, torch.rand(80, generator=g) / 50
        out = silu_and_mul_triton(x, fp8_scales=scales, **scale_rows)
        assert_nearly_equal(out, silu_and_mul(x, fp8_scales=scales, **scale_rows))   # the CPU path
        x = scale_out(x.clone(), *scales, None)
        assert torch.equal(out, silu_and_mul_triton(x, **scale_rows))   # the fused pass is the two passes
    else:
        out = silu_and_mul_triton(x, **scale_rows)
    assert out.shape == (5, 40)
    assert_nearly_equal(out, silu_and_mul_ref(x, **scale_rows))


@interp
def test_interp_qk_norm_rope_store_without_a_cache():
    # The warm-up run binds no cache: nothing is stored, slot_mapping may be None.
    from nanovllm.kernels.qk_norm_rope import qk_norm_rope_store_triton
    args = qk_case(4, 4, 2, 16)
    q_ref, k_ref, _ = qk_norm_rope_store_ref(*args, 4, 2, 16)
    empty = torch.tensor([])
    q, k, v = qk_norm_rope_store_triton(*args[:6], None, empty, empty, 4, 2, 16)
    assert_nearly_equal(q, q_ref)
    assert_nearly_equal(k, k_ref)


# ---- FP8 KV cache (e4m3 with a per-layer K and V scale) ----

def fp8_paged(lens, block_size, num_kv_heads, head_dim, k_scale, v_scale, seed=0):
    """make_paged's cache quantized to FP8 with the given scales ([1] fp32 tensors)."""
    k_cache, v_cache, tables = make_paged(lens, block_size, num_kv_heads, head_dim, seed=seed)
    return quantize_fp8(k_cache * 3, k_scale), quantize_fp8(v_cache, v_scale), tables


def test_quantize_fp8_divides_saturates_and_rounds_to_nearest_even():
    x = torch.tensor([500.0, -1e4, 1.0625, 1.1875, 0.003, -0.0001, 0.0, 3.0])
    q = quantize_fp8(x, None).float()
    # 1.0625 lies halfway between 1.0 and 1.125 (ties to the even mantissa); 0.003 is a subnormal
    # (multiples of 2^-9); a tiny negative rounds to -0.
    assert q.tolist() == [448.0, -448.0, 1.0, 1.25, 2 ** -8, -0.0, 0.0, 3.0]
    # x / 2: 250 rounds to 256 (steps of 16 there)
    assert quantize_fp8(x, torch.tensor([2.0])).float().tolist()[:4] == [256.0, -448.0, 0.5, 0.625]
    # dequantize_kv multiplies back; other dtypes pass through untouched
    scale = torch.tensor([0.25])
    assert torch.equal(dequantize_kv(quantize_fp8(x, scale), scale), quantize_fp8(x, scale).float() * 0.25)
    assert dequantize_kv(x, scale) is x


def test_store_kvcache_ref_fp8_quantizes_with_the_scales():
    k_cache = torch.zeros(3, 4, 2, 8, dtype=torch.float8_e4m3fn)
    v_cache = torch.zeros_like(k_cache)
    gen = torch.Generator().manual_seed(0)
    # |key| / k_scale below e4m3's 448 (saturated values are not within 1/16 of themselves)
    key, value = torch.randn(3, 2, 8, generator=gen).clamp(-2, 2) * 10, torch.randn(3, 2, 8, generator=gen)
    k_scale, v_scale = torch.tensor([0.05]), torch.tensor([0.01])
    slots = torch.tensor([9, -1, 0], dtype=torch.int32)
    store_kvcache_ref(key, value, k_cache, v_cache, slots, k_scale, v_scale)
    assert torch.equal(k_cache[2, 1].float(), quantize_fp8(key[0], k_scale).float())
    assert torch.equal(v_cache[0, 0].float(), quantize_fp8(value[2], v_scale).float())
    # e4m3 keeps 3 mantissa bits: a stored value is within 1/16 of itself (relative), subnormals aside
    torch.testing.assert_close(dequantize_kv(k_cache[2, 1], k_scale), key[0], rtol=1 / 16,
                               atol=2 ** -9 * 0.05)
    assert k_cache.float().count_nonzero() <= 2 * key[0].numel()


def test_decode_and_prefill_refs_read_fp8_as_the_dequantized_cache():
    lens = [3, 9, 21]
    k_scale, v_scale = torch.tensor([0.02]), torch.tensor([0.005])
    k8, v8, tables = fp8_paged(lens, 4, 2, 8, k_scale, v_scale)
    k_deq, v_deq = dequantize_kv(k8, k_scale), dequantize_kv(v8, v_scale)
    ctx = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(3, 4, 8)
    assert torch.equal(paged_decode_attention_ref(q, k8, v8, tables, ctx, 0.3, k_scale, v_scale),
                       paged_decode_attention_ref(q, k_deq, v_deq, tables, ctx, 0.3))
    cu_q = torch.tensor([0, 1, 3, 7], dtype=torch.int32)
    cu_k = torch.tensor([0, 3, 12, 33], dtype=torch.int32)
    qp, new = torch.randn(7, 4, 8), torch.randn(7, 2, 8)   # new k, v: ignored when block_tables are given
    fp8 = prefill_attention_ref(qp, new, new, k8, v8, cu_q, cu_k, 4, 21, tables, 0.3, k_scale, v_scale)
    assert torch.equal(fp8, prefill_attention_ref(qp, new, new, k_deq, v_deq, cu_q, cu_k, 4, 21, tables, 0.3))


@interp
@pytest.mark.parametrize("block_size,num_splits,block_n", [(4, 1, 16), (16, 2, 32), (16, None, 16)])
def test_interp_decode_fp8_matches_reference(block_size, num_splits, block_n):
    # FP8's loop: whole tiles without masks, then the partial one; the dots transposed.
    from nanovllm.kernels.decode_attention import paged_decode_attention_triton
    lens = [0, 1, block_size + 1, 3 * block_size - 1]
    k_scale, v_scale = torch.tensor([0.03]), torch.tensor([0.004])
    k8, v8, tables = fp8_paged(lens, block_size, 2, 16, k_scale, v_scale, seed=6)
    ctx = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), 4, 16)
    out = paged_decode_attention_triton(q, k8, v8, tables, ctx, 0.25, num_splits=num_splits, block_n=block_n,
                                        k_scale=k_scale, v_scale=v_scale)
    ref = paged_decode_attention_ref(q, k8, v8, tables, ctx, 0.25, k_scale, v_scale)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[1:], ref[1:], atol=1e-5, rtol=1e-5)


@interp
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(3, 3, 16), (6, 2, 24), (16, 2, 8), (16, 1, 16)])
def test_interp_decode_fp8_default_over_group_sizes_and_head_dims(heads, kv_heads, head_dim):
    # FP8's transposed dots (the group's query heads as the dots' N, padded to 8 or more) at groups
    # of 1, 3, 8 and 16 query heads a KV head and head_dims that need padding, with bf16 queries
    # (fp16 dots, as on the GPU), against the reference.
    from nanovllm.kernels.decode_attention import paged_decode_attention_triton
    lens = [0, 5, 23, 40]
    k_scale, v_scale = torch.tensor([0.02]), torch.tensor([0.006])
    k8, v8, tables = fp8_paged(lens, 16, kv_heads, head_dim, k_scale, v_scale, seed=11)
    ctx = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), heads, head_dim).bfloat16()
    for num_splits in (1, 2):
        out = paged_decode_attention_triton(q, k8, v8, tables, ctx, head_dim ** -0.5, num_splits=num_splits,
                                            block_n=16, k_scale=k_scale, v_scale=v_scale)
        ref = paged_decode_attention_ref(q.float(), k8, v8, tables, ctx, head_dim ** -0.5, k_scale, v_scale)
        assert torch.isfinite(out.float()).all()
        torch.testing.assert_close(out[1:].float(), ref[1:], atol=2e-2, rtol=2e-2)


@interp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_interp_gather_dequantize_kv_is_gather_then_dequantize(dtype):
    # The FP8 prefill's gather: one kernel, the reference's numbers (fp32 product, one rounding).
    from nanovllm.kernels.flash_prefill import gather_dequantize_kv
    k_lens = [5, 1, 12]   # 18 rows: not a whole number of the kernel's 4-row tiles
    k_scale, v_scale = torch.tensor([0.03]), torch.tensor([0.004])
    k8, v8, tables = fp8_paged(k_lens, 4, 2, 8, k_scale, v_scale, seed=9)
    slots = paged_kv_slots(tables, torch.tensor([0, 5, 6, 18], dtype=torch.int32), 18, block_size=4)
    k, v = gather_dequantize_kv(k8, v8, slots, k_scale, v_scale, dtype)
    k_ref, v_ref = gather_kv_varlen(k8, v8, slots)
    assert k.dtype == v.dtype == dtype
    assert torch.equal(k, dequantize_kv(k_ref, k_scale).to(dtype))
    assert torch.equal(v, dequantize_kv(v_ref, v_scale).to(dtype))


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.005, 0.004)])   # the small scales saturate some values
def test_interp_qk_norm_rope_store_fp8_quantizes_like_the_reference(dtype, scales):
    from nanovllm.kernels.qk_norm_rope import qk_norm_rope_store_triton
    *inputs, k_cache, v_cache = qk_case(40, 4, 2, 16, dtype, seed=2)
    slots = inputs[6]
    k_scale, v_scale = torch.tensor([scales[0]]), torch.tensor([scales[1]])
    k8 = quantize_fp8(k_cache, k_scale)
    v8 = quantize_fp8(v_cache, v_scale)
    k_ref, v_ref = k8.clone(), v8.clone()
    q_ref, kk_ref, _ = qk_norm_rope_store_ref(*inputs, k_ref, v_ref, 4, 2, 16, k_scale, v_scale)
    k_out, v_out = k8.clone(), v8.clone()
    q, k, v = qk_norm_rope_store_triton(*inputs, k_out, v_out, 4, 2, 16, k_scale, v_scale)
    assert_nearly_equal(q, q_ref)
    assert_nearly_equal(k, kk_ref)
    keep = slots >= 0
    rows = slots[keep].long()
    bits = lambda c: c.view(torch.uint8).view(-1, 2, 16)  # noqa: E731
    # The kernel's quantization is the reference's, bit for bit, on the kernel's own k and v ...
    assert torch.equal(bits(k_out)[rows], quantize_fp8(k[keep], k_scale).view(torch.uint8))
    assert torch.equal(bits(v_out)[rows], quantize_fp8(v[keep], v_scale).view(torch.uint8))
    assert torch.equal(bits(v_out), bits(v_ref))
    # ... every other row is untouched, and the stored keys are the reference's (bf16 k may differ
    # from it by one bf16 ulp on a few values, which can move an fp8 value by one step).
    written = torch.zeros(k8.shape[0] * k8.shape[1], dtype=torch.bool)
    written[rows] = True
    assert torch.equal(bits(k_out)[~written], bits(k8)[~written])
    differ = bits(k_out) != bits(k_ref)
    assert differ.float().mean() <= 0.01
    torch.testing.assert_close(k_out.float(), k_ref.float(), rtol=1 / 8, atol=2 ** -9)
    if scales[0] < 1:   # saturated, not NaN
        assert (k_out.float().abs() == 448).any() and (v_out.float().abs() == 448).any()
        assert not k_out.float().isnan().any() and not v_out.float().isnan().any()


@interp
def test_interp_decode_fp8_with_bf16_queries_runs_fp16_dots():
    # The GPU's FP8 path: bf16 queries, K/V tiles converted to fp16 (the interpreter's tl.dot is
    # right on fp16, unlike bf16); the output is bf16, so within a bf16 rounding of the reference.
    from nanovllm.kernels.decode_attention import paged_decode_attention_triton
    lens = [1, 17, 47]
    k_scale, v_scale = torch.tensor([0.03]), torch.tensor([0.004])
    k8, v8, tables = fp8_paged(lens, 16, 2, 16, k_scale, v_scale, seed=7)
    ctx = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(3, 4, 16).bfloat16()
    out = paged_decode_attention_triton(q, k8, v8, tables, ctx, 0.25, num_splits=2, block_n=16,
                                        k_scale=k_scale, v_scale=v_scale)
    ref = paged_decode_attention_ref(q.float(), k8, v8, tables, ctx, 0.25, k_scale, v_scale)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)
