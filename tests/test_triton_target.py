"""dsl.compile(target="triton") runs the Triton kernels (interpreter on CPU) and matches the reference."""
from pathlib import Path

import pytest
import torch

import dsl
from tiny_model import clear_ids, exercise

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.usefixtures("wide_moe_tiles")


def test_tiny_triton_matches_reference():
    """The inference program (fused and generated kernels) and the training program (every op alone) give the
    reference's logits; training through target="triton" gives every parameter its gradient, equal to the
    reference's (the generated / fused forward-only kernels step aside while autograd records; the Triton kernels
    with a backward - kda_chunk, attn_residual, qb_route, moe_experts - stay)."""
    g = dsl.load(ROOT / "models" / "kimi_k3.mtc", "tiny")
    ref = dsl.compile(g, target="reference").eval()
    tri = dsl.compile(g, target="triton").eval()
    exercise(ref)
    tri.load_state_dict(ref.state_dict())
    assert tri.state_dict().keys() == ref.state_dict().keys()
    prog = tri.program
    # the fused launches of the inference program: generated epilogues of the templates, AttnRes + RMSNorm in one
    # kernel, and the KDA prologue chains (short_conv -> silu [-> l2norm]) as one kernel each
    gen = [L for L in prog.launches if L.generated is not None and L.generated.name.startswith("ep")]
    assert gen and all(L.kernel.startswith("generated.ep") for L in gen)
    assert any(L.kernel == "triton.attn_residual_merge+rmsnorm" for L in prog.launches)
    n_kda = sum(1 for L in prog.launches if L.kernel == "triton.kda_chunk")
    assert n_kda and sum(1 for L in prog.launches if L.kernel == "triton.conv_silu_norm") == 3 * n_kda
    absorbed = {m for L in prog.launches if len(L.ops) > 1 for m in L.ops}
    ids = clear_ids(ref, (1, 70))
    with torch.no_grad(), tri.tracing() as trace:           # inference: the fused / generated kernels run
        a, b = tri(ids), ref(ids)
    assert [t.kernel for t in trace] == [L.kernel for L in prog.launches]
    alone = {t.node.name for t in trace if t.kernel.split(".")[0] in ("reference", "library", "triton", "view")
             and "+" not in t.kernel and t.kernel != "triton.conv_silu_norm"}
    assert not (absorbed - {t.node.name for t in trace if len(prog.launches[t.index].ops) > 1}) & alone
    assert torch.isfinite(a).all()
    assert ((a - b).norm() / b.norm()).item() < 1e-4
    # with autograd recording the training program runs: every op on its own (same result)
    with tri.tracing() as trace:
        c = tri(ids)
    assert [t.kernel for t in trace] == [L.kernel for L in tri.train_program.launches]
    assert all(len(L.ops) == 1 for L in tri.train_program.launches)
    assert absorbed & {t.node.name for t in trace}
    assert ((c - b).norm() / b.norm()).item() < 1e-4
    tgt = torch.randn_like(c)
    (c.float() * tgt).mean().backward()
    (ref(ids).float() * tgt).mean().backward()
    want = dict(ref.named_parameters())
    pairs = []
    for name, p in tri.named_parameters():
        r = want[name].grad
        assert (p.grad is None) == (r is None), name
        if r is not None:
            pairs.append((name, p.grad, r))
    g_ = torch.cat([g.flatten() for _, g, _ in pairs])
    r_ = torch.cat([r.flatten() for _, _, r in pairs])
    assert ((g_ - r_).norm() / r_.norm()).item() < 1e-3          # all gradients together (seen: <= 2.3e-4)
    # per tensor: 5e-3 of its own norm, plus 1e-3 of the model's RMS gradient entry per element. The floor
    # matters for the A_log / dt_bias gradients ([heads] sums over every token and channel): they can nearly
    # cancel, and then float32 rounding alone (reference vs float64: ~2e-5; Triton path: up to 8e-4) is a large
    # part of a tiny norm (seen 2.8e-2 relative). A missing or wrong gradient is off by O(1) of its norm.
    rms = r_.norm() / r_.numel() ** 0.5
    for name, g, r in pairs:
        assert (g - r).norm() <= 5e-3 * r.norm() + 1e-3 * rms * r.numel() ** 0.5, name


def test_tiny_tvm_matches_reference():
    """target="tvm": TensorIR kernels (llvm) for the memory-bound ops, Triton (interpreter) for the rest.
    TVM kernels are forward-only, so run without autograd recording (else they defer to the reference)."""
    g = dsl.load(ROOT / "models" / "kimi_k3.mtc", "tiny")
    ref = dsl.compile(g, target="reference").eval()
    tvm = dsl.compile(g, target="tvm").eval()
    low = tvm.ir("lowered")
    assert "tvm.rmsnorm" in low and "triton.kda_chunk" in low
    # the listing names the implementation each op runs on: the router and the SiTU-GLU after the GEMMs are TVM
    # kernels under target tvm (backends/tvm/impls.py), not Triton ones
    assert "tvm.qb_route" in low and "triton.qb_route" not in low
    assert "tvm.situ_glu" in low and "triton.situ_glu" not in low
    listing = tvm.ir("tvm")
    assert "router_scores" in listing and "def router_scores" in listing
    exercise(ref)
    with torch.no_grad():
        tvm.load_state_dict(ref.state_dict())
    ids = clear_ids(ref, (1, 70))
    with torch.no_grad():
        a, b = tvm(ids), ref(ids)
    assert ((a - b).norm() / b.norm()).item() < 1e-4


def test_cli_prints_tvmscript():
    import subprocess, sys
    r = subprocess.run([sys.executable, "-m", "dsl.cli", "ir", "models/kimi_k3.mtc", "--variant", "tiny",
                        "--stage", "tvm"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "@T.prim_func" in r.stdout and "def attn_residual" in r.stdout and "def rmsnorm" in r.stdout


_COMPILE_GENERATED = r"""
import inspect
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import dsl
from passes.manager import PassManager, PIPELINES
from passes.lower import lower
from backends.triton.codegen import write_and_load
import tempfile
g = dsl.load("models/kimi_k3.mtc", "small")
pm = PassManager(PIPELINES["default"])
pm.run(g)
prog = lower(pm.stages["fused"], "triton")
path, mod, kernels = write_and_load(prog, tempfile.mkdtemp())
done = set()
for k in kernels:
    if k.name in done:
        continue
    done.add(k.name)
    fn = getattr(mod, k.name)
    sig = {}
    for a in fn.arg_names:
        if a.startswith(("in", "out")):
            sig[a] = "*bf16"
        elif a in ("BLOCK_D", "ROWS"):
            sig[a] = "constexpr"
        elif a == "N":
            sig[a] = "i64"
        elif a == "D":
            sig[a] = "i32"
        else:
            sig[a] = "fp32"
    ck = triton.compile(ASTSource(fn, sig, dict(BLOCK_D=2048, ROWS=1)), target=GPUTarget("cuda", 90, 32),
                        options=dict(num_warps=4))
    assert ck.asm["ptx"], k.name
print("OK", len(done))
"""


def test_generated_kernels_compile_for_hopper():
    """Every generated kernel of the small model (pointwise chains and template epilogues) compiles for sm_90
    with bf16 operands (fresh process, interpreter off; no GPU needed)."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", _COMPILE_GENERATED], env=env, cwd=ROOT, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]


def test_triton_module_pickles_with_its_generated_kernels():
    # torch.save(m) of a target="triton" module: the generated pointwise kernels are regenerated on load and run
    import io
    g = dsl.load(ROOT / "models" / "kimi_k3.mtc", "tiny")
    tri = dsl.compile(g, target="triton", seed=1).eval()
    buf = io.BytesIO()
    torch.save(tri, buf)
    buf.seek(0)
    tri2 = torch.load(buf, weights_only=False)
    assert tri2.program.text() == tri.program.text() and tri2._generated is not None
    ids = torch.randint(0, 256, (1, 9))
    with torch.no_grad():
        assert torch.equal(tri(ids), tri2(ids))
