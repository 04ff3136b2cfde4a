"""Plans as certificates: before a plan is lowered, check that it is one autopar could have made
for this graph.

A plan file is data a person can edit, and the lowering trusts it: a row-parallel matmul whose
output is edited from ``P`` to ``R`` lowers, runs and trains to a slightly wrong loss, since
nothing sums the partial products. ``certify`` re-derives what the plan claims, from the captured
graph and the sharding rules alone (no costs, no solver), and refuses a plan where

1. a node's strategy — the spec of each tensor input and output, the rewrite, in-op collective
   and work split of each mesh axis — is not one its op allows: along every axis the placements
   must be one of the op's ``AxisStrategy``s (``autopar.rules.axis_strategies``, with the block
   shards ``block_hints`` offers), and together they must cut every tensor into equal pieces (the
   N-D strategies are the per-axis products that divide, ``autopar.passes.strategies``). Members
   of a mixture-of-experts region (``autopar.rules.routing``) are made jointly: all of them must
   take the same one of the region's strategies. A ``getitem`` passes its producer's output on
   unchanged. Parameters may be sharded (ZeRO stage 1–3), nothing else has a ZeRO stage;
2. a reshard does not connect what its producer gives to what its consumer reads: its ``src`` must
   be the producer's output spec, its ``dst`` the consumer's input spec, and every input whose spec
   differs from its producer's output must have one;
3. a node the plan gives no strategy (run on whole tensors, as captured) reads a sharded value;
4. the plan's parameter and input tables disagree with the placeholders' specs, or it names a
   node the program does not have.

The check is pure (the same graph and plan give the same answer on every rank), so every rank
refuses the same plan at the same point, before any collective. It costs a few milliseconds per
hundred nodes (see ``certify``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.fx import Graph, Node

from autopar.graph import OpFamily, op_family, op_name, tensor_inputs, tensor_outputs
from autopar.ir import Rewrite
from autopar.placement import Replicate, Shard, Spec, divides, format_spec, parse_spec
from autopar.planfile import NodePlan, Plan
from autopar.rules import AxisStrategy, axis_strategies, block_hints
from autopar.rules.moe_regions import MoERegion, moe_regions, region_strategies

__all__ = ["CertificateError", "certify"]


class CertificateError(ValueError):
    """The plan is not one autopar could have made for this graph (it names the node and why)."""


_EDITED = "was the plan edited? plan again for this model, or restore the node as autopar wrote it"


def _fmt(specs: Sequence[Spec | None]) -> str:
    return "(" + ", ".join("-" if s is None else ",".join(format_spec(s)) for s in specs) + ")"


def _fmt_axis(ps: Sequence[object]) -> str:
    return "(" + ", ".join("-" if p is None else str(p) for p in ps) + ")"


class _Certifier:
    def __init__(self, graph: Graph, plan: Plan, params: set[str]):
        self.graph = graph
        self.plan = plan
        self.mesh = tuple(plan.mesh_shape)
        self.ndim = len(self.mesh)
        self.params = params
        self.np: dict[str, NodePlan] = {}
        for n in plan.nodes:
            if n.name in self.np:
                raise CertificateError(f"the plan lists node {n.name} twice: {_EDITED}")
            self.np[n.name] = n
        self.hints = block_hints(graph)
        self.region_of: dict[Node, MoERegion] = {m: r for r in moe_regions(graph) for m in r.members}
        self.specs: dict[str, tuple[tuple[Spec | None, ...], tuple[Spec, ...]]] = {}
        """Node name -> its parsed input and output specs."""

    # ------------------------------------------------------------------ helpers
    def fail(self, node: Node, why: str) -> CertificateError:
        p = self.np.get(node.name)
        where = f" in {p.module}" if p is not None and p.module else ""
        op = op_name(node) if node.op == "call_function" else node.op
        return CertificateError(f"the plan does not hold at node {node.name} ({op}{where}): {why}; {_EDITED}")

    def axis_name(self, a: int) -> str:
        names = self.plan.mesh_axes
        return f"mesh axis {a} ({names[a]})" if a < len(names) else f"mesh axis {a}"

    def parsed(self, node: Node, p: NodePlan) -> tuple[tuple[Spec | None, ...], tuple[Spec, ...]]:
        """``p``'s specs, checked for form against the node: one per tensor input and output."""
        got = self.specs.get(node.name)
        if got is not None:
            return got
        ins, outs = tensor_inputs(node), tensor_outputs(node)
        if len(p.inputs) != len(ins):
            raise self.fail(
                node, f"the plan gives {len(p.inputs)} input specs, the op has {len(ins)} tensor inputs"
            )
        if len(p.outputs) != len(outs):
            raise self.fail(
                node, f"the plan gives {len(p.outputs)} output specs, the op has {len(outs)} tensor outputs"
            )
        for field, v in (("rewrites", p.rewrites), ("comms", p.comms), ("split", p.split)):
            if len(v) != self.ndim:
                raise self.fail(node, f"its {field} has {len(v)} entries, the mesh {self.ndim} axes")
        got = (
            tuple(None if s is None else parse_spec(s) for s in p.inputs),
            tuple(parse_spec(s) for s in p.outputs),
        )
        self.specs[node.name] = got
        return got

    def out_spec(self, node: Node) -> Spec:
        """The spec ``node``'s (first) output has in the plan; whole tensors where it has none."""
        p = self.np.get(node.name)
        if p is None:
            return tuple(Replicate() for _ in self.mesh)
        return self.parsed(node, p)[1][0]

    def rewrites(self, node: Node, p: NodePlan) -> tuple[Rewrite, ...]:
        try:
            return tuple(Rewrite(r) for r in p.rewrites)
        except ValueError:
            known = ", ".join(repr(str(r)) for r in Rewrite)
            raise self.fail(
                node, f"its rewrites {p.rewrites} name an unknown rewrite (known: {known})"
            ) from None

    # ------------------------------------------------------------------ 1. strategies
    def check_divides(self, node: Node, ins: tuple[Spec | None, ...], outs: tuple[Spec, ...]) -> None:
        shapes = [tuple(i.meta["val"].shape) for i in tensor_inputs(node)]
        for what, specs, shs in (
            ("input", ins, shapes),
            ("output", outs, [tuple(o.shape) for o in tensor_outputs(node)]),
        ):
            for j, (spec, shape) in enumerate(zip(specs, shs)):
                if spec is None:
                    continue
                blocked = [x.dim for x in spec if isinstance(x, Shard) and x.blocks > 1]
                sharded = [x.dim for x in spec if isinstance(x, Shard)]
                if not divides(shape, spec, self.mesh) or any(sharded.count(d) != 1 for d in blocked):
                    raise self.fail(
                        node,
                        f"its {what} {j} of shape {shape} does not divide into equal pieces as "
                        f"{','.join(format_spec(spec))} on the mesh {self.mesh}",
                    )

    def check_strategy(self, node: Node, p: NodePlan) -> None:
        """An op's or placeholder's strategy: per axis one of its rule's, dividing every tensor."""
        ins, outs = self.parsed(node, p)
        rewrites = self.rewrites(node, p)
        allowed = axis_strategies(node, self.hints)
        allowed_set = set(allowed)
        for a in range(self.ndim):
            s = AxisStrategy(
                tuple(None if sp is None else sp[a] for sp in ins),
                tuple(sp[a] for sp in outs),
                rewrites[a],
                p.comms[a],
            )
            if s not in allowed_set:
                same_in = [x for x in allowed if x.inputs == s.inputs]
                if not same_in:
                    why = (
                        f"along {self.axis_name(a)} its op cannot read its inputs as {_fmt_axis(s.inputs)}"
                        f" (it reads {', '.join(sorted({_fmt_axis(x.inputs) for x in allowed}))})"
                        if ins
                        else f"along {self.axis_name(a)} it cannot be laid out as {_fmt_axis(s.outputs)}"
                        f" (its layouts: {', '.join(_fmt_axis(x.outputs) for x in allowed)})"
                    )
                else:
                    gives = "; ".join(
                        _fmt_axis(x.outputs)
                        + (f" rewritten {x.rewrite}" if x.rewrite else "")
                        + (f" with {x.comm}" if x.comm else "")
                        for x in same_in
                    )
                    extra = (f" rewritten {s.rewrite}" if s.rewrite else "") + (
                        f" with {s.comm}" if s.comm else ""
                    )
                    why = (
                        f"along {self.axis_name(a)} its inputs {_fmt_axis(s.inputs)} give {gives}, "
                        f"not {_fmt_axis(s.outputs)}{extra} as the plan says"
                    )
                raise self.fail(node, why)
            if bool(p.split[a]) != s.split:
                raise self.fail(
                    node,
                    f"its work is {'split' if p.split[a] else 'not split'} along {self.axis_name(a)} in the plan, "
                    f"but its placements there say it is {'split' if s.split else 'not split'}",
                )
        self.check_divides(node, ins, outs)
        self.check_zero(node, p, outs)

    def check_zero(self, node: Node, p: NodePlan, outs: tuple[Spec, ...]) -> None:
        sharded_param = (
            node.op == "placeholder"
            and node.name in self.params
            and any(isinstance(x, Shard) for x in outs[0])
        )
        if p.zero_stage not in ((0, 1, 2, 3) if sharded_param else (0,)):
            raise self.fail(
                node,
                f"it has ZeRO stage {p.zero_stage}, which only a sharded parameter has (1, 2 or 3)"
                if sharded_param is False
                else f"ZeRO stage {p.zero_stage} does not exist (1, 2 or 3)",
            )

    def check_getitem(self, node: Node, p: NodePlan) -> None:
        """A ``getitem`` reads one output of its producer, as it is."""
        src = node.args[0]
        if len(p.inputs) != 1 or len(p.outputs) != 1 or p.inputs[0] is None:
            raise self.fail(node, "a getitem has one input spec and one output spec")
        ins, outs = (parse_spec(p.inputs[0]),), (parse_spec(p.outputs[0]),)
        self.specs[node.name] = (ins, outs)
        sp = self.np.get(src.name)
        if sp is None:
            raise self.fail(node, f"its producer {src.name} has no strategy in the plan")
        pos = _output_position(src, node.args[1])
        given = self.parsed(src, sp)[1][pos]
        if ins != (given,) or outs != (given,):
            raise self.fail(
                node,
                f"it takes output {pos} of {src.name} as it is, {','.join(format_spec(given))}, but the plan reads it "
                f"as {_fmt(ins)} and gives {_fmt(outs)}",
            )
        if any(self.rewrites(node, p)) or any(p.comms) or any(p.split) or p.zero_stage:
            raise self.fail(node, "a getitem has no rewrite, in-op collective, split work or ZeRO stage")

    def check_region(self, region: MoERegion) -> None:
        """The members of a mixture-of-experts region take one of the region's joint strategies."""
        built = region_strategies(region, self.mesh)
        common: set[int] | None = None
        for m in region.members:
            if op_name(m) == "getitem":
                continue  # passes its producer's output on, as any getitem (``check_getitem``)
            p = self.np.get(m.name)
            if p is None:
                raise self.fail(m, "a mixture-of-experts region's member has no strategy in the plan")
            ins, outs = self.parsed(m, p)
            key = (ins, outs, self.rewrites(m, p), tuple(p.comms), tuple(bool(x) for x in p.split))
            ks = {
                k
                for k, s in enumerate(built[m])
                if (s.inputs, s.outputs, tuple(s.rewrites), tuple(s.comms), tuple(s.split)) == key
            }
            if not ks:
                raise self.fail(
                    m,
                    f"inputs {_fmt(ins)} to outputs {_fmt(outs)} is none of the layouts its mixture-of-experts "
                    f"region (from {region.sort.name}) allows it",
                )
            common = ks if common is None else common & ks
            if not common:
                raise self.fail(
                    m,
                    f"its layout belongs to another of its mixture-of-experts region's modes than the members "
                    f"before it (the region from {region.sort.name} is laid out as one)",
                )
            if p.zero_stage:
                raise self.fail(m, "only a sharded parameter has a ZeRO stage")

    # ------------------------------------------------------------------ 2. reshards
    def check_reshards(self, edges: dict[tuple[str, str], tuple[Spec, Spec]], nodes: dict[str, Node]) -> None:
        seen: set[tuple[str, str]] = set()
        for r in self.plan.reshards:
            key = (r.producer, r.consumer)
            consumer = nodes.get(r.consumer)
            if consumer is None or r.producer not in nodes:
                gone = r.consumer if consumer is None else r.producer
                raise CertificateError(
                    f"the plan's reshard {r.producer} -> {r.consumer} names {gone}, which is not in this program: "
                    f"{_EDITED}"
                )
            if key not in edges:
                raise self.fail(
                    consumer,
                    f"the plan reshards {r.producer} for it, but it does not read {r.producer} as planned",
                )
            if key in seen:
                raise self.fail(consumer, f"the plan lists two reshards of {r.producer} for it")
            seen.add(key)
            src, dst = edges[key]
            try:
                rsrc, rdst = parse_spec(r.src), parse_spec(r.dst)
            except ValueError as e:
                raise self.fail(consumer, f"its reshard of {r.producer}: {e}") from None
            if rsrc != src:
                raise self.fail(
                    consumer,
                    f"the reshard of its input {r.producer} starts from {','.join(format_spec(rsrc))}, but "
                    f"{r.producer} gives {','.join(format_spec(src))}",
                )
            if rdst != dst:
                raise self.fail(
                    consumer,
                    f"the reshard of its input {r.producer} ends at {','.join(format_spec(rdst))}, but it reads "
                    f"{r.producer} as {','.join(format_spec(dst))}",
                )
        for (prod, cons), (src, dst) in edges.items():
            if src != dst and (prod, cons) not in seen:
                raise self.fail(
                    nodes[cons],
                    f"it reads {prod} as {','.join(format_spec(dst))}, {prod} gives {','.join(format_spec(src))}, "
                    f"and the plan has no reshard between them",
                )

    # ------------------------------------------------------------------ the walk
    def run(self) -> None:
        nodes = {n.name: n for n in self.graph.nodes}
        for name in self.np:
            if name not in nodes:
                raise CertificateError(f"the plan's node {name} is not in this program: {_EDITED}")
        edges: dict[tuple[str, str], tuple[Spec, Spec]] = {}
        regions_done: set[int] = set()
        for node in self.graph.nodes:
            if node.op not in ("placeholder", "call_function"):
                continue
            p = self.np.get(node.name)
            if p is None:
                if node.op == "call_function" and op_name(node) == "getitem":
                    src = node.args[0]
                    sp = self.np.get(src.name)
                    given = self.parsed(src, sp)[1] if sp is not None and tensor_outputs(node) else ()
                    pos = _output_position(src, node.args[1])
                    if pos < len(given) and any(not isinstance(x, Replicate) for x in given[pos]):
                        raise self.fail(
                            node,
                            f"the plan gives it no strategy, so it passes on a whole tensor, but output {pos} "
                            f"of {src.name} is laid out as {','.join(format_spec(given[pos]))}",
                        )
                elif (
                    node.op == "call_function"
                    and op_family(node) is not OpFamily.ASSERT
                    and tensor_outputs(node)
                ):
                    for i in tensor_inputs(node):
                        spec = self.out_spec(i)
                        if any(not isinstance(x, Replicate) for x in spec):
                            raise self.fail(
                                node,
                                f"the plan gives it no strategy, so it runs on whole tensors, but it reads "
                                f"{i.name} laid out as {','.join(format_spec(spec))}",
                            )
                continue
            if node.op == "call_function" and op_name(node) == "getitem":
                self.check_getitem(node, p)
                continue  # it reads its producer's output as it is: no reshard
            elif node in self.region_of:
                region = self.region_of[node]
                if id(region) not in regions_done:
                    regions_done.add(id(region))
                    self.check_region(region)
            else:
                self.check_strategy(node, p)
            ins = self.parsed(node, p)[0]
            for i, dst in zip(tensor_inputs(node), ins):
                if dst is None or i.name not in self.np or not isinstance(i.meta.get("val"), torch.Tensor):
                    continue
                edges[(i.name, node.name)] = (self.out_spec(i), dst)
        self.check_reshards(edges, nodes)
        self.check_tables(nodes)

    # ------------------------------------------------------------------ 4. tables
    def check_tables(self, nodes: dict[str, Node]) -> None:
        for p in self.plan.nodes:
            if p.kind not in ("param", "input"):
                continue
            table = self.plan.params if p.kind == "param" else self.plan.inputs
            if p.fqn in table and parse_spec(table[p.fqn]) != self.out_spec(nodes[p.name]):
                raise self.fail(
                    nodes[p.name],
                    f"the plan's {p.kind}s table places {p.fqn} as {','.join(table[p.fqn])}, its node as "
                    f"{','.join(p.outputs[0])}",
                )


def _output_position(src: Node, idx: int) -> int:
    """Which of ``src``'s tensor outputs its output ``idx`` is (non-tensor outputs skipped)."""
    pos = 0
    for i, v in enumerate(src.meta.get("val") or ()):
        if i == idx:
            return pos
        if isinstance(v, torch.Tensor):
            pos += 1
    return pos


def certify(graph: Graph, plan: Plan, params: Sequence[str] | set[str] = ()) -> None:
    """Raise ``CertificateError`` naming the first node where ``plan`` is not a plan autopar could
    have made for ``graph`` (module docstring); return ``None`` where it holds. ``params``: the
    placeholder names that are parameters (``Captured.params``), which alone may have a ZeRO
    stage. Pure: every rank gives the same answer."""
    _Certifier(graph, plan, set(params)).run()
