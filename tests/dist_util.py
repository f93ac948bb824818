"""Run a function on several processes with torch.distributed for the parallel tests.

``run_ranks(fn, world, *args)`` spawns ``world`` processes (torch.multiprocessing); each joins a gloo process group
(``backend="nccl"``: NCCL, one GPU per rank) over a free local TCP port with a process-group timeout (a rank that
dies or a collective that never completes is an error, not a hang), sets one intra-op thread (the test machine is
shared), calls ``fn(rank, world, *args)`` and returns; an exception on any rank fails the caller with that rank's
traceback. ``fn`` must be a module-level function (pickled by name)."""
from __future__ import annotations

import datetime
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, timeout_s, backend, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if backend == "nccl":           # the GPU ranks run the compiled kernels; the gloo ranks the CPU interpreter
        torch.cuda.set_device(rank)
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = "1"
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()
    # A gloo worker thread can still hold the last collective's tensors for a moment after the collective returned;
    # if it drops them while the interpreter finalizes, it needs the GIL and aborts the process ("terminate called
    # without an active exception", pytorch/pytorch#179291). The rank's work is done and checked: leave without
    # finalizing (an exception above skips this and reaches torch.multiprocessing's error file as before).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn, world: int, *args, timeout_s: int = TIMEOUT_S, backend: str = "gloo") -> None:
    mp.spawn(_entry, args=(world, free_port(), timeout_s, backend, fn, args), nprocs=world, join=True)
