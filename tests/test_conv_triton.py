"""backends.triton.conv.conv_silu_norm (the fused KDA prologue chain) against a naive re-derivation."""
import pytest
import torch

from backends.triton.conv import conv_silu_norm


def naive(x, w, silu, head_dim, eps):
    """Token-by-token loop: u_t = sum_j w[:, j] x_{t-W+1+j} (zeros before t=0), SiLU, per-head L2 norm."""
    B, T, C = x.shape
    W = w.shape[-1]
    xf, wf = x.double(), w.double().reshape(C, W)
    out = torch.zeros(B, T, C, dtype=torch.float64)
    for t in range(T):
        for j in range(W):
            s = t - W + 1 + j
            if s >= 0:
                out[:, t] += wf[:, j] * xf[:, s]
    if silu:
        out = out * torch.sigmoid(out)
    if head_dim:
        o = out.view(B, T, C // head_dim, head_dim)
        out = (o / torch.sqrt((o * o).sum(-1, keepdim=True) + eps)).view(B, T, C)
    return out


def rel(a, b):
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("B,T,H,D,W", [(1, 1, 2, 16, 4), (2, 63, 3, 32, 4), (1, 100, 1, 24, 3), (1, 1000, 2, 16, 4)])
@pytest.mark.parametrize("norm", [True, False])
def test_matches_naive(B, T, H, D, W, norm):
    C = H * D
    x, w = torch.randn(B, T, C), torch.randn(C, 1, W)
    y = conv_silu_norm(x, w, head_dim=D if norm else None, eps=1e-6)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert rel(y, naive(x, w, True, D if norm else None, 1e-6)) < 1e-6


def test_float16_and_no_silu():
    x, w = torch.randn(2, 37, 48).half(), torch.randn(48, 4)
    y = conv_silu_norm(x, w, silu=False, head_dim=16)
    assert y.dtype == torch.float16
    assert rel(y, naive(x.float(), w, False, 16, 1e-6)) < 2e-3


def test_errors():
    x, w = torch.randn(1, 5, 32), torch.randn(32, 4)
    with pytest.raises(ValueError, match="B, T, C"):
        conv_silu_norm(x[0], w)
    with pytest.raises(ValueError, match="channels"):
        conv_silu_norm(x, w[:16])
    with pytest.raises(ValueError, match="head_dim"):
        conv_silu_norm(x, w, head_dim=12)
    with pytest.raises(ValueError, match="eps"):
        conv_silu_norm(x, w, head_dim=16, eps=0.0)


@pytest.mark.gpu
def test_gpu_bf16_k3_width():
    # K3's KDA: 96 heads x 128 (C = 12288), conv 4, bf16, against the float32 reference ops
    from backends.reference import ops as R
    x = torch.randn(1, 4097, 12288, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(12288, 4, device="cuda", dtype=torch.bfloat16) * 0.5
    y = conv_silu_norm(x, w, head_dim=128)
    r = R.l2norm(R.silu(R.short_conv(x.float(), w.float())[0]).view(1, 4097, 96, 128)).view(1, 4097, 12288)
    assert ((y.float() - r).norm() / r.norm()).item() < 1e-2


_COMPILE = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from backends.triton.conv import _conv_silu_norm_kernel as k
for dt in ("*bf16", "*fp16", "*fp32"):
    sig = dict(x=dt, w=dt, y=dt, T="i32", C="i32", eps="fp32", D="constexpr", BD="constexpr", W="constexpr",
               BT="constexpr", SILU="constexpr", NORM="constexpr")
    ck = triton.compile(ASTSource(k, sig, dict(D=128, BD=128, W=4, BT=32, SILU=True, NORM=True)),
                        target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    assert ck.asm["ptx"]
print("OK")
"""


def test_hopper_compile():
    """The kernel compiles for sm_90 (no GPU needed: fresh process, interpreter off)."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", _COMPILE], env=env, cwd=root, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]
