"""The runtime shared by all backends: a ``torch.nn.Module`` that owns a compiled graph's parameters and
buffers (under their state-dict names) and executes the graph's primitive ops through a target's op
table.

    m = dsl.compile(g, target="reference")          # float32 ground truth
    logits = m(input_ids)                             # [B, T] int64 -> [B, T, vocab]
    m.routing_stats                                   # {layer: tokens per expert} of the last forward
    print(m.ir("canonical"))

Targets share parameter names and shapes, so ``load_state_dict`` moves weights between them.
"""
from __future__ import annotations

import math
import numbers
import os
import sys
import warnings
import weakref
from typing import Callable, NamedTuple

import sympy
import torch
from torch import nn

import backends.cuda_device
from backends import interpret_setting, interpreting
from backends.cuda_device import on_tensor_device
from backends.mxfp4 import MXFP4Experts
from dsl.errors import MtcError, MtcWarning
from dsl.ir import Graph, Node
from dsl.printer import print_graph

_MODULE_CALL_FILE = os.path.join("torch", "nn", "modules", "module.py")
_GUARD_FILE = backends.cuda_device.__file__


def _caller_stacklevel() -> int:
    """The warnings.warn stacklevel, for a warning raised in this file, of the first frame outside this file,
    torch.nn.Module's call machinery and the device guard of run: the user's line that called the model."""
    f, level = sys._getframe(1), 1
    while f is not None and (f.f_code.co_filename in (__file__, _GUARD_FILE)
                             or f.f_code.co_filename.endswith(_MODULE_CALL_FILE)):
        f, level = f.f_back, level + 1
    return level


#: the dtypes a model computes in (its kernels take these; float64 is not offered)
MODEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TORCH_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "f64": torch.float64,
                "i64": torch.int64, "i32": torch.int32}


# ---------------------------------------------------------------------------------------------
#: the targets (backends/registry.py CHAINS: where each target's ops fall back to)
from backends.registry import CHAINS as TARGETS  # noqa: E402


def _records_grad(*xs) -> bool:
    """True while autograd records and one of xs needs a gradient."""
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in xs)


class _Call:
    """What an implementation sees of the launch it runs: the node's attributes (``attr``), its input types,
    the fused launch's member nodes, and concrete shapes of symbolic dims at the running forward's sizes."""

    __slots__ = ("node", "members", "in_types", "module", "attrs")

    def __init__(self, node: Node, members: list[Node], in_types, module: "CompiledModule", derive=None):
        self.node, self.members, self.in_types, self.module = node, members, in_types, module
        # a fused launch's own attributes (Impl.derive) beside its anchor's
        self.attrs = node.attr_dict if derive is None else {**node.attr_dict, **derive(node, members)}

    def attr(self, key: str, default=None):
        return self.attrs.get(key, default)

    @property
    def loc(self):
        return self.node.loc

    def shape(self, dims) -> list[int]:
        return self.module._shape(dims, self.module._bind)


class Traced(NamedTuple):
    """One launch the runtime made (``m.tracing()``): its index in the program, the implementation name the listing
    prints, what ran (the registered Impl, or the generated jit function), the node that triggered it, its input
    and output buffers, and (tracing(values=True)) the operand and output tensors."""

    index: int
    kernel: str
    impl: object
    node: Node
    inputs: list
    outputs: list
    args: list | None
    outs: tuple | None


class RunStats:
    """What the last forward did (``m.last_run``): ``peak_bytes``, the most bytes of activations (graph inputs and
    op outputs, views not counted twice, weights not at all) alive at once; ``buffer_bytes``, bytes of new storage
    each buffer allocated (0 for a view or an output that reuses an input's storage); ``launches``, the number of
    launches run; ``inplace``, the number of outputs written in place of an input (the program's
    ``inplace_count()``, less any an implementation declined); ``bind``, the sizes of the shape symbols;
    ``training``, whether it ran the training program."""

    __slots__ = ("peak_bytes", "buffer_bytes", "launches", "inplace", "bind", "training")

    def __init__(self, bind, training):
        self.peak_bytes, self.buffer_bytes, self.launches, self.bind, self.training = 0, {}, 0, bind, training
        self.inplace = 0

    def __repr__(self) -> str:
        return (f"RunStats(peak_bytes={self.peak_bytes:,}, launches={self.launches}, inplace={self.inplace}, "
                f"bind={ {str(k): v for k, v in self.bind.items()} }, training={self.training})")


class _Live:
    """Bytes of activation storage referenced by the running forward's buffers (storages by address, with the
    number of buffers referencing each); the caller leaves out views of weights."""

    __slots__ = ("refs", "live", "peak", "off")

    def __init__(self, off: bool = False):
        self.refs: dict[int, list] = {}
        self.live = self.peak = 0
        self.off = off

    @staticmethod
    def _key(t) -> tuple[int, int]:
        """(address, bytes) of the storage a tensor lives in: its own, or for a view its base's."""
        b = t._base if t._base is not None else t
        if b.storage_offset() == 0:             # (the common case, without a storage object per call)
            return b.data_ptr(), b.nbytes
        st = b.untyped_storage()
        return st.data_ptr(), st.nbytes()

    def add(self, t) -> int:
        """Count a buffer's tensor; returns the bytes of new storage it brought."""
        if self.off or not isinstance(t, torch.Tensor) or t.is_meta:
            return 0
        ptr, nb = self._key(t)
        if ptr == 0:
            return 0
        hit = self.refs.get(ptr)
        if hit is not None:
            hit[1] += 1
            return 0
        self.refs[ptr] = [nb, 1]
        self.live += nb
        self.peak = max(self.peak, self.live)
        return nb

    def drop(self, t) -> None:
        if self.off or not isinstance(t, torch.Tensor) or t.is_meta:
            return
        ptr = self._key(t)[0]
        hit = self.refs.get(ptr)
        if hit is not None:
            hit[1] -= 1
            if hit[1] == 0:
                self.live -= hit[0]
                del self.refs[ptr]


# ---------------------------------------------------------------------------------------------
def _init_(t: torch.Tensor, init: str, std: float | None, gen: torch.Generator | None = None) -> None:
    """Initialise one tensor in place by its IR ``init`` kind."""
    with torch.no_grad():
        if init in ("normal", "expert"):
            t.normal_(0.0, std if std is not None else 0.02, generator=gen)
        elif init == "ones":
            t.fill_(1.0)
        elif init == "zeros":
            t.zero_()
        elif init == "conv":                       # depthwise conv: fan_in = kernel width
            bound = 1.0 / math.sqrt(t.shape[-1])
            t.uniform_(-bound, bound, generator=gen)
        elif init == "a_log":                      # A in [1, 16] (Mamba-2 / KDA convention)
            t.uniform_(1.0, 16.0, generator=gen).log_()
        elif init == "dt_bias":                    # softplus^-1 of dt in [1e-3, 1e-1], log-uniform
            dt = torch.exp(torch.empty_like(t).uniform_(math.log(1e-3), math.log(1e-1), generator=gen))
            t.copy_(dt + torch.log(-torch.expm1(-dt)))
        elif init == "dt_bias_sigmoid":            # logit of a fraction f of the gate's bound, log-uniform [2e-4, 0.2]
            f = torch.exp(torch.empty_like(t).uniform_(math.log(2e-4), math.log(0.2), generator=gen))
            t.copy_(torch.log(f) - torch.log1p(-f))
        else:
            raise MtcError(f"unknown initialiser '{init}'")


def _check_free(owner: nn.Module, part: str, key: str, loc) -> None:
    """MtcError at ``loc`` when torch would refuse ``part`` (of the weight name ``key``) as a submodule, parameter
    or buffer of ``owner``: an attribute of its class (forward, to, state_dict, dtype, ...) or of the instance
    (training, graph, ...) that is none of those."""
    if part in owner._modules or part in owner._parameters or part in owner._buffers:
        return
    if hasattr(type(owner), part) or part in owner.__dict__:
        raise MtcError(f"weight name '{key}': '{part}' is an attribute of {type(owner).__name__} (torch.nn.Module's "
                       f"namespace), so it cannot name a submodule or a weight there; rename it (e.g. "
                       f"name=\"{part}_\" or a prefix= without it)", loc)


def _container(root: nn.Module, path: list[str], key: str = "", loc=None) -> nn.Module:
    """The submodule of ``root`` at ``path`` (made as plain nn.Module containers where missing); _check_free on
    each part of the weight name ``key`` on the way."""
    m = root
    for p in path:
        _check_free(m, p, key, loc)
        if p not in m._modules:
            m.add_module(p, nn.Module())
        m = m._modules[p]
    return m


#: balance_defer: warn when this many train-mode forwards kept router scores without apply_balance()
DEFER_WARN_FORWARDS = 64
#: activation checkpointing: the router biases of up to this many train-mode forwards that a backward may still
#: recompute are kept (micro-batches summed into one backward; apply_balance() before the backward). Forwards already
#: recomputed, or whose input tensors are gone, are dropped first; past the limit the oldest is dropped, and its
#: recomputation raises an MtcError instead of routing with another bias.
BIAS_KEEP_FORWARDS = 1024


class _KeptBias:
    """A router bias kept for the activation-checkpoint recomputation of one train-mode forward: the bias, weak
    references to the forward's input tensors, whether a backward has recomputed the forward, and whether another
    forward over the same inputs routed with another bias before that (then the recomputation cannot tell which
    bias is its own)."""
    __slots__ = ("bias", "refs", "recomputed", "ambiguous")

    def __init__(self, bias: torch.Tensor, refs: tuple):
        self.bias, self.refs, self.recomputed, self.ambiguous = bias, refs, False, False

    def pending(self) -> bool:
        """Its forward may still be recomputed: not yet by a backward, and its input tensors are alive."""
        return not self.recomputed and all(r() is not None for r in self.refs)


class TokenIdError(MtcError, IndexError):
    """A token id outside the vocabulary of the embedding it feeds (an MtcError, and an IndexError as torch's
    own indexing would raise)."""


def _forward_key(inputs: dict) -> tuple:
    """Which forward a (re)computation is: its input tensors by storage, shape and version (a checkpoint's
    recomputation gets the same tensors back; tensors alive at the same time never share a storage address)."""
    return tuple(sorted((k, v.data_ptr(), tuple(v.shape), tuple(v.stride()), v._version)
                        for k, v in inputs.items() if isinstance(v, torch.Tensor)))


def _in_backward() -> bool:
    """True while the autograd engine runs a backward on this thread (an activation-checkpoint recomputation of
    the forward happens there)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def _fill_balance_updates(module, state_dict, prefix, *_):
    """load_state_dict pre-hook: a state dict without balance_updates (saved before it existed, or a plain
    weights file) keeps the module's counts instead of failing as a missing key."""
    state_dict.setdefault(prefix + "balance_updates", module.balance_updates.detach().clone())


def _sync_updates_hook(module, _keys):
    """load_state_dict post-hook: the Python-side QB counts follow the loaded balance_updates buffer."""
    module._sync_updates()


#: the CompiledModule attributes that set the router-bias balancing (see its docstring)
_BALANCE_FIELDS = ("balance", "balance_warmup", "balance_ema", "balance_defer", "fixed_step")


def _check_stats_hooks(hooks) -> None:
    """CompiledModule.stats_hooks: a list of callables fn(layer: str, load: Tensor); TypeError naming the entry
    (checked when assigned, and before each forward of a model with routers: list.append is not checked)."""
    if not isinstance(hooks, list):
        raise TypeError(f"CompiledModule.stats_hooks must be a list of callables fn(layer, load) (append to it, or "
                        f"clear() it), got {type(hooks).__name__}")
    for i, h in enumerate(hooks):
        if not callable(h):
            raise TypeError(f"CompiledModule.stats_hooks[{i}] is {type(h).__name__} {h!r:.60}, not a callable "
                            f"fn(layer, load)")


def _check_balance_field(name, value) -> None:
    """ValueError naming the CompiledModule attribute `name` when value is out of its domain."""
    if name == "balance" and value not in ("qb", "fixed", None):
        raise ValueError(f"CompiledModule.balance must be 'qb', 'fixed' or None, got {value!r}")
    if name == "balance_warmup" and (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0):
        raise ValueError(f"CompiledModule.balance_warmup must be an integer >= 0 (the QB updates of each router "
                         f"made with ema 0 before balance_ema applies), got {value!r}")
    if name == "balance_ema" and (isinstance(value, bool) or not isinstance(value, numbers.Real)
                                  or not 0.0 <= value < 1.0):
        raise ValueError(f"CompiledModule.balance_ema must be a number in [0, 1) (QB's moving average of the "
                         f"bias estimate), got {value!r}")
    if name == "balance_defer" and not isinstance(value, bool):
        raise ValueError(f"CompiledModule.balance_defer must be True or False, got {value!r}")
    if name == "fixed_step" and (isinstance(value, bool) or not isinstance(value, numbers.Real)
                                 or not math.isfinite(value) or value <= 0):
        raise ValueError(f"CompiledModule.fixed_step must be a finite number > 0 (the bias step of the fixed-step "
                         f"rule, DeepSeek-V3's u = 1e-3), got {value!r}")
    if name == "dp_group" and isinstance(value, (numbers.Number, str, bytes)):  # (bool is a Number)
        raise ValueError(f"CompiledModule.dp_group must be a torch.distributed process group or None, "
                         f"got {value!r}")


class CompiledModule(nn.Module):
    """A compiled graph. ``forward(input_ids [B, T] int64) -> logits [B, T, vocab]``.

    ``torch.save(m)`` / ``torch.load(..., weights_only=False)`` keep the whole module (graph, IR stages,
    weights, balancing state; the op table and target="triton"'s generated kernels are rebuilt on load).
    Raises MtcError for a module with ``dp_group`` set (a process group does not travel) or with a stats hook
    that cannot be pickled; ``m.state_dict()`` with ``dsl.compile`` is the portable way to keep weights.

    Attributes:
        graph: the executed (canonical) graph; stages: every IR stage by name.
        routing_stats: {MoE layer prefix: int64 [E] tokens per expert} from the last forward.
        balance: "qb" (Quantile Balancing, default), "fixed" (DeepSeek-V3 step rule) or None: how the
            router bias buffers are updated after each forward in training mode (computed on batch t,
            applied to batch t+1; ValueError at the forward for another value). balance_ema / balance_warmup:
            QB's ema after the first balance_warmup updates of each router (ema 0 before); the counts are the
            buffer balance_updates, so a state dict resumes the schedule. An activation-checkpoint
            recomputation (inside the backward) routes with the bias of the original forward and updates
            nothing. balance_defer: keep each train-mode forward's router scores instead of updating;
            apply_balance() then updates once from all of them (gradient accumulation). fixed_step: the fixed
            rule's step (a finite number > 0; ValueError at the forward otherwise). stats_hooks: callables
            fn(layer, load [E] int64), called for every router (in graph order) once the forward has run, so
            that a hook that raises leaves no half-updated forward.
            dp_group: torch.distributed group over which QB averages its step.
    """

    def __init__(self, graph: Graph, stages: dict[str, Graph], target: str, dtype: torch.dtype,
                 device: torch.device | str, seed: int | None = None, packed_experts: bool = True):
        super().__init__()
        self.graph = graph
        self.stages = stages
        self.target = target
        self.dtype = dtype
        self._dtype_key: str | None = None
        self._names: dict[str, str] = {}           # node name -> state-dict key
        self.routing_stats: dict[str, torch.Tensor] = {}
        self._shape_cache: dict = {}
        self._bind: dict = {}                      # the running forward's shape sizes
        self._bind_key: tuple = ()
        self._slots: dict = {}                     # weight node -> (submodule, attribute)
        # the programs it executes (passes/lower.py): without autograd (fused kernels, buffers freed at their last
        # use) and while autograd records (every op with a backward); set by compile_graph
        self.program = None
        self.train_program = None
        self.kernel_source_path = None
        self._generated = None                     # the imported module of the generated kernels (target triton)
        self._generated_key = ""                   # its key for the mtc::generated custom op
        self._traced: dict = {}                    # training -> the program's steps under torch.compile (traced.py)
        self._input_table = None
        self._bound: dict = {}                     # program -> [(launch, Impl or jit fn, _Call)]
        self.last_run: RunStats | None = None
        self._trace: list | None = None
        self._route_spy = None
        self._seq = None                           # the cache-aware launches of a prefill / decode (inference.py)
        self.balance: str | None = "qb"
        # QB schedule (benchmarks/results/qb_balance.md): ema 0 for the first updates (converge from the
        # initial skew), then ema 0.5 (average out one batch's quantile noise): ~1.02-1.04x the floor
        self.balance_ema = 0.5
        self.balance_warmup = 3
        self._updates: dict[str, int] = {}
        # gradient accumulation: with balance_defer the train-mode forwards keep their router scores (loads for
        # "fixed") and apply_balance() makes one update from all of them, as one big batch would
        self.balance_defer = False
        self._deferred: dict[str, list[torch.Tensor]] = {}
        self.fixed_step = 1e-3
        # data parallelism: a torch.distributed process group over which each QB step averages b_hat before
        # centring (spec/OPS.md qb_update), so every rank applies the same bias; None = this process alone
        self.dp_group = None
        self.stats_hooks: list[Callable[[str, torch.Tensor], None]] = []
        self._hook_calls: list[tuple[str, torch.Tensor]] = []
        gen = None
        if seed is not None and str(device) != "meta":
            gen = torch.Generator(device=device).manual_seed(int(seed))
        for n in graph.nodes:
            if n.op not in ("param", "buffer"):
                continue
            key = n.attr("name")
            *path, leaf = key.split(".")
            t = n.type
            if n.op == "buffer" or n.attr("pinned") or t.dtype in ("i64", "i32", "bool"):
                tdt = TORCH_DTYPES[t.dtype]           # precision-critical (A_log, dt_bias, router bias)
            else:
                tdt = dtype                           # bf16 / mxfp4 / f32 weights run in the compile dtype
            shape = [int(d) for d in t.shape]
            if t.dtype == "mxfp4" and packed_experts and n.op == "param":
                # routed experts kept packed (backends/mxfp4.py): frozen uint8 buffers, the plan's bytes
                owner = _container(self, path, key, n.loc)
                _check_free(owner, leaf, key, n.loc)
                w = MXFP4Experts(*shape, device=device)
                if str(device) != "meta":
                    d32 = torch.empty(shape, dtype=torch.float32, device=device)
                    _init_(d32, n.attr("init"), n.attr("std"), gen)
                    w.quantize_(d32)
                    del d32
                owner.add_module(leaf, w)
                self._names[n.name] = key
                continue
            data = torch.empty(shape, dtype=tdt, device=device)
            if str(device) != "meta":
                if tdt.is_floating_point and tdt != torch.float32:
                    # drawn in float32, then rounded: one seed gives one model in every compile dtype
                    d32 = torch.empty(shape, dtype=torch.float32, device=device)
                    _init_(d32, n.attr("init"), n.attr("std"), gen)
                    data.copy_(d32)
                    del d32
                else:
                    _init_(data, n.attr("init"), n.attr("std"), gen)
            owner = _container(self, path, key, n.loc)
            _check_free(owner, leaf, key, n.loc)
            if n.op == "param":
                owner.register_parameter(leaf, nn.Parameter(data))
            else:
                owner.register_buffer(leaf, data)
            self._names[n.name] = key
            if n.op == "param" and tdt is dtype and self._dtype_key is None:
                self._dtype_key = key              # a weight in the compile dtype: m.dtype follows it
        self._router_layers = {}
        self._node_types = {n.name: n.types[0].shape for n in graph.nodes if n.types}
        nodes = graph.node_map()
        for n in graph.nodes:
            if n.op == "qb_route":
                wkey = nodes[n.inputs[1].node].attr("name")
                self._router_layers[n.name] = (wkey.removesuffix(".gate.weight"), self._names[n.inputs[2].node])
        # QB updates applied per router (the ema warm-up counts them): a buffer, so that a state dict resumes the
        # schedule (the Python dict _updates mirrors it without a device sync per step); a state dict saved
        # before this buffer existed loads with the current counts
        # (a model without routers has no such buffer: its state dict holds the graph's tensors only)
        self._router_order = sorted({layer for layer, _ in self._router_layers.values()})
        if self._router_order:
            self.register_buffer("balance_updates", torch.zeros(len(self._router_order), dtype=torch.int64,
                                                                device=device))
            self.register_load_state_dict_pre_hook(_fill_balance_updates)
            self.register_load_state_dict_post_hook(_sync_updates_hook)
        # router -> {forward key: the bias that train-mode forward routed with} (up to BIAS_KEEP_FORWARDS pending),
        # for activation-checkpoint recomputation; router -> {forward key: None}: pending forwards dropped past it
        self._bias_used: dict[str, dict[tuple, _KeptBias]] = {}
        self._bias_dropped: dict[str, dict[tuple, None]] = {}

    def __getstate__(self):
        if self.dp_group is not None:
            raise MtcError(f"{self.graph.name}: a module with dp_group set cannot be pickled (a process group does "
                           f"not travel): set m.dp_group = None before torch.save(m), and again after loading")
        import pickle
        for i, hook in enumerate(self.stats_hooks):
            try:
                pickle.dumps(hook)
            except Exception as e:  # noqa: BLE001 - any pickling failure of a user callable
                raise MtcError(f"{self.graph.name}: stats_hooks[{i}] ({getattr(hook, '__qualname__', hook)!r}) "
                               f"cannot be pickled ({type(e).__name__}: {e}): remove it before torch.save(m) "
                               f"(m.stats_hooks.clear()), or save m.state_dict() instead") from None
        state = self.__dict__.copy()
        state["_bound"] = {}                   # implementations and jit functions: bound again on first use
        state["_generated"] = None             # generated kernels (imported module): regenerated on load
        state["_traced"] = {}                  # (custom ops and closures: rebuilt on load)
        state["_shape_cache"] = {}
        state["_slots"] = {}
        state["_hook_calls"] = []
        state["_bias_used"] = {}               # for recomputations inside a backward in flight: none in a saved module
        state["_bias_dropped"] = {}
        state["_trace"] = None
        state["_route_spy"] = None
        state["_seq"] = None
        state.pop("_cache_layout", None)
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self.__dict__.setdefault("_bias_dropped", {})     # (a module pickled before it existed)
        self.__dict__.setdefault("_generated_key", "")
        self.__dict__.setdefault("_input_table", None)
        self.__dict__.setdefault("_seq", None)
        self._traced = {}
        if self.program is not None and any(L.generated is not None for L in self.program.launches):
            self.load_generated()
        elif self.program is not None and not self._is_meta():
            self.prepare_tracing()

    def load_generated(self, directory=None) -> None:
        """Write (to the kernel cache, or ``directory``) and import the generated kernels of the program."""
        from backends.triton.codegen import write_and_load
        from backends.custom_ops import register_generated
        self.kernel_source_path, self._generated, kernels = write_and_load(self.program, directory)
        self._generated_key = str(self.kernel_source_path)
        register_generated(self._generated_key, self._generated, kernels)
        self._bound = {}
        self.prepare_tracing()

    def save_hf(self, directory, **options):
        """Write this model as a Hugging Face checkpoint (config.json + safetensors); see
        :func:`dsl.checkpoint.save_hf`."""
        from dsl.checkpoint import save_hf
        return save_hf(self, directory, **options)

    def _is_meta(self) -> bool:
        p0 = next(self.parameters(), None)
        return p0 is not None and p0.is_meta

    def prepare_tracing(self) -> None:
        """Prepare the programs' launches for torch.compile / torch.export (backends/traced.py; done by
        dsl.compile): each implementation's custom op defined, operands and attribute values resolved."""
        from backends import traced
        from backends.custom_ops import expert_load_op
        if self._router_layers:
            expert_load_op()                   # (defined here: the tracer cannot define an op)
        self._input_table = traced.input_table(self.graph)
        self._traced = {False: traced.build(self, self.program)}
        if self.train_program is not None:
            self._traced[True] = traced.build(self, self.train_program)

    def to(self, *args, **kwargs):
        """nn.Module.to; float64 is refused (MtcError), as at compile: the kernels take float32, float16 and
        bfloat16."""
        dtype = torch._C._nn._parse_to(*args, **kwargs)[1]
        if dtype is not None and dtype not in MODEL_DTYPES:
            raise MtcError(f"{self.graph.name}: dtype {str(dtype).removeprefix('torch.')} is not offered (float32, "
                           f"float16 or bfloat16); the module stays {str(self.dtype).removeprefix('torch.')}")
        return super().to(*args, **kwargs)

    def double(self):
        """Refused (MtcError): no float64 model (see ``to``)."""
        return self.to(torch.float64)

    def _apply(self, fn, recurse=True):
        # m.to(torch.bfloat16) / m.half() / m.float() convert the weights: keep m.dtype equal to theirs
        out = super()._apply(fn, recurse)
        if self._dtype_key is not None:
            self.dtype = self.get_parameter(self._dtype_key).dtype
        return out

    # -- IR access ----------------------------------------------------------------------------
    def ir(self, stage: str = "canonical", *, training: bool = False) -> str:
        """The printed IR of one stage ("graph", "typed", "canonical", "fused", "lowered": the program the module
        runs without autograd, or with ``training`` the one it runs while autograd records), or "tvm": the
        TVMScript of the TVM kernels the model needs in the module's dtype (as ``mtc ir --stage tvm``;
        unscheduled source)."""
        if stage == "tvm" and "canonical" in self.stages:
            from backends.tvm import model_tvmscript
            return model_tvmscript(self.stages["canonical"], dtype=str(self.dtype).removeprefix("torch."))
        if stage == "lowered" and training and self.train_program is not None:
            return self.train_program.text()
        if stage not in self.stages:
            have = list(self.stages) + (["tvm"] if "canonical" in self.stages else [])
            raise MtcError(f"no IR stage '{stage}'; stages: {', '.join(have)}")
        st = self.stages[stage]
        return st.text() if hasattr(st, "text") else print_graph(st)

    def _tensor(self, key: str) -> torch.Tensor:
        *path, leaf = key.split(".")
        m = self
        for p in path:
            m = m._modules[p]
        return getattr(m, leaf)

    def _slot(self, name: str):
        """(the submodule holding the weight of graph node ``name``, its attribute): a parameter or buffer is read
        from there at each use, so replacing or moving a weight is seen at once."""
        hit = self._slots.get(name)
        if hit is None:
            *path, leaf = self._names[name].split(".")
            m = self
            for p in path:
                m = m._modules[p]
            hit = self._slots[name] = (m, leaf)
        return hit

    # -- execution ----------------------------------------------------------------------------
    def _warn_past_max_seq_len(self, inputs: dict) -> None:
        """One MtcWarning per module when a token input is longer than the spec's max_seq_len (the context
        the model is built for: it runs, but positions past it were never trained or planned)."""
        from passes.stats import declared_max_seq_len
        limit = declared_max_seq_len(self.graph)
        if limit is None or getattr(self, "_warned_seq_len", False):
            return
        longest = max((x.shape[-1] for x in inputs.values() if isinstance(x, torch.Tensor)
                       and x.dtype in (torch.int64, torch.int32) and x.dim() >= 1), default=0)
        if longest > limit:
            self._warned_seq_len = True
            warnings.warn(MtcWarning(f"{self.graph.name}: {longest} tokens per sequence is past the spec's "
                                     f"max_seq_len = {limit} (the context it is built for); running anyway"),
                          stacklevel=_caller_stacklevel())

    def forward(self, input_ids: torch.Tensor, *more: torch.Tensor,
                progress: Callable[[int, int], None] | None = None, cu_seqlens: torch.Tensor | None = None):
        """The model on its single input (token ids [B, T] for the K3 specs); returns its output, or the tuple of
        its outputs when the graph returns several.

        ``progress(done, total)`` is called after every op (mtc run's per-op bar). A graph with several inputs
        runs through :meth:`run` instead: ``m.run(name=tensor, ...)`` returns the list of outputs (MtcError
        naming them when several are passed here). ``cu_seqlens`` (int32 / int64 [N + 1], offsets 0 ... T):
        ``input_ids`` [1, T] holds N packed sequences (documents), each with its own zero KDA / conv state and
        attending only to itself (spec/OPS.md), in training too; the logits equal each sequence run alone
        (backends/inference.py packed_forward; eager only, not under torch.compile)."""
        if cu_seqlens is not None:
            from backends.inference import packed_forward
            if more:
                raise MtcError("cu_seqlens: the model takes one input, token ids [1, T]")
            return packed_forward(self, input_ids, cu_seqlens, progress)
        if torch.compiler.is_compiling() and self._input_table is not None and len(self._input_table) == 1 \
                and not more:
            outs = self.run(**{self._input_table[0][0]: input_ids}, progress=progress)
            return outs[0] if len(outs) == 1 else tuple(outs)
        ins = self.graph.inputs()
        if len(ins) == 1 and more:
            raise MtcError(f"this graph takes one input ({ins[0].attr('name')}); got {1 + len(more)} positional "
                           f"tensors")
        if len(ins) != 1:
            names = ", ".join(f"{n.attr('name')}=..." for n in ins)
            raise MtcError(f"this graph takes {len(ins)} inputs ({', '.join(n.attr('name') for n in ins)}): call "
                           f"m.run({names}), which returns the list of outputs")
        outs = self.run(**{ins[0].attr("name"): input_ids}, progress=progress)
        return outs[0] if len(outs) == 1 else tuple(outs)

    @on_tensor_device
    def run(self, progress=None, **inputs):
        """Run the graph on named inputs (``m.run(q=..., k=...)``); returns the list of its outputs.

        Inputs are checked against the graph's declared types: rank, the sizes of numeric dimensions, one size
        per shape symbol across inputs, integer ids (int64 / int32) or float tensors as declared. Float inputs
        keep their dtype (an input may be meant to stay float32 in a bf16 model, as kda_chunk's decay g): the
        reference ops compute in float32, the Triton / TVM kernels take the dtypes their ops document (e.g.
        kda_chunk: q, k, v of one dtype). ``progress(done, total)``: see forward. The inputs' CUDA device is the
        current device during the call (Triton launches on the current device).
        Raises MtcError for a missing, unknown, empty or mis-shaped input.

        Under torch.compile / torch.export (``torch.compiler.is_compiling()``) the launches run as custom ops
        (backends/traced.py), and the host-side work of an eager forward is skipped: the input value checks (NaN /
        inf, token ids in the vocabulary), the memory check, freeing buffers at their last use, ``m.last_run``,
        ``m.tracing()`` and ``progress``."""
        if torch.compiler.is_compiling():
            from backends import traced
            training = torch.is_grad_enabled() and _records_grad(*self.parameters(), *inputs.values())
            if self._router_layers:
                self._check_balance_settings()
            outs = traced.run(self, inputs, training)
            self._call_stats_hooks()
            return outs
        g = self.graph
        p0 = next(self.parameters(), None)
        if p0 is not None and p0.is_meta:
            raise MtcError("this model was compiled on device='meta': it has shapes but no weights (for stats, "
                           "the IR and planning); compile it on 'cpu' or 'cuda' to run it")
        if p0 is not None and p0.dtype == torch.bfloat16:
            _check_interpreter_dtype(self.target, p0.dtype)
        env: dict[str, object] = {}
        bind: dict[sympy.Symbol, int] = {}
        names = [n.attr("name") for n in g.inputs()]
        extra = [k for k in inputs if k not in names]
        if extra:
            from dsl.errors import did_you_mean
            raise MtcError(f"'{extra[0]}' is not an input of this graph{did_you_mean(extra[0], names)}; its inputs: "
                           f"{', '.join(names)}")
        first_float = None          # (name, dtype) of the first float input
        for n in g.inputs():
            name = n.attr("name")
            if name not in inputs:
                raise MtcError(f"missing graph input '{name}'")
            x = inputs[name]
            t = n.type
            if not isinstance(x, torch.Tensor):
                raise MtcError(f"input '{name}' must be a torch.Tensor of rank {t.rank} ({t}), got a "
                               f"{type(x).__module__}.{type(x).__qualname__}"
                               + (" (torch.from_numpy(x) makes one)" if type(x).__module__ == "numpy" else ""))
            if x.dim() != t.rank:
                raise MtcError(f"input '{name}' must be a tensor of rank {t.rank} ({t}), got shape "
                               f"{tuple(x.shape)}")
            if p0 is not None and x.device != p0.device:
                raise MtcError(f"input '{name}' is on {x.device} but the model's weights are on {p0.device}: move "
                               f"it there (x.to({str(p0.device)!r})) or the model (m.to(...))")
            if t.dtype in ("i64", "i32") and x.dtype not in (torch.int64, torch.int32):
                raise MtcError(f"input '{name}' must be an int64 or int32 tensor ({t}), got {x.dtype}")
            if t.dtype not in ("i64", "i32", "bool") and not x.is_floating_point():
                raise MtcError(f"input '{name}' must be a float tensor ({t}), got {x.dtype}")
            if x.is_floating_point() and x.dtype not in MODEL_DTYPES:
                raise MtcError(f"input '{name}' is {str(x.dtype).removeprefix('torch.')}: the model computes in "
                               f"{str(self.dtype).removeprefix('torch.')} (float32, float16 or bfloat16 are offered); "
                               f"pass {name}.to({self.dtype})")
            if x.is_floating_point():
                if first_float is None:
                    first_float = (name, x.dtype)
                elif x.dtype != first_float[1]:
                    dt, dt0, dm = (str(v).removeprefix("torch.") for v in (x.dtype, first_float[1], self.dtype))
                    raise MtcError(f"input '{name}' is {dt} but input '{first_float[0]}' is {dt0}: the float inputs "
                                   f"of one call share one dtype (the model's is {dm}); pass "
                                   f"{name}.to({first_float[1]}), or all of them in {dm}")
            if x.numel() == 0:
                raise MtcError(f"input '{name}' is empty (shape {list(x.shape)}); need at least one token")
            if x.is_floating_point() and x.device.type == "cpu" and not bool(torch.isfinite(x).all()):
                # (on the CPU, where the scan costs nothing beside the model; on a GPU it would synchronise every
                # call, and NaN in gives NaN out there, as the kernels say)
                bad = [int(i) for i in torch.nonzero(~torch.isfinite(x))[0]]
                raise MtcError(f"input '{name}' holds NaN or inf (first at index {bad}: {float(x[tuple(bad)])})")
            for d, s in zip(t.shape, x.shape):
                if isinstance(d, sympy.Symbol):
                    if bind.setdefault(d, s) != s:
                        raise MtcError(f"input '{name}': dimension {d} is {s} here but {bind[d]} elsewhere")
                elif d.is_number and int(d) != s:
                    raise MtcError(f"input '{name}' has size {s} where {t} needs {d} (a fixed size: the spec "
                                   f"writes an integer, or a config field, there)")
            env[str(n.out())] = x
        self._warn_past_max_seq_len(inputs)
        self._check_token_ids(env)
        fkey = None
        self._hook_calls = []
        if self._router_layers:
            self._check_balance_settings()
            _check_stats_hooks(self.stats_hooks)        # before the forward moves any bias
            fkey = _forward_key(inputs)         # which forward this is, for a checkpoint's recomputation
        # the generated and fused kernels are forward-only: while autograd records (training) the training
        # program runs, every op on its own with an implementation that has a backward
        training = torch.is_grad_enabled() and _records_grad(*self.parameters(), *inputs.values())
        program = self.train_program if training else self.program
        # under torch.compile's tracing the memory check and the live-bytes accounting stay out of the graph
        tracing = torch.compiler.is_compiling()
        if p0 is not None and not tracing:
            from backends.memory import check_forward_fits
            check_forward_fits(program, g, bind, self.dtype, p0.device, f"{g.name}: ")
        stats = RunStats(bind, training)
        live = _Live(off=tracing)                 # (weights are never counted: views of them are marked in the plan)
        for x in env.values():
            live.add(x)
        saved_bind, saved_key, self._bind, self._bind_key = self._bind, self._bind_key, bind, tuple(bind.items())
        try:
            bound = self._bound_program(program)
            buffers = program.buffers
            n_launches = len(bound)

            def step(i):
                L, fn, call = bound[i]
                if progress is not None:
                    progress(i, n_launches)
                args = [self._arg(env, r) for r, _t in L.inputs]
                n = call.node
                recompute = False
                if L.op == "qb_route":
                    args, recompute = self._router_args(n, args, fkey)
                # outputs the program writes in place of an input whose last use this is (passes/lower.py)
                into = {j: args[i] for j, i in L.inplace.items()} if L.inplace else None
                seq = self._seq
                if seq is not None and L.anchor in seq.anchors:
                    # prefill / decode: short conv, KDA and MLA with the cache's state (backends/inference.py)
                    into = None
                    out = seq.launch(L, fn, call, args)
                else:
                    out = self._launch(L, fn, call, args, into)
                if L.op == "qb_route":
                    if self._route_spy is not None:
                        self._route_spy(n, out, args)
                    if not recompute:
                        self._after_route(n, out, fkey, inputs)
                outs = out if len(L.outputs) > 1 else (out,)
                if into is not None:
                    stats.inplace += sum(outs[j].data_ptr() == t.data_ptr() for j, t in into.items())
                for (r, _t), v in zip(L.outputs, outs):
                    env[r] = v
                    stats.buffer_bytes[r] = 0 if buffers[r].weight_view else live.add(v)
                    if seq is not None and r in seq.captures:
                        seq.capture(r, v)          # the MLA latent of this chunk, into the cache
                if self._trace is not None:
                    trace, values = self._trace
                    trace.append(Traced(L.index, L.kernel, fn, n, [r for r, _ in L.inputs], [r for r, _ in L.outputs],
                                        args if values else None, outs if values else None))
                for r in L.frees:
                    live.drop(env.pop(r))
            units = self._launch_units(program)
            if units is None:
                for i in range(n_launches):
                    step(i)
            else:
                # runs of launches inside a call of the submodules that own their weights (the parallel
                # runtime's FSDP2 units: their module hooks gather the weights; ParallelModule._launch_units)
                for start, stop, enter, ins, outs in units:
                    if enter is None:
                        for i in range(start, stop):
                            step(i)
                        continue

                    def segment(*xs, start=start, stop=stop, ins=ins, outs=outs):
                        env.update(zip(ins, xs))
                        for i in range(start, stop):
                            step(i)
                        return tuple(env[r] for r in outs)
                    env.update(zip(outs, enter(segment, *[env[r] for r in ins])))
            stats.launches = n_launches
        finally:
            self._bind, self._bind_key = saved_bind, saved_key
        stats.peak_bytes = live.peak
        self.last_run = stats
        outs = [env[str(r)] for r in g.outputs]
        self._call_stats_hooks()
        return outs

    def _router_args(self, n: Node, args: list, fkey) -> tuple[list, bool]:
        """(the router's operands, whether this is an activation-checkpoint recomputation). Activation checkpointing
        re-runs the forward inside the backward: it routes with the bias the original forward used (a balancing
        update, or apply_balance(), may have changed the buffer since; several forwards may precede one backward),
        and neither updates the bias nor counts nor calls the hooks a second time."""
        recompute = _in_backward()
        kept = self._bias_used.get(n.name, {}).get(fkey) if recompute else None
        if kept is not None:
            if kept.ambiguous:
                raise MtcError(
                    f"{self.graph.name}: activation checkpointing: the same input tensor went through two "
                    f"train-mode forwards that routed with different router biases "
                    f"({self._router_layers[n.name][0]}; the bias moves "
                    f"after each forward unless balance_defer is set) before this backward, so the "
                    f"recomputation cannot tell which bias was its own and would give wrong gradients. Pass "
                    f"each forward its own tensor (e.g. ids.clone()), or set m.balance_defer = True and call "
                    f"m.apply_balance() once per step")
            kept.recomputed = True
            args = [args[0], args[1], kept.bias]
        elif recompute and fkey in self._bias_dropped.get(n.name, ()):
            raise MtcError(
                f"{self.graph.name}: activation checkpointing: this backward recomputes a train-mode forward "
                f"whose router bias ({self._router_layers[n.name][0]}) is no longer kept: more than "
                f"{BIAS_KEEP_FORWARDS} train-mode forwards that a backward had not yet recomputed came after "
                f"it (backends.runtime.BIAS_KEEP_FORWARDS). Routing with today's bias would give wrong "
                f"gradients. Call backward at least every {BIAS_KEEP_FORWARDS} micro-batches, or raise "
                f"backends.runtime.BIAS_KEEP_FORWARDS")
        elif not recompute and self._bias_dropped.get(n.name):
            # a new forward with the key of a dropped one (a freed input's storage reused): not that one
            self._bias_dropped[n.name].pop(fkey, None)
        return args, recompute

    def _bound_program(self, program) -> list:
        """The launches of ``program`` with what runs each: the registered implementation (or the generated jit
        function) and its call context; bound once per program."""
        hit = self._bound.get(id(program))
        if hit is not None and hit[0] is program:
            return hit[1]
        from backends.registry import by_name
        nodes = self.graph.node_map()
        if any(L.generated is not None for L in program.launches) and self._generated is None:
            self.load_generated()
        out = []
        for L in program.launches:
            members = [nodes[m] for m in L.ops]
            fn = getattr(self._generated, L.generated.name) if L.generated is not None else by_name(L.kernel)
            call = _Call(nodes[L.anchor], members, [t for _r, t in L.inputs], self,
                         derive=None if L.generated is not None else fn.derive)
            out.append((L, fn, call))
        self._bound[id(program)] = (program, out)
        return out

    def _launch_units(self, program):
        """None: run ``program``'s launches one after another. A subclass may return [(start, stop, enter, ins,
        outs)] covering the launches in order: launches start..stop-1 run inside ``enter(segment, *[the buffers
        ins])`` (None: directly), where ``segment(*xs)`` takes the buffers ``ins`` as ``xs``, runs the launches and
        returns the buffers ``outs`` (those read after the run), which ``enter`` returns."""
        return None

    def _launch(self, L, fn, call, args, into=None):
        """Run one launch: a generated kernel on contiguous operands, or an implementation; an op's ValueError (NaN /
        inf operands, ...) becomes an MtcError at the op's spec line. ``into``: {output index: the operand tensor
        the output is written into} (the implementation's ``out=``, backends/registry.py)."""
        if L.generated is not None:
            from backends.custom_ops import generated_launch
            return generated_launch(L.generated, fn, args, [self._shape(t.shape, self._bind) for _r, t in L.outputs],
                                    into)
        try:
            if into:
                out = into.get(0) if len(L.outputs) == 1 else tuple(into.get(j) for j in range(len(L.outputs)))
                return fn.fn(call, *args, out=out)
            return fn.fn(call, *args)
        except ValueError as e:
            n = call.node
            raise MtcError(f"%{n.name} = {n.op}(...): {e} (raised inside the model; for NaN / inf: check the weights "
                           f"and the ops before it)", n.loc) from e

    # -- inference with caches (backends/inference.py) -----------------------------------------------------------
    def new_cache(self, batch_size: int, max_len: int):
        """The decoding state for ``batch_size`` rows of up to ``max_len`` tokens each (:class:`backends.inference.
        Cache`): per KDA layer the recurrent state [B, H, K, V] float32 and the short-conv states [B, W-1, C]; per
        MLA layer the latent cache [B, max_len, kv_lora_rank] and its rope part [B, max_len, qk_rope_dim] (model
        dtype). Block AttnRes mixes over depth at one position: it needs no cache across tokens. ``cache.nbytes``
        is what ``mtc stats`` prints per sequence (MLA latent KV cache at T = max_len, KDA + conv state) times
        batch_size. Raises MtcError for sizes that are not integers >= 1, a cache larger than the free memory, a
        module on device 'meta', or a graph without a cache form (an attention that is not an mla_layer's core)."""
        from backends.inference import new_cache
        return new_cache(self, batch_size, max_len)

    def prefill(self, input_ids: torch.Tensor, cache, *, lengths=None, chunk_tokens: int | None = None,
                logits: str = "all", progress: Callable[[int, int], None] | None = None) -> torch.Tensor:
        """Run prompts through the model into ``cache``, in chunks, and return their logits.

        ``input_ids`` int64 [B, T], right-padded when ``lengths`` (B ints: each row's tokens) is given; the tokens
        are appended after what each row of the cache holds (a first prefill, or a continuation). The inference
        program runs once per chunk of ``chunk_tokens`` tokens (all rows together; default: from the memory plan
        and the device's free memory, :func:`backends.inference.default_chunk_tokens`), carrying the KDA and
        conv states across chunks and appending to the MLA latent cache; rows never mix. Eval mode, without
        autograd: the router biases do not move. ``logits``: "all" -> [B, T, vocab] in the model's dtype (zeros
        past a row's length; equal to ``m(input_ids)`` for full rows), "last" -> [B, 1, vocab] (each row's last
        token: what a million-token prompt should ask for). ``progress(done, total)`` after each chunk.
        Raises MtcError for ids that are not int64 [B, T] in the vocabulary, a cache of another module or batch
        size, an empty prompt, a row past the cache's max_len (nothing is written then), bad lengths /
        chunk_tokens / logits."""
        from backends.inference import prefill
        return prefill(self, input_ids, cache, lengths=lengths, chunk_tokens=chunk_tokens, logits=logits,
                       progress=progress)

    def decode(self, next_ids: torch.Tensor, cache) -> torch.Tensor:
        """One token for every row: ``next_ids`` int64 [B, 1] after what ``cache`` holds -> logits [B, 1, vocab]
        (the cache advances by one per row). Raises MtcError for another module's cache or batch size, an empty
        row (prefill first), or a row already at max_len (nothing is written then)."""
        from backends.inference import decode
        return decode(self, next_ids, cache)

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 20, do_sample: bool = False,
                 temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                 eos_token_id=None, streamer=None, *, pad_token_id: int | None = None, attention_mask=None,
                 generator: torch.Generator | None = None, chunk_tokens: int | None = None,
                 timings: dict | None = None) -> torch.Tensor:
        """Autoregressive generation with Hugging Face's arguments (transformers ``GenerationMixin.generate``):
        returns int64 [B, T + n] = input_ids followed by n <= max_new_tokens new tokens per row.

        do_sample False: greedy (argmax; temperature, top_k, top_p unused); True: a draw from softmax(logits /
        temperature) after top_k then top_p filtering (``generator`` makes it reproducible). eos_token_id (an id
        or a list): a row that produced one continues with pad_token_id (default: the first eos id), and
        generation stops once every row has. attention_mask [B, T] (1 = token): each row's ones must be one run
        (left or right padding); without it every row is its full T tokens. streamer: an object with put(ids) /
        end() as transformers' streamers (put gets the prompt first, then each step's [B] new ids), or a
        callable fn(ids [B]) per step. The prompts go through :meth:`prefill` (``chunk_tokens``), then one
        :meth:`decode` per new token, on a cache of the needed length. ``timings`` (a dict) gets prefill_s,
        decode_s, prefill_tokens, decode_steps. Raises MtcError for bad arguments or an empty prompt."""
        from backends.inference import generate
        return generate(self, input_ids, max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature,
                        top_k=top_k, top_p=top_p, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                        attention_mask=attention_mask, streamer=streamer, generator=generator,
                        chunk_tokens=chunk_tokens, timings=timings)

    def parallelize(self, mesh, **options) -> "CompiledModule":
        """Run this module on a torch.distributed DeviceMesh with dims named from dp / ep / cp (in place; returns
        it): see backends.parallel.module.parallelize for the options and what each dimension does."""
        from backends.parallel.module import parallelize
        return parallelize(self, mesh, **options)

    def plan_memory(self, *, training: bool = False, **sizes) -> tuple[float, float]:
        """(peak bytes of live activations, the same with the largest launch workspace) that one forward of this
        module at the shape sizes ``sizes`` (``B=1, T=4096``) will allocate: the inference program's (or with
        ``training`` the training program's) memory plan, which ``m.last_run.peak_bytes`` measures."""
        from backends.memory import forward_bytes
        from dsl.ir import sym
        bind = {sym(k): int(v) for k, v in sizes.items()}
        return forward_bytes(self.train_program if training else self.program, self.graph, bind, self.dtype)

    def tracing(self, values: bool = False):
        """``with m.tracing() as trace:`` records every launch the runtime makes, in order, as a :class:`Traced`
        (``values``: with the launch's operand and output tensors, which the record then keeps alive: the run's own
        tensors, so a storage that a later launch writes in place (``in place of`` in the listing) holds that
        launch's output by the end; compile with ``inplace=False`` to keep every recorded value)."""
        import contextlib

        @contextlib.contextmanager
        def cm():
            prev, self._trace = self._trace, ([], values)
            try:
                yield self._trace[0]
            finally:
                self._trace = prev
        return cm()

    def _check_token_ids(self, env: dict) -> None:
        """MtcError naming the input, the first out-of-range id and its position, for token ids outside the
        vocabulary of an embedding they feed (before any op runs; on a GPU an out-of-range gather is a
        device-side assert that ends the process's CUDA context)."""
        for n in self.graph.nodes:
            if n.op != "embedding" or str(n.inputs[0]) not in env:
                continue
            ids = env[str(n.inputs[0])]
            vocab = int(self._node_types[n.inputs[1].node][0])
            lo, hi = (int(v) for v in torch.aminmax(ids))
            if lo >= 0 and hi < vocab:
                continue
            bad = torch.nonzero((ids < 0) | (ids >= vocab))[0].tolist()
            name = self.graph.node_map()[n.inputs[0].node].attr("name")
            raise TokenIdError(f"{self.graph.name}: input '{name}' holds token id {int(ids[tuple(bad)])} at index {bad}, "
                           f"outside the vocabulary [0, {vocab}) of the embedding {self._names.get(n.inputs[1].node, '')}"
                           f"; every id must be in [0, {vocab})", n.loc)

    def _call_stats_hooks(self) -> None:
        """The stats hooks, router by router, after the forward: a hook that raises leaves a whole forward behind
        (every router updated), and its error says which hook and layer it came from."""
        calls, self._hook_calls = self._hook_calls, []
        with torch.no_grad():
            for layer, load in calls:
                for i, h in enumerate(self.stats_hooks):
                    try:
                        h(layer, load)
                    except Exception as e:
                        e.add_note(f"mtc: raised by stats_hooks[{i}] ({getattr(h, '__qualname__', h)!r}) for {layer}; "
                                   f"the forward itself had completed (every router's statistics and bias updated)")
                        raise

    def _arg(self, env, ref: str):
        """A launch operand: a buffer of the running forward, else a parameter or buffer of the module."""
        v = env.get(ref)
        if v is None:
            m, leaf = self._slot(ref[1:])         # (weights are nodes of one output: no '#i')
            v = m._parameters.get(leaf)
            if v is None:
                v = m._buffers.get(leaf)
            if v is None:
                v = m._modules[leaf]              # MXFP4Experts (packed routed experts)
        return v

    def _shape(self, dims, bind) -> list[int]:
        from dsl.ir import dim
        key = (dims, self._bind_key if bind is self._bind else tuple(bind.items()))
        hit = self._shape_cache.get(key)
        if hit is not None:
            return hit
        if len(self._shape_cache) > 4096:      # (shapes of many different sizes: start over)
            self._shape_cache.clear()
        out = []
        for d in dims:
            v = dim(d).subs(bind)
            if not v.is_number:
                raise MtcError(f"cannot evaluate dimension {d} with {bind}")
            out.append(int(v))
        self._shape_cache[key] = out
        return out

    def route_margins(self, input_ids: torch.Tensor | None = None, **inputs: torch.Tensor) -> dict[str, float]:
        """How close each MoE layer's top-k choice is to a tie, for one input (a probe forward).

        ``m.route_margins(ids)``, or for a model with several inputs ``m.route_margins(a=..., b=...)`` (named as
        for :meth:`run`). Runs the input (``input_ids`` [B, T]) through the model without autograd and without QB
        bias updates (the module's mode is restored) and returns {MoE layer prefix: the smallest, over tokens,
        gap between the k-th and the (k+1)-th biased router score (sigmoid units)}.  Two targets (or dtypes) whose
        scores differ by more than a layer's margin may pick different experts for some token: a discrete
        switch, not an error; compare logits across targets on inputs whose margins exceed that rounding
        (float32: ~1e-7; bf16: ~1e-2).  A layer whose top-k takes every expert (top_k == experts) has no
        (k+1)-th score and no choice to flip: its margin is inf.
        """
        ins = self.graph.inputs()
        if (input_ids is None) == (not inputs) or (input_ids is not None and len(ins) != 1):
            named = f"m.route_margins({', '.join(n.attr('name') + '=...' for n in ins)})"
            raise MtcError(f"{self.graph.name}: " + (f"route_margins takes the input tensor, m.route_margins(ids), or "
                                                      f"it by name, {named}" if len(ins) == 1 else
                                                      f"this graph takes {len(ins)} inputs: pass them by name, "
                                                      f"{named}"))
        margins: dict[str, float] = {}

        def spy(n, out, args):
            biased = out[2] + args[2].float()
            k = n.attr("top_k")
            if k >= biased.shape[-1] or biased.numel() == 0:
                gap = math.inf                      # every expert is chosen (or no token): nothing can flip
            else:
                top = biased.topk(k + 1, dim=-1).values
                gap = float((top[..., -2] - top[..., -1]).min())
            layer = self._router_layers[n.name][0]
            margins[layer] = min(gap, margins.get(layer, gap))

        training, self._route_spy = self.training, spy
        hooks, stats = self.stats_hooks, dict(self.routing_stats)
        self.stats_hooks = []                   # a probe: no hook call, and routing_stats stays the last forward's
        self.eval()
        try:
            with torch.no_grad():
                if input_ids is not None:
                    self(input_ids)
                else:
                    self.run(**inputs)
        finally:
            self._route_spy = None
            self.train(training)
            self.stats_hooks, self.routing_stats = hooks, stats
        return margins

    def apply_balance(self) -> int:
        """With ``balance_defer`` (gradient accumulation): one balancing update per router from every train-mode
        forward since the last call, as if their batches were one (QB on the concatenated router scores; the
        fixed rule on the summed loads); clears them. Returns the number of routers updated (0: nothing kept).
        Call it once per optimizer step."""
        from backends.reference import fixed_step_update
        nodes = self.graph.node_map()
        done = 0
        with torch.no_grad():
            for name, kept in self._deferred.items():
                layer, bias_key = self._router_layers[name]
                bias = self._tensor(bias_key)
                if (self.balance == "qb") != kept[0].is_floating_point() or self.balance is None:
                    raise ValueError(f"apply_balance: the balance mode changed to {self.balance!r} after the "
                                     f"deferred forwards of {layer}; set it back, or drop them with "
                                     f"discard_balance()")
                if self.balance == "fixed":
                    bias.copy_(fixed_step_update(bias, torch.stack(kept).sum(0), step=self.fixed_step))
                else:
                    self._qb_step(layer, bias, torch.cat(kept), nodes[name].attr("top_k"))
                done += 1
        self._deferred = {}
        return done

    def discard_balance(self) -> int:
        """Drop what ``balance_defer`` kept since the last apply_balance (router scores or loads), with no bias
        update. Returns the number of routers that had some kept."""
        n = sum(1 for kept in self._deferred.values() if kept)
        self._deferred = {}
        return n

    def _sync_updates(self) -> None:
        """_updates from the balance_updates buffer (after load_state_dict); router scores kept by balance_defer
        and the biases kept for checkpoint recomputation belong to the replaced state: dropped."""
        counts = self.balance_updates.tolist() if self.balance_updates.device.type != "meta" else []
        self._updates = {layer: int(c) for layer, c in zip(self._router_order, counts) if c}
        self._deferred = {}
        self._bias_used = {}
        self._bias_dropped = {}

    def _qb_step(self, layer: str, bias: torch.Tensor, scores: torch.Tensor, top_k: int) -> None:
        """One QB update of a router's bias in place (ema 0 during the warm-up), counted."""
        from backends.reference import qb_update
        step = self._updates.get(layer, 0)
        ema = 0.0 if step < self.balance_warmup else self.balance_ema
        bias.copy_(qb_update(scores, bias, top_k=top_k, ema=ema, dp_group=self.dp_group))
        self._updates[layer] = step + 1
        self.balance_updates[self._router_order.index(layer)] += 1

    def _check_balance_settings(self) -> None:
        """ValueError for a balance setting out of its domain (checked when set, and at every forward of a model
        with routers)."""
        for name in _BALANCE_FIELDS:
            _check_balance_field(name, getattr(self, name))

    def __setattr__(self, name, value):
        if name in _BALANCE_FIELDS or name == "dp_group":
            if "dp_group" in self.__dict__:  # set after __init__: checked now, at the user's line
                _check_balance_field(name, value)
        elif name == "stats_hooks":
            _check_stats_hooks(value)
        super().__setattr__(name, value)

    def _traced_route(self, n: Node, out, args, inputs: dict) -> None:
        """A router's bookkeeping under the tracer (backends/traced.py): ``routing_stats`` and the stats hooks' loads
        by the custom op mtc::expert_load; a train-mode forward's bias update (balancing) outside the graph. Under
        torch.export none (the exported program is the forward alone)."""
        if torch.compiler.is_exporting():
            return                             # (an exported program keeps no module state)
        if self.training and self.balance is not None:
            self._route_update_eager(n, tuple(out), inputs)
            return
        from backends.custom_ops import expert_load_op
        layer, bias_key = self._router_layers[n.name]
        load = expert_load_op()(out[0], int(self._node_types[n.inputs[2].node][0]))
        self.routing_stats[layer] = load
        self._hook_calls.append((layer, load))

    @torch.compiler.disable
    def _route_update_eager(self, n: Node, out, inputs: dict) -> None:
        """_after_route of a train-mode forward under torch.compile, run eagerly (a graph break): the QB update
        reads the scores on the host."""
        self._after_route(n, out, _forward_key(inputs), inputs)

    def _after_route(self, n: Node, out, fkey: tuple, inputs: dict) -> None:
        from backends.reference import expert_load, fixed_step_update
        idx, _w, scores = out
        layer, bias_key = self._router_layers[n.name]
        bias = self._tensor(bias_key)
        with torch.no_grad():
            load = expert_load(idx, bias.shape[0])
            self.routing_stats[layer] = load
            self._hook_calls.append((layer, load))            # called once the whole forward has run
            balancing = self.training and self.balance is not None
            if balancing:
                kept_bias = self._bias_used.setdefault(n.name, {})
                prev = kept_bias.pop(fkey, None)
                entry = _KeptBias(bias.detach().clone(),       # what this forward routed with
                                  tuple(weakref.ref(v) for v in inputs.values() if isinstance(v, torch.Tensor)))
                # an earlier forward over the same input tensors, not yet recomputed, routed with another bias:
                # a recomputation of either could not tell its bias (micro-batches summed into one loss that pass
                # the same tensor twice)
                entry.ambiguous = prev is not None and prev.pending() and (
                    prev.ambiguous or not torch.equal(prev.bias, entry.bias))
                kept_bias[fkey] = entry
                if len(kept_bias) > BIAS_KEEP_FORWARDS:
                    for key in [key for key, e in kept_bias.items() if not e.pending()]:
                        del kept_bias[key]                     # recomputed already, or its inputs are gone
                    dropped = self._bias_dropped.setdefault(n.name, {})
                    while len(kept_bias) > BIAS_KEEP_FORWARDS:
                        oldest = next(iter(kept_bias))                  # the oldest pending one
                        del kept_bias[oldest]
                        dropped[oldest] = None
                    dropped.pop(fkey, None)
                    while len(dropped) > 4 * BIAS_KEEP_FORWARDS:
                        dropped.pop(next(iter(dropped)))
            if balancing and not self.balance_defer and self._deferred.get(n.name):
                warnings.warn(MtcWarning(
                    f"balance_defer is off but {len(self._deferred[n.name])} earlier forward(s) kept their router "
                    f"scores for {layer} without apply_balance(): dropped (this forward balances at once)"),
                    stacklevel=2)
                self._deferred.pop(n.name)
            if not balancing or self.balance_defer:
                if balancing:
                    kept = self._deferred.setdefault(n.name, [])
                    kept.append(scores.detach() if self.balance == "qb" else load)
                    if len(kept) == DEFER_WARN_FORWARDS:
                        warnings.warn(MtcWarning(
                            f"balance_defer: {DEFER_WARN_FORWARDS} train-mode forwards have kept their router scores "
                            f"for {layer} without apply_balance(); call m.apply_balance() once per optimizer step "
                            f"(the kept scores grow memory until then)"), stacklevel=2)
                return
            if self.balance == "qb":
                self._qb_step(layer, bias, scores, n.attr("top_k"))
            else:
                bias.copy_(fixed_step_update(bias, load, step=self.fixed_step))


def _check_kernel_constraints(g: Graph, target: str) -> None:
    """Shapes the Triton templates cannot take are errors at compile time, at the user's spec line (kda_chunk:
    K, V <= 256; sizes that are not powers of two >= 16 run zero-padded); a gate bound below the dense tiles'
    limit is a warning there (kda_chunk then takes its safe path)."""
    from backends.triton.impls import fast_bound
    from backends.triton.kda import FAST_LOWER_BOUND_LIMIT
    for n in g.nodes:
        if n.op == "kda_chunk":
            lb = n.attr("lower_bound")
            if lb is not None and fast_bound(lb) is None:
                warnings.warn(MtcWarning(
                    f"target '{target}': lower_bound = {lb} is below {FAST_LOWER_BOUND_LIMIT}, the limit of the "
                    f"Triton kda_chunk's dense diagonal tiles (their factors reach e^(8 |bound|), float32 ends at "
                    f"e^88): this layer runs the kernel's safe path (slower, same result)", n.loc), stacklevel=2)
            K = int(g.type_of(n.inputs[0]).shape[3])      # q [B, T, H, K]
            V = int(n.types[0].shape[3])                  # o [B, T, H, V]
            for name, d in (("head_dim (K)", K), ("value head_dim (V)", V)):
                if d > 256:
                    raise MtcError(f"target '{target}': the Triton kda_chunk kernel takes {name} up to 256, got "
                                   f"{d}; change the spec or use target='reference'", n.loc)


def check_weights_fit(graph: Graph, element_bytes: int, device: torch.device, advice: str | Callable[[], str],
                      where: str = "", dtype_name: str | None = None, packed_mxfp4: bool = False) -> None:
    """MtcError, before anything is allocated, when the graph's weights at element_bytes each take more than 80%
    of the device's memory: the whole GPU's for 'cuda', the available physical memory (os.sysconf) for 'cpu'
    (nothing is checked where that is unknown, or on 'meta'). ``packed_mxfp4``: the weights typed mxfp4 (routed
    experts, ``expert_dtype="mxfp4"``) are held packed and count their packed bytes (dsl.ir.DTYPES["mxfp4"] =
    0.53125 per element: 4 bits and one E8M0 scale per 32), as the memory plan does; else they are decoded to the
    compute dtype and count element_bytes like the others. The message names the parameter count and sizes, then
    `advice` (what to do instead; a callable is only called for the message); `where` prefixes it, `dtype_name`
    (if given) follows the weight size."""
    have = None
    if device.type == "cuda":
        have = torch.cuda.get_device_properties(device).total_memory
    elif device.type == "cpu":
        try:
            have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            have = None
    if have is None:
        return
    from dsl.ir import DTYPES
    n = need = 0
    for p in graph.params():
        k = int(p.type.numel())
        n += k
        need += k * (DTYPES["mxfp4"] if packed_mxfp4 and p.type.dtype == "mxfp4" else element_bytes)
    if need > 0.8 * have:
        from passes.stats import human_bytes
        raise MtcError(f"{where}model '{graph.name}' has {n:,} parameters: {human_bytes(need)} of weights"
                       + (f" in {dtype_name}" if dtype_name else "")
                       + f", more than this {'GPU' if device.type == 'cuda' else 'machine'} holds "
                         f"({human_bytes(have)} free); {advice() if callable(advice) else advice}")


def _check_interpreter_dtype(target: str, dtype: torch.dtype) -> None:
    """MtcError for bfloat16 on the Triton interpreter: triton 3.6's interpreter computes bf16 tl.dot wrongly
    (silent garbage in kda_chunk, qb_route, moe_experts), so a model would run but print nonsense."""
    if target in ("triton", "tvm") and dtype == torch.bfloat16 and interpreting():
        raise MtcError(f"target '{target}' in bfloat16 under the Triton interpreter (TRITON_INTERPRET=1, the CPU): "
                       f"the interpreter computes bfloat16 tl.dot wrongly; use float32 or float16 on the CPU "
                       f"(bfloat16 on a GPU), or target='reference'")


def compile_graph(graph: Graph, target: str = "reference", *, dtype: torch.dtype | str | None = None,
                  device: torch.device | str = "cpu", seed: int | None = 0, passes="default",
                  print_after=(), dump_ir=None, emit_dir=None, inplace: bool = True, mesh=None,
                  packed_experts: bool = True) -> CompiledModule:
    """Run the pass pipeline and build a runnable module.

    Args:
        graph: a graph from dsl.load / dsl.parse / the builder (any stage up to 'graph').
        target: "reference" (plain float32 PyTorch), "triton" (Triton kernels; the CPU interpreter needs
            TRITON_INTERPRET=1) or "tvm" (TVM kernels for the memory-bound ops, Triton for the rest).
        dtype: parameter/activation dtype (default float32 for every target; the spec's ``dtype`` field is
            not applied: pass dtype="bf16" / torch.bfloat16 for a bf16 model on the GPU).
        device: "cpu", "cuda", or "meta" to build the full model without allocating weights.
        seed: parameter initialisation seed (None: torch's global RNG).
        passes / print_after / dump_ir: see passes.PassManager.
        emit_dir: (triton) write the generated kernels there instead of the cache directory.
        inplace: let the program that runs without autograd write an output into the storage of an input whose
            last use that launch is, where the implementation can and it is safe (passes/lower.py; the results are
            the same bits); False: every output gets its own storage.
        mesh: a torch.distributed DeviceMesh (dims named from dp, ep, cp): the module is parallelized on it
            (``m.parallelize(mesh)``; every rank compiles with the same seed).
        packed_experts: routed experts the spec types ``expert_dtype="mxfp4"`` are held packed (True, default): per
            expert weight an :class:`backends.mxfp4.MXFP4Experts` with uint8 buffers ``weight_packed`` /
            ``weight_scale`` (state-dict keys ``<key>.weight_packed`` / ``<key>.weight_scale``), the memory plan's
            0.53125 bytes per element, decoded by the moe_experts kernels as they run; they are frozen (no
            gradient; the activations' gradients flow). Random initialisation draws the float weights and rounds
            them to MXFP4. False: they are dense weights in ``dtype`` (trainable), as other expert dtypes.
    Raises:
        MtcError: an unknown target or device, a dtype other than float32 / float16 / bfloat16 (float64
            too: the reference ops compute in float32), bfloat16 under the Triton interpreter, a seed that is not an
            integer in [0, 2**63), an inplace that is not a bool, target "tvm" without TVM installed, or a graph that
            fails verification.
    """
    from passes import PassManager, pipeline
    if not isinstance(target, str):
        raise MtcError(f"target must be a string, one of {', '.join(TARGETS)}; got {type(target).__name__}")
    if target not in TARGETS:
        from dsl.errors import did_you_mean
        raise MtcError(f"unknown target '{target}'{did_you_mean(target, TARGETS)}; targets: {', '.join(TARGETS)}")
    if dtype is None:
        dtype = torch.float32
    if isinstance(dtype, str):
        from dsl.ir import canon_dtype
        try:
            dtype = TORCH_DTYPES[canon_dtype(dtype)]
        except (MtcError, KeyError):
            raise MtcError(f"dtype '{dtype}': not a model dtype; a model computes in f32, bf16 or f16 (float32, bfloat16, "
                           f"float16)") from None
    if dtype == torch.float64:
        raise MtcError("dtype float64: not offered; the reference ops compute in float32 (a float64 model would "
                       "round every op to float32 and back, which is no float64 check); use float32")
    if dtype not in MODEL_DTYPES:
        raise MtcError(f"dtype {dtype!r}: a model computes in float32, bfloat16 or float16")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed < 2 ** 63):
        raise MtcError(f"seed {seed!r}: an integer in [0, 2**63) (or None: torch's global RNG)")
    if not isinstance(inplace, bool):
        raise MtcError(f"inplace must be True or False, got {inplace!r}")
    if not isinstance(packed_experts, bool):
        raise MtcError(f"packed_experts must be True or False, got {packed_experts!r}")
    if passes == "default":
        passes = pipeline(target)
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise MtcError(f"unknown device {device!r}: use 'cpu', 'cuda', 'cuda:N' or 'meta'") from None
    if dev.type not in ("cpu", "cuda", "meta"):
        raise MtcError(f"device {device!r}: mtc runs on 'cpu', 'cuda' (or 'cuda:N') and 'meta' (no weights)")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise MtcError(f"device {device!r}: this torch has no CUDA device (torch.cuda.is_available() is False)")
    now = interpret_setting()
    if target in ("triton", "tvm") and dev.type == "cpu" and now != "1":
        raise MtcError(f"target '{target}' on the CPU runs its Triton kernels under the interpreter: set "
                       f"TRITON_INTERPRET=1 before triton is imported ("
                       + ("mtc run sets it when it is unset" if now is None else
                          f"it is set to {now!r} in the environment, which mtc run keeps: unset it or set it to 1")
                       + ")")
    if target in ("triton", "tvm") and dev.type == "cpu":
        from backends.interpreter_versions import check_interpreter_versions
        check_interpreter_versions()          # triton 3.6 with numpy >= 2.4: one line, not a kernel traceback
    if dev.type != "meta":
        _check_interpreter_dtype(target, dtype)
        check_weights_fit(graph, torch.empty((), dtype=dtype).element_size(), dev,
                          "device='meta' builds it without weights (its IR, shapes and kernels), or compile a "
                          "smaller variant", where="dsl.compile: ", dtype_name=str(dtype).removeprefix("torch."),
                          packed_mxfp4=packed_experts)
    if target == "tvm":
        from backends.tvm import available
        if not available():
            raise MtcError("target 'tvm' needs Apache TVM 0.27 (the 'tvm' package): pip install -e \".[tvm]\" "
                           "(or target='triton' / 'reference')")
    pm = PassManager(passes, print_after=print_after, dump_dir=dump_ir)
    g = pm.run(graph)
    if target in ("triton", "tvm"):
        _check_kernel_constraints(g, target)
    m = CompiledModule(g, dict(pm.stages), target, dtype, device, seed, packed_experts=packed_experts)
    m.pass_timings = pm.timings
    from passes.lower import lower
    m.program = lower(g, target, inplace=inplace)
    m.train_program = lower(g, target, training=True)
    m.stages["lowered"] = m.program
    if str(device) != "meta" and any(L.generated is not None for L in m.program.launches):
        m.load_generated(emit_dir)
    elif str(device) != "meta":
        m.prepare_tracing()
    if mesh is not None:
        m = m.parallelize(mesh)
    return m
