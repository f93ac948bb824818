"""mla_attention: the Triton backend's (torch's fused SDPA) against the reference and a float64 softmax written
here from spec/OPS.md; argument checks shared by both (cu_seqlens offsets, shapes, dtypes, scale)."""
import pytest
import torch

from backends import reference as R
from backends.triton.mla import mla_attention as T_mla


def naive(q, k, v, scale, causal, bounds=None):
    """float64, one (batch, head) at a time; bounds: packed sequences [(start, end)] of a B == 1 input."""
    B, T, H, _ = q.shape
    out = torch.zeros(B, T, H, v.shape[-1], dtype=torch.float64)
    segs = bounds or [(0, T)]
    for b in range(B):
        for h in range(H):
            for s, e in segs:
                for i in range(s, e):
                    last = i + 1 if causal else e
                    logits = torch.stack([scale * (q[b, i, h].double() @ k[b, j, h].double()) for j in range(s, last)])
                    p = torch.softmax(logits, 0)
                    out[b, i, h] = (p[:, None] * v[b, s:last, h].double()).sum(0)
    return out


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dqk,dv", [(24, 16), (16, 24), (20, 20)])
def test_matches_reference_and_naive(causal, dqk, dv):
    B, T, H = 2, 37, 3
    q, k, v = torch.randn(B, T, H, dqk), torch.randn(B, T, H, dqk), torch.randn(B, T, H, dv)
    scale = dqk ** -0.5 * 1.7
    ref = naive(q, k, v, scale, causal)
    for fn in (R.mla_attention, T_mla):
        o = fn(q, k, v, scale=scale, causal=causal)
        assert o.shape == (B, T, H, dv) and o.dtype == v.dtype
        assert rel(o, ref) < 1e-5


def test_packed_sequences_and_gradients():
    T, H, dqk, dv = 40, 2, 16, 8
    cu = torch.tensor([0, 5, 5, 31, 40], dtype=torch.int32)
    bounds = [(0, 5), (5, 5), (5, 31), (31, 40)]
    q, k, v = (torch.randn(1, T, H, d, requires_grad=True) for d in (dqk, dqk, dv))
    ref = naive(q.detach(), k.detach(), v.detach(), 0.3, True, bounds)
    o = T_mla(q, k, v, scale=0.3, cu_seqlens=cu)
    o_r = R.mla_attention(q, k, v, scale=0.3, cu_seqlens=cu)
    assert rel(o, ref) < 1e-5 and rel(o_r, ref) < 1e-5
    go = torch.randn_like(o)
    g = torch.autograd.grad((o * go).sum(), (q, k, v))
    g_r = torch.autograd.grad((o_r * go).sum(), (q, k, v))
    assert all(rel(a, b) < 1e-5 for a, b in zip(g, g_r))


@pytest.mark.parametrize("fn", [R.mla_attention, T_mla], ids=["reference", "triton"])
def test_bad_arguments_are_clear_errors(fn):
    q, k, v = torch.randn(1, 30, 2, 8), torch.randn(1, 30, 2, 8), torch.randn(1, 30, 2, 4)
    for cs in ([0, 10, 20], [0, 10, 40], [0, 20, 10, 30]):           # short of T, past T, decreasing
        with pytest.raises(ValueError, match="cu_seqlens must start at 0, be non-decreasing and end at T=30"):
            fn(q, k, v, scale=1.0, cu_seqlens=torch.tensor(cs))
    with pytest.raises(TypeError, match="cu_seqlens must be an int32/int64 tensor"):
        fn(q, k, v, scale=1.0, cu_seqlens=torch.tensor([0.0, 30.0]))
    with pytest.raises(ValueError, match="needs B == 1"):
        fn(q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1), scale=1.0,
           cu_seqlens=torch.tensor([0, 30]))
    with pytest.raises(TypeError, match="q must be a floating-point tensor"):
        fn(q.long(), k, v, scale=1.0)
    with pytest.raises(ValueError, match=r"q must be \[B, T, H, D\], got shape \[30, 2, 8\]"):
        fn(q[0], k, v, scale=1.0)
    with pytest.raises(ValueError, match="must be equal and share"):
        fn(q, k[:, :29], v, scale=1.0)
    with pytest.raises(TypeError, match="scale must be a real number"):
        fn(q, k, v, scale=None)
    with pytest.raises(ValueError, match="scale must be finite"):
        fn(q, k, v, scale=float("nan"))


@pytest.mark.parametrize("bad", [None, "yes", 1, 0.0])
def test_causal_must_be_a_bool(bad):
    # a truthy / falsy stand-in would silently pick a mask: refused by both backends
    q, k, v = torch.randn(1, 5, 2, 8), torch.randn(1, 5, 2, 8), torch.randn(1, 5, 2, 8)
    for f in (R.mla_attention, T_mla):
        with pytest.raises(TypeError, match="causal must be True or False"):
            f(q, k, v, scale=0.3, causal=bad)
    for ok in (False, torch.tensor(True)):
        want = R.mla_attention(q, k, v, scale=0.3, causal=bool(ok))
        assert torch.allclose(T_mla(q, k, v, scale=0.3, causal=ok), want, atol=1e-6)
