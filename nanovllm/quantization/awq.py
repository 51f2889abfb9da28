"""quant_method 'awq' (AutoAWQ's GEMM export, transformers' AwqConfig version 'gemm'), 4 bits:

  qweight [K, N / 8] int32   packed along the output columns, in AWQ's interleaved order: nibble i
                             of word c holds column 8 c + AWQ_ORDER[i]
  qzeros  [G, N / 8] int32   the zero points, packed the same way (stored as they are)
  scales  [G, N] float16

G = ceil(K / group_size); w = (v - z) * s."""
from dataclasses import dataclass

import torch

from nanovllm.kernels.wna16_reference import pack, unpack
from nanovllm.quantization.wna16 import Geometry, Layout, Spec, WNA16Config

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)            # the column each nibble holds
AWQ_COLUMN_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)    # the nibble each column is in (AWQ_ORDER's inverse)


def awq_unpack(words: torch.Tensor) -> torch.Tensor:
    """[R, C / 8] AWQ-ordered words -> [R, C] values in column order."""
    v = unpack(words, 4, 1)   # entry 8 c + i: nibble i of word c
    return v.unflatten(1, (-1, 8))[:, :, list(AWQ_COLUMN_NIBBLE)].flatten(1)


@dataclass(frozen=True)
class AwqLayout(Layout):
    group: int | None
    bits: int = 4

    def specs(self, geo: Geometry) -> dict[str, Spec]:
        g, groups = self.group or geo.k_full, self.num_groups(geo.k)
        in_dim = None if self.group is None else 0
        return {"qweight": Spec((geo.k, geo.n // 8), torch.int32, 1, 8, 0, 1),
                "qzeros": Spec((groups, geo.n // 8), torch.int32, 1, 8, in_dim, g),
                "scales": Spec((groups, geo.n), torch.float32, 1, 1, in_dim, g)}

    def to_packed(self, t):
        return pack(awq_unpack(t["qweight"]), 4, 0), t["scales"], awq_unpack(t["qzeros"]), None


def awq_config(qc: dict) -> WNA16Config:
    bits, group = qc.get("bits", qc.get("w_bit")), qc.get("group_size", qc.get("q_group_size", 128))
    version = str(qc.get("version", "gemm")).lower()
    if bits != 4:
        raise ValueError(f"quant_method 'awq' with bits {bits!r} is not supported (only 4)")
    if version != "gemm":
        raise ValueError(f"quant_method 'awq' with version {version!r} is not supported (only 'gemm', "
                         "AutoAWQ's default export)")
    if not qc.get("zero_point", True):
        raise ValueError("quant_method 'awq' without zero_point is not supported")
    if group != -1 and not (isinstance(group, int) and group > 0):
        raise ValueError(f"quant_method 'awq' with group_size {group!r}: expected a positive integer or -1")
    return WNA16Config(AwqLayout(None if group == -1 else group),
                       ignore=tuple(qc.get("modules_to_not_convert") or ()))
