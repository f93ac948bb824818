"""kda_gate: the KDA per-channel log decay g from the gate projection, as a Triton kernel (forward only)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from backends.cuda_device import on_tensor_device
from backends.reference import kda as _ref
from backends.reference.ops import check_finite_cpu

from ..guard import cdiv, check_forward_only, check_kernel_device, next_power_of_2


@triton.jit
def _gate_kernel(x, A_log, dt_bias, g, n_rows, H, lb, K: tl.constexpr, BR: tl.constexpr,
                 SOFTPLUS: tl.constexpr, KP: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BR + tl.arange(0, BR)
    dk = tl.arange(0, KP)                       # KP = K rounded up to a power of two; columns >= K masked
    rm = rows < n_rows
    m2 = rm[:, None] & (dk < K)[None, :]
    hh = rows % H
    off = rows.to(tl.int64)[:, None] * K + dk[None, :]
    z = tl.load(x + off, mask=m2, other=0.0).to(tl.float32)
    z += tl.load(dt_bias + hh[:, None] * K + dk[None, :], mask=m2, other=0.0).to(tl.float32)
    a = tl.exp(tl.load(A_log + hh, mask=rm, other=0.0).to(tl.float32))[:, None]
    if SOFTPLUS:
        sp = tl.where(z > 20.0, z, tl.log(1.0 + tl.exp(tl.minimum(z, 20.0))))
        out = -a * sp
    else:
        az = a * z
        e = tl.exp(-tl.abs(az))                 # sigmoid without overflow (the interpreter warns on exp(+big))
        out = lb * tl.where(az >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    tl.store(g + off, out, mask=m2)


@on_tensor_device
def kda_gate(x, A_log, dt_bias, *, lower_bound=-5.0, gate="sigmoid"):
    """The KDA per-channel log decay g as a Triton kernel (float32 out); same contract as the reference.

    x [B, T, H, K] any float dtype, any K >= 1; A_log [H]; dt_bias [H*K].  "sigmoid": g = L sigmoid(e^A_log
    (x + dt_bias)) in [L, 0]; "softplus": g = -e^A_log softplus(x + dt_bias) (unbounded).  Forward only (no
    autograd; use the reference or the fused layer for training).  Raises like backends.reference.kda.kda_gate,
    ValueError for K = 0 and for CPU tensors without TRITON_INTERPRET=1, and RuntimeError when autograd records
    a gradient for an input (the result would carry none).
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"triton.kda_gate: x must be a torch.Tensor, got {type(x).__name__}")
    _ref.kda_gate(x[:0] if x.dim() == 4 else x, A_log, dt_bias, lower_bound=lower_bound, gate=gate)  # checks
    check_forward_only("triton.kda_gate", x, A_log, dt_bias)
    check_kernel_device("triton.kda_gate", x=x)
    check_finite_cpu("kda_gate", x=x)           # (A_log, dt_bias: scanned by the reference check above)
    B, T, H, K = x.shape
    if K == 0:
        raise ValueError(f"triton.kda_gate: the key dimension K of x {list(x.shape)} must be >= 1")
    xc = x.contiguous()
    g = torch.empty(B, T, H, K, dtype=torch.float32, device=x.device)
    n = B * T * H
    BR = 32
    if n:
        _gate_kernel[(cdiv(n, BR),)](xc, A_log.contiguous(), dt_bias.contiguous(), g, n, H,
                                            float(lower_bound), K=K, BR=BR, SOFTPLUS=(gate == "softplus"),
                                            KP=next_power_of_2(K))
    _ref.check_gate_finite(g, A_log, "kda_gate", gate)
    return g
