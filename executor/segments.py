"""The traced joint graph cut into per-block segments, and an interpreter that runs them.

Segments `fwd:<b>` / `bwd:<b>` are the joint-graph nodes of the IR ops with that block and
phase, plus the `getitem` users of each (multi-output ops), in graph order. A segment runs
by interpretation: `node.target(*args)` with fx Nodes replaced by values. Interpreting
(rather than building one fx GraphModule per segment) lets the executor free each
intermediate right after its last use inside the segment, count every allocation on the
device, and fetch the segment's inputs from whichever buffer copy holds them.

Block templates: a replicated trace (`ir.template`) holds 3 layers for L. Segment `fwd:b<i>` is
then its template's nodes with a rename map: the roots it reads and makes are called by layer
i's instance names, and its parameters are layer i's; the nodes themselves are shared.

Storage roots: buffers hold storage roots only (IR `Tensor.storage == name`). A view that a
later segment or the optimizer reads (a `t` of a weight gradient, the `split` of q/k/v) is
re-created from its root by replaying its aliasing ops, which moves no data, so a buffer
that went to DRAM and back gives kernels exactly the tensors (values, shapes, strides)
they would have seen without the trip.
"""
from __future__ import annotations

import functools
import operator
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.fx.node import map_arg

from tensorstow.ir.build import view_source
from tensorstow.ir.template import Instances, instances
from tensorstow.ir.trace import Traced

_MISSING = object()


@dataclass(frozen=True)
class Segment:
    name: str
    nodes: tuple[fx.Node, ...]
    ext_roots: frozenset[str]
    """Storage roots the segment reads from outside (placeholders included)."""
    produced: frozenset[str]
    """Storage roots the segment creates."""
    release_after: tuple[tuple[str, ...], ...]
    """release_after[i]: local values whose last use in the segment is node i."""
    rename: dict[str, str] | None = None
    """Template node -> this block's name, for the roots it reads and makes (None: identity)."""
    local: dict[str, str] | None = None
    """This block's name -> template node, for the roots it makes."""

    def outer(self, node: str) -> str:
        return self.rename.get(node, node) if self.rename else node

    def instantiate(self, name: str, rename: dict[str, str]) -> "Segment":
        if not rename:
            return self if name == self.name else Segment(name, self.nodes, self.ext_roots, self.produced,
                                                          self.release_after)
        made = {rename.get(r, r): r for r in self.produced}
        return Segment(name=name, nodes=self.nodes,
                       ext_roots=frozenset(rename.get(r, r) for r in self.ext_roots),
                       produced=frozenset(made), release_after=self.release_after, rename=rename, local=made)


class Joint:
    """The joint forward+backward graph of a traced model, split into one segment per block and
    phase (a replicated trace: template segments instantiated for every layer)."""

    def __init__(self, traced: Traced):
        gm, g = traced.gm, traced.graph
        nodes = list(gm.graph.nodes)
        self.node = {n.name: n for n in nodes}
        pos = {n.name: i for i, n in enumerate(nodes)}
        self.tensors = {t.name: t for t in g.tensors}
        ph = [n for n in nodes if n.op == "placeholder"]
        names = traced.param_names
        self.inst: Instances = instances(g, traced.layer_path)
        self.targets: dict = {}
        """CPU-only op -> what runs it on the execution device (`executor.device_ops.targets_for`)."""
        self.placeholder = {p: ph[i].name for i, p in enumerate(names)}
        """Model-state name -> its placeholder (primals_k; `primals_k@b<i>` for a layer
        instantiated from a template)."""
        self.inputs = tuple(n.name for n in ph[len(names):])
        """idx, targets (a packing step: positions) and the loss tangent: given by the caller every step."""
        self.constants = {n.name: getattr(gm, n.target) for n in nodes if n.op == "get_attr"}
        """Literals of forward (`torch.tensor([...])`), part of the graph: real tensors."""
        fake = [k for k, v in self.constants.items() if type(v) is not torch.Tensor]
        if fake:
            raise RuntimeError(f"internal: graph constants {fake[:3]} have no real value")
        if len(self.inputs) != 3 + traced.packing:
            raise RuntimeError(f"internal: expected placeholders params..., idx, targets, "
                               f"{'positions, ' if traced.packing else ''}tangent; got {len(self.inputs)} after the "
                               f"parameters")
        out = next(n for n in nodes if n.op == "output").args[0]
        self.loss = out[0].name
        self.grad = {p: out[1 + i].name for i, p in enumerate(names)
                     if i + 1 < len(out) and isinstance(out[1 + i], fx.Node)}
        """Parameter name -> the node holding its gradient (joint-graph outputs after the loss)."""
        self._roots: dict[str, frozenset[str]] = {}
        self._compiled: dict[tuple, _Compiled] = {}  # (template nodes, device) -> its compiled run
        self._outer: dict[str, tuple] = {}  # segment -> (it, the outer names of the roots it fetches)
        self._recipes: dict[str, list] = {}  # `materialize`: node name -> its walk
        self.block_state: dict[str, tuple[list[str], list[str]]] = {}
        """Block -> (trainable parameters, frozen parameters and buffers) it owns, by the model's
        own names: its P:/C: buffers."""
        self._instantiate_state(g, set(traced.trainable))
        self.param_names = sorted(self.placeholder)

        members: dict[str, list[fx.Node]] = {}
        seen = set()
        for op in g.ops:
            if op.phase not in ("fwd", "bwd"):
                continue
            n = self.node[op.name]
            seg = members.setdefault(f"{op.phase}:{op.block}", [])
            for m in [n] + [u for u in n.users if u.target is operator.getitem]:
                if m.name not in seen:
                    seen.add(m.name)
                    seg.append(m)
        missing = [n.name for n in nodes if n.op == "call_function" and n.name not in seen]
        if missing or any(n.op not in ("placeholder", "call_function", "get_attr", "output") for n in nodes):
            raise RuntimeError(f"internal: joint-graph nodes outside every segment: {missing[:5]}")
        templates = {k: self._segment(k, sorted(v, key=lambda n: pos[n.name])) for k, v in members.items()}
        self.segments: dict[str, Segment] = {}
        for blk in g.blocks:
            for phase in ("fwd", "bwd"):
                t = templates.get(f"{phase}:{blk.profile}")
                if t is not None:
                    name = f"{phase}:{blk.name}"
                    self.segments[name] = t.instantiate(name, self.inst.rename.get(blk.name, {}))
        self.segments = dict(sorted(self.segments.items()))

    def _instantiate_state(self, g, trainable: set[str]) -> None:
        """Placeholders, gradients and owned state of every block, replicas included."""
        inst, ph, grad = self.inst, dict(self.placeholder), dict(self.grad)
        owned: dict[str, list] = defaultdict(list)
        for t in g.tensors:
            if t.kind in ("parameter", "constant") and t.producer is None and t.storage == t.name and t.param:
                owned[t.block].append(t.param)
        for blk in g.blocks:
            b = blk.name
            state = [inst.state_name(b, p) for p in sorted(owned.get(blk.profile, ()))]
            for p, real in zip(sorted(owned.get(blk.profile, ())), state):
                self.placeholder[real] = inst.name(b, ph[p])
                if p in grad:
                    self.grad[real] = inst.name(b, grad[p])
            self.block_state[b] = ([r for p, r in zip(sorted(owned.get(blk.profile, ())), state) if p in trainable],
                                   [r for p, r in zip(sorted(owned.get(blk.profile, ())), state) if p not in trainable])

    # ---- structure --------------------------------------------------------------------------
    def is_root(self, name: str) -> bool:
        name = self.inst.template_of(name)[0]
        n = self.node[name]
        if n.op in ("placeholder", "get_attr"):
            return True
        t = self.tensors.get(name)
        return t is not None and t.storage == name

    def roots_of(self, name: str) -> frozenset[str]:
        """The storage roots a node's value lives in (itself, for a root)."""
        t, b = self.inst.template_of(name)
        return frozenset(self.inst.name(b, r) for r in self._troots(t)) if b else self._troots(name)

    def _troots(self, name: str) -> frozenset[str]:
        """`roots_of` in the traced graph's own names."""
        r = self._roots.get(name)
        if r is None:
            if self.is_root(name):
                r = frozenset([name])
            else:
                r = frozenset()
                for a in _arg_nodes(self.node[name]):
                    r |= self._troots(a.name)
            self._roots[name] = r
        return r

    def meta(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        v = self.node[self.inst.template_of(name)[0]].meta["val"]
        return v.dtype, tuple(int(s) for s in v.shape)

    def _segment(self, name: str, nodes: list[fx.Node]) -> Segment:
        inside = {n.name for n in nodes}
        ext, produced = set(), set()
        last: dict[str, int] = {}
        for i, n in enumerate(nodes):
            for a in _arg_nodes(n):
                last[a.name] = i
                if a.name not in inside:
                    ext |= self._troots(a.name)
            if self.is_root(n.name):
                produced.add(n.name)
        release: list[list[str]] = [[] for _ in nodes]
        for i, n in enumerate(nodes):
            if n.name not in last:  # unused inside: release right after it is made
                release[i].append(n.name)
        for a, i in last.items():
            release[i].append(a)
        return Segment(name=name, nodes=tuple(nodes), ext_roots=frozenset(ext),
                       produced=frozenset(produced),
                       release_after=tuple(tuple(sorted(r)) for r in release))

    def add_reforward(self, b: str, make, given) -> Segment:
        """Segment `refwd:<b>`: the nodes of b's forward that `make` (roots) depend on, stopping at
        the roots in `given` (fetched from their buffer instead of made again) and at values from
        outside the forward. A partial swap's re-forward (planner.cost.reforward_split)."""
        fwd = self.segments[f"fwd:{b}"]
        local = fwd.local or {}
        need = {local.get(r, r) for r in make}
        have = {local.get(r, r) for r in given}
        picked = []
        for n in reversed(fwd.nodes):
            if n.name in need:
                picked.append(n)
                need.update(a.name for a in _arg_nodes(n) if a.name not in have)
        name = f"refwd:{b}"
        seg = self._segment(name, picked[::-1]).instantiate(name, fwd.rename or {})
        self.segments[name] = seg
        return seg

    def add_backward_parts(self, b: str, first: set[str]) -> tuple[Segment, Segment]:
        """Segments `bwd1:<b>` (the nodes of b's backward for the IR ops named in `first`, with
        their getitem users) and `bwd2:<b>` (the rest): a cut backward (planner BlockDecision.bwd_cut).
        What the first part makes for the second crosses in a planned buffer (K:<b>)."""
        whole = self.segments[f"bwd:{b}"]
        is_first = {n.name for n in whole.nodes if n.name in first
                    or n.target is operator.getitem and n.args[0].name in first}
        one = [n for n in whole.nodes if n.name in is_first]
        two = [n for n in whole.nodes if n.name not in is_first]
        late = {n.name for n in two}
        if not one or not two or any(a.name in late for n in one for a in _arg_nodes(n)):
            raise RuntimeError(f"internal: the cut of {b}'s backward does not split it into two runs")
        out = []
        for k, nodes in (("bwd1", one), ("bwd2", two)):
            name = f"{k}:{b}"
            self.segments[name] = self._segment(name, nodes).instantiate(name, whole.rename or {})
            out.append(self.segments[name])
        return out[0], out[1]

    # ---- execution --------------------------------------------------------------------------
    def call(self, n: fx.Node, value, device: torch.device | None = None):
        args = map_arg(n.args, value)
        portable = self.targets.get(n.target) if self.targets else None  # none on the CPU
        kwargs = map_arg(n.kwargs, value) if n.kwargs else {}
        if device is not None and isinstance(kwargs.get("device"), torch.device):
            kwargs = {**kwargs, "device": device}
        if portable is not None:  # a CPU-only kernel, on another device (executor.device_ops)
            return portable(*args, **kwargs, _like=n.meta.get("val"))
        return n.target(*args, **kwargs)

    def materialize(self, name: str, fetch_root):
        """The value of node `name`, fetching roots with `fetch_root` and replaying views. The
        walk (which nodes, which are roots, their outer names) is made once per name: the
        optimizer materializes every gradient every step."""
        steps = self._recipes.get(name)
        if steps is None:
            steps = self._recipes[name] = self._recipe(name)
        env: dict[str, object] = {}
        for n, root in steps:
            env[n.name] = fetch_root(root) if root is not None else self.call(n, lambda a: env[a.name])
        return env[steps[-1][0].name]

    def _recipe(self, name: str) -> list[tuple[fx.Node, str | None]]:
        """`materialize`'s nodes in the order it makes them, each with the outer name of the root
        it fetches (None: a view, replayed from what comes before it)."""
        t, b = self.inst.template_of(name)
        steps: list[tuple[fx.Node, str | None]] = []
        seen: set[str] = set()

        def visit(n: fx.Node) -> None:
            if n.name in seen:
                return
            seen.add(n.name)
            if self.is_root(n.name):
                steps.append((n, self.inst.name(b, n.name) if b else n.name))
                return
            for a in _arg_nodes(n):
                visit(a)
            steps.append((n, None))
        visit(self.node[t])
        return steps

    def run(self, seg: Segment, *, fetch, hold, release, keep: frozenset[str], sink,
            device: torch.device | None = None) -> None:
        """Run `seg`. Outside roots come from `fetch(name)`; views of them are replayed.
        Every local value is `hold`-ed when made and `release`-d after its last use, except the
        roots in `keep`: `sink(name, value)` gets each at the end, with its hold (the sink
        releases it, or passes it on). Outside names (fetch, keep, sink) are the block's own
        (`Segment.rename`).

        The segment runs as Python made for it once (`_compile`): one line per node with its
        values in locals, so a node costs its kernel call and its accounting, not a walk of its
        arguments (on a GPU the host would otherwise fall behind the kernels). `interpret` does
        the same node by node."""
        if seg.local:
            keep = frozenset(seg.local[k] for k in keep)
        key = (id(seg.nodes), device)
        code = self._compiled.get(key)
        if code is None:
            code = self._compiled[key] = _compile(seg, self, device)
        names = self._outer.get(seg.name)
        if names is None or names[0] is not seg:
            names = self._outer[seg.name] = (seg, tuple(seg.outer(r) for r in code.fetched))
        code.fn(fetch, hold, release, keep, sink, names[1], seg.outer, device)

    def interpret(self, seg: Segment, *, fetch, hold, release, keep: frozenset[str], sink,
                  device: torch.device | None = None) -> None:
        """`run`, node by node (the reference the compiled segments are tested against)."""
        env: dict = {}
        if seg.local:
            keep = frozenset(seg.local[k] for k in keep)

        def value(n: fx.Node):
            v = env.get(n.name, _MISSING)
            if v is not _MISSING:
                return v
            if self.is_root(n.name):
                return fetch(seg.outer(n.name))
            v = self.call(n, value, device)  # a view of an outside root: replay it
            hold(v, n.name)
            env[n.name] = v
            return v

        try:
            for i, n in enumerate(seg.nodes):
                v = self.call(n, value, device)
                hold(v, n.name)
                env[n.name] = v
                for name in seg.release_after[i]:
                    if name not in keep and name in env:
                        release(env.pop(name))
            for name in sorted(keep):
                sink(seg.outer(name), env.pop(name))  # its hold goes with it
        finally:
            for v in env.values():
                release(v)
            env.clear()


@dataclass(frozen=True)
class _Compiled:
    fn: object
    """fn(fetch, hold, release, keep, sink, fetched_names, outer, device)"""
    fetched: tuple[str, ...]
    """The outside roots the segment fetches, in the order of `fetched_names`."""


_SAFE_LITERALS = (bool, int, str, type(None))


def _compile(seg: Segment, joint: Joint, device: torch.device | None) -> _Compiled:
    """Python source for `Joint.interpret`'s walk of `seg`, with every decision it makes per node
    taken once: which arguments are locals, outside roots (fetched at their first use and kept
    in a local: the buffer holding one is not freed or replaced while the segment runs) or views
    of them (replayed at the first use), which kernel runs (a portable one off the CPU), where a
    `device=` keyword points, and when each value is released (`_view_holders`: views are not
    counted). `_SegmentSource` writes it; here it is compiled (`_code`) and bound to its constants."""
    src = _SegmentSource(seg, joint, device)
    scope = dict(src.consts)
    exec(_code(src.text, f"<segment {seg.name}>"), scope)
    return _Compiled(fn=scope["_segment"], fetched=tuple(sorted(src.fetched, key=src.fetched.get)))


class _SegmentSource:
    """The source of one compiled segment (`_compile`): a function
    `_segment(fetch, hold, release, keep, sink, _names, outer, device)` with one statement per
    node, its releases after the node of each value's last use, the kept roots handed to `sink`
    at the end, and a cleanup that releases every value still held."""

    INDENT = "        "
    """The body's indentation: inside the function's `try`."""

    def __init__(self, seg: Segment, joint: Joint, device: torch.device | None):
        self.seg, self.joint, self.device = seg, joint, device
        self.inside = {n.name for n in seg.nodes}
        """The segment's own nodes."""
        self.holder = _view_holders(seg)
        """View -> the node holding its storage (None: an outside root's)."""
        self.consts: dict[str, object] = {}
        """Name in the source -> a value that has no literal (the scope the source runs in)."""
        self.fetched: dict[str, int] = {}
        """Outside root -> k: fetched into local `_f<k>` as `_names[k]`."""
        self.var: dict[str, str] = {}
        """Node -> its local: `h<k>` for a held value, `a<k>` for an uncounted view."""
        self.held: list[str] = []
        """Locals released in the cleanup (every held value)."""
        self.lines: list[str] = []
        """The body's lines so far."""
        self.produced = {n.name for n in seg.nodes if joint.is_root(n.name)}
        """The roots the segment makes: what `keep` may name (template names)."""
        self.write()

    def write(self) -> None:
        """The body: each node, then the releases of the values it used last; at the end the kept
        roots to the sink."""
        for i, n in enumerate(self.seg.nodes):
            self.emit(n, self.INDENT)
            for name in sorted(self.release_points[i]):
                self.release(name)
        for name in sorted(self.produced):  # a kept root goes to the sink with its hold
            v = self.var[name]
            self.lines += [f"{self.INDENT}if {name!r} in keep:", f"{self.INDENT}    _v = {v}",
                           f"{self.INDENT}    del {v}", f"{self.INDENT}    sink(outer({name!r}), _v)"]

    @property
    def text(self) -> str:
        """The whole function."""
        src = ["def _segment(fetch, hold, release, keep, sink, _names, outer, device):",
               "    try:"]
        src += self.lines
        src += ["    finally:",
                "        for k, v in list(locals().items()):",
                "            if k[0] == 'h' and k[1:].isdigit():",
                "                release(v)"]
        return "\n".join(src)

    @functools.cached_property
    def release_points(self) -> list[list[str]]:
        """Per node, the values whose last use it is (a holder's goes with its views' last use)."""
        last = {name: i for i, names in enumerate(self.seg.release_after) for name in names}
        for view, h in self.holder.items():  # a holder is released once its views are done with too
            if h is not None:
                last[h] = max(last[h], last[view])
        release_at: list[list[str]] = [[] for _ in self.seg.nodes]
        for name, i in last.items():
            release_at[i].append(name)
        return release_at

    def const(self, v) -> str:
        """A value in the source: its literal where it is a safe one, else a named constant."""
        if type(v) in _SAFE_LITERALS:
            return repr(v)
        k = f"_c{len(self.consts)}"
        self.consts[k] = v
        return k

    def arg(self, a, indent: str) -> str:
        """An argument in the source: a local, an outside root (fetched at its first use), a view
        of one (replayed here, before the node that reads it), a structure of those, a constant."""
        if isinstance(a, fx.Node):
            if a.name in self.var:
                return self.var[a.name]
            if a.name in self.inside:
                raise RuntimeError(f"internal: {self.seg.name} uses {a.name} before making it")
            if self.joint.is_root(a.name):  # an outside root: fetched at its first use, kept in a local
                if a.name in self.fetched:
                    return f"_f{self.fetched[a.name]}"
                k = self.fetched[a.name] = len(self.fetched)
                return f"(_f{k} := fetch(_names[{k}]))"
            self.emit(a, indent)  # a view of an outside root: replayed here, kept until its last use
            return self.var[a.name]
        if isinstance(a, (list, tuple)) and _arg_nodes(a):
            items = ", ".join(self.arg(x, indent) for x in a)
            return f"[{items}]" if isinstance(a, list) else f"({items}{',' if len(a) == 1 else ''})"
        if isinstance(a, dict) and _arg_nodes(a):
            return "{" + ", ".join(f"{k!r}: {self.arg(v, indent)}" for k, v in a.items()) + "}"
        return self.const(a)

    def emit(self, n: fx.Node, indent: str) -> None:
        """The node's call, bound to a new local: held, unless a view (`_view_holders`)."""
        args = [self.arg(a, indent) for a in n.args]
        kwargs = {k: self.arg(v, indent) for k, v in n.kwargs.items()}
        if self.device is not None and isinstance(n.kwargs.get("device"), torch.device):
            kwargs["device"] = "device"
        portable = self.joint.targets.get(n.target) if self.joint.targets else None
        if portable is not None:
            kwargs["_like"] = self.const(n.meta.get("val"))
        target = self.const(_callable(portable if portable is not None else n.target))
        call = ", ".join(args + [f"{k}={x}" for k, x in kwargs.items()])
        uncounted = n.name in self.holder or n.name not in self.inside and view_source(n) is not None
        if uncounted:  # a view: nothing to count (_view_holders)
            self.var[n.name] = v = f"a{len(self.var)}"
            self.lines.append(f"{indent}{v} = {target}({call})")
            return
        v = f"h{len(self.held)}"
        self.held.append(v)
        self.var[n.name] = v
        self.lines.append(f"{indent}hold(_v := {target}({call}), {n.name!r})")  # held, then bound: the cleanup
        self.lines.append(f"{indent}{v} = _v")                                    # releases only what was held

    def release(self, name: str) -> None:
        """The value's release after its last use (a produced root only where the caller does not
        keep it); a view only drops its reference: its storage's holder keeps the count."""
        v, body = self.var.get(name), self.INDENT
        if v is None:
            return  # an outside root: never held here
        if v[0] == "a":
            self.lines.append(f"{body}del {v}")
        elif name in self.produced:  # the caller may keep it
            self.lines += [f"{body}if {name!r} not in keep:", f"{body}    release({v})", f"{body}    del {v}"]
        else:
            self.lines += [f"{body}release({v})", f"{body}del {v}"]


@functools.lru_cache(maxsize=1024)
def _code(source: str, filename: str):
    """Python's compile of a segment's source, shared by every executor of the same trace (their
    segments read the same source with their own constants): compiling is most of `_compile`."""
    return compile(source, filename, "exec")


def _callable(target):
    """What a compiled segment calls for `target`: an aten OpOverload's C++ entry point itself,
    which its `__call__` only forwards to (one Python frame less a node)."""
    op = getattr(target, "_op", None)
    if isinstance(target, torch._ops.OpOverload) and type(target).__call__ is torch._ops.OpOverload.__call__ \
            and callable(op):
        return op
    return target


def _view_holders(seg: Segment) -> dict[str, str | None]:
    """The views a segment makes (`view_source`, through any chain of views, getitems of
    `split` included) -> the node of the segment that makes and holds their storage, or None for a
    view of an outside root (a buffer copy or a step input, held on the device tier from before
    the segment starts until a free the plan orders after it).

    The compiled run does not hold or release these views: a holder's release moves to the last
    use of its last view, when the storage's count would drop to zero under per-view holds too,
    so the bytes counted after every hold and release are the same with about half the
    accounting calls (most nodes of a transformer block are views, and on a host-bound model the
    accounting is a fifth of the step: benchmarks/RESULTS.md "Executor vs eager PyTorch on the CPU")."""
    inside = {n.name for n in seg.nodes}
    holder: dict[str, str | None] = {}
    for n in seg.nodes:
        src = view_source(n)
        if src is not None:
            holder[n.name] = holder.get(src.name, src.name) if src.name in inside else None
    return holder


def _arg_nodes(n) -> list[fx.Node]:
    """The Nodes a node reads (its args and kwargs), or that an argument structure holds."""
    out: list[fx.Node] = []
    map_arg((n.args, n.kwargs) if isinstance(n, fx.Node) else n, lambda a: out.append(a))
    return out
