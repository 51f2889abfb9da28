"""Beam search as vLLM's LLM.beam_search runs it: every step asks the engine for one token with
the top 2 * beam_width logprobs of each beam, extends each beam with those tokens, and keeps the
beam_width best by length-normalised score. Each step's beams are prompts that share their leading
KV blocks through the prefix cache, so only the new tail of each beam is computed."""
from dataclasses import dataclass, field

from nanovllm.outputs import Logprob


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0              # of the step that proposes each beam's next tokens
    length_penalty: float = 1.0           # score = cumulative logprob / length ** length_penalty
    include_stop_str_in_output: bool = False   # vLLM's field; the EOS token is never in a beam's text

    def __post_init__(self):
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name, ok in (("temperature", lambda v: v >= 0), ("length_penalty", lambda v: True)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
                at_least = " >= 0" if name == "temperature" else ""
                raise ValueError(f"{name} must be a number{at_least}, got {value!r}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")


@dataclass
class BeamSearchSequence:
    tokens: list[int]                     # the prompt and the beam's tokens, as in vLLM
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)   # one dict per generated token
    cum_logprob: float = 0.0
    text: str | None = None               # the returned beams': `tokens` decoded, prompt and EOS text too
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]   # the best beam_width beams, best score first


def get_beam_search_score(tokens: list[int], cumulative_logprob: float, eos_token_id,
                          length_penalty: float = 1.0) -> float:
    """vLLM's: the score beams are sorted by, the cumulative logprob over the length (prompt
    included, a final EOS not) to the power length_penalty. eos_token_id: one id, as vLLM takes
    it, or a set of them (the engine's EOS ids, which end a beam here)."""
    eos = {eos_token_id} if isinstance(eos_token_id, int) else eos_token_id
    length = len(tokens) - (tokens[-1] in eos)
    return cumulative_logprob / (length ** length_penalty)


def beam_score(beam: BeamSearchSequence, eos_token_ids, length_penalty: float) -> float:
    return get_beam_search_score(beam.tokens, beam.cum_logprob, eos_token_ids, length_penalty)


def extend(beam: BeamSearchSequence, step_logprobs: dict[int, Logprob]) -> list[BeamSearchSequence]:
    """beam followed by each token of one step's logprobs."""
    return [BeamSearchSequence(beam.tokens + [t], beam.logprobs + [step_logprobs],
                               beam.cum_logprob + lp.logprob)
            for t, lp in step_logprobs.items()]
