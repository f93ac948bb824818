"""Memory a forward will need, checked against what the device has free before any op runs.

A forward that cannot fit fails at once with an :class:`~dsl.errors.MtcError` that says how much it needs, how
much is free, and how many tokens per sequence would fit, instead of a raw allocator error deep inside an op
(or the operating system's OOM killer on the CPU).

The estimate is the runtime's own: every op output of the executed graph stays alive until the forward ends
(views alias their input and cost nothing), plus the largest transient buffer inside one op (the reference
``mla_attention`` materialises its [B, H, T, T] scores). Weights are already resident and are not counted
again.
"""
from __future__ import annotations

import os

import sympy
import torch

from dsl.errors import MtcError
from dsl.ir import DTYPES, SOURCE_OPS, Graph

#: below this many bytes a forward is not checked (reading the free memory costs more than it could save)
CHECK_FROM_BYTES = 64 << 20
VIEW_OPS = ("reshape", "slice", "broadcast")


def available_bytes(device: torch.device) -> int | None:
    """Bytes a forward may still allocate on ``device``: for CUDA the driver's free memory plus what torch's
    caching allocator holds unused; for the CPU the kernel's MemAvailable, capped by a cgroup v2 limit (a
    container's); None where neither is known."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    if device.type != "cpu":
        return None
    have = None
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f.read(1 << 16).decode("ascii", "replace").splitlines():
                if line.startswith("MemAvailable:"):
                    have = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        have = None
    if have is None:
        try:
            have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return None
    try:
        with open("/sys/fs/cgroup/memory.max", "rb") as f:
            limit = f.read(64).strip()
        with open("/sys/fs/cgroup/memory.current", "rb") as f:
            used = int(f.read(64).strip())
        if limit != b"max":
            have = min(have, max(int(limit) - used, 0))
    except (OSError, ValueError):
        pass
    return have


def _workspace(n, shape, target: str) -> float:
    """The largest transient inside op ``n`` (bytes), beyond its outputs: the reference attention's scores
    (s, its masked copy and the softmax, float32 [B, H, T, T] each)."""
    if n.op == "mla_attention" and target == "reference":
        B, T, H = shape(n.inputs[0])[:3]
        return 3.0 * B * H * T * T * 4
    return 0.0


def forward_bytes(graph: Graph, bind: dict, dtype: torch.dtype, target: str) -> float:
    """Bytes of activations a forward of ``graph`` allocates at the shape binding ``bind`` ({Symbol: int}) with
    float values in ``dtype``: every non-view op output (kept to the end of the forward) plus the largest
    single op's transient workspace."""
    fbytes = torch.empty((), dtype=dtype).element_size()
    types = {n.name: n.types for n in graph.nodes}
    sizes: dict = {}

    def numel(t) -> float:
        hit = sizes.get(t.shape)
        if hit is None:
            v = sympy.Mul(*t.shape).subs(bind) if t.shape else sympy.Integer(1)
            hit = sizes[t.shape] = float(v) if v.is_number else 0.0
        return hit

    def shape(ref):
        return [int(d.subs(bind)) for d in types[ref.node][ref.index].shape]

    total = work = 0.0
    for n in graph.nodes:
        if n.op in SOURCE_OPS or n.op in VIEW_OPS:
            continue
        for t in n.types:
            eb = fbytes if t.dtype in ("f32", "f16", "bf16") else DTYPES.get(t.dtype, 4)
            total += numel(t) * eb
        work = max(work, _workspace(n, shape, target))
    return total + work


def check_forward_fits(graph: Graph, bind: dict, dtype: torch.dtype, device: torch.device, target: str,
                       where: str) -> None:
    """MtcError before the forward runs when its activations (:func:`forward_bytes`) exceed the device's free
    memory (:func:`available_bytes`); the message gives both and the longest sequence that fits at this batch
    size. Nothing is checked when the device's free memory is unknown."""
    need = forward_bytes(graph, bind, dtype, target)
    if need < CHECK_FROM_BYTES:
        return
    have = available_bytes(device)
    if have is None or need <= have:
        return
    from dsl.stats import human_bytes
    T = next((s for s in bind if str(s) == "T"), None)
    fit = ""
    if T is not None:
        lo, hi = 0, int(bind[T])                    # the longest T that fits: forward_bytes grows with T
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if forward_bytes(graph, {**bind, T: mid}, dtype, target) <= have:
                lo = mid
            else:
                hi = mid - 1
        B = next((v for s, v in bind.items() if str(s) == "B"), None)
        fit = (f"; at most {lo:,} tokens per sequence fit" + (f" at batch {B}" if B is not None else "")
               if lo else "; not even one token per sequence fits")
    raise MtcError(f"{where}this forward ({', '.join(f'{s} = {v:,}' for s, v in bind.items())}) needs about "
                   f"{human_bytes(need)} of activations, but {device} has {human_bytes(have)} free{fit}. Run "
                   f"shorter sequences (or fewer per batch), a smaller dtype, or free memory first")
