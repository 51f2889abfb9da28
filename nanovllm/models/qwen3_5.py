"""Qwen3.5 / Qwen3.6 and Qwen3-Next: a hybrid decoder whose layers (config.layer_types) are Gated
DeltaNet linear attention (layers/gated_deltanet.py, a state per sequence) or gated full attention
(layers/gated_attention.py), each followed by a dense MLP (Qwen3_5ForCausalLM) or a mixture of experts
with a gated shared expert (Qwen3_5MoeForCausalLM; Qwen3-Next: in the layers config.py's
is_sparse_layer picks, dense elsewhere). Every RMSNorm but the gated one is zero-centred (it scales by
1 + w). The published Qwen3.5 checkpoints are the multimodal *ForConditionalGeneration: their text
model is read (under model.language_model.), the vision tower and the MTP head are skipped."""
import logging

import torch
from torch import nn
from transformers import PretrainedConfig

from nanovllm.config import is_sparse_layer
from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.fused_moe import FusedMoE, route
from nanovllm.layers.gated_attention import GatedAttention
from nanovllm.layers.gated_deltanet import GatedDeltaNet, log_delta_rule_kernels
from nanovllm.layers.linear import MergedColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from nanovllm.layers.zero_centred_norm import ZeroCentredRMSNorm
from nanovllm.models.llama import LlamaForCausalLM
from nanovllm.parallel.parallel_state import all_reduce

logger = logging.getLogger(__name__)


class SiluMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of forward(x), before the all-reduce (the same under one rank)."""
        return self.down_proj.matmul(self.act_fn(self.gate_up_proj(x)))


class SharedExpertMoe(nn.Module):
    """Top-k experts (the router's softmax renormalised over the k) plus a shared expert scaled by
    sigmoid(shared_expert_gate(x)) per token. Experts are sharded as in layers/fused_moe.py."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        hidden, num_experts = config.hidden_size, config.num_experts
        self.top_k = config.num_experts_per_tok
        if not 1 <= self.top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({self.top_k}) must be between 1 and num_experts "
                             f"({num_experts})")
        self.renormalize = bool(getattr(config, "norm_topk_prob", True))   # Qwen3.5: always
        self.gate = ReplicatedLinear(hidden, num_experts)
        self.experts = FusedMoE(num_experts, hidden, config.moe_intermediate_size)
        self.shared_expert = SiluMLP(hidden, config.shared_expert_intermediate_size)
        self.shared_expert_gate = ReplicatedLinear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, hidden] -> [num_tokens, hidden]
        topk_weights, topk_ids = route(self.gate(x), self.top_k, self.renormalize)
        routed, shared = self.experts(x, topk_weights, topk_ids), self.shared_expert.partial(x)
        # The shared expert's gate is per token and the same on every rank: one all-reduce sums both.
        return all_reduce(routed + torch.sigmoid(self.shared_expert_gate(x)) * shared)


class Qwen3_5DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, kind: str, mlp: nn.Module, fused_projections: bool):
        super().__init__()
        if kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(config, fused_projections)
        elif kind == "full_attention":
            self.self_attn = GatedAttention(config)
        else:
            raise ValueError(f"layer type {kind!r} is not supported "
                             "(only 'linear_attention' and 'full_attention')")
        self.is_linear = kind == "linear_attention"
        self.mlp = mlp
        self.input_layernorm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, x, residual):
        # The residual stream is carried separately so each RMSNorm fuses the preceding add.
        x, residual = (self.input_layernorm(x), x) if residual is None else self.input_layernorm(x, residual)
        x = self.linear_attn(x) if self.is_linear else self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Qwen3_5Model(nn.Module):
    def __init__(self, config: PretrainedConfig, make_mlp, fused_projections: bool):
        """make_mlp(config, layer_index) -> the layer's MLP (dense, or mixture-of-experts)."""
        super().__init__()
        kinds = list(config.layer_types)
        if len(kinds) != config.num_hidden_layers:
            raise ValueError(f"layer_types lists {len(kinds)} layers, num_hidden_layers is "
                             f"{config.num_hidden_layers}")
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen3_5DecoderLayer(config, kind, make_mlp(config, i), fused_projections)
                                    for i, kind in enumerate(kinds))
        self.norm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        return self.norm(x, residual)[0]


class Qwen3_5ForCausalLM(nn.Module):
    # checkpoint name -> (packed parameter, shard id)
    packed_modules_mapping = {
        **LlamaForCausalLM.packed_modules_mapping,   # q/k/v and gate/up, as the Llama family's
        "in_proj_qkv": ("in_proj_qkvz", "qkv"), "in_proj_z": ("in_proj_qkvz", "z"),
        "in_proj_b": ("in_proj_ba", "b"), "in_proj_a": ("in_proj_ba", "a"),
    }
    # utils/loader.py: the vision tower and the multi-token-prediction head are not run; a text model
    # saved inside a multimodal one (model.language_model.) is read as the text model.
    skipped_checkpoint_prefixes = ("model.visual.", "mtp.")
    checkpoint_prefix_renames = {"model.language_model.": "model."}
    fused_projections = False   # see GatedDeltaNet

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        log_delta_rule_kernels(torch.get_default_device())
        self.model = Qwen3_5Model(config, self.make_mlp, self.fused_projections)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_index: int) -> nn.Module:
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only 'silu')")
        return SiluMLP(config.hidden_size, config.intermediate_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [num_tokens] -> hidden states: [num_tokens, hidden]
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Every layer's MLP is a mixture of experts with a shared expert."""

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_index: int) -> nn.Module:
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only 'silu')")
        return SharedExpertMoe(config)


class Qwen3NextForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3-Next: the same parts, with fused in_proj_qkvz / in_proj_ba checkpoint tensors and
    experts in the layers mlp_only_layers and decoder_sparse_step select (top-k renormalised when
    norm_topk_prob)."""
    fused_projections = True
    packed_modules_mapping = {k: v for k, v in Qwen3_5ForCausalLM.packed_modules_mapping.items()
                              if not k.startswith("in_proj_")}   # its in_proj_qkvz / _ba are whole

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_index: int) -> nn.Module:
        if is_sparse_layer(config, layer_index):
            return Qwen3_5MoeForCausalLM.make_mlp(config, layer_index)
        return Qwen3_5ForCausalLM.make_mlp(config, layer_index)


# Multimodal checkpoints whose text model runs as the causal LM (config: their text_config, see
# utils/text_config.py).
MULTIMODAL = {"Qwen3_5ForConditionalGeneration": Qwen3_5ForCausalLM,
              "Qwen3_5MoeForConditionalGeneration": Qwen3_5MoeForCausalLM}
