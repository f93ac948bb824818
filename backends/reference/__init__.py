"""The reference backend: every op of ../shared/spec/OPS.md in plain float32 PyTorch (ground truth)."""
from .ops import (embedding, linear, lm_head, rmsnorm, l2norm, short_conv, silu, sigmoid, add, mul,  # noqa: F401
                  mla_attention)
from .kda import kda_gate, kda_chunk, kda_step, kda_chunk_workspace  # noqa: F401
from .moe import qb_route, qb_update, fixed_step_update, expert_load, situ_glu, moe_experts, latent_moe  # noqa: F401
from .attn_residual import attn_residual, attn_residual_phase1, attn_residual_merge  # noqa: F401

__all__ = ["embedding", "linear", "lm_head", "rmsnorm", "l2norm", "short_conv", "silu", "sigmoid", "add", "mul",
           "mla_attention", "kda_gate", "kda_chunk", "kda_step", "qb_route", "qb_update", "fixed_step_update",
           "expert_load", "situ_glu", "moe_experts", "latent_moe", "attn_residual", "attn_residual_phase1",
           "attn_residual_merge"]
