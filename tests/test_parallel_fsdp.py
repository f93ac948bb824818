"""FSDP2 for the dense weights (parallelize(..., fsdp=True): fully_shard of each layer block unit, then of the
module, over the whole mesh, the routed experts left to expert parallelism), alone on dp and composed with cp and
with ep: logits, loss, every gradient (the dense ones gathered from their shards), QB biases and the full state
dict as in tests/test_parallel_module.py against a single-process run; and the units themselves: one per Block
AttnRes group of layers (its phase 1 reads the whole group's pseudo-queries), their weights DTensors sharded over
the mesh, and during the forward only the unit whose launch runs has its weights gathered. 2 gloo ranks, tiny."""
import copy

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

from dist_util import run_ranks
from test_parallel_module import VOCAB, _case, _model, _rel


def test_fsdp_data_parallel(_fresh_seed):
    run_ranks(_case, 2, _fresh_seed, ("dp",), (2,), None, True)


def test_fsdp_with_context_parallel(_fresh_seed):
    run_ranks(_case, 2, _fresh_seed, ("cp",), (2,), None, True)


def test_fsdp_with_expert_parallel(_fresh_seed):
    run_ranks(_case, 2, _fresh_seed, ("ep",), (2,), 18, True)


def _units(rank, world, seed, dims):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=dims)
    m0 = _model()
    m = copy.deepcopy(m0).parallelize(mesh, fsdp=True)
    layers = [f"model.layers.{i}" for i in range(9)]                # tiny: 9 layers in AttnRes groups of 3
    assert m.fsdp_units == [layers[0:3], layers[3:6], layers[6:9]]
    fsdp_modules = [name for name, mod in m.named_modules() if isinstance(mod, FSDPModule)]
    assert fsdp_modules == [""] + layers                              # the root and every block
    experts = m._expert_keys()
    for k, p in m.named_parameters():
        if k in experts:                                              # ep: this rank's slots, outside FSDP
            assert not isinstance(p, DTensor), k
            continue
        assert isinstance(p, DTensor) and p.placements == (Shard(0),), k
        assert p.device_mesh.mesh_dim_names == dims and p.to_local().shape[0] <= -(-p.shape[0] // world), k
    first = {b: next(k for k in m.state_dict() if k.startswith(b + ".")) for b in layers}
    unit_of = {b: i for i, u in enumerate(m.fsdp_units) for b in u}
    seen = []
    launch = m._launch

    def spy(L, fn, call, args, into=None):
        gathered = {b for b in layers if not isinstance(m._tensor(first[b]), DTensor)}
        reads = {m._names[r[1:]] for r, _t in L.inputs if r[1:] in m._names}
        assert len({unit_of[b] for b in gathered}) <= 1, (L.index, gathered)   # one unit's weights at a time
        assert all(k in experts or not isinstance(m._tensor(k), DTensor) for k in reads), L.index
        seen.append(frozenset(gathered))
        return launch(L, fn, call, args, into)
    m._launch = spy
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, 31), generator=gen)
    tgt = torch.randint(0, VOCAB, (2, 31), generator=gen)
    logits = m(ids[rank:rank + 1].clone())
    assert {frozenset(u) for u in m.fsdp_units} <= set(seen) and frozenset() in set(seen)
    assert all(isinstance(m._tensor(first[b]), DTensor) for b in layers)   # resharded after the forward
    logits0 = m0(ids)
    assert _rel(logits, logits0[rank:rank + 1].detach()) < 1e-5
    (F.cross_entropy(logits.reshape(-1, VOCAB), tgt[rank].reshape(-1), reduction="sum") / ids.numel()).backward()
    m.sync_gradients()
    (F.cross_entropy(logits0.reshape(-1, VOCAB), tgt.reshape(-1), reduction="sum") / ids.numel()).backward()
    g0 = dict(m0.named_parameters())
    for k, p in m.named_parameters():
        assert isinstance(p.grad, DTensor) and isinstance(p, DTensor), k
        tol = 1e-4 if k.endswith(".A_log") else 1e-5
        assert _rel(p.grad.full_tensor(), g0[k].grad) < tol, (k, _rel(p.grad.full_tensor(), g0[k].grad))


def test_fsdp_units_are_layer_blocks(_fresh_seed):
    run_ranks(_units, 2, _fresh_seed, ("dp",))

