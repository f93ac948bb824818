"""Helpers of the layer-level ops (their type rule, the builder calls their expansions make, their spec form) and
the spec form of ``stack``, the spec statement that fills the layers' slots."""
from __future__ import annotations

from ..builder import GraphBuilder, ParamSpec, ShapeError
from ..ir import Ref, TensorType
from .core import X, SpecForm, _dims_attr, _need_float, spec_example


def _x_only(what, sequence: bool = False):
    """Type rule of a layer op that keeps its input's type: x float [..., d]; sequence: exactly [B, T, d] (the
    sequence mixers, KDA and MLA, run along dim 1)."""
    def infer(ts, a):
        x = ts[0]
        _need_float(x, "x")
        if sequence and x.rank != 3:
            raise ShapeError(f"input must be [B, T, d] (batch, sequence, width), got {x}")
        if x.rank < 2:
            raise ShapeError(f"input must be [..., d], got {x}")
        return [x]
    return infer


def _lead(x: TensorType) -> tuple:
    return x.shape[:-1]


def _reshape_to(b: GraphBuilder, x: Ref, shape, loc) -> Ref:
    return b.call("reshape", x, shape=_dims_attr(shape), loc=loc)


def _lin(b, x, w, loc):
    return b.call("linear", x, w, loc=loc)


def _slots(x: Ref, params: list[Ref], specs: list[ParamSpec]) -> dict:
    return {s.suffix.removesuffix(".weight"): r for s, r in zip(specs, params)}

_LAYER_NOTE = ("define once with its keywords, apply by name: `block NAME = {op}(...)`, then `y = NAME(x)` or "
               "`y = NAME(x, name=\"...\")`, or pick it in a stack body; inline `y = {op}(x, ..., name=\"...\")` "
               "works too. name= is the state-dict prefix (default \"{default}\"; in a stack "
               "<prefix>.<i-1>.{default})")


def layer_spec(form: str, example: str):
    """The spec form of a layer op (for register's ``spec``): ``form`` its block statement, ``example`` the call
    of a block in an example spec that applies it twice."""
    def make(od) -> SpecForm:
        return SpecForm(form, _LAYER_NOTE.format(op=od.name, default=od.default_name),
                        spec_example(X, "y = blk(x)", 'z = blk(y, name="second")', "return z",
                                     blocks=f"block blk = {example}"))
    return make


#: ``stack`` is a spec statement, not a graph op; `mtc ops stack` prints this form
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

