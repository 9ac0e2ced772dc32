"""A diffusers pipeline directory: ``model_index.json`` and one folder per component.

``model_index.json`` names the pipeline class (``_class_name``) and, for each component,
the library and class that load it (``"transformer": ["diffusers",
"WanTransformer3DModel"]``). This module reads it and loads single components, so the
trainer can load only what it uses (the transformer in the backend; VAE and text encoder
in the algorithm) instead of the whole pipeline.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

from reasonctl.core.errors import ReasonctlError

MODEL_INDEX = "model_index.json"


class PipelineDirError(ReasonctlError):
    """A pipeline directory is missing a file or names a component that cannot be loaded."""


def is_pipeline_dir(path: str | Path) -> bool:
    """True when ``path`` is a diffusers pipeline directory (it has ``model_index.json``)."""
    return (Path(path) / MODEL_INDEX).is_file()


def read_model_index(path: str | Path) -> dict[str, Any]:
    """The parsed ``model_index.json`` of pipeline directory ``path``."""
    index_file = Path(path) / MODEL_INDEX
    try:
        value = json.loads(index_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PipelineDirError(f"{index_file}: not found; {path} is not a diffusers pipeline "
                               "directory") from None
    except json.JSONDecodeError as exc:
        raise PipelineDirError(f"{index_file}:{exc.lineno}: invalid JSON: {exc.msg}") from None
    if not isinstance(value, dict):
        raise PipelineDirError(f"{index_file}: expected a JSON object")
    return value


def pipeline_class_name(path: str | Path) -> str:
    """The pipeline class recorded in ``model_index.json`` (e.g. ``WanPipeline``)."""
    return str(read_model_index(path).get("_class_name", ""))


def component_spec(path: str | Path, name: str) -> tuple[str, str] | None:
    """``(library, class)`` of component ``name``, or ``None`` when the pipeline has none."""
    entry = read_model_index(path).get(name)
    if not isinstance(entry, list) or len(entry) != 2 or entry[0] is None or entry[1] is None:
        return None
    return str(entry[0]), str(entry[1])


def component_class(path: str | Path, name: str) -> Any:
    """The Python class that loads component ``name`` (imported from its library)."""
    spec = component_spec(path, name)
    if spec is None:
        raise PipelineDirError(f"{Path(path) / MODEL_INDEX}: the pipeline has no {name!r} "
                               "component")
    library, class_name = spec
    if library not in ("diffusers", "transformers"):
        raise PipelineDirError(
            f"{Path(path) / MODEL_INDEX}: component {name!r} comes from {library!r}; only "
            "diffusers and transformers components are loaded (no remote code)"
        )
    module = importlib.import_module(library)
    cls = getattr(module, class_name, None)
    if cls is None:
        raise PipelineDirError(
            f"{Path(path) / MODEL_INDEX}: {library} has no class {class_name!r} (component "
            f"{name!r}); upgrade {library} or check the directory"
        )
    return cls


def load_component(path: str | Path, name: str, **kwargs: Any) -> Any:
    """Load component ``name`` of the pipeline at ``path`` with its class's ``from_pretrained``."""
    from reasonctl.models.quiet import quiet_transformers

    folder = Path(path) / name
    if not folder.is_dir():
        raise PipelineDirError(f"{folder}: component folder not found")
    quiet_transformers()
    return component_class(path, name).from_pretrained(folder, **kwargs)


def transformer_class_name(path: str | Path) -> str:
    """The class name of the pipeline's ``transformer`` component."""
    spec = component_spec(path, "transformer")
    if spec is None:
        raise PipelineDirError(f"{Path(path) / MODEL_INDEX}: the pipeline has no 'transformer' "
                               "component; only transformer-based (DiT) pipelines are trained")
    return spec[1]
