"""In-place reuse (issue 33, item 2): the program that runs without autograd writes an output into the storage of an
input whose last use that launch is, where the implementation can and it is safe; the results are the same bits as
with every output in its own storage, the runtime's measured peak is the plan's, and the training program never
reuses."""
from pathlib import Path

import pytest
import torch

import dsl

pytestmark = pytest.mark.usefixtures("wide_moe_tiles")

ROOT = Path(__file__).resolve().parent.parent
SPECS = [(ROOT / "models" / "kimi_k3.mtc", "tiny"), (ROOT / "examples" / "hybrid_tiny.mtc", None)]

SMALL = """model m {
  forward(x: f32[B, T, 8]) {
    a = silu(x)
    v = reshape(a, shape=[B, T, 2, 4])
    b = sigmoid(a)
    c = silu(v)
    s = slice(b, dim=-1, start=0, end=4)
    e = sigmoid(s)
    d = mul(b, reshape(c, shape=[B, T, 8]))
    f = silu(e)
    return d, add(f, f), add(d, d)
  }
}
"""


def _launch(program, out):
    return next(L for L in program.launches if any(r == out for r, _t in L.outputs))


def test_reuse_takes_only_dead_values_of_the_program():
    m = dsl.compile(dsl.parse(SMALL), target="reference").eval()
    p = m.program
    took = {r: L.inputs[i][0] for L in p.launches for j, i in L.inplace.items() for r in [L.outputs[j][0]]}
    # %3 = silu(%1): %1 is a reshape of %0, dead once %2 = sigmoid(%0) has read it; %7 = mul(%2, %6): %2's slice
    # %4 died at %5; %8 = silu(%5). Not taken: the graph input %x, %0 while its view %1 lives, the slice %4 (a
    # strided view), an operand passed twice (%9 = add(%8, %8)), a graph output (%10 = add(%7, %7))
    assert took == {"%3": "%1", "%7": "%2", "%8": "%5"}
    assert p.storage_of("%7") == "%2" and p.storage_of("%6") == p.storage_of("%3") == "%0"
    assert "(%3: f32[B, T, 2, 4] in place of %1)" in m.ir("lowered")
    assert m.train_program.inplace_count() == 0 and "] in place of" not in m.ir("lowered", training=True)
    x = torch.randn(2, 5, 8)
    keep = x.clone()
    with torch.no_grad():
        d, ff, dd = m.run(x=x)
    assert torch.equal(x, keep)                   # the caller's tensor is never written
    a = torch.nn.functional.silu(x.double())
    b = torch.sigmoid(a)
    want = b * torch.nn.functional.silu(a)
    f = torch.nn.functional.silu(torch.sigmoid(b[..., :4]))
    for got, ref in ((d, want), (ff, 2 * f), (dd, 2 * want)):
        torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=1e-6)
    assert m.last_run.inplace == p.inplace_count() == len(took)
    assert m.last_run.peak_bytes == m.plan_memory(B=2, T=5)[0]


@pytest.mark.parametrize("target", ["reference", "triton"])
@pytest.mark.parametrize("spec,variant", SPECS, ids=["tiny", "hybrid_tiny"])
def test_reuse_changes_no_bit_and_the_peak_is_the_plan(spec, variant, target):
    g = dsl.load(spec, variant)
    on, off = (dsl.compile(g, target=target, seed=4, inplace=flag).eval() for flag in (True, False))
    assert on.program.inplace_count() > 0 and off.program.inplace_count() == 0
    assert on.train_program.inplace_count() == 0
    B, T = (2, 37) if target == "reference" else (1, 19)       # (the Triton interpreter is slow)
    ids = torch.randint(0, 256, (B, T))
    with torch.no_grad():
        got, want = on(ids), off(ids)
    assert torch.equal(got, want)
    for m in (on, off):
        assert m.last_run.inplace == m.program.inplace_count()
        assert m.last_run.peak_bytes == m.plan_memory(B=B, T=T)[0]
    assert on.last_run.peak_bytes <= off.last_run.peak_bytes
    # every reused buffer is a dead value of the program: defined by a launch, read last by the one that takes it
    for L in on.program.launches:
        for j, i in L.inplace.items():
            b = on.program.buffers[L.inputs[i][0]]
            assert b.first >= 0 and b.last == L.index and on.program.buffers[L.outputs[j][0]].reuses == b.name


def test_inplace_option_is_checked():
    with pytest.raises(dsl.MtcError, match="inplace must be True or False, got 'no'"):
        dsl.compile(dsl.parse(SMALL), inplace="no")


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 1000, 4097])
@pytest.mark.parametrize("spec,variant", SPECS, ids=["tiny", "hybrid_tiny"])
def test_gpu_reuse_changes_no_bit(spec, variant, T):
    # (the generated kernels in place on the GPU: each program reads its rows before writing them, also where a tile
    # is smaller than the threads of a program, T = 1)
    g = dsl.load(spec, variant, d=512) if variant == "tiny" else dsl.load(spec, variant)
    on, off = (dsl.compile(g, target="triton", dtype=torch.bfloat16, device="cuda", seed=4, inplace=flag).eval()
               for flag in (True, False))
    ids = torch.randint(0, 256, (2, T), device="cuda")
    with torch.no_grad():
        got, want = on(ids), off(ids)
    assert torch.equal(got, want)
    assert on.last_run.inplace == on.program.inplace_count() > 0
    assert on.last_run.peak_bytes == on.plan_memory(B=2, T=T)[0] <= off.last_run.peak_bytes
