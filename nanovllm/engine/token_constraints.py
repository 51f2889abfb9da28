"""bad_words, as vLLM applies them: each word becomes the token ids it is written with (alone and
after a space); its last token is banned wherever the output so far ends in the others."""


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """The token-id sequences of each bad word: as written at the start of a text and, where that
    tokenizes differently (a leading-space word token), in the middle of one."""
    sequences = []
    for word in words:
        alone = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if alone:
            sequences.append(alone)
        # Only a distinct word token counts, not " " + the same tokens.
        if spaced and len(spaced) == len(alone) and spaced[0] != alone[0]:
            sequences.append(spaced)
    return sequences


def banned_by_bad_words(bad_words_ids: list[list[int]], output_ids: list[int]) -> list[int]:
    """Tokens that would complete a bad word if sampled next after output_ids."""
    banned = []
    for ids in bad_words_ids:
        prefix = ids[:-1]
        if len(prefix) <= len(output_ids) and (not prefix or output_ids[-len(prefix):] == prefix):
            banned.append(ids[-1])
    return banned
