"""Inference with caches on the triton target (under TRITON_INTERPRET=1 on the CPU: small T to keep the time):
chunked prefill with the fused conv_silu_norm, Triton kda_chunk with initial_state / final_state, kda_step for
decode, SDPA with a lower-right causal bias.

Tolerance: the triton target's own forward differs from the reference target's by ~1e-5 relative on these
models' logits (its kda_chunk agrees with the reference's to ~5e-7 per call, amplified through the layers;
measured 0.9-1.2e-5 at T = 41 on tiny), so a cached run is held to the reference forward (the ground truth) within
twice the distance of the triton forward to it, and to its own forward within 3e-5 (measured: prefill 7e-6,
decode 0.9-1.3e-5). A lost state or a wrong offset gives errors of 1e-2 and more."""
import pytest
import torch

import dsl

pytestmark = pytest.mark.usefixtures("wide_moe_tiles")


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("spec,variant,T,chunk,k", [("models/kimi_k3.mtc", "tiny", 33, 20, 2),
                                                   ("examples/hybrid_tiny.mtc", None, 24, 13, 2)])
def test_prefill_and_decode_equal_forward_triton(spec, variant, T, chunk, k):
    g = dsl.load(spec, variant=variant)
    ref = dsl.compile(g, target="reference", seed=0).eval()
    with torch.no_grad():                     # router logits with std ~2 (see tests/test_inference.py _model)
        for name, p in ref.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0, 2.0 / p.shape[1] ** 0.5)
    m = dsl.compile(g, target="triton", seed=0).eval()
    m.load_state_dict(ref.state_dict())
    assert "triton.conv_silu_norm" in m.ir("lowered") and "triton.kda_chunk" in m.ir("lowered")
    vocab = int(g.type_of(g.outputs[0]).shape[-1])
    for _ in range(20):
        ids = torch.randint(0, vocab, (1, T))
        if min(ref.route_margins(ids).values()) >= 1e-6:     # no routing near-tie (see test_inference._clear)
            break
    with torch.no_grad():
        truth, fwd = ref(ids), m(ids)

    def check(got, i):
        assert _rel(got, fwd[:, i]) < 3e-5, i
        assert _rel(got, truth[:, i]) < 2 * _rel(fwd[:, i], truth[:, i]) + 1e-6, i

    cache = m.new_cache(1, T)
    out = m.prefill(ids[:, :T - k], cache, chunk_tokens=chunk)      # chunks of 20, 11 / 13, 9
    check(out, slice(0, T - k))
    for i in range(T - k, T):
        check(m.decode(ids[:, i:i + 1], cache)[:, 0], i)


@pytest.mark.gpu
def test_prefill_and_decode_small_bf16_on_the_gpu():
    """`small`'s layers (d 1536, 12 KDA / MLA heads of 128) in bf16 on the GPU: prefill of 4,099 tokens in chunks of
    1,000 (expanded MLA through flash SDPA with a lower-right causal bias) and 6 fused decode steps (mla_decode, the
    KDA decode kernel) are as accurate as the bf16 forward, all three against the float32 reference forward of the
    same weights: the prefill within 1.5x the forward's error, each decode step within 2x its token's.

    All layers dense (first_dense = n_layers): at a random init the routers' top-k margins are ~1e-6, so bf16
    rounding alone re-routes 17% of a layer's tokens and moves `small`'s logits by 85% (bf16 vs float32 of the
    reference forward: 0.84); the dense model's bf16 error is 5e-2, continuous in the rounding."""
    g = dsl.load("models/kimi_k3.mtc", variant="small", first_dense=12)
    m = dsl.compile(g, target="triton", dtype=torch.bfloat16, device="cuda", seed=0).eval()
    truth = dsl.compile(g, target="reference", dtype=torch.float32, device="cuda", seed=0).eval()
    truth.load_state_dict({k: v.float() for k, v in m.state_dict().items()})
    T, k = 4099, 6
    ids = torch.randint(0, 32768, (1, T), device="cuda")

    def err(a, b):                    # per token: ||a - b|| / ||b|| over the vocabulary
        return (a.float() - b.float()).norm(dim=-1) / b.float().norm(dim=-1)
    with torch.no_grad():
        tru = truth(ids)
        e_fwd = err(m(ids), tru)[0]
        cache = m.new_cache(1, T)
        out = m.prefill(ids[:, :T - k], cache, chunk_tokens=1000)
        e_pre = err(out, tru[:, :T - k])[0]
        assert e_fwd.mean() < 0.1, float(e_fwd.mean())
        assert e_pre.mean() <= 1.5 * e_fwd[:T - k].mean(), (float(e_pre.mean()), float(e_fwd[:T - k].mean()))
        for i in range(T - k, T):
            e = float(err(m.decode(ids[:, i:i + 1], cache)[:, 0], tru[:, i]))
            assert e <= 2 * float(e_fwd[i]) + 1e-3, (i, e, float(e_fwd[i]))
