"""Output text: the final decode (decode_output) and the incremental one for stop strings and
streams (IncrementalDetokenizer), both read behind the prompt's last tokens, as vLLM reads them."""
from dataclasses import dataclass, field

CONTEXT_TOKENS = 4   # prompt tokens an output is decoded behind (prompt_context)


def prompt_context(prompt_ids: list[int]) -> list[int]:
    """The prompt's last tokens, whose text gives the output's first token its word boundary: a
    SentencePiece tokenizer (Llama 2, Mistral) drops the leading space of the first token it decodes,
    which vLLM's output text keeps."""
    return list(prompt_ids[-CONTEXT_TOKENS:])


def decode_output(tokenizer, context: list[int], ids: list[int], **options) -> str:
    """The text of output tokens ids as it reads after the prompt: decoded behind context (the
    prompt's last tokens), whose own text is cut off. The ids alone when that text is no prefix."""
    if context:
        prefix = tokenizer.decode(context, **options)
        full = tokenizer.decode(context + list(ids), **options)
        if full.startswith(prefix) and not prefix.endswith("\ufffd"):
            return full[len(prefix):]
    return tokenizer.decode(ids, **options)


@dataclass
class IncrementalDetokenizer:
    """The output text so far, grown one step at a time, read behind `context` (prompt_context). Only
    requests with stop strings keep one (other outputs are decoded once, at the end), and streams.
    Plain data, so a Sequence stays picklable."""
    context: list[int] = field(default_factory=list)
    text: str = ""
    # Offsets into context + output tokens: [prefix_offset, read_offset) give the new text its
    # context; tokens before read_offset are already in `text` (at first: the context, which is not).
    prefix_offset: int = 0
    read_offset: int = -1

    def step(self, tokenizer, output_ids: list[int], skip_special_tokens: bool,
             spaces_between_special_tokens: bool = True) -> str:
        """Decode the newest output tokens; return the text they add (appended to `text`)."""
        # Decoding with the previous tokens as context keeps word boundaries (leading spaces)
        # right; the difference of the two decodes is the new text.
        options = dict(skip_special_tokens=skip_special_tokens)
        if not spaces_between_special_tokens:   # passed only when asked: the default needs no option
            options["spaces_between_special_tokens"] = False
        if self.read_offset < 0:   # the first step
            if self.context and tokenizer.decode(self.context, **options).endswith("\ufffd"):
                self.context = []   # it ends inside a character: no clean prefix to cut off
            self.read_offset = len(self.context)
        window = self._tokens_from(self.prefix_offset, output_ids)
        prefix = tokenizer.decode(window[:self.read_offset - self.prefix_offset], **options)
        full = tokenizer.decode(window, **options)
        if full.endswith("\ufffd"):
            return ""   # a multi-byte character is split across tokens: wait for the rest
        new_text = full[len(prefix):]
        self.text += new_text
        self.prefix_offset, self.read_offset = self.read_offset, len(self.context) + len(output_ids)
        return new_text

    def _tokens_from(self, start: int, output_ids: list[int]) -> list[int]:
        """(context + output_ids)[start:], without copying the tokens before start (a step would
        otherwise copy the whole output)."""
        n = len(self.context)
        return self.context[start:] + output_ids if start < n else output_ids[start - n:]

    def find_stop(self, new_len: int, stops: list[str], include: bool) -> str | None:
        """The first stop string of the list (as vLLM looks for them) that ends in the newest
        `new_len` characters; truncate `text` at it (after it when `include`)."""
        for stop in stops:
            # Only a match that overlaps the new text is new; older text was checked before.
            i = self.text.find(stop, max(0, len(self.text) - new_len - len(stop) + 1))
            if i != -1:
                self.text = self.text[:i + len(stop) if include else i]
                return stop
        return None
