"""A registry decoder built for pooling: the decoder without its LM head (the embeddings are the
final norm's output, as transformers' AutoModel gives last_hidden_state), and for classifiers the
score head of *ForSequenceClassification (one linear map, no bias), or one made from LM-head rows
(a causal LM converted to a reranker: hf_overrides classifier_from_token)."""
import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from nanovllm.layers.pooler import pool_step
from nanovllm.models.llama import LlamaForCausalLM, LlamaModel
from nanovllm.pooler_config import PoolingSpec
from nanovllm.utils.loader import default_weight_loader


class ScoreHead(nn.Module):
    """hidden -> num_labels logits, replicated on every tensor-parallel rank (it is tiny, and the
    hidden states it reads are whole on every rank)."""

    def __init__(self, hidden_size: int, num_labels: int, token_ids: tuple[int, ...] = (),
                 method: str | None = None):
        super().__init__()
        self.token_ids, self.method = token_ids, method
        self.weight = nn.Parameter(torch.empty(num_labels, hidden_size))
        if token_ids:   # the checkpoint has an LM head, not a score head
            self.weight.weight_loader = self.load_from_lm_head

    def load_from_lm_head(self, param: nn.Parameter, lm_head: torch.Tensor, shard_id=None):
        # lm_head: [vocab, hidden] (the LM head, or the embedding it is tied to)
        rows = lm_head[list(self.token_ids)].float()
        if self.method == "from_2_way_softmax":   # sigmoid(l1 - l0) = softmax([l0, l1])[1]
            rows = rows[1:] - rows[:1]
        default_weight_loader(param, rows.to(param.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [rows, hidden] -> [rows, num_labels]
        return F.linear(x, self.weight)


class PoolingDecoder(nn.Module):
    def __init__(self, config: PretrainedConfig, spec: PoolingSpec, lm: type[LlamaForCausalLM]):
        """lm: the registry class whose decoder this is (models.decoder_of)."""
        super().__init__()
        if not issubclass(lm, LlamaForCausalLM):
            raise ValueError("the pooling runner runs Llama-family decoders (Llama, Qwen2, Qwen3, "
                             f"Qwen3-MoE); {lm.__name__}'s is not one: use runner='generate'")
        self.packed_modules_mapping = lm.packed_modules_mapping
        self.model = LlamaModel(config, lm.qkv_bias(config), lm.qk_norm, lm.make_mlp)
        self.score = ScoreHead(config.hidden_size, spec.num_labels, spec.from_token_ids,
                               spec.from_token_method) if spec.num_labels else None
        # a reranker made from a tied LM head takes its rows from the embedding
        self.rows_from_embedding = bool(spec.from_token_ids) and bool(config.tie_word_embeddings)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [num_tokens] -> hidden states: [num_tokens, hidden]
        return self.model(input_ids, positions)

    def pool(self, hidden_states: torch.Tensor, step) -> list[torch.Tensor | None]:
        """A prompt-only step's hidden states [num_tokens, hidden] -> each sequence's share of its
        output (layers/pooler.py: pool_step)."""
        return pool_step(hidden_states, step, self.score)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The head's output (a classifier's logits; an embedder's hidden states), for the runner's
        warm-up, which runs it as it would an LM head."""
        return hidden_states if self.score is None else self.score(hidden_states)

    def fold_norms(self) -> int:
        return LlamaForCausalLM.fold_norms(self)

    def checkpoint_targets(self, name: str) -> tuple[str, ...]:
        """The parameters a checkpoint tensor loads into (utils/loader.py asks): a base model's
        checkpoint (Qwen3Model.save_pretrained) names its tensors without the "model." prefix; an
        embedder drops the LM head; a reranker made from LM-head rows loads them into its score head."""
        if name == "lm_head.weight":
            return ("score.weight",) if self.score is not None and self.score.token_ids else ()
        if name == "score.weight":
            return (name,)
        if not name.startswith("model."):
            name = "model." + name
        if self.rows_from_embedding and name == "model.embed_tokens.weight":
            return name, "score.weight"
        return (name,)
