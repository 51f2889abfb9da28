"""Requests in: a caller's prompts and SamplingParams checked and turned into Sequences. Every value
is checked before anything is queued, and an error names the prompt's (or the SamplingParams')
index in the caller's batch."""
import numbers
from collections.abc import Callable

from nanovllm.config import Config
from nanovllm.engine.block_manager import cdiv
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.token_constraints import bad_words_token_ids
from nanovllm.inputs import UNSUPPORTED_PROMPT_KEYS
from nanovllm.lora.adapter import check_adapter
from nanovllm.lora.request import LoRARequest
from nanovllm.sampling_params import SamplingParams
from nanovllm.structured.params import StructuredOutputsParams

NO_TOKENIZER = "the model folder has none, or skip_tokenizer_init=True"


class RequestBuilder:
    """Checks prompts and SamplingParams against one engine's model (vocabulary, max_model_len, KV
    cache, tokenizer) and builds their Sequences. default_overrides: the SamplingParams fields of a
    request given none (the model's generation config). (It holds no reference to the engine: an
    engine dropped without the cycle collector must still be freed at once.)"""

    def __init__(self, config: Config, tokenizer, num_kvcache_blocks: int, eos_token_ids: set[int],
                 default_overrides: dict):
        self.config, self.tokenizer, self.default_overrides = config, tokenizer, default_overrides
        self.num_kvcache_blocks = num_kvcache_blocks
        self.eos_token_ids = eos_token_ids
        self._eos = frozenset(eos_token_ids)   # each Sequence's (for its min_tokens ban)
        self._grammar_compiler = None   # built by the first request with structured_outputs
        self.lora_modules = None        # the PEFT modules the model takes LoRA on (set by the engine)
        self._adapters: dict[int, LoRARequest] = {}   # lora_int_id -> the checked adapter

    def token_ids(self, prompt, index: int, truncate: int | None = None) -> list[int]:
        """Validate one prompt and return its token ids; errors name the prompt's index. truncate:
        SamplingParams.truncate_prompt_tokens (keep the last k tokens; -1: as many as fit)."""
        where = f"prompt {index}"
        prompt = unwrap_prompt_dict(prompt, where)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{where}: the engine has no tokenizer ({NO_TOKENIZER}), "
                                 "so prompts must be token-id lists")
            ids = encode_text(self.tokenizer, prompt, where)
        elif isinstance(prompt, (list, tuple)):
            if all(type(t) is int for t in prompt):   # the common case, checked fast (bench: 144k ids)
                ids = list(prompt)
            else:
                bad = next((i for i, t in enumerate(prompt) if not is_token_id(t)), None)
                if bad is not None:
                    raise TypeError(f"{where}: a token-id prompt must be a flat list of ints; item {bad} is "
                                    f"{type(prompt[bad]).__name__} {prompt[bad]!r}")
                ids = [int(t) for t in prompt]   # numpy integers become plain ints
        else:
            raise TypeError(f"{where}: expected a string or a list of token ids, got {type(prompt).__name__}")
        limit = self.config.max_model_len
        if truncate is not None:
            if truncate >= limit:
                raise ValueError(f"{where}: truncate_prompt_tokens={truncate} leaves no room for output in "
                                 f"max_model_len={limit}: use at most {limit - 1}, or -1")
            ids = ids[-(limit - 1 if truncate == -1 else truncate):]
        vocab = self.config.hf_config.vocab_size
        if not ids:
            raise ValueError(f"{where} is empty"
                             + (" (its text has no tokens)" if isinstance(prompt, str) else ""))
        if min(ids) < 0 or max(ids) >= vocab:
            bad = next(i for i, t in enumerate(ids) if not 0 <= t < vocab)
            raise ValueError(f"{where}: token id {ids[bad]} at position {bad} is outside the model's "
                             f"vocabulary [0, {vocab})")
        if len(ids) >= limit:   # the prompt and at least one output token must fit
            raise ValueError(f"{where} has {len(ids)} tokens, too many for max_model_len={limit} (prompt + "
                             f"output): shorten it to at most {limit - 1} tokens or raise max_model_len")
        blocks, block_size = self.num_kvcache_blocks, self.config.kvcache_block_size
        if cdiv(len(ids), block_size) > blocks:
            raise ValueError(f"{where} has {len(ids)} tokens and cannot fit in the whole KV cache "
                             f"({blocks} blocks of {block_size} tokens); "
                             "give the cache more memory "
                             "(gpu_memory_utilization, kv_cache_memory_bytes or num_kvcache_blocks)")
        return ids

    def params_list(self, sampling_params, n: int) -> list[SamplingParams]:
        """One checked SamplingParams per prompt (see sampling_params_list)."""
        if isinstance(sampling_params, SamplingParams):
            self.check_params(sampling_params, 0)
        params = sampling_params_list(sampling_params, n, self.default_params)
        if isinstance(sampling_params, (list, tuple)):
            checked = set()
            for i, p in enumerate(params):
                if id(p) not in checked:   # one SamplingParams is often shared by every prompt
                    self.check_params(p, i)
                    checked.add(id(p))
        return params

    def default_params(self) -> SamplingParams:
        return SamplingParams(**self.default_overrides)

    def check_params(self, params: SamplingParams, index: int):
        try:
            params.validate()   # again: its fields may have been changed since it was built
        except (ValueError, TypeError) as e:
            raise type(e)(f"sampling_params {index}: {e}") from None
        vocab = self.config.hf_config.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"sampling_params {index}: stop_token_ids must be in [0, {vocab}) "
                             "(the model's vocabulary)")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"sampling_params {index}: stop strings need a tokenizer, and the engine "
                             f"has none ({NO_TOKENIZER}): use stop_token_ids")
        for name in ("logit_bias", "allowed_token_ids"):
            if any(t >= vocab for t in getattr(params, name) or ()):
                raise ValueError(f"sampling_params {index}: {name} token ids must be in [0, {vocab}) "
                                 "(the model's vocabulary)")
        if params.bad_words and self.tokenizer is None:
            raise ValueError(f"sampling_params {index}: bad_words need a tokenizer; the model folder has "
                             "none")
        cap = self.config.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if past_max_logprobs(k, cap):
                raise ValueError(f"sampling_params {index}: {name}={k} is more than max_logprobs={cap}; "
                                 "ask for fewer or raise LLM(max_logprobs=...) (-1: no cap)")
        if params.structured_outputs is not None:
            try:
                self.compile_grammar(params.structured_outputs)   # compiled now, and cached
            except ValueError as e:
                raise ValueError(f"sampling_params {index}: {e}") from None

    def compile_grammar(self, params: StructuredOutputsParams):
        """The grammar of a structured_outputs, compiled once per distinct spec while requests are
        validated, so the step loop only fills token bitmasks. Thread-safe: a server may call it
        before add_request, off its engine loop, so add_request then finds it cached."""
        if self._grammar_compiler is None:
            if self.tokenizer is None:
                raise ValueError(f"structured outputs need a tokenizer, and the engine has none "
                                 f"({NO_TOKENIZER}): pass tokenizer=FOLDER")
            from nanovllm.structured.grammars import GrammarCompiler   # xgrammar: an optional extra
            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.config.hf_config.vocab_size,
                                                     self.eos_token_ids)
        return self._grammar_compiler.compile(params)

    def lora_list(self, lora_request, n: int) -> list[LoRARequest | None]:
        """One LoRARequest (or None: the base model) per prompt, each adapter's folder checked
        against the model (check_adapter) the first time its lora_int_id comes."""
        requests = lora_per_prompt(lora_request, n, self.config.enable_lora)
        for i, r in enumerate(requests):
            if r is None:
                continue
            known = self._adapters.get(r.lora_int_id)
            if known is not None and (known.lora_path, known.lora_name) != (r.lora_path, r.lora_name):
                raise ValueError(f"lora_request {i}: lora_int_id {r.lora_int_id} is adapter "
                                 f"{known.lora_name!r} ({known.lora_path}) already; give each adapter "
                                 "its own lora_int_id")
            if known is None:
                check_adapter(r, self.config.hf_config, self.config.max_lora_rank, self.lora_modules)
                self._adapters[r.lora_int_id] = r
        return requests

    def new_seqs(self, token_ids: list[int], params: SamplingParams,
                 lora_request: LoRARequest | None = None) -> list[Sequence]:
        """The request's params.n sequences (completions 0..n-1) of checked token ids and params."""
        # n sequences share the prompt (the prefix cache shares its blocks once they are computed).
        compiled = None
        if params.structured_outputs is not None:
            from nanovllm.structured.grammars import GrammarState
            compiled = self.compile_grammar(params.structured_outputs)   # a cache hit: checked before
        seqs = [Sequence(token_ids, params, index=i, eos_token_ids=self._eos,
                         grammar=GrammarState(compiled) if compiled is not None else None,
                         lora_request=lora_request)
                for i in range(params.n)]   # each completion its own matcher
        if params.bad_words:
            bad = bad_words_token_ids(self.tokenizer, params.bad_words)
            for seq in seqs:
                seq.bad_words_ids = bad
        return seqs


def sampling_params_list(sampling_params, n: int,
                         default: Callable[[], SamplingParams]) -> list[SamplingParams]:
    """One SamplingParams per prompt, of their types and number only (their values are checked by
    the engine that runs them); None: default()'s."""
    if sampling_params is None:
        return [default()] * n
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    if not isinstance(sampling_params, (list, tuple)):
        raise TypeError(f"sampling_params must be a SamplingParams or a list of them, "
                        f"got {type(sampling_params).__name__}")
    bad = next((i for i, p in enumerate(sampling_params) if not isinstance(p, SamplingParams)), None)
    if bad is not None:
        raise TypeError(f"sampling_params {bad} is {type(sampling_params[bad]).__name__}, "
                        "not SamplingParams")
    if len(sampling_params) != n:
        raise ValueError(f"got {len(sampling_params)} SamplingParams for {n} prompts; "
                         "give one, or one per prompt")
    return list(sampling_params)


def past_max_logprobs(k: int | None, cap: int) -> bool:
    """Does a request's logprobs / prompt_logprobs k (-1: the whole vocabulary) pass LLM(max_logprobs)
    (-1: no cap)?"""
    return k is not None and cap != -1 and (k == -1 or k > cap)


def check_priority(priority, num_prompts: int):
    """vLLM's generate option, taken at its default so that vLLM code passing it explicitly runs
    unchanged: priority None or all 0 (vLLM's default first-come-first-served policy also refuses
    other priorities)."""
    if priority is not None:
        if len(priority) != num_prompts:
            raise ValueError(f"priority has {len(priority)} entries for {num_prompts} prompts")
        if any(p != 0 for p in priority):
            raise ValueError("priority: nanovllm schedules first come, first served, with no "
                             "priorities; pass None (or zeros)")


def is_token_id(t) -> bool:
    return isinstance(t, numbers.Integral) and not isinstance(t, bool)


def encode_text(tokenizer, text: str, where: str, add_special_tokens: bool = True) -> list[int]:
    """The tokenizer's ids for text; text that is not valid Unicode is a ValueError naming `where`."""
    try:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    except Exception:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:   # the tokenizer's own message does not say this
            bad = text[e.start:e.end]
            raise ValueError(f"{where}: its text is not valid Unicode ({e.reason}: {bad!r} at character "
                             f"{e.start}); a str prompt must encode to UTF-8") from None
        raise


def unwrap_prompt_dict(prompt, where: str):
    """vLLM's prompt dicts -> their text or token ids: TextPrompt {"prompt": text} or TokensPrompt
    {"prompt_token_ids": ids, optionally "prompt": their text}."""
    if not isinstance(prompt, dict):
        return prompt
    unsupported = [k for k in UNSUPPORTED_PROMPT_KEYS if k in prompt]
    if unsupported:
        raise ValueError(f"{where}: prompt key(s) {unsupported} are not supported (nanovllm runs text-only "
                         "models with one shared prefix cache)")
    text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
    unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
    if unknown or (text is None and ids is None) or (text is not None and not isinstance(text, str)) \
            or (ids is not None and not isinstance(ids, (list, tuple))):
        raise TypeError(f"{where}: a prompt dict is {{'prompt': str}} (TextPrompt) or {{'prompt_token_ids': "
                        f"[int, ...]}} with an optional 'prompt' text (TokensPrompt); got {prompt!r:.80}")
    return ids if ids is not None else text


def as_prompt_list(prompts) -> list:
    """A single prompt (string, token-id list or vLLM prompt dict) or a list of prompts -> a list of
    prompts. A list that starts with a number is one token-id prompt (so [5, 6.0] is reported as a
    bad item of prompt 0, not as a bad prompt 0)."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                            and isinstance(prompts[0], numbers.Number)):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError("prompts must be a string, a list of token ids, or a list of those; "
                        f"got {type(prompts).__name__}")
    return list(prompts)


def lora_per_prompt(lora_request, n: int, enable_lora: bool) -> list[LoRARequest | None]:
    """generate's lora_request (None, one LoRARequest, or one per prompt) as one per prompt, its
    types checked; an adapter for an engine made without enable_lora is a ValueError."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        requests = [lora_request] * n
    elif isinstance(lora_request, (list, tuple)):
        if len(lora_request) != n:
            raise ValueError(f"got {len(lora_request)} LoRARequests for {n} prompts; give one, "
                             "or one per prompt")
        requests = list(lora_request)
    else:
        raise TypeError(f"lora_request must be a LoRARequest, a list of them (one per prompt) or "
                        f"None, got {type(lora_request).__name__}")
    for i, r in enumerate(requests):
        if r is not None and not isinstance(r, LoRARequest):
            raise TypeError(f"lora_request {i} is {type(r).__name__}, not LoRARequest (from "
                            "nanovllm.lora.request import LoRARequest)")
    if any(requests) and not enable_lora:
        raise ValueError("lora_request given, but this engine serves no LoRA adapters: create it "
                         "with LLM(..., enable_lora=True)")
    return requests
