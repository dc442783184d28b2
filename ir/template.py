"""Block templates: the layers of a replicated trace, instantiated for every layer of the model.

A deep model is traced as 3 layers (first `b0`, middle `b1`, last `b2`) and its IR describes
all L layers, layers 1..L-2 sharing the middle one's profile (Mobius §3.2 layer similarity).
The executor runs exactly that trace: layer i's segments are its template's segments, replayed
with layer i's own parameters and buffers and with the values that cross the layer boundary
taken from its neighbours. This module says, in IR terms, what each instance reads and makes.

Naming. A template tensor `n` of layer i is called `n` in the traced instances (pre, b0, b1,
the last layer, post) and `n@b<i>` elsewhere; model state is renamed by its layer index
(`h.1.attn.weight` -> `h.5.attn.weight`).

Boundaries. In the trace, b1 reads values b0's forward made (its input hidden state), and b2
reads the same kind of values from b1: `IN_F(b1)` and `IN_F(b2)`, in reading order. The j-th
element of each is the same value of a layer's output when both are read at the same place
(op position and input slot) of structurally equal layers; the backward gradients flowing from
b2 to b1 and from b1 to b0 (`IN_B`) are matched the same way. Layer i's reads of its template's
`IN_F[j]` then come from layer i-1's instance of what its own template hands on at j, and
likewise for the backward. Anything else a template reads across layers (a value of a layer two
away, all hidden states read by the head) cannot be replicated: `instances` says so.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from tensorstow.errors import TensorstowError
from tensorstow.ir.graph import Graph


class NotReplicable(TensorstowError):
    """The traced layers cannot stand for the model's other layers (why, in one line)."""


@dataclass(frozen=True)
class Instances:
    """How every block of a (possibly replicated) IR maps onto the traced joint graph."""

    depth: int
    """Layers of the real model."""
    profile: dict[str, str]
    """Block -> its template block (itself when traced)."""
    rename: dict[str, dict[str, str]] = field(default_factory=dict)
    """Block -> {template tensor name: this block's name}; absent names are shared (inputs,
    values of `pre`/`post`). Empty when every layer is traced."""
    origin: dict[str, tuple[str, str]] = field(default_factory=dict)
    """Instance name -> (template name, block), for every renamed tensor."""
    state: dict[str, dict[str, str]] = field(default_factory=dict)
    """Block -> {template model-state name: this layer's model-state name}."""

    def name(self, block: str, tensor: str) -> str:
        return self.rename.get(block, {}).get(tensor, tensor)

    def template_of(self, name: str) -> tuple[str, str | None]:
        return self.origin.get(name, (name, None))

    def state_name(self, block: str, template_state: str) -> str:
        return self.state.get(block, {}).get(template_state, template_state)


def instances(graph: Graph, layer_path: str) -> Instances:
    """The instance maps of `graph`'s blocks; identity when every layer was traced."""
    profile = {b.name: b.profile for b in graph.blocks}
    layers = graph.layer_blocks()
    depth = len(layers)
    if graph.traced_layers == depth:
        return Instances(depth=depth, profile=profile)
    if graph.traced_layers != 3:
        raise NotReplicable(f"a replicated trace has 3 layers, this one {graph.traced_layers}")
    by_name = {t.name: t for t in graph.tensors}
    ops = graph.ops

    def made_by(name: str) -> tuple[str, str]:
        """(block, phase) of the op that makes a tensor; (owner, "state") for model state."""
        t = by_name[name]
        if t.producer is None:
            return t.block, ("state" if t.kind in ("parameter", "constant") else "input")
        return ops[t.producer].block, ops[t.producer].phase

    own: dict[str, list[str]] = {t: [] for t in ("b0", "b1", "b2")}
    for t in graph.tensors:
        if t.block in own and t.kind != "optimizer_state":
            own[t.block].append(t.name)
    reads = {t: _reads(graph, t, by_name, made_by) for t in ("pre", "b0", "b1", "b2", "post")}
    prev = {"b1": "b0", "b2": "b1"}
    nxt = {"b0": "b1", "b1": "b2"}
    for t, rs in reads.items():
        for (blk, phase), _ in rs.items():
            ok = (blk in (t, "", "pre", "post")
                  or (blk, phase) == (prev.get(t), "fwd") or (blk, phase) == (nxt.get(t), "bwd")
                  or (t, blk, phase) in (("pre", "b0", "bwd"), ("post", "b2", "fwd")))
            if not ok:
                raise NotReplicable(f"block {t} reads what block {blk} made in its {phase} pass, which only "
                                    f"neighbouring layers may do in a replicated trace")
    in_f = {t: reads[t].get((prev[t], "fwd"), []) for t in ("b1", "b2")}
    in_b = {t: reads[t].get((nxt[t], "bwd"), []) for t in ("b0", "b1")}
    _same_places("forward inputs", in_f["b1"], in_f["b2"])
    _same_places("backward gradients", in_b["b0"], in_b["b1"])
    out_f = {"b0": [n for n, _ in in_f["b1"]], "b1": [n for n, _ in in_f["b2"]]}
    out_b = {"b1": [n for n, _ in in_b["b0"]], "b2": [n for n, _ in in_b["b1"]]}
    _same_makers(graph, "b0", "b1", "fwd", out_f["b0"], out_f["b1"])
    _same_makers(graph, "b1", "b2", "bwd", out_b["b1"], out_b["b2"])

    traced = {"pre", "post", "b0", "b1", f"b{depth - 1}"}
    def own_name(block: str, n: str) -> str:
        return n if block in traced else f"{n}@{block}"

    state_of = {t: [by_name[n].param for n in own[t] if by_name[n].producer is None and by_name[n].param]
                for t in own}
    index = {"b0": 0, "b1": 1, "b2": 2}
    rename: dict[str, dict[str, str]] = {}
    origin: dict[str, tuple[str, str]] = {}
    state: dict[str, dict[str, str]] = {}
    for i, blk in enumerate(layers):
        b, t = blk.name, blk.profile
        r = {n: own_name(b, n) for n in own[t]}
        if i >= 1:
            before = layers[i - 1]
            for j, (n, _) in enumerate(in_f[t]):
                r[n] = own_name(before.name, out_f[before.profile][j])
        if i <= depth - 2:
            after = layers[i + 1]
            for j, (n, _) in enumerate(in_b[t]):
                r[n] = own_name(after.name, out_b[after.profile][j])
        rename[b] = {k: v for k, v in r.items() if k != v}
        for n in own[t]:
            origin[own_name(b, n)] = (n, b)
        state[b] = {p: _layer_state(p, layer_path, index[t], i) for p in state_of[t]}
        state[b] = {k: v for k, v in state[b].items() if k != v}
    return Instances(depth=depth, profile=profile, rename=rename, origin=origin, state=state)


def _reads(graph: Graph, block: str, by_name, made_by) -> dict[tuple[str, str], list[tuple[str, tuple]]]:
    """What `block`'s ops read from elsewhere, by (maker block, phase): [(storage root, places)] in
    reading order, where places are the (phase, op position in the block's phase, input slot) of
    every read."""
    out: dict[tuple[str, str], dict[str, list]] = {}
    pos = {"fwd": 0, "bwd": 0}
    for op in graph.ops:
        if op.block != block or op.phase not in pos:
            continue
        for slot, a in enumerate(op.inputs):
            root = by_name[a].storage
            maker = made_by(root)
            if maker[0] == block:
                continue
            if maker[1] == "input":
                maker = ("", "input")
            out.setdefault(maker, {}).setdefault(root, []).append((op.phase, pos[op.phase], slot))
        pos[op.phase] += 1
    return {k: [(n, tuple(p)) for n, p in v.items()] for k, v in out.items()}


def _same_places(what: str, a: list, b: list) -> None:
    if [p for _, p in a] != [p for _, p in b]:
        raise NotReplicable(f"the middle and last layers read their {what} at different places "
                            f"({len(a)} vs {len(b)} values), so one cannot stand for the other")


def _same_makers(graph: Graph, ta: str, tb: str, phase: str, a: list[str], b: list[str]) -> None:
    """The j-th value handed on by `ta` and by `tb` comes from the same op and output, counting
    ops from the end of the pass (the first layer's forward may begin in `pre`: the norm of a
    frozen embedding needs no gradient, so autograd's numbering puts it before the layer)."""
    def places(t, names):
        seq = [op for op in graph.ops if op.block == t and op.phase == phase]
        where = {}
        for k, op in enumerate(reversed(seq)):
            for o in op.outputs:
                t = graph.tensor(o)
                where[o] = (k, op.target, t.dtype, t.shape)
        return [where.get(n) for n in names]
    pa, pb = places(ta, a), places(tb, b)
    if None in pa or pa != pb:
        raise NotReplicable(f"layers {ta} and {tb} hand on their {phase} values from different ops, so "
                            f"the traced layers are not one template")


def _layer_state(name: str, layer_path: str, k: int, i: int) -> str:
    """Template layer k's model-state name as layer i's (`h.1.w` -> `h.5.w`)."""
    head = f"{layer_path}.{k}." if layer_path else f"{k}."
    if not name.startswith(head):
        raise NotReplicable(f"model state {name} of traced layer {k} is not under {head!r}")
    return (f"{layer_path}.{i}." if layer_path else f"{i}.") + name[len(head):]


def layer_structure(layer) -> str:
    """A layer's similarity class, read from the module without tracing it: its submodules'
    classes, plain attributes (except the layer's own index), and the shapes, dtypes and
    trainability of its parameters and buffers. Layers with equal structure trace alike."""
    from tensorstow.ir.graph import stable_hash
    desc = []
    for name, m in layer.named_modules():
        attrs = sorted((k, repr(v)) for k, v in vars(m).items()
                       if not k.startswith("_") and _plain(v) and not _INDEX.search(k))
        desc.append([name, f"{type(m).__module__}.{type(m).__qualname__}", attrs])
    desc.append([[n, list(p.shape), str(p.dtype), p.requires_grad] for n, p in layer.named_parameters()])
    desc.append([[n, list(b.shape), str(b.dtype)] for n, b in layer.named_buffers()])
    return stable_hash(desc)


_INDEX = re.compile(r"(^|_)(idx|index|layer_id|layer_number|layer_num)$")


def _plain(v) -> bool:
    if isinstance(v, (tuple, list)):
        return all(_plain(x) for x in v)
    return v is None or isinstance(v, (bool, int, float, str))
