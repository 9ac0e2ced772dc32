"""Writing a trained diffusion transformer back out, in layouts diffusers loads unchanged.

- **Full fine-tune**: a pipeline directory. Every component but the transformer is taken
  from the source pipeline (hard-linked where the file system allows, else copied); the
  transformer folder gets the source's ``config.json`` and the trained weights as
  (sharded) ``diffusion_pytorch_model*.safetensors``, so
  ``DiffusionPipeline.from_pretrained(export)`` loads the trained pipeline.
- **LoRA**: the adapters in diffusers' LoRA format (``pytorch_lora_weights.safetensors``,
  written by the pipeline class's ``save_lora_weights``), which ``pipe.load_lora_weights``
  reads, plus ``reasonctl_lora.json`` naming the base pipeline so ``reasonctl infer`` can
  find it.

Directories are written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reasonctl.diffusion.pipeline_dir import pipeline_class_name

if TYPE_CHECKING:
    import torch

    from reasonctl.diffusion.policy import DiffusionModelInfo

LORA_MANIFEST = "reasonctl_lora.json"
"""Written next to a LoRA export: ``{"base_model": <pipeline dir>, "lora": {...}}``."""
WEIGHTS_PATTERN = "diffusion_pytorch_model{suffix}.safetensors"


def save_pipeline_export(directory: Path, state_dict: dict[str, torch.Tensor], *,
                         info: DiffusionModelInfo, dtype: torch.dtype,
                         max_shard_size: str) -> Path:
    """Write the source pipeline with the transformer's weights replaced by ``state_dict``."""
    from huggingface_hub import save_torch_state_dict

    tmp = _fresh_tmp(directory)
    shutil.copytree(info.model_dir, tmp, ignore=_skip_transformer(info.model_dir),
                    copy_function=_link_or_copy)
    transformer_dir = tmp / "transformer"
    transformer_dir.mkdir()
    shutil.copyfile(info.model_dir / "transformer" / "config.json",
                    transformer_dir / "config.json")
    weights = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous()
               for k, v in state_dict.items()}
    save_torch_state_dict(weights, transformer_dir, filename_pattern=WEIGHTS_PATTERN,
                          max_shard_size=max_shard_size)
    return _commit(tmp, directory)


def save_lora_export(directory: Path, adapter_state: dict[str, torch.Tensor], *,
                     model: Any, info: DiffusionModelInfo, dtype: torch.dtype,
                     lora: dict[str, Any]) -> Path:
    """Write the LoRA adapters of ``model`` (``adapter_state`` holds their full values;
    ``lora`` is the ``[model.lora]`` section, recorded in the manifest)."""
    from peft.utils import get_peft_model_state_dict

    from reasonctl.models.lora import ADAPTER as ADAPTER_NAME

    tmp = _fresh_tmp(directory)
    tmp.mkdir()
    peft_state = get_peft_model_state_dict(model, state_dict=adapter_state,
                                           adapter_name=ADAPTER_NAME)
    peft_state = {k: v.to(dtype).contiguous() for k, v in peft_state.items()}
    pipeline_cls = component_class_for_pipeline(info.model_dir)
    metadata = model.peft_config[ADAPTER_NAME].to_dict()
    pipeline_cls.save_lora_weights(tmp, transformer_lora_layers=peft_state,
                                   transformer_lora_adapter_metadata=_jsonable(metadata))
    manifest = {"base_model": str(info.model_dir.absolute()),
                "pipeline": pipeline_class_name(info.model_dir),
                "lora": lora}
    (tmp / LORA_MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return _commit(tmp, directory)


def component_class_for_pipeline(model_dir: Path) -> Any:
    """The diffusers pipeline class of ``model_dir`` (for its LoRA loader methods)."""
    import diffusers

    name = pipeline_class_name(model_dir)
    cls = getattr(diffusers, name, None)
    if cls is None or not hasattr(cls, "save_lora_weights"):
        raise ValueError(f"pipeline class {name!r} of {model_dir} has no LoRA loader in "
                         f"diffusers {diffusers.__version__}; train without LoRA or upgrade")
    return cls


def read_lora_manifest(directory: Path) -> dict[str, Any] | None:
    """The manifest of a LoRA export directory, ``None`` when ``directory`` is not one."""
    path = Path(directory) / LORA_MANIFEST
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def source_weights_dtype(model_dir: Path) -> torch.dtype:
    """The dtype of the source transformer's floating weights (float32 when unknown)."""
    import torch
    from safetensors import safe_open

    files = sorted((Path(model_dir) / "transformer").glob("*.safetensors"))
    if not files:
        return torch.float32
    with safe_open(str(files[0]), framework="pt") as handle:
        for key in handle.keys():
            tensor = handle.get_slice(key)
            dtype = _SAFETENSORS_DTYPES.get(tensor.get_dtype())
            if dtype is not None:
                return getattr(torch, dtype)
    return torch.float32


_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def _jsonable(value: Any) -> Any:
    """peft configs hold sets; diffusers stores the metadata as JSON."""
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset, tuple, list)):
        return sorted(_jsonable(v) for v in value) if isinstance(value, (set, frozenset)) \
            else [_jsonable(v) for v in value]
    return value


def _skip_transformer(root: Path) -> Any:
    def ignore(directory: str, names: list[str]) -> list[str]:
        return ["transformer"] if Path(directory) == Path(root) else []
    return ignore


def _link_or_copy(src: str, dst: str) -> str:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
    return dst


def _fresh_tmp(directory: Path) -> Path:
    directory = Path(directory)
    tmp = directory.with_name(f".tmp-{directory.name}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    return tmp


def _commit(tmp: Path, directory: Path) -> Path:
    if directory.exists():
        shutil.rmtree(directory)
    tmp.rename(directory)
    return directory
