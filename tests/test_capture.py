"""Capture: real models (transformers GPT-2 and LLaMA, our GPT) become ATen graphs with a
FakeTensor on every op and every parameter named; models that cannot be exported fail with an
error that names the module and suggests a fix."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import autopar
from autopar.capture import normalize_inputs


def _check_graph(cap, model, lo=120, hi=250):  # GPT-2: 137 nodes once its mask is proven causal
    nodes = list(cap.graph.nodes)
    assert lo <= len(nodes) <= hi, len(nodes)
    fake = torch._subclasses.FakeTensor
    for n in nodes:
        if n.op == "placeholder":
            assert isinstance(n.meta.get("val"), fake), n.format_node()
        elif n.op == "call_function":
            assert "val" in n.meta, n.format_node()
            val = n.meta["val"]
            if val is None:  # only runtime checks that return nothing
                assert not n.users and "assert" in str(n.target), n.format_node()
            elif isinstance(val, (list, tuple)):
                assert all(isinstance(v, fake) for v in val if isinstance(v, torch.Tensor)), n.format_node()
            elif not isinstance(val, (int, float, bool, torch.SymInt)):
                assert isinstance(val, fake), n.format_node()
    # Every parameter placeholder maps to a parameter FQN, and every parameter has a placeholder.
    params = [n for n in nodes if n.op == "placeholder" and n.name in cap.params]
    unique = dict(model.named_parameters())  # first name of each (tied) parameter
    assert sorted(cap.params[n.name] for n in params) == sorted(unique)
    for fqn, aliases in cap.param_aliases.items():
        assert all(a == fqn or a in dict(model.named_parameters(remove_duplicate=False)) for a in aliases)


def test_capture_gpt2(make_gpt2, batch):
    model = make_gpt2()
    cap = autopar.capture(model, batch(2, 16, 256))
    _check_graph(cap, model)
    assert set(cap.inputs.values()) == {"input_ids", "labels"}
    # lm_head is tied to the token embedding: one placeholder, two names.
    assert cap.param_aliases["transformer.wte.weight"] == ["transformer.wte.weight", "lm_head.weight"]
    assert list(cap.params.values()).count("transformer.wte.weight") == 1
    assert len(cap.fingerprint) == 16


def test_capture_llama(make_llama, batch):
    model = make_llama(layers=2)
    cap = autopar.capture(model, batch(2, 16, 256))
    _check_graph(cap, model)
    ops = {str(n.target) for n in cap.graph.nodes if n.op == "call_function"}
    assert "aten.scaled_dot_product_attention.default" in ops
    assert "aten.linear.default" in ops


@pytest.mark.parametrize("arch", ["gpt2", "t5"])
def test_a_model_built_from_its_default_config_is_captured_without_its_kv_cache(arch):
    """``transformers`` configs say ``use_cache=True``: the export turns the cache off (its object
    is no type the exporter knows), leaves no cache among the outputs and sets the configs back."""
    import transformers

    if arch == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64)
        model = transformers.GPT2LMHeadModel(config)
    else:  # encoder-decoder: its decoder stack holds a config of its own
        config = transformers.T5Config(
            vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0
        )
        model = transformers.T5ForConditionalGeneration(config)
    configs = {id(m.config): m.config for m in model.modules() if getattr(m, "config", None) is not None}
    cached = [c for c in configs.values() if c.use_cache]  # T5's encoder stack already says False
    assert config in cached
    ids = torch.randint(0, 64, (2, 8))
    cap = autopar.capture(model, {"input_ids": ids, "labels": ids.clone()})
    out_names = str(cap.out_spec)
    assert "loss" in out_names and "logits" in out_names
    assert "past_key_values" not in out_names
    assert [c for c in configs.values() if c.use_cache] == cached  # set back after the export
    outputs = next(n for n in cap.graph.nodes if n.op == "output").args[0]
    eager = model(input_ids=ids, labels=ids, use_cache=False)  # what a training step returns
    assert len(outputs) == len([v for v in eager.values() if isinstance(v, torch.Tensor)]), outputs


def test_capture_on_the_meta_device(make_llama, batch):
    model = make_llama(layers=2, meta=True)
    cap = autopar.capture(model, batch(4, 32, 256, device="meta"))
    _check_graph(cap, model)
    vals = [n.meta["val"] for n in cap.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    assert vals and all(v.device.type == "meta" for v in vals)


def test_capture_our_gpt_with_positional_inputs(make_gpt):
    model = make_gpt()
    idx = torch.randint(0, 128, (2, 16))
    cap = autopar.capture(model, (idx, idx.clone()))
    assert set(cap.inputs.values()) == {"args[0]", "args[1]"}
    assert cap.param_aliases["wte.weight"] == ["wte.weight", "lm_head.weight"]
    assert tuple(cap.graph.find_nodes(op="output")[0].args[0][0].meta["val"].shape) == ()  # the loss


def test_same_model_same_fingerprint_different_shapes_differ(make_gpt):
    model = make_gpt()
    a = torch.zeros(2, 16, dtype=torch.long)
    b = torch.zeros(4, 16, dtype=torch.long)
    assert (
        autopar.capture(model, (a, a.clone())).fingerprint
        == autopar.capture(model, (a, a.clone())).fingerprint
    )
    assert (
        autopar.capture(model, (a, a.clone())).fingerprint
        != autopar.capture(model, (b, b.clone())).fingerprint
    )


def test_normalize_inputs_forms():
    x = torch.zeros(2)
    assert normalize_inputs(x) == ((x,), {})
    assert normalize_inputs((x, x)) == ((x, x), {})
    assert normalize_inputs({"a": x}) == ((), {"a": x})
    assert normalize_inputs(((x,), {"a": x})) == ((x,), {"a": x})
    with pytest.raises(TypeError, match="example_inputs"):
        normalize_inputs(3)


class _Gate(nn.Module):
    """Branches in Python on a tensor's value: cannot be exported."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if y.sum() > 0:
            return y.relu()
        return y


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.gate = _Gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(self.inp(x)).sum()


def test_data_dependent_control_flow_raises_capture_error_naming_the_module():
    with pytest.raises(autopar.CaptureError) as err:
        autopar.capture(_Net(), torch.randn(4, 8))
    msg = str(err.value)
    assert "in module gate (_Gate)" in msg  # the submodule whose code branched, not the root
    assert "if y.sum() > 0:" in msg  # the offending line
    assert "test_capture.py" in msg
    assert "fix:" in msg and "torch.where" in msg and "torch.cond" in msg
    assert isinstance(err.value.__cause__, Exception)  # the exporter's own error is kept


class _Masked(nn.Module):
    """Selects rows by a boolean mask of the input (BART's classification head picks its
    end-of-sentence tokens so): the selection's size depends on the mask's values."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return self.proj(x)[keep].sum()


def test_a_size_that_depends_on_the_inputs_values_is_refused_naming_the_op():
    x = torch.randn(4, 6, 8)
    with pytest.raises(autopar.CaptureError) as err:
        autopar.capture(_Masked(), (x, x[..., 0] > 0))
    msg = str(err.value)
    assert "size depends on its inputs' values: aten.index.Tensor" in msg
    assert "(_Masked)" in msg and "fix:" in msg and "boolean mask" in msg


def test_inputs_on_another_device_than_the_model_are_named_in_the_fix(make_gpt):
    with torch.device("meta"):
        model = make_gpt()
    ids = torch.randint(0, 64, (2, 8))  # on the CPU, the model on the meta device
    with pytest.raises(autopar.CaptureError) as err:
        autopar.capture(model, (ids, ids))
    msg = str(err.value)
    assert "fix: the computation mixes tensors on meta and cpu" in msg, msg
    assert "device='meta'" in msg


def _structure(cap):
    """(name, op, target, shape, dtype, args) of every node: what a plan and the runtime key on."""
    out = []
    for n in cap.graph.nodes:
        v = n.meta.get("val")
        shape = (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else None
        out.append((n.name, n.op, str(n.target), shape, repr(n.args), repr(n.kwargs)))
    return out


@pytest.mark.parametrize("kind", ["gpt", "gpt2", "llama", "t5"])
def test_microbatch_graph_is_the_graph_an_export_of_the_micro_batch_gives(
    kind, make_gpt, make_gpt2, make_llama, batch
):
    """One export with a symbolic batch, specialised per micro-batch count, gives exactly the graph
    (node names, ops, arguments, shapes, fingerprint) that exporting the micro-batch itself gives."""
    from autopar.capture import microbatch_inputs
    from autopar.microbatch import MicrobatchCaptures

    if kind == "t5":
        from transformers import T5Config, T5ForConditionalGeneration

        cfg = T5Config(
            vocab_size=128,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            dropout_rate=0.0,
            use_cache=False,
        )
        model = T5ForConditionalGeneration(cfg)
        ids = torch.randint(0, 128, (8, 12))
        inputs = {"input_ids": ids, "decoder_input_ids": ids[:, :6].clone(), "labels": ids[:, 1:7].clone()}
    else:
        model = {"gpt": make_gpt, "gpt2": make_gpt2, "llama": lambda: make_llama(layers=2)}[kind]()
        inputs = batch(8, 16, 128)
        if kind == "gpt":
            inputs = (inputs["input_ids"], inputs["labels"])
    graphs = MicrobatchCaptures(model, inputs)
    model.eval()  # no dropout: the graph's loss is compared with the eager model's
    for m in (2, 8):
        got = graphs(m)
        assert graphs.symbolic_failure is None
        args, kwargs = normalize_inputs(inputs)
        micro = microbatch_inputs(args, kwargs, m)
        want = autopar.capture(model, micro)
        if kind == "gpt":  # our GPT traces to the same graph either way
            assert _structure(got) == _structure(want)
            assert got.fingerprint == want.fingerprint
        # transformers' mask code folds differently with a symbolic batch: the same values, a few more ops
        assert got.params == want.params and got.inputs == want.inputs
        for n in got.user_input_nodes():
            assert n.meta["val"].shape[0] == 8 // m
        out = got.gm(*_placeholder_values(got, model, micro))
        eager = model(*micro[0], **micro[1])
        eager = eager if isinstance(eager, torch.Tensor) else eager.loss
        torch.testing.assert_close(out[0], eager, rtol=1e-6, atol=1e-6)
    assert graphs(1) is graphs(1)  # cached


def _placeholder_values(cap, model, inputs):
    """The graph's inputs in placeholder order: parameters, buffers and the user's tensors."""
    args, kwargs = inputs
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    out = []
    for n in cap.graph.nodes:
        if n.op != "placeholder":
            continue
        if n.name in cap.params or n.name in cap.buffers:
            out.append(params[cap.params.get(n.name) or cap.buffers[n.name]])
        elif n.name in cap.inputs:
            path = cap.inputs[n.name]
            out.append(args[int(path[5:-1])] if path.startswith("args[") else kwargs[path])
        else:
            out.append(cap.constants[n.name])
    return out


class _BranchesOnBatch(nn.Module):
    """Takes a different path for a batch of 4 or more: no symbolic batch can be exported."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] >= 4:
            return self.lin(x).sum()
        return (self.lin(x) * 2).sum()


def test_microbatch_graph_of_a_model_branching_on_the_batch_is_exported_by_itself():
    from autopar.microbatch import MicrobatchCaptures

    model = _BranchesOnBatch()
    graphs = MicrobatchCaptures(model, torch.randn(8, 8))
    cap = graphs(4)  # a micro-batch of 2 takes the other branch
    assert graphs.symbolic_failure is not None
    ops = [str(n.target) for n in cap.graph.nodes if n.op == "call_function"]
    assert "aten.mul.Tensor" in ops
    assert tuple(cap.user_input_nodes()[0].meta["val"].shape) == (2, 8)


def graph_record(gm: torch.fx.GraphModule, ops: bool = False) -> tuple[list, list]:
    """Every node's value (sizes, strides, offset, dtype, gradient) — and, with ``ops``, its op
    and arguments — and which of the ops' values share a storage."""
    rows, storages = [], {}
    for n in gm.graph.nodes:
        if ops:
            rows.append((n.name, str(n.target), str(n.args), str(n.kwargs)))
        for k, v in enumerate(torch.utils._pytree.tree_leaves(n.meta.get("val"))):
            if isinstance(v, torch.Tensor):
                rows.append(
                    (n.name, k, tuple(v.shape), v.stride(), v.storage_offset(), v.dtype, v.requires_grad)
                )
                if n.op == "call_function":
                    storages.setdefault(v.untyped_storage()._cdata, []).append(n.name)
            else:
                rows.append((n.name, k, v))
    return rows, sorted(storages.values())


@pytest.mark.parametrize("kind", ["gpt2", "llama", "mixtral", "t5", "vit", "cnn"])
def test_micro_batch_values_evaluated_at_the_batch_are_the_propagated_ones(
    kind, make_gpt2, make_llama, monkeypatch
):
    """``specialise_batch`` evaluates each node's symbolic sizes at the batch instead of running the
    ops on fake tensors: the same shape, strides, offset, dtype and ``requires_grad`` on every
    node as the propagation it falls back to gives, and the values sharing a storage among the
    ops (``passes.annotate.is_alias``) those of the export, as a capture of the whole batch has
    them (propagation differs there: ``dropout`` at p = 0 returns its input's storage)."""
    import test_architectures as A

    from autopar import microbatch as mb

    if kind in ("gpt2", "llama"):
        model = make_gpt2() if kind == "gpt2" else make_llama(layers=2)
        ids = torch.randint(0, 128, (8, 16))
        inputs: object = {"input_ids": ids, "labels": ids.clone()}
    else:  # a mixture of experts, an encoder-decoder, a vision transformer, a CNN with batch norm
        model, inputs = A.build(kind)
    ep = mb.MicrobatchCaptures(model, inputs)._symbolic_export()
    evaluated = mb.specialise_batch(ep.graph_module, 2)

    def refuse(*args: object) -> None:
        raise mb._NotSubstituted("the test's")

    monkeypatch.setattr(mb, "_substitute_vals", refuse)
    propagated = mb.specialise_batch(ep.graph_module, 2)

    record = graph_record
    got, want = record(evaluated), record(propagated)
    assert any(len(r) > 3 and r[2][:1] == (2,) for r in got[0])  # a batch of 2
    assert got[0] == want[0]
    exported = record(ep.graph_module)[1]
    assert got[1] == exported and (kind == "cnn" or any(len(g) > 1 for g in got[1]))  # views share a storage


def test_specialising_a_micro_batch_graph_starts_no_thread(make_gpt, monkeypatch):
    """A process with a second thread may not fork, and the planner then solves its meshes one after
    another: specialising a micro-batch graph by propagation (``torch.fx.Interpreter`` makes a tqdm
    bar, whose first instance starts tqdm's monitor thread; the fallback of evaluating the values)
    must leave the thread count as it was."""
    import threading

    from tqdm import tqdm

    from autopar import microbatch as mb
    from autopar.microbatch import MicrobatchCaptures

    def refuse(*args: object) -> None:
        raise mb._NotSubstituted("the test's")

    monkeypatch.setattr(mb, "_substitute_vals", refuse)

    if tqdm.monitor is not None:  # started by an earlier test: stop it, so this one can fail
        tqdm.monitor.exit()
        tqdm.monitor = None
    model = make_gpt()
    ids = torch.randint(0, 128, (8, 16))
    before = threading.active_count()
    graphs = MicrobatchCaptures(model, (ids, ids.clone()))
    graphs(2)
    assert graphs.symbolic_failure is None
    assert tqdm.monitor is None
    assert threading.active_count() == before, [t.name for t in threading.enumerate()]


# ---------------------------------------------------------------- canonical graph (meta = cpu)


def _t5(vocab: int = 128) -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(
        vocab_size=vocab, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
        use_cache=False, decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return T5ForConditionalGeneration(cfg)


def _on_meta(x):
    if isinstance(x, torch.Tensor):
        return torch.empty_like(x, device="meta")
    if isinstance(x, dict):
        return {k: _on_meta(v) for k, v in x.items()}
    return tuple(_on_meta(v) for v in x)


@pytest.mark.parametrize("kind", ["gpt", "gpt2", "llama", "t5"])
def test_the_meta_device_captures_the_program_the_real_model_runs(kind, make_gpt, make_gpt2, make_llama):
    """A plan is made on the meta device and run on the real model: both captures are one program
    (same node names, ops, shapes, fingerprint), one batch and micro-batches alike. Before the
    canonical graph, attention's ``contiguous`` (a copy on CPU, nothing on meta) and T5's
    ``labels[:, 0] = 0`` (``fill_`` on CPU, ``copy_`` on meta) made them differ."""
    from autopar.microbatch import MicrobatchCaptures

    build = {"gpt": make_gpt, "gpt2": make_gpt2, "llama": lambda: make_llama(layers=2), "t5": _t5}[kind]
    ids = torch.randint(0, 128, (4, 16))
    inputs = {"input_ids": ids, "labels": ids[:, :8].clone() if kind == "t5" else ids.clone()}
    if kind == "gpt":
        inputs = (inputs["input_ids"], inputs["labels"])
    torch.manual_seed(0)
    real = build()
    with torch.device("meta"):
        meta = build()
    for m in (1, 2):
        got = MicrobatchCaptures(meta, _on_meta(inputs))(m)
        want = MicrobatchCaptures(real, inputs)(m)
        assert got.fingerprint == want.fingerprint, kind
        assert _rows(got) == _rows(want)
        assert not [n for n in want.graph.nodes if n.target is torch.ops.aten.contiguous.default]


def _rows(cap) -> list[tuple]:
    """Each node's name, op (``reshape`` read as ``view``, as the fingerprint reads it) and shape."""
    same = {"aten.reshape.default": "aten.view.default"}
    out = []
    for n in cap.graph.nodes:
        v = n.meta.get("val")
        shape = tuple(v.shape) if isinstance(v, torch.Tensor) else None
        out.append((n.name, same.get(str(n.target), str(n.target)), shape))
    return out


class _Layouts(nn.Module):
    """A transposed copy read by a view (removed), one written in place (kept), and Python numbers
    written into a tensor (one form on every device)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.transpose(0, 1).contiguous().view(-1)
        kept = x.t().contiguous()
        kept.mul_(2)
        through_view = x.t().contiguous()
        through_view[0] = 5  # a write through a view (select) of the copy
        shifted = x.new_zeros(x.shape)
        shifted[:, 1:] = x[:, :-1]
        shifted[:, 0] = 3
        out = flat.sum() + kept.sum() + through_view.sum()
        return out + (shifted * torch.arange(x.shape[1], device=x.device)).sum() + x.sum()


def test_canonical_graph_keeps_the_values_and_the_copies_written_into():
    x = torch.randn(4, 6)
    model = _Layouts()
    cap = autopar.capture(model, (x,))
    aten = torch.ops.aten
    contig = [n for n in cap.graph.nodes if n.target is aten.contiguous.default]
    assert [next(iter(c.users)).target for c in contig] == [aten.mul_.Tensor, aten.select.int]
    assert any(n.target is aten.reshape.default for n in cap.graph.nodes)
    assert not cap.constants  # the lifted 3 became a scalar_tensor
    fills = [n for n in cap.graph.nodes if n.target is aten.fill_.Tensor]
    assert len(fills) == 2 and all(f.args[1].target is aten.scalar_tensor.default for f in fills)
    torch.testing.assert_close(cap.gm(x)[0], model(x))
    meta = autopar.capture(_Layouts(), (x.to("meta"),))
    assert meta.fingerprint == cap.fingerprint
    # numbered again in graph order: per op, ``op``, ``op_1``, ``op_2``, … with no gaps (fx starts
    # at ``sum_1`` for a name that is a Python builtin)
    numbers: dict[str, list[int]] = {}
    for n in cap.graph.nodes:
        if n.op == "call_function":
            base, num = re.fullmatch(r"(.*?)(?:_(\d+))?", n.name).groups()
            numbers.setdefault(base, []).append(int(num or 0))
    assert all(nums == list(range(nums[0], nums[0] + len(nums))) for nums in numbers.values()), numbers


def test_a_capture_is_recognised_as_its_model_and_inputs_and_a_different_one_is_named(make_gpt2, batch):
    """``capture_difference`` (what ``parallelize(captured=...)`` checks): None for the model and
    inputs captured, the first difference in words otherwise; ``parallelize`` refuses a capture
    of another model before anything distributed starts."""
    from autopar.capture import capture_difference

    model, inputs = make_gpt2(), batch(2, 16, 256)
    cap = autopar.capture(model, inputs)
    assert capture_difference(cap, model, *normalize_inputs(inputs)) is None
    assert capture_difference(cap, make_gpt2(), *normalize_inputs(inputs)) is None  # values are not compared

    longer = capture_difference(cap, model, *normalize_inputs(batch(2, 32, 256)))
    assert (
        longer == "input 'input_ids': the capture has (2, 16) torch.int64, these inputs (2, 32) torch.int64"
    )
    renamed = capture_difference(cap, model, (), {"ids": inputs["input_ids"], "labels": inputs["labels"]})
    assert renamed is not None and "'input_ids'" in renamed and "ids, labels" in renamed
    wider = capture_difference(cap, make_gpt2(n_embd=32), *normalize_inputs(inputs))
    assert wider is not None and wider.startswith(
        "parameter 'transformer.wte.weight': the capture has (256, 64)"
    )
    deeper = capture_difference(cap, make_gpt2(n_layer=3), *normalize_inputs(inputs))
    assert deeper == "parameter 'transformer.h.2.ln_1.weight' is not in the capture"
    shallower = capture_difference(
        autopar.capture(make_gpt2(n_layer=3), inputs), model, *normalize_inputs(inputs)
    )
    assert shallower is not None and "the capture has parameters the model lacks" in shallower

    cluster = autopar.Cluster.local(1)
    with pytest.raises(
        ValueError, match=r"captured is not a capture of this model .*: parameter 'transformer.h.2"
    ):
        autopar.parallelize(make_gpt2(n_layer=3), cluster, inputs, captured=cap)
    with pytest.raises(TypeError, match=r"captured must be what autopar\.capture"):
        autopar.parallelize(model, cluster, inputs, captured=cap.gm)
