"""The launch settings of the KDA kernels: one frozen dataclass, one override context.

``kda_chunk`` reads the settings active at its call (``active()``) and keeps them for its backward, so a forward
and its backward always run with the same ones. Override them for a block of code with::

    with backends.triton.kda.config(bv=16, pipeline=False):
        o, _ = kda_chunk(...)

The defaults are the launch settings measured best on the H200 (benchmarks/results/kda.md); every field is a
launch parameter or a threshold of an input condition, none selects a different kernel for the same input.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from dataclasses import dataclass

#: tokens per chunk
CHUNK = 64
#: the most negative promised bound for which the dense diagonal tiles stay in range (8 * 10 = 80 < 88)
FAST_LOWER_BOUND_LIMIT = -10.0
#: the same for float16 inputs (a lower bound runs the safe path, same result).  Their dense tiles form the
#: anchored operands (factors up to e^(8 |L|)) in float32, as float16 ends at 65504 ~ e^11.09 (q entries past
#: ~3 overflowed it at e^10); this limit is the range in which float16's dense path has been tested
FP16_FAST_LOWER_BOUND_LIMIT = -1.25


@dataclass(frozen=True)
class KdaConfig:
    """Launch settings of the KDA kernels (see the module docstring for the override context)."""

    # ---- intra-chunk kernels (backends/triton/kda/intra.py)
    #: channel slice and warps of the 16-row strip kernel (no bound promised, float16 inputs; benchmarks/results/kda.md)
    bk: int = 32
    nw_strip: int = 4
    #: channel slice, warps and ptxas register cap of the 32-row strip kernel (a dense gate, bf16 / float32)
    bk_strip32: int = 32
    nw_strip32: int = 4
    maxnreg_strip32: int | None = 128
    #: warps of the cumulative-gate kernel and its channel slices per (chunk, head) (at most K / 16, dividing K)
    nw_cumsum: int = 4
    cumsum_slices: int = 2
    #: warps of the solve kernel; tl.dot input precision of its 16x16 products under autograd (the backward reads
    #: the T it forms) and in a forward without autograd (T is rounded to the input dtype for the w/u dots there)
    nw_solve: int = 1
    solve_prec: str = "tf32x3"
    solve_prec_fwd: str = "tf32"
    #: warps of the w/u kernel
    nw_wu: int = 4
    #: the per-chunk kernels run head-major grids (H, NC) up to this many chunks (the grid's second axis holds at
    #: most 65535), chunk-major grids (NC, H) past it
    head_major_max_chunks: int = 65535

    # ---- serial state passes (state.py: forward state pass, segment maps, the backward's dS chain)
    state_warps: int = 4
    #: pipeline stages of a pass whose programs share the SMs two by two, and of one whose programs fit one per SM
    state_stages: int = 2
    stages_one_wave: int = 3
    #: programs per SM the segment model counts with
    ctas_per_sm: int = 2
    #: state columns per program: 16, 32, 64 or "auto" (state._value_block)
    bv: int | str = "auto"
    #: modelled step cost (us) of an unsplit pass that fits one program per SM (tables._seg_chunks_for)
    w_one_wave: float = 1.1

    # ---- the pipelined forward (forward.py _fwd_pipelined: one sequence of at least pipe_min_chunks chunks,
    # without autograd)
    pipeline: bool = True
    pipe_min_chunks: int = 1024
    #: pieces of about pipe_piece_chunks chunks, at most pipe_max_pieces of them
    pipe_piece_chunks: int = 256
    pipe_max_pieces: int = 32
    #: state columns per program of its state pass (widened while the pass would hold more than half the SMs)
    pipe_bv: int = 32

    # ---- backward (backward.py)
    bwd_chain_warps: int = 4
    bwd_chain_stages: int = 1
    bwd_ut_warps: int = 8
    #: channel slice and warps of the pair kernel
    bwd_pair_bk: int = 32
    bwd_pair_warps: int = 4
    #: the per-chunk gradient kernel takes V in column blocks of bwd_chunk_kv // K (K = V = 128: one block, 64 KB
    #: of shared memory; K = V = 256 at once would need 256 KB, over the H200's 227)
    bwd_chunk_kv: int = 128 * 128

    #: benchmarks' phase timing: a list that the forward and backward append (phase name, CUDA event) to at their
    #: phase boundaries (guard.mark_phase); None: nothing recorded
    profile: list | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        if self.bv not in (16, 32, 64, "auto"):
            raise ValueError(f"backends.triton.kda.config: bv must be 16, 32, 64 or 'auto', got {self.bv!r}")
        for name in ("solve_prec", "solve_prec_fwd"):
            if getattr(self, name) not in ("ieee", "tf32", "tf32x3"):
                raise ValueError(f"backends.triton.kda.config: {name} must be 'ieee', 'tf32' or 'tf32x3', got "
                                 f"{getattr(self, name)!r}")


_ACTIVE: contextvars.ContextVar[KdaConfig] = contextvars.ContextVar("backends.triton.kda settings",
                                                                    default=KdaConfig())


def active() -> KdaConfig:
    """The settings in force here (the innermost ``config`` block's, else the defaults)."""
    return _ACTIVE.get()


@contextlib.contextmanager
def config(**changes):
    """Override KdaConfig fields inside the ``with`` block (TypeError for an unknown name, ValueError for a bad
    value); yields the settings in force. Nested blocks override the enclosing one's settings."""
    cfg = dataclasses.replace(_ACTIVE.get(), **changes)
    token = _ACTIVE.set(cfg)
    try:
        yield cfg
    finally:
        _ACTIVE.reset(token)
