"""A compiled model on a DeviceMesh (backends/parallel/module.py), CPU gloo, float32, the tiny K3 variant: each
rank's logits, the loss, every parameter gradient after one backward (and sync_gradients) and the QB router biases
after the step equal a single-process run of the same model and batch (rel 1e-5), for cp, ep (with replicas:
16 experts in 18 slots), dp, and ep x cp / dp x ep on 4 ranks; T = 45 (uneven over cp = 2: 23 + 22). Also the
mesh checks (clear MtcErrors), the forward without autograd, and the full state dict gathered and loaded back."""
import copy
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import dsl
from backends import reference as R
from backends.parallel import split_sizes
from dsl.errors import MtcError
from torch.distributed.tensor import DTensor
from dist_util import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T, VOCAB = 45, 256


def _rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _model():
    return dsl.compile(dsl.load(os.path.join(ROOT, "models", "kimi_k3.mtc"), "tiny"), target="reference",
                       seed=0).train()


def _case(rank, world, seed, dims, sizes, num_slots, fsdp=False):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", sizes, mesh_dim_names=dims)
    m0 = _model()
    m = copy.deepcopy(m0).parallelize(mesh, num_slots=num_slots, fsdp=fsdp)
    lay = m.layout
    if lay.sizes["cp"] > 1:           # MLA gathers its latent (kv_lora_rank 16 + qk_rope_dim 8), not K / V
        assert sorted(m.cp_gathered_width.values()) == [24, 24, 24]
    shards = lay.sizes["dp"] * lay.sizes["ep"]                  # sequences: one per dp x ep rank
    di = lay.coords["dp"] * lay.sizes["ep"] + lay.coords["ep"]
    lengths = split_sizes(T, lay.sizes["cp"])
    lo = sum(lengths[:lay.coords["cp"]])
    hi = lo + lengths[lay.coords["cp"]]
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (shards, T), generator=gen)
    tgt = torch.randint(0, VOCAB, (shards, T), generator=gen)
    # this rank's weight bytes are the memory plan's per-GPU weight figure for this mesh (no tensor parallelism)
    from passes.plan_memory import plan_memory
    e0 = next(iter(m._ep_layers.values()), None)
    mp_ = plan_memory(dsl.load(os.path.join(ROOT, "models", "kimi_k3.mtc"), "tiny"), seq_len=T, gpus=world,
                      ep_size=lay.sizes["ep"], tp_size=1, num_slots=e0.placement.num_slots if e0 else None)
    graph_keys = set(m._names.values())
    mine = sum(t.numel() * t.element_size() for k, t in [*m.named_parameters(), *m.named_buffers()] if k in graph_keys)
    if not fsdp:                      # (FSDP2 shards the dense weights, which the plan splits by tensor parallel)
        assert mine == mp_.weight_bytes, (mine, mp_.weight_bytes)
    # the gathered state dict is the single-process one
    full = m.full_state_dict()
    ref_sd = m0.state_dict()
    assert full.keys() == ref_sd.keys()
    assert all(torch.equal(full[k], ref_sd[k]) for k in full)
    # ... and it loads back: a perturbed copy of the whole model, cut to this rank's slots
    moved = {k: v + 1 if v.is_floating_point() else v for k, v in ref_sd.items()}
    m.load_full_state_dict(moved)
    assert all(torch.equal(a, b) for a, b in zip(m.full_state_dict().values(), moved.values()))
    m.load_full_state_dict(ref_sd)
    # single process: the whole batch, no balancing (its router scores kept to compute the expected step)
    m0.balance = None
    scores = {}
    m0._route_spy = lambda n, out, args: scores.__setitem__(n.name, out[2].detach())
    logits0 = m0(ids)
    (F.cross_entropy(logits0.reshape(-1, VOCAB), tgt.reshape(-1), reduction="sum") / ids.numel()).backward()
    # this rank: without autograd (the inference program), then training
    with torch.no_grad():
        m.balance = None
        assert _rel(m(ids[di:di + 1, lo:hi].clone()), logits0[di:di + 1, lo:hi].detach()) < 1e-5
        m.balance = "qb"
    logits = m(ids[di:di + 1, lo:hi].clone())
    assert _rel(logits, logits0[di:di + 1, lo:hi]) < 1e-5
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), tgt[di:di + 1, lo:hi].reshape(-1), reduction="sum") / ids.numel()
    total = loss.detach().clone()
    dist.all_reduce(total)
    loss0 = F.cross_entropy(logits0.reshape(-1, VOCAB), tgt.reshape(-1), reduction="sum") / ids.numel()
    assert abs(float(total - loss0)) < 1e-5 * float(loss0)
    loss.backward()
    m.sync_gradients()
    g0 = {k: p.grad for k, p in m0.named_parameters()}
    experts = {k: e for e in m._ep_layers.values() for k in e.keys}
    for k, p in m.named_parameters():
        want = g0[k][experts[k].slots] if k in experts else g0[k]
        if fsdp and k not in experts:
            assert p.grad is not None and isinstance(p.grad, DTensor)
            p.grad = p.grad.full_tensor()             # (this rank holds its shard)
        # A_log's gradient (one value per KDA head) is a signed sum over every token and channel of the layer: its
        # float32 cancellation is larger (cp = 2, 8 seeds: up to 4.8e-5 relative; every other parameter < 5e-6)
        tol = 1e-4 if k.endswith(".A_log") else 1e-5
        assert p.grad is not None and _rel(p.grad, want) < tol, (k, _rel(p.grad, want))
    # QB: the step from every token's scores of each sequence, b_hat averaged over the sequences (dp x ep)
    for name, (layer, bias_key) in m._router_layers.items():
        s = scores[name].view(shards, T, -1)
        top_k = m.graph.node_map()[name].attr("top_k")
        b0 = torch.zeros(s.shape[-1])
        want = sum(R.qb_update(s[j], b0, top_k=top_k, ema=0.0) for j in range(shards)) / shards
        got = m._tensor(bias_key)
        # b_hat is a difference of two scores (~0.5; the biases ~0.01): its float32 rounding is relative to them
        err = float((got - want).abs().max())
        assert err < 1e-5 * float(s.abs().max()), (layer, err)
        assert not torch.equal(want, b0)
    if lay.sizes["ep"] > 1:
        sent = sum(st.pairs for st in m.last_exchange.values())
        assert sent == len(m._ep_layers) * (hi - lo) * 4          # every (token, choice) pair of this rank, top_k 4


def test_context_parallel_model(_fresh_seed):
    run_ranks(_case, 2, _fresh_seed, ("cp",), (2,), None)


def test_data_parallel_model(_fresh_seed):
    run_ranks(_case, 2, _fresh_seed, ("dp",), (2,), None)


def test_expert_parallel_model_with_replicas(_fresh_seed):
    run_ranks(_case, 2, _fresh_seed, ("ep",), (2,), 18)


def test_ep_cp_model_four_ranks(_fresh_seed):
    run_ranks(_case, 4, _fresh_seed, ("ep", "cp"), (2, 2), None)


def test_dp_ep_model_four_ranks(_fresh_seed):
    run_ranks(_case, 4, _fresh_seed, ("dp", "ep"), (2, 2), 20)


def _mesh_errors(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    m = _model()
    with pytest.raises(MtcError, match="DeviceMesh"):
        m.parallelize("cp")
    with pytest.raises(MtcError, match="unknown dimension name 'tp'"):
        m.parallelize(init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
    with pytest.raises(MtcError, match="name its dimensions"):
        m.parallelize(init_device_mesh("cpu", (2,)))
    with pytest.raises(MtcError, match="num_slots = 17 .* multiple of ep = 2"):
        m.parallelize(init_device_mesh("cpu", (2,), mesh_dim_names=("ep",)), num_slots=17)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    p = dsl.compile(dsl.load(os.path.join(ROOT, "models", "kimi_k3.mtc"), "tiny"), seed=0, mesh=mesh)
    with pytest.raises(MtcError, match="already parallel"):
        p.parallelize(mesh)
    with pytest.raises(MtcError, match="cannot be pickled"):
        copy.deepcopy(p)
    with pytest.raises(MtcError, match="save_hf: a parallel module.*full_state_dict"):
        p.save_hf(tempfile.mkdtemp())
    p.balance = "fixed"
    with pytest.raises(MtcError, match="balance = 'fixed' is not offered on a mesh"):
        p(torch.randint(0, 256, (1, 9)))


def test_mesh_errors():
    run_ranks(_mesh_errors, 2)


def _checkpointed(rank, world, seed):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.utils.checkpoint import checkpoint
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    m0 = _model()
    m = copy.deepcopy(m0).parallelize(mesh)
    gen = torch.Generator().manual_seed(seed)
    ids, tgt = torch.randint(0, VOCAB, (1, T), generator=gen), torch.randint(0, VOCAB, (1, T), generator=gen)
    F.cross_entropy(m0(ids).reshape(-1, VOCAB), tgt.reshape(-1), reduction="sum").backward()
    lengths = split_sizes(T, world)
    lo = sum(lengths[:rank])
    hi = lo + lengths[rank]
    # the recomputation inside the backward runs the collectives again, on every rank in the same order
    out = checkpoint(m, ids[:, lo:hi].clone(), use_reentrant=False)
    F.cross_entropy(out.reshape(-1, VOCAB), tgt[:, lo:hi].reshape(-1), reduction="sum").backward()
    m.sync_gradients()
    for (k, p), p0 in zip(m.named_parameters(), m0.parameters()):
        assert _rel(p.grad, p0.grad) < (1e-4 if k.endswith(".A_log") else 1e-5), k


def test_context_parallel_with_activation_checkpointing(_fresh_seed):
    run_ranks(_checkpointed, 2, _fresh_seed)
