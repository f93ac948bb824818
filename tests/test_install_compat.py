"""The kernels run on every triton the project installs (3.6, the GPU machine's, through the newest, 3.9), and a
triton / numpy pair that cannot run them under the CPU interpreter is one clear error at start-up.

CI has one triton; what newer releases changed is checked here on it: triton 3.9 removed block pointers, and
its interpreter takes only bool masks in loads and stores (so a mask must be bool however the interpreter
builds it: it broadcasts a scalar comparison as an integer)."""
import importlib
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import dsl
import backends.reference as ref
from backends.interpreter_versions import interpreter_problem
from dsl.errors import MtcError

ROOT = Path(__file__).resolve().parent.parent
triton = pytest.importorskip("triton")
interp = pytest.importorskip("triton.runtime.interpreter")


@pytest.fixture
def strict_masks(monkeypatch):
    """triton 3.9's interpreter check on whatever triton runs here: a load or store whose mask holds anything
    but bools raises ValueError('mask has unsupported dtype')."""
    if not hasattr(interp, "InterpreterBuilder"):
        pytest.skip("no triton interpreter")
    B = interp.InterpreterBuilder
    load, store = B.create_masked_load, B.create_masked_store

    def check(mask):
        if np.asarray(mask.data).dtype != np.bool_:
            raise ValueError(f"mask has unsupported dtype ({np.asarray(mask.data).dtype})")

    def masked_load(self, ptrs, mask, *a, **k):
        check(mask)
        return load(self, ptrs, mask, *a, **k)

    def masked_store(self, ptrs, value, mask, *a, **k):
        check(mask)
        return store(self, ptrs, value, mask, *a, **k)

    monkeypatch.setattr(B, "create_masked_load", masked_load)
    monkeypatch.setattr(B, "create_masked_store", masked_store)


def rel_rms(a, b):
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


def test_no_block_pointers_in_the_kernels():
    """triton 3.9 removed tl.make_block_ptr / tl.advance (NotImplementedError at the first launch)."""
    hits = [f"{p.name}:{i}" for p in sorted((ROOT / "backends" / "triton").rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1)
            if re.search(r"\b(make_block_ptr|tl\.advance)\b", line.split("#")[0])]
    assert not hits, hits


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's masks (CPU)")
def test_kda_chunk_with_bool_masks_only(strict_masks):
    """kda_chunk's forward (the 32-row strip kernel and the state pass, whose masks combine a scalar comparison
    with a block) and its gradients, against the reference, with the interpreter's masks checked as triton 3.9's
    interpreter checks them."""
    import backends.triton.kda as tk
    with tk.config(bk=16):
        B, T, H, K, V = 1, 83, 2, 16, 32
        q = torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1).requires_grad_()
        k = torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1).requires_grad_()
        v = torch.randn(B, T, H, V, requires_grad=True)
        g = -5.0 * torch.rand(B, T, H, K)
        beta = torch.rand(B, T, H)
        S0 = torch.randn(B, H, K, V)
        o, S = tk.kda_chunk(q, k, v, g, beta, initial_state=S0, output_final_state=True, lower_bound=-5.0)
        o_r, S_r = ref.kda_chunk(q, k, v, g, beta, initial_state=S0, output_final_state=True)
        assert rel_rms(o, o_r) < 2e-5 and rel_rms(S, S_r) < 2e-5
        w = torch.randn_like(o)
        gr = torch.autograd.grad((o * w).sum(), (q, k, v))
        gr_r = torch.autograd.grad((o_r * w).sum(), (q, k, v))
        for a, b in zip(gr, gr_r):
            assert rel_rms(a, b) < 1e-4


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's masks (CPU)")
def test_attn_residual_with_bool_masks_only(strict_masks):
    """The direct attn_residual kernel with its software-pipelined loads (the next source ahead: a mask of a scalar
    comparison and a row block), against the reference, with triton 3.9's mask check."""
    ta = importlib.import_module("backends.triton.attn_residual")    # the package exports the function
    L, N, D = 5, 37, 48
    srcs = [torch.randn(N, D) for _ in range(L)]
    qv, nw = torch.randn(D), 1 + 0.1 * torch.randn(D)
    want = ref.attn_residual(qv, srcs, nw)
    got = ta.attn_residual(qv, srcs, nw)
    assert rel_rms(got, want) < 1e-5


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's masks (CPU)")
def test_two_phase_attn_residual_with_bool_masks_only(strict_masks, monkeypatch):
    """Phase 1 over a bank and the persistent merge (rows past N: a scalar row mask with the column mask), against
    the reference."""
    ta = importlib.import_module("backends.triton.attn_residual")
    Q, B, n, d = 3, 4, 29, 40
    bank = [torch.randn(n, d) for _ in range(B)]
    queries, ws = torch.randn(Q, d), 1 + 0.3 * torch.randn(Q, d)
    partial = torch.randn(n, d)
    acc, m, s = ta.attn_residual_phase1(queries, bank, ws)
    for k in range(Q):
        with ta.config(merge_persistent=True):
            out = ta.attn_residual_merge(acc[k], m[k], s[k], partial, queries[k], ws[k])
        assert rel_rms(out, ref.attn_residual(queries[k], bank + [partial], ws[k])) < 1e-5


@pytest.mark.parametrize("tv,nv,bad", [("3.6.0", "1.26.4", False), ("3.6.0", "2.3.5", False),
                                       ("3.6.0", "2.4.6", True), ("3.6.1+git3a1b", "2.5.0rc1", True),
                                       ("3.7.0", "2.4.6", False), ("3.9.0", "2.4.6", False),
                                       ("3.9.0", "1.26.4", False)])
def test_interpreter_version_pairs(tv, nv, bad):
    msg = interpreter_problem(tv, nv)
    assert (msg is not None) == bad
    if bad:
        assert "\n" not in msg and tv in msg and nv in msg and 'pip install "numpy<2"' in msg


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU interpreter")
def test_compile_says_so_for_triton_3_6_with_numpy_2_4(monkeypatch):
    """triton 3.6's interpreter with numpy >= 2.4 stops with a TypeError deep inside a kernel (a loop bound
    loaded from memory): dsl.compile for the Triton target says so at once, in one line."""
    g = dsl.load(ROOT / "models" / "kimi_k3.mtc", variant="tiny")
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    monkeypatch.setattr(np, "__version__", "2.4.6")
    with pytest.raises(MtcError, match=r"triton 3\.6\.0's CPU interpreter .* numpy 2\.4\.6: it needs numpy < 2\.4"):
        dsl.compile(g, target="triton")
    monkeypatch.setattr(np, "__version__", "1.26.4")
    dsl.compile(g, target="triton")
