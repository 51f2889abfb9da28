import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.parallel.parallel_state import all_reduce, gather_last_dim, tp_rank, tp_size


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous slice of the vocabulary (the last slice zero-padded when the
    vocabulary does not divide); a token outside this rank's slice embeds to zero before the sum."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.per_partition
        self.weight = nn.Parameter(torch.empty(self.per_partition, embedding_dim))
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None):
        if loaded.shape != (self.num_embeddings, param.size(1)):
            raise ValueError(f"shape mismatch: expected {(self.num_embeddings, param.size(1))}, "
                             f"checkpoint has {tuple(loaded.shape)}")
        shard = loaded[self.vocab_start:self.vocab_start + self.per_partition]
        param.data.zero_()
        param.data[:shard.size(0)].copy_(shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens] token ids -> [num_tokens, embedding_dim]
        if self.tp_size == 1:
            return F.embedding(x, self.weight)
        local = x - self.vocab_start
        mask = (local >= 0) & (local < self.per_partition)
        y = F.embedding(local.clamp(0, self.per_partition - 1), self.weight) * mask.unsqueeze(-1)
        return all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits from hidden states. The caller passes only the rows it samples from (the last
    position of each sequence in prefill), so the vocabulary matmul runs on those alone."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_rows, hidden] -> logits: [num_rows, vocab_size] on every rank
        logits = gather_last_dim(F.linear(x, self.weight))
        return logits[:, :self.num_embeddings]
