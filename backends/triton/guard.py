"""Checks and host-side helpers shared by the Triton entry points."""
from __future__ import annotations

import warnings
from collections import OrderedDict
from typing import Callable, Hashable

import torch

from backends.reference.ops import check_devices


def interpreted() -> bool:
    """True when Triton runs its kernels under the CPU interpreter (TRITON_INTERPRET=1)."""
    from backends import interpreting
    return interpreting()


def check_kernel_device(where: str, **tensors) -> None:
    """The Triton kernels run on a CUDA device, or on the CPU under TRITON_INTERPRET=1: ValueError naming the
    tensors otherwise, for tensors on different devices and for meta tensors (the reference backend's
    check_devices; None entries are skipped)."""
    check_devices(where, **tensors)
    dev = next((t.device for t in tensors.values() if isinstance(t, torch.Tensor)), None)
    if dev is not None and dev.type != "cuda" and not interpreted():
        raise ValueError(f"{where}: tensors must be on a CUDA device (or run with TRITON_INTERPRET=1), got {dev}")


def scan_values(check_finite: bool | None, t: torch.Tensor) -> bool:
    """Whether an op scans its inputs for NaN / inf (its ``check_finite`` argument): when asked, and by default
    (None) on CPU tensors only (on the GPU the scan costs a host sync per call)."""
    return bool(check_finite) or (check_finite is None and not t.is_cuda)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) of host integers (grid sizes), the same value as ``triton.cdiv``.

    ``triton.cdiv`` / ``triton.next_power_of_2`` are ConstexprFunctions in triton 3.6: about 1.7 us per call
    from host code (measured on the CI machine: the six calls of attn_residual's launch path were 10 of its
    41 us of host work). These plain versions are for the launch paths."""
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n for host integers (0 for 0), the same value as ``triton.next_power_of_2``."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


_SM_COUNTS: dict = {}


def sm_count(device) -> int:
    """Streaming multiprocessors of a CUDA device, cached per device (the launch paths size their grids by it)."""
    dev = torch.device(device)
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    n = _SM_COUNTS.get(idx)
    if n is None:
        n = _SM_COUNTS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return n


#: the dtypes the Triton kernels take (tl.dot operands, TMA descriptors)
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_kernel_dtype(where: str, **tensors) -> None:
    """TypeError naming the first tensor whose dtype the Triton kernels do not take (float64 and others run on
    backends.reference)."""
    for name, t in tensors.items():
        if t.dtype not in KERNEL_DTYPES:
            raise TypeError(f"{where}: {name} is {t.dtype}; the Triton kernels take float32, float16 or bfloat16 "
                            f"(backends.reference runs other float dtypes)")


def check_interpreter_dot_dtype(where: str, **tensors) -> None:
    """Refuse bfloat16 operands of a kernel with ``tl.dot`` under the interpreter.

    Triton 3.6's interpreter computes bf16 ``tl.dot`` wrongly (relative errors of 1e9 and more, no error
    raised), so such a call would return garbage silently.  float32 / float16 are computed right there;
    on a GPU bf16 is the normal dtype.

    Raises:
        TypeError: a bfloat16 tensor among ``tensors`` while TRITON_INTERPRET=1.
    """
    if not interpreted():
        return
    bad = [name for name, t in tensors.items() if isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16]
    if bad:
        raise TypeError(f"{where}: {', '.join(bad)} in bfloat16 under TRITON_INTERPRET=1: triton's CPU interpreter "
                        f"computes bfloat16 tl.dot wrongly (silent garbage); use float32 or float16 on the CPU "
                        f"(bfloat16 runs on a GPU), or the reference backend")


def device_table(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host-built table (list / numpy array of ints) as a tensor on ``device``, WITHOUT a device
    synchronisation on CUDA.

    ``torch.tensor(values, device="cuda")`` copies from pageable memory and then synchronises the stream,
    so the CPU waits for all queued GPU work before every call (no launching ahead; a GPU bubble per
    call). Here the table goes through pinned memory with ``non_blocking=True``: the copy is queued on the
    current stream and torch's caching host allocator keeps the pinned block until the copy has run. If
    pinned memory cannot be had (RuntimeError), the synchronising copy is used. On other devices: a plain
    copy."""
    t = torch.as_tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        try:
            pinned = t.pin_memory()
            out = pinned.to(device, non_blocking=True)
            if torch.cuda.is_current_stream_capturing():
                # the copy is part of the graph and reads this host buffer on every replay: keep it alive
                # (and out of the host allocator's reuse) as long as the device table
                out._mtc_pinned_source = pinned
            return out
        except RuntimeError:
            pass
    return t.to(device)


class DeviceTableCache:
    """Host-built index tables on the device, reused across calls (least recently used dropped first).

    A model calls its kernels with the same geometry step after step (the same sequence lengths, the same
    relative offsets of its activations), so after the first step a call builds no table: no host work and
    no host-to-device copy on the launch path. ``get(key, build, device)`` returns the cached value for
    ``key`` or ``build()`` (any object holding device tensors made on the current stream, e.g. from
    :func:`device_table`). The key must determine the value.

    Streams: on CUDA an entry records an event after its build; a hit on another stream before the copies
    have run makes that stream wait for them. CUDA graphs: a captured graph reads the tables on every replay,
    so an entry hit during a capture is never dropped afterwards, and a table built during a capture (its
    copy runs only when the graph replays) is not cached but kept alive for good, with its pinned host source
    (see :func:`device_table`)."""

    def __init__(self, max_entries: int):
        self.max_entries = int(max_entries)
        self._entries: "OrderedDict[Hashable, tuple]" = OrderedDict()
        self._pinned: set = set()            # keys a captured graph uses: never evicted
        self._captured: list = []            # tables built inside a capture: alive as long as the process

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable, build: Callable[[], object], device: torch.device):
        cuda = torch.device(device).type == "cuda"
        capturing = cuda and torch.cuda.is_current_stream_capturing()
        hit = self._entries.get(key)
        if hit is not None:
            self._entries.move_to_end(key)
            value, ready, stream = hit
            if capturing:
                self._pinned.add(key)
            # (during a capture nothing runs, and querying or waiting on an event recorded outside it is an error)
            if ready is not None and not capturing:
                if ready.query():                    # the copies have run: nothing to order any more
                    self._entries[key] = (value, None, None)
                elif torch.cuda.current_stream(device) != stream:
                    torch.cuda.current_stream(device).wait_event(ready)
            return value
        value = build()
        if capturing:
            self._captured.append(value)
            return value
        ready = stream = None
        if cuda:
            stream = torch.cuda.current_stream(device)
            ready = torch.cuda.Event()
            ready.record(stream)
        self._entries[key] = (value, ready, stream)
        self._evict()
        return value

    def _evict(self) -> None:
        over = len(self._entries) - self.max_entries
        for key in [k for k in self._entries if k not in self._pinned][:max(0, over)]:
            del self._entries[key]


_BF16_WARNED: set = set()


def warn_interpreter_bf16(where: str, *tensors) -> None:
    """Warn once per entry point when a kernel without ``tl.dot`` gets bfloat16 tensors under
    TRITON_INTERPRET=1: triton 3.6's interpreter rounds bfloat16 stores toward zero, so results are biased
    by up to one bf16 step (seen: 59% of attn_residual outputs one step smaller in magnitude than the
    reference's). Not an error (the values are close); float32 / float16 are exact there, and on a GPU
    bf16 rounds to nearest.  Called from an entry point under on_tensor_device: the warning names the line
    that called the entry point."""
    if not interpreted() or where in _BF16_WARNED:
        return
    if any(isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 for t in tensors):
        _BF16_WARNED.add(where)
        warnings.warn(f"{where}: bfloat16 under TRITON_INTERPRET=1: triton's CPU interpreter rounds bfloat16 "
                      f"results toward zero (up to one bf16 step off the reference); use float32 or float16 "
                      f"on the CPU for exact comparisons", RuntimeWarning, stacklevel=4)   # past the device guard


def no_create_graph(where: str) -> None:
    """Call first in a Triton autograd Function's backward: grad mode is on there exactly when the backward
    runs with create_graph=True (a gradient penalty, a second derivative). The Triton backwards are not
    themselves differentiable, and torch would silently give zero second derivatives (the kernels'
    outputs carry no graph): a clear error instead."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"{where}: the Triton backward is not differentiable (backward / autograd.grad "
                           f"with create_graph=True, e.g. a gradient penalty or a second derivative); use "
                           f"target='reference' / backends.reference for higher-order gradients")


def mark_phase(profile, name):
    """Benchmarks' phase timing: append (name, a CUDA event recorded now on the current stream) to the list
    profile; nothing when profile is None (the default of the modules' PROFILE attributes)."""
    if profile is not None:
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        profile.append((name, e))


def check_forward_only(where: str, *tensors) -> None:
    """Refuse a call of a forward-only Triton op while autograd records a gradient for one of its inputs (the
    result would silently carry no gradient). Raises RuntimeError naming the op and the way out."""
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors):
        raise RuntimeError(f"{where}: forward only (no autograd), but an input requires a gradient and autograd is "
                           f"recording; call it under torch.no_grad() / on detached inputs, or use the "
                           f"backends.reference op of the same name for gradients")
