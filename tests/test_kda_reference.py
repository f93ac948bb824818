"""Reference KDA (backends/reference/kda.py) against an independent token-by-token recurrence."""
import math

import pytest
import torch

from backends.reference.kda import kda_chunk, kda_gate, kda_step


def naive_recurrence(q, k, v, g, beta, scale, S0=None):
    """spec/OPS.md written as a loop, float64.  q,k,g [T,H,K]; v [T,H,V]; beta [T,H]; S0 [H,K,V]."""
    T, H, K = q.shape
    V = v.shape[-1]
    d = torch.float64
    S = torch.zeros(H, K, V, dtype=d) if S0 is None else S0.to(d).clone()
    out = torch.zeros(T, H, V, dtype=d)
    for t in range(T):
        for h in range(H):
            S[h] = torch.exp(g[t, h].to(d))[:, None] * S[h]
            kt = k[t, h].to(d)
            err = v[t, h].to(d) - S[h].T @ kt
            S[h] = S[h] + beta[t, h].to(d) * torch.outer(kt, err)
            out[t, h] = scale * S[h].T @ q[t, h].to(d)
    return out, S


def rel_rms(a, b):
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


def make_inputs(B, T, H, K, V, gate="sigmoid", dtype=torch.float32, at_bound=False):
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1).to(dtype)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1).to(dtype)
    v = torch.randn(B, T, H, V).to(dtype)
    x = torch.randn(B, T, H, K) * 2
    if at_bound:
        g = torch.full((B, T, H, K), -5.0)
    else:
        g = kda_gate(x, torch.randn(H) * 0.5, torch.randn(H * K), gate=gate)
    beta = torch.rand(B, T, H).to(dtype)
    return q, k, v, g, beta


@pytest.mark.parametrize("T", [1, 63, 64, 65, 100, 1000])
def test_chunk_matches_recurrence(T):
    B, H, K, V = 2, 2, 16, 24
    q, k, v, g, beta = make_inputs(B, T, H, K, V)
    S0 = torch.randn(B, H, K, V)
    o, S = kda_chunk(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    assert o.shape == (B, T, H, V) and o.dtype == v.dtype and S.dtype == torch.float32
    for b in range(B):
        o_ref, S_ref = naive_recurrence(q[b], k[b], v[b], g[b], beta[b], K ** -0.5, S0[b])
        assert rel_rms(o[b], o_ref) < 1e-5
        assert rel_rms(S[b], S_ref) < 1e-5


def test_no_initial_state_no_final():
    q, k, v, g, beta = make_inputs(1, 70, 2, 16, 24)
    o, S = kda_chunk(q, k, v, g, beta, scale=0.3)
    assert S is None
    o_ref, _ = naive_recurrence(q[0], k[0], v[0], g[0], beta[0], 0.3)
    assert rel_rms(o[0], o_ref) < 1e-5


def test_gate_at_bound_and_softplus():
    for kw in (dict(at_bound=True), dict(gate="softplus")):
        q, k, v, g, beta = make_inputs(1, 130, 2, 16, 24, **kw)
        S0 = torch.randn(1, 2, 16, 24)
        o, S = kda_chunk(q, k, v, g, beta, initial_state=S0, output_final_state=True)
        o_ref, S_ref = naive_recurrence(q[0], k[0], v[0], g[0], beta[0], 0.25, S0[0])
        assert torch.isfinite(o).all()
        assert rel_rms(o[0], o_ref) < 1e-5 and rel_rms(S[0], S_ref) < 1e-5


def test_strong_unbounded_decay_stays_finite():
    # g as low as -200 per token: cumulative sums reach -1e4 in a chunk; pairwise differences keep it finite
    q, k, v, _, beta = make_inputs(1, 100, 1, 16, 16)
    g = -torch.rand(1, 100, 1, 16) * 200
    o, S = kda_chunk(q, k, v, g, beta, output_final_state=True)
    o_ref, S_ref = naive_recurrence(q[0], k[0], v[0], g[0], beta[0], 0.25)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    # (up to 3e-5 over 40 draws while the reference kept G in float32; float64 G: float32 rounding only)
    assert rel_rms(o[0], o_ref) < 1e-5 and rel_rms(S[0], S_ref) < 1e-5


@pytest.mark.parametrize("strong", [-80.0, -5.0])
def test_alternating_strong_and_weak_decays(strong):
    # each (token, channel) decays by `strong` or by -1e-4 at random: a channel's cumulative gate reaches
    # |G| ~ 2600 within a chunk while some of its steps are tiny, so G_i - G_j from a float32 prefix sum would
    # be off by ulp(|G|) ~ 2.4e-4 (this gave 4.1e-5 against the recurrence at -80; found by a user trial)
    q, k, v, _, beta = make_inputs(1, 130, 2, 32, 32)
    g = torch.where(torch.rand(1, 130, 2, 32) < 0.5, torch.tensor(strong), torch.tensor(-1e-4))
    S0 = torch.randn(1, 2, 32, 32)
    o, S = kda_chunk(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    o_ref, S_ref = naive_recurrence(q[0], k[0], v[0], g[0], beta[0], 32 ** -0.5, S0[0])
    assert rel_rms(o[0], o_ref) < 2e-6 and rel_rms(S[0], S_ref) < 2e-6


def test_cu_seqlens_uneven():
    lens = [1, 64, 37, 130, 0, 65]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    T, H, K, V = int(cu[-1]), 2, 16, 24
    q, k, v, g, beta = make_inputs(1, T, H, K, V)
    S0 = torch.randn(len(lens), H, K, V)
    o, S = kda_chunk(q, k, v, g, beta, initial_state=S0, output_final_state=True, cu_seqlens=cu)
    for n in range(len(lens)):
        s, e = int(cu[n]), int(cu[n + 1])
        o_ref, S_ref = naive_recurrence(q[0, s:e], k[0, s:e], v[0, s:e], g[0, s:e], beta[0, s:e], K ** -0.5, S0[n])
        if e > s:
            assert rel_rms(o[0, s:e], o_ref) < 1e-5
        assert rel_rms(S[n], S_ref) < 1e-5


def test_step_chain_equals_chunk():
    B, T, H, K, V = 2, 77, 2, 16, 24
    q, k, v, g, beta = make_inputs(B, T, H, K, V)
    S0 = torch.randn(B, H, K, V)
    o, S = kda_chunk(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    state = S0.clone()
    outs = []
    for t in range(T):
        ot, new = kda_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        assert new is not state
        outs.append(ot)
        state = new
    assert rel_rms(torch.stack(outs, 1), o) < 1e-5
    assert rel_rms(state, S) < 1e-5


def test_step_does_not_modify_state():
    q, k, v, g, beta = (t[:, 0] for t in make_inputs(1, 1, 2, 16, 24))
    st = torch.randn(1, 2, 16, 24)
    copy = st.clone()
    kda_step(q, k, v, g, beta, st)
    assert torch.equal(st, copy)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs(dtype):
    q, k, v, g, beta = make_inputs(1, 100, 2, 16, 24, dtype=dtype)
    o, S = kda_chunk(q, k, v, g, beta, output_final_state=True)
    assert o.dtype == dtype and S.dtype == torch.float32
    o_ref, S_ref = naive_recurrence(q[0], k[0], v[0], g[0], beta[0], 0.25)
    # inputs are exactly representable; only the output rounding to dtype differs
    assert rel_rms(o[0], o_ref) < 1e-2 and rel_rms(S[0], S_ref) < 1e-5


def test_gate_formulas():
    B, T, H, K = 2, 5, 3, 8
    x = torch.randn(B, T, H, K) * 3
    A_log, dt = torch.randn(H), torch.randn(H * K)
    g = kda_gate(x, A_log, dt, lower_bound=-3.0)
    g_sp = kda_gate(x.half(), A_log, dt, gate="softplus")
    assert g.dtype == torch.float32 and g_sp.dtype == torch.float32
    for b, t, h, c in [(0, 0, 0, 0), (1, 4, 2, 7), (0, 3, 1, 5)]:
        z = float(x[b, t, h, c]) + float(dt[h * K + c])
        a = math.exp(float(A_log[h]))
        assert abs(float(g[b, t, h, c]) - (-3.0 / (1 + math.exp(-a * z)))) < 1e-5
        zh = float(x.half()[b, t, h, c]) + float(dt[h * K + c])
        assert abs(float(g_sp[b, t, h, c]) - (-a * math.log1p(math.exp(zh)))) < 1e-4 * max(1, a * abs(zh))
    assert (g >= -3.0).all() and (g <= 0).all()


def test_errors():
    q, k, v, g, beta = make_inputs(2, 10, 2, 16, 24)
    with pytest.raises(ValueError, match="B == 1"):
        kda_chunk(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 10], dtype=torch.int32))
    with pytest.raises(ValueError, match="k must"):
        kda_chunk(q, k[..., :8], v, g, beta)
    with pytest.raises(ValueError, match="beta"):
        kda_chunk(q, k, v, g, beta[:, :, :1])
    with pytest.raises(ValueError, match="initial_state"):
        kda_chunk(q, k, v, g, beta, initial_state=torch.zeros(2, 2, 16, 16))
    with pytest.raises(TypeError):
        kda_chunk(q, k, v.long(), g, beta)
    bad = q.clone()
    bad[0, 3, 1, 2] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        kda_chunk(bad, k, v, g, beta)
    with pytest.raises(ValueError, match="g must be <= 0"):
        kda_chunk(q, k, v, -g, beta)
    with pytest.raises(ValueError, match="cu_seqlens"):
        kda_chunk(q[:1], k[:1], v[:1], g[:1], beta[:1], cu_seqlens=torch.tensor([0, 4, 3, 10]))
    with pytest.raises(ValueError, match="gate"):
        kda_gate(g, torch.zeros(2), torch.zeros(32), gate="relu")
    with pytest.raises(ValueError, match="state"):
        kda_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], torch.zeros(2, 2, 16, 23))


def test_float64_inputs_run_and_match_float32():
    # the reference takes any float dtype: float64 keys broke its beta ||k||^2 stability check (vector_norm may
    # not narrow float64 to float32); the result is float64 (v's dtype) and agrees with the float32 run
    B, T, H, K, V = 1, 100, 2, 16, 24
    q, k, v, g, beta = make_inputs(B, T, H, K, V)
    S0 = torch.randn(B, H, K, V)
    o32, S32 = kda_chunk(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    o64, S64 = kda_chunk(*(t.double() for t in (q, k, v, g, beta)), initial_state=S0.double(),
                         output_final_state=True)
    assert o64.dtype == torch.float64 and rel_rms(o64, o32) < 1e-5 and rel_rms(S64, S32) < 1e-5
    ot, st = kda_step(*(t[:, 0].double() for t in (q, k, v, g, beta)), S0.double())
    ot32, st32 = kda_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], S0)
    assert rel_rms(ot, ot32) < 1e-5 and rel_rms(st, st32) < 1e-5


def recurrence64(q, k, v, g, beta, scale, S0):
    """spec/OPS.md as a token loop in float64, differentiable (no in-place writes). q, k, g [T,H,K]; v [T,H,V];
    beta [T,H]; S0 [H,K,V]. Returns (o [T,H,V], the final state [H,K,V])."""
    S, outs = S0, []
    for t in range(q.shape[0]):
        S = g[t].exp()[..., None] * S
        err = v[t] - torch.einsum("hkv,hk->hv", S, k[t])
        S = S + beta[t][:, None, None] * k[t][:, :, None] * err[:, None, :]
        outs.append(scale * torch.einsum("hkv,hk->hv", S, q[t]))
    return (torch.stack(outs) if outs else v[:0]), S


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("lens", [None, [100, 1, 0, 517, 382]], ids=["B2_T100", "varlen_T1000"])
def test_chunk_outputs_and_gradients_match_float64_recurrence(lens, dtype):
    # the chunks of all sequences at once: sequence ends inside chunks, one-token and empty sequences, batches;
    # o, the final states and the gradients of all six inputs against float64 autograd through the token loop
    # (measured: relative errors 0.3e-7 to 2e-7 for both input dtypes, the computation being float32)
    H, K, V = 2, 16, 24
    if lens is None:
        B, T, bounds, cu = 2, 100, [(0, 100)] * 2, None
    else:
        B, T = 1, sum(lens)
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int64)
        bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    q, k, v, g, beta = make_inputs(B, T, H, K, V)
    S0 = torch.randn(len(bounds), H, K, V)
    ins = [t.to(dtype).requires_grad_() for t in (q, k, v, g, beta, S0)]
    o, S = kda_chunk(*ins[:5], initial_state=ins[5], output_final_state=True, cu_seqlens=cu)
    assert o.dtype == dtype and S.dtype == torch.float32
    w_o, w_s = torch.randn(o.shape, dtype=torch.float64), torch.randn(S.shape, dtype=torch.float64)
    ((o.double() * w_o).sum() + (S.double() * w_s).sum()).backward()
    ref = [t.detach().double().requires_grad_() for t in (q, k, v, g, beta, S0)]
    o_ref, S_ref = [], []
    for n, (s, e) in enumerate(bounds):
        b = n if cu is None else 0
        on, sn = recurrence64(*(t[b, s:e] for t in ref[:5]), K ** -0.5, ref[5][n])
        o_ref.append(on)
        S_ref.append(sn)
    o_ref = torch.stack(o_ref) if cu is None else torch.cat(o_ref)[None]
    S_ref = torch.stack(S_ref)
    ((o_ref * w_o).sum() + (S_ref * w_s).sum()).backward()
    assert rel_rms(o.detach(), o_ref.detach()) < 2e-6 and rel_rms(S.detach(), S_ref.detach()) < 2e-6
    for name, a, r in zip(("q", "k", "v", "g", "beta", "initial_state"), ins, ref):
        assert a.grad.dtype == dtype, name
        assert rel_rms(a.grad, r.grad) < 2e-6, name


def test_declared_workspace_bounds_what_the_call_allocates():
    # the memory plan counts kda_chunk_workspace for every reference kda_chunk launch: the most the call holds
    # beyond its output (torch.profiler's allocation trace, no autograd) must be within it, and the bound not
    # loose (measured: declared / held 1.04-1.19 over eight shapes)
    import json
    import os
    import tempfile
    from torch.profiler import ProfilerActivity, profile
    from backends.reference.kda import kda_chunk_workspace
    for (B, T, H, K, V), dtype in (((3, 203, 3, 32, 24), torch.float32), ((2, 100, 2, 16, 16), torch.bfloat16)):
        q, k, v, g, beta = make_inputs(B, T, H, K, V, dtype=dtype)
        with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            kda_chunk(q, k, v, g, beta)
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        try:
            prof.export_chrome_trace(path)
            with open(path) as f:
                events = json.load(f)["traceEvents"]
        finally:
            os.unlink(path)
        total = [e["args"]["Total Allocated"] for e in sorted(events, key=lambda e: e.get("ts", 0))
                 if e.get("name") == "[memory]"]
        held = max(total) - total[-1]                      # (total[-1]: the output, still alive)
        declared = kda_chunk_workspace(B, T, H, K, V, in_bytes=q.element_size())
        assert held <= declared <= 1.5 * held, (B, T, H, K, V, dtype, held, declared)
