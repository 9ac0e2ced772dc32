"""Loading the model to train: where it lives, which class, dtype, attention, what trains.

``model.name_or_path`` may be the ``tiny-random`` alias, a local directory, a storage URI
(``s3://bucket/prefix``, ``hf://org/repo``: fetched once through the storage plugins into
the reasonctl cache) or a Hugging Face Hub repository id (resolved by ``huggingface_hub``,
which honours ``HF_HUB_OFFLINE`` and its cache). Everything downstream works on a local
directory, so exports can copy the tokenizer and processor files next to the weights.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reasonctl.core.errors import ReasonctlError
from reasonctl.core.types import ModelSource
from reasonctl.models.quiet import quiet_transformers

if TYPE_CHECKING:
    import torch

    from reasonctl.core.config import ModelSection, RunConfig
    from reasonctl.core.protocols import RunContext
    from reasonctl.core.registry import Registry

DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


class ModelLoadError(ReasonctlError):
    """The model could not be found or loaded; the message says what to change."""


@dataclass(frozen=True)
class ParameterCounts:
    """How many parameters the model has and how many of them train."""

    trainable: int
    total: int

    def describe(self) -> str:
        """A one-line human summary such as ``trainable 1.2M / 3.4M (35.3%)``."""
        share = 100.0 * self.trainable / self.total if self.total else 0.0
        return f"trainable {_human(self.trainable)} / {_human(self.total)} ({share:.1f}%)"


def resolve_model_dir(
    name_or_path: str,
    *,
    registry: Registry | None = None,
    config: RunConfig | None = None,
) -> Path:
    """A local directory holding ``name_or_path`` (see the module docstring for the forms)."""
    from reasonctl.models.tiny_aliases import resolve_tiny_alias

    resolved = resolve_tiny_alias(name_or_path)
    local = Path(resolved).expanduser()
    if local.is_dir():
        return local
    if "://" in resolved:
        return _fetch_remote(resolved, registry=registry, config=config)
    if local.exists():
        raise ModelLoadError(f"model {name_or_path!r} is a file; point to the model directory")
    if _looks_like_repo_id(resolved):
        return _hub_snapshot(resolved)
    raise ModelLoadError(
        f"model {name_or_path!r} not found: no such directory (cwd: {Path.cwd()}). Use a "
        "local model directory, 'tiny-random', an s3:// or hf:// URI, or a Hub id like "
        "'Qwen/Qwen2.5-0.5B-Instruct'"
    )


def resolve_model_source(config: RunConfig, registry: Registry) -> ModelSource:
    """The local model and tokenizer directories of ``model.name_or_path``/``model.tokenizer``.

    Remote sources are fetched once into the cache; the runner resolves this once per run
    (``ctx.model_source``) so backends, the processor and rollout engines read the same
    files.
    """
    section = config.model
    model_dir = resolve_model_dir(section.name_or_path, registry=registry, config=config)
    tokenizer_dir = model_dir
    if section.tokenizer:
        tokenizer_dir = resolve_model_dir(section.tokenizer, registry=registry, config=config)
    return ModelSource(model_dir=model_dir, tokenizer_dir=tokenizer_dir)


def ensure_model_source(ctx: RunContext) -> ModelSource:
    """``ctx.model_source``, resolved (and stored there) on first use."""
    if ctx.model_source is None:
        ctx.model_source = resolve_model_source(ctx.config, ctx.registry)
    return ctx.model_source


def load_hf_config(model_dir: Path, *, trust_remote_code: bool = False) -> Any:
    """The model's ``PretrainedConfig`` with an error that names the directory."""
    from transformers import AutoConfig

    quiet_transformers()

    try:
        return AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except ValueError as exc:
        hint = "" if trust_remote_code else (
            " If the model ships its own code, set model.trust_remote_code = true "
            "(only for sources you trust)."
        )
        raise ModelLoadError(f"cannot read the model config in {model_dir}: {exc}.{hint}") from exc
    except OSError as exc:
        raise ModelLoadError(f"{model_dir} has no readable config.json: {exc}") from exc


def auto_model_class(hf_config: Any) -> Any:
    """``AutoModelForImageTextToText`` for vision-language configs, else ``AutoModelForCausalLM``.

    A config whose architecture is a ``...ForConditionalGeneration`` registered for
    image-text-to-text (Qwen2.5-VL, LLaVA, Gemma 3) gets the vision-language class; text
    models get the causal-LM class.
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto import modeling_auto

    model_type = getattr(hf_config, "model_type", "")
    architectures = list(getattr(hf_config, "architectures", None) or [])
    vision_types = modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    text_types = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    if model_type in vision_types and (
        model_type not in text_types
        or any(a.endswith("ForConditionalGeneration") for a in architectures)
    ):
        return AutoModelForImageTextToText
    if model_type in text_types or getattr(hf_config, "auto_map", None):
        return AutoModelForCausalLM
    raise ModelLoadError(
        f"model type {model_type!r} (architectures {architectures}) is neither a causal "
        "language model nor an image-text-to-text model known to this transformers version"
    )


def is_vision_language(hf_config: Any) -> bool:
    """True when the config describes a vision-language model."""
    from transformers import AutoModelForImageTextToText

    return auto_model_class(hf_config) is AutoModelForImageTextToText


def compute_dtype(name: str, device: torch.device) -> torch.dtype:
    """The dtype matmuls run in: ``auto`` is bfloat16 on CUDA and float32 elsewhere."""
    import torch

    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ModelLoadError(f"model.dtype {name!r} is not one of auto, {', '.join(DTYPES)}")
    return getattr(torch, DTYPES[name])


def checkpoint_dtype(hf_config: Any) -> torch.dtype:
    """The dtype the source checkpoint declares (float32 when it declares none)."""
    import torch

    value = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value in DTYPES:
        return getattr(torch, value)
    return torch.float32


def load_pretrained(
    model_dir: Path,
    section: ModelSection,
    *,
    param_dtype: torch.dtype,
    device: torch.device | str = "cpu",
    on_meta: bool = False,
) -> Any:
    """Build the Hugging Face model with weights in ``param_dtype``.

    ``on_meta`` builds the architecture without weights on the meta device (ranks that
    receive their shards from rank 0). Frozen/trainable patterns and gradient checkpointing
    are applied by :func:`apply_trainable_patterns` and :func:`enable_gradient_checkpointing`.
    """
    import torch

    hf_config = load_hf_config(model_dir, trust_remote_code=section.trust_remote_code)
    model_class = auto_model_class(hf_config)
    common: dict[str, Any] = {
        "attn_implementation": section.attention,
        "trust_remote_code": section.trust_remote_code,
        "dtype": param_dtype,
    }
    try:
        if on_meta:
            with torch.device("meta"):
                model = model_class.from_config(hf_config, **common)
        else:
            model = model_class.from_pretrained(model_dir, **common).to(device)
    except ImportError as exc:
        raise ModelLoadError(
            f"loading {model_dir} with model.attention = {section.attention!r} failed: {exc}. "
            "Use model.attention = 'sdpa' or install the missing package."
        ) from exc
    if getattr(model.config, "use_cache", None):
        model.config.use_cache = False
    return model


def apply_trainable_patterns(
    model: Any, *, freeze: Sequence[str] = (), trainable: Sequence[str] = ()
) -> ParameterCounts:
    """Set ``requires_grad`` from regexes over parameter names and count parameters.

    With ``trainable`` patterns only matching parameters train; ``freeze`` patterns then
    freeze what they match (e.g. ``^model\\.visual\\.`` for a Qwen2.5-VL vision tower). A
    pattern that matches no parameter is an error, since it is almost always a typo.
    """
    names = [name for name, _ in model.named_parameters()]
    for key, patterns in (("model.trainable", trainable), ("model.freeze", freeze)):
        for pattern in patterns:
            try:
                compiled = re.compile(pattern)
            except re.error as exc:
                raise ModelLoadError(f"{key}: invalid regex {pattern!r}: {exc}") from exc
            if not any(compiled.search(n) for n in names):
                examples = ", ".join(names[:3] + names[-2:])
                raise ModelLoadError(
                    f"{key}: pattern {pattern!r} matches no parameter; names look like: "
                    f"{examples}"
                )
    train_res = [re.compile(p) for p in trainable]
    freeze_res = [re.compile(p) for p in freeze]
    for name, param in model.named_parameters():
        wanted = not train_res or any(r.search(name) for r in train_res)
        if any(r.search(name) for r in freeze_res):
            wanted = False
        param.requires_grad_(wanted)
    counts = count_parameters(model)
    if counts.trainable == 0:
        raise ModelLoadError(
            "model.freeze / model.trainable leave no parameter to train; loosen the patterns"
        )
    return counts


def count_parameters(model: Any) -> ParameterCounts:
    """Trainable and total parameter counts (shared parameters counted once)."""
    seen: set[int] = set()
    trainable = total = 0
    for param in model.parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        n = _global_numel(param)
        total += n
        if param.requires_grad:
            trainable += n
    return ParameterCounts(trainable=trainable, total=total)


def enable_gradient_checkpointing(model: Any) -> None:
    """Recompute each decoder block's activations in backward (non-reentrant)."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ModelLoadError(
            f"{type(model).__name__} does not support gradient checkpointing; set "
            "model.gradient_checkpointing = false"
        )
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _global_numel(param: Any) -> int:
    shape = getattr(param, "shape", None)
    if shape is None:
        return int(param.numel())
    n = 1
    for dim in shape:
        n *= int(dim)
    return n


def _fetch_remote(uri: str, *, registry: Registry | None, config: RunConfig | None) -> Path:
    from reasonctl.core.storage import fetch_model

    if registry is None:
        raise ModelLoadError(
            f"model {uri!r} is a storage URI; resolving it needs the run's plugins (pass the "
            "registry of a loaded PluginHost)"
        )
    return Path(fetch_model(registry, config, uri))


def _looks_like_repo_id(text: str) -> bool:
    return re.fullmatch(r"[A-Za-z0-9][\w.\-]*/[\w.\-]+", text) is not None


def _hub_snapshot(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:  # pragma: no cover - a transformers dependency
        raise ModelLoadError(f"cannot resolve Hub id {repo_id!r}: huggingface_hub is missing") \
            from exc
    try:
        return Path(snapshot_download(repo_id))
    except Exception as exc:
        raise ModelLoadError(
            f"cannot get {repo_id!r} from the Hugging Face Hub ({type(exc).__name__}: {exc}). "
            "Download it first (it is then read from the cache, also with HF_HUB_OFFLINE=1) "
            "or point model.name_or_path at a local directory"
        ) from exc


def _human(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)
