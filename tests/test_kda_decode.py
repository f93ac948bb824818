"""The fused KDA decode step (backends/triton/kda/decode.py) and the in-place kda_step_rows against the reference
ops composed in float64, on cache rows in a non-trivial order (TRITON_INTERPRET=1 on the CPU, float32)."""
import pytest
import torch

from backends.triton.kda.decode import kda_decode_step
from backends.triton.kda.step import kda_step_rows


def _reference_step(xq, xk, xv, cq, ck, cv, wq, wk, wv, f, A_log, dt_bias, b, S, rows, scale, gate, lb, norm):
    """The layer's decode step in float64 from its definition (dsl/ops/kda.py kda_layer, spec/OPS.md kda_step):
    returns (y, new conv states, new S) for the cache rows ``rows`` (other rows unchanged)."""
    d = torch.float64
    B, N, H, K, V = xq.shape[0], S.shape[0], *S.shape[1:]
    cq, ck, cv, S = (t.to(d).clone() for t in (cq, ck, cv, S))

    def conv(x, c, w):
        xe = torch.cat([c[rows], x.to(d)[:, None]], dim=1)                     # [B, W, C]
        c[rows] = xe[:, 1:]
        u = (xe * w.to(d).reshape(w.shape[0], -1).t()[None]).sum(1)
        return u * torch.sigmoid(u)

    def l2(x, D):
        x = x.view(B, H, D)
        return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)

    q, k, v = l2(conv(xq, cq, wq), K), l2(conv(xk, ck, wk), K), conv(xv, cv, wv).view(B, H, V)
    z = (f.to(d) + dt_bias.to(d)).view(B, H, K) * A_log.to(d).exp()[None, :, None] if gate == "sigmoid" else None
    if gate == "sigmoid":
        g = lb * torch.sigmoid(z)
    else:
        g = -A_log.to(d).exp()[None, :, None] * torch.nn.functional.softplus((f.to(d) + dt_bias.to(d)).view(B, H, K))
    beta = torch.sigmoid(b.to(d))
    s = S[rows] * g.exp()[..., None]
    u = v - torch.einsum("bhkv,bhk->bhv", s, k)
    s = s + beta[..., None, None] * k[..., :, None] * u[..., None, :]
    S[rows] = s
    o = scale * torch.einsum("bhkv,bhk->bhv", s, q)
    if norm is not None:
        w_o, gl, eps = norm
        o = o / torch.sqrt((o * o).mean(-1, keepdim=True) + eps) * w_o.to(d) * torch.sigmoid(gl.to(d).view(B, H, V))
    return o.reshape(B, H * V), cq, ck, cv, S


def _inputs(H, K, V, W, B, N, gen):
    r = lambda *s: torch.randn(*s, generator=gen)
    t = dict(xq=r(B, H * K), xk=r(B, H * K), xv=r(B, H * V), conv_q=r(N, W - 1, H * K), conv_k=r(N, W - 1, H * K),
             conv_v=r(N, W - 1, H * V), w_q=r(H * K, 1, W) * 0.5, w_k=r(H * K, 1, W) * 0.5, w_v=r(H * V, 1, W) * 0.5,
             f=r(B, H * K), A_log=r(H) * 0.3, dt_bias=r(H * K), b=r(B, H), state=r(N, H, K, V) * 0.3)
    return t


@pytest.mark.parametrize("H,K,V,W,gate,with_norm,bv", [(3, 32, 48, 4, "sigmoid", True, None),
                                                        (2, 48, 32, 3, "softplus", False, None),
                                                        (3, 20, 40, 2, "sigmoid", True, 16),
                                                        (2, 16, 24, 1, "sigmoid", True, None)])
def test_fused_decode_step_matches_float64_reference(H, K, V, W, gate, with_norm, bv, monkeypatch):
    """Rows 3, 0 of a 4-row cache; the untouched rows stay as they were. bv: a smaller state tile (several V blocks,
    the output norm across them)."""
    import backends.triton.kda.decode as D
    if bv is not None:
        monkeypatch.setattr(D, "STATE_TILE", 32 * bv)
    gen = torch.Generator().manual_seed(H * 1000 + K + V + W)
    t = _inputs(H, K, V, W, 2, 4, gen)
    rows = torch.tensor([3, 0])
    norm = (torch.rand(V, generator=gen) + 0.5, torch.randn(2, H * V, generator=gen), 1e-5) if with_norm else None
    scale, lb = K ** -0.5, -5.0
    want = _reference_step(*t.values(), rows, scale, gate, lb, norm)
    before = {k: t[k].clone() for k in ("conv_q", "conv_k", "conv_v", "state")}
    y = kda_decode_step(*t.values(), rows, scale=scale, gate=gate, lower_bound=lb, norm=norm)
    assert y.shape == (2, H * V) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), want[0], rtol=2e-5, atol=2e-5)
    for name, ref in zip(("conv_q", "conv_k", "conv_v", "state"), want[1:]):
        torch.testing.assert_close(t[name].double(), ref, rtol=2e-5, atol=2e-5, msg=name)
        for r in (1, 2):
            assert torch.equal(t[name][r], before[name][r]), (name, r)


def test_kda_step_rows_updates_the_cache_rows_in_place():
    gen = torch.Generator().manual_seed(7)
    B, N, H, K, V = 2, 5, 3, 48, 40
    q, k, g = (torch.randn(B, H, K, generator=gen) for _ in range(3))
    k = k / k.norm(dim=-1, keepdim=True)
    g = -torch.rand(B, H, K, generator=gen)
    v, beta = torch.randn(B, H, V, generator=gen), torch.rand(B, H, generator=gen)
    S = torch.randn(N, H, K, V, generator=gen)
    rows = torch.tensor([4, 1])
    before = S.clone()
    d = torch.float64
    s = before.to(d)[rows] * g.to(d).exp()[..., None]
    u = v.to(d) - torch.einsum("bhkv,bhk->bhv", s, k.to(d))
    s = s + beta.to(d)[..., None, None] * k.to(d)[..., :, None] * u[..., None, :]
    o_want = K ** -0.5 * torch.einsum("bhkv,bhk->bhv", s, q.to(d))
    ptr = S.data_ptr()
    o = kda_step_rows(q, k, v, g, beta, S, rows)
    assert S.data_ptr() == ptr
    torch.testing.assert_close(o.double(), o_want, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(S[rows].double(), s, rtol=2e-5, atol=2e-5)
    for r in (0, 2, 3):
        assert torch.equal(S[r], before[r])
    with pytest.raises(ValueError, match="distinct"):
        kda_step_rows(q, k, v, g, beta, S, torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="float32"):
        kda_step_rows(q, k, v, g, beta, S.double(), rows)
