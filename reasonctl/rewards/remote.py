"""The ``remote`` reward: scores from a reward service (``reasonctl serve-rewards``).

```toml
[[rewards.components]]
name = "remote"
url = "https://rewards.example.org"     # the service (TLS terminated by a proxy in front)
token_env = "REASONCTL_REWARD_TOKEN"    # the variable holding the bearer token
rewards = { math = 1.0, format = 0.2 }  # rewards of the service, with weights
timeout = 600                           # seconds from submitting a batch to its scores
on_error = "raise"                      # or "zero" / "skip" when the service fails a batch
```

It is asynchronous (:class:`~reasonctl.SubmitsAsync`): :meth:`RemoteReward.submit` sends
the batch in background threads and returns at once, :meth:`RemoteReward.collect` waits for
the scores, so GRPO's log-prob passes run while the service scores. Its score per completion
is the weighted sum of the service's rewards (``None`` where all of them said ``None``); each
served reward is reported too (:class:`~reasonctl.core.reward_set.ScoresWithParts`), logged
as ``reward/remote/<name>/mean``.
With ``media_type`` image, video or latent it scores generated media
(:class:`~reasonctl.ScoresMedia`): completions are numpy arrays, sent as one ``.npy``
array per request.

Pre-flight (``reasonctl config validate`` and ``reasonctl run``, before a model loads) and
again when built, it checks that the token variable is set and that the service accepts
the token and serves the rewards for ``media_type`` (a mistake is exit 2 naming the fix; a
service not reachable yet is not). A request the service refuses later raises whatever
``on_error`` says.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator

from reasonctl.core.config.redaction import remember_secret_variables
from reasonctl.core.errors import RewardError, UsageError, did_you_mean
from reasonctl.core.reward_set import ScoresWithParts
from reasonctl.core.types import Sample
from reasonctl.rewards.base import RewardConfig

if TYPE_CHECKING:
    from reasonctl.core.config import RunConfig
    from reasonctl.reward_service.client import RewardServiceClient

logger = logging.getLogger(__name__)

NAME = "remote"


class RemoteConfig(RewardConfig):
    """Options of the ``remote`` reward."""

    url: str = Field(description="The reward service, http(s)://host[:port].")
    token_env: str = Field(default="REASONCTL_REWARD_TOKEN",
                           description="Environment variable holding the bearer token.")
    rewards: dict[str, float] = Field(
        min_length=1, description="Rewards of the service to score with, and their weights "
        "({name = weight}; a list of names weighs each 1).")
    timeout: float = Field(default=600.0, gt=0,
                           description="Seconds from submitting a batch to having its scores.")
    on_error: Literal["raise", "zero", "skip"] = Field(
        default="raise",
        description="When the service fails a batch or misses the deadline: raise (then "
        "rewards.on_error applies), score 0, or skip (None: the reward does not apply).",
    )
    media_type: Literal["text", "image", "video", "latent"] = "text"
    chunk_size: int = Field(default=256, gt=0,
                            description="Completions per request (a batch is split).")

    @field_validator("rewards", mode="before")
    @classmethod
    def _names_weigh_one(cls, value: Any) -> Any:
        """A list of names (as the wire format takes them) weighs each 1."""
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return dict.fromkeys(value, 1.0)
        return value

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("use an http:// or https:// URL with a host, e.g. "
                             "https://rewards.example.org")
        return value.rstrip("/")

    def config_problems(self, config: RunConfig, *, world_size: int) -> list[str]:
        """Pre-flight: the token variable is set, and a reachable service accepts the token
        and serves the rewards for ``media_type`` (``key: message`` lines under this
        reward's entry)."""
        from reasonctl.reward_service.client import RewardServiceClient

        token = _token(self)
        if not token:
            return [f"token_env: {_missing_token(self)}"]
        client = RewardServiceClient(self.url, token)
        try:
            return [f"{key}: {message}" for key, message in service_problems(self, client)[0]]
        finally:
            client.close()


@dataclass
class _Submitted:
    """A submitted batch: one future per request, and the size of each."""

    futures: list[Future[dict[str, Any]] | BaseException]
    sizes: list[int]


class RemoteReward:
    """Scores completions with a reward service (see the module docstring)."""

    def __init__(self, config: RemoteConfig) -> None:
        from reasonctl.reward_service.client import RewardServiceClient

        self.config = config
        token = _token(config)
        if not token:
            raise UsageError(f"reward 'remote': {_missing_token(config)}")
        if urlsplit(config.url).scheme == "http" and not _is_local(config.url):
            logger.warning("reward 'remote' sends its token to %s without TLS; put the "
                           "service behind an https proxy", config.url)
        self.client = RewardServiceClient(config.url, token)
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="remote-reward")
        self._preflight()

    def _preflight(self) -> None:
        """Check the token, the reward names and their media with the service now, before
        a run spends a rollout on a request it would refuse; a service not reachable yet
        is only a warning (each batch is retried until ``timeout``)."""
        cfg = self.config
        problems, reachable = service_problems(cfg, self.client)
        if not reachable:
            logger.warning("reward 'remote': the reward service at %s is not reachable now; "
                           "each batch is retried until the remote reward's timeout (%gs)",
                           cfg.url, cfg.timeout)
            return
        refused = [message for key, message in problems if key == "token_env"]
        if refused:
            raise UsageError(refused[0])
        if problems:
            raise UsageError(f"reward 'remote' ({cfg.url}): "
                             + "; ".join(message for _, message in problems))

    def __repr__(self) -> str:
        return f"RemoteReward(url={self.config.url!r}, rewards={self.config.rewards!r})"

    def __call__(self, completions: Sequence[Any], samples: Sequence[Sample]
                 ) -> list[float | None]:
        """Submit and wait."""
        return self.collect(self.submit(completions, samples))

    def submit(self, completions: Sequence[Any], samples: Sequence[Sample]) -> _Submitted:
        """Send the batch (in requests of ``chunk_size``) in the background."""
        from reasonctl.reward_service.wire import encode_request

        cfg = self.config
        deadline = time.monotonic() + cfg.timeout
        size = cfg.chunk_size
        futures: list[Future[dict[str, Any]] | BaseException] = []
        sizes = []
        for start in range(0, len(completions), size):
            chunk = list(completions[start:start + size])
            sizes.append(len(chunk))
            try:
                body = encode_request(cfg.rewards, chunk, samples[start:start + size],
                                      media_type=cfg.media_type, deadline_s=cfg.timeout)
            except Exception as exc:  # a completion the wire cannot carry: the batch fails
                futures.append(exc)
                continue
            futures.append(self._pool.submit(self._score, body, deadline))
        return _Submitted(futures, sizes)

    def _score(self, body: bytes, deadline: float) -> dict[str, Any]:
        request_id = self.client.enqueue(body, deadline=deadline)
        return self.client.wait(request_id, deadline=deadline)

    def collect(self, handle: _Submitted) -> list[float | None]:
        """Wait for every request of ``handle``; apply ``on_error`` to failed ones."""
        from reasonctl.reward_service.client import ServiceRefused

        out: list[float | None] = []
        parts: dict[str, list[float | None]] = {name: [] for name in self.config.rewards}
        for future, size in zip(handle.futures, handle.sizes, strict=True):
            try:
                if isinstance(future, BaseException):
                    raise future
                answer = future.result()
            except ServiceRefused as exc:  # the request is wrong: on_error would hide it
                advice = _token_advice(self.config, exc.status) if exc.status in (401, 403) \
                    else str(exc)
                raise RewardError(advice, reward=NAME) from None
            except Exception as exc:
                out += self._failed(f"{type(exc).__name__}: {exc}", size)
                for values in parts.values():
                    values += [None] * size
                continue
            if answer.get("status") != "done":
                out += self._failed(str(answer.get("error") or answer), size)
                for values in parts.values():
                    values += [None] * size
                continue
            out += self._weighted(answer["scores"], size)
            for name, values in parts.items():
                values += [_score(v) for v in answer["scores"][name][:size]]
        return ScoresWithParts(out, parts)

    def _weighted(self, scores: dict[str, list[float | None]], size: int) -> list[float | None]:
        out: list[float | None] = []
        for i in range(size):
            present = [(weight, scores[name][i]) for name, weight in self.config.rewards.items()
                       if scores[name][i] is not None]
            out.append(sum(w * float(v) for w, v in present) if present else None)  # type: ignore[arg-type]
        return out

    def _failed(self, reason: str, size: int) -> list[float | None]:
        on_error = self.config.on_error
        message = f"the reward service at {self.config.url} failed a request: {reason}"
        if on_error == "raise":
            raise RewardError(message + " (set on_error = \"zero\" or \"skip\" in the remote "
                              "reward's options to go on without these scores)", reward=NAME)
        logger.warning("%s; scored %s (on_error = %r)", message,
                       "0" if on_error == "zero" else "None", on_error)
        return [0.0 if on_error == "zero" else None] * size


class RemoteMediaReward(RemoteReward):
    """:class:`RemoteReward` for generated media (:class:`~reasonctl.ScoresMedia`)."""

    def __init__(self, config: RemoteConfig) -> None:
        super().__init__(config)
        self.media_type = config.media_type


def remote_reward(config: RemoteConfig) -> RemoteReward:
    """The factory of ``remote``: a media reward when ``media_type`` is not text."""
    return RemoteReward(config) if config.media_type == "text" else RemoteMediaReward(config)


def service_problems(config: RemoteConfig, client: RewardServiceClient
                     ) -> tuple[list[tuple[str, str]], bool]:
    """What the service at ``config.url`` says about ``config``: ``(key, message)``
    problems (``token_env`` for a refused token, ``rewards`` for a reward it does not serve
    or serves for other media) and whether it answered at all (an unreachable service has
    no problems yet: each batch is retried until ``timeout``)."""
    health, status = client.probe()
    if health is None and status is None:
        return [], False
    if status in (401, 403):
        return [("token_env", _token_advice(config, status))], True
    served = (health or {}).get("rewards")
    if not isinstance(served, dict):
        return [], True  # not a reasonctl service (or an older one): nothing more to check
    problems = []
    for name in config.rewards:
        if name not in served:
            close = did_you_mean(name, served)
            problems.append(("rewards", f"{name!r} is not served there"
                             + (f" (did you mean {close!r}?)" if close else "")
                             + f"; served: {', '.join(sorted(served)) or 'none'}"))
        elif served[name] != config.media_type:
            problems.append(("rewards", _media_advice(name, str(served[name]),
                                                      config.media_type)))
    return problems, True


def _token(config: RemoteConfig) -> str:
    remember_secret_variables([config.token_env])
    return os.environ.get(config.token_env, "").strip()


def _missing_token(config: RemoteConfig) -> str:
    return (f"environment variable {config.token_env} is not set; export the reward "
            f"service's token there (the value its [auth] token_env or token_file holds), "
            "or name another variable with token_env")


def _score(value: Any) -> float | None:
    return None if value is None else float(value)


def _token_advice(config: RemoteConfig, status: int) -> str:
    return (f"reward 'remote': the reward service at {config.url} refused the token in "
            f"{config.token_env} (HTTP {status}); export there a token the service accepts "
            "(its [auth] token_env or token_file)")


def _media_advice(name: str, served: str, sent: str) -> str:
    advice = f"{name!r} scores {served} there, and this reward sends {sent}"
    if served == "video" and sent == "image":
        return advice + ("; set media_type = \"video\" in the remote reward (an image "
                         "model's samples are sent as one-frame videos)")
    return advice + f"; set media_type = {served!r} in the remote reward, or serve a " \
        f"reward of {sent}"


def _is_local(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


__all__ = ["RemoteConfig", "RemoteMediaReward", "RemoteReward", "remote_reward",
           "service_problems"]
