"""Host-side helpers shared by the attn_residual launches: source offset tables, argument checks, row tiles."""
from __future__ import annotations

import importlib
from typing import Sequence

import torch

from ..guard import DeviceTableCache, device_table, interpreted, next_power_of_2, sm_count

# the module itself (backends.reference re-exports a function of the same name)
ref = importlib.import_module("backends.reference.attn_residual")

INTERPRET = interpreted()
SUPPORTED = (torch.float32, torch.float16, torch.bfloat16)


def offset_table(tensors: Sequence[torch.Tensor], where: str):
    """(base tensor, int64 element-offset table on the device, VEC alignment hint) for a list of tensors."""
    base = tensors[0]
    es = base.element_size()
    ptrs = [t.data_ptr() for t in tensors]
    for i, p in enumerate(ptrs):
        if (p - ptrs[0]) % es:
            raise ValueError(f"{where}: source {i} is not element-aligned relative to source 0")
    offs = cached_table(tuple((p - ptrs[0]) // es for p in ptrs), base.device)
    vec = 16 // es if all(p % 16 == 0 for p in ptrs) else 1
    return base, offs, vec


#: offset tables already on the device, keyed by (device, offsets); a model's activations come back at the same
#: relative offsets step after step (torch's caching allocator), so after the first step a call builds no table
#: (its host work would show next to a kernel of ~0.17 ms: benchmarks/results/attn_residual.md). The tables hold
#: offsets, not pointers: a stale entry is still a right table for the same offsets.
TABLES_MAX = 256
TABLES = DeviceTableCache(TABLES_MAX)


def cached_table(offsets: tuple, device: torch.device) -> torch.Tensor:
    return TABLES.get((str(device), offsets), lambda: device_table(list(offsets), torch.int64, device), device)


def flat(t: torch.Tensor, d: int) -> torch.Tensor:
    return t.reshape(-1, d).contiguous()


def check_device(t: torch.Tensor, where: str) -> None:
    if t.device.type != "cuda" and not INTERPRET:
        raise ValueError(f"{where}: the Triton backend needs CUDA tensors (got {t.device}); use "
                         f"backends.reference on CPU, or set TRITON_INTERPRET=1 before importing triton")
    if t.dtype not in SUPPORTED:
        raise TypeError(f"{where}: dtype {t.dtype} is not supported (float32, float16, bfloat16)")


def row_tile(d: int, n: int):
    """(BT, BD, num_warps) of the row kernels: one tile holds BT whole rows of BD >= d columns."""
    bd = next_power_of_2(d)
    bt = max(1, min(16, 4096 // bd, next_power_of_2(max(n, 1))))
    nw = 4 if bd * bt <= 2048 else (8 if bd * bt <= 8192 else 16)
    return bt, bd, nw


def num_sms(dev: torch.device) -> int:
    return sm_count(dev) if dev.type == "cuda" else 4
