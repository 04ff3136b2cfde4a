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
from autopar.api import measure_local, parallelize, plan
from autopar.capture import CaptureError, capture
from autopar.cluster import Cluster
from autopar.config import PlanConfig
from autopar.devices import DeviceSpec, Link
from autopar.mesh import Mesh
from autopar.placement import Partial, Replicate, Shard
from autopar.planfile import Plan
from autopar.report import explain
from autopar.simulate import simulate  # the function (the module is autopar.simulate's namesake)

__all__ = [
    "CaptureError",
    "Cluster",
    "DeviceSpec",
    "Link",
    "Mesh",
    "Partial",
    "Plan",
    "PlanConfig",
    "Replicate",
    "Shard",
    "capture",
    "explain",
    "layouts",
    "measure_local",
    "parallelize",
    "plan",
    "simulate",
]
