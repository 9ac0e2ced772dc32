"""What an exported model carries for generation besides its weights and tokenizer.

A run's rollouts stop on ``rollout.stop`` strings after at most ``rollout.max_new_tokens``
tokens, behind the run's system prompt and prompt template. An export keeps those
settings in two files, so a model generates as the run's rollouts did without the run's
config:

- ``generation_config.json`` (transformers' format): ``eos_token_id`` lists the model's
  end-of-sequence ids, the tokenizer's, and every ``rollout.stop`` string that is a single
  token; ``max_new_tokens``, ``do_sample``, ``temperature``, ``top_p`` and ``top_k`` are
  the rollout's. ``model.generate`` and ``reasonctl``'s own engine read it.
- ``reasonctl_generation.toml``: a config file with only the keys ``reasonctl infer``
  uses (``rollout`` stop strings and sampling, ``eval`` temperature and lengths,
  ``data.system_prompt`` and ``prompt_template``, the data format's ``fps`` and
  ``max_pixels``, ``model.max_length``). ``reasonctl infer --model DIR`` reads it when no
  ``--config`` is given. A file holding any other key is refused
  (:func:`generation_settings_file`), so an export can never select code to run.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reasonctl.core.errors import UsageError

if TYPE_CHECKING:
    from reasonctl.core.config import RunConfig

SETTINGS_FILE = "reasonctl_generation.toml"
GENERATION_CONFIG_FILE = "generation_config.json"
ROLLOUT_KEYS = ("max_new_tokens", "temperature", "top_p", "top_k", "stop", "suppress_tokens")
EVAL_KEYS = ("temperature", "max_new_tokens", "repetition_penalty")
DATA_KEYS = ("format", "system_prompt", "prompt_template")
MEDIA_KEYS = ("fps", "max_pixels")
MODEL_KEYS = ("max_length",)
HEADER = (
    "# Generation settings of the run that trained this model. `reasonctl infer --model <this\n"
    "# directory>` reads them when no --config is given; only these keys are accepted here.\n"
)


def generation_settings(config: RunConfig) -> dict[str, Any]:
    """The keys of ``config`` that generation needs, as a plain config mapping."""
    rollout = config.rollout.model_dump()
    evaluation = config.eval.model_dump()
    data: dict[str, Any] = {key: getattr(config.data, key) for key in DATA_KEYS[1:]
                            if getattr(config.data, key) is not None}
    media = {key: getattr(config.component_config("data", config.data.format), key, None)
             for key in MEDIA_KEYS}
    media = {key: value for key, value in media.items() if value is not None}
    if media:
        data.update({"format": config.data.format, config.data.format: media})
    settings: dict[str, Any] = {
        "model": {key: getattr(config.model, key) for key in MODEL_KEYS},
        "rollout": {key: rollout[key] for key in ROLLOUT_KEYS},
        "eval": {key: evaluation[key] for key in EVAL_KEYS if evaluation[key] is not None},
    }
    if data:
        settings["data"] = data
    return settings


def write_generation_files(directory: Path, config: RunConfig) -> None:
    """Write ``reasonctl_generation.toml`` into ``directory`` and put the rollout's stops
    and sampling into its ``generation_config.json`` (see the module docstring)."""
    import tomli_w

    directory = Path(directory)
    (directory / SETTINGS_FILE).write_text(HEADER + tomli_w.dumps(generation_settings(config)),
                                           encoding="utf-8")
    path = directory / GENERATION_CONFIG_FILE
    if not path.is_file():
        return
    values = json.loads(path.read_text(encoding="utf-8"))
    rollout = config.rollout
    values["eos_token_id"] = sorted(_eos_ids(values.get("eos_token_id"), directory,
                                             rollout.stop))
    values["max_new_tokens"] = rollout.max_new_tokens
    values["do_sample"] = rollout.temperature > 0
    for key in ("temperature", "top_p", "top_k"):
        values[key] = getattr(rollout, key) if rollout.temperature > 0 else None
    path.write_text(json.dumps({k: v for k, v in values.items() if v is not None}, indent=2,
                               sort_keys=True) + "\n", encoding="utf-8")


def _eos_ids(declared: Any, directory: Path, stops: list[str]) -> set[int]:
    ids = {int(v) for v in (declared if isinstance(declared, list) else [declared])
           if v is not None}
    tokenizer = _tokenizer(directory)
    if tokenizer is None:
        return ids
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    for stop in stops:
        encoded = tokenizer.encode(stop, add_special_tokens=False)
        if len(encoded) == 1:
            ids.add(int(encoded[0]))
    return ids


def _tokenizer(directory: Path) -> Any:
    from transformers import AutoTokenizer

    from reasonctl.models.loading import quiet_transformers

    if not any((directory / name).is_file() for name in ("tokenizer.json", "tokenizer.model",
                                                         "vocab.json")):
        return None
    quiet_transformers()
    return AutoTokenizer.from_pretrained(directory, trust_remote_code=False)


def generation_settings_file(directory: Path) -> Path | None:
    """``directory``'s ``reasonctl_generation.toml`` when it has one, after checking that it
    holds only the keys generation uses (:class:`UsageError` naming the others)."""
    path = Path(directory) / SETTINGS_FILE
    if not path.is_file():
        return None
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise UsageError(f"{path}: unreadable ({exc}); delete it or pass the run's config "
                         "with --config") from exc
    data_format = data.get("data", {}).get("format") if isinstance(data.get("data"),
                                                                    Mapping) else None
    allowed = {("model", k) for k in MODEL_KEYS} | {("rollout", k) for k in ROLLOUT_KEYS} \
        | {("eval", k) for k in EVAL_KEYS} | {("data", k) for k in DATA_KEYS} \
        | {("data", str(data_format), k) for k in MEDIA_KEYS}
    others = [".".join(key) for key in _leaf_keys(data) if key not in allowed]
    if others:
        raise UsageError(
            f"{path}: holds keys an export's generation settings never have "
            f"({', '.join(others)}); remove them, or pass the run's config with --config")
    return path


def _leaf_keys(data: Mapping[str, Any], prefix: tuple[str, ...] = ()
               ) -> Iterator[tuple[str, ...]]:
    for key, value in data.items():
        if isinstance(value, Mapping) and value:
            yield from _leaf_keys(value, (*prefix, str(key)))
        else:
            yield (*prefix, str(key))
