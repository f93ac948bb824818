"""Every op's tensor-input count is checked at the call, from one table (OpDef.inputs / n_data_inputs): a spec,
the Python builder and a hand-made graph get "<op>: takes N tensor input(s) (names), got M" at the call's
file:line:col, never an unpacking error inside a shape rule or a KeyError inside a layer expansion."""
import pytest

import dsl
from dsl.builder import GraphBuilder, ShapeError
from dsl.errors import MtcError
from dsl.ir import TensorType
from dsl.ops import OPS

SPEC = """model m {
  config { d: int = 32 }
  forward(input_ids: i64[B, T]) {
    x = embedding(input_ids, vocab=64, dim=d)
    y = CALL
    return lm_head(rmsnorm(add(x, y)), vocab=64)
  }
}
"""

#: op -> (the attributes of a valid call, the tensor a valid call takes). Every op that owns parameters is here.
OWNING = {
    "embedding": ("vocab=64, dim=32", "input_ids"),
    "linear": ("out=32, name=\"proj\"", "x"),
    "lm_head": ("vocab=32, name=\"head2\"", "x"),
    "rmsnorm": ("name=\"norm2\"", "x"),
    "kda_layer": ("heads=2, head_dim=16", "x"),
    "mla_layer": ("heads=2, kv_lora_rank=8, qk_nope_dim=8, qk_rope_dim=8, v_dim=8", "x"),
    "glu_ffn": ("inter=24", "x"),
    "moe": ("experts=4, top_k=2, inter=8", "x"),
    "latent_moe": ("experts=4, top_k=2, inter=8, latent=16", "x"),
}


def _call_spec(op, args):
    attrs, _ = OWNING[op]
    return SPEC.replace("CALL", f"{op}({', '.join(args + [attrs])})")


def test_the_table_covers_every_op_that_owns_parameters():
    assert set(OWNING) == {n for n, od in OPS.items() if od.params is not None}


@pytest.mark.parametrize("op", sorted(OWNING))
def test_ops_owning_parameters_check_their_tensor_count_at_the_call(op):
    from passes import PassManager
    _, good = OWNING[op]
    if op not in ("embedding",):          # (embedding's output feeds add: its right call is the spec's own)
        PassManager().run(dsl.parse(_call_spec(op, [good]), file="s.mtc"))      # expands cleanly
    names = ", ".join(OPS[op].inputs[:1])
    layer = OPS[op].is_layer
    for args in ([], [good, good], [good, good, good]):
        with pytest.raises(MtcError) as ei:
            dsl.parse(_call_spec(op, args), file="s.mtc")
        e = ei.value
        if layer and not args:     # a layer op without a tensor is a block (configured, not applied): legal
            assert e.msg.startswith(f"argument 2 of 'add' must be a tensor, got a {op} block"), e.msg
            assert (e.loc.line, e.loc.col) == (6, 35) and f"{op}(x, ...)" in e.hint
            continue
        assert e.msg == f"{op}: takes 1 tensor input ({names}), got {len(args)}", e.msg
        assert (e.loc.file, e.loc.line, e.loc.col) == ("s.mtc", 5, 9)
        assert "Traceback" not in e.render() and e.render().splitlines()[2].endswith("^")


@pytest.mark.parametrize("op,n", [("silu", 1), ("add", 2), ("kda_gate", 3), ("kda_chunk", 5), ("concat", 2)])
def test_ops_without_parameters_name_their_inputs(op, n):
    names = ", ".join(OPS[op].inputs)
    for got in (0, n + 1):
        with pytest.raises(MtcError) as ei:
            dsl.parse(SPEC.replace("CALL", f"{op}({', '.join(['x'] * got)})"), file="s.mtc")
        want = f"{op}: takes {n} tensor input{'s' if n > 1 else ''} ({names}), got {got}"
        assert ei.value.msg == want and (ei.value.loc.line, ei.value.loc.col) == (5, 9)


def test_python_builder_checks_the_count_and_still_takes_explicit_parameters():
    b = GraphBuilder("t")
    x = b.input("x", "f32", ["B", "T", 24])
    with pytest.raises(MtcError, match=r"error: rmsnorm: takes 1 tensor input \(x\), got 0$"):
        b.call("rmsnorm")
    with pytest.raises(MtcError, match=r"error: glu_ffn: takes 1 tensor input \(x\), got 2$"):
        b.call("glu_ffn", x, x, inter=8)
    w = b.param("w", (24,), "ones")
    y = b.call("rmsnorm", x, w)                           # x with its weight given: the expansions' form
    assert b.type(y).same(b.type(x))
    with pytest.raises(MtcError, match=r"error: rmsnorm: takes 1 tensor input \(x\), got 3$"):
        b.call("rmsnorm", x, w, w)


def test_graph_level_count_includes_the_parameters():
    """A node (after its parameters exist) must have the data inputs plus exactly the op's parameters."""
    x, w = TensorType("f32", ("B", "T", 24)), TensorType("f32", (24,))
    od = OPS["rmsnorm"]
    assert od.check_and_infer([x, w], {"eps": 1e-6})[0].same(x)
    with pytest.raises(ShapeError, match=r"takes 2 inputs \(x and its parameter weight\), got 3"):
        od.check_and_infer([x, w, w], {"eps": 1e-6})
    glu = OPS["glu_ffn"]
    attrs = {**glu.attrs, "inter": 8}
    with pytest.raises(ShapeError, match=r"takes 4 inputs \(x and its 3 parameters\), got 2"):
        glu.check_and_infer([x, x], attrs)
    with pytest.raises(ShapeError, match="needs attribute 'inter'"):
        glu.check_and_infer([x], dict(glu.attrs))


def test_a_block_must_be_a_layer_op():
    text = SPEC.replace("  forward(", "  block dense = rmsnorm()\n  forward(").replace("CALL", "x")
    with pytest.raises(MtcError) as ei:
        dsl.parse(text, file="s.mtc")
    e = ei.value
    assert e.msg.startswith("block 'dense': rmsnorm is not a layer op; a block is one of glu_ffn, kda_layer")
    assert (e.loc.line, e.loc.col) == (3, 17) and "y = rmsnorm(x, ...)" in e.hint
