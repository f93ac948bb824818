"""The examples/ scripts run as a user runs them, and say what they should."""
import re
import subprocess
import sys
from pathlib import Path

import torch

import dsl

ROOT = Path(__file__).resolve().parent.parent


def _run(*args, timeout=300):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout)


def test_quickstart_runs():
    r = _run("examples/quickstart.py")
    assert r.returncode == 0, r.stderr
    loss = float(re.search(r"loss ([0-9.]+) nats/byte", r.stdout).group(1))
    assert abs(loss - 5.545) < 0.3                  # untrained: near ln 256
    gpu_loads = re.search(r"GPU loads \[([0-9, ]+)\]", r.stdout).group(1)
    loads = [int(x) for x in gpu_loads.split(",")]
    assert sum(loads) == 512 * 4 and max(loads) <= 1.05 * 512      # 512 tokens x top-4 over 4 GPUs
    assert "routed experts (7 per MoE layer x 92 layers, EP 128)" in r.stdout


def test_hybrid_spec_compiles_and_runs():
    g = dsl.load(ROOT / "examples" / "hybrid_tiny.mtc")
    m = dsl.compile(g).eval()
    ops = {n.op for n in m.graph.nodes}
    assert {"kda_chunk", "mla_attention", "qb_route", "attn_residual_phase1"} <= ops
    with torch.no_grad():
        y = m(torch.randint(0, 512, (2, 33)))
    assert y.shape == (2, 33, 512) and torch.isfinite(y).all()


def test_compare_targets_triton_matches():
    r = _run("examples/compare_targets.py", "--targets", "triton", "--tokens", "9", "--batch", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    row = next(line for line in r.stdout.splitlines() if line.startswith("triton"))
    err, same = row.split()[2], row.split()[3]
    assert float(err) < 1e-4 and same == "True"
