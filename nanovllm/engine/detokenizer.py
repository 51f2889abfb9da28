"""Incremental detokenization for stop strings: each step decodes only a short tail of tokens."""
from dataclasses import dataclass


@dataclass
class IncrementalDetokenizer:
    """The output text so far, grown one step at a time. Only requests with stop strings keep one
    (other outputs are decoded once, at the end). Plain data, so a Sequence stays picklable."""
    text: str = ""
    prefix_offset: int = 0   # output tokens [prefix_offset, read_offset) give the new text its context
    read_offset: int = 0     # output tokens before this are already in `text`

    def step(self, tokenizer, output_ids: list[int], skip_special_tokens: bool,
             spaces_between_special_tokens: bool = True) -> str:
        """Decode the newest output tokens; return the text they add (appended to `text`)."""
        # Decoding with the previous tokens as context keeps word boundaries (leading spaces)
        # right; the difference of the two decodes is the new text.
        options = dict(skip_special_tokens=skip_special_tokens)
        if not spaces_between_special_tokens:   # passed only when asked: the default needs no option
            options["spaces_between_special_tokens"] = False
        prefix = tokenizer.decode(output_ids[self.prefix_offset:self.read_offset], **options)
        full = tokenizer.decode(output_ids[self.prefix_offset:], **options)
        if full.endswith("\ufffd"):
            return ""   # a multi-byte character is split across tokens: wait for the rest
        new_text = full[len(prefix):]
        self.text += new_text
        self.prefix_offset, self.read_offset = self.read_offset, len(output_ids)
        return new_text

    def find_stop(self, new_len: int, stops: list[str], include: bool) -> str | None:
        """The stop string that ends in the newest `new_len` characters (the earliest if several);
        truncate `text` at it (after it when `include`)."""
        best = None
        for stop in stops:
            # Only a match that overlaps the new text is new; older text was checked before.
            i = self.text.find(stop, max(0, len(self.text) - new_len - len(stop) + 1))
            if i != -1 and (best is None or i < best[0]):
                best = (i, stop)
        if best is None:
            return None
        i, stop = best
        self.text = self.text[:i + len(stop) if include else i]
        return stop
