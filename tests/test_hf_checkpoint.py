"""Hugging Face checkpoints (dsl.from_hf, m.save_hf, mtc import-hf) against independent references:

* Kimi Linear: transformers' own KimiLinearForCausalLM (pure-PyTorch fallbacks on the CPU) is the oracle: a small
  random config with KDA and MLA layers, dense and MoE layers with shared experts; its save_pretrained checkpoint
  loads into mtc with the same logits, and mtc's save_hf loads into transformers with the same logits.
* Kimi K3 (no public modeling code runs here): a tiny checkpoint written by this test under K3's names (its own
  table below, not mtc's), routed experts in MXFP4 encoded by this test from the format's definition.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dsl
from dsl.checkpoint import mxfp4

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
from transformers import KimiLinearConfig, KimiLinearForCausalLM  # noqa: E402
from transformers.models.kimi_linear import modeling_kimi_linear as _hf_kimi  # noqa: E402


@pytest.fixture(autouse=True)
def _transformers_pure_pytorch(monkeypatch):
    """The oracle is transformers' own PyTorch code: where fla-core is installed (the GPU machine), its modeling
    file binds its chunked and recurrent KDA functions to fla's Triton kernels, which neither run on CPU tensors
    nor are independent of the kernels mtc is measured against; the functions they wrap are its PyTorch ones."""
    import inspect
    for name in ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention"):
        monkeypatch.setattr(_hf_kimi, name, inspect.unwrap(getattr(_hf_kimi, name)))

ROOT = Path(__file__).resolve().parents[1]
torch.set_num_threads(1)

# ---------------------------------------------------------------------------------------------------------------
# the MXFP4 format, from its definition (OCP MX v1.0 E2M1 elements, E8M0 scales; compressed-tensors packing)
E2M1_BY_CODE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def decode_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Element by element: byte b of row r holds column 2b in its low nibble and 2b + 1 in its high nibble;
    value = E2M1(code) * 2 ** (scale[r, c // 32] - 127)."""
    out, half = packed.shape
    w = torch.empty(out, 2 * half, dtype=torch.float64)
    for r in range(out):
        for b in range(half):
            byte = int(packed[r, b])
            for c, code in ((2 * b, byte & 15), (2 * b + 1, byte >> 4)):
                w[r, c] = E2M1_BY_CODE[code] * 2.0 ** (int(scale[r, c // 32]) - 127)
    return w


def random_mxfp4(out: int, n_in: int, gen=None):
    codes = torch.randint(0, 16, (out, n_in), generator=gen, dtype=torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    scale = torch.randint(118, 128, (out, n_in // 32), generator=gen, dtype=torch.uint8)   # 2^-9 .. 2^0
    return packed, scale


def test_mxfp4_decode_matches_the_format_definition():
    packed, scale = random_mxfp4(7, 96)
    got = mxfp4.dequantize(packed, scale)
    assert got.dtype == torch.float32
    ref = decode_mxfp4(packed, scale)
    assert torch.equal(got.double(), ref)
    assert torch.equal(torch.signbit(got), torch.signbit(ref))            # -0.0 (code 8) keeps its sign
    # by hand: byte 0x21 = low nibble 1 (0.5, column 0), high nibble 2 (1.0, column 1); byte 0xF7 = 6, -6
    p = torch.tensor([[0x21, 0xF7] + [0] * 14], dtype=torch.uint8)
    s = torch.tensor([[129]], dtype=torch.uint8)                            # 2^2
    assert mxfp4.dequantize(p, s)[0, :4].tolist() == [2.0, 4.0, 24.0, -24.0]


def test_mxfp4_encode_is_exact_on_mxfp4_values_and_rounds_to_nearest():
    packed, scale = random_mxfp4(5, 64)
    w = mxfp4.dequantize(packed, scale)
    p2, s2 = mxfp4.quantize(w)
    assert torch.equal(mxfp4.dequantize(p2, s2), w)
    assert torch.equal(torch.signbit(mxfp4.dequantize(p2, s2)), torch.signbit(w))
    x = torch.randn(3, 64)
    q = mxfp4.dequantize(*mxfp4.quantize(x)).double()
    # each element is an E2M1 value times its group's scale, the nearest one to x (checked against the grid)
    grid = torch.tensor(sorted(set(abs(v) for v in E2M1_BY_CODE)), dtype=torch.float64)
    g = x.double().view(3, 2, 32)
    sc = 2.0 ** (torch.floor(torch.log2(g.abs().amax(-1))) - 2)
    cand = torch.sign(g).unsqueeze(-1) * grid * sc.unsqueeze(-1).unsqueeze(-1)
    best = (cand - g.unsqueeze(-1)).abs().min(-1).values
    assert torch.allclose((q.view(3, 2, 32) - g).abs(), best, rtol=0, atol=1e-12)


def test_mxfp4_bad_pairs_are_errors():
    with pytest.raises(dsl.MtcError, match="weight_scale"):
        mxfp4.dequantize(torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8))
    with pytest.raises(dsl.MtcError, match="uint8"):
        mxfp4.dequantize(torch.zeros(4, 16, dtype=torch.int8), torch.zeros(4, 1, dtype=torch.uint8))
    with pytest.raises(dsl.MtcError, match="NaN"):
        mxfp4.dequantize(torch.zeros(4, 16, dtype=torch.uint8), torch.full((4, 1), 255, dtype=torch.uint8))


# ---------------------------------------------------------------------------------------------------------------
# Kimi Linear against transformers

def small_config(**kw):
    """4 layers: KDA, MLA, KDA, MLA; layer 1 dense, 2-4 MoE with 2 shared experts; odd sizes."""
    args = dict(vocab_size=97, hidden_size=48, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=4,
                num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                qk_nope_head_dim=16, v_head_dim=16, n_shared_experts=2, num_local_experts=8, num_experts_per_tok=2,
                routed_scaling_factor=2.446, linear_head_dim=16, linear_num_heads=3, rms_norm_eps=1e-5,
                layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
                mlp_layer_types=["dense", "sparse", "sparse", "sparse"], pad_token_id=0, bos_token_id=1,
                eos_token_id=2)
    args.update(kw)
    return KimiLinearConfig(**args)


def _perturb_(params):
    """Move the weights initialised to constants (norms to 1, router biases to 0) to random values, so that the
    comparison sees every weight where it enters the model."""
    with torch.no_grad():
        for name, t in params:
            if t.dtype.is_floating_point and (t.dim() <= 1 or "A_log" in name or "bias" in name):
                t.add_(torch.randn_like(t) * (0.05 if "bias" in name else 0.2))


def test_softplus_gate_is_kimi_linears_forget_gate():
    """kda_gate(gate="softplus") = KimiLinearForgetGate: -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias), A_log
    stored [1, 1, H, 1] there and [H] in mtc, dt_bias [H*K] in both; inputs past softplus' linear threshold too."""
    from backends.reference import kda_gate
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearForgetGate
    fg = KimiLinearForgetGate(small_config())
    H, K = fg.num_heads, fg.head_dim
    with torch.no_grad():
        fg.A_log.copy_(torch.rand(1, 1, H, 1) * 3)
        fg.dt_bias.copy_(torch.randn(H * K) * 4)
        fg.f_b_proj.weight.mul_(400)                          # pre-activations well past +-20
    x = torch.randn(2, 33, 48)
    with torch.no_grad():
        ref = fg(x)
        f = fg.f_b_proj(fg.f_a_proj(x)).view(2, 33, H, K)
        got = kda_gate(f, fg.A_log.view(H), fg.dt_bias, gate="softplus")
    assert (f + fg.dt_bias.view(H, K)).abs().max() > 25
    # transformers computes log(1 + exp(x)): rounding 1 + e^x to float32 is an absolute error up to 2^-24 in the
    # softplus, times exp(A_log) <= e^3 (1.2e-6); mtc against the float64 formula is held to 1e-6
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=3e-6)
    truth = -torch.exp(fg.A_log.double().view(H, 1)) * torch.nn.functional.softplus(
        f.double() + fg.dt_bias.double().view(H, K))
    torch.testing.assert_close(got.double(), truth, rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    """(transformers model, its save_pretrained directory)."""
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    hf = KimiLinearForCausalLM(small_config()).eval()
    _perturb_(list(hf.named_parameters()) + list(hf.named_buffers()))
    d = tmp_path_factory.mktemp("kl") / "ckpt"
    hf.save_pretrained(d)
    return hf, d


def _rel(a, b):
    """max |a - b| / max |b|; 0 when both are all zero (a prompt of only the pad token: transformers' padding_idx
    embedding row is zero, and so are both models' logits)."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(torch.finfo(torch.float32).tiny)).item()


def _prompts(vocab):
    return [torch.randint(0, vocab, (1, 100)), torch.randint(0, vocab, (2, 37)), torch.randint(0, vocab, (1, 1))]


def test_from_hf_logits_equal_transformers(hf_pair):
    hf, d = hf_pair
    m = dsl.from_hf(d).eval()
    assert m.hf_family == "kimi_linear" and not m.hf_report.missing and not m.hf_report.unexpected
    with torch.no_grad():
        for x in _prompts(97):
            ref = hf(x).logits
            got = m(x)
            assert got.shape == ref.shape
            assert _rel(got, ref) < 1e-5, _rel(got, ref)


def test_from_hf_other_settings_equal_transformers(tmp_path):
    """q-LoRA MLA, MLA layers no `i % k` rule gives (1 and 3 of 5: the spec lists them), two dense layers, one
    shared expert, conv width 3, KDA heads of 32."""
    cfg = small_config(num_hidden_layers=5, q_lora_rank=12, n_shared_experts=1, linear_head_dim=32,
                       linear_num_heads=2, linear_conv_kernel_dim=3, num_experts_per_tok=3,
                       layer_types=["full_attention", "linear_attention", "full_attention", "linear_attention",
                                    "linear_attention"],
                       mlp_layer_types=["dense", "dense", "sparse", "sparse", "sparse"])
    hf = KimiLinearForCausalLM(cfg).eval()
    _perturb_(list(hf.named_parameters()) + list(hf.named_buffers()))
    hf.save_pretrained(tmp_path / "c")
    assert "attn = mla if i == 1 or i == 3 else kda" in dsl.checkpoint.import_hf(tmp_path / "c")
    m = dsl.from_hf(tmp_path / "c").eval()
    x = torch.randint(0, 97, (2, 61))
    with torch.no_grad():
        assert _rel(m(x), hf(x).logits) < 1e-5


def test_from_hf_triton_interpreter_logits_equal_transformers(hf_pair):
    hf, d = hf_pair
    m = dsl.from_hf(d, target="triton").eval()
    x = torch.randint(0, 97, (1, 70))
    with torch.no_grad():
        assert _rel(m(x), hf(x).logits) < 1e-5


def test_the_router_bias_is_e_score_correction_bias(hf_pair):
    hf, d = hf_pair
    m = dsl.from_hf(d)
    for i in (1, 2, 3):
        ref = hf.model.layers[i].mlp.gate.e_score_correction_bias
        got = m.state_dict()[f"model.layers.{i}.block_sparse_moe.gate.e_score_correction_bias"]
        assert torch.equal(got, ref) and ref.abs().sum() > 0


def test_released_config_builds_the_spec_graph(tmp_path):
    """The config.json of moonshotai/Kimi-Linear-48B-A3B-Instruct (its published values) gives the graph of
    models/kimi_linear_48b.mtc."""
    cfg = {"architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "vocab_size": 163840,
           "hidden_size": 2304, "intermediate_size": 9216, "moe_intermediate_size": 1024, "num_hidden_layers": 27,
           "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 72, "kv_lora_rank": 512,
           "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
           "mla_use_nope": True, "num_experts": 256, "num_experts_per_token": 8, "num_shared_experts": 1,
           "moe_router_activation_func": "sigmoid", "moe_renormalize": True, "routed_scaling_factor": 2.446,
           "first_k_dense_replace": 1, "moe_layer_freq": 1, "num_expert_group": 1, "topk_group": 1,
           "use_grouped_topk": True, "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "rope_scaling": None,
           "model_max_length": 1048576, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
           "hidden_act": "silu", "bos_token_id": 163584, "eos_token_id": 163585, "pad_token_id": 163839,
           "num_nextn_predict_layers": 0, "use_cache": True, "initializer_range": 0.02,
           "linear_attn_config": {"full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "head_dim": 128,
                                  "kda_layers": [i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)],
                                  "num_heads": 32, "short_conv_kernel_size": 4}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    text = dsl.checkpoint.import_hf(tmp_path)
    assert dsl.parse(text).nodes == dsl.load(ROOT / "models" / "kimi_linear_48b.mtc").nodes


def test_save_hf_of_an_mtc_model_loads_in_transformers(tmp_path):
    m = dsl.compile(dsl.load(ROOT / "models" / "kimi_linear_48b.mtc", "tiny"), seed=None).eval()
    _perturb_(list(m.named_parameters()) + list(m.named_buffers()))
    m.save_hf(tmp_path / "out")
    hf = KimiLinearForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert hf.config.rms_norm_eps == 1e-5 and hf.config.layer_types[4] == "full_attention"
    with torch.no_grad():
        for x in _prompts(256):
            assert _rel(m(x), hf(x).logits) < 1e-5
    back = dsl.from_hf(tmp_path / "out")
    assert back.stages["graph"].nodes == m.stages["graph"].nodes
    a, b = m.state_dict(), back.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a if k != "balance_updates")


def test_sharded_both_ways(hf_pair, tmp_path):
    hf, _ = hf_pair
    d = tmp_path / "sharded_hf"
    hf.save_pretrained(d, max_shard_size="40KB")
    assert (d / "model.safetensors.index.json").exists()
    m = dsl.from_hf(d).eval()
    x = torch.randint(0, 97, (1, 50))
    with torch.no_grad():
        assert _rel(m(x), hf(x).logits) < 1e-5
    out = tmp_path / "sharded_mtc"
    m.save_hf(out, max_shard_size=30_000)
    idx = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(idx["weight_map"].values())) > 3
    back = dsl.from_hf(out)
    assert all(torch.equal(back.state_dict()[k], t) for k, t in m.state_dict().items())
    # saved again unsharded into the same folder: the old shards and index (mtc's own) are removed
    m.save_hf(out)
    assert not (out / "model.safetensors.index.json").exists() and (out / "model.safetensors").exists()
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]


def test_save_hf_never_replaces_a_users_file(hf_pair, tmp_path):
    _, d = hf_pair
    m = dsl.from_hf(d)
    user = tmp_path / "theirs"
    shutil.copytree(d, user)
    before = (user / "model.safetensors").read_bytes()
    with pytest.raises(dsl.MtcError, match="not written there by mtc"):
        m.save_hf(user)
    assert (user / "model.safetensors").read_bytes() == before


def test_meta_device_checks_without_reading(hf_pair):
    _, d = hf_pair
    m = dsl.from_hf(d, device="meta")
    assert all(p.is_meta for p in m.parameters())


# ---------------------------------------------------------------------------------------------------------------
# bad checkpoints

def _copy(d, tmp_path):
    out = tmp_path / "bad"
    shutil.copytree(d, out)
    return out


def _rewrite(path, fn):
    t = safetensors_torch.load_file(path)
    fn(t)
    safetensors_torch.save_file(t, path)


def test_missing_tensor(hf_pair, tmp_path):
    d = _copy(hf_pair[1], tmp_path)
    _rewrite(d / "model.safetensors", lambda t: t.pop("model.layers.2.self_attn.g_b_proj.weight"))
    with pytest.raises(dsl.MtcError, match=r"missing tensor 'model\.layers\.2\.self_attn\.g_b_proj\.weight'"):
        dsl.from_hf(d)
    with pytest.warns(dsl.errors.MtcWarning, match="g_b_proj"):
        m = dsl.from_hf(d, strict=False)
    assert m.hf_report.missing == ["model.layers.2.self_attn.g_b_proj.weight"]
    assert torch.isfinite(m.state_dict()["model.layers.2.self_attn.g_b_proj.weight"]).all()


def test_missing_expert(hf_pair, tmp_path):
    d = _copy(hf_pair[1], tmp_path)
    _rewrite(d / "model.safetensors", lambda t: t.pop("model.layers.3.block_sparse_moe.experts.5.w2.weight"))
    with pytest.raises(dsl.MtcError, match=r"experts\.5\.w2\.weight"):
        dsl.from_hf(d)


def test_unexpected_tensor(hf_pair, tmp_path):
    d = _copy(hf_pair[1], tmp_path)
    _rewrite(d / "model.safetensors", lambda t: t.update({"model.layers.0.self_attn.extra.weight": torch.ones(3)}))
    with pytest.raises(dsl.MtcError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.extra\.weight' "
                                           r"\(in model\.safetensors\)"):
        dsl.from_hf(d)
    with pytest.warns(dsl.errors.MtcWarning, match="1 checkpoint tensors not loaded"):
        m = dsl.from_hf(d, strict=False)
    assert m.hf_report.unexpected == ["model.layers.0.self_attn.extra.weight"]


def test_wrong_shape_and_dtype(hf_pair, tmp_path):
    d = _copy(hf_pair[1], tmp_path)
    q = "model.layers.1.self_attn.q_proj.weight"
    _rewrite(d / "model.safetensors", lambda t: t.update({q: torch.ones(48, 47)}))
    with pytest.raises(dsl.MtcError, match=r"model\.safetensors: tensor 'model\.layers\.1\.self_attn\.q_proj\.weight'"
                                           r" has shape \[48, 47\]; mtc's .* needs \[48, 48\]"):
        dsl.from_hf(d)
    _rewrite(d / "model.safetensors", lambda t: t.update({"model.layers.1.self_attn.q_proj.weight":
                                                          torch.ones(48, 48, dtype=torch.int32)}))
    with pytest.raises(dsl.MtcError, match=r"q_proj\.weight' has dtype I32"):
        dsl.from_hf(d)


def test_truncated_shard_and_missing_shard(hf_pair, tmp_path):
    d = tmp_path / "sh"
    hf_pair[0].save_pretrained(d, max_shard_size="40KB")
    shards = sorted(d.glob("model-*.safetensors"))
    raw = shards[1].read_bytes()
    shards[1].write_bytes(raw[: len(raw) // 2])
    with pytest.raises(dsl.MtcError, match=f"{shards[1].name}: not a complete safetensors file"):
        dsl.from_hf(d)
    shards[1].unlink()
    with pytest.raises(dsl.MtcError, match=f"index.json: tensor '.*' is in '{shards[1].name}', which does not exist"):
        dsl.from_hf(d)


def test_unsupported_config_fields(hf_pair, tmp_path):
    d = _copy(hf_pair[1], tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "sliding_window": 4096}))
    with pytest.raises(dsl.MtcError, match=r"config\.json: config field 'sliding_window' is not supported"):
        dsl.from_hf(d)
    with pytest.warns(dsl.errors.MtcWarning, match="sliding_window"):
        assert dsl.from_hf(d, strict=False).hf_report.ignored_fields == ["sliding_window"]
    (d / "config.json").write_text(json.dumps({**cfg, "hidden_act": "gelu"}))
    with pytest.raises(dsl.MtcError, match=r"field 'hidden_act' = 'gelu' is not supported"):
        dsl.from_hf(d)
    (d / "config.json").write_text(json.dumps({**cfg, "num_expert_group": 4}))
    with pytest.raises(dsl.MtcError, match=r"field 'num_expert_group' = 4 is not supported"):
        dsl.from_hf(d)
    (d / "config.json").write_text("{not json")
    with pytest.raises(dsl.MtcError, match=r"config\.json:1:2: the config\.json is not valid JSON"):
        dsl.from_hf(d)


def test_save_hf_refuses_a_model_no_family_builds(tmp_path):
    # the K3-style lower-bounded gate in a plain-residual model: transformers' Kimi Linear has no such gate
    text = (ROOT / "models" / "kimi_linear_48b.mtc").read_text().replace('gate="softplus"', "lower_bound=-5.0")
    m = dsl.compile(dsl.parse(text, "tiny"))
    with pytest.raises(dsl.MtcError, match="cannot be written as a kimi_linear checkpoint.*kda_layer"):
        m.save_hf(tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_import_hf_cli(hf_pair, tmp_path):
    out = tmp_path / "model.mtc"
    cmd = [sys.executable, "-m", "dsl.cli", "import-hf", str(hf_pair[1]), "-o", str(out)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert "norm_eps: float = 1e-05" in text and "kda_heads: int = 3" in text
    assert dsl.load(out).nodes == dsl.from_hf(hf_pair[1], device="meta").stages["graph"].nodes
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "exists" in r.stderr and out.read_text() == text


# ---------------------------------------------------------------------------------------------------------------
# Kimi K3: a tiny checkpoint under K3's names, MXFP4 experts

def k3_names(key: str, E: int):
    """This test's own reading of K3's names: mtc key -> [(checkpoint name, how)] ('row': [1, d];
    'pad': zero-padded to the head dim; 'expert j')."""
    p = "language_model."
    parts = key.split(".")
    if key.endswith(("self_attention_res.proj_weight", "mlp_res.proj_weight")):
        return [(p + key.replace("_res.proj_weight", "_res_proj.weight"), "row")]
    if key.endswith(("self_attention_res.norm_weight", "mlp_res.norm_weight")):
        return [(p + key.replace("_res.norm_weight", "_res_norm.weight"), "same")]
    if key == "model.final_attn_res.proj_weight":
        return [(p + "model.output_attn_res_proj.weight", "row")]
    if key == "model.final_attn_res.norm_weight":
        return [(p + "model.output_attn_res_norm.weight", "same")]
    if key.endswith("self_attn.A_log"):
        return [(p + key, "pad")]
    if parts[-2] == "experts":
        stem = ".".join(parts[:-1])
        return [(f"{p}{stem}.{j}.{parts[-1]}.weight", f"expert {j}") for j in range(E)]
    return [(p + key, "same")]


K3_TINY_CONFIG = {
    "model_type": "kimi_k3",
    "text_config": {
        "model_type": "kimi_linear", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 9,
        "intermediate_size": 128, "moe_intermediate_size": 32, "num_attention_heads": 2, "num_key_value_heads": 2,
        "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "mla_use_nope": True, "mla_use_output_gate": True, "num_experts": 16, "num_experts_per_token": 4,
        "num_shared_experts": 1, "routed_scaling_factor": 1.0, "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid", "first_k_dense_replace": 1, "rms_norm_eps": 1e-5,
        "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
        "routed_expert_hidden_size": 32, "latent_moe_use_norm": True, "attn_res_block_size": 3,
        "model_max_length": 4096, "tie_word_embeddings": False, "dtype": "float32",
        "linear_attn_config": {"num_heads": 2, "head_dim": 32, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
                               "use_full_rank_gate": True, "kda_layers": [1, 2, 3, 5, 6, 7],
                               "full_attn_layers": [4, 8, 9]}},
    "quantization_config": {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
                            "config_groups": {"group_0": {"targets": ["Linear"], "format": "mxfp4-pack-quantized",
                                                          "weights": {"num_bits": 4, "type": "float",
                                                                      "group_size": 32}}}},
}


@pytest.fixture(scope="module")
def k3_ckpt(tmp_path_factory):
    """(directory, the weights it holds as mtc's state dict): a random tiny K3 model (the spec's tiny variant at
    rms_norm_eps 1e-5), every routed expert random MXFP4, the vision tower's tensors beside it."""
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    text = (ROOT / "models" / "kimi_k3.mtc").read_text()
    m = dsl.compile(dsl.parse(text, "tiny", norm_eps=1e-5), seed=None)
    _perturb_(list(m.named_parameters()) + list(m.named_buffers()))
    sd, files = {}, {}
    for key, t in m.state_dict().items():
        if key == "balance_updates":
            continue
        if key.split(".")[-2] == "experts":
            E = t.shape[0]
            full = torch.empty_like(t)
            for (name, _), j in zip(k3_names(key, E), range(E)):
                packed, scale = random_mxfp4(t.shape[1], t.shape[2])
                full[j] = decode_mxfp4(packed, scale).float()
                files[name.removesuffix("weight") + "weight_packed"] = packed
                files[name.removesuffix("weight") + "weight_scale"] = scale
            sd[key] = full
            continue
        sd[key] = t.clone()
        (name, how), = k3_names(key, 0)
        files[name] = (t.reshape(1, -1) if how == "row" else
                       torch.cat([t, torch.zeros(32 - t.numel())]) if how == "pad" else t).contiguous()
    files["vision_tower.patch_embed.proj.weight"] = torch.randn(8, 3, 2, 2)
    d = tmp_path_factory.mktemp("k3") / "ckpt"
    d.mkdir()
    names = sorted(files)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for f, ns in shards.items():
        safetensors_torch.save_file({n: files[n] for n in ns}, d / f)
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: f for f, ns in shards.items() for n in ns}}))
    (d / "config.json").write_text(json.dumps(K3_TINY_CONFIG))
    return d, sd, text


def test_k3_mxfp4_checkpoint_loads(k3_ckpt):
    d, sd, text = k3_ckpt
    m = dsl.from_hf(d).eval()
    assert m.hf_family == "kimi_k3"
    assert [n for n, _ in m.hf_report.skipped] == ["vision_tower.patch_embed.proj.weight"]
    got = m.state_dict()
    assert all(torch.equal(got[k], v) for k, v in sd.items()), [k for k, v in sd.items() if not torch.equal(got[k], v)]
    # the same model built from the spec file with these weights: the same logits, bit for bit
    ref = dsl.compile(dsl.parse(text, "tiny", norm_eps=1e-5)).eval()
    ref.load_state_dict({**sd, "balance_updates": ref.balance_updates})
    assert m.stages["graph"].nodes == dsl.parse(text, "tiny", norm_eps=1e-5, expert_dtype="mxfp4").nodes
    x = torch.randint(0, 256, (2, 41))
    with torch.no_grad():
        assert torch.equal(m(x), ref(x))


def test_k3_round_trip_is_bit_exact(k3_ckpt, tmp_path):
    d, sd, _ = k3_ckpt
    m = dsl.from_hf(d)
    m.save_hf(tmp_path / "k3", max_shard_size="100KB")
    cfg = json.loads((tmp_path / "k3" / "config.json").read_text())
    assert cfg["quantization_config"]["format"] == "mxfp4-pack-quantized"
    assert cfg["text_config"]["attn_res_block_size"] == 3
    from safetensors import safe_open
    idx = json.loads((tmp_path / "k3" / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(tmp_path / "k3" / idx["language_model.model.output_attn_res_proj.weight"], "pt") as f:
        assert f.get_slice("language_model.model.output_attn_res_proj.weight").get_shape() == [1, 64]
    assert "language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight_packed" in idx
    back = dsl.from_hf(tmp_path / "k3")
    a, b = m.state_dict(), back.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in sd)
    # dense experts (expert_format="dense"): the same weights, then the config declares no quantization
    m.save_hf(tmp_path / "k3d", expert_format="dense")
    assert "quantization_config" not in json.loads((tmp_path / "k3d" / "config.json").read_text())
    back = dsl.from_hf(tmp_path / "k3d")
    assert all(torch.equal(back.state_dict()[k], a[k]) for k in sd)


def test_k3_mxfp4_loads_packed_with_the_decoded_logits(k3_ckpt):
    """dequantize=False keeps the checkpoint's bytes (uint8 weight_packed / weight_scale per MoE weight, stacked
    over the experts) and gives the logits of the decoded load (float32, rel 1e-5; the Triton W4A16 kernels:
    tests/test_moe_mxfp4.py)."""
    from safetensors import safe_open
    d, sd, _ = k3_ckpt
    m = dsl.from_hf(d, dequantize=False).eval()
    dense = dsl.from_hf(d).eval()
    got = m.state_dict()
    key = "model.layers.1.block_sparse_moe.experts.w2"
    assert key not in got and got[key + ".weight_packed"].dtype == torch.uint8
    idx = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    name = "language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight_packed"
    with safe_open(d / idx[name], "pt") as f:
        assert torch.equal(got[key + ".weight_packed"][3], f.get_tensor(name))
    x = torch.randint(0, 256, (2, 23))
    with torch.no_grad():
        a, b = m(x), dense(x)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


def test_k3_packed_round_trip_is_bit_exact(k3_ckpt, tmp_path):
    d, sd, _ = k3_ckpt
    m = dsl.from_hf(d, dequantize=False)
    m.save_hf(tmp_path / "k3")
    back = dsl.from_hf(tmp_path / "k3", dequantize=False)
    a, b = m.state_dict(), back.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    m.save_hf(tmp_path / "k3d", expert_format="dense")             # decoded on export: the dense load's weights
    again = dsl.from_hf(tmp_path / "k3d").state_dict()
    assert all(torch.equal(again[k], v) for k, v in sd.items())
    with pytest.raises(dsl.MtcError, match="dequantize must be True or False"):
        dsl.from_hf(d, dequantize="no")


def test_k3_bad_padding_and_packed_without_quantization(k3_ckpt, tmp_path):
    d = _copy(k3_ckpt[0], tmp_path)
    f = next(p for p in d.glob("model-*.safetensors")
             if "language_model.model.layers.0.self_attn.A_log" in safetensors_torch.load_file(p))
    _rewrite(f, lambda t: t["language_model.model.layers.0.self_attn.A_log"].__setitem__(5, 1.0))
    with pytest.raises(dsl.MtcError, match="nonzero values past its 2 heads"):
        dsl.from_hf(d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("quantization_config")
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(dsl.MtcError, match="MXFP4-packed but config.json declares no MXFP4"):
        dsl.from_hf(d)


def test_k3_released_config_builds_the_spec_graph(tmp_path):
    """K3's config values (spec/MODEL.md) give the graph of models/kimi_k3.mtc."""
    t = dict(K3_TINY_CONFIG["text_config"], vocab_size=163840, hidden_size=7168, num_hidden_layers=93,
             intermediate_size=33792, moe_intermediate_size=3072, num_attention_heads=96, num_key_value_heads=96,
             q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
             num_experts=896, num_experts_per_token=16, num_shared_experts=2, routed_expert_hidden_size=3584,
             attn_res_block_size=12, model_max_length=1048576, dtype="bfloat16",
             linear_attn_config={"num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4,
                                 "gate_lower_bound": -5.0, "use_full_rank_gate": True,
                                 "full_attn_layers": [*range(4, 93, 4), 93],
                                 "kda_layers": [i for i in range(1, 94) if i % 4 and i != 93]})
    (tmp_path / "config.json").write_text(json.dumps({**K3_TINY_CONFIG, "text_config": t}))
    assert dsl.parse(dsl.checkpoint.import_hf(tmp_path)).nodes == dsl.load(ROOT / "models" / "kimi_k3.mtc").nodes


# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-3), (torch.bfloat16, 2e-2)])
def test_gpu_from_hf_triton_matches_transformers(hf_pair, dtype, tol):
    """On the GPU: the checkpoint loaded straight to cuda, Triton target, against transformers on the CPU in
    float32 (the float32 tolerance leaves room for TF32 matmuls)."""
    hf, d = hf_pair
    m = dsl.from_hf(d, target="triton", device="cuda", dtype=dtype).eval()
    assert all(p.device.type == "cuda" for p in m.parameters())
    x = torch.randint(0, 97, (2, 300))
    with torch.no_grad():
        ref = hf(x).logits
        got = m(x.cuda()).float().cpu()
    # the mean error, not the largest: rounding (bf16, or the TF32 tensor-core products of float32 on the GPU) may
    # switch a near-tied expert for a few tokens, which moves those tokens' logits by several percent
    err = ((got - ref).abs().mean() / ref.abs().mean()).item()
    assert err < tol, err
