"""torch.compile and torch.export of a compiled module (backends/custom_ops.py, backends/traced.py): the launches
run as torch.library custom ops (torch.ops.mtc.*), so that dynamo traces a whole forward without a graph break
(fullgraph=True) and the result equals the eager forward's; every custom op's fake gives its real output's shape,
dtype and strides; the backward through a custom op (register_autograd) equals the implementation's own."""
import pathlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import dsl

pytestmark = pytest.mark.usefixtures("wide_moe_tiles")

ROOT = pathlib.Path(__file__).resolve().parents[1]
SPECS = {"tiny": (ROOT / "models" / "kimi_k3.mtc", "tiny"),
         "hybrid_tiny": (ROOT / "examples" / "hybrid_tiny.mtc", None)}


def _check_fakes(m, trace, bind):
    """Each custom-op launch of the eager forward ``trace`` (m.tracing(values=True)): the op on the launch's
    operands gives the eager outputs' values, with the shapes, dtypes and strides its fake gives on fake copies of
    them. Returns the number checked."""
    steps = m._traced[False]
    checked = 0
    for t in trace:
        kind, op, vals, _ins, _outs, _route = steps[t.index]
        if kind != "op":
            continue
        vals = [v(bind) if callable(v) else v for v in vals]
        real = op(list(t.args), *vals)
        with FakeTensorMode() as mode:
            fakes = op([mode.from_tensor(a) for a in t.args], *vals)
        assert len(fakes) == len(real) == len(t.outs), t.kernel
        for f, r, e in zip(fakes, real, t.outs):
            assert (tuple(f.shape), f.dtype) == (tuple(r.shape), r.dtype), \
                (t.kernel, f.shape, f.dtype, r.shape, r.dtype)
            assert all(a == b for n, a, b in zip(f.shape, f.stride(), r.stride()) if n > 1), \
                (t.kernel, f.stride(), r.stride())
            assert torch.equal(r, e), t.kernel
        checked += 1
    return checked


def _compiled_equals_eager(m, x, export: bool):
    """torch.compile(fullgraph, aot_eager) and torch.export of ``m`` on ``x`` (no_grad, eval) against its eager
    forward; the custom ops the exported graph calls."""
    with torch.no_grad():
        with m.tracing(values=True) as trace:
            ref = m(x)
        stats = {k: v.clone() for k, v in m.routing_stats.items()}
        eager_run = m.last_run
        assert _check_fakes(m, trace, {str(k): v for k, v in eager_run.bind.items()}) > 5
        torch._dynamo.reset()
        out = torch.compile(m, fullgraph=True, backend="aot_eager")(x)
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
        assert m.last_run is eager_run                      # (the traced forward keeps no run statistics)
        assert stats and m.routing_stats.keys() == stats.keys()
        for k, v in stats.items():
            assert torch.equal(m.routing_stats[k], v), k
        if not export:
            return None
        ep = torch.export.export(m, (x,))
        torch.testing.assert_close(ep.module()(x), ref, rtol=1e-6, atol=1e-6)
        return {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize("name", ["tiny", "hybrid_tiny"])
def test_reference_compile_and_export_equal_eager(name):
    spec, variant = SPECS[name]
    # (inplace=False: _check_fakes re-runs each launch on the operands the trace recorded, which an in-place output
    # of a later launch would overwrite; tests/test_inplace.py checks that reuse changes no bit)
    m = dsl.compile(dsl.load(spec, variant), target="reference", seed=5, inplace=False).eval()
    x = torch.randint(0, 256, (2, 37))
    called = _compiled_equals_eager(m, x, export=True)
    for op in ("kda_chunk", "kda_gate", "mla_attention", "qb_route", "moe_experts", "attn_residual_phase1",
               "attn_residual_merge", "short_conv", "rmsnorm", "situ_glu"):
        assert f"mtc.{op}_reference.default" in called, op
    # the eager forward's host logic still runs after a traced one
    with torch.no_grad():
        m(x)
    assert m.last_run.launches == len(m.program.launches) and m.last_run.peak_bytes > 0


def test_triton_compile_equals_eager():
    """target triton under the interpreter: the Triton kernels (kda_chunk, qb_route, moe_experts, AttnRes's two
    phases with the fused norm, conv_silu_norm, generated pointwise kernels) as custom ops."""
    spec, variant = SPECS["hybrid_tiny"]
    m = dsl.compile(dsl.load(spec, variant), target="triton", seed=5, inplace=False).eval()   # (as above)
    x = torch.randint(0, 256, (1, 21))
    _compiled_equals_eager(m, x, export=False)
    assert {s[0] for s in m._traced[False]} >= {"op", "generated"}
    assert "triton.kda_chunk" in m.program.counts()


def test_training_compile_gradients_equal_eager():
    """A train-mode forward and backward through torch.compile (register_autograd of every op of the training
    program; router balancing off, which would update the bias outside the graph) against eager."""
    spec, variant = SPECS["hybrid_tiny"]
    m = dsl.compile(dsl.load(spec, variant), target="reference", seed=7).train()
    m.balance = None
    x = torch.randint(0, 256, (2, 29))
    out = m(x)
    out.float().pow(2).mean().backward()
    ref = {k: p.grad.clone() for k, p in m.named_parameters() if p.grad is not None}
    assert len(ref) > 20
    m.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    out2 = torch.compile(m, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(out2, out, rtol=1e-6, atol=1e-6)
    out2.float().pow(2).mean().backward()
    for k, g in ref.items():
        got = dict(m.named_parameters())[k].grad
        assert got is not None, k
        torch.testing.assert_close(got, g, rtol=1e-5, atol=1e-5 * float(g.abs().max()), msg=k)


def test_kda_chunk_custom_op_backward_equals_its_autograd_function():
    """torch.ops.mtc.kda_chunk_triton's backward (register_autograd: the Triton kda_chunk's own autograd.Function)
    against the direct call's, and both against the float32 reference's gradients (T = 70: two chunks, one ragged)."""
    from backends import triton as T
    from backends.reference import kda_chunk as ref_kda
    from backends.registry import by_name
    torch.manual_seed(0)
    B, Tn, H, K, V = 1, 70, 2, 16, 32
    q, k = (torch.randn(B, Tn, H, K) for _ in range(2))
    k = torch.nn.functional.normalize(k, dim=-1)
    v = torch.randn(B, Tn, H, V)
    g = -torch.rand(B, Tn, H, K) * 0.5
    beta = torch.rand(B, Tn, H) * 0.8 + 0.1
    do = torch.randn(B, Tn, H, V)

    def grads(fn):
        xs = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]
        o = fn(*xs)
        o.backward(do)
        return o.detach(), [x.grad for x in xs]

    assert by_name("triton.kda_chunk").custom_op is not None          # (defines torch.ops.mtc.kda_chunk_triton)
    op = torch.ops.mtc.kda_chunk_triton
    scale = K ** -0.5
    o1, g1 = grads(lambda *a: op(list(a), scale, -5.0)[0])
    o2, g2 = grads(lambda *a: T.kda_chunk(*a, scale=scale, lower_bound=-5.0)[0])
    o3, g3 = grads(lambda *a: ref_kda(*a, scale=scale)[0])
    torch.testing.assert_close(o1, o2, rtol=0, atol=0)
    for a, b, c in zip(g1, g2, g3):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-4)
