"""A spec is data (issue 32, items 1-3): no code runs from a spec, an IR text or the CLI's inputs; what is evaluated
is bounded (no hang on 9**9**9 or /dev/zero); bad values are located MtcErrors, never tracebacks."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import sympy

import dsl
from dsl.dim_expr import DimError
from dsl.errors import MtcError
from dsl.ir import dim, sym

ROOT = Path(__file__).resolve().parents[1]
TOY = ROOT / "tests" / "data" / "toy.mtc"

RESHAPE = """model m {
  forward(x: f32[B, T, 24]) {
    h = reshape(x, shape=SHAPE)
    return h
  }
}
"""


def _touch(marker: Path) -> str:
    """A Python expression that creates ``marker`` if anything evaluates it: no commas or brackets (it fits a
    free-text dimension token), no double quotes (it fits a spec string), and inside a lambda, whose body looks
    ``__import__`` up among the builtins even where the names of the text are bound to sympy Symbols."""
    return f"(lambda: __import__('pathlib').Path('{marker}').touch())()"


def _spec_err(text: str, file="spec.mtc") -> MtcError:
    with pytest.raises(MtcError) as ei:
        dsl.parse(text, file=file)
    return ei.value


def _ir_err(text: str) -> MtcError:
    with pytest.raises(MtcError) as ei:
        dsl.parse_ir(text, file="m.ir")
    return ei.value


def _toy_ir() -> str:
    return dsl.print_graph(dsl.parse(TOY.read_text(), file=str(TOY)))


def _line_of(text: str, needle: str) -> int:
    return next(i for i, ln in enumerate(text.splitlines(), 1) if needle in ln)


# -- 1. no code runs ----------------------------------------------------------------------------------------------
def test_a_shape_string_in_a_spec_is_not_evaluated(tmp_path):
    marker = tmp_path / "MARKER"
    e = _spec_err(RESHAPE.replace("SHAPE", f'["{_touch(marker)} + B", T, 8]'))
    assert not marker.exists()
    assert (e.loc.file, e.loc.line, e.loc.col) == ("spec.mtc", 3, 9)
    assert e.msg.startswith("reshape: shape must list integers and shape symbols") and "unexpected" in e.msg, e.msg


def test_a_dimension_in_ir_text_is_not_evaluated(tmp_path):
    marker = tmp_path / "MARKER"
    text = _toy_ir()
    bad = text.replace("i64[B, T]", f"i64[{_touch(marker)}, T]", 1)
    e = _ir_err(bad)
    assert not marker.exists()
    assert e.loc.file == "m.ir" and e.loc.line == _line_of(bad, "pathlib") and e.msg.startswith(
        "cannot read the dimension '(lambda: __import__(") and "unexpected" in e.msg, e.render()


def test_the_python_api_does_not_evaluate_a_dimension_string(tmp_path):
    marker = tmp_path / "MARKER"
    with pytest.raises(DimError):
        dim(_touch(marker) + " + B")
    b = dsl.GraphBuilder("g")
    with pytest.raises(ValueError):
        b.input("x", "f32", [_touch(marker), 4])
    assert not marker.exists()


def test_the_cli_does_not_run_code_in_a_spec(tmp_path):
    marker = tmp_path / "MARKER"
    spec = tmp_path / "evil.mtc"
    spec.write_text(RESHAPE.replace("SHAPE", f'["{_touch(marker)} + B", T, 8]'))
    r = subprocess.run([sys.executable, "-m", "dsl.cli", "stats", str(spec)], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert not marker.exists()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"{spec}:3:9: error: reshape: shape must list integers and shape symbols" in r.stderr, r.stderr


#: the one exec in the package: backends/triton/codegen.py runs the Triton source it generated itself from the
#: kernel IR (op names from the registry, numbers it formats, never text from a spec; it is compared byte for byte
#: with what sits in the kernel cache, which is rewritten where it differs)
_GENERATED_SOURCE_EXEC = ("backends/triton/codegen.py", "exec")


def test_mtc_has_no_eval_like_call():
    """No sympify / parse_expr / eval / exec / pickle load, and no torch.load without weights_only=True, in the
    package's code (docstrings may name them; user-facing torch.load of a whole module is the user's own call);
    the generated kernels' exec is the only exception (_GENERATED_SOURCE_EXEC), and there exactly once."""
    bad, generated = [], 0
    for sub in ("dsl", "passes", "backends"):
        for p in sorted((ROOT / sub).rglob("*.py")):
            for node in ast.walk(ast.parse(p.read_text(), str(p))):
                if not isinstance(node, ast.Call):
                    continue
                f = node.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
                owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
                unsafe = name in ("sympify", "parse_expr", "S") and owner in ("sympy", "") \
                    or (name in ("eval", "exec") and isinstance(f, ast.Name)) \
                    or (owner in ("pickle", "marshal", "dill") and name in ("load", "loads")) \
                    or (owner == "torch" and name == "load" and not any(
                        k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                        for k in node.keywords))
                if unsafe and (str(p.relative_to(ROOT)), name) == _GENERATED_SOURCE_EXEC:
                    generated += 1
                elif unsafe:
                    bad.append(f"{p.relative_to(ROOT)}:{node.lineno}: {owner + '.' if owner else ''}{name}")
    assert not bad, bad
    assert generated == 1


# -- 2. bounded: no hang --------------------------------------------------------------------------------------------
_HANG_PROBES = r"""
import contextlib, io, json, os, sys, warnings
warnings.simplefilter("ignore")
import dsl
from dsl.cli import main
out = {}
toy = open(sys.argv[1]).read()
def probe(name, fn):
    try:
        fn()
        out[name] = ["ok"]
    except dsl.MtcError as e:
        out[name] = ["MtcError", e.msg, [e.loc.line, e.loc.col] if e.loc else None]
def cli(*args):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(list(args))
    return [rc, err.getvalue()]
probe("config", lambda: dsl.parse(toy.replace("d: int = 32", "d: int = 9 ** 9 ** 9")))
probe("shape", lambda: dsl.parse(sys.argv[2].replace("SHAPE", '["9**9**9", T, 24]')))
ir = dsl.print_graph(dsl.parse(toy))
probe("ir", lambda: dsl.parse_ir(ir.replace("i64[B, T]", "i64[9**9**9, T]", 1)))
probe("ir_symbolic", lambda: dsl.parse_ir(ir.replace("i64[B, T]", "i64[B**(9**9), T]", 1)))
os.mkfifo(sys.argv[3])
for f in ("/dev/zero", "/dev/urandom", sys.argv[3]):
    out[f] = cli("stats", f)
print(json.dumps(out))
"""


def test_huge_powers_and_endless_files_are_refused_at_once(tmp_path):
    fifo = tmp_path / "fifo.mtc"
    r = subprocess.run([sys.executable, "-c", _HANG_PROBES, str(TOY), RESHAPE, str(fifo)], capture_output=True,
                       text=True, cwd=ROOT, timeout=90, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["config"] == ["MtcError", "9**387420489 passes 2**63: config integers are int64", [6, 14]], out
    assert out["shape"][0] == "MtcError" and out["shape"][1].endswith(
        "got [9**9**9, T, 24]: 9**387420489 passes 2**63 (sizes are int64)") and out["shape"][2] == [3, 9], out
    ir_line = _line_of(_toy_ir(), "i64[B, T]")
    assert out["ir"] == ["MtcError", "cannot read the dimension '9**9**9': 9**387420489 passes 2**63 (sizes are int64)",
                         [ir_line, out["ir"][2][1]]], out
    assert out["ir_symbolic"][1] == ("cannot read the dimension 'B**(9**9)': the exponent 387420489 of B is past 62: "
                                     "the size passes 2**63"), out
    for f, kind in (("/dev/zero", "a character device"), ("/dev/urandom", "a character device"),
                    (str(fifo), "a pipe")):
        rc, err = out[f]
        assert rc == 2 and err.strip() == f"mtc: error: cannot read spec '{f}': it is {kind}, not a regular file", \
            (f, err)


def test_a_spec_file_over_the_size_limit_is_refused_unread(tmp_path):
    from dsl.spec import MAX_SPEC_BYTES
    p = tmp_path / "big.mtc"
    with open(p, "wb") as fh:
        fh.truncate(MAX_SPEC_BYTES + 1)              # sparse: nothing to write, nothing read
    with pytest.raises(MtcError) as ei:
        dsl.load(p)
    assert ei.value.msg == f"spec '{p}' is {MAX_SPEC_BYTES + 1:,} bytes, more than the limit of 16 MiB for a spec"
    with pytest.raises(MtcError) as ei:
        dsl.load(tmp_path)
    assert ei.value.msg == f"cannot read spec '{tmp_path}': it is a directory, not a regular file"


def test_a_spec_that_is_not_utf8_is_located_at_the_first_bad_byte(tmp_path):
    p = tmp_path / "latin1.mtc"
    p.write_bytes(TOY.read_bytes().replace(b"d: int = 32", b"d: int = 32 # caf\xe9"))
    with pytest.raises(MtcError) as ei:
        dsl.load(p)
    e = ei.value
    line = _line_of(TOY.read_text(), "d: int = 32")
    assert e.msg.startswith(f"spec '{p}' is not UTF-8 text (byte ") and (e.loc.line, e.loc.col) == (line, 22)
    assert "^" in e.render() and "caf\ufffd" in e.render()


@pytest.mark.parametrize("expr,msg", [
    ("2 ** 62 * 2", "'*': the result passes 2**63 (config integers are int64)"),
    ("(-3) ** 40", "'**': the result passes 2**63 (config integers are int64)"),    # computed: 3**40 < 2**64
    ("(-3) ** 80", "(-3)**80 passes 2**63: config integers are int64"),             # refused before it is
    ("9 ** 9 ** 9 ** 9", "9**387420489 passes 2**63: config integers are int64"),
    ("10.0 ** 400", "'**': the result is too large for a float"),
    ("(-8.0) ** 0.5", "'**': the result is not a real number (-8.0 to a fractional power)"),
    ("0 ** -1", "division by zero (0 to a negative power)"),
    ("9" * 4001, "integer literal of 4001 digits is too large"),
])
def test_config_arithmetic_is_bounded(expr, msg):
    e = _spec_err(TOY.read_text().replace("d: int = 32", f"d: int = {expr}"))
    assert e.msg == msg and e.loc.line == 6, (e.msg, e.loc)


def test_string_doubling_is_bounded():
    fields = "\n".join(f"    s{i + 1}: str = s{i} + s{i}" for i in range(40))
    e = _spec_err(TOY.read_text().replace("d: int = 32", f'd: int = 32\n    s0: str = "abcdefgh"\n{fields}'))
    assert e.msg == "'+' would make a string of 131072 characters, more than the limit of 65536" and e.loc.line == 21


# -- 3. errors, not tracebacks --------------------------------------------------------------------------------------
@pytest.mark.parametrize("expr,msg,col", [
    ("min(8)", "min(a, b, ...) takes two or more numbers, got 1 argument", 14),
    ("max(8)", "max(a, b, ...) takes two or more numbers, got 1 argument", 14),
    ('max(8, "a")', 'max(a, b, ...) takes numbers, got "a"', 21),
    ('min(8, 9) if "a" < 3 else 2', '\'<\' compares two numbers or two strings, got "a" < 3', 33),
    ("32 if [1] < [2] else 2", "'<' compares two numbers or two strings, got [1] < [2]", 20),
])
def test_bad_config_calls_and_comparisons_are_located_errors(expr, msg, col):
    e = _spec_err(TOY.read_text().replace("d: int = 32", f"d: int = {expr}"))
    assert (e.msg, e.loc.line, e.loc.col) == (msg, 6, col)


def test_power_parses_in_specs():
    text = TOY.read_text().replace("d: int = 32", "d: int = 2 ** 5\n    p: float = 2 ** -1 + 3 ** 2 ** 2 - -2 ** 2")
    cfg = dict(dsl.parse(text).meta_get("config"))
    assert cfg["d"] == 32 and cfg["p"] == 0.5 + 81 + 4


def test_deeply_nested_ir_attributes_are_a_located_error():
    text = _toy_ir()
    bad = text.replace('std = 0.02', "std = " + "[" * 3000 + "]" * 3000, 1)
    e = _ir_err(bad)
    line = _line_of(bad, "[[[")
    assert e.msg == "brackets nested more than 64 deep" and e.loc.line == line, e.render()
    # at the '[' that is the 65th open bracket: the graph's '{', the attribute list's '{', then 63 '['
    assert e.loc.col == bad.splitlines()[line - 1].index("[[[") + 63


@pytest.mark.parametrize("d,msg", [
    ("~B", "unexpected character '~'"), ("B<T", "unexpected character '<'"), ("B&T", "unexpected character '&'"),
    ("B|T", "unexpected character '|'"), ("B+", "unexpected ','"), ("Eq(B, T)", "unknown function 'Eq'"),
    ("min(B)", "min(...) takes 2 or more arguments, got 1"), ("B//0", "division by zero in a dimension"),
    ("99999999999999999999", "the dimension 99999999999999999999 passes 2**63 (sizes are int64)"),
    ("B**T", "an exponent must be an integer constant (B**2), got T"),
])
def test_an_ir_dimension_outside_the_grammar_is_a_located_error(d, msg):
    text = _toy_ir()
    bad = text.replace("i64[B, T]", f"i64[{d}, T]", 1)
    e = _ir_err(bad)
    assert e.msg.startswith(f"cannot read the dimension '{d}': {msg}"), e.msg
    assert e.loc.line == _line_of(bad, f"i64[{d}, T]")


def test_ir_integers_past_what_int_reads_are_located_errors():
    text = _toy_ir()
    for old, new in (("std = 0.02", "std = " + "7" * 5000), ("%p0)", "%p0#" + "7" * 5000 + ")")):
        bad = text.replace(old, new, 1)
        e = _ir_err(bad)
        assert e.msg == "integer of 5000 digits is too large" and e.loc.line == _line_of(bad, "7777"), e.msg


# -- the dimension grammar reads back what the printer writes --------------------------------------------------------
def test_every_printed_form_of_a_dimension_reads_back():
    B, T = sym("B"), sym("T")
    forms = [B * T, 2 * B - 1, -B + T, B**2, sympy.floor(B / 2), sympy.ceiling(T / 3), sympy.Mod(B, 3),
             sympy.Max(B, T), sympy.Min(B, 64), 3 * B / 2, (B + 1)**2, T * sympy.floor((B + 1) / 2), 1 / B, B**-2,
             sympy.Max(B, sympy.floor(T / 2)) * 7]
    for f in forms:
        assert dim(str(f)) == f and dim(str(f).replace(" ", "")) == f, f
    assert dim("T // 2") == sympy.floor(T / 2) and dim("B % 5") == sympy.Mod(B, 5) and dim("min(T, 4096)") == \
        sympy.Min(T, 4096) and dim("2 ** 3 ** 2 * B") == 512 * B


def test_floor_division_in_ir_types_is_not_a_comment():
    g = dsl.parse_ir('graph g(B, T) {\n  %x = input {name = "x"} : f32[B // 2, T % 3, 8]  // a comment\n'
                     '  return %x\n}\n')
    assert str(g.nodes[0].type) == "f32[floor(B/2), Mod(T,3), 8]"


@pytest.mark.parametrize("path,variant", [("models/kimi_k3.mtc", "tiny"), ("models/kimi_k3.mtc", "small"),
                                          ("examples/hybrid_tiny.mtc", None)])
def test_every_printed_stage_round_trips(path, variant):
    from passes.manager import PassManager
    pm = PassManager(keep_stages=True)
    pm.run(dsl.load(ROOT / path, variant=variant))
    stages = {k: g for k, g in pm.stages.items() if isinstance(g, dsl.Graph)}
    assert set(stages) == {"graph", "typed", "canonical", "fused"}
    for name, g in stages.items():
        text = dsl.print_graph(g)
        back = dsl.parse_ir(text, file=f"{name}.ir")
        assert back == g and dsl.print_graph(back) == text, name


# -- found by the long fuzz run (benchmarks/fuzz_spec_ir.py) ---------------------------------------------------------
def test_a_forward_input_dim_of_thousands_of_digits_is_a_located_error():
    text = TOY.read_text().replace("i64[B, T]", "i64[" + "9" * 5000 + ", T]")
    e = _spec_err(text)
    assert e.msg == f"input 'input_ids': dimension {'9' * 20}... (5000 digits) must be between 1 and 2147483647"
    assert (e.loc.line, e.loc.col) == (_line_of(text, "i64[999"), 26)
    g = dsl.parse(TOY.read_text().replace("i64[B, T]", "i64[" + "0" * 4999 + "1, T]"))   # 1, leading zeros
    assert str(g.nodes[0].type) == "i64[1, T]"


def test_a_long_shape_symbol_name_is_a_symbol_not_a_text_to_parse():
    name = "T" + "x" * 5000
    g = dsl.parse(TOY.read_text().replace("i64[B, T]", f"i64[B, {name}]"), file="spec.mtc")
    assert g.symbols == ("B", name) and g.nodes[0].type.shape == (sym("B"), sym(name))
