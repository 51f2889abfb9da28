"""Which FP8 weight format a model runs in: read from the checkpoint's quantization_config (as vLLM
does), or chosen for quantization='fp8' on an unquantized checkpoint (quantized at load).

Formats read (weights float8_e4m3fn, dequantized as w * scale):
  quant_method 'fp8' (Qwen3-*-FP8, DeepSeek): weight_block_size [bn, bk]; `weight_scale_inv`
      [ceil(N/bn), ceil(K/bk)], one scale per block; activations quantized per token and group of
      bk columns at run time (activation_scheme 'dynamic').
  quant_method 'compressed-tensors' (llm-compressor's FP8_DYNAMIC): `weight_scale` [N, 1], one per
      output channel; activations quantized per token at run time. Its FP8_BLOCK export
      (strategy 'block' / 'group') reads as the block format.
  Per-tensor weights (quant_method 'fp8' without weight_block_size, as AutoFP8 writes it, or
      compressed-tensors strategy 'tensor', its FP8 scheme): one `weight_scale` a projection, loaded
      as per-channel scales (the same value on every row). Their static per-tensor `input_scale`s
      (activation_scheme 'static', or activations 'tensor' not dynamic) are not read: activations
      are quantized per token at run time, as for every format here (at least as accurate as one
      calibrated scale; vLLM uses the static scales).
  Static KV scales (kv_cache_scheme: AutoFP8's k_proj/v_proj `output_scale`, llm-compressor's
      `k_scale` / `v_scale`, the older `kv_scale`) become an FP8 KV cache's per-layer scales with
      kv_cache_dtype='fp8', as vLLM uses them (layers/attention.py: kv_scale_rows); with the cache in
      the model's dtype they are not used (config.py warns). A scheme other than 8-bit float per
      tensor (int8, per head) is a ValueError.
  quant_method 'fbgemm_fp8' (Meta's Llama-3.1-*-FP8, transformers' FbgemmFp8Config): `weight_scale`
      [N, 1], one per output channel, on the linear layers; the experts stay unquantized (as vLLM
      reads it; transformers' quantizer converts nn.Linear modules only). Its `activation_scale_ub`
      bounds each token's activation amax: a token's scale is at most activation_scale_ub / 448 and
      larger values saturate, as in vLLM and FBGEMM's quantize_fp8_per_row.
  quantization='fp8' on a bf16/fp16/fp32 checkpoint: the per-channel format, quantized at load.
"""
import re
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

SUPPORTED = ("fp8", "compressed-tensors", "fbgemm_fp8")
_FORMATS = ("'fp8' with weight_block_size and activation_scheme 'dynamic' (Qwen3-*-FP8), or without it "
            "(per-tensor weight scales, dynamic or static activations), 'compressed-tensors' FP8 with "
            "channel or tensor weights and dynamic token or static tensor activations (FP8_DYNAMIC, FP8) "
            "or block weights and dynamic group activations (FP8_BLOCK), 'fbgemm_fp8' (channel weights)")
INPUT_SCALES = (".input_scale",)
KV_SCALES = (".output_scale", ".k_scale", ".v_scale", ".kv_scale")
FLOAT32_MAX = torch.finfo(torch.float32).max


@dataclass(frozen=True)
class Fp8Scheme:
    block: tuple[int, int] | None   # (rows, cols) of W per scale; None: one scale per output channel
    scale_name: str                 # the checkpoint's name of the scale beside each `weight`
    ignore: tuple[str, ...] = ()    # modules left unquantized: names, or 're:' + a pattern
    online: bool = False            # an unquantized checkpoint: quantize the weights at load
    unread: tuple[str, ...] = ()    # suffixes of checkpoint tensors not read (static input scales)
    kv_scales: tuple[str, ...] = () # suffixes of static KV cache scales (kept for an FP8 cache)
    experts: bool = True            # the MoE experts are FP8 too (not in fbgemm_fp8)
    activation_scale_ub: float | None = None   # fbgemm_fp8: the largest activation amax a scale takes

    def ignores(self, module_name: str) -> bool:
        """A module the checkpoint keeps unquantized (HF's modules_to_not_convert or compressed-tensors'
        ignore list: plain names match the module or a prefix of it; 're:' patterns match the name)."""
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.match(entry[3:], module_name):
                    return True
            elif module_name == entry or module_name.startswith(entry + ".") or module_name.endswith(
                    "." + entry):
                return True
        return False


def fp8_scheme(hf_config: PretrainedConfig, quantization: str | None) -> Fp8Scheme | None:
    """The FP8 format the model runs in, or None (unquantized). A ValueError naming what is supported
    for any other method or FP8 variant (e.g. static activation scales with block weights)."""
    if quantization is not None and quantization not in SUPPORTED:
        raise ValueError(f"quantization={quantization!r} is not supported: pass None, 'fp8' (an FP8 "
                         f"checkpoint, or a bf16 one quantized at load), 'compressed-tensors' or "
                         f"'fbgemm_fp8'")
    qc = getattr(hf_config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
    if not qc:
        if quantization is None:
            return None
        if quantization != "fp8":
            raise ValueError(f"quantization={quantization!r} needs a checkpoint in that format; the model's "
                             "config.json has no quantization_config (pass quantization='fp8' to quantize "
                             "an unquantized checkpoint at load)")
        return Fp8Scheme(block=None, scale_name="weight_scale", online=True)
    method = qc.get("quant_method")
    if quantization is not None and method in SUPPORTED and quantization != method:
        raise ValueError(f"quantization={quantization!r}, but the checkpoint's quantization_config says "
                         f"{method!r}: pass quantization=None (or {method!r}) to read it as it is")
    if method == "fp8":
        return _hf_fp8(qc)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "fbgemm_fp8":
        return Fp8Scheme(block=None, scale_name="weight_scale", experts=False,
                         ignore=tuple(qc.get("modules_to_not_convert") or ()),
                         activation_scale_ub=_scale_ub(qc.get("activation_scale_ub")))
    raise ValueError(f"the checkpoint's quantization_config has quant_method {method!r}, which nanovllm does "
                     f"not run; supported: {_FORMATS}")


def _hf_fp8(qc: dict) -> Fp8Scheme:
    activations = qc.get("activation_scheme", "dynamic")
    if activations not in ("dynamic", "static"):
        raise ValueError(f"quant_method 'fp8' with activation_scheme {activations!r} is not supported; "
                         f"supported: {_FORMATS}")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"quant_method 'fp8' with fmt {qc.get('fmt')!r} is not supported (only e4m3)")
    ignore = tuple(qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ())
    block = qc.get("weight_block_size")
    if block is None:   # per-tensor weight scales (AutoFP8)
        return Fp8Scheme(block=None, scale_name="weight_scale", ignore=ignore,
                         unread=INPUT_SCALES if activations == "static" else (), kv_scales=_kv_scales(qc))
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0
                                                                          for b in block)):
        raise ValueError(f"quant_method 'fp8' with weight_block_size {block!r}: expected [rows, cols]")
    if activations != "dynamic":
        raise ValueError(f"quant_method 'fp8' with weight_block_size and activation_scheme {activations!r} "
                         f"is not supported; supported: {_FORMATS}")
    return Fp8Scheme(block=tuple(block), scale_name="weight_scale_inv", ignore=ignore,
                     kv_scales=_kv_scales(qc))


def _scale_ub(value) -> float | None:
    """fbgemm_fp8's activation_scale_ub: None, or a positive finite number."""
    if value is None:
        return None
    # (Python compares an int with a float exactly: an int past float's range is refused, not an overflow)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= FLOAT32_MAX:
        raise ValueError(f"quant_method 'fbgemm_fp8' with activation_scale_ub {value!r}: expected a positive "
                         "number a float32 holds (the largest per-token activation amax), or none")
    return float(value)


def _kv_scales(qc: dict) -> tuple[str, ...]:
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


def _compressed_tensors(qc: dict) -> Fp8Scheme:
    groups = list((qc.get("config_groups") or {}).values())
    schemes, static = set(), False
    for g in groups:
        w, a = g.get("weights") or {}, g.get("input_activations") or {}
        fp8_w = (w.get("type") == "float" and w.get("num_bits") == 8 and w.get("symmetric", True)
                 and w.get("dynamic") is not True)
        fp8_a = a.get("type") == "float" and a.get("num_bits") == 8 and a.get("symmetric", True)
        dynamic = a.get("dynamic") is True
        is_static = a.get("dynamic") is False and a.get("strategy") == "tensor"   # input_scale tensors
        static |= is_static
        if (fp8_w and fp8_a and w.get("strategy") in ("channel", "tensor")
                and (is_static or (dynamic and a.get("strategy") in ("token", "tensor")))):
            schemes.add(None)
        elif (fp8_w and fp8_a and dynamic and w.get("strategy") == "block" and a.get("strategy") == "group"
              and isinstance(w.get("block_structure"), (list, tuple)) and len(w["block_structure"]) == 2
              and a.get("group_size") == w["block_structure"][1]):
            schemes.add(tuple(w["block_structure"]))
        else:
            raise ValueError(f"compressed-tensors group with weights {w} and input_activations {a} is not "
                             f"supported; supported: {_FORMATS}")
    if len(schemes) != 1:
        raise ValueError(f"compressed-tensors: {len(groups)} config groups with {len(schemes)} weight "
                         f"formats (one is read: per channel or tensor, or one block size); supported: "
                         f"{_FORMATS}")
    return Fp8Scheme(block=schemes.pop(), scale_name="weight_scale", ignore=tuple(qc.get("ignore") or ()),
                     unread=INPUT_SCALES if static else (), kv_scales=_kv_scales(qc))
