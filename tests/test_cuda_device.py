"""Triton launches on torch's current CUDA device: every Triton entry point and the compiled module's run make
the device of their tensors current for the call (backends.cuda_device.on_tensor_device)."""
import contextlib
from pathlib import Path

import pytest
import torch

import backends.cuda_device as cd
import backends.triton as T

ROOT = Path(__file__).resolve().parent.parent

# the entry points whose kernels Triton launches (mla_attention is torch's own SDPA, which follows its tensors)
ENTRY_POINTS = [n for n in T.__all__ if n != "mla_attention"]


def test_every_triton_entry_point_and_the_module_run_are_guarded():
    from backends.runtime import CompiledModule
    guarded = cd.on_tensor_device(lambda: None).__code__
    for name in ENTRY_POINTS:
        f = getattr(T, name)
        assert f.__code__ is guarded and callable(f.__wrapped__), name
    assert CompiledModule.run.__code__ is guarded


def test_guard_makes_the_tensors_device_current(monkeypatch):
    # no second GPU here: the current device and torch.cuda.device are stand-ins that record what the guard does
    entered, current = [], {"index": 0}

    @contextlib.contextmanager
    def device(dev):
        entered.append(dev)
        old, current["index"] = current["index"], dev.index
        yield
        current["index"] = old

    monkeypatch.setattr(torch.cuda, "current_device", lambda: current["index"])
    monkeypatch.setattr(torch.cuda, "device", device)
    found = {}
    monkeypatch.setattr(cd, "tensor_device", lambda args, kwargs: found.get("dev"))
    seen = []
    f = cd.on_tensor_device(lambda x, *, y=None: seen.append(current["index"]) or (x, y))
    x = torch.randn(3)
    found["dev"] = torch.device("cuda", 1)
    assert f(x, y=5) == (x, 5)                       # arguments and result pass through
    assert entered == [torch.device("cuda", 1)] and seen == [1] and current["index"] == 0
    current["index"] = 1                             # already current: no switch
    f(x)
    assert len(entered) == 1 and seen == [1, 1]
    found["dev"] = None                              # no CUDA tensor: no switch, the CUDA state is not touched
    monkeypatch.setattr(torch.cuda, "current_device", lambda: pytest.fail("queried the current device"))
    f(x)
    assert len(entered) == 1


def test_tensor_device_finds_the_first_cuda_tensor():
    x = torch.randn(2)
    assert cd.tensor_device((x, [x, x], 3, None), {"w": x}) is None     # CPU tensors only
    if torch.cuda.is_available():
        n = torch.cuda.device_count() - 1
        y = torch.randn(2, device=f"cuda:{n}")
        assert cd.tensor_device((x, [x, y]), {}) == y.device
        assert cd.tensor_device((x,), {"w": y}) == y.device


@pytest.mark.gpu
def test_gpu_second_device_not_current():
    # tensors on cuda:1 while cuda:0 is current: the kernels must run on cuda:1 and give what they give there
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    torch.cuda.set_device(0)
    d1 = torch.device("cuda", 1)
    B, Tn, H, K = 1, 1000, 2, 64
    q = torch.nn.functional.normalize(torch.randn(B, Tn, H, K), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, Tn, H, K), dim=-1)
    v = torch.randn(B, Tn, H, K)
    g = -5.0 * torch.sigmoid(torch.randn(B, Tn, H, K))
    beta = torch.sigmoid(torch.randn(B, Tn, H))
    args = [t.to(d1, torch.bfloat16) if t is not g else t.to(d1) for t in (q, k, v, g, beta)]
    o, S = T.kda_chunk(*args, output_final_state=True, lower_bound=-5.0)
    assert o.device == d1 and torch.cuda.current_device() == 0
    with torch.cuda.device(1):
        o1, S1 = T.kda_chunk(*args, output_final_state=True, lower_bound=-5.0)
    assert torch.equal(o, o1) and torch.equal(S, S1)
    xs = [torch.randn(1000, 256, device=d1, dtype=torch.bfloat16) for _ in range(3)]
    w, qv = torch.rand(256, device=d1) + 0.5, torch.randn(256, device=d1)
    r = T.attn_residual(qv, xs, w)
    with torch.cuda.device(1):
        assert torch.equal(r, T.attn_residual(qv, xs, w))
    # a compiled model on cuda:1
    import dsl
    from tiny_model import clear_ids, exercise
    gr = dsl.load(ROOT / "models" / "kimi_k3.mtc", "tiny")
    ref = dsl.compile(gr, target="reference").eval()
    exercise(ref)
    tri = dsl.compile(gr, target="triton", device=d1).eval()
    tri.load_state_dict(ref.state_dict())
    ids = clear_ids(ref, (1, 70))
    with torch.no_grad():
        a = tri(ids.to(d1))
        assert a.device == d1 and torch.cuda.current_device() == 0
        with torch.cuda.device(1):
            b = tri(ids.to(d1))
    assert torch.isfinite(a).all() and ((a - b).norm() / b.norm()).item() < 1e-5
