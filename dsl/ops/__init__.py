"""The op registry: every graph op declared once, one module per op family.

An op's declaration (one :func:`register` call) holds everything the front end and the compiler passes know of it:
its graph signature (``inputs``, ``n_data_inputs``, ``variadic``) and attribute kinds, its shape and dtype rule
(``infer``), the parameters it owns (``params``, ``default_name``), its FLOPs (``flops``), a layer block's
expansion into primitive ops (``expand``) and stack slot (``slot``), how a spec writes it (``spec``, what `mtc ops`
prints), its compiler ``role`` (:data:`ROLES`: view, pointwise, row_norm, memory_bound, gemm, anchor, layer), the
fused kernel it anchors (``fusion``: prologue / epilogue / side ops and the tile rule that passes/fuse_tiles.py
applies) and its canonicalize rewrites (``rewrites``). The passes derive their op sets and rules from these
declarations (:func:`ops_with_role`, :func:`op_set`, :func:`ops_in_slot`); the backends attach implementations
beside their own code (backends/registry.py, ``@impl(target, op, ...)``). ``dsl`` imports neither.

Families: elementwise (silu, sigmoid, add, mul, situ_glu), movement (reshape, slice, broadcast, concat), dense
(embedding, linear, lm_head), norm (rmsnorm, l2norm), conv (short_conv), kda (kda_gate, kda_chunk, kda_layer),
mla (mla_attention, mla_layer), ffn (glu_ffn), moe (qb_route, moe_experts, latent_moe, moe), attn_residual
(attn_residual and the two-phase attn_residual_phase1 / attn_residual_merge). The primitive ops follow
../shared/spec/OPS.md; layer ops own their parameters under Hugging Face style state-dict names and are expanded
by the ``canonicalize`` pass.

Adding an op
------------
1. Declare it once, in its family's module (or a new module imported below)::

       def _softcap(ts, a):                                  # shape and dtype rule: output types from input types
           _need_float(ts[0], "x")
           return [ts[0]]

       register("softcap", _softcap, role="pointwise", inputs=("x",), attrs={"cap": 30.0},
                kinds={"cap": POSITIVE}, flops=lambda ts, os, a: 3 * numel(ts[0]),
                doc="cap * tanh(x / cap) (Gemma 2 logit soft-capping)",
                spec=SpecForm("y = softcap(x, cap=30.0)", "", spec_example(X, "y = softcap(x)", "return y")))

2. Implement it once per backend, beside the backend's code (backends/registry.py)::

       @impl("reference", "softcap")                         # backends/reference/impls.py
       def _softcap(node, x):
           cap = node.attr("cap")
           return cap * torch.tanh(x / cap)

   A target without its own implementation runs the op on the next target of its chain (tvm -> triton ->
   reference). A ``pointwise`` or ``row_norm`` op joins the Triton target's generated kernels once
   backends/triton/codegen.py writes its expression; until then its chains run op by op.

``tests/test_op_registry.py`` does exactly these two steps for a toy op and compiles and runs a spec that uses it.
"""
from __future__ import annotations

from .core import *  # noqa: F401,F403
from .core import (_dims, _dims_attr, _eq, _is_int, _is_num, _kind_from_default, _need_float,  # noqa: F401
                   _need_rank, _pow2, _shape, _tokens)
from . import elementwise, movement, dense, norm, conv, kda, mla, ffn, moe, attn_residual  # noqa: F401,E402
from .layers import STACK, layer_spec  # noqa: F401,E402
from .sources import INITS, SOURCE_KINDS, SOURCE_REQUIRED, check_source  # noqa: F401,E402

#: the layer blocks a stack's 'attn' slot and 'ffn' slot take (the built-in ones; ops_in_slot reads the registry)
LAYER_OPS_ATTN = ops_in_slot("attn")  # noqa: F405
LAYER_OPS_FFN = ops_in_slot("ffn")  # noqa: F405
