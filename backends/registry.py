"""Op implementations per target, declared beside each backend's code, and the targets' fallback chain.

A backend registers what it can run with :func:`impl`::

    @impl("triton", "kda_chunk", accepts=_kda_shapes)
    def _kda_chunk(node, q, k, v, g, beta):
        ...

``fn(node, *tensors)`` takes the graph node (its attributes) and the op's input tensors in graph order and
returns the op's output (a tuple for several outputs). ``accepts(node, types)`` states the input condition the
implementation needs (``types``: the node's input TensorTypes); it returns None when it takes the node, else
the reason it does not, which the lowered listing prints beside the implementation that runs instead.
``grad=False`` marks a forward-only implementation: a program lowered for training (autograd recording)
skips it. ``workspace(node, shapes, elem)`` gives the bytes an implementation allocates inside one call beyond
its outputs (the memory plan adds the largest); ``meta(node, types)`` the meta-parameters the kernel reads (the
lowered listing prints them); ``aliases(node, types)`` the outputs that are views of an input ({output index: input
index}: the memory plan counts their storage once); ``inplace`` the outputs it can write into the storage of an input
({output index: input index, or a tuple of the input indices it may take}): called as ``fn(node, *tensors,
out=tensor)`` (one output; a tuple with None for a fresh output where it has several), it writes that output into
``out`` and returns it, where ``out`` is one of its inputs. The lowering (passes/lower.py) decides which launches
do so, for the program that runs without autograd only (when the input's last use is that launch, its type is the
output's, and no other live buffer shares its storage); an implementation that finds ``out`` unusable (a layout
its result would not have) returns a fresh result instead, which is correct but costs what the plan saved.

``args`` and ``fake`` make the implementation a ``torch.library`` custom op, ``torch.ops.mtc.<op>_<target>``
(backends/custom_ops.py), which the runtime calls under ``torch.compile`` / ``torch.export``: ``args`` types the
node attributes ``fn`` reads (``"float eps, int? top_k"``, torch.library's schema language; ``SymInt[]`` for a
shape of symbolic dims, evaluated at the running sizes), ``fake(call, *tensors)`` returns empty outputs of the
real ones' shapes, dtypes and strides; ``derive(node, members)`` gives a fused launch's attributes from its member
nodes (``fn`` then reads them with ``call.attr``, like a node's own).

Targets fall back along one chain (:data:`CHAINS`): an op or a node the target's own backend does not take runs
on the next target of the chain.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

#: where each target's ops run when its own backend has no implementation that accepts them
CHAINS: dict[str, tuple[str, ...]] = {
    "reference": ("reference",),
    "triton": ("triton", "reference"),
    "tvm": ("tvm", "triton", "reference"),
}
#: the module whose import registers a target's implementations
_MODULES = {"reference": "backends.reference.impls", "triton": "backends.triton.impls",
            "tvm": "backends.tvm.impls"}


@dataclass(frozen=True)
class Impl:
    """One implementation of one op on one target (see the module docstring)."""

    target: str
    op: str
    name: str                                   # as the lowered listing prints it, e.g. "triton.kda_chunk"
    fn: Callable
    accepts: Callable | None = None
    grad: bool = True
    workspace: Callable | None = None
    meta: Callable | None = None                # meta(node, types) -> the meta-parameters the kernel reads
    aliases: Callable | None = None             # aliases(node, types) -> {output index: input index it views}
    args: str = ""                              # the custom op's attribute parameters (schema language)
    fake: Callable | None = None                # fake(call, *tensors) -> outputs' shapes / dtypes, no compute
    derive: Callable | None = None              # derive(node, members) -> a fused launch's attributes
    inplace: tuple = ()                         # ((output index, (input indices it may overwrite)), ...)
    op_name: str = ""                           # the custom op: torch.ops.mtc.<op_name>

    @property
    def custom_op(self):
        """The torch.library custom op that runs this implementation (None without a ``fake``)."""
        from backends.custom_ops import get
        return get(self)

    def refusal(self, node, types) -> str | None:
        """None when this implementation takes ``node`` (input types ``types``), else why not."""
        return None if self.accepts is None else self.accepts(node, types)


_IMPLS: dict[tuple[str, str], list[Impl]] = {}


def impl(target: str, op: str, *, name: str | None = None, accepts: Callable | None = None, grad: bool = True,
         workspace: Callable | None = None, meta: Callable | None = None, aliases: Callable | None = None,
         args: str = "", fake: Callable | None = None, derive: Callable | None = None, inplace: dict | None = None):
    """Decorator: register ``fn(node, *tensors)`` as ``target``'s implementation of ``op`` (see the module
    docstring). Several implementations of one op on one target are tried in registration order."""
    if target not in CHAINS:
        raise ValueError(f"impl: unknown target {target!r}; targets: {', '.join(CHAINS)}")
    if inplace is not None:
        inplace = {int(j): (i,) if isinstance(i, int) else tuple(i) for j, i in inplace.items()}
        if any(j < 0 or not ins or any(not isinstance(i, int) or i < 0 for i in ins) for j, ins in inplace.items()):
            raise ValueError(f"impl {target}.{op}: inplace maps output indices to input indices (>= 0), got "
                             f"{inplace!r}")
        inplace = tuple(sorted(inplace.items()))

    def deco(fn):
        from backends.custom_ops import op_name
        taken = {i.op_name for impls in _IMPLS.values() for i in impls}
        _IMPLS.setdefault((target, op), []).append(
            Impl(target, op, name or f"{target}.{op}", fn, accepts, grad, workspace, meta, aliases, args, fake,
                 derive, inplace or (), op_name(target, op, taken)))
        return fn
    return deco


def register_target(name: str, chain: tuple[str, ...]) -> None:
    """Declare a target ``name`` (e.g. a benchmark's baseline) whose ops fall back along ``chain`` (it starts with
    ``name``; the rest are declared targets); its implementations are registered with :func:`impl` by the caller.
    ValueError for a name already declared with another chain, or a chain that does not start with it."""
    chain = tuple(chain)
    if not chain or chain[0] != name or any(t not in CHAINS for t in chain[1:]):
        raise ValueError(f"register_target: the chain of {name!r} starts with it and continues with declared "
                         f"targets ({', '.join(CHAINS)}); got {chain}")
    if CHAINS.get(name, chain) != chain:
        raise ValueError(f"register_target: target {name!r} is declared with the chain {CHAINS[name]}")
    CHAINS[name] = chain


def load(target: str) -> None:
    """Import the backends of ``target``'s chain, which registers their implementations (a target declared with
    register_target registers its own)."""
    for t in CHAINS[target]:
        if t in _MODULES:
            importlib.import_module(_MODULES[t])


def resolve(target: str, node, types, *, training: bool = False) -> tuple[Impl | None, list[str]]:
    """The implementation that runs ``node`` on ``target``: the first along the target's chain that accepts it
    (with ``training``, that also has a backward). Returns (impl or None, the refusals met on the way, as
    'name: reason' strings)."""
    load(target)
    refused = []
    for t in CHAINS[target]:
        for cand in _IMPLS.get((t, node.op), ()):
            why = "forward only (autograd records)" if training and not cand.grad else cand.refusal(node, types)
            if why is None:
                return cand, refused
            refused.append(f"{cand.name}: {why}")
    return None, refused


def by_name(name: str) -> Impl:
    """The registered implementation printed as ``name`` (KeyError if none, with every target's backends
    loaded)."""
    for attempt in range(2):
        for impls in _IMPLS.values():
            for cand in impls:
                if cand.name == name:
                    return cand
        if attempt == 0:
            for t in list(CHAINS):
                load(t)
    raise KeyError(name)
