"""Structured logs: one JSON object per line on stderr (or plain text), secrets redacted.

Events carry their fields as ``extra``: ``logger.info("request done", extra={"event":
"done", "request_id": ..., "latency_s": ...})`` becomes ``{"ts": ..., "level": "info",
"event": "done", "message": "request done", "request_id": ..., "latency_s": ...}``.
Request bodies and headers are never logged; every line passes through the same redaction
as run configs (bearer tokens, credential variables, URL passwords).
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

from reasonctl.core.config.redaction import redact_text

_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message", "asctime", "color_message"}


class JsonFormatter(logging.Formatter):
    """A log record as one JSON line with its ``extra`` fields."""

    def format(self, record: logging.LogRecord) -> str:
        """The JSON line."""
        line: dict[str, Any] = {
            "ts": round(record.created, 6), "level": record.levelname.lower(),
            "logger": record.name, "message": record.getMessage(),
        }
        line.update((k, v) for k, v in vars(record).items() if k not in _STANDARD)
        if record.exc_info:
            line["error"] = self.formatException(record.exc_info)
        return redact_text(json.dumps(line, default=str))


class TextFormatter(logging.Formatter):
    """``time level message key=value ...``, redacted."""

    def format(self, record: logging.LogRecord) -> str:
        """The text line."""
        extra = " ".join(f"{k}={v}" for k, v in vars(record).items() if k not in _STANDARD)
        text = f"{self.formatTime(record)} {record.levelname.lower()} {record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return redact_text(f"{text} {extra}".rstrip())


def configure_logging(log_format: str, level: int = logging.INFO) -> None:
    """Send the service's and uvicorn's logs to stderr in ``log_format`` (json or text)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    for name in ("reasonctl.reward_service", "uvicorn", "uvicorn.error"):
        log = logging.getLogger(name)
        log.handlers[:] = [handler]
        log.setLevel(level)
        log.propagate = False


__all__ = ["JsonFormatter", "TextFormatter", "configure_logging"]
