"""LoRA on the decoder's linear layers: each qkv_proj, o_proj, gate_up_proj and down_proj gets a
LoRALinear (its `lora` attribute), which the layer runs before any all-reduce. A LoRALinear holds
max_loras slots of zero-padded A and B matrices (kernels/lora.py); the step's LoRABatch (in the
forward context) says which slot each token uses. A layer of unquantized weights without a bias
keeps the slots' A as rows under its own weight (one buffer [out + max_loras x R, in], the layer's
weight a view of its first rows): in a step with a LoRABatch (every decode step of a LoRA engine,
and each prefill step with an adapter's tokens) its GEMM gives x W^T and every slot's A x at once,
and the expand adds each token's B (A x) ("folded"). An FP8 or biased layer calls the LoRALinear on
its input and output instead (the shrink kernel, then the expand). A base-model request in a LoRA
engine so gets the same sums through a wider GEMM and the expand's copy: its tokens can differ in
the last bits from an engine without LoRA (the o and down outputs are rounded before the residual
is added, not with it).

Tensor parallelism splits an adapter with its base layer: a column-parallel layer (qkv, gate_up)
keeps A whole and takes its rows of each slice's B; a row-parallel one (o, down) takes its columns
of A and keeps B whole, so each rank adds B (A_rank x_rank) to its partial sum and the all-reduce
that sums the base layer's partials sums these too.

With the RMSNorm weights folded into qkv_proj and gate_up_proj (models/llama.py), those layers
see the un-normalised residual stream h and their outputs are scaled by rstd(h) afterwards: so A
takes the same fold (A diag(w)) and its output, added before that scaling, gets rstd(h) too."""
from collections import OrderedDict

import torch

import torch.nn.functional as F

from nanovllm.kernels.lora import LoRABatch, apply_lora, expand_folded
from nanovllm.lora.adapter import TARGETS, AdapterInfo, check_adapter, load_adapter
from nanovllm.lora.request import LoRARequest
from nanovllm.lora.slots import SlotTable
from nanovllm.utils.context import get_context

# our fused layer -> its PEFT modules, in slice order
SLICES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
          "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


class LoRALinear:
    def __init__(self, base, modules: tuple[str, ...], max_loras: int, max_rank: int, dtype: torch.dtype,
                 input_scale: torch.Tensor | None = None, shard_ids: tuple | None = None):
        """shard_ids (a base layer whose weight_loader moves rows, e.g. the gated q_proj): each module's
        shard id there; B's rows then go through that loader, as the weight's did."""
        out_local, in_local = base.out_features, base.in_features   # (a quantized weight may be packed)
        self.modules, self.rank = modules, max_rank
        self.base_loader = base.weight_loader if shard_ids is not None else None
        self.shard_ids = shard_ids
        self.row_parallel = base.tp_dim == 1
        self.tp_rank, self.tp_size = base.tp_rank, base.tp_size
        if hasattr(base, "num_kv_heads"):     # QKVParallelLinear
            q, kv = base.num_heads * base.head_dim, base.num_kv_heads * base.head_dim
            self.sizes = (q, kv, kv)
        elif hasattr(base, "output_sizes"):   # MergedColumnParallelLinear
            self.sizes = tuple(s // base.tp_size for s in base.output_sizes)
        else:
            self.sizes = (out_local,)
        self.input_scale = input_scale
        kw = dict(dtype=dtype, device=next(base.parameters()).device)   # the activations' (any weight's)
        R = len(modules) * max_rank
        self.folded = base.quant is None and base.bias is None
        if self.folded:   # [W; A_0; ...]: the base weight becomes a view of the buffer's first rows
            self.weight = torch.zeros(out_local + max_loras * R, in_local, **kw)
            self.weight[:out_local] = base.weight.data
            base.weight.data = self.weight[:out_local]
            self.base_weight = base.weight
            self.a = self.weight[out_local:].view(max_loras, R, in_local)
        else:
            self.a = torch.zeros(max_loras, R, in_local, **kw)
        self.b = torch.zeros(out_local, max_loras, R, **kw)

    def set_slot(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]):
        """Slot `slot` <- this layer's matrices of one adapter (module -> (A, scaled B), whole);
        a module the adapter lacks gets zeros."""
        # a folded layer's weight must still be the view of the buffer (nothing may replace it)
        assert not self.folded or self.base_weight.data_ptr() == self.weight.data_ptr()
        self.a[slot].zero_()
        self.b[:, slot].zero_()
        offset = 0
        for i, (module, size) in enumerate(zip(self.modules, self.sizes)):
            if module in weights:
                a, b = weights[module]
                r, cols = a.size(0), slice(i * self.rank, i * self.rank + a.size(0))
                if self.row_parallel:
                    width = self.a.size(2)
                    a = a[:, self.tp_rank * width:(self.tp_rank + 1) * width]
                elif self.base_loader is None:
                    b = b[self.tp_rank * size:(self.tp_rank + 1) * size]
                if self.input_scale is not None:
                    a = a * self.input_scale.float().cpu()
                self.a[slot, cols] = a.to(self.a.dtype)
                if self.base_loader is not None:   # this rank's rows of B, where the weight's went
                    rows = torch.zeros(self.b.size(0), r)
                    self.base_loader(rows, b, self.shard_ids[i])
                    self.b[:, slot, cols] = rows.to(self.b.dtype)
                else:
                    self.b[offset:offset + size, slot, cols] = b.to(self.b.dtype)
                assert r <= self.rank
            offset += size

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """An unfolded layer: its output y plus the step's adapters' B (A x)."""
        batch = get_context().lora
        return y if batch is None else apply_lora(x, y, self.a, self.b, batch)

    def folds(self) -> bool:
        """Whether the layer runs folded in this step (a folded layer, and a LoRABatch in the step:
        every decode step, and a prefill step with an adapter's tokens)."""
        return self.folded and get_context().lora is not None

    def folded_linear(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """A folded layer's output with the step's adapters: one GEMM for x W^T and every slot's
        A x, then the expand; residual given: the output added into it (in place on CUDA)."""
        return expand_folded(F.linear(x, self.weight), self.b, get_context().lora, residual)


class LoRAModel:
    """One rank's LoRA state: the LoRALinear of every layer, and the adapters read from disk, kept in
    an LRU of max_cpu_loras on the host so that an adapter evicted from its GPU slot comes back by a
    copy, not a read."""

    def __init__(self, model, max_loras: int, max_lora_rank: int, max_cpu_loras: int):
        self.max_loras, self.max_lora_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        self.layers: dict[tuple[int, str], LoRALinear] = {}
        dtype = model.model.embed_tokens.weight.dtype   # the activations'
        packed = getattr(model, "packed_modules_mapping", {})
        blocks = {}   # our layer name -> the decoder layers that have its block (self_attn / mlp)
        for i, layer in enumerate(model.model.layers):
            folded = getattr(layer, "folded", False)
            for block, norm in (("self_attn", "input_layernorm"), ("mlp", "post_attention_layernorm")):
                for name in ("qkv_proj", "o_proj") if block == "self_attn" else ("gate_up_proj", "down_proj"):
                    owner = getattr(layer, block, None)   # None: a hybrid's linear-attention layer
                    if owner is not None:
                        blocks.setdefault(name, []).append(i)
                    base = getattr(owner, name, None)
                    if base is None:   # a mixture-of-experts MLP or linear attention: no LoRA there
                        continue
                    scale = getattr(layer, norm).weight if folded and name in ("qkv_proj", "gate_up_proj") \
                        else None
                    shard_ids = tuple(packed[m][1] for m in SLICES[name]) if hasattr(
                        base, "checkpoint_rows") else None
                    base.lora = self.layers[i, name] = LoRALinear(base, SLICES[name], max_loras,
                                                                  max_lora_rank, dtype, scale, shard_ids)
        # PEFT modules every layer of their block has (a mixture-of-experts model: no MLP ones)
        self.modules = frozenset(m for name, layers in blocks.items() for m in SLICES[name]
                                 if all((i, name) in self.layers for i in layers))
        self.cpu: OrderedDict[int, dict] = OrderedDict()   # lora_int_id -> load_adapter's tensors
        self.slots = SlotTable(max_loras)   # rank 0's: which adapter is in which slot

    @classmethod
    def of(cls, model, config) -> "LoRAModel | None":
        """The model's LoRA layers (after loading and folding), or None when config.enable_lora is off."""
        if not config.enable_lora:
            return None
        return cls(model, config.max_loras, config.max_lora_rank, config.max_cpu_loras)

    def load_all(self, loads: list[tuple[int, LoRARequest]], hf_config):
        """A step's loads. One that fails leaves its slot's contents unknown: the table forgets every
        slot, so each adapter is loaded again when next used."""
        try:
            for slot, request in loads:
                self.load(slot, request, hf_config)
        except BaseException:
            self.slots.reset()
            raise

    def load(self, slot: int, request: LoRARequest, hf_config):
        """Put an adapter into a GPU slot (from the host LRU, or read and checked from its folder)."""
        weights = self.cpu.pop(request.lora_int_id, None)
        if weights is None:
            info: AdapterInfo = check_adapter(request, hf_config, self.max_lora_rank, self.modules)
            weights = load_adapter(request, info)
        self.cpu[request.lora_int_id] = weights
        while len(self.cpu) > self.max_cpu_loras:
            self.cpu.popitem(last=False)
        per_layer: dict[tuple[int, str], dict] = {}
        for (layer, module), pair in weights.items():
            per_layer.setdefault((layer, TARGETS[module][1]), {})[module] = pair
        with torch.no_grad():
            for key, lora in self.layers.items():
                lora.set_slot(slot, per_layer.get(key, {}))

    def batch(self, slots: torch.Tensor) -> LoRABatch:
        return LoRABatch.of(slots, self.max_loras)

    def prefill_batch(self, step, device: torch.device) -> LoRABatch | None:
        """A prefill step's LoRABatch: each sequence's slot for each of its tokens; None when every
        sequence runs the base model (no LoRA kernels in the step)."""
        if max(step.lora_slots) < 0:
            return None
        per_token = [slot for slot, ids in zip(step.lora_slots, step.token_ids) for _ in ids]
        return self.batch(torch.tensor(per_token, dtype=torch.int32).to(device, non_blocking=True))
