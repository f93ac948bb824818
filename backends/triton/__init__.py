"""The Triton backend: kernels for the heavy ops, with the same signatures as backends.reference.

On a machine without a GPU, set TRITON_INTERPRET=1 before importing triton to run them on the CPU
(float32/float16; the interpreter computes bf16 tl.dot wrongly)."""
import os

# fused multiply-adds, as the kernels were tuned with (triton 3.6's default): triton 3.9 warns at the first compile
# while this is unset, and 3.10 turns fusion off by default
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

from .kda import kda_gate, kda_chunk, kda_step  # noqa: F401
from .attn_residual import attn_residual, attn_residual_phase1, attn_residual_merge  # noqa: F401
from .moe import qb_route, qb_update, expert_load, situ_glu, moe_experts, latent_moe  # noqa: F401
from .conv import conv_silu_norm  # noqa: F401
from .mla import mla_attention  # noqa: F401   (torch's fused SDPA; no mtc kernel)

__all__ = ["kda_gate", "kda_chunk", "kda_step", "attn_residual", "attn_residual_phase1", "attn_residual_merge",
           "qb_route", "qb_update", "expert_load", "situ_glu", "moe_experts", "latent_moe", "conv_silu_norm",
           "mla_attention"]
