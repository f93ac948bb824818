"""The current CUDA device for a call: Triton (and the generated kernels) launch on torch's current device, not on
the device of the tensors they are given.  No Triton import here: the runtime uses it too."""
from __future__ import annotations

import functools
from typing import Callable

import torch


def tensor_device(args, kwargs) -> torch.device | None:
    """The CUDA device of the first CUDA tensor among the arguments (tensors, or lists / tuples of them), or
    None when there is none."""
    for a in (*args, *kwargs.values()):
        for t in (a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(t, torch.Tensor) and t.is_cuda:
                return t.device
    return None


def on_tensor_device(fn: Callable) -> Callable:
    """Decorator for a Triton entry point: run it with the CUDA device of its first CUDA tensor argument as the
    current device.  Triton launches its kernels (and takes its stream) on the current device, so tensors on
    cuda:1 while cuda:0 is current would otherwise be handed to a kernel on the wrong GPU.  The autograd
    backward needs no guard: torch's engine runs it with the tensors' device current."""
    @functools.wraps(fn)
    def guarded(*args, **kwargs):
        dev = tensor_device(args, kwargs)
        if dev is None or dev.index is None or dev.index == torch.cuda.current_device():
            return fn(*args, **kwargs)
        with torch.cuda.device(dev):
            return fn(*args, **kwargs)
    return guarded
