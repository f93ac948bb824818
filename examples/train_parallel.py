"""A few training steps of a K3 variant on several processes: data, expert and context parallel on a DeviceMesh.

    torchrun --nproc-per-node 4 examples/train_parallel.py --mesh ep=2,cp=2 --steps 5
    torchrun --nproc-per-node 2 examples/train_parallel.py --mesh cp=2 --seq-len 256 --input README.md
    torchrun --nproc-per-node 8 examples/train_parallel.py --variant small --mesh dp=2,ep=4 --target triton --fsdp

Next-byte prediction (vocab 256) on a text file (default: the excerpt shipped in examples/data). Every step takes
``--batch`` windows of ``--seq-len + 1`` bytes per dp x ep rank (the same windows on every rank for one seed); each
cp rank takes its contiguous run of the window (backends.parallel.split_sizes). The loss on each rank is the sum
of its tokens' cross entropy over the global token count, so that after ``m.sync_gradients()`` every rank holds
the gradient of the global mean loss; AdamW then takes the same step everywhere. Rank 0 prints the global loss of
every step. ``--mesh`` names the dims (dp, ep, cp; sizes multiply to the number of processes). The backend is
NCCL with one GPU per process when CUDA is present (LOCAL_RANK picks it), else gloo on the CPU. Run without
torchrun, it is one process.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import dsl  # noqa: E402
from backends.parallel import split_sizes  # noqa: E402
from backends.parallel.module import DIMS  # noqa: E402
from dsl.errors import MtcError  # noqa: E402


def parse_mesh(text: str, world: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """'ep=2,cp=2' -> (('ep', 'cp'), (2, 2)); MtcError for an unknown name, a size < 1, or sizes whose product is
    not the number of processes."""
    names, sizes = [], []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, size = part.partition("=")
        if name not in DIMS or not size.isdigit() or int(size) < 1 or name in names:
            raise MtcError(f"--mesh {text!r}: write dims as name=size from {', '.join(DIMS)}, each once, "
                           f"e.g. ep=2,cp=2 (got {part!r})")
        names.append(name)
        sizes.append(int(size))
    if not names:
        names, sizes = ["dp"], [world]
    prod = 1
    for s in sizes:
        prod *= s
    if prod != world:
        raise MtcError(f"--mesh {text!r}: the sizes multiply to {prod} but there are {world} processes "
                       f"(torchrun --nproc-per-node {prod})")
    return tuple(names), tuple(sizes)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", default=str(ROOT / "models" / "kimi_k3.mtc"))
    ap.add_argument("--variant", default="tiny")
    ap.add_argument("--mesh", default="", help="e.g. dp=2,ep=2,cp=1 (default: dp over every process)")
    ap.add_argument("--input", default=str(ROOT / "examples" / "data" / "python_reference_excerpt.txt"))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1, help="sequences per dp x ep rank")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target", default="reference")
    ap.add_argument("--fsdp", action="store_true",
                    help="shard the dense weights over the mesh (FSDP2: one unit per group of layer blocks)")
    ap.add_argument("--timeout", type=float, default=300.0, help="process group timeout, seconds")
    a = ap.parse_args(argv)

    if "RANK" not in os.environ:            # not under torchrun: one process
        import socket
        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            port = sk.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=a.timeout))
    try:
        world, rank = dist.get_world_size(), dist.get_rank()
        names, sizes = parse_mesh(a.mesh, world)
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cuda" if cuda else "cpu", sizes, mesh_dim_names=names)
        device = f"cuda:{torch.cuda.current_device()}" if cuda else "cpu"
        m = dsl.compile(dsl.load(a.spec, a.variant), target=a.target, seed=a.seed, device=device).train()
        m.parallelize(mesh, fsdp=a.fsdp)
        lay = m.layout
        shards = lay.sizes["dp"] * lay.sizes["ep"]
        di = lay.coords["dp"] * lay.sizes["ep"] + lay.coords["ep"]
        lengths = split_sizes(a.seq_len, lay.sizes["cp"])
        lo = sum(lengths[:lay.coords["cp"]])
        hi = lo + lengths[lay.coords["cp"]]
        data = torch.tensor(list(Path(a.input).read_bytes()), dtype=torch.int64)
        if data.numel() < a.seq_len + 2:
            raise MtcError(f"--input {a.input}: {data.numel()} bytes, fewer than --seq-len + 2 = {a.seq_len + 2}")
        opt = torch.optim.AdamW(m.parameters(), lr=a.lr)
        gen = torch.Generator().manual_seed(a.seed)
        n_tok = shards * a.batch * a.seq_len
        if rank == 0:
            print(f"{m.graph.name} ({a.variant}) on {world} processes, mesh {dict(zip(names, sizes))}: "
                  f"{sum(p.numel() for p in m.parameters()) / 1e6:.2f} M parameters on rank 0, {n_tok} tokens "
                  f"per step", flush=True)
        for step in range(1, a.steps + 1):
            t0 = time.perf_counter()
            starts = torch.randint(0, data.numel() - a.seq_len - 1, (shards * a.batch,), generator=gen)
            win = torch.stack([data[s:s + a.seq_len + 1] for s in starts.tolist()])
            rows = slice(di * a.batch, (di + 1) * a.batch)
            x, y = win[rows, lo:hi].to(device), win[rows, lo + 1:hi + 1].to(device)
            logits = m(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1),
                                   reduction="sum") / n_tok
            loss.backward()
            m.sync_gradients()
            opt.step()
            opt.zero_grad(set_to_none=True)
            total = loss.detach().clone()
            dist.all_reduce(total)
            if rank == 0:
                print(f"step {step}: loss {total.item():.6f} nats/byte ({time.perf_counter() - t0:.2f} s)",
                      flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except MtcError as e:
        print(e, file=sys.stderr)
        sys.exit(2)
