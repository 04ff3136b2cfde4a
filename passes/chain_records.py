"""The records of Inductor's fusion chains (``autopar.passes.chains`` finds them; its module
docstring defines the words): the ``node.meta``/``gm.meta`` keys, :class:`Chain`,
:class:`ChainRole`, and whether the cost model charges the compiled step. Apart from the finder so
that ``autopar.passes.annotate``, whose helpers the finder uses, can read them without a circle."""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cost.compiled import ChainShare
from autopar.passes import PassContext

__all__ = ["CHAIN", "CHAINS", "Chain", "ChainRole", "compile_assumed"]

CHAIN = "autopar.chain"
"""``node.meta`` key: the member's :class:`ChainRole`."""
CHAINS = "autopar.chains"
"""``gm.meta`` key: every :class:`Chain` found, in program order."""


@dataclass(frozen=True, slots=True)
class Chain:
    """One group of members (module docstring), names in program order."""

    members: tuple[str, ...]
    depth: int
    inputs: tuple[str, ...]
    """The external values it reads (nodes outside it), in program order of first reading."""
    outputs: tuple[str, ...]
    """Members whose values are read outside it."""
    computing: int
    """Members that are not views (``autopar.passes.annotate.is_alias``); 0: a chain of views
    only, which launches no kernel."""


@dataclass(frozen=True, slots=True)
class ChainRole:
    """A member's part of its chain (module docstring: role)."""

    chain: int
    """Index of its chain in ``gm.meta[CHAINS]``."""
    share: ChainShare
    """What its share of the chain's kernels depends on (``autopar.cost.compiled``)."""

    def key(self) -> tuple:
        """What costing the member depends on (repeated layers share strategies only with nodes of
        the same key)."""
        s = self.share
        return ("chain", s.reads, s.writes, s.extern_grads, s.launch_fwd, s.launch_bwd, s.reread)


def compile_assumed(ctx: PassContext) -> bool:
    """Whether the cost model charges the compiled step: ``PlanConfig.compile`` and
    ``annotate_chains`` not disabled."""
    return ctx.config.compile and "annotate_chains" not in set(ctx.config.disable)
