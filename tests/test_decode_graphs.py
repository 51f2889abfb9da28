"""The decode inputs' named layout (DecodeInputs) and DecodeGraphs' padding, static buffers and
replay, on CPU: a subclass records each "graph" as the plain Python step it would capture, so a
replay re-runs the forward on the views of the static buffer, as a CUDA graph reads them.
Real capture runs in tests/test_gpu_engine.py."""
import pytest
import torch

from conftest import assert_clean, random_prompts, tokens
from nanovllm import LLM, SamplingParams
from nanovllm.engine.decode_graphs import PADDING, DecodeGraphs, DecodeInputs, graph_batch_sizes
from nanovllm.engine.step_input import StepInput

BLOCK = 4


def decode_step(token_rows=None) -> StepInput:
    # Two sequences: 6 tokens in blocks [7, 3] (computes position 5), 9 tokens in [2, 5, 8] (position 8).
    return StepInput(is_prefill=False, seq_ids=[0, 1], starts=[5, 8],
                     token_ids=[[11], [0 if token_rows else 12]], block_tables=[[7, 3], [2, 5, 8]],
                     samples=[True, True], token_rows=token_rows)


def test_pack_then_view_gives_each_named_field_with_padding():
    host = DecodeInputs.pack(decode_step(), rows=4, width=3, block_size=BLOCK)
    assert host.dtype == torch.int32 and host.numel() == DecodeInputs.numel(4, 3)
    inputs = DecodeInputs.view(host.clone(), 4, 3)   # as on the device after the one copy
    assert inputs.input_ids.tolist() == [11, 12, 0, 0]
    assert inputs.positions.tolist() == [5, 8, 0, 0]
    assert inputs.slots.tolist() == [3 * BLOCK + 1, 8 * BLOCK + 0, -1, -1]   # position 5: block 1, offset 1
    assert inputs.context_lens.tolist() == [6, 9, 0, 0]
    assert inputs.token_rows.tolist() == [-1, -1, -1, -1]
    assert inputs.order.tolist() == [1, 0, 2, 3]   # the longer context first, then the padding rows
    assert inputs.lora_slots.tolist() == [-1, -1, -1, -1]   # no LoRA: the base model, padding too
    assert inputs.block_tables.tolist() == [[7, 3, 0], [2, 5, 8], [0, 0, 0], [0, 0, 0]]
    pending = DecodeInputs.view(DecodeInputs.pack(decode_step([-1, 4]), 2, 3, BLOCK), 2, 3)
    assert pending.token_rows.tolist() == [-1, 4] and pending.input_ids.tolist() == [11, 0]
    step = decode_step()
    step.lora_slots = [1, -1]
    assert DecodeInputs.view(DecodeInputs.pack(step, 3, 3, BLOCK), 3, 3).lora_slots.tolist() == [1, -1, -1]


@pytest.mark.parametrize("rows", [2, 3, 4, 6, 250])
def test_every_field_starts_on_a_16_byte_boundary(rows):
    # Triton specializes a pointer on its 16-byte alignment: unaligned views would compile every
    # decode kernel a second time (the 2-row graph did, 1.5 s of a cold start on an H100)
    host = DecodeInputs.pack(decode_step(), rows=rows, width=3, block_size=BLOCK)
    buf = torch.zeros(DecodeInputs.numel(rows, 3) + 64, dtype=torch.int32)
    buf[:host.numel()].copy_(host)
    for name, view in DecodeInputs.view(buf, rows, 3)._asdict().items():
        assert (view.data_ptr() - buf.data_ptr()) % 16 == 0, name


def test_view_reads_the_start_of_a_larger_buffer():
    big = torch.full((DecodeInputs.numel(8, 5),), 99, dtype=torch.int32)
    host = DecodeInputs.pack(decode_step(), 2, 5, BLOCK)
    big[:host.numel()].copy_(host)
    assert all(torch.equal(a, b) for a, b in zip(DecodeInputs.view(big, 2, 5), DecodeInputs.view(host, 2, 5)))


class EagerGraphs(DecodeGraphs):
    """DecodeGraphs whose "graphs" are the steps they would record, so replays run on CPU."""

    def _record(self, step, group):
        self.recorded = getattr(self, "recorded", 0) + 1
        return step


def fields(inputs: DecodeInputs) -> torch.Tensor:
    # A fake model: its "hidden state" of row i is row i of every input field.
    return torch.cat([torch.stack(list(inputs[:-1]), dim=1), inputs.block_tables], dim=1).float()


def test_graphs_pad_to_the_next_size_and_replay_on_the_static_buffer():
    graphs = EagerGraphs(fields, max_bs=6, max_blocks=3, block_size=BLOCK, hidden_size=11,
                         dtype=torch.float32, device=torch.device("cpu"))
    assert graphs.sizes == [2, 4, 6] and graphs.recorded == 3
    # The last capture (the smallest size) saw padding only: every field holds its padding value.
    capture_view = DecodeInputs.view(graphs.inputs, 2, 3)
    assert all((view == PADDING[name]).all() for name, view in capture_view._asdict().items()
               if name != "order")
    assert capture_view.order.tolist() == [0, 1]   # a permutation: each padding row its own index
    three = StepInput(is_prefill=False, seq_ids=[0, 1, 2], starts=[5, 0, 8], token_ids=[[11], [12], [13]],
                      block_tables=[[7, 3], [9], [2, 5, 8]], samples=[True] * 3)
    for step in (decode_step(), decode_step([-1, 4]), three):   # three pads to 4
        n = step.num_seqs
        out = graphs.run(step)
        assert out.shape == (n, 11) and out.data_ptr() == graphs.outputs.data_ptr()
        assert torch.equal(out, fields(DecodeInputs.view(DecodeInputs.pack(step, n, 3, BLOCK), n, 3)))
    assert DecodeInputs.view(graphs.inputs, 4, 3).order.tolist() == [2, 0, 1, 3]   # three's, padded
    assert graphs.fits(6) and not graphs.fits(7)


def test_graph_batch_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(8) == [2, 4, 8]
    sizes = graph_batch_sizes(512)
    assert sizes[:8] == [2, 4, 8, 16, 24, 32, 40, 48] and sizes[-1] == 512
    # A batch padded to size b has more than a real rows (a: the size below): at most 8 rows or a
    # quarter of b are padding.
    assert all(b - a <= max(8, b // 4) for a, b in zip(sizes, sizes[1:]))


@pytest.mark.usefixtures("one_torch_thread")
def test_engine_on_replayed_graphs_gives_the_eager_tokens(qwen3_dir):
    """The runner's decode through DecodeGraphs (batches of up to 4; 5 runs eagerly) with async
    scheduling (pending input tokens come from the device) gives the eager engine's tokens."""
    prompts = random_prompts(5, [3, 9, 17, 5, 12], seed=4)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 6, 9, 12, 15)]
    opts = dict(device="cpu", kvcache_block_size=BLOCK, num_kvcache_blocks=64, max_num_seqs=8,
                max_model_len=64)
    eager = LLM(qwen3_dir, **opts)
    expect = tokens(eager.generate(prompts, params, use_tqdm=False))
    llm = LLM(qwen3_dir, **opts)
    runner = llm.model_runner
    with torch.inference_mode():
        runner.graphs = EagerGraphs(runner.decode_forward, 4, 64 // BLOCK, BLOCK,
                                    llm.config.hf_config.hidden_size, runner.dtype, runner.device)
    replays = []
    for bs, replay in runner.graphs.replays.items():
        runner.graphs.replays[bs] = lambda bs=bs, replay=replay: replays.append(bs) or replay()
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == expect
    assert set(replays) == {2, 4}   # batches of 4 and 3 pad to 4; 2 and 1 pad to 2
    assert_clean(llm)
