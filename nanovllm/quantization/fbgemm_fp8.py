"""quant_method 'fbgemm_fp8' (Meta's Llama-3.1-*-FP8, transformers' FbgemmFp8Config): `weight_scale`
[N, 1], one per output channel, on the linear layers; the experts stay unquantized (as vLLM reads it;
transformers' quantizer converts nn.Linear modules only). Its `activation_scale_ub` bounds each
token's activation amax: a token's scale is at most activation_scale_ub / 448 and larger values
saturate, as in vLLM and FBGEMM's quantize_fp8_per_row."""
import torch

from nanovllm.quantization.fp8 import Fp8Config

FLOAT32_MAX = torch.finfo(torch.float32).max


def fbgemm_fp8_config(qc: dict) -> Fp8Config:
    return Fp8Config(block=None, scale_name="weight_scale", experts=False,
                     ignore=tuple(qc.get("modules_to_not_convert") or ()),
                     activation_scale_ub=_scale_ub(qc.get("activation_scale_ub")))


def _scale_ub(value) -> float | None:
    """fbgemm_fp8's activation_scale_ub: None, or a positive finite number."""
    if value is None:
        return None
    # (Python compares an int with a float exactly: an int past float's range is refused, not an overflow)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= FLOAT32_MAX:
        raise ValueError(f"quant_method 'fbgemm_fp8' with activation_scale_ub {value!r}: expected a positive "
                         "number a float32 holds (the largest per-token activation amax), or none")
    return float(value)
