"""dsl.compile(target="triton") runs the Triton kernels (interpreter on CPU) and matches the reference."""
from pathlib import Path

import torch

import dsl

ROOT = Path(__file__).resolve().parent.parent


def test_tiny_triton_matches_reference():
    g = dsl.load(ROOT / "models" / "kimi_k3.mtc", "tiny")
    ref = dsl.compile(g, target="reference").eval()
    tri = dsl.compile(g, target="triton").eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("proj_weight"):
                p.normal_(0, 0.5)
    tri.load_state_dict(ref.state_dict())
    assert tri.state_dict().keys() == ref.state_dict().keys()
    ids = torch.randint(0, 256, (1, 70))
    a, b = tri(ids), ref(ids)
    assert torch.isfinite(a).all()
    assert ((a - b).norm() / b.norm()).item() < 1e-4
