"""Reference (plain PyTorch, float32) Kimi Delta Attention: kda_gate, kda_chunk, kda_step.

Ground truth for every other backend.  The math follows Kimi Linear (arXiv 2510.26692, Sec. 3, eqs. 1-8)
and the op contract in spec/OPS.md:

    S <- diag(exp(g_t)) S                         (decay first, per key channel)
    S <- S + beta_t k_t (v_t - S^T k_t)^T         (delta-rule update on the decayed state)
    o_t = scale * S^T q_t

``kda_chunk`` computes the same recurrence with the chunked WY/UT representation (chunks of CHUNK = 16 tokens).
Within a chunk, with G_i = g_1 + ... + g_i (cumulative log decay, per channel) and S_0 the state at the
chunk start, the state after token i is diag(exp(G_i)) (S_0 + sum_{j<=i} (k_j * exp(-G_j)) w_j^T) where
the pseudo-values w solve the unit lower-triangular system

    (I + A) W = diag(beta) (V - (K * exp(G)) S_0),    A_ij = beta_i sum_d k_id k_jd exp(G_id - G_jd), j < i

(the UT transform of the Householder-like products, Kimi Linear eq. 6-7).  Outputs and the next state are

    O = scale * ((Q * exp(G)) S_0 + P W),            P_ij = sum_d q_id k_jd exp(G_id - G_jd), j <= i
    S_C = diag(exp(G_C)) S_0 + (K * exp(G_C - G))^T W.

W is linear in S_0: W = U - W_k S_0 with (I + A) [U | W_k] = diag(beta) [V | K * exp(G)], which needs no state, so
everything but the state is computed for all chunks of all sequences at once; the state then passes from chunk
to chunk as S_C = M S_0 + R (M = diag(exp(G_C)) - (K * exp(G_C - G))^T W_k, R = (K * exp(G_C - G))^T U), one
batched matrix product per chunk step, and the outputs of all chunks follow at once from their start states.
The chunks are small because the pairwise decays exp(G_i - G_j) [C, C, K] dominate the cost, C of them per token
and channel, while a scan step is one small product (T / C of them).

Every exponent here is a difference G_i - G_j with i >= j, hence <= 0: the reference is safe for the
unbounded (softplus) gate too, at any decay strength.  Everything is computed in float32, except the in-chunk
cumulative gate G and its differences (float64, then rounded to float32 before the exponential: a float32 G
keeps only ulp(|G|) of absolute accuracy, 1.2e-4 at |G| ~ 2000, which a channel alternating decays of -80 and
-1e-4 reaches within a chunk, while a float64 difference rounded to float32 moves exp(G_i - G_j) by at most
2^-24 / e absolute), and is differentiable through torch.autograd (it is the gradient reference of the Triton
kernels, whose G is float32).
"""
from __future__ import annotations

import math
import numbers
import warnings

import torch
import torch.nn.functional as F

from .ops import check_devices, check_finite_cpu, check_flag

__all__ = ["kda_gate", "kda_chunk", "kda_step", "kda_chunk_workspace", "CHUNK"]

#: tokens per chunk of the reference's chunked form (its result does not depend on it beyond float rounding)
CHUNK = 16


def _check_float(name: str, t: torch.Tensor, where: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{where}: {name} must be a floating-point tensor, got dtype {t.dtype}")


def _check_finite(name: str, t: torch.Tensor, where: str) -> None:
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{where}: {name} holds NaN or inf")


def check_inputs_finite_and_decay(q, k, v, g, beta, where: str) -> None:
    """ValueError if q, k, v, g or beta hold NaN/inf, or g > 0 anywhere (a growing "decay"); RuntimeWarning
    where the delta update is expansive (check_delta_stability)."""
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _check_finite(name, t, where)
    if g.numel() and bool((g > 0).any()):
        raise ValueError(f"{where}: g must be <= 0 (a log decay); got max {float(g.max()):.4g}")
    check_delta_stability(k, beta, where)


#: beta_t ||k_t||^2 past which the delta update I - beta_t k_t k_t^T is expansive (its eigenvalue along k_t,
#: 1 - beta_t ||k_t||^2, falls below -1): 2, with slack for the rounding of L2-normalised bf16 keys, so that
#: beta = 2 on unit keys (the largest step DeltaNet variants use) passes
DELTA_STABLE_LIMIT = 2.05


def _max_beta_kk(k, beta):
    """(beta ||k||^2 of every token and head, float32 (float64 for float64 keys) in beta's shape, its max as a
    float; -inf when empty)."""
    with torch.no_grad():
        dt = torch.promote_types(k.dtype, torch.float32)
        kk = torch.linalg.vector_norm(k, dim=-1, dtype=dt).square() * beta.to(dt)
    return kk, (float(kk.max()) if kk.numel() else -math.inf)


def check_delta_stability(k, beta, where: str) -> None:
    """RuntimeWarning when beta ||k||^2 > DELTA_STABLE_LIMIT somewhere (k [..., K], beta [...]): there the delta
    rule's update expands the state along k, and a run of such tokens makes it grow without bound (inf / NaN).
    Keys L2-normalised and beta in (0, 1], as in Kimi K3 (the layer normalises q and k), never trigger it."""
    kk, m = _max_beta_kk(k, beta)
    if m > DELTA_STABLE_LIMIT:
        at = [int(i) for i in torch.nonzero(kk > DELTA_STABLE_LIMIT)[0]]
        warnings.warn(f"{where}: beta * ||k||^2 reaches {m:.4g}, past 2 first at beta{at}: the delta update "
                      f"I - beta k k^T is expansive there and the state can grow without bound; L2-normalise k "
                      f"(Kimi K3's layer does) and keep beta * ||k||^2 <= 2", RuntimeWarning, stacklevel=3)


def check_lower_bound_kept(g, lower_bound, where: str) -> None:
    """RuntimeWarning when g [B, T, H, K] falls below the lower_bound a kda_chunk call promised (None: nothing
    promised, nothing checked), naming the first such token (batch, position, head) and channel: the gate does
    not keep its bound there (the Triton kernels then run those chunks on the slower safe path; the result is
    right either way). Compared in g's dtype, so a gate rounding to the bound itself passes."""
    if lower_bound is None or not g.numel():
        return
    lb = torch.tensor(float(lower_bound), dtype=g.dtype)
    below = g < lb.to(g.device)
    if bool(below.any()):
        b, t, h, c = (int(i) for i in torch.nonzero(below)[0])
        n = int(below.any(dim=-1).sum())
        warnings.warn(f"{where}: g is below the promised lower_bound {float(lower_bound):.6g} at {n} token-head(s), "
                      f"first at batch {b}, position {t}, head {h} (channel {c}: g = {float(g[b, t, h, c]):.6g}); "
                      f"the gate does not keep its bound (the Triton kernels take the slower safe path for such "
                      f"chunks; the result is right either way): pass the gate's true bound, or None",
                      RuntimeWarning, stacklevel=3)


def check_result_finite(o, final, k, beta, where: str) -> None:
    """ValueError when the result of finite inputs holds inf/NaN (o [B, T, H, V], final state or None): the
    recurrence diverged, which only an expansive delta update (beta ||k||^2 > 2) can do; the message says where
    and how far."""
    bad = ~torch.isfinite(o)
    if bool(bad.any()):
        at = f"first at o{[int(i) for i in torch.nonzero(bad)[0]]}"
    elif final is not None and not bool(torch.isfinite(final).all()):
        at = "in the final state"
    else:
        return
    _, m = _max_beta_kk(k, beta)
    raise ValueError(f"{where}: the result holds inf or NaN although every input is finite ({at}): the state "
                     f"recurrence diverged (beta * ||k||^2 reaches {m:.4g}; past 2 the delta update I - beta k k^T "
                     f"is expansive). L2-normalise k (Kimi K3's layer does) and keep beta * ||k||^2 <= 2")


def kda_gate(x: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, *, lower_bound: float = -5.0,
             gate: str = "sigmoid") -> torch.Tensor:
    """The KDA per-channel log decay g (float32).

    Args:
        x: [B, T, H, K] gate pre-activation (any float dtype), e.g. f_b(f_a(hidden)).
        A_log: [H] per-head log scale.
        dt_bias: [H*K] per-channel bias.
        lower_bound: the bound L < 0 of the sigmoid gate (default -5.0, Kimi K3); ignored for softplus.
        gate: "sigmoid" (the lower-bounded form, default) or "softplus" (the unbounded Mamba-style form).

    Returns:
        g [B, T, H, K] float32, a log-space decay (units: nats per token):
        - "sigmoid":  g = L * sigmoid(exp(A_log[h]) * (x + dt_bias[h, :]))   so L <= g <= 0
          (the lower-bounded gate of Kimi K3; spec/OPS.md "kda_gate").  In float32 the sigmoid can round
          to exactly 0 or 1, so the bounds are reached, never crossed.
        - "softplus": g = -exp(A_log[h]) * softplus(x + dt_bias[h, :])   so g <= 0, unbounded below
          (Kimi Linear arXiv 2510.26692, eq. 9 / Mamba-2's dt parametrisation).

    Raises:
        TypeError: non-tensor or non-float inputs, a sigmoid gate's lower_bound that is not a real number.
        ValueError: wrong shapes, unknown gate, lower_bound not finite and negative, tensors on different
            devices, NaN/inf in a CPU input, a gate that overflows float32 (A_log past ~88; CPU results).
    """
    where = "kda_gate"
    for name, t in (("x", x), ("A_log", A_log), ("dt_bias", dt_bias)):
        _check_float(name, t, where)
    if x.dim() != 4:
        raise ValueError(f"{where}: x must be [B, T, H, K], got shape {tuple(x.shape)}")
    B, T, H, K = x.shape
    if tuple(A_log.shape) != (H,):
        raise ValueError(f"{where}: A_log must be [H]=[{H}], got {tuple(A_log.shape)}")
    if tuple(dt_bias.shape) not in ((H * K,), (H, K)):
        raise ValueError(f"{where}: dt_bias must be [H*K]=[{H * K}] (or [H, K]=[{H}, {K}]), got "
                         f"{tuple(dt_bias.shape)}")
    if gate not in ("sigmoid", "softplus"):
        raise ValueError(f"{where}: gate must be 'sigmoid' or 'softplus', got {gate!r}")
    if gate == "sigmoid":
        check_gate_bound(lower_bound, where)
    check_devices(where, allow_meta=True, x=x, A_log=A_log, dt_bias=dt_bias)   # (no value is read on meta)
    check_finite_cpu(where, x=x, A_log=A_log, dt_bias=dt_bias)
    z = x.float() + dt_bias.float().reshape(H, K)
    a = A_log.float().exp().view(H, 1)
    if gate == "sigmoid":
        g = float(lower_bound) * torch.sigmoid(a * z)
    else:
        g = -a * F.softplus(z)
    check_gate_finite(g, A_log, where, gate)
    return g


def check_gate_bound(lower_bound, where: str) -> None:
    """The sigmoid gate's lower bound: a real number (Python or numpy; TypeError otherwise), finite and < 0
    (ValueError)."""
    if isinstance(lower_bound, bool) or not isinstance(lower_bound, numbers.Real):
        raise TypeError(f"{where}: lower_bound must be a finite negative number, got {type(lower_bound).__name__} "
                        f"{lower_bound!r}")
    if not float("-inf") < float(lower_bound) < 0.0:
        raise ValueError(f"{where}: lower_bound must be a finite negative number, got {lower_bound!r}")


def check_gate_finite(g: torch.Tensor, A_log: torch.Tensor, where: str, gate: str = "softplus") -> None:
    """The gate of finite inputs is non-finite only by overflow of exp(A_log) (softplus: inf; sigmoid: inf * 0 =
    NaN where x + dt_bias = 0): ValueError saying so (CPU tensors; on a GPU the scan would synchronise every
    call)."""
    if g.device.type == "cpu" and g.numel() and not bool(torch.isfinite(g).all()):
        form = ("-exp(A_log) * softplus(x + dt_bias)" if gate == "softplus"
                else "lower_bound * sigmoid(exp(A_log) * (x + dt_bias))")
        raise ValueError(f"{where}: the {gate} gate {form} overflows float32 (A_log max "
                         f"{float(A_log.float().max()):.4g}; exp(A_log) ends at A_log ~ 88)")


def check_cu_seqlens(cu_seqlens, B: int, T: int, where: str) -> list[tuple[int, int]]:
    """Packed-sequence offsets (kda_chunk, mla_attention): an int32/int64 1-D tensor [N_seq+1] starting at 0,
    non-decreasing, ending at T, with B == 1. Read on the host (one sync). Returns [(start, end), ...].

    Raises:
        TypeError: not an int32/int64 tensor.  ValueError: B != 1, wrong rank / length, bad offsets.
    """
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{where}: cu_seqlens must be an int32/int64 tensor, got "
                        f"{cu_seqlens.dtype if isinstance(cu_seqlens, torch.Tensor) else type(cu_seqlens).__name__}")
    if B != 1:
        raise ValueError(f"{where}: cu_seqlens needs B == 1 (packed sequences), got B={B}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"{where}: cu_seqlens must be 1-D [N_seq+1] with N_seq >= 1")
    cs = cu_seqlens.tolist()
    if cs[0] != 0 or cs[-1] != T or any(b < a for a, b in zip(cs, cs[1:])):
        raise ValueError(f"{where}: cu_seqlens must start at 0, be non-decreasing and end at T={T}; got {cs}")
    return list(zip(cs[:-1], cs[1:]))


def _validate(q, k, v, g, beta, scale, initial_state, cu_seqlens, where):
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _check_float(name, t, where)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"{where}: q, k, v must be 4-D [B,T,H,K] / [B,T,H,V]; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    B, T, H, K = q.shape
    if tuple(k.shape) != (B, T, H, K):
        raise ValueError(f"{where}: k must have q's shape {(B, T, H, K)}, got {tuple(k.shape)}")
    if tuple(v.shape[:3]) != (B, T, H):
        raise ValueError(f"{where}: v must be [B,T,H,V] with B,T,H = {(B, T, H)}, got {tuple(v.shape)}")
    V = v.shape[3]
    if tuple(g.shape) != (B, T, H, K):
        raise ValueError(f"{where}: g must be [B,T,H,K] = {(B, T, H, K)}, got {tuple(g.shape)}")
    if tuple(beta.shape) != (B, T, H):
        raise ValueError(f"{where}: beta must be [B,T,H] = {(B, T, H)}, got {tuple(beta.shape)}")
    if K == 0 or V == 0 or H == 0:
        raise ValueError(f"{where}: empty head/key/value dimension (H={H}, K={K}, V={V})")
    named = (("k", k), ("v", v), ("g", g), ("beta", beta), ("initial_state", initial_state))
    for name, t in named:                # (cu_seqlens is read on the host: any device)
        if isinstance(t, torch.Tensor) and t.device != q.device:
            raise ValueError(f"{where}: {name} is on {t.device} but q is on {q.device} (every tensor on one device)")
    check_scale(scale, where)
    bounds = check_cu_seqlens(cu_seqlens, B, T, where) if cu_seqlens is not None else None
    n_seq = len(bounds) if bounds is not None else B
    if initial_state is not None:
        _check_float("initial_state", initial_state, where)
        if tuple(initial_state.shape) != (n_seq, H, K, V):
            raise ValueError(f"{where}: initial_state must be [N_seq,H,K,V] = {(n_seq, H, K, V)}, "
                             f"got {tuple(initial_state.shape)}")
    return B, T, H, K, V, bounds, n_seq


#: pairwise-decay elements [chunks, H, C, C, K] the intra-chunk step builds at once (float64 differences, float32
#: exponentials); more chunks are done in groups of at most this many (at least one chunk per group)
PAIR_ELEMENTS = 1 << 18


def chunks_per_group(H: int, K: int) -> int:
    """Chunks whose pairwise decays [n, H, CHUNK, CHUNK, K] one group of the intra-chunk step holds (at least 1)."""
    return max(1, PAIR_ELEMENTS // (H * CHUNK * CHUNK * K))


def kda_chunk_workspace(B: int, T: int, H: int, K: int, V: int, in_bytes: float = 4.0,
                        n_chunks: int | None = None, n_seq: int | None = None) -> float:
    """Bytes the reference kda_chunk allocates inside one call besides its output (no autograd), an upper bound.

    B, T, H, K, V: the shapes of q [B, T, H, K] and v [B, T, H, V]; in_bytes: bytes per element of the inputs
    (below 4 they are copied to float32 first); n_chunks, n_seq: the chunk count of the chunk table and the
    sequence count (defaults B ceil(T / CHUNK) and B, those without cu_seqlens). The largest of the phases of
    _chunk_all, each the tensors live in it per chunk slot and head (s of them) and per chunk and head (c), on top
    of the initial states and the slot maps: the pairwise step (the q, k, v, beta tables, G in float64, the stacked
    k and q, the scores, one group's float64 and float32 pairwise decays), the exponentials of G (and their
    float64 temporaries), the solve (its right-hand side and solution), the scaled queries, the transitions (M and
    its temporaries), the scan (M, R and the start states) and the outputs (W, O and their temporaries).
    """
    C = CHUNK
    N = B * -(-T // C) if n_chunks is None else n_chunks
    s, c = float(N * C * H), float(N * H)
    group = 12.0 * min(N, chunks_per_group(H, K)) * H * C * C * K         # float64 differences + float32 copy
    phases = (s * (24 * K + 4 * V + 8 * C + 4) + group,                     # pairwise decays
              s * (36 * K + 4 * V + 8 * C + 4),                             # exp(G), kd
              s * (24 * K + 12 * V + 12 * C + 4),                           # the solve
              s * (24 * K + 4 * V + 4 * C),                                 # the scaled queries
              s * (12 * K + 4 * V + 4 * C) + c * 12 * K * K,                # M
              s * (8 * K + 4 * V + 4 * C) + c * (4 * K * K + 8 * K * V),    # the scan
              s * (8 * K + 16 * V + 4 * C) + c * 4 * K * V)                 # W and O
    states = 4.0 * (B if n_seq is None else n_seq) * H * K * V
    ins = B * T * H * (3 * K + V + 1) * 4.0 if in_bytes < 4 else 0.0       # float32 copies of 16-bit inputs
    return max(phases) + states + ins + 16.0 * (N * C + B * T + 1)         # + the int64 slot maps


def _chunk_table(lengths, starts, device):
    """The chunk layout of sequences ``lengths`` (token counts) starting at flat token ``starts``.

    Sequences are ranked by chunk count, most first (stable), and the table lists chunks step-major: every
    rank's chunk 0, then every rank's chunk 1 of those that have one, ...; so the chunks of scan step t are a
    contiguous range of the table and their sequences the first ``active[t]`` ranks.

    Returns (idx [N, CHUNK] int64 flat token of each slot, -1 for padding; order [n_seq] the sequence of each
    rank; active [steps] list of ints).
    """
    n_chunks = [-(-L // CHUNK) for L in lengths]
    order = sorted(range(len(lengths)), key=lambda i: -n_chunks[i])
    steps = max(n_chunks, default=0)
    active = [sum(1 for i in order if n_chunks[i] > t) for t in range(steps)]
    N = sum(active)
    ln = torch.tensor([lengths[i] for i in order], dtype=torch.int64)
    st = torch.tensor([starts[i] for i in order], dtype=torch.int64)
    rank, step = [], []
    for t in range(steps):
        rank.extend(range(active[t]))
        step.extend([t] * active[t])
    rank, step = torch.tensor(rank, dtype=torch.int64), torch.tensor(step, dtype=torch.int64)
    pos = step[:, None] * CHUNK + torch.arange(CHUNK)[None, :]             # [N, C] position in its sequence
    idx = torch.where(pos < ln[rank][:, None], st[rank][:, None] + pos, -1) if N else pos
    return idx.to(device), order, active


def _pair_scores(G, q, k, beta, scale):
    """A = beta_i sum_d k_id k_jd exp(G_id - G_jd) (j < i) and P = scale sum_d q_id k_jd exp(G_id - G_jd) (j <= i),
    [N, H, C, C] float32, from G [N, H, C, K] float64 and q, k [N, H, C, K], beta [N, H, C, 1] float32; the
    pairwise decays [n, H, C, C, K] for groups of n = chunks_per_group chunks at a time."""
    C = G.shape[2]
    causal = torch.ones(C, C, dtype=torch.bool, device=G.device).tril()[:, :, None]   # j <= i
    qk = torch.stack((k, q), dim=-1)                                         # [N, H, C, K, 2]
    AP, Gb, kb, qkb = [], None, None, None
    n = chunks_per_group(G.shape[1], G.shape[3])
    for Gb, kb, qkb in zip(G.split(n), k.split(n), qk.split(n)):   # (split: one backward for all groups)
        diff = (Gb[:, :, :, None, :] - Gb[:, :, None, :, :]).float()         # [n, H, C, C, K] = G_i - G_j
        decay = torch.exp(torch.where(causal, diff, float("-inf")))          # 0 for j > i
        del diff
        AP.append((decay * kb[:, :, None, :, :]) @ qkb)                      # [n, H, C, C, 2]: k_i, q_i against k_j
        del decay
    del qk, Gb, kb, qkb
    A, P = torch.cat(AP).unbind(-1)
    del AP
    return (A * beta).tril(-1), P.tril() * scale                             # strictly lower; lower incl. diagonal


def _scan(S0, M, R, active):
    """The state scan S <- M S + R over the chunk steps: S0 [n_seq, H, K, V] (rank order), M [N, H, K, K] and
    R [N, H, K, V] in table order (step t: the first active[t] ranks). Returns (the start state of every chunk, a
    list of [active[t], H, K, V], the final states [n_seq, H, K, V])."""
    S, starts = S0, []
    n, H, K, V = S0.shape
    # (split, not slicing: the backward of one split is one concatenation, that of a slice a zero-filled tensor of
    # the whole table per step)
    for a, Mt, Rt in zip(active, M.split(active), R.split(active)):
        Sa = S[:a]
        starts.append(Sa)
        new = torch.baddbmm(Rt.flatten(0, 1), Mt.flatten(0, 1), Sa.flatten(0, 1)).view(a, H, K, V)
        S = new if a == n else torch.cat((new, S[a:]))
    return starts, S


def _chunk_all(q, k, v, g, beta, S0, scale, idx, active):
    """All chunks of all sequences at once (see the module docstring), the state scan a loop over chunk steps.

    q, k, g [B, T, H, K], v [B, T, H, V], beta [B, T, H] (any float dtype, computed in float32); idx [N, CHUNK]
    (flat token b * T + t of every slot, B * T for the padding slots, which read zeros: g = 0, k = v = beta = 0
    leave the state as it is) and active from _chunk_table; S0 [n_seq, H, K, V] float32 in rank order.

    Returns (O [N * CHUNK, H, V] float32 in table order, S [n_seq, H, K, V] the final states in rank order).
    Tensors are released as soon as they are dead (the declared workspace, kda_chunk_workspace, follows this).
    """
    N, C = idx.shape
    H, K, V = v.shape[2], k.shape[3], v.shape[3]
    flat = idx.reshape(-1)

    def table(x):                               # [B, T, H, *] -> [N, H, C, *] float32, padding slots 0
        x = x.reshape(-1, *x.shape[2:]).to(torch.float32)
        x = torch.cat((x, x.new_zeros(1, *x.shape[1:])))[flat].view(N, C, *x.shape[1:])
        return x.transpose(1, 2).contiguous() if x.dim() == 4 else x.transpose(1, 2)[..., None]
    q, k, v, g, beta = table(q), table(k), table(v), table(g), table(beta)   # beta [N, H, C, 1]
    # G and its differences in float64: a float32 prefix sum holds G only to ulp(|G|) (1.2e-4 at |G| ~ 2000,
    # where strong and weak decays of one channel alternate), and G_i - G_j would inherit that absolute error.
    # A difference rounded to float32 (|G_i - G_j| (1 + 2^-24)) then moves its exponential by at most 2^-24 / e.
    G = torch.cumsum(g.double(), dim=2)                                      # [N, H, C, K]
    del g
    A, P = _pair_scores(G, q, k, beta, scale)
    eG = G.exp().float()
    kd = k * (G[:, :, -1:, :] - G).exp().float()                             # k_j exp(G_C - G_j)
    decay_C = G[:, :, -1, :].exp().float()                                   # [N, H, K] exp(G_C)
    del G
    # (I + A) [U | Wk] = diag(beta) [V | K * exp(G)]: the chunk's pseudo-values W = U - Wk S_0
    UW = torch.linalg.solve_triangular(A, beta * torch.cat((v, k * eG), dim=-1), upper=False, unitriangular=True)
    del A, v, k, beta
    U, Wk = UW[..., :V], UW[..., V:]
    qe = q * eG * scale
    del q, eG
    # the chunk's transition S_C = M S_0 + R, M = diag(exp(G_C)) - kd^T Wk, R = kd^T U
    kdT = kd.transpose(-1, -2)
    M = torch.diag_embed(decay_C) - kdT @ Wk                                 # [N, H, K, K]
    R = kdT @ U                                                              # [N, H, K, V]
    del kd, kdT, decay_C
    starts, S = _scan(S0, M, R, active)
    del M, R
    S_start = torch.cat(starts) if starts else S0[:0]                        # [N, H, K, V]: S_0 of every chunk
    del starts
    W = U - Wk @ S_start                                                     # [N, H, C, V]
    del UW, U, Wk
    O = qe @ S_start + P @ W                                                 # [N, H, C, V]
    return O.transpose(1, 2).reshape(N * C, H, V), S


def kda_chunk(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
              cu_seqlens=None, lower_bound=None, segment_chunks=None, check_finite=None):
    """Kimi Delta Attention over whole sequences, chunked WY/UT algorithm in float32 (the reference).

    Args:
        q, k: [B, T, H, K] queries and keys (any float dtype; usually L2-normalised upstream).
        v: [B, T, H, V] values (any float dtype).
        g: [B, T, H, K] log decay per channel, g <= 0 (float32 preferred; any float dtype accepted).
        beta: [B, T, H] delta-rule step sizes, normally in (0, 1).  Values outside are computed as given
            (the recurrence is still defined) but are not a supported regime.
        scale: output scale, default K ** -0.5.
        initial_state: [N_seq, H, K, V] (any float dtype, used as float32) or None (zeros).
        output_final_state: return the state after the last token of each sequence.
        cu_seqlens: int32/int64 [N_seq+1] offsets of packed sequences (requires B == 1); each sequence
            starts from its own initial state (or zero).  Empty sequences are allowed (state passes through).
        lower_bound, segment_chunks, check_finite: the Triton backend's launch options, accepted so that a
            call runs on either backend unchanged; the reference's result does not depend on them (it always
            checks the inputs).  lower_bound must still be None or a number < 0 (TypeError / ValueError), and
            segment_chunks None or a positive int; g below a promised lower_bound gets a RuntimeWarning naming
            the first such token (check_lower_bound_kept, as on the Triton backend).

    Returns:
        (o, final_state): o [B, T, H, V] in v's dtype; final_state [N_seq, H, K, V] float32 or None.
        N_seq = len(cu_seqlens) - 1 with cu_seqlens, else B.

    Math: Kimi Linear (arXiv 2510.26692) eqs. 1-8; spec/OPS.md "kda_chunk" (decay first, then the delta
    update on the decayed state, o_t = scale * S_t^T q_t).  Chunks of CHUNK = 16 tokens, all chunks at once, then
    the state scan; all exponents are pairwise differences G_i - G_j <= 0, so the chunked form overflows for no
    g <= 0.  The recurrence itself stays bounded while beta_t ||k_t||^2 <= 2 (the delta update I - beta k k^T is
    then no expansion; L2-normalised keys with beta in (0, 1], as in Kimi K3, always are); past that a
    RuntimeWarning names the first such token, and a result that overflows raises ValueError
    (check_delta_stability, check_result_finite).

    Raises:
        TypeError: non-tensor / non-float inputs, bad cu_seqlens dtype, non-numeric scale, an
            output_final_state that is not a bool.
        ValueError: shape mismatches (H, K, V, T, B), cu_seqlens with B != 1 or not a valid offset list,
            initial_state of the wrong shape, NaN/inf in any input, g > 0 anywhere (a growing "decay"), a result
            that overflowed from finite inputs (an expansive delta update, beta ||k||^2 > 2).

    Warns:
        RuntimeWarning: beta_t ||k_t||^2 > 2 somewhere (the state can grow without bound from there); g below
        the promised lower_bound.
    """
    where = "kda_chunk"
    B, T, H, K, V, bounds, n_seq = _validate(q, k, v, g, beta, scale, initial_state, cu_seqlens, where)
    if lower_bound is not None:
        if not -math.inf < check_lower_bound_type(lower_bound, where) < 0:
            raise ValueError(f"{where}: lower_bound must be a finite number < 0 or None, got {lower_bound!r}")
    if segment_chunks is not None and (isinstance(segment_chunks, bool)
                                       or not isinstance(segment_chunks, numbers.Integral) or segment_chunks < 1):
        raise ValueError(f"{where}: segment_chunks must be a positive int or None, got {segment_chunks!r}")
    output_final_state = check_flag(output_final_state, "output_final_state", where)
    check_inputs_finite_and_decay(q, k, v, g, beta, where)
    if initial_state is not None:
        _check_finite("initial_state", initial_state, where)
    check_lower_bound_kept(g, lower_bound, where)
    scale = K ** -0.5 if scale is None else float(scale)
    f32 = torch.float32
    if bounds is None:
        lengths, starts = [T] * B, [b * T for b in range(B)]
    else:
        lengths, starts = [e - s for s, e in bounds], [s for s, _ in bounds]
    idx, order, active = _chunk_table(lengths, starts, q.device)
    n_tok = B * T                               # flat tokens; row n_tok is the zero row the padding slots read
    idx = torch.where(idx < 0, n_tok, idx)
    S0 = (initial_state.to(f32)[order] if initial_state is not None
          else torch.zeros(n_seq, H, K, V, dtype=f32, device=q.device))
    O, S = _chunk_all(q, k, v, g, beta, S0, scale, idx, active)
    # every real token sits in exactly one slot of the table: scatter the slots back to token order
    slot = torch.full((n_tok + 1,), -1, dtype=torch.int64, device=q.device)
    slot[idx.reshape(-1)] = torch.arange(idx.numel(), device=q.device)
    o = O[slot[:n_tok]] if n_tok else O.new_zeros(0, H, V)
    o = o.view(B, T, H, V).to(v.dtype)
    final = None
    if output_final_state:
        rank = torch.empty(n_seq, dtype=torch.int64)
        rank[torch.tensor(order, dtype=torch.int64)] = torch.arange(n_seq)
        final = S[rank.to(q.device)]
    check_result_finite(o, final, k, beta, where)
    return o, final


def check_scale(scale, where: str) -> None:
    """scale: None (the default K ** -0.5) or a finite real number (Python or NumPy scalar, not a bool).

    Raises:
        TypeError: not a real number.  ValueError: NaN or infinite.
    """
    if scale is None:
        return
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"{where}: scale must be a real number or None, got {type(scale).__name__} {scale!r}")
    if not math.isfinite(float(scale)):
        raise ValueError(f"{where}: scale must be finite, got {scale!r}")


def check_lower_bound_type(lower_bound, where: str) -> float:
    """kda_chunk's lower_bound (not None) as a float: TypeError unless a number (bools are not); the range each
    backend checks itself (the Triton kernel runs dense diagonal tiles for [-10, 0), the safe path below)."""
    if isinstance(lower_bound, bool) or not isinstance(lower_bound, numbers.Real):
        raise TypeError(f"{where}: lower_bound must be a number or None, got {type(lower_bound).__name__} "
                        f"{lower_bound!r}")
    return float(lower_bound)


def check_step_finite(q, k, v, g, beta, state, where: str) -> None:
    """kda_step's value checks: ValueError if an input or the state holds NaN/inf, or g > 0 anywhere."""
    check_inputs_finite_and_decay(q, k, v, g, beta, where)
    _check_finite("state", state, where)


def check_step_args(q, k, v, g, beta, state, where: str):
    """The argument checks of kda_step (shared with the Triton backend): float tensors, q / k / g [B,H,K],
    v [B,H,V], beta [B,H], state [B,H,K,V], on one device. Returns (B, H, K, V).

    Raises:
        TypeError: non-tensor / non-float inputs.  ValueError: shape or device mismatches.
    """
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("state", state)):
        _check_float(name, t, where)
    if q.dim() != 3 or v.dim() != 3:
        raise ValueError(f"{where}: q must be [B,H,K] and v [B,H,V]; got {tuple(q.shape)}, {tuple(v.shape)}")
    B, H, K = q.shape
    V = v.shape[2]
    if tuple(k.shape) != (B, H, K) or tuple(g.shape) != (B, H, K):
        raise ValueError(f"{where}: k and g must be [B,H,K] = {(B, H, K)}; got {tuple(k.shape)}, {tuple(g.shape)}")
    if tuple(v.shape[:2]) != (B, H):
        raise ValueError(f"{where}: v must be [B,H,V] with B,H = {(B, H)}, got {tuple(v.shape)}")
    if tuple(beta.shape) != (B, H):
        raise ValueError(f"{where}: beta must be [B,H] = {(B, H)}, got {tuple(beta.shape)}")
    if tuple(state.shape) != (B, H, K, V):
        raise ValueError(f"{where}: state must be [B,H,K,V] = {(B, H, K, V)}, got {tuple(state.shape)}")
    if K == 0 or V == 0:
        raise ValueError(f"{where}: empty key/value dimension (K={K}, V={V})")
    for name, t in (("k", k), ("v", v), ("g", g), ("beta", beta), ("state", state)):
        if t.device != q.device:
            raise ValueError(f"{where}: {name} is on {t.device} but q is on {q.device}")
    return B, H, K, V


def kda_step(q, k, v, g, beta, state, *, scale=None, check_finite=None):
    """One decoding step of KDA (the token recurrence of spec/OPS.md), float32 math.

    Args:
        q, k: [B, H, K]; v: [B, H, V]; g: [B, H, K] log decay (<= 0); beta: [B, H];
        state: [B, H, K, V] (any float dtype, used as float32; not modified in place); scale: default K ** -0.5.
        check_finite: the Triton backend's option, accepted so that a call runs on either backend unchanged
            (the reference always checks its inputs).

    Returns:
        (o [B, H, V] in v's dtype, new_state [B, H, K, V] float32), with
        S' = diag(exp(g)) S;  S' += beta k (v - S'^T k)^T;  o = scale * S'^T q.
        Running kda_step over t = 0..T-1 equals kda_chunk on the whole sequence.

    Raises:
        TypeError: non-tensor / non-float inputs, a scale that is not a real number.  ValueError: shape
        mismatches, K or V = 0, a NaN / infinite scale, NaN / inf in an input or the state, g > 0 anywhere, a
        result that overflowed from finite inputs (check_result_finite, as kda_chunk).
    """
    B, H, K, V = check_step_args(q, k, v, g, beta, state, "kda_step")
    check_scale(scale, "kda_step")
    check_step_finite(q, k, v, g, beta, state, "kda_step")
    scale = K ** -0.5 if scale is None else float(scale)
    f32 = torch.float32
    S = state.to(f32) * g.to(f32).exp()[..., None]
    kf = k.to(f32)
    u = v.to(f32) - torch.einsum("bhkv,bhk->bhv", S, kf)
    S = S + beta.to(f32)[..., None, None] * kf[..., :, None] * u[..., None, :]
    o = scale * torch.einsum("bhkv,bhk->bhv", S, q.to(f32))
    o = o.to(v.dtype)
    check_result_finite(o, S, k, beta, "kda_step")        # (as kda_chunk: an overflowing step is an error)
    return o, S
