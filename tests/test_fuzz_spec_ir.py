"""Fuzzing the two text front ends (issue 32): mutants of a real spec (tests/data/toy.mtc) and of its printed graph
IR (character insertions and deletions, token swaps, digit changes, operator and bracket insertions) each end as a
parsed graph or as an MtcError located at a line of the text, never another exception and never a hang (a
per-example time limit).

CI runs a fixed, derandomised budget (a few seconds). A longer run, outside CI:
    MTC_FUZZ_EXAMPLES=5000 python -m pytest tests/test_fuzz_spec_ir.py          (the same property, more examples)
    python benchmarks/fuzz_spec_ir.py --mutants 5000                            (counts by outcome)
"""
from __future__ import annotations

import os
import re
import signal
import warnings
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import dsl
from dsl.errors import MtcError

ROOT = Path(__file__).resolve().parents[1]
SEED_SPEC = ROOT / "tests" / "data" / "toy.mtc"

#: seconds one mutant may take before it counts as a hang (the slowest legitimate mutant, a 4096-layer stack, would
#: take ~15 s: the digit changes never write a layer count that large)
TIME_LIMIT = 10.0

#: what an insertion puts into the text: single characters of every class, operators, brackets, keywords,
#: oversized and degenerate numbers, the code-execution and boolean-dimension probes of issue 32
SNIPPETS = list("0123456789+-*/%<>=!~&|^()[]{},:\"'#.\n\t @\\_?aZ;") + [
    "**", "//", "**9**9", "9**9**9", " ** 2", "//0", "%0", "/0", "**-1", "** 0.5", " if true else ", " and ", " or ",
    " not ", "min(", "max(8)", "min(1, 2)", "[[[[[[[[", "]]]]", "((((((((", "))))", "{{{{", "}}", "\u00e9", "\x00",
    "\ufeff", "\u2028", "1e999", "1e-999", "99999999999999999999999", "9" * 5000, "-", "%x", "%0#7", "?", "inf",
    "-inf", "nan", "none", "true", "false", "__import__('os')", "B", "T", "B*T", "~B", "B<T", "B&T", "Max(B, T)",
    "floor(T/2)", "Mod(B, 0)", "stack(", "return ", "graph ", "model ", "config ", "variant ", "block ", "forward(",
    '"x"', '"', "@\"f\":1:1", "= ", ": f32[B, T]", "i64", "f32", "x", "reshape(x, shape=[B*T, 8])",
    '"B*T"', "[" * 300, "(" * 300, "-" * 300, "+B" * 200, "2 ** 3", '"a" < 3', "d < \"x\"", "[1, [2, [3]]]",
    '"9**9**9"', '"__import__(\'os\')"', "B**B", "B**99", "T // 0", "-B", "0", "1.5", "-3",
]
#: what a digit change writes in place of a number
NUMBERS = ["0", "1", "-1", "7", "00", "2147483648", str(2**63), str(2**64 + 3), "9" * 40, "1.5", "1e2", "0x10",
           "6_4", "3k", "1.2.3", "-0"]
KINDS = ("insert", "delete", "swap", "digits", "dup", "char", "tok_insert", "tok_replace", "dim")

_TOKEN = re.compile(r'"[^"\n]*"|[A-Za-z_][A-Za-z0-9_.]*|\d+(?:\.\d+)?|\*\*|//|\S')
_DIGITS = re.compile(r"\d+")
#: a type's or a shape's [...]: IR types (f32[B, T, 32]), spec inputs (i64[B, T]) and shape lists (shape=[B, T])
_BRACKETS = re.compile(r"(?<=[\w=]\[)[^\]\[\n]*(?=\])")


def _dims(text: str) -> list:
    """The spans of the entries of every type / shape bracket of ``text``."""
    out = []
    for m in _BRACKETS.finditer(text):
        pos = m.start()
        for part in m.group().split(","):
            lead = len(part) - len(part.lstrip())
            out.append((pos + lead, pos + len(part.rstrip())))
            pos += len(part) + 1
    return out


def mutate(text: str, ops) -> str:
    """``text`` with the mutations ``ops`` applied in turn: each a (kind, a, b) with a, b non-negative ints that
    pick positions and snippets (reduced modulo the lengths), so that any ints give a valid mutation."""
    for kind, a, b in ops:
        n = max(len(text), 1)
        if kind == "insert":
            p = a % (n + 1)
            text = text[:p] + SNIPPETS[b % len(SNIPPETS)] + text[p:]
        elif kind == "delete":
            p = a % n
            text = text[:p] + text[p + 1 + b % 12:]
        elif kind == "char":
            p = a % n
            text = text[:p] + SNIPPETS[b % len(SNIPPETS)][:1] + text[p + 1:]
        elif kind == "swap":
            toks = [m.span() for m in _TOKEN.finditer(text)]
            if len(toks) >= 2:
                (i0, i1), (j0, j1) = sorted((toks[a % len(toks)], toks[b % len(toks)]))
                if i1 <= j0:
                    text = text[:i0] + text[j0:j1] + text[i1:j0] + text[i0:i1] + text[j1:]
        elif kind == "digits":
            runs = [m.span() for m in _DIGITS.finditer(text)]
            if runs:
                s, e = runs[a % len(runs)]
                text = text[:s] + NUMBERS[b % len(NUMBERS)] + text[e:]
        elif kind in ("tok_insert", "tok_replace"):
            toks = [m.span() for m in _TOKEN.finditer(text)]
            if toks:
                s, e = toks[a % len(toks)]
                text = text[:s] + SNIPPETS[b % len(SNIPPETS)] + text[s if kind == "tok_insert" else e:]
        elif kind == "dim":
            dims = _dims(text)
            if dims:
                s, e = dims[a % len(dims)]
                text = text[:s] + SNIPPETS[b % len(SNIPPETS)] + text[e:]
        elif kind == "dup":
            lines = text.split("\n")
            k = a % len(lines)
            lines.insert(b % (len(lines) + 1), lines[k])
            text = "\n".join(lines)
    return text


@lru_cache(maxsize=1)
def seeds() -> dict:
    """The two texts mutated: the toy spec and its printed graph IR (the 'graph' stage, with source locations)."""
    spec = SEED_SPEC.read_text()
    return {"spec": spec, "ir": dsl.print_graph(dsl.parse(spec, file=str(SEED_SPEC)))}


class _Timeout(Exception):
    pass


@contextmanager
def time_limit(seconds: float):
    """Raise _Timeout in the main thread when the block runs past ``seconds`` (SIGALRM; a no-op where there is
    no SIGALRM)."""
    if not hasattr(signal, "setitimer"):
        yield
        return

    def on_alarm(*_):
        raise _Timeout()
    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def outcome(kind: str, text: str) -> tuple[str, str]:
    """(outcome, detail) of parsing ``text`` as a spec (kind "spec") or as graph IR (kind "ir"): "parsed",
    "located" (an MtcError whose Loc has a line, and which renders), "unlocated" (an MtcError without one),
    "timeout", or "other" (any other exception; detail: its type and message)."""
    try:
        with time_limit(TIME_LIMIT), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if kind == "spec":
                dsl.parse(text, file="fuzz.mtc")
            else:
                dsl.parse_ir(text, file="fuzz.ir")
    except _Timeout:
        return "timeout", ""
    except MtcError as e:
        try:
            with time_limit(TIME_LIMIT):
                e.render()
        except _Timeout:
            return "timeout", "render: " + e.msg[:200]
        except Exception as r:                              # noqa: BLE001 - rendering must not fail either
            return "other", f"render: {type(r).__name__}: {r}"[:300]
        if e.loc is None or not isinstance(e.loc.line, int) or e.loc.line < 1:
            return "unlocated", e.msg[:300]
        return "located", ""
    except RecursionError as e:
        return "other", f"RecursionError: {e}"[:300]
    except Exception as e:                                  # noqa: BLE001 - the point: no other exception
        return "other", f"{type(e).__name__}: {e}"[:300]
    return "parsed", ""


_N = int(os.environ.get("MTC_FUZZ_EXAMPLES", "0")) or None
_OPS = st.lists(st.tuples(st.sampled_from(KINDS), st.integers(0, 2**20), st.integers(0, 2**20)), min_size=1,
                max_size=4)
_SETTINGS = dict(derandomize=_N is None, database=None, deadline=None,
                 suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize("kind,examples", [("spec", 200), ("ir", 120)])
def test_mutants_parse_or_give_a_located_error(kind, examples):
    seed = seeds()[kind]
    assert outcome(kind, seed) == ("parsed", "")            # the unmutated text parses

    @settings(max_examples=_N or examples, **_SETTINGS)
    @given(_OPS)
    def check(ops):
        text = mutate(seed, ops)
        got = outcome(kind, text)
        assert got[0] in ("parsed", "located"), (got, ops)
    check()
