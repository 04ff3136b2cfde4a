"""The records of Inductor's fusion chains (``autopar.passes.chains`` finds them; its module
docstring defines the words): the ``node.meta``/``gm.meta`` keys, :class:`Chain`,
:class:`ChainRole`, and whether the cost model charges the compiled step. Apart from the finder so
that ``autopar.passes.annotate``, whose helpers the finder uses, can read them without a circle."""

from __future__ import annotations

from dataclasses import dataclass

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
    reads: tuple[bool, ...]
    """Per tensor argument (``autopar.passes.annotate.ordered_tensor_args``): an external value
    this member reads first in its chain."""
    writes: bool
    """Its output is read outside the chain (directly or through views in it)."""
    extern_grads: int
    """Gradients it receives from outside the chain."""
    launch_fwd: bool
    launch_bwd: bool
    reread: bool
    """The chain's backward needs values: some member's derivative reads its operands
    (``autopar.passes.annotate.saved_inputs``, or it keeps its output), recomputed from the
    chain's external inputs (``autopar.cost.compiled``)."""
    view: bool = False
    """A view (no kernel of its own); ``extern_grads`` then counts the gradients a view of an
    external value receives from outside, which one generated kernel adds up."""
    shared_grad: bool = False
    """Its derivative hands each input the same gradient (``add``)."""

    def key(self) -> tuple:
        """What costing the member depends on (repeated layers share strategies only with nodes of
        the same key)."""
        return (
            "chain",
            self.reads,
            self.writes,
            self.extern_grads,
            self.launch_fwd,
            self.launch_bwd,
            self.reread,
        )


def compile_assumed(ctx: PassContext) -> bool:
    """Whether the cost model charges the compiled step: ``PlanConfig.compile`` and
    ``annotate_chains`` not disabled."""
    return ctx.config.compile and "annotate_chains" not in set(ctx.config.disable)
