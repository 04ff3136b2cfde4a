"""Emulated nodes on one machine: local processes in groups, joined by a slower link.

On one machine every gloo process reaches every other at the same speed, so a plan for a cluster
of several nodes joined by a slower network (two-level collectives, which mesh axis crosses the
nodes) cannot be measured here as it is. :func:`emulate_nodes` makes a ``ParallelModule``'s
collectives behave as if its ranks sat on separate machines joined by one NIC each, so that the
cost model's prediction for such a cluster can be held against a measurement
(``examples/local_fidelity.py --slow-link``).

Words:

* **emulated node** — ``per_node`` consecutive ranks standing for one machine (node ``k``: ranks
  ``k·per_node … (k+1)·per_node − 1``). Collectives among them run at gloo's own speed.
* **crossing collective** — one whose group has ranks on more than one emulated node.
* **NIC** — each emulated node has one, of ``bandwidth`` bytes/s in each direction. The bytes a
  crossing collective sends out of a node queue on that node's NIC, first come first served: the
  groups of the other mesh axes on the node that cross at the same time (every tensor-parallel
  rank's data-parallel reduction) share it.
* **share** — the bytes that leave one node. A ring over the group's members leaves each node
  once per round, so a node sends the ring's per-device volume (NCCL's bus-bandwidth notes,
  ``nccl-tests/doc/PERFORMANCE.md``; the same volumes as ``autopar.cost.comm``, which the runtime
  does not import): all-reduce ``2(n−1)/n·S``, all-gather and reduce-scatter ``(n−1)/n·S`` (``S``
  the full buffer); an all-to-all sends each of the node's ``p`` members' off-node part,
  ``p·(n−p)/n·S`` (``S`` one member's buffer); a broadcast passes ``S`` through each node once; a
  point-to-point transfer between nodes puts its bytes on the sender's NIC.
* **charge** — a crossing collective is charged when its last member issues it (its transfer can
  start no earlier), a point-to-point transfer when its sender does: each node's NIC takes its
  share after what it already carries, and the collective's **finish** is when the last of its
  nodes' NICs is done, plus ``latency``. Its wait returns at gloo's own completion or at the
  finish, whichever is later: the rank sleeps for the difference. Work issued before the wait runs
  meanwhile (a link is a wire, not a core).

The ranks share the NIC clocks and the charges in flight through a file they all map
(``EmulatedLink.state``, ``_SharedTable``; ``flock`` around every access): every emulated process
runs on this machine.

What is emulated: the training step — the collectives of its traced program (a plan without
pipeline stages), or of a pipeline's stage programs with the runner's transfers, its loss
broadcast and its shared weights' gradient sums (``PipelineRunner.transport``). Not the forward
program run without gradients (evaluation), and not Inductor's programs (``compile=True``):
:func:`emulate_nodes` refuses a compiled step rather than leave its link fast.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.fx import GraphModule

from autopar.program.records import FUNCTIONAL_COLLECTIVES
from autopar.runtime.pipeline_runner import Transport
from autopar.runtime.step_runner import plain_attribute

__all__ = ["EmulatedLink", "LinkTally", "emulate_nodes", "node_share"]


@dataclass(frozen=True, slots=True)
class EmulatedLink:
    """Nodes of ``per_node`` consecutive ranks, each with one NIC of ``bandwidth`` bytes/s (one
    direction) and ``latency`` seconds per crossing collective; ``state``: the file the ranks share
    (every rank passes the same path; :meth:`create` makes one)."""

    per_node: int
    bandwidth: float
    state: str
    latency: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.per_node, bool) or not isinstance(self.per_node, int) or self.per_node < 1:
            raise ValueError(
                f"EmulatedLink.per_node must be a whole number of ranks >= 1, got {self.per_node!r}"
            )
        if not self.bandwidth > 0:
            raise ValueError(f"EmulatedLink.bandwidth must be > 0 bytes/s, got {self.bandwidth!r}")
        if not self.latency >= 0:
            raise ValueError(f"EmulatedLink.latency must be >= 0 seconds, got {self.latency!r}")
        if not self.state:
            raise ValueError(
                "EmulatedLink.state must name the file the ranks share (EmulatedLink.create makes one)"
            )

    @classmethod
    def create(cls, per_node: int, bandwidth: float, directory: str, latency: float = 0.0) -> EmulatedLink:
        """A link whose state file is new, in ``directory`` (make it before the ranks start)."""
        path = os.path.join(directory, f"autopar-link-{os.getpid()}-{time.monotonic_ns()}.bin")
        with open(path, "wb") as f:
            f.truncate(_SharedTable.SIZE)
        return cls(per_node=per_node, bandwidth=bandwidth, state=path, latency=latency)

    def node_of(self, rank: int) -> int:
        return rank // self.per_node


def node_share(kind: str, nbytes: float, ranks: tuple[int, ...], node: int, per_node: int) -> float:
    """Bytes a ``kind`` collective over ``ranks`` on an ``nbytes`` buffer (``S`` as in the module
    docstring) sends out of emulated ``node`` (0 when the group does not cross nodes)."""
    n = len(ranks)
    nodes = {r // per_node for r in ranks}
    if len(nodes) < 2 or node not in nodes:
        return 0.0
    p = sum(1 for r in ranks if r // per_node == node)
    if kind == "all_reduce":
        return 2 * (n - 1) / n * nbytes
    if kind in ("all_gather", "reduce_scatter"):
        return (n - 1) / n * nbytes
    if kind == "all_to_all":
        return p * (n - p) / n * nbytes
    if kind == "broadcast":  # a pipelined ring broadcast passes the buffer through each node once
        return nbytes
    raise ValueError(f"no emulated share for a {kind!r} collective")


MAX_NODES = 256
SLOTS = 8192
_SLOT = struct.Struct("<qiid")  # key, members arrived, members done, finish (monotonic seconds)
_EMPTY = 0


class _SharedTable:
    """The NIC clocks and the charges in flight, in a file every rank maps (``mmap``): ``busy``
    (one double per node: when its NIC is next free) then ``SLOTS`` slots, one per charge in
    flight (open addressing, linear probing). Every access holds ``flock`` on the file for a few struct reads and writes:
    short enough that a rank is rarely descheduled inside (a JSON file read and written under the
    lock cost 2 ms a transfer with 4 processes on 2 cores, in convoys)."""

    SIZE = 8 * MAX_NODES + _SLOT.size * SLOTS

    def __init__(self, path: str) -> None:
        self.file = open(path, "r+b")  # noqa: SIM115 (held open for the rank's life)
        self.map = mmap.mmap(self.file.fileno(), self.SIZE)

    @staticmethod
    def _off(i: int) -> int:
        return 8 * MAX_NODES + _SLOT.size * i

    def _slot(self, key: int) -> int:
        """The index of ``key``'s slot, or of the empty slot it would take (linear probing)."""
        i = key % SLOTS
        for _ in range(SLOTS):
            k = struct.unpack_from("<q", self.map, self._off(i))[0]
            if k in (key, _EMPTY):
                return i
            i = (i + 1) % SLOTS
        raise RuntimeError(f"the emulated link has more than {SLOTS} transfers in flight")

    def _free(self, i: int) -> None:
        """Empty slot ``i``, moving back the later entries of its probe run that would otherwise be
        cut off from their home slot (deletion under linear probing)."""
        j = i
        while True:
            j = (j + 1) % SLOTS
            row = _SLOT.unpack_from(self.map, self._off(j))
            if row[0] == _EMPTY:
                break
            home = row[0] % SLOTS
            if (i < home <= j) if i <= j else (home > i or home <= j):
                continue  # its home lies after the hole: it stays reachable
            _SLOT.pack_into(self.map, self._off(i), *row)
            i = j
        _SLOT.pack_into(self.map, self._off(i), _EMPTY, 0, 0, 0.0)

    def arrive(
        self, key: int, members: int | None, shares: dict[int, float], bandwidth: float, latency: float
    ) -> None:
        """A member reached the charge ``key``; the last of ``members`` (``None``: a transfer's
        receiver, which never charges) queues each node's share on its NIC and sets the finish."""
        with _flock(self.file):
            off = self._off(self._slot(key))
            k, arrived, done, finish = _SLOT.unpack_from(self.map, off)
            if k != key:
                arrived, done, finish = 0, 0, -1.0
            arrived += 1
            if members is not None and arrived >= members:
                now = finish = time.monotonic()
                for node, share in sorted(shares.items()):
                    busy = max(now, struct.unpack_from("<d", self.map, 8 * node)[0]) + share / bandwidth
                    struct.pack_into("<d", self.map, 8 * node, busy)
                    finish = max(finish, busy)
                finish += latency
            _SLOT.pack_into(self.map, off, key, arrived, done, finish)

    def leave(self, key: int, members: int) -> float:
        """A member is done waiting for ``key``: its finish (the slot is freed after the last)."""
        with _flock(self.file):
            i = self._slot(key)
            k, arrived, done, finish = _SLOT.unpack_from(self.map, self._off(i))
            assert k == key and finish >= 0, "a transfer completed before its charge (emulated link)"
            if done + 1 >= members:
                self._free(i)
            else:
                _SLOT.pack_into(self.map, self._off(i), key, arrived, done + 1, finish)
            return finish


class _flock:
    def __init__(self, f: Any) -> None:
        self.f = f

    def __enter__(self) -> None:
        fcntl.flock(self.f, fcntl.LOCK_EX)

    def __exit__(self, *exc: Any) -> None:
        fcntl.flock(self.f, fcntl.LOCK_UN)


def _key(*parts: int) -> int:
    """A charge's slot key (ints hash alike in every process): never the empty mark."""
    return (hash(parts) & 0x3FFFFFFFFFFFFFFF) + 1


@dataclass
class LinkTally:
    """What the emulated link did on this rank: crossing collectives issued (by kind), the bytes
    this rank's node sent for them (each collective's share of this rank's node, once per rank),
    and the seconds its waits slept for the link."""

    calls: Counter = field(default_factory=Counter)
    node_bytes: float = 0.0
    slept: float = 0.0


class _Emulator:
    """One rank's side of an :class:`EmulatedLink` (attached to its programs and transport)."""

    def __init__(self, link: EmulatedLink, rank: int) -> None:
        self.link = link
        self.rank = rank
        self.seq: Counter = Counter()
        self.pending: dict[str, tuple[int | None, int]] = {}
        self.ranks: dict[str, tuple[int, ...]] = {}
        self.targets: dict[str, Any] = {}
        """What each rewritten node called, by ``"<program>:<node name>"`` (``_rewrite``)."""
        self.tally = LinkTally()
        self.table = _SharedTable(link.state)

    def _group_ranks(self, group: Any) -> tuple[int, ...]:
        """The global ranks of ``group`` (a process group, or a functional collective's group name)."""
        if isinstance(group, str):
            if group not in self.ranks:
                pg = dist.distributed_c10d._resolve_process_group(group)
                self.ranks[group] = tuple(dist.get_process_group_ranks(pg))
            return self.ranks[group]
        return tuple(dist.get_process_group_ranks(group or dist.group.WORLD))

    def _charge(self, key: int, members: int | None, shares: dict[int, float]) -> None:
        """This rank reached the charge ``key`` (``_SharedTable.arrive``)."""
        self.table.arrive(key, members, shares, self.link.bandwidth, self.link.latency)

    def begin(self, kind: str, nbytes: float, ranks: tuple[int, ...]) -> int | None:
        """Before a collective over ``ranks`` is issued: its key where it crosses nodes (charged
        once every member has begun it), else ``None``."""
        per = self.link.per_node
        nodes = {r // per for r in ranks}
        if len(nodes) < 2:
            return None
        key = _key(0, self.seq[ranks], *ranks)
        self.seq[ranks] += 1
        self.tally.calls[kind] += 1
        self.tally.node_bytes += node_share(kind, nbytes, ranks, self.link.node_of(self.rank), per)
        self._charge(key, len(ranks), {k: node_share(kind, nbytes, ranks, k, per) for k in nodes})
        return key

    def begin_send(self, src: int, dst: int, tag: int, nbytes: float) -> int | None:
        """Before a point-to-point transfer: its key where it crosses nodes, charged to the
        sender's NIC at once (the sender and the receiver both call it, each once)."""
        a, b = self.link.node_of(src), self.link.node_of(dst)
        if a == b:
            return None
        pair = (-1, src, dst, tag)
        key = _key(*pair, self.seq[pair])
        self.seq[pair] += 1
        if self.rank == src:
            self.tally.calls["p2p"] += 1
            self.tally.node_bytes += nbytes
        self._charge(key, 1 if self.rank == src else None, {a: nbytes})  # the sender charges it
        return key

    def end(self, key: int | None, members: int) -> None:
        """After the real wait of ``key``'s transfer (every member has begun it): sleep until the
        link is done with it."""
        if key is None:
            return
        delay = self.table.leave(key, members) - time.monotonic()
        if delay > 0:
            time.sleep(delay)
            self.tally.slept += delay

    # ------------------------------------------------------------------ in the step programs
    def issue(self, node_name: str, target: Any, args: tuple, kwargs: dict) -> Any:
        kind = FUNCTIONAL_COLLECTIVES[target]
        ranks = self._group_ranks([a for a in args if isinstance(a, str)][-1])
        x = args[0]
        nbytes = x.numel() * x.element_size() * (len(ranks) if kind == "all_gather" else 1)
        # Begun before the real issue: its completion then implies every member has charged.
        self.pending[node_name] = (self.begin(kind, nbytes, ranks), len(ranks))
        return target(*args, **kwargs)

    def wait(self, node_name: str, target: Any, args: tuple) -> Any:
        out = target(*args)
        self.end(*self.pending.pop(node_name))
        return out


class _Work:
    """A transfer's work whose ``wait`` also waits for the emulated link."""

    def __init__(self, work: Any, emu: _Emulator, key: int | None) -> None:
        self.work, self.emu, self.key = work, emu, key

    def wait(self) -> bool:
        out = self.work.wait()
        self.emu.end(self.key, 2)
        return out


class _EmulatedTransport(Transport):
    """The pipeline runner's transfers, broadcast and shared-weight sums through the link."""

    def __init__(self, emu: _Emulator) -> None:
        self.emu = emu

    def isend(self, t: torch.Tensor, dst: int, group: Any, tag: int) -> Any:
        key = self.emu.begin_send(self.emu.rank, dst, tag, t.numel() * t.element_size())
        return _Work(super().isend(t, dst, group, tag), self.emu, key)

    def irecv(self, buf: torch.Tensor, src: int, group: Any, tag: int) -> Any:
        key = self.emu.begin_send(src, self.emu.rank, tag, buf.numel() * buf.element_size())
        return _Work(super().irecv(buf, src, group, tag), self.emu, key)

    def _blocking(self, kind: str, t: torch.Tensor, group: Any, call: Any) -> None:
        ranks = self.emu._group_ranks(group)
        key = self.emu.begin(kind, t.numel() * t.element_size(), ranks)
        call()
        self.emu.end(key, len(ranks))

    def broadcast(self, t: torch.Tensor, src: int, group: Any) -> None:
        self._blocking("broadcast", t, group, lambda: Transport.broadcast(self, t, src, group))

    def all_reduce(self, t: torch.Tensor, group: Any) -> None:
        self._blocking("all_reduce", t, group, lambda: Transport.all_reduce(self, t, group))


def _emulated_issue(emu: _Emulator, node_name: str, *args: Any, **kwargs: Any) -> Any:
    return emu.issue(node_name, emu.targets[node_name], args, kwargs)


def _emulated_wait(emu: _Emulator, node_name: str, wait_name: str, *args: Any) -> Any:
    return emu.wait(node_name, emu.targets[wait_name], args)


def _rewrite(gm: GraphModule, emu: _Emulator, program: int) -> None:
    """Route ``gm``'s collectives and their waits through ``emu`` (``program``: this program's
    number among the module's, which keeps its nodes' names apart from the others')."""
    attr = None
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target not in FUNCTIONAL_COLLECTIVES:
            continue
        if attr is None:
            attr = plain_attribute(gm, "_link_emulator", emu)
        name = f"{program}:{n.name}"
        waits = [u for u in n.users if u.op == "call_function"]
        emu.targets[name] = n.target
        n.args = (attr, name, *n.args)
        n.target = _emulated_issue
        for w in waits:  # wait_tensor, or the monitor's wait in its place (runtime.step_runner)
            emu.targets[f"{program}:{w.name}"] = w.target
            w.args = (attr, name, f"{program}:{w.name}", *w.args)
            w.target = _emulated_wait
    gm.recompile()


def emulate_nodes(module: Any, link: EmulatedLink) -> LinkTally:
    """Make ``module`` (a ``ParallelModule`` on this rank) run as if its ranks were on nodes joined
    by ``link`` (module docstring); returns this rank's :class:`LinkTally`, updated as it runs.
    Call it on every rank, after ``autopar.parallelize`` and before the first step."""
    pipeline = getattr(module, "pipeline", None)
    step = getattr(module, "step", None)
    if pipeline is None and step is None:
        raise ValueError(
            "emulate_nodes needs a module whose training step is a traced program (autopar.parallelize)"
        )
    compiled = step.compiled if step is not None else any(s.compiled for s in pipeline.steps.values())
    if compiled:
        raise ValueError(
            "emulate_nodes cannot reach into a step compiled by Inductor (compile=True): parallelize without compile"
        )
    nodes = -(-dist.get_world_size() // link.per_node)
    if nodes > MAX_NODES:
        raise ValueError(f"emulate_nodes emulates at most {MAX_NODES} nodes; {dist.get_world_size()} ranks of "
                         f"{link.per_node} per node make {nodes}: put more ranks on a node")  # fmt: skip
    emu = _Emulator(link, dist.get_rank())
    if step is not None:
        programs = [step.forward, step.backward]
    else:
        names = ("forward", "backward_input", "backward_weight", "backward_weight_local")
        programs = [
            getattr(s, n) for s in pipeline.steps.values() for n in names if getattr(s, n) is not None
        ]
        pipeline.transport = _EmulatedTransport(emu)
    for i, gm in enumerate(programs):
        _rewrite(gm, emu, i)
    return emu.tally
