"""The Redis side of separate rollout workers: keys, streams, consumer groups, heartbeats.

Everything a run shares lives under ``reasonctl:<run id>:`` in one Redis database, so a
restarted trainer or a worker joining from another node finds the whole state there:

- ``prompts``: a stream of prompt batches; the consumer group ``workers`` hands each entry
  to one worker (``XREADGROUP ... BLOCK``). A worker acknowledges an entry (``XACK``) in
  the same transaction that appends its rollouts, so an entry is either pending or done.
- ``rollouts:<rank>``: a stream per trainer data-parallel rank; the consumer group
  ``trainer`` keeps what a trainer read but has not finished with (its pending list), which
  a restarted trainer reads again first.
- the janitor (:meth:`Transport.reclaim_prompt`): an idle worker takes over
  (``XAUTOCLAIM``) an entry whose owner stopped refreshing it for ``heartbeat_ttl_s``; live
  workers refresh their entry (``XCLAIM ... JUSTID``, which leaves the delivery count
  alone). An entry delivered ``max_deliveries`` times goes to the ``dead`` stream.
- heartbeats: ``hb:worker:<name>`` and ``hb:trainer`` keys with a TTL.
- ``meta`` (run id, incarnation, state), ``config`` (the run's config, secrets redacted),
  ``weights`` (the newest staged weight version and how to fetch it), ``ledger`` (what each
  trained step trained on), ``errors`` (the last error per prompt batch).

Every call that reaches Redis turns a lost connection into a :class:`ReasonctlError`
naming the server, after redis-py's bounded retries, so nothing hangs on a dead Redis.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from reasonctl.core.config import redact_text
from reasonctl.core.config.placement import redis_url_problem
from reasonctl.core.errors import ReasonctlError, UsageError, require

PROMPTS_GROUP = "workers"
RESULTS_GROUP = "trainer"
KEY_PREFIX = "reasonctl"
F = TypeVar("F", bound=Callable[..., Any])

Fields = dict[str, bytes]


@dataclass(frozen=True)
class Entry:
    """One stream entry: its id, its fields and how often it was delivered."""

    id: str
    fields: Fields
    deliveries: int = 1


def connect(url: str, *, timeout_s: float, block_s: float = 1.0) -> Any:
    """A redis-py client for ``url`` that answered a PING within ``timeout_s`` seconds.

    Raises :class:`~reasonctl.core.errors.UsageError` for a URL that is not a Redis URL or
    a server that rejects our credentials, :class:`ReasonctlError` naming the server when it
    does not answer in time (each probe is bounded by the time left, so the wait ends
    within ``timeout_s`` plus a fraction of a second), and
    :class:`~reasonctl.core.errors.MissingDependencyError` without redis-py.
    """
    redis = require("redis", "async", "separate rollout workers")
    from redis.backoff import ExponentialBackoff, NoBackoff
    from redis.retry import Retry

    problem = redis_url_problem(url)
    if problem:
        raise UsageError(f"{redact_text(url)} is not a Redis URL: {problem} "
                         "(rollout.workers.redis_url / --redis)")
    attempts = max(1, int(timeout_s))
    client = redis.Redis.from_url(
        url,
        socket_connect_timeout=min(timeout_s, 5.0),
        socket_timeout=timeout_s + block_s,
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.1), attempts),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
    )
    deadline = time.monotonic() + timeout_s
    while True:
        left = max(0.05, min(deadline - time.monotonic(), 5.0))
        probe = redis.Redis.from_url(url, socket_connect_timeout=left, socket_timeout=left,
                                     retry=Retry(NoBackoff(), 0))
        try:
            probe.ping()
            return client
        except redis.AuthenticationError as exc:
            raise UsageError(f"Redis at {redact_text(url)} refused our credentials ({exc}); "
                             "give its password in the URL, after a colon before the host "
                             "and @ (see the URL form in docs/rollout-workers.md)") from exc
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            if time.monotonic() + 0.2 >= deadline:
                raise ReasonctlError(
                    f"cannot reach Redis at {redact_text(url)} within {timeout_s:g}s ({exc}); "
                    "start redis-server there or fix rollout.workers.redis_url / --redis"
                ) from exc
            time.sleep(0.2)
        except redis.ResponseError as exc:  # e.g. a password is needed
            raise ReasonctlError(f"Redis at {redact_text(url)} refused us: {exc}") from exc
        finally:
            probe.close()


def _redis_errors(method: F) -> F:
    """Turn redis-py's connection errors into a :class:`ReasonctlError` naming the server."""

    @functools.wraps(method)
    def wrapper(self: Transport, *args: Any, **kwargs: Any) -> Any:
        import redis

        try:
            return method(self, *args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise ReasonctlError(
                f"lost the connection to Redis at {redact_text(self.url)} ({exc}); once it "
                "answers again, `reasonctl run ... --resume` continues the trainer from its "
                "last checkpoint (a Redis the run started itself is started again) and "
                "workers rejoin with `reasonctl worker rollout`"
            ) from exc

    return wrapper  # type: ignore[return-value]


class Transport:
    """One run's streams and keys in Redis (thread-safe: redis-py pools connections)."""

    def __init__(self, client: Any, url: str, run_id: str) -> None:
        self.client = client
        self.url = url
        self.run_id = run_id
        self.prefix = f"{KEY_PREFIX}:{run_id}"

    @classmethod
    def open(cls, url: str, run_id: str, *, timeout_s: float) -> Transport:
        """Connect to ``url`` (bounded by ``timeout_s``) for run ``run_id``."""
        return cls(connect(url, timeout_s=timeout_s), url, run_id)

    def key(self, *parts: object) -> str:
        """The Redis key ``reasonctl:<run id>:<parts...>``."""
        return ":".join([self.prefix, *map(str, parts)])

    def results_key(self, rank: int) -> str:
        """The rollouts stream of trainer rank ``rank``."""
        return self.key("rollouts", rank)

    # --- the run ---------------------------------------------------------------------------

    @_redis_errors
    def create_run(self, config_toml: str, world_size: int) -> None:
        """Record the run (idempotent: a resumed run keeps its streams) and its groups."""
        import redis

        pipe = self.client.pipeline()
        pipe.hsetnx(self.key("meta"), "created", str(time.time()))
        pipe.hset(self.key("meta"), mapping={"world_size": world_size, "state": "running"})
        pipe.set(self.key("config"), config_toml)
        pipe.execute()
        streams = [(self.key("prompts"), PROMPTS_GROUP)]
        streams += [(self.results_key(r), RESULTS_GROUP) for r in range(world_size)]
        for stream, group in streams:
            try:
                self.client.xgroup_create(stream, group, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    @_redis_errors
    def exists(self) -> bool:
        """Whether a trainer registered this run."""
        return bool(self.client.exists(self.key("meta")))

    @_redis_errors
    def known_runs(self, limit: int = 20) -> dict[str, str]:
        """Up to ``limit`` runs registered in this Redis database: run id -> state."""
        runs: dict[str, str] = {}
        for key in self.client.scan_iter(match=f"{KEY_PREFIX}:*:meta", count=200):
            run_id = _text(key)[len(KEY_PREFIX) + 1 : -len(":meta")]
            state = self.client.hget(key, "state")
            runs[run_id] = _text(state) if state is not None else "?"
            if len(runs) >= limit:
                break
        return dict(sorted(runs.items()))

    @_redis_errors
    def meta(self) -> dict[str, str]:
        """The run's ``meta`` hash (``world_size``, ``state``, ``incarnation`` ...)."""
        return {k.decode(): v.decode() for k, v in self.client.hgetall(self.key("meta")).items()}

    @_redis_errors
    def config_text(self) -> str:
        """The run's config as TOML (secrets redacted)."""
        value = self.client.get(self.key("config"))
        return value.decode() if value is not None else ""

    @_redis_errors
    def set_state(self, state: str) -> None:
        """``running``, ``done`` or ``failed``: workers stop once it is not ``running``."""
        self.client.hset(self.key("meta"), "state", state)

    @_redis_errors
    def state(self) -> str:
        """The run's state (``missing`` when no trainer registered it)."""
        value = self.client.hget(self.key("meta"), "state")
        return value.decode() if value is not None else "missing"

    @_redis_errors
    def next_incarnation(self) -> int:
        """Count one more trainer start; weights are stamped with it."""
        return int(self.client.hincrby(self.key("meta"), "incarnation", 1))

    # --- prompts (workers consume) ----------------------------------------------------------

    @_redis_errors
    def publish_prompts(self, fields: Fields) -> str:
        """Append a prompt batch; return its entry id."""
        return _text(self.client.xadd(self.key("prompts"), fields))

    @_redis_errors
    def read_prompt(self, consumer: str, *, block_ms: int) -> Entry | None:
        """The next undelivered prompt batch for ``consumer``, waiting up to ``block_ms``."""
        reply = self.client.xreadgroup(PROMPTS_GROUP, consumer, {self.key("prompts"): ">"},
                                       count=1, block=block_ms)
        entries = list(_entries(reply))
        return entries[0] if entries else None

    @_redis_errors
    def reclaim_prompt(self, consumer: str, *, min_idle_ms: int) -> Entry | None:
        """The janitor: take over one prompt batch nobody refreshed for ``min_idle_ms``
        (its worker died), with its delivery count (this delivery included)."""
        stream = self.key("prompts")
        _next, claimed, *_deleted = self.client.xautoclaim(
            stream, PROMPTS_GROUP, consumer, min_idle_ms, start_id="0-0", count=1)
        if not claimed:
            return None
        entry_id, fields = claimed[0]
        if fields is None:  # trimmed meanwhile
            return None
        info = self.client.xpending_range(stream, PROMPTS_GROUP, min=entry_id, max=entry_id,
                                          count=1)
        deliveries = int(info[0]["times_delivered"]) if info else 1
        return Entry(_text(entry_id), _decode_fields(fields), deliveries)

    @_redis_errors
    def keep_alive(self, consumer: str, entry_id: str) -> None:
        """Reset the idle time of an entry ``consumer`` is working on (no new delivery)."""
        self.client.xclaim(self.key("prompts"), PROMPTS_GROUP, consumer, 0, [entry_id],
                           justid=True)

    @_redis_errors
    def complete_prompt(self, entry_id: str, rank: int, result: Fields) -> None:
        """Append rollouts to rank ``rank``'s stream and finish the prompt batch, atomically."""
        pipe = self.client.pipeline(transaction=True)
        pipe.xadd(self.results_key(rank), result)
        pipe.xack(self.key("prompts"), PROMPTS_GROUP, entry_id)
        pipe.xdel(self.key("prompts"), entry_id)
        pipe.hdel(self.key("errors"), entry_id)
        pipe.execute()

    @_redis_errors
    def record_error(self, entry_id: str, message: str) -> None:
        """Keep the last error of a prompt batch (shown if it ends in the dead letters)."""
        self.client.hset(self.key("errors"), entry_id, message[-4000:])

    @_redis_errors
    def dead_letter(self, entry: Entry, reason: str) -> None:
        """Move a prompt batch to the ``dead`` stream with ``reason`` and its last error."""
        last = self.client.hget(self.key("errors"), entry.id)
        fields = {"meta": entry.fields.get("meta", b"{}"), "entry": entry.id.encode(),
                  "reason": reason.encode(), "deliveries": str(entry.deliveries).encode(),
                  "error": last or b""}
        pipe = self.client.pipeline(transaction=True)
        pipe.xadd(self.key("dead"), fields)
        pipe.xack(self.key("prompts"), PROMPTS_GROUP, entry.id)
        pipe.xdel(self.key("prompts"), entry.id)
        pipe.execute()

    @_redis_errors
    def dead_letters(self, after: str = "0-0") -> list[Entry]:
        """Dead-letter entries after id ``after``."""
        reply = self.client.xrange(self.key("dead"), min=f"({after}" if after != "0-0" else "-")
        return [Entry(_text(i), _decode_fields(f)) for i, f in reply]

    @_redis_errors
    def forget_consumer(self, name: str) -> None:
        """Remove a dead worker from the prompts group once it holds nothing."""
        self.client.xgroup_delconsumer(self.key("prompts"), PROMPTS_GROUP, name)

    @_redis_errors
    def pending_by_consumer(self) -> dict[str, int]:
        """Prompt batches held per worker (delivered, not finished)."""
        info = self.client.xinfo_consumers(self.key("prompts"), PROMPTS_GROUP)
        return {_text(c["name"]): int(c["pending"]) for c in info}

    # --- rollouts (the trainer consumes) ----------------------------------------------------

    @_redis_errors
    def read_results(self, rank: int, *, block_ms: int, pending: bool = False) -> list[Entry]:
        """Rollouts for ``rank``: those read before but not dropped (``pending``), else new
        ones, waiting up to ``block_ms`` for them."""
        position = "0" if pending else ">"
        reply = self.client.xreadgroup(RESULTS_GROUP, f"rank{rank}",
                                       {self.results_key(rank): position}, count=64,
                                       block=None if pending else block_ms)
        return list(_entries(reply))

    @_redis_errors
    def drop_results(self, rank: int, entry_ids: list[str]) -> None:
        """Finish with rollouts (acknowledge and delete them)."""
        if not entry_ids:
            return
        pipe = self.client.pipeline(transaction=True)
        pipe.xack(self.results_key(rank), RESULTS_GROUP, *entry_ids)
        pipe.xdel(self.results_key(rank), *entry_ids)
        pipe.execute()

    @_redis_errors
    def record_trained(self, fields: dict[str, str]) -> None:
        """Append what a trained step trained on to the ``ledger`` stream."""
        self.client.xadd(self.key("ledger"), fields)

    @_redis_errors
    def ledger(self) -> list[dict[str, str]]:
        """Every ledger row, oldest first."""
        return [{k.decode(): v.decode() for k, v in fields.items()}
                for _id, fields in self.client.xrange(self.key("ledger"))]

    # --- heartbeats -------------------------------------------------------------------------

    @_redis_errors
    def beat(self, role: str, name: str, ttl_s: float) -> None:
        """Say ``name`` (a ``worker`` or the ``trainer``) is alive for ``ttl_s`` seconds."""
        pipe = self.client.pipeline()
        pipe.set(self.key("hb", role, name), str(time.time()), px=max(1, int(ttl_s * 1000)))
        if role == "worker":
            pipe.sadd(self.key("workers"), name)
        pipe.execute()

    @_redis_errors
    def leave(self, name: str) -> None:
        """Worker ``name`` is done: it no longer counts as alive."""
        pipe = self.client.pipeline()
        pipe.delete(self.key("hb", "worker", name))
        pipe.srem(self.key("workers"), name)
        pipe.execute()

    @_redis_errors
    def live_workers(self) -> list[str]:
        """Names of workers whose heartbeat has not expired."""
        names = sorted(_text(n) for n in self.client.smembers(self.key("workers")))
        if not names:
            return []
        alive = self.client.exists(*[self.key("hb", "worker", n) for n in names])
        if alive == len(names):
            return names
        return [n for n in names if self.client.exists(self.key("hb", "worker", n))]

    @_redis_errors
    def trainer_alive(self) -> bool:
        """Whether the trainer's heartbeat has not expired."""
        return bool(self.client.exists(self.key("hb", "trainer", "0")))

    # --- weights ----------------------------------------------------------------------------

    @_redis_errors
    def set_weights(self, info: dict[str, str]) -> None:
        """Publish the newest staged weights (version, mechanism, manifest ...)."""
        self.client.hset(self.key("weights"), mapping=info)

    @_redis_errors
    def weights(self) -> dict[str, str]:
        """The newest staged weights' description (empty before the first)."""
        return {k.decode(): v.decode() for k, v in self.client.hgetall(self.key("weights")).items()}

    @_redis_errors
    def push_sync_request(self, request: str) -> None:
        """Ask the trainer to send the staged weights (broadcast mechanism)."""
        self.client.rpush(self.key("sync", "requests"), request)

    @_redis_errors
    def pop_sync_request(self, timeout_s: float) -> str | None:
        """The next weight request, waiting up to ``timeout_s``."""
        reply = self.client.blpop([self.key("sync", "requests")], timeout=timeout_s)
        return reply[1].decode() if reply else None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _decode_fields(fields: dict[Any, Any]) -> Fields:
    return {_text(k): v for k, v in fields.items()}


def _entries(reply: Any) -> Iterator[Entry]:
    for _stream, items in reply or []:
        for entry_id, fields in items:
            if fields:  # an entry deleted while pending comes back empty
                yield Entry(_text(entry_id), _decode_fields(fields))
