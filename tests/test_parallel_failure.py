"""A parallel module whose peer rank is gone, or does not arrive within the process group's timeout: the waiting
rank gets an MtcError naming itself and the mesh (not a hang, not only the transport's message), in the forward
and in the backward of the expert / context parallel launches; in FSDP2's backward hooks, the transport's error in
time. 2 gloo ranks."""
import os
import time

import pytest
import torch

import dsl
from dsl.errors import MtcError
from dist_util import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 6


def _peer_missing(rank, world, mode):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    m = dsl.compile(dsl.load(os.path.join(ROOT, "models", "kimi_k3.mtc"), "tiny"), seed=0, mesh=mesh)
    if rank == 1:
        if mode == "late":
            time.sleep(TIMEOUT_S + 4)
        return                                           # "died": leaves without running the forward
    with pytest.raises(MtcError, match=r"rank 0 of the mesh .*'cp': 2.*a collective in the forward failed"):
        m(torch.randint(0, 256, (1, 20)))


def test_dead_rank_is_an_error():
    run_ranks(_peer_missing, 2, "dead", timeout_s=TIMEOUT_S)


def test_late_rank_times_out_with_an_error():
    run_ranks(_peer_missing, 2, "late", timeout_s=TIMEOUT_S)


def _peer_leaves_before_backward(rank, world, dim, fsdp):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=(dim,))
    m = dsl.compile(dsl.load(os.path.join(ROOT, "models", "kimi_k3.mtc"), "tiny"), seed=0).train()
    m = m.parallelize(mesh, fsdp=fsdp)
    m.balance = None
    loss = m(torch.randint(0, 256, (1, 20))).square().mean()
    if rank == 1:
        return                                           # "died" after the forward, before its backward
    t0 = time.monotonic()
    if fsdp:
        # FSDP2's own all-gather in its pre-backward hook fails first: the transport's RuntimeError, in time (the
        # hooks run inside the autograd engine, outside the module's code)
        with pytest.raises(RuntimeError, match=r"(?i)connection|peer"):
            loss.backward()
    else:
        # the exchanges of the expert / context parallel launches' backward (all_to_all, all-gather,
        # reduce-scatter of the KDA states)
        with pytest.raises(MtcError, match=r"rank 0 of the mesh .* a collective in the backward failed"):
            loss.backward()
    assert time.monotonic() - t0 < TIMEOUT_S + 2


@pytest.mark.parametrize("dim,fsdp", [("ep", False), ("cp", False), ("dp", True)])
def test_dead_rank_in_the_backward_is_an_error(dim, fsdp):
    run_ranks(_peer_leaves_before_backward, 2, dim, fsdp, timeout_s=TIMEOUT_S)
