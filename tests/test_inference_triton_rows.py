"""Rows of different lengths on the triton target (interpreter): packed prefill chunks (Triton kda_chunk with
cu_seqlens and initial_state, the fused conv on packed rows), then decode steps whose rows attend to caches of
different lengths (the split-T mla_decode kernel, the fused KDA decode kernel on a batch). Against the reference
target's forward of each row alone, within twice the triton forward's own distance to it (see
tests/test_inference_triton.py); the same decode steps through the per-launch path give the fused path's logits and
cache states."""
import copy

import pytest
import torch

import backends.inference as inf
import backends.triton.kda.decode as D
import dsl

pytestmark = pytest.mark.usefixtures("wide_moe_tiles")


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_rows_of_different_lengths_triton(monkeypatch):
    g = dsl.load("models/kimi_k3.mtc", variant="tiny")
    ref = dsl.compile(g, target="reference", seed=0).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0, 2.0 / p.shape[1] ** 0.5)
    m = dsl.compile(g, target="triton", seed=0).eval()
    m.load_state_dict(ref.state_dict())
    lens, steps = [23, 9, 1], 2
    rows = []
    for n in lens:
        for _ in range(20):
            r = torch.randint(0, 256, (n + steps,))
            if min(ref.route_margins(r[None]).values()) >= 1e-6:
                break
        rows.append(r)
    ids = torch.zeros(3, max(lens), dtype=torch.long)
    for b, n in enumerate(lens):
        ids[b, :n] = rows[b][:n]
    cache = m.new_cache(3, max(lens) + steps)
    out = m.prefill(ids, cache, lengths=lens, chunk_tokens=24)       # 8 per row: packed (8, 8, 1), (8, 1), then (7)
    nxt = [torch.stack([r[n + i] for r, n in zip(rows, lens)])[:, None] for i in range(steps)]
    # the per-launch decode (inference.FUSE_KDA_DECODE = False: conv_silu_norm, kda_gate, sigmoid, kda_step_rows,
    # the epilogue) on a copy of the cache, then the default: each KDA layer as one backends/triton/kda/decode.py
    # launch that updates the cache's conv and recurrent states in place
    per_launch = copy.deepcopy(cache)
    monkeypatch.setattr(inf, "FUSE_KDA_DECODE", False)
    dec_pl = [m.decode(x, per_launch) for x in nxt]
    monkeypatch.setattr(inf, "FUSE_KDA_DECODE", True)
    calls = []
    real = D.kda_decode_step
    monkeypatch.setattr(D, "kda_decode_step", lambda *a, **k: calls.append(1) or real(*a, **k))
    dec = [m.decode(x, cache) for x in nxt]
    n_kda = len(inf.cache_layout(m).kda)
    assert len(calls) == steps * n_kda and n_kda == len(inf.kda_decode_plans(m, inf.cache_layout(m)))
    assert _rel(torch.cat(dec, 1), torch.cat(dec_pl, 1)) < 2e-6
    for a, b in zip(cache.tensors(), per_launch.tensors()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for b, n in enumerate(lens):
        with torch.no_grad():
            truth, fwd = ref(rows[b][None]), m(rows[b][None])
        got = torch.cat([out[b:b + 1, :n]] + [d[b:b + 1] for d in dec], dim=1)
        assert _rel(got, fwd) < 3e-5, b
        assert _rel(got, truth) < 2 * _rel(fwd, truth) + 1e-6, b
