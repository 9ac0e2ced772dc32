"""Writing a trained model as a Hugging Face directory that ``from_pretrained`` loads unchanged.

The weights go through transformers' own ``save_pretrained`` (sharded safetensors, index,
``config.json``, ``generation_config.json``, tied weights stored once, legacy key names
restored where the library renames them on load), called on a weightless meta-device copy
of the model with the gathered state dict, so the live (possibly sharded) model is never
touched. Tokenizer and processor files are copied from the source model directory, and the
run's generation settings written beside them. The directory is written under a temporary
name and renamed when complete.
"""

from __future__ import annotations

import copy
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from reasonctl.backends.generation_files import write_generation_files
from reasonctl.core.errors import NonFiniteError
from reasonctl.models.loading import ModelSource, quiet_transformers

if TYPE_CHECKING:
    from reasonctl.core.config import RunConfig

DEFAULT_MAX_SHARD_SIZE = "5GB"
TOKENIZER_AND_PROCESSOR_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.json",
    "chat_template.jinja",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
)
"""Files copied from the source model (and tokenizer) directory into an export."""


def tied_parameter_groups(model: torch.nn.Module) -> list[list[str]]:
    """Names that refer to one shared parameter (e.g. tied input/output embeddings)."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def cast_state_dict(
    state_dict: dict[str, torch.Tensor],
    dtype: torch.dtype,
    tied_groups: Sequence[Sequence[str]] = (),
) -> dict[str, torch.Tensor]:
    """Floating tensors cast to ``dtype``; names of one tied group share one tensor."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        out[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    for names in tied_groups:
        present = [n for n in names if n in out]
        for alias in present[1:]:
            out[alias] = out[present[0]]
    return out


def save_hf_export(
    directory: Path,
    state_dict: dict[str, torch.Tensor],
    *,
    hf_model: Any,
    source: ModelSource,
    dtype: torch.dtype,
    tied_groups: Sequence[Sequence[str]] = (),
    max_shard_size: str = DEFAULT_MAX_SHARD_SIZE,
    run_config: RunConfig | None = None,
) -> Path:
    """Write ``state_dict`` (full tensors, Hugging Face names) as a model directory.

    ``hf_model`` supplies the class, config and generation config (its weights are not
    read). With ``run_config``, the run's stops and sampling go into the generation config
    and ``reasonctl_generation.toml`` (:mod:`reasonctl.backends.generation_files`).
    Returns ``directory``. Weights holding NaN or infinity are never written
    (:class:`~reasonctl.core.errors.NonFiniteError`).
    """
    directory = Path(directory)
    check_finite(state_dict)
    tmp = directory.with_name(f".tmp-{directory.name}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    weights = cast_state_dict(state_dict, dtype, tied_groups)
    config = copy.deepcopy(hf_model.config)
    with torch.device("meta"):
        skeleton = type(hf_model)._from_config(config, dtype=dtype)
    generation_config = getattr(hf_model, "generation_config", None)
    if generation_config is not None:
        skeleton.generation_config = copy.deepcopy(generation_config)
    quiet_transformers()
    skeleton.save_pretrained(tmp, state_dict=weights, max_shard_size=max_shard_size)
    copy_tokenizer_files(tmp, [source.model_dir, source.tokenizer_dir])
    if run_config is not None:
        write_generation_files(tmp, run_config)
    if directory.exists():
        shutil.rmtree(directory)
    tmp.rename(directory)
    return directory


def check_finite(state_dict: dict[str, torch.Tensor]) -> None:
    """Raise :class:`~reasonctl.core.errors.NonFiniteError` naming the floating-point
    tensors that hold NaN or infinity."""
    bad = [name for name, tensor in state_dict.items()
           if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())]
    if bad:
        shown = ", ".join(bad[:5]) + (f" (and {len(bad) - 5} more)" if len(bad) > 5 else "")
        raise NonFiniteError(
            f"not exporting: {len(bad)} weight tensor(s) hold NaN or infinity ({shown}). "
            "Training diverged; resume from an earlier checkpoint with a lower train.lr"
        )


def copy_tokenizer_files(target: Path, sources: Iterable[Path]) -> list[str]:
    """Copy tokenizer/processor files found in ``sources`` (later sources win)."""
    copied: list[str] = []
    for source in sources:
        for name in TOKENIZER_AND_PROCESSOR_FILES:
            path = Path(source) / name
            if path.is_file():
                shutil.copyfile(path, target / name)
                if name not in copied:
                    copied.append(name)
    return copied
