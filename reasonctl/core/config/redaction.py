"""Keeping secrets out of printed and saved configs, error messages and tracebacks.

Three rules, applied everywhere text leaves the process:

- **By key**: a config value is secret when its key, split into segments on ``_``, ``-``,
  ``.`` and camelCase, names one (``token``, ``secret``, ``password``, ``api_key``,
  ``access_key``, ``private_key``, ``credentials`` ...). Ordinary keys stay readable:
  ``tokenizer``, ``max_tokens``, ``keywords``, ``key_column``, ``pad_token`` are not
  secrets, and keys that *name* a secret (``token_env``, ``password_file``) are not either.
- **In URLs**: the userinfo of any URL (``https://user:pass@host``) becomes ``***``.
- **In ``secret=value`` text**: the value becomes ``***``, unless it is a shell reference to
  where the secret is (``TOKEN=$(openssl rand -hex 32)``, ``TOKEN=$HF_TOKEN``).
- **By value**: the values of credential environment variables (``HF_TOKEN`` ... any
  variable whose own name is secret by the key rule, and every variable a config names in a
  ``*_env`` option) are replaced wherever they appear.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

REDACTED = "***"
SECRET_ENV_VARS = (
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_ACCESS_KEY_ID",
    "AWS_SESSION_TOKEN",
    "WANDB_API_KEY",
)
"""Credential variables redacted by value whatever their names say."""

SECRET_WORDS = frozenset({
    "token", "secret", "secrets", "password", "passwords", "passwd", "passphrase",
    "credential", "credentials", "apikey", "authorization", "cookie",
})
SECRET_PAIRS = frozenset({
    ("api", "key"), ("access", "key"), ("private", "key"), ("secret", "key"),
    ("session", "key"), ("signing", "key"), ("encryption", "key"), ("auth", "key"),
    ("client", "secret"), ("auth", "token"),
})
NAMING_SUFFIXES = frozenset({"env", "var", "variable", "file", "path", "dir", "name"})
"""A key ending in one of these names where a secret is, and is not a secret itself."""
MODEL_TOKENS = frozenset({
    "pad", "eos", "bos", "unk", "sep", "cls", "mask", "image", "video", "audio", "vision",
    "start", "end", "stop", "think", "answer", "special", "placeholder", "eot", "im", "box",
})
"""Words before ``token`` that make it a vocabulary token (``pad_token``), not a secret."""
MIN_SECRET_LENGTH = 6

_SEGMENT = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|\d+")
_URL_USERINFO = re.compile(
    r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?:[^\s/@?#:]*:[^\s@'\"]*|[^\s/@?#]+)@"
)
"""``scheme://user:password@`` or ``scheme://token@``. A password may hold ``/`` (AWS secret
keys do), so after a colon everything up to the ``@`` is taken."""
_ASSIGNMENT = re.compile(
    r"""(?P<key>["']?[A-Za-z][\w.-]*["']?)(?P<sep>\s*(?:=|(?<=["']):)\s*)"""
    r"""(?P<quote>["']?)(?P<value>[^\s"',;&)}\]]+)"""
)
_BEARER = re.compile(r"\b(?P<kind>Bearer|Basic|Token)\s+[A-Za-z0-9._~+/=-]{8,}")
_SHELL_REFERENCE = re.compile(r"^\$(\(|\{|[A-Z_][A-Z0-9_]*$)")
"""``$(command)``, ``${VAR}`` or ``$VAR``: where a secret comes from in a shell line
(``export TOKEN=$(openssl rand -hex 32)``), not the secret."""
_named_variables: set[str] = set()


def key_segments(key: str) -> list[str]:
    """``key`` split on ``_``, ``-``, ``.``, spaces and camelCase, lower-cased."""
    return [m.group(0).lower() for m in _SEGMENT.finditer(key)]


def is_secret_key(key: str) -> bool:
    """True when the value under ``key`` is a secret (see the module docstring)."""
    segments = key_segments(key)
    if not segments or segments[-1] in NAMING_SUFFIXES:
        return False
    for index, segment in enumerate(segments):
        previous = segments[index - 1] if index else ""
        if segment == "token" and previous in MODEL_TOKENS:
            continue
        if segment in SECRET_WORDS:
            return True
        if (previous, segment.removesuffix("s")) in SECRET_PAIRS:
            return True
    return False


def remember_secret_variables(names: Iterable[str]) -> None:
    """Treat the values of environment variables ``names`` as secrets from now on.

    Called with the variables a config names in its ``*_env`` options, which hold
    credentials whatever the variables are called.
    """
    _named_variables.update(n for n in names if n)


def secret_variables_named_in(data: Any, _key: str = "") -> list[str]:
    """Variable names held by ``*_env`` keys anywhere in plain config ``data``."""
    if isinstance(data, Mapping):
        return [n for k, v in data.items() for n in secret_variables_named_in(v, str(k))]
    if isinstance(data, list):
        return [n for item in data for n in secret_variables_named_in(item, _key)]
    segments = key_segments(_key)
    if isinstance(data, str) and segments and segments[-1] == "env":
        return [data]
    return []


def secret_values(environ: Mapping[str, str] | None = None) -> list[str]:
    """Values of credential environment variables, longest first (to scrub from text)."""
    environ = os.environ if environ is None else environ
    values = set()
    for name, value in environ.items():
        if not (name in SECRET_ENV_VARS or name in _named_variables or is_secret_key(name)):
            continue
        if _could_be_secret(value):
            values.add(value)
    return sorted(values, key=len, reverse=True)


def _could_be_secret(value: str) -> bool:
    plain = value.strip().lower()
    if len(plain) < MIN_SECRET_LENGTH or plain in ("true", "false", "none", "null"):
        return False
    return not plain.replace(".", "").replace("-", "").isdigit()


def redact_secrets(data: Any, _key: str = "") -> Any:
    """Plain config ``data`` with secret values replaced by ``***``."""
    if isinstance(data, Mapping):
        return {k: redact_secrets(v, str(k)) for k, v in data.items()}
    if isinstance(data, list):
        return [redact_secrets(v, _key) for v in data]
    if isinstance(data, str):
        if data and _key and is_secret_key(_key):
            return REDACTED
        return redact_text(data)
    return data


def redact_text(text: str) -> str:
    """``text`` with URL credentials, ``secret=value`` pairs and secret values replaced."""
    text = _URL_USERINFO.sub(rf"\g<scheme>{REDACTED}@", text)
    text = _BEARER.sub(rf"\g<kind> {REDACTED}", text)
    text = _ASSIGNMENT.sub(_redact_assignment, text)
    for secret in secret_values():
        text = text.replace(secret, REDACTED)
    return text


def _redact_assignment(match: re.Match[str]) -> str:
    value = match.group("value")
    if value == REDACTED or _SHELL_REFERENCE.match(value) or \
            not is_secret_key(match.group("key").strip("\"'")):
        return match.group(0)
    if value.lower() in ("true", "false", "none", "null") or value.replace(".", "").isdigit():
        return match.group(0)
    return f"{match.group('key')}{match.group('sep')}{match.group('quote')}{REDACTED}"
