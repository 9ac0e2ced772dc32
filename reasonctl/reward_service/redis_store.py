"""The :class:`~reasonctl.reward_service.store.RequestStore` in Redis (redis-py), so several
service replicas share one queue and pending work outlives a replica.

Keys under ``<prefix>``: ``req:<id>`` (a hash: status, weights, sizes, each reward's scores
and duration), ``body:<id>`` (the request as received, until it is finished), ``pending``
(a sorted set of unfinished ids by deadline), ``q:<reward>`` (a list of ids waiting for
that reward) and ``claimed:<reward>`` (ids being scored, by lease expiry). Every change of
state is one Lua script, so replicas never see half a transition.

A replica renews the lease of the work it scores; work whose lease ran out (the replica
died or was restarted) goes back to the front of its queue at the next sweep of any
replica, so a restarted service finishes what was pending. A reward's scores are written
once (a second scoring of re-queued work is ignored), so nothing is counted twice.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from reasonctl.core.errors import require
from reasonctl.reward_service.store import Job, Result
from reasonctl.reward_service.wire import ScoreRequest, parse_request

_ADD = """
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[2])
redis.call('HSET', KEYS[2], 'status', 'pending', 'weights', ARGV[5], 'created', ARGV[4],
           'deadline', ARGV[3], 'size', ARGV[6], 'remaining', #KEYS - 3)
redis.call('SET', KEYS[3], ARGV[7])
for i = 4, #KEYS do redis.call('RPUSH', KEYS[i], ARGV[2]) end
return 1
"""

_CLAIM = """
local out = {}
local taken = 0
local room = tonumber(ARGV[1])
while true do
  local id = redis.call('LINDEX', KEYS[1], 0)
  if not id then break end
  local st = redis.call('HMGET', ARGV[3] .. ':req:' .. id, 'status', 'size')
  if st[1] ~= 'pending' then
    redis.call('LPOP', KEYS[1])
  else
    local size = tonumber(st[2])
    if #out > 0 and taken + size > room then break end
    redis.call('LPOP', KEYS[1])
    redis.call('ZADD', KEYS[2], ARGV[2], id)
    table.insert(out, id)
    table.insert(out, st[2])
    taken = taken + size
    if taken >= room then break end
  end
end
return out
"""

_FINISH = """
redis.call('ZREM', KEYS[2], ARGV[1])
if redis.call('HGET', KEYS[1], 'status') ~= 'pending' then return 0 end
if redis.call('HSETNX', KEYS[1], 'score:' .. ARGV[2], ARGV[3]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'dur:' .. ARGV[2], ARGV[4])
if redis.call('HINCRBY', KEYS[1], 'remaining', -1) > 0 then return 1 end
redis.call('HSET', KEYS[1], 'status', 'done', 'finished', ARGV[5])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('DEL', KEYS[4])
redis.call('EXPIRE', KEYS[1], ARGV[6])
return 2
"""

_FAIL = """
if redis.call('HGET', KEYS[1], 'status') ~= 'pending' then return 0 end
redis.call('HSET', KEYS[1], 'status', 'failed', 'error', ARGV[2], 'finished', ARGV[3])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('DEL', KEYS[3])
redis.call('EXPIRE', KEYS[1], ARGV[4])
return 1
"""

_REQUEUE = """
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
for _, id in ipairs(ids) do
  redis.call('ZREM', KEYS[1], id)
  local req = ARGV[2] .. ':req:' .. id
  if redis.call('HGET', req, 'status') == 'pending'
     and redis.call('HEXISTS', req, 'score:' .. ARGV[3]) == 0 then
    redis.call('LPUSH', KEYS[2], id)
  end
end
return #ids
"""

POLL_MIN_S = 0.002
POLL_MAX_S = 0.02


class RedisStore:
    """:class:`~reasonctl.reward_service.store.RequestStore` in Redis (see the module)."""

    def __init__(self, url: str, *, prefix: str, rewards: Sequence[str], max_pending: int,
                 result_ttl_s: float, lease_s: float) -> None:
        redis = require("redis", "serve", "the reward service's Redis queue")
        self.client: Any = redis.Redis.from_url(url, socket_timeout=10,
                                                socket_connect_timeout=5,
                                                health_check_interval=15)
        self.prefix = prefix
        self.rewards = list(rewards)
        self.max_pending = max_pending
        self.result_ttl_s = result_ttl_s
        self.lease_s = lease_s
        self._add = self.client.register_script(_ADD)
        self._claim = self.client.register_script(_CLAIM)
        self._finish = self.client.register_script(_FINISH)
        self._fail = self.client.register_script(_FAIL)
        self._requeue = self.client.register_script(_REQUEUE)

    def _key(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    def ping(self) -> None:
        """Raise when Redis cannot be reached (checked at start-up)."""
        self.client.ping()

    def add(self, request_id: str, body: bytes, request: ScoreRequest, deadline: float) -> bool:
        """See :meth:`RequestStore.add`."""
        keys = [self._key("pending"), self._key("req", request_id),
                self._key("body", request_id),
                *(self._key("q", reward) for reward in request.weights)]
        args = [self.max_pending, request_id, repr(deadline), repr(time.time()),
                json.dumps(request.weights), len(request), body]
        return bool(self._add(keys=keys, args=args))

    def claim(self, reward: str, max_items: int, wait_s: float, idle_s: float = 0.25
              ) -> list[Job]:
        """See :meth:`RequestStore.claim` (polls Redis with a short backoff while idle)."""
        jobs: list[Job] = []
        size = 0
        pause = POLL_MIN_S
        idle_end = time.monotonic() + idle_s
        batch_end: float | None = None
        while True:
            taken = self._claim_once(reward, max_items - size)
            jobs += taken
            size += sum(j.size for j in taken)
            now = time.monotonic()
            if jobs and batch_end is None:
                batch_end = now + wait_s
            if size >= max_items or (batch_end is not None and now >= batch_end):
                return jobs
            if batch_end is None and now >= idle_end:
                return []
            pause = POLL_MIN_S if taken else min(pause * 2, POLL_MAX_S)
            end = batch_end if batch_end is not None else idle_end
            time.sleep(max(0.0, min(pause, end - now)))

    def _claim_once(self, reward: str, room: int) -> list[Job]:
        if room <= 0:
            return []
        flat = self._claim(keys=[self._key("q", reward), self._key("claimed", reward)],
                           args=[room, repr(time.time() + self.lease_s), self.prefix])
        return [Job(flat[i].decode(), reward, int(flat[i + 1])) for i in range(0, len(flat), 2)]

    def request(self, request_id: str) -> ScoreRequest | None:
        """See :meth:`RequestStore.request` (parsed again from the stored body)."""
        body = self.client.get(self._key("body", request_id))
        return parse_request(body) if body is not None else None

    def renew(self, reward: str, request_ids: Sequence[str]) -> None:
        """Push the lease of ``request_ids`` forward (only those still claimed)."""
        if request_ids:
            until = time.time() + self.lease_s
            self.client.zadd(self._key("claimed", reward), dict.fromkeys(request_ids, until),
                             xx=True)

    def finish(self, request_id: str, reward: str, scores: list[float | None],
               duration: float) -> Result | None:
        """See :meth:`RequestStore.finish`."""
        keys = [self._key("req", request_id), self._key("claimed", reward),
                self._key("pending"), self._key("body", request_id)]
        args = [request_id, reward, json.dumps(scores), repr(duration), repr(time.time()),
                max(1, int(self.result_ttl_s))]
        if self._finish(keys=keys, args=args) != 2:
            return None
        return self.result(request_id)

    def fail(self, request_id: str, reason: str) -> bool:
        """See :meth:`RequestStore.fail`."""
        keys = [self._key("req", request_id), self._key("pending"),
                self._key("body", request_id)]
        args = [request_id, reason, repr(time.time()), max(1, int(self.result_ttl_s))]
        return bool(self._fail(keys=keys, args=args))

    def result(self, request_id: str) -> Result | None:
        """See :meth:`RequestStore.result`."""
        raw = self.client.hgetall(self._key("req", request_id))
        if not raw:
            return None
        fields = {k.decode(): v.decode() for k, v in raw.items()}
        weights = json.loads(fields.get("weights", "{}"))
        result = Result(fields.get("status", "pending"), weights,  # type: ignore[arg-type]
                        float(fields.get("created", 0)), error=fields.get("error"))
        if fields.get("finished"):
            result.finished = float(fields["finished"])
        if result.status == "done":
            for name in weights:
                result.scores[name] = json.loads(fields[f"score:{name}"])
                result.durations[name] = float(fields.get(f"dur:{name}", 0.0))
        return result

    def pending_count(self) -> int:
        """See :meth:`RequestStore.pending_count`."""
        return int(self.client.zcard(self._key("pending")))

    def sweep(self, now: float) -> list[str]:
        """See :meth:`RequestStore.sweep`: abandoned claims go back to their queue first."""
        for reward in self.rewards:
            self._requeue(keys=[self._key("claimed", reward), self._key("q", reward)],
                          args=[repr(now), self.prefix, reward])
        expired = []
        for raw in self.client.zrangebyscore(self._key("pending"), "-inf", repr(now)):
            request_id = raw.decode()
            result = self.result(request_id)
            waited = now - result.created if result is not None else 0.0
            if self.fail(request_id, f"deadline exceeded: not scored within {waited:.0f} s of "
                                     "arrival"):
                expired.append(request_id)
        return expired

    def close(self) -> None:
        """Close the connection pool."""
        self.client.close()


__all__ = ["RedisStore"]
