"""kda_chunk without a promised bound (lower_bound=None, e.g. Kimi Linear's softplus gate): the diagonal 16x16
tiles as dense dots on operands anchored below the block's start (backends/triton/kda/common.py _diag_tiles,
_diag_grads), and the rows of a block whose gate fell too far for them token pair by token pair. Checked against
the reference's autograd (float32, interpreter on the CPU), forward and every gradient."""
import pytest
import torch

import backends.reference.kda as R

tk = pytest.importorskip("backends.triton.kda")


def rel_rms(a, b):
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


def gates(kind, B, T, H, K):
    if kind == "mild":           # every row of every block on the dense diagonal tile
        return -5.0 * torch.sigmoid(2 * torch.randn(B, T, H, K))
    if kind == "mixed":          # channel 0 falls ~10 nats a token: later rows of each block leave the dense range
        g = -0.5 * torch.rand(B, T, H, K)
        g[..., 0] = -20.0 * torch.rand(B, T, H)
        return g
    return -80.0 * torch.rand(B, T, H, K)        # "strong": nearly every row pair by pair


@pytest.mark.parametrize("kind,T,dtype", [("mild", 100, torch.float32), ("mixed", 100, torch.float32),
                                          ("strong", 37, torch.float32), ("mixed", 77, torch.float16)])
def test_unbounded_forward_and_gradients(kind, T, dtype):
    B, H, K, V = 1, 2, 16, 16
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1)
    v = torch.randn(B, T, H, V)
    g = gates(kind, B, T, H, K)
    beta = torch.rand(B, T, H)
    h0 = torch.randn(B, H, K, V)
    ins = [t.to(dtype) for t in (q, k, v)] + [g, beta.to(dtype), h0]
    ins = [t.requires_grad_() for t in ins]
    do, dS = torch.randn(B, T, H, V), torch.randn(B, H, K, V)
    o, S = tk.kda_chunk(*ins[:5], initial_state=ins[5], output_final_state=True, lower_bound=None)
    got = torch.autograd.grad((o.float() * do).sum() + (S * dS).sum(), ins)
    ref_in = [t.detach().double().requires_grad_() for t in ins]
    o_r, S_r = R.kda_chunk(*ref_in[:5], initial_state=ref_in[5], output_final_state=True)
    want = torch.autograd.grad((o_r * do.double()).sum() + (S_r * dS.double()).sum(), ref_in)
    tol = 5e-5 if dtype == torch.float32 else 2e-3
    assert torch.isfinite(o).all() and rel_rms(o, o_r) < tol
    for name, a, b in zip("q k v g beta h0".split(), got, want):
        assert torch.isfinite(a).all(), name
        assert rel_rms(a, b) < tol, (name, rel_rms(a, b))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["mild", "mixed"])
def test_gpu_unbounded_bf16(kind):
    # bf16 at a real head size and a T past the pipelined forward's and the segments' thresholds, against float64
    B, T, H, K, V = 1, 4097, 4, 128, 128
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1)
    v, g, beta = torch.randn(B, T, H, V), gates(kind, B, T, H, K), torch.rand(B, T, H)
    ins = [t.cuda().to(dt).requires_grad_() for t, dt in
           zip((q, k, v, g, beta), (torch.bfloat16,) * 3 + (torch.float32, torch.bfloat16))]
    do = torch.randn(B, T, H, V, device="cuda")
    o, _ = tk.kda_chunk(*ins, lower_bound=None)
    got = torch.autograd.grad((o.float() * do).sum(), ins)
    ref_in = [t.detach().double().requires_grad_() for t in ins]
    o_r, _ = R.kda_chunk(*ref_in)
    want = torch.autograd.grad((o_r * do.double()).sum(), ref_in)
    assert rel_rms(o, o_r) < 1e-2
    for name, a, b in zip("q k v g beta".split(), got, want):
        assert torch.isfinite(a).all() and rel_rms(a, b) < 2e-2, (name, rel_rms(a, b))
