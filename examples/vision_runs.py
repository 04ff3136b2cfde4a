"""Published ResNet-50 training throughput, predicted: each row of
``reference/published_vision_runs.csv`` (NVIDIA's DeepLearningExamples on DGX A100 and DGX-1; its
header gives the source) planned as a user would — transformers' ``ResNetForImageClassification``
at ResNet-50's default config (v1.5: the stride in the 3×3 convolution), built on the meta device
in the row's precision, data parallel over the row's GPUs with the row's batch per GPU — its
predicted step turned into images per second, against the published figure.

    python examples/vision_runs.py              # every row (seconds each)
    python examples/vision_runs.py --rows 2 4   # some rows (1-based)

Precision: ``tf32`` and ``fp32`` plan the float32 model (float32 convolutions run on TF32 tensor
cores where the device has them, cuDNN's default) in PyTorch's default channels-first layout, as
the source runs them; ``amp`` plans it in bfloat16 (autocast fp16 in the source; the same
tensor-core rate) with model and images channels-last (the source's ``memory_format: nhwc``). The plan synchronizes BatchNorm over the data-parallel
ranks (autopar keeps one device's numerics); the source's DDP runs each GPU's BatchNorm alone —
a few latency-bound gathers per layer, small beside the step.
"""

from __future__ import annotations

import argparse
import csv
import sys
import warnings
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class VisionRow:
    device: str
    gpus: int
    precision: str
    batch_per_gpu: int
    images_per_s: float


def read_rows() -> list[VisionRow]:
    from autopar.reference import data_path

    with open(data_path("published_vision_runs.csv")) as f:
        rows = csv.DictReader(line for line in f if line.strip() and not line.startswith("#"))
        return [
            VisionRow(
                r["device"], int(r["gpus"]), r["precision"], int(r["batch_per_gpu"]), float(r["images_per_s"])
            )
            for r in rows
        ]


def predict(row: VisionRow) -> float:
    """Predicted images per second of ``row``'s run."""
    import transformers

    import autopar

    with torch.device("meta"):
        model = transformers.ResNetForImageClassification(transformers.ResNetConfig(num_labels=1000))
    amp = row.precision == "amp"
    dtype = torch.bfloat16 if amp else torch.float32
    layout = torch.channels_last if amp else torch.contiguous_format  # the source's memory_format
    model = model.to(dtype=dtype, memory_format=layout)
    b = row.batch_per_gpu * row.gpus
    batch = {
        "pixel_values": torch.empty(b, 3, 224, 224, device="meta", dtype=dtype).to(memory_format=layout),
        "labels": torch.empty(b, dtype=torch.long, device="meta"),
    }
    cluster = autopar.Cluster.preset(row.device, row.gpus)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(model, batch, cluster, mesh_shape=(row.gpus,))
    return b / plan.predicted.step_time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="*", help="1-based rows of the CSV (default: all)")
    args = ap.parse_args(argv)
    rows = read_rows()
    chosen = args.rows or range(1, len(rows) + 1)
    print(
        f"{'row':>3} {'device':<10} {'gpus':>4} {'prec':<5} {'b/gpu':>5} {'published':>10} {'predicted':>10} {'error':>7}"
    )
    for i in chosen:
        r = rows[i - 1]
        got = predict(r)
        err = got / r.images_per_s - 1
        print(
            f"{i:>3} {r.device:<10} {r.gpus:>4} {r.precision:<5} {r.batch_per_gpu:>5} "
            f"{r.images_per_s:>10.0f} {got:>10.0f} {err * 100:>+6.1f}%"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
