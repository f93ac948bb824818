"""Reference (plain PyTorch, float32) Quantile-Balancing router and latent mixture of experts.

Ground truth for the Triton backend (``backends/triton/moe.py``). Written for clarity, not speed.
Semantics follow ``spec/OPS.md`` (qb_route, qb_update, situ_glu, moe_experts) and ``spec/MODEL.md``
(Stable LatentMoE).

Sources of the math
-------------------
* Sigmoid router with a selection-only bias (auxiliary-loss-free balancing) and unbiased,
  renormalised gating weights: DeepSeek-V3 technical report (arXiv 2412.19437), Sec. 2.1.2,
  Eqs. (12)-(16); the fixed-step bias rule ``b_j += u * sign(mean_load - load_j)`` is from the
  same section ("bias update speed" u = 1e-3).
* Quantile Balancing (QB): Kimi K3 technical report (arXiv 2607.24653), as written down in
  ``spec/OPS.md`` (qb_update): each token's cut-off alpha_i is the (k+1)-th largest biased score,
  and expert j's new bias is minus the (q+1)-th largest margin ``scores_ij - alpha_i`` with
  ``q = floor(N k / E)``, so that with alpha fixed exactly q tokens clear the cut-off.
* SiTU-GLU: ``h = beta_g tanh(a / beta_g) sigmoid(a) * beta_u tanh(b / beta_u)``, the bounded
  SwiGLU of the K3 report (spec/OPS.md, situ_glu); SwiGLU itself: Shazeer, "GLU Variants Improve
  Transformer" (arXiv 2002.05202), Eq. (6).
* Stable LatentMoE: ``y = sum_shared E_j(x) + W_up RMSNorm(u)``, ``u = sum_k p_k E_k(W_down x)``
  (spec/MODEL.md); RMSNorm: Zhang & Sennrich (arXiv 1910.07467), Eq. (4).
"""
from __future__ import annotations

import numbers

import torch

from backends.mxfp4 import is_packed

from .ops import _store, check_devices, check_eps, rmsnorm, writable

__all__ = [
    "qb_route",
    "qb_update",
    "fixed_step_update",
    "expert_load",
    "situ_glu",
    "moe_experts",
    "latent_moe",
]

_ACTIVATIONS = ("situ", "silu")


# ----------------------------------------------------------------------------------------------
# input checks shared with the Triton backend
# ----------------------------------------------------------------------------------------------
def _check_tensor(name: str, t, ndim: int, where: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{where}: {name} must have {ndim} dims, got shape {tuple(t.shape)}")


def _check_float(name: str, t: torch.Tensor, where: str) -> None:
    if not t.is_floating_point():
        raise TypeError(f"{where}: {name} must be a floating tensor, got {t.dtype}")


def _check_top_k(top_k, num_experts: int, where: str) -> int:
    """top_k as a Python int (numpy integers too): TypeError for another type, ValueError outside [1, E]."""
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral):
        raise TypeError(f"{where}: top_k must be an int, got {type(top_k).__name__}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"{where}: top_k must be in [1, E={num_experts}], got {top_k}")
    return int(top_k)


def check_ema(ema, where: str) -> float:
    """qb_update's ema: a real number (Python or numpy; TypeError otherwise) in [0, 1) (ValueError); as float."""
    if isinstance(ema, bool) or not isinstance(ema, numbers.Real):
        raise TypeError(f"{where}: ema must be a real number in [0, 1), got {type(ema).__name__} {ema!r}")
    if not 0.0 <= float(ema) < 1.0:
        raise ValueError(f"{where}: ema must be in [0, 1), got {ema}")
    return float(ema)


def check_num_experts(num_experts, where: str) -> int:
    """An expert count: an int (Python or numpy; TypeError otherwise) > 0 (ValueError); as int."""
    if isinstance(num_experts, bool) or not isinstance(num_experts, numbers.Integral):
        raise TypeError(f"{where}: num_experts must be an int, got {type(num_experts).__name__} {num_experts!r}")
    if num_experts <= 0:
        raise ValueError(f"{where}: num_experts must be positive, got {num_experts}")
    return int(num_experts)


def check_routed_scaling(routed_scaling, where: str) -> None:
    """routed_scaling: a finite real number > 0 (ValueError otherwise: NaN would give NaN routing weights, and
    0 or a negative factor zeroes or flips every routed expert's output; the DSL's attribute check refuses them
    too)."""
    if isinstance(routed_scaling, bool) or not isinstance(routed_scaling, numbers.Real) or not (
            0 < routed_scaling < float("inf")):
        raise ValueError(f"{where}: routed_scaling must be a finite real number > 0 (Python or numpy), got "
                         f"{type(routed_scaling).__name__} {routed_scaling!r}")


def check_finite_rows(name: str, x: torch.Tensor, where: str) -> None:
    """Raise ValueError naming the first row of the 2-D tensor ``x`` that holds NaN or +-inf."""
    bad = ~torch.isfinite(x).all(dim=-1)
    if bool(bad.any()):
        row = int(torch.nonzero(bad)[0, 0])
        raise ValueError(
            f"{where}: row {row} of {name} holds NaN or inf "
            f"({int(bad.sum())} bad row(s) of {x.shape[0]})"
        )


def check_route_inputs(x, weight, bias, top_k, where: str = "qb_route"):
    """Shape/dtype checks of qb_route's arguments; returns (N, d, E)."""
    _check_tensor("x", x, 2, where)
    _check_tensor("weight", weight, 2, where)
    _check_tensor("bias", bias, 1, where)
    _check_float("x", x, where)
    _check_float("weight", weight, where)
    _check_float("bias", bias, where)
    check_devices(where, x=x, weight=weight, bias=bias)
    n, d = x.shape
    e, d2 = weight.shape
    if d2 != d:
        raise ValueError(f"{where}: weight is [E, d] = {tuple(weight.shape)} but x has d = {d}")
    if bias.shape[0] != e:
        raise ValueError(f"{where}: bias has {bias.shape[0]} entries, expected E = {e}")
    _check_top_k(top_k, e, where)
    if not bool(torch.isfinite(bias).all()):
        raise ValueError(f"{where}: bias holds NaN or inf")
    if not bool(torch.isfinite(weight).all()):
        raise ValueError(f"{where}: router weight holds NaN or inf")
    return n, d, e


def check_expert_inputs(x_lat, topk_idx, topk_weight, w1, w3, w2, activation, where="moe_experts",
                        beta_gate=4.0, beta_up=25.0):
    """Shape/dtype/device checks of moe_experts' arguments (and the SiTU-GLU bounds); returns (N, l, E, I, k).
    The expert weights are float tensors, or all three :class:`backends.mxfp4.MXFP4Experts` (packed)."""
    _check_tensor("x_lat", x_lat, 2, where)
    _check_tensor("topk_idx", topk_idx, 2, where)
    _check_tensor("topk_weight", topk_weight, 2, where)
    packed = [is_packed(w) for w in (w1, w3, w2)]
    if any(packed) and not all(packed):
        raise TypeError(f"{where}: w1, w3 and w2 are all MXFP4Experts (packed) or all float tensors, got "
                        + ", ".join(type(w).__name__ for w in (w1, w3, w2)))
    named = {"x_lat": x_lat, "topk_weight": topk_weight}
    if not any(packed):
        _check_tensor("w1", w1, 3, where)
        _check_tensor("w3", w3, 3, where)
        _check_tensor("w2", w2, 3, where)
        named.update(w1=w1, w3=w3, w2=w2)
    for name, t in named.items():
        _check_float(name, t, where)          # (complex, bool or integer expert weights are no experts)
    if topk_idx.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{where}: topk_idx must be int64 (or int32), got {topk_idx.dtype}")
    ws = {n: (w.weight_packed if p else w) for n, w, p in zip(("w1", "w3", "w2"), (w1, w3, w2), packed)}
    check_devices(where, x_lat=x_lat, topk_idx=topk_idx, topk_weight=topk_weight, **ws)
    if activation == "situ":
        check_betas(beta_gate, beta_up, where)
    n, l = x_lat.shape
    e, i, l1 = w1.shape
    if tuple(w3.shape) != (e, i, l1):
        raise ValueError(f"{where}: w3 {tuple(w3.shape)} must match w1 {tuple(w1.shape)} ([E, I, l])")
    if l1 != l:
        raise ValueError(f"{where}: w1 is [E, I, l] = {tuple(w1.shape)} but x_lat has l = {l}")
    if tuple(w2.shape) != (e, l, i):
        raise ValueError(f"{where}: w2 must be [E, l, I] = {(e, l, i)}, got {tuple(w2.shape)}")
    if topk_idx.shape[0] != n or tuple(topk_weight.shape) != tuple(topk_idx.shape):
        raise ValueError(
            f"{where}: topk_idx {tuple(topk_idx.shape)} and topk_weight {tuple(topk_weight.shape)} "
            f"must both be [N={n}, k]"
        )
    k = topk_idx.shape[1]
    if n > 0 and k > 0:
        lo, hi = torch.stack(torch.aminmax(topk_idx)).tolist()  # one device read-back, not two
        if lo < 0 or hi >= e:
            raise ValueError(f"{where}: topk_idx values must be in [0, E={e}), got range [{lo}, {hi}]")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"{where}: activation must be one of {_ACTIVATIONS}, got {activation!r}")
    if x_lat.device.type == "cpu" and n > 0:        # (a GPU scan would synchronise every call)
        check_finite_rows("x_lat", x_lat, where)
        check_finite_rows("topk_weight", topk_weight, where)
    return n, l, e, i, k


# ----------------------------------------------------------------------------------------------
# routing
# ----------------------------------------------------------------------------------------------
def biased_topk(biased: torch.Tensor, top_k: int) -> torch.Tensor:
    """Indices [N, k] int64 of the k largest entries per row of ``biased`` [N, E].

    Order: descending value; equal values go to the LOWER expert index first (a stable descending
    sort keeps the original, ascending-index order among equals; torch.topk does not promise that).
    """
    order = torch.sort(biased, dim=-1, descending=True, stable=True).indices
    return order[:, :top_k].contiguous()


def qb_route(x, weight, bias, *, top_k, routed_scaling=1.0):
    """Sigmoid router with selection-only bias (Quantile Balancing's routing half).

    Args:
        x: [N, d] token features, any float dtype.
        weight: [E, d] router weight (float).
        bias: [E] float32 selection bias (a buffer; not trained by gradient).
        top_k: experts per token, 1 <= top_k <= E.
        routed_scaling: factor applied to the renormalised weights (1.0 in most K3 ports).

    Returns:
        topk_idx: [N, k] int64, the k experts with the largest ``scores + bias``, in descending
            order of that value; ties go to the lower expert index.
        topk_weight: [N, k] float32, the UNBIASED scores of the chosen experts divided by their
            sum, times ``routed_scaling`` (DeepSeek-V3, arXiv 2412.19437, Eqs. 13-16).
        scores: [N, E] float32, ``sigmoid(x @ weight^T)`` computed in float32.

    Raises:
        TypeError / ValueError: wrong types or shapes, tensors on different devices (or on meta), top_k out of
            range, routed_scaling not finite and > 0, a non-finite bias or router weight, or a row of x holding
            NaN/inf (the message names the row). A finite row whose logits overflow float32 is routed from
            float64 logits (route_overflow_rows).

    Differentiable with respect to x and weight through topk_weight and scores (the selection
    itself is not).
    """
    n, d, e = check_route_inputs(x, weight, bias, top_k)
    check_routed_scaling(routed_scaling, "qb_route")
    check_finite_rows("x", x, "qb_route")
    logits = x.float() @ weight.float().t()
    over = ~torch.isfinite(logits).all(dim=-1)          # x @ W^T overflowed float32 in these rows (x is finite)
    rows = torch.nonzero(over).flatten() if n and bool(over.any()) else None
    if rows is not None:
        logits = logits.masked_fill(over[:, None], 0.0)  # (replaced below; no inf / NaN in the backward)
    scores = torch.sigmoid(logits)
    with torch.no_grad():
        topk_idx = biased_topk(scores.detach() + bias.float(), top_k)
    topk_weight = route_weights(logits.gather(1, topk_idx), routed_scaling)
    if rows is not None:
        i_o, w_o, s_o = route_overflow_rows(x[rows], weight, bias, top_k, routed_scaling)
        topk_idx = topk_idx.index_put((rows,), i_o)
        topk_weight = topk_weight.index_put((rows,), w_o)
        scores = scores.index_put((rows,), s_o)
    return topk_idx, topk_weight, scores


def route_overflow_rows(x_rows, weight, bias, top_k: int, routed_scaling=1.0):
    """qb_route of rows whose float32 router logits overflow although x is finite (|x| ~ 1e38): the logits in
    float64, where a product of two float32 values and its sum over d cannot overflow, scores = their sigmoid
    rounded to float32 (0 or 1 where the logit is huge), the picks by those scores + bias as for every row, the
    weights from the float64 logits (the largest logit among the picks takes the weight; no 0 / 0). Both backends
    take this path for such rows. x_rows [R, d]; returns (topk_idx [R, k] int64, topk_weight [R, k] float32,
    scores [R, E] float32), differentiable."""
    z = x_rows.double() @ weight.double().t()
    scores = torch.sigmoid(z).float()
    with torch.no_grad():
        idx = biased_topk(scores.detach() + bias.float(), top_k)
    return idx, route_weights(z.gather(1, idx), routed_scaling).float(), scores


def route_weights(chosen_logits, routed_scaling=1.0):
    """The chosen experts' unbiased scores divided by their sum, times routed_scaling (spec/OPS.md qb_route),
    from their router logits [N, k] (float32): s_j / sum s = softmax(log sigmoid(z))_j, formed in log space,
    so that a row whose sigmoid scores all underflow to 0 (every logit below about -88) still gets its
    finite weights instead of 0 / 0.  Differentiable."""
    return torch.softmax(torch.nn.functional.logsigmoid(chosen_logits), dim=-1) * float(routed_scaling)


def qb_update(scores, bias, *, top_k, ema=0.0, dp_group=None):
    """One Quantile Balancing step: the bias that would have balanced this batch exactly.

    Args:
        scores: [N, E] router scores (sigmoid outputs) of batch t, any float dtype (used as float32).
        bias: [E] the bias that was used to route batch t.
        top_k: experts per token, 1 <= top_k <= E.
        ema: in [0, 1): ``new_bias = ema * bias + (1 - ema) * b_new``.
        dp_group: optional ``torch.distributed`` process group. When given and torch.distributed is
            initialised, the per-rank b_hat are averaged (all-reduce SUM / world size) over the
            group before centring (spec/OPS.md: "with data parallelism the b_hat of all ranks are
            averaged before centring").

    Returns:
        new_bias: [E] float32, to be applied to batch t+1. Definitions (spec/OPS.md):
            alpha_i = (k+1)-th largest of scores_i + bias            (cut-off of token i)
            margin  = scores - alpha[:, None]
            q       = floor(N k / E)                                 (target load per expert)
            b_hat_j = -((q+1)-th largest of margin[:, j])
            b_new   = b_hat - mean(b_hat)
        so that, with alpha fixed, exactly q tokens have scores_ij + b_hat_j > alpha_i (fewer if
        margins tie).

    Edge rules (documented choices):
        * q = 0 is legal: b_hat_j = -max_i margin_ij (then no token clears the cut-off).
        * top_k == E: every expert takes every token whatever the bias, alpha (a (k+1)-th value)
          does not exist, and b_new = 0.
        * N == 0 (e.g. a data-parallel rank that got no tokens): no information; new_bias = bias,
          unchanged (as float32). With dp_group such a rank contributes nothing: b_hat is averaged over
          the ranks that had tokens, and when none had, every rank keeps its bias.
        For k < E, q = floor(N k / E) <= N - 1, so the (q+1)-th largest margin always exists.

    Raises:
        TypeError / ValueError: wrong shapes/types, top_k or ema out of range, non-finite input.
    """
    where = "qb_update"
    _check_tensor("scores", scores, 2, where)
    _check_tensor("bias", bias, 1, where)
    _check_float("scores", scores, where)
    _check_float("bias", bias, where)
    check_devices(where, scores=scores, bias=bias)
    n, e = scores.shape
    if bias.shape[0] != e:
        raise ValueError(f"{where}: bias has {bias.shape[0]} entries but scores has E = {e}")
    top_k = _check_top_k(top_k, e, where)
    ema = check_ema(ema, where)
    check_finite_rows("scores", scores, where)
    if not bool(torch.isfinite(bias).all()):
        raise ValueError(f"{where}: bias holds NaN or inf")
    s = scores.detach().float()
    b = bias.detach().float()
    if n == 0:
        b_hat = None                                   # no tokens: nothing to balance by
    elif top_k == e:
        b_hat = torch.zeros_like(b)
    else:
        biased = s + b
        alpha = torch.topk(biased, top_k + 1, dim=1).values[:, top_k]  # (k+1)-th largest
        margin = s - alpha[:, None]
        q = (n * top_k) // e
        # (q+1)-th largest of each column = its (n - q)-th smallest
        b_hat = -torch.kthvalue(margin, n - q, dim=0).values
    return qb_finish(b_hat, b, ema, dp_group)


def qb_finish(b_hat, b: torch.Tensor, ema: float, dp_group) -> torch.Tensor:
    """The end of a QB step (shared by the backends): b_hat [E] float32 (None: this rank had no tokens) averaged
    over dp_group, centred, and blended with the old bias b [E] float32 by ema; b itself (a copy) when no rank
    had tokens."""
    b_hat = _dp_average(b_hat, dp_group, b)
    if b_hat is None:
        return b.clone()
    b_new = b_hat - b_hat.mean()
    return ema * b + (1.0 - ema) * b_new


def _dp_average(b_hat, dp_group, like: torch.Tensor):
    """The mean of b_hat [E] over the ranks of a data-parallel group that had tokens (b_hat None: this rank had
    none and adds nothing: one all-reduce of [E + 1] values, the sums and the count of such ranks); None when no
    rank had any. Without a group or a distributed run: b_hat as given."""
    if dp_group is None:
        return b_hat
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return b_hat
    e = like.shape[0]
    buf = torch.zeros(e + 1, dtype=torch.float32, device=like.device)
    if b_hat is not None:
        buf[:e] = b_hat
        buf[e] = 1.0
    dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=dp_group)
    count = float(buf[e])
    return buf[:e] / count if count > 0 else None


def fixed_step_update(bias, load, *, step=1e-3):
    """The fixed-step bias rule of DeepSeek-V3 (arXiv 2412.19437, Sec. 2.1.2), for comparison.

    ``new_bias_j = bias_j + step * sign(mean(load) - load_j)``: under-loaded experts gain ``step``,
    over-loaded ones lose it, exactly-average ones stay.

    Args:
        bias: [E] float bias used to route the batch.
        load: [E] tokens per expert of that batch (int or float), e.g. from ``expert_load``.
        step: the update speed u (1e-3 in DeepSeek-V3), >= 0.
    Returns:
        [E] float32 new bias.
    Raises:
        TypeError / ValueError on wrong shapes, a negative or non-finite step.
    """
    where = "fixed_step_update"
    _check_tensor("bias", bias, 1, where)
    _check_tensor("load", load, 1, where)
    if load.shape[0] != bias.shape[0]:
        raise ValueError(f"{where}: load has {load.shape[0]} entries, bias has {bias.shape[0]}")
    step = float(step)
    if not (step >= 0.0 and step < float("inf")):
        raise ValueError(f"{where}: step must be finite and >= 0, got {step}")
    lf = load.double()
    return (bias.double() + step * torch.sign(lf.mean() - lf)).float()


def expert_load(topk_idx, num_experts):
    """Routing statistics: tokens per expert, int64 [E] (the hook ``mtc run`` prints and the
    placement pass consumes).

    Args:
        topk_idx: [N, k] integer expert indices in [0, num_experts).
        num_experts: E.
    Raises:
        ValueError when an index lies outside [0, E).
    """
    where = "expert_load"
    if not isinstance(topk_idx, torch.Tensor) or topk_idx.is_floating_point():
        raise TypeError(f"{where}: topk_idx must be an integer tensor")
    e = check_num_experts(num_experts, where)
    flat = topk_idx.reshape(-1).long()
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= e):
        raise ValueError(f"{where}: expert indices must be in [0, {e}), got [{int(flat.min())}, {int(flat.max())}]")
    return torch.bincount(flat, minlength=e)


# ----------------------------------------------------------------------------------------------
# experts
# ----------------------------------------------------------------------------------------------
def check_glu_args(a, b, beta_gate, beta_up, where: str) -> None:
    """situ_glu's argument checks (shared with the Triton backend): float tensors of one shape on one device,
    finite positive betas. Raises TypeError / ValueError."""
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{where}: {name} must be a floating-point tensor, got {t.dtype}")
    if a.shape != b.shape:
        raise ValueError(f"{where}: a {tuple(a.shape)} and b {tuple(b.shape)} must have one shape")
    if a.device != b.device:
        raise ValueError(f"{where}: a is on {a.device} but b on {b.device}")
    check_betas(beta_gate, beta_up, where)


def check_betas(beta_gate, beta_up, where: str) -> None:
    """SiTU-GLU's bounds: numbers, finite and > 0 (TypeError / ValueError)."""
    for name, x in (("beta_gate", beta_gate), ("beta_up", beta_up)):
        if isinstance(x, bool) or not isinstance(x, numbers.Real):
            raise TypeError(f"{where}: {name} must be a number, got {type(x).__name__} {x!r}")
        if not 0 < x < float("inf"):
            raise ValueError(f"{where}: beta_gate and beta_up must be finite and > 0, got {beta_gate}, {beta_up}")


def situ_glu(a, b, *, beta_gate=4.0, beta_up=25.0, out=None):
    """SiTU-GLU, the bounded gated activation (spec/OPS.md, situ_glu).

    ``h = (beta_gate * tanh(a / beta_gate) * sigmoid(a)) * (beta_up * tanh(b / beta_up))``; near
    zero it is SwiGLU ``silu(a) * b`` (Shazeer, arXiv 2002.05202, Eq. 6) and everywhere
    ``|h| <= beta_gate * beta_up``. The sigmoid takes the uncapped a.

    Args:
        a: gate pre-activation, any float dtype; b: up pre-activation, same shape.
        beta_gate, beta_up: positive caps.
        out: a tensor to write h into (a or b itself allowed: both are read before h is written), taken where
            ``backends.reference.ops.writable``, else h is a fresh tensor.
    Returns:
        h, same shape, in the promoted dtype of a and b; computed in float32.
    Raises:
        TypeError on non-tensor or non-float inputs or non-numeric betas; ValueError on mismatched shapes or
        betas that are not finite and > 0.
    """
    check_glu_args(a, b, beta_gate, beta_up, "situ_glu")
    af, bf = a.float(), b.float()
    gate, up = beta_gate * torch.tanh(af / beta_gate) * torch.sigmoid(af), beta_up * torch.tanh(bf / beta_up)
    dtype = torch.promote_types(a.dtype, b.dtype)
    if writable(out, dtype, a, b):
        return _store(out, torch.mul, gate, up)
    return (gate * up).to(dtype)


def _glu(a, b, activation, beta_gate, beta_up):
    if activation == "silu":
        return torch.nn.functional.silu(a) * b
    return (beta_gate * torch.tanh(a / beta_gate) * torch.sigmoid(a)) * (beta_up * torch.tanh(b / beta_up))


def moe_experts(x_lat, topk_idx, topk_weight, w1, w3, w2, *, activation="situ", beta_gate=4.0,
                beta_up=25.0):
    """Routed experts (spec/OPS.md, moe_experts), computed in float32.

    ``u[n] = sum_k topk_weight[n, k] * w2[e] @ glu(w1[e] @ x_lat[n], w3[e] @ x_lat[n])``,
    ``e = topk_idx[n, k]``, glu = SiTU-GLU (activation="situ", the contract's default) or plain
    SwiGLU ``silu(a) * b`` (activation="silu", used by kimi_linear_48b).

    Args:
        x_lat: [N, l] tokens in the latent width; topk_idx: [N, k] int64 in [0, E);
        topk_weight: [N, k] float; w1, w3: [E, I, l]; w2: [E, l, I]: float tensors, or all three
            :class:`backends.mxfp4.MXFP4Experts` (MXFP4 packed; each expert that gets a token is decoded to float32
            for this call, exactly, and dropped after it).
    Returns:
        u: [N, l] in x_lat's dtype. Experts with no token and all tokens on one expert are legal.
        Differentiable in x_lat, topk_weight and float w1, w3, w2; packed weights are frozen (no gradient).
    Raises:
        TypeError / ValueError on wrong shapes/dtypes, out-of-range indices, an unknown
        activation, or NaN/inf in a row of x_lat or topk_weight (CPU inputs; a GPU scan would synchronise).
    """
    n, l, e, i, k = check_expert_inputs(x_lat, topk_idx, topk_weight, w1, w3, w2, activation,
                                        beta_gate=beta_gate, beta_up=beta_up)
    xf = x_lat.float()
    u = torch.zeros(n, l, dtype=torch.float32, device=x_lat.device)
    idx = topk_idx.long()
    packed = is_packed(w1)

    def weight(w, ex):
        return w.expert(ex, torch.float32) if packed else w[ex].float()
    for ex in torch.unique(idx).tolist():
        tok, slot = torch.nonzero(idx == ex, as_tuple=True)
        xe = xf[tok]
        h = _glu(xe @ weight(w1, ex).t(), xe @ weight(w3, ex).t(), activation, beta_gate, beta_up)
        ye = h @ weight(w2, ex).t()
        u = u.index_add(0, tok, ye * topk_weight[tok, slot].float()[:, None])
    if n * k == 0:  # no row: still a graph, so that backward gives zero gradients (sums of empty slices are 0)
        u = u + sum(t[:0].float().sum() for t in (xf, topk_weight) + (() if packed else (w1, w3, w2)))
    return u.to(x_lat.dtype)


def latent_moe(x, router_weight, router_bias, w_down, w1, w3, w2, norm_weight, w_up, shared_w1,
               shared_w3, shared_w2, *, top_k, routed_scaling=1.0, eps=1e-6, activation="situ",
               beta_gate=4.0, beta_up=25.0):
    """The Stable LatentMoE layer (spec/MODEL.md), in float32.

    ``(topk_idx, p, _) = qb_route(x, router_weight, router_bias)`` on the FULL-width x;
    ``x_lat = x @ w_down^T``; ``u = moe_experts(x_lat, topk_idx, p, w1, w3, w2)``;
    ``y = shared(x) + RMSNorm(u; norm_weight, eps) @ w_up^T`` with
    ``shared(x) = w2_s glu(w1_s x, w3_s x)``. Several shared experts are one expert whose
    intermediate dimension is the concatenation of theirs (K3: 2 x 3072 = Is 6144), so they are
    passed stacked.

    Args:
        x: [N, d]; router_weight: [E, d]; router_bias: [E] float32;
        w_down: [l, d] or None (None: no latent projection, x_lat = x, and then norm_weight and
            w_up must be None too and y = shared(x) + u, the plain MoE of kimi_linear_48b);
        w1, w3: [E, I, l]; w2: [E, l, I]; norm_weight: [l]; w_up: [d, l];
        shared_w1, shared_w3: [Is, d]; shared_w2: [d, Is] (all three None: no shared expert).
        top_k, routed_scaling: as in qb_route; eps: RMSNorm epsilon;
        activation: "situ" (default) or "silu", for the routed and the shared experts alike.
    Returns:
        y: [N, d] in x's dtype; topk_idx: [N, k] int64 (for the routing-statistics hook and
        qb_update; the router scores are recomputable, or use qb_route directly).
    Raises:
        TypeError / ValueError on inconsistent shapes (naming the argument) and NaN/inf rows of x.
    """
    where = "latent_moe"
    _check_tensor("x", x, 2, where)
    check_eps(eps, where)
    n, d = x.shape
    topk_idx, topk_weight, _ = qb_route(x, router_weight, router_bias, top_k=top_k,
                                        routed_scaling=routed_scaling)
    xf = x.float()
    if w_down is None:
        if norm_weight is not None or w_up is not None:
            raise ValueError(f"{where}: w_down is None, so norm_weight and w_up must be None too")
        x_lat = xf
    else:
        _check_tensor("w_down", w_down, 2, where)
        if w_down.shape[1] != d:
            raise ValueError(f"{where}: w_down must be [l, d={d}], got {tuple(w_down.shape)}")
        lat = w_down.shape[0]
        _check_tensor("norm_weight", norm_weight, 1, where)
        _check_tensor("w_up", w_up, 2, where)
        if norm_weight.shape[0] != lat:
            raise ValueError(f"{where}: norm_weight must be [l={lat}], got {tuple(norm_weight.shape)}")
        if tuple(w_up.shape) != (d, lat):
            raise ValueError(f"{where}: w_up must be [d, l] = {(d, lat)}, got {tuple(w_up.shape)}")
        x_lat = xf @ w_down.float().t()
    u = moe_experts(x_lat, topk_idx, topk_weight, w1.float(), w3.float(), w2.float(),
                    activation=activation, beta_gate=beta_gate, beta_up=beta_up)
    if w_down is None:
        y = u
    else:
        y = rmsnorm(u.float(), norm_weight, eps=eps).float() @ w_up.float().t()
    y = y + _shared(xf, shared_w1, shared_w3, shared_w2, d, activation, beta_gate, beta_up, where)
    return y.to(x.dtype), topk_idx


def _shared(xf, s1, s3, s2, d, activation, beta_gate, beta_up, where):
    if s1 is None and s3 is None and s2 is None:
        return torch.zeros((), dtype=torch.float32, device=xf.device)
    for name, t in (("shared_w1", s1), ("shared_w3", s3), ("shared_w2", s2)):
        _check_tensor(name, t, 2, where)
    i_s = s1.shape[0]
    if tuple(s1.shape) != (i_s, d) or tuple(s3.shape) != (i_s, d) or tuple(s2.shape) != (d, i_s):
        raise ValueError(
            f"{where}: shared weights must be w1, w3 [Is, d={d}] and w2 [d, Is]; got "
            f"{tuple(s1.shape)}, {tuple(s3.shape)}, {tuple(s2.shape)}"
        )
    h = _glu(xf @ s1.float().t(), xf @ s3.float().t(), activation, beta_gate, beta_up)
    return h @ s2.float().t()
