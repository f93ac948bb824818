"""The DSL front end: every model file parses, its printed IR parses back to an equal graph, golden
printed IR of a small spec, the Python builder produces the same IR as the spec."""
import os
from pathlib import Path

import pytest

import dsl
from dsl.builder import GraphBuilder
from dsl.printer import print_graph
from passes import PassManager

ROOT = Path(__file__).resolve().parent.parent
MODELS = sorted((ROOT / "models").glob("*.mtc"))
DATA = Path(__file__).parent / "data"
GOLDEN = Path(__file__).parent / "golden"


def _variants(path):
    from dsl.spec import parse_spec
    return [None] + list(parse_spec(path.read_text(), str(path)).variants)


@pytest.mark.parametrize("path", MODELS, ids=lambda p: p.name)
def test_every_model_and_variant_round_trips(path):
    for v in _variants(path):
        g = dsl.load(path, v)
        text = print_graph(g)
        g2 = dsl.parse_ir(text)
        assert g2 == g, f"{path.name} variant {v}: printed IR does not parse back to an equal graph"
        assert print_graph(g2) == text


@pytest.mark.parametrize("path", MODELS, ids=lambda p: p.name)
def test_canonical_stage_round_trips(path):
    g = PassManager().run(dsl.load(path, "tiny"))
    assert all(n.op not in ("kda_layer", "mla_layer", "glu_ffn", "latent_moe", "moe") for n in g.nodes)
    assert dsl.parse_ir(print_graph(g)) == g


def test_parse_ir_fills_unknown_types():
    g = PassManager().run(dsl.load(DATA / "toy.mtc"))
    text = print_graph(g, with_loc=False)
    # erase every op's type: infer_shapes must recover them
    lines = []
    for ln in text.splitlines():
        if " = " in ln and not any(f"= {k} " in ln for k in ("input", "param", "buffer")) and " : " in ln:
            ln = ln[: ln.rindex(" : ")] + " : ?"
        lines.append(ln)
    g2 = dsl.parse_ir("\n".join(lines))
    from passes.infer_shapes import infer_shapes
    assert infer_shapes(g2) == g


@pytest.mark.parametrize("stage", ["graph", "canonical", "fused"])
def test_golden_printed_ir(stage):
    pm = PassManager(keep_stages=True)
    pm.run(dsl.load(DATA / "toy.mtc"))
    got = print_graph(pm.stages[stage], with_loc=False)
    gold = GOLDEN / f"toy.{stage}.ir"
    if os.environ.get("MTC_UPDATE_GOLDEN") == "1":
        gold.write_text(got)
    assert got == gold.read_text(), f"printed IR of tests/data/toy.mtc at stage {stage} changed"


def test_variant_and_overrides_recompute_derived_values():
    g = dsl.load(DATA / "toy.mtc", "wide")
    # head_dim = d // heads follows the variant's d = 48
    kda = next(n for n in g.nodes if n.op == "kda_layer")
    assert kda.attr("head_dim") == 24
    g = dsl.load(DATA / "toy.mtc", "wide", heads=3)
    kda = next(n for n in g.nodes if n.op == "kda_layer")
    assert (kda.attr("heads"), kda.attr("head_dim")) == (3, 16)
    g = dsl.load(ROOT / "models" / "kimi_k3.mtc", n_layers=5)
    assert sum(n.op in ("kda_layer", "mla_layer") for n in g.nodes) == 5


def test_k3_layer_pattern():
    g = dsl.load(ROOT / "models" / "kimi_k3.mtc")
    kinds = [n.op for n in g.nodes if n.op in ("kda_layer", "mla_layer")]
    mla_layers = [i + 1 for i, k in enumerate(kinds) if k == "mla_layer"]
    assert len(kinds) == 93
    assert mla_layers == list(range(4, 93, 4)) + [93]
    ffn = [n.op for n in g.nodes if n.op in ("glu_ffn", "latent_moe")]
    assert ffn[0] == "glu_ffn" and set(ffn[1:]) == {"latent_moe"} and len(ffn) == 93
    # Block AttnRes: the bank grows by one source per 12-layer block; the final mix sees 7 blocks +
    # embedding + the partial of the last 9 layers
    srcs = [len(n.inputs) - 2 for n in g.nodes if n.op == "attn_residual"]
    assert len(srcs) == 2 * 93 + 1
    assert srcs[0] == 1 and srcs[1] == 2 and srcs[2 * 12] == 2 and srcs[-1] == 1 + 7 + 1


def test_python_builder_matches_spec():
    spec = """
model pb {
  config { d: int = 32 }
  forward(input_ids: i64[B, T]) {
    x = embedding(input_ids, vocab=256, dim=d)
    h = kda_layer(rmsnorm(x, name="model.layers.0.input_layernorm"), heads=2, head_dim=16,
                  name="model.layers.0.self_attn")
    y = add(x, h)
    return lm_head(rmsnorm(y), vocab=256)
  }
}
"""
    g_spec = dsl.parse(spec)
    b = GraphBuilder("pb")
    ids = b.input("input_ids", "i64", ["B", "T"])
    x = b.embedding(ids, vocab=256, dim=32)
    h = b.kda_layer(b.rmsnorm(x, name="model.layers.0.input_layernorm"), heads=2, head_dim=16,
                    name="model.layers.0.self_attn")
    y = b.add(x, h)
    g_py = b.build([b.lm_head(b.rmsnorm(y), vocab=256)])
    assert g_py.nodes == g_spec.nodes and g_py.outputs == g_spec.outputs


def test_pass_manager_dump_and_print_after(tmp_path, capsys):
    pm = PassManager(print_after=["canonicalize"], dump_dir=tmp_path)
    pm.run(dsl.load(DATA / "toy.mtc"))
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == [".mtc-outputs.json", "00-graph.ir", "01-verify.ir", "02-infer_shapes.ir", "03-canonicalize.ir",
                     "04-batch_attn_residual.ir", "05-fuse_tiles.ir"]     # (the manifest: dsl.fileio.OutputDir)
    assert "IR after canonicalize" in capsys.readouterr().out
    assert [n for n, _ in pm.timings] == ["verify", "infer_shapes", "canonicalize", "batch_attn_residual",
                                              "fuse_tiles"]


def _mla(dn, dr):
    spec = f"""model m {{
  forward(x: f32[B, T, 24]) {{
    return mla_layer(x, heads=2, kv_lora_rank=12, qk_nope_dim={dn}, qk_rope_dim={dr}, v_dim=10, gated=false,
                     name="a")
  }}
}}"""
    return dsl.compile(dsl.parse(spec), target="reference").eval()


@pytest.mark.parametrize("zero", ["rope", "nope"])
def test_mla_with_a_zero_qk_part_equals_the_full_layer_with_that_part_switched_off(zero):
    """qk_rope_dim=0 (NoPE only) / qk_nope_dim=0: the same function as the full layer (dn=16, dr=8) whose
    query rows for the missing part are zero and whose other query rows are rescaled so that the softmax
    scale 1/sqrt(dn + dr) matches."""
    import torch
    H, dn, dr, dv, T = 2, 16, 8, 10, 63
    full = _mla(dn, dr)
    part = _mla(dn, 0) if zero == "rope" else _mla(0, dr)
    sp, sf = part.state_dict(), full.state_dict()
    new = {k: v.clone() for k, v in sf.items()}
    keep = (slice(0, dn), slice(dn, dn + dr))[zero == "nope"]
    kdim = dn if zero == "rope" else dr
    q = torch.zeros(H, dn + dr, 24)
    q[:, keep] = sp["a.q_proj.weight"].view(H, kdim, 24) * ((dn + dr) / kdim) ** 0.5
    new["a.q_proj.weight"] = q.reshape(H * (dn + dr), 24)
    new["a.o_proj.weight"] = sp["a.o_proj.weight"]
    new["a.kv_a_layernorm.weight"] = sp["a.kv_a_layernorm.weight"]
    if zero == "rope":
        new["a.kv_a_proj_with_mqa.weight"][:12] = sp["a.kv_a_proj_with_mqa.weight"]
        new["a.kv_b_proj.weight"] = sp["a.kv_b_proj.weight"]
    else:
        new["a.kv_a_proj_with_mqa.weight"] = sp["a.kv_a_proj_with_mqa.weight"]
        kvb = new["a.kv_b_proj.weight"].view(H, dn + dv, 12)
        kvb[:, dn:] = sp["a.kv_b_proj.weight"].view(H, dv, 12)
        new["a.kv_b_proj.weight"] = kvb.reshape(H * (dn + dv), 12)
    full.load_state_dict(new)
    x = torch.randn(2, T, 24)
    a, b = part(x), full(x)
    assert torch.isfinite(a).all()
    assert ((a - b).pow(2).mean() / b.pow(2).mean()).sqrt() < 1e-5


def test_a_block_shadows_the_op_of_its_name():
    # `block moe = moe(...)` then `moe(x)`: the configured block is applied (K3 names its latent_moe block `moe`),
    # not the op (which would then miss its attributes)
    g = dsl.parse("""model m {
  block moe = moe(experts=6, top_k=2, inter=24)
  forward(input_ids: i64[B, T]) {
    x = embedding(input_ids, vocab=256, dim=32)
    return lm_head(moe(x), vocab=256)
  }
}""")
    layers = [n for n in g.nodes if n.op == "moe"]
    assert len(layers) == 1 and layers[0].attr("experts") == 6 and layers[0].attr("top_k") == 2
