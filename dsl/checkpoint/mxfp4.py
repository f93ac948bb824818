"""MXFP4 weights as compressed-tensors stores them (format ``mxfp4-pack-quantized``, the Kimi K3 release's routed
experts): decode on load, encode on save.

Format (OCP Microscaling Formats v1.0, MXFP4: E2M1 elements, one E8M0 scale per 32 consecutive elements of a
row; compressed-tensors' packing):

* ``weight_packed`` uint8 [out, in / 2]: two 4-bit E2M1 codes per byte, the LOW nibble is the even column
  (2c), the high nibble the odd one (2c + 1). A code is sign (bit 3) | exponent (bits 2-1) | mantissa (bit 0):
  magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 for codes 0..7, the same negated for 8..15.
* ``weight_scale`` uint8 [out, in / 32]: E8M0, the group's scale 2^(s - 127); s = 255 is NaN (refused).
* value[r, c] = E2M1(code[r, c]) * 2^(scale[r, c // 32] - 127).
"""
from __future__ import annotations

import torch

from ..errors import MtcError

GROUP = 32
#: E2M1 magnitude by code (codes 8..15: the same, negative)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _table(device) -> torch.Tensor:
    pos = torch.tensor(E2M1, dtype=torch.float32, device=device)
    return torch.cat([pos, -pos])


def check_pair(packed_shape, scale_shape, packed_dtype, scale_dtype, where: str) -> tuple[int, int]:
    """(out, in) of an MXFP4 weight from its two tensors' shapes and dtypes; MtcError naming ``where`` when they
    are not uint8 [out, in / 2] and uint8 [out, in / 32]."""
    if packed_dtype not in (torch.uint8, "U8") or scale_dtype not in (torch.uint8, "U8"):
        raise MtcError(f"{where}: MXFP4 weight_packed and weight_scale must be uint8, got {packed_dtype} and "
                       f"{scale_dtype}")
    if len(packed_shape) != 2 or len(scale_shape) != 2:
        raise MtcError(f"{where}: MXFP4 weight_packed {list(packed_shape)} and weight_scale {list(scale_shape)} must "
                       f"be 2-d ([out, in / 2], [out, in / 32])")
    out, half = packed_shape
    n_in = 2 * half
    if n_in % GROUP or tuple(scale_shape) != (out, n_in // GROUP):
        raise MtcError(f"{where}: MXFP4 weight_packed {list(packed_shape)} (in = {n_in}) needs weight_scale "
                       f"[{out}, {n_in // GROUP if n_in % GROUP == 0 else f'{n_in}/32'}] (one scale per 32 inputs; "
                       f"in a multiple of 32), got {list(scale_shape)}")
    return out, n_in


def dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
               where: str = "mxfp4") -> torch.Tensor:
    """The [out, in] weight of an MXFP4 pair (see the module docstring), in ``dtype``.

    Exact in float32 (every MXFP4 value is a float32 number) and in bf16 / f16 within their exponent range.
    Raises MtcError for wrong shapes or dtypes, or a NaN scale (255)."""
    out, n_in = check_pair(tuple(packed.shape), tuple(scale.shape), packed.dtype, scale.dtype, where)
    if bool((scale == 255).any()):
        raise MtcError(f"{where}: MXFP4 weight_scale holds 255 (E8M0 NaN)")
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(out, n_in).long()
    vals = _table(packed.device)[codes]
    exp = scale.to(torch.int32) - 127
    # 2^(s - 127) for s in 0..254 spans 2^-127 .. 2^127: ldexp keeps it exact in float32 (2^-127 is subnormal)
    w = torch.ldexp(vals.view(out, n_in // GROUP, GROUP), exp.unsqueeze(-1).to(torch.float32)).reshape(out, n_in)
    w = w.to(dtype)
    if not bool(torch.isfinite(w).all()):
        raise MtcError(f"{where}: an MXFP4 value overflows {str(dtype).removeprefix('torch.')} (scale up to 2^127)")
    return w


def quantize(w: torch.Tensor, where: str = "mxfp4") -> tuple[torch.Tensor, torch.Tensor]:
    """(weight_packed uint8 [out, in / 2], weight_scale uint8 [out, in / 32]) of a float [out, in] weight.

    The scale of a group is the OCP MX rule's 2^(floor(log2(amax)) - 2) (2 = E2M1's largest exponent); each
    element is rounded to the nearest E2M1 value of value / scale (ties to the even code), clamped to +-6. A
    weight whose every group is already MXFP4-representable (e.g. one decoded from MXFP4) is encoded exactly:
    ``dequantize(*quantize(w)) == w`` bit for bit. A group of zeros gets scale 2^-127 (s = 0).
    Raises MtcError for a weight that is not 2-d with ``in`` a multiple of 32, or that holds NaN / inf."""
    if w.dim() != 2 or w.shape[1] % GROUP:
        raise MtcError(f"{where}: MXFP4 needs a 2-d weight [out, in] with in a multiple of {GROUP}, got "
                       f"{list(w.shape)}")
    x = w.detach().to(torch.float32)
    if not bool(torch.isfinite(x).all()):
        raise MtcError(f"{where}: cannot encode NaN or inf as MXFP4")
    out, n_in = x.shape
    g = x.view(out, n_in // GROUP, GROUP)
    amax = g.abs().amax(-1)
    e = torch.where(amax > 0, torch.floor(torch.log2(torch.where(amax > 0, amax, torch.ones_like(amax)))) - 2,
                    torch.full_like(amax, -127.0))
    s = (e + 127).clamp(0, 254)
    y = torch.ldexp(g, (-(s - 127)).unsqueeze(-1))                  # value / scale, exact (a power of two)
    mag = y.abs().clamp(max=6.0)
    grid = torch.tensor(E2M1, dtype=torch.float32, device=x.device)
    # nearest magnitude; a tie goes to the even code (the one with mantissa bit 0)
    dist = (mag.unsqueeze(-1) - grid).abs()
    best = dist.min(-1, keepdim=True).values
    cand = dist == best
    even = cand & (torch.arange(8, device=x.device) % 2 == 0)
    code = torch.where(even.any(-1), even.float().argmax(-1), cand.float().argmax(-1))
    code = code + 8 * torch.signbit(y).long()                     # sign bit (-0.0 keeps its sign: code 8)
    code = code.view(out, n_in).to(torch.uint8)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    return packed.contiguous(), s.to(torch.uint8).contiguous()
