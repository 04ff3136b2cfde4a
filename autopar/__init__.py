"""autopar: a compiler-style auto-parallelizer for PyTorch training.

    import autopar
    cluster = autopar.Cluster.preset("A100-80GB", gpus_per_node=8, nodes=2)
    plan = autopar.plan(model, example_inputs, cluster)      # capture, cost, solve
    print(plan)                                              # per-module placements and costs
    pm = autopar.parallelize(model, cluster, example_inputs, plan=plan)   # on every rank

Stages (each printable): ``capture`` (torch.export) → annotation passes (``autopar.passes``:
tensors, costs, strategies) → ``solver`` (CP-SAT) → ``Plan`` → lowering to per-rank programs
(``autopar.passes.lower``) → ``autopar.runtime``.
"""

from autopar import layouts
from autopar.capture import CaptureError, capture
from autopar.cluster import Cluster, DeviceSpec, Link
from autopar.placement import Partial, Replicate, Shard
from autopar.plan import Plan
from autopar.planner import plan

__all__ = [
    "CaptureError",
    "Cluster",
    "DeviceSpec",
    "Link",
    "Partial",
    "Plan",
    "Replicate",
    "Shard",
    "capture",
    "layouts",
    "parallelize",
    "plan",
]


def parallelize(*args, **kwargs):  # replaced below by the runtime's, with its full signature
    from autopar.runtime.module import parallelize as _parallelize

    return _parallelize(*args, **kwargs)


try:  # give the lazy wrapper the real signature and docstring when the runtime imports cleanly
    from autopar.runtime.module import parallelize as _p

    parallelize = _p  # type: ignore[assignment]
except ImportError:  # the runtime is importable only once it exists; planning works without it
    pass
