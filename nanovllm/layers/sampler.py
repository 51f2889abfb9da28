import torch
from torch import nn


class Sampler(nn.Module):
    """Temperature sampling by the exponential race (argmax of p / E, E ~ Exp(1), draws a token with
    probability p without a host sync); temperature 0 rows take the argmax."""

    def forward(self, logits: torch.Tensor, temperatures: torch.Tensor | None) -> torch.Tensor:
        # logits: [num_seqs, vocab] fp32; temperatures: [num_seqs], None when all are greedy
        # -> token ids: [num_seqs]
        greedy = logits.argmax(dim=-1)
        if temperatures is None:
            return greedy
        probs = torch.softmax(logits / temperatures.clamp_min(1e-5).unsqueeze(1), dim=-1)
        sampled = probs.div_(torch.empty_like(probs).exponential_(1)).argmax(dim=-1)
        return torch.where(temperatures > 0, sampled, greedy)
