"""Gemma 2 and Gemma 3 (text): a decoder whose layers alternate sliding-window and global attention
(config.layer_types: Gemma 2 one to one, Gemma 3 five sliding layers to one global), with

  - every RMSNorm zero-centred (it scales by 1 + w), and four a layer: before and after attention,
    before and after the MLP (each block's output is normalised before it joins the residual stream);
  - the embeddings scaled by sqrt(hidden_size), in the model's dtype;
  - attention scaled by query_pre_attn_scalar ** -0.5, not head_dim ** -0.5;
  - a gelu (tanh approximation) gated MLP;
  - Gemma 2: attention scores and final logits soft-capped (cap * tanh(s / cap));
  - Gemma 3: per-head q/k norms, and sliding layers' rotary on their own (local) base.

Gemma3ForConditionalGeneration's checkpoints hold the text model under a language_model prefix; its
vision tower and projector are skipped (utils/text_config.py builds from the text_config)."""
import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from nanovllm.layers.attention import Attention
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanovllm.layers.rotary_embedding import get_rope
from nanovllm.layers.zero_centred_norm import ZeroCentredRMSNorm
from nanovllm.models.llama import LlamaForCausalLM, head_dim_of, rope_settings
from nanovllm.utils.loader import default_weight_loader

LAYER_KINDS = ("sliding_attention", "full_attention")


def layer_kinds(config: PretrainedConfig) -> list[str]:
    """Each layer's attention, "sliding_attention" or "full_attention" (transformers' layer_types)."""
    kinds = list(getattr(config, "layer_types", None) or [])
    if len(kinds) != config.num_hidden_layers or not set(kinds) <= set(LAYER_KINDS):
        raise ValueError(f"layer_types must name {LAYER_KINDS} for each of the {config.num_hidden_layers} "
                         f"layers, got {kinds}")
    return kinds


def rope_of(config: PretrainedConfig, kind: str) -> tuple[float, dict | None]:
    """(theta, scaling) of a layer kind: transformers 5 keeps one rope_parameters dict per kind (Gemma 3);
    older Gemma 3 configs give the sliding layers rope_local_base_freq."""
    params = getattr(config, "rope_parameters", None) or {}
    if kind in params:
        per_kind = dict(params[kind])
        rope_type = per_kind.pop("rope_type", "default")
        theta = per_kind.pop("rope_theta")
        return theta, None if rope_type == "default" else {"rope_type": rope_type, **per_kind}
    if kind == "sliding_attention" and getattr(config, "rope_local_base_freq", None):
        return float(config.rope_local_base_freq), None
    return rope_settings(config)


def one_plus_weight_norm(size: int, eps: float) -> RMSNorm:
    """A per-head q or k norm whose checkpoint weight w scales by 1 + w, as a plain RMSNorm of weight
    1 + w (loaded so), so that the fused q/k norm + rotary + KV-store kernel runs it."""
    norm = RMSNorm(size, eps)
    norm.weight.weight_loader = lambda param, loaded: default_weight_loader(param, loaded.float() + 1.0)
    return norm


class GemmaAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, kind: str, qk_norm: bool):
        super().__init__()
        hidden, head_dim = config.hidden_size, head_dim_of(config)
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=bias)
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, hidden, bias=bias)
        theta, scaling = rope_of(config, kind)
        self.rotary_emb = get_rope(head_dim, config.max_position_embeddings, theta, scaling)
        window = config.sliding_window if kind == "sliding_attention" else 0
        self.attn = Attention(self.qkv_proj.num_heads, head_dim, config.query_pre_attn_scalar ** -0.5,
                              self.qkv_proj.num_kv_heads, sliding_window=window,
                              logit_softcap=getattr(config, "attn_logit_softcapping", None) or 0.0)
        self.q_norm = one_plus_weight_norm(head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = one_plus_weight_norm(head_dim, config.rms_norm_eps) if qk_norm else None

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, hidden] -> [num_tokens, hidden]
        out = self.attn(positions, self.qkv_proj(x), self.rotary_emb, self.q_norm, self.k_norm)
        return self.o_proj(out.flatten(1))


class GeluTanhMLP(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"hidden_activation {act!r} is not supported for Gemma (only "
                             "'gelu_pytorch_tanh')")
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, -1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, kind: str, qk_norm: bool):
        super().__init__()
        self.self_attn = GemmaAttention(config, kind, qk_norm)
        self.mlp = GeluTanhMLP(config)
        norm = lambda: ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)   # noqa: E731
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()

    def forward(self, positions: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        # h: the residual stream [num_tokens, hidden]; each block's output is normalised before it joins
        h = h + self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(h)))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class GemmaModel(nn.Module):
    def __init__(self, config: PretrainedConfig, qk_norm: bool):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.embed_scale = config.hidden_size ** 0.5
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, kind, qk_norm) for kind in layer_kinds(config))
        self.norm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # transformers rounds the scale to the weights' dtype first (in bf16: 8.0 for 64, 45.25 for 2048)
        h = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        for layer in self.layers:
            h = layer(positions, h)
        return self.norm(h)


class Gemma2ForCausalLM(nn.Module):
    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping   # the same packed q/k/v and gate/up
    qk_norm = False

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError(f"{type(config).__name__}: use_bidirectional_attention (an encoder) is not "
                             "supported; nanovllm runs causal decoders")
        self.model = GemmaModel(config, self.qk_norm)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(config, "tie_word_embeddings", True):
            self.lm_head.weight = self.model.embed_tokens.weight
        self.final_softcap = getattr(config, "final_logit_softcapping", None) or 0.0

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [num_tokens] -> hidden states: [num_tokens, hidden]
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden_states)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The multimodal checkpoint's text model (its weights under a language_model prefix, old and new
    layouts); the vision tower and projector are skipped."""
    skipped_checkpoint_prefixes = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.",
                                   "multi_modal_projector.")
    checkpoint_prefix_renames = {"model.language_model.": "model.", "language_model.model.": "model.",
                                 "language_model.lm_head.": "lm_head."}

    def __init__(self, config: PretrainedConfig):
        super().__init__(config)
        if self.lm_head.weight is self.model.embed_tokens.weight:   # the old layout's copy of the tied head
            self.skipped_checkpoint_prefixes += ("language_model.lm_head.",)
