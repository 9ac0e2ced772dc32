"""Config problems as lines a user can act on: ``path: message (got value)``.

Pydantic's errors become one line per problem: union branches are folded into one
expectation (``Input should be a valid string or a valid list``), unknown keys get a
did-you-mean and the list of valid keys, values under secret keys are never echoed, and a
value that came from an environment variable is reported under the variable's name
(``REASONCTL_TRAIN__BETAS (train.betas.0): ...``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from reasonctl.core.config.foreign_keys import foreign_key_hint
from reasonctl.core.config.redaction import REDACTED, is_secret_key, redact_text
from reasonctl.core.config.schema import model_in
from reasonctl.core.config.sources import ENV_DELIMITER, ENV_PREFIX, ConfigSources
from reasonctl.core.errors import did_you_mean

UNION_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "tuple", "set", "bytes"})
EXPECTATION = "Input should be "
TEXT_EXPECTED = "Input should be a valid string"
MAX_SHOWN = 80

Loc = tuple[Any, ...]


@dataclass(frozen=True)
class Issue:
    """One problem at a location in the merged config values."""

    loc: Loc
    message: str

    def format(self, sources: ConfigSources | None = None) -> str:
        """``path: message``, or ``VARIABLE (path): message`` for an environment value."""
        path = ".".join(str(part) for part in self.loc)
        origin = sources.source_of(self.loc) if sources is not None and self.loc else None
        from_env = origin is not None and origin.upper().startswith(ENV_PREFIX) \
            and "," not in origin
        message = self.message
        if (from_env or (origin or "").startswith("--set ")) and TEXT_EXPECTED in message:
            message += "; values are read as TOML literals, so quote text (e.g. '2024')"
        if from_env and origin is not None:
            variable_path = origin[len(ENV_PREFIX):].lower().split(ENV_DELIMITER)
            if variable_path == [str(part) for part in self.loc]:
                return f"{origin}: {message}"
            return f"{origin} ({path}): {message}"
        return f"{path}: {message}" if path else message


def format_validation_errors(
    exc: ValidationError, model: type[BaseModel], prefix: str = ""
) -> list[str]:
    """Pydantic errors as ``path: message (got value)`` lines, with did-you-mean for typos."""
    loc_prefix = tuple(prefix.split(".")) if prefix else ()
    return [issue.format() for issue in validation_issues(exc, model, loc_prefix)]


def validation_issues(
    exc: ValidationError, model: type[BaseModel], prefix: Loc = (), extra_keys: Iterable[str] = ()
) -> list[Issue]:
    """The errors of ``exc`` (raised validating ``model``) as issues under ``prefix``.

    ``extra_keys`` are keys valid beside the model's own fields (``name`` and ``weight`` of
    a reward entry), listed in did-you-mean hints.
    """
    groups: dict[Loc, list[dict[str, Any]]] = {}
    tagged: set[Loc] = set()
    for error in exc.errors():
        loc = tuple(part for part in error["loc"] if not _is_union_tag(part))
        groups.setdefault(loc, []).append(error)
        if len(loc) != len(error["loc"]):
            tagged.add(loc)
    issues = []
    for loc, errors in groups.items():
        deeper = any(other[: len(loc)] == loc and len(other) > len(loc) for other in groups)
        if loc in tagged and deeper and all(_is_type_error(e) for e in errors):
            continue  # a union branch went deeper: its errors say more
        issues.append(Issue((*prefix, *loc), _message(loc, errors, model, extra_keys)))
    return issues


def _is_union_tag(part: Any) -> bool:
    return isinstance(part, str) and (
        part in UNION_TAGS or "[" in part or part.startswith("function-")
    )


def _is_type_error(error: dict[str, Any]) -> bool:
    return error["type"].endswith(("_type", "_parsing")) or error["type"] == "literal_error"


def _message(loc: Loc, errors: list[dict[str, Any]], model: type[BaseModel],
             extra_keys: Iterable[str]) -> str:
    first = errors[0]
    if first["type"] == "extra_forbidden":
        siblings = sorted({*known_keys(model, loc[:-1]), *(extra_keys if len(loc) == 1 else ())})
        close = did_you_mean(str(loc[-1]), siblings)
        section = model_at(model, loc[:-1])
        foreign = foreign_key_hint(str(loc[-1]), first.get("input"),
                                   ".".join(map(str, loc)),
                                   getattr(section, "foreign_keys", None))
        message = "unknown key" + (f"; {foreign}" if foreign else
                                   f"; did you mean {close!r}?" if close else "")
        return message + (f" (valid keys: {', '.join(siblings)})" if siblings else "")
    if first["type"] == "missing":
        if loc and isinstance(loc[-1], int):
            return f"item {loc[-1]} is missing: too few items (got {_shown(loc, first)})"
        return "required key is missing"
    texts: list[str] = []
    for error in errors:
        text = error["msg"]
        if texts and text.startswith(EXPECTATION) and texts[0].startswith(EXPECTATION):
            text = text[len(EXPECTATION):]
        if text not in texts:
            texts.append(text)
    return f"{' or '.join(texts)} (got {_shown(loc, first)})"


def _shown(loc: Loc, error: dict[str, Any]) -> str:
    if any(isinstance(part, str) and is_secret_key(part) for part in loc):
        return REDACTED
    value = error.get("input")
    text = repr(value) if isinstance(value, str) else json.dumps(value, default=str)
    text = redact_text(text)
    return text if len(text) <= MAX_SHOWN else text[: MAX_SHOWN - 3] + "..."


def known_keys(model: type[BaseModel], loc: Sequence[Any]) -> list[str]:
    """The keys valid at ``loc`` inside ``model`` (aliases where set)."""
    fields = getattr(model_at(model, loc), "model_fields", None) or {}
    return [f.alias or n for n, f in fields.items()]


def model_at(model: type[BaseModel], loc: Sequence[Any]) -> type[BaseModel] | None:
    """The model of the section at ``loc`` inside ``model`` (``None`` when not a model)."""
    current: Any = model
    for part in loc:
        if isinstance(part, int):
            continue
        fields = getattr(current, "model_fields", None)
        if not fields:
            return None
        field = next((f for n, f in fields.items() if part in (n, f.alias)), None)
        if field is None:
            return None
        current = _model_below(field.annotation)
        if current is None:
            return None
    return current


def _model_below(annotation: Any) -> type[BaseModel] | None:
    """The model an annotation holds directly, in a union, or as list/dict items."""
    found = model_in(annotation)
    if found is not None:
        return found
    for arg in getattr(annotation, "__args__", ()):
        found = _model_below(arg)
        if found is not None:
            return found
    return None
