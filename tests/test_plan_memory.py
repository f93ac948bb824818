"""passes.plan_memory: per-GPU memory and all-to-all volume, checked against independent arithmetic from
../shared/spec/MODEL.md and against tensor sizes measured while running the tiny model."""
import json
import math
from pathlib import Path

import pytest
import torch

import dsl
from passes import PassManager
from passes.plan_memory import plan_memory

ROOT = Path(__file__).resolve().parent.parent
M = 2 ** 20


@pytest.fixture(scope="module")
def k3():
    g = dsl.load(ROOT / "models" / "kimi_k3.mtc")
    return g, PassManager(["verify", "infer_shapes", "canonicalize"]).run(g)


def test_k3_caches_at_one_million_tokens(k3):
    g, c = k3
    mp = plan_memory(g, seq_len=M, gpus=128, canonical=c)
    # MODEL.md: (512 + 64) x 2 bytes per token per MLA layer, 24 layers
    assert mp.kv_cache_total_bytes == 24 * 1152 * M
    assert mp.tp_size == 8
    assert mp.kv_cache_bytes == 24 * 1152 * M / (128 / 8)        # split over 16 TP groups
    # MODEL.md: 96 x 128 x 128 float32 per KDA layer, 69 layers (+ the small short-conv state)
    state = 69 * 96 * 128 * 128 * 4
    assert state <= mp.kda_state_total_bytes < 1.05 * state
    assert mp.kda_state_bytes == pytest.approx(mp.kda_state_total_bytes / 8, rel=1e-12)
    # batch 3: caches scale with the batch, the KV cache also with T
    mp3 = plan_memory(g, seq_len=M // 2, gpus=128, batch=3, canonical=c)
    assert mp3.kv_cache_total_bytes == 24 * 1152 * (M // 2) * 3
    assert mp3.kda_state_total_bytes == pytest.approx(3 * mp.kda_state_total_bytes, rel=1e-12)


def test_k3_weights_per_gpu(k3):
    g, c = k3
    mp = plan_memory(g, seq_len=4096, gpus=128, canonical=c)
    # 896 experts over 128 GPUs: 7 each, w1 + w3 + w2 = 3 x 3072 x 3584 in MXFP4 (4.25 bits), 92 MoE layers
    expert = 3 * 3072 * 3584
    assert mp.expert_slots_per_gpu == 7 and mp.moe_layers == 92
    assert mp.expert_weight_bytes == pytest.approx(92 * 7 * expert * 4.25 / 8, rel=1e-12)
    mp8 = plan_memory(g, seq_len=4096, gpus=128, num_slots=1024, canonical=c)
    assert mp8.expert_slots_per_gpu == 8
    assert mp8.expert_weight_bytes == pytest.approx(92 * 8 * expert * 4.25 / 8, rel=1e-12)
    # the non-expert weights, re-derived from MODEL.md's widths (as in test_stats): bf16, except A_log
    # [96] and dt_bias [12288] in float32 per KDA layer and the float32 router bias [896] per MoE layer
    d, V, H, K = 7168, 163840, 96, 128
    HK = H * K
    kda = 5 * d * HK + d * 128 + 128 * HK + d * H + 3 * HK * 4 + H + HK + K
    mla = d * 1536 + 1536 + 1536 * H * 192 + d * 576 + 512 + 512 * H * 256 + d * HK + HK * d
    E, I, L = 896, 3072, 3584
    moe_dense = E * d + 2 * d * L + L + 3 * d * 2 * I
    dense = 3 * d * 33792
    norms = 93 * (2 * d + 4 * d) + 2 * d + d
    params = 69 * kda + 24 * mla + 92 * moe_dense + dense + 2 * V * d + norms
    f32 = 69 * (H + HK)
    nonexpert_bytes = (params - f32) * 2 + f32 * 4 + 92 * E * 4
    # the replicated part is the 1-D tensors: norms, o_norm, A_log, dt_bias, latent norm, router bias
    one_d = (norms + 69 * K + 24 * (1536 + 512) + 92 * L) * 2 + f32 * 4 + 92 * E * 4
    assert mp.replicated_weight_bytes == one_d
    assert mp.sharded_weight_bytes * 8 + mp.replicated_weight_bytes == pytest.approx(nonexpert_bytes, rel=1e-12)
    # the whole model is accounted for: experts x 128 GPUs + non-expert
    assert mp.expert_weight_bytes * 128 + nonexpert_bytes == pytest.approx(mp.weights_total_bytes, rel=1e-12)


def test_k3_all_to_all_volume(k3):
    g, c = k3
    for gpus, ep in ((128, None), (64, 16)):
        mp = plan_memory(g, seq_len=M, gpus=gpus, ep_size=ep, canonical=c)
        ep = ep or gpus
        tokens = M / gpus
        per = tokens * 16 * 3584 * 2 * (ep - 1) / ep       # top-16 copies at the latent width, bf16, remote part
        assert len(mp.moe_comm) == 92
        for cm in mp.moe_comm:
            assert cm.dispatch_bytes == pytest.approx(per, rel=1e-12)
            assert cm.combine_bytes == pytest.approx(per, rel=1e-12)
            # once per destination GPU: expected other GPUs among 16 distinct experts, E / ep per GPU
            eg = 896 // ep
            hit = (ep - 1) * (1 - math.comb(896 - eg, 16) / math.comb(896, 16))
            assert cm.dispatch_dedup_bytes == pytest.approx(tokens * 3584 * 2 * hit, rel=1e-9)
            assert cm.dispatch_dedup_bytes < cm.dispatch_bytes
        assert mp.a2a_bytes_per_layer == pytest.approx(2 * per, rel=1e-12)
        assert mp.a2a_bytes_total == pytest.approx(92 * 2 * per, rel=1e-12)
        assert mp.moe_comm[0].layer == "model.layers.1.block_sparse_moe"
    # FP8 payload and KV cache halve both
    mp1 = plan_memory(g, seq_len=M, gpus=128, dtype_bytes=1, canonical=c)
    assert mp1.a2a_bytes_total == pytest.approx(92 * M / 128 * 16 * 3584 * 127 / 128 * 2, rel=1e-12)
    assert mp1.kv_cache_total_bytes == 24 * 576 * M
    # one GPU: nothing leaves it
    assert plan_memory(g, seq_len=1024, gpus=1, canonical=c).a2a_bytes_total == 0


@pytest.fixture(scope="module")
def tiny():
    g = dsl.load(ROOT / "models" / "kimi_k3.mtc", variant="tiny")
    m = dsl.compile(g, target="reference", passes=["verify", "infer_shapes", "canonicalize"])
    return g, m.graph, m


def _measured(m, B, T):
    """Run the tiny model op by op and record every op's output tensors (held, so storages stay unique)."""
    with torch.no_grad(), m.tracing(values=True) as trace:
        m(torch.randint(0, 256, (B, T)))
    return [(t.node, t.args, t.outs) for t in trace]


def _live_peak(m, rec):
    """The peak over time of the bytes of the storages alive in a recorded run (_measured), from data pointers
    (views share storage; parameters and buffers excluded; the output lives to the end)."""
    params = {t.untyped_storage().data_ptr() for t in list(m.parameters()) + list(m.buffers())}
    first, last, size = {}, {}, {}
    for k, (n, args, outs) in enumerate(rec):
        for x in args:
            if isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() in first:
                last[x.untyped_storage().data_ptr()] = k
        for o in outs:
            p = o.untyped_storage().data_ptr()
            if p not in params and p not in first:
                first[p], last[p], size[p] = k, k, o.untyped_storage().nbytes()
    last[rec[-1][2][0].untyped_storage().data_ptr()] = len(rec)
    return max(sum(v for p, v in size.items() if first[p] <= k <= last[p]) for k in range(len(rec) + 1))


@pytest.mark.parametrize("B,T", [(1, 1), (2, 63), (1, 100)])
def test_tiny_activations_match_measured_tensors(tiny, B, T):
    g, c, m = tiny
    rec = _measured(m, B, T)
    views = ("reshape", "slice", "broadcast")
    # "none": every value the graph computes (views excluded) + the input ids
    total = sum(o.numel() * o.element_size() for n, _, outs in rec if n.op not in views for o in outs)
    total += B * T * 8
    mp = plan_memory(g, seq_len=T, gpus=1, batch=B, checkpointing="none", canonical=c, two_phase_attn_res=False)
    assert mp.activation_bytes == total
    # "inference": the peak over time of the storages alive
    peak = _live_peak(m, rec)
    mp = plan_memory(g, seq_len=T, gpus=1, batch=B, checkpointing="inference", canonical=c,
                     two_phase_attn_res=False)
    assert mp.activation_bytes == peak
    # "layer": kept = input ids + embedding + every layer's output ([B, T, d] float32); "block": the
    # embedding + the 3 block outputs (block_size 3 of 9 layers)
    d, n_layers = 64, 9
    stream = B * T * d * 4
    lay = plan_memory(g, seq_len=T, gpus=1, batch=B, checkpointing="layer", canonical=c, two_phase_attn_res=False)
    assert lay.activation_kept_bytes == B * T * 8 + (1 + n_layers) * stream
    blk = plan_memory(g, seq_len=T, gpus=1, batch=B, checkpointing="block", canonical=c, two_phase_attn_res=False)
    assert blk.activation_kept_bytes == B * T * 8 + (1 + n_layers // 3) * stream
    # one layer's values are fewer than all values but at least an average layer's share
    for p in (lay, blk):
        assert p.activation_bytes == p.activation_kept_bytes + p.activation_recompute_bytes
        assert (total - p.activation_kept_bytes) / (n_layers + 2) <= p.activation_recompute_bytes < total
    assert lay.activation_recompute_bytes < blk.activation_recompute_bytes
    assert lay.activation_bytes < total


@pytest.mark.parametrize("B,T", [(1, 37), (2, 100)])
def test_two_phase_attn_res_activations_match_measured_tensors(B, T):
    # the default pipeline runs Block AttnRes in its two-phase form: each block's phase-1 accumulators live
    # until the block's last merge; the plan (two_phase_attn_res=True, the default) counts them (a trial found
    # the buffer missing: 2.6 GiB per GPU at T = 1M on 128 GPUs)
    g = dsl.load(ROOT / "models" / "kimi_k3.mtc", variant="tiny")
    m = dsl.compile(g, target="reference")
    assert any(n.op == "attn_residual_phase1" for n in m.graph.nodes)
    c = m.stages["canonical"]
    peak = _live_peak(m, _measured(m, B, T))
    two = plan_memory(g, seq_len=T, gpus=1, batch=B, checkpointing="inference", canonical=c)
    direct = plan_memory(g, seq_len=T, gpus=1, batch=B, checkpointing="inference", canonical=c,
                         two_phase_attn_res=False)
    assert two.activation_bytes == peak and two.activation_bytes > direct.activation_bytes


def test_per_gpu_scaling(k3):
    g, c = k3
    a = plan_memory(g, seq_len=65536, gpus=8, canonical=c)
    b = plan_memory(g, seq_len=65536, gpus=32, tp_size=8, canonical=c)
    assert b.activation_bytes == pytest.approx(a.activation_bytes / 4, rel=1e-12)
    assert b.kv_cache_bytes == pytest.approx(a.kv_cache_bytes / 4, rel=1e-12)
    assert b.kda_state_bytes == a.kda_state_bytes            # same TP split, one segment state each
    assert b.sharded_weight_bytes == a.sharded_weight_bytes
    assert b.expert_weight_bytes == pytest.approx(a.expert_weight_bytes / 4, rel=1e-12)
    t2 = plan_memory(g, seq_len=2 * 65536, gpus=8, canonical=c)
    assert t2.kv_cache_bytes == 2 * a.kv_cache_bytes
    assert t2.total_bytes == pytest.approx(t2.weight_bytes + t2.activation_bytes + t2.kv_cache_bytes
                                           + t2.kda_state_bytes)


def test_summary_and_dict(k3):
    g, c = k3
    mp = plan_memory(g, seq_len=M, gpus=128, checkpointing="block", canonical=c)
    s = mp.summary()
    assert "T = 1,048,576" in s and "128 GPU" in s and "7 per MoE layer x 92 layers" in s
    assert "all-to-all" in s and "'block' checkpointing" in s
    d = json.loads(json.dumps(mp.to_dict()))
    assert d["kv_cache_total_bytes"] == 24 * 1152 * M
    assert d["total_bytes"] == pytest.approx(mp.total_bytes)
    assert len(d["moe_comm"]) == 92 and d["moe_comm"][0]["total_bytes"] == pytest.approx(mp.a2a_bytes_per_layer)


@pytest.mark.parametrize("kw,msg", [
    (dict(checkpointing="full"), "checkpointing"),
    (dict(ep_size=3), "ep_size"),
    (dict(tp_size=5), "tp_size"),
    (dict(seq_len=0), "seq_len"),
    (dict(gpus=-1), "gpus"),
    (dict(batch=1.5), "batch"),
    (dict(num_slots=15), "num_slots"),
    (dict(num_slots=20), "num_slots"),
    (dict(dtype_bytes=float("nan")), "dtype_bytes"),
])
def test_bad_arguments(tiny, kw, msg):
    g = tiny[0]
    args = dict(seq_len=64, gpus=8)
    args.update(kw)
    with pytest.raises(ValueError, match=msg):
        plan_memory(g, **args)


def test_canonical_graph_and_missing_block_size_rejected(tiny):
    c = tiny[1]
    with pytest.raises(ValueError, match="already canonicalized"):
        plan_memory(c, seq_len=64, gpus=1)
    g48 = dsl.load(ROOT / "models" / "kimi_linear_48b.mtc", n_layers=4)
    with pytest.raises(ValueError, match="block"):
        plan_memory(g48, seq_len=64, gpus=8, checkpointing="block")
    mp = plan_memory(g48, seq_len=64, gpus=8, checkpointing="block", block_size=2)
    assert mp.moe_comm and mp.moe_comm[0].width == 2304          # plain MoE: tokens travel at width d


@pytest.mark.parametrize("gpus", [32, 64])
def test_more_gpus_than_experts_dispatch_once_per_gpu(tiny, gpus):
    """16 experts on 32 / 64 GPUs: each GPU holds one slot (replicas split an expert's tokens), so a token
    reaches each of its top-4 GPUs once and the once-per-GPU volume equals the per-expert one (never more)."""
    g, c, _ = tiny
    mp = plan_memory(g, seq_len=4096, gpus=gpus, canonical=c)
    for cm in mp.moe_comm:
        assert cm.experts < gpus
        assert cm.dispatch_dedup_bytes == pytest.approx(cm.dispatch_bytes, rel=1e-12)
        assert cm.dispatch_bytes == pytest.approx(4096 / gpus * 4 * 32 * 4 * (gpus - 1) / gpus, rel=1e-12)


def test_uneven_token_split_says_what_gpus_hold(tiny):
    """1000 tokens on 96 GPUs: the summary gives the average and the two whole counts; more GPUs than tokens
    warns that some GPUs hold none (16th session: a plan for 100,000 GPUs printed 10.486 tokens per GPU only)."""
    import warnings
    from dsl.errors import MtcWarning
    g, c, _ = tiny
    with warnings.catch_warnings():
        warnings.simplefilter("error", MtcWarning)
        mp = plan_memory(g, seq_len=1000, gpus=96, canonical=c)
    assert mp.tokens_per_gpu == pytest.approx(1000 / 96)
    assert "(10.417 tokens per GPU on average, 10 or 11 each)" in mp.summary()
    assert "(1,000 tokens per GPU)" in plan_memory(g, seq_len=1000, gpus=1, canonical=c).summary()
    with pytest.warns(MtcWarning, match=r"1,000 tokens on 1,024 GPUs: 24 GPUs hold no token"):
        mp = plan_memory(g, seq_len=1000, gpus=1024, canonical=c)
    assert "0 or 1 each" in mp.summary()


def test_primitive_op_spec_plans_with_a_warning_and_canonical_graphs_are_refused():
    """A spec written with mla_attention itself (no layer blocks) is planned, saying what it cannot count;
    the canonical graph of a parsed model (what compile produces) is still refused."""
    from dsl.errors import MtcWarning
    g = dsl.parse("model p {\n  forward(q: f32[B, T, 2, 16], k: f32[B, T, 2, 16], v: f32[B, T, 2, 8]) {\n"
                  "    return mla_attention(q, k, v, scale=0.25)\n  }\n}\n")
    with pytest.warns(MtcWarning, match="primitive ops"):
        mp = plan_memory(g, seq_len=1000, gpus=1)
    assert mp.kv_cache_bytes == 0 and mp.activation_total_bytes > 0
    c = PassManager(["verify", "infer_shapes", "canonicalize"]).run(dsl.load(ROOT / "models" / "kimi_k3.mtc", "tiny"))
    with pytest.raises(ValueError, match="already canonicalized"):
        plan_memory(c, seq_len=1000, gpus=1)


def test_default_tensor_parallel_group_divides_the_heads():
    # K3 tiny has 2 heads per attention layer: 32 GPUs give TP 2 (not gcd(32, 8) = 8), and an explicit TP that
    # does not divide the heads is refused; the full K3 (96 heads) keeps TP 8
    g = dsl.load(ROOT / "models" / "kimi_k3.mtc", "tiny")
    assert plan_memory(g, seq_len=4096, gpus=32).tp_size == 2
    assert plan_memory(g, seq_len=4096, gpus=3).tp_size == 1
    with pytest.raises(ValueError, match="tp_size = 4 does not divide the 2 heads"):
        plan_memory(g, seq_len=4096, gpus=32, tp_size=4)


_STACK_SPEC = """model m {
  config { block_size: int = 12 }
  block kda = kda_layer(heads=2, head_dim=16)
  block dense = glu_ffn(inter=64)
  forward(ids: i64[B, T]) {
    x = embedding(ids, vocab=64, dim=32)
    x = stack(x, layers=6, residual="attn_res", block_size=BS) {
      attn = kda
      ffn = dense
    }
    return lm_head(rmsnorm(x), vocab=64)
  }
}
"""


def test_block_checkpointing_takes_the_stacks_block_size():
    # the checkpoint unit is the block_size= the stack was built with: a literal 3 plans like block_size 3 passed
    # explicitly, not like the unrelated config value 12 (once the planner read only the config value)
    lit = dsl.parse(_STACK_SPEC.replace("BS", "3"))
    via_config = dsl.parse(_STACK_SPEC.replace("BS", "block_size"), block_size=3)
    kw = dict(seq_len=256, gpus=1, checkpointing="block")
    a, b = plan_memory(lit, **kw), plan_memory(via_config, **kw)
    c = plan_memory(lit, **kw, block_size=3)
    wrong = plan_memory(lit, **kw, block_size=12)
    assert a.activation_kept_bytes == b.activation_kept_bytes == c.activation_kept_bytes
    assert a.activation_recompute_bytes == b.activation_recompute_bytes == c.activation_recompute_bytes
    assert a.activation_kept_bytes != wrong.activation_kept_bytes
