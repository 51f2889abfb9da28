"""The Llama-family decoder, shared by Llama, Qwen2 (Llama with a QKV bias) and Qwen3 (per-head
RMSNorm on q and k). Architectures differ only in the flags of LlamaAttention."""
import torch
from torch import nn
from transformers import PretrainedConfig

import nanovllm.envs as envs
from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.attention import Attention
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanovllm.layers.rotary_embedding import get_rope


# Fold each layer's RMSNorm weights into the GEMM after them at load (fold_norms): two kernels a
# layer fewer. NANOVLLM_FOLD_NORMS=0 turns it off (envs.py; benchmarks/bench_with.py compares both).
FOLD_NORMS = envs.FOLD_NORMS.get()


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_settings(config: PretrainedConfig) -> tuple[float, dict | None]:
    """(theta, scaling) from transformers 5's `rope_parameters` or older `rope_theta`/`rope_scaling`."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = dict(getattr(config, "rope_scaling", None) or params)
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    # Older configs name the scaling kind "type"; get_rope reads "rope_type" only.
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if rope_type == "default":
        return theta, None
    return theta, {"rope_type": rope_type, **{k: v for k, v in scaling.items() if k != "rope_theta"}}


class LlamaAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, qkv_bias: bool, qk_norm: bool, sliding_window: int = 0):
        super().__init__()
        hidden, head_dim = config.hidden_size, head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=qkv_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, hidden,
                                        bias=bool(getattr(config, "attention_bias", False)))
        theta, scaling = rope_settings(config)
        self.rotary_emb = get_rope(head_dim, config.max_position_embeddings, theta, scaling)
        self.attn = Attention(self.num_heads, head_dim, head_dim ** -0.5, self.num_kv_heads, sliding_window)
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps) if qk_norm else None

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                norm_eps: float | None = None) -> torch.Tensor:
        # x: [num_tokens, hidden] -> [num_tokens, hidden]
        # The attention layer applies q_norm / k_norm (Qwen3) and rotary itself: on CUDA they are
        # fused with its KV-cache write into one kernel.
        # norm_eps given: x is the residual stream h, the RMSNorm before this block folded into
        # qkv_proj (LlamaDecoderLayer.fold_norms): q, k, v are scaled by rstd(h) and the output is
        # added into h (in place) and returned.
        h = None if norm_eps is None else x
        out = self.attn(positions, self.qkv_proj(x), self.rotary_emb, self.q_norm, self.k_norm,
                        norm_of=h, norm_eps=norm_eps or 0.0)
        return self.o_proj(out.flatten(1), residual=h)


class LlamaMLP(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only 'silu')")
        bias = bool(getattr(config, "mlp_bias", False))   # Llama's config may ask for MLP biases
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2,
                                                       bias=bias)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor, norm_eps: float | None = None) -> torch.Tensor:
        # norm_eps given: as in LlamaAttention.forward (x the residual stream, the RMSNorm before
        # folded into gate_up_proj; the output added into x and returned)
        # (an FP8 gate_up_proj may leave its scales to SiLU-and-mul)
        h = None if norm_eps is None else x
        gate_up, scales = self.gate_up_proj.forward_unscaled(x)
        act = self.act_fn(gate_up, norm_of=h, eps=norm_eps or 0.0, fp8_scales=scales)
        return self.down_proj(act, residual=h)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, qkv_bias: bool, qk_norm: bool, mlp: nn.Module,
                 sliding_window: int = 0):
        super().__init__()
        self.self_attn = LlamaAttention(config, qkv_bias, qk_norm, sliding_window)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    folded = False   # set by fold_norms

    def fold_norms(self) -> bool:
        """Fold both RMSNorm weights into the weights of the GEMM after them, once, after loading:
        norm(h) W^T = rstd(h) * h (W diag(w))^T. The layer then runs on the un-normalised residual
        stream h: qkv_proj and gate_up_proj take h, the q/k norm + rotary + store kernel and
        SiLU-and-mul apply rstd(h) row by row, o_proj and down_proj add their output to h in their
        GEMM (C = h, beta 1; under tensor parallelism rank 0's, before the all-reduce): no RMSNorm or
        add kernel in the layer (two launches fewer). Only a dense MLP, with no bias on the folded or
        residual GEMMs, and not in fp16 (the un-normalised stream through a GEMM could pass fp16's
        65504), nor into FP8 weights (W diag(w) would need new scales: quantization at load folds
        first); False: left as it is."""
        attn, mlp = self.self_attn, self.mlp
        # (a quantized layer first: its weight may be packed, under other names)
        if (self.folded or not isinstance(mlp, LlamaMLP) or attn.qkv_proj.quant is not None
                or mlp.gate_up_proj.quant is not None or attn.qkv_proj.weight.dtype == torch.float16
                or any(p.bias is not None for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                                    mlp.down_proj))):
            return False
        with torch.no_grad():
            attn.qkv_proj.weight.mul_(self.input_layernorm.weight)
            mlp.gate_up_proj.weight.mul_(self.post_attention_layernorm.weight)
        self.folded = True
        return True

    def forward(self, positions, x, residual):
        if self.folded:
            # x + residual is the residual stream h; each block adds into it in place.
            h = x if residual is None else x + residual
            h = self.self_attn(positions, h, norm_eps=self.input_layernorm.eps)
            return self.mlp(h, norm_eps=self.post_attention_layernorm.eps), None
        # The residual stream is carried separately so each RMSNorm fuses the preceding add.
        x, residual = (self.input_layernorm(x), x) if residual is None else self.input_layernorm(x, residual)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config: PretrainedConfig, qkv_bias: bool, qk_norm: bool, make_mlp):
        """make_mlp(config, layer_index) -> the layer's MLP module (dense, or mixture-of-experts)."""
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, qkv_bias, qk_norm, make_mlp(config, i),
                                                      sliding_window_of(config, i))
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        return self.norm(x) if residual is None else self.norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    # checkpoint name -> (packed parameter, shard id) for projections fused into one matrix
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    qk_norm = False

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        qkv_bias = self.qkv_bias(config)
        self.model = LlamaModel(config, qkv_bias, self.qk_norm, self.make_mlp)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @staticmethod
    def qkv_bias(config: PretrainedConfig) -> bool:
        return bool(getattr(config, "attention_bias", False))

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_index: int) -> nn.Module:
        return LlamaMLP(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [num_tokens] -> hidden states: [num_tokens, hidden]
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)

    def fold_norms(self) -> int:
        """After loading: fold the layers' RMSNorm weights into their GEMMs where it applies
        (LlamaDecoderLayer.fold_norms; FOLD_NORMS off: none). Returns the layers folded."""
        return sum(layer.fold_norms() for layer in self.model.layers) if FOLD_NORMS else 0


def sliding_window_of(config: PretrainedConfig, layer_index: int) -> int:
    """The layer's sliding window (0: full attention). transformers lists each layer's kind in
    layer_types (Qwen2/3: sliding from layer max_window_layers on when use_sliding_window); a config
    that asks for windows without layer_types (Qwen3-MoE) is refused rather than guessed at."""
    kinds = getattr(config, "layer_types", None)
    if kinds is None:
        if getattr(config, "use_sliding_window", False):
            raise ValueError(f"{type(config).__name__}: sliding-window attention (use_sliding_window) "
                             "without layer_types is not supported; use a config whose layers all use "
                             "full attention")
        return 0
    return int(config.sliding_window or 0) if kinds[layer_index] == "sliding_attention" else 0


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def qkv_bias(config: PretrainedConfig) -> bool:
        # Qwen2 always has q/k/v biases (and never an o_proj bias: its config has no attention_bias).
        return True
