"""Hard inputs fail clearly, before anything runs: each case asserts its message says what was
wrong and what to do (``autopar.capture``, ``autopar.plan``, plan files, ``autopar.parallelize``)."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.models import GPT, GPTConfig


def test_a_sequence_longer_than_the_position_table_is_refused_at_capture(make_gpt2, batch):
    model = make_gpt2(n_positions=64)
    with pytest.raises(ValueError, match=r"position table transformer\.wpe\.weight has 64 rows") as err:
        autopar.capture(model, batch(2, 128, 256))
    assert "at most 64 tokens" in str(err.value) and "positions up to 127 (128 tokens)" in str(err.value)
    autopar.capture(model, batch(2, 64, 256))  # the longest sequence it supports is fine
    # autopar's own GPT, on the meta device: found from the graph's structure, not from names
    with torch.device("meta"):
        gpt = GPT(GPTConfig.tiny(block_size=32))
    ids = torch.empty(2, 48, dtype=torch.long, device="meta")
    with pytest.raises(ValueError, match=r"wpe\.weight has 32 rows.*at most 32 tokens"):
        autopar.plan(gpt, (ids, ids.clone()), autopar.Cluster.preset("A100-80GB"))


class _ItemLoss(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> float:
        return self.fc(x).pow(2).mean().item()


class _Branchy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        if y.sum() > 0:  # data-dependent control flow: cannot be exported
            return y.mean()
        return y.sum()


def test_a_forward_that_returns_item_is_not_a_loss():
    with pytest.raises(
        ValueError, match=r"returns a Python number: \.item\(\) turned its loss into a number"
    ) as err:
        autopar.plan(_ItemLoss(), (torch.randn(8, 4),), autopar.Cluster.local(2))
    assert "return the loss tensor itself" in str(err.value)


def test_torch_dumps_are_held_back_and_only_autopars_error_is_printed(capfd):
    with pytest.raises(autopar.CaptureError) as err:
        autopar.capture(_Branchy(), (torch.randn(2, 4),))
    out, errs = capfd.readouterr()
    assert "def forward" not in out + errs and "Unable to find user code" not in errs
    assert "test_inputs.py" in str(err.value) and "if y.sum() > 0" in str(err.value)
    assert "def forward" in err.value.exporter_output  # kept for --debug


def test_a_batch_that_does_not_divide_is_planned_and_the_replicated_axis_explained(make_gpt2, batch):
    cluster = autopar.Cluster.preset("A100-80GB", gpus_per_node=8, nodes=2)
    with pytest.warns(
        UserWarning, match=r"mesh axis 0 \(rep=16\) repeats the same work on its 16 devices"
    ) as rec:
        # TF32 matmuls: at the plain FP32 rate this fp32 model's best use of the axis is tensor parallelism
        plan = autopar.plan(
            make_gpt2(), batch(3, 32, 256), cluster, mesh_shape=(16,), float32_matmul_precision="high"
        )
    msg = next(str(w.message) for w in rec if "repeats" in str(w.message))
    assert "the batch (3) does not divide 16 ways" in msg and "a multiple of 16, or fewer devices" in msg
    assert plan.mesh_axes == ("rep",)
    assert "note: mesh axis 0 (rep=16)" in str(plan)  # and print(plan) says it too


def test_the_default_memory_budget_keeps_a_reserve_the_user_can_change():
    gib = 1 << 30
    assert autopar.PlanConfig().budget(80 * gib) == pytest.approx(72 * gib)  # 10% kept free
    assert autopar.PlanConfig(memory_reserve=0.0).budget(80 * gib) == 80 * gib
    assert autopar.PlanConfig(memory_budget=60 * gib, memory_reserve=0.5).budget(80 * gib) == 60 * gib
    with pytest.raises(
        ValueError, match=r"memory_reserve is a fraction of the device's memory in \[0, 1\), got 10"
    ):
        autopar.PlanConfig(memory_reserve=10)
    model = GPT(GPTConfig.tiny())
    idx = torch.randint(0, 128, (8, 32))
    plan = autopar.plan(model, (idx, idx.clone()), autopar.Cluster.preset("A100-80GB"), mesh_shape=(8,))
    assert plan.info["memory_budget"] == pytest.approx(72 * gib)
    assert "of 72.00 GiB budget (device memory less 8.00 GiB reserved)" in plan.summary()


def test_a_truncated_edited_or_foreign_plan_file_names_the_file_and_what_to_do(tmp_path, gpt2_plan):
    path = tmp_path / "plan.json"
    gpt2_plan.save(path)
    assert autopar.Plan.load(path) == gpt2_plan
    text = path.read_text()
    cut = tmp_path / "cut.json"
    cut.write_text(text[: len(text) // 2])
    with pytest.raises(
        ValueError, match=r"cut.json: not a complete plan file \(JSON error at line \d+.*truncated"
    ) as e:
        autopar.Plan.load(cut)
    assert "autopar plan ... -o cut.json" in str(e.value)
    edited = tmp_path / "edited.json"
    edited.write_text(
        text.replace('"S(0)"', '"R"', 1) if '"S(0)"' in text else text.replace('"R"', '"S(0)"', 1)
    )
    with pytest.raises(ValueError, match=r"edited.json: edited after autopar wrote it .*verify=False"):
        autopar.Plan.load(edited)
    assert autopar.Plan.load(edited, verify=False) != gpt2_plan  # a deliberate edit still loads
    binary = tmp_path / "model.bin"
    binary.write_bytes(bytes(range(256)))
    with pytest.raises(ValueError, match=r"model.bin: not a plan file \(binary data"):
        autopar.Plan.load(binary)
    other = tmp_path / "other.json"
    other.write_text('{"format": 2, "mesh_shape": [2]}')
    with pytest.raises(ValueError, match=r"other.json: not a plan file \(no field 'mesh_axes'\)"):
        autopar.Plan.load(other)
    with pytest.raises(FileNotFoundError, match=r"missing.json: no such plan file"):
        autopar.Plan.load(tmp_path / "missing.json")


class _WarnsInForward(torch.nn.Module):
    """Warns while its forward is traced: once per rank unless parallelize shows rank 0's only."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import warnings

        warnings.warn("this model warns while it is traced", UserWarning, stacklevel=1)
        return self.fc(x).pow(2).mean()


def ranks_worker(rank: int, world: int) -> dict[str, str]:
    import warnings

    from autopar.models import GPT, GPTConfig

    out = {}
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("always")  # so a second print could not hide behind the once-filter
        autopar.parallelize(_WarnsInForward(), autopar.Cluster.local(world), (torch.randn(8, 8),))
    # A plan made for another model: refused on every rank, before the model runs.
    idx = torch.randint(0, 128, (4, 32))
    two = GPT(GPTConfig.tiny(n_layer=2))
    plan = autopar.layouts.megatron(two, (idx, idx.clone()), autopar.Cluster.local(world), tp=world)
    three = GPT(GPTConfig.tiny(n_layer=3))
    try:
        autopar.parallelize(three, autopar.Cluster.local(world), (idx, idx.clone()), plan=plan)
        out["other model"] = "no error"
    except Exception as exc:
        out["other model"] = f"{type(exc).__name__}: {exc}"
    return out


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_parallelize_warns_once_and_refuses_a_plan_for_another_model_on_every_rank(capfd):
    from autopar.runtime.launch import spawn

    results = spawn(ranks_worker, 2, timeout=150)
    _, err = capfd.readouterr()  # the ranks' stderr: spawned processes share this file descriptor
    assert err.count("UserWarning: this model warns while it is traced") == 1, err
    assert "Attempted to insert a get_attr Node" not in err
    for rank, out in enumerate(results):
        msg = out["other model"]
        assert "the plan was made for a different program (graph fingerprint" in msg, (rank, msg)
        assert "plan again for this model and input shapes" in msg, (rank, msg)
        assert "this program's node p_blocks_2_" in msg, (rank, msg)  # the first layer the plan lacks
