"""quant_method 'compressed-tensors' (llm-compressor's exports): its config_groups name the weights'
and activations' schemes, read as vLLM reads them.

  format 'float-quantized' (FP8): weights 8-bit float per channel (`weight_scale` [N, 1], FP8_DYNAMIC),
      per tensor (FP8; static per-tensor `input_scale`s skipped) or per block (FP8_BLOCK, read as
      HF's block format); activations quantized per token (or group) at run time (quantization/fp8.py).
"""
from nanovllm.quantization.fp8 import FORMATS, INPUT_SCALES, Fp8Config, kv_scales_of


def compressed_tensors_config(qc: dict) -> Fp8Config:
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
                             f"supported; supported: {FORMATS}")
    if len(schemes) != 1:
        raise ValueError(f"compressed-tensors: {len(groups)} config groups with {len(schemes)} weight "
                         f"formats (one is read: per channel or tensor, or one block size); supported: "
                         f"{FORMATS}")
    return Fp8Config(block=schemes.pop(), scale_name="weight_scale", ignore=tuple(qc.get("ignore") or ()),
                     unread=INPUT_SCALES if static else (), kv_scales=kv_scales_of(qc))
