"""Where config values come from: TOML files, ``REASONCTL_*`` variables, flags, ``--set``.

:func:`collect_sources` merges the layers in order of precedence, lowest first::

    defaults < --config files (in order) < REASONCTL_A__B environment < CLI flags < --set

and records, for every value, which layer set it (``config show --sources`` prints it and
error messages name the variable an environment value came from). Tables merge key by
key; any other value, lists included, is replaced whole, and a list that a later file
replaces is reported as a warning naming both files. Problems with a source (a missing or
unreadable file, a malformed ``--set``, a misspelt variable) are collected, not raised, so
they are reported together with every schema problem.
"""

from __future__ import annotations

import copy
import datetime
import difflib
import os
import re
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reasonctl.core.config.redaction import is_secret_key, secret_variables_named_in
from reasonctl.core.errors import ConfigError, did_you_mean

ENV_PREFIX = "REASONCTL_"
ENV_DELIMITER = "__"
PROCESS_VARIABLES = frozenset({
    "REASONCTL_STRICT_PLUGINS",
    "REASONCTL_DISABLE_PLUGINS",
    "REASONCTL_CACHE",
    "REASONCTL_OUTPUT_LOCK",
    "REASONCTL_LAUNCHER_PID",
    "REASONCTL_NODE_RANK",
    "REASONCTL_GROUP_STARTED",
    "REASONCTL_STOP_REQUESTED",
})
"""``REASONCTL_*`` variables that steer the process and are not config keys. Config
variables always hold ``__`` (``REASONCTL_<SECTION>__<KEY>``); a name without it is never
read as config."""
PROCESS_VARIABLE_CUTOFF = 0.7
"""How close (difflib ratio of the part after ``REASONCTL_``) an unknown name must be to a
process variable to be reported as its misspelling."""
FLAGS = "command-line flags"
DEFAULT = "default"

Path_ = tuple[str, ...]


@dataclass
class ConfigSources:
    """Merged raw values of every layer, where each value came from, and what went wrong."""

    data: dict[str, Any] = field(default_factory=dict)
    origins: dict[Path_, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    unread_files: list[str] = field(default_factory=list)
    """Config files that could not be read (their values are missing from ``data``)."""

    def merge(self, values: Mapping[str, Any], source: str, *, is_file: bool = False) -> None:
        """Merge a layer of ``values`` set by ``source`` (tables merge, the rest replaces)."""
        self._merge(self.data, values, (), source, is_file)

    def set(self, path: Sequence[str], value: Any, source: str) -> None:
        """Set one value at ``path`` (creating tables on the way) on behalf of ``source``."""
        nested: Any = value
        for part in reversed(path[1:]):
            nested = {part: nested}
        self._merge(self.data, {path[0]: nested}, (), source, False)

    def _merge(self, node: dict[str, Any], values: Mapping[str, Any], prefix: Path_,
               source: str, is_file: bool) -> None:
        for key, value in values.items():
            path = (*prefix, str(key))
            current = node.get(key)
            if isinstance(value, Mapping) and isinstance(current, dict):
                self._merge(current, value, path, source, is_file)
                continue
            if is_file and isinstance(current, list) and isinstance(value, list):
                earlier = self.origins.get(path)
                if earlier is not None and earlier != source:
                    self.warnings.append(
                        f"{'.'.join(path)}: the list from {earlier} is replaced by the one from "
                        f"{source} (lists are replaced, not merged; repeat in {source} every "
                        "entry you want to keep)"
                    )
            self._forget(path)
            node[key] = copy.deepcopy(dict(value) if isinstance(value, Mapping) else value)
            self._record(path, value, source)

    def _forget(self, path: Path_) -> None:
        for known in [p for p in self.origins if p[: len(path)] == path or path[: len(p)] == p]:
            del self.origins[known]

    def _record(self, path: Path_, value: Any, source: str) -> None:
        if isinstance(value, Mapping) and value:
            for key, item in value.items():
                self._record((*path, str(key)), item, source)
        else:
            self.origins[path] = source

    def source_of(self, loc: Sequence[Any]) -> str | None:
        """The layer that set the value at ``loc`` (or all values under it), if known."""
        path = tuple(str(part) for part in loc)
        for end in range(len(path), 0, -1):
            if path[:end] in self.origins:
                return self.origins[path[:end]]
        below = sorted({s for p, s in self.origins.items() if p[: len(path)] == path})
        return ", ".join(below) if below else None


def collect_sources(
    paths: Iterable[str | Path] = (),
    overrides: Iterable[str] = (),
    *,
    values: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    sections: Iterable[str] = (),
) -> ConfigSources:
    """Merge files, environment, ``values`` (CLI flags) and ``a.b=v`` overrides, in order.

    ``sections`` are the top-level section names, for did-you-mean on misspelt variables.
    """
    sources = ConfigSources()
    for path in paths:
        try:
            sources.merge(read_toml(path), str(path), is_file=True)
        except ConfigError as exc:
            sources.problems += exc.problems
            sources.unread_files.append(str(path))
    parsed = []
    for text in overrides:
        try:
            parsed.append((text, *parse_override(text)))
        except ConfigError as exc:
            sources.problems += exc.problems
    named = _variables_named_in(sources.data, values, [(key, value) for _, key, value in parsed])
    for name, key, value in env_entries(os.environ if environ is None else environ,
                                        list(sections), sources.problems, secrets=named):
        sources.set(key, value, name)
    if values:
        sources.merge(values, FLAGS)
    for text, key, value in parsed:
        sources.set(key, value, f"--set {text}")
    return sources


def _variables_named_in(data: Mapping[str, Any], values: Mapping[str, Any] | None,
                        overrides: list[tuple[list[str], Any]]) -> set[str]:
    """Variables the files, flags and overrides name in ``*_env`` options (secrets)."""
    named = set(secret_variables_named_in(data)) | set(secret_variables_named_in(values or {}))
    for key, value in overrides:
        named.update(secret_variables_named_in({key[-1]: value}))
    return {name.upper() for name in named}


# --- the layers ----------------------------------------------------------------------------


def read_toml(path: str | Path) -> dict[str, Any]:
    """Read one TOML file; any problem is a :class:`ConfigError` naming the file."""
    path = Path(path)
    try:
        if not path.exists():
            raise ConfigError([f"{path}: file not found (cwd: {Path.cwd()})"])
        if path.is_dir():
            raise ConfigError([f"{path}: is a directory; --config takes a TOML file"])
        raw = path.read_bytes()
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise ConfigError([f"{path}: cannot read the config file: {reason}"]) from exc
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError([
            f"{path}: not UTF-8 text (byte 0x{raw[exc.start]:02x} on line {line}); "
            "TOML files must be saved as UTF-8"
        ]) from exc
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"{path}: invalid TOML: {toml_error_text(text, exc)}"]) from exc


_REDEFINED = ("Cannot overwrite a value", "Cannot declare")
_KEY_LINE = re.compile(r"^\s*(?P<key>[^=\[#][^=]*?)\s*=")
_HEADER_LINE = re.compile(r"^\s*\[\[?\s*(?P<name>[^\]]+?)\s*\]\]?\s*(#.*)?$")


def toml_error_text(text: str, error: tomllib.TOMLDecodeError) -> str:
    """``error`` as a user reads it: a key or table defined twice is named, with its lines
    (the parser says only "Cannot overwrite a value", at times "at end of document")."""
    message = str(error)
    if not message.startswith(_REDEFINED):
        return message
    lines = text.splitlines()
    for end in range(1, len(lines) + 1):  # the first line whose text redefines something
        try:
            tomllib.loads("\n".join(lines[:end]))
        except tomllib.TOMLDecodeError as exc:
            if str(exc).startswith(_REDEFINED):
                return _redefinition(lines, end) or message
    return message


def _redefinition(lines: list[str], end: int) -> str | None:
    for number in range(end, 0, -1):  # back to where the value or table starts
        header = _HEADER_LINE.match(lines[number - 1])
        if header:
            name = header.group("name")
            return (f"[{name}] on line {number} defines {name!r} again (it is a table or a "
                    "value above); merge the two into one")
        key = _KEY_LINE.match(lines[number - 1])
        if key:
            table = _table_at(lines, number)
            full = f"{table}.{key.group('key')}" if table else key.group("key")
            first = next((n for n in range(1, number) if _table_at(lines, n) == table
                          and (m := _KEY_LINE.match(lines[n - 1]))
                          and m.group("key") == key.group("key")), None)
            where = f" (first set on line {first})" if first else ""
            return (f"duplicate key {full!r} on line {number}{where}; keep one of them")
    return None


def _table_at(lines: list[str], number: int) -> str:
    """The table header in force at line ``number`` (1-based; "" at the top level)."""
    for index in range(number - 1, 0, -1):
        header = _HEADER_LINE.match(lines[index - 1])
        if header:
            return header.group("name")
    return ""


def parse_value(raw: str) -> Any:
    """A ``--set`` or environment value: a TOML literal (``1e-5``, ``[1, 2]``, ``true``,
    ``'text'``), else the text itself. Dates and times stay text."""
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw
    if isinstance(value, (datetime.date, datetime.time)):
        return raw
    return value


def parse_override(text: str) -> tuple[list[str], Any]:
    """Parse ``a.b.c=value``; the value is a TOML literal, or a plain string otherwise."""
    if "=" not in text:
        raise ConfigError([f"--set {text}: expected KEY=VALUE, e.g. --set train.lr=1e-5"])
    key, raw = text.split("=", 1)
    parts = [part.strip() for part in key.strip().split(".")]
    if not key.strip() or any(not part for part in parts):
        raise ConfigError([f"--set {text}: empty key segment in {key.strip()!r}"])
    return parts, parse_value(raw)


def env_entries(
    environ: Mapping[str, str],
    sections: list[str],
    problems: list[str],
    *,
    secrets: Iterable[str] = (),
) -> list[tuple[str, list[str], Any]]:
    """``(variable, key path, value)`` of each ``REASONCTL_<SECTION>__<KEY>`` variable.

    A misspelt section or a malformed name is appended to ``problems`` with a
    did-you-mean; names without ``__`` are process variables, never config, but a close
    misspelling of a known one is reported too. Credentials are never config: the
    ``secrets`` a config names in ``*_env`` options, and names that say they hold one
    (``REASONCTL_REWARD_TOKEN``), are skipped.
    """
    skipped = PROCESS_VARIABLES | {name.upper() for name in secrets}
    entries = []
    for name in sorted(environ):
        if not name.upper().startswith(ENV_PREFIX) or name.upper() in skipped:
            continue
        if ENV_DELIMITER not in name and is_secret_key(name):
            continue
        rest = name[len(ENV_PREFIX):]
        if ENV_DELIMITER not in rest:
            problems += _process_variable_problems(name, rest, sections)
            continue
        parts = [part.lower() for part in rest.split(ENV_DELIMITER)]
        if any(not part for part in parts):
            problems.append(f"{name}: empty name segment; config variables are named "
                            "REASONCTL_<SECTION>__<KEY>, e.g. REASONCTL_TRAIN__LR")
            continue
        if sections and parts[0] not in sections:
            close = did_you_mean(parts[0], sections)
            keys = ENV_DELIMITER.join(rest.split(ENV_DELIMITER)[1:])
            hint = f"; did you mean {ENV_PREFIX}{close.upper()}{ENV_DELIMITER}{keys}?" \
                if close else ""
            problems.append(f"{name}: unknown config section {parts[0]!r}{hint} "
                            f"(sections: {', '.join(sections)})")
            continue
        entries.append((name, parts, parse_value(environ[name])))
    return entries


def _process_variable_problems(name: str, rest: str, sections: list[str]) -> list[str]:
    if rest.lower() in sections:
        return [f"{name}: set keys one at a time, e.g. {name}__<KEY>=value"]
    known = {variable[len(ENV_PREFIX):]: variable for variable in PROCESS_VARIABLES}
    close = difflib.get_close_matches(rest.upper(), list(known), n=1,
                                      cutoff=PROCESS_VARIABLE_CUTOFF)
    if close:
        return [f"{name}: unknown variable; did you mean {known[close[0]]}?"]
    return []


# --- plain-data helpers (public: the SDK and benches use them) --------------------------


def deep_merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Recursively merge ``override`` into a copy of ``base`` (tables merge, values replace)."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def set_path(data: dict[str, Any], path: Sequence[str], value: Any) -> None:
    """Set ``data[p0][p1]... = value``, creating tables on the way."""
    node = data
    for part in path[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[path[-1]] = value
