"""One attribute validation per op, run by the spec builder and the IR path alike: dim ranges of slice / concat,
attribute types and values (booleans are not numbers, eps > 0 and finite), layer-op attributes against their
parameters' shapes, the IR signature's shape symbols, '?' types on the compile path, and parameter size limits."""
import contextlib
import io
import re

import pytest
import torch

import dsl
from dsl.builder import MAX_PARAM_DIM, GraphBuilder
from dsl.errors import MtcError
from dsl.ops import OPS, OpDef
from passes import PassManager
from passes.verify import verify


def _spec(body: str) -> str:
    """A spec whose line 4 is ``body`` (which sets h from x: f32[B, T, 32])."""
    return ("model m {\n  forward(input_ids: i64[B, T]) {\n    x = embedding(input_ids, vocab=64, dim=32)\n"
            f"    {body}\n    return lm_head(h, vocab=64)\n  }}\n}}\n")


def _spec_err(body: str) -> MtcError:
    with pytest.raises(MtcError) as ei:
        dsl.parse(_spec(body), file="s.mtc")
    return ei.value


def _ir_err(text: str, file: str = "m.ir") -> MtcError:
    with pytest.raises(MtcError) as ei:
        dsl.parse_ir(text, file=file)
    return ei.value


def _where(e: MtcError):
    return (e.loc.file, e.loc.line, e.loc.col)


def _line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


@pytest.fixture(scope="module")
def hybrid_ir():
    g = dsl.load("examples/hybrid_tiny.mtc")
    pm = PassManager("default", keep_stages=True)
    pm.run(g)
    return {k: str(v) for k, v in pm.stages.items()}


@pytest.fixture(scope="module")
def k3_graph_ir():
    return str(dsl.load("models/kimi_k3.mtc", variant="tiny"))


# -- 1. dim ranges ----------------------------------------------------------------------------
@pytest.mark.parametrize("body,d", [
    ("h = concat(x, x, dim=5)", 5),
    ("h = concat(x, x, dim=-4)", -4),
    ("h = slice(x, start=0, end=4, dim=-7)", -7),
    ("h = slice(x, start=0, end=16, dim=3)", 3),
])
def test_a_dim_outside_the_rank_is_a_located_error(body, d):
    e = _spec_err(body)
    assert _where(e) == ("s.mtc", 4, 9)
    assert f"dim {d} is out of range for the rank-3 input f32[B, T, 32] (valid: -3..2)" in e.msg


def test_dims_inside_the_rank_still_work_both_ways():
    g = dsl.parse(_spec("h = concat(slice(x, start=0, end=16, dim=-1), slice(x, start=16, end=32, dim=2), dim=-3)"))
    cat = next(n for n in g.nodes if n.op == "concat")
    assert str(cat.type) == "f32[2*B, T, 16]"
    g = dsl.parse(_spec("h = slice(x, start=0, end=8, dim=-1)"))
    assert str(next(n for n in g.nodes if n.op == "slice").type) == "f32[B, T, 8]"


def test_an_ir_dim_out_of_range_is_an_error_at_the_ir_line(hybrid_ir):
    text = hybrid_ir["canonical"]
    assert "dim = -1" in text
    bad = text.replace("dim = -1", "dim = 4", 1)
    e = _ir_err(bad)
    assert _where(e) == ("m.ir", _line_of(bad, "dim = 4"), 3)
    assert "dim 4 is out of range for the rank-3 input" in e.msg and "(valid: -3..2)" in e.msg


# -- 2. attribute kinds -----------------------------------------------------------------------
def test_every_op_attribute_has_a_kind_and_an_op_without_one_is_refused():
    for od in OPS.values():
        for k in {**od.attrs, **od.param_attrs}:
            assert od.kind(k) is not None, (od.name, k)
    with pytest.raises(TypeError, match="attribute 'mystery' has no kind"):
        OpDef("made_up", lambda ts, a: ts, attrs={"mystery": None})


@pytest.mark.parametrize("body,msg", [
    ('h = rmsnorm(x, eps=true, name="n")', "rmsnorm: attribute 'eps' must be a number, got true"),
    ('h = rmsnorm(x, eps=0, name="n")', "rmsnorm: attribute 'eps' must be a positive number (finite, > 0), got 0"),
    ('h = rmsnorm(x, eps=-1.0, name="n")', "attribute 'eps' must be a positive number (finite, > 0), got -1.0"),
    ('h = l2norm(x, eps="small")', "l2norm: attribute 'eps' must be a number, got 'small'"),
    ('h = slice(x, start=0, end=4, dim=true)', "slice: attribute 'dim' must be an integer, got true"),
    ('h = linear(x, out=true, name="up")', "linear: attribute 'out' must be an integer, got true"),
    ('h = linear(x, out=0, name="up")', "linear: attribute 'out' must be an integer >= 1, got 0"),
    ('h = glu_ffn(x, inter=16, act="gelu", name="f")', "glu_ffn: attribute 'act' must be one of 'situ', 'silu', "
                                                        "got 'gelu'"),
    ('h = kda_layer(x, heads=0, head_dim=16, name="k")', "kda_layer: attribute 'heads' must be an integer >= 1, "
                                                         "got 0"),
])
def test_spec_attributes_are_checked_at_the_call(body, msg):
    e = _spec_err(body)
    assert msg in e.msg, e.msg
    assert _where(e) == ("s.mtc", 4, 9)


def test_kda_layer_lower_bound_is_checked_at_the_layer_not_only_at_expansion(k3_graph_ir):
    e = _spec_err('h = kda_layer(x, heads=2, head_dim=16, lower_bound=1.0, name="k")')
    assert "kda_layer: lower_bound must be negative with gate 'sigmoid', got 1.0" in e.msg
    assert _where(e) == ("s.mtc", 4, 9)
    bad = k3_graph_ir.replace("lower_bound = -5.0", "lower_bound = 0.5", 1)
    e = _ir_err(bad, "k3.ir")
    assert _where(e) == ("k3.ir", _line_of(bad, "lower_bound = 0.5"), 3)
    dsl.parse(_spec('h = kda_layer(x, heads=2, head_dim=16, gate="softplus", lower_bound=1.0, name="k")'))


def test_valid_spec_attributes_still_build():
    dsl.parse(_spec('h = rmsnorm(x, eps=1e-5, name="n")'))
    dsl.parse(_spec('h = rmsnorm(x, eps=1, name="n")'))          # an int is a number
    dsl.parse(_spec('h = glu_ffn(x, inter=16, act="silu", name="f")'))


def test_the_python_builder_refuses_the_same_and_keeps_optional_attributes():
    b = GraphBuilder("t")
    x = b.input("x", "f32", ["B", "T", 4, 16])
    with pytest.raises(MtcError, match="rmsnorm: attribute 'eps' must be a number, got true"):
        b.call("rmsnorm", x, eps=True, name="n")
    with pytest.raises(MtcError, match="rmsnorm: attribute 'eps' must be a number, got none"):
        b.call("rmsnorm", x, eps=None, name="n")
    g = b.call("kda_gate", x, b.param("A", [4], "a_log"), b.param("dt", [64], "dt_bias"))
    beta = b.call("sigmoid", b.input("b", "f32", ["B", "T", 4]))
    o = b.call("kda_chunk", x, x, x, g, beta, scale=None, lower_bound=None)      # none = not set
    assert str(b.type(o)) == "f32[B, T, 4, 16]"
    with pytest.raises(MtcError, match=r"kda_chunk: attribute 'lower_bound' must be none or a negative number "
                                       r"\(finite, < 0\), got 2.0"):
        b.call("kda_chunk", x, x, x, g, beta, lower_bound=2.0)


@pytest.mark.parametrize("value,msg", [
    ('"x"', "attribute 'eps' must be a number, got 'x'"),
    ("none", "attribute 'eps' must be a number, got none"),
    ("[1, 2]", "attribute 'eps' must be a number, got [1, 2]"),
    ("true", "attribute 'eps' must be a number, got true"),
    ("-1.0", "attribute 'eps' must be a positive number (finite, > 0), got -1.0"),
    ("0.0", "attribute 'eps' must be a positive number (finite, > 0), got 0.0"),
    ("nan", "attribute 'eps' must be a positive number (finite, > 0), got nan"),
    ("inf", "attribute 'eps' must be a positive number (finite, > 0), got inf"),
])
def test_ir_attribute_values_are_checked_at_the_ir_line(hybrid_ir, value, msg):
    text = hybrid_ir["canonical"]
    bad = text.replace("{eps = 1e-06}", "{eps = " + value + "}", 1)
    assert bad != text
    e = _ir_err(bad)
    assert msg in e.msg, e.msg
    assert _where(e) == ("m.ir", _line_of(bad, "{eps = " + value + "}"), 3)
    assert e.msg.startswith("%1: attn_residual: ")


def test_ir_primitive_op_values_are_checked(hybrid_ir):
    text = hybrid_ir["canonical"]
    bad = re.sub(r"routed_scaling = [0-9.]+", "routed_scaling = -1.0", text, count=1)
    assert bad != text
    e = _ir_err(bad)
    assert "qb_route: attribute 'routed_scaling' must be a positive number (finite, > 0), got -1.0" in e.msg
    assert _where(e) == ("m.ir", _line_of(bad, "routed_scaling = -1.0"), 3)
    bad = text.replace("causal = true", "causal = 1", 1)
    e = _ir_err(bad)
    assert "mla_attention: attribute 'causal' must be true or false, got 1" in e.msg


def test_ir_layer_op_attributes_are_checked(hybrid_ir):
    bad = hybrid_ir["graph"].replace("gated = true", 'gated = "yes"', 1)
    e = _ir_err(bad)
    assert "mla_layer: attribute 'gated' must be true or false, got 'yes'" in e.msg
    assert _where(e) == ("m.ir", _line_of(bad, 'gated = "yes"'), 3)
    bad = hybrid_ir["graph"].replace('act = "situ"', 'act = "sitU"', 1)
    e = _ir_err(bad)
    assert "attribute 'act' must be one of 'situ', 'silu', got 'sitU' (did you mean 'situ'?)" in e.msg


@pytest.mark.parametrize("old,new,msg", [
    ("std = 0.02}", "std = -1.0}", "param: attribute 'std' must be a finite number >= 0, got -1.0"),
    ("std = 0.02}", "std = nan}", "param: attribute 'std' must be a finite number >= 0, got nan"),
    ('init = "normal"', 'init = "nromal"', "param: attribute 'init' must be one of 'normal', 'expert', 'ones', "
                                           "'zeros', 'conv', 'a_log', 'dt_bias', 'dt_bias_sigmoid', got 'nromal' (did you mean "
                                           "'normal'?)"),
    ("std = 0.02}", "sdt = 0.02}", "param has no attribute 'sdt' (did you mean 'std'?)"),
    ('{init = "normal", ', "{", "param needs the attribute 'init' (its initialiser)"),
    ("f32[512, 96]", "f32[512, 0]", "the shape [512, 0] has a dimension 0"),
    ("f32[512, 96]", "f32[512, 2000000000000]", "has a dimension of 2000000000000, more than the limit of 2**40"),
    ("f32[512, 96]", "f32[1000000, 1000000, 1000]", "has 1e+15 elements, more than the limit of 2**48"),
])
def test_ir_parameter_nodes_are_checked_at_the_ir_line(hybrid_ir, old, new, msg):
    text = hybrid_ir["canonical"]
    line = _line_of(text, '%p0 = param')
    bad = text.replace(old, new, 1)
    assert bad != text and _line_of(bad, '%p0 = param') == line
    e = _ir_err(bad)
    assert msg in e.msg, e.msg
    assert e.msg.startswith("%p0: ")
    assert _where(e) == ("m.ir", line, 3)


def test_ir_buffer_and_input_nodes_are_checked(hybrid_ir):
    text = hybrid_ir["canonical"]
    bad = re.sub(r'(= buffer \{init = "zeros", name = "[^"]+", )pinned = true', r'\1pinned = "yes"', text, count=1)
    assert bad != text
    e = _ir_err(bad)
    assert "buffer: attribute 'pinned' must be true or false, got 'yes'" in e.msg
    bad = text.replace('{name = "input_ids"}', '{name = 3}', 1)
    e = _ir_err(bad)
    assert "input: attribute 'name' must be a string, got 3" in e.msg and _where(e) == ("m.ir", 2, 3)


def test_bad_ir_attributes_also_fail_verify_on_a_graph_built_in_python():
    from dsl.ir import Graph
    g = dsl.load("examples/hybrid_tiny.mtc")
    nodes = [n.replace(attrs={**n.attr_dict, "eps": float("nan")}) if n.op == "rmsnorm" else n for n in g.nodes]
    with pytest.raises(MtcError, match=r"\(rmsnorm\): attribute 'eps' must be a positive number") as ei:
        verify(Graph(g.name, tuple(nodes), g.outputs, g.symbols))
    assert ei.value.loc.file == "examples/hybrid_tiny.mtc"


# -- 3. layer-op attributes against their parameters -----------------------------------------
def test_latent_moe_experts_must_match_its_weights(k3_graph_ir):
    bad = k3_graph_ir.replace("experts = 16", "experts = 8", 1)
    e = _ir_err(bad, "k3.ir")
    assert _where(e) == ("k3.ir", _line_of(bad, "experts = 8"), 3)
    assert "latent_moe: parameter 'gate.weight' (input 2) is f32[16, 64], but the attributes and the input give " \
           "f32[8, 64]" in e.msg


def test_kda_heads_must_match_its_weights_at_the_ir_line(k3_graph_ir):
    bad = k3_graph_ir.replace("heads = 2", "heads = 3", 1)
    e = _ir_err(bad, "k3.ir")
    assert _where(e) == ("k3.ir", _line_of(bad, "heads = 3"), 3)
    assert "kda_layer: parameter 'q_proj.weight' (input 2) is f32[64, 64], but the attributes and the input give " \
           "f32[96, 64]" in e.msg


def test_expert_dtype_must_match_the_expert_weights(k3_graph_ir):
    bad = k3_graph_ir.replace('expert_dtype = ""', 'expert_dtype = "mxfp4"', 1)
    e = _ir_err(bad, "k3.ir")
    assert "parameter 'experts.w1' (input 5) is f32[16, 32, 32], but the attributes and the input give " \
           "mxfp4[16, 32, 32]" in e.msg


def test_a_layer_ops_parameters_are_checked_by_verify_too():
    from dsl.ir import Graph
    g = dsl.load("models/kimi_k3.mtc", variant="tiny")
    i = next(i for i, n in enumerate(g.nodes) if n.op == "latent_moe")
    nodes = list(g.nodes)
    nodes[i] = nodes[i].replace(attrs={**nodes[i].attr_dict, "experts": 8})
    with pytest.raises(MtcError, match=r"parameter 'gate.weight' \(input 2\) is f32\[16, 64\]"):
        verify(Graph(g.name, tuple(nodes), g.outputs, g.symbols))


# -- 4. the signature -------------------------------------------------------------------------
def test_an_undeclared_shape_symbol_is_named(hybrid_ir):
    bad = hybrid_ir["graph"].replace("graph hybrid_tiny(B, T)", "graph hybrid_tiny(B)")
    e = _ir_err(bad)
    assert _where(e) == ("m.ir", 2, 3)
    assert "the type i64[B, T] uses the shape symbol 'T', which the graph's signature 'graph hybrid_tiny(B)' " \
           "does not declare" in e.msg
    assert "graph hybrid_tiny(B, T)" in e.hint
    e = _ir_err(hybrid_ir["graph"].replace("graph hybrid_tiny(B, T)", "graph hybrid_tiny(B, T, B)"))
    assert _where(e) == ("m.ir", 1, 1) and "declares the shape symbol 'B' twice" in e.msg
    dsl.parse_ir(hybrid_ir["graph"].replace("graph hybrid_tiny(B, T)", "graph hybrid_tiny(B, T, S)"))  # unused: ok


def test_the_signature_lists_the_inputs_symbols():
    text = ("model m {\n  forward(ids: i64[N, S]) {\n    x = embedding(ids, vocab=64, dim=32)\n"
            "    return lm_head(x, vocab=64)\n  }\n}\n")
    g = dsl.parse(text)
    assert g.symbols == ("N", "S")
    assert str(g).startswith("graph m(N, S) {")
    assert str(dsl.parse_ir(str(g))) == str(g)
    b = GraphBuilder("t", symbols=("B",))
    with pytest.raises(MtcError, match=r"input 'x': the shape symbol 'T' is not one of the graph's symbols \(B\)"):
        b.input("x", "f32", ["B", "T"])


# -- 5. '?' types on the compile path, IR text given to the CLI --------------------------------
def test_untyped_ir_compiles_and_runs_like_the_spec(hybrid_ir):
    lines = []
    for line in hybrid_ir["graph"].splitlines():
        if not re.search(r"= (input|param|buffer) ", line):
            line = re.sub(r" : [a-z0-9]+\[[^\]]*\]", " : ?", line)
        lines.append(line)
    text = "\n".join(lines) + "\n"
    assert text.count(": ?") > 20
    g = dsl.parse_ir(text)
    m = dsl.compile(g)
    ref = dsl.compile(dsl.load("examples/hybrid_tiny.mtc"))
    ids = torch.randint(0, 512, (1, 6))
    torch.testing.assert_close(m(ids), ref(ids))
    assert str(m.stages["typed"]) == hybrid_ir["typed"]
    with pytest.raises(MtcError, match=r"%0 \(embedding\) has no type: run passes.infer_shapes.infer_shapes\(g\)"):
        verify(g)


def test_ir_text_given_as_a_spec_gets_a_hint(tmp_path, hybrid_ir):
    from dsl.cli import main
    p = tmp_path / "m.ir"
    p.write_text(hybrid_ir["graph"])
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(["ir", str(p)])
    assert rc == 2
    out = err.getvalue()
    assert "Traceback" not in out and f"{p}:1:1: error: syntax error" in out
    assert f"hint: '{p}' is graph IR text (what `mtc ir` prints), not a .mtc spec" in out
    assert "dsl.parse_ir(" in out


# -- 6. parameter size limits -----------------------------------------------------------------
@pytest.mark.parametrize("body,msg", [
    ('h = linear(x, out=99999999999999999999999999, name="up")',
     "parameter 'up.weight': the shape [99999999999999999999999999, 32] has a dimension of "
     "99999999999999999999999999, more than the limit of 2**40"),
    ('h = kda_layer(x, heads=1099511627777, head_dim=16, name="k")',
     "parameter 'k.q_proj.weight': the shape [17592186044432, 32] has a dimension of 17592186044432"),
])
def test_absurd_parameter_sizes_are_refused(body, msg):
    e = _spec_err(body)
    assert msg in e.msg, e.msg
    assert _where(e) == ("s.mtc", 4, 9)


def test_sizes_at_the_limits_are_accepted():
    g = dsl.parse(_spec('h = linear(x, out=1099511627776, name="up")'))     # 2**40 x 32: within both limits
    assert any(n.op == "param" and int(n.type.shape[0]) == MAX_PARAM_DIM for n in g.nodes)


def test_the_element_limit_applies_to_the_product():
    e = _spec_err('h = linear(linear(x, out=1048576, name="a"), out=1073741824, name="up")')
    assert "parameter 'up.weight': the shape [1073741824, 1048576] has 1.13e+15 elements, more than the limit " \
           "of 2**48 (2.81e+14) per parameter" in e.msg


# -- the round trip still holds ---------------------------------------------------------------
def test_round_trip_of_every_stage(hybrid_ir):
    g = dsl.load("models/kimi_k3.mtc", variant="tiny")
    pm = PassManager("default", keep_stages=True)
    pm.run(g)
    for stages in (hybrid_ir, {k: str(v) for k, v in pm.stages.items()}):
        for st in ("graph", "typed", "canonical", "fused"):
            assert str(dsl.parse_ir(stages[st])) == stages[st], st
