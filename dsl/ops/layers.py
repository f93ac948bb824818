"""Helpers of the layer-level ops (their type rule, the builder calls their expansions make) and the layer sets
of a stack's slots."""
from __future__ import annotations

from ..builder import GraphBuilder, ParamSpec, ShapeError
from ..ir import Ref, TensorType
from .core import _dims_attr, _need_float


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



#: the layer blocks a stack's 'attn' slot and 'ffn' slot take
LAYER_OPS_ATTN = frozenset({"kda_layer", "mla_layer"})
LAYER_OPS_FFN = frozenset({"glu_ffn", "latent_moe", "moe"})

