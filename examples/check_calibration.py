"""Predicted against measured, for every row of the H100 reference files (``reference/``).

    python examples/check_calibration.py                   # the H100-SXM preset
    python examples/check_calibration.py --profile p.json  # the preset with a calibration profile

Matmul rows check the GEMM efficiency curve; training-step rows build the model on the meta device,
capture it and predict one eager step (forward + backward, AdamW(fused=True), peak memory) with
``autopar.passes.eager_step.single_device_step`` — the same figures ``tests/test_cost_calibration.py``
holds within ±10 %.
"""

from __future__ import annotations

import argparse
import time

from autopar import Cluster
from autopar.reference import check_calibration, format_comparisons


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="H100-SXM", help="cluster preset (default H100-SXM)")
    ap.add_argument("--profile", default=None, help="calibration profile JSON (autopar.runtime.calibrate)")
    args = ap.parse_args()
    cluster = Cluster.preset(args.preset, gpus_per_node=1, profile=args.profile)
    t0 = time.perf_counter()
    rows = check_calibration(cluster)
    print(f"{cluster.describe()}\n")
    print(format_comparisons(rows))
    worst = max(abs(c.error) for c in rows)
    print(f"\nworst error {worst * 100:.1f}% over {len(rows)} figures ({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
