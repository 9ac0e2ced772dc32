"""Where a run resumes from, and whether its config still fits that checkpoint.

Every checkpoint's manifest records the run's config (secrets redacted). On resume the
settings that decide what is trained are compared with the new config: ``model``,
``data``, ``train``, ``algorithm``, ``rewards``, ``environment`` (when one is set) and the
sampling keys of ``rollout`` (not the engine or its options). Keys that change how, not
what, is computed (:data:`NOT_COMPARED`), the run's length (:data:`RUN_LENGTH`, reported)
and the sections of the run's place and outputs (``run``, ``checkpoint``, ``logging``,
``eval``, ``storage``) may change freely; so may the backend and the number of processes, since
checkpoints are resharded on load (the backend checks the tensors themselves and names
any that do not fit).

A difference is refused with :class:`ResumeConfigError` (exit code 2) listing each changed
key, unless ``run.resume_with_changes`` (``--resume-with-changes``) is set: then the
changes are printed and applied, the restored optimizer taking the new hyperparameters.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from reasonctl.core.checkpoint import CheckpointInfo, CheckpointManager, read_checkpoint
from reasonctl.core.checkpoint_files import CheckpointIntegrityError, verify_files
from reasonctl.core.config import (
    AlgorithmSection,
    DataSection,
    RolloutSection,
    RunConfig,
    redact_secrets,
)
from reasonctl.core.config.schema import field_name
from reasonctl.core.errors import ConfigError, UsageError

COMPARED_SECTIONS = ("model", "data", "train", "algorithm", "rollout", "rewards",
                     "environment")
NOT_COMPARED = frozenset({
    "model.attention", "model.gradient_checkpointing", "model.lora.export", "train.compile",
    "train.on_nonfinite",
})
"""Keys of the compared sections that do not change what is trained (``model.lora.export``
only chooses the export's layout)."""
RUN_LENGTH = frozenset({"train.max_steps", "train.epochs"})
"""Keys that may change on resume to lengthen or shorten a run: applied and reported (the
learning-rate schedule follows the new length)."""
ROLLOUT_SAMPLING = tuple(k for k in RolloutSection.model_fields if k != "engine")
MAX_SHOWN = 120


class ResumeConfigError(UsageError):
    """The config differs from the one the checkpoint to resume was written with;
    ``changes`` lists ``key: old -> new``."""

    def __init__(self, message: str, changes: list[str]) -> None:
        super().__init__(message)
        self.changes = changes


SELECTORS = {"data": ("format", DataSection), "algorithm": ("name", AlgorithmSection)}
"""Sections whose component subsection (``[data.<format>]``, ``[algorithm.<name>]``) is
compared for the selected component only."""


def config_record(config: RunConfig) -> dict[str, Any]:
    """What a checkpoint's manifest keeps of the config: everything, secrets redacted, with
    the selected data format's and algorithm's sections filled with their defaults."""
    record = config.to_dict(redact=True)
    for section, (selector, _) in SELECTORS.items():
        name = record[section][selector]
        options = config.component_config(section, name)
        if hasattr(options, "model_dump"):
            record[section][field_name(name)] = redact_secrets(
                options.model_dump(mode="json", by_alias=True))
    return record


def compared_view(record: dict[str, Any]) -> dict[str, Any]:
    """The flattened ``{"section.key": value}`` of the settings compared on resume."""
    flat: dict[str, Any] = {}
    for section in COMPARED_SECTIONS:
        value = record.get(section)
        if isinstance(value, dict) and section == "environment" and value.get("name") is None:
            continue  # single-turn rollouts: nothing of the section applies
        if isinstance(value, dict) and section == "rollout":
            value = {k: v for k, v in value.items() if k in ROLLOUT_SAMPLING}
        elif isinstance(value, dict) and section in SELECTORS:
            selector, model = SELECTORS[section]
            chosen = field_name(str(value.get(selector)))
            value = {k: v for k, v in value.items() if k in model.model_fields or k == chosen}
        _flatten(section, value, flat)
    return {k: v for k, v in flat.items() if k not in NOT_COMPARED}


def config_hash(config: RunConfig) -> str:
    """A short hash of the compared settings (informational, kept in the manifest)."""
    view = compared_view(config_record(config))
    return hashlib.sha256(json.dumps(view, sort_keys=True).encode()).hexdigest()[:16]


def config_changes(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, str]:
    """``{key: "key: old -> new"}`` for every compared key that differs, sorted by key.

    A key the saved config lacks (written by an earlier version) whose new value is
    ``None`` (an optional section left unset, such as ``model.lora``) is no change."""
    old, new = compared_view(saved), compared_view(current)
    changes = {}
    for key in sorted(old.keys() | new.keys()):
        before, after = old.get(key, _UNSET), new.get(key, _UNSET)
        if before is _UNSET and after is None:  # a section added since, left unset
            continue
        if before != after:
            changes[key] = f"{key}: {_shown(before)} -> {_shown(after)}"
    return changes


def select_resume_point(config: RunConfig, root: Path,
                        log: Callable[[str], None]) -> CheckpointInfo | None:
    """The checkpoint this run resumes from (``None``: start from scratch).

    ``run.resume = true`` takes the newest complete checkpoint under ``root`` whose files
    match its manifest (damaged and torn ones are reported and skipped);
    ``run.resume = "path"`` takes that checkpoint, and a damaged one is an error.
    """
    resume = config.run.resume
    if not resume:
        return None
    if isinstance(resume, str):
        try:
            info = read_checkpoint(Path(resume))
        except (FileNotFoundError, ValueError, KeyError) as exc:
            raise ConfigError([f"run.resume: {exc}"]) from exc
        problems = verify_files(info.path, info.manifest.get("files"))
        if problems:
            raise CheckpointIntegrityError(_damaged(info, problems) + "; resume from another "
                                           "checkpoint")
        return info
    manager = CheckpointManager(root, keep=1, is_main=False)
    candidates = manager.complete()
    for torn in manager.torn:
        log(f"skipping incomplete checkpoint {torn}")
    for info in reversed(candidates):
        problems = verify_files(info.path, info.manifest.get("files"))
        if not problems:
            return info
        log(f"skipping {_damaged(info, problems)}")
    return None


def check_resume_config(info: CheckpointInfo, config: RunConfig,
                        log: Callable[[str], None]) -> None:
    """Refuse (or, with ``run.resume_with_changes``, report) config changes since ``info``."""
    saved = info.manifest.get("config")
    _note_resharding(info, saved, config, log)
    if not isinstance(saved, dict):
        log(f"{info.path} was written before checkpoints recorded their config; config "
            "changes cannot be checked")
        return
    found = config_changes(saved, config_record(config))
    length = [line for key, line in found.items() if key in RUN_LENGTH]
    if length:
        log(f"resuming {info.path} with a new run length: {'; '.join(length)}")
    changes = [line for key, line in found.items() if key not in RUN_LENGTH]
    if not changes:
        return
    listing = "\n".join(f"  - {line}" for line in changes)
    if config.run.resume_with_changes:
        log(f"resuming {info.path} with {len(changes)} changed setting(s) "
            f"(run.resume_with_changes):\n{listing}")
        return
    raise ResumeConfigError(
        f"run.resume: the config differs from the one {info.path} was written with "
        f"({len(changes)} setting(s)):\n{listing}\nTo continue with the new values pass "
        "--resume-with-changes (run.resume_with_changes = true); to resume unchanged, "
        "restore the old values; to start over, use another run.output_dir.",
        changes,
    )


def _note_resharding(info: CheckpointInfo, saved: Any, config: RunConfig,
                     log: Callable[[str], None]) -> None:
    before = info.manifest.get("world_size")
    now = int(os.environ.get("WORLD_SIZE", "1"))
    old_backend = saved.get("backend", {}).get("name") if isinstance(saved, dict) else None
    if (before is not None and before != now) or (old_backend and
                                                  old_backend != config.backend.name):
        log(f"resharding {info.path}: written by {before or '?'} process(es) with the "
            f"{old_backend or '?'} backend, loaded by {now} with the {config.backend.name} "
            "backend")


def _damaged(info: CheckpointInfo, problems: list[str]) -> str:
    shown = "; ".join(problems[:5]) + (f" (and {len(problems) - 5} more)"
                                       if len(problems) > 5 else "")
    return f"damaged checkpoint {info.path}: {shown}"


class _Unset:
    def __repr__(self) -> str:
        return "(not set)"


_UNSET = _Unset()


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict) and value:
        for key, item in value.items():
            _flatten(f"{prefix}.{key}", item, out)
    else:
        out[prefix] = value


def _shown(value: Any) -> str:
    text = repr(value) if isinstance(value, (_Unset, str)) else json.dumps(value)
    return text if len(text) <= MAX_SHOWN else text[: MAX_SHOWN - 3] + "..."
