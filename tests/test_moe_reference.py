"""Reference MoE / Quantile Balancing ops against definitions written out independently here
(plain Python loops over tokens and experts, no sorting helpers shared with the module)."""
import math

import pytest
import torch

from backends.reference import moe as ref


def rel_rms(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ---------------------------------------------------------------- independent definitions
def naive_topk_row(vals, k):
    """k indices of the largest values, ties to the lower index, by repeated argmax scans."""
    vals = [float(v) for v in vals]
    taken = []
    for _ in range(k):
        best = None
        for j, v in enumerate(vals):
            if j in taken:
                continue
            if best is None or v > vals[best]:  # strict: an equal value later never wins
                best = j
        taken.append(best)
    return taken


def kth_largest(vals, k1):
    """k1-th largest (1-based) of a list, counting duplicates."""
    return sorted((float(v) for v in vals), reverse=True)[k1 - 1]


def naive_route(x, w, b, k, scaling):
    s = torch.sigmoid(x.double() @ w.double().t())
    n = x.shape[0]
    idx = torch.zeros(n, k, dtype=torch.long)
    wt = torch.zeros(n, k, dtype=torch.float64)
    for i in range(n):
        row = (s[i] + b.double()).tolist()
        pick = naive_topk_row(row, k)
        idx[i] = torch.tensor(pick)
        tot = sum(float(s[i, j]) for j in pick)
        for c, j in enumerate(pick):
            wt[i, c] = float(s[i, j]) / tot * scaling
    return idx, wt, s


def naive_qb(scores, bias, k, ema):
    s = scores.double()
    b = bias.double()
    n, e = s.shape
    alpha = [kth_largest((s[i] + b).tolist(), k + 1) for i in range(n)]
    q = math.floor(n * k / e)
    b_hat = []
    for j in range(e):
        col = [float(s[i, j]) - alpha[i] for i in range(n)]
        b_hat.append(-kth_largest(col, q + 1))
    mean = sum(b_hat) / e
    return torch.tensor([ema * float(b[j]) + (1 - ema) * (b_hat[j] - mean) for j in range(e)])


def naive_experts(x, idx, wt, w1, w3, w2, act="situ", bg=4.0, bu=25.0):
    n, l = x.shape
    out = torch.zeros(n, l, dtype=torch.float64)
    for t in range(n):
        for c in range(idx.shape[1]):
            e = int(idx[t, c])
            a = w1[e].double() @ x[t].double()
            bb = w3[e].double() @ x[t].double()
            if act == "silu":
                h = a * torch.sigmoid(a) * bb
            else:
                h = bg * torch.tanh(a / bg) * torch.sigmoid(a) * bu * torch.tanh(bb / bu)
            out[t] += wt[t, c].double() * (w2[e].double() @ h)
    return out


# ---------------------------------------------------------------- qb_route
@pytest.mark.parametrize("n,d,e,k", [(1, 8, 4, 1), (63, 16, 12, 3), (100, 24, 33, 8), (65, 8, 16, 16)])
def test_qb_route_matches_naive(n, d, e, k):
    x = torch.randn(n, d)
    w = torch.randn(e, d) / d ** 0.5
    b = torch.randn(e) * 0.1
    scaling = float(torch.rand(()) * 2 + 0.5)
    idx, wt, s = ref.qb_route(x, w, b, top_k=k, routed_scaling=scaling)
    assert idx.dtype == torch.int64 and wt.dtype == torch.float32 and s.dtype == torch.float32
    assert idx.shape == (n, k) and wt.shape == (n, k) and s.shape == (n, e)
    nidx, nwt, ns = naive_route(x, w, b, k, scaling)
    assert rel_rms(s, ns) < 1e-6
    assert torch.equal(idx, nidx)
    assert rel_rms(wt, nwt) < 1e-6


def test_qb_route_ties_go_to_lower_index():
    e, k, n = 40, 6, 50
    w = torch.zeros(e, 4)
    # bias with many exact ties: values in {0, 0.5}; scores are all sigmoid(0)=0.5 (x @ 0)
    b = (torch.rand(e) < 0.5).float() * 0.5
    x = torch.randn(n, 4)
    idx, _, _ = ref.qb_route(x, w, b, top_k=k)
    high = [j for j in range(e) if b[j] > 0]
    low = [j for j in range(e) if b[j] == 0]
    expect = (high + low)[:k]
    for i in range(n):
        assert idx[i].tolist() == expect
    # all equal: first k experts
    idx2, wt2, _ = ref.qb_route(x, w, torch.zeros(e), top_k=k)
    assert (idx2 == torch.arange(k)).all()
    assert torch.allclose(wt2, torch.full_like(wt2, 1.0 / k))


def test_qb_route_nan_row_raises_naming_row():
    x = torch.randn(70, 8)
    bad = int(torch.randint(0, 70, ()))
    x[bad, 3] = float("nan") if bad % 2 else float("inf")
    with pytest.raises(ValueError, match=f"row {bad} "):
        ref.qb_route(x, torch.randn(5, 8), torch.zeros(5), top_k=2)


def test_qb_route_bad_args():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError):
        ref.qb_route(x, torch.randn(5, 7), torch.zeros(5), top_k=2)
    with pytest.raises(ValueError):
        ref.qb_route(x, torch.randn(5, 8), torch.zeros(5), top_k=6)
    with pytest.raises(ValueError):
        ref.qb_route(x, torch.randn(5, 8), torch.zeros(4), top_k=2)
    with pytest.raises(TypeError):
        ref.qb_route(x, torch.randn(5, 8), torch.zeros(5), top_k=2.0)


def test_qb_route_gradient_flows_to_router_weight():
    x = torch.randn(30, 8)
    w = torch.randn(6, 8, requires_grad=True)
    _, wt, _ = ref.qb_route(x, w, torch.zeros(6), top_k=2)
    (wt * torch.randn_like(wt)).sum().backward()
    assert w.grad is not None and torch.isfinite(w.grad).all() and w.grad.abs().sum() > 0


# ---------------------------------------------------------------- qb_update
@pytest.mark.parametrize("n,e,k", [(1, 4, 1), (63, 12, 3), (100, 33, 8), (65, 7, 2), (5, 16, 2)])
@pytest.mark.parametrize("ema", [0.0, 0.7])
def test_qb_update_matches_naive(n, e, k, ema):
    s = torch.rand(n, e)
    b = torch.randn(e) * 0.05
    nb = ref.qb_update(s, b, top_k=k, ema=ema)
    assert nb.dtype == torch.float32 and nb.shape == (e,)
    expect = naive_qb(s, b, k, ema)
    # float32 module vs this float64 derivation: centring cancels the common part of b_hat, so the error of
    # the rest is some float32 ulps of |b_hat| (worst of 4000 draws: 1.34e-6; CI once saw 1.01e-6 > 1e-6)
    assert rel_rms(nb, expect) < 1e-5
    if ema == 0.0:
        assert abs(float(nb.double().mean())) < 1e-6


@pytest.mark.parametrize("n,e,k", [(100, 33, 8), (257, 20, 4), (64, 16, 4), (9, 13, 1)])
def test_qb_property_q_tokens_clear_cutoff(n, e, k):
    s = torch.rand(n, e)
    b = torch.randn(e) * 0.1
    nb = ref.qb_update(s, b, top_k=k)
    q = (n * k) // e
    # alpha fixed (computed with the OLD bias), independently, in float64
    alpha = torch.tensor([kth_largest((s[i].double() + b.double()).tolist(), k + 1) for i in range(n)],
                         dtype=torch.float64)
    margin = s.double() - alpha[:, None]
    b_hat = torch.tensor([-kth_largest(margin[:, j].tolist(), q + 1) for j in range(e)], dtype=torch.float64)
    # the module returns b_hat centred (float32 against this float64 derivation: centring cancels the common
    # part of b_hat, so the relative error of the rest is some float32 ulps of |b_hat|; seen up to 1.2e-6)
    assert rel_rms(nb.double(), b_hat - b_hat.mean()) < 1e-5
    # with alpha fixed: at most q tokens clear the cut-off strictly, and at least q+1 reach it;
    # exactly q wherever the (q+1)-th margin is not tied (ties are structural: a token whose
    # (k+1)-th expert is j has margin exactly -b_j)
    above = (margin + b_hat[None, :] > 0).sum(0)
    reach = (margin + b_hat[None, :] >= 0).sum(0)
    tied = (margin + b_hat[None, :] == 0).sum(0)
    assert (above <= q).all() and (reach >= q + 1).all()
    assert (above[tied == 1] == q).all()
    # the recovered b_hat applied as a bias (alpha fixed) gives the same counts
    cleared = (s.double() + b_hat[None, :] > alpha[:, None]).sum(0)
    assert (cleared[tied == 1] == q).all()


def test_qb_property_exact_without_ties():
    # experts 0..k always hold the k+1 largest scores, so every cut-off alpha_i comes from them
    # and the margins of experts k+1..E-1 are continuous and tie-free: exactly q clear the cut-off
    n, e, k = 300, 24, 3
    s = torch.rand(n, e) * 0.8
    s[:, : k + 1] = 0.9 + 0.1 * torch.rand(n, k + 1)
    b = torch.zeros(e)
    nb = ref.qb_update(s, b, top_k=k)
    alpha = torch.tensor([kth_largest(s[i].double().tolist(), k + 1) for i in range(n)], dtype=torch.float64)
    q = (n * k) // e
    margin = s.double() - alpha[:, None]
    b_hat = torch.tensor([-kth_largest(margin[:, j].tolist(), q + 1) for j in range(e)], dtype=torch.float64)
    assert rel_rms(nb.double(), b_hat - b_hat.mean()) < 1e-6
    c = float(b_hat.mean())
    recovered = nb.double() + c  # b_hat as the module computed it (float32)
    cleared = (s.double()[:, k + 1:] + recovered[None, k + 1:] > alpha[:, None] + 1e-7).sum(0)
    cleared_hat = (margin[:, k + 1:] + b_hat[None, k + 1:] > 0).sum(0)
    assert (cleared_hat == q).all(), cleared_hat
    assert (cleared == q).all(), cleared


def test_qb_update_balances_skewed_router():
    # strong per-expert skew; each step's bias is applied to a fresh batch of the same distribution
    e, k, n, d = 64, 4, 4096, 16
    w = torch.randn(e, d) / d ** 0.5
    skew = torch.linspace(-3, 3, e)

    def batch():
        return torch.sigmoid(torch.randn(n, d) @ w.t() + skew)

    b = torch.zeros(e)
    mean = n * k / e
    ratios = []
    for _ in range(5):
        s = batch()
        load = ref.expert_load(ref.biased_topk(s + b, k), e)
        ratios.append(float(load.max()) / mean)
        b = ref.qb_update(s, b, top_k=k)
    assert ratios[0] > 4.0
    assert ratios[-1] < 1.5, ratios


def test_qb_update_edge_cases():
    # q = 0 (N k < E): nobody clears the cut-off
    s = torch.rand(3, 20)
    b = torch.zeros(20)
    nb = ref.qb_update(s, b, top_k=2)
    assert rel_rms(nb, naive_qb(s, b, 2, 0.0)) < 1e-6
    # top_k == E: bias irrelevant, b_new = 0
    nb = ref.qb_update(torch.rand(10, 5), torch.randn(5), top_k=5)
    assert torch.equal(nb, torch.zeros(5))
    # N == 0: no information, the bias unchanged
    b = torch.randn(6)
    nb = ref.qb_update(torch.rand(0, 6), b, top_k=2)
    assert torch.equal(nb, b)
    # one token, one expert per token
    s = torch.rand(1, 7)
    assert rel_rms(ref.qb_update(s, torch.zeros(7), top_k=1), naive_qb(s, torch.zeros(7), 1, 0.0)) < 1e-6
    with pytest.raises(ValueError, match="row 1 "):
        ref.qb_update(torch.tensor([[0.1, 0.2], [float("nan"), 0.3]]), torch.zeros(2), top_k=1)
    with pytest.raises(ValueError):
        ref.qb_update(torch.rand(4, 5), torch.zeros(5), top_k=2, ema=1.0)


def test_fixed_step_and_expert_load():
    e = 11
    idx = torch.randint(0, e, (57, 3))
    load = ref.expert_load(idx, e)
    expect = [sum(int(v == j) for v in idx.flatten().tolist()) for j in range(e)]
    assert load.tolist() == expect and load.dtype == torch.int64
    b = torch.randn(e)
    nb = ref.fixed_step_update(b, load, step=1e-3)
    mean = sum(expect) / e
    for j in range(e):
        sgn = (mean > expect[j]) - (mean < expect[j])
        assert abs(float(nb[j]) - (float(b[j]) + 1e-3 * sgn)) < 1e-6
    with pytest.raises(ValueError):
        ref.expert_load(torch.tensor([[0, e]]), e)


# ---------------------------------------------------------------- situ_glu / experts
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_situ_glu(dtype):
    a = (torch.randn(1000) * 30).to(dtype)
    b = (torch.randn(1000) * 60).to(dtype)
    h = ref.situ_glu(a, b)
    assert h.dtype == dtype
    ad, bd = a.double(), b.double()
    expect = 4.0 * torch.tanh(ad / 4.0) * torch.sigmoid(ad) * 25.0 * torch.tanh(bd / 25.0)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert rel_rms(h, expect) < tol
    assert h.double().abs().max() <= 100.0 + 1e-3
    # near zero it is SwiGLU
    a0, b0 = torch.randn(100) * 1e-2, torch.randn(100) * 1e-2
    assert rel_rms(ref.situ_glu(a0, b0), torch.nn.functional.silu(a0) * b0) < 1e-3


@pytest.mark.parametrize("n,l,e,i,k", [(1, 8, 4, 6, 2), (63, 12, 9, 10, 3), (100, 16, 33, 8, 8)])
@pytest.mark.parametrize("act", ["situ", "silu"])
def test_moe_experts_matches_naive(n, l, e, i, k, act):
    x = torch.randn(n, l)
    w1, w3 = torch.randn(e, i, l) / l ** 0.5, torch.randn(e, i, l) / l ** 0.5
    w2 = torch.randn(e, l, i) / i ** 0.5
    idx = torch.stack([torch.randperm(e)[:k] for _ in range(n)])
    wt = torch.rand(n, k)
    u = ref.moe_experts(x, idx, wt, w1, w3, w2, activation=act)
    assert u.dtype == torch.float32 and u.shape == (n, l)
    assert rel_rms(u, naive_experts(x, idx, wt, w1, w3, w2, act)) < 1e-5


def test_moe_experts_all_tokens_one_expert_and_empty_experts():
    n, l, e, i = 65, 8, 10, 12
    x = torch.randn(n, l)
    w1, w3, w2 = torch.randn(e, i, l), torch.randn(e, i, l), torch.randn(e, l, i)
    one = int(torch.randint(0, e, ()))
    idx = torch.full((n, 1), one, dtype=torch.long)
    wt = torch.rand(n, 1)
    u = ref.moe_experts(x, idx, wt, w1, w3, w2)
    assert rel_rms(u, naive_experts(x, idx, wt, w1, w3, w2)) < 1e-5
    # bf16 input keeps its dtype
    u16 = ref.moe_experts(x.bfloat16(), idx, wt, w1, w3, w2)
    assert u16.dtype == torch.bfloat16
    with pytest.raises(ValueError):
        ref.moe_experts(x, idx + e, wt, w1, w3, w2)
    with pytest.raises(ValueError):
        ref.moe_experts(x, idx, wt, w1, w3, w2, activation="gelu")


def test_moe_experts_gradients():
    n, l, e, i, k = 20, 6, 5, 7, 2
    x = torch.randn(n, l, dtype=torch.float64, requires_grad=True)
    w1 = torch.randn(e, i, l, dtype=torch.float64, requires_grad=True)
    w3 = torch.randn(e, i, l, dtype=torch.float64, requires_grad=True)
    w2 = torch.randn(e, l, i, dtype=torch.float64, requires_grad=True)
    idx = torch.stack([torch.randperm(e)[:k] for _ in range(n)])
    wt = torch.rand(n, k, dtype=torch.float64, requires_grad=True)
    # reference computes in float32; compare gradient directions against the float64 naive loop
    u = ref.moe_experts(x, idx, wt, w1, w3, w2)
    g = torch.randn_like(u)
    grads = torch.autograd.grad((u * g).sum(), (x, wt, w1, w3, w2))
    expect = torch.autograd.grad((naive_experts(x, idx, wt, w1, w3, w2) * g).sum(), (x, wt, w1, w3, w2))
    for a, b in zip(grads, expect):
        assert rel_rms(a, b) < 1e-4


# ---------------------------------------------------------------- latent_moe
def naive_latent(x, rw, rb, wd, w1, w3, w2, nw, wu, s1, s3, s2, k, scaling, eps):
    idx, wt, _ = naive_route(x, rw, rb, k, scaling)
    xl = x.double() @ wd.double().t()
    u = naive_experts(xl, idx, wt, w1, w3, w2)
    un = u / torch.sqrt((u * u).mean(-1, keepdim=True) + eps) * nw.double()
    a, b = x.double() @ s1.double().t(), x.double() @ s3.double().t()
    h = 4 * torch.tanh(a / 4) * torch.sigmoid(a) * 25 * torch.tanh(b / 25)
    return h @ s2.double().t() + un @ wu.double().t(), idx


@pytest.mark.parametrize("n", [1, 63])
def test_latent_moe_matches_naive(n):
    d, lat, e, i, k, i_s = 16, 8, 12, 6, 3, 10
    x = torch.randn(n, d)
    rw, rb = torch.randn(e, d) / 4, torch.randn(e) * 0.1
    wd, wu = torch.randn(lat, d) / 4, torch.randn(d, lat) / 3
    w1, w3, w2 = torch.randn(e, i, lat) / 3, torch.randn(e, i, lat) / 3, torch.randn(e, lat, i) / 3
    nw = torch.rand(lat) + 0.5
    s1, s3, s2 = torch.randn(i_s, d) / 4, torch.randn(i_s, d) / 4, torch.randn(d, i_s) / 3
    y, idx = ref.latent_moe(x, rw, rb, wd, w1, w3, w2, nw, wu, s1, s3, s2, top_k=k,
                            routed_scaling=2.5, eps=1e-6)
    ey, eidx = naive_latent(x, rw, rb, wd, w1, w3, w2, nw, wu, s1, s3, s2, k, 2.5, 1e-6)
    assert torch.equal(idx, eidx)
    assert y.shape == (n, d) and y.dtype == torch.float32
    assert rel_rms(y, ey) < 1e-5


@pytest.mark.parametrize("n,k", [(0, 2), (5, 0)])
def test_moe_experts_no_rows_backward_gives_zero_gradients(n, k):
    # no (token, slot) row: u is zeros and still differentiable, every gradient an exact zero of its shape
    e, i, l = 4, 6, 8
    x = torch.randn(n, l, requires_grad=True)
    idx = torch.zeros(n, k, dtype=torch.long)
    wt = torch.rand(n, k, requires_grad=True)
    ws = [torch.randn(e, i, l).requires_grad_(), torch.randn(e, i, l).requires_grad_(),
          torch.randn(e, l, i).requires_grad_()]
    u = ref.moe_experts(x, idx, wt, *ws)
    assert u.shape == (n, l) and torch.equal(u, torch.zeros(n, l))
    grads = torch.autograd.grad(u.sum(), [x, wt] + ws)
    for t, g in zip([x, wt] + ws, grads):
        assert g.shape == t.shape and torch.equal(g, torch.zeros_like(t))
