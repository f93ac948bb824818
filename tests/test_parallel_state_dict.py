"""The state dict of a parallel module (backends/parallel/module.py): the full model's names, DTensor values of
the full shapes (FSDP2 shards of the dense weights; the experts Shard(0) over ep, from the slots each rank holds,
replicas included) as torch.distributed.checkpoint takes them, the gathered full tensors on request
(full_state_dict, get_model_state_dict(full_state_dict=True)), and a checkpoint moving between layouts: saved
from dp = 2 with FSDP2, loaded into ep = 2 (16 experts in 18 slots) through a full state dict, through the
DTensors directly, and through torch.distributed.checkpoint's files; saved from ep x cp = 2 x 2 with FSDP2 and
loaded into dp x ep = 2 x 2 (20 slots) and into whole modules; both checkpoints loaded by a single process
without a process group. The weights equal the saved ones bit for bit and the logits a single-process run of
them (rel 1e-5). Also the expert exchange between slots and DTensor shards alone (uneven torch.chunk splits, an
empty shard, replicas) against indexing the whole weight. gloo ranks, tiny, float32."""
import copy
import warnings

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from dist_util import run_ranks
from test_parallel_module import VOCAB, _model, _rel

T = 29


def _saved(seed, rows):
    """(the single-process module holding the checkpoint's weights, those weights, token ids [rows, T]): the seed-0
    weights moved, so that a module left at its initial weights cannot pass; the same on every process."""
    gen = torch.Generator().manual_seed(seed)
    m0 = _model().eval()
    saved = {k: (v + 0.02 * torch.randn(v.shape, generator=gen) if v.is_floating_point() else v)
             for k, v in m0.state_dict().items()}
    m0.load_state_dict(saved)
    return m0, saved, torch.randint(0, VOCAB, (rows, T), generator=gen)


def _single_process_load(seed, rows, path):
    """The checkpoint at ``path`` loaded by this process alone (no process group) into a whole module's state dict:
    the saved weights bit for bit."""
    import torch.distributed.checkpoint as dcp
    _m0, saved, _ids = _saved(seed, rows)
    sd = _model().state_dict()
    with warnings.catch_warnings():              # (DCP says it assumes one process: what this load means)
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(sd, checkpoint_id=path, no_dist=True)
    assert sd.keys() == saved.keys()
    for k in saved:
        assert torch.equal(sd[k], saved[k]), k


def _layouts(rank, world, seed, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    m0, saved, ids = _saved(seed, world)
    with torch.no_grad():
        want = m0(ids)[rank:rank + 1]
    dp = _model().parallelize(init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)), fsdp=True)
    dp.load_full_state_dict(saved)
    sd = get_model_state_dict(dp)
    assert sd.keys() == saved.keys()
    buffers = dict(m0.named_buffers())                               # (router biases, counts: whole everywhere)
    for k, v in sd.items():
        assert isinstance(v, DTensor) != (k in buffers), k
        if k not in buffers:
            assert v.shape == saved[k].shape and v.placements == (Shard(0),), k
    full = get_model_state_dict(dp, options=StateDictOptions(full_state_dict=True))
    assert full.keys() == saved.keys() and all(torch.equal(full[k], saved[k]) for k in saved)
    dcp.save(sd, checkpoint_id=path)

    ep_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    fresh = _model()
    ep = copy.deepcopy(fresh).parallelize(ep_mesh, num_slots=18)
    esd = ep.state_dict()
    assert esd.keys() == saved.keys()
    experts = ep._expert_keys()
    assert len(experts) == 24                                        # w1, w3, w2 of 8 MoE layers
    for k in sorted(experts):                                      # (one order on every rank: collectives)
        v = esd[k]
        assert isinstance(v, DTensor) and v.shape == saved[k].shape and v.placements == (Shard(0),), k
        assert v.to_local().shape[0] == 8                            # torch.chunk of 16 rows, not the 9 slots
        assert v.device_mesh == ep_mesh, k
        assert torch.equal(v.full_tensor(), fresh.state_dict()[k]), k
    assert all(not isinstance(esd[k], DTensor) for k in esd if k not in experts)   # dense: whole on every rank

    def check(m, how):
        got = m.full_state_dict()
        assert got.keys() == saved.keys() and all(torch.equal(got[k], saved[k]) for k in saved), how
        with torch.no_grad():
            got = m.eval()(ids[rank:rank + 1].clone())
        assert _rel(got, want) < 1e-5, (how, _rel(got, want))

    set_model_state_dict(ep, full, options=StateDictOptions(full_state_dict=True))
    check(ep, "set_model_state_dict(full_state_dict=True)")
    ep = copy.deepcopy(fresh).parallelize(ep_mesh, num_slots=18)
    ep.load_state_dict(sd)                                           # the dp mesh's DTensors, gathered
    check(ep, "load_state_dict(DTensors of the dp mesh)")
    ep = copy.deepcopy(fresh).parallelize(ep_mesh, num_slots=18)
    esd = ep.state_dict()
    dcp.load(esd, checkpoint_id=path)                                # resharded by DCP into this layout
    ep.load_state_dict(esd)
    check(ep, "torch.distributed.checkpoint")
    # and back: the ep layout's DTensors into a dp layout without FSDP (dense weights whole)
    plain = copy.deepcopy(fresh).parallelize(init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)))
    plain.load_state_dict(ep.state_dict())
    check(plain, "load_state_dict(DTensors of the ep mesh)")


def _check_loaded(m, saved, ids, want, how):
    got = m.full_state_dict()
    assert got.keys() == saved.keys(), how
    for k in saved:
        assert torch.equal(got[k], saved[k]), (how, k)
    with torch.no_grad():
        got = m.eval()(ids.clone())
    assert _rel(got, want) < 1e-5, (how, _rel(got, want))


def _meshes(rank, world, seed, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    m0, saved, ids = _saved(seed, world)
    # saved from ep x cp with FSDP2 (dense weights sharded over the 4 ranks; experts Shard(0) on ep, 18 slots)
    src = _model().parallelize(init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "cp")), num_slots=18,
                               fsdp=True)
    src.load_full_state_dict(saved)
    sd = src.state_dict()
    assert sd.keys() == saved.keys()
    for k in sorted(src._expert_keys()):
        v = sd[k]
        assert isinstance(v, DTensor) and v.shape == saved[k].shape and v.placements == (Shard(0), Replicate()), k
        assert torch.equal(v.to_local(), saved[k][8 * src.layout.coords["ep"]:][:8]), k
    dcp.save(sd, checkpoint_id=path)
    # into dp x ep with FSDP2 and another slot count (20: other replicas)
    dst = _model().parallelize(init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep")), num_slots=20,
                               fsdp=True)
    dsd = dst.state_dict()
    dcp.load(dsd, checkpoint_id=path)
    dst.load_state_dict(dsd)
    di = dst.layout.coords["dp"] * 2 + dst.layout.coords["ep"]
    with torch.no_grad():
        want = m0(ids)
    _check_loaded(dst, saved, ids[di:di + 1], want[di:di + 1], "dp x ep from ep x cp")
    # into a whole module on every rank (plain tensors: each rank reads all of it)
    whole = _model()
    wsd = whole.state_dict()
    dcp.load(wsd, checkpoint_id=path)
    for k in saved:
        assert torch.equal(wsd[k], saved[k]), k


def test_checkpoint_moves_between_layouts(_fresh_seed, tmp_path):
    run_ranks(_layouts, 2, _fresh_seed, str(tmp_path / "ckpt"))
    _single_process_load(_fresh_seed, 2, str(tmp_path / "ckpt"))


def test_checkpoint_moves_between_meshes(_fresh_seed, tmp_path):
    run_ranks(_meshes, 4, _fresh_seed, str(tmp_path / "ckpt"))
    _single_process_load(_fresh_seed, 4, str(tmp_path / "ckpt"))


def _exchange(rank, world, seed):
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.device_mesh import init_device_mesh
    from backends.parallel.expert import local_slots, shard_rows, shard_to_slots, slots_to_shard
    from passes.place_experts import plan
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    gen = torch.Generator().manual_seed(seed)
    group = dist.group.WORLD
    for E, S in ((4, 6), (5, 9), (7, 9)):               # shards of 2 2 0, 2 2 1, 3 3 1 rows; 2, 4, 2 replicas
        load = torch.rand(E, generator=gen) * 100
        pl = plan(load, num_gpus=world, num_slots=S)
        full = torch.randn(E, 3, 2, generator=gen)
        lo, hi = shard_rows(E, world, rank)
        # shard_rows is DTensor's own split
        assert torch.equal(distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None).to_local(), full[lo:hi])
        slots = full[local_slots(pl, rank)]
        assert torch.equal(slots_to_shard(slots, pl, group), full[lo:hi]), (E, S)
        assert torch.equal(shard_to_slots(full[lo:hi].clone(), pl, group), slots), (E, S)


def test_expert_exchange_slots_and_shards(_fresh_seed):
    run_ranks(_exchange, 3, _fresh_seed)
