"""How each op is written in a ``.mtc`` spec, for ``mtc ops``.

The op registry (:mod:`dsl.ops`) gives every op's graph signature: its tensor inputs *including the
parameters it owns* (``linear(x, weight)``). In a spec, an op that owns parameters creates them itself,
sized by keywords and named by ``name=`` (their state-dict prefix), so one writes
``y = linear(x, out=N, name="proj")``. This table gives that spec form, notes on the keywords, and a
complete example spec that builds (``tests/test_cli.py`` loads every example, runs ``mtc stats`` and
``mtc ir`` at every ``--stage`` on it, compiles it for the reference and Triton targets, and checks that
every registered op has an entry here). Examples take [B, T, ...] inputs (the symbols ``mtc stats``
binds; moe_experts' token dim is written T) and sizes the Triton kernels take (head dims powers of two
>= 16).

Each entry: ``SpecForm(form, notes, example)``; ``form`` is ``None`` for ops that a spec cannot write
(the two-phase AttnRes ops made by a pass; the multi-output ``qb_route``); ``example`` is a whole spec
(``None`` where ``form`` is). ``stack`` is a spec statement, not a graph op; it has an entry too.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpecForm:
    form: str | None
    notes: str = ""
    example: str | None = None


def _spec(inputs: str, *body: str, blocks: str = "") -> str:
    """A minimal model around forward(inputs) { body }."""
    lines = ["model example {"]
    if blocks:
        lines += [f"  {b}" for b in blocks.splitlines()]
    lines.append(f"  forward({inputs}) {{")
    lines += [f"    {b}" for b in body]
    lines += ["  }", "}"]
    return "\n".join(lines) + "\n"


X = "x: f32[B, T, 64]"
_WEIGHT_IN = ("its weights are tensor inputs (declare them as forward(...) parameters); it creates no "
              "parameters of its own")

SPEC_FORMS: dict[str, SpecForm] = {
    # -- elementwise and data movement
    "add": SpecForm("y = add(a, b)", "numpy broadcasting; a and b have the same float dtype",
                    _spec(f"{X}, b: f32[64]", "y = add(x, b)", "return y")),
    "mul": SpecForm("y = mul(a, b)", "numpy broadcasting; a and b have the same float dtype",
                    _spec(f"{X}, b: f32[B, T, 1]", "y = mul(x, b)", "return y")),
    "silu": SpecForm("y = silu(x)", "", _spec(X, "y = silu(x)", "return y")),
    "sigmoid": SpecForm("y = sigmoid(x)", "", _spec(X, "y = sigmoid(x)", "return y")),
    "l2norm": SpecForm("y = l2norm(x, eps=1e-6)", "over the last dim; eps optional",
                       _spec(X, "y = l2norm(x)", "return y")),
    "reshape": SpecForm('y = reshape(x, shape=["B", "T", 2, 32])',
                        "shape: a list of integers and quoted symbol names (\"B\", \"T\"); the element "
                        "count must stay the same",
                        _spec(X, 'y = reshape(x, shape=["B", "T", 2, 32])', "return y")),
    "slice": SpecForm("y = slice(x, start=S, end=E, dim=-1)", "x[..., S:E] along dim (default -1, the last)",
                      _spec(X, "y = slice(x, start=0, end=16)", "return y")),
    "concat": SpecForm("y = concat(a, b, dim=-1)", "same rank and dtype; other dims equal",
                       _spec(X, "y = concat(x, x, dim=-1)", "return y")),
    "broadcast": SpecForm('y = broadcast(x, shape=["B", "T", 4, 8])',
                          "same rank; only size-1 dims expand; symbol names quoted as in reshape",
                          _spec("x: f32[B, T, 1, 8]", 'y = broadcast(x, shape=["B", "T", 4, 8])', "return y")),
    # -- basic layers that own parameters
    "embedding": SpecForm('x = embedding(ids, vocab=V, dim=D, name="model.embed_tokens")',
                          'ids integer [..]; the table <name>.weight is [vocab, dim]; name= optional (default '
                          '"model.embed_tokens")',
                          _spec("ids: i64[B, T]", "x = embedding(ids, vocab=256, dim=64)", "return x")),
    "linear": SpecForm('y = linear(x, out=N, name="...")',
                       "name= required: the weight <name>.weight is [out, in], in = the last dim of x",
                       _spec(X, 'y = linear(x, out=32, name="proj")', "return y")),
    "lm_head": SpecForm('logits = lm_head(x, vocab=V, name="lm_head")',
                        'the weight <name>.weight is [vocab, d]; name= optional (default "lm_head")',
                        _spec(X, "return lm_head(x, vocab=256)")),
    "rmsnorm": SpecForm('y = rmsnorm(x, eps=1e-6, name="model.norm")',
                        'the weight <name>.weight is [d] (ones); name= optional (default "model.norm"): a '
                        "second rmsnorm needs its own name",
                        _spec(X, 'h = rmsnorm(x, name="pre_norm")', "y = rmsnorm(h, eps=1e-5)", "return y")),
    "short_conv": SpecForm("y = short_conv(x, w)", f"x [B, T, C], w [C, 1, W]; {_WEIGHT_IN}",
                           _spec(f"{X}, w: f32[64, 1, 4]", "y = short_conv(x, w)", "return y")),
    # -- the ops of the op contract (weights as tensor inputs)
    "kda_gate": SpecForm('g = kda_gate(x, A_log, dt_bias, lower_bound=-5.0, gate="sigmoid")',
                         f"x [B, T, H, K], A_log [H], dt_bias [H*K]; {_WEIGHT_IN}",
                         _spec("x: f32[B, T, 2, 16], A_log: f32[2], dt_bias: f32[32]",
                               "g = kda_gate(x, A_log, dt_bias)", "return g")),
    "kda_chunk": SpecForm("o = kda_chunk(q, k, v, g, beta, scale=S)",
                          "q, k, g [B, T, H, K], v [B, T, H, V], beta [B, T, H]; scale optional (default "
                          "K^-0.5)",
                          _spec("q: f32[B, T, 2, 16], k: f32[B, T, 2, 16], v: f32[B, T, 2, 16], "
                                "g: f32[B, T, 2, 16], beta: f32[B, T, 2]",
                                "o = kda_chunk(q, k, v, g, beta)", "return o")),
    "mla_attention": SpecForm("o = mla_attention(q, k, v, scale=S, causal=true)",
                              "q, k [B, T, H, D], v [B, T, H, Dv]; scale required",
                              _spec("q: f32[B, T, 2, 16], k: f32[B, T, 2, 16], v: f32[B, T, 2, 16]",
                                    "o = mla_attention(q, k, v, scale=0.25)", "return o")),
    "qb_route": SpecForm(None, "three outputs (topk_idx, topk_weight, scores), which a spec cannot unpack: "
                               "it runs inside the latent_moe and moe layers"),
    "situ_glu": SpecForm("h = situ_glu(a, b, beta_gate=4.0, beta_up=25.0)", "a: gate branch, b: up branch",
                         _spec(f"{X}, b: f32[B, T, 64]", "h = situ_glu(x, b)", "return h")),
    "moe_experts": SpecForm('u = moe_experts(x_lat, topk_idx, topk_weight, w1, w3, w2, activation="situ")',
                            "x_lat [N, l] (N tokens; the example names them T), topk_idx/topk_weight [N, k], "
                            "w1/w3 [E, I, l], w2 [E, l, I]; "
                            f"{_WEIGHT_IN}; normally it runs inside latent_moe / moe, fed by qb_route",
                            _spec("x: f32[T, 16], idx: i64[T, 2], w: f32[T, 2], w1: f32[4, 16, 16], "
                                  "w3: f32[4, 16, 16], w2: f32[4, 16, 16]",
                                  "u = moe_experts(x, idx, w, w1, w3, w2)", "return u")),
    "attn_residual": SpecForm("h = attn_residual(query, rms_weight, s1, s2, ...)",
                              f"query, rms_weight [d], sources [..., d]; {_WEIGHT_IN}; "
                              'stack(..., residual="attn_res") creates and wires them for every sublayer',
                              _spec("q: f32[64], w: f32[64], a: f32[B, T, 64], b: f32[B, T, 64]",
                                    "h = attn_residual(q, w, a, b)", "return h")),
    "attn_residual_phase1": SpecForm(None, "made by the batch_attn_residual pass from attn_residual; not "
                                           "written in a spec"),
    "attn_residual_merge": SpecForm(None, "made by the batch_attn_residual pass from attn_residual; not "
                                          "written in a spec"),
}

_LAYER_NOTE = ("define once with its keywords, apply by name: `block NAME = {op}(...)`, then `y = NAME(x)` or "
               "`y = NAME(x, name=\"...\")`, or pick it in a stack body; inline `y = {op}(x, ..., name=\"...\")` "
               "works too. name= is the state-dict prefix (default \"{default}\"; in a stack "
               "<prefix>.<i-1>.{default})")

_LAYERS = {
    "kda_layer": ("block kda = kda_layer(heads=H, head_dim=K)", "kda_layer(heads=2, head_dim=16)", "self_attn"),
    "mla_layer": ("block mla = mla_layer(heads=H, kv_lora_rank=R)",
                  "mla_layer(heads=2, kv_lora_rank=16, qk_nope_dim=16, qk_rope_dim=8, v_dim=16)", "self_attn"),
    "glu_ffn": ("block dense = glu_ffn(inter=I)", "glu_ffn(inter=128)", "mlp"),
    "latent_moe": ("block moe = latent_moe(experts=E, top_k=k, inter=I, latent=L)",
                   "latent_moe(experts=8, top_k=2, inter=32, latent=32, shared=1)", "block_sparse_moe"),
    "moe": ("block moe = moe(experts=E, top_k=k, inter=I)", "moe(experts=8, top_k=2, inter=32)",
            "block_sparse_moe"),
}
for _op, (_form, _ex, _default) in _LAYERS.items():
    SPEC_FORMS[_op] = SpecForm(_form, _LAYER_NOTE.format(op=_op, default=_default),
                               _spec(X, "y = blk(x)", 'z = blk(y, name="second")', "return z",
                                     blocks=f"block blk = {_ex}"))

STACK = SpecForm(
    'x = stack(x, layers=N, residual="add", block_size=K, prefix="model.layers", norm_eps=1e-6) {\n'
    "      attn = <kda_layer or mla_layer block>     # i: the 1-based layer index, e.g. mla if i % 4 == 0 else kda\n"
    "      ffn = <glu_ffn, latent_moe or moe block>\n"
    "    }",
    'N pre-norm layers, each "attn" then "ffn" (both set, in that order). residual: "add" (default) or '
    '"attn_res" (Block Attention Residuals; needs block_size=<layers per block>). prefix (default '
    '"model.layers"): layer i\'s weights are <prefix>.<i-1>.self_attn..., .mlp or .block_sparse_moe, '
    ".input_layernorm, .post_attention_layernorm. norm_eps: the eps of those RMSNorms (default 1e-6)",
    "model example {\n"
    "  block kda = kda_layer(heads=2, head_dim=16)\n"
    "  block mla = mla_layer(heads=2, kv_lora_rank=16, qk_nope_dim=16, qk_rope_dim=8, v_dim=16)\n"
    "  block dense = glu_ffn(inter=128)\n"
    "  forward(ids: i64[B, T]) {\n"
    "    x = embedding(ids, vocab=256, dim=64)\n"
    '    x = stack(x, layers=4, residual="attn_res", block_size=2, prefix="model.layers") {\n'
    "      attn = mla if i % 2 == 0 else kda\n"
    "      ffn = dense\n"
    "    }\n"
    "    return lm_head(rmsnorm(x), vocab=256)\n"
    "  }\n"
    "}\n")
