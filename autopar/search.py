"""The 3D search: pipeline ranks, micro-batches and schedule around the SPMD plan of one stage,
every candidate scored by the whole-step simulator (``autopar.simulate``).

Words (``autopar.schedule`` defines stage, action and the schedules):

* **candidate** — ``(pp, m, schedule, v)``: ``pp`` pipeline ranks (dividing the device count, at
  most one more than the model's seams, ``autopar.passes.stages``), ``m`` micro-batches (a
  multiple of ``pp`` dividing the global batch: ``pp``, ``2·pp``, ``4·pp``, … up to the batch),
  a schedule, ``v`` stages per rank (2 with ``interleaved`` where the model has the seams).
  ``pp = 1`` is the one-stage plan: with ``m = 1`` the whole batch at once, with ``m > 1``
  gradient accumulation (the micro-batches one after another on every device, gradients summed
  and reduced once, as Megatron-LM runs ``--micro-batch-size`` below the per-rank batch).
* **stage mesh** — each pipeline rank's devices: ``world / pp`` of them, the inner devices of the
  cluster (a stage stays in one node while it fits: pipeline transfers are the ones that cross
  nodes, as Megatron-LM places them). The SPMD planner (``autopar.planner``) plans one micro-batch
  on it; its memory budget is relaxed to ``pp ×`` the device's (a stage holds a ``1/pp`` share of
  the model) with activations counted ``pp`` times (``PlanConfig.activations_in_flight``: the
  micro-batches 1F1B's first rank holds; ``m`` under GPipe), and the simulator's per-rank peak
  (static state of the rank's stages + activations of the micro-batches in flight) must then fit
  the device's budget, or the candidate is dropped.
* **score** — the simulated step time: the schedule played with each stage's forward, input- and
  weight-gradient times, transfers to the next stage over the pipeline axis's link, gradient
  reductions overlapped in buckets, then the optimizer step. The fastest candidate that fits wins.

Planning time: one SPMD plan per ``(pp, m)``; the schedules of one ``(pp, m)`` share it. Under
``pp="auto"`` the step time is taken as unimodal in ``pp`` and in the accumulation count
(``plan.info["pipeline_candidates"]`` lists what was skipped, and why); ``pp="search"`` tries
everything.

* Where the whole batch fits one stage, sizes are tried in increasing order; the search stops
  after two slower than the best plan so far, or one more than ``FAR_SLOWER`` times it (with
  ``2·pp`` micro-batches the bubble ``(pp − 1)/(2·pp·v)`` and the per-micro-batch collectives only
  grow with ``pp``, so a larger pipeline does not recover such a gap).
* Where it does not (memory, not speed, is what pipelines are for then), the pipelines go first,
  in increasing order with the same stops, and gradient accumulation (a pipeline of one) last,
  only where the two smallest pipelines' steps do not already fall with depth: were the step to
  fall from ``pp = 2`` to ``pp = 4``, its fastest would lie deeper (LLaMA-3-8B in fp32 on 8 nodes
  plans pp = 2, 4 and 8, not accumulation). Bisecting the sizes instead planned fewer on that
  model but more on GPT-3 175B, and on the 1T-parameter row settled on a 1.5 % slower pipeline:
  the step is not unimodal where divisibility changes the stage's layouts (pp = 3 there).
* On a mixed cluster, gradient accumulation is tried even where the whole batch fits: its
  micro-batches are what unequal data-parallel shares are made of (``autopar.dp_shares``: a
  replica of a faster device kind runs more of them). Where the stage plan ties the replicas of
  its first axis together (a sequence split or a ZeRO-3 weight over it), it is planned once more
  with that axis kept to replicas (``PlanConfig.replicas_first``) and its shares candidates join.
* Where a size's last count does not fit, smaller micro-batches (the next count dividing the batch
  at least twice as many) are tried while the smallest memory per device its plans reach still
  falls (``ESCALATE_SHRINK``), down to one sequence per micro-batch: activations shrink with the
  micro-batch, the weights and optimizer state do not. NVIDIA's LLaMA 3.1 8B recipe on 8 H100
  (128 × 8192) accumulates 32 micro-batches on one stage; counts 2, 4 and 8 do not fit there.
* An accumulation count slower than the one before it ends the counts of that size, unless
  ``recompute="auto"`` had it recompute: smaller micro-batches may fit without (Table 1's row 1
  recomputes selectively with 2 micro-batches, slower than the whole batch so, and with 8 keeps
  every activation, 1.12× faster than both).
* Under ``recompute="auto"`` the whole batch is planned first keeping every activation; where it
  fits only by recomputing, that plan is made last, its compute path bounded by the best step then
  (``PipelineSearch.recomputing_whole``), and the search goes on as where it does not fit at all.
* Under ``recompute="auto"`` a candidate recomputes in every repeated layer; where the fastest
  does, its ``(pp, m)`` is planned once more with the mode in the fewest layers its memory allows
  (``autopar.refine.fewer_layers``, ``PlanConfig.recompute_layers``).
* Where the solver picks the ZeRO stages, accumulated candidates within ``ZERO1_REACH`` of the
  fastest are planned once more with stage 1 offered (``autopar.refine.accumulated_zero1``):
  Megatron-LM's distributed optimizer, a reduce-scatter once a step where stage 2 has one every
  micro-batch; kept where it plays faster.
* **Pruning.** A rank is busy at least ``m/pp`` of a micro-batch's *compute path* (what every
  micro-batch puts on the compute stream: ``StrategyGraph.path_terms``), so a stage plan whose
  path exceeds ``FAR_SLOWER · best · pp / m`` is far slower than the best plan so far. The stage
  plan is solved under that bound (the solver's constraint (h)); CP-SAT proves at its root LP
  that no such plan exists, in about the time of one LP, instead of solving the candidate.
* **Screening.** Once a plan exists to beat, a pipelined candidate's stage plan is first solved
  only to within ``SCREEN_GAP`` of its optimum, and solved again at ``PlanConfig.relative_gap``
  only where its step, less that gap, could still beat the best plan so far. The stage programs
  of memory-bound pipelines are the slow ones: their root LP sits 2-3 % under the optimum (the
  budget is a knapsack over 50 000 Booleans), so closing the last half per cent took 40 s per
  mesh on LLaMA-3-8B's pp = 2 (16, 2) and (8, 4) stages, for candidates 23 % slower than the
  whole-batch plan; at 5 % CP-SAT stops at its first plans, in about two seconds. Cutoffs
  between the meshes keep the configured gap (``PlanConfig.screen_gap``), so where every mesh
  was pruned or already solved within that gap the screened plan is kept as it is
  (``_solved_to``). The stop
  rules below read a screened candidate's step less the gap (the least its refined step would
  be), so screening ends no search that a full solve would have continued.
* The parent process exports the model with a symbolic batch while the one-stage plan's meshes
  are solved in other processes (``plan_captured(background=…)``), so the first pipelined
  candidate only specialises it.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from autopar.cluster import Cluster
from autopar.config import PlanConfig, stage_plan_budget
from autopar.mesh_pool import Background
from autopar.microbatch import MicrobatchCaptures
from autopar.passes.stages import seams
from autopar.pipelined import Player, Scored, stage_cluster
from autopar.planfile import Plan
from autopar.planner import InfeasibleError, plan_captured, plan_recomputing
from autopar.solver import NotBetter

__all__ = ["PipelineSearch"]

log = logging.getLogger("autopar.planner")

SCREEN_GAP = 0.05
"""Relative gap a pipelined candidate's stage plan is first solved to, once a plan exists to beat
(module docstring: screening)."""

FAR_SLOWER = 1.25
"""Under ``pp="auto"``, a pipeline size whose best step is more than this times the best plan's
ends the search over pipeline sizes (module docstring)."""


def _more_microbatches(batch: int, pp: int, m: int) -> int | None:
    """The next micro-batch count after ``m`` to try for ``pp`` ranks: the smallest count dividing
    the batch that is at least ``2·m``, a multiple of ``pp`` where one is (the interleaved schedule
    needs it); ``None`` past the batch."""
    counts = [k for k in range(2 * m, batch + 1) if batch % k == 0]
    return next((k for k in counts if k % pp == 0), counts[0] if counts else None)


ESCALATE_SHRINK = 0.02
"""Smaller micro-batches are tried after an infeasible count while the smallest memory per device
its plans reached fell by at least this fraction from the count before (module docstring)."""


def _escalates(before: float | None, now: float | None, steps: int) -> bool:
    """Whether to try smaller micro-batches after an infeasible count, ``steps`` counts having been
    added so: while the smallest memory reached (``InfeasibleError.smallest``; ``before``: the
    previous infeasible count's) falls by ``ESCALATE_SHRINK`` (activations shrink with the
    micro-batch, the static state does not); where a figure is missing, at most two counts."""
    if before is not None and now is not None:
        return now <= before * (1 - ESCALATE_SHRINK)
    return steps < 2


def _solved_to(plan: Plan, gap: float) -> bool:
    """Whether every mesh of ``plan``'s solve ended as a solve at ``gap`` would have: each one
    solved within ``gap`` of its optimum, or pruned (screening keeps the cutoffs at ``gap``:
    ``SolverConfig.cutoff_gap``), or not fitting."""
    tried = plan.info.get("meshes_tried", ())
    return bool(tried) and all(
        "pruned" in t or not t.get("feasible") or t.get("gap", 1.0) <= gap for t in tried
    )


@dataclass
class _Size:
    """What planning one pipeline size gave: its fastest step (``inf`` where nothing fits),
    ``pruned`` where the path bound proved it far slower than the best plan (module docstring)."""

    step: float = math.inf
    pruned: bool = False

    @property
    def scored(self) -> bool:
        return self.step < math.inf


class PipelineSearch:
    """One ``plan_model`` call's search over pipeline sizes and micro-batch counts: the graphs,
    every candidate scored so far, and what was skipped or failed and why."""

    def __init__(
        self, graphs: MicrobatchCaptures, cluster: Cluster, config: PlanConfig, batch: int | None
    ) -> None:
        self.graphs = graphs
        self.cluster = cluster
        self.config = config = config.resolved(cluster.device.memory)  # plan_model's, or a caller's
        self.batch = batch
        self.budget = config.device_budget
        self.exhaustive = config.pp == "search"
        self.scored: list[Scored] = []
        self.errors: list[str] = []
        self.tried: list[dict[str, Any]] = []
        # The smallest memory a failed one-stage candidate reaches, and which it was.
        self.least: tuple[float, str] | None = None
        self.seam_count: int | None = None
        # Whether the whole batch fits one stage only by recomputing, if at all (``recomputing_whole``).
        self.whole_recomputes = False
        self.kept_whole: float | None = None  # the least memory its plans keeping every activation reach

    def best(self) -> float:
        return min((c.step_time for c in self.scored), default=math.inf)

    def note_least(self, smallest: float | None, label: str) -> None:
        if smallest is not None:
            self.least = min(self.least or (smallest, label), (smallest, label))

    def prefetch(self, pp: int | None, eager: bool = False) -> Background | None:
        """Work for this process while a candidate's meshes are solved in others
        (``planner.Background``): the graph of ``pp`` ranks' first micro-batch count, the
        candidate likely planned next. The first exports the model with a symbolic batch, which
        every micro-batch graph is specialised from (``eager``: beside the whole batch's meshes,
        a few seconds); the later ones fill the tail of a candidate's solves, where a core idles."""
        if pp is None or self.batch is None or not self.possible(pp, quiet=True):
            return None
        ms = [m for m in self.counts(pp) if self.batch % m == 0]
        return Background(lambda: self.graphs(ms[0]), eager=eager) if ms else None

    def whole(self, then: int | None) -> Plan | None:
        """The one-stage plan of the whole batch, or ``None`` where it does not fit; ``then``: the
        pipeline size likely planned next (``prefetch``)."""
        config = self.config
        auto = config.recompute == "auto"  # recomputing, it is planned last (``recomputing_whole``)
        try:
            p = plan_captured(
                self.graphs(1),
                self.cluster,
                config.replace(pp=1, recompute="none", recompute_layers=None)
                if auto
                else config.replace(pp=1),
                background=self.prefetch(then, eager=True),
            )
        except InfeasibleError as e:
            self.errors.append(f"pp=1: {e}")
            self.note_least(e.smallest, "pp=1")
            self.whole_recomputes = auto
            self.kept_whole = e.smallest
            return None
        self.scored.append(Scored(p, p.predicted.step_time, "pp=1"))
        self.tried.append({"pp": 1, "step_time": p.predicted.step_time})
        return p

    def recomputing_whole(self) -> None:
        """Under ``recompute="auto"``, where the whole batch fits one stage only by recomputing:
        that plan, last, its compute path bounded by the best step found (a one-stage step is at
        least its compute path), so CP-SAT proves at its root LP that it cannot win where it
        cannot (GPT-3 175B on 1024 A100: 14 s of planning for a plan 1.26× slower than the best)."""
        if not self.whole_recomputes:
            return
        best = self.best()
        try:  # selective, then full (which may fit a faster sharding where selective cannot)
            p = plan_recomputing(
                self.graphs(1),
                self.cluster,
                self.config.replace(pp=1),
                kept=self.kept_whole,
                fewer_layers=False,  # for the fastest candidate only (``fewer_layers``)
                path_cutoff=best if best < math.inf else None,
            )
        except NotBetter:
            self.tried.append(
                {"pp": 1, "recompute": "auto", "pruned": "its compute path exceeds the best step"}
            )
            return
        except InfeasibleError as e:
            self.errors.append(f"pp=1 recomputing: {e}")
            return
        self.scored.append(Scored(p, p.predicted.step_time, f"pp=1 recompute={p.recompute}"))
        self.tried.append({"pp": 1, "recompute": p.recompute, "step_time": p.predicted.step_time})

    def possible(self, pp: int, quiet: bool = False) -> bool:
        """Whether ``pp`` ranks can be planned at all (equal stages, enough seams, a batch to
        cut); where not, the error says why (unless ``quiet``)."""
        cluster, world = self.cluster, self.cluster.world_size
        why = None
        shape = self.config.mesh_shape
        if stage_cluster(cluster, pp) is None:
            why = f"{world} devices on {cluster.nodes} node(s) do not cut into {pp} equal stages"
        elif shape is not None and math.prod(shape) * pp != world:
            why = (
                f"mesh_shape {shape} spans {math.prod(shape)} devices, a stage of {pp} has "
                f"{world} / {pp} = {world / pp:g}"
            )
        elif self.seam_count is not None and pp - 1 > self.seam_count:
            why = f"the model has {self.seam_count} seams"
        elif self.batch is None:
            why = "no batch dimension to cut into micro-batches"
        if why is not None and not quiet:
            self.errors.append(f"pp={pp}: {why}")
        return why is None

    def counts(self, pp: int) -> list[int]:
        """The micro-batch counts to try first for ``pp`` ranks (module docstring: candidate)."""
        config, batch = self.config, self.batch
        assert batch is not None
        ms = [config.microbatches] if config.microbatches else []
        if not ms and config.pp != "search" and pp > 1:
            ms = [k for k in (2 * pp, pp) if batch % k == 0][:1]
        if not ms:  # pp = 1: gradient accumulation over 2, 4, 8 micro-batches
            k = pp if pp > 1 else 2
            while k <= batch:
                if batch % k == 0:
                    ms.append(k)
                if len(ms) == 3:
                    break
                k *= 2
        return ms

    def stage_config(self, pp: int, m: int) -> PlanConfig:
        """The SPMD planner's options for one stage of ``pp`` ranks running ``m`` micro-batches
        (module docstring: stage mesh)."""
        config = self.config
        return config.replace(
            pp=1,
            microbatches=None,
            schedule=None,
            virtual=None,
            stage_of={},  # the cut is the pipeline's (``pipelined_candidates`` reads the search's)
            memory_budget=stage_plan_budget(self.budget, pp),
            activations_in_flight=m if config.schedule == "gpipe" else min(pp, m),
            microbatches_per_sync=m,
            mesh_shape=config.mesh_shape,  # the mesh inside a stage (``possible`` checked its size)
        )

    def size(self, pp: int, then: int | None = None) -> _Size:
        """Plan ``pp`` pipeline ranks (``pp = 1``: gradient accumulation) over its micro-batch
        counts; every candidate found joins ``scored``. ``then``: the size likely planned next
        (``prefetch``)."""
        config, batch, cluster = self.config, self.batch, self.cluster
        if not self.possible(pp):
            return _Size()
        sub = stage_cluster(cluster, pp)
        assert sub is not None and batch is not None
        ms = self.counts(pp)
        # Where the last count's stages do not fit, smaller micro-batches are tried while they still
        # shrink the memory (Megatron-LM runs large models at one sequence per data-parallel rank;
        # Megatron-Core's LLaMA 3.1 8B recipe accumulates 32 micro-batches on one stage).
        escalate = not self.exhaustive and not config.microbatches
        least_before: float | None = None  # the smallest memory the previous infeasible count reached
        escalated = 0
        out = _Size()
        prev_m: float | None = None  # the best step of the previous micro-batch count (inf: pruned)
        # Whether that count's fastest plan recomputes where ``recompute="auto"`` chose it: more
        # (smaller) micro-batches may then fit without, so its being slower ends nothing.
        prev_recomputes = False
        for m in ms:
            best_before = self.best()
            if not self.exhaustive and prev_m is not None and prev_m > best_before and not prev_recomputes:
                self.tried.append({"pp": pp, "microbatches": m, "skipped": "fewer micro-batches were slower"})
                break
            if batch % m:
                self.errors.append(f"pp={pp}: a batch of {batch} does not cut into {m} micro-batches")
                continue
            cap = self.graphs(m)
            stage_config = self.stage_config(pp, m)
            more = _more_microbatches(batch, pp, m) if escalate and m == ms[-1] else None
            # A rank is busy at least m/pp of a micro-batch's compute path (``StrategyGraph.path_terms``):
            # a candidate whose path exceeds FAR_SLOWER·best·pp/m is far slower than the best plan,
            # and CP-SAT proves there is no shorter one at its root LP (module docstring).
            # On a mixed cluster the path is the floor device's; a faster rank runs it sooner.
            far = (
                FAR_SLOWER * best_before * pp / m * cluster.speed_spread
                if not self.exhaustive and best_before < math.inf
                else None
            )
            # Screened at SCREEN_GAP where a plan exists to beat (module docstring: screening).
            screen = not self.exhaustive and best_before < math.inf and config.relative_gap < SCREEN_GAP
            # Near-tie meshes are ranked by the step this candidate plays (``planner.MESH_TIE``).
            score = Player(cap.gm, cluster, config, pp, m, self.budget)
            try:
                spmd = plan_captured(
                    cap,
                    sub,
                    stage_config.replace(screen_gap=SCREEN_GAP) if screen else stage_config,
                    path_cutoff=far,
                    background=self.prefetch(then) if m == ms[0] else None,
                    score=score,
                    fewer_layers=False,  # for the fastest candidate only (``fewer_layers``)
                )
            except NotBetter:
                why = f"no plan within {FAR_SLOWER}× the best plan's step (its compute path alone is longer)"
                self.errors.append(f"pp={pp} m={m}: {why}")
                self.tried.append({"pp": pp, "microbatches": m, "pruned": why})
                out.pruned = not out.scored
                prev_m, prev_recomputes = math.inf, False  # more micro-batches are not tried either
                continue
            except InfeasibleError as e:
                self.errors.append(f"pp={pp} m={m}: {e}")
                if pp == 1:  # a stage's figure is not one device's
                    self.note_least(e.smallest, f"{m} micro-batches accumulated")
                if more is not None and _escalates(least_before, e.smallest, escalated):
                    ms.append(more)
                    escalated += 1
                least_before = e.smallest
                continue
            if self.seam_count is None:
                self.seam_count = len(seams(cap.gm))
            found = score.candidates(spmd)
            if screen and _solved_to(spmd, config.relative_gap):
                screen = False  # CP-SAT's first plans already met the configured gap: nothing to refine
            if screen and found and min(c.step_time for c in found) * (1 - SCREEN_GAP) <= best_before:
                try:  # it may win: the stage plan at the configured gap
                    spmd = plan_captured(
                        cap, sub, stage_config, path_cutoff=far, score=score, fewer_layers=False
                    )
                    found = score.candidates(spmd)
                    screen = False
                except (NotBetter, InfeasibleError) as e:
                    log.info("pp=%d m=%d: refining the screened stage plan failed (%s)", pp, m, e)
            if (
                pp == 1
                and m > 1
                and cluster.mixed_kinds
                and not any(c.plan.pipeline is not None and c.plan.pipeline.dp_shares for c in found)
            ):
                found += self.replicas_first(cap, sub, stage_config, far, score, m)
            if not found:
                self.errors.append(f"pp={pp} m={m}: no schedule fits the memory budget or the model's seams")
                if more is not None and escalated < 2:
                    ms.append(more)
                    escalated += 1
            for c in found:
                self.tried.append(
                    {"pp": pp, "microbatches": m, "candidate": c.what, "step_time": c.step_time}
                    | ({"screened_gap": SCREEN_GAP} if screen else {})
                )
            self.scored += found
            if found:
                fastest = min(found, key=lambda c: c.step_time)
                # A screened step less the gap: the least its refined plan's would be.
                prev_m = fastest.step_time * ((1 - SCREEN_GAP) if screen else 1.0)
                prev_recomputes = config.recompute == "auto" and fastest.plan.recompute != "none"
                out = _Size(min(out.step, prev_m))
        return out

    def replicas_first(
        self, cap: Any, sub: Cluster, stage_config: PlanConfig, far: float | None, score: Player, m: int
    ) -> list[Scored]:
        """An accumulated candidate on a mixed cluster whose stage plan ties the replicas of its
        first axis together: planned once more keeping that axis to independent replicas
        (``PlanConfig.replicas_first``), so that they may run unequal shares (``autopar.dp_shares``;
        module docstring). Only its shares candidates are kept; none where no such plan exists."""
        try:
            spmd = plan_captured(
                cap,
                sub,
                stage_config.replace(replicas_first=True),
                path_cutoff=far,
                score=score,
                fewer_layers=False,
            )
        except (NotBetter, InfeasibleError) as e:
            log.info("pp=1 m=%d: no plan keeps the first axis to replicas (%s)", m, e)
            return []
        return [
            c for c in score.candidates(spmd) if c.plan.pipeline is not None and c.plan.pipeline.dp_shares
        ]

    def skip(self, pp: int, why: str) -> None:
        self.errors.append(f"pp={pp}: not tried ({why})")
        self.tried.append({"pp": pp, "skipped": why})

    def ascending(self, pps: list[int], then: int | None = None) -> dict[int, _Size]:
        """Pipeline sizes in increasing order, until two are slower than the best plan or one is
        far slower (all of them under ``"search"``); what each gave. ``then``: the size planned
        after the last (``prefetch``)."""
        slower = 0
        done: dict[int, _Size] = {}
        for k, pp in enumerate(pps):
            if not self.exhaustive and slower >= 2:
                self.skip(
                    pp,
                    f"two smaller pipelines, or one {FAR_SLOWER}× the best plan's step, were slower than the "
                    "best plan",
                )
                continue
            best_before = self.best()
            r = done[pp] = self.size(pp, pps[k + 1] if k + 1 < len(pps) else then)
            if pp == 1:
                continue
            if r.scored:
                if r.step > FAR_SLOWER * best_before:
                    slower = 2  # far slower: the next size will not recover it (module docstring)
                else:
                    slower = slower + 1 if r.step > best_before else 0
            elif r.pruned:
                slower = 2
        return done

    def pipelines_first(self, pps: list[int]) -> None:
        """``pp="auto"`` where the whole batch does not fit one stage as it is (``pps[0] = 1``:
        gradient accumulation, a pipeline of one): the pipelines in increasing order
        (``ascending``), then accumulation, unless the two smallest pipelines' steps already fall
        with depth: the step being unimodal in ``pp``, the fastest then lies beyond the smallest
        pipeline, so not at one stage (module docstring)."""
        rest = pps[1:]
        done = self.ascending(rest, then=1)
        two = [done.get(pp) for pp in rest[:2]]
        if len(two) == 2 and all(r is not None and r.scored for r in two) and two[0].step > two[1].step:
            self.skip(
                1,
                f"the step falls from pp={rest[0]} to pp={rest[1]}: unimodal in pp, its fastest is not at one stage",
            )
            return
        self.size(1)
