"""Expert parallelism op by op (backends/parallel/expert.py): moe_experts with the experts spread over 2 gloo ranks
by passes.place_experts.plan equals the single-process reference (output, gradients of x, the routing weights and
every expert weight after summing replicas); experts not a multiple of the ranks (7 experts in 8 slots: one
replica), an expert with no tokens and a rank whose experts receive nothing; the bytes sent equal
plan_memory's all-to-all figure when the routing is the uniform one it assumes."""
import os

import torch
import torch.distributed as dist

import dsl
from backends import reference as R
from backends.parallel.expert import local_slots, moe_experts_ep
from dist_util import run_ranks
from passes.place_experts import plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N, L, I = 37, 12, 10


def _rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _experts_fn(x, idx, w, w1, w3, w2):
    return R.moe_experts(x, idx, w, w1, w3, w2)


def _exchange(rank, world, seed, E, S, k, route, L=L):
    gen = torch.Generator().manual_seed(seed)
    w1, w3 = torch.randn(E, I, L, generator=gen) * 0.3, torch.randn(E, I, L, generator=gen) * 0.3
    w2 = torch.randn(E, L, I, generator=gen) * 0.3
    xs = [torch.randn(N, L, generator=gen) for _ in range(world)]
    idxs = [route(gen, r) for r in range(world)]
    ws = [torch.softmax(torch.randn(N, k, generator=gen), -1) for _ in range(world)]
    wo = [torch.randn(N, L, generator=gen) for _ in range(world)]
    pl = plan(None, num_gpus=world, num_slots=S, num_experts=E)
    slots = local_slots(pl, rank)
    # single process: every rank's tokens, the full experts
    ref = [t.clone().requires_grad_() for t in (w1, w3, w2)]
    loss0 = 0.0
    for r in range(world):
        xr, wr = xs[r].clone().requires_grad_(), ws[r].clone().requires_grad_()
        u0 = R.moe_experts(xr, idxs[r], wr, *ref)
        (u0 * wo[r]).sum().backward()
        if r == rank:
            want_u, want_dx, want_dw = u0.detach(), xr.grad, wr.grad
    x, w = xs[rank].clone().requires_grad_(), ws[rank].clone().requires_grad_()
    loc = [t[slots].clone().requires_grad_() for t in (w1, w3, w2)]
    u, st = moe_experts_ep(x, idxs[rank], w, *loc, placement=pl, group=dist.group.WORLD, experts_fn=_experts_fn)
    assert _rel(u, want_u) < 1e-5
    (u * wo[rank]).sum().backward()
    assert _rel(x.grad, want_dx) < 1e-5 and _rel(w.grad, want_dw) < 1e-5
    for t, r in zip(loc, ref):
        g = torch.zeros_like(t) if t.grad is None else t.grad.clone()     # (None: no pair reached them)
        # an expert's gradient is the sum over its replicas (held on several ranks)
        full = torch.zeros_like(r.grad).index_add_(0, slots, g)
        dist.all_reduce(full)
        assert _rel(full[slots], r.grad[slots]) < 1e-5
    return st, pl


def _uneven(rank, world, seed):
    E, k = 7, 2

    def route(gen, r):          # expert 3 gets no token; rank 1's tokens pile onto expert 0
        if r == 1:
            return torch.stack([torch.zeros(N, dtype=torch.int64), torch.randint(4, 7, (N,), generator=gen)], 1)
        return torch.stack([torch.randint(0, 3, (N,), generator=gen), torch.randint(4, 7, (N,), generator=gen)], 1)
    _exchange(rank, world, seed, E, 8, k, route)


def _idle_rank(rank, world, seed):
    E, k = 6, 2
    pl = plan(None, num_gpus=world, num_slots=6, num_experts=E)
    on0 = torch.tensor(pl.experts_on_gpu(0))

    def route(gen, r):          # every pair goes to rank 0's experts: rank 1 computes nothing
        return on0[torch.stack([torch.randperm(3, generator=gen)[:2] for _ in range(N)])]
    st, _ = _exchange(rank, world, seed, E, 6, k, route)
    assert sum(st.recv_counts) == (0 if rank == 1 else world * N * k)


def _volume(rank, world, seed):
    # the tiny K3's MoE (16 experts, top 4, latent 32, float32): each token picks 2 experts on each rank, the
    # uniform routing under which plan_memory counts (ep - 1) / ep of the copies as remote
    from passes.plan_memory import plan_memory
    E, k, l = 16, 4, 32
    pl = plan(None, num_gpus=world, num_slots=E, num_experts=E)
    per = [torch.tensor(pl.experts_on_gpu(g)) for g in range(world)]

    def route(gen, r):
        return torch.cat([p[torch.stack([torch.randperm(len(p), generator=gen)[:2] for _ in range(N)])]
                          for p in per], 1)
    st, _ = _exchange(rank, world, seed, E, E, k, route, L=l)
    mp_ = plan_memory(dsl.load(os.path.join(ROOT, "models", "kimi_k3.mtc"), "tiny"), seq_len=N * world,
                      gpus=world, ep_size=world, tp_size=1)
    c = mp_.moe_comm[0]
    assert (c.experts, c.top_k, c.width) == (E, k, l)
    assert st.dispatch_bytes == c.dispatch_bytes and st.combine_bytes == c.combine_bytes


def test_expert_parallel_uneven_experts(_fresh_seed):
    run_ranks(_uneven, 2, _fresh_seed)


def test_expert_parallel_idle_rank(_fresh_seed):
    run_ranks(_idle_rank, 2, _fresh_seed)


def test_expert_parallel_volume_equals_plan(_fresh_seed):
    run_ranks(_volume, 2, _fresh_seed)
