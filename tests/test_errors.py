"""Bad input gets one clear message that names file:line:col, never a traceback."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

import dsl
from dsl.errors import MtcError

GOOD = """model m {
  config {
    d: int = 32
    heads: int = 2
  }
  forward(input_ids: i64[B, T]) {
    x = embedding(input_ids, vocab=256, dim=d)
    y = kda_layer(x, heads=heads, head_dim=16, name="model.layers.0.self_attn")
    return lm_head(rmsnorm(x), vocab=256)
  }
}
"""


def _err(text, **kw) -> MtcError:
    with pytest.raises(MtcError) as ei:
        dsl.parse(text, file="spec.mtc", **kw)
    return ei.value


def _loc(e):
    return (e.loc.line, e.loc.col)


def test_good_spec_parses():
    dsl.parse(GOOD)


def test_syntax_error_points_at_token():
    e = _err(GOOD.replace("dim=d)", "dim=d"))
    assert e.loc.file == "spec.mtc" and e.loc.line == 8
    assert "syntax error" in e.msg
    r = e.render()
    assert r.startswith("spec.mtc:8:") and "^" in r


def test_unexpected_character():
    e = _err(GOOD.replace("d: int = 32", "d: int = 32 $"))
    assert _loc(e) == (3, 17)


def test_unknown_op_suggests_the_right_one():
    e = _err(GOOD.replace("kda_layer(x", "kda_layr(x"))
    assert _loc(e) == (8, 9) and "unknown op 'kda_layr'" in e.msg and "kda_layer" in e.msg


def test_unknown_name_in_config():
    e = _err(GOOD.replace("heads: int = 2", "heads: int = hedas"))
    assert _loc(e) == (4, 18) and "unknown name 'hedas'" in e.msg


def test_config_type_mismatch():
    e = _err(GOOD.replace("d: int = 32", "d: int = 32.5"))
    assert _loc(e)[0] == 3 and "declared int" in e.msg


def test_unknown_attribute():
    e = _err(GOOD.replace("head_dim=16", "head_dimm=16"))
    assert _loc(e) == (8, 9) and "head_dim" in e.msg


def test_shape_mismatch_is_reported_at_the_users_line():
    bad = GOOD.replace("return lm_head(rmsnorm(x), vocab=256)",
                       "z = linear(x, out=48, name=\"proj\")\n    w = add(x, z)\n    return lm_head(rmsnorm(w), vocab=256)")
    e = _err(bad)
    assert _loc(e) == (10, 9)
    assert "do not broadcast" in e.msg and "[B, T, 32]" in e.msg and "[B, T, 48]" in e.msg


def test_head_dim_inconsistent_with_width():
    bad = GOOD.replace("return lm_head(rmsnorm(x), vocab=256)",
                       "h = reshape(x, shape=[\"B\", \"T\", 3, 11])\n    return lm_head(rmsnorm(x), vocab=256)")
    e = _err(bad)
    assert _loc(e) == (9, 9) and "element counts differ" in e.msg


def test_unknown_variant_and_override():
    with pytest.raises(MtcError, match="no variant 'huge'"):
        dsl.parse(GOOD, "huge")
    with pytest.raises(MtcError, match="not a config field"):
        dsl.parse(GOOD, n_layerz=3)


def test_top_k_larger_than_experts():
    bad = GOOD.replace("y = kda_layer(x, heads=heads, head_dim=16, name=\"model.layers.0.self_attn\")",
                       "y = latent_moe(x, experts=4, top_k=8, inter=8, latent=16)")
    e = _err(bad)
    assert _loc(e) == (8, 9) and "top_k = 8" in e.msg


def test_cli_reports_one_paragraph_without_traceback(tmp_path):
    p = tmp_path / "bad.mtc"
    p.write_text(GOOD.replace("kda_layer(x", "kda_layr(x"))
    r = subprocess.run([sys.executable, "-m", "dsl.cli", "run", str(p)], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parent.parent)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert r.stderr.startswith(f"{p}:8:9: error: unknown op 'kda_layr'")
    assert len(r.stderr.strip().splitlines()) == 3      # message, source line, caret


def test_cli_missing_input_file(tmp_path):
    r = subprocess.run([sys.executable, "-m", "dsl.cli", "run", "--input", str(tmp_path / "nope.txt")],
                       capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent)
    assert r.returncode == 2 and "cannot read --input" in r.stderr and "Traceback" not in r.stderr


STACK = """model m {
  config { d: int = 32  n: int = 2 }
  block kda = kda_layer(heads=2, head_dim=16)
  block dense = glu_ffn(inter=48)
  forward(input_ids: i64[B, T]) {
    x = embedding(input_ids, vocab=256, dim=d)
    x = stack(x, layers=n) {
      attn = kda
      ffn = dense
    }
    return lm_head(rmsnorm(x), vocab=256)
  }
}
"""


def test_stack_layer_count_and_slot_kinds_are_checked():
    dsl.parse(STACK)
    e = _err(STACK.replace("n: int = 2", "n: int = 99999999999999999999"))
    assert "more than 4096 layers" in str(e) and _loc(e) == (7, 5)
    e = _err(STACK.replace("attn = kda", "attn = dense"))
    assert "'attn' slot takes kda_layer or mla_layer" in str(e) and _loc(e) == (8, 7)
    e = _err(STACK.replace("ffn = dense", "ffn = kda"))
    assert "'ffn' slot takes" in str(e) and _loc(e) == (9, 7)


def test_duplicate_parameter_names_explain_the_fix():
    e = _err(GOOD.replace("return lm_head(rmsnorm(x)", "x = rmsnorm(x)\n    return lm_head(rmsnorm(x)"))
    assert "defined twice" in str(e) and "name=" in str(e)


def test_meta_model_refuses_to_run_and_lowered_ir_on_reference():
    import torch
    g = dsl.parse(STACK)
    with pytest.raises(MtcError, match="device='meta'"):
        dsl.compile(g, device="meta")(torch.zeros(1, 4, dtype=torch.long))
    assert "kernels m(B, T)" in dsl.compile(g, target="reference").ir("lowered")


def test_compile_emit_into_a_file_is_a_clean_error(tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    spec = tmp_path / "m.mtc"
    spec.write_text(STACK)
    r = subprocess.run([sys.executable, "-m", "dsl.cli", "compile", str(spec), "--emit", str(f)],
                       capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parent.parent)
    assert r.returncode == 2 and "cannot write the generated kernels" in r.stderr and "Traceback" not in r.stderr


def test_friendly_syntax_messages_and_editor_quirks():
    e = _err("")
    assert "expected 'model'" in str(e)
    e = _err(GOOD.replace("return lm_head(rmsnorm(x), vocab=256)",
                          "return x\n    return lm_head(rmsnorm(x), vocab=256)"))
    assert "second return" in str(e) and _loc(e) == (10, 5)
    e = _err(GOOD.replace("  forward(", "  config { e: int = 1 }\n  forward("))
    assert "one config" in str(e) and _loc(e) == (6, 3)
    dsl.parse("\ufeff" + GOOD)                       # a byte-order mark is not an error
    e = _err(GOOD.replace("    y = kda_layer", "\ty = kda_layr"))
    assert _loc(e) == (8, 6)
    excerpt = e.render().splitlines()
    assert excerpt[1].endswith("    y = kda_layr(x, heads=heads, head_dim=16, name=\"model.layers.0.self_attn\")")
    assert excerpt[2].index("^") - excerpt[1].index("|") == excerpt[1].index("kda_layr") - excerpt[1].index("|")


def test_unused_blocks_and_values_are_warned_about():
    from dsl.errors import MtcWarning
    text = GOOD.replace("  forward(", "  block never = glu_ffn(inter=48)\n  forward(").replace(
        "    return", "    unused = silu(x)\n    return")
    with pytest.warns(MtcWarning) as rec:
        dsl.parse(text, file="spec.mtc")
    msgs = sorted(str(r.message) for r in rec)
    assert any("spec.mtc:6:3: warning: block 'never'" in m for m in msgs)
    assert any("spec.mtc:10:5: warning: 'unused' is computed but never used" in m for m in msgs)
    assert any("'y' is computed but never used" in m for m in msgs)      # GOOD's own unused kda_layer


def test_duplicate_block_name_is_reported_at_the_second():
    text = STACK.replace("  block dense = glu_ffn(inter=48)", "  block dense = glu_ffn(inter=48)\n"
                                                              "  block kda = glu_ffn(inter=8)")
    e = _err(text)
    assert e.msg.startswith("block 'kda' is defined twice (first at line 3)") and _loc(e) == (5, 3)
    e = _err(STACK.replace("block dense =", "block d ="))
    assert "block 'd' has the name of a config field" in e.msg and _loc(e) == (4, 3)


def test_reshape_takes_bare_shape_symbols_and_prints_shapes_plainly():
    body = "h = reshape(x, shape=SHAPE)\n    return lm_head(rmsnorm(reshape(h, shape=[B, T, d])), vocab=256)"
    spec = GOOD.replace("return lm_head(rmsnorm(x), vocab=256)", body)
    bare = dsl.parse(spec.replace("SHAPE", "[B, T, 2, d // 2]"))
    quoted = dsl.parse(spec.replace("SHAPE", '["B", "T", 2, 16]').replace("[B, T, d]", '["B", "T", 32]'))
    assert bare == quoted and str(bare) == str(quoted)
    assert dsl.parse(spec.replace("SHAPE", "[B * T, 2, 16]")) == dsl.parse(spec.replace("SHAPE", '["B*T", 2, 16]'))
    e = _err(spec.replace("SHAPE", "[B, T, 7, 9]"))
    assert e.msg == "reshape: cannot reshape [B, T, 32] into [B, T, 7, 9]: element counts differ (32*B*T vs 63*B*T)"
    assert _loc(e) == (9, 9)
    e = _err(spec.replace("SHAPE", '["B", "Q", 2, 16]'))        # quoted: the shape rule names the symbol
    assert e.msg == ("reshape: unknown symbol 'Q' in the shape [B, Q, 2, 16]: the input [B, T, 32] has symbols B, T")
    e = _err(spec.replace("SHAPE", "[B, Q, 2, 16]"))            # bare: an unknown name, at the name
    assert e.msg == "unknown name 'Q'" and _loc(e) == (9, 30) and "shape symbols are B, T" in e.hint
    e = _err(spec.replace("SHAPE", "[B, T // 2, 2, 32]"))
    assert "'//' needs numbers, got the shape expression T" in e.msg and _loc(e) == (9, 30)


def test_an_unapplied_layer_block_is_named_not_dumped():
    e = _err(GOOD.replace("return lm_head(rmsnorm(x), vocab=256)",
                          "f = glu_ffn(inter=8)\n    return lm_head(rmsnorm(add(x, f)), vocab=256)"))
    assert e.msg == ("argument 2 of 'add' must be a tensor, got a glu_ffn block "
                     "(a layer op called without a tensor is configured, not applied)")
    assert _loc(e) == (10, 35) and e.hint == "give the layer its input tensor: glu_ffn(x, ...)"
    assert "Block(" not in e.render() and "Loc(" not in e.render()
    e = _err(GOOD.replace("head_dim=16,", "head_dim=x,"))
    assert e.msg.startswith("keyword 'head_dim' of 'kda_layer' is a tensor;") and _loc(e) == (8, 44)
    e = _err(GOOD.replace("return lm_head(rmsnorm(x), vocab=256)", "return glu_ffn(inter=8)"))
    assert e.msg.startswith("return needs tensors, got a glu_ffn block") and "Ref(" not in e.msg


@pytest.mark.parametrize("lit,value", [("6_4", "64"), ("0x40", "64"), ("0o17", "15"), ("3k", None),
                                       ("1.2.3", None)])
def test_malformed_number_is_reported_on_its_own_line(lit, value):
    e = _err(GOOD.replace("d: int = 32", f"d: int = {lit}"))
    assert e.msg == f"invalid number literal '{lit}'" and _loc(e) == (3, 14)
    assert ("write " + value) in e.hint if value else "write" not in e.hint
    # in a variant the typo would even parse (a = 6, then _4 = 3 as a second assignment): still reported
    e = _err(GOOD.replace("  forward(", f"  variant v {{ d = {lit} heads = 3 }}\n  forward("))
    assert e.msg == f"invalid number literal '{lit}'" and _loc(e) == (6, 19)
    dsl.parse(GOOD.replace("d: int = 32", "d: int = 32\n    e: float = 1e-6 + 1.5e+3 + 2. + 1E5 * 0"))


def test_capitalised_booleans_get_a_hint():
    text = GOOD.replace("heads: int = 2", "heads: int = 2\n    flag: bool = True")
    e = _err(text)
    assert e.msg == "unknown name 'True'" and _loc(e) == (5, 18) and "use true / false" in e.hint
    e = _err(text.replace("= True", "= true"), flag="True")          # an override (mtc ... --set flag=True)
    assert e.msg == "config field 'flag' is declared bool but its value is \"True\"" and "true / false" in e.hint
    assert dsl.parse(text.replace("= True", "= true"), flag="false") is not None


def _canonical_ir():
    from dsl.printer import print_graph
    from passes import PassManager
    return print_graph(PassManager().run(dsl.parse(STACK, file="m.mtc")))


def _ir_err(text) -> MtcError:
    with pytest.raises(MtcError) as ei:
        dsl.parse_ir(text, file="g.ir")
    return ei.value


@pytest.mark.parametrize("edit,msg", [
    (lambda s: s.replace("= rmsnorm(", "= rmsnrm("), "unknown op 'rmsnrm' (did you mean 'rmsnorm'?)"),
    (lambda s: re.sub(r"\((%\w+), (%\w+)\)", r"(\1, \2, \2)", s),
     "rmsnorm: takes 2 inputs (x and its parameter weight), got 3"),
    (lambda s: s.replace("(%", "(%nope, %", 1), "uses %nope, which is not defined before it"),
    (lambda s: s.replace("{eps =", "{epz =", 1), "op 'rmsnorm' has no attribute 'epz' (did you mean 'eps'?)"),
    (lambda s: s.replace("} : f32[B, T, 32]", "} : bf16[B, T, 32]", 1),
     "rmsnorm is typed bf16[B, T, 32] but its inputs give f32[B, T, 32]"),
])
def test_parse_ir_checks_nodes_at_the_ir_line(edit, msg):
    text = _canonical_ir()
    lines = text.splitlines()
    k = next(i for i, ln in enumerate(lines) if "= rmsnorm(" in ln)     # the first rmsnorm node
    lines[k] = edit(lines[k])
    e = _ir_err("\n".join(lines))
    assert e.loc.file == "g.ir" and (e.loc.line, e.loc.col) == (k + 1, 3), e.render()
    assert e.msg.startswith("%") and msg in e.msg, e.msg
    assert e.render().splitlines()[1] == f"  {k + 1} | {lines[k]}"            # the IR line, not the .mtc one
    assert dsl.parse_ir(text) is not None                                      # the unedited IR is fine


def test_parse_ir_type_and_return_errors_are_located():
    text = _canonical_ir()
    lines = text.splitlines()
    k = next(i for i, ln in enumerate(lines) if "= embedding(" in ln)
    col = lines[k].index(": f32[") + 3
    lines[k] = lines[k].replace(": f32[B, T, 32]", ": f32[B+, T, 32]")
    e = _ir_err("\n".join(lines))
    assert e.msg.startswith("cannot read the dimension 'B+'") and (e.loc.line, e.loc.col) == (k + 1, col)
    r = next(i for i, ln in enumerate(text.splitlines()) if ln.strip().startswith("return "))
    e = _ir_err(text.replace("return %", "return %zz, %"))
    assert e.msg == "return uses %zz, which is not defined" and (e.loc.line, e.loc.col) == (r + 1, 3)


def test_unused_forward_input_is_warned_about():
    from dsl.errors import MtcWarning
    text = ("model m {\n  forward(input_ids: i64[B, T], mask: f32[B, T]) {\n"
            "    x = embedding(input_ids, vocab=100, dim=32)\n    return lm_head(x, vocab=100)\n  }\n}\n")
    with pytest.warns(MtcWarning) as rec:
        dsl.parse(text, file="u.mtc")
    msgs = [str(r.message) for r in rec]
    assert msgs == ["u.mtc:2:33: warning: forward input 'mask' is never used (the model ignores it, but a caller "
                    "must still pass it)"]
