"""The physical limit of bench.py's workload for a model config, dense or mixture-of-experts: output
tokens/s if every step ran at the H200's copy bandwidth or its bf16 peak, whichever binds.

    decode step (B live sequences): max(bytes / 4.3 TB/s, flops / 770 TFLOP/s), where
        bytes = the weights the step reads + every live sequence's whole KV cache (its prompt and the
                tokens generated so far), and the weights read are the dense ones (all of them) plus,
                per MoE layer, the experts the batch touches: with B tokens each routed to top_k of E
                experts (uniform routing, as dummy weights give), E * (1 - (1 - top_k / E) ** B) of them
                (for B = 256, top 8 of 128: all 128; for B = 8: about 51)
        flops = B * 2 * (active parameters per token) + attention (4 * context * heads * head_dim per layer)
    prefill: every prompt token's flops at the bf16 peak (2 * active parameters + causal attention)
    TP = n: n GPUs each read 1/n of the weights and the cache and do 1/n of the work: n times one GPU.

The sequences are assumed to decode together from the first step (the whole batch fits the cache).
Run: python benchmarks/moe_limit.py [config folders...] (default: the three configs/)."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import workload

BANDWIDTH, PEAK = 4.3e12, 770e12   # H200: measured device copy bytes/s; bf16 dense tensor-core FLOP/s
DTYPE_BYTES = 2


def shapes(cfg: dict) -> dict:
    hidden, layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    attn = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    sparse = [experts > 0 and i not in (cfg.get("mlp_only_layers") or [])
              and (i + 1) % (cfg.get("decoder_sparse_step") or 1) == 0 for i in range(layers)]
    num_sparse = sum(sparse)
    # per-layer matmul parameters every token uses: attention, dense MLPs, routers
    per_token = layers * attn + (layers - num_sparse) * 3 * hidden * cfg["intermediate_size"] \
        + num_sparse * experts * hidden
    return dict(per_token=per_token, expert=3 * hidden * cfg.get("moe_intermediate_size", 0), experts=experts,
                top_k=cfg.get("num_experts_per_tok", 0), sparse_layers=num_sparse, layers=layers,
                lm_head=vocab * hidden, embeddings=vocab * hidden * (1 if cfg.get("tie_word_embeddings") else 2),
                attn_flops_per_ctx=4 * layers * heads * head_dim,   # q.k and p.v per context token
                kv_bytes_per_token=layers * 2 * kv_heads * head_dim * DTYPE_BYTES)


def limit(cfg: dict) -> dict:
    s = shapes(cfg)
    prompts, params = workload(256, 1024, 1024, 0.6)
    prompt_lens = [len(p) for p in prompts]
    out_lens = [sp.max_tokens for sp in params]
    active = s["per_token"] + s["sparse_layers"] * s["top_k"] * s["expert"]   # matmul params per token
    prefill = sum(2 * active * n + s["attn_flops_per_ctx"] * n * (n + 1) / 2 + 2 * s["lm_head"]
                  for n in prompt_lens) / PEAK
    decode, touched_at_256 = 0.0, None
    for step in range(max(out_lens)):
        ctx = [p + step for p, o in zip(prompt_lens, out_lens) if o > step]
        b = len(ctx)
        touched = s["experts"] * (1 - (1 - s["top_k"] / s["experts"]) ** b) if s["experts"] else 0
        touched_at_256 = touched if touched_at_256 is None else touched_at_256
        weights = s["per_token"] + s["embeddings"] + s["sparse_layers"] * touched * s["expert"]
        bytes_ = weights * DTYPE_BYTES + sum(ctx) * s["kv_bytes_per_token"]
        flops = b * 2 * (active + s["lm_head"]) + s["attn_flops_per_ctx"] * sum(ctx)
        decode += max(bytes_ / BANDWIDTH, flops / PEAK)
    tokens = sum(out_lens)
    all_weights = s["per_token"] + s["embeddings"] + s["sparse_layers"] * s["experts"] * s["expert"]
    return dict(tokens_per_s=tokens / (prefill + decode), decode_only_tokens_per_s=tokens / decode,
                prefill_s=prefill, decode_s=decode, experts_touched_at_batch_256=touched_at_256,
                weights_gb=all_weights * DTYPE_BYTES / 1e9)


def main():
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
    folders = sys.argv[1:] or [os.path.join(root, n) for n in ("qwen3-0.6b", "qwen3-8b", "qwen3-30b-a3b")]
    print(f"{'config':<16} {'weights GB':>10} {'experts@256':>11} {'prefill s':>9} {'decode s':>8} "
          f"{'limit tok/s (TP=1)':>18} {'TP=2':>7}")
    for folder in folders:
        with open(os.path.join(folder, "config.json")) as f:
            r = limit(json.load(f))
        print(f"{os.path.basename(folder):<16} {r['weights_gb']:>10.1f} {r['experts_touched_at_batch_256']:>11.1f} "
              f"{r['prefill_s']:>9.2f} {r['decode_s']:>8.2f} {r['tokens_per_s']:>18,.0f} "
              f"{2 * r['tokens_per_s']:>7,.0f}")


if __name__ == "__main__":
    main()
