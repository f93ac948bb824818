"""A forward that cannot fit fails before any op runs, with the numbers; token ids outside the vocabulary are a
located error (issue 32, items 3 and 10); the runtime frees each buffer at its last use and reports the peak the
program's memory plan predicts (issue 33, item 3)."""
import pytest
import sympy
import torch

import dsl
from backends import memory
from dsl.errors import MtcError

pytestmark = pytest.mark.usefixtures("wide_moe_tiles")

B, T = (sympy.Symbol(s, integer=True, positive=True) for s in "BT")


@pytest.fixture(scope="module")
def tiny():
    return dsl.compile(dsl.load("models/kimi_k3.mtc", variant="tiny"), target="reference").eval()


@pytest.mark.parametrize("bad", [256, 1000, -1])
def test_out_of_vocabulary_id_is_a_located_error(tiny, bad):
    ids = torch.randint(0, 256, (2, 37))
    r, c = int(torch.randint(0, 2, ())), int(torch.randint(0, 37, ()))
    ids[r, c] = bad
    with tiny.tracing() as trace, pytest.raises(MtcError) as e:
        tiny(ids)
    msg = str(e.value)
    assert f"token id {bad} at index [{r}, {c}]" in msg and "[0, 256)" in msg
    assert e.value.loc is not None and e.value.loc.file.endswith("kimi_k3.mtc")
    assert isinstance(e.value, IndexError)          # as torch's own indexing raises
    assert trace == []
    ids[r, c] = 255
    assert tiny(ids).shape == (2, 37, 256)


def test_forward_that_cannot_fit_fails_before_any_op(tiny, monkeypatch):
    have = 100 << 20
    monkeypatch.setattr(memory, "available_bytes", lambda device: have)
    T_run = 20011

    def need(t):
        return memory.forward_bytes(tiny.program, tiny.graph, {B: 1, T: t}, torch.float32)[1]
    assert need(T_run) > have
    with torch.no_grad(), tiny.tracing() as trace, pytest.raises(MtcError) as e:
        tiny(torch.randint(0, 256, (1, T_run)))
    assert trace == []
    msg = str(e.value)
    assert "T = 20,011" in msg and "has 100 MiB free" in msg
    fit = int(msg.split("at most ")[1].split(" tokens")[0].replace(",", ""))
    assert need(fit) <= have < need(fit + 1)         # the length it names is the longest that fits


@pytest.fixture(scope="module")
def tiny_triton():
    return dsl.compile(dsl.load("models/kimi_k3.mtc", variant="tiny"), target="triton").eval()


@pytest.mark.parametrize("target,b,t", [("reference", 1, 100), ("reference", 2, 37), ("triton", 2, 37)])
def test_reported_peak_is_the_programs_plan_and_the_live_storages(request, target, b, t):
    # (target triton: fused launches, and views as outputs: the one-source phase 1 gives its accumulator as a
    # view of the source)
    tiny = request.getfixturevalue("tiny" if target == "reference" else "tiny_triton")
    with torch.no_grad(), tiny.tracing(values=True) as trace:
        tiny(torch.randint(0, 256, (b, t)))
    # independent: the storages the launches produced, each alive from its first output to its last read
    weights = {x.untyped_storage().data_ptr() for x in (*tiny.parameters(), *tiny.buffers())}
    ids = trace[0].args[0]                       # the graph input: alive from the start to its last read
    first, last, size = {}, {}, {}
    p = ids.untyped_storage().data_ptr()
    first[p], last[p], size[p] = 0, 0, b * t * 8
    for k, rec in enumerate(trace):
        for x in rec.args:
            p = x.untyped_storage().data_ptr()
            if p in first:
                last[p] = k
        for o in rec.outs:
            p = o.untyped_storage().data_ptr()
            if p not in weights and p not in first:
                first[p], last[p], size[p] = k, k, o.untyped_storage().nbytes()
    last[trace[-1].outs[0].untyped_storage().data_ptr()] = len(trace)
    want = max(sum(v for p, v in size.items() if first[p] <= k <= last[p]) for k in range(len(trace)))
    assert tiny.last_run.peak_bytes == want
    assert tiny.plan_memory(B=b, T=t)[0] == want
    # the buffers the runtime allocated are the plan's, byte for byte (views and reused storages: 0)
    elem = memory.elem_bytes(tiny.graph, torch.float32)
    for name, got in tiny.last_run.buffer_bytes.items():
        buf = tiny.program.buffers[name]
        planned = (int(sympy.Mul(*buf.type.shape).subs({B: b, T: t})) * elem(buf.type)
                   if tiny.program.storage_of(name) == name and not buf.weight_view else 0)
        assert got == planned, name


def test_small_forward_is_not_checked_against_free_memory(tiny, monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda device: pytest.fail("read free memory"))
    assert tiny(torch.randint(0, 256, (1, 19))).shape == (1, 19, 256)
