"""examples/train_parallel.py under torchrun (CPU, gloo): three AdamW steps of tiny with the sequence split over 2
context-parallel processes (also with FSDP2 for the dense weights) print the same global losses as one process
(rel 1e-5), and a bad --mesh is one line."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(nproc, mesh, *more):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           os.path.join(ROOT, "examples", "train_parallel.py"), "--mesh", mesh, "--steps", "3", "--seq-len", "61", *more]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=240)


def _losses(r):
    assert r.returncode == 0, r.stderr[-3000:]
    return [float(x) for x in re.findall(r"step \d+: loss ([0-9.]+)", r.stdout)]


def test_context_parallel_training_matches_one_process():
    one, two, sharded = _losses(_run(1, "cp=1")), _losses(_run(2, "cp=2")), _losses(_run(2, "cp=2", "--fsdp"))
    assert len(one) == 3 and len(two) == 3 and len(sharded) == 3
    for a, b, c in zip(one, two, sharded):
        assert abs(a - b) <= 1e-5 * a and abs(a - c) <= 1e-5 * a, (one, two, sharded)


def test_bad_mesh_is_an_error():
    r = _run(1, "tp=1")
    assert r.returncode != 0 and "write dims as name=size from dp, ep, cp" in r.stderr
