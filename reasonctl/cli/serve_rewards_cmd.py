"""``reasonctl serve-rewards``: run the reward service (:mod:`reasonctl.reward_service`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from reasonctl.cli import common
from reasonctl.cli.common import handle_errors


@handle_errors
def serve_rewards_command(
    config: Annotated[Path, typer.Option("--config", "-c",
                                         help="The service's TOML config file.")],
    host: Annotated[str | None, typer.Option("--host", help="server.host")] = None,
    port: Annotated[int | None, typer.Option("--port", min=0, max=65535,
                                             help="server.port")] = None,
    redis: Annotated[str | None, typer.Option(
        "--redis", help="Share the queue through Redis at this URL (queue.backend = redis)."
    )] = None,
    check: Annotated[bool, typer.Option(
        "--check", help="Validate the config and the token source, then exit.")] = False,
) -> None:
    """Serve rewards over HTTP to trainers using the `remote` reward (token required)."""
    from reasonctl.core.errors import require
    from reasonctl.reward_service.auth import load_tokens
    from reasonctl.reward_service.config import load_service_config

    overrides: dict[str, dict[str, Any]] = {}
    if host is not None:
        overrides["server"] = {"host": host}
    if port is not None:
        overrides.setdefault("server", {})["port"] = port
    if redis is not None:
        overrides["queue"] = {"backend": "redis", "redis_url": redis}
    cfg = load_service_config(config, common.host().registry, overrides)
    tokens = load_tokens(cfg.auth)
    if check:
        names = ", ".join(r.name for r in cfg.rewards.components)
        typer.echo(f"{config}: valid; serves {names} on {cfg.server.host}:{cfg.server.port}")
        return
    require("starlette", "serve", "reasonctl serve-rewards")
    require("uvicorn", "serve", "reasonctl serve-rewards")
    from reasonctl.reward_service.logs import configure_logging
    from reasonctl.reward_service.server import RewardService

    configure_logging(cfg.server.log_format)
    RewardService(cfg, common.host().registry, tokens=tokens).run()
