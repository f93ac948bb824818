"""Context parallelism on one GPU (the multi-GPU runs belong to the multi-GPU issue): a 1-rank NCCL group runs
kda_chunk_cp with the Triton kda_chunk (its [v | 0] / [0 | I] augmented call, the NCCL all-gather and
reduce-scatter of the state scan) and must equal one Triton kda_chunk call with the same initial state: outputs,
final state and every gradient. The same check runs on the CPU with gloo (the reference kda_chunk, and the Triton
one under the interpreter). And a
compiled module on a 1-rank NCCL mesh of dims dp, ep, cp trains like the module without a mesh."""
import os

import pytest
import torch
import torch.distributed as dist

from dist_util import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _kda_one_rank(rank, world, seed, device, target, tol):
    import importlib
    from backends.parallel.context import kda_chunk_cp
    kda = importlib.import_module(f"backends.{target}").kda_chunk
    gen = torch.Generator().manual_seed(seed)
    B, T, H, K, V = 2, 77, 2, 32, 32
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = -5.0 * torch.sigmoid(torch.randn(B, T, H, K, generator=gen))
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    s0 = torch.randn(B, H, K, V, generator=gen)
    wo, ws = torch.randn(B, T, H, V, generator=gen), torch.randn(B, H, K, V, generator=gen)
    outs = []
    for cp in (False, True):
        xs = [t.to(device).requires_grad_() for t in (q, k, v, g, beta, s0)]
        if cp:
            o, s = kda_chunk_cp(*xs[:5], group=dist.group.WORLD, initial_state=xs[5], output_final_state=True,
                                kda=kda)
        else:
            o, s = kda(*xs[:5], initial_state=xs[5], output_final_state=True)
        ((o.float() * wo.to(device)).sum() + (s * ws.to(device)).sum()).backward()
        outs.append([o.detach(), s.detach()] + [x.grad for x in xs])
    for name, a, b in zip(["o", "final state", "dq", "dk", "dv", "dg", "dbeta", "d initial_state"], *outs):
        assert _rel(a, b) < tol, (name, _rel(a, b))


def test_kda_cp_one_rank_cpu(_fresh_seed):
    run_ranks(_kda_one_rank, 1, _fresh_seed, "cpu", "reference", 1e-5)


def test_kda_cp_one_rank_cpu_triton_interpreter(_fresh_seed):
    run_ranks(_kda_one_rank, 1, _fresh_seed, "cpu", "triton", 1e-5)


@pytest.mark.gpu
def test_kda_cp_one_rank_nccl_triton(_fresh_seed):
    # (float32 inputs on the GPU: the kernels' dots are TF32 tensor-core products (10-bit mantissa inputs), so the
    # context-parallel combination and the one-call forward differ by ~1e-4, not by float32 reordering)
    run_ranks(_kda_one_rank, 1, _fresh_seed, "cuda", "triton", 1e-3, backend="nccl")


def _module_one_rank(rank, world, seed):
    import copy
    import torch.nn.functional as F
    import dsl
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cuda", (1, 1, 1), mesh_dim_names=("dp", "ep", "cp"))
    m0 = dsl.compile(dsl.load(os.path.join(ROOT, "models", "kimi_k3.mtc"), "tiny"), target="triton", seed=0,
                     device="cuda").train()
    m = copy.deepcopy(m0).parallelize(mesh)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (2, 100), generator=gen).cuda()
    for mod in (m0, m):
        F.cross_entropy(mod(ids).reshape(-1, 256), ids.reshape(-1)).backward()
    m.sync_gradients()
    for (k, p), p0 in zip(m.named_parameters(), m0.parameters()):
        assert torch.equal(p.grad, p0.grad), k


@pytest.mark.gpu
def test_module_on_one_rank_nccl_mesh(_fresh_seed):
    run_ranks(_module_one_rank, 1, _fresh_seed, backend="nccl")
