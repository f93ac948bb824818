"""Parse the printed graph IR back into a :class:`~dsl.ir.Graph`, checked as it is read: unknown ops and
attributes, undefined values, wrong input counts and types are errors at the IR text's own line:col (not at
the ``@"file":line:col`` source location a node carries from its spec)."""
from __future__ import annotations

import json
from functools import lru_cache

import lark

from .errors import Loc, MtcError, did_you_mean
from .dim_expr import MAX_DIM_TEXT, MAX_INT_DIGITS, WHAT, DimError, from_tree, syntax_message
from .ir import SOURCE_OPS, Graph, Node, Ref, TensorType, canon_dtype, make_attrs, undeclared_symbols


#: the deepest nesting of brackets ([ ( {) that IR text may have (printed IR has 3 or 4; a deeper text is refused
#: before it is parsed, so that nothing downstream recurses past Python's limit)
MAX_IR_NESTING = 64


@lru_cache(maxsize=1)
def _parser() -> lark.Lark:
    return lark.Lark.open("ir.lark", rel_to=__file__, parser="lalr", maybe_placeholders=False,
                          propagate_positions=True)


class _ToGraph(lark.visitors.Transformer_NonRecursive):
    def __init__(self, file: str, text: str):
        super().__init__()
        self.file, self.text = file, text
        self.where: dict[int, Loc] = {}      # id(node) -> its place in the IR text

    def _int(self, tok) -> int:
        """int(tok), an integer of more than MAX_INT_DIGITS digits an MtcError at it (int() refuses 4300)."""
        s = str(tok).lstrip("+-")
        if len(s) > MAX_INT_DIGITS:
            raise MtcError(f"integer of {len(s)} digits is too large", Loc(self.file, tok.line, tok.column), self.text)
        return int(str(tok))

    def number(self, t):
        s = str(t[0])
        return float(s) if any(c in s for c in ".eE") else self._int(t[0])

    def string(self, t):
        return json.loads(t[0])

    def true(self, _):
        return True

    def false(self, _):
        return False

    def none(self, _):
        return None

    def pinf(self, _):
        return float("inf")

    def ninf(self, _):
        return float("-inf")

    def nan(self, _):
        return float("nan")

    def list(self, t):
        return tuple(x for x in t)

    def dict(self, t):
        return tuple(sorted(t))

    def attr(self, t):
        return (str(t[0]), t[1])

    def attrs(self, t):
        return dict(t)

    def ref(self, t):
        return Ref(str(t[0]), self._int(t[1]) if len(t) > 1 else 0)

    def args(self, t):
        return list(t)

    def tensor(self, t):
        dims = []
        for d in t[1:]:
            line, col = getattr(d.meta, "line", 1), getattr(d.meta, "column", 1)
            start, end = getattr(d.meta, "start_pos", 0), getattr(d.meta, "end_pos", 0)
            if end - start > MAX_DIM_TEXT:
                raise MtcError(f"a dimension expression of {end - start} characters, more than the limit of "
                               f"{MAX_DIM_TEXT}", Loc(self.file, line, col), self.text)
            try:
                dims.append(from_tree(d))
            except DimError as e:
                shown = self.text[start:end] if len(self.text[start:end]) <= 60 else self.text[start:start + 57] + "..."
                raise MtcError(f"cannot read the dimension '{shown}': {e.msg}",
                               Loc(self.file, e.line or line, e.col or col), self.text, WHAT) from None
        return TensorType(canon_dtype(str(t[0])), tuple(dims))

    def unknown(self, _):
        return None

    def types(self, t):
        return tuple(t)

    def loc(self, t):
        return Loc(json.loads(t[0]), self._int(t[1]), self._int(t[2]), claimed=True)    # named by the text: see Loc

    @lark.v_args(meta=True)
    def ret(self, meta, t):
        self.where["return"] = Loc(self.file, getattr(meta, "line", 1), getattr(meta, "column", 1))
        return ("ret", tuple(t))

    @lark.v_args(meta=True)
    def node(self, meta, t):
        n = self._node(t)
        self.where[id(n)] = Loc(self.file, getattr(meta, "line", 1), getattr(meta, "column", 1))
        return n

    def _node(self, t):
        name, op = str(t[0]), str(t[1])
        inputs, attrs, types, loc = [], {}, (), None
        for x in t[2:]:
            if isinstance(x, list):
                inputs = x
            elif isinstance(x, dict):
                attrs = x
            elif isinstance(x, tuple):
                types = x
            elif isinstance(x, Loc):
                loc = x
        return Node(name, op, tuple(inputs), make_attrs(attrs), types, loc)

    def start(self, t):
        name = str(t[0])
        symbols = tuple(str(x) for x in t[1:] if isinstance(x, lark.Token))
        nodes = tuple(x for x in t if isinstance(x, Node))
        outputs = next(x[1] for x in t if isinstance(x, tuple) and x and x[0] == "ret")
        return Graph(name, nodes, outputs, symbols)


def parse_ir(text: str, file: str = "<ir>") -> Graph:
    """Parse printed IR text (what :func:`dsl.printer.print_graph` writes) into a Graph.

    Every node is checked as the verify and infer_shapes passes would, but located in ``text``: the op is known,
    its attributes exist, the required ones are set and each is of its kind (OpDef.check_attrs: types, and values
    such as eps > 0 and finite; param / buffer / input attributes likewise, parameter shapes within the size
    limits), its inputs are defined earlier, their number and types fit the op's shape rule, a layer op's
    parameters have the shapes its attributes imply, every shape symbol is declared in the signature, and a
    declared type equals the inferred one (``?`` types are left for infer_shapes to fill in: ``dsl.compile``
    runs it).

    Raises:
        MtcError: a syntax or checking error, at ``file:line:col`` of the IR text with its excerpt.
    """
    first = next(((i, ln.strip()) for i, ln in enumerate(text.splitlines(), 1)
                  if ln.strip() and not ln.strip().startswith(("//", "#"))), (1, ""))
    kernel_ir = first[1].startswith("kernels ")
    if kernel_ir or first[1].startswith(("@T.prim_func", "@I.ir_module", "from tvm")):
        what = ("kernel IR (the 'lowered' stage: launches, for reading)" if kernel_ir
                else "a TVMScript listing (the 'tvm' stage, for reading)")
        raise MtcError(f"this is {what}; parse_ir reads the graph IR of the stages graph, typed, canonical and "
                       f"fused (mtc ir SPEC --stage fused)", Loc(file, first[0], 1), text)
    deep = _too_deep(text)
    if deep is not None:
        raise MtcError(f"brackets nested more than {MAX_IR_NESTING} deep", _loc_at(text, deep, file), text,
                       "printed IR nests a few levels (an attribute's list of lists); split the value")
    try:
        tree = _parser().parse(text)
    except lark.exceptions.UnexpectedInput as e:
        raise _ir_syntax_error(e, text, file) from None
    tr = _ToGraph(file, text)
    try:
        g = tr.transform(tree)
    except lark.exceptions.VisitError as e:          # a bad dtype or dim in a type
        orig = e.orig_exc
        loc = Loc(file, getattr(e.obj.meta, "line", 1), getattr(e.obj.meta, "column", 1)) \
            if isinstance(e.obj, lark.Tree) else Loc(file, 1, 1)
        if isinstance(orig, MtcError):
            raise MtcError(orig.msg, orig.loc or loc, text, orig.hint) from None
        raise MtcError(f"malformed IR: {type(orig).__name__}: {orig}", loc, text) from None
    _check(g, tr.where, text, file)
    return g


def _loc_at(text: str, pos: int, file: str) -> Loc:
    """The Loc of offset ``pos`` of ``text``."""
    return Loc(file, text.count("\n", 0, pos) + 1, pos - (text.rfind("\n", 0, pos) + 1) + 1)


def _scan(text: str, start: int, end: int):
    """Yield (offset, char) of the brackets and commas of text[start:end] outside JSON strings ("..." on one
    line, with backslash escapes) and // comments."""
    i = start
    while i < end:
        c = text[i]
        if c == '"':
            i += 1
            while i < end and text[i] not in '"\n':
                i += 2 if text[i] == "\\" else 1
        elif c == "/" and text.startswith("//", i):
            nl = text.find("\n", i)
            i = end if nl < 0 else nl
            continue
        elif c in "[({)}],":
            yield i, c
        i += 1


def _too_deep(text: str) -> int | None:
    """The offset of the first bracket nested past MAX_IR_NESTING, or None."""
    depth = 0
    for i, c in _scan(text, 0, len(text)):
        if c in "[({":
            depth += 1
            if depth > MAX_IR_NESTING:
                return i
        elif c in ")}]":
            depth = max(depth - 1, 0)
    return None


def _ir_syntax_error(e: lark.exceptions.UnexpectedInput, text: str, file: str) -> MtcError:
    """A lark parse failure of IR text as an MtcError: inside a type's [...] it names the dimension that cannot be
    read (at the type), elsewhere the spec's wording of syntax errors, adapted."""
    pos = getattr(e, "pos_in_stream", None)
    tok = getattr(e, "token", None)
    if tok is not None:
        pos = len(text) if tok.type == "$END" else getattr(tok, "start_pos", pos)
    if isinstance(pos, int) and 0 <= pos <= len(text):
        line0 = text.rfind("\n", 0, pos) + 1
        stack = []                                   # [offset of a bracket, the bracket, offset after its last ',']
        for i, c in _scan(text, line0, pos):
            if c in "[({":
                stack.append([i, c, i + 1])
            elif c in ")}]" and stack:
                stack.pop()
            elif c == "," and stack:
                stack[-1][2] = i + 1
        k = next((j for j in range(len(stack) - 1, -1, -1) if stack[j][1] != "("), None)
        if k is not None and stack[k][1] == "[" and stack[k][0] > line0 and \
                (text[stack[k][0] - 1].isalnum() or text[stack[k][0] - 1] == "_"):
            t0 = stack[k][0]                          # back to the start of the dtype before the '['
            while t0 > line0 and (text[t0 - 1].isalnum() or text[t0 - 1] == "_"):
                t0 -= 1
            d0 = stack[k][2]                          # the dim starts after the '[' or the type's last ','
            depth, d1 = 0, d0
            while d1 < len(text) and text[d1] != "\n":
                c = text[d1]
                if c == "(":
                    depth += 1
                elif c == ")" and depth:
                    depth -= 1
                elif c in ",]" and depth == 0:
                    break
                d1 += 1
            shown = text[d0:d1].strip()
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            return MtcError(f"cannot read the dimension '{shown}': {syntax_message(e, text)}",
                            _loc_at(text, t0, file), text, WHAT)
    from .spec import _syntax_error                 # the spec's friendly wording of lark's errors
    err = _syntax_error(e, text, file)
    msg = err.msg.replace("syntax error", "syntax error in IR", 1).replace("PERCENT", "'%' (a value: %0, %x)")
    return MtcError(msg, err.loc, text)


def _check_merge(n: Node, seen: dict, err) -> None:
    """An attn_residual_merge (an edited fused IR) reads (acc, max, sum) of one attn_residual_phase1 node, and its
    index selects the phase-1 query and RMSNorm weight that it names as its own query and weight."""
    acc, m, s, q, w = n.inputs[:5]
    p1 = seen.get(acc.node)
    if p1 is None or p1.op != "attn_residual_phase1" or [(r.node, r.index) for r in (acc, m, s)] != \
            [(acc.node, 0), (acc.node, 1), (acc.node, 2)]:
        raise err("attn_residual_merge: its first three inputs must be outputs 0, 1 and 2 (acc, max, sum) of one "
                  f"attn_residual_phase1 node, got {', '.join(map(str, (acc, m, s)))}")
    i, nq = n.attr("index"), int(p1.attr("n_queries"))
    queries, weights = p1.inputs[:nq], p1.inputs[nq:2 * nq]
    if queries[i] != q or weights[i] != w:
        mine = next((j for j in range(nq) if queries[j] == q and weights[j] == w), None)
        raise err(f"attn_residual_merge: index {i} selects query {queries[i]} and weight {weights[i]} of "
                  f"%{p1.name}, but this merge reads query {q} and weight {w}",
                  f"index = {mine}" if mine is not None else f"%{p1.name} has no query {q} with weight {w}")


def _check(g: Graph, where: dict, text: str, file: str) -> None:
    from .builder import ShapeError
    from .ir import ANNOTATIONS                        # the fused stage's per-node annotations
    from .ops import OPS, check_source
    types: dict[str, tuple] = {}
    dup = next((x for i, x in enumerate(g.symbols) if x in g.symbols[:i]), None)
    if dup:
        line = next((i for i, x in enumerate(text.splitlines(), 1) if x.lstrip().startswith("graph")), 1)
        raise MtcError(f"the graph's signature declares the shape symbol '{dup}' twice", Loc(file, line, 1),
                       text)
    seen: dict[str, Node] = {}
    named: dict[tuple[str, str], Node] = {}     # ("input" | "state", name attribute) -> the node that has it
    for n in g.nodes:
        loc = where.get(id(n))
        seen[n.name] = n

        def err(msg, hint=None):
            return MtcError(f"%{n.name}: {msg}", loc, text, hint)

        if n.name in types:
            raise err("defined twice")
        in_types = []
        for r in n.inputs:
            if r.node not in types:
                raise err(f"uses %{r.node}, which is not defined before it")
            if r.index >= len(types[r.node]):
                raise err(f"uses output {r.index} of %{r.node}, which has {len(types[r.node])}")
            in_types.append(types[r.node][r.index])
        undeclared = undeclared_symbols(g, n)
        if undeclared:
            raise err(f"the type {undeclared[1]} uses the shape symbol '{undeclared[0]}', which the graph's "
                      f"signature 'graph {g.name}({', '.join(g.symbols)})' does not declare",
                      f"declare every shape symbol the types use: graph {g.name}("
                      f"{', '.join(g.symbols + (undeclared[0],))})")
        if n.op in SOURCE_OPS:
            if n.inputs:
                raise err(f"{n.op} takes no inputs, got {len(n.inputs)}")
            try:
                check_source(n.op, n.attr_dict, n.types, ANNOTATIONS)
            except ShapeError as e:
                raise err(f"{n.op}: {e}") from None
            key = ("input" if n.op == "input" else "state", n.attr("name"))
            if key[1] is not None and key in named:
                first = named[key]
                raise err(f"{n.op} name {key[1]!r} is already the name of %{first.name}"
                          + (f" (line {where[id(first)].line})" if where.get(id(first)) else "")
                          + ("; a forward's inputs are fed by name, so each needs its own" if key[0] == "input"
                             else "; parameters and buffers are state-dict keys, so each needs its own"))
            named[key] = n
            types[n.name] = n.types
            continue
        od = OPS.get(n.op)
        if od is None:
            raise err(f"unknown op '{n.op}'{did_you_mean(n.op, list(OPS) + list(SOURCE_OPS))}")
        extra = sorted(set(n.attr_dict) - set(od.attrs) - set(ANNOTATIONS))
        if extra:
            raise err(f"op '{n.op}' has no attribute '{extra[0]}'{did_you_mean(extra[0], od.attrs)}; "
                      f"it takes: {', '.join(od.attrs) or 'none'}")
        if any(t is None for t in in_types):
            types[n.name] = n.types or (None,)
            continue
        try:
            got = tuple(od.check_and_infer(in_types, {**od.attrs, **n.attr_dict}))
        except ShapeError as e:
            raise err(f"{n.op}: {e}") from None
        if n.op == "attn_residual_merge":
            _check_merge(n, seen, err)
        if n.types and all(t is not None for t in n.types):
            if len(got) != len(n.types) or not all(a.same(b) for a, b in zip(got, n.types)):
                raise err(f"{n.op} is typed {', '.join(map(str, n.types))} but its inputs give "
                          f"{', '.join(map(str, got))}")
        types[n.name] = got
    for r in g.outputs:
        if r.node not in types:
            raise MtcError(f"return uses %{r.node}, which is not defined", where.get("return"), text)
        if r.index >= len(types[r.node]):
            raise MtcError(f"return uses output {r.index} of %{r.node}, which has {len(types[r.node])}",
                           where.get("return"), text)
