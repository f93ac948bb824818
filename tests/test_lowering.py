"""fuse_tiles + lowering + codegen: the fusion groups, the kernel IR (golden), the cache key, generated
pointwise kernels against the reference, and `mtc ir --stage lowered` for the full model."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import dsl
from backends import reference as R
from dsl.builder import GraphBuilder
from passes import PassManager
from passes.lower import lower
from dsl.ir import Ref

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).parent / "data"
GOLDEN = Path(__file__).parent / "golden"


def _generated(m):
    """(GeneratedKernel, jit function) of each generated launch of a compiled module's program."""
    return [(L.generated, getattr(m._generated, L.generated.name)) for L in m.program.launches if L.generated]


def _fused(path, variant=None, **kw):
    return PassManager().run(dsl.load(path, variant, **kw))


def test_kda_group_absorbs_its_prologue_and_epilogue():
    g = _fused(ROOT / "models" / "kimi_k3.mtc", "tiny")
    anchor = next(n for n in g.nodes if n.op == "kda_chunk")
    group = [n.op for n in g.nodes if n.attr("fusion") == anchor.name]
    for op in ("short_conv", "silu", "l2norm", "kda_gate", "sigmoid", "rmsnorm", "mul"):
        assert op in group, op
    assert group.count("short_conv") == 3 and group.count("l2norm") == 2
    assert "linear" not in group                 # projections stay library GEMMs
    assert dict(anchor.attr("tiles"))["chunk"] == 64
    # no node belongs to two groups, and every absorbed producer's users are in its group
    users, pos = g.users(), {n.name: i for i, n in enumerate(g.nodes)}
    for n in g.nodes:
        a = n.attr("fusion")
        if a is not None and pos[n.name] < pos[a]:          # prologue members
            assert all(g.node_map()[u].attr("fusion") == a for u in users[n.name])


def test_lowered_kernel_ir_golden():
    prog = lower(_fused(DATA / "toy.mtc"))
    got = prog.text()
    gold = GOLDEN / "toy.lowered.txt"
    if os.environ.get("MTC_UPDATE_GOLDEN") == "1":
        gold.write_text(got)
    assert got == gold.read_text()


def test_cache_key_depends_on_kernel_ir_not_sizes():
    a = lower(_fused(DATA / "toy.mtc"))
    b = lower(_fused(DATA / "toy.mtc"))
    c = lower(_fused(DATA / "toy.mtc", "wide"))
    assert a.cache_key() == b.cache_key() != c.cache_key()
    assert "B*T" in a.text()                      # sizes stay symbolic in the IR the key hashes


def test_generated_pointwise_kernel_matches_reference(tmp_path):
    b = GraphBuilder("pw")
    x = b.input("x", "f32", ["B", "T", 100])
    y = b.input("y", "f32", ["B", "T", 100])
    h = b.add(x, y)
    out = b.rmsnorm(b.silu(h), name="norm")
    g = PassManager().run(b.build([out]))
    m = dsl.compile(g, target="triton", emit_dir=tmp_path)
    assert len(_generated(m)) == 1 and (tmp_path / "kernels.py").exists()
    src = (tmp_path / "kernels.py").read_text()
    assert "tl.sum" in src and "tl.sigmoid" in src
    with torch.no_grad():
        m.norm.weight.normal_()
    xs, ys = torch.randn(3, 37, 100), torch.randn(3, 37, 100)
    got = m.run(x=xs, y=ys)[0]
    want = R.rmsnorm(R.silu(xs + ys), m.norm.weight)
    assert ((got - want).norm() / want.norm()).item() < 1e-6


def test_generated_situ_glu_small_inputs_and_nan(tmp_path):
    # the generated chain's tanh near 0 (where (e - 1) / (e + 1) would cancel) and NaN propagation, against a
    # float64 evaluation of the op's formula
    b = GraphBuilder("pw")
    x = b.input("x", "f32", ["N", 100])
    y = b.input("y", "f32", ["N", 100])
    out = b.situ_glu(b.sigmoid(x), y)
    m = dsl.compile(PassManager().run(b.build([out])), target="triton", emit_dir=tmp_path)
    assert len(_generated(m)) == 1
    for scale in (1e-6, 1e-3, 1.0, 10.0):     # (not past |x| ~ 87, where float32 sigmoid underflows to 0)
        xs, ys = torch.randn(37, 100) * scale, torch.randn(37, 100) * scale
        with torch.no_grad():
            got = m.run(x=xs, y=ys)[0].double()
        a, bd = torch.sigmoid(xs.double()), ys.double()
        want = (4.0 * torch.tanh(a / 4.0) * torch.sigmoid(a)) * (25.0 * torch.tanh(bd / 25.0))
        assert ((got - want).abs() / want.abs()).max().item() < 1e-5, scale
    # NaN (which the module's input check refuses on the CPU) straight through the generated kernel
    from backends.triton import codegen
    (k, fn), = _generated(m)
    xs, ys = torch.randn(3, 100), torch.randn(3, 100)
    xs[0, 5], ys[1, 7] = float("nan"), float("nan")
    outs = [torch.empty_like(xs) for _ in k.outputs]
    codegen.launch(k, fn, [xs, ys], outs)
    got = outs[-1]
    assert got[0, 5].isnan() and got[1, 7].isnan() and got.isnan().sum() == 2


def test_full_model_lowered_cli_under_20s():
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "dsl.cli", "ir", "models/kimi_k3.mtc", "--stage", "lowered",
                        "--seq-len", "1048576", "--gpus", "128", "--slots", "1024"],
                       capture_output=True, text=True, cwd=ROOT)
    dt = time.perf_counter() - t0
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert dt < 20
    assert "triton.kda_chunk x69" in out and "triton.moe_experts x92" in out
    assert "memory plan: kimi_k3, T = 1,048,576" in out and "on 128 GPU(s)" in out
    assert "896 experts -> 1024 slots on 128 GPUs (8 per GPU)" in out
    assert "128 expert(s) replicated" in out


@pytest.mark.parametrize("rows,d", [(1, 100), (37, 100), (1000, 24), (65, 300)])
def test_generated_kernel_tiled_launch(tmp_path, rows, d):
    """codegen.launch: several rows per program for short rows (ROWS = 4096 // BLOCK_D), same values
    as the reference (and as the runtime's one-row-per-program launch)."""
    from backends.triton import codegen
    b = GraphBuilder("pw")
    x = b.input("x", "f32", ["N", d])
    out = b.l2norm(b.rmsnorm(x, name="norm"))
    g = PassManager().run(b.build([out]))
    m = dsl.compile(g, target="triton", emit_dir=tmp_path)
    (k, fn), = _generated(m)
    with torch.no_grad():
        m.norm.weight.normal_()
    xs = torch.randn(rows, d) * 3
    from dsl.ir import Ref
    env = {"x": xs}
    args = []
    for ref in k.inputs:               # resolved as the runtime resolves them (inputs, then parameters)
        name, _, idx = ref.lstrip("%").partition("#")
        args.append((env[name] if name in env else m._arg({}, ref)).detach().contiguous())
    outs = [torch.empty_like(xs) for _ in k.outputs]
    cfg = codegen.launch_config(rows, d)
    assert cfg["ROWS"] * cfg["BLOCK_D"] <= codegen.TILE_ELEMS or cfg["ROWS"] == 1
    codegen.launch(k, fn, args, outs)
    xd = xs.double()
    r = xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + 1e-6) * m.norm.weight.detach().double()
    want = r / torch.sqrt((r * r).sum(-1, keepdim=True) + 1e-6)
    assert ((outs[-1].double() - want).norm() / want.norm()).item() < 1e-5
    assert ((m.run(x=xs)[0].double() - want).norm() / want.norm()).item() < 1e-5


def test_lowered_phase1_accumulator_in_the_banks_16_bit_dtype():
    # the Triton phase 1 stores its accumulator in the bank's dtype when that is 16-bit (the runtime's
    # _phase1_acc_dtype, the memory plan's _two_phase): the lowered listing says so for target triton, in the
    # phase-1 launch's outputs and the merges' inputs; target tvm (the reference's float32) keeps f32
    g = _fused(ROOT / "models" / "kimi_k3.mtc")                 # the full model: bf16
    types = {Ref(n.name, i): t for n in g.nodes for i, t in enumerate(n.types)}
    p1_nodes = [n for n in g.nodes if n.op == "attn_residual_phase1"]
    assert p1_nodes and all(types[n.inputs[-1]].dtype == "bf16" for n in p1_nodes)     # a bf16 bank
    assert all(n.types[0].dtype == "f32" for n in p1_nodes)         # the fused graph: the op's contract type
    for target, want in (("triton", "bf16"), ("tvm", "f32")):
        prog = lower(g, target)
        p1 = [ln for ln in prog.launches if ln.op_kinds == ["attn_residual_phase1"]]
        merges = [ln for ln in prog.launches if "attn_residual_merge" in ln.op_kinds]
        assert p1 and merges
        assert all(ln.outputs[0][1].dtype == want and ln.outputs[1][1].dtype == "f32" for ln in p1), target
        accs = {name for ln in p1 for name, _ in ln.outputs[:1]}
        assert all(t.dtype == want for ln in merges for name, t in ln.inputs if name in accs), target
