"""A forward that cannot fit fails before any op runs, with the numbers; token ids outside the vocabulary are a
located error (issue 32, items 3 and 10)."""
import pytest
import sympy
import torch

import dsl
from backends import memory
from dsl.errors import MtcError

B, T = (sympy.Symbol(s, integer=True, positive=True) for s in "BT")


@pytest.fixture(scope="module")
def tiny():
    return dsl.compile(dsl.load("models/kimi_k3.mtc", variant="tiny"), target="reference").eval()


def _count_ops(m, monkeypatch):
    calls = []
    orig = m._exec
    monkeypatch.setattr(m, "_exec", lambda *a: calls.append(a[0].op) or orig(*a))
    return calls


@pytest.mark.parametrize("bad", [256, 1000, -1])
def test_out_of_vocabulary_id_is_a_located_error(tiny, monkeypatch, bad):
    ids = torch.randint(0, 256, (2, 37))
    r, c = int(torch.randint(0, 2, ())), int(torch.randint(0, 37, ()))
    ids[r, c] = bad
    calls = _count_ops(tiny, monkeypatch)
    with pytest.raises(MtcError) as e:
        tiny(ids)
    msg = str(e.value)
    assert f"token id {bad} at index [{r}, {c}]" in msg and "[0, 256)" in msg
    assert e.value.loc is not None and e.value.loc.file.endswith("kimi_k3.mtc")
    assert isinstance(e.value, IndexError)          # as torch's own indexing raises
    assert calls == []
    ids[r, c] = 255
    assert tiny(ids).shape == (2, 37, 256)


def test_forward_that_cannot_fit_fails_before_any_op(tiny, monkeypatch):
    have = 1 << 30
    monkeypatch.setattr(memory, "available_bytes", lambda device: have)
    T_run = 20011
    need = memory.forward_bytes(tiny.graph, {B: 1, T: T_run}, torch.float32, "reference")
    assert need > have
    calls = _count_ops(tiny, monkeypatch)
    with torch.no_grad(), pytest.raises(MtcError) as e:
        tiny(torch.randint(0, 256, (1, T_run)))
    assert calls == []
    msg = str(e.value)
    assert "T = 20,011" in msg and "has 1 GiB free" in msg
    fit = int(msg.split("at most ")[1].split(" tokens")[0].replace(",", ""))
    # the length it names is the longest that fits
    assert memory.forward_bytes(tiny.graph, {B: 1, T: fit}, torch.float32, "reference") <= have
    assert memory.forward_bytes(tiny.graph, {B: 1, T: fit + 1}, torch.float32, "reference") > have


def test_forward_bytes_counts_every_kept_value(tiny):
    # independent count: every op output of the executed graph (views excluded) at B, T, in float32 / int64
    b, t = 3, 101
    want = 0
    for n in tiny.graph.nodes:
        if n.op in ("input", "param", "buffer", "const", "reshape", "slice", "broadcast"):
            continue
        for ty in n.types:
            numel = 1
            for d in ty.shape:
                numel *= int(d.subs({B: b, T: t}))
            want += numel * (8 if ty.dtype == "i64" else 4)
    heads = [int(n.types[0].shape[2].subs({B: b, T: t})) for n in tiny.graph.nodes if n.op == "mla_attention"]
    want += 3 * b * max(heads) * t * t * 4
    assert memory.forward_bytes(tiny.graph, {B: b, T: t}, torch.float32, "reference") == want


def test_small_forward_is_not_checked_against_free_memory(tiny, monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda device: pytest.fail("read free memory"))
    assert tiny(torch.randint(0, 256, (1, 19))).shape == (1, 19, 256)
