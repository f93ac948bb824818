"""backends.triton.rms_norm against the reference rmsnorm (torch autograd of backends.reference.ops.rmsnorm).
On CPU under TRITON_INTERPRET=1 in float32; the GPU case (bf16, the K3 latent width) carries @pytest.mark.gpu."""
import pytest
import torch

from backends.reference import ops as R
from backends.triton.norm import rms_norm

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def rel_rms(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _check(shape, dtype, tol_y, tol_g, eps=1e-6, scale=1.0):
    x = (torch.randn(*shape, device=DEV) * scale).to(dtype).requires_grad_()
    w = (torch.rand(shape[-1], device=DEV) + 0.5).requires_grad_()
    g = torch.randn(*shape, device=DEV).to(dtype)
    y = rms_norm(x, w, eps)
    assert y.dtype == dtype and y.shape == x.shape
    dx, dw = torch.autograd.grad(y, (x, w), g)
    xr = x.detach().double().requires_grad_()
    wr = w.detach().double().requires_grad_()
    yr = R.rmsnorm(xr, wr, eps=eps)
    dxr, dwr = torch.autograd.grad(yr, (xr, wr), g.double())
    assert rel_rms(y, yr) < tol_y
    assert rel_rms(dx, dxr) < tol_g
    assert dw.dtype == w.dtype and rel_rms(dw, dwr) < tol_g


@pytest.mark.parametrize("shape", [(1, 7), (100, 48), (1000, 33), (37, 5, 130)])
def test_rms_norm_matches_reference_float32(shape):
    _check(shape, torch.float32, 1e-6, 1e-5)


def test_rms_norm_eps_dominates_zero_rows():
    # all-zero rows: y = 0 and dx = g w / sqrt(eps), finite; a large eps changes the result as the reference's
    x = torch.zeros(5, 16, device=DEV).requires_grad_()
    w = torch.rand(16, device=DEV) + 0.5
    g = torch.randn(5, 16, device=DEV)
    y = rms_norm(x, w, 0.25)
    (dx,) = torch.autograd.grad(y, (x,), g)
    assert torch.equal(y, torch.zeros_like(y))
    assert torch.allclose(dx, g * w / 0.5, rtol=1e-6, atol=0)
    _check((64, 24), torch.float32, 1e-6, 1e-5, eps=0.5, scale=0.3)


def test_rms_norm_strided_input_and_no_weight_grad():
    base = torch.randn(50, 80, device=DEV)
    x = base[:, 10:74]  # rows of 64 with stride 80
    w = torch.rand(64, device=DEV) + 0.5  # no grad
    y = rms_norm(x, w)
    assert rel_rms(y, R.rmsnorm(x, w)) < 1e-6
    xg = x.clone().requires_grad_()
    (dx,) = torch.autograd.grad(rms_norm(xg, w).sum(), (xg,))
    xr = x.double().requires_grad_()
    (dxr,) = torch.autograd.grad(R.rmsnorm(xr, w.double()).sum(), (xr,))
    assert rel_rms(dx, dxr) < 1e-5


def test_rms_norm_empty_and_bad_input():
    x = torch.randn(0, 12, device=DEV, requires_grad=True)
    w = torch.ones(12, device=DEV, requires_grad=True)
    y = rms_norm(x, w)
    dx, dw = torch.autograd.grad(y.sum(), (x, w))
    assert y.shape == (0, 12) and dx.shape == (0, 12) and torch.equal(dw, torch.zeros(12, device=DEV))
    with pytest.raises(ValueError, match=r"weight must be a float \[D=12\]"):
        rms_norm(torch.randn(3, 12, device=DEV), torch.ones(11, device=DEV))
    with pytest.raises(TypeError, match="floating-point"):
        rms_norm(torch.ones(3, 12, dtype=torch.int64, device=DEV), torch.ones(12, device=DEV))
    with pytest.raises(ValueError, match="eps"):
        rms_norm(torch.randn(3, 12, device=DEV), torch.ones(12, device=DEV), eps=0.0)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [4097, 32768])
def test_gpu_rms_norm_bf16_latent_width(n):
    # the latent MoE's norm on u: d 3584, bf16 in and out, float32 weight
    _check((n, 3584), torch.bfloat16, 5e-3, 1e-2, scale=3.0)


def test_rms_norm_wide_rows_take_the_reference(monkeypatch):
    # past MAX_D the row does not fit one program: the reference's torch ops, same values and gradients
    import backends.triton.norm as N
    monkeypatch.setattr(N, "MAX_D", 32)
    x = torch.randn(7, 40, device=DEV, requires_grad=True)
    w = (torch.rand(40, device=DEV) + 0.5).requires_grad_()
    y = N.rms_norm(x, w)
    assert y.grad_fn is not None and "RMSNormFn" not in type(y.grad_fn).__name__
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    g = torch.randn(7, 40, device=DEV)
    got = torch.autograd.grad(y, (x, w), g)
    want = torch.autograd.grad(R.rmsnorm(xr, wr), (xr, wr), g.double())
    assert rel_rms(y, R.rmsnorm(xr, wr)) < 1e-6
    for a_, b_ in zip(got, want):
        assert rel_rms(a_, b_) < 1e-5


def test_rms_norm_zero_width_and_numpy_eps():
    import numpy as np
    x = torch.randn(3, 0, device=DEV, requires_grad=True)
    w = torch.randn(0, device=DEV, requires_grad=True)
    y = rms_norm(x, w)
    assert y.shape == (3, 0)
    dx, dw = torch.autograd.grad(y.sum(), (x, w), allow_unused=True)
    assert dx is None or dx.shape == (3, 0)
    x = torch.randn(20, 24, device=DEV)
    w = torch.rand(24, device=DEV) + 0.5
    assert rel_rms(rms_norm(x, w, np.float32(1e-3)), R.rmsnorm(x.double(), w.double(), eps=1e-3)) < 1e-6


def test_rms_norm_refuses_meta_tensors():
    """Meta tensors (shapes only) get a ValueError naming them, not torch's "Cannot copy out of meta tensor"."""
    x, w = torch.randn(4, 16, device="meta"), torch.ones(16, device="meta")
    with pytest.raises(ValueError, match=r"triton.rms_norm: meta tensors hold no data .*: x, weight"):
        rms_norm(x, w, 1e-6)
    assert R.rmsnorm(x, w).shape == (4, 16)            # the reference op sizes them
