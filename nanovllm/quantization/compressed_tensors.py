"""quant_method 'compressed-tensors' (llm-compressor's exports): its config_groups name the weights'
and activations' schemes, read as vLLM reads them.

  format 'float-quantized' (FP8): weights 8-bit float per channel (`weight_scale` [N, 1], FP8_DYNAMIC),
      per tensor (FP8; static per-tensor `input_scale`s skipped) or per block (FP8_BLOCK, read as
      HF's block format); activations quantized per token (or group) at run time (quantization/fp8.py).
  format 'pack-quantized' (W4A16, W8A16: integer weights, 16-bit activations; quantization/wna16.py):
      weight_packed [N, K / p] int32   the values + 2^(bits-1), packed along the input columns
      weight_scale  [N, G]             strategy 'group' (G = ceil(K / group_size)) or 'channel' (G 1)
      weight_zero_point [N / p, G] int32   asymmetric only: the zero points + 2^(bits-1), packed along
                                       the output rows (symmetric: zero)
      weight_shape  [2]                [N, K], checked
      weight_g_idx  [K]                actorder 'group' only: the group of each input column
      w = (v - z) * s with v, z the signed values.
"""
from dataclasses import dataclass

import torch

from nanovllm.quantization.base import QuantizationConfig
from nanovllm.quantization.fp8 import FORMATS, INPUT_SCALES, Fp8Config, kv_scales_of
from nanovllm.kernels.wna16_reference import pack, unpack
from nanovllm.quantization.wna16 import Geometry, Layout, Spec, WNA16Config

INT_FORMATS = ("'pack-quantized' integer weights of 4 or 8 bits, strategy 'group' or 'channel', symmetric "
               "or not, without input activation quantization (W4A16, W8A16)")


def compressed_tensors_config(qc: dict) -> QuantizationConfig:
    groups = list((qc.get("config_groups") or {}).values())
    int_groups = [g for g in groups if (g.get("weights") or {}).get("type") == "int"]
    if int_groups:
        return _pack_quantized(qc, groups)
    return _float_quantized(qc, groups)


@dataclass(frozen=True)
class PackQuantizedLayout(Layout):
    bits: int
    group: int | None
    symmetric: bool
    g_idx: bool   # actorder 'group'

    def specs(self, geo: Geometry) -> dict[str, Spec]:
        p, g = self.pack, self.group or geo.k_full
        whole = self.g_idx and geo.tp_dim == 1 and geo.tp_size > 1   # act order: every group on every rank
        groups = self.num_groups(geo.k_full if whole else geo.k)
        in_dim = None if whole or self.group is None else 1
        specs = {"weight_packed": Spec((geo.n, geo.k // p), torch.int32, 0, 1, 1, p),
                 "weight_scale": Spec((geo.n, groups), torch.float32, 0, 1, in_dim, g),
                 "weight_shape": Spec((2,), torch.int64, None, 1, None, 1, holds_shape=True)}
        if not self.symmetric:
            specs["weight_zero_point"] = Spec((geo.n // p, groups), torch.int32, 0, p, in_dim, g)
        if self.g_idx:
            specs["weight_g_idx"] = Spec((geo.k,), torch.int32, None, 1, 0, 1, shared=True)
        return specs

    def to_packed(self, t):
        mid = 1 << (self.bits - 1)
        qweight = pack(unpack(t["weight_packed"], self.bits, 1).t(), self.bits, 0)   # [K / p, N]
        scales = t["weight_scale"].t()                                                 # [G, N]
        if self.symmetric:
            zeros = torch.full(scales.shape, mid, dtype=torch.int32, device=scales.device)
        else:
            zeros = unpack(t["weight_zero_point"], self.bits, 0).t()
        return qweight, scales, zeros, t.get("weight_g_idx")


def _pack_quantized(qc: dict, groups: list[dict]) -> WNA16Config:
    schemes = set()
    for g in groups:
        w, a = g.get("weights") or {}, g.get("input_activations")
        fmt = g.get("format") or qc.get("format")
        strategy, group = w.get("strategy"), w.get("group_size")
        if (w.get("type") != "int" or w.get("num_bits") not in (4, 8) or a or fmt != "pack-quantized"
                or w.get("dynamic") not in (False, None) or strategy not in ("group", "channel")
                or (strategy == "group" and not (isinstance(group, int) and group > 0))
                or w.get("actorder") not in (None, "weight", "group")):
            raise ValueError(f"compressed-tensors group with format {fmt!r}, weights {w} and "
                             f"input_activations {a} is not supported; supported: {INT_FORMATS}, or FP8: "
                             f"{FORMATS}")
        schemes.add(PackQuantizedLayout(w["num_bits"], group if strategy == "group" else None,
                                        bool(w.get("symmetric", True)), w.get("actorder") == "group"))
    if len(schemes) != 1:
        raise ValueError(f"compressed-tensors: {len(groups)} config groups with {len(schemes)} weight "
                         f"formats (one is read); supported: {INT_FORMATS}")
    if qc.get("kv_cache_scheme"):
        raise ValueError("compressed-tensors: a kv_cache_scheme beside integer weights is not supported")
    return WNA16Config(schemes.pop(), ignore=tuple(qc.get("ignore") or ()))


def _float_quantized(qc: dict, groups: list[dict]) -> Fp8Config:
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
