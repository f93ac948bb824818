"""A parallel module whose peer rank is gone, or does not arrive within the process group's timeout: the waiting
rank gets an MtcError naming itself and the mesh (not a hang, not only the transport's message). 2 gloo ranks."""
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
