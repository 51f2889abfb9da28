"""Outputs out: finished Sequences as vLLM's RequestOutput / CompletionOutput (text, token ids,
logprobs in vLLM's shapes); and the prompt logprobs a prefill step brings back."""
from nanovllm.engine.detokenizer import decode_output
from nanovllm.engine.scheduler import ScheduledBatch
from nanovllm.engine.sequence import Sequence, TokenLogprobs
from nanovllm.outputs import CompletionOutput, Logprob, RequestOutput, SpecDecodingMetrics


class OutputBuilder:
    """Builds outputs with the engine's tokenizer (None: no text)."""

    def __init__(self, tokenizer, speculative: bool = False):
        """speculative: speculative decoding is on (outputs carry its counts as metrics)."""
        self.tokenizer = tokenizer
        self.speculative = speculative

    def request_output(self, seqs: list[Sequence], prompt) -> RequestOutput:
        """One prompt's RequestOutput: seqs are its n completions; prompt as the caller gave it."""
        first = seqs[0]
        prompt_logprobs = None
        if first.prompt_logprobs is not None:   # vLLM's shape: None for the first token, then one dict each
            prompt_logprobs = [None] + self.logprob_dicts(first.prompt_token_ids[1:], first.prompt_logprobs,
                                                          first.sampling_params.detokenize)
        return RequestOutput(str(first.seq_id), prompt_text(prompt), first.prompt_token_ids,
                             [self.completion(seq) for seq in seqs], finished=True,
                             prompt_logprobs=prompt_logprobs, num_cached_tokens=first.num_cached_tokens or 0,
                             lora_request=first.lora_request, metrics=self.spec_metrics(seqs))

    def spec_metrics(self, seqs: list[Sequence]) -> SpecDecodingMetrics | None:
        if not self.speculative:
            return None
        return SpecDecodingMetrics(sum(s.num_drafts for s in seqs), sum(s.num_draft_tokens for s in seqs),
                                   sum(s.num_accepted_tokens for s in seqs))

    def completion(self, seq: Sequence) -> CompletionOutput:
        ids, p = seq.completion_token_ids, seq.sampling_params
        if isinstance(seq.stop_reason, str):
            text = seq.detokenizer.text   # already cut at the stop string
        elif self.tokenizer is None or not p.detokenize:
            text = ""
        else:
            text = decode_output(self.tokenizer, seq.text_context, text_token_ids(seq),
                                 skip_special_tokens=p.skip_special_tokens,
                                 spaces_between_special_tokens=p.spaces_between_special_tokens)
        logprobs = self.logprob_dicts(ids, seq.logprobs, p.detokenize) if seq.logprobs is not None else None
        cumulative = sum(lp.logprob for lp in seq.logprobs) if seq.logprobs is not None else None
        return CompletionOutput(seq.index, text, ids, cumulative, logprobs,
                                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                                lora_request=seq.lora_request)

    def logprob_dicts(self, ids: list[int], logprobs: list[TokenLogprobs],
                      detokenize: bool = True) -> list[dict[int, Logprob]]:
        """vLLM's shape: per token, {token id: Logprob}, the chosen (sampled or prompt) token first."""
        names: dict[int, str | None] = {}

        def name(t: int) -> str | None:
            if t not in names:
                names[t] = self.tokenizer.decode([t]) if self.tokenizer and detokenize else None
            return names[t]

        dicts = []
        for token, lp in zip(ids, logprobs):
            entry = {token: Logprob(lp.logprob, lp.rank, name(token))}
            for rank, (t, value) in enumerate(zip(lp.top_ids, lp.top_logprobs), start=1):
                entry.setdefault(t, Logprob(value, rank, name(t)))
            dicts.append(entry)
        return dicts


def add_prompt_logprobs(batch: ScheduledBatch, rows: dict[int, tuple[int, list[TokenLogprobs]]]):
    """Append a prefill step's prompt logprobs (seq_id -> first position, one entry per position).
    Positions already there are skipped: a sequence preempted before its last chunk's logprobs
    arrived computes them again."""
    for seq in batch.seqs:
        if seq.seq_id in rows:
            first, entries = rows[seq.seq_id]
            have = len(seq.prompt_logprobs)
            if first <= have:
                seq.prompt_logprobs.extend(entries[have - first:])


def text_token_ids(seq: Sequence) -> list[int]:
    """The output tokens whose text is the output's text. As in vLLM v1, the token that stopped the
    sequence (EOS or one of stop_token_ids) stays in token_ids, but its text is left out (whatever
    skip_special_tokens says) unless include_stop_str_in_output."""
    ids = seq.completion_token_ids
    stopped_by_token = seq.finish_reason == "stop" and not isinstance(seq.stop_reason, str)
    if stopped_by_token and ids and not seq.sampling_params.include_stop_str_in_output:
        return ids[:-1]
    return ids


def prompt_text(prompt) -> str | None:
    """RequestOutput.prompt: the prompt's text when the user gave one."""
    if isinstance(prompt, dict):
        return prompt.get("prompt")
    return prompt if isinstance(prompt, str) else None
