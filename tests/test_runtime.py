"""dsl.compile(target="reference"): a runnable module with HF-style names, sane initialisation, the QB
bias as a buffer, routing statistics, and the full model on meta tensors."""
import math
import re
from pathlib import Path

import pytest
import torch

import dsl
from backends import reference as R
from dsl.errors import MtcWarning
from passes.stats import compute_stats

ROOT = Path(__file__).resolve().parent.parent
K3 = ROOT / "models" / "kimi_k3.mtc"


@pytest.fixture(scope="module")
def tiny():
    return dsl.compile(dsl.load(K3, "tiny"), target="reference").eval()


def test_tiny_forward(tiny):
    ids = torch.randint(0, 256, (2, 100))
    logits = tiny(ids)
    assert logits.shape == (2, 100, 256) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 256), ids[:, 1:].reshape(-1))
    # small-std initialisation: near-uniform predictions at the start
    assert abs(loss.item() - math.log(256)) < 0.3


def test_causality(tiny):
    ids = torch.randint(0, 256, (1, 70))
    a = tiny(ids)
    ids2 = ids.clone()
    ids2[0, 50:] = torch.randint(0, 256, (20,))
    b = tiny(ids2)
    assert torch.allclose(a[0, :50], b[0, :50], atol=1e-5)
    assert not torch.allclose(a[0, 50:], b[0, 50:])


def test_state_dict_names_and_initialisation(tiny):
    sd = tiny.state_dict()
    for key in ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.A_log",
                "model.layers.0.self_attn.dt_bias", "model.layers.0.self_attn.o_norm.weight",
                "model.layers.0.self_attn.q_conv1d.weight", "model.layers.0.mlp.gate_proj.weight",
                "model.layers.3.self_attn.kv_a_proj_with_mqa.weight", "model.layers.3.self_attn.q_a_layernorm.weight",
                "model.layers.1.block_sparse_moe.routed_expert_down_proj.weight",
                "model.layers.1.block_sparse_moe.experts.w1", "model.layers.1.self_attention_res.proj_weight",
                "model.layers.1.mlp_res.norm_weight", "model.final_attn_res.proj_weight"]:
        assert key in sd, key
    # pseudo-queries start at zero; the router bias is a buffer (in the state dict, not a parameter)
    assert all(torch.count_nonzero(v) == 0 for k, v in sd.items() if k.endswith("res.proj_weight"))
    bias = "model.layers.1.block_sparse_moe.gate.e_score_correction_bias"
    assert bias in sd and bias not in dict(tiny.named_parameters())
    assert tiny.state_dict()["model.layers.0.self_attn.q_conv1d.weight"].shape == (64, 1, 4)


def _kda_gate_params(m):
    sd = dict(m.named_parameters())
    return [(sd[k], sd[k.replace("A_log", "dt_bias")]) for k in sd if k.endswith("self_attn.A_log")]


def test_sigmoid_decay_gate_starts_open_to_learning():
    # gate "sigmoid" (K3's): at initialisation g = lower_bound * sigmoid(exp(A_log) (x + dt_bias)) must sit inside
    # (lower_bound, 0), away from 0 (forgetting happens) and from the bound, with a gradient reaching A_log and
    # dt_bias. (Mamba's softplus-gate initialisation inside the sigmoid gave g ~ -1e-5 and ~1e-5 gradients.)
    m = dsl.compile(dsl.load(K3, "tiny"), target="reference", seed=int(torch.randint(0, 2**31, ())))
    gates = _kda_gate_params(m)
    assert gates
    for a_log, dt in gates:
        h = a_log.shape[0]
        x = torch.randn(1, 16, h, dt.shape[0] // h) * 0.1
        g = R.kda_gate(x, a_log, dt, lower_bound=-5.0)
        assert float(g.max()) < -5e-4 and float(g.min()) > -2.0, (float(g.min()), float(g.max()))
        assert float(g.min()) < 10 * float(g.max())             # a spread of decay rates, not one value
    ids = torch.randint(0, 256, (1, 64))
    loss = torch.nn.functional.cross_entropy(m(ids)[0, :-1], ids[0, 1:])
    loss.backward()
    q = dict(m.named_parameters())["model.layers.0.self_attn.q_proj.weight"].grad.abs().max()
    a_log, dt = gates[0]
    # (over 20 seeds the ratios to q_proj's gradient were >= 5e-3 for A_log and >= 7e-3 for dt_bias; the
    # softplus initialisation's gradients were ~2e-5 of it. A bound of 1e-2 for A_log failed ~1 seed in 10.)
    assert float(a_log.grad.abs().max()) > 1e-3 * float(q) and float(dt.grad.abs().max()) > 1e-3 * float(q)


def test_softplus_decay_gate_keeps_the_mamba_initialisation(tmp_path):
    spec = K3.read_text().replace("lower_bound=lower_bound,", 'gate="softplus",', 1)
    assert spec != K3.read_text()
    f = tmp_path / "k3_softplus.mtc"
    f.write_text(spec)
    m = dsl.compile(dsl.load(f, "tiny"), target="reference")
    for a_log, dt in _kda_gate_params(m):
        assert float(a_log.min()) >= 0.0 and float(a_log.max()) <= math.log(16.0) + 1e-6   # A in [1, 16]
        sp = torch.nn.functional.softplus(dt)                                             # dt in [1e-3, 0.1]
        assert float(sp.min()) >= 1e-3 * (1 - 1e-4) and float(sp.max()) <= 0.1 * (1 + 1e-4)


def test_zero_queries_make_attn_res_a_mean():
    """With zero pseudo-queries every AttnRes read is the plain mean of its sources (softmax of equal
    logits) - checked through the module against the reference op on a one-block model."""
    q = torch.zeros(16)
    srcs = [torch.randn(3, 16) for _ in range(4)]
    out = R.attn_residual(q, srcs, torch.ones(16))
    assert torch.allclose(out, torch.stack(srcs).mean(0), atol=1e-6)


def test_weights_move_between_compiles(tiny):
    other = dsl.compile(dsl.load(K3, "tiny"), target="reference", seed=123).eval()
    ids = torch.randint(0, 256, (1, 40))
    assert not torch.allclose(other(ids), tiny(ids))
    other.load_state_dict(tiny.state_dict())
    assert torch.equal(other(ids), tiny(ids))


def test_routing_stats_and_qb_update():
    m = dsl.compile(dsl.load(K3, "tiny"), target="reference", seed=1)
    ids = torch.randint(0, 256, (2, 64))
    m.eval()
    m(ids)
    loads = m.routing_stats
    assert len(loads) == 8
    for v in loads.values():
        assert v.shape == (16,) and int(v.sum()) == 2 * 64 * 4    # N tokens x top-4
    key = "model.layers.1.block_sparse_moe.gate.e_score_correction_bias"
    before = m.state_dict()[key].clone()
    m(ids)
    assert torch.equal(m.state_dict()[key], before)             # eval: no update
    m.train()
    with torch.no_grad():
        m(ids)
    after = m.state_dict()[key]
    assert not torch.equal(after, before)
    assert abs(float(after.mean())) < 1e-5                      # QB centres the bias


def test_full_model_on_meta_matches_stats():
    g = dsl.load(K3)
    m = dsl.compile(g, device="meta")
    from backends.mxfp4 import MXFP4Experts
    packed = [w for w in m.modules() if isinstance(w, MXFP4Experts)]     # (the release's MXFP4 routed experts:
    assert packed                                                           # frozen buffers, logical shape [E, o, i])
    n = sum(p.numel() for p in m.parameters()) + sum(math.prod(w.shape) for w in packed)
    assert n == compute_stats(g).total_params
    assert all(t.device.type == "meta" for t in (*m.parameters(), *m.buffers()))


def test_kimi_linear_tiny_runs():
    m = dsl.compile(dsl.load(ROOT / "models" / "kimi_linear_48b.mtc", "tiny"))
    out = m(torch.randint(0, 256, (1, 65)))
    assert out.shape == (1, 65, 256) and torch.isfinite(out).all()


def test_bad_inputs_are_clear_errors(tiny):
    with pytest.raises(dsl.MtcError, match="rank 2"):
        tiny(torch.randint(0, 256, (5,)))
    with pytest.raises(dsl.MtcError, match="must be an int64 or int32 tensor"):
        tiny(torch.randn(1, 5))
    with pytest.raises(IndexError, match="token id 300"):
        tiny(torch.tensor([[1, 300]]))
    with pytest.raises(dsl.MtcError, match="unknown target"):
        dsl.compile(dsl.load(K3, "tiny"), target="cuda")
    with pytest.raises(dsl.MtcError, match="did you mean 'tvm'"):
        dsl.compile(dsl.load(K3, "tiny"), target="TVM")
    for target in ("reference", "triton", "tvm"):   # no float64 model: refused at compile, not at the forward
        with pytest.raises(dsl.MtcError, match="dtype float64: not offered"):
            dsl.compile(dsl.load(K3, "tiny"), target=target, dtype="f64")


def test_cli_main_job_runs(tmp_path):
    import subprocess, sys, json
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, "-m", "dsl.cli", "run", "--max-tokens", "2000", "--json", str(out)],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert math.isfinite(res["loss"]) and 4.5 < res["loss"] < 6.5 and res["model"] == "kimi_k3.tiny"
    assert "expert load" in r.stdout


def test_gate_bound_below_the_dense_tiles_limit_takes_the_safe_path():
    # lower_bound < -10: legal for the gate, too wide for kda_chunk's dense diagonal tiles; the triton target warns at
    # the spec line at compile time and runs the kernel's safe path (the reference's result), not an error at the
    # first forward
    g = dsl.load(K3, "tiny", lower_bound=-20.0)
    with pytest.warns(MtcWarning, match=r"kimi_k3\.mtc:\d+:\d+: warning: .*lower_bound = -20.0 is below -10"):
        mt = dsl.compile(g, target="triton", seed=3)
    mr = dsl.compile(g, target="reference", seed=3)
    ids = torch.randint(0, 256, (1, 70))
    with torch.no_grad():
        assert torch.allclose(mt(ids), mr(ids), rtol=1e-4, atol=1e-4)


def test_triton_target_rejects_head_dims_its_kernels_cannot_take():
    spec = """model m {
  forward(input_ids: i64[B, T]) {
    x = embedding(input_ids, vocab=256, dim=48)
    y = kda_layer(x, heads=5, head_dim=7, name="l0")
    return lm_head(y, vocab=256)
  }
}
"""
    g = dsl.parse(spec, file="m.mtc")
    dsl.compile(g, target="reference")                     # the reference takes any width
    dsl.compile(g, target="triton")                        # head_dim 7: zero-padded to 16 by kda_chunk
    g = dsl.parse(spec.replace("heads=5, head_dim=7", "heads=1, head_dim=300").replace("dim=48", "dim=300"),
                  file="m.mtc")
    with pytest.raises(dsl.MtcError, match="takes head_dim \\(K\\) up to 256, got 300") as ei:
        dsl.compile(g, target="triton")
    assert (ei.value.loc.line, ei.value.loc.col) == (4, 9)


def test_empty_input_and_empty_graph_are_errors(tiny):
    with pytest.raises(dsl.MtcError, match="is empty"):
        tiny(torch.randint(0, 256, (1, 0)))
    with pytest.raises(dsl.MtcError, match="at least one output"):
        dsl.GraphBuilder("g").build([])


def test_bad_devices_are_clear_errors():
    g = dsl.load(K3, "tiny")
    for dev, msg in (("tpu", "unknown device 'tpu'"), ("xla", "mtc runs on 'cpu', 'cuda'")):
        with pytest.raises(dsl.MtcError, match=msg):
            dsl.compile(g, device=dev)
    if not torch.cuda.is_available():
        with pytest.raises(dsl.MtcError, match="no CUDA device"):
            dsl.compile(g, device="cuda")
    with pytest.raises(dsl.MtcError) as e:                 # without torch's list of every device type it knows
        dsl.compile(g, device="xyz")
    assert str(e.value).endswith("unknown device 'xyz': use 'cpu', 'cuda', 'cuda:N' or 'meta'")


def test_a_model_too_big_for_the_machine_is_refused_before_allocating():
    """The full K3 (2.78 T parameters) on the CPU: an MtcError pointing at device='meta' before any weight is
    allocated (new-user trial, 16th session: ~40 GB allocated over 33 s, then a raw allocator error)."""
    g = dsl.load(K3)
    with pytest.raises(dsl.MtcError, match=r"model 'kimi_k3' has 2,779,484,393,568 parameters: .* of weights in "
                                           r"float32, more than this machine holds .*device='meta' builds it"):
        dsl.compile(g)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is the CPU path")
def test_bf16_under_the_triton_interpreter_is_refused():
    """Triton's interpreter computes bf16 tl.dot wrongly: compiling or converting a triton-target model to
    bf16 on the CPU is an error, not silently wrong logits; the kernels refuse bf16 dot operands too."""
    import backends.triton as T
    g = dsl.load(K3, "tiny")
    with pytest.raises(dsl.MtcError, match="bfloat16 tl.dot wrongly"):
        dsl.compile(g, target="triton", dtype="bf16")
    m = dsl.compile(g, target="triton").eval().to(torch.bfloat16)
    with pytest.raises(dsl.MtcError, match="bfloat16 tl.dot wrongly"), torch.no_grad():
        m(torch.randint(0, 256, (1, 5)))
    q = torch.randn(1, 7, 1, 16).bfloat16()
    with pytest.raises(TypeError, match="kda_chunk: q in bfloat16"):
        T.kda_chunk(q, q, q, -torch.rand(1, 7, 1, 16), torch.rand(1, 7, 1))
    with pytest.raises(TypeError, match="qb_route: x in bfloat16"):
        T.qb_route(torch.randn(5, 16).bfloat16(), torch.randn(8, 16), torch.zeros(8), top_k=2)
    # float16 is computed right there: same picks as the reference
    x, w = torch.randn(9, 16), torch.randn(8, 16)
    assert torch.equal(T.qb_route(x.half(), w, torch.zeros(8), top_k=2)[0].sort(1).values,
                       R.qb_route(x.half().float(), w.half().float(), torch.zeros(8), top_k=2)[0].sort(1).values)


def test_target_tvm_without_tvm_is_a_clear_error(monkeypatch):
    import backends.tvm
    monkeypatch.setattr(backends.tvm, "available", lambda: False)
    with pytest.raises(dsl.MtcError, match=r"needs Apache TVM .*pip install"):
        dsl.compile(dsl.load(K3, "tiny"), target="tvm")


def test_tvm_ir_stage_and_unknown_stage(tiny):
    text = tiny.ir("tvm")
    assert text.startswith("# ") and "@T.prim_func" in text and "def rmsnorm" in text
    assert "'dtype': 'float32'" in text and "'dtype': 'float16'" not in text
    half = dsl.compile(dsl.load(K3, "tiny"), target="reference", dtype="f16").ir("tvm")   # the module's dtype
    assert "'dtype': 'float16'" in half and "'dtype': 'float32'" not in half and '"float16")' in half
    with pytest.raises(dsl.MtcError, match="stages: graph, typed, canonical, fused, lowered, tvm"):
        tiny.ir("nope")


def test_past_max_seq_len_warns_once():
    m = dsl.compile(dsl.load(K3, "tiny"), target="reference").eval()
    ids = torch.randint(0, 256, (1, 4100))
    from dsl.errors import MtcWarning
    with pytest.warns(MtcWarning, match="4100 tokens per sequence is past the spec's max_seq_len = 4096") as rec:
        with torch.no_grad():
            m(ids)
    assert [w.filename for w in rec] == [__file__]   # attributed to the caller's line, not torch's Module call
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            m(ids[:, :4096])
            m(ids)                                  # once per module


def test_route_margins_with_every_expert_chosen_is_inf():
    # top_k == experts: no (k+1)-th score to compare, no choice that rounding could flip
    spec = """model manye {
  config {
    d: int = 32
  }
  block kda = kda_layer(heads=2, head_dim=16)
  block moe = moe(experts=4, top_k=4, inter=8)
  forward(input_ids: i64[B, T]) {
    x = embedding(input_ids, vocab=256, dim=d)
    x = stack(x, layers=1) {
      attn = kda
      ffn = moe
    }
    return lm_head(rmsnorm(x), vocab=256)
  }
}"""
    m = dsl.compile(dsl.parse(spec))
    margins = m.route_margins(torch.randint(0, 256, (1, 5)))
    assert margins and all(v == float("inf") for v in margins.values())


def test_route_margins_of_a_model_with_two_inputs():
    """Inputs by name, as for m.run (new-user trial, 16th session: only m.route_margins(ids) existed, and its error
    advised m.run); the margin equals the one of a one-input model fed the same router input."""
    g = dsl.parse("model two {\n  block m = moe(experts=4, top_k=2, inter=8)\n  forward(a: i64[B, T], "
                  "y: f32[B, T, 32]) {\n    x = add(embedding(a, vocab=256, dim=32), y)\n"
                  "    return lm_head(rmsnorm(m(x)), vocab=256)\n  }\n}\n")
    m = dsl.compile(g, seed=3)
    a, y = torch.randint(0, 256, (2, 9)), torch.randn(2, 9, 32)
    with pytest.raises(dsl.MtcError, match=r"this graph takes 2 inputs: pass them by name, m.route_margins\(a=..., "
                                           r"y=...\)"):
        m.route_margins(a)
    margins = m.route_margins(a=a, y=y)
    assert set(margins) == {"block_sparse_moe"} and 0 <= margins["block_sparse_moe"] < math.inf
    one = dsl.compile(dsl.parse("model one {\n  block m = moe(experts=4, top_k=2, inter=8)\n  forward(a: i64[B, T]) {"
                                "\n    x = embedding(a, vocab=256, dim=32)\n    return lm_head(rmsnorm(m(x)), "
                                "vocab=256)\n  }\n}\n"), seed=3)
    one.load_state_dict(m.state_dict())
    # feed y = 0 to the two-input model: the same router input as the one-input model's
    assert m.route_margins(a=a, y=torch.zeros_like(y)) == pytest.approx(one.route_margins(a), rel=1e-6)
    with pytest.raises(dsl.MtcError, match="route_margins takes the input tensor"):
        one.route_margins(a, a=a)


def test_route_margins_probe_is_exact_and_changes_nothing():
    m = dsl.compile(dsl.load(K3, "tiny"), target="reference")         # train mode: a forward moves QB biases
    ids = torch.randint(0, 256, (2, 41))
    with torch.no_grad():
        m(torch.randint(0, 256, (1, 9)))                             # (a train-mode forward: the biases move)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    stats = {k: v.clone() for k, v in m.routing_stats.items()}
    calls = []
    m.stats_hooks.append(lambda layer, load: calls.append(layer))
    margins = m.route_margins(ids)
    assert m.training and all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    assert set(margins) == {layer for layer, _ in m._router_layers.values()}
    # a probe: no hook call, and routing_stats still those of the last forward
    assert calls == [] and set(stats) == set(m.routing_stats)
    assert all(torch.equal(stats[k], m.routing_stats[k]) for k in stats)
    # independent: recompute layer 1's router input by hand from the recorded node inputs
    seen = {}
    m.eval()
    with torch.no_grad(), m.tracing(values=True) as trace:
        m(ids)
    for t in trace:
        if t.node.op == "qb_route":
            x, w, b = t.args
            seen[m._router_layers[t.node.name][0]] = (x.reshape(-1, x.shape[-1]).double(), w.double(), b.double(),
                                                      t.node.attr("top_k"))
    for layer, (x, w, b, k) in seen.items():
        s = torch.sigmoid(x @ w.t()) + b
        top = s.sort(dim=-1, descending=True).values
        assert margins[layer] == pytest.approx(float((top[:, k - 1] - top[:, k]).min()), abs=1e-6)


def test_multi_input_graph_runs_through_run_and_forward_says_so():
    g = dsl.parse("model two {\n  forward(a: f32[B, T, 8], b: f32[B, T, 8]) {\n    return add(a, b), mul(a, b)\n"
                  "  }\n}\n")
    m = dsl.compile(g)
    a, b = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    with pytest.raises(dsl.MtcError, match=r"call m.run\(a=..., b=...\)"):
        m(a)
    s, p = m.run(a=a, b=b)
    assert torch.equal(s, a + b) and torch.equal(p, a * b)
    with pytest.raises(dsl.MtcError, match=r"takes 2 inputs \(a, b\): call m.run\(a=..., b=...\)"):
        m(a, b)                                    # positional tensors: the same pointer to m.run
    one = dsl.compile(dsl.parse("model one {\n  forward(x: f32[B, 8]) {\n    return silu(x)\n  }\n}\n"))
    with pytest.raises(dsl.MtcError, match=r"takes one input \(x\); got 2 positional tensors"):
        one(a[0], a[0])
    assert torch.allclose(one(a[0]), torch.nn.functional.silu(a[0]))


def test_run_refuses_unknown_inputs_and_compile_refuses_a_path(tiny):
    from dsl.errors import MtcError
    ids = torch.randint(0, 256, (1, 9))
    with pytest.raises(dsl.MtcError, match=r"'input_id' is not an input of this graph \(did you mean 'input_ids'\?\); its inputs: input_ids"):
        tiny.run(input_ids=ids, input_id=ids)
    with pytest.raises(dsl.MtcError, match=r"input 'input_ids' must be an int64 or int32 tensor \(i64\[B, T\]\), got torch.float32"):
        tiny.run(input_ids=ids.float())
    out = tiny.run(input_ids=ids)
    assert torch.equal(out[0] if isinstance(out, (list, tuple)) else out, tiny(ids))
    with pytest.raises(TypeError, match=r"dsl.compile takes a Graph .* got str \(a path: dsl.compile\(dsl.load\("):
        dsl.compile(str(K3))


def test_one_seed_gives_one_model_in_every_dtype():
    # initial weights are drawn in float32 and rounded, so the compile dtype does not change the model
    g = dsl.load(K3, "tiny")
    a = dsl.compile(g, seed=3).state_dict()
    for dt, tol in ((torch.bfloat16, 2 ** -8), (torch.float16, 2 ** -10)):
        b = dsl.compile(g, seed=3, dtype=dt).state_dict()
        for k, v in a.items():
            if v.is_floating_point():
                err = float((b[k].double() - v.double()).abs().max() / v.double().abs().max().clamp_min(1e-30))
                assert err <= tol, (dt, k, err)


@pytest.mark.parametrize("kw,needle", [(dict(dtype=torch.int32), "a model computes in float32, bfloat16 or float16"),
                                       (dict(dtype=torch.float64), "the reference ops compute in float32"),
                                       (dict(seed="a"), "seed 'a': an integer"), (dict(seed=-1), "seed -1"),
                                       (dict(seed=True), "seed True"),
                                       (dict(dtype="float128"), "dtype 'float128': not a model dtype; a model computes "
                                                                "in f32, bf16 or f16"),
                                       (dict(dtype="mxfp4"), "dtype 'mxfp4': not a model dtype"),
                                       (dict(target=None), "target must be a string, one of reference, triton, tvm"),
                                       (dict(dtyp="bf16"), "dsl.compile: unknown option 'dtyp' (did you mean 'dtype'?); "
                                                           "options: target, dtype, device, seed")])
def test_compile_rejects_a_bad_dtype_or_seed(kw, needle):
    with pytest.raises(dsl.MtcError, match=re.escape(needle)):
        dsl.compile(dsl.load(K3, "tiny"), **kw)


def test_inputs_multi_output_and_module_dtype():
    m = dsl.compile(dsl.parse("""model t {
  forward(x: f32[B, 16]) {
    return silu(x), sigmoid(x)
  }
}"""))
    x = torch.randn(3, 16)
    y = m(x)                                   # several outputs: a tuple
    assert isinstance(y, tuple) and len(y) == 2 and y[0].dtype == torch.float32
    torch.testing.assert_close(y[1], torch.sigmoid(x))
    with pytest.raises(dsl.MtcError, match=r"input 'x' must be a float tensor \(f32\[B, 16\]\), got torch.int64"):
        m(torch.ones(3, 16, dtype=torch.int64))
    k3 = dsl.compile(dsl.load(K3, "tiny"))
    with pytest.raises(dsl.MtcError, match="must be an int64 or int32 tensor"):
        k3(torch.zeros(1, 5, dtype=torch.uint8))
    k3.to(torch.float16)                       # m.dtype follows the weights
    assert k3.dtype == torch.float16
    k3.float()
    assert k3.dtype == torch.float32


def test_slice_past_a_symbolic_dimension_names_the_spec_line(tmp_path):
    spec = tmp_path / "sl.mtc"
    spec.write_text("model t {\n  forward(x: f32[B, T, 64]) {\n    return slice(x, start=2, end=10, dim=1)\n  }\n}\n")
    m = dsl.compile(dsl.load(spec))
    x = torch.randn(2, 12, 64)
    torch.testing.assert_close(m(x), x[:, 2:10])
    with pytest.raises(dsl.MtcError, match=r"slice \[2:10\] needs dimension T >= 10, but this input has 5") as ei:
        m(torch.randn(2, 5, 64))
    assert ei.value.loc is not None and (ei.value.loc.line, ei.value.loc.col) == (3, 12)


def _one_ffn():
    """A compiled model of one gated FFN on a float input x [B, T, 32]."""
    return dsl.compile(dsl.parse("""model m {
  forward(x: f32[B, T, 32]) {
    return glu_ffn(x, inter=64, name="f")
  }
}"""))


def test_no_float64_module_or_input():
    # compile refuses float64 (the kernels take float32 / float16 / bfloat16): so do m.double(), m.to(float64) and a
    # float64 input, with the module left as it was
    m = _one_ffn()
    x = torch.randn(2, 7, 32)
    want = m(x)
    for bad in (lambda: m.double(), lambda: m.to(torch.float64), lambda: m.to("cpu", torch.float64)):
        with pytest.raises(dsl.MtcError, match="dtype float64 is not offered .* the module stays float32"):
            bad()
    assert m.dtype == torch.float32 and all(p.dtype == torch.float32 for p in m.parameters())
    with pytest.raises(dsl.MtcError, match=r"input 'x' is float64: the model computes in float32 .* x\.to\("):
        m(x.double())
    assert torch.equal(m(x), want)
    assert m.to(torch.bfloat16).dtype == torch.bfloat16        # the offered dtypes still convert


def test_nan_or_inf_in_a_float_input_is_named():
    m = _one_ffn()
    x = torch.randn(2, 9, 32)
    t, c = int(torch.randint(0, 9, ())), int(torch.randint(0, 32, ()))
    for v in (float("nan"), float("inf"), -float("inf")):
        xb = x.clone()
        xb[1, t, c] = v
        with pytest.raises(dsl.MtcError, match=rf"input 'x' holds NaN or inf \(first at index \[1, {t}, {c}\]"):
            m(xb)


@pytest.mark.parametrize("bad", [-3, 2.5, True, "3"])
def test_balance_warmup_must_be_a_count(bad):
    m = dsl.compile(dsl.load(K3, "tiny"), target="reference").train()
    with pytest.raises(ValueError, match=r"balance_warmup must be an integer >= 0 .* got " + re.escape(repr(bad))):
        m.balance_warmup = bad
    assert m.balance_warmup == 3


@pytest.mark.parametrize("bad", [5, "world", 0.5, True])
def test_dp_group_that_is_a_plain_value_is_refused_when_set(bad):
    m = dsl.compile(dsl.load(K3, "tiny"), target="reference")
    with pytest.raises(ValueError, match="dp_group must be a torch.distributed process group or None"):
        m.dp_group = bad
    assert m.dp_group is None


def test_whole_module_pickles_and_resumes_training(tmp_path):
    # torch.save(m) keeps the graph, weights and the balancing state (counts, ema schedule); the loaded module
    # gives the same logits and, trained one more step beside the original, the same biases
    import io
    m = dsl.compile(dsl.load(K3, "tiny"), target="reference", seed=3)
    ids = torch.randint(0, 256, (2, 61))
    for _ in range(2):                              # two QB updates: past the ema-0 warm-up's first step
        m(ids).float().sum().backward()
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    m2 = torch.load(buf, weights_only=False)
    assert m2._updates == m._updates and torch.equal(m2.balance_updates, m.balance_updates)
    with torch.no_grad():
        assert torch.equal(m.eval()(ids), m2.eval()(ids))
    m.train(), m2.train()
    ids2 = torch.randint(0, 256, (2, 61))
    m(ids2).float().sum().backward()
    m2(ids2).float().sum().backward()
    sd, sd2 = m.state_dict(), m2.state_dict()
    biases = [key for _, key in m._router_layers.values()]
    assert biases and all(sd[k].abs().sum() > 0 for k in biases)     # the QB updates moved them
    assert sd.keys() == sd2.keys() and all(torch.equal(sd[k], sd2[k]) for k in sd)


def test_pickling_refuses_what_does_not_travel():
    import io
    m = dsl.compile(dsl.load(K3, "tiny"), target="reference")
    m.stats_hooks.append(lambda layer, load: None)
    with pytest.raises(dsl.MtcError, match=r"stats_hooks\[0\].*cannot be pickled.*stats_hooks.clear\(\)"):
        torch.save(m, io.BytesIO())
    m.stats_hooks.clear()
    m.dp_group = object()                           # stands in for a torch.distributed process group
    with pytest.raises(dsl.MtcError, match="dp_group set cannot be pickled"):
        torch.save(m, io.BytesIO())
    m.dp_group = None
    torch.save(m, io.BytesIO())


def test_a_raising_stats_hook_leaves_a_whole_forward():
    # the hooks run after the forward: one that raises at the second router leaves every router's bias updated,
    # as the same forward without hooks does, and its error names the hook and the layer
    a = dsl.compile(dsl.load(K3, "tiny"), target="reference", seed=5)
    b = dsl.compile(dsl.load(K3, "tiny"), target="reference", seed=5)
    seen = []

    def picky(layer, load):
        seen.append(layer)
        if len(seen) == 2:
            raise RuntimeError("hook failed")
    a.stats_hooks.append(picky)
    ids = torch.randint(0, 256, (2, 40))
    with pytest.raises(RuntimeError, match="hook failed") as ei:
        a(ids)
    assert any("stats_hooks[0]" in note and seen[1] in note and "completed" in note for note in ei.value.__notes__)
    b(ids)
    sa, sb = a.state_dict(), b.state_dict()
    assert len(a._router_layers) > 2 and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert a._updates == b._updates and a.routing_stats.keys() == b.routing_stats.keys()


def test_nan_arising_inside_the_model_names_the_spec_line():
    # a NaN that is not in the input (here: one embedding row) reaches an op that refuses it: the error is an
    # MtcError at the spec line of the node, naming the op and the operand
    m = dsl.compile(dsl.load(K3, "tiny"), target="reference", seed=0).eval()
    key = next(k for k, _ in m.named_parameters() if "embed" in k)
    with torch.no_grad():
        m.get_parameter(key)[5] = float("nan")
    with pytest.raises(dsl.MtcError) as ei:
        m(torch.full((1, 8), 5))
    e = ei.value
    assert str(e.loc.file).endswith("kimi_k3.mtc") and e.loc.line > 1
    assert "NaN" in e.msg and "inside the model" in e.msg and isinstance(e.__cause__, ValueError)


def test_input_on_another_device_than_the_weights_is_named(tiny):
    with pytest.raises(dsl.MtcError, match=r"input 'input_ids' is on meta but the model's weights are on cpu"):
        tiny(torch.zeros(1, 4, dtype=torch.long, device="meta"))


def test_kernel_cache_root_ignores_an_empty_mtc_cache_dir(monkeypatch, tmp_path):
    """MTC_CACHE_DIR="" means the default ~/.cache/mtc, for the generated Triton kernels and the TVM modules alike
    (new-user trial, 16th session: an empty value wrote the cache into the current directory)."""
    from pathlib import Path
    from backends import cache_root
    from backends.triton.codegen import cache_dir as triton_cache
    home = Path.home() / ".cache" / "mtc"
    for v in ("", "  "):
        monkeypatch.setenv("MTC_CACHE_DIR", v)
        assert cache_root() == home and triton_cache() == home
    monkeypatch.delenv("MTC_CACHE_DIR")
    assert cache_root() == home
    monkeypatch.setenv("MTC_CACHE_DIR", str(tmp_path))
    assert cache_root() == tmp_path and triton_cache() == tmp_path


def test_a_pipeline_without_canonicalize_says_so():
    """passes=["fuse_tiles"] leaves the layer blocks unexpanded: the error names the missing pass (new-user trial,
    16th session: only "no kernel for op 'kda_layer'")."""
    g = dsl.load(K3, "tiny")
    with pytest.raises(dsl.MtcError, match=r"no kernel for op 'kda_layer' \(a layer block: the pass pipeline lacks "
                                           r"'canonicalize'"):
        dsl.compile(g, passes=["fuse_tiles"])(torch.randint(0, 256, (1, 5)))


def test_two_attn_res_stacks_name_their_final_mix_by_prefix():
    # (from a user trial) the final AttnRes weights follow the stack's prefix: two attn_res stacks with their own
    # prefixes used to collide on model.final_attn_res.* ("defined twice"); the default prefix keeps that name
    spec = """model two {
      block kda = kda_layer(heads=2, head_dim=16)
      block ffn = glu_ffn(inter=64)
      forward(input_ids: i64[B, T]) {
        x = embedding(input_ids, vocab=256, dim=32)
        x = stack(x, layers=2, residual="attn_res", block_size=1, prefix="enc") { attn = kda
          ffn = ffn }
        x = stack(x, layers=2, residual="attn_res", block_size=1, prefix="dec.layers") { attn = kda
          ffn = ffn }
        return lm_head(rmsnorm(x), vocab=256)
      }
    }"""
    m = dsl.compile(dsl.parse(spec), target="reference")
    final = sorted(k for k in m.state_dict() if "final_attn_res" in k)
    assert final == ["dec.final_attn_res.norm_weight", "dec.final_attn_res.proj_weight",
                     "enc.final_attn_res.norm_weight", "enc.final_attn_res.proj_weight"]
    with torch.no_grad():
        m.get_parameter("dec.final_attn_res.proj_weight").normal_()
        out = m(torch.randint(0, 256, (1, 9)))
    assert out.shape == (1, 9, 256) and torch.isfinite(out).all()


def test_float_inputs_of_one_call_share_a_dtype():
    # (from a user trial) a float16 source beside float32 inputs failed inside attn_residual with an op-level
    # message that named neither the input nor the fix
    m = dsl.compile(dsl.parse("model a { forward(q: f32[8], w: f32[8], s0: f32[B, T, 8], s1: f32[B, T, 8]) "
                              "{ return rmsnorm(attn_residual(q, w, s0, s1)) } }"), target="reference")
    q, w, s0, s1 = torch.randn(8), torch.rand(8) + 0.5, torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    with pytest.raises(dsl.MtcError, match=r"input 's0' is float16 but input 'q' is float32.*s0\.to\(torch\.float32\)"):
        m.run(q=q, w=w, s0=s0.half(), s1=s1)
    (out,) = m.run(q=q, w=w, s0=s0, s1=s1)
    want = R.rmsnorm(R.attn_residual(q, [s0, s1], w), torch.ones(8))
    assert torch.allclose(out, want, atol=1e-6)


def test_discard_balance_drops_the_kept_router_scores():
    # a user trial: after the balance mode changed with deferred scores pending, apply_balance's message pointed
    # at a private attribute; discard_balance() is the public way to drop them (no bias update)
    import dsl
    m = dsl.compile(dsl.parse(Path(__file__).parent.parent.joinpath("examples/hybrid_tiny.mtc").read_text(),
                              file="hybrid_tiny.mtc"), target="reference")
    m.train()
    m.balance_defer = True
    biases = {k: v.clone() for k, v in m.state_dict().items() if k.endswith("bias")}
    assert biases
    m(torch.randint(0, 256, (1, 20)))
    m.balance = None
    with pytest.raises(ValueError, match=r"drop them with discard_balance\(\)"):
        m.apply_balance()
    assert m.discard_balance() > 0 and m.discard_balance() == 0
    m.balance = "qb"
    assert m.apply_balance() == 0
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in biases.items())
