"""FP8 weights (float8_e4m3fn, dequantized as w * scale), read from a checkpoint's quantization_config
as vLLM reads it, or quantized at load for quantization='fp8' on an unquantized checkpoint. The
methods are in quantization/fp8_methods.py.

  quant_method 'fp8' (Qwen3-*-FP8, DeepSeek): weight_block_size [bn, bk]; `weight_scale_inv`
      [ceil(N/bn), ceil(K/bk)], one scale per block; activations quantized per token and group of
      bk columns at run time (activation_scheme 'dynamic').
  Per-tensor weights (quant_method 'fp8' without weight_block_size, as AutoFP8 writes it; also
      compressed-tensors strategy 'tensor', quantization/compressed_tensors.py): one `weight_scale` a
      projection, loaded as per-channel scales (the same value on every row). Their static
      per-tensor `input_scale`s (activation_scheme 'static') are not read: activations are quantized
      per token at run time, as for every format here (at least as accurate as one calibrated scale;
      vLLM uses the static scales).
  Static KV scales (kv_cache_scheme: AutoFP8's k_proj/v_proj `output_scale`, llm-compressor's
      `k_scale` / `v_scale`, the older `kv_scale`) become an FP8 KV cache's per-layer scales with
      kv_cache_dtype='fp8', as vLLM uses them (layers/attention.py: kv_scale_rows); with the cache in
      the model's dtype they are not used (a warning). A scheme other than 8-bit float per tensor
      (int8, per head) is a ValueError.
  quantization='fp8' on a bf16/fp16/fp32 checkpoint: the per-channel format, quantized at load.

Which layers: every sharded linear layer and every FusedMoE (not in fbgemm_fp8), except those the
checkpoint's ignore list names; replicated layers (the MoE router), embeddings and lm_head stay
unquantized."""
from dataclasses import dataclass

from torch import nn

from nanovllm.layers.linear import LinearBase
from nanovllm.quantization.base import QuantizationConfig
from nanovllm.quantization.fp8_methods import Fp8LinearMethod, Fp8MoEMethod
from nanovllm.utils.loader import CheckpointNames

INPUT_SCALES = (".input_scale",)
KV_SCALES = (".output_scale", ".k_scale", ".v_scale", ".kv_scale")
BLOCK_SCALE_NAME = "weight_scale_inv"   # HF's FP8 block scales (a dequantization factor despite the name)
FORMATS = ("'fp8' with weight_block_size and activation_scheme 'dynamic' (Qwen3-*-FP8), or without it "
           "(per-tensor weight scales, dynamic or static activations), 'compressed-tensors' FP8 with "
           "channel or tensor weights and dynamic token or static tensor activations (FP8_DYNAMIC, FP8) "
           "or block weights and dynamic group activations (FP8_BLOCK), 'fbgemm_fp8' (channel weights)")


@dataclass(frozen=True)
class Fp8Config(QuantizationConfig):
    block: tuple[int, int] | None   # (rows, cols) of W per scale; None: one scale per output channel
    scale_name: str                 # the checkpoint's name of the scale beside each `weight`
    ignore: tuple[str, ...] = ()    # modules left unquantized: names, or 're:' + a pattern
    online: bool = False            # an unquantized checkpoint: quantize the weights at load
    unread: tuple[str, ...] = ()    # suffixes of checkpoint tensors not read (static input scales)
    kv_scales: tuple[str, ...] = () # suffixes of static KV cache scales (kept for an FP8 cache)
    experts: bool = True            # the MoE experts are FP8 too (not in fbgemm_fp8)
    activation_scale_ub: float | None = None   # fbgemm_fp8: the largest activation amax a scale takes

    @classmethod
    def from_config(cls, qc: dict) -> "Fp8Config":
        """quant_method 'fp8' (HF's FineGrainedFP8Config, AutoFP8)."""
        activations = qc.get("activation_scheme", "dynamic")
        if activations not in ("dynamic", "static"):
            raise ValueError(f"quant_method 'fp8' with activation_scheme {activations!r} is not supported; "
                             f"supported: {FORMATS}")
        if qc.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"quant_method 'fp8' with fmt {qc.get('fmt')!r} is not supported (only e4m3)")
        ignore = tuple(qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ())
        block = qc.get("weight_block_size")
        if block is None:   # per-tensor weight scales (AutoFP8)
            return cls(block=None, scale_name="weight_scale", ignore=ignore,
                       unread=INPUT_SCALES if activations == "static" else (), kv_scales=kv_scales_of(qc))
        if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0
                                                                              for b in block)):
            raise ValueError(f"quant_method 'fp8' with weight_block_size {block!r}: expected [rows, cols]")
        if activations != "dynamic":
            raise ValueError(f"quant_method 'fp8' with weight_block_size and activation_scheme "
                             f"{activations!r} is not supported; supported: {FORMATS}")
        return cls(block=tuple(block), scale_name=BLOCK_SCALE_NAME, ignore=ignore, kv_scales=kv_scales_of(qc))

    @classmethod
    def at_load(cls) -> "Fp8Config":
        """quantization='fp8' on an unquantized checkpoint: per channel, quantized at load."""
        return cls(block=None, scale_name="weight_scale", online=True)

    @property
    def names(self) -> CheckpointNames:
        renames = ((f".{self.scale_name}", ".weight_scale"),) if self.scale_name != "weight_scale" else ()
        return CheckpointNames(unread=self.unread, kv_scales=self.kv_scales, renames=renames)

    def linear_method(self, name: str, layer: LinearBase) -> Fp8LinearMethod:
        return Fp8LinearMethod(self.block, self.activation_scale_ub)

    def moe_method(self, name: str, moe: nn.Module) -> Fp8MoEMethod | None:
        return Fp8MoEMethod(self.block) if self.experts else None

    @property
    def reads_checkpoint(self) -> bool:
        return not self.online


def kv_scales_of(qc: dict) -> tuple[str, ...]:
    """The static KV scales' tensor suffixes when the checkpoint has them: one e4m3 scale per layer's
    K and V (AutoFP8 writes the string 'static'; compressed-tensors a quantization scheme)."""
    scheme = qc.get("kv_cache_scheme")
    if not scheme:
        return ()
    if isinstance(scheme, dict) and (scheme.get("type"), scheme.get("num_bits"), scheme.get("strategy"),
                                     scheme.get("symmetric", True)) != ("float", 8, "tensor", True):
        raise ValueError(f"kv_cache_scheme {scheme} is not supported: the KV cache scales read are 8-bit "
                         "float, symmetric, one per tensor (a layer's K or V)")
    return KV_SCALES
