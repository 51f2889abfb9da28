"""The OpenAI API's shapes: request bodies (validated by pydantic, mapped to SamplingParams as
vLLM's server maps them), responses, stream chunks and errors."""

import dataclasses
import time
import types
import typing
import uuid

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from nanovllm.chat_utils import text_parts
from nanovllm.sampling_params import SamplingParams, StructuredOutputsParams


INT64 = 2**63


class _Body(BaseModel):
    # Unknown fields are kept aside (model_extra) and ignored, as vLLM's server does: OpenAI clients
    # send some we don't use (user, metadata, ...); the server logs their names.
    model_config = ConfigDict(extra="allow")
    model: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data):
        """An explicit null for a field that does not take None (n, stream, echo, ...) means its
        default, as in vLLM's and OpenAI's schemas, where they are nullable."""
        if isinstance(data, dict):
            fields = cls.model_fields
            return {k: v for k, v in data.items() if v is not None or k not in fields or _nullable(fields[k])}
        return data

    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or ())


class _Request(_Body):
    # OpenAI's cap: a huge n would build that many sequences (n >= 1 is SamplingParams' check)
    n: int = Field(default=1, le=128)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = Field(default=None, ge=-INT64, lt=INT64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict | None = None            # OpenAI's {token id: bias}
    allowed_token_ids: list[int] | None = None   # vLLM's extras
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    stream: bool = False
    stream_options: dict | None = None
    prompt_logprobs: int | None = None         # vLLM's: logprobs of the prompt's tokens (not streamed)
    return_tokens_as_token_ids: bool = False   # vLLM's: logprobs name tokens "token_id:<id>"
    use_beam_search: bool = False              # vLLM's; refused here (LLM.beam_search does it offline)
    best_of: int | None = None                 # OpenAI's legacy field; only 1 (as vLLM V1)
    # Structured outputs, as vLLM's server takes them: OpenAI's response_format, vLLM's
    # structured_outputs object, or its older guided_* fields (one of them per request).
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, defaults: dict,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """SamplingParams for this request. A field the client left out takes the model's default
        (defaults: from its generation_config.json, as vLLM's server does), else SamplingParams'.
        Raises ValueError (a 400) for out-of-range values."""
        self.refuse_unsupported()
        given = {k: v for k, v in defaults.items() if k != "max_tokens"}
        given |= {
            name: getattr(self, name)
            for name in (
                "temperature",
                "top_p",
                "top_k",
                "min_p",
                "seed",
                "presence_penalty",
                "frequency_penalty",
                "repetition_penalty",
            )
            if getattr(self, name) is not None
        }
        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs if self.prompt_logprobs is not None else prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            structured_outputs=self.structured(),
            **given,
        )

    def refuse_unsupported(self):
        """ValueError (a 400) for fields that make no sense together, as vLLM's server refuses them."""
        if self.stream_options and not self.stream:   # as vLLM: an empty one passes
            raise ValueError("stream_options can only be given with stream=true")
        if self.prompt_logprobs is not None and self.stream:   # as vLLM
            raise ValueError("prompt_logprobs are not available with stream=true")
        if self.use_beam_search:
            raise ValueError("use_beam_search is not supported by this server; LLM.beam_search runs beam "
                             "search offline")
        if self.best_of not in (None, 1):
            raise ValueError(f"best_of={self.best_of} is not supported (as in vLLM V1): ask for n "
                             "completions with logprobs and rank them")

    def structured(self) -> StructuredOutputsParams | None:
        """The request's output constraint, or None. Raises ValueError (a 400) for a malformed one
        or for two given at once; whether a schema, regex or grammar compiles is checked later."""
        guided = {
            kind: getattr(self, f"guided_{kind}")
            for kind in ("json", "regex", "choice", "grammar")
            if getattr(self, f"guided_{kind}") is not None
        }
        given = [
            name
            for name, value in (
                ("response_format", _constraint_of(self.response_format)),
                ("structured_outputs", self.structured_outputs),
                ("guided_*", guided or None),
            )
            if value is not None
        ]
        if len(given) > 1:
            raise ValueError(f"give one of response_format, structured_outputs or guided_*; got {given}")
        if not given:
            if self.guided_whitespace_pattern is not None:
                raise ValueError("guided_whitespace_pattern needs guided_json")
            return None
        if given[0] == "response_format":
            return StructuredOutputsParams(**_constraint_of(self.response_format))
        fields = self.structured_outputs if given[0] == "structured_outputs" else guided
        if given[0] == "guided_*" and self.guided_whitespace_pattern is not None:
            fields = fields | {"whitespace_pattern": self.guided_whitespace_pattern}
        try:
            return StructuredOutputsParams(**fields)
        except TypeError:  # a field StructuredOutputsParams does not have
            known = ", ".join(f.name for f in dataclasses.fields(StructuredOutputsParams))
            unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(StructuredOutputsParams)})
            raise ValueError(
                f"structured_outputs: unknown field(s) {unknown}; the fields are {known}"
            ) from None


def _nullable(field) -> bool:
    kind = field.annotation
    return kind is None or kind is type(None) or (
        typing.get_origin(kind) in (typing.Union, types.UnionType) and type(None) in typing.get_args(kind))


def _constraint_of(response_format: dict | None) -> dict | None:
    """StructuredOutputsParams' fields for OpenAI's response_format: {"type": "json_schema",
    "json_schema": {"name", "schema", "strict", "description"}}, {"type": "json_object"} (any
    JSON object) or {"type": "text"} (no constraint: None)."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ValueError(
                'response_format json_schema needs "json_schema": {"name": ..., "schema": {...}}'
            )
        return {"json": spec["schema"]}
    raise ValueError(f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}")


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt alone (with its logprobs, to score it), as vLLM
        answers it; one token is generated and dropped."""
        return self.echo and self.max_tokens == 0

    def completion_params(self, defaults: dict) -> SamplingParams:
        """With echo and logprobs the prompt's tokens get logprobs too (as vLLM's server does)."""
        return self.sampling_params(1 if self.echo_only else self.max_tokens, self.logprobs, defaults,
                                    self.logprobs if self.echo else None)

    def refuse_unsupported(self):
        super().refuse_unsupported()
        if self.suffix is not None:   # as vLLM: its models do not insert text before a suffix
            raise ValueError("suffix is not supported")

    def prompts(self) -> list:
        """One prompt or a batch: a string, token ids, or a list of either."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise ValueError("prompt is empty")
        return list(p)


class ChatRequest(_Request):
    messages: list[dict] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    echo: bool = False     # vLLM's: the reply starts with the content of a message it continues
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    chat_template_kwargs: dict | None = None
    _tool_schema: dict | None = PrivateAttr(default=None)

    def chat_params(self, defaults: dict, tool_schema: dict | None = None) -> SamplingParams:
        """tool_schema: the JSON schema a tool_choice holds the output to (tools.ToolChoice.schema)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        self._tool_schema = tool_schema
        return self.sampling_params(
            self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens,
            (self.top_logprobs or 0) if self.logprobs else None,
            defaults,
        )

    def structured(self) -> StructuredOutputsParams | None:
        constraint = super().structured()
        schema = self._tool_schema
        if schema is None:
            return constraint
        if constraint is not None:
            raise ValueError('a "required" or named tool_choice constrains the output already: give no '
                             "response_format or structured outputs with it")
        return StructuredOutputsParams(json=schema)

    @property
    def reply_role(self) -> str:
        """As vLLM: the assistant's, or the last message's when the reply continues it."""
        return "assistant" if self.add_generation_prompt else str(self.messages[-1].get("role"))

    def echo_text(self) -> str:
        """With echo, the text the reply starts with: the last message's content when it has the
        reply's role (a message being continued), else nothing."""
        last = self.messages[-1]
        if not self.echo or last.get("role") != self.reply_role:
            return ""
        content = last.get("content") or ""
        return content if isinstance(content, str) else "\n".join(text_parts(content, "echo"))


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a prompt, or chat messages rendered by the model's template."""
    prompt: str | None = None
    messages: list[dict] | None = None
    add_special_tokens: bool | None = None     # None: True for a prompt, False for messages (vLLM's)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict] | None = None
    chat_template_kwargs: dict | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give one of prompt or messages")
        return self


class DetokenizeRequest(_Body):
    tokens: list[int]


def error_body(message: str, kind: str, code: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


# ---- logprobs, in the two shapes the two endpoints use ------------------------------------


def token_names(tokenizer, as_ids: bool = False):
    """How logprobs name a token: its text, or "token_id:<id>" (vLLM's return_tokens_as_token_ids)."""
    if as_ids:
        return lambda token_id: f"token_id:{token_id}"
    return lambda token_id: tokenizer.decode([token_id])


def completion_logprobs(name, token_ids: list[int], logprobs: list, text_offset: int) -> dict:
    """/v1/completions' shape: parallel lists of tokens, their logprobs, the top alternatives and
    each token's character offset in the text. name: token_names'."""
    tokens, values, tops, offsets = [], [], [], []
    for token_id, lp in zip(token_ids, logprobs):
        token = name(token_id)
        tokens.append(token)
        if lp is None:   # an echoed prompt's first token: nothing comes before it
            values.append(None)
            tops.append(None)
        else:
            values.append(lp.logprob)
            top = {name(t): v for t, v in zip(lp.top_ids, lp.top_logprobs)}
            top.setdefault(token, lp.logprob)   # the chosen token is always listed, as vLLM lists it
            tops.append(top)
        offsets.append(text_offset)
        text_offset += len(token)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def join_logprobs(first: dict, second: dict) -> dict:
    """Two completion_logprobs dicts, one after the other (an echoed prompt's, then the output's)."""
    return {key: first[key] + second[key] for key in first}


def chat_logprobs(name, token_ids: list[int], logprobs: list) -> dict:
    """/v1/chat/completions' shape: {"content": [{token, logprob, bytes, top_logprobs}]}."""

    def entry(token_id: int, value: float) -> dict:
        token = name(token_id)
        return {"token": token, "logprob": value, "bytes": list(token.encode())}

    return {
        "content": [
            {
                **entry(t, lp.logprob),
                "top_logprobs": [entry(i, v) for i, v in zip(lp.top_ids, lp.top_logprobs)],
            }
            for t, lp in zip(token_ids, logprobs)
        ]
    }


def prompt_logprobs(tokenizer, token_ids: list[int], logprobs: list) -> list:
    """vLLM's prompt_logprobs field: None for the first token, then per token {token id: {logprob,
    rank, decoded_token}} with the prompt's token first; -inf is written -9999.0, as vLLM clamps it
    (JSON has no infinity)."""

    def entry(token_id: int, value: float, rank: int) -> dict:
        return {"logprob": max(value, -9999.0), "rank": rank,
                "decoded_token": tokenizer.decode([token_id]) if tokenizer is not None else None}

    out: list = [None]
    for token_id, lp in zip(token_ids[1:], logprobs):
        d = {str(token_id): entry(token_id, lp.logprob, lp.rank)}
        for rank, (t, v) in enumerate(zip(lp.top_ids, lp.top_logprobs), start=1):
            d.setdefault(str(t), entry(t, v, rank))
        out.append(d)
    return out


def json_error_message(error: dict, content_type: str) -> str:
    """One pydantic error of a request body, said so a client knows what to change."""
    where = ".".join(map(str, error["loc"][1:])) or "body"
    if error["type"] == "json_invalid":
        reason = (error.get("ctx") or {}).get("error", "")
        return f"the body is not valid JSON (at character {where}): {reason}".rstrip(": ")
    if where == "body" and "json" not in content_type:
        return (f"the body must be a JSON object sent with Content-Type: application/json "
                f"(got {content_type or 'no Content-Type'})")
    return f"{where}: {error['msg']}"
