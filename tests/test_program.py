"""The kernel program is what runs (issue 33, item 2): the launches the runtime makes, recorded by a trace hook,
equal the printed `--stage lowered` listing (implementation, input and output buffers, in order), for tiny K3 and
examples/hybrid_tiny.mtc on every target, without autograd and while it records; and the backend functions the
listing names are the ones called, as often as it names them."""
import re
from pathlib import Path

import pytest
import torch

import backends.reference as R
import backends.triton as T
import dsl
from backends.registry import by_name

pytestmark = pytest.mark.usefixtures("wide_moe_tiles")

ROOT = Path(__file__).resolve().parent.parent
SPECS = [(ROOT / "models" / "kimi_k3.mtc", "tiny"), (ROOT / "examples" / "hybrid_tiny.mtc", None)]
_LINE = re.compile(r"^\s*k(\d+) = (\S+)(?: grid \[[^\]]*\])?(?: meta \{[^}]*\})? \(([^)]*)\) -> \((.*)\)(?:  //.*)?$")


def parse_listing(text: str) -> list[tuple[int, str, list[str], list[str]]]:
    """(index, implementation, input buffers, output buffers) of every launch line of a printed program."""
    out = []
    for ln in text.splitlines():
        m = _LINE.match(ln)
        if m:
            ins = [x.strip() for x in m.group(3).split(",") if x.strip()]
            outs = [x.split(":")[0].strip() for x in re.split(r",\s*(?=%)", m.group(4)) if x.strip()]
            out.append((int(m.group(1)), m.group(2), ins, outs))
    return out


def _check(m, trace, text):
    listed = parse_listing(text)
    assert listed and len(listed) == text.count("\n  k")     # every launch line parsed
    ran = [(t.index, t.kernel, t.inputs, t.outputs) for t in trace]
    assert ran == listed
    for t in trace:                      # what ran is what the name says: the registered impl, or the generated fn
        if t.kernel.startswith("generated."):
            assert t.impl.fn.__name__ == t.kernel.split(".", 1)[1]
        else:
            assert t.impl is by_name(t.kernel)


@pytest.mark.parametrize("target", ["reference", "triton", "tvm"])
@pytest.mark.parametrize("spec,variant", SPECS, ids=["tiny", "hybrid_tiny"])
def test_launches_equal_the_printed_listing(spec, variant, target, monkeypatch):
    if target == "tvm":
        pytest.importorskip("tvm")
    m = dsl.compile(dsl.load(spec, variant), target=target, seed=3).eval()
    ids = torch.randint(0, 200, (1, 13))
    calls = {"triton.kda_chunk": 0, "triton.moe_experts": 0, "reference.rmsnorm": 0}
    for mod, name, key in ((T, "kda_chunk", "triton.kda_chunk"), (T, "moe_experts", "triton.moe_experts"),
                           (R, "rmsnorm", "reference.rmsnorm")):
        fn = getattr(mod, name)
        monkeypatch.setattr(mod, name, (lambda f, k: lambda *a, **kw: calls.__setitem__(k, calls[k] + 1) or
                                        f(*a, **kw))(fn, key))
    with torch.no_grad(), m.tracing() as trace:
        m(ids)
    text = m.ir("lowered")
    _check(m, trace, text)
    listed = [k for _i, k, _a, _b in parse_listing(text)]
    for key, n in calls.items():
        assert n == listed.count(key), key
    if target != "reference" and variant == "tiny":
        return                           # (the training program on the kernel targets: checked on hybrid_tiny)
    # while autograd records, the forward runs the training program, also as printed
    with m.tracing() as trace:
        m(ids)
    _check(m, trace, m.ir("lowered", training=True))
    if target == "triton":
        fused = {k for k in listed if "+" in k or k.startswith("generated.") or k == "triton.conv_silu_norm"}
        assert fused and not fused & {t.kernel for t in trace}     # the forward-only fusions step aside
