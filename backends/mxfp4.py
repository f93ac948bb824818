"""Routed-expert weights kept packed as MXFP4 (``moe(..., expert_dtype="mxfp4")``): :class:`MXFP4Experts`.

The format is compressed-tensors' ``mxfp4-pack-quantized`` (:mod:`dsl.checkpoint.mxfp4`): per expert, a
``weight_packed`` uint8 [out, in / 2] (two E2M1 codes per byte, the low nibble the even column) and a
``weight_scale`` uint8 [out, in / 32] (E8M0, 2^(s - 127)). The module holds them stacked over the experts, in
mtc's expert layout (w1, w3 [E, I, l]; w2 [E, l, I]), so that its bytes are the memory plan's MXFP4 figure
(dsl.ir.DTYPES["mxfp4"] = 0.53125 bytes per element: 4 bits + one 8-bit scale per 32).

The weights are frozen: they are buffers, not parameters, and no op computes a gradient for them (the gradients
of the activations flow as with dense weights). ``.to(dtype)`` / ``.half()`` leave them as they are (uint8);
``.to(device)`` moves them.
"""
from __future__ import annotations

import torch
from torch import nn

from dsl.checkpoint import mxfp4 as fmt
from dsl.errors import MtcError


class MXFP4Experts(nn.Module):
    """E stacked MXFP4 weights of logical shape [E, out, in] (``in`` a multiple of 32).

    Buffers: ``weight_packed`` uint8 [E, out, in / 2], ``weight_scale`` uint8 [E, out, in / 32] (see the module
    docstring). ``shape`` is the logical (E, out, in). Raises MtcError for sizes that are not positive or an ``in``
    that is not a multiple of 32."""

    def __init__(self, experts: int, out: int, n_in: int, device=None):
        super().__init__()
        if min(experts, out, n_in) < 1 or n_in % fmt.GROUP:
            raise MtcError(f"MXFP4 experts [{experts}, {out}, {n_in}]: sizes >= 1 and an input width that is a "
                           f"multiple of {fmt.GROUP} (one E8M0 scale per {fmt.GROUP} inputs)")
        self.register_buffer("weight_packed", torch.zeros(experts, out, n_in // 2, dtype=torch.uint8, device=device))
        self.register_buffer("weight_scale", torch.zeros(experts, out, n_in // fmt.GROUP, dtype=torch.uint8,
                                                         device=device))

    @property
    def shape(self) -> torch.Size:
        e, out, half = self.weight_packed.shape
        return torch.Size((e, out, 2 * half))

    @property
    def device(self) -> torch.device:
        return self.weight_packed.device

    @property
    def nbytes(self) -> int:
        return self.weight_packed.nbytes + self.weight_scale.nbytes

    def dim(self) -> int:
        return 3

    def expert(self, j: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Expert j's weight [out, in] decoded to ``dtype`` (a fresh tensor; exact in float32)."""
        return fmt.dequantize(self.weight_packed[j], self.weight_scale[j], dtype, where=f"MXFP4 expert {j}")

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """All experts [E, out, in] decoded to ``dtype`` (a full copy: for checks and export, not the forward)."""
        e, out, n_in = self.shape
        w = fmt.dequantize(self.weight_packed.reshape(e * out, n_in // 2),
                           self.weight_scale.reshape(e * out, n_in // fmt.GROUP), dtype, where="MXFP4 experts")
        return w.view(e, out, n_in)

    @torch.no_grad()
    def quantize_(self, w: torch.Tensor, j: int | None = None) -> "MXFP4Experts":
        """Encode the float weight ``w`` ([E, out, in], or expert j's [out, in]) into the buffers, rounded to the
        nearest MXFP4 value (exact for MXFP4-representable weights; :func:`dsl.checkpoint.mxfp4.quantize`)."""
        e, out, n_in = self.shape
        want = (e, out, n_in) if j is None else (out, n_in)
        if tuple(w.shape) != want:
            raise MtcError(f"MXFP4 experts {list(self.shape)}: a weight of shape {list(w.shape)} given, {list(want)} "
                           f"needed")
        p, s = fmt.quantize(w.reshape(-1, n_in), where="MXFP4 experts")
        dst_p = self.weight_packed if j is None else self.weight_packed[j]
        dst_s = self.weight_scale if j is None else self.weight_scale[j]
        dst_p.copy_(p.view(dst_p.shape))
        dst_s.copy_(s.view(dst_s.shape))
        return self

    def extra_repr(self) -> str:
        return f"mxfp4 {list(self.shape)}, {self.nbytes} bytes"


def is_packed(w) -> bool:
    return isinstance(w, MXFP4Experts)
