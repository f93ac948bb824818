"""Quantile Balancing under data parallelism: two CPU processes (torch.distributed, gloo) each see their own
batch; with dp_group the b_hat of the ranks are averaged before centring (spec/OPS.md qb_update), so both
ranks end with the same bias, equal to the mean over ranks of the single-rank QB step (centring is linear)."""
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import dsl
from backends import reference as R

N, E, K = 301, 24, 3


def _batch(rank):
    gen = torch.Generator().manual_seed(1234 + rank)
    return torch.rand(N, E, generator=gen) * (1 + torch.linspace(0, 1, E))   # skewed scores


def _worker(rank, world, init_file, out_dir, seed):
    os.environ["TRITON_INTERPRET"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        from backends.triton import moe as TM
        torch.manual_seed(seed)
        bias = 0.01 * torch.randn(E)                    # same on every rank (same seed)
        scores = _batch(rank)
        res = {"ref": R.qb_update(scores, bias, top_k=K, ema=0.3, dp_group=dist.group.WORLD),
               "triton": TM.qb_update(scores, bias, top_k=K, ema=0.3, dp_group=dist.group.WORLD)}
        # the compiled model in training mode: its QB step averages over the group too
        g = dsl.load(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                  "models", "kimi_k3.mtc"), "tiny")
        m = dsl.compile(g, target="reference", seed=seed).train()
        m.dp_group = dist.group.WORLD
        with torch.no_grad():
            m(torch.randint(0, 256, (1, 50), generator=torch.Generator().manual_seed(rank)))
        res["model"] = {k: v.clone() for k, v in m.state_dict().items() if k.endswith("e_score_correction_bias")}
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_qb_update_averages_over_data_parallel_ranks():
    seed = int(torch.randint(0, 10_000, ()).item())
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(2, os.path.join(d, "init"), d, seed), nprocs=2, join=True)
        r0, r1 = (torch.load(os.path.join(d, f"rank{r}.pt")) for r in range(2))
    torch.manual_seed(seed)
    bias = 0.01 * torch.randn(E)
    # independent expectation: the mean over ranks of the single-rank step without ema, then the ema
    single = [R.qb_update(_batch(r), bias, top_k=K, ema=0.0) for r in range(2)]
    want = 0.3 * bias + 0.7 * (single[0] + single[1]) / 2
    for name in ("ref", "triton"):
        assert torch.allclose(r0[name], want, atol=1e-6), name
        assert torch.equal(r0[name], r1[name]), name
    # and it is not what a single rank alone would do
    assert (r0["ref"] - (0.3 * bias + 0.7 * single[0])).abs().max() > 1e-4
    assert r0["model"] and r0["model"].keys() == r1["model"].keys()
    for k in r0["model"]:
        assert torch.equal(r0["model"][k], r1["model"][k]), k      # both ranks apply the same bias
        assert r0["model"][k].abs().sum() > 0, k                    # and the step did move it
