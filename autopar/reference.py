"""Predictions against measurements: the cost model checked on the reference rows in
``reference/`` (measured on one H100-SXM, PyTorch 2.11, bf16, eager; each file's header says how).
The folder is installed as the package ``autopar.reference_data`` and every ``*.csv`` in it ships
in the wheel: read a file through ``data_path(name)``, never by a path relative to the checkout.

* ``h100_matmul.csv`` — dense bf16 ``torch.matmul`` of ``M×K @ K×N`` in TFLOP/s: checks the GEMM
  efficiency curve (``autopar.cost.compute.gemm_efficiency``).
* ``h100_training_steps.csv`` — whole single-device training steps of GPT (``autopar.models.GPT``)
  and LLaMA (transformers' ``LlamaForCausalLM``) shapes: forward + ``loss.backward()`` in ms,
  ``AdamW(fused=True).step()`` in ms, and ``torch.cuda.max_memory_allocated()``. The model is
  built on the meta device from the row, captured, annotated and walked as one eager step
  (``autopar.passes.eager_step.single_device_step``); nothing is fitted per row.

* ``published_runs.csv`` — published large-scale H100 runs (Megatron-Core's weak-scaling table,
  NVIDIA's LLaMA 3.1 benchmarks), each predicted with its own layout by
  ``examples/published_runs.py``; ``published_runs_more.csv`` — more such rows (Nemotron-4 15B and
  340B, GPT-3 175B, LLaMA 3.1 405B from NVIDIA's dgxc-benchmarking), held out: read after the cost
  model was fitted, never tuned to.
* ``published_vision_runs.csv`` — published data-parallel ResNet-50 training throughput (NVIDIA's
  DeepLearningExamples on DGX A100 and DGX-1, TF32/FP32 and mixed precision), predicted by
  ``examples/vision_runs.py``: the CNN counterpart of the language-model rows, held out.

``check_calibration()`` returns one :class:`Comparison` per figure; ``format_comparisons`` prints
them (``examples/check_calibration.py``).
"""

from __future__ import annotations

import csv
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from autopar import reference_data
from autopar.capture import capture
from autopar.cluster import Cluster
from autopar.config import PlanConfig
from autopar.cost.compute import gemm_efficiency
from autopar.cost.step import StepEstimate
from autopar.passes import PassContext, run_passes
from autopar.passes.annotate import annotate_cost, annotate_tensors
from autopar.passes.eager_step import StepOptions, single_device_step

__all__ = [
    "REFERENCE_DIR",
    "Comparison",
    "MatmulRow",
    "StepRow",
    "build_step_model",
    "check_calibration",
    "data_path",
    "format_comparisons",
    "predict_step",
    "read_matmul_rows",
    "read_step_rows",
]

REFERENCE_DIR = Path(reference_data.__file__).resolve().parent
"""The measured reference files: ``reference/`` in a checkout, ``autopar/reference_data/`` installed."""


def data_path(name: str) -> Path:
    """The reference file ``name`` (e.g. ``"h100_matmul.csv"``), wherever autopar is installed."""
    path = REFERENCE_DIR / name
    if not path.is_file():
        have = ", ".join(sorted(p.name for p in REFERENCE_DIR.glob("*.csv")))
        raise FileNotFoundError(f"no reference file {name!r} in {REFERENCE_DIR} (it has: {have})")
    return path


@dataclass(frozen=True, kw_only=True, slots=True)
class MatmulRow:
    m: int
    n: int
    k: int
    tflops: float


@dataclass(frozen=True, kw_only=True, slots=True)
class StepRow:
    """One measured training step (see ``h100_training_steps.csv``'s header)."""

    model: str
    """``"gpt"`` or ``"llama"``."""
    layers: int
    heads: int
    hidden: int
    batch: int
    seq: int
    params: int
    fwd_bwd_ms: float
    optimizer_ms: float
    peak_memory_bytes: float
    vocab: int = 0
    """GPT only: the vocabulary, untied from the input embedding (0: the file's tied 50304)."""

    @property
    def name(self) -> str:
        v = f" V{self.vocab}" if self.vocab else ""
        return f"{self.model} L{self.layers} h{self.hidden} a{self.heads} b{self.batch} s{self.seq}{v}"


@dataclass(frozen=True, slots=True)
class Comparison:
    """One predicted figure against its measurement."""

    row: str
    what: str
    predicted: float
    measured: float
    unit: str

    @property
    def error(self) -> float:
        """Relative error of the prediction, ``predicted / measured − 1``."""
        return self.predicted / self.measured - 1.0


def _rows(path: str | os.PathLike[str]) -> list[dict[str, str]]:
    with open(path) as f:
        return list(csv.DictReader(line for line in f if line.strip() and not line.startswith("#")))


def read_matmul_rows(path: str | os.PathLike[str] | None = None) -> list[MatmulRow]:
    rows = _rows(path or data_path("h100_matmul.csv"))
    return [MatmulRow(m=int(r["M"]), n=int(r["N"]), k=int(r["K"]), tflops=float(r["tflops"])) for r in rows]


def read_step_rows(path: str | os.PathLike[str] | None = None) -> list[StepRow]:
    out = []
    for r in _rows(path or data_path("h100_training_steps.csv")):
        out.append(
            StepRow(
                model=r["model"],
                layers=int(r["layers"]),
                heads=int(r["heads"]),
                hidden=int(r["hidden"]),
                batch=int(r["batch"]),
                seq=int(r["seq"]),
                params=int(r["params"]),
                fwd_bwd_ms=float(r["fwd_bwd_ms"]),
                optimizer_ms=float(r["optimizer_ms"]),
                peak_memory_bytes=float(r["peak_memory_bytes"]),
                vocab=int(r["vocab"]) if (r.get("vocab") or "").strip() else 0,
            )
        )
    return out


def build_step_model(row: StepRow) -> tuple[torch.nn.Module, Any]:
    """The row's model in bf16 on the meta device and its example inputs, built as the reference
    measured it (the file's header)."""
    ids = torch.empty(row.batch, row.seq, dtype=torch.long, device="meta")
    if row.model == "gpt":
        from autopar.models import GPT, GPTConfig

        with torch.device("meta"):
            vocab = {"vocab_size": row.vocab, "tie_embeddings": False} if row.vocab else {}
            model = GPT(
                GPTConfig(
                    n_layer=row.layers, n_head=row.heads, n_embd=row.hidden, block_size=row.seq, **vocab
                )
            )
        return model.to(torch.bfloat16), (ids, ids.clone())
    if row.model == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            hidden_size=row.hidden,
            num_hidden_layers=row.layers,
            num_attention_heads=row.heads,
            num_key_value_heads=8,
            intermediate_size=4 * row.hidden,
            vocab_size=32000,
            max_position_embeddings=max(row.seq, 2048),
            attn_implementation="sdpa",
            use_cache=False,
        )
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg)
        return model.to(torch.bfloat16), {"input_ids": ids, "labels": ids.clone()}
    raise ValueError(f"unknown reference model {row.model!r} (known: gpt, llama)")


def predict_step(
    model: torch.nn.Module, example_inputs: Any, cluster: Cluster, options: StepOptions | None = None
) -> StepEstimate:
    """Capture ``model`` and predict one eager training step on one device of ``cluster``
    (``single_device_step``; default options: pure-bf16 ``AdamW(fused=True)``, as measured)."""
    cap = capture(model, example_inputs)
    opts = options or StepOptions()
    ctx = PassContext(
        captured=cap,
        cluster=cluster,
        config=PlanConfig(optimizer=opts.optimizer),
        mixed_precision=opts.master_weights,
    )
    gm = run_passes(cap.gm, ctx, (annotate_tensors, annotate_cost))
    return single_device_step(gm, ctx, opts)


def check_calibration(
    cluster: Cluster | None = None,
    *,
    steps: Sequence[StepRow] | None = None,
    matmuls: Sequence[MatmulRow] | None = None,
) -> list[Comparison]:
    """Every reference figure predicted on ``cluster`` (default one ``H100-SXM``)."""
    cl = cluster or Cluster.preset("H100-SXM", gpus_per_node=1)
    dev = cl.device
    out = []
    for r in read_matmul_rows() if matmuls is None else matmuls:
        tf = gemm_efficiency(r.m, r.n, r.k, dev) * dev.flops_for("bfloat16") / 1e12
        out.append(Comparison(f"matmul {r.m}×{r.n}×{r.k}", "TFLOP/s", tf, r.tflops, "TFLOP/s"))
    for r in read_step_rows() if steps is None else steps:
        model, inputs = build_step_model(r)
        est = predict_step(model, inputs, cl)
        out.append(Comparison(r.name, "forward+backward", est.fwd_bwd * 1e3, r.fwd_bwd_ms, "ms"))
        out.append(Comparison(r.name, "optimizer step", est.optimizer * 1e3, r.optimizer_ms, "ms"))
        out.append(
            Comparison(r.name, "peak memory", est.peak_memory / 2**30, r.peak_memory_bytes / 2**30, "GiB")
        )
    return out


def format_comparisons(rows: Sequence[Comparison]) -> str:
    """A table: row, figure, predicted, measured, error."""
    head = f"{'reference row':<36} {'figure':<17} {'predicted':>16} {'measured':>16}  {'error':>7}"
    lines = [head, "-" * len(head)]
    for c in rows:
        lines.append(
            f"{c.row:<36} {c.what:<17} {c.predicted:>8.2f} {c.unit:<7} {c.measured:>8.2f} {c.unit:<7} "
            f"{c.error * 100:>+6.1f}%"
        )
    return "\n".join(lines)
