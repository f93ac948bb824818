"""The op registry (dsl/ops): every op declared once, with its spec form and compiler role; the passes' op sets and
fusion rules are the ones the declarations give; a new op is one declaration plus one implementation per backend."""
from __future__ import annotations

import pytest
import torch

import dsl
from dsl.errors import MtcError
from dsl.ops import (OPS, POSITIVE, ROLES, X, Fusion, SpecForm, _need_float, numel, op_set, ops_in_slot,
                     ops_with_role, register, spec_example, unregister)


def test_every_op_declares_a_spec_form_and_a_role():
    assert len(OPS) >= 28
    for name, od in OPS.items():
        assert isinstance(od.spec, SpecForm), name
        assert od.role in ROLES, (name, od.role)
        assert (od.fusion is not None) == (od.role == "anchor" or name == "situ_glu"), name   # situ_glu: GLU GEMMs
        assert (od.role == "layer") == od.is_layer == (od.expand is not None) == (od.slot is not None), name
    assert ops_in_slot("attn") | ops_in_slot("ffn") == ops_with_role("layer")


def test_the_passes_use_the_sets_the_roles_give():
    from backends.triton import codegen
    from passes import canonicalize, fuse_tiles, lower, plan_memory
    views = {"reshape", "slice", "broadcast"}
    codegen_ops = {"add", "mul", "silu", "sigmoid", "situ_glu", "rmsnorm", "l2norm"}
    assert lower.VIEWS == fuse_tiles.VIEWS == plan_memory.VIEW_OPS == ops_with_role("view") == views
    assert lower.GEMMS == ops_with_role("gemm") == {"linear", "lm_head"}
    assert lower.CODEGEN_OPS == codegen.ROW_OPS == ops_with_role("pointwise", "row_norm") == codegen_ops
    assert lower.POINTWISE == codegen_ops | {"short_conv", "kda_gate", "embedding", "concat"}
    assert plan_memory._LAYER_OPS == ops_with_role("layer") == {"kda_layer", "mla_layer", "glu_ffn", "latent_moe",
                                                                 "moe"}
    assert ops_in_slot("attn") == {"kda_layer", "mla_layer"}
    assert [(r.name, r.op) for r in canonicalize.RULES] == [("reshape-noop", "reshape"), ("reshape-reshape", "reshape")]
    rules = {r.anchor: r for r in fuse_tiles.RULES}
    assert rules.keys() == {n for n, od in OPS.items() if od.fusion is not None}
    for anchor, r in rules.items():
        f = OPS[anchor].fusion
        assert (r.name, r.prologue, r.epilogue, r.side) == (f.name, op_set(f.prologue), op_set(f.epilogue),
                                                           op_set(f.side))
    kda = rules["kda_chunk"]
    assert kda.prologue == {"short_conv", "silu", "l2norm", "kda_gate", "sigmoid"} | views
    assert kda.epilogue == {"rmsnorm", "mul"} | views and kda.side == {"sigmoid"} | views
    assert rules["qb_route"].prologue == views and rules["moe_experts"].epilogue == {"rmsnorm"}
    assert rules["situ_glu"].prologue == {"linear"} and rules["attn_residual_phase1"].epilogue == frozenset()


def test_a_declaration_is_checked():
    with pytest.raises(TypeError, match="already registered"):
        register("silu", lambda ts, a: ts, role="pointwise", spec=SpecForm(None, "x"))
    with pytest.raises(TypeError, match="role 'fancy' is not one of"):
        register("made_up", lambda ts, a: ts, role="fancy", spec=SpecForm(None, "x"))
    with pytest.raises(TypeError, match="an anchor op declares its fusion rule"):
        register("made_up", lambda ts, a: ts, role="anchor", spec=SpecForm(None, "x"))
    with pytest.raises(TypeError, match="stack slot"):
        register("made_up", lambda ts, a: ts, role="gemm", slot="attn", spec=SpecForm(None, "x"))
    assert "made_up" not in OPS
    with pytest.raises(ValueError, match="unknown role 'fancy'"):
        ops_with_role("fancy")


# -- a new op: the two steps of dsl/ops/__init__.py's "Adding an op" -------------------------------------------
@pytest.fixture
def softcap():
    """Declare softcap (cap * tanh(x / cap), Gemma 2's logit soft-capping) and its reference implementation;
    remove both afterwards so that no other test sees them."""
    from backends import registry

    def infer(ts, a):
        _need_float(ts[0], "x")
        return [ts[0]]

    register("softcap", infer, role="pointwise", inputs=("x",), attrs={"cap": 30.0}, kinds={"cap": POSITIVE},
             flops=lambda ts, os, a: 3 * numel(ts[0]), doc="cap * tanh(x / cap) (Gemma 2 logit soft-capping)",
             spec=SpecForm("y = softcap(x, cap=30.0)", "", spec_example(X, "y = softcap(x, cap=2.5)", "return y")))
    try:
        @registry.impl("reference", "softcap")
        def _softcap(node, x):
            cap = node.attr("cap")
            return cap * torch.tanh(x / cap)
        yield OPS["softcap"]
    finally:
        unregister("softcap")
        registry._IMPLS.pop(("reference", "softcap"), None)
    assert "softcap" not in OPS


def test_a_new_op_compiles_and_runs_from_one_declaration_and_one_impl(softcap, tmp_path):
    g = dsl.parse(softcap.spec.example)
    m = dsl.compile(g, target="reference").eval()
    assert "reference.softcap" in m.ir("lowered")
    x = torch.randn(3, 100, 64) * 4
    with torch.no_grad():
        y = m(x)
    want = 2.5 * torch.tanh(x.double() / 2.5)
    torch.testing.assert_close(y.double(), want, rtol=1e-6, atol=1e-6)
    # training: autograd through the implementation (d/dx = 1 - tanh(x / cap)^2)
    xg = x.clone().requires_grad_(True)
    m.train()(xg).sum().backward()
    torch.testing.assert_close(xg.grad.double(), 1 - torch.tanh(x.double() / 2.5) ** 2, rtol=1e-5, atol=1e-6)
    # the Triton target has no implementation of its own: the chain falls back to the reference one
    assert "reference.softcap" in dsl.compile(g, target="triton", device="meta").ir("lowered")
    # its attribute kind, FLOPs and spec form come from the same declaration
    with pytest.raises(MtcError, match="attribute 'cap' must be a positive number"):
        dsl.parse(softcap.spec.example.replace("cap=2.5", "cap=-1.0"))
    from passes.stats import compute_stats
    assert compute_stats(g, seq_len=100).flops_per_token_by_op["softcap"] == 3 * 64
    from dsl.cli import main
    import contextlib
    import io
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["ops", "softcap"]) == 0
    assert "in a spec:  y = softcap(x, cap=30.0)" in out.getvalue() and "graph op:   softcap(x)" in out.getvalue()
