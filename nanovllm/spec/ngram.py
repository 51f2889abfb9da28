"""The n-gram proposer (prompt lookup, as vLLM's NgramProposer): find the longest suffix n-gram of a
sequence's tokens (prompt_lookup_min <= n <= prompt_lookup_max) that occurred earlier in them, and
propose the tokens that followed that occurrence (the most recent one). No model: drafts cost only
host time, and a repetitive text (code, quotes of the prompt) gets long runs accepted."""
from nanovllm.engine.sequence import Sequence


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        self.k, self.min_n, self.max_n = num_speculative_tokens, prompt_lookup_min, prompt_lookup_max

    def propose(self, token_ids: list[int], max_drafts: int) -> list[int]:
        """At most min(k, max_drafts) draft tokens to follow token_ids ([] when no n-gram recurs)."""
        limit = min(self.k, max_drafts)
        if limit <= 0:
            return []
        length = len(token_ids)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = find_earlier(token_ids, n)
            if start is not None:
                return token_ids[start + n:start + n + limit]
        return []


def find_earlier(token_ids: list[int], n: int) -> int | None:
    """The start of the most recent earlier occurrence of the last n tokens (one that ends before
    the last token, so at least one token follows it), or None."""
    suffix = token_ids[-n:]
    last = suffix[-1]
    for start in range(len(token_ids) - n - 1, -1, -1):
        # the cheap test first: most positions differ in the n-gram's last token
        if token_ids[start + n - 1] == last and token_ids[start:start + n] == suffix:
            return start
    return None


def can_speculate(seq: Sequence) -> bool:
    """May seq's next step verify drafts? Only where a token's distribution depends on nothing the
    drafts would change: no penalties, bad_words or grammar (built from the tokens before each row),
    min_tokens already met (its bans end mid-draft), and every input token on the host."""
    p = seq.sampling_params
    return (seq.num_pending == 0 and seq.grammar is None and not p.has_penalties and not seq.bad_words_ids
            and seq.output_index >= p.min_tokens and seq.pooling is None)
