"""Lowering: the captured global graph + a Plan → this rank's program over local shards.

The per-rank program is a new ``torch.fx.GraphModule`` (printable with ``.code``) in which

* every op runs on local shards, its arguments rewritten where sharding changes them: shape
  arguments of views/expands/``new_*`` become the local output shape, ``split`` sizes the local
  sizes, and ops with a ``rewrite`` tag in the plan are replaced by their local form
  (``autopar.program.local_ops``, emitted by ``passes.lower_local``: vocabulary-parallel
  embedding, sharded cross-entropy, mean over a sharded dimension); ``device=`` arguments name the
  rank's device;
* every reshard the plan implies is a sequence of collective nodes (``autopar.program.collectives``),
  one per step of ``autopar.reshard.reshard_steps``, on the ``AxisGroup`` of its mesh axis
  (``self._ax{i}`` in the generated code);
* a replicated value read by an op that splits work along an axis passes through ``grad_sync``
  (identity forward, all-reduce of the gradient backward: Megatron-LM's ``f``) — once per value
  and set of axes, however many consumers share it; when the value was just all-gathered along that
  axis the all-gather's backward becomes a reduce-scatter instead (``grad_partial=True``); a weight
  whose gradient is partial as a whole (data parallelism) is synced once, at the weight itself
  (``plan_param_syncs``), so its all-reduce is the last thing its gradient goes through: the
  bucketing pass (``passes.overlap.bucket_gradients``) merges those into buckets;
* outputs are resharded to ``Replicate`` (``gather_outputs``), so the program returns what the
  model returns.

Lowering never imports the solver: it reads only the Plan (JSON) and the captured graph.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.fx import Graph, GraphModule, Node

from autopar.capture import Captured
from autopar.graph import op_info, op_name, tensor_inputs, tensor_outputs, written_inputs
from autopar.ir import Rewrite
from autopar.passes.lower_local import EXPERT_REWRITES, LOCAL_OPS, LocalOps, out_of_place
from autopar.passes.param_syncs import dropped, weight_syncs
from autopar.passes.plan_check import LoweringError, check_plan
from autopar.placement import (
    Partial,
    Replicate,
    Shard,
    Spec,
    format_spec,
    local_shape,
    parse_spec,
)
from autopar.planfile import NodePlan, Plan
from autopar.program import collectives as C
from autopar.program.collectives import AxisGroup
from autopar.reshard import (
    BroadcastChain,
    StepKind,
    broadcast_chain,
    grad_sync_axes,
    lift_placement,
    moved_before_broadcast,
    reshard_steps,
)

__all__ = ["LOCAL_OPS", "LoweringError", "lower"]

aten = torch.ops.aten
_PURE_VIEWS = (aten.expand.default, aten.reshape.default, aten.view.default, aten.unsqueeze.default)
"""Ops ``drop_unread`` may remove where nothing reads them (no side effect, no collective)."""


class _Lowerer(LocalOps):
    def __init__(
        self,
        cap: Captured,
        plan: Plan,
        axes: Sequence[AxisGroup],
        device: torch.device,
        gather_outputs: bool,
        stage_of: dict[str, int] | None = None,
    ):
        self.cap = cap
        self.stage_of = dict(stage_of or {})
        self.pstage = 0
        """The pipeline stage of the node being lowered (memo tables are per stage, so no derived
        value crosses a stage boundary except the activations that must)."""
        self.param_values: dict[tuple[Node, int], Node] = {}
        self.plan = plan
        self.axes = list(axes)
        self.mesh = tuple(plan.mesh_shape)
        self.coord = tuple(ax.coord for ax in axes)
        self.device = device
        self.gather_outputs = gather_outputs
        self.np: dict[str, NodePlan] = {n.name: n for n in plan.nodes}
        self.g = Graph()
        self.env: dict[Node, Node] = {}
        self.ax_nodes: dict[int | str, Node] = {}
        self.reshard_memo: dict[tuple, Node] = {}
        self.unread: list[Node] = []  # repeats lowered on local pieces, read no more (drop_unread)
        self.sync_memo: dict[tuple, Node] = {}
        self.root = nn.Module()
        for i, ax in enumerate(self.axes):
            setattr(self.root, f"_ax{i}", ax)
        self.gathered = C.GatheredParams()
        self.root._gathered_params = self.gathered
        self.store_node: Node | None = None
        self.routes: dict[Node, Node] = {}
        """A MoE region's counts (captured node) -> its route in this program (``lower_experts``)."""
        self.dispatched: set[Node] = set()
        """Captured nodes whose local value is rows dispatched to this device's experts."""
        self.bucketed_values: set[tuple[Node, tuple[int, ...]]] = set()
        self.param_syncs: dict[str, tuple[int, ...]] = {}
        """Parameter placeholder name -> axes its gradient is all-reduced over at the weight."""

    # -------------------------------------------------------------- helpers
    def ax(self, a: int) -> Node:
        if a not in self.ax_nodes:
            with self.g.inserting_before(self._first_non_placeholder()):
                self.ax_nodes[a] = self.g.get_attr(f"_ax{a}")
        return self.ax_nodes[a]

    def sync_groups(self, axes: Sequence[int]) -> tuple[Node, ...]:
        """The groups a gradient partial on ``axes`` is all-reduced over: one group spanning them
        all where the mesh made it (``AxisGroup.combined``), as ``autopar.cost`` prices it (one
        collective, bucketed with the others over the same axes), else one per axis."""
        key = tuple(sorted(axes))
        combined = self.axes[0].combined.get(key) if len(key) > 1 and self.axes else None
        if combined is None:
            return tuple(self.ax(a) for a in key)
        attr = "_ax" + "_".join(str(a) for a in key)
        if attr not in self.ax_nodes:
            setattr(self.root, attr, combined)
            with self.g.inserting_before(self._first_non_placeholder()):
                self.ax_nodes[attr] = self.g.get_attr(attr)
        return (self.ax_nodes[attr],)

    def store(self) -> Node:
        if self.store_node is None:
            with self.g.inserting_before(self._first_non_placeholder()):
                self.store_node = self.g.get_attr("_gathered_params")
        return self.store_node

    def _first_non_placeholder(self) -> Node | None:
        for n in self.g.nodes:
            if n.op != "placeholder":
                return n
        return None

    def spec_out(self, node: Node, index: int = 0) -> Spec:
        p = self.np.get(node.name)
        if p is None:
            return tuple(Replicate() for _ in self.mesh)
        return parse_spec(p.outputs[index])

    def fail(self, node: Node, msg: str) -> LoweringError:
        return LoweringError(f"cannot lower {node.format_node()}: {msg}")

    # -------------------------------------------------------------- reshards
    def local_input(self, producer: Node, dst: Spec, split: Sequence[bool]) -> Node:
        """``producer``'s local value laid out as ``dst`` (+ gradient sync for split consumers)."""
        src = self.spec_out(producer)
        val = producer.meta["val"]
        # A collective over an axis of one device moves nothing: such steps and syncs are left out.
        steps = [st for st in reshard_steps(tuple(val.shape), src, dst, self.mesh) if self.mesh[st.axis] > 1]
        pplan = self.np.get(producer.name)
        stage = pplan.zero_stage if pplan is not None and pplan.kind == "param" else 0
        sync = {a for a in grad_sync_axes(split, dst, val.is_floating_point()) if self.mesh[a] > 1}
        last = {s.axis: s for s in steps}
        # A gathered weight's gradient is reduce-scattered to its shard (ZeRO-1, 2 and 3 alike:
        # ``autopar.cost.reshard.edge_cost``).
        fused = frozenset(a for a in sync if a in last and last[a].kind == StepKind.ALL_GATHER)
        key = (producer, dst, fused, self.pstage)
        value = self.reshard_memo.get(key)
        chain = broadcast_chain(producer)
        if value is None and moved_before_broadcast(chain, steps) and chain.expand.name in self.np:
            value = self.reshard_memo[key] = self.moved_before_repeat(chain, dst, fused)
        if value is None:
            value = self.param_value(producer)
            zero3 = stage == 3
            for n_step, st in enumerate(steps):
                if (
                    zero3
                    and st.kind == StepKind.ALL_GATHER
                    and all(o.kind == StepKind.SLICE for o in steps[:n_step])
                ):
                    # The parameter's first collective, a gather (after any local slice): its full
                    # copy is freed after use (ZeRO-3).
                    kw = {
                        "dim": st.dim,
                        "blocks": st.blocks,
                        "grad_partial": st.axis in fused and st is last[st.axis],
                    }
                    value = self.g.call_function(
                        C.all_gather_param, (value, self.ax(st.axis), self.store()), kw
                    )
                    self.gathered.used = True
                    continue
                fn, kw = C.step_call(st, grad_partial=st.axis in fused and st is last[st.axis])
                value = self.g.call_function(fn, (value, self.ax(st.axis)), kw)
            self.reshard_memo[key] = value
        rest = tuple(sorted(sync - fused))
        if not rest or (not steps and (producer, rest) in self.bucketed_values):
            return value  # nothing to sync, or the weight itself is synced (``plan_param_syncs``)
        skey = (value, rest, self.pstage)
        synced = self.sync_memo.get(skey)
        if synced is None:
            synced = self.g.call_function(C.grad_sync, (value, *self.sync_groups(rest)))
            self.sync_memo[skey] = synced
        return synced

    def moved_before_repeat(self, chain: BroadcastChain, dst: Spec, fused: frozenset[int]) -> Node:
        """A repeated value (``chain``: grouped-query attention's key-value heads) resharded before
        its repeat: the expand's local input gathered, or reordered by all-to-all, on the axes
        where ``dst`` differs from the repeat's own spec, to the same split one dimension over
        (``autopar.reshard.lift_placement``; its gradient reduce-scattered on ``fused``), then
        broadcast and merged again at the new shape (``autopar.reshard.BroadcastChain``; the cost
        model prices the same). The repeat the walk lowered on the local pieces is left unread and
        removed at the end (``drop_unread``)."""
        lowered = self.env[chain.expand]
        value = lowered.args[0]
        src5 = parse_spec(self.np[chain.expand.name].inputs[0])
        own = self.spec_out(chain.reshape)
        dst5 = tuple(p if dst[a] == own[a] else lift_placement(dst[a], chain) for a, p in enumerate(src5))
        shape5 = tuple(chain.unsqueeze.meta["val"].shape)
        steps = [st for st in reshard_steps(shape5, src5, dst5, self.mesh) if self.mesh[st.axis] > 1]
        last = {st.axis: st for st in steps}
        for st in steps:
            fn, kw = C.step_call(st, grad_partial=st.axis in fused and st is last[st.axis])
            value = self.g.call_function(fn, (value, self.ax(st.axis)), kw)
        expanded = local_shape(tuple(chain.expand.meta["val"].shape), dst5, self.mesh)
        value = self.g.call_function(aten.expand.default, (value, list(expanded)))
        merged = local_shape(tuple(chain.reshape.meta["val"].shape), dst, self.mesh)
        self.unread.extend([lowered.args[0], lowered, self.env[chain.reshape]][::-1])
        return self.g.call_function(aten.reshape.default, (value, list(merged)))

    def drop_unread(self) -> None:
        """Remove the repeats ``moved_before_repeat`` left unread (walked in use order: the
        reshape, then the expand, then what fed it), each only where nothing reads it."""
        for n in self.unread:
            if n.graph is self.g and not n.users and n.op == "call_function" and n.target in _PURE_VIEWS:
                self.g.erase_node(n)

    def param_value(self, producer: Node) -> Node:
        """The value a consumer reads for ``producer``: a data-parallel weight synced at the weight
        (``plan_param_syncs``) gets its ``grad_sync`` here, once per pipeline stage that reads it."""
        axes = self.param_syncs.get(producer.name) if producer.op == "placeholder" else None
        axes = tuple(a for a in axes or () if self.mesh[a] > 1)
        if not axes:
            return self.env[producer]
        key = (producer, self.pstage)
        if key not in self.param_values:
            self.param_values[key] = self.g.call_function(
                C.grad_sync, (self.env[producer], *self.sync_groups(axes))
            )
        return self.param_values[key]

    def _tag(self, source: Node) -> None:
        """Mark the nodes just emitted for ``source`` with it and its pipeline stage."""
        for n in reversed(self.g.nodes):
            if "autopar.source" in n.meta or n.op == "placeholder":
                break
            if n.op == "get_attr" and n.target.startswith(("_ax", "_gathered_params")):
                continue
            n.meta["autopar.source"] = source.name
            n.meta["autopar.stage"] = self.pstage
            # Kept by the joint trace (``torch.fx.traceback.preserve_node_meta``).
            n.meta["custom"] = {"autopar.source": source.name}

    # -------------------------------------------------------------- main walk
    def plan_param_syncs(self) -> None:
        """The weights whose gradient is synced at the weight itself (``passes.param_syncs``)."""
        self.bucketed_values, self.param_syncs = weight_syncs(self.cap.graph, self.cap.params, self.plan)

    def run(self) -> GraphModule:
        self.plan_param_syncs()
        for node in self.cap.graph.nodes:
            if node.op in ("call_function", "output"):
                self.pstage = self.stage_of.get(node.name, self.pstage)
            if node.op == "placeholder":
                self.env[node] = self.g.placeholder(node.name)
            elif node.op == "get_attr":
                obj = _fetch(self.cap.gm, node.target)
                _install(self.root, node.target, obj)
                self.env[node] = self.g.get_attr(node.target)
            elif node.op == "call_function":
                self.lower_call(node)
                self._tag(node)
            elif node.op == "output":
                self.lower_output(node)
                self._tag(node)
            else:
                raise self.fail(node, f"unsupported node kind {node.op}")
        self.drop_unread()
        self.g.lint()
        gm = GraphModule(self.root, self.g, class_name="RankProgram")
        gm._gathered_params = self.gathered  # read by ParallelModule even when no node uses it
        return gm

    def lower_call(self, node: Node) -> None:
        name = op_name(node)
        if dropped(node):
            return
        p = self.np.get(node.name)
        if node.target is operator.getitem:
            src = node.args[0]
            self.env[node] = self.g.call_function(operator.getitem, (self.env[src], node.args[1]))
            return
        if p is None:
            # No tensor output recorded in the plan (e.g. a symbolic-size op): copy as is.
            self.env[node] = self.g.node_copy(node, lambda n: self.env[n])
            return
        ins = tensor_inputs(node)
        if len(ins) != len(p.inputs):
            raise self.fail(node, f"plan lists {len(p.inputs)} tensor inputs, graph has {len(ins)}")
        local: dict[Node, Node] = {}
        split = p.split
        written = written_inputs(node)
        for i, spec in zip(ins, p.inputs):
            if spec is None:
                local[i] = self.env[i]
                continue
            if i in written and i.op == "placeholder" and parse_spec(spec) != self.spec_out(i):
                raise self.fail(
                    node,
                    f"it writes into {i.name} in place, but the plan reshards it from "
                    f"{format_spec(self.spec_out(i))} to {spec}: the write would land in a copy and be lost "
                    f"(plan again: the planner keeps such inputs in their stored layout)",
                )
            local[i] = self.local_input(i, parse_spec(spec), split)
        args = torch.fx.node.map_arg(node.args, lambda n: local.get(n, self.env.get(n)))
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: local.get(n, self.env.get(n)))
        kwargs = dict(kwargs)
        if "device" in kwargs:
            kwargs["device"] = self.device
        out_specs = [parse_spec(s) for s in p.outputs]
        outs = tensor_outputs(node)
        out_local = [local_shape(tuple(o.shape), s, self.mesh) for o, s in zip(outs, out_specs)]
        sharded_out = any(isinstance(x, Shard) for s in out_specs for x in s)
        rewrites = {Rewrite(r) for r in p.rewrites} - {Rewrite.NONE, Rewrite.SPLIT_LOCAL}
        shape_arg = op_info(name).shape_arg
        if shape_arg is not None and sharded_out:
            args = list(args)
            args[shape_arg] = list(out_local[0])
            args = tuple(args)
        if name == "unflatten" and sharded_out:
            # A negative dim counts from the end of the *input*, which has len(sizes) - 1 fewer dims.
            dim = args[1] % (len(out_local[0]) - len(args[2]) + 1)
            args = (args[0], args[1], list(out_local[0][dim : dim + len(args[2])]))
        if name in ("split", "split_with_sizes") and sharded_out:
            dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
            dim = dim % len(out_local[0])
            sizes = [s[dim] for s in out_local]
            if name == "split":
                args = (args[0], sizes[0], *args[2:])
            else:
                args = (args[0], sizes, *args[2:])
        if name == "arange" and sharded_out and len(args) == 1:
            args = (out_local[0][0],)  # positions of this device's rows (a MoE region's inverse)
        if shape_arg is not None and any(i in self.dispatched for i in ins):
            args = list(args)  # dispatched rows: as many as this device received
            args[shape_arg] = [-1, *list(args[shape_arg])[1:]]
            args = tuple(args)
        if rewrites:
            (kind,) = {LOCAL_OPS[r] for r in rewrites}  # one local op per node, on any number of axes
            self.env[node] = kind(self, node, p, args, kwargs, ins)
        else:
            target = out_of_place(node)
            if target is aten.view.default:
                # A captured ``view`` holds for the strides seen at capture; here its input may come
                # from a collective, a local op or a kernel with another layout (SDPA's output is
                # [b, t, h, d]-strided on one path, contiguous on another): ``reshape`` views when
                # it can and copies when it must.
                target = aten.reshape.default
            self.env[node] = self.g.call_function(target, tuple(args), kwargs)
        if rewrites & {Rewrite.EXPERT_DISPATCH, Rewrite.EXPERT_LOCAL} or (
            not rewrites & EXPERT_REWRITES and any(i in self.dispatched for i in ins)
        ):
            self.dispatched.add(node)

    def lower_output(self, node: Node) -> None:
        replicated = tuple(Replicate() for _ in self.mesh)
        no_split = tuple(False for _ in self.mesh)
        # Unequal data-parallel shares (``PipelinePlan.dp_shares``): the ranks along the first axis
        # run different numbers of micro-batches, so a loss partial over it stays partial — the
        # pipeline runner sums the parts once per step (``autopar.runtime.pipeline_runner``).
        pipe = self.plan.pipeline
        shares = pipe is not None and bool(pipe.dp_shares)

        def out(n: Node) -> Node:
            val = n.meta.get("val")
            if not isinstance(val, torch.Tensor):
                return self.env[n]
            if shares and val.dim() == 0 and isinstance(self.spec_out(n)[0], Partial):
                return self.local_input(n, (self.spec_out(n)[0], *replicated[1:]), no_split)
            if self.gather_outputs or val.dim() == 0:
                return self.local_input(n, replicated, no_split)
            return self.env[n]

        self.g.output(torch.fx.node.map_arg(node.args[0], out))


def _fetch(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _install(root: nn.Module, target: str, obj: Any) -> None:
    *path, last = target.split(".")
    mod = root
    for part in path:
        if not hasattr(mod, part):
            mod.add_module(part, nn.Module())
        mod = getattr(mod, part)
    if isinstance(obj, nn.Module):
        mod.add_module(last, obj)
    elif isinstance(obj, torch.Tensor):
        mod.register_buffer(last, obj, persistent=False)
    else:
        setattr(mod, last, obj)


def lower(
    cap: Captured,
    plan: Plan,
    axes: Sequence[AxisGroup],
    device: torch.device | str = "cpu",
    gather_outputs: bool = True,
    stage_of: dict[str, int] | None = None,
    certify: bool = True,
) -> GraphModule:
    """This rank's program (see module docstring). ``axes[i]`` is mesh axis ``i`` as this rank sees
    it. ``stage_of``: captured node name -> pipeline stage; every emitted node is tagged with its
    stage (``meta["autopar.stage"]``) and source node (``meta["autopar.source"]``) for
    ``passes.stage_cut.cut_stages``. ``check_plan`` (``passes.plan_check``) runs first; ``certify=False`` leaves out its
    certificate check (where the caller has made it)."""
    check_plan(cap, plan, certify)
    if len(axes) != len(plan.mesh_shape) or any(ax.size != n for ax, n in zip(axes, plan.mesh_shape)):
        raise LoweringError(f"axis groups {axes} do not match the plan's mesh {plan.mesh_shape}")
    return _Lowerer(cap, plan, axes, torch.device(device), gather_outputs, stage_of).run()
