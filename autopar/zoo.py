"""The model zoo: well-known models built from their published configurations, never downloaded.

``autopar.zoo.load("llama3-8b", batch=64, seq=8192)`` returns a :class:`Workload`: the model (on
the meta device unless asked otherwise, so a 70B model costs no memory) and one global example
batch that makes it return its training loss. A MODEL argument of the command line is one of:

* a **built-in name** (``autopar.zoo.names()``): ``gpt-tiny``, ``gpt2``, ``gpt2-xl``,
  ``gpt3-175b``, and Megatron-Core's weak-scaling GPTs ``mcore-gpt-1.7b`` … ``mcore-gpt-462b``
  (the rows of ``reference/published_runs.csv``) (autopar's own GPT-2-style model,
  ``autopar.models.GPT``, no extra dependency);
  ``llama3-8b``, ``llama3-70b``, ``mixtral-8x7b``, ``t5-base``, ``vit-base`` (built with
  transformers' model classes from the configurations their papers and model cards publish:
  ``pip install 'autopar[models]'``);
* a **transformers config file** (``path/to/config.json``, or its directory): the model class is
  the config's ``architectures[0]``, else the causal-LM, sequence-to-sequence or image classifier
  class registered for its ``model_type``;
* **``module:factory``** (or ``path/to/file.py:factory``): ``factory(**kw)`` called with those of
  ``batch``, ``seq``, ``dtype`` and ``device`` it accepts, returning a model or ``(model,
  example_inputs)``.

Words: the **kind** of a model says what its example batch is — ``causal-lm`` (token ids and the
same ids as labels), ``seq2seq-lm`` (encoder ids and decoder labels), ``image-classifier``
(pixels and class labels). ``overrides`` change configuration fields (``num_hidden_layers=2``),
e.g. to plan a shallow copy of a model quickly; ``layers`` is the common case.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

__all__ = ["ZOO", "ModelSpec", "Workload", "ZooError", "load", "names", "parse_dtype"]

DTYPES = MappingProxyType({"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32})
"""``--dtype`` values and the parameter dtype they give."""

MODELS_EXTRA = "pip install 'transformers>=4.45'  (or, in a checkout: pip install -e '.[models]')"


class ZooError(ValueError):
    """A model argument that names nothing buildable; the message says what would work."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """A built-in model: where its class comes from and its published configuration."""

    name: str
    summary: str
    """One line: what it is, its size, where the configuration is published."""
    kind: str
    """``causal-lm``, ``seq2seq-lm`` or ``image-classifier`` (see module docstring)."""
    source: str
    """``autopar`` (``autopar.models.GPT``) or the transformers class name."""
    config: Mapping[str, Any]
    """Configuration fields (``GPTConfig`` or the transformers config class)."""
    default_seq: int
    """Sequence length (image side in pixels for an image classifier) when none is given."""
    layers_field: str
    """The configuration field holding the depth (``layers=`` overrides it)."""
    max_seq_field: str = ""
    """The configuration field bounding the sequence length, if the model has one."""


def _gpt(name: str, summary: str, **cfg: Any) -> ModelSpec:
    return ModelSpec(
        name=name, summary=summary, kind="causal-lm", source="autopar", config=MappingProxyType(cfg),
        default_seq=cfg["block_size"], layers_field="n_layer", max_seq_field="block_size",
    )  # fmt: skip


def _hf(
    name: str,
    summary: str,
    *,
    kind: str,
    cls: str,
    seq: int,
    layers_field: str = "num_hidden_layers",
    max_seq: str = "",
    **cfg: Any,
) -> ModelSpec:
    return ModelSpec(
        name=name, summary=summary, kind=kind, source=cls, config=MappingProxyType(cfg),
        default_seq=seq, layers_field=layers_field, max_seq_field=max_seq,
    )  # fmt: skip


_GPT = (
    # name, summary, vocabulary, sequence, layers, heads, width
    ("gpt-tiny", "a 2-layer, 64-wide GPT for trying things out", 256, 64, 2, 4, 64),
    ("gpt2", "GPT-2 small, 124M (Radford et al. 2019)", 50257, 1024, 12, 12, 768),
    ("gpt2-xl", "GPT-2 XL, 1.5B (Radford et al. 2019)", 50257, 1024, 48, 25, 1600),
    ("gpt3-175b", "GPT-3 175B (Brown et al. 2020, Table 2.1)", 50257, 2048, 96, 96, 12288),
)  # fmt: skip
"""autopar's own GPTs (``autopar.models.GPT``) from their papers' configurations."""

_MCORE_GPT = (
    ("1.7B", 24, 2048, 16), ("7.1B", 30, 4096, 32), ("16B", 32, 6144, 48), ("32B", 48, 7168, 56),
    ("70B", 84, 8192, 64), ("119B", 92, 10240, 80), ("177B", 96, 12288, 96), ("314B", 96, 16384, 128),
    ("462B", 112, 18432, 144),
)  # fmt: skip
"""Megatron-Core's weak-scaling table (NVIDIA/Megatron-LM README, r0.8.0): size, layers, hidden,
heads of a GPT with a GeLU MLP of 4·h, vocabulary 131072, sequence 4096, untied embeddings."""


def _gpt_row(
    name: str, summary: str, vocab: int, seq: int, layers: int, heads: int, width: int, **extra: Any
) -> ModelSpec:
    """One row of ``_GPT`` (``extra``: further ``GPTConfig`` fields)."""
    return _gpt(name, summary, vocab_size=vocab, block_size=seq, n_layer=layers, n_head=heads, n_embd=width,
                **extra)  # fmt: skip


def _mcore_gpt(size: str, layers: int, hidden: int, heads: int) -> ModelSpec:
    """One GPT of ``_MCORE_GPT``."""
    summary = f"GPT {size} of Megatron-Core's weak-scaling table on H100 (Megatron-LM README, 2024)"
    return _gpt_row(
        f"mcore-gpt-{size.lower()}", summary, 131072, 4096, layers, heads, hidden, tie_embeddings=False
    )


_LLAMA3 = dict(vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
               tie_word_embeddings=False, use_cache=False, bos_token_id=128000, eos_token_id=128001)  # fmt: skip


def _llama3(size: str, hidden: int, ffn: int, layers: int, heads: int) -> ModelSpec:
    """Llama 3 of one size (Meta's model card): grouped-query attention with 8 key-value heads."""
    return _hf(
        f"llama3-{size.lower()}", f"Llama 3 {size} (Meta, model card)", kind="causal-lm", cls="LlamaForCausalLM",
        seq=8192, max_seq="max_position_embeddings", hidden_size=hidden, intermediate_size=ffn,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=8, **_LLAMA3,
    )  # fmt: skip


_MIXTRAL = _hf(
    "mixtral-8x7b", "Mixtral 8x7B, 47B parameters, 13B active (Jiang et al. 2024)",
    kind="causal-lm", cls="MixtralForCausalLM", seq=4096, max_seq="max_position_embeddings",
    vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
    max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-5, tie_word_embeddings=False,
    use_cache=False,
)  # fmt: skip
_T5 = _hf(
    "t5-base", "T5 base, 223M, encoder-decoder (Raffel et al. 2020)",
    kind="seq2seq-lm", cls="T5ForConditionalGeneration", seq=512, layers_field="num_layers",
    vocab_size=32128, d_model=768, d_kv=64, d_ff=3072, num_layers=12, num_decoder_layers=12,
    num_heads=12, use_cache=False, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
)  # fmt: skip
_VIT = _hf(
    "vit-base", "ViT-B/16, 86M, 224×224 images (Dosovitskiy et al. 2021)",
    kind="image-classifier", cls="ViTForImageClassification", seq=224,
    hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
    image_size=224, patch_size=16, num_labels=1000,
)  # fmt: skip

ZOO: Mapping[str, ModelSpec] = MappingProxyType(
    {
        s.name: s
        for s in (
            *(_gpt_row(*row) for row in _GPT),
            *(_mcore_gpt(*row) for row in _MCORE_GPT),
            _llama3("8B", 4096, 14336, 32, 32),
            _llama3("70B", 8192, 28672, 80, 64),
            _MIXTRAL,
            _T5,
            _VIT,
        )
    }
)
"""The built-in models by name."""


@dataclass(kw_only=True, slots=True)
class Workload:
    """A model and one global example batch that makes it return its training loss."""

    name: str
    """The MODEL argument it was built from."""
    model: nn.Module
    example_inputs: Any
    """Positional args (a tuple) or keyword args (a dict), as ``autopar.plan`` takes them."""
    batch: int
    seq: int | None
    """Tokens per sequence (pixels per image side for an image classifier); None if unknown."""
    kind: str
    dtype: torch.dtype
    description: str = ""
    info: dict[str, Any] = field(default_factory=dict)
    """How to build it again: ``{"model": name, "batch", "seq", "dtype", "layers", "overrides"}``
    (``autopar plan`` stores it in the plan so ``compare`` and ``report`` can rebuild the model)."""

    @property
    def num_params(self) -> int:
        """Parameters, each tied parameter counted once."""
        return sum(p.numel() for p in self.model.parameters())


@dataclass(frozen=True, kw_only=True, slots=True)
class _Request:
    """What ``load`` was asked to build, checked: the same for every kind of MODEL argument."""

    batch: int
    seq: int | None
    """None: the model's usual length."""
    dtype: torch.dtype
    device: torch.device
    layers: int | None
    """None: the configuration's depth."""
    overrides: dict[str, Any]
    seed: int


def names() -> list[str]:
    """The built-in model names."""
    return list(ZOO)


def parse_dtype(text: str | torch.dtype) -> torch.dtype:
    """``bf16``/``fp16``/``fp32`` (or a torch dtype) → the torch dtype."""
    if isinstance(text, torch.dtype):
        return text
    if text not in DTYPES:
        raise ZooError(f"unknown dtype {text!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[text]


def load(
    spec: str,
    *,
    batch: int,
    seq: int | None = None,
    dtype: str | torch.dtype = "bf16",
    device: str | torch.device = "meta",
    layers: int | None = None,
    overrides: Mapping[str, Any] | None = None,
    seed: int = 0,
) -> Workload:
    """Build the model ``spec`` names and one global batch for it (see module docstring).

    ``batch`` sequences of ``seq`` tokens (default: the model's usual length); ``dtype`` of the
    parameters; ``device="meta"`` (plan without memory) or ``"cpu"`` (train: random weights from
    ``seed`` and random token ids); ``layers`` / ``overrides`` change the configuration."""
    if not isinstance(batch, int) or batch < 1:
        raise ZooError(f"batch must be a positive number of sequences, got {batch!r}")
    if seq is not None and (not isinstance(seq, int) or seq < 1):
        raise ZooError(f"seq must be a positive number of tokens, got {seq!r}")
    r = _Request(batch=batch, seq=seq, dtype=parse_dtype(dtype), device=torch.device(device), layers=layers,
                 overrides=dict(overrides or {}), seed=seed)  # fmt: skip
    info = {"model": spec, "batch": r.batch, "seq": r.seq, "dtype": str(r.dtype).replace("torch.", ""),
            "layers": r.layers, "overrides": r.overrides}  # fmt: skip
    if spec in ZOO:
        w = _load_builtin(ZOO[spec], r)
    elif ":" in spec and not Path(spec).exists():
        w = _load_factory(spec, r)
    elif spec.endswith(".json") or Path(spec).is_dir():
        w = _load_config_file(spec, r)
    else:
        close = [n for n in ZOO if spec.lower().replace("_", "-") in n or n in spec.lower()]
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ZooError(
            f"unknown model {spec!r}{hint}: use a built-in name ({', '.join(ZOO)}), a transformers "
            f"config.json path, or module:factory"
        )
    w.info = info | {"seq": w.seq}
    return w


def _require_transformers(what: str) -> Any:
    try:
        import transformers
    except ImportError:
        raise ZooError(f"{what} is built with transformers, which is not installed: {MODELS_EXTRA}") from None
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # config warnings about token ids outside small vocabularies
    return transformers


def _check_seq(name: str, seq: int, limit: int | None, field_name: str) -> None:
    if limit is not None and seq > limit:
        raise ZooError(
            f"{name} supports sequences of at most {limit} tokens ({field_name}={limit}); got {seq}: use "
            f"--seq {limit} or less, or --set {field_name}={seq} to plan an extended context deliberately"
        )


def _load_builtin(s: ModelSpec, r: _Request) -> Workload:
    cfg = dict(s.config)
    if r.layers is not None:
        if r.layers < 1:
            raise ZooError(f"layers must be at least 1, got {r.layers}")
        cfg[s.layers_field] = r.layers
        if s.name == "t5-base":
            cfg["num_decoder_layers"] = r.layers
    unknown = sorted(set(r.overrides) - set(cfg)) if s.source == "autopar" else []
    if unknown:
        raise ZooError(f"{s.name}: unknown configuration field(s) {unknown}; fields: {sorted(cfg)}")
    cfg.update(r.overrides)
    seq = r.seq or s.default_seq
    if s.max_seq_field:
        _check_seq(s.name, seq, int(cfg[s.max_seq_field]), s.max_seq_field)
    torch.manual_seed(r.seed)
    if s.source == "autopar":
        from autopar.models import GPT, GPTConfig

        with r.device:
            model = GPT(GPTConfig(**cfg)).to(r.dtype)
        ids = _ids(r.batch, seq, int(cfg["vocab_size"]), r.device, r.seed)
        inputs: Any = (ids, torch.roll(ids, -1, dims=1) if r.device.type != "meta" else ids.clone())
        return Workload(name=s.name, model=model, example_inputs=inputs, batch=r.batch, seq=seq, kind=s.kind,
                        dtype=r.dtype, description=s.summary)  # fmt: skip
    transformers = _require_transformers(s.name)
    cls = getattr(transformers, s.source)
    unknown = sorted(k for k in r.overrides if not hasattr(cls.config_class(), k))
    if unknown:
        raise ZooError(f"{s.name}: {cls.config_class.__name__} has no field(s) {unknown}")
    config = cls.config_class(**cfg)
    model = _build_hf(cls, config, r.dtype, r.device)
    return Workload(name=s.name, model=model, example_inputs=_hf_inputs(s.kind, config, r.batch, seq, r.device, r.seed),
                    batch=r.batch, seq=seq, kind=s.kind, dtype=r.dtype, description=s.summary)  # fmt: skip


def _build_hf(cls: Any, config: Any, dtype: torch.dtype, device: torch.device) -> nn.Module:
    if hasattr(config, "use_cache"):
        config.use_cache = False
    with device:
        model = cls(config)
    return model.to(dtype).train(False)


def _ids(batch: int, seq: int, vocab: int, device: torch.device, seed: int) -> torch.Tensor:
    if device.type == "meta":
        return torch.empty(batch, seq, dtype=torch.long, device=device)
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g).to(device)


def _hf_inputs(
    kind: str, config: Any, batch: int, seq: int, device: torch.device, seed: int
) -> dict[str, Any]:
    if kind == "image-classifier":
        size = seq
        if size != config.image_size:
            raise ZooError(
                f"this ViT was configured for {config.image_size}×{config.image_size} images; got --seq {size} "
                f"(the image side in pixels): use --seq {config.image_size} or --set image_size={size}"
            )
        if device.type == "meta":
            pixels = torch.empty(batch, config.num_channels, size, size, device=device)
            labels = torch.empty(batch, dtype=torch.long, device=device)
        else:
            g = torch.Generator().manual_seed(seed)
            pixels = torch.randn(batch, config.num_channels, size, size, generator=g).to(device)
            labels = torch.randint(0, config.num_labels, (batch,), generator=g).to(device)
        return {"pixel_values": pixels, "labels": labels}
    ids = _ids(batch, seq, config.vocab_size, device, seed)
    # A distinct tensor for the labels: torch.export would merge two uses of one input.
    return {"input_ids": ids, "labels": ids.clone()}


def _kind_of(cls_name: str) -> str:
    if cls_name.endswith("ForCausalLM"):
        return "causal-lm"
    if cls_name.endswith(("ForConditionalGeneration", "ForSeq2SeqLM")):
        return "seq2seq-lm"
    if cls_name.endswith("ForImageClassification"):
        return "image-classifier"
    raise ZooError(
        f"{cls_name}: autopar builds example batches for causal LMs, sequence-to-sequence LMs and image "
        f"classifiers; for another model write a module:factory returning (model, example_inputs)"
    )


def _load_config_file(path: str, r: _Request) -> Workload:
    transformers = _require_transformers(f"the model of {path}")
    if not Path(path).exists():
        raise ZooError(f"{path}: no such file")
    named = _named_model(path)
    try:
        config = transformers.AutoConfig.from_pretrained(path)
    except Exception as exc:  # a malformed or unknown config: say which file and why
        if named.get("model_type") and named["model_type"] not in transformers.CONFIG_MAPPING:
            arch = (
                f" (architecture {', '.join(named['architectures'])})" if named.get("architectures") else ""
            )
            raise ZooError(
                f"{path}: transformers {transformers.__version__} has no model_type {named['model_type']!r}{arch}: "
                f"upgrade transformers, or build the model yourself as a module:factory"
            ) from exc
        raise ZooError(
            f"{path}: not a transformers model configuration ({str(exc).splitlines()[0]})"
        ) from exc
    for key, value in r.overrides.items():
        if not hasattr(config, key):
            raise ZooError(f"{path}: the configuration has no field {key!r}")
        setattr(config, key, value)
    if r.layers is not None:  # every depth field the configuration has (an encoder-decoder has two)
        for key in ("num_hidden_layers", "n_layer", "num_layers", "num_decoder_layers"):
            if hasattr(config, key):
                setattr(config, key, r.layers)
    archs = getattr(config, "architectures", None) or []
    cls = getattr(transformers, archs[0], None) if archs else None
    if archs and cls is None:
        raise ZooError(
            f"{path}: transformers {transformers.__version__} has no architecture {archs[0]!r} (the configuration's "
            f"'architectures'): upgrade transformers, remove 'architectures' to build the class it registers "
            f"for model_type {config.model_type!r}, or build the model yourself as a module:factory"
        )
    if cls is None:
        for auto in ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModelForImageClassification"):
            mapping = getattr(transformers, auto)._model_mapping
            if type(config) in mapping:
                cls = mapping[type(config)]
                break
    if cls is None:
        raise ZooError(
            f"{path}: no causal-LM, sequence-to-sequence or image-classification class for model_type {config.model_type!r}"
        )
    kind = _kind_of(cls.__name__)
    if kind == "image-classifier":
        seq = r.seq or config.image_size
    else:
        limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        seq = r.seq or min(limit or 1024, 2048)
        _check_seq(Path(path).name, seq, limit, "max_position_embeddings")
    torch.manual_seed(r.seed)
    model = _build_hf(cls, config, r.dtype, r.device)
    return Workload(name=path, model=model, example_inputs=_hf_inputs(kind, config, r.batch, seq, r.device, r.seed),
                    batch=r.batch, seq=seq, kind=kind, dtype=r.dtype, description=f"{cls.__name__} from {path}")  # fmt: skip


def _named_model(path: str) -> dict[str, Any]:
    """The ``model_type`` and ``architectures`` a configuration file names, read as plain JSON (for
    an error message when transformers cannot load it); empty where the file is not JSON."""
    import json

    file = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
    try:
        d = json.loads(file.read_text())
    except (OSError, ValueError):
        return {}
    return {
        "model_type": d.get("model_type") if isinstance(d.get("model_type"), str) else None,
        "architectures": [a for a in d.get("architectures") or [] if isinstance(a, str)],
    }


def _load_factory(spec: str, r: _Request) -> Workload:
    target, _, attr = spec.rpartition(":")
    try:
        if target.endswith(".py"):
            if not Path(target).exists():
                raise ZooError(f"{spec}: no such file {target}")
            mod_name = f"_autopar_factory_{Path(target).stem}"
            loader = importlib.util.spec_from_file_location(mod_name, target)
            module = importlib.util.module_from_spec(loader)
            sys.modules[mod_name] = module  # dataclasses and pickling look modules up by name
            loader.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except ImportError as exc:
        raise ZooError(f"{spec}: cannot import {target!r} ({exc})") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ZooError(f"{spec}: {target} has no callable {attr!r}")
    offered = {"batch": r.batch, "seq": r.seq, "dtype": r.dtype, "device": r.device}
    params = inspect.signature(factory).parameters
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in offered.items() if takes_all or k in params}
    torch.manual_seed(r.seed)
    out = factory(**kwargs)
    if isinstance(out, nn.Module):
        config = getattr(out, "config", None)
        if config is None or not hasattr(config, "vocab_size"):
            raise ZooError(
                f"{spec} returned a model without example inputs and autopar cannot tell what it takes: "
                f"return (model, example_inputs) instead"
            )
        seq = r.seq or 1024
        return Workload(name=spec, model=out, example_inputs=_hf_inputs("causal-lm", config, r.batch, seq, r.device, r.seed),
                        batch=r.batch, seq=seq, kind="causal-lm", dtype=r.dtype, description=spec)  # fmt: skip
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], nn.Module):
        return Workload(name=spec, model=out[0], example_inputs=out[1], batch=r.batch, seq=r.seq, kind="custom",
                        dtype=r.dtype, description=spec)  # fmt: skip
    raise ZooError(
        f"{spec} returned {type(out).__name__}; a factory returns a model or (model, example_inputs)"
    )
