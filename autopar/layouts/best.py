"""``best_megatron``: the fastest Megatron-LM layout that fits, found as an expert tunes its knobs
(``KNOBS``), each candidate a ``megatron`` layout planned and scored by the simulator; the search
and its pruning are in ``best_megatron``'s docstring.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.fx import Node

from autopar.audit import audited
from autopar.capture import Captured
from autopar.cluster import Cluster
from autopar.config import PlanConfig
from autopar.cost.compute import itemsize
from autopar.cost.memory import StateBytes, state_bytes_per_param
from autopar.graph import OpFamily, op_family
from autopar.ir import TENSOR
from autopar.layouts.megatron_layout import block_recompute_layers, megatron, megatron_pipelined
from autopar.layouts.roles import expert_weights, megatron_weight_roles
from autopar.layouts.static_bytes import megatron_static_bytes
from autopar.microbatch import MicrobatchCaptures
from autopar.passes import PassContext, run_passes
from autopar.passes.annotate import annotate_tensors
from autopar.passes.strategies import repeated_layers
from autopar.planfile import Plan
from autopar.planner import InfeasibleError

__all__ = ["KNOBS", "MegatronSearch", "best_megatron"]

log = logging.getLogger("autopar.layouts.best")


KNOBS = {
    "tp": "tp",
    "pp": "pp",
    "ep": "ep",
    "cp": "cp",
    "microbatch_size": "mbs",
    "schedule": "schedule",
    "virtual": "v",
    "sequence_parallel": "sp",
    "recompute": "recompute",
    "recompute_num_layers": "recompute_num_layers",
    "distributed_optimizer": "distributed_optimizer",
}
"""The knobs ``best_megatron`` tunes (Megatron-LM's names) and their keys in
``plan.info["megatron_candidates"]``."""


@dataclass(eq=False)
class MegatronSearch:
    """One ``best_megatron`` run: the model, the knobs held, the candidates so far."""

    model: nn.Module
    example_inputs: Any
    cluster: Cluster
    config: PlanConfig
    fixed: dict[str, Any]
    args: tuple
    kwargs: dict
    captures: MicrobatchCaptures | None = None
    tried: list[dict[str, Any]] = field(default_factory=list)
    best: Plan | None = None

    @property
    def batch(self) -> int:
        """The global batch (sequences)."""
        from autopar.capture import batch_size

        return batch_size(self.args, self.kwargs) or 1

    def descent_ends(
        self, step: float, previous: float, none_fits: str, slower: str, rest: list[dict[str, Any]]
    ) -> bool:
        """Whether a descent along one knob ends at ``step``: nothing fits (``step`` infinite) or
        it is no faster than the ``previous`` value's; the ``rest`` of the knob's values (each a
        candidate's knobs) are then skipped, with why (``none_fits`` or ``slower``)."""
        if step < previous:
            return False
        for knobs in rest:
            self.skip(none_fits if step == math.inf else slower, **knobs)
        return True

    def options(self, name: str, values: list[Any]) -> list[Any]:
        """``values`` to try for knob ``name``, or the one value it is held at."""
        return [self.fixed[name]] if name in self.fixed else values

    def captured(self, m: int) -> Captured:
        """The model captured on one of ``m`` micro-batches (shared by every candidate)."""
        if self.captures is None:
            self.captures = MicrobatchCaptures(self.model, (self.args, self.kwargs))
        return self.captures(m)

    def skip(self, why: str, **knobs: Any) -> None:
        """Record candidates not planned: knobs not given are the held value or ``None`` (any)."""
        row = {key: self.fixed.get(name) for name, key in KNOBS.items()}
        self.tried.append({**row, **knobs, "feasible": False, "skipped": True, "why": why})

    def plan(self, knobs: dict[str, Any], m: int, schedules: list[tuple[str, int]]) -> float:
        """Plan one candidate (one stage plan, every schedule around it), record each schedule;
        the fastest step that fits (``inf`` where none does). ``knobs["recompute_num_layers"]``
        (full recomputation in the first ``N`` layers of each model chunk) cuts the chunks by
        ``pp · virtual``, so each schedule then has a stage plan of its own."""
        n = knobs.get("recompute_num_layers")
        if n is None:
            return self._plan(knobs, m, schedules, None)
        fastest = math.inf
        for schedule, v in schedules:
            config = self.config.replace(recompute="full", pp=1)
            try:
                layers = block_recompute_layers(self.captured(m), self.cluster, config, n, knobs["pp"] * v)
            except ValueError as e:
                self.tried.append(
                    {**knobs, "schedule": schedule, "v": v, "feasible": False, "why": str(e)[:200]}
                )
                continue
            fastest = min(fastest, self._plan(knobs, m, [(schedule, v)], layers))
        return fastest

    def _plan(
        self, knobs: dict[str, Any], m: int, schedules: list[tuple[str, int]], layers: tuple[int, ...] | None
    ) -> float:
        """``plan`` with the recomputed layers given (``None``: ``config.recompute_layers``)."""
        tp, pp, ep, sp, do = (knobs[k] for k in ("tp", "pp", "ep", "sp", "distributed_optimizer"))
        cp = knobs.get("cp", 1)
        world = self.cluster.world_size
        dp = world // (tp * pp * cp)
        if layers is None:
            layers = self.config.recompute_layers if knobs["recompute"] != "none" else None
        config = self.config.replace(recompute=knobs["recompute"], recompute_layers=layers, pp=1)
        t0 = time.perf_counter()
        try:
            if pp == 1 and m == 1:
                got: list[tuple[str, int, Plan | str]] = [("1f1b", 1, megatron(
                    self.model, self.example_inputs, self.cluster, tp, dp, sp, ep=ep, cp=cp, distributed_optimizer=do,
                    config=config, captured=self.captured(1),
                ))]  # fmt: skip
            else:
                got = megatron_pipelined(
                    self.model, self.example_inputs, self.cluster, tp, dp, sp, ep=ep, cp=cp, pp=pp, microbatches=m,
                    schedules=schedules, distributed_optimizer=do, config=config, captured=self.captured(m),
                )  # fmt: skip
        except (InfeasibleError, ValueError) as e:
            got = [(schedule, v, str(e)) for schedule, v in schedules]
        log.info("best_megatron: %s planned in %.1f s", knobs, time.perf_counter() - t0)
        fastest = math.inf
        for schedule, v, p in got:
            row = {**knobs, "schedule": schedule, "v": v}
            if isinstance(p, str):
                self.tried.append({**row, "feasible": False, "why": p.splitlines()[0][:200]})
                continue
            self.tried.append({**row, "feasible": True, "step_time": p.predicted.step_time})
            fastest = min(fastest, p.predicted.step_time)
            if self.best is None or p.predicted.step_time < self.best.predicted.step_time:
                self.best = p
        return fastest

    def recompute_ladder(
        self, base: dict[str, Any], m: int, schedules: list[tuple[str, int]], optimizers: list[bool]
    ) -> tuple[float, int]:
        """Pruning 2: recomputation levels lightest first, stopping at the first that fits, the
        distributed optimizer only where the layout does not fit without it; where that level is
        full recomputation, the fewest layers recomputing that fit (``fewest_layers``). The
        fastest step and the index of the level that fit (``inf, -1`` where none does)."""
        held = self.fixed.get("recompute_num_layers")
        levels = self.options("recompute", ["none", "selective", "full"] if held is None else ["full"])
        for k, rc in enumerate(levels):
            step = math.inf
            for do in optimizers:
                knobs = {**base, "recompute": rc, "distributed_optimizer": do}
                if rc == "full" and held is not None:
                    knobs["recompute_num_layers"] = held
                if step < math.inf:
                    self.skip(f"fits without the distributed optimizer at recompute={rc} (rule 2)", **knobs)
                    continue
                step = self.plan(knobs, m, schedules)
            if step < math.inf:
                for heavier in levels[k + 1 :]:
                    self.skip(f"recompute={rc} fits with the same knobs (rule 2)", **base, recompute=heavier)
                if rc == "full" and "recompute_num_layers" not in self.fixed:
                    # with the distributed optimizer where allowed: more room for activations
                    knobs = {**base, "recompute": rc, "distributed_optimizer": max(optimizers)}
                    step = min(step, self.fewest_layers(knobs, m, schedules))
                return step, k
        return math.inf, -1

    def fewest_layers(self, knobs: dict[str, Any], m: int, schedules: list[tuple[str, int]]) -> float:
        """Pruning 2, block recomputation: where full recomputation in every layer is the lightest
        level that fits, Megatron-LM's ``--recompute-method block --recompute-num-layers N``
        (the first ``N`` layers of each model chunk), ``N`` the fewest that fit, found by bisection
        for each schedule (memory rises and time falls as ``N`` falls; ``N`` = the chunk is every
        layer, already planned). The fastest step found (``inf`` where no ``N`` fits)."""
        cap = self.captured(m)
        run_passes(
            cap.gm, PassContext(captured=cap, cluster=self.cluster, config=self.config), [annotate_tensors]
        )
        total = len(repeated_layers(cap.gm.graph))
        fastest = math.inf
        for schedule, v in schedules:
            stages = knobs["pp"] * v
            if total < 2 or total % stages:
                continue
            lo, hi = 1, total // stages  # hi: every layer of the chunk, which fits
            while lo < hi:
                mid = (lo + hi) // 2
                step = self.plan({**knobs, "recompute_num_layers": mid}, m, [(schedule, v)])
                if step < math.inf:
                    hi, fastest = mid, min(fastest, step)
                else:
                    lo = mid + 1
        return fastest

    def tune_stage(
        self, tp: int, pp: int, ep: int, optimizers: list[bool], moe: bool, cp: int = 1
    ) -> tuple[float, bool]:
        """Sequence parallelism (pruning 3), micro-batch size (pruning 4), recomputation and the
        distributed optimizer for one ``(tp, pp, ep, cp)``: the fastest step (``inf`` where
        nothing fits), and whether a candidate fits at the lightest recomputation tried."""
        dp = self.cluster.world_size // (tp * pp * cp)
        per_rank = self.batch // dp
        light, fastest = False, math.inf
        sps = [True] if moe and tp > 1 else ([False, True] if tp > 1 else [False])
        for sp in self.options("sequence_parallel", sps):
            # One stage: gradient accumulation over micro-batches of 1, 2, 4, 8 sequences, or the
            # whole per-rank batch at once.
            mbss = (
                sorted({b for b in (1, 2, 4, 8) if per_rank % b == 0} | {per_rank})
                if pp == 1
                else [b for b in (1, 2, 4, 8) if per_rank % b == 0 and per_rank // b >= pp]
            )
            mbss = self.options("microbatch_size", mbss)
            previous = math.inf
            for i, mbs in enumerate(mbss):
                base = {"tp": tp, "pp": pp, "ep": ep, "cp": cp, "mbs": mbs, "sp": sp}
                if per_rank % mbs:
                    self.skip(
                        f"microbatch_size={mbs} does not divide the {per_rank} sequences per rank", **base
                    )
                    continue
                m = per_rank // mbs
                schedules = [("1f1b", 1)]
                if pp > 1:
                    schedules = [
                        (s, self.fixed.get("virtual", 2 if s == "interleaved" else 1))
                        for s in self.options("schedule", ["1f1b", "interleaved"])
                        if m >= pp and not (s == "interleaved" and m % pp)
                    ]
                if not schedules:
                    self.skip(f"{m} micro-batches do not fill {pp} stages", **base)
                    continue
                step, level = self.recompute_ladder(base, m, schedules, optimizers)
                light |= level == 0
                fastest = min(fastest, step)
                if self.descent_ends(
                    step,
                    previous,
                    f"microbatch_size={mbs} fits at no recomputation level (rule 4)",
                    f"the step got slower from microbatch_size={mbss[i - 1]} to {mbs} (rule 4)",
                    [{**base, "mbs": larger} for larger in mbss[i + 1 :]],
                ):
                    break
                previous = step
        return fastest, light


def sequence_length(cap: Captured) -> int | None:
    """The sequence context parallelism would split: dimension 1 of the batched inputs, where
    attention runs over that many positions (``None`` otherwise: no attention, or attention over
    something else, such as a vision model's patches)."""
    lengths = {
        int(v.shape[1])
        for n in cap.user_input_nodes()
        if isinstance(v := n.meta.get("val"), torch.Tensor) and v.dim() >= 2
    }
    queries = {
        int(n.args[0].meta["val"].shape[-2])
        for n in cap.gm.graph.nodes
        if n.op == "call_function" and op_family(n) is OpFamily.ATTENTION and isinstance(n.args[0], Node)
    }
    both = lengths & queries
    return max(both) if len(lengths) == 1 and both else None


@audited
def best_megatron(
    model: nn.Module,
    example_inputs: Any,
    cluster: Cluster,
    *,
    config: PlanConfig | None = None,
    **fixed: Any,
) -> Plan:
    """The fastest Megatron-LM layout that fits, as an expert tunes Megatron's knobs (``KNOBS``):
    tensor parallel size ``tp`` (powers of two up to a node), pipeline size ``pp`` (stages of whole
    nodes, or inside one), expert parallel size ``ep`` (models with mixture-of-experts regions
    only: powers of two dividing the data-parallel size and the experts — Megatron-LM's
    ``ep | dp`` — 1 included), micro-batch size ``microbatch_size`` (1, 2, 4, 8 sequences per
    data-parallel rank), ``schedule`` (1F1B, interleaved with ``virtual=2``),
    ``sequence_parallel``, ``recompute`` (none, selective, full), ``recompute_num_layers`` (full
    recomputation in the first ``N`` layers of each model chunk only; held at ``None``: in every
    layer, as Megatron-LM before its block method), ``distributed_optimizer`` and
    context parallel size ``cp`` (models whose attention runs over the inputs' sequence: 1, then
    powers of two dividing the sequence and the devices left; the solver picks each layer's
    attention form, ``megatron``'s ``cp_comm_type=None``). Expert tensor parallel size stays 1
    (``megatron`` cannot express ``etp = tp``). Any knob passed in ``fixed`` is held (e.g. ``tp=8, pp=4, ep=8, recompute="full"``). Every candidate is a
    ``megatron`` layout, planned and scored by the simulator (``plan.predicted.step_time``).

    The space is pruned as Megatron's own guides prune it (Narayanan et al., SC'21, arXiv
    2104.04473, §3.3 takeaways; Megatron-Core MoE's "guidelines for parallel mappings",
    ``megatron/core/transformer/moe/README.md``, also arXiv 2603.07685 §9.1):

    1. **static memory** — a ``(tp, pp, ep, cp, distributed_optimizer)`` whose training state alone
       exceeds the memory budget (``megatron_static_bytes``, a lower bound) is not planned;
    2. **recomputation** — levels are tried lightest first and, with the same other knobs, none
       heavier once one fits (recomputing only adds compute); the distributed optimizer only
       where the layout does not fit without it at that level (it saves memory, not time); where
       full recomputation is the lightest level that fits, also Megatron-LM's block method
       (``recompute_num_layers=N``: the first ``N`` layers of each model chunk recompute, the
       others keep their activations) with the fewest layers that fit, found by bisection with
       the distributed optimizer where allowed (each layer recomputed adds its forward again
       and frees its activations: the fewest that fit is the fastest);
    3. **sequence parallelism** — a mixture-of-experts model with tensor parallelism runs it, as
       Megatron-LM requires ("When using MoE and tensor parallelism, sequence parallelism must
       be used"); dense models try both;
    4. **micro-batch size** — swept upward while the step gets faster, stopping at the first size
       that fits at no recomputation level (a larger one keeps more activations);
    5. **pipeline as short as pays** — for each ``(tp, ep)`` pipeline sizes are tried upward;
       once one fits at the lightest recomputation, larger ones only while the step gets faster
       (takeaway #2: the model-parallel size only as large as memory needs, the rest data
       parallelism, MoE guideline 1 — unless the network makes data parallelism's gradient
       reduction the bottleneck, where an expert pipelines across nodes to shrink it: two nodes
       on 100 Gb/s Ethernet run a 2-layer GPT 4.7 % faster on two stages than on one that fits);
    6. **expert parallelism from the largest** — for each ``tp``, ``ep`` is tried from the largest
       down (MoE guideline 4: prefer EP; ``ep`` = the number of experts needs no local
       permutation) while the step gets faster, and stops at the first that fits nowhere (a
       smaller one keeps more experts per device);
    7. **context parallelism only where it pays** — for each ``(tp, pp)``, ``cp`` is tried upward
       from 1, a larger one only while the smaller does not fit at the lightest recomputation or
       cannot split the batch over its data-parallel ranks, and none past one that is slower
       (Megatron-Core's context-parallel guide: CP splits the activations of long sequences; at
       equal tokens per device it moves no compute off a device that data parallelism would not,
       and adds attention's communication).

    Rules 4–7 are the guides' experience, not proofs: they may skip a candidate that would have
    won. The schedules of one ``(pp, micro-batch size, …)`` share one stage plan, and each
    micro-batch count is captured once. ``plan.info["megatron_candidates"]`` lists every
    candidate planned (``feasible``, its ``step_time`` or ``why`` not) and every one skipped
    (``skipped: True`` and why; a knob it does not depend on is ``None``);
    ``plan.info["megatron_search_time"]`` the seconds the search took."""
    from autopar.capture import normalize_inputs
    from autopar.planner import detect_mixed_precision

    unknown = sorted(set(fixed) - set(KNOBS))
    if unknown:
        raise TypeError(f"best_megatron: unknown knob(s) {unknown}; known: {sorted(KNOBS)}")
    if fixed.get("recompute_num_layers") is not None and fixed.get("recompute", "full") != "full":
        raise ValueError(
            f"best_megatron(recompute_num_layers={fixed['recompute_num_layers']}): Megatron-LM's "
            f"--recompute-num-layers applies to full recomputation, but recompute={fixed['recompute']!r} is held; "
            "give recompute='full' or leave recompute free"
        )
    t_start = time.perf_counter()
    config = PlanConfig.build(config)
    args, kwargs = normalize_inputs(example_inputs)
    s = MegatronSearch(model, example_inputs, cluster, config, dict(fixed), args, kwargs)
    world, gpn, budget = (
        cluster.world_size,
        cluster.gpus_per_node,
        config.resolved(cluster.device.memory).memory_budget,
    )
    whole = s.captured(1)
    run_passes(whole.gm, PassContext(captured=whole, cluster=cluster, config=config), [annotate_tensors])
    roles, experts = megatron_weight_roles(whole.gm.graph), expert_weights(whole.gm.graph)
    if fixed.get("ep", 1) > 1 and not experts:
        raise ValueError(
            f"ep={fixed['ep']}, but the model has no mixture-of-experts layer autopar recognises"
        )
    num_experts = math.gcd(*experts.values()) if experts else 1
    mixed = config.mixed_precision if config.mixed_precision is not None else detect_mixed_precision(whole)
    moments = itemsize(config.optimizer_state_dtype) if config.optimizer_state_dtype else None
    params = [
        (n.meta[TENSOR].fqn, math.prod(n.meta[TENSOR].shape), n.meta["val"].element_size(), n.meta[TENSOR].requires_grad)
        for n in whole.gm.graph.nodes
        if n.op == "placeholder" and TENSOR in n.meta and n.meta[TENSOR].kind == "param"
    ]  # fmt: skip

    def state(nbytes: int) -> StateBytes:
        s = state_bytes_per_param(
            nbytes, optimizer=config.optimizer, master_weights=mixed, state_bytes=moments
        )
        # with the optimizer offloaded, its state is on the host (autopar.cost.offload)
        return replace(s, optimizer=0.0) if config.offload_optimizer is True else s

    seq = sequence_length(whole)

    def context_sizes(tp: int, pp: int) -> list[int]:
        """``cp`` values for one ``(tp, pp)``, smallest first: 1, then powers of two dividing the
        sequence and the devices left (a model without attention: 1 only)."""
        rest = world // (tp * pp)
        more = [c for c in (2, 4, 8, 16, 32) if seq and seq % c == 0 and rest % c == 0]
        return s.options("cp", [1, *more])

    def pipelines(tp: int, ep: int) -> float | None:
        """Pipeline sizes for one ``(tp, ep)``, smallest first (pruning 1, 5 and 7): the fastest
        step (``inf`` where none fits), ``None`` where ``ep`` divides no data-parallel size."""
        fastest, applicable = math.inf, False
        pps = s.options("pp", [p for p in range(1, world // tp + 1) if (world // tp) % p == 0])
        fitted = math.inf  # the fastest step of the pipelines that fit at the lightest recomputation
        for i, pp in enumerate(pps):
            light, previous, previous_cp = False, math.inf, 0
            this_pp = math.inf
            cps = context_sizes(tp, pp)
            for k, cp in enumerate(cps):
                dp = world // (tp * pp * cp)
                if s.batch % dp or dp % ep:
                    why = (
                        f"ep={ep} does not divide dp={dp}"
                        if dp % ep
                        else f"the batch of {s.batch} does not split over dp={dp}"
                    )
                    s.skip(why, tp=tp, pp=pp, ep=ep, cp=cp)
                    continue
                applicable = True
                optimizers = []
                for do in s.options("distributed_optimizer", [False, True]):
                    # Megatron-Core's distributed optimizer splits the state over dp × cp.
                    static = megatron_static_bytes(
                        params, roles, experts, tp=tp, dp=dp * cp, ep=ep, pp=pp, distributed_optimizer=do,
                        state=state,
                    )  # fmt: skip
                    if static <= budget:
                        optimizers.append(do)
                        continue
                    s.skip(
                        f"training state alone {static / 2**30:.1f} GiB per device > budget {budget / 2**30:.1f} GiB (rule 1)",
                        tp=tp, pp=pp, ep=ep, cp=cp, distributed_optimizer=do,
                    )  # fmt: skip
                if not optimizers:
                    continue
                step, fits_light = s.tune_stage(tp, pp, ep, optimizers, bool(experts), cp)
                fastest = min(fastest, step)
                this_pp = min(this_pp, step)
                light |= fits_light
                if step < math.inf and step >= previous:
                    for larger in cps[k + 1 :]:
                        s.skip(
                            f"the step got slower from cp={previous_cp} to {cp} (rule 7)", tp=tp, pp=pp, ep=ep, cp=larger
                        )  # fmt: skip
                    break
                if step < previous:
                    previous, previous_cp = step, cp
                if light:
                    for larger in cps[k + 1 :]:
                        s.skip(
                            f"cp={cp} fits at the lightest recomputation: context parallelism would only save "
                            "activation memory (rule 7)",
                            tp=tp, pp=pp, ep=ep, cp=larger,
                        )  # fmt: skip
                    break
            if light and this_pp >= fitted:
                for larger in pps[i + 1 :]:
                    s.skip(
                        f"a pipeline shorter than pp={pp} fits at the lightest recomputation and was faster (rule 5)",
                        tp=tp, pp=larger, ep=ep,
                    )  # fmt: skip
                break
            if light:
                fitted = this_pp
        return fastest if applicable else None

    eps = [e for e in (64, 32, 16, 8, 4, 2) if e <= min(num_experts, world) and num_experts % e == 0] + [1]
    eps = s.options("ep", eps if experts else [1])
    for tp in s.options("tp", [t for t in (1, 2, 4, 8, 16) if t <= gpn and world % t == 0]):
        previous, previous_ep = math.inf, None
        for k, ep in enumerate(eps):  # largest first, while the step gets faster (rule 6)
            step = pipelines(tp, ep)
            if step is None:
                continue
            if s.descent_ends(
                step,
                previous,
                f"ep={ep} fits nowhere: a smaller ep keeps more experts per device (rule 6)",
                f"the step got slower from ep={previous_ep} to {ep} (rule 6)",
                [{"tp": tp, "ep": smaller} for smaller in eps[k + 1 :]],
            ):
                break
            previous, previous_ep = step, ep
    if s.best is None:
        planned = [t for t in s.tried if not t.get("skipped")]
        err = InfeasibleError(
            "no Megatron-LM layout fits:\n  " + "\n  ".join(f"{t}" for t in (planned or s.tried)[:20])
        )
        # As an expert would next: Megatron-Core's --optimizer-cpu-offload (under its distributed
        # optimizer), where the search may decide offload and the cluster's host is described.
        if (
            config.offload_optimizer is not None
            or cluster.host is None
            or fixed.get("distributed_optimizer") is False
        ):
            raise err
        try:
            plan = best_megatron(
                model,
                example_inputs,
                cluster,
                config=config.replace(offload_optimizer=True),
                **{**fixed, "distributed_optimizer": True},
            )
        except InfeasibleError as off:
            raise InfeasibleError(f"{err}\nwith --optimizer-cpu-offload as well: {off}") from None
        plan.info["offload_reason"] = (
            "no Megatron-LM layout fits with the optimizer state on the device (Megatron-Core's --optimizer-cpu-offload)"
        )
        plan.info["megatron_search_time"] = time.perf_counter() - t_start
        return plan
    s.best.info["megatron_candidates"] = s.tried
    s.best.info["megatron_search_time"] = time.perf_counter() - t_start
    return s.best
