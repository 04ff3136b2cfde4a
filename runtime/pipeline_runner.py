"""Running pipeline stages: one small interpreter over this rank's list of actions.

Words (see ``autopar.passes.stage_cut`` for stages, boundary values and the three programs of a
stage step; ``autopar.schedule`` for schedules):

* **action** — ``(kind, stage, microbatch)``: ``F`` runs the stage's forward program, ``B`` its
  input-gradient program, ``W`` its weight-gradient program (zero-bubble schedules place ``W``
  apart; others run it right after ``B``). The list is data, the same the simulator walks.
* **transfer** — a boundary value goes from its producer to each reader stage by point-to-point
  send/receive on the pipeline axis (or in memory when both stages are this rank's), tagged by
  value and micro-batch so transfers never mix; its gradient goes back the same way, summed over
  the readers.
* **micro-batch** — the rank's batch is cut into ``m`` equal pieces along dimension 0; the loss
  is the mean of the micro-batches' losses (each micro-batch's loss gets the gradient ``1/m``),
  which equals the whole batch's when micro-batches count equally (the model's mean losses over
  equal-sized micro-batches).
* **unequal shares** (``PipelinePlan.dp_shares``, ``autopar.dp_shares``) — ranks at different
  coordinates of the first mesh axis run different numbers of micro-batches of one size. The
  stage program then leaves the loss partial over that axis (each rank's part of the mean over
  the plan's micro-batch), every micro-batch's loss still gets ``1/m`` of the plan's ``m``, and
  after the schedule the loss's parts are summed over the axis (``shares``): the mean over all
  the step's rows, as the gradients summed over the axis are.

A step runs the whole schedule when the module is called (forward and backward of every
micro-batch), stashes the parameter gradients, and returns the loss as a tensor whose backward
adds ``grad_output ·`` stash into ``.grad``: ``loss = pm(batch); loss.backward()`` trains as for
any other plan, gradient accumulation included. Weights held by stages on several ranks (a tied
embedding and LM head) have their gradients summed between those ranks after the schedule.
Stage programs compiled by Inductor (``parallelize(..., compile=True)``: ``StageStep.compiled``)
run in place of the graphs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from autopar.program.collectives import AxisGroup
from autopar.program.records import RankStages, StageStep
from autopar.runtime.monitor import StepMonitor

__all__ = ["PipelineRunner", "Transport", "build_runner"]


class Transport:
    """How the runner moves values between ranks outside its stage programs: the transfers
    (point-to-point, each returning a work to ``wait`` on), the loss's broadcast and the shared
    weights' gradient sums. This one calls ``torch.distributed``; an emulated link
    (``autopar.runtime.link_emulation``) replaces it to hold crossing transfers back."""

    def isend(self, t: torch.Tensor, dst: int, group: Any, tag: int) -> Any:
        return dist.isend(t, dst=dst, group=group, tag=tag)

    def irecv(self, buf: torch.Tensor, src: int, group: Any, tag: int) -> Any:
        return dist.irecv(buf, src=src, group=group, tag=tag)

    def broadcast(self, t: torch.Tensor, src: int, group: Any) -> None:
        dist.broadcast(t, src=src, group=group)

    def all_reduce(self, t: torch.Tensor, group: Any) -> None:
        dist.all_reduce(t, group=group)


@dataclass(frozen=True)
class _Dropped:
    """A non-scalar model output the runner does not keep (``PipelineRunner.last``:
    ``outputs_kept``): what its zero gradient is made of."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


def _storages(values: tuple) -> dict[int, float]:
    """The distinct storages among ``values`` and their bytes (views of one storage once)."""
    seen: dict[int, float] = {}
    for v in values:
        if isinstance(v, torch.Tensor):
            st = v.untyped_storage()
            seen[st.data_ptr()] = float(st.nbytes())
    return seen


class _Loss(torch.autograd.Function):
    """The step's loss; its backward hands the stashed gradients to autograd, scaled."""

    @staticmethod
    def forward(ctx, runner: PipelineRunner, loss: torch.Tensor, *params: torch.Tensor):  # type: ignore[override]
        ctx.runner = runner
        return loss.clone()

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        grads = ctx.runner.stash
        return (None, None, *[None if s is None else s * g for s in grads])


@dataclass(eq=False)
class PipelineRunner:
    """This rank's stages and schedule (see module docstring)."""

    steps: dict[int, StageStep]
    """The stages this rank holds."""
    stage_coord: dict[int, int]
    """Stage -> the pipeline coordinate holding it."""
    pp: AxisGroup
    pp_ranks: list[int]
    """Global ranks along this rank's pipeline axis, by coordinate."""
    actions: list[tuple[str, int, int]]
    microbatches: int
    primal_kinds: list[str]
    """Kind of each primal (``param``, ``buffer``, ``input``, ``const``)."""
    trainable: list[int]
    """Primal indices of the trainable parameters this rank holds."""
    shared: list[tuple[int, Any]] = field(default_factory=list)
    """(primal index, process group) of weights also held by another pipeline rank."""
    holders: dict[str, list[int]] = field(default_factory=dict)
    """Parameter or buffer name -> the pipeline coordinates holding it."""
    monitor: StepMonitor | None = None
    value_ids: dict[str, int] = field(default_factory=dict)
    stash: list[torch.Tensor | None] = field(default_factory=list)
    times: list[dict[str, float]] = field(default_factory=list)
    """Per step, when ``timing``: see ``last``."""
    last: dict[str, float] = field(default_factory=dict)
    """The last step's seconds on this rank: ``step`` (the whole schedule), ``compute`` (running
    stage programs, their collectives inside), ``p2p`` (waiting for transfers), ``idle`` (the
    rest), ``in_flight`` (the most micro-batches whose activations were kept at once),
    ``saved_peak`` (the most bytes of them kept at once, distinct storages counted once) and
    ``outputs_kept`` (the bytes of the model's outputs kept until the step's end: the scalar
    losses alone — a non-scalar output, the logits, is dropped once computed, only its shape kept
    for its zero gradient)."""
    timing: bool = False
    transport: Transport = field(default_factory=Transport)
    shares: AxisGroup | None = None
    """With unequal data-parallel shares (module docstring): the first mesh axis, over which the
    loss's parts are summed after the schedule."""
    loss_weight: float = 0.0
    """The gradient each micro-batch's loss gets: ``1/m`` of the plan's ``m`` (0: of
    ``microbatches``, this rank's count, which is the plan's without unequal shares)."""
    predicted: dict[str, float] = field(default_factory=dict)
    """What the plan predicts for this rank's step, as ``last`` measures it: ``step``, ``compute``,
    ``in_flight`` (set by ``autopar.parallelize``, the plan's schedule played by
    ``autopar.cost.timeline``; empty where the plan has no per-stage costs)."""

    def __post_init__(self) -> None:
        names = sorted({v for s in self.steps.values() for v in (*s.sent, *s.received)})
        self.value_ids = {v: i for i, v in enumerate(names)}

    # ---------------------------------------------------------------------------- transfers
    def _tag(self, value: str, mb: int, direction: int) -> int:
        return (self.value_ids[value] * self.microbatches + mb) * 2 + direction

    def _rank_of(self, stage: int) -> int:
        return self.pp_ranks[self.stage_coord[stage]]

    def _mine(self, stage: int) -> bool:
        return self.stage_coord[stage] == self.pp.coord

    # ---------------------------------------------------------------------------- a step
    def run(self, primals: Sequence[Any], grad: bool) -> tuple[Any, ...]:
        """Run the schedule on ``primals`` (the whole program's inputs, this rank's batch) and
        return the model's outputs (on every rank: broadcast from the last stage's rank)."""
        m = self.microbatches
        split = [
            list(torch.chunk(p, m, dim=0))
            if k == "input" and isinstance(p, torch.Tensor) and p.dim() > 0
            else None
            for p, k in zip(primals, self.primal_kinds)
        ]

        def inputs_for(step: StageStep, mb: int) -> list[Any]:
            return [split[i][mb] if split[i] is not None else primals[i] for i in step.primals]

        local: dict[tuple[str, int, int], torch.Tensor] = {}  # (value, mb, direction) -> tensor
        pending: list[Any] = []
        saved: dict[tuple[int, int], tuple] = {}
        passed: dict[tuple[int, int], tuple] = {}
        outputs: dict[int, tuple] = {}
        kept_outputs = 0.0
        grads: dict[int, torch.Tensor] = {}
        clock = {"compute": 0.0, "p2p": 0.0}
        in_flight = 0
        live = peak_saved = 0.0  # bytes kept for backward (each storage once)
        refs: dict[int, list[float]] = {}  # storage -> [bytes, saved tuples holding it]
        weights = {
            p.untyped_storage().data_ptr()
            for p, k in zip(primals, self.primal_kinds)
            if k in ("param", "buffer") and isinstance(p, torch.Tensor)
        }
        t_step = time.perf_counter()
        last = max(self.stage_coord)
        last_w = {s: mb for k, s, mb in self.actions if k == "W"}  # each stage's last weight gradient
        deferred: dict[int, list[torch.Tensor]] = {}  # stage -> unreduced sums (deferred reduction)

        def recv(
            value: str, src_stage: int, mb: int, direction: int, shape: tuple, dtype: torch.dtype
        ) -> torch.Tensor:
            key = (value, mb, direction)
            if self._mine(src_stage):
                return local.pop(key)
            t0 = time.perf_counter()
            buf = torch.empty(shape, dtype=dtype)
            self.transport.irecv(
                buf, self._rank_of(src_stage), self.pp.group, self._tag(value, mb, direction)
            ).wait()
            clock["p2p"] += time.perf_counter() - t0
            return buf

        def send(value: str, t: torch.Tensor, dst_stage: int, mb: int, direction: int, first: bool) -> None:
            if self._mine(dst_stage):
                key = (value, mb, direction)
                local[key] = t if first or key not in local else local[key] + t
                return
            t = t.contiguous()
            work = self.transport.isend(
                t, self._rank_of(dst_stage), self.pp.group, self._tag(value, mb, direction)
            )
            pending.append((work, t))

        for kind, stage, mb in self.actions if grad else self._forward_order():
            step = self.steps[stage]
            if kind == "F":
                received = [
                    recv(r, step.producer[r], mb, 0, *step.received_meta[k])
                    for k, r in enumerate(step.received)
                ]
                t0 = time.perf_counter()
                res = step.program("forward")(*inputs_for(step, mb), *received)
                clock["compute"] += time.perf_counter() - t0
                n_sent = len(step.sent)
                for v, t in zip(step.sent, res[:n_sent]):
                    for reader in step.readers[v]:
                        send(v, t.detach(), reader, mb, 0, True)
                if step.num_outputs:
                    # The step returns the loss alone: a non-scalar output (the logits) is not kept
                    # to the step's end, m of them at once, only its shape for its zero gradient.
                    outputs[mb] = tuple(
                        o if o.dim() == 0 else _Dropped(tuple(o.shape), o.dtype, o.device)
                        for o in res[n_sent : n_sent + step.num_outputs]
                    )
                    kept_outputs += sum(
                        o.numel() * o.element_size() for o in outputs[mb] if isinstance(o, torch.Tensor)
                    )
                if grad:
                    saved[(stage, mb)] = tuple(res[n_sent + step.num_outputs :])
                    in_flight = max(in_flight, len(saved))
                    for ptr, nbytes in _storages(saved[(stage, mb)]).items():
                        if ptr in weights:
                            continue  # parameters and buffers are state, not activations
                        if ptr not in refs:
                            refs[ptr] = [nbytes, 0]
                            live += nbytes
                        refs[ptr][1] += 1
                    peak_saved = max(peak_saved, live)
            elif kind == "B":
                sv = saved[(stage, mb)]
                tangents = []
                n_sent = len(step.sent)
                for i in step.tangent_outputs:
                    if i < n_sent:
                        v = step.sent[i]
                        shape, dtype = self._sent_meta(step, i)
                        total = None
                        for reader in step.readers[v]:
                            g = recv(v, reader, mb, 1, shape, dtype)
                            total = g if total is None else total + g
                        tangents.append(total)
                    else:
                        out = outputs[mb][i - n_sent]
                        if isinstance(out, _Dropped):
                            tangents.append(torch.zeros(out.shape, dtype=out.dtype, device=out.device))
                        else:
                            tangents.append(torch.full_like(out, self.loss_weight or 1.0 / m))
                t0 = time.perf_counter()
                res = step.program("backward_input")(*sv[: step.num_saved_i], *tangents)
                clock["compute"] += time.perf_counter() - t0
                n_rg = len(step.received_grads)
                for k, g in zip(step.received_grads, res[:n_rg]):
                    r = step.received[k]
                    send(r, g, step.producer[r], mb, 1, True)
                passed[(stage, mb)] = tuple(res[n_rg:])
            else:  # "W"
                sv = saved.pop((stage, mb))
                for ptr in _storages(sv):
                    if ptr in weights:
                        continue
                    refs[ptr][1] -= 1
                    if refs[ptr][1] == 0:
                        live -= refs.pop(ptr)[0]
                args = [sv[j] for j in step.saved_w] + list(passed.pop((stage, mb)))
                t0 = time.perf_counter()
                if step.num_deferred and mb != last_w[stage]:
                    res = step.program("backward_weight_local")(*args)
                    res, unreduced = res[: len(step.param_grads)], res[len(step.param_grads) :]
                    acc = deferred.get(stage)
                    deferred[stage] = (
                        list(unreduced) if acc is None else [a + u for a, u in zip(acc, unreduced)]
                    )
                elif step.num_deferred:
                    sums = deferred.pop(stage, None)
                    if sums is None:  # one micro-batch of this stage in the step
                        dev = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
                        sums = [torch.zeros((), device=dev)] * step.num_deferred
                    res = step.program("backward_weight")(*args, *sums)
                else:
                    res = step.program("backward_weight")(*args)
                clock["compute"] += time.perf_counter() - t0
                for j, g in zip(step.param_grads, res):
                    if g is None:
                        continue
                    i = step.primals[j]
                    grads[i] = g if i not in grads else grads[i] + g
        t0 = time.perf_counter()
        for work, _ in pending:
            work.wait()
        clock["p2p"] += time.perf_counter() - t0
        # The model's outputs: the mean loss over micro-batches, from the last stage's rank.
        src = self._rank_of(last)
        if self._mine(last):
            losses = torch.stack([outputs[mb][0].detach().float() for mb in range(m)])
            loss = losses.mean() if self.shares is None else losses.sum() * self.loss_weight
        else:
            loss = torch.zeros(())
        if self.shares is not None and self._mine(last) and self.shares.size > 1:
            self.transport.all_reduce(loss, self.shares.group)  # the parts of the step's mean
        self.transport.broadcast(loss, src, self.pp.group)
        if grad:
            for i, group in self.shared:
                g = grads.get(i)
                if g is None:
                    g = torch.zeros_like(primals[i])
                self.transport.all_reduce(g, group)
                grads[i] = g
            self.stash = [grads.get(i) for i in self.trainable]
        clock["step"] = time.perf_counter() - t_step
        clock["idle"] = max(0.0, clock["step"] - clock["compute"] - clock["p2p"])
        clock["in_flight"] = float(in_flight)
        clock["saved_peak"] = peak_saved
        clock["outputs_kept"] = kept_outputs
        self.last = clock
        if self.timing:
            self.times.append(clock)
        return (loss,)

    def _sent_meta(self, step: StageStep, i: int) -> tuple[tuple[int, ...], torch.dtype]:
        out = next(n for n in step.forward.graph.nodes if n.op == "output")
        val = out.args[0][i].meta.get("val")
        return tuple(val.shape), val.dtype

    def _forward_order(self) -> list[tuple[str, int, int]]:
        """Forward only (no gradients): every held stage in order, every micro-batch."""
        return [("F", s, mb) for s in sorted(self.steps) for mb in range(self.microbatches)]

    def report(self, schedule: str) -> str:
        """This rank's last step as measured beside ``predicted``, the plan's prediction for it
        (``schedule``: the schedule's name, for the heading; ``ParallelModule.report``)."""
        m = self.last
        if not m:
            raise RuntimeError("report(): run a training step first")
        pred = self.predicted
        if not pred:
            raise RuntimeError(
                "report(): the plan has no per-stage costs (plan.pipeline.stage_costs) to predict from"
            )
        rows = [
            ("step", pred["step"], m["step"]),
            ("compute", pred["compute"], m["compute"]),
            ("waiting for transfers + idle", pred["step"] - pred["compute"], m["p2p"] + m["idle"]),
        ]
        lines = [
            f"pipeline rank {self.pp.coord} of {self.pp.size}, {schedule}, {self.microbatches} micro-batches"
        ]
        lines += [
            f"  {name:<30} predicted {p * 1e3:9.3f} ms   measured {q * 1e3:9.3f} ms" for name, p, q in rows
        ]
        lines.append(
            f"  {'micro-batches in flight':<30} predicted {int(pred['in_flight']):9d}      measured {int(m['in_flight']):9d}"
        )
        return "\n".join(lines)

    def loss(self, primals: Sequence[Any], params: Sequence[torch.Tensor]) -> torch.Tensor:
        """One training step's loss (see module docstring)."""
        grad = torch.is_grad_enabled()
        try:
            # The stage programs are the forward and backward already differentiated: autograd
            # records nothing of them (it would keep every micro-batch's graph alive, and the
            # all-gather's out= form, ``passes.gather_buffers``, refuses under grad mode an input
            # that requires grad, a parameter's shard); ``_Loss`` joins the step to the caller's
            # autograd.
            with torch.no_grad():
                (loss,) = self.run(primals, grad)
        except Exception as exc:  # noted and released for the other ranks (autopar.runtime.monitor)
            err = self.monitor.step_failed(exc, "the pipeline schedule") if self.monitor is not None else None
            if err is None:
                raise
            raise err from exc
        if not grad:
            return loss
        return _Loss.apply(self, loss, *params)


def build_runner(
    stages: RankStages,
    *,
    roles: Sequence[tuple[str, str]],
    trainable: Sequence[int],
    pp_axis: AxisGroup,
    pp_groups: Sequence[Sequence[int]],
    actions: Sequence[tuple[str, int, int]],
    microbatches: int,
    timeout: float = 300.0,
    shares: AxisGroup | None = None,
    loss_weight: float = 0.0,
) -> PipelineRunner:
    """This rank's ``PipelineRunner`` for ``stages`` (built by the per-rank compiler's stage cut, ``autopar.passes.stage_cut``),
    with the groups that sum tied weights' gradients across pipeline ranks. ``roles``: ``(kind,
    name)`` of each primal; ``pp_groups``: the global ranks of every pipeline group (each rank's,
    by coordinate; every rank creates the tied-weight groups of all of them, in the same order);
    ``actions``: this rank's schedule; ``shares``, ``loss_weight``: with unequal data-parallel
    shares, the first mesh axis and each micro-batch loss's gradient (``PipelineRunner``)."""
    import datetime

    # Weights held on several pipeline ranks (tied): one group per distinct set of coordinates in
    # each pipeline group; every rank creates all of them, in the same order.
    me = dist.get_rank()
    pp_ranks = next(list(g) for g in pp_groups if me in g)
    holders = stages.holders
    shared = []
    groups: dict[tuple[int, ...], object] = {}
    for key in sorted({tuple(sorted(c)) for c in holders.values() if len(c) > 1}):
        for g in pp_groups:
            group = dist.new_group([g[c] for c in key], timeout=datetime.timedelta(seconds=timeout))
            if me in g:
                groups[key] = group
    for i, (kind, name) in enumerate(roles):
        if kind == "param" and i in set(trainable) and len(holders.get(name, ())) > 1:
            shared.append((i, groups[tuple(sorted(holders[name]))]))
    coord = stages.stage_coord
    return PipelineRunner(
        steps=stages.steps,
        stage_coord=coord,
        pp=pp_axis,
        pp_ranks=list(pp_ranks),
        actions=[a for a in actions if coord[a[1]] == pp_axis.coord],
        microbatches=microbatches,
        primal_kinds=[k for k, _ in roles],
        trainable=list(trainable),
        shared=shared,
        holders=holders,
        shares=shares,
        loss_weight=loss_weight,
    )
