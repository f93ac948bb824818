"""Variants that extend another (``variant small_full : small { mla_every = 1 }``) and the full-attention twins of
kimi_k3 built with it."""
import warnings

import pytest
import torch

import dsl
from dsl.errors import MtcError, MtcWarning
from passes.stats import compute_stats

SPEC = """model m {
  config { d: int = 8  n: int = 2  every: int = 2 }
  variant a { d = 16 }
  variant b : a { n = 3 }
  variant c : b { d = 32 }
  block kda = kda_layer(heads=2, head_dim=8)
  block mla = mla_layer(heads=2, kv_lora_rank=8, qk_nope_dim=8, qk_rope_dim=4, v_dim=8)
  block ffn = glu_ffn(inter=16)
  forward(input_ids: i64[B, T]) {
    x = embedding(input_ids, vocab=256, dim=d)
    x = stack(x, layers=n, residual="add") { attn = mla if i % every == 0 else kda  ffn = ffn }
    return lm_head(rmsnorm(x), vocab=256)
  }
}
"""


def _config(g):
    return dict(g.meta_get("config", ()))


def test_a_variant_takes_its_bases_settings_then_its_own():
    assert (_config(dsl.parse(SPEC, "b"))["d"], _config(dsl.parse(SPEC, "b"))["n"]) == (16, 3)
    assert (_config(dsl.parse(SPEC, "c"))["d"], _config(dsl.parse(SPEC, "c"))["n"]) == (32, 3)
    assert _config(dsl.parse(SPEC, "a"))["n"] == 2


def test_unknown_or_cyclic_base_is_an_error_at_the_variant():
    with pytest.raises(MtcError, match="extends 'aa', which is not a variant.*did you mean 'a'"):
        dsl.parse(SPEC.replace("variant b : a", "variant b : aa"))
    with pytest.raises(MtcError, match="extends itself"):
        dsl.parse(SPEC.replace("variant a {", "variant a : c {"))


def test_a_block_named_in_the_forward_but_not_picked_gives_no_warning():
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        dsl.parse(SPEC, "a", every=1)                       # every layer MLA: kda is named, not picked
        assert not [x for x in w if issubclass(x.category, MtcWarning)]
        dsl.parse(SPEC.replace("block ffn", "block spare = glu_ffn(inter=8)\n  block ffn"), "a")
    assert any("block 'spare' is defined but never used" in str(x.message) for x in w)


def test_full_attention_twins_of_kimi_k3():
    """tiny_full / small_full: the variant's settings with MLA on every layer (mla_every = 1)."""
    for base in ("tiny", "small"):
        g, twin = dsl.load("models/kimi_k3.mtc", variant=base), dsl.load("models/kimi_k3.mtc", variant=f"{base}_full")
        s, t = compute_stats(g), compute_stats(twin)
        assert t.layers["kda"] == 0 and t.layers["mla"] == s.layers["kda"] + s.layers["mla"]
        assert {k: v for k, v in _config(twin).items() if k != "mla_every"} == \
            {k: v for k, v in _config(g).items() if k != "mla_every"}
        assert t.kda_state_bytes == 0 and t.kv_cache_bytes > s.kv_cache_bytes
    m = dsl.compile(dsl.load("models/kimi_k3.mtc", variant="tiny_full"), target="reference").eval()
    for _ in range(30):                                     # no routing near-tie (see test_inference._clear)
        ids = torch.randint(0, 256, (1, 90))
        if min(m.route_margins(ids).values()) >= 1e-6:
            break
    with torch.no_grad():
        ref = m(ids)
    cache = m.new_cache(1, 90)
    assert not cache.kda and len(cache.latent) == 9
    out = m.prefill(ids[:, :85], cache, chunk_tokens=32)
    dec = torch.cat([m.decode(ids[:, i:i + 1], cache) for i in range(85, 90)], dim=1)
    assert float((torch.cat([out, dec], 1) - ref).norm() / ref.norm()) < 1e-5
