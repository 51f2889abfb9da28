"""The n-gram proposer (prompt lookup, as vLLM's NgramProposer): find the longest suffix n-gram of a
sequence's tokens (prompt_lookup_min <= n <= prompt_lookup_max) that occurred earlier in them, and
propose the tokens that followed that occurrence (the most recent one). No model: drafts cost only
host time, and a repetitive text (code, quotes of the prompt) gets long runs accepted."""
from array import array

from nanovllm.engine.sequence import Sequence

_ITEM = 8   # bytes per token id in the search (int64)


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        self.k, self.min_n, self.max_n = num_speculative_tokens, prompt_lookup_min, prompt_lookup_max

    def propose(self, token_ids: list[int], max_drafts: int) -> list[int]:
        """At most min(k, max_drafts) draft tokens to follow token_ids ([] when no n-gram recurs)."""
        limit = min(self.k, max_drafts)
        if limit <= 0 or len(token_ids) < 2:
            return []
        # The search runs over the ids' bytes (bytes.rfind, in C): every decode step searches each
        # sequence's whole history, which a loop in Python would make the step's largest host cost.
        data = array("q", token_ids).tobytes()
        for n in range(min(self.max_n, len(token_ids) - 1), self.min_n - 1, -1):
            start = find_earlier(data, n)
            if start is not None:
                return token_ids[start + n:start + n + limit]
        return []


def find_earlier(data: bytes, n: int) -> int | None:
    """data: token ids as int64 bytes. The token index where the most recent earlier occurrence of
    the last n tokens starts (one that ends before the last token, so a token follows it), or None."""
    width = _ITEM * n
    suffix = data[-width:]
    end = len(data) - _ITEM   # the occurrence ends before the last token
    pos = data.rfind(suffix, 0, end)
    while pos >= 0 and pos % _ITEM:   # a match across token boundaries: look further back
        pos = data.rfind(suffix, 0, pos + width - 1)
    return pos // _ITEM if pos >= 0 else None


def can_speculate(seq: Sequence) -> bool:
    """May seq's next step verify drafts? Only where a token's distribution depends on nothing the
    drafts would change: no penalties, bad_words or grammar (built from the tokens before each row),
    min_tokens already met (its bans end mid-draft), and every input token on the host."""
    p = seq.sampling_params
    return (seq.num_pending == 0 and seq.grammar is None and not p.has_penalties and not seq.bad_words_ids
            and seq.output_index >= p.min_tokens and seq.pooling is None)
