"""Launch settings of the attn_residual kernels: one frozen ``AttnResConfig``, replaced for a scope by ``config``.

The values are the measured best on an H200 at d = 7168 in bf16 (benchmarks/attn_residual.py's sweeps; the tables
and the history of each value are in benchmarks/results/attn_residual.md). Which kernel runs is not a setting: it
follows from the input (see the package docstring); ``fwd_pipelined`` and ``merge_persistent`` only force that rule's
answer, so that the tests can run the GPU's kernels under the interpreter.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class AttnResConfig:
    """Settings of the attn_residual launches (ints >= 1 unless noted).

    Forward, pipelined kernels (a row tile of at least ``pipelined_tile`` elements, on the GPU):
        fwd_num_warps, fwd_bt (token rows per tile), fwd_ns (pipeline stages of the flat (tile, source block) loop;
        fewer where the stages would not fit 200 KB of shared memory, as for float32 sources), fwd_progs_per_sm
        (persistent programs per SM; program p takes the token tiles p, p + grid, ...);
        sources loaded and reduced per step: fwd_bl below fwd_wide_l sources, fwd_bl_wide from there; with the
        fused output norm fwd_bl_onorm on rows of exact power-of-two pieces and fwd_bl_onorm_padded on padded
        rows (two sources per step spill registers there).
    pipelined_tile: the tile size (elements: rows x padded width, _row_tile) from which the forward and the merge
        take their pipelined / persistent kernels; smaller tiles and the interpreter take the row kernels.
    fwd_pipelined, merge_persistent: None (the rule above), or True / False to force it.
    Phase 1 on the GPU (the interpreter uses small tiles of its own): logits tiles p1_bt tokens x p1_bk columns,
        p1_ns stages, p1_nw warps; the bank mix (every query per (token, column chunk), banks of at most
        mix_bank_max_sources sources, rounded up to a power of two, and mix_bank_max_queries queries) on
        mix_bank_bc columns with mix_bank_nw warps; else the query-group mix on mix_groups_bc columns x
        mix_groups_qb queries, mix_groups_ns stages, mix_groups_nw warps.
    Merge (persistent kernel): merge_num_warps, merge_progs_per_sm, merge_ns pipeline stages (fewer where two
        programs' stages would not fit an SM's shared memory).
    """
    fwd_num_warps: int = 4
    fwd_bt: int = 1
    fwd_ns: int = 3
    fwd_progs_per_sm: int = 2
    fwd_bl: int = 1
    fwd_bl_wide: int = 2
    fwd_wide_l: int = 6
    fwd_bl_onorm: int = 2
    fwd_bl_onorm_padded: int = 1
    pipelined_tile: int = 2048
    fwd_pipelined: Optional[bool] = None
    p1_bt: int = 128
    p1_bk: int = 64
    p1_ns: int = 4
    p1_nw: int = 8
    mix_bank_bc: int = 1024
    mix_bank_nw: int = 4
    mix_bank_max_sources: int = 16
    mix_bank_max_queries: int = 64
    mix_groups_bc: int = 1024
    mix_groups_qb: int = 8
    mix_groups_ns: int = 3
    mix_groups_nw: int = 4
    merge_num_warps: int = 4
    merge_progs_per_sm: int = 2
    merge_ns: int = 3
    merge_persistent: Optional[bool] = None

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in ("fwd_pipelined", "merge_persistent"):
                if v is not None and not isinstance(v, bool):
                    raise ValueError(f"attn_residual config: {f.name} must be None, True or False, got {v!r}")
            elif isinstance(v, bool) or not isinstance(v, int) or v < (0 if f.name.startswith("mix_bank_max")
                                                                        else 1):
                raise ValueError(f"attn_residual config: {f.name} must be an integer >= 1, got {v!r}")


_current = AttnResConfig()


def current() -> AttnResConfig:
    """The settings in force."""
    return _current


@contextlib.contextmanager
def config(**overrides):
    """``with config(fwd_ns=4, merge_num_warps=8): ...``: the given AttnResConfig fields replaced inside the block
    (nested blocks stack); yields the settings in force there. ValueError for an unknown field or a bad value."""
    global _current
    names = {f.name for f in dataclasses.fields(AttnResConfig)}
    bad = sorted(set(overrides) - names)
    if bad:
        raise ValueError(f"attn_residual config: unknown setting(s) {', '.join(bad)}")
    old = _current
    _current = dataclasses.replace(old, **overrides)
    try:
        yield _current
    finally:
        _current = old
