"""``megatron_static_bytes``: the training state (weights, gradients, optimizer state) a
Megatron-LM layout holds per device, known before planning it (``autopar.layouts.best`` skips the
layouts it proves cannot fit)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from autopar.cost.memory import StateBytes

__all__ = ["megatron_static_bytes"]


def megatron_static_bytes(
    params: Sequence[tuple[str, int, int, bool]],
    roles: dict[str, str],
    experts: dict[str, int],
    *,
    tp: int,
    dp: int,
    ep: int,
    pp: int,
    distributed_optimizer: bool,
    state: Callable[[int], StateBytes],
) -> float:
    """A lower bound on the training state (weights, gradients, optimizer state) one device of
    the Megatron layout holds: ``params`` are ``(name, elements, bytes per element, trainable)``,
    ``state(bytes per element)`` the per-parameter accounting (``autopar.cost.memory``: ZeRO's,
    Rajbhandari et al. Table 1). Each weight is split ``tp`` ways where Megatron splits it
    (``roles``), experts ``ep`` ways; under the distributed optimizer its gradient and optimizer
    state are further split over its data-parallel ranks (``dp`` for dense weights, ``dp · tp / ep``
    for experts) as ZeRO-2 counts them (``megatron``'s docstring); the pipeline's largest stage
    holds at least ``1/pp`` of the total. Exact splits may fall short where shapes do not divide,
    so the true figure is at least this."""
    total = 0.0
    for fqn, numel, nbytes, trainable in params:
        role = roles.get(fqn, "")
        split = ep if fqn in experts else (tp if role and role != "row_bias" else 1)
        n = numel / split
        if not trainable:
            total += n * nbytes
            continue
        s = state(nbytes)
        if distributed_optimizer:
            group = dp * tp // ep if fqn in experts else dp
            total += n * (s.weight + (s.grad + s.optimizer) / group)
        else:
            total += n * s.total
    return total / pp
