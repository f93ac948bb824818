"""Reference simple ops and the MLA core against naive re-derivations written here."""
import math

import pytest
import torch

from backends import reference as R


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_l2norm(dtype):
    x = torch.randn(3, 37, 100).to(dtype)
    w = torch.randn(100).to(dtype)
    xd, wd = x.double(), w.double()
    want = xd / torch.sqrt((xd ** 2).mean(-1, keepdim=True) + 1e-6) * wd
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert R.rmsnorm(x, w).dtype == dtype and rel(R.rmsnorm(x, w), want) < tol
    want = xd / torch.sqrt((xd ** 2).sum(-1, keepdim=True) + 1e-6)
    assert rel(R.l2norm(x), want) < tol


def test_short_conv_matches_loop_with_state():
    B, T, C, W = 2, 100, 7, 4
    x = torch.randn(B, T, C)
    w = torch.randn(C, 1, W)
    init = torch.randn(B, C, W - 1)
    y, fin = R.short_conv(x, w, initial_state=init, output_final_state=True)
    hist = torch.cat([init.transpose(1, 2), x], 1).double()          # [B, W-1+T, C]
    want = torch.zeros(B, T, C, dtype=torch.float64)
    for t in range(T):
        for j in range(W):
            want[:, t] += w[:, 0, j].double() * hist[:, t + j]
    assert rel(y, want) < 1e-6
    assert torch.equal(fin, hist[:, -(W - 1):].transpose(1, 2).float())
    # streaming: two halves with the carried state equal the whole
    y1, s1 = R.short_conv(x[:, :63], w, initial_state=init, output_final_state=True)
    y2, _ = R.short_conv(x[:, 63:], w, initial_state=s1)
    assert rel(torch.cat([y1, y2], 1), want) < 1e-6


@pytest.mark.parametrize("T", [1, 65, 100])
def test_mla_attention_matches_loop(T):
    B, H, Dqk, Dv = 2, 3, 24, 16
    q, k = torch.randn(B, T, H, Dqk), torch.randn(B, T, H, Dqk)
    v = torch.randn(B, T, H, Dv)
    scale = 1 / math.sqrt(Dqk)
    o = R.mla_attention(q, k, v, scale=scale)
    want = torch.empty(B, T, H, Dv, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for t in range(T):
                s = torch.tensor([float(q[b, t, h].double() @ k[b, j, h].double()) * scale for j in range(t + 1)],
                                 dtype=torch.float64)
                p = torch.exp(s - s.max())
                p = p / p.sum()
                want[b, t, h] = (p[:, None] * v[b, : t + 1, h].double()).sum(0)
    assert o.shape == (B, T, H, Dv) and rel(o, want) < 1e-5


def test_mla_attention_varlen_equals_separate_sequences():
    lens = [5, 17, 1, 40]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)))
    T, H, D = sum(lens), 2, 8
    q, k, v = (torch.randn(1, T, H, D) for _ in range(3))
    o = R.mla_attention(q, k, v, scale=0.3, cu_seqlens=cu)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        ref = R.mla_attention(q[:, a:b], k[:, a:b], v[:, a:b], scale=0.3)
        assert rel(o[:, a:b], ref) < 1e-6


def test_embedding_rejects_out_of_range_ids():
    w = torch.randn(10, 4)
    with pytest.raises(IndexError, match="token id 12"):
        R.embedding(torch.tensor([[1, 12]]), w)


def test_short_conv_width_one_final_state_is_empty():
    """Width 1 keeps no past inputs: the final state is an empty float32 [B, C, 0] tensor (it was None, which a
    decoding loop reading state.shape tripped on; new-user trial, 16th session), and it feeds the next call."""
    import backends.reference as R
    x, w = torch.randn(2, 7, 5), torch.randn(5, 1, 1)
    y, st = R.short_conv(x, w, output_final_state=True)
    assert st is not None and st.shape == (2, 5, 0) and st.dtype == torch.float32
    assert torch.allclose(y, x * w.view(1, 1, 5), rtol=1e-6, atol=1e-6)
    y2, st2 = R.short_conv(x[:, :3], w, initial_state=st, output_final_state=True)
    assert st2.shape == (2, 5, 0) and torch.allclose(y2, y[:, :3], rtol=1e-6, atol=1e-6)
    _, st0 = R.short_conv(x[:, :0], w, output_final_state=True)          # T = 0
    assert st0.shape == (2, 5, 0)
    _, st4 = R.short_conv(x, torch.randn(5, 1, 4), output_final_state=True)
    assert torch.equal(st4, x[:, -3:].transpose(1, 2))                  # width 4: the last 3 inputs
