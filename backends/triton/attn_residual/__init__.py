"""Block Attention Residuals (attention over depth) as Triton kernels: forward, backward, two-phase form.

Math: "Attention Residuals" (arXiv 2603.15031), Block AttnRes; the contract is spec/OPS.md
"attn_residual" and the float32 reference is backends/reference/attn_residual.py (same signatures):

    logit_i = <query, x_i * r_i * rms_weight>,  r_i = rsqrt(mean_d x_i^2 + eps)
    p = softmax_i(logit) (float32),  out = sum_i p_i x_i,  optional out <- RMSNorm(out; output_rms_weight)

Kernels (all accumulate in float32, all index with int64, so tensors past 2^31/2^32 elements are fine), one
default per input class:

* forward (forward.py): an online softmax over depth (Milakov & Gimelshein 2018), each source row read once, the
  optional output RMSNorm applied before the single store; the sources reached through a table of int64 element
  offsets from one base pointer, so L is a runtime value. ``_fwd_rows_kernel`` for row tiles under
  ``pipelined_tile`` elements and under the interpreter; on the GPU above that the pipelined kernels:
  ``_fwd_pieces_kernel`` where d is up to three power-of-two pieces of >= 512 columns (7168 = 4096 + 2048 +
  1024), ``_fwd_padded_kernel`` otherwise.
* backward (backward.py): ``_bwd_kernel`` recomputes the mix from the saved logits and log-sum-exp, then writes
  every source's gradient.
* two-phase form: phase1.py (``_phase1_logits_kernel``, ``_phase1_stats_kernel``, then ``_phase1_mix_bank_kernel``
  for banks of up to 16 sources and 64 queries, ``_phase1_mix_groups_kernel`` beyond) and merge.py
  (``_merge_rows_kernel`` / ``_merge_persistent_kernel``, by the same tile rule as the forward).

Launch settings: config.py (``AttnResConfig``; ``config(**fields)`` overrides them in a with block). The measured
history of every kernel and setting: benchmarks/results/attn_residual.md.

Public functions: ``attn_residual``, ``attn_residual_phase1``, ``attn_residual_merge`` (documented there).
"""
from __future__ import annotations

from .backward import _bwd_kernel, attn_residual  # noqa: F401
from .common import (TABLES as _TABLES, TABLES_MAX as _TABLES_MAX, cached_table as _cached_table,  # noqa: F401
                     offset_table as _offset_table, row_tile as _row_tile)
from .config import AttnResConfig, config, current  # noqa: F401
from .forward import _fwd_padded_kernel, _fwd_pieces_kernel, _fwd_rows_kernel, pow2_parts as _pow2_parts  # noqa: F401
from .merge import _merge_persistent_kernel, _merge_rows_kernel, attn_residual_merge  # noqa: F401
from .phase1 import (_phase1_logits_kernel, _phase1_mix_bank_kernel, _phase1_mix_groups_kernel,  # noqa: F401
                     _phase1_stats_kernel, attn_residual_phase1, phase1_launch as _phase1_launch)

__all__ = ["attn_residual", "attn_residual_phase1", "attn_residual_merge"]
