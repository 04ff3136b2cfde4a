"""Pipelines on models that are not a stack of equal transformer layers: small vision models from
``transformers`` (ViT, Swin, ConvNeXt, ResNet, CLIP's vision tower) and plain torch (an MLP-Mixer,
a residual CNN with BatchNorm), each with a classification loss, built from tiny configs.

A classifier's smallest crossing activation is its logits (batch × classes), so all its seams lie
at the head; cut there, the second stage held only the loss and no parameter, and
``torch.optim.AdamW(pm.parameters())`` on that rank raised "optimizer got an empty parameter
list". The cuts now fall back to the model's boundaries (one activation crossing: between its
blocks) where the seams leave a stage idle, and never make a stage without a parameter
(``autopar.passes.stages``)."""

from __future__ import annotations

import os
from typing import Any

import _runtime_helpers as H
import pytest
import torch
from torch import nn

import autopar
from autopar.runtime.launch import spawn

pytestmark = pytest.mark.filterwarnings("ignore:autopar")

BATCH, CLASSES = 4, 10


class Mixer(nn.Module):
    """An MLP-Mixer (Tolstikhin et al., arXiv 2105.01601): patches, then token- and channel-mixing
    MLPs with residuals."""

    def __init__(self, dim: int = 32, patches: int = 16, layers: int = 2) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, dim, 4, 4)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {
                    "n1": nn.LayerNorm(dim),
                    "tok": nn.Sequential(nn.Linear(patches, 32), nn.GELU(), nn.Linear(32, patches)),
                    "n2": nn.LayerNorm(dim),
                    "ch": nn.Sequential(nn.Linear(dim, 64), nn.GELU(), nn.Linear(64, dim)),
                }
            )
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, CLASSES)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.stem(x).flatten(2).transpose(1, 2)
        for b in self.blocks:
            x = x + b["tok"](b["n1"](x).transpose(1, 2)).transpose(1, 2)
            x = x + b["ch"](b["n2"](x))
        return nn.functional.cross_entropy(self.head(self.norm(x).mean(1)), y)


class ResCNN(nn.Module):
    """A residual CNN with BatchNorm."""

    def __init__(self, c: int = 16, blocks: int = 3) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU())
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.Conv2d(c, c, 3, padding=1),
                nn.BatchNorm2d(c),
                nn.ReLU(),
                nn.Conv2d(c, c, 3, padding=1),
                nn.BatchNorm2d(c),
            )
            for _ in range(blocks)
        )
        self.head = nn.Linear(c, CLASSES)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for b in self.blocks:
            x = torch.relu(x + b(x))
        return nn.functional.cross_entropy(self.head(x.mean((2, 3))), y)


class Classifier(nn.Module):
    """A ``transformers`` vision backbone, a linear head on its pooled output (or its first
    token), and the cross-entropy loss: ``(pixel_values, labels) -> loss``."""

    def __init__(self, backbone: nn.Module, dim: int, pooled: bool = True) -> None:
        super().__init__()
        self.backbone, self.head, self.pooled = backbone, nn.Linear(dim, CLASSES), pooled

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.backbone(pixel_values=x)
        h = out.pooler_output if self.pooled else out.last_hidden_state[:, 0]
        return nn.functional.cross_entropy(self.head(h.flatten(1)), y)


def build(kind: str, seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """A tiny fp32 model without dropout and one batch of 4 images of 16 × 16 pixels."""
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    torch.manual_seed(seed)
    inputs = (torch.randn(BATCH, 3, 16, 16), torch.randint(0, CLASSES, (BATCH,)))
    if kind == "mixer":
        return Mixer(), inputs
    if kind == "rescnn":
        return ResCNN(), inputs
    import transformers as T

    vit = dict(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=64)  # fmt: skip
    if kind == "vit":
        cfg = T.ViTConfig(**vit, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        return Classifier(T.ViTModel(cfg, add_pooling_layer=False), 32, pooled=False), inputs
    if kind == "clip":
        return Classifier(T.CLIPVisionModel(T.CLIPVisionConfig(**vit)), 32), inputs
    if kind == "swin":
        cfg = T.SwinConfig(image_size=16, patch_size=2, embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=4,
                           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0)  # fmt: skip
        return Classifier(T.SwinModel(cfg), 32), inputs
    if kind == "convnext":
        cfg = T.ConvNextConfig(
            hidden_sizes=[16, 32], depths=[2, 2], num_stages=2, patch_size=2, drop_path_rate=0.0
        )
        return Classifier(T.ConvNextModel(cfg), 32), inputs
    if kind == "resnet":
        cfg = T.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic")
        return Classifier(T.ResNetModel(cfg), 32), inputs
    raise ValueError(kind)


KINDS = ("vit", "swin", "convnext", "resnet", "clip", "mixer", "rescnn")


def _params_by_stage(model: nn.Module, inputs: Any, plan: Any) -> list[set[str]]:
    """The parameters each stage's compute nodes read, from the graph the plan was made for."""
    from autopar.microbatch import MicrobatchCaptures

    pipe = plan.pipeline
    cap = MicrobatchCaptures(model, inputs)(pipe.microbatches)
    out: list[set[str]] = [set() for _ in range(pipe.num_stages)]
    for n in cap.graph.nodes:
        if n.name in pipe.stage_of:
            out[pipe.stage_of[n.name]] |= {
                cap.params[i.name] for i in n.all_input_nodes if i.name in cap.params
            }
    return out


# ------------------------------------------------------------------------------ single process


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", KINDS)
def test_every_stage_of_a_vision_pipeline_holds_parameters_and_work(kind):
    model, inputs = build(kind)
    plan = autopar.plan(model, inputs, autopar.Cluster.local(2), pp=2, microbatches=2)
    pipe = plan.pipeline
    assert pipe is not None and pipe.num_stages == 2
    held = _params_by_stage(model, inputs, plan)
    assert all(held), [sorted(h) for h in held]  # stage 1 held none: AdamW raised on its rank
    assert all(c["static"] > 0 for c in pipe.stage_costs), pipe.stage_costs
    work = [c["forward"] + c["backward_input"] + c["backward_weight"] for c in pipe.stage_costs]
    assert min(work) >= 0.25 * max(work), work  # balanced, not the loss alone in a stage


def test_a_stage_count_no_cut_can_give_parameters_is_refused():
    """One parameter-reading op: no two stages can each hold a parameter; the error says so."""
    from autopar.passes import PassContext, run_passes
    from autopar.passes.annotate import annotate_tensors
    from autopar.passes.stages import stage_cuts

    class OneLayer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(torch.tanh(self.fc(x))).pow(2).mean()

    cap = autopar.capture(OneLayer(), (torch.randn(4, 8),))
    run_passes(cap.gm, PassContext(captured=cap, cluster=autopar.Cluster.local(2)), [annotate_tensors])
    with pytest.raises(ValueError, match=r"2 pipeline stages that each read a parameter.*use pp <= 1"):
        stage_cuts(cap.gm, 2)


@pytest.mark.timeout(200)
def test_megatron_pipelines_cut_vision_models_or_say_which_reason_applies():
    """``layouts.megatron(pp=2)`` refused all of them with one message for two reasons; it cuts
    them at equal layer counts now, and a refusal names the reason that applies."""
    cluster = autopar.Cluster.local(2)
    for kind in ("vit", "mixer"):
        model, inputs = build(kind)
        plan = autopar.layouts.megatron(model, inputs, cluster, tp=1, pp=2, microbatches=2)
        assert all(_params_by_stage(model, inputs, plan)), kind
    torch.manual_seed(0)
    three, inputs = Mixer(layers=3), build("mixer")[1]
    with pytest.raises(autopar.solver.InfeasibleError) as err:
        autopar.layouts.megatron(three, inputs, cluster, tp=1, pp=2, microbatches=2)
    msg = str(err.value)
    assert "3 repeated layers do not divide into 2 stages" in msg and "memory" not in msg, msg
    model, inputs = build("mixer")
    with pytest.raises(autopar.solver.InfeasibleError) as err:
        autopar.layouts.megatron(model, inputs, cluster, tp=1, pp=2, microbatches=2, memory_budget=2e5)
    msg = str(err.value)
    assert "peaks at" in msg and "over the memory budget of 195.31 KiB" in msg and "divide" not in msg, msg


# ------------------------------------------------------------------------------ distributed

TRAINED = ("vit", "convnext", "rescnn")
STEPS = 2


def _train(module: nn.Module, inputs: Any, opt: torch.optim.Optimizer) -> list[float]:
    losses = []
    for _ in range(STEPS):
        loss = module(*inputs)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def vision_worker(rank: int, world: int, plans: dict[str, Any]) -> dict[str, list[float]]:
    H.quiet()
    out = {}
    for kind, plan in plans.items():
        model, inputs = build(kind)
        pm = autopar.parallelize(model, autopar.Cluster.local(world), inputs, plan=plan)
        out[kind] = _train(pm, inputs, torch.optim.AdamW(pm.parameters(), lr=1e-3))  # on every rank
    return out


def _reference(kind: str, microbatches: int) -> list[float]:
    """One process: the mean loss over the micro-batches, each run by itself (BatchNorm's
    statistics are a micro-batch's, as in the pipeline), one AdamW step per batch."""
    model, (x, y) = build(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(STEPS):
        parts = [model(xm, ym) for xm, ym in zip(x.chunk(microbatches), y.chunk(microbatches))]
        loss = torch.stack(parts).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_vision_pipelines_train_like_one_process_with_adamw_on_every_rank():
    plans = {}
    for kind in TRAINED:
        model, inputs = build(kind)
        plans[kind] = autopar.plan(model, inputs, autopar.Cluster.local(2), pp=2, microbatches=2)
    results = spawn(vision_worker, 2, plans, timeout=360)
    for kind in TRAINED:
        ref = _reference(kind, 2)
        for rank, r in enumerate(results):
            assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(r[kind], ref)), (kind, rank, r[kind], ref)
