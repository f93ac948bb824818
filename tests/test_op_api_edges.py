"""Op-level API edges found by a new-user trial (2026-11-30): inputs a user plausibly gets wrong get a clear error
naming the op and the argument, and edge sizes that are legal give the reference's result. CPU: the Triton ops
run under the interpreter (conftest)."""
import numpy as np
import pytest
import torch

import backends.reference as R
import backends.triton as X

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def rel_rms(a, b):
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


def _experts(dtype=torch.float32, n=8, e=4, lat=16, inter=16, grad=False):
    x = torch.randn(n, lat, device=DEV, dtype=dtype, requires_grad=grad)
    ws = [torch.randn(e, inter, lat, device=DEV, dtype=dtype, requires_grad=grad),
          torch.randn(e, inter, lat, device=DEV, dtype=dtype, requires_grad=grad),
          torch.randn(e, lat, inter, device=DEV, dtype=dtype, requires_grad=grad)]
    idx = torch.randint(0, e, (n, 2), device=DEV)
    wt = torch.rand(n, 2, device=DEV)
    return x, idx, wt, ws


def test_triton_moe_ops_refuse_float64_the_reference_runs_it():
    x, idx, wt, ws = _experts(torch.float64)
    with pytest.raises(TypeError, match=r"triton.moe_experts: x_lat is torch.float64"):
        X.moe_experts(x, idx, wt, *ws)
    with pytest.raises(TypeError, match=r"triton.qb_route: x is torch.float64"):
        X.qb_route(torch.randn(8, 32, dtype=torch.float64, device=DEV),
                   torch.randn(4, 32, dtype=torch.float64, device=DEV), torch.zeros(4, device=DEV), top_k=2)
    assert torch.isfinite(R.moe_experts(x, idx, wt, *ws)).all()


def test_triton_moe_experts_empty_dimension_is_named():
    x, idx, wt, _ = _experts()
    with pytest.raises(ValueError, match=r"w1 has an empty dimension"):
        X.moe_experts(x, idx, wt, torch.randn(4, 0, 16, device=DEV), torch.randn(4, 0, 16, device=DEV),
                      torch.randn(4, 16, 0, device=DEV))


def test_triton_moe_experts_second_backward_over_a_retained_graph_is_refused_clearly():
    x, idx, wt, ws = _experts(grad=True)
    u = X.moe_experts(x, idx, wt, *ws)
    u_r = R.moe_experts(x, idx, wt, *ws)
    (gx,) = torch.autograd.grad(u.sum(), x, retain_graph=True)
    (gx_r,) = torch.autograd.grad(u_r.sum(), x)
    assert rel_rms(gx, gx_r) < 1e-5                      # the first backward is right
    with pytest.raises(RuntimeError, match=r"second backward through the same graph"):
        torch.autograd.grad(u.sum(), ws[0])


def test_forward_only_triton_ops_refuse_to_drop_a_gradient():
    q = torch.randn(1, 2, 16, device=DEV, requires_grad=True)
    args = (torch.randn(1, 2, 16, device=DEV), torch.randn(1, 2, 8, device=DEV), -torch.rand(1, 2, 16, device=DEV),
            torch.rand(1, 2, device=DEV), torch.randn(1, 2, 16, 8, device=DEV))
    with pytest.raises(RuntimeError, match=r"triton.kda_step: forward only"):
        X.kda_step(q, *args)
    with torch.no_grad():                                # decoding: the intended use, equal to the reference
        o, s = X.kda_step(q, *args)
        o_r, s_r = R.kda_step(q, *args)
    assert rel_rms(o, o_r) < 1e-5 and rel_rms(s, s_r) < 1e-5
    x = torch.randn(1, 3, 2, 8, device=DEV, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"triton.kda_gate: forward only"):
        X.kda_gate(x, torch.zeros(2, device=DEV), torch.zeros(16, device=DEV))
    g = X.kda_gate(x.detach(), torch.zeros(2, device=DEV), torch.zeros(16, device=DEV))
    assert rel_rms(g, R.kda_gate(x.detach(), torch.zeros(2, device=DEV), torch.zeros(16, device=DEV))) < 1e-6


def test_reference_kda_chunk_with_no_sequences():
    z = torch.zeros(0, 8, 1, 16)
    for mod in (R, X):
        o, s = mod.kda_chunk(z, z, z, z, torch.zeros(0, 8, 1), output_final_state=True)
        assert o.shape == (0, 8, 1, 16) and s.shape == (0, 1, 16, 16) and s.dtype == torch.float32


def test_empty_key_or_value_dimension_is_named():
    with pytest.raises(ValueError, match=r"triton.kda_gate: the key dimension K"):
        X.kda_gate(torch.randn(1, 3, 2, 0), torch.zeros(2), torch.zeros(0))
    for mod, where in ((R, "kda_step"), (X, "triton.kda_step")):
        with pytest.raises(ValueError, match=where + r": empty key/value dimension \(K=4, V=0\)"):
            mod.kda_step(torch.randn(1, 2, 4), torch.randn(1, 2, 4), torch.randn(1, 2, 0), -torch.rand(1, 2, 4),
                         torch.rand(1, 2), torch.zeros(1, 2, 4, 0))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_scalars_are_refused(bad):
    q, k, v = (torch.nn.functional.normalize(torch.randn(1, 20, 1, 16), dim=-1) for _ in range(3))
    g, b = -torch.rand(1, 20, 1, 16), torch.rand(1, 20, 1)
    for mod, where in ((R, "kda_chunk"), (X, "triton.kda_chunk")):
        with pytest.raises(ValueError, match=where + r": scale must be finite"):
            mod.kda_chunk(q, k, v, g, b, scale=bad)
    x, w = torch.randn(4, 8), torch.randn(3, 8)
    for mod in (R, X):
        with pytest.raises(ValueError, match=r"qb_route: routed_scaling must be a finite real number"):
            mod.qb_route(x, w, torch.zeros(3), top_k=1, routed_scaling=bad)
    with pytest.raises(ValueError, match=r"rmsnorm: eps must be a finite number > 0"):
        R.rmsnorm(torch.randn(3, 4), torch.ones(4), eps=-1.0)


def test_numpy_scalar_scale_is_a_number():
    q, k, v = (torch.nn.functional.normalize(torch.randn(1, 30, 1, 16), dim=-1) for _ in range(3))
    g, b = -torch.rand(1, 30, 1, 16), torch.rand(1, 30, 1)
    o_r, _ = R.kda_chunk(q, k, v, g, b, scale=0.5)
    for mod in (R, X):
        o, _ = mod.kda_chunk(q, k, v, g, b, scale=np.float32(0.5))
        assert rel_rms(o, o_r) < 1e-5


def test_reference_elementwise_ops_refuse_integers_and_check_the_conv_state():
    with pytest.raises(TypeError, match=r"l2norm: x must be a floating-point tensor"):
        R.l2norm(torch.tensor([3, 4]))
    with pytest.raises(TypeError, match=r"short_conv: x must be a floating-point tensor"):
        R.short_conv(torch.ones(1, 3, 2, dtype=torch.long), torch.full((2, 4), 0.4))
    with pytest.raises(ValueError, match=r"short_conv: initial_state must be \[B, C, W-1\]"):
        R.short_conv(torch.randn(1, 3, 2), torch.randn(2, 4), initial_state=torch.randn(1, 3, 2))


def test_reference_weight_shapes_and_dtypes_are_named():
    # (a user trial found torch's own messages here, and an [N, d] rmsnorm weight broadcast without a word)
    x = torch.randn(3, 8)
    cases = [(lambda: R.rmsnorm(x, torch.ones(5)), ValueError, r"rmsnorm: the weight must be \[d\].*got \[5\]"),
             (lambda: R.rmsnorm(x, torch.ones(3, 8)), ValueError, r"rmsnorm: the weight must be \[d\].*got \[3, 8\]"),
             (lambda: R.linear(x, torch.randn(4, 7)), ValueError, r"linear: the weight must be \[out, 8\]"),
             (lambda: R.linear(x, torch.randn(4, 8), torch.zeros(3)), ValueError, r"linear: bias must be \[4\]"),
             (lambda: R.lm_head(x, torch.randn(4, 7)), ValueError, r"lm_head: the weight must be \[out, 8\]"),
             (lambda: R.linear(x.long(), torch.randn(4, 8)), TypeError, "linear: x must be a floating-point"),
             (lambda: R.short_conv(torch.randn(1, 4, 3), torch.ones(3, 0)), ValueError, "short_conv: the weight"),
             (lambda: R.rmsnorm(x, torch.ones(8, dtype=torch.bool)), TypeError, "rmsnorm: the weight must be a real")]
    for f, err, msg in cases:
        with pytest.raises(err, match=msg):
            f()
    w, b = torch.randn(4, 8), torch.randn(4)
    assert torch.allclose(R.linear(x, w, b), x @ w.t() + b, atol=1e-6)
    # an integer norm weight is used as float32 (the Triton layers take it too)
    assert torch.allclose(R.rmsnorm(x, torch.arange(8)), R.rmsnorm(x, torch.arange(8.0)))


def test_reference_short_conv_with_no_tokens_passes_the_state_through():
    st = torch.randn(2, 3, 3)
    y, fin = R.short_conv(torch.randn(2, 0, 3), torch.randn(3, 4), initial_state=st, output_final_state=True)
    assert y.shape == (2, 0, 3) and torch.equal(fin, st)
    # and it equals running the 5 tokens after the empty call in one go from the same state
    x = torch.randn(2, 5, 3)
    w = torch.randn(3, 4)
    y1, f1 = R.short_conv(x, w, initial_state=fin, output_final_state=True)
    y2, f2 = R.short_conv(x, w, initial_state=st, output_final_state=True)
    assert torch.equal(y1, y2) and torch.equal(f1, f2)


def test_kda_gate_dt_bias_layout():
    H, K = 2, 8
    x, a = torch.randn(1, 5, H, K), torch.randn(H)
    db = torch.randn(H * K)
    g = R.kda_gate(x, a, db)
    assert torch.equal(R.kda_gate(x, a, db.reshape(H, K)), g)        # [H, K] is the same layout
    for mod, where in ((R, "kda_gate"), (X, "kda_gate")):
        with pytest.raises(ValueError, match=where + r": dt_bias must be \[H\*K\]=\[16\]"):
            mod.kda_gate(x, a, db.reshape(K, H))                     # [K, H]: the wrong layout
    assert rel_rms(X.kda_gate(x, a, db), g) < 1e-6


# ---------------------------------------------------------------------- third new-user trial (11th session)
def _kda(B=1, T=20, H=2, K=16, V=16):
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=DEV), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=DEV), dim=-1)
    return q, k, torch.randn(B, T, H, V, device=DEV), -torch.rand(B, T, H, K, device=DEV), \
        torch.rand(B, T, H, device=DEV)


def test_triton_ops_on_cpu_without_the_interpreter_say_so():
    # without TRITON_INTERPRET=1 a CPU tensor would reach Triton's launcher ("0 active drivers"): every Triton
    # op names the device problem instead (a fresh interpreter: conftest sets the variable for this process)
    import os
    import subprocess
    import sys
    code = r"""
import torch, backends.triton as X
calls = {
    "qb_route": lambda: X.qb_route(torch.randn(3, 8), torch.randn(4, 8), torch.zeros(4), top_k=2),
    "qb_update": lambda: X.qb_update(torch.rand(3, 4), torch.zeros(4), top_k=2),
    "expert_load": lambda: X.expert_load(torch.zeros(3, 2, dtype=torch.long), 4),
    "situ_glu": lambda: X.situ_glu(torch.randn(3), torch.randn(3)),
    "moe_experts": lambda: X.moe_experts(torch.randn(5, 16), torch.zeros(5, 2, dtype=torch.long), torch.rand(5, 2),
                                         torch.randn(4, 8, 16), torch.randn(4, 8, 16), torch.randn(4, 16, 8)),
    "conv_silu_norm": lambda: X.conv_silu_norm(torch.randn(1, 5, 8), torch.randn(8, 4)),
    "kda_chunk": lambda: X.kda_chunk(*(torch.randn(1, 5, 1, 16) for _ in range(3)), -torch.rand(1, 5, 1, 16),
                                     torch.rand(1, 5, 1)),
    "kda_gate": lambda: X.kda_gate(torch.randn(1, 5, 1, 16), torch.zeros(1), torch.zeros(16)),
    "kda_step": lambda: X.kda_step(*(torch.randn(1, 1, 16) for _ in range(3)), -torch.rand(1, 1, 16),
                                   torch.rand(1, 1), torch.zeros(1, 1, 16, 16)),
}
for name, f in calls.items():
    try:
        f()
        print(name, "no error")
    except ValueError as e:
        print(name, "OK" if "CUDA device (or run with TRITON_INTERPRET=1)" in str(e) else repr(e))
    except Exception as e:
        print(name, repr(e))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    lines = r.stdout.split("\n")
    assert r.returncode == 0 and len([ln for ln in lines if ln.strip()]) == 9, r.stderr[-2000:]
    assert all(ln.endswith(" OK") for ln in lines if ln.strip()), r.stdout


@pytest.mark.parametrize("backend", [R, X])
def test_moe_experts_checks_the_glu_bounds(backend):
    x, idx, wt, ws = _experts()
    with pytest.raises(ValueError, match="beta_gate and beta_up must be finite and > 0"):
        backend.moe_experts(x, idx, wt, *ws, beta_gate=0.0)
    with pytest.raises(ValueError, match="beta_gate and beta_up must be finite and > 0"):
        backend.moe_experts(x, idx, wt, *ws, beta_up=float("inf"))


def test_triton_kda_chunk_checks_the_initial_state_like_the_reference():
    q, k, v, g, b = _kda()
    s = torch.zeros(1, 2, 16, 16, device=DEV)
    s[0, 1, 3, 4] = float("nan")
    for backend in (R, X):
        with pytest.raises(ValueError, match="initial_state holds NaN or inf"):
            backend.kda_chunk(q, k, v, g, b, initial_state=s, check_finite=True)


@pytest.mark.parametrize("backend", [R, X])
def test_kda_step_checks_values(backend):
    q, k, v, g, b = (t[:, 0] for t in _kda())
    s = torch.zeros(1, 2, 16, 16, device=DEV)
    kw = {"check_finite": True} if backend is X else {}
    with pytest.raises(ValueError, match="g must be <= 0"):
        backend.kda_step(q, k, v, -g + 25.0, b, s, **kw)
    qn = q.clone()
    qn[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="q holds NaN or inf"):
        backend.kda_step(qn, k, v, g, b, s, **kw)
    sn = s.clone()
    sn[0, 0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="state holds NaN or inf"):
        backend.kda_step(q, k, v, g, b, sn, **kw)
    o, _ = backend.kda_step(q, k, v, g, b, s.half(), **kw)        # any float state, used as float32
    o_r, _ = R.kda_step(q, k, v, g, b, s)
    assert rel_rms(o, o_r) < 1e-5


@pytest.mark.parametrize("backend", [R, X])
def test_mla_attention_refuses_nan_instead_of_returning_nan_or_zeros(backend):
    q, k, v = (torch.randn(1, 6, 2, 8, device=DEV) for _ in range(3))
    q[0, 2, 1, 3] = float("nan")
    kw = {"check_finite": True} if backend is X else {}
    with pytest.raises(ValueError, match="q holds NaN or inf"):
        backend.mla_attention(q, k, v, scale=0.3, **kw)


def test_reference_kda_chunk_takes_the_triton_launch_options():
    # the same call runs on either backend: lower_bound / segment_chunks / check_finite are accepted (and checked)
    q, k, v, g, b = _kda()
    g = g * 5.0                                            # g in [-5, 0]
    o_r, _ = R.kda_chunk(q, k, v, g, b, lower_bound=-5.0, segment_chunks=2, check_finite=False)
    o_x, _ = X.kda_chunk(q, k, v, g, b, lower_bound=-5.0, segment_chunks=2, check_finite=True)
    assert rel_rms(o_x, o_r) < 1e-5
    with pytest.raises(ValueError, match="lower_bound must be a finite number < 0"):
        R.kda_chunk(q, k, v, g, b, lower_bound=0.5)
    with pytest.raises(TypeError, match="lower_bound must be a number or None"):
        R.kda_chunk(q, k, v, g, b, lower_bound="-5")
    with pytest.raises(ValueError, match="segment_chunks must be a positive int"):
        R.kda_chunk(q, k, v, g, b, segment_chunks=0)


def test_kda_chunk_names_a_tensor_on_another_device():
    q, k, v, g, b = _kda()
    for backend in (R, X):
        with pytest.raises(ValueError, match=r"v is on meta but q is on"):
            backend.kda_chunk(q, k, v.to("meta"), g, b)


def test_norm_eps_one_rule_across_ops():
    """Every op with a norm eps takes the reference's rule (a finite real > 0, numpy scalars included): results
    equal to the float eps, and the same ValueError for a bad one (16th session: two ops refused numpy floats)."""
    src = [torch.randn(37, 24) for _ in range(3)]
    qv, wv = torch.randn(24), torch.rand(24) + 0.5
    ref = R.attn_residual(qv, src, wv, eps=1e-3)
    assert rel_rms(R.attn_residual(qv, src, wv, eps=np.float32(1e-3)), ref) < 1e-6
    x, cw = torch.randn(2, 19, 16), torch.randn(16, 4)
    y_ref = X.conv_silu_norm(x, cw, head_dim=8, eps=1e-3)
    assert rel_rms(X.conv_silu_norm(x, cw, head_dim=8, eps=np.float64(1e-3)), y_ref) < 1e-6
    for bad in (0.0, -1.0, float("nan"), float("inf"), True, "1e-6"):
        with pytest.raises(ValueError, match=r"attn_residual: eps must be a finite number > 0"):
            R.attn_residual(qv, src, wv, eps=bad)
        with pytest.raises(ValueError, match=r"conv_silu_norm: eps must be a finite number > 0"):
            X.conv_silu_norm(x, cw, head_dim=8, eps=bad)


@pytest.mark.parametrize("backend", [R, X])
def test_nan_inputs_are_refused_by_every_public_op(backend):
    """NaN or inf in a CPU input is a ValueError naming it, for the ops that used to pass it through to NaN outputs
    (kda_gate, attn_residual and its phase 1, moe_experts, short_conv / conv_silu_norm; new-user trial, 16th
    session); the same finite inputs still run."""
    nan = float("nan")
    src = [torch.randn(5, 16) for _ in range(3)]
    qv, wv = torch.randn(16), torch.rand(16) + 0.5
    backend.attn_residual(qv, src, wv)
    bad = [s.clone() for s in src]
    bad[1][2, 3] = nan
    with pytest.raises(ValueError, match=r"attn_residual: sources\[1\] holds NaN or inf"):
        backend.attn_residual(qv, bad, wv)
    with pytest.raises(ValueError, match=r"attn_residual: query holds NaN or inf"):
        backend.attn_residual(torch.full((16,), float("inf")), src, wv)
    with pytest.raises(ValueError, match=r"attn_residual_phase1: bank\[1\] holds NaN or inf"):
        backend.attn_residual_phase1(torch.randn(2, 16), bad[:2], torch.rand(2, 16) + 0.5)
    x, idx, wt, ws = _experts()
    backend.moe_experts(x, idx, wt, *ws)
    x[3, 0] = nan
    with pytest.raises(ValueError, match=r"moe_experts: row 3 of x_lat holds NaN or inf"):
        backend.moe_experts(x, idx, wt, *ws)
    xg, A, dt = torch.randn(1, 7, 2, 4), torch.zeros(2), torch.zeros(8)
    backend.kda_gate(xg, A, dt)
    xg[0, 1, 0, 0] = nan
    with pytest.raises(ValueError, match=r"kda_gate: x holds NaN or inf"):
        backend.kda_gate(xg, A, dt)
    with pytest.raises(ValueError, match=r"kda_gate: the softplus gate .* overflows float32"):
        backend.kda_gate(torch.randn(1, 7, 2, 4), torch.full((2,), 100.0), dt, gate="softplus")
    xc, wc = torch.randn(2, 9, 8), torch.randn(8, 4)
    conv = (lambda a, b: R.short_conv(a, b)[0]) if backend is R else (lambda a, b: X.conv_silu_norm(a, b))
    conv(xc, wc)
    xc[1, 4, 2] = nan
    with pytest.raises(ValueError, match=r"(short_conv|conv_silu_norm): x holds NaN or inf"):
        conv(xc, wc)


def test_eps_as_a_tensor_says_how_to_pass_it():
    # (from a user trial) eps=torch.tensor(1e-6) was refused as "must be a finite number > 0", which reads oddly
    # for a valid value
    with pytest.raises(ValueError, match=r"rmsnorm: eps must be a Python or numpy number, got a tensor .*float\(eps\)"):
        R.rmsnorm(torch.randn(3, 4), torch.ones(4), eps=torch.tensor(1e-6))
    x = torch.randn(3, 4)
    torch.testing.assert_close(R.rmsnorm(x, torch.ones(4), eps=np.float32(1e-6)), R.rmsnorm(x, torch.ones(4), eps=1e-6))


def _kda_inputs(B, T, H, K, V, normalize=True, beta=None):
    q, k = torch.randn(B, T, H, K), torch.randn(B, T, H, K)
    if normalize:
        q, k = (torch.nn.functional.normalize(t, dim=-1) for t in (q, k))
    v, g = torch.randn(B, T, H, V), -torch.rand(B, T, H, K)
    b = torch.rand(B, T, H) if beta is None else torch.full((B, T, H), float(beta))
    return q, k, v, g, b


@pytest.mark.parametrize("M", [R, X], ids=["reference", "triton"])
def test_kda_chunk_diverging_recurrence_is_an_error_not_nan(M, recwarn):
    # keys not L2-normalised (||k||^2 ~ 32 here) with beta 0.9 make the delta update I - beta k k^T expansive:
    # the state grows every step and overflows within the first chunks; from finite inputs that must be a
    # ValueError that says why (found by a user trial: both backends returned inf / NaN silently), after a
    # RuntimeWarning that names the first token past beta ||k||^2 = 2
    q, k, v, g, b = _kda_inputs(1, 100, 1, 32, 16, normalize=False, beta=0.9)
    g.zero_()
    with pytest.warns(RuntimeWarning, match=r"kda_chunk: beta \* \|\|k\|\|\^2 reaches .*past 2 first at beta\[0, 0, 0\]"):
        with pytest.raises(ValueError, match=r"kda_chunk: the result holds inf or NaN although every input is "
                                             r"finite \(first at o\[0, \d+, 0, \d+\]\): the state recurrence diverged"):
            M.kda_chunk(q, k, v, g, b, output_final_state=True)
    # unit keys with beta = 2 (the largest step DeltaNet variants use) are the stable limit: no warning, finite
    q, k, v, g, b = _kda_inputs(1, 100, 1, 32, 16, beta=2.0)
    recwarn.clear()
    o, S = M.kda_chunk(q, k, v, g, b, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning) and "beta *" in str(w.message)]


def test_kda_and_mla_outputs_are_contiguous():
    # [B, T, H, V] results are contiguous on both backends (a user's o.view(B, T, H * V) failed: the reference
    # returned a transposed view, Triton a view into its padded [.., 16] buffer at V = 8)
    q, k, v, g, b = _kda_inputs(2, 5, 2, 16, 8)
    for M in (R, X):
        o, S = M.kda_chunk(q, k, v, g, b, output_final_state=True)
        assert o.is_contiguous() and S.is_contiguous(), M.__name__
        assert o.view(2, 5, 16).shape == (2, 5, 16)
        for vv in (v, v.half()):
            o = M.mla_attention(q, k, vv, scale=0.25)
            assert o.is_contiguous() and o.dtype == vv.dtype, M.__name__
    want = R.kda_chunk(q, k, v, g, b)[0]
    assert rel_rms(X.kda_chunk(q, k, v, g, b)[0], want) < 2e-5


def test_triton_kda_chunk_takes_mixed_dtypes_like_the_reference():
    # OPS.md: o in v's dtype for any float q, k, v; the Triton kernels take one dtype, so q, k, v run in their
    # promoted one (a user trial found TypeError where the reference ran); float64 stays the reference's
    q, k, v, g, b = _kda_inputs(1, 70, 2, 16, 16)
    for qq, kk, vv in ((q, k, v.half()), (q.half(), k, v), (q.half(), k.half(), v)):
        want = R.kda_chunk(qq, kk, vv, g, b)[0]
        got = X.kda_chunk(qq, kk, vv, g, b)[0]
        assert got.dtype == vv.dtype == want.dtype
        assert rel_rms(got, want) < 2e-3
    with pytest.raises(TypeError, match=r"triton.kda_chunk: q is torch.float64; the Triton kernels take float32, "
                                        r"float16 or bfloat16 \(backends.reference runs other float dtypes\)"):
        X.kda_chunk(q.double(), k.double(), v.double(), g, b)


# ---- a third new-user trial (2026-12-01): op contracts at their edges ----

@pytest.mark.parametrize("scale", [-0.3, 0.0])
def test_causal_attention_with_a_non_positive_scale_is_finite(scale):
    # torch's causal SDPA masked with -inf before scaling: scale <= 0 gave NaN rows on Triton, finite on the reference
    q, k, v = (torch.randn(1, 7, 2, 8, device=DEV) for _ in range(3))
    o = X.mla_attention(q, k, v, scale=scale)
    o_r = R.mla_attention(q, k, v, scale=scale)
    assert torch.isfinite(o).all() and rel_rms(o, o_r) < 1e-5


def test_conv_silu_norm_checks_its_arguments_like_short_conv():
    x, w = torch.randn(2, 9, 6, device=DEV), torch.randn(6, 4, device=DEV)
    for bad_w in (w.view(6, 2, 2), w[:, 0], None, [[1.0] * 4] * 6):
        for op, where in ((X.conv_silu_norm, "conv_silu_norm"), (R.short_conv, "short_conv")):
            with pytest.raises((TypeError, ValueError), match=where + r": the weight must be"):
                op(x, bad_w)
    with pytest.raises(TypeError, match=r"conv_silu_norm: x must be a floating-point tensor, got torch.int32"):
        X.conv_silu_norm(x.int(), w)
    for bad in (2.0, "3", True):
        with pytest.raises(TypeError, match=r"conv_silu_norm: head_dim must be an int or None"):
            X.conv_silu_norm(x, w, head_dim=bad)
    y = X.conv_silu_norm(x, w.view(6, 1, 4), head_dim=3)       # [C, 1, W] is the other legal form
    u, _ = R.short_conv(x, w)
    s = u * torch.sigmoid(u)
    ref = (s.view(2, 9, 2, 3) / (s.view(2, 9, 2, 3).pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()).view(2, 9, 6)
    assert rel_rms(y, ref) < 1e-5


def test_sigmoid_gate_overflow_and_bad_bounds_are_named_errors():
    x, dt = torch.zeros(1, 2, 1, 4, device=DEV), torch.zeros(4, device=DEV)
    for mod, where in ((R, "kda_gate"), (X, "kda_gate")):
        if DEV == "cpu":    # (the overflow scan runs on CPU results only: on a GPU it would sync every call)
            with pytest.raises(ValueError, match=where + r": the sigmoid gate .* overflows float32 \(A_log max 100"):
                mod.kda_gate(x, torch.tensor([100.0], device=DEV), dt)
        for bad in (None, "x", True):
            with pytest.raises(TypeError, match=where + r": lower_bound must be a finite negative number"):
                mod.kda_gate(x, torch.zeros(1, device=DEV), dt, lower_bound=bad)
        g = mod.kda_gate(x + 1.0, torch.zeros(1, device=DEV), dt, lower_bound=np.float32(-5.0))
        assert torch.allclose(g, torch.full_like(g, -5.0 * float(torch.sigmoid(torch.tensor(1.0)))))


def test_scalar_arguments_take_numpy_numbers_and_name_bad_ones():
    scores, bias = torch.randn(6, 4, device=DEV), torch.zeros(4, device=DEV)
    idx = torch.randint(0, 4, (6, 2), device=DEV)
    for mod in (R, X):
        for bad in (None, "0.5", torch.tensor(0.5), True):
            with pytest.raises(TypeError, match=r"qb_update: ema must be a real number in \[0, 1\)"):
                mod.qb_update(scores, bias, top_k=2, ema=bad)
        assert torch.equal(mod.qb_update(scores, bias, top_k=2, ema=np.float32(0.5)),
                           mod.qb_update(scores, bias, top_k=2, ema=0.5))
        for bad in (None, 2.5, "10", True):
            with pytest.raises(TypeError, match=r"expert_load: num_experts must be an int"):
                mod.expert_load(idx, bad)
        assert torch.equal(mod.expert_load(idx, np.int64(4)), mod.expert_load(idx, 4))
        x, w = torch.randn(5, 8, device=DEV), torch.randn(4, 8, device=DEV)
        a = mod.qb_route(x, w, bias, top_k=2, routed_scaling=np.float32(0.5))
        b = mod.qb_route(x, w, bias, top_k=2, routed_scaling=0.5)
        assert all(torch.equal(p, r) for p, r in zip(a, b))
        u, v = torch.randn(3, 8, device=DEV), torch.randn(3, 8, device=DEV)
        assert torch.equal(mod.situ_glu(u, v, beta_gate=np.float32(4.0)), mod.situ_glu(u, v, beta_gate=4.0))
        q = torch.randn(1, 5, 1, 8, device=DEV)
        assert torch.equal(mod.mla_attention(q, q, q, scale=np.float32(0.25)), mod.mla_attention(q, q, q, scale=0.25))


def test_reference_takes_the_triton_only_options():
    # one call runs on either backend: the reference accepts check_finite (it always checks) and acc_dtype
    B, H, K, V = 2, 2, 8, 8
    q, k = (torch.nn.functional.normalize(torch.randn(B, H, K, device=DEV), dim=-1) for _ in range(2))
    v, g, beta, S = torch.randn(B, H, V, device=DEV), -torch.rand(B, H, K, device=DEV), \
        torch.rand(B, H, device=DEV), torch.randn(B, H, K, V, device=DEV)
    o_r, S_r = R.kda_step(q, k, v, g, beta, S, check_finite=True)
    o_x, S_x = X.kda_step(q, k, v, g, beta, S, check_finite=True)
    assert rel_rms(o_r, o_x) < 1e-5 and rel_rms(S_r, S_x) < 1e-5
    qa = torch.randn(1, 5, 1, 8, device=DEV)
    assert rel_rms(R.mla_attention(qa, qa, qa, scale=0.3, check_finite=True),
                   X.mla_attention(qa, qa, qa, scale=0.3, check_finite=True)) < 1e-5
    bank = [torch.randn(6, 16, device=DEV) for _ in range(3)]
    qs, ws = torch.randn(2, 16, device=DEV), torch.rand(2, 16, device=DEV) + 0.5
    acc, m, s = R.attn_residual_phase1(qs, bank, ws, acc_dtype=torch.bfloat16)
    acc32, m32, s32 = R.attn_residual_phase1(qs, bank, ws)
    assert acc.dtype == torch.bfloat16 and torch.equal(acc, acc32.to(torch.bfloat16))
    assert torch.equal(m, m32) and torch.equal(s, s32)
    with pytest.raises(TypeError, match=r"attn_residual_phase1: acc_dtype torch.int32 is not"):
        R.attn_residual_phase1(qs, bank, ws, acc_dtype=torch.int32)


def test_reference_light_ops_name_bad_arguments():
    # lists instead of tensors and a 0-d x get a TypeError / ValueError that says which argument, not an
    # AttributeError from inside the op; the right call still works
    x, w = torch.randn(2, 3, device=DEV), torch.randn(4, 3, device=DEV)
    with pytest.raises(TypeError, match=r"linear: the weight must be a real tensor, got list"):
        R.linear(x, [[1.0, 2.0, 3.0]])
    with pytest.raises(TypeError, match=r"linear: bias must be a tensor or None, got list"):
        R.linear(x, w, [0.0] * 4)
    with pytest.raises(ValueError, match=r"linear: x must have at least 1 dimension"):
        R.linear(torch.tensor(1.0, device=DEV), w)
    with pytest.raises(ValueError, match=r"rmsnorm: x must have at least 1 dimension"):
        R.rmsnorm(torch.tensor(1.0, device=DEV), torch.ones(1, device=DEV))
    with pytest.raises(TypeError, match=r"rmsnorm: the weight must be a real tensor, got list"):
        R.rmsnorm(x, [1.0, 1.0, 1.0])
    for op in (lambda: R.sigmoid([1.0]), lambda: R.add([1.0], x), lambda: R.mul(x, [1.0])):
        with pytest.raises(TypeError, match=r"expected a torch.Tensor, got list"):
            op()
    assert rel_rms(R.linear(x, w), x @ w.t()) < 1e-6


def test_latent_moe_checks_eps_first_on_both_backends():
    # a bad eps is named as latent_moe's (the reference used to fail late, inside its RMSNorm, naming rmsnorm)
    x = torch.randn(4, 8, device=DEV)
    args = (x, torch.randn(4, 8, device=DEV), torch.zeros(4, device=DEV), None, torch.randn(4, 6, 8, device=DEV),
            torch.randn(4, 6, 8, device=DEV), torch.randn(4, 8, 6, device=DEV), None, None, None, None, None)
    for mod in (R, X):
        for bad in (-1.0, 0.0, float("nan")):
            with pytest.raises(ValueError, match=r"^latent_moe: eps must be a finite number > 0"):
                mod.latent_moe(*args, top_k=2, eps=bad)
