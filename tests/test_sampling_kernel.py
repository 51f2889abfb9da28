"""The fused Gumbel-max sampling kernel (nanovllm/kernels/sampling.py) and when the sampler uses it.

The kernel runs under the Triton interpreter on CPU: `test_sampling_kernel_under_interpreter`
re-runs this file's `interp_` tests in a subprocess with TRITON_INTERPRET=1 (it must be set before
triton compiles the kernel). The interpreter runs ~30 ms per row, so its distribution test takes
1000 draws; the GPU test (skipped without CUDA) takes many more at Qwen3's vocabulary and prints
the kernel's time against the torch path's.
"""
import random
import time

import pytest
import torch

from conftest import interp, random_prompts, run_interpreted_tests
from nanovllm import LLM, SamplingParams
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.sampling_prep import SamplingPrep, step_seed
from nanovllm.layers.sampler import Sampler

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
LOGITS8 = [1.0, 2.0, 0.5, -0.5, 2.2, 2.2, 0.0, 1.5]   # two tied maxima: greedy picks 4


def assert_matches_softmax(tokens: torch.Tensor, logits: torch.Tensor, temperature: float, sigmas=4.0):
    # tokens: [draws] sampled from logits [vocab]: each token's frequency within `sigmas` standard errors
    draws = tokens.numel()
    probs = torch.softmax(logits.double() / temperature, dim=-1).cpu()
    freq = torch.bincount(tokens.cpu(), minlength=probs.numel()).double() / draws
    stderr = (probs * (1 - probs) / draws).sqrt()
    assert ((freq - probs).abs() <= sigmas * stderr + 1e-12).all(), (freq, probs)


# ---- when the fused path applies (CPU, no kernel) ----------------------------------------------

def test_row_seeds_only_for_temperature_only_steps_of_a_fused_sampler():
    seqs = [Sequence([5, 6], SamplingParams(temperature=0.6)),
            Sequence([5, 6], SamplingParams(temperature=0.6, seed=7)),
            Sequence([5, 6], SamplingParams(temperature=0))]
    t = SamplingPrep(16, seed=0, fused=True).prepare(seqs)
    seeds = t.row_seeds.tolist()
    assert seeds[1] == step_seed(7, seqs[1].index, 0) & (2 ** 63 - 1)   # seeded: batch-independent
    assert seeds[2] == 0 and 0 <= seeds[0] < 2 ** 63
    assert seeds[0] == random.Random(0).getrandbits(63)   # unseeded: the engine seed's first draw
    # The same engine seed gives the same unseeded seeds; a new step gives fresh ones.
    prep = SamplingPrep(16, seed=0, fused=True)
    assert prep.prepare(seqs).row_seeds.tolist() == seeds
    assert prep.prepare(seqs).row_seeds[0].item() != seeds[0]
    # Not fused (CPU by default) or another knob: the torch path, with its seed list.
    assert SamplingPrep(16).prepare(seqs).row_seeds is None
    for extra in (dict(top_k=3), dict(top_p=0.9), dict(min_p=0.1), dict(logprobs=1),
                  dict(presence_penalty=0.5), dict(min_tokens=2, stop_token_ids=[3])):
        other = Sequence([5, 6], SamplingParams(temperature=0.6, **extra))
        t = SamplingPrep(16, seed=0, fused=True).prepare(seqs + [other])
        assert t.row_seeds is None and t.seeds == [(1, step_seed(7, seqs[1].index, 0))], extra


def test_cpu_logits_take_the_torch_path_even_with_row_seeds():
    seqs = [Sequence([5], SamplingParams(temperature=0.6, seed=3))]
    t = SamplingPrep(8, fused=True).prepare(seqs)
    assert t.row_seeds is not None
    logits = torch.tensor([LOGITS8]).bfloat16()   # the torch path converts to fp32 itself
    expect = Sampler().sample(logits.float(), SamplingPrep(8).prepare(seqs)).token_ids
    assert torch.equal(Sampler().sample(logits, t).token_ids, expect)


# ---- the kernel under the interpreter ----------------------------------------------------------

def test_sampling_kernel_under_interpreter():
    run_interpreted_tests(__file__)


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interp_greedy_rows_are_the_argmax_lowest_index_on_ties(dtype):
    from nanovllm.kernels.sampling import gumbel_max_sample
    torch.manual_seed(0)
    vocab = 4 * 1024 + 37   # two loop steps, the second partly masked
    logits = torch.randn(5, vocab).to(dtype)
    logits[1, [9, 3000, 4100]] = 50.0             # ties in different lanes and loop steps
    logits[2, [2000, 2000 + 1024]] = 50.0         # ties in one lane, different Philox words
    logits[3] = float("-inf")                     # torch.argmax gives 0
    logits[4, vocab - 1] = 60.0                   # the last, odd column
    temps = torch.zeros(5)
    seeds = torch.arange(5)
    tokens = gumbel_max_sample(logits, temps, seeds)
    assert tokens.dtype == torch.int64
    assert (tokens.tolist() == logits.float().argmax(dim=-1).tolist()
            == [tokens[0].item(), 9, 2000, 0, vocab - 1])


@interp
def test_interp_a_seed_fixes_the_token_whatever_the_batch():
    from nanovllm.kernels.sampling import gumbel_max_sample
    torch.manual_seed(1)
    logits = torch.randn(4, 300)
    temps = torch.tensor([1.0, 0.0, 2.0, 5.0])
    seeds = torch.tensor([11, 12, 2 ** 62 + 5, 14])
    first = gumbel_max_sample(logits, temps, seeds, quarter=16)
    assert torch.equal(gumbel_max_sample(logits, temps, seeds, quarter=16), first)
    alone = gumbel_max_sample(logits[2:3], temps[2:3], seeds[2:3], quarter=16)
    flipped = gumbel_max_sample(logits.flip(0), temps.flip(0), seeds.flip(0), quarter=16)
    assert alone.item() == first[2].item() and torch.equal(flipped.flip(0), first)
    assert first[1].item() == logits[1].argmax().item()   # a greedy row among sampled ones
    # Other seeds (or another offset) draw differently: at T=5 over 300 tokens, 8 draws are not all equal.
    row = logits[3:4].expand(8, -1).contiguous()
    assert len(set(gumbel_max_sample(row, torch.full((8,), 5.0), torch.arange(8), quarter=16).tolist())) > 1
    offsets = {gumbel_max_sample(logits[3:4], temps[3:4], seeds[3:4], offset=k, quarter=16).item()
               for k in range(8)}
    assert len(offsets) > 1


@interp
def test_interp_chunks_of_the_vocabulary_change_no_token():
    from nanovllm.kernels.sampling import gumbel_max_sample
    torch.manual_seed(3)
    logits = torch.randn(6, 300)                  # quarter 16: 5 loop steps of 64 columns
    logits[0, [10, 70, 290]] = 40.0               # greedy ties in the first, second and last chunk
    logits[1, [200, 260]] = 40.0                  # ... in two later chunks only
    logits[2] = float("-inf")                     # no finite score anywhere: column 0
    temps = torch.tensor([0.0, 0.0, 0.0, 0.7, 1.0, 3.0])
    seeds = torch.arange(6) + 40
    draws = [gumbel_max_sample(logits, temps, seeds, quarter=16, num_chunks=c) for c in (1, 2, 3, 5, 9)]
    assert all(torch.equal(d, draws[0]) for d in draws[1:])
    assert draws[0][:3].tolist() == [10, 200, 0]


@interp
def test_interp_bf16_logits_draw_like_their_fp32_values():
    from nanovllm.kernels.sampling import gumbel_max_sample
    torch.manual_seed(2)
    logits = torch.randn(6, 200).bfloat16()
    temps, seeds = torch.full((6,), 0.8), torch.arange(100, 106)
    assert torch.equal(gumbel_max_sample(logits, temps, seeds, quarter=16),
                       gumbel_max_sample(logits.float(), temps, seeds, quarter=16))


@interp
def test_interp_draws_follow_softmax_over_temperature():
    from nanovllm.kernels.sampling import gumbel_max_sample
    draws = 1000
    logits = torch.tensor(LOGITS8).repeat(draws, 1)
    tokens = gumbel_max_sample(logits, torch.full((draws,), 0.7), torch.arange(draws), quarter=2)
    assert_matches_softmax(tokens, logits[0], 0.7)


@interp
def test_interp_a_bitmask_forbids_its_columns_and_keeps_the_other_draws():
    from nanovllm.kernels.sampling import gumbel_max_sample
    torch.manual_seed(4)
    n, vocab = 64, 300                            # 10 words, the last one partly past the vocabulary
    logits = torch.randn(n, vocab) * 3
    temps, seeds = torch.cat([torch.zeros(1), torch.full((n - 1,), 1.5)]), torch.arange(n) + 7
    allowed = torch.zeros(n, vocab, dtype=torch.bool)
    allowed[:, [3, 40, 41, 299]] = True           # a few tokens, none of them likely
    allowed[1] = True                             # a row without a grammar: all allowed
    bits = torch.zeros(n, 10 * 32, dtype=torch.int64)
    bits[:, :vocab] = allowed.long()
    words = (bits.view(n, 10, 32) << torch.arange(32)).sum(-1)
    bitmask = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    tokens = gumbel_max_sample(logits, temps, seeds, quarter=16, bitmask=bitmask)
    assert allowed.gather(1, tokens.unsqueeze(1)).all()
    assert tokens[0].item() == logits[0].masked_fill(~allowed[0], float("-inf")).argmax().item()
    free = gumbel_max_sample(logits, temps, seeds, quarter=16)
    assert tokens[1].item() == free[1].item()     # the unmasked row draws as without a bitmask
    assert len(set(tokens[2:].tolist())) > 1


# ---- on the GPU --------------------------------------------------------------------------------

@cuda
def test_gpu_fused_sampler_at_qwen3_vocab():
    from nanovllm.kernels.sampling import gumbel_max_sample
    n, vocab, rounds = 256, 151936, 40
    gen = torch.Generator(device="cuda").manual_seed(0)
    # Most mass on 12 tokens (the rest share what is left): draws per token checkable in 40 rounds.
    base = torch.randn(vocab, device="cuda", generator=gen) - 6
    base[:12] = torch.linspace(0.0, 2.0, 12, device="cuda")
    logits = base.repeat(n, 1).bfloat16()
    temps = torch.full((n,), 0.6, device="cuda")
    tokens = torch.cat([gumbel_max_sample(logits, temps, torch.arange(n, device="cuda") + r * n)
                        for r in range(rounds)])
    probs = torch.softmax(logits[0].double() / 0.6, -1)
    lumped = torch.cat([probs[:12], probs[12:].sum(0, keepdim=True)])        # 12 tokens + the rest
    lumped_tokens = tokens.clamp(max=12)
    draws = tokens.numel()
    freq = torch.bincount(lumped_tokens, minlength=13).double() / draws
    stderr = (lumped * (1 - lumped) / draws).sqrt()
    assert ((freq - lumped).abs() <= 4 * stderr + 1e-12).all(), (freq, lumped)
    # Greedy rows are the argmax; a seeded row does not depend on the batch.
    noisy = torch.randn(n, vocab, device="cuda", generator=gen).bfloat16()
    greedy = gumbel_max_sample(noisy, torch.zeros(n, device="cuda"), torch.arange(n, device="cuda"))
    assert torch.equal(greedy, noisy.argmax(dim=-1))
    seeds = torch.arange(n, device="cuda")
    assert gumbel_max_sample(logits[5:6], temps[5:6], seeds[5:6]).item() == \
        gumbel_max_sample(logits, temps, seeds)[5].item()
    print_timing(logits, temps, seeds)


@cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_engine_takes_the_fused_path_reproducibly(qwen3_dir, dtype, monkeypatch):
    """Temperature-only requests on CUDA: a seeded one ignores its batch (fp32: in bf16 another
    batch size rounds the logits differently, which may flip a near-tie), and the same config
    seed repeats an unseeded run."""
    import nanovllm.kernels.sampling as kernel
    calls = []
    fused = kernel.gumbel_max_sample
    monkeypatch.setattr(kernel, "gumbel_max_sample", lambda *a, **k: calls.append(1) or fused(*a, **k))
    prompts = random_prompts(4, [7, 12, 5, 9], seed=3)
    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True)
    free = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def run(llm, prompts, params):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    llm = LLM(qwen3_dir, device="cuda", dtype=dtype, kvcache_block_size=16, num_kvcache_blocks=64)
    alone = run(llm, prompts[:1], seeded)[0]
    batched = run(llm, prompts, [seeded, free, greedy, free])[0]
    assert batched == alone or dtype == "bfloat16"
    assert calls   # the fused kernel did the drawing
    first = run(LLM(qwen3_dir, device="cuda", dtype=dtype, kvcache_block_size=16, num_kvcache_blocks=64,
                    seed=5), prompts, free)
    again = run(LLM(qwen3_dir, device="cuda", dtype=dtype, kvcache_block_size=16, num_kvcache_blocks=64,
                    seed=5), prompts, free)
    assert first == again


def print_timing(logits, temps, seeds):
    from nanovllm.kernels.sampling import gumbel_max_sample
    from nanovllm.layers.sampler import SamplingTensors

    def median_ms(fn, reps=50):
        fn()
        times = []
        for _ in range(reps):
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
        return sorted(times)[reps // 2]

    torch_params = SamplingTensors(temperatures=temps, all_greedy=False)
    sampler = Sampler()
    fused = median_ms(lambda: gumbel_max_sample(logits, temps, seeds))
    unfused = median_ms(lambda: sampler.sample(logits, torch_params))   # converts to fp32 first
    print(f"\nsampling {tuple(logits.shape)} bf16 T=0.6: fused {fused:.3f} ms, torch path {unfused:.3f} ms")


@cuda
def test_gpu_fused_sampler_never_draws_a_masked_token():
    from nanovllm.kernels.sampling import gumbel_max_sample
    n, vocab = 256, 151936
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(n, vocab, device="cuda", generator=gen).bfloat16()
    allowed = torch.rand(n, vocab, device="cuda", generator=gen) < 0.001   # about 150 tokens a row
    bits = (allowed.view(n, -1, 32).long() << torch.arange(32, device="cuda")).sum(-1)
    bitmask = torch.where(bits >= 2 ** 31, bits - 2 ** 32, bits).to(torch.int32)
    for step in range(20):
        seeds = torch.randint(0, 2 ** 62, (n,), device="cuda", generator=gen)
        tokens = gumbel_max_sample(logits, torch.full((n,), 1.0, device="cuda"), seeds, bitmask=bitmask)
        assert allowed.gather(1, tokens.unsqueeze(1)).all(), step
