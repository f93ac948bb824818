"""Memory a forward will need, from the program it runs, checked against what the device has free before any op
runs.

A forward that cannot fit fails at once with an :class:`~dsl.errors.MtcError` that says how much it needs, how
much is free, and how many tokens per sequence would fit, instead of a raw allocator error deep inside an op
(or the operating system's OOM killer on the CPU).

The estimate is the runtime's own walk over its program (passes/lower.py ``KernelProgram.memory``): the graph
inputs and every launch's outputs live until their last use (while autograd does not record; under autograd the
saved tensors live on, so the check uses the sum of all outputs), views sharing their input's storage, plus the
largest transient buffer one launch allocates inside itself (``workspace`` of its implementation,
backends/registry.py). Weights are already resident and are not counted again.
"""
from __future__ import annotations

import os

import sympy
import torch

from dsl.errors import MtcError
from dsl.ir import DTYPES

#: below this many bytes a forward is not checked (reading the free memory costs more than it could save)
CHECK_FROM_BYTES = 64 << 20
_FLOATS = ("f32", "f16", "bf16")


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


def elem_bytes(graph, dtype: torch.dtype):
    """Bytes per element of a value as a module compiled in ``dtype`` stores it: values in the graph's activation
    dtype (its config ``dtype``, f32 if unset) take the module's; other dtypes keep theirs (f32 router scores,
    i64 ids)."""
    act = dict(graph.meta_get("config", ())).get("dtype", "f32")
    fb = torch.empty((), dtype=dtype).element_size()

    def elem(t) -> float:
        return fb if t.dtype == act and t.dtype in _FLOATS else DTYPES.get(t.dtype, 4)
    return elem


def workspace(program, bind: dict, elem):
    """``fn(launch)``: the bytes the launch's implementation allocates inside one call (0 where it declares
    none), at the shape sizes ``bind``."""
    from backends.registry import by_name
    impls: dict = {}

    def nbytes(r: str) -> float:
        t = program.buffers[r].type
        return float(sympy.Mul(*t.shape).subs(bind)) * elem(t)

    def ws(L) -> float:
        if L.is_view:
            return 0.0
        if L.generated is not None:             # operands that are strided views are copied to contiguous rows
            return sum(nbytes(r) for r, _t in L.inputs if _strided(program, r))
        if L.kernel not in impls:
            try:
                impls[L.kernel] = by_name(L.kernel).workspace
            except KeyError:
                impls[L.kernel] = None
        fn = impls[L.kernel]
        if fn is None:
            return 0.0
        shapes = [[int(d.subs(bind)) for d in t.shape] for _r, t in L.inputs]
        return float(fn(L, shapes, elem))
    return ws


def _strided(program, r: str) -> bool:
    """Whether buffer ``r`` is a strided view: a broadcast, or a slice of its last dimension."""
    b = program.buffers.get(r)
    if b is None or b.first < 0:
        return False
    P = program.launches[b.first]
    if P.kernel == "view.broadcast":
        return True
    if P.kernel != "view.slice":
        return False
    rank = len(P.inputs[0][1].shape)
    return P.meta.get("dim", -1) % rank == rank - 1


def forward_bytes(program, graph, bind: dict, dtype: torch.dtype) -> tuple[float, float]:
    """(peak bytes of live activations, the same with the largest launch workspace) of one run of ``program``
    (a module's ``program`` or ``train_program``) at the shape sizes ``bind`` ({Symbol: int}); kept per sizes
    and dtype on the program (a forward at sizes seen before costs a lookup)."""
    key = (tuple(sorted((str(s), int(v)) for s, v in bind.items())), dtype)
    hit = program.memo.get(key)
    if hit is None:
        if len(program.memo) >= 64:
            program.memo.pop(next(iter(program.memo)))
        hit = program.memo[key] = _forward_bytes(program, graph, bind, dtype)
    return hit


def _forward_bytes(program, graph, bind: dict, dtype: torch.dtype) -> tuple[float, float]:
    elem = elem_bytes(graph, dtype)
    if program.training:                     # autograd keeps the saved tensors: every output to the end
        total = sum(float(sympy.Mul(*b.type.shape).subs(bind)) * elem(b.type)
                    for b in program.buffers.values() if program.storage_of(b.name) == b.name and not b.weight_view)
        ws = workspace(program, bind, elem)
        return total, total + max((ws(L) for L in program.launches), default=0.0)
    return program.memory(bind, elem, workspace(program, bind, elem))


def check_forward_fits(program, graph, bind: dict, dtype: torch.dtype, device: torch.device, where: str) -> None:
    """MtcError before the forward runs when its activations (:func:`forward_bytes`, with workspace) exceed the
    device's free memory (:func:`available_bytes`); the message gives both and the longest sequence that fits at
    this batch size. Nothing is checked when the device's free memory is unknown."""
    need = forward_bytes(program, graph, bind, dtype)[1]
    if need < CHECK_FROM_BYTES:
        return
    have = available_bytes(device)
    if have is None or need <= have:
        return
    from passes.stats import human_bytes
    T = next((s for s in bind if str(s) == "T"), None)
    fit = ""
    if T is not None:
        lo, hi = 0, int(bind[T])                    # the longest T that fits: the bytes grow with T
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if forward_bytes(program, graph, {**bind, T: mid}, dtype)[1] <= have:
                lo = mid
            else:
                hi = mid - 1
        B = next((v for s, v in bind.items() if str(s) == "B"), None)
        fit = (f"; at most {lo:,} tokens per sequence fit" + (f" at batch {B}" if B is not None else "")
               if lo else "; not even one token per sequence fits")
    raise MtcError(f"{where}this forward ({', '.join(f'{s} = {v:,}' for s, v in bind.items())}) needs about "
                   f"{human_bytes(need)} of activations, but {device} has {human_bytes(have)} free{fit}. Run "
                   f"shorter sequences (or fewer per batch), a smaller dtype, or free memory first")


def measured_workspace(module, **inputs) -> dict[int, int]:
    """{launch index: bytes it allocated beyond what was allocated before it and its new outputs} for one forward of
    ``module`` (a CUDA CompiledModule) without autograd on ``inputs`` (by graph input name), each launch timed alone
    (the device synchronised and the peak statistics reset around it): what the implementations' declared
    ``workspace`` (backends/registry.py) is checked against. An output that shares an input's storage (a view) brings
    no new bytes."""
    out: dict[int, int] = {}
    orig = module._launch

    def spy(L, fn, call, args, into=None):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        res = orig(L, fn, call, args, into)
        torch.cuda.synchronize()
        held = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        new = sum(o.untyped_storage().nbytes() for o in (res if isinstance(res, tuple) else (res,))
                  if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in held)
        out[L.index] = torch.cuda.max_memory_allocated() - before - new
        return res
    module._launch = spy
    try:
        with torch.no_grad():
            module.run(**inputs)
    finally:
        del module._launch
    return out
