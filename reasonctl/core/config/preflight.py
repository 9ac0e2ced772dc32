"""Pre-flight checks: what a valid config needs from the world, known without loading a model.

``reasonctl config validate`` runs them, and so does ``reasonctl run`` before it loads
anything, so a missing data file or an unwritable output directory is reported in a second,
with every other problem, instead of after minutes of model loading:

- local input paths exist and are what they should be: every field marked with
  :class:`~reasonctl.core.config.markers.InputPath` in the sections and in the configs of the
  components the config selects (first-party and third-party alike), e.g.
  ``data.jsonl.path``, ``data.video_folder.root``, ``eval.data``;
- ``run.output_dir`` is (or can be created as) a writable directory (a file is created
  and removed there to find out);
- ``model.name_or_path`` and ``model.tokenizer``, when they name a local directory, exist
  and hold a model (a name that does not exist is a Hub id or storage URI when it can be);
- ``checkpoint.upload`` URIs use an installed storage scheme and are well-formed, as the
  scheme's config model tells (:class:`ChecksUris`: ``s3://`` needs a bucket, ``hf://`` an
  ``owner/repo``, a plugin's scheme what it says);
- the requested ``backend.device`` is present (torch is imported only for that check);
- ``run.resume``, when a path, is a complete checkpoint directory.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from pydantic import BaseModel

from reasonctl.core.config.markers import InputPath
from reasonctl.core.config.redaction import redact_text
from reasonctl.core.config.schema import RunConfig
from reasonctl.core.errors import ConfigError, ReasonctlError, did_you_mean
from reasonctl.core.uris import parse_uri

if TYPE_CHECKING:
    from pydantic.fields import FieldInfo

    from reasonctl.core.registry import Registry

_SCHEME_MISSING_SLASH = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+:/?[^/]")


@runtime_checkable
class ChecksUris(Protocol):
    """Optional for a storage's config model: what is wrong with a URI of its scheme,
    known without any network access (default: nothing). Pre-flight (``reasonctl config
    validate``, and ``reasonctl run`` before it loads anything) asks it about every
    ``checkpoint.upload`` target of the scheme."""

    def uri_problems(self, uri: str) -> list[str]:
        """What is wrong with ``uri``, each a phrase that follows the quoted URI in a
        ``checkpoint.upload.N: '<uri>' <phrase>`` line, e.g. ``"has no bucket; expected
        s3://BUCKET[/prefix]"``; empty when it is well-formed."""
        ...


def check_preflight(config: RunConfig, registry: Registry, *, reads_data: bool = True) -> None:
    """Raise :class:`ConfigError` listing every :func:`preflight_problems` entry."""
    problems = preflight_problems(config, registry, reads_data=reads_data)
    if problems:
        raise ConfigError(problems)


def preflight_problems(config: RunConfig, registry: Registry, *,
                       reads_data: bool = True) -> list[str]:
    """Every problem of ``config`` with the outside world, as ``path: message`` lines.

    ``reads_data = False`` (an algorithm whose ``Needs`` ask for no dataset) leaves the
    data format's paths unchecked. The algorithm's own checks
    (:class:`~reasonctl.core.protocols.ValidatesRunConfig`) are added by
    :func:`reasonctl.runtime.composition.preflight`.
    """
    problems: list[str] = []
    for prefix, model, fields in _models_in_use(config, registry, reads_data):
        problems += _input_path_problems(prefix, model, fields)
    problems += _guarded("run.output_dir", config.run.output_dir, _output_dir_problems)
    problems += _model_problems(config)
    problems += _upload_problems(config, registry)
    problems += _device_problems(config.backend.device)
    if isinstance(config.run.resume, str) and config.run.resume:
        problems += _guarded("run.resume", config.run.resume, _resume_problems)
    return [redact_text(problem) for problem in problems]


def data_path_problems(config: RunConfig) -> list[str]:
    """The selected data format's input paths that are missing or of the wrong kind, worded
    as :func:`preflight_problems` words them (for commands that read the data but run
    nothing, such as ``reasonctl data check``)."""
    options = config.component_config("data", config.data.format)
    if not isinstance(options, BaseModel):
        return []
    prefix = f"data.{config.data.format}"
    return [redact_text(p) for p in
            _input_path_problems(prefix, options, type(options).model_fields)]


# --- marked input paths ----------------------------------------------------------------------


def _models_in_use(
    config: RunConfig, registry: Registry, reads_data: bool
) -> list[tuple[str, BaseModel, dict[str, FieldInfo]]]:
    """The built-in sections (their own fields) and the configs of the selected components
    (the data format's only when the algorithm reads a dataset)."""
    out: list[tuple[str, BaseModel, dict[str, FieldInfo]]] = []
    for name, field in RunConfig.model_fields.items():
        base: Any = field.annotation
        out.append((name, getattr(config, name), base.model_fields))
    selected = [
        ("algorithm", config.algorithm.name),
        ("backend", config.backend.name),
        *([("data", config.data.format)] if reads_data else []),
        ("rollout", config.rollout.engine),
        *([("environment", config.environment.name)] if config.environment.name else []),
        *(("logging", name) for name in config.logging.loggers),
        *(("storage", parse_uri(uri)[0]) for uri in config.checkpoint.upload),
    ]
    for section, name in dict.fromkeys(selected):
        value = config.component_config(section, name)
        if isinstance(value, BaseModel):
            out.append((f"{section}.{name}", value, type(value).model_fields))
    for index, (_entry, options) in enumerate(_reward_options(config, registry)):
        if isinstance(options, BaseModel):
            out.append((f"rewards.components.{index}", options, type(options).model_fields))
    return out


def _reward_options(config: RunConfig, registry: Registry) -> list[tuple[Any, Any]]:
    try:
        return config.reward_configs(registry)
    except ReasonctlError:
        return []  # an unknown reward is a schema problem, reported by validation


def _input_path_problems(prefix: str, model: BaseModel, fields: dict[str, FieldInfo]) -> list[str]:
    problems = []
    for name, field in fields.items():
        value = getattr(model, name, None)
        path = f"{prefix}.{field.alias or name}"
        for marker in field.metadata:
            if isinstance(marker, InputPath):
                problems += _check_input(path, value, marker)
        if isinstance(value, BaseModel):
            problems += _input_path_problems(path, value, type(value).model_fields)
        elif isinstance(value, list):
            for index, item in enumerate(value):
                if isinstance(item, BaseModel):
                    problems += _input_path_problems(f"{path}.{index}", item,
                                                     type(item).model_fields)
    return problems


def _check_input(path: str, value: Any, marker: InputPath) -> list[str]:
    if value is None:
        return [f"{path}: not set; point it at an existing {_kind_word(marker)}"] \
            if marker.required else []
    if isinstance(value, (str, os.PathLike)):
        return _guarded(path, os.fspath(value), _check_one, marker)
    if isinstance(value, (list, tuple)):
        if not value and marker.required:
            return [f"{path}: empty; list at least one existing {_kind_word(marker)}"]
        return [p for index, item in enumerate(value)
                for p in _check_input(f"{path}.{index}", item, marker)]
    if isinstance(value, Mapping):
        return [p for key, item in value.items()
                for p in _check_input(f"{path}.{key}", item, marker)]
    return []


def _kind_word(marker: InputPath) -> str:
    return {"file": "file", "dir": "directory"}.get(marker.kind, "file or directory")


def _guarded(path: str, value: str, check: Callable[..., list[str]], *args: Any) -> list[str]:
    """``check(path, value, *args)``, with a path the OS rejects reported as a problem."""
    try:
        return check(path, value, *args)
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        return [f"{path}: {value!r} is not a usable path ({reason})"]


def _check_one(path: str, value: str, marker: InputPath) -> list[str]:
    target = Path(value).expanduser()
    if not target.exists():
        return [f"{path}: {value!r} does not exist (cwd: {Path.cwd()})"]
    if marker.kind == "file" and not target.is_file():
        what = "a directory" if target.is_dir() else "not a regular file"
        return [f"{path}: {value!r} is {what}; expected a file"]
    if marker.kind == "dir" and not target.is_dir():
        return [f"{path}: {value!r} is not a directory"]
    if not os.access(target, os.R_OK):
        return [f"{path}: {value!r} is not readable (check its permissions)"]
    return []


# --- outputs and storage -------------------------------------------------------------------


def _output_dir_problems(path: str, value: str) -> list[str]:
    target = Path(value).expanduser()
    if target.exists():
        if not target.is_dir():
            return [f"{path}: {value!r} is a file; choose a directory"]
        reason = _unwritable(target)
        if reason:
            return [f"{path}: {value!r} is not writable: no file can be created there "
                    f"({reason}); check its permissions or choose another directory"]
        return []
    parent = target.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return [f"{path}: cannot create {value!r}: {parent} is a file"]
    reason = _unwritable(parent)
    if reason:
        return [f"{path}: cannot create {value!r}: no file can be created in {parent} "
                f"({reason}); choose a directory you can write"]
    return []


def _unwritable(directory: Path) -> str | None:
    """Why no file can be created in ``directory`` (``None`` when one can): tried for real,
    since permission bits do not tell (root, read-only mounts, /proc)."""
    try:
        fd, name = tempfile.mkstemp(prefix=".reasonctl-write-check-", dir=directory)
    except OSError as exc:
        return exc.strerror or str(exc)
    os.close(fd)
    os.unlink(name)
    return None


# --- the model ---------------------------------------------------------------------------

MODEL_FILES = ("config.json", "model_index.json", "adapter_config.json", "reasonctl_lora.json")
"""Files of which a local model directory holds at least one: a Hugging Face model, a
diffusers pipeline, a peft adapter, a reasonctl LoRA export of a pipeline."""
BUILT_IN_MODELS = "tiny-random"


def _model_problems(config: RunConfig) -> list[str]:
    """A local model or tokenizer directory that is missing, a file, or holds no model."""
    problems = []
    for key, name, needs_model in (("model.name_or_path", config.model.name_or_path, True),
                                   ("model.tokenizer", config.model.tokenizer, False)):
        if name:
            problems += _guarded(key, name, _model_dir_problems, needs_model)
    return problems


def _model_dir_problems(path: str, name: str, needs_model: bool) -> list[str]:
    target = Path(name).expanduser()
    if not target.exists():
        if "://" in name or name.startswith(BUILT_IN_MODELS) or not _names_a_local_path(name):
            return []  # a storage URI, a built-in model or a Hub id
        return [f"{path}: {name!r} does not exist (cwd: {Path.cwd()}); point it at a model "
                "directory (e.g. an export's export/final), or a Hub id such as "
                "'Qwen/Qwen2.5-0.5B-Instruct'"]
    if not target.is_dir():
        return [f"{path}: {name!r} is a file; point it at the model directory"]
    if not any(target.iterdir()):
        return [f"{path}: {name!r} is an empty directory; point it at a model directory"]
    if needs_model and not any((target / file).is_file() for file in MODEL_FILES):
        return [f"{path}: {name!r} holds no model ({', '.join(MODEL_FILES[:2])} missing); "
                "point it at a Hugging Face model directory or a diffusers pipeline"]
    return []


def _names_a_local_path(name: str) -> bool:
    """Whether ``name``, which does not exist, can only mean a local path: it starts like
    one, has more parts than a Hub id (``owner/repo``), or its first part is a local
    directory."""
    if name.startswith(("/", ".", "~")) or "\\" in name or name.count("/") > 1:
        return True
    return "/" in name and Path(name.split("/")[0]).is_dir()


def _upload_problems(config: RunConfig, registry: Registry) -> list[str]:
    problems = []
    schemes = registry.names("storage")
    for index, uri in enumerate(config.checkpoint.upload):
        path = f"checkpoint.upload.{index}"
        scheme, rest = parse_uri(uri)
        if scheme == "file":
            if _SCHEME_MISSING_SLASH.match(uri) and not Path(uri).exists():
                problems.append(f"{path}: {uri!r} is not a URI (expected scheme://...) "
                                "nor an existing local path")
            else:
                problems += _guarded(path, rest, _output_dir_problems)
            continue
        if scheme not in schemes:
            close = did_you_mean(scheme, schemes)
            hint = f"; did you mean {close}://?" if close else ""
            problems.append(f"{path}: unknown storage scheme {scheme!r} in {uri!r}{hint} "
                            f"(installed: {', '.join(schemes) or 'none'})")
            continue
        options = config.component_config("storage", scheme)
        if isinstance(options, ChecksUris):
            problems += [f"{path}: {uri!r} {problem}" for problem in options.uri_problems(uri)]
    return problems


# --- devices, batches, resume --------------------------------------------------------------


def _device_problems(device: str) -> list[str]:
    kind, _, index = device.partition(":")
    if kind not in ("cuda", "mps"):
        return []
    try:
        import torch
    except ImportError:
        return [f"backend.device: {device!r} needs torch, which is not installed"]
    if kind == "mps":
        if not torch.backends.mps.is_available():
            return ["backend.device: 'mps' is not available on this machine; use 'cpu' or 'auto'"]
        return []
    if not torch.cuda.is_available():
        return [f"backend.device: {device!r} but CUDA is not available on this machine; "
                "use 'cpu' or 'auto'"]
    count = torch.cuda.device_count()
    if index and int(index) >= count:
        return [f"backend.device: {device!r} but this machine has {count} CUDA device(s) "
                f"(cuda:0 to cuda:{count - 1})"]
    return []


def _resume_problems(_path: str, resume: str) -> list[str]:
    from reasonctl.core.checkpoint import MANIFEST

    target = Path(resume).expanduser()
    lowered = resume.strip().lower()
    hint = ""
    if lowered in ("true", "false"):
        hint = f"; for the boolean, write run.resume = {lowered} without quotes"
    if not target.exists():
        return [f"run.resume: checkpoint {resume!r} does not exist (cwd: {Path.cwd()}){hint}"]
    if not target.is_dir() or not (target / MANIFEST).is_file():
        return [f"run.resume: {resume!r} is not a complete checkpoint (no {MANIFEST}); point it "
                "at a checkpoints/step_<N> directory, or set run.resume = true for the newest one"]
    return []
