"""The state dict of a parallel module (backends/parallel/module.py): the full model's names, DTensor values of
the full shapes (FSDP2 shards of the dense weights; the experts Shard(0) over ep, from the slots each rank holds,
replicas included) as torch.distributed.checkpoint takes them, the gathered full tensors on request
(full_state_dict, get_model_state_dict(full_state_dict=True)), and a checkpoint moving between layouts: saved
from dp = 2 with FSDP2, loaded into ep = 2 (16 experts in 18 slots) through a full state dict, through the
DTensors directly, and through torch.distributed.checkpoint's files; the logits then equal a single-process run of
the saved weights (rel 1e-5). 2 gloo ranks, tiny, float32."""
import copy

import torch
from torch.distributed.tensor import DTensor, Shard

from dist_util import run_ranks
from test_parallel_module import VOCAB, _model, _rel

T = 29


def _layouts(rank, world, seed, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    gen = torch.Generator().manual_seed(seed)
    m0 = _model().eval()
    # the checkpoint: the seed-0 weights moved, so that a module left at its initial weights cannot pass
    saved = {k: (v + 0.02 * torch.randn(v.shape, generator=gen) if v.is_floating_point() else v)
             for k, v in m0.state_dict().items()}
    m0.load_state_dict(saved)
    ids = torch.randint(0, VOCAB, (world, T), generator=gen)
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


def test_checkpoint_moves_between_layouts(_fresh_seed, tmp_path):
    run_ranks(_layouts, 2, _fresh_seed, str(tmp_path / "ckpt"))
