"""vLLM's prompt dicts: LLM.generate takes these as well as plain strings and token-id lists."""
from typing import TypedDict

try:
    from typing import NotRequired
except ImportError:   # Python 3.10 (torch installs typing_extensions)
    from typing_extensions import NotRequired


class TextPrompt(TypedDict):
    prompt: str                          # tokenized by the engine


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]             # the text of the ids, if known: reported as RequestOutput.prompt


# vLLM's optional prompt keys that only multimodal or cache-isolating engines use: refused by name
# (silently ignoring them would change what the user asked for).
UNSUPPORTED_PROMPT_KEYS = ("multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids", "cache_salt",
                           "token_type_ids", "prompt_embeds")
