"""quant_method 'gptq' (AutoGPTQ / GPTQModel, transformers' GPTQConfig), bits 4 or 8, p = 32 / bits:

  qweight [K / p, N] int32   packed along the input rows: word j holds rows j * p + i
  qzeros  [G, N / p] int32   packed along the output columns; v1 checkpoints (checkpoint_format
                             'gptq', the default) store zero - 1, 'gptq_v2' the zero itself
                             (symmetric: 2^(bits-1), i.e. 0x77777777 in v1 at 4 bits)
  scales  [G, N] float16
  g_idx   [K] int32          desc_act (act order): the group of each input row; without desc_act
                             it is row // group_size, and not read

G = ceil(K / group_size), or 1 for group_size -1 (one scale per output channel); w = (v - z) * s.
Modules left unquantized: modules_to_not_convert, and GPTQModel's `dynamic` exclusions ('-:pattern')."""
from dataclasses import dataclass

import torch

from nanovllm.kernels.wna16_reference import unpack
from nanovllm.quantization.wna16 import Geometry, Layout, Spec, WNA16Config


@dataclass(frozen=True)
class GptqLayout(Layout):
    bits: int
    group: int | None
    desc_act: bool
    zero_offset: int   # added to the stored zero point: 1 for v1 checkpoints, 0 for v2

    def specs(self, geo: Geometry) -> dict[str, Spec]:
        p, g = self.pack, self.group or geo.k_full
        # act order: a row-parallel rank's rows may be in any group, so it keeps all of them
        whole = self.desc_act and geo.tp_dim == 1 and geo.tp_size > 1
        groups = self.num_groups(geo.k_full if whole else geo.k)
        in_dim = None if whole or self.group is None else 0
        specs = {"qweight": Spec((geo.k // p, geo.n), torch.int32, 1, 1, 0, p),
                 "qzeros": Spec((groups, geo.n // p), torch.int32, 1, p, in_dim, g),
                 "scales": Spec((groups, geo.n), torch.float32, 1, 1, in_dim, g)}
        if self.desc_act:
            specs["g_idx"] = Spec((geo.k,), torch.int32, None, 1, 0, 1, shared=True)
        return specs

    def to_packed(self, t):
        zeros = unpack(t["qzeros"], self.bits, 1) + self.zero_offset   # [G, N]
        return t["qweight"], t["scales"], zeros, t.get("g_idx")


def gptq_config(qc: dict) -> WNA16Config:
    bits, group, desc_act = qc.get("bits"), qc.get("group_size", 128), bool(qc.get("desc_act", False))
    fmt = qc.get("checkpoint_format") or qc.get("format") or "gptq"
    if bits not in (4, 8):
        raise ValueError(f"quant_method 'gptq' with bits {bits!r} is not supported (4 or 8)")
    if group != -1 and not (isinstance(group, int) and group > 0):
        raise ValueError(f"quant_method 'gptq' with group_size {group!r}: expected a positive integer or -1")
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"quant_method 'gptq' with checkpoint_format {fmt!r} is not supported ('gptq' or "
                         "'gptq_v2'; re-save a marlin / bitblas export in the GPTQ format)")
    dynamic = qc.get("dynamic") or {}
    if any(not key.startswith("-:") for key in dynamic):
        raise ValueError("quant_method 'gptq' with per-module 'dynamic' overrides is not supported: one bits "
                         "and group_size for every layer (only GPTQModel's '-:pattern' exclusions are read)")
    if qc.get("lm_head"):
        raise ValueError("quant_method 'gptq' with a quantized lm_head is not supported")
    layout = GptqLayout(bits, None if group == -1 else group, desc_act, 1 if fmt == "gptq" else 0)
    skipped = tuple("re:" + key[2:] for key in dynamic)   # GPTQModel: modules left unquantized
    return WNA16Config(layout, ignore=tuple(qc.get("modules_to_not_convert") or ()) + skipped,
                       unread=() if desc_act else (".g_idx",))
