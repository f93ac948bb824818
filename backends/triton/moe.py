"""Triton backend of the Quantile-Balancing router and the latent mixture of experts.

Same signatures and results as ``backends/reference/moe.py`` (the ground truth), to within the
precision of the dtype. Semantics: ``spec/OPS.md`` (qb_route, qb_update, situ_glu, moe_experts)
and ``spec/MODEL.md`` (Stable LatentMoE). Kernels: ``backends/triton/moe_kernels.py``.

Pipeline of ``moe_experts`` (forward):
  1. dispatch: a stable device sort of the N*k expert ids (torch.sort, no host sync, no per-expert
     Python loop) gives the rows in expert order, per-expert offsets (int64, searchsorted) and the
     inverse map pos[t, j]; a per-tile schedule (tile -> expert) for each tile height BM;
  2. grouped GEMM 1 with SiTU-GLU in the epilogue: h = glu(x w1^T, x w3^T), one A tile (gathered
     token rows) against the w1 and the w3 tile in the same K loop;
  3. grouped GEMM 2: y = h w2^T per expert;
  4. weighted combine: u[t] = sum_j p[t, j] y[pos[t, j]] in float32.
MXFP4 experts (backends.mxfp4.MXFP4Experts, W4A16): the same grouped GEMMs load the packed E2M1 nibbles and E8M0
scales of each weight tile and decode it in registers before the dot (moe_kernels._mx_tile), forward and in the
backward's dA|dB and dx GEMMs; the weights are frozen (no weight gradient), and such GEMMs run BM-row tiles (no
HALF / TAIL).
Backward (torch.autograd.Function): G = du w2 by a plain grouped GEMM, then a row kernel forms the
activation's derivative dA, dB and d topk_weight (a row sum of G * h) over the saved pre-activations;
dx = dA w1 + dB w3 through one grouped GEMM that runs its K loop over (dA, w1) and then over (dB, w3) into
one accumulator (PAIR 3); the weight gradients by a grouped "K = tokens of the expert" GEMM: where the experts
average fewer than MoeConfig.wgrad_few_rows rows, _wgrad_held_kernel (one program per expert and m-tile holds
the expert's P^T tile; experts grouped by row count on the host) for the experts of at most
wgrad_held_max_rows rows, else (and for the experts left over) _wgrad_tile_kernel, one program per output
tile; dW1 and dW3 are two single-output launches. The SiTU-GLU's sigmoid and tanh run on the
special-function unit (tanh.approx) on the GPU and exactly under the interpreter. Otherwise no host
synchronisation in the GEMM path: the grids are upper bounds and the schedule lives on the device; the
argument checks read back the expert-id range (moe_experts) and the non-finite-row flags (qb_route) once per
call, and the held kernel's row counts come through a copy to pinned memory that the forward starts (the
backward waits for it only).

Launch settings: MoeConfig (tile table per device class, row-count thresholds), overridden in a with block by
config(...). Measurements behind every value, and the retired variants: benchmarks/results/moe.md.

Sources: DeepSeek-V3 (arXiv 2412.19437) Sec. 2.1.2 for the router; the Kimi K3 report
(arXiv 2607.24653) / spec/OPS.md for Quantile Balancing, SiTU-GLU and Stable LatentMoE.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping, Optional

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from backends.cuda_device import on_tensor_device
from backends.mxfp4 import is_packed
from backends.reference import moe as _ref
from backends.reference.ops import check_eps
from backends.reference.moe import fixed_step_update  # noqa: F401  (elementwise on [E]; same on GPU)
from . import moe_kernels as _k
from .norm import rms_norm
from .guard import (cdiv, check_interpreter_dot_dtype, check_kernel_device, check_kernel_dtype, device_table,
                    mark_phase, next_power_of_2, no_create_graph)

__all__ = [
    "qb_route",
    "qb_update",
    "fixed_step_update",
    "expert_load",
    "situ_glu",
    "moe_experts",
    "latent_moe",
    "TILE_CONFIGS",
    "MoeConfig",
    "config",
]

# Tile configurations per kernel: BM rows x BN cols x BK depth, warps, software-pipeline stages; A_TMA / W_TMA /
# O_TMA: TMA descriptors for the token rows / weights / weight-gradient output where the tensor allows them (else
# pointers); HALF: an expert's last m-tile of at most BM / 2 rows at half height; TAIL T: m-tiles of BM + T rows whose
# last T rows run swapped on the same weight tile (TAIL_STAGES: the stages then); both only where the experts
# average fewer than half_tile_max_rows rows. KX / KP_BASE: the held weight gradient's depth classes. The values are
# the measured best on an H200 at the K3 layer's shapes (benchmarks/moe_tiles.py; history: benchmarks/results/moe.md).
_CUDA_TILES = {
    "router": dict(BM=128, BN=128, BK=64, num_warps=8, num_stages=3, A_TMA=True, W_TMA=True),
    "glu_fwd": dict(BM=128, BN=128, BK=64, num_warps=8, num_stages=4, A_TMA=True, W_TMA=True, HALF=True, TAIL=32),
    "mm": dict(BM=128, BN=256, BK=64, num_warps=8, num_stages=3, A_TMA=True, W_TMA=True, HALF=True, TAIL=32,
               TAIL_STAGES=4),
    # dx = dA w1 + dB w3 as two K loops in sequence (PAIR 3: one operand pair per pipeline stage, so 128 x 256 fit)
    "dx": dict(BM=128, BN=256, BK=64, num_warps=8, num_stages=3, A_TMA=True, W_TMA=True, HALF=True, TAIL=32,
               TAIL_STAGES=4),
    "glu_bwd_mm": dict(BM=128, BN=256, BK=64, num_warps=8, num_stages=3, A_TMA=True, W_TMA=True, HALF=True,
                       TAIL=32, TAIL_STAGES=4),
    "glu_bwd_rows": dict(BLOCK_R=4, BLOCK_N=1024, num_warps=8, num_stages=1),
    # weight gradients, tile kernel: 128 x 256 tiles with pointer stores; below wgrad_few_rows rows per expert
    # 128 x 128 x 32 at 4 warps with TMA stores, so that two programs share an SM and one's stores overlap the other's
    # products
    "wgrad": dict(BM=128, BN=256, BK=64, num_warps=8, num_stages=3),
    "wgrad_few": dict(BM=128, BN=128, BK=32, num_warps=4, num_stages=3, O_TMA=True),
    # the held kernel (few rows per expert): depth in 32-row steps past 128 (stages cut to what fits at large depth)
    "wgrad_held": dict(BM=128, BN=128, num_warps=8, num_stages=3, KX=32),
}
# the interpreter's tiles: 16 wide, so that every kernel runs several tiles and partial tiles
_CPU_TILES = {name: dict(BM=16, BN=16, BK=16, num_warps=4, num_stages=1, A_TMA=True, W_TMA=True, O_TMA=True)
              for name in _CUDA_TILES if name != "glu_bwd_rows"}
_CPU_TILES["glu_bwd_rows"] = dict(BLOCK_R=2, BLOCK_N=16, num_warps=4, num_stages=1)
_CPU_TILES["wgrad_held"].update(KX=16, KP_BASE=16)  # the held kernel's depth classes at the CPU tiles' scale


def _f32_tiles(cfg):
    """The float32 form of a GPU tile config: tiles of at most 64 x 64 x 32 at 4 warps and 2 stages.  The GPU
    entries are sized for 2-byte operands; with float32 ones the products run in IEEE precision on the FMA units
    (_prec), and the bf16 tiles took twice the shared memory per stage and compiled for minutes
    (benchmarks/results/moe.md)."""
    cfg = dict(cfg)
    if "BM" in cfg:
        cfg.update(BM=min(cfg["BM"], 64), BN=min(cfg["BN"], 64), num_warps=4, num_stages=min(cfg["num_stages"], 2))
        if "BK" in cfg:
            cfg["BK"] = min(cfg["BK"], 32)
        if "TAIL_STAGES" in cfg:
            cfg["TAIL_STAGES"] = 2
    return cfg


def _frozen_tiles(tiles):
    return MappingProxyType({dev: MappingProxyType({name: MappingProxyType(dict(e)) for name, e in entries.items()})
                             for dev, entries in tiles.items()})


@dataclass(frozen=True)
class MoeConfig:
    """Launch settings of the MoE kernels.

    tiles: device class ("cuda"; "cuda_f32" for float32 operands on the GPU; "cpu", the interpreter) -> kernel
        entry -> its settings (read-only; see the comment above _CUDA_TILES).
    wgrad_few_rows: below this many rows per expert on average (N k / E; the K3 layer: 146 at 8192 tokens, 585 at
        32768), the weight gradients run the held kernel for the experts it takes and the tile kernel on its
        "wgrad_few" tiles for the others; else the tile kernel on "wgrad" tiles for all.
    wgrad_held_max_rows: the held kernel takes experts of at most this many rows.
    half_tile_max_rows: HALF and TAIL apply where the experts average fewer rows than this.
    profile: None, or a list that moe_experts appends (phase name, CUDA event) pairs to at its phase boundaries
        (benchmarks/moe.py --phases).
    """
    tiles: Mapping = field(default_factory=lambda: _frozen_tiles(
        {"cuda": _CUDA_TILES, "cuda_f32": {n: _f32_tiles(c) for n, c in _CUDA_TILES.items()}, "cpu": _CPU_TILES}))
    wgrad_few_rows: int = 256
    wgrad_held_max_rows: int = 256
    half_tile_max_rows: int = 256
    profile: Optional[list] = field(default=None, compare=False)


_DEFAULT = MoeConfig()
_current = _DEFAULT
#: the default tile table (read-only): device class -> kernel entry -> settings
TILE_CONFIGS = _DEFAULT.tiles
SHARED_BYTES = 232448  # an sm_90 block's shared-memory limit (227 KB)


def current() -> MoeConfig:
    """The settings in force."""
    return _current


@contextlib.contextmanager
def config(tiles=None, **fields):
    """``with config(tiles={"cpu": {"dx": {"BM": 32}}}, wgrad_few_rows=0): ...``: the settings in force inside the
    block. tiles: per device class and kernel entry, the settings that change (merged into the entry; a value None
    removes the key); fields: MoeConfig's other fields. Nested blocks stack. ValueError for an unknown field, device
    class or entry."""
    global _current
    old = _current
    names = {f.name for f in dataclasses.fields(MoeConfig)} - {"tiles"}
    bad = sorted(set(fields) - names)
    if bad:
        raise ValueError(f"moe config: unknown setting(s) {', '.join(bad)}")
    new = dataclasses.replace(old, **fields)
    if tiles:
        merged = {dev: {name: dict(e) for name, e in entries.items()} for dev, entries in old.tiles.items()}
        for dev, entries in tiles.items():
            if dev not in merged:
                raise ValueError(f"moe config: unknown device class {dev!r} (one of {', '.join(merged)})")
            for name, change in entries.items():
                if name not in merged[dev]:
                    raise ValueError(f"moe config: unknown kernel entry {name!r}")
                merged[dev][name].update(change)
                for k_ in [k_ for k_, v in merged[dev][name].items() if v is None]:
                    del merged[dev][name][k_]
        new = dataclasses.replace(new, tiles=_frozen_tiles(merged))
    _current = new
    try:
        yield new
    finally:
        _current = old


def _mark(name):
    mark_phase(_current.profile, name)


_ACT = {"situ": 0, "silu": 1}


def _check_gemm_operands(where, **named):
    """The grouped-GEMM kernels take float32 / float16 / bfloat16 operands with every dimension >= 1 (TMA
    descriptors and tl.dot): TypeError for another dtype (float64 gave wrong results), ValueError for an
    empty dimension."""
    for name, t in named.items():
        check_kernel_dtype(where, **{name: t})
        if 0 in t.shape[1:]:
            raise ValueError(f"{where}: {name} has an empty dimension {tuple(t.shape)}")


def _cfg(name, t):
    """The tile entry `name` in force for operand t: "cpu" (interpreter), "cuda", or "cuda_f32" for float32."""
    tiles = _current.tiles
    if not t.is_cuda:
        return tiles["cpu"][name]
    return tiles["cuda_f32" if t.dtype == torch.float32 else "cuda"][name]


def _prec(dtype):
    return "ieee" if dtype == torch.float32 else "tf32"


#: launch key (the tile entry and what else sets the shared memory a stage takes: the operand dtype, swapped
#: tails) -> the pipeline stages that fit the GPU's shared memory, where fewer than configured (_fit_launch)
_STAGES_FIT: dict = {}


def _fit_launch(kernel, grid, key, launch, *args, **kwargs):
    """kernel[grid](*args, **kwargs, **launch), with launch["num_stages"] lowered one at a time while the GPU's
    shared memory cannot hold that many stages (triton raises OutOfResources when it loads the kernel, before
    anything runs), and the count that fits remembered under key.  The GPU tile entries are sized for 2-byte
    operands; float32 ones take twice the shared memory per stage (a float32 model on the GPU asked for 360 KB of
    the H200's 227 KB in the grouped GEMM)."""
    if key in _STAGES_FIT:
        launch = dict(launch, num_stages=min(launch["num_stages"], _STAGES_FIT[key]))
    while True:
        try:
            return kernel[grid](*args, **kwargs, **launch)
        except triton.runtime.errors.OutOfResources as e:
            if "shared memory" not in str(e) or launch["num_stages"] <= 1:
                raise
            launch = dict(launch, num_stages=launch["num_stages"] - 1)
            _STAGES_FIT[key] = launch["num_stages"]


def _launch_cfg(cfg, tail=0):
    """num_warps / num_stages of a tile entry ("TAIL_STAGES" instead when a grouped GEMM runs swapped tails: each
    stage then holds the tail's rows too)."""
    launch = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if tail and cfg.get("TAIL_STAGES"):
        launch["num_stages"] = cfg["TAIL_STAGES"]
    return launch


# ------------------------------------------------------------------------------------------------
# routing
# ------------------------------------------------------------------------------------------------
def _overflow_rows(bad, x, weight, bias, where):
    """The rows flagged by the routing kernel (non-finite logits) as an index tensor, when each is a row of
    finite x whose x @ weight^T overflowed float32 (they are routed from float64 logits, as in the reference);
    ValueError naming the first row of x that holds NaN / inf, or a non-finite router weight or bias."""
    rows = torch.nonzero(bad).flatten()
    xbad = ~torch.isfinite(x[rows]).all(dim=-1)
    if bool(xbad.any()):
        n_bad = int((~torch.isfinite(x).all(dim=-1)).sum())
        raise ValueError(f"{where}: row {int(rows[xbad][0])} of x holds NaN or inf ({n_bad} bad row(s) of "
                         f"{x.shape[0]}); refusing to route it")
    if weight is not None and not bool(torch.isfinite(weight).all()):
        raise ValueError(f"{where}: router weight holds NaN or inf")
    if bias is not None and not bool(torch.isfinite(bias).all()):
        raise ValueError(f"{where}: bias holds NaN or inf")
    return rows


def _router_logits(x, weight):
    """float32 logits [N, E] = x @ weight^T through the grouped GEMM kernel with a single group."""
    n, d = x.shape
    e = weight.shape[0]
    logits = torch.empty(n, e, dtype=torch.float32, device=x.device)
    if n == 0:
        return logits
    cfg = _cfg("router", x)
    offs = device_table([0, n], torch.int64, x.device)
    m_tiles = cdiv(n, cfg["BM"])
    sched = (torch.zeros(m_tiles, dtype=torch.int64, device=x.device),
             torch.zeros(1, dtype=torch.int64, device=x.device), m_tiles, cfg["BM"])
    _gg("router", x, weight.unsqueeze(0), sched, offs, 1, d, e, logits, gather=False, w_kn=False)
    return logits


def _select(values, bias, k_sel, *, from_logits, write_topk, write_alpha, routed_scaling=1.0):
    """Run the row top-k kernel; returns (scores or None, idx, wt, alpha, bad)."""
    n, e = values.shape
    dev = values.device
    block_e = next_power_of_2(max(e, 2))
    block_r = max(1, min(16, 4096 // block_e))
    scores = torch.empty(n, e, dtype=torch.float32, device=dev) if from_logits else values
    idx = torch.empty(n, k_sel, dtype=torch.int64, device=dev) if write_topk else bias
    wt = torch.empty(n, k_sel, dtype=torch.float32, device=dev) if write_topk else bias
    alpha = torch.empty(n, dtype=torch.float32, device=dev) if write_alpha else bias
    bad = torch.empty(n, dtype=torch.int32, device=dev)
    if n > 0:
        _k._route_topk_kernel[(cdiv(n, block_r),)](
            values, bias, scores, idx, wt, alpha, bad, n, e, float(routed_scaling),
            K_SEL=k_sel, K_PAD=next_power_of_2(max(k_sel, 2)), FROM_LOGITS=from_logits,
            WRITE_TOPK=write_topk, WRITE_ALPHA=write_alpha, BLOCK_R=block_r, BLOCK_E=block_e,
            num_warps=4)
    return scores, idx, wt, alpha, bad


class _RouteFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, top_k, routed_scaling):
        # the GEMM in the wider of the two dtypes (float32 accumulation either way): a float32 router weight
        # with bf16 / fp16 activations keeps its precision (the contract's scores are float32; casting the
        # weight down put ~1e-3 relative error into the logits); a bf16 model's router stays one bf16 GEMM
        dt = torch.promote_types(x.dtype, weight.dtype)
        xc = x.to(dt).contiguous()
        wc = weight.to(dt).contiguous()
        logits = _router_logits(xc, wc)
        scores, idx, wt, _, bad = _select(logits, bias.float().contiguous(), top_k, from_logits=True,
                                          write_topk=True, write_alpha=False,
                                          routed_scaling=routed_scaling)
        if x.shape[0] > 0 and bool(bad.any()):
            rows = _overflow_rows(bad.bool(), x, weight, bias, "qb_route")
            idx[rows], wt[rows], scores[rows] = _ref.route_overflow_rows(x[rows], weight, bias.float(), top_k,
                                                                         routed_scaling)
        ctx.save_for_backward(x, weight, scores, idx, wt)
        ctx.scaling = float(routed_scaling)
        ctx.gemm_dtype = dt
        ctx.mark_non_differentiable(idx)
        return idx, wt, scores

    @staticmethod
    def backward(ctx, _didx, dwt, dscores):
        no_create_graph("backends.triton.qb_route")
        x, weight, scores, idx, wt = ctx.saved_tensors
        ds = torch.zeros_like(scores) if dscores is None else dscores.float().clone()
        dlog = ds * scores * (1.0 - scores)
        if dwt is not None:
            # w = c softmax(l), l_j = log sigmoid(z_j) of the picks:  dL/dl_m = w_m (g_m - sum_j g_j w_j / c),
            # dl/dz = 1 - s (no division by the picks' score sum, which underflows with the scores)
            g = dwt.float()
            inner = (g * wt).sum(1, keepdim=True) / ctx.scaling
            dlog.scatter_add_(1, idx, wt * (g - inner) * (1.0 - scores.gather(1, idx)))
        # the two backward GEMMs in the forward GEMM's dtype (float32 accumulation in cuBLAS), as autograd
        # through a bf16 x @ W^T runs them (the torch._grouped_mm baseline of benchmarks/moe.py does): in
        # float32 they would run off the tensor cores
        dt = ctx.gemm_dtype
        dlog = dlog.to(dt)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = (dlog @ weight.to(dt)).to(x.dtype)
        if ctx.needs_input_grad[1]:
            dw = (dlog.t() @ x.to(dt)).to(weight.dtype)
        return dx, dw, None, None, None


@on_tensor_device
def qb_route(x, weight, bias, *, top_k, routed_scaling=1.0):
    """Sigmoid router with selection-only bias, on Triton (see the reference for the contract).

    Args:
        x: [N, d] (float32 / float16 / bfloat16); weight: [E, d] (the GEMM runs in the wider dtype of the two,
            accumulating in float32);
        bias: [E] float32 buffer; top_k in [1, E]; routed_scaling: factor on the weights.
    Returns:
        topk_idx [N, k] int64 (descending biased score, ties to the lower expert index),
        topk_weight [N, k] float32 (unbiased scores of the picks / their sum * routed_scaling),
        scores [N, E] float32 = sigmoid(x @ weight^T).
    Raises:
        TypeError / ValueError: bad shapes/types, top_k out of range, routed_scaling not finite and > 0, and a
        row of x with NaN/inf (message names the row; one device-to-host sync per call for this check). A
        finite row whose logits overflow float32 is routed as in the reference (float64 logits for that row).
    Differentiable in x and weight (through topk_weight and scores).
    Math: DeepSeek-V3 (arXiv 2412.19437) Eqs. 13-16; bias selection-only (Sec. 2.1.2).
    """
    _ref._check_tensor("x", x, 2, "qb_route")
    _ref._check_tensor("weight", weight, 2, "qb_route")
    _ref._check_tensor("bias", bias, 1, "qb_route")
    _ref._check_float("x", x, "qb_route")
    _ref._check_float("weight", weight, "qb_route")
    _ref._check_float("bias", bias, "qb_route")
    check_kernel_device("triton.qb_route", x=x, weight=weight, bias=bias)
    if weight.shape[1] != x.shape[1]:
        raise ValueError(f"qb_route: weight is [E, d] = {tuple(weight.shape)} but x has d = {x.shape[1]}")
    if bias.shape[0] != weight.shape[0]:
        raise ValueError(f"qb_route: bias has {bias.shape[0]} entries, expected E = {weight.shape[0]}")
    top_k = _ref._check_top_k(top_k, weight.shape[0], "qb_route")
    if x.shape[1] == 0:
        # no features: every logit is the empty sum 0 (scores 0.5) and there is no product to run a kernel for;
        # the reference gives that result (and its gradients, empty), as for any other d
        return _ref.qb_route(x, weight, bias, top_k=top_k, routed_scaling=routed_scaling)
    _check_gemm_operands("triton.qb_route", x=x, weight=weight)
    _ref.check_routed_scaling(routed_scaling, "qb_route")
    check_interpreter_dot_dtype("triton.qb_route", x=x)
    return _RouteFn.apply(x, weight, bias, top_k, routed_scaling)


@on_tensor_device
def qb_update(scores, bias, *, top_k, ema=0.0, dp_group=None):
    """One Quantile Balancing step on Triton (contract and edge rules: reference ``qb_update``).

    alpha (each token's (k+1)-th largest biased score) by the row-selection kernel; the
    (q+1)-th largest margin of each expert column by an exact radix select (8 passes of 4-bit
    digits over the order-preserving integer image of float32, counts by atomics), so the result
    equals the sort-based definition bit for bit. Centring, ema and the data-parallel average
    (all-reduce over ``dp_group`` when torch.distributed is initialised) as in the reference.

    Args: scores [N, E] float (sigmoid outputs of batch t), bias [E], top_k, ema in [0, 1).
    Returns: new_bias [E] float32. Raises: TypeError / ValueError as the reference.
    """
    where = "qb_update"
    _ref._check_tensor("scores", scores, 2, where)
    _ref._check_tensor("bias", bias, 1, where)
    _ref._check_float("scores", scores, where)
    _ref._check_float("bias", bias, where)
    check_kernel_device("triton.qb_update", scores=scores, bias=bias)
    n, e = scores.shape
    if bias.shape[0] != e:
        raise ValueError(f"{where}: bias has {bias.shape[0]} entries but scores has E = {e}")
    top_k = _ref._check_top_k(top_k, e, where)
    ema = _ref.check_ema(ema, where)
    s = scores.detach().float().contiguous()
    b = bias.detach().float().contiguous()
    if not bool(torch.isfinite(b).all()):         # [E]: one small check (the reference refuses it too)
        raise ValueError(f"{where}: bias holds NaN or inf")
    if n == 0:
        b_hat = None                                  # no tokens: nothing to balance by (the bias stays)
    elif top_k == e:
        _ref.check_finite_rows("scores", s, where)
        b_hat = torch.zeros_like(b)
    else:
        _, _, _, alpha, bad = _select(s, b, top_k + 1, from_logits=False, write_topk=False,
                                      write_alpha=True)
        if bool(bad.any()):
            row = int(torch.nonzero(bad)[0, 0])
            raise ValueError(f"{where}: row {row} of scores holds NaN or inf")
        q = (n * top_k) // e
        cnt = torch.zeros(8, e, 16, dtype=torch.int32, device=s.device)
        bn, be = (64, 64) if s.is_cuda else (32, 16)
        grid = (cdiv(n, bn), cdiv(e, be))
        for p in range(8):
            _k._qb_count_kernel[grid](s, alpha, cnt, n, e, q, p, BLOCK_N=bn, BLOCK_E=be, num_warps=4)
        b_hat = torch.empty(e, dtype=torch.float32, device=s.device)
        _k._qb_finish_kernel[(cdiv(e, 128),)](cnt, b_hat, e, q, BLOCK_E=128, num_warps=4)
    return _ref.qb_finish(b_hat, b, ema, dp_group)


@on_tensor_device
def expert_load(topk_idx, num_experts):
    """Tokens per expert, int64 [E] (the routing-statistics hook), by an atomic histogram kernel.

    Raises ValueError when an index lies outside [0, num_experts) (one host sync for the check).
    """
    if not isinstance(topk_idx, torch.Tensor) or topk_idx.is_floating_point():
        raise TypeError("expert_load: topk_idx must be an integer tensor")
    check_kernel_device("triton.expert_load", topk_idx=topk_idx)
    e = _ref.check_num_experts(num_experts, "expert_load")
    flat = topk_idx.reshape(-1).contiguous()
    load = torch.zeros(e, dtype=torch.int64, device=flat.device)
    bad = torch.zeros(1, dtype=torch.int32, device=flat.device)
    m = flat.numel()
    if m:
        _k._expert_load_kernel[(cdiv(m, 1024),)](flat, load, m, e, bad, BLOCK=1024, num_warps=4)
        if int(bad.item()):
            raise ValueError(f"expert_load: expert indices must be in [0, {e}), got "
                             f"[{int(flat.min())}, {int(flat.max())}]")
    return load


# ------------------------------------------------------------------------------------------------
# SiTU-GLU elementwise (used by the shared experts)
# ------------------------------------------------------------------------------------------------
class _GluFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, act, beta_gate, beta_up):
        a_c, b_c = a.contiguous(), b.contiguous()
        dtype = torch.promote_types(a.dtype, b.dtype)
        h = torch.empty(a.shape, dtype=dtype, device=a.device)
        m = a_c.numel()
        if m:
            _k._situ_fwd_ew[(cdiv(m, 1024),)](a_c, b_c, h, m, float(beta_gate), float(beta_up),
                                            ACT=act, FAST=a.is_cuda, BLOCK=1024, num_warps=4)
        ctx.save_for_backward(a_c, b_c)
        ctx.cfg = (act, float(beta_gate), float(beta_up))
        return h

    @staticmethod
    def backward(ctx, dh):
        no_create_graph("backends.triton.situ_glu")
        a, b = ctx.saved_tensors
        act, bg, bu = ctx.cfg
        dh = dh.contiguous()
        da, db = torch.empty_like(a), torch.empty_like(b)
        m = a.numel()
        if m:
            _k._situ_bwd_ew[(cdiv(m, 1024),)](a, b, dh, da, db, m, bg, bu, ACT=act, FAST=a.is_cuda,
                                            BLOCK=1024, num_warps=4)
        return da, db, None, None, None


@on_tensor_device
def situ_glu(a, b, *, beta_gate=4.0, beta_up=25.0):
    """SiTU-GLU on Triton: h = (bg tanh(a/bg) sigmoid(a)) (bu tanh(b/bu)) (spec/OPS.md), computed in
    float32, returned in the promoted dtype of a and b; differentiable. On the GPU tanh uses the
    hardware approximation (relative error ~2^-11). Raises TypeError / ValueError as the reference (same
    checks)."""
    _ref.check_glu_args(a, b, beta_gate, beta_up, "situ_glu")
    check_kernel_device("triton.situ_glu", a=a, b=b)
    return _GluFn.apply(a, b, 0, beta_gate, beta_up)


def _glu_act(a, b, activation, beta_gate, beta_up):
    return _GluFn.apply(a, b, _ACT[activation], beta_gate, beta_up)


# ------------------------------------------------------------------------------------------------
# dispatch and grouped GEMMs
# ------------------------------------------------------------------------------------------------
class _Dispatch:
    """Rows of the routed problem in expert order (see moe_kernels' module docstring)."""

    def __init__(self, topk_idx, num_experts):
        n, k = topk_idx.shape
        dev = topk_idx.device
        self.n, self.k, self.e, self.nk = n, k, num_experts, n * k
        flat = topk_idx.reshape(-1).to(torch.int64)
        sorted_e, perm = torch.sort(flat, stable=True)
        self.perm = perm  # row -> flat (token, slot) index
        self.tok = perm // k  # row -> token
        self.offs = torch.searchsorted(sorted_e, torch.arange(num_experts + 1, device=dev))  # int64
        pos = torch.empty_like(perm)
        pos[perm] = torch.arange(self.nk, device=dev)
        self.pos = pos  # flat (token, slot) -> row
        self._sched = {}
        self._counts = self._counts_ready = self._host_list = None

    def prefetch_counts(self):
        """Start copying the rows per expert to pinned host memory behind the work queued so far (CUDA), so that
        host_counts() later waits for that copy only, not for the whole queue (a plain read-back would drain it:
        the launches after it then start from an empty queue)."""
        if self._counts is None and self.offs.is_cuda:
            self._counts = torch.empty(self.e, dtype=torch.int64, pin_memory=True)
            self._counts.copy_(self.offs[1:] - self.offs[:-1], non_blocking=True)
            self._counts_ready = torch.cuda.Event()
            self._counts_ready.record()

    def host_counts(self):
        """Rows per expert as a Python list, read once (after prefetch_counts: waits for that copy; else one device
        sync) and kept for the dispatch's other launches."""
        if self._host_list is None:
            if self._counts_ready is not None:
                self._counts_ready.synchronize()
                self._host_list = self._counts.tolist()
            else:
                self._host_list = (self.offs[1:] - self.offs[:-1]).tolist()
        return self._host_list

    def schedule(self, bm):
        """(tile_expert [max_tiles] int64, tile_start [E] int64, max_tiles, bm) for tile height bm (rows)."""
        if bm not in self._sched:
            counts = self.offs[1:] - self.offs[:-1]
            mt = (counts + bm - 1) // bm
            ends = torch.cumsum(mt, 0)
            max_tiles = max(1, cdiv(self.nk, bm) + min(self.e, self.nk))
            tile_expert = torch.searchsorted(ends, torch.arange(max_tiles, device=ends.device), right=True)
            self._sched[bm] = (tile_expert, (ends - mt).contiguous(), max_tiles, bm)
        return self._sched[bm]


def _tma_ok(t, block):
    """Whether a TMA descriptor can address t: last dim contiguous, 16-byte aligned base and
    strides, and every block dim no larger than 256 (the copy engine's box limit)."""
    if t.dim() == 0 or t.stride(-1) != 1 or t.data_ptr() % 16:
        return False
    if any((st * t.element_size()) % 16 for st in t.stride()[:-1]):
        return False
    return all(b_ <= 256 for b_ in block)


def _check_tile_rows(what, stride, bm):
    """The kernels' store epilogues address a tile with int32 offsets (row x stride): ValueError when bm rows of
    this stride reach 2**31 elements."""
    if stride * bm >= 2 ** 31:
        raise ValueError(f"moe_experts: {what} rows of {stride} elements are too wide for {bm}-row tiles "
                         f"(row stride x tile rows must stay below 2**31)")


def _gg(name, a, w, sched, offs, num_experts, kk, nn, c, *, gather, w_kn, tok=None, pair=0,
        w2=None, a2=None, epi=0, save=False, c2=None, c3=None, wrow=None, act=0, bg=4.0, bu=25.0,
        row_scale=False):
    """Launch the grouped GEMM kernel (see its docstring). a: [rows, kk] (gathered through tok
    when `gather`); w: [E, nn, kk] (w_kn False) or [E, kk, nn] (w_kn True), a tensor or (w and w2 both)
    MXFP4Experts, whose tiles the kernel decodes (W_MX). sched: (tile_expert, tile_start,
    max_tiles, tile height) from _sched (height BM + TAIL with a swapped tail, else BM)."""
    if is_packed(w):
        return _gg_mx(name, a, w, sched, offs, num_experts, kk, nn, c, gather=gather, w_kn=w_kn, tok=tok, pair=pair,
                      w2=w2, a2=a2, epi=epi, save=save, c2=c2, c3=c3, wrow=wrow, act=act, bg=bg, bu=bu,
                      row_scale=row_scale)
    cfg = _cfg(name, a)
    bm, bn, bk = cfg["BM"], cfg["BN"], cfg["BK"]
    te, ts, mt, height = sched
    tail = height - bm
    if tail and (tail < 16 or tail > bm or tail & (tail - 1)):
        raise ValueError(f"moe_experts: {name}: a tile of {height} rows on {bm}-row tiles leaves a tail of {tail} "
                         f"rows; TAIL must be a power of two from 16 to BM (MoeConfig.tiles)")
    _check_tile_rows("output", c.stride(0), bm)
    n_tiles = cdiv(nn, bn)
    a_mode, a_src, a2_src = _a_sources(a, a2, cfg, bm, bk, gather)
    wblock = [1, bk, bn] if w_kn else [1, bn, bk]
    w_desc = bool(cfg.get("W_TMA")) and _tma_ok(w, wblock) and (w2 is None or (
        _tma_ok(w2, wblock) and w2.stride() == w.stride()))
    if w_desc:
        w_src = TensorDescriptor.from_tensor(w, wblock)
        w2_src = TensorDescriptor.from_tensor(w2, wblock) if w2 is not None else w_src
    else:
        w_src, w2_src = w, (w2 if w2 is not None else w)
    swk, swn = (w.stride(1), w.stride(2)) if w_kn else (w.stride(2), w.stride(1))
    rows = tok.numel() if gather and tok is not None else a.shape[0]
    half = bool(cfg.get("HALF")) and bm >= 32 and _few_rows(rows, num_experts)

    def row_srcs(on, height):
        """The A (and A2) sources of the tiles `height` rows tall: descriptors with [height, BK] blocks (A_MODE 2)
        when `on`, else the BM-row ones."""
        if not (on and a_mode == 2):
            return a_src, a2_src
        d1 = TensorDescriptor.from_tensor(a, [height, bk])
        return d1, (TensorDescriptor.from_tensor(a2, [height, bk]) if a2 is not None else d1)
    a_h_src, a2_h_src = row_srcs(half, bm // 2)
    a_t_src, a2_t_src = row_srcs(tail, tail)
    dummy = c
    _fit_launch(
        _k._grouped_gemm_kernel, (mt * n_tiles,), (name, a.dtype, bool(tail)), _launch_cfg(cfg, tail=tail),
        a_src, tok if tok is not None else offs, w_src, a2_src, w2_src,
        c, c2 if c2 is not None else dummy, c3 if c3 is not None else dummy,
        wrow if wrow is not None else dummy,
        te, ts, offs, kk, nn, num_experts, n_tiles,
        a.stride(0), w.stride(0), swn, swk, c.stride(0), float(bg), float(bu),
        PAIR=pair, EPI=epi, SAVE=save, ROW_SCALE=row_scale, ACT=act, FAST=a.is_cuda, A_MODE=a_mode, W_DESC=w_desc,
        W_KN=w_kn, PREC=_prec(a.dtype), EVEN_K=(kk % bk == 0), BM=bm, BN=bn, BK=bk, HALF=half,
        a_h_src=a_h_src, a2_h_src=a2_h_src, TAIL=tail, a_t_src=a_t_src, a2_t_src=a2_t_src)
    return c


def _a_sources(a, a2, cfg, bm, bk, gather):
    """(A_MODE, A source, A2 source) of a grouped GEMM launch: 0 rows gathered through the token index (pointers),
    2 TMA descriptors of [BM, BK] blocks when the config asks for them and the tensors allow, else 1 pointers."""
    if gather:
        return 0, a, a
    if cfg.get("A_TMA") and _tma_ok(a, [bm, bk]) and (a2 is None or _tma_ok(a2, [bm, bk])):
        d = TensorDescriptor.from_tensor(a, [bm, bk])
        return 2, d, (TensorDescriptor.from_tensor(a2, [bm, bk]) if a2 is not None else d)
    return 1, a, (a2 if a2 is not None else a)


def _gg_mx(name, a, w, sched, offs, num_experts, kk, nn, c, *, gather, w_kn, tok, pair, w2, a2, epi, save, c2,
           c3, wrow, act, bg, bu, row_scale):
    """_gg with MXFP4 weights w (and w2): the kernel's W_MX path (W4A16), A through pointers or TMA as in _gg, the
    weights through pointers (packed bytes and scales, decoded in registers). No HALF / TAIL tiles."""
    cfg = _cfg(name, a)
    bm, bn, bk = cfg["BM"], cfg["BN"], cfg["BK"]
    te, ts, mt, height = sched
    if height != bm:
        raise ValueError(f"moe_experts: {name}: MXFP4 weights run {bm}-row tiles, the schedule has {height}")
    w2 = w if w2 is None else w2
    if w2.shape != w.shape:
        raise ValueError(f"moe_experts: MXFP4 weight pair {list(w.shape)} and {list(w2.shape)} differ")
    p, sc, p2, sc2 = w.weight_packed, w.weight_scale, w2.weight_packed, w2.weight_scale
    if any(not t.is_contiguous() for t in (p, sc, p2, sc2)):
        raise ValueError("moe_experts: MXFP4 weight_packed / weight_scale must be contiguous")
    _check_tile_rows("output", c.stride(0), bm)
    n_tiles = cdiv(nn, bn)
    a_mode, a_src, a2_src = _a_sources(a, a2, cfg, bm, bk, gather)
    dummy = c
    _fit_launch(
        _k._grouped_gemm_kernel, (mt * n_tiles,), (name, a.dtype, "mx"), _launch_cfg(cfg),
        a_src, tok if tok is not None else offs, p, a2_src, p2,
        c, c2 if c2 is not None else dummy, c3 if c3 is not None else dummy,
        wrow if wrow is not None else dummy,
        te, ts, offs, kk, nn, num_experts, n_tiles,
        a.stride(0), p.stride(0), p.stride(1), 0, c.stride(0), float(bg), float(bu),
        PAIR=pair, EPI=epi, SAVE=save, ROW_SCALE=row_scale, ACT=act, FAST=a.is_cuda, A_MODE=a_mode, W_DESC=False,
        W_KN=w_kn, PREC=_prec(a.dtype), EVEN_K=(kk % bk == 0), BM=bm, BN=bn, BK=bk, HALF=False,
        ws_src=sc, w2s_src=sc2, stride_se=sc.stride(0), stride_sr=sc.stride(1), W_MX=True)
    return c


def _sched(d, name, a, mx=False):
    """The m-tile schedule of dispatch d for the grouped GEMM `name`: tiles BM + TAIL rows tall when the config
    has a TAIL and the experts average fewer than half_tile_max_rows rows (as HALF) and the weights are not MXFP4
    (mx), else BM."""
    cfg = _cfg(name, a)
    tail = int(cfg.get("TAIL") or 0)
    if mx or not (tail and _few_rows(d.nk, d.e)):
        tail = 0
    return d.schedule(cfg["BM"] + tail)


def _few_rows(rows, num_experts):
    """Whether the experts average fewer than half_tile_max_rows rows: the gate of HALF and TAIL."""
    return rows < _current.half_tile_max_rows * max(num_experts, 1)


def _pregather(name, t, d):
    """Rows t[tok[r]] in dispatch order when the kernel `name` is set to feed A through TMA."""
    cfg = _cfg(name, t)
    if cfg.get("A_TMA") and _tma_ok(t, [cfg["BM"], cfg["BK"]]):
        return t.index_select(0, d.tok)
    return None


def _combine(y, d, out_dtype):
    """out[t] = sum_j y[pos[t, j]] in float32 (the rows carry their routing weights already)."""
    n, lw = d.n, y.shape[1]
    out = torch.empty(n, lw, dtype=out_dtype, device=y.device)
    block = min(1024, next_power_of_2(max(lw, 16)))
    if n:
        _k._combine_kernel[(n, cdiv(lw, block))](
            y, d.pos, out, lw, y.stride(0), out.stride(0), TOPK=d.k, BLOCK=block, num_warps=4)
    return out


def _wgrad(p, q, d, mm, nn, out, *, ptok=None, qtok=None):
    """out[e] = P_e^T Q_e over each expert's rows (P[r] = p[ptok[r]], Q[r] = q[qtok[r]] when given): where the
    experts average fewer than wgrad_few_rows rows, the held kernel for the experts it takes (_wgrad_held_groups)
    and the tile kernel on "wgrad_few" tiles for the rest; else the tile kernel on "wgrad" tiles for all."""
    few = d.nk < _current.wgrad_few_rows * d.e
    rest = None  # the experts left to the tile kernel (None: all of them)
    if few:
        groups, rest = _wgrad_held_groups(_counts_of(d), _cfg("wgrad_held", p))
        for (kp, nx), experts in groups:
            _wgrad_held(p, q, d, mm, nn, out, kp, ptok=ptok, qtok=qtok, nx=nx, experts=experts)
        if rest == []:
            return
    cfg = _cfg("wgrad_few" if few else "wgrad", p)
    bm, bn = cfg["BM"], cfg["BN"]
    m_tiles, n_tiles = cdiv(mm, bm), cdiv(nn, bn)
    o_desc, o_dst = _wgrad_out(cfg, out, bm, bn)
    exp = d.offs if rest is None else _device_list(rest, p.device)
    _fit_launch(
        _k._wgrad_tile_kernel, ((d.e if rest is None else len(rest)) * m_tiles * n_tiles,), ("wgrad", p.dtype),
        _launch_cfg(cfg), p, ptok if ptok is not None else d.tok, q, qtok if qtok is not None else d.tok,
        o_dst, d.offs, exp, mm, nn, m_tiles, n_tiles, p.stride(0), q.stride(0), out.stride(0), out.stride(1),
        P_GATHER=ptok is not None, Q_GATHER=qtok is not None, PREC=_prec(p.dtype), BM=bm, BN=bn, BK=cfg["BK"],
        O_DESC=o_desc, EXP_LIST=rest is not None)


def _device_list(experts, device):
    """Expert ids as an int32 tensor on device (the EXP_LIST argument of the weight-gradient kernels)."""
    return torch.tensor(experts, dtype=torch.int32).to(device, non_blocking=True)


def _wgrad_out(cfg, out, bm, bn):
    """The weight-gradient kernels' output slot: (True, descriptor) with [1, bm, bn] blocks when cfg asks for TMA
    stores ("O_TMA") and out allows them, else (False, out)."""
    if not (cfg.get("O_TMA") and _tma_ok(out, [1, bm, bn])):
        return False, out
    return True, TensorDescriptor.from_tensor(out, [1, bm, bn])


def _wgrad_held_stages(cfg, kp, es):
    """Pipeline stages of _wgrad_held_kernel that fit SHARED_BYTES: the held [BM, KP] P tile, one [KP, BN] Q tile per
    stage and the epilogue's [BM, BN] staging (sm_90a compile: KP 256, 128 x 128 -> 224 KB at 2 stages; KP 128 ->
    160 KB at 3). es: element size in bytes."""
    bm, bn = cfg["BM"], cfg["BN"]
    fit = (SHARED_BYTES - bm * kp * es - bm * bn * es) // (kp * bn * es)
    return max(1, min(cfg["num_stages"], fit))


def _counts_of(d):
    """Rows per expert of dispatch d as a Python list (_Dispatch.host_counts; d may also be an object with just
    offs, as the tests' stand-ins)."""
    return d.host_counts() if hasattr(d, "host_counts") else (d.offs[1:] - d.offs[:-1]).tolist()


def _wgrad_held_groups(counts, cfg):
    """The held kernel's launches for experts of these row counts, and the experts left to the tile kernel:
    ([((KP, NX), experts)], rest), rest = [] when the held kernel takes every expert, None when it takes none (the
    tile kernel then runs over all of them). Experts grouped by depth: an expert of c rows at KP = next power of
    two of c (>= 16) when c <= KP_BASE (default 128), else KP = KP_BASE and NX = ceil((c - KP_BASE) / KX) more
    KX-row blocks; experts of more than wgrad_held_max_rows rows or 4 such blocks go to the tile kernel."""
    kx = cfg["KX"]
    base = cfg.get("KP_BASE", 128)
    groups, rest = {}, []
    for e, c in enumerate(counts):
        key = (max(16, next_power_of_2(max(c, 1))), 0) if c <= base else (base, cdiv(c - base, kx))
        if key[1] > 4 or c > _current.wgrad_held_max_rows:
            rest.append(e)
        else:
            groups.setdefault(key, []).append(e)
    if len(rest) == len(counts):
        return [], None
    return sorted(groups.items()), rest


def _wgrad_held(p, q, d, mm, nn, out, kp, *, ptok=None, qtok=None, nx=0, experts=None):
    """Launch _wgrad_held_kernel: out[e] = P_e^T Q_e for experts of at most kp + nx * KX rows (kp a power of two
    >= 16; KX from the "wgrad_held" entry), over every expert or over the list `experts`."""
    cfg = _cfg("wgrad_held", p)
    bm, bn = cfg["BM"], cfg["BN"]
    kx = cfg["KX"]
    m_tiles = cdiv(mm, bm)
    _check_tile_rows("weight-gradient", out.stride(1), bm)
    launch = _launch_cfg(cfg)
    if p.is_cuda:
        launch["num_stages"] = _wgrad_held_stages(cfg, kp + nx * kx, p.element_size())
    exp = d.offs if experts is None else _device_list(experts, p.device)
    n_exp = d.e if experts is None else len(experts)
    o_desc, o_dst = _wgrad_out(cfg, out, bm, bn)
    _k._wgrad_held_kernel[(n_exp * m_tiles,)](
        p, ptok if ptok is not None else d.tok, q, qtok if qtok is not None else d.tok, o_dst, d.offs, exp,
        mm, nn, m_tiles, p.stride(0), q.stride(0), out.stride(0), out.stride(1),
        P_GATHER=ptok is not None, Q_GATHER=qtok is not None, PREC=_prec(p.dtype), BM=bm, BN=bn, KP=kp, KX=kx,
        NX=nx, EXP_LIST=experts is not None, O_DESC=o_desc, **launch)


def _glu_bwd_rows(g, a, b, w_rows, da, db, dwrow, act, bg, bu):
    """The split GLU backward's row pass (config "glu_bwd_rows"): from G and the saved pre-activations a, b [rows, i],
    dA, dB (da / db may be a / b themselves) and dwrow[r] = sum_n G h, float32."""
    rows, i = a.shape
    rc = _cfg("glu_bwd_rows", a)
    _k._glu_bwd_rows_kernel[(cdiv(rows, rc["BLOCK_R"]),)](
        g, a, b, w_rows, da, db, dwrow, rows, i, g.stride(0), float(bg), float(bu), ACT=act,
        FAST=a.is_cuda, BLOCK_R=rc["BLOCK_R"], BLOCK_N=rc["BLOCK_N"], **_launch_cfg(rc))


def _glu_backward(d, du, dus, w2, a, b, w_rows, l, i, act, bg, bu, da=None, db=None):
    """The backward of GEMM 1's GLU epilogue: G = du[tok] w2[e] (K = l, N = i) by a plain grouped GEMM, then
    _glu_bwd_rows_kernel forms dA, dB from the saved pre-activations a, b [rows, i] and d w_rows (float32 [rows],
    the row sums of G h). dus: du's rows in dispatch order (from _pregather) or None (the GEMM gathers du). da, db:
    output buffers; by default a, b themselves (written in place). Returns (da, db, dwrow)."""
    src = dus if dus is not None else du
    da = a if da is None else da
    db = b if db is None else db
    dwrow = torch.empty(d.nk, dtype=torch.float32, device=a.device)
    g = torch.empty_like(a)
    _gg("glu_bwd_mm", src, w2, _sched(d, "glu_bwd_mm", a, is_packed(w2)), d.offs, d.e, l, i, g, gather=dus is None,
        tok=d.tok, w_kn=True)
    _glu_bwd_rows(g, a, b, w_rows, da, db, dwrow, act, bg, bu)
    return da, db, dwrow


def _wgrad_w13(da, db, q, d, i, l, dw1, dw3, *, qtok=None):
    """dW1[e] = dA_e^T Q_e and dW3[e] = dB_e^T Q_e: two launches of the single-output kernels."""
    _wgrad(da, q, d, i, l, dw1, qtok=qtok)
    _wgrad(db, q, d, i, l, dw3, qtok=qtok)


class _ExpertsFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_idx, topk_weight, w1, w3, w2, act, bg, bu, grad):
        # grad: autograd was on at the call and an input needs a gradient (inside forward grad mode is off, and
        # needs_input_grad says True under no_grad too: the backward's intermediates would be kept for nothing)
        n, l = x.shape
        _mark("fwd: start")
        e, i, _ = w1.shape
        d = _Dispatch(topk_idx, e)
        ctx.empty = d.nk == 0
        # MXFP4 experts (W4A16): the kernels decode the packed tiles; frozen, so kept on ctx (not saved tensors)
        ctx.mx = (w1, w3, w2) if is_packed(w1) else None
        if ctx.empty:
            ctx.save_for_backward(x, topk_weight, *(() if ctx.mx else (w1, w3, w2)))
            return torch.zeros(n, l, dtype=x.dtype, device=x.device)
        if ctx.mx is None:
            w1, w3, w2 = w1.to(x.dtype), w3.to(x.dtype), w2.to(x.dtype)
            if w1.stride() != w3.stride():
                w1, w3 = w1.contiguous(), w3.contiguous()
        need_grad = grad and any(ctx.needs_input_grad)
        if need_grad and any(ctx.needs_input_grad[3:6]):
            d.prefetch_counts()  # the held weight gradient's launches read them; copied now, in the GPU's order
        # GEMM 1 + SiTU-GLU, scaled by the routing weight of the row:
        #   hw[r] = p[r] glu(x[tok r] w1^T, x[tok r] w3^T)      (N = I, K = l)
        g1, g2 = "glu_fwd", "mm"
        # the dispatch-order copy of x feeds GEMM 1 through TMA and is kept for dW1|dW3; without gradients GEMM 1
        # gathers the rows itself (faster there: benchmarks/results/moe.md)
        xs = _pregather(g1, x, d) if need_grad else None
        wt = topk_weight.float().contiguous()
        w_rows = wt.reshape(-1)[d.perm].contiguous()  # routing weight of each sorted row
        hw = torch.empty(d.nk, i, dtype=x.dtype, device=x.device)
        a = torch.empty_like(hw) if need_grad else None
        b = torch.empty_like(hw) if need_grad else None
        _gg(g1, xs if xs is not None else x, w1, _sched(d, g1, x, is_packed(w1)), d.offs, e, l, i, hw,
            gather=xs is None, tok=d.tok, w_kn=False, pair=1, w2=w3, epi=1, save=need_grad, c2=a,
            c3=b, wrow=w_rows, row_scale=True, act=act, bg=bg, bu=bu)
        _mark("fwd: dispatch + GEMM 1 + GLU")
        # GEMM 2: y = hw w2^T   (N = l, K = I); then u[t] = sum_j y[pos[t, j]]
        y = torch.empty(d.nk, l, dtype=x.dtype, device=x.device)
        _gg(g2, hw, w2, _sched(d, g2, x, is_packed(w2)), d.offs, e, i, l, y, gather=False,
            w_kn=False)
        _mark("fwd: GEMM 2")
        u = _combine(y, d, x.dtype)
        del y
        _mark("fwd: combine")
        ctx.d, ctx.cfg = d, (act, bg, bu)
        ctx.save_for_backward(x, wt, *(() if ctx.mx else (w1, w3, w2)))
        # intermediates kept as attributes so that backward can free each as soon as it is used
        ctx.inter = [xs, a, b, hw, w_rows]
        return u

    @staticmethod
    def backward(ctx, du):
        no_create_graph("backends.triton.moe_experts")
        if ctx.empty:
            x, tw, *ws = ctx.saved_tensors
            z = torch.zeros_like
            dws = [z(w) for w in ws] if ws else [None] * 3
            return z(x), None, z(tw), *dws, None, None, None, None
        x, wt, *ws = ctx.saved_tensors
        w1, w3, w2 = ctx.mx or ws
        if ctx.inter is None:
            raise RuntimeError("backends.triton.moe_experts: a second backward through the same graph "
                               "(retain_graph=True) is not supported: the first backward frees the forward's "
                               "intermediates to keep peak memory low; run the forward again, or use "
                               "backends.reference.moe_experts")
        xs, a, b, hw, w_rows = ctx.inter
        ctx.inter = None
        d = ctx.d
        act, bg, bu = ctx.cfg
        n, l = x.shape
        e, i, _ = w1.shape
        need_x, _, need_wt, need_w1, need_w3, need_w2 = ctx.needs_input_grad[:6]   # (False for MXFP4 experts)
        _mark("bwd: start")
        du = du.to(x.dtype).contiguous()
        dx = dwt = dw1 = dw3 = dw2 = None
        # G = du[tok] w2[e] (K = l, N = I), then d topk_weight (row sums of G h), dA, dB
        dus = _pregather("glu_bwd_mm", du, d)
        da, db, dwrow = _glu_backward(d, du, dus, w2, a, b, w_rows, l, i, act, bg, bu)
        del a, b
        _mark("bwd: GEMM dA|dB (+ GLU backward)")
        if need_wt:
            dwt = dwrow[d.pos].view(n, d.k)
        # peak memory: free each intermediate right after its last use
        if need_w2:
            # dW2[e] = sum_r du[tok r]^T (p[r] h[r]) = dus^T hw
            dw2 = torch.empty(e, l, i, dtype=w2.dtype, device=x.device)
            if dus is not None:
                _wgrad(dus, hw, d, l, i, dw2)
            else:
                _wgrad(du, hw, d, l, i, dw2, ptok=d.tok)
            _mark("bwd: dW2")
        del dus, hw
        if need_x:
            # dxg[r] = dA[r] w1[e] + dB[r] w3[e]  (K = I, N = l), then a per-token sum
            dxg = torch.empty(d.nk, l, dtype=x.dtype, device=x.device)
            _gg("dx", da, w1, _sched(d, "dx", x, is_packed(w1)), d.offs, e, i, l, dxg, gather=False,
                w_kn=True, pair=3, a2=db, w2=w3)
            dx = _combine(dxg, d, x.dtype)
            del dxg
            _mark("bwd: dx GEMM + combine")
        if need_w1 or need_w3:
            dw1 = torch.empty(e, i, l, dtype=w1.dtype, device=x.device)
            dw3 = torch.empty(e, i, l, dtype=w3.dtype, device=x.device)
            q, qtok = (xs, None) if xs is not None else (x, d.tok)
            _wgrad_w13(da, db, q, d, i, l, dw1, dw3, qtok=qtok)
            _mark("bwd: dW1|dW3")
        return dx, None, dwt, dw1, dw3, dw2, None, None, None, None


@on_tensor_device
def moe_experts(x_lat, topk_idx, topk_weight, w1, w3, w2, *, activation="situ", beta_gate=4.0,
                beta_up=25.0):
    """Routed experts on Triton (grouped GEMMs, SiTU-GLU fused), forward and backward.

    ``u[n] = sum_k topk_weight[n, k] * w2[e] glu(w1[e] x_lat[n], w3[e] x_lat[n])``, e = topk_idx[n, k].

    Args:
        x_lat: [N, l] float32 / float16 / bfloat16 (the compute dtype: weights are cast to it;
            bf16 on the GPU for speed, float32 under the interpreter);
        topk_idx: [N, k] int64 in [0, E); topk_weight: [N, k] float (used in float32);
        w1, w3: [E, I, l]; w2: [E, l, I] (any strides; contiguous is fastest), or all three
            :class:`backends.mxfp4.MXFP4Experts` (W4A16: the grouped GEMMs load the packed E2M1 nibbles and E8M0
            scales and decode each weight tile in registers, in x_lat's dtype, before the dot; no dequantized copy
            is made; the decoded values must be finite in that dtype, e.g. scales up to 2^15 for float16);
        activation: "situ" (contract default) or "silu" (plain SwiGLU, kimi_linear_48b).
    Returns:
        u [N, l] in x_lat's dtype. Differentiable in x_lat, topk_weight, and float w1, w3, w2 (weight
        gradients in the weights' dtype, accumulated in float32); MXFP4 weights are frozen (no gradient; dx and
        d topk_weight run the same kernels on the packed weights). Experts with no token get
        zero gradient; all tokens on one expert is legal; offsets are int64.
    Raises:
        TypeError / ValueError on wrong shapes/dtypes, out-of-range expert ids (checked on the
        device range with one host sync), or an unknown activation.
    """
    _ref.check_expert_inputs(x_lat, topk_idx, topk_weight, w1, w3, w2, activation, beta_gate=beta_gate,
                             beta_up=beta_up)
    check_kernel_device("triton.moe_experts", x_lat=x_lat)
    if is_packed(w1):
        _check_gemm_operands("triton.moe_experts", x_lat=x_lat)
        for name, w in (("w1", w1), ("w3", w3), ("w2", w2)):
            if w.weight_packed.device != x_lat.device:
                raise ValueError(f"triton.moe_experts: {name} (MXFP4) is on {w.weight_packed.device}, x_lat on "
                                 f"{x_lat.device}")
    else:
        _check_gemm_operands("triton.moe_experts", x_lat=x_lat, w1=w1, w3=w3, w2=w2)
    check_interpreter_dot_dtype("triton.moe_experts", x_lat=x_lat)
    grad = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                           for t in (x_lat, topk_weight, w1, w3, w2))
    return _ExpertsFn.apply(x_lat.contiguous(), topk_idx, topk_weight, w1, w3, w2, _ACT[activation],
                            float(beta_gate), float(beta_up), grad)


@on_tensor_device
def latent_moe(x, router_weight, router_bias, w_down, w1, w3, w2, norm_weight, w_up, shared_w1,
               shared_w3, shared_w2, *, top_k, routed_scaling=1.0, eps=1e-6, activation="situ",
               beta_gate=4.0, beta_up=25.0):
    """The Stable LatentMoE layer (spec/MODEL.md) with the Triton router and experts.

    y = shared(x) + W_up RMSNorm(u),  u = moe_experts(W_down x, qb_route(x)), the router on the
    full-width x. Dense projections (W_down, W_up, the shared experts' GEMMs) run through
    torch.matmul (cuBLAS); the shared experts' activation is the Triton SiTU-GLU, the norm on u the Triton
    ``rms_norm``. Arguments,
    shapes, the w_down=None (plain MoE) form and errors exactly as the reference ``latent_moe``.
    Returns (y [N, d] in x's dtype, topk_idx [N, k] int64). Differentiable in x and every weight
    (not in router_bias, a buffer).
    """
    where = "latent_moe"
    _ref._check_tensor("x", x, 2, where)
    check_eps(eps, where)
    n, dm = x.shape
    topk_idx, topk_weight, _ = qb_route(x, router_weight, router_bias, top_k=top_k,
                                        routed_scaling=routed_scaling)
    if w_down is None:
        if norm_weight is not None or w_up is not None:
            raise ValueError(f"{where}: w_down is None, so norm_weight and w_up must be None too")
        x_lat = x
    else:
        _ref._check_tensor("w_down", w_down, 2, where)
        if w_down.shape[1] != dm:
            raise ValueError(f"{where}: w_down must be [l, d={dm}], got {tuple(w_down.shape)}")
        lat = w_down.shape[0]
        _ref._check_tensor("norm_weight", norm_weight, 1, where)
        _ref._check_tensor("w_up", w_up, 2, where)
        if norm_weight.shape[0] != lat:
            raise ValueError(f"{where}: norm_weight must be [l={lat}], got {tuple(norm_weight.shape)}")
        if tuple(w_up.shape) != (dm, lat):
            raise ValueError(f"{where}: w_up must be [d, l] = {(dm, lat)}, got {tuple(w_up.shape)}")
        x_lat = x @ w_down.to(x.dtype).t()
    u = moe_experts(x_lat, topk_idx, topk_weight, w1, w3, w2, activation=activation,
                    beta_gate=beta_gate, beta_up=beta_up)
    if w_down is None:
        y = u
    else:
        nw = norm_weight if norm_weight.is_floating_point() else norm_weight.float()  # (the reference takes ints)
        y = rms_norm(u, nw, eps).to(x.dtype) @ w_up.to(x.dtype).t()
    if not (shared_w1 is None and shared_w3 is None and shared_w2 is None):
        for name, t in (("shared_w1", shared_w1), ("shared_w3", shared_w3), ("shared_w2", shared_w2)):
            _ref._check_tensor(name, t, 2, where)
        i_s = shared_w1.shape[0]
        if (tuple(shared_w1.shape) != (i_s, dm) or tuple(shared_w3.shape) != (i_s, dm)
                or tuple(shared_w2.shape) != (dm, i_s)):
            raise ValueError(f"{where}: shared weights must be w1, w3 [Is, d={dm}] and w2 [d, Is]; got "
                             f"{tuple(shared_w1.shape)}, {tuple(shared_w3.shape)}, {tuple(shared_w2.shape)}")
        hs = _glu_act(x @ shared_w1.to(x.dtype).t(), x @ shared_w3.to(x.dtype).t(), activation,
                      beta_gate, beta_up)
        y = y + hs @ shared_w2.to(x.dtype).t()
    return y.to(x.dtype), topk_idx
