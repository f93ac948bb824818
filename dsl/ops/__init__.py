"""The op registry: every graph op's signature, shape rule, parameters, FLOP count and (for layer-level
building blocks) its expansion into primitive ops, one module per op family.

Primitive ops are the ones of ../shared/spec/OPS.md (kda_gate, kda_chunk, mla_attention, qb_route,
situ_glu, moe_experts, attn_residual) plus the graph ops embedding, linear, rmsnorm, l2norm, short_conv,
silu, sigmoid, mul, add, lm_head and the data-movement ops reshape, slice, concat, broadcast.

Layer-level ops (kda_layer, mla_layer, glu_ffn, latent_moe, moe) own their parameters (created with
Hugging Face style state-dict names) and are expanded into primitive ops by the ``canonicalize`` pass.
"""
from __future__ import annotations

from .core import *  # noqa: F401,F403
from .core import (_dims, _dims_attr, _eq, _is_int, _is_num, _kind_from_default, _need_float,  # noqa: F401
                   _need_rank, _shape, _tokens)
from . import elementwise, movement, dense, norm, conv, kda, mla, ffn, moe, attn_residual  # noqa: F401,E402
from .layers import LAYER_OPS_ATTN, LAYER_OPS_FFN  # noqa: F401,E402
from .sources import INITS, SOURCE_KINDS, SOURCE_REQUIRED, check_source  # noqa: F401,E402
