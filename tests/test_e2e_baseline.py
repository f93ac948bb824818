"""benchmarks/e2e.py's eager baseline computes the ops' exact semantics: each of its plain-PyTorch implementations
equals the reference op in float32 on the CPU, and so does the whole tiny model on its target "eager"; the fla-core
implementations (target "eager_fla") are checked against the reference on a GPU (-m gpu, bf16 tolerances). The
benchmark runs the eager program as PlainModel (no runtime around the calls): the same values, launch for launch."""
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import dsl
from backends.registry import by_name
from tiny_model import clear_ids, exercise

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("e2e_bench", ROOT / "benchmarks" / "e2e.py")
E2E = importlib.util.module_from_spec(_spec)
sys.modules["e2e_bench"] = E2E             # (dynamo resolves the implementations' globals by module name)
_spec.loader.exec_module(E2E)


class Ctx:
    """What an implementation reads of its launch: the node's attributes."""

    def __init__(self, **attrs):
        self.attrs = attrs

    def attr(self, key, default=None):
        return self.attrs.get(key, default)

    def shape(self, dims):
        return list(dims)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def same(target, op, c, *args, tol=1e-5):
    """The ``target`` implementation of ``op`` equals the reference's on ``args`` (every output)."""
    got = by_name(f"{target}.{op}" if target == "eager" else f"fla.{op}").fn(c, *args)
    want = by_name(f"reference.{op}").fn(c, *[a.float() if a.is_floating_point() else a for a in args])
    got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
    for x, y in zip(got, want, strict=True):
        assert x.shape == y.shape
        if y.is_floating_point():
            assert rel(x, y) < tol, (op, rel(x, y))
        else:
            assert torch.equal(x, y), op


def _experts(N=40, k=3, E=6, I=10, L=12, empty=2):
    """Random moe_experts operands, expert ``empty`` receiving no token."""
    scores = torch.rand(N, E)
    scores[:, empty] = -1
    idx = torch.topk(scores, k, dim=1).indices
    return (torch.randn(N, L), idx, torch.rand(N, k), torch.randn(E, I, L) / L ** 0.5, torch.randn(E, I, L) / L ** 0.5,
            torch.randn(E, L, I) / I ** 0.5)


def test_eager_ops_equal_the_reference_float32():
    E2E.register(fla=False)
    x = torch.randn(2, 7, 24)
    same("eager", "embedding", Ctx(), torch.randint(0, 11, (2, 5)), torch.randn(11, 8))
    for op in ("linear", "lm_head"):
        same("eager", op, Ctx(), x, torch.randn(9, 24))
    same("eager", "rmsnorm", Ctx(eps=1e-6), x, torch.rand(24) + 0.5)
    same("eager", "l2norm", Ctx(eps=1e-6), x.view(2, 7, 3, 8))
    same("eager", "short_conv", Ctx(), x, torch.randn(24, 1, 4))
    same("eager", "short_conv", Ctx(), x[:, :2], torch.randn(24, 1, 4))          # T < W - 1
    for op in ("silu", "sigmoid"):
        same("eager", op, Ctx(), 4 * x)
    for op in ("add", "mul"):
        same("eager", op, Ctx(), x, torch.randn(2, 7, 24))
    same("eager", "situ_glu", Ctx(beta_gate=4.0, beta_up=25.0), 8 * x, 40 * torch.randn(2, 7, 24))
    for gate in ("sigmoid", "softplus"):
        same("eager", "kda_gate", Ctx(gate=gate, lower_bound=-5.0), x.view(2, 7, 3, 8), torch.randn(3),
             torch.randn(24))
    q, k = torch.randn(2, 9, 3, 12), torch.randn(2, 9, 3, 12)
    for causal in (True, False):
        same("eager", "mla_attention", Ctx(scale=0.3, causal=causal), q, k, torch.randn(2, 9, 3, 8))
    same("eager", "qb_route", Ctx(top_k=3, routed_scaling=2.5), torch.randn(30, 24), torch.randn(7, 24) / 3,
         torch.randn(7) * 0.1)
    for act in ("situ", "silu"):
        same("eager", "moe_experts", Ctx(activation=act, beta_gate=4.0, beta_up=25.0), *_experts())


def test_eager_experts_loop_fallback_and_fused_weight_cache(monkeypatch):
    """Where torch has no CPU grouped GEMM, one matmul per expert; the cached w1|w3 follows in-place weight
    changes (its version) and is not used while autograd records."""
    E2E.register(fla=False)
    c = Ctx(activation="situ", beta_gate=4.0, beta_up=25.0)
    args = _experts()
    with torch.no_grad():
        same("eager", "moe_experts", c, *args)
        args[3].mul_(1.5)                        # w1 changes in place: the cached w1|w3 must not be reused
        same("eager", "moe_experts", c, *args)

    def no_gmm(*a, **kw):
        raise RuntimeError("no grouped GEMM here")
    monkeypatch.setattr(torch, "_grouped_mm", no_gmm)
    same("eager", "moe_experts", c, *args)
    w1 = args[3].clone().requires_grad_()
    u = by_name("eager.moe_experts").fn(c, *args[:3], w1, *args[4:])
    u.sum().backward()
    assert w1.grad is not None and w1.grad.abs().sum() > 0


def test_tiny_model_on_target_eager_equals_reference():
    g = dsl.load(ROOT / "models" / "kimi_k3.mtc", "tiny")
    passes = ["verify", "infer_shapes", "canonicalize"]
    ref = dsl.compile(g, target="reference", passes=passes).eval()
    eager = dsl.compile(g, target=E2E.register(fla=False), passes=passes).eval()
    exercise(ref)
    eager.load_state_dict(ref.state_dict())
    ran = {L.kernel for L in eager.program.launches}
    # every compute op on the eager implementations, but the two without a plain-torch form here
    assert {k for k in ran if k.startswith("reference.")} == {"reference.kda_chunk", "reference.attn_residual",
                                                             "reference.concat"}
    ids = clear_ids(ref, (2, 37))
    plain = E2E.PlainModel(eager)
    with torch.no_grad():
        a, b = eager(ids), ref(ids)
        c = plain(ids)
        assert plain(ids[:1, :5]).shape == (1, 5, 256)         # one plan per input shape
    assert rel(a, b) < 1e-5
    assert all(torch.equal(eager.routing_stats[k], ref.routing_stats[k]) for k in ref.routing_stats)
    assert torch.equal(c, a)                  # the plain model runs the eager program, launch for launch


@pytest.mark.gpu
def test_fla_ops_equal_the_reference_gpu():
    """fla-core's kernels as target "eager_fla" calls them, in bf16 on the GPU, against the float32 reference of
    the same operands (graph argument order), and the eager grouped-GEMM experts on CUDA's torch._grouped_mm."""
    pytest.importorskip("fla")
    E2E.register(fla=True)
    dev, bf = "cuda", torch.bfloat16

    def cu(*ts):
        return [t.to(dev, bf) if t.is_floating_point() else t.to(dev) for t in ts]

    B, T, H, K = 1, 300, 4, 64
    x = torch.randn(B, T, H * K)
    same("eager_fla", "short_conv", Ctx(), *cu(x, torch.randn(H * K, 1, 4)), tol=1e-2)
    same("eager_fla", "l2norm", Ctx(eps=1e-6), *cu(x.view(B, T, H, K)), tol=1e-2)
    A_log, dt = torch.randn(H).to(dev), torch.randn(H * K).to(dev)
    xg, = cu(x.view(B, T, H, K))
    for gate in ("sigmoid", "softplus"):
        same("eager_fla", "kda_gate", Ctx(gate=gate, lower_bound=-5.0), xg, A_log, dt, tol=1e-5)
    import backends.reference as R
    q, k = (R.l2norm(torch.randn(B, T, H, K)) for _ in range(2))
    g = R.kda_gate(torch.randn(B, T, H, K), torch.randn(H), torch.randn(H * K), lower_bound=-5.0)
    q, k, v, beta = cu(q, k, torch.randn(B, T, H, K), torch.rand(B, T, H))
    same("eager_fla", "kda_chunk", Ctx(scale=K ** -0.5, lower_bound=-5.0), q, k, v, g.to(dev), beta, tol=2e-2)
    src = cu(*[torch.randn(B, T, 256) for _ in range(5)])
    same("eager_fla", "attn_residual", Ctx(eps=1e-6), *cu(torch.randn(256), torch.rand(256) + 0.5), *src, tol=1e-2)
    for act in ("situ", "silu"):
        same("eager", "moe_experts", Ctx(activation=act, beta_gate=4.0, beta_up=25.0),
             *cu(*_experts(N=256, k=4, E=8, I=128, L=256)), tol=2e-2)
    same("eager", "mla_attention", Ctx(scale=192 ** -0.5, causal=True),
         *cu(torch.randn(B, T, H, 192), torch.randn(B, T, H, 192), torch.randn(B, T, H, 128)), tol=2e-2)
