"""What a hybrid linear-attention decoder (Qwen3.5 / Qwen3.6, Qwen3-Next) brings to the roofline's
count (utils/roofline.py), read from its HF config.json as a dict: which of its layers are Gated
DeltaNet layers, and for those layers their weights, the FLOPs of their delta rule and the state each
sequence keeps. The sizes are those nanovllm builds (layers/gated_deltanet.py, gated_attention.py)."""
from dataclasses import dataclass

CONV_STATE_BYTES = 2        # the conv state is kept in the model's dtype (bf16)
RECURRENT_STATE_BYTES = 4   # the recurrent state in fp32, as fla-core keeps it
LINEAR_SIZES = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                "linear_value_head_dim", "linear_conv_kernel_dim")


def decoder_config(config: dict) -> dict:
    """The decoder's part of a config.json: a multimodal checkpoint's text_config (nanovllm builds its
    text model from it, utils/text_config.py), else the config itself."""
    text = config.get("text_config")
    return text if isinstance(text, dict) and "hidden_size" not in config else config


def layer_kinds(config: dict) -> list[str]:
    """Each layer's layer_types entry; a config with linear-attention sizes but no layer_types gets
    transformers' default (every full_attention_interval-th layer full attention, the rest linear)."""
    kinds = config.get("layer_types")
    if kinds is None and "linear_num_value_heads" in config:
        interval = config.get("full_attention_interval") or 4
        kinds = ["linear_attention" if (i + 1) % interval else "full_attention"
                 for i in range(config["num_hidden_layers"])]
    return list(kinds or ["full_attention"] * config["num_hidden_layers"])


@dataclass(frozen=True)
class LinearAttentionShapes:
    """One Gated DeltaNet layer."""
    params: int           # in_proj_qkvz, in_proj_ba, conv1d, A_log, dt_bias, the gated norm, out_proj
    flops_per_token: int  # the delta rule's, beyond 2 per weight (the conv is a weight's 2 per token)
    state_bytes: int      # one sequence's conv state and recurrent state


def linear_attention_shapes(config: dict) -> LinearAttentionShapes:
    missing = [k for k in LINEAR_SIZES if k not in config]
    if missing:
        raise ValueError(f"the model config has linear_attention layers but lacks {', '.join(missing)}: "
                         "pass the model's own config.json")
    hidden = config["hidden_size"]
    k_heads, v_heads = config["linear_num_key_heads"], config["linear_num_value_heads"]
    k_dim, v_dim, kernel = (config["linear_key_head_dim"], config["linear_value_head_dim"],
                            config["linear_conv_kernel_dim"])
    key, value = k_heads * k_dim, v_heads * v_dim
    conv_channels = 2 * key + value   # q | k | v go through the conv, z does not
    params = (hidden * (2 * key + 2 * value)   # in_proj_qkvz
              + hidden * 2 * v_heads            # in_proj_ba
              + conv_channels * kernel          # conv1d
              + 2 * v_heads + v_dim             # A_log, dt_bias, the gated RMSNorm
              + value * hidden)                 # out_proj
    # Per token and value head, three products with the [k_dim, v_dim] state (S^T k, the rank-one
    # update, S^T q), 2 FLOPs per state value each.
    flops = 3 * 2 * v_heads * k_dim * v_dim
    state = (conv_channels * (kernel - 1) * CONV_STATE_BYTES
             + v_heads * k_dim * v_dim * RECURRENT_STATE_BYTES)
    return LinearAttentionShapes(params, flops, state)


def shared_expert_params(config: dict) -> int:
    """A mixture-of-experts layer's shared expert (gate, up, down) and its sigmoid gate; 0 without."""
    shared = config.get("shared_expert_intermediate_size") or 0
    return 3 * config["hidden_size"] * shared + config["hidden_size"] if shared else 0
