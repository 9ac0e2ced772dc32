"""The trainer's side of a GRPO step with separate rollout workers.

Each trainer rank, at the start of step ``s`` (its weights are version ``s``: ``s`` updates
done):

1. **stages** weight version ``(incarnation, s)`` for the workers (every rank iterates
   ``backend.full_state_dict()``; the main process keeps it, see
   :mod:`~reasonctl.async_rl.weight_sync`);
2. **publishes** its prompt batches up to step ``s + max_staleness``: the prompts drawn from
   the same seeded order as a colocated run (so ``max_staleness = 0`` reproduces it), with
   the colocated run's sampling seed for that step and rank;
3. **waits** for the rollouts of step ``s`` on its stream, keeping early ones for their
   steps. A rollout is trained on only if its weights are at most ``max_staleness`` versions
   old and belong to this trainer's lineage (its incarnation, or at most the step it resumed
   from); otherwise it is dropped and the batch published again. A batch already trained,
   or answered twice, is dropped as a duplicate: a prompt group is never trained twice.
4. **scores** the completions with the run's reward set and hands the groups to GRPO.

Rollouts a trained step used stay pending in Redis until a checkpoint covers that step
when a restarted trainer could still use them (weights no newer than the last checkpoint),
and are deleted otherwise. The prompt batches published but not yet trained are part of
the algorithm's checkpoint state, so a resumed trainer publishes exactly what the
interrupted one would have. Each trained step appends a row to the run's ``ledger``.

While a rank waits, workers that join or stop heartbeating are named (within the
heartbeat TTL). When no worker has been alive for ``wait_timeout_s`` on any rank, every rank
stops the step before it starts (:class:`~reasonctl.core.errors.StopWithCheckpoint`): the
runner checkpoints the steps done and the run ends saying how to start a worker and resume.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from reasonctl.algorithms.rollouts import mix_seed, score_groups
from reasonctl.async_rl.messages import PromptBatch, RolloutBatch, WeightVersion, group_ids
from reasonctl.async_rl.weight_sync import wire_nbytes
from reasonctl.backends.distributed import mean_over_processes
from reasonctl.core.errors import ReasonctlError, StopWithCheckpoint
from reasonctl.core.protocols import environment_tools
from reasonctl.data.datasets import shard
from reasonctl.models.loading import compute_dtype

if TYPE_CHECKING:
    from reasonctl.algorithms.sampling import EpochSampler
    from reasonctl.async_rl.pool import RolloutWorkers
    from reasonctl.core.protocols import RunContext
    from reasonctl.core.types import Metrics, RolloutGroup

BLOCK_MS = 1000
NOTICE_AFTER_S = 30.0


@dataclass
class FeedRollout:
    """The groups of one step and what producing them cost."""

    groups: list[RolloutGroup]
    generated_tokens: int
    generate_seconds: float
    reward_seconds: float
    metrics: Metrics = field(default_factory=dict)


@dataclass
class _Counters:
    duplicates: int = 0
    stale: int = 0


class RolloutFeed:
    """Publishes prompt batches and collects rollouts for GRPO (one per trainer rank)."""

    def __init__(self, ctx: RunContext, sampler: EpochSampler, *, prompts_per_step: int,
                 mcq_layout: bool) -> None:
        if ctx.rollout_workers is None or ctx.backend is None:
            raise RuntimeError("separate rollout workers are built by the runner")
        self.pool: RolloutWorkers = ctx.rollout_workers
        self.transport = self.pool.transport
        self.settings = ctx.config.rollout.workers
        self.staleness = self.settings.max_staleness
        self.sampler = sampler
        self.rank = ctx.backend.rank
        self.world = ctx.backend.world_size
        self.prompts_per_step = prompts_per_step
        self.mcq_layout = mcq_layout
        self.run_seed = ctx.config.run.seed
        self.wire_dtype = compute_dtype(ctx.config.model.dtype, ctx.backend.device)
        self.items: dict[int, list[int]] = {}
        """Published, untrained steps -> this rank's dataset indices."""
        self.published_through = -1
        self.encoded: dict[int, list[Any]] = {}
        self.buffer: dict[int, tuple[str, RolloutBatch]] = {}
        self.kept: dict[int, str] = {}
        """Trained steps -> their rollout entry, kept for a resumed trainer."""
        self.resumed_at: int | None = None
        self.dead_seen = "0-0"
        self.workers_seen: set[str] = set()
        self.counters = _Counters()

    # --- checkpoint state -----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The published-but-untrained batches and how far publishing went."""
        return {"published_through": self.published_through,
                "items": {str(k): v for k, v in sorted(self.items.items())}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (before the first step)."""
        self.published_through = int(state.get("published_through", -1))
        self.items = {int(k): [int(i) for i in v] for k, v in state.get("items", {}).items()}

    # --- a step -------------------------------------------------------------------------

    def next_groups(self, ctx: RunContext) -> FeedRollout:
        """Stage weights, publish ahead, wait for this step's rollouts and score them."""
        step = ctx.step
        metrics: Metrics = {}
        metrics.update(self._stage(ctx, WeightVersion(self.pool.incarnation, step)))
        if self.resumed_at is None:
            self._begin(ctx)
        self._release_checkpointed(ctx)
        last = min(step + self.staleness, ctx.total_steps - 1)
        for later in range(self.published_through + 1, last + 1):
            self.items[later] = shard(self.sampler.take(self.prompts_per_step), self.rank,
                                      self.world)
            self._publish(ctx, later)
            self.published_through = later
        waited = time.perf_counter()
        awaited = self._await(ctx, step)
        if _any_rank(ctx, awaited is None):
            raise StopWithCheckpoint(
                f"no rollout worker has been alive for {self.settings.wait_timeout_s:g}s "
                f"(rollout.workers.wait_timeout_s) while step {step + 1} waited for its "
                f"rollouts; start one with `reasonctl worker rollout --redis "
                f"{self.transport.url} --run {self.transport.run_id}` (or raise "
                "rollout.workers.count).")
        assert awaited is not None
        entry_id, batch = awaited
        wait_s = time.perf_counter() - waited
        scored = time.perf_counter()
        groups = self._groups(ctx, step, batch)
        reward_s = time.perf_counter() - scored
        self._finish(ctx, step, entry_id, batch)
        staleness = step - batch.version.step
        alive = self.transport.live_workers()
        self._report(ctx, step, batch, alive)
        metrics.update({
            "time/wait_s": wait_s,
            "async/staleness/mean": float(staleness),
            "async/staleness/max": float(staleness),
            **{f"async/staleness/{k}": float(staleness == k) for k in range(self.staleness + 1)},
            "async/redelivered": float(batch.deliveries - 1),
            "async/duplicates_dropped": float(self.counters.duplicates),
            "async/stale_dropped": float(self.counters.stale),
            "async/workers_alive": float(len(alive)),
            "weights/sync_ms": batch.sync_ms,
        })
        self.counters = _Counters()
        return FeedRollout(groups, batch.tokens, batch.generate_s, reward_s, metrics)

    def _report(self, ctx: RunContext, step: int, batch: RolloutBatch, alive: list[str]
                ) -> None:
        """Say (main process) which workers joined or stopped heartbeating since the last
        look, and when a batch was taken over from a worker that stopped holding it."""
        self._note_workers(ctx, alive)
        if batch.deliveries > 1:
            ctx.info(f"step {step + 1}: prompt batch {batch.batch_id} was taken over from a "
                     f"worker that stopped while holding it; {batch.worker} answered it "
                     f"(delivery {batch.deliveries}), nothing lost or trained twice")

    def _note_workers(self, ctx: RunContext, alive: list[str]) -> None:
        """Name (main process) the workers that joined or stopped heartbeating."""
        names = set(alive)
        gone, joined = sorted(self.workers_seen - names), sorted(names - self.workers_seen)
        self.workers_seen = names
        if joined:
            ctx.info(f"rollout worker(s) joined: {', '.join(joined)} ({len(names)} alive)")
        if gone:
            left = ("what they held goes to the others" if names else
                    f"the run checkpoints and stops if none is alive for "
                    f"{self.settings.wait_timeout_s:g}s (rollout.workers.wait_timeout_s)")
            ctx.info(f"rollout worker(s) stopped heartbeating: {', '.join(gone)} "
                     f"({len(names)} alive; {left})")

    def _stage(self, ctx: RunContext, version: WeightVersion) -> Metrics:
        """Hand weight ``version`` to the publisher; milliseconds and bytes on every rank."""
        backend = ctx.backend
        assert backend is not None
        started = time.perf_counter()
        size = 0

        def counted() -> Any:
            nonlocal size
            for name, tensor in backend.full_state_dict():
                size += wire_nbytes(tensor, self.wire_dtype)
                yield name, tensor

        if self.pool.publisher is not None:
            self.pool.publisher.stage(counted(), version)
        else:
            for _ in counted():  # the gathers are collective
                pass
        backend.barrier()  # version announced before any rank publishes prompts for it
        return {"weights/stage_ms": (time.perf_counter() - started) * 1000,
                "weights/bytes": float(size)}

    def _begin(self, ctx: RunContext) -> None:
        """First step of this trainer: reread pending rollouts, republish restored batches."""
        self.resumed_at = ctx.step
        self._sort(self.transport.read_results(self.rank, block_ms=0, pending=True), ctx.step)
        for step in sorted(self.items):
            if step >= ctx.step and step not in self.buffer:
                self._publish(ctx, step)
        for step in [s for s in self.items if s < ctx.step]:
            del self.items[step]

    def _publish(self, ctx: RunContext, step: int, attempt: int = 0) -> None:
        assert ctx.dataset is not None
        # episodes of an environment start from the samples themselves
        samples = [ctx.dataset[i].to_dict() for i in self.items[step]] \
            if ctx.environment is not None else []
        batch = PromptBatch(step=step, rank=self.rank, seed=mix_seed(self.run_seed, step, 0,
                                                                       self.rank),
                            indices=self.items[step],
                            prompts=[e.as_prompt() for e in self._encoded(ctx, step)],
                            attempt=attempt, samples=samples)
        self.transport.publish_prompts(batch.to_fields())

    def _encoded(self, ctx: RunContext, step: int) -> list[Any]:
        """This rank's encoded prompts of ``step`` (encoded once, until trained)."""
        assert ctx.processor is not None and ctx.dataset is not None
        if step not in self.encoded:
            tools = environment_tools(ctx.environment)
            self.encoded[step] = [
                ctx.processor.encode_prompt(ctx.dataset[i], mcq_layout=self.mcq_layout,
                                            tools=tools)
                for i in self.items[step]]
        return self.encoded[step]

    # --- collecting -------------------------------------------------------------------------

    def _await(self, ctx: RunContext, step: int) -> tuple[str, RolloutBatch] | None:
        """This step's rollouts, or ``None`` when no worker was alive for
        ``wait_timeout_s``."""
        started = time.monotonic()
        alive_since = started
        noticed = False
        while step not in self.buffer:
            entries = self.transport.read_results(self.rank, block_ms=BLOCK_MS)
            self._sort(entries, step, ctx)
            self._check_dead_letters()
            if step in self.buffer:
                break
            now = time.monotonic()
            alive = self.transport.live_workers()
            self._note_workers(ctx, alive)
            if alive:
                alive_since = now
            elif now - alive_since > self.settings.wait_timeout_s:
                return None
            if not noticed and now - started > NOTICE_AFTER_S and self.rank == 0:
                noticed = True
                wait = ("" if alive else f"; without one for "
                        f"{self.settings.wait_timeout_s:g}s the run checkpoints and stops")
                ctx.info(f"waiting for the rollouts of step {step + 1} "
                         f"({len(alive)} worker(s) alive{wait})")
        return self.buffer.pop(step)

    def _sort(self, entries: list[Any], step: int, ctx: RunContext | None = None) -> None:
        """Keep each rollout for its step, or drop it (a duplicate, or too stale)."""
        drop: list[str] = []
        for entry in entries:
            batch = RolloutBatch.from_fields(entry.fields)
            if batch.step < step or batch.step in self.buffer or batch.step not in self.items:
                self.counters.duplicates += 1
                drop.append(entry.id)
            elif not self._usable(batch):
                self.counters.stale += 1
                drop.append(entry.id)
                if ctx is not None:  # while resuming, _begin publishes it again
                    self._publish(ctx, batch.step, batch.attempt + 1)
            else:
                self.buffer[batch.step] = (entry.id, batch)
        self.transport.drop_results(self.rank, drop)

    def _usable(self, batch: RolloutBatch) -> bool:
        """Within the staleness bound and generated by weights of this trainer's lineage."""
        version = batch.version
        lag = batch.step - version.step
        if lag < 0 or lag > self.staleness:
            return False
        assert self.resumed_at is not None
        return version.incarnation == self.pool.incarnation or version.step <= self.resumed_at

    def _check_dead_letters(self) -> None:
        for entry in self.transport.dead_letters(self.dead_seen):
            self.dead_seen = entry.id
            meta = json.loads(entry.fields.get("meta", b"{}"))
            mine = int(meta.get("rank", -1)) == self.rank
            if not mine or int(meta.get("step", -1)) not in self.items:
                continue
            error = entry.fields.get("error", b"").decode(errors="replace").strip()
            raise ReasonctlError(
                f"prompt batch s{meta['step']}-r{self.rank} failed on rollout workers "
                f"({entry.fields.get('reason', b'').decode()}, "
                f"{entry.fields.get('deliveries', b'?').decode()} deliveries; see the "
                f"{self.transport.key('dead')} stream)" + (f":\n{error}" if error else ""))

    def _groups(self, ctx: RunContext, step: int, batch: RolloutBatch) -> list[RolloutGroup]:
        assert ctx.dataset is not None
        samples = [ctx.dataset[i] for i in self.items[step]]
        if len(batch.completions) != len(samples):
            raise ReasonctlError(f"rollouts of batch {batch.batch_id} answer "
                                 f"{len(batch.completions)} prompts, not {len(samples)}")
        return score_groups(ctx, samples, self._encoded(ctx, step), batch.completions)

    def _finish(self, ctx: RunContext, step: int, entry_id: str, batch: RolloutBatch) -> None:
        """Ledger row; keep the entry while a resumed trainer could reuse it."""
        indices = self.items.pop(step)
        self.encoded.pop(step, None)
        ids = group_ids(step, self.rank, len(indices))
        self.transport.record_trained({
            "step": str(step), "rank": str(self.rank), "batch": batch.batch_id,
            "groups": ",".join(ids), "indices": json.dumps(indices),
            "version": batch.version.as_text(), "incarnation": str(self.pool.incarnation),
            "worker": batch.worker, "deliveries": str(batch.deliveries),
            "attempt": str(batch.attempt),
        })
        if batch.version.step <= self._checkpointed(ctx):
            self.kept[step] = entry_id
        else:
            self.transport.drop_results(self.rank, [entry_id])

    def _release_checkpointed(self, ctx: RunContext) -> None:
        covered = self._checkpointed(ctx)
        done = [s for s in self.kept if s < covered]
        self.transport.drop_results(self.rank, [self.kept.pop(s) for s in done])

    def _checkpointed(self, ctx: RunContext) -> int:
        """The step of the newest checkpoint: committed in this run, or resumed from."""
        path = ctx.checkpoints.last_committed if ctx.checkpoints is not None else None
        committed = 0
        if path is not None and path.name.rsplit("_", 1)[-1].isdigit():
            committed = int(path.name.rsplit("_", 1)[-1])
        return max(committed, self.resumed_at or 0)



def _any_rank(ctx: RunContext, flag: bool) -> bool:
    """Whether ``flag`` is true on any trainer process (collective on every process)."""
    assert ctx.backend is not None
    return mean_over_processes({"flag/max": float(flag)}, ctx.backend.device)["flag/max"] > 0
