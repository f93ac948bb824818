"""mtc stats against the headline numbers of ../shared/spec/MODEL.md and an independent count."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

import dsl
from passes.stats import compute_stats

ROOT = Path(__file__).resolve().parent.parent


def _cli_stats(*args):
    r = subprocess.run([sys.executable, "-m", "dsl.cli", "stats", *args, "--json"], capture_output=True, text=True,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_k3_headline_within_3_percent():
    s = _cli_stats("models/kimi_k3.mtc")
    assert abs(s["total_params"] / 2.78e12 - 1) < 0.03
    assert abs(s["active_params"] / 1.042e11 - 1) < 0.03
    assert s["layers"] == {"kda": 69, "mla": 24, "dense_ffn": 1, "moe": 92}


def test_k3_parameter_count_matches_independent_arithmetic():
    """Re-derive the count from MODEL.md's widths, written out here independently of the op registry."""
    d, V, H, K = 7168, 163840, 96, 128
    HK = H * K
    kda = 5 * d * HK + d * 128 + 128 * HK + d * H + 3 * HK * 4 + H + HK + K
    mla = (d * 1536 + 1536 + 1536 * H * 192 + d * 576 + 512 + 512 * H * 256 + d * HK + HK * d)
    E, I, L = 896, 3072, 3584
    moe = E * d + 2 * d * L + L + E * 3 * I * L + 3 * d * 2 * I
    dense = 3 * d * 33792
    norms_and_attnres = 93 * (2 * d + 4 * d) + 2 * d + d      # 2 norms + 2 AttnRes (query, norm) per layer
    total = 69 * kda + 24 * mla + 92 * moe + dense + 2 * V * d + norms_and_attnres
    s = compute_stats(dsl.load(ROOT / "models" / "kimi_k3.mtc"))
    assert s.total_params == total
    active = 69 * kda + 24 * mla + 92 * (moe - E * 3 * I * L + 16 * 3 * I * L) + dense + V * d + norms_and_attnres
    assert s.active_params == pytest.approx(active, rel=1e-12)


def test_kimi_linear_48b():
    s = _cli_stats("models/kimi_linear_48b.mtc")
    assert abs(s["total_params"] / 48e9 - 1) < 0.05        # "about 48e9"
    assert abs(s["active_params"] / 3e9 - 1) < 0.05         # "about 3e9"


def test_memory_at_one_million_tokens():
    s = _cli_stats("models/kimi_k3.mtc", "--seq-len", "1048576")
    # MODEL.md: (512 + 64) x 2 bytes per token per MLA layer, 24 layers -> about 28 GB at 1M tokens
    assert s["kv_cache_bytes"] == 24 * 1152 * 1048576
    # 96 x 128 x 128 fp32 per KDA layer, 69 layers -> about 434 MB (+ the short-conv state)
    state = 69 * 96 * 128 * 128 * 4
    assert state <= s["kda_state_bytes"] < state * 1.05
    assert s["residual_stream_bytes"] == 1048576 * 7168 * 2
    s2 = _cli_stats("models/kimi_k3.mtc", "--seq-len", "1048576", "--gpus", "8", "--batch", "2")
    assert s2["per_gpu"]["kv_cache_bytes"] == 2 * s["kv_cache_bytes"] / 8
    # over 3 GPUs: whole bytes, the even share rounded up (JSON printed 519981743829.3333)
    s3 = _cli_stats("models/kimi_k3.mtc", "--gpus", "3")
    for k in ("weights_bytes", "kv_cache_bytes", "kda_state_bytes"):
        assert isinstance(s3["per_gpu"][k], int) and 0 <= 3 * s3["per_gpu"][k] - s3[k] < 3, k


def test_flops_grow_with_context_only_through_attention():
    g = dsl.load(ROOT / "models" / "kimi_k3.mtc")
    a = compute_stats(g, seq_len=4096)
    b = compute_stats(g, seq_len=8192)
    # per-token MLA attention FLOPs scale ~linearly with T; everything else per token is constant
    for op in a.flops_per_token_by_op:
        if op == "mla_attention":
            assert b.flops_per_token_by_op[op] / a.flops_per_token_by_op[op] == pytest.approx(2.0, rel=1e-3)
        else:
            assert b.flops_per_token_by_op[op] == pytest.approx(a.flops_per_token_by_op[op], rel=1e-9)
    # linear + experts: about 2 x active matmul parameters
    assert 2 * 0.9 * a.active_params < a.flops_per_token_by_op["linear"] + a.flops_per_token_by_op["moe_experts"] \
        + a.flops_per_token_by_op["qb_route"] + a.flops_per_token_by_op["lm_head"] < 2 * 1.1 * a.active_params_with_embedding


def test_flops_per_token_of_a_fixed_input_shape():
    """compute_stats on a spec whose input is fixed at [3, 20] counts per token of those 60 tokens: equal to
    the symbolic spec at T = 20 (a linear model: FLOPs per token do not depend on B)."""
    body = ") {\n    x = embedding(input_ids, vocab=100, dim=32)\n    return lm_head(linear(x, out=48, name=\"p\"), vocab=100)\n  }\n}\n"
    fixed = dsl.parse("model m {\n  forward(input_ids: i64[3, 20]" + body)
    symb = dsl.parse("model m {\n  forward(input_ids: i64[B, T]" + body)
    f = compute_stats(fixed, seq_len=20, batch=3).flops_per_token
    s = compute_stats(symb, seq_len=20).flops_per_token
    assert f == pytest.approx(s, rel=1e-12)
    assert s == pytest.approx(2 * 32 * 48 + 2 * 48 * 100, rel=1e-12)    # two GEMMs per token


def test_input_symbols_other_than_b_and_t_are_a_clear_error():
    g = dsl.parse("model n {\n  forward(x: f32[N, 64]) {\n    return linear(x, out=32, name=\"p\")\n  }\n}\n",
                  file="n.mtc")
    with pytest.raises(dsl.MtcError, match=r"n.mtc:2:11: error: n: the input shape symbol\(s\) N have no size"):
        compute_stats(g, seq_len=100)


def test_absurd_gpu_counts_are_errors():
    g = dsl.load(ROOT / "models" / "kimi_k3.mtc", "tiny")
    with pytest.raises(dsl.MtcError, match="more than 1,048,576"):
        compute_stats(g, gpus=10 ** 26)
    from passes.plan_memory import plan_memory
    with pytest.raises(ValueError, match="more than 1,048,576"):
        plan_memory(g, seq_len=64, gpus=10 ** 30)


def test_layers_the_outputs_do_not_use_are_not_counted():
    # dead code (dropped when compiled) adds no layer, cache or state to the statistics either
    spec = """model m {
  forward(input_ids: i64[B, T]) {
    x = embedding(input_ids, vocab=256, dim=32)
    h = kda_layer(x, heads=2, head_dim=16, name="l0")
    y = mla_layer(x, heads=2, kv_lora_rank=16, qk_nope_dim=16, qk_rope_dim=8, v_dim=16, name="l1")
    return lm_head(RET, vocab=256)
  }
}"""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                  # the spec's own 'never used' warnings
        both = compute_stats(dsl.parse(spec.replace("RET", "add(h, y)")))
        kda_only = compute_stats(dsl.parse(spec.replace("RET", "h")))
    assert both.layers["kda"] == 1 and both.layers["mla"] == 1 and both.kv_cache_bytes > 0
    assert kda_only.layers["kda"] == 1 and kda_only.layers["mla"] == 0 and kda_only.kv_cache_bytes == 0
    assert kda_only.kda_state_bytes == both.kda_state_bytes > 0


def test_human_formats_have_no_exponent_and_json_counts_are_ints():
    from passes.stats import human, human_bytes
    assert human_bytes(1008 * 1024) == "1008 KiB"          # .3g printed 1.01e+03 KiB
    assert human_bytes(2.5 * 2 ** 30) == "2.5 GiB" and human_bytes(5) == "5 B"
    assert human_bytes(3 * 2 ** 50) == "3 PiB" and human_bytes(2 ** 61) == "2 EiB"   # (was 3072 TiB, 2097152 TiB)
    assert human(2.78e12, "FLOP") == "2.78 TFLOP" and human(999.6) == "1000"
    d = compute_stats(dsl.load(ROOT / "models" / "kimi_k3.mtc")).to_dict()
    assert isinstance(d["weights_bytes"], int) and isinstance(d["flops_per_token"], int)
    assert all(isinstance(v, int) for v in d["flops_per_token_by_op"].values())


def test_a_spec_without_dtype_counts_everything_in_one_dtype(tmp_path):
    """No `dtype` config field: the weights, KV cache, residual stream and all-to-all are all counted in the
    graph builder's default dtype (f32, 4 bytes), not the weights in f32 and the rest in bf16."""
    import re
    from passes.plan_memory import plan_memory
    text = (ROOT / "models" / "kimi_k3.mtc").read_text()
    text, n = re.subn(r"^\s*dtype(: dtype)? = \"\w+\".*\n", "", text, flags=re.M)
    assert n == 2 and "dtype =" not in text.replace("expert_dtype", "")
    spec = tmp_path / "no_dtype.mtc"
    spec.write_text(text)
    g = dsl.load(spec, variant="tiny")
    assert {n.type.dtype for n in g.params()} == {"f32"}
    T, B, eb = 37, 3, 4
    s = compute_stats(g, seq_len=T, batch=B)
    numel = sum(int(n.type.numel()) for n in [*g.params(), *g.buffers()])
    assert s.weights_bytes == numel * eb
    assert s.layers["mla"] == 3
    assert s.kv_cache_bytes == 3 * (16 + 8) * eb * T * B          # kv_lora_rank + qk_rope_dim per MLA layer
    assert s.residual_stream_bytes == T * B * 64 * eb
    p = plan_memory(g, seq_len=T, batch=B, gpus=2)
    assert p.kv_cache_total_bytes == s.kv_cache_bytes
    c = p.moe_comm[0]
    assert c.dispatch_bytes == pytest.approx(c.tokens_per_gpu * c.top_k * c.width * eb * c.remote_fraction)
