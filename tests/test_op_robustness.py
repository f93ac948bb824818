"""Op calls with hostile values (issue 32, items 6-8): finite inputs give a finite result where the exact one is
finite (huge query / source / q k values: scaled or float64 evaluation) and else the same ValueError on every
backend; loose arguments get one shared check (expert-weight dtypes, routed_scaling, yes/no flags, tensors on
different devices or on meta); no state is lost (QB on an empty batch, with and without data parallelism) and
a broken lower-bound promise is named. CPU: the Triton ops run under the interpreter (conftest), float32."""
import os
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import backends.reference as R
import backends.triton as X

BACKENDS = (R, X)
try:                                     # the tvm backend runs the memory-bound ops (attn_residual, qb_route, short_conv)
    import tvm  # noqa: F401
    import backends.tvm as V
    TVM_TOO = (R, X, V)
except ImportError:                      # pragma: no cover - TVM is in the test extra
    TVM_TOO = BACKENDS


def _name(mod) -> str:
    return mod.__name__.split(".")[-1]


def rel_err(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _naive_attn_residual(q, xs, w, eps, ow=None):
    """The contract's formula in float64, where products of float32 values cannot overflow."""
    x = torch.stack([s.double() for s in xs])
    xn = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    p = torch.softmax((xn * w.double() * q.double()).sum(-1), dim=0)
    o = (p[..., None] * x).sum(0)
    if ow is not None:
        o = o / torch.sqrt((o * o).mean(-1, keepdim=True) + eps) * ow.double()
    return o


# ------------------------------------------------------------------------------------------------------------
# 6. silent non-finite results from finite inputs
# ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mod", TVM_TOO, ids=_name)
def test_attn_residual_huge_query_element_gives_the_softmax_not_nan(mod):
    # query[j] = 3e38 with every source's normalised column j above 1: each logit is past float32's range (inf,
    # and inf - inf in the softmax); the exact softmax puts the weight on the source with the largest column
    d, n = 29, 11
    q, w = torch.randn(d), torch.rand(d) + 0.5
    xs = [torch.randn(n, d) for _ in range(4)]
    j = int(torch.randint(0, d, ()))
    q[j], w[j] = 3e38, 1.0
    for s in xs:
        s[:, j] = 2.0 + 3.0 * torch.rand(n)
    out = mod.attn_residual(q, xs, w)
    want = _naive_attn_residual(q, xs, w, 1e-6)
    assert torch.isfinite(out).all()
    assert rel_err(out, want) < 1e-6
    g = torch.autograd.grad(mod.attn_residual(q, [s.requires_grad_() for s in xs], w).sum(), xs)
    assert all(torch.isfinite(t).all() for t in g)


@pytest.mark.parametrize("mod", TVM_TOO, ids=_name)
@pytest.mark.parametrize("onorm", [False, True], ids=["plain", "onorm"])
def test_attn_residual_huge_source_element_is_normalised_right(mod, onorm):
    # one source element of -3e38 (its x^2 overflows: rsqrt(inf) = 0 zeroed the row's logit in the reference,
    # and the Triton kernel gave NaN): RMSNorm of that row is finite (|x / rms(x)| <= sqrt(d))
    d, n = 23, 9
    q, w = torch.randn(d), torch.rand(d) + 0.5
    xs = [torch.randn(n, d) for _ in range(3)]
    r, c = int(torch.randint(0, n, ())), int(torch.randint(0, d, ()))
    xs[1][r, c] = -3e38
    xs[2][(r + 1) % n] *= 1e25                      # a whole row of 1e25: x^2 overflows there too
    q[c] = 4.0 * (1 if q[c] < 0 else -1)            # that column's normalised value (~ -sqrt(d)) gets a large weight
    ow = torch.rand(d) + 0.5 if onorm else None
    out = mod.attn_residual(q, xs, w, output_rms_weight=ow)
    want = _naive_attn_residual(q, xs, w, 1e-6, ow)
    assert torch.isfinite(out).all()
    assert rel_err(out[r], want[r]) < 1e-5 and rel_err(out, want) < 1e-5


@pytest.mark.parametrize("mod", BACKENDS, ids=_name)
def test_two_phase_form_with_huge_values_is_the_direct_form_or_an_error(mod):
    # the block-batching pass's form: a huge bank element as in the direct form; huge queries, whose logits its
    # float32 logit max m cannot hold, are an error instead of NaN
    d, n, Q = 21, 6, 3
    queries, rms = torch.randn(Q, d), torch.rand(Q, d) + 0.5
    bank, part = [torch.randn(n, d) for _ in range(3)], torch.randn(n, d)
    bank[0][int(torch.randint(0, n, ())), 4] = 3e38
    acc, m, s = mod.attn_residual_phase1(queries, bank, rms)
    for j in range(Q):
        out = mod.attn_residual_merge(acc[j], m[j], s[j], part, queries[j], rms[j])
        assert rel_err(out, _naive_attn_residual(queries[j], bank + [part], rms[j], 1e-6)) < 1e-5
    queries[1, 2] = 3e38
    for s_ in bank:
        s_[:, 2] = 2.0 + torch.rand(n)
    with pytest.raises(ValueError, match=r"attn_residual_phase1: m overflows float32"):
        mod.attn_residual_phase1(queries, bank, rms)


@pytest.mark.parametrize("mod", TVM_TOO, ids=_name)
def test_attn_residual_result_past_float32_is_the_same_error(mod):
    # a fused output norm with a huge weight: the exact result is past float32's range, an error on every backend
    d = 17
    q, w, xs = torch.randn(d), torch.rand(d) + 0.5, [torch.randn(5, d) for _ in range(2)]
    ow = torch.full((d,), 3e38)
    with pytest.raises(ValueError, match=r"attn_residual: the result overflows torch.float32"):
        mod.attn_residual(q, xs, w, output_rms_weight=ow)


def _kda_step_inputs(B=2, H=3, K=8, V=5):
    q, k = torch.randn(B, H, K), torch.nn.functional.normalize(torch.randn(B, H, K), dim=-1)
    v, g, beta = torch.randn(B, H, V), -torch.rand(B, H, K), torch.rand(B, H)
    b, h = int(torch.randint(0, B, ())), int(torch.randint(0, H, ()))
    k[b, h, 1] = 3e38                               # finite, but beta ||k||^2 overflows: the update diverges
    return q, k, v, g, beta, torch.randn(B, H, K, V)


@pytest.mark.parametrize("mod", BACKENDS, ids=_name)
def test_kda_step_raises_as_kda_chunk_for_the_same_data(mod):
    q, k, v, g, beta, state = _kda_step_inputs()
    where = "triton." if mod is X else ""
    for op, call in (("kda_step", lambda: mod.kda_step(q, k, v, g, beta, state)),
                     ("kda_chunk", lambda: mod.kda_chunk(q[:, None], k[:, None], v[:, None], g[:, None],
                                                         beta[:, None], initial_state=state,
                                                         output_final_state=True))):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")              # (the expansive-update warning, and numpy's overflow)
            with pytest.raises(ValueError, match=rf"{where}{op}: the result holds inf or NaN although every input "
                                                 rf"is finite"):
                call()


def _naive_route(x, wt, bias, k):
    z = x.double() @ wt.double().t()
    s = torch.sigmoid(z).float()
    idx = torch.sort(s + bias, dim=-1, descending=True, stable=True).indices[:, :k]
    zc = z.gather(1, idx)
    return idx, torch.softmax(torch.nn.functional.logsigmoid(zc), dim=-1).float(), s


@pytest.mark.parametrize("mod", TVM_TOO, ids=_name)
def test_qb_route_routes_rows_whose_logits_overflow(mod):
    # finite rows of x whose x @ W^T overflows float32: every logit -inf (weights 0 / 0 before), and inf - inf
    # (NaN scores before); the scores are sigmoid of the exact logits (0, 1 or 1/2 for 3e38 - 3e38) and the
    # weights go to the pick with the largest logit
    n, d, e, k = 13, 10, 6, 2
    x, wt, bias = torch.randn(n, d), torch.randn(e, d), 0.01 * torch.randn(e)
    wt[:, 0] = torch.rand(e) + 1.0
    wt[:, 1] = wt[:, 0]
    wt[0, 2:4] = torch.tensor([2.0, -2.0])            # expert 0: 3e38 * 2 - 3e38 * 2 = 0 exactly
    a = int(torch.randint(0, n, ()))
    x[a] = 0.0
    x[a, :2] = -3e38                                  # every logit of row a below -6e38: -inf in float32
    b = (a + 1 + int(torch.randint(0, n - 1, ()))) % n
    x[b] = 0.0
    x[b, 2:4] = 3e38                                  # expert 0's logit NaN in float32 (inf - inf)
    idx, w, s = mod.qb_route(x, wt, bias, top_k=k, routed_scaling=2.5)
    i_n, w_n, s_n = _naive_route(x, wt, bias, k)
    for r in (a, b):
        assert torch.isfinite(w[r]).all() and torch.isfinite(s[r]).all()
        assert torch.equal(idx[r], i_n[r]) and torch.equal(s[r], s_n[r])
        assert torch.allclose(w[r], 2.5 * w_n[r], rtol=1e-6, atol=0)
    assert float(s[b, 0]) == 0.5
    rest = [r for r in range(n) if r not in (a, b)]
    idx_r, w_r, s_r = R.qb_route(x[rest], wt, bias, top_k=k, routed_scaling=2.5)
    assert torch.equal(idx[rest], idx_r) and rel_err(w[rest], w_r) < 1e-6 and rel_err(s[rest], s_r) < 1e-6


@pytest.mark.parametrize("mod", BACKENDS, ids=_name)
def test_mla_attention_huge_q_k_is_the_softmax_not_nan(mod):
    B, T, H, D = 1, 7, 2, 8
    q, k, v = torch.randn(B, T, H, D), torch.randn(B, T, H, D), torch.randn(B, T, H, D)
    t = int(torch.randint(2, T, ()))
    q[0, t, 1] = 1e19 * torch.sign(torch.randn(D))
    k[0, 0, 1] = q[0, t, 1]                           # logit ~ +8e38 (inf), and a second one ~ -inf
    k[0, 1, 1] = -q[0, t, 1]
    out = mod.mla_attention(q, k, v, scale=D ** -0.5)
    s = (q.double().transpose(1, 2) @ k.double().transpose(1, 2).transpose(-1, -2)) * D ** -0.5
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    want = (torch.softmax(s, dim=-1) @ v.double().transpose(1, 2)).transpose(1, 2)
    assert torch.isfinite(out).all()
    assert rel_err(out, want) < 1e-6
    assert torch.allclose(out[0, t, 1], v[0, 0, 1], atol=1e-6)      # the weight on the one huge logit


# ------------------------------------------------------------------------------------------------------------
# 7. loose argument checks: one shared checker per kind
# ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mod", BACKENDS, ids=_name)
@pytest.mark.parametrize("dtype", [torch.complex64, torch.bool, torch.int64])
def test_moe_experts_refuses_non_float_expert_weights(mod, dtype):
    n, e, lat, inter = 7, 3, 16, 16
    x, idx, wt = torch.randn(n, lat), torch.randint(0, e, (n, 2)), torch.rand(n, 2)
    ws = [torch.randn(e, inter, lat), torch.randn(e, inter, lat), torch.randn(e, lat, inter)]
    for i, name in enumerate(("w1", "w3", "w2")):
        bad = list(ws)
        bad[i] = torch.ones(ws[i].shape, dtype=dtype)
        with pytest.raises(TypeError, match=rf"moe_experts: {name} must be a floating tensor, got {dtype}"):
            mod.moe_experts(x, idx, wt, *bad)


@pytest.mark.parametrize("mod", TVM_TOO, ids=_name)
def test_qb_route_refuses_routed_scaling_not_positive(mod):
    x, wt, bias = torch.randn(9, 12), torch.randn(5, 12), torch.zeros(5)
    for bad in (0, 0.0, -1.0, -1e-30):
        with pytest.raises(ValueError, match=r"qb_route: routed_scaling must be a finite real number > 0"):
            mod.qb_route(x, wt, bias, top_k=2, routed_scaling=bad)
    _, w, _ = mod.qb_route(x, wt, bias, top_k=2, routed_scaling=1e-3)
    assert torch.allclose(w.sum(-1), torch.full((9,), 1e-3))


def _kda(B=1, T=21, H=2, K=16, V=16):
    q, k = torch.randn(B, T, H, K), torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1)
    return q, k, torch.randn(B, T, H, V), -torch.rand(B, T, H, K), torch.rand(B, T, H)


@pytest.mark.parametrize("mod", BACKENDS, ids=_name)
def test_yes_no_flags_take_bools_only(mod):
    q, k, v, g, beta = _kda()
    for bad in ("no", "False", 1, [], None):
        with pytest.raises(TypeError, match=r"kda_chunk: output_final_state must be True or False"):
            mod.kda_chunk(q, k, v, g, beta, output_final_state=bad)
    import numpy as np
    o, s = mod.kda_chunk(q, k, v, g, beta, output_final_state=np.bool_(True))
    assert s is not None and s.shape == (1, 2, 16, 16)
    x, cw = torch.randn(2, 9, 8), torch.randn(8, 4)
    if mod is R:
        with pytest.raises(TypeError, match=r"short_conv: output_final_state must be True or False"):
            R.short_conv(x, cw, output_final_state="yes")
        with pytest.raises(TypeError, match=r"mla_attention: causal must be True or False"):
            R.mla_attention(q, k, v, scale=0.25, causal="yes")
    else:
        with pytest.raises(TypeError, match=r"conv_silu_norm: silu must be True or False"):
            X.conv_silu_norm(x, cw, silu="no")
        with pytest.raises(TypeError, match=r"mla_attention: causal must be True or False"):
            X.mla_attention(q, k, v, scale=0.25, causal=0)


@pytest.mark.parametrize("mod", BACKENDS, ids=_name)
def test_meta_tensor_among_cpu_ones_is_named(mod):
    x, a, dt = torch.randn(1, 3, 2, 4), torch.zeros(2), torch.zeros(8)
    xr, wr, br = torch.randn(6, 8), torch.randn(4, 8), torch.zeros(4)
    s, b = torch.rand(6, 4), torch.zeros(4)
    calls = {
        "kda_gate": [lambda m=m: mod.kda_gate(*m) for m in ((x.to("meta"), a, dt), (x, a.to("meta"), dt),
                                                             (x, a, dt.to("meta")))],
        "qb_route": [lambda m=m: mod.qb_route(*m, top_k=2) for m in ((xr.to("meta"), wr, br), (xr, wr.to("meta"), br),
                                                                      (xr, wr, br.to("meta")))],
        "qb_update": [lambda m=m: mod.qb_update(*m, top_k=2) for m in ((s.to("meta"), b), (s, b.to("meta")))],
    }
    for op, fns in calls.items():
        for fn in fns:
            with pytest.raises(ValueError, match=rf"{op}: the tensors are on different devices: .* on meta"):
                fn()
    # meta tensors alone: the ops that read values say so (kda_gate's reference reads none: shapes out)
    with pytest.raises(ValueError, match=r"qb_route: meta tensors hold no data"):
        mod.qb_route(xr.to("meta"), wr.to("meta"), br.to("meta"), top_k=2)
    with pytest.raises(ValueError, match=r"qb_update: meta tensors hold no data"):
        mod.qb_update(s.to("meta"), b.to("meta"), top_k=2)


# ------------------------------------------------------------------------------------------------------------
# 8. lost state
# ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mod", BACKENDS, ids=_name)
def test_qb_update_on_an_empty_batch_keeps_the_bias(mod):
    e = 7
    bias = 0.1 * torch.randn(e) + 3.0                 # a bias with a common offset (centring would move it)
    for ema in (0.0, 0.4):
        nb = mod.qb_update(torch.rand(0, e), bias, top_k=2, ema=ema)
        assert nb.dtype == torch.float32 and torch.equal(nb, bias)
    nb = mod.qb_update(torch.rand(0, e), bias.double(), top_k=3)
    assert nb.dtype == torch.float32 and torch.equal(nb, bias)


_E, _K = 11, 2


def _dp_worker(rank, world, init_file, out_dir, n0, seed):
    os.environ["TRITON_INTERPRET"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        from backends import reference as RR
        from backends.triton import moe as TM
        torch.manual_seed(seed)
        bias = 0.05 * torch.randn(_E) + 1.0            # the same on every rank
        n = n0 if rank == 0 else 0                     # rank 1 got no tokens
        scores = torch.rand(n, _E)
        res = {}
        for name, fn in (("ref", RR.qb_update), ("triton", TM.qb_update)):
            res[name] = fn(scores, bias, top_k=_K, ema=0.25, dp_group=dist.group.WORLD)
            res[name + "_none"] = fn(scores[:0], bias, top_k=_K, ema=0.25, dp_group=dist.group.WORLD)
        res["scores"], res["bias"] = scores, bias
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_qb_update_empty_data_parallel_rank_contributes_nothing():
    seed = int(torch.randint(0, 10_000, ()).item())
    n0 = int(torch.randint(20, 60, ()))
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_dp_worker, args=(2, os.path.join(d, "init"), d, n0, seed), nprocs=2, join=True)
        r0, r1 = (torch.load(os.path.join(d, f"rank{r}.pt")) for r in range(2))
    # the average is over the ranks that had tokens: rank 0's own step, on both ranks
    want = R.qb_update(r0["scores"], r0["bias"], top_k=_K, ema=0.25)
    for name in ("ref", "triton"):
        assert torch.allclose(r0[name], want, atol=1e-6, rtol=0), name
        assert torch.equal(r0[name], r1[name]), name
        # no rank had tokens: every rank keeps its bias
        assert torch.equal(r0[name + "_none"], r0["bias"]) and torch.equal(r1[name + "_none"], r0["bias"]), name


@pytest.mark.parametrize("mod", BACKENDS, ids=_name)
def test_kda_chunk_names_g_below_the_promised_lower_bound(mod):
    B, T, H, K = 2, 37, 3, 16
    q, k, v, _, beta = _kda(B, T, H, K, 16)
    lb = -3.7
    g = R.kda_gate(torch.randn(B, T, H, K), torch.zeros(H), torch.zeros(H * K), lower_bound=lb)
    g[0, :4] = lb                                     # the bound itself is kept (the gate reaches it in float32)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        mod.kda_chunk(q, k, v, g, beta, lower_bound=lb)
    assert not [w for w in seen if "lower_bound" in str(w.message)]      # a kept promise: no warning
    b, t, h = 1, int(torch.randint(5, T, ())), int(torch.randint(0, H, ()))
    g[b, t, h, 3] = lb - 0.5
    g[b, t + 1 if t + 1 < T else t, (h + 1) % H, 0] = lb - 2.0     # a later token: not the one named
    with pytest.warns(RuntimeWarning, match=rf"kda_chunk: g is below the promised lower_bound -3.7 at 2 "
                                            rf"token-head\(s\), first at batch {b}, position {t}, head {h} "
                                            rf"\(channel 3: g = -4.2\)"):
        o, _ = mod.kda_chunk(q, k, v, g, beta, lower_bound=lb)
    o_ref, _ = R.kda_chunk(q, k, v, g, beta)          # (the result is right either way)
    assert rel_err(o, o_ref) < 1e-5


def test_tvm_short_conv_flag_takes_bools_only():
    pytest.importorskip("tvm")
    import backends.tvm as V
    x, cw = torch.randn(2, 9, 8), torch.randn(8, 4)
    for bad in ("yes", 1, None):
        with pytest.raises(TypeError, match=r"tvm short_conv: output_final_state must be True or False"):
            V.short_conv(x, cw, output_final_state=bad)
    y, st = V.short_conv(x, cw, output_final_state=True)
    y_r, st_r = R.short_conv(x, cw, output_final_state=True)
    assert rel_err(y, y_r) < 1e-6 and torch.equal(st, st_r)
