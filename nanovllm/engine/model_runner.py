"""Builds the model on its device, owns the paged KV cache and the decode CUDA graphs, and turns
a ScheduledBatch into sampled token ids."""
import gc
import logging
import os
import time
from collections.abc import Callable
from contextlib import contextmanager

import torch

from nanovllm.config import Config
from nanovllm.engine.block_manager import cache_slots, cdiv
from nanovllm.engine.decode_graphs import DecodeGraphs, DecodeInputs
from nanovllm.engine.devices import default_dtype, pick_device, pick_dtype, pick_kv_cache_dtype
from nanovllm.engine.sampled_tokens import PendingSample, prompt_logprobs
from nanovllm.engine.sampling_prep import SamplingPrep
from nanovllm.engine.scheduler import ScheduledBatch
from nanovllm.engine.state_cache import allocate_beside_kv
from nanovllm.engine.step_input import StepInput
from nanovllm.kernels import paged_kv_slots
from nanovllm.layers.attention import Attention, kv_scale_rows, warm_up_store
from nanovllm.layers.prefill_attention import select_prefill_attention
from nanovllm.layers.sampler import Sampler
from nanovllm.lora.layers import LoRAModel
from nanovllm.models import build_model
from nanovllm.quantization import finish_loading, prepare_model, quantization_of
from nanovllm.spec.verify import sample_verify_step
from nanovllm.utils.context import Context, forward_context
from nanovllm.parallel.parallel_state import (TPGroup, broadcast, connect_peer_all_reduce, host_barrier,
                                              min_across_ranks, tp_group, wait_for_device)
from nanovllm.utils.loader import load_dummy_weights, load_model

logger = logging.getLogger(__name__)
CPU_KV_CACHE_BYTES = 1 << 30   # default KV budget on CPU (override: kv_cache_memory_bytes)


class BrokenLogitsError(ValueError):
    """NaN or inf in the first logits: the weights are broken. Raised after every rank finished the
    step, so tensor-parallel ranks stay in step."""


class ModelRunner:
    def __init__(self, config: Config, group: TPGroup | None = None):
        """group: this rank's tensor-parallel group (None: one rank)."""
        self.config = config
        self.group = group
        self.block_size = config.kvcache_block_size
        self.device = pick_device(config)
        self.dtype = pick_dtype(config, self.device)
        self.kv_cache_dtype = pick_kv_cache_dtype(config, self.dtype)
        self.use_cuda = self.device.type == "cuda"
        # Chosen before the model loads, so a forced prefill kernel that cannot run fails at once.
        self.prefill_attention = select_prefill_attention(config.prefill_attention, self.device, self.dtype,
                                                          self.kv_cache_dtype)
        self.prefill_attention.log(logger, first_rank=group is None or group.rank == 0)
        torch.manual_seed(config.seed)
        self.startup_seconds: dict[str, float] = {}   # phase -> seconds, for logs and bench.py
        self.logits_checked = False   # see check_first_logits
        with tp_group(group):   # layers take their shard from it; their collectives run in it
            with self._timed("load model"):
                with self.device, default_dtype(self.dtype):
                    self.model = build_model(config)
                    plan = prepare_model(self.model, quantization_of(config), config.load_format)
                if config.load_format == "dummy":
                    load_dummy_weights(self.model, config.seed)
                else:
                    load_model(self.model, config.model, plan.names)
                finish_loading(self.model, plan)   # fold the norms, quantize at load
                self.lora = LoRAModel.of(self.model, config)   # None unless enable_lora
            host_barrier("loaded")   # every rank has its shard: only now the first collective
            if not config.disable_custom_all_reduce:
                connect_peer_all_reduce(self.device)   # decode-sized sums over peer memory (CUDA TP)
            self.model.eval()
            self.sampling_prep = SamplingPrep(config.hf_config.vocab_size, self.device, config.seed)
            self.sampler = Sampler()
            # The last step's sampled token ids on the device (row i: its i-th sampling sequence), read by a
            # step launched before they reach the host (run_ahead.py); a huge max_num_seqs costs nothing.
            rows = min(config.max_num_seqs, config.max_num_batched_tokens)
            self.sampled_tokens = torch.zeros(rows, dtype=torch.int64, device=self.device)
            self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
            for layer in self.attention_layers:
                layer.backend = self.prefill_attention.backend
            if self.use_cuda:
                with self._timed("warm-up (and compile)"):
                    self.warmup_model()
            self.num_kvcache_blocks = self.allocate_kv_cache()
            self.graphs: DecodeGraphs | None = None
            if self.use_cuda and not config.enforce_eager and config.pooling is None:   # pooling: no decode
                with self._timed("capture CUDA graphs"):
                    self.graphs = self.capture_cudagraph()
        logger.info("start-up: %s; KV cache: %d blocks of %d tokens = %d tokens (%s, %.2f GiB)",
                    ", ".join(f"{k} {v:.1f}s" for k, v in self.startup_seconds.items()),
                    self.num_kvcache_blocks, self.block_size, self.num_kvcache_blocks * self.block_size,
                    str(self.kv_cache_dtype).removeprefix("torch."),
                    self.kv_cache.numel() * self.kv_cache.element_size() / 2 ** 30)

    @contextmanager
    def _timed(self, phase: str):
        t = time.perf_counter()
        yield
        self.startup_seconds[phase] = time.perf_counter() - t

    # ---- start-up -------------------------------------------------------------------------
    @torch.inference_mode()
    def warmup_model(self):
        """Run the largest prefill once so the KV budget accounts for its peak activations."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        c = self.config
        seq_len = min(c.max_num_batched_tokens, c.max_model_len)
        num_seqs = max(1, min(c.max_num_batched_tokens // seq_len, c.max_num_seqs))
        cu = torch.arange(0, (num_seqs + 1) * seq_len, seq_len, dtype=torch.int32, device=self.device)
        input_ids = torch.zeros(num_seqs * seq_len, dtype=torch.int64, device=self.device)
        # LoRA: all tokens in slot 0 (empty), so its prefill kernels compile now and count in the peak
        ctx = Context(is_prefill=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=seq_len,
                      max_seqlen_k=seq_len, lora=self.lora and self.lora.batch(input_ids.int()),
                      slot_mapping=torch.full_like(input_ids, -1, dtype=torch.int32))   # stored nowhere
        positions = torch.arange(seq_len, dtype=torch.int32, device=self.device).repeat(num_seqs)
        compiled = self.prefill_attention.start_warm_up(self.attention_layers[0], self.block_size, self.dtype,
                                                        self.kv_cache_dtype, seq_len)
        with forward_context(ctx), warm_up_store(self.attention_layers, self.block_size, self.kv_cache_dtype,
                                                 self.device):
            hidden = self.model(input_ids, positions)
        self.sampler.sample(self.model.compute_logits(hidden[cu[1:] - 1]).float(), None)
        compiled()
        wait_for_device(self.device)

    def kv_bytes_per_block(self) -> int:
        attn = self.attention_layers[0]
        return (2 * len(self.attention_layers) * self.block_size * attn.num_kv_heads * attn.head_dim
                * self.kv_cache_dtype.itemsize)

    def kv_cache_budget(self) -> int:
        c = self.config
        if c.kv_cache_memory_bytes is not None:
            return c.kv_cache_memory_bytes
        if not self.use_cuda:
            # Enough for max_num_seqs full-length sequences, but at most CPU_KV_CACHE_BYTES.
            need = c.max_num_seqs * cdiv(c.max_model_len, self.block_size) * self.kv_bytes_per_block()
            return min(CPU_KV_CACHE_BYTES, need)
        # Memory this process reserved in torch's caching allocator but holds no tensor in (a
        # deleted engine's, say) is ours to use: count only the allocator's peak of live tensors
        # (weights + warm-up activations), and what others (and CUDA itself) hold outside it.
        free, total = torch.cuda.mem_get_info()
        stats = torch.cuda.memory_stats()
        outside_allocator = (total - free) - stats["reserved_bytes.all.current"]
        peak = stats["allocated_bytes.all.peak"]
        return int(total * c.gpu_memory_utilization - outside_allocator - peak)

    def allocate_kv_cache(self) -> int:
        num_blocks, self.state_cache = allocate_beside_kv(self.model, self.config, self.dtype, self.device,
                                                          self.kv_cache_budget, self.kv_bytes_per_block())
        # Every rank's scheduler view is rank 0's, so all ranks must hold the same number of blocks.
        num_blocks = min_across_ranks(num_blocks, self.device)
        if num_blocks < 1:
            per_block = f"{self.kv_bytes_per_block()} bytes per block of {self.block_size} tokens"
            if self.config.kv_cache_memory_bytes is not None:
                raise ValueError(f"kv_cache_memory_bytes={self.config.kv_cache_memory_bytes} "
                                 f"is less than one KV block ({per_block}): raise it")
            raise ValueError(
                f"no memory left for the KV cache ({per_block}): raise gpu_memory_utilization "
                f"(now {self.config.gpu_memory_utilization}), lower max_num_batched_tokens, "
                "or set kv_cache_memory_bytes / num_kvcache_blocks")
        self.check_kv_fits(num_blocks)
        attn = self.attention_layers[0]
        # kv_cache: [2 (k, v), num_layers, num_blocks, block_size, num_kv_heads, head_dim]
        self.kv_cache = torch.zeros(2, len(self.attention_layers), num_blocks, self.block_size,
                                    attn.num_kv_heads, attn.head_dim, dtype=self.kv_cache_dtype,
                                    device=self.device)
        for i, layer in enumerate(self.attention_layers):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
        if self.kv_cache_dtype == torch.float8_e4m3fn:
            # kv_scales: [2 (k, v), num_layers, 1] fp32 (1.0, or the checkpoint's), read by the kernels on
            # the device: the first column of 16-byte rows, so every layer's scale is 16-byte aligned
            # (Triton specialises pointers on that: packed scales gave each FP8 kernel two variants).
            rows = kv_scale_rows(self.model, len(self.attention_layers)).to(self.device)
            self.kv_scales = rows[:, :, :1]
            for i, layer in enumerate(self.attention_layers):
                layer.k_scale, layer.v_scale = self.kv_scales[0, i], self.kv_scales[1, i]
                layer.calculate_kv_scales = self.config.calculate_kv_scales
        return num_blocks

    def check_kv_fits(self, num_blocks: int):
        """An explicit num_kvcache_blocks or kv_cache_memory_bytes larger than the device's memory is an
        error before anything is allocated (on CPU, zero-filling it would end in the OOM killer).
        On CPU every tensor-parallel rank's cache is in the same host memory."""
        ranks = 1 if self.use_cuda else self.config.tensor_parallel_size
        need = num_blocks * self.kv_bytes_per_block() * ranks
        if self.use_cuda:
            total = torch.cuda.mem_get_info()[1]
        else:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if need > total:
            each, in_all = ("", "") if ranks == 1 else (f" on each of {ranks} ranks (one host's memory)",
                                                         " in all")
            raise ValueError(f"the KV cache of {num_blocks} blocks{each} needs {need / 2**30:.1f} GiB"
                             f"{in_all}, more than the {total / 2**30:.1f} GiB of memory of the device "
                             f"({self.device}): lower num_kvcache_blocks or kv_cache_memory_bytes")

    # ---- inputs ---------------------------------------------------------------------------
    def _tensor(self, data, dtype) -> torch.Tensor:
        t = torch.tensor(data, dtype=dtype, pin_memory=self.use_cuda)
        return t.to(self.device, non_blocking=True)

    def prepare_prefill(self, step: StepInput):
        input_ids, positions, slots, cu_q, cu_k, logits_indices = [], [], [], [0], [0], []
        logit_rows = iter(step.logit_rows or ())
        for start, ids, table, samples in zip(step.starts, step.token_ids, step.block_tables, step.samples):
            end = start + len(ids)
            input_ids.extend(ids)
            positions.extend(range(start, end))
            slots.extend(cache_slots(table, start, end, self.block_size))
            cu_q.append(cu_q[-1] + len(ids))
            cu_k.append(cu_k[-1] + end)
            if samples:   # its last row, or (verifying drafts) its last 1 + k rows
                rows = next(logit_rows) if step.logit_rows else 1
                logits_indices.extend(range(cu_q[-1] - rows, cu_q[-1]))
        # Rows after the sampling rows: the positions whose logits give prompt logprobs.
        for first, count in zip(cu_q, step.prompt_logprob_counts or ()):
            logits_indices.extend(range(first, first + count))
        cu_seqlens_k = self._tensor(cu_k, torch.int32)
        block_tables = kv_slots = None
        if any(step.starts):   # some sequence has a cached prefix: keys are read from the pages
            width = max(map(len, step.block_tables))
            block_tables = self._tensor([t + [-1] * (width - len(t)) for t in step.block_tables], torch.int32)
            kv_slots = paged_kv_slots(block_tables, cu_seqlens_k, cu_k[-1], self.block_size)
        ctx = Context(is_prefill=True, cu_seqlens_q=self._tensor(cu_q, torch.int32),
                      cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max(map(len, step.token_ids)),
                      max_seqlen_k=max(b - a for a, b in zip(cu_k, cu_k[1:])),
                      slot_mapping=self._tensor(slots, torch.int32),
                      block_tables=block_tables, kv_slots=kv_slots,
                      lora=self.lora and self.lora.prefill_batch(step, self.device),
                      state_slots=step.state_slots and self._tensor(step.state_slots, torch.int64))
        return (self._tensor(input_ids, torch.int64), self._tensor(positions, torch.int32), ctx,
                self._tensor(logits_indices, torch.int64))

    def decode_forward(self, inputs: DecodeInputs) -> torch.Tensor:
        """The model on one decode step's inputs (on the device): eager, or recorded into a graph,
        where the pending-token lookup must be recorded too. An input whose token row is set
        comes from sampled_tokens (the previous step's, still pending on the host)."""
        pending = self.sampled_tokens.index_select(0, inputs.token_rows.clamp(min=0))
        input_ids = torch.where(inputs.token_rows >= 0, pending, inputs.input_ids)
        ctx = Context(is_prefill=False, slot_mapping=inputs.slots, context_lens=inputs.context_lens,
                      block_tables=inputs.block_tables, decode_order=inputs.order,
                      lora=self.lora and self.lora.batch(inputs.lora_slots), state_slots=inputs.state_slots)
        with forward_context(ctx):
            return self.model(input_ids, inputs.positions)

    # ---- running --------------------------------------------------------------------------
    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, step: StepInput | None = None,
               before_sampling: Callable[[], None] | None = None) -> PendingSample:
        """Queue the batch's model step and sampling on the device and return at once; the
        PendingSample's result() waits for one sampled token (and its logprobs when asked) per
        sequence that reached its end; they also stay on the device (keep_sampled). step: the
        batch's StepInput when the caller built it already (to send it to the other ranks).
        before_sampling: called once the forward pass is queued, before sampling is prepared (where
        RunAhead applies the previous step's tokens, for a grammar's bitmask)."""
        if not batch.seqs:
            return PendingSample(None, None)
        step = step or self.step_input(batch)
        logits = self.forward_step(step)
        if logits is None or self.config.pooling is not None:   # mid-prompt chunks only, or pooled shares
            return PendingSample(None, None) if logits is None else PendingSample.pooling(batch, logits)
        prompt = None
        if step.prompt_logprob_counts:   # their rows follow the sampling rows
            num_sampling = len(batch.sampling_seqs)
            logits, prompt = logits[:num_sampling], prompt_logprobs(logits[num_sampling:], batch, step)
        out = sampling = None
        if logits.size(0):   # else a prefill step that only computed prompt logprobs: nothing sampled
            if not self.logits_checked:
                self.check_first_logits(logits)
            if before_sampling is not None:
                before_sampling()
            if batch.draft_tokens is not None:   # speculative decoding: verified at once
                return self.verify_drafts(logits, batch)
            # Built while the device runs the forward pass just queued: the host's share of sampling
            # (a grammar's token bitmasks, penalty counts) overlaps it.
            sampling = self.sampling_prep.prepare(batch.sampling_seqs)
            out = self.sampler.sample(logits, sampling)
            self.keep_sampled(out.token_ids)
        return PendingSample(out, sampling, prompt)

    def verify_drafts(self, logits: torch.Tensor, batch: ScheduledBatch) -> PendingSample:
        """A verify step's sampling (speculative decoding: spec/verify.py), on the host at once.
        logits: [sum of the sampling sequences' rows, vocab]."""
        drafts = [d for d, samples in zip(batch.draft_tokens, batch.samples) if samples]
        sampled = sample_verify_step(logits, batch.sampling_seqs, drafts, self.sampler, self.sampling_prep)
        last = [ids[-1] for ids in sampled.token_ids]
        # one row per sampling sequence, as the other ranks count them (worker_main.py)
        self.keep_sampled(torch.tensor(last, dtype=torch.int64, device=self.device))
        return PendingSample.known_result(sampled)

    def check_first_logits(self, logits: torch.Tensor):
        """NaN or inf logits mean broken weights (or a float16 overflow); sampling would turn them into
        token 0 forever. Checked once per engine, on the first logits (a device sync), not every step."""
        if bool(torch.isfinite(logits).all()):
            self.logits_checked = True
            return
        # Send rank 0's (dummy) tokens all the same, so the other ranks stay in step.
        self.keep_sampled(torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device))
        fp16 = " (or float16 activations overflow: try dtype='bfloat16')" \
            if self.dtype == torch.float16 else ""
        raise BrokenLogitsError(f"the model's logits contain NaN or inf: the weights in "
                                f"{self.config.model!r} are broken (NaN or inf in the checkpoint){fp16}")

    def step_input(self, batch: ScheduledBatch) -> StepInput:
        """What every rank needs to run the batch (the other ranks get it from rank 0)."""
        return StepInput.of(batch, self.lora and self.lora.slots)

    def keep_sampled(self, token_ids: torch.Tensor):
        """Rank 0: store a step's sampled tokens, row i for its i-th sampling sequence, where the next
        step may read its input tokens (see run_ahead.py), and send them to the other ranks."""
        self.sampled_tokens[:token_ids.numel()].copy_(token_ids)
        self.share_sampled(token_ids.numel())

    def share_sampled(self, n: int):
        """Every rank, after a step that sampled n tokens (the same n on every rank): rank 0's
        sampled_tokens rows reach the others. 0 (a step that only computed prompt logprobs): nothing."""
        if n and self.group is not None and self.group.size > 1:
            with tp_group(self.group):
                broadcast(self.sampled_tokens[:n])

    @torch.inference_mode()
    def forward_step(self, step: StepInput) -> torch.Tensor | None:
        """Run the model on one step; every rank runs it (its collectives need them all). Returns the
        logits of the sampling positions, [num_sampling_seqs, vocab] in the model's dtype, on every
        rank, or None when no sequence samples; a pooling model's shares of its outputs (layers/pooler.py)."""
        with tp_group(self.group):
            if step.lora_loads:   # adapters new to their GPU slots (in stream order after the last step)
                self.lora.load_all(step.lora_loads, self.config.hf_config)
            for src, dst, n in step.kv_copies or ():   # prefix-cache partial hits, before any write
                self.kv_cache[:, :, dst, :n] = self.kv_cache[:, :, src, :n]
            if step.is_prefill:
                input_ids, positions, ctx, logits_indices = self.prepare_prefill(step)
                with forward_context(ctx):
                    hidden = self.model(input_ids, positions)
                if logits_indices.numel() == 0:   # mid-prompt chunks only, or a pooling step
                    return self.model.pool(hidden, step) if self.config.pooling is not None else None
                hidden = hidden[logits_indices]
            else:
                hidden = self.run_decode(step)
            return self.model.compute_logits(hidden)

    def run_decode(self, step: StepInput) -> torch.Tensor:
        if self.graphs is not None and self.graphs.fits(step.num_seqs):
            return self.graphs.run(step)
        n, width = step.num_seqs, max(map(len, step.block_tables))
        host = DecodeInputs.pack(step, n, width, self.block_size, pin=self.use_cuda)
        return self.decode_forward(DecodeInputs.view(host.to(self.device, non_blocking=True), n, width))

    @torch.inference_mode()
    def capture_cudagraph(self) -> DecodeGraphs:
        """Decode CUDA graphs for batches up to max_num_seqs (at most 512; larger ones run eagerly)."""
        c = self.config
        max_bs, max_blocks = min(c.max_num_seqs, 512), cdiv(c.max_model_len, self.block_size)
        return DecodeGraphs(self.decode_forward, max_bs, max_blocks,
                            self.block_size, c.hf_config.hidden_size, self.dtype, self.device, self.group)

    # ---- shutdown -------------------------------------------------------------------------
    def release(self):
        """Give the device memory back: KV cache, CUDA graphs, model. Idempotent; the runner
        cannot run afterwards. (The group, if any, must be destroyed first: it resets the graphs
        that captured its collectives.)"""
        for layer in self.attention_layers:
            layer.k_cache = layer.v_cache = None
        self.attention_layers = []
        # the group too: it holds the rendezvous store and gloo's sockets until collected
        self.graphs = self.kv_cache = self.model = self.sampled_tokens = self.group = self.lora = None
        self.state_cache = None
        # The model's layers and their parameters reference each other (each parameter's
        # weight_loader is a bound method of its layer): only the cycle collector frees them, so
        # collect now, before giving the memory back, and also when automatic collection is off.
        gc.collect()
        if self.use_cuda:
            torch.cuda.empty_cache()
