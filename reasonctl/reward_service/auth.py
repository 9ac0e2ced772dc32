"""Bearer-token authentication: tokens from the environment or a file, compared in constant
time, never logged; every route but ``/health`` needs one.

:class:`BearerAuth` is plain ASGI middleware, so a request without a valid token is
answered 401 (with ``WWW-Authenticate: Bearer``) before its body is read, and logged as a
``rejected`` event with its method, path, client address and reason (never the token or
any header).
"""

from __future__ import annotations

import hmac
import json
import logging
import os
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

from reasonctl.core.config.redaction import remember_secret_variables
from reasonctl.core.errors import ConfigError
from reasonctl.reward_service.config import AuthSection

OPEN_PATHS = frozenset({"/health"})
logger = logging.getLogger("reasonctl.reward_service")

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class Tokens:
    """The accepted tokens (several allow rotation); their values never appear in ``repr``."""

    def __init__(self, values: list[str]) -> None:
        if not values:
            raise ValueError("at least one token is needed")
        self._values = [v.encode() for v in values]

    def __repr__(self) -> str:
        return f"Tokens(<{len(self._values)} hidden>)"

    def accepts(self, presented: str) -> bool:
        """Whether ``presented`` is one of the tokens, compared in constant time against
        every token (no early exit that would tell which one came close)."""
        candidate = presented.encode()
        matched = False
        for value in self._values:
            matched |= hmac.compare_digest(candidate, value)
        return matched


def load_tokens(auth: AuthSection, environ: dict[str, str] | None = None) -> Tokens:
    """The tokens named by ``[auth]``; a missing variable or unreadable file is a
    :class:`ConfigError` naming the key (the token itself is never shown)."""
    environ = dict(os.environ) if environ is None else environ
    values: list[str] = []
    problems: list[str] = []
    if auth.token_env is not None:
        remember_secret_variables([auth.token_env])
        value = environ.get(auth.token_env, "").strip()
        if value:
            values.append(value)
        elif auth.token_file is None:
            problems.append(f"auth.token_env: environment variable {auth.token_env} is not set "
                            "or empty; export a token there (e.g. `export "
                            f"{auth.token_env}=$(openssl rand -hex 32)`) or set auth.token_file")
    if auth.token_file is not None:
        path = Path(auth.token_file).expanduser()
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            problems.append(f"auth.token_file: cannot read {path}: {exc.strerror or exc}")
            lines = []
        tokens = [line.strip() for line in lines
                  if line.strip() and not line.strip().startswith("#")]
        if not tokens and not problems:
            problems.append(f"auth.token_file: {path} holds no token (one per line)")
        values += tokens
    short = [v for v in values if len(v) < 16]
    if short:
        problems.append(f"auth: {len(short)} token(s) shorter than 16 characters; use long "
                        "random tokens (e.g. `openssl rand -hex 32`)")
    if problems:
        raise ConfigError(problems)
    return Tokens(values)


class BearerAuth:
    """ASGI middleware: 401 unless ``Authorization: Bearer <token>`` holds a valid token."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]],
                 tokens: Tokens) -> None:
        self.app = app
        self.tokens = tokens

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Check the token of HTTP requests, then hand them on."""
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        header = ""
        for key, value in scope.get("headers", []):
            if key == b"authorization":
                header = value.decode("latin-1")
                break
        scheme, _, presented = header.partition(" ")
        if scheme.lower() == "bearer" and presented.strip() and \
                self.tokens.accepts(presented.strip()):
            await self.app(scope, receive, send)
            return
        reason = "missing bearer token" if not header else "invalid bearer token"
        client = scope.get("client") or ("?", 0)
        logger.warning("request rejected: %s", reason, extra={
            "event": "rejected", "status": 401, "reason": reason, "method": scope.get("method"),
            "path": scope["path"], "client": str(client[0])})
        body = json.dumps({"error": f"{reason}: send 'Authorization: Bearer <token>'"}).encode()
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b'Bearer realm="reasonctl-rewards"'),
        ]})
        await send({"type": "http.response.body", "body": body})


__all__ = ["BearerAuth", "Tokens", "load_tokens"]
