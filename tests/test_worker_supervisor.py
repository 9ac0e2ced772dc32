"""The supervisor of the rollout workers a run starts, on real worker processes that fail
at once: one that exits with a usage error (status 2) is not started again, one that fails
otherwise is started again under a new name until its restarts are used up, each time
saying what ended it."""

from __future__ import annotations

import time
from pathlib import Path

from reasonctl.async_rl.processes import free_port
from reasonctl.async_rl.supervisor import WorkerSupervisor


def test_failed_workers_are_restarted_up_to_the_bound_and_usage_errors_are_not(
        tmp_path: Path) -> None:
    lines: list[str] = []
    supervisor = WorkerSupervisor(max_restarts=1, log=lines.append)
    # not a Redis URL: a usage error (exit 2)
    supervisor.start("bad-url", ["--redis", "http://nowhere", "--run", "r"],
                     tmp_path / "bad-url.log")
    # nobody listens there: a run failure (exit 1)
    supervisor.start("no-redis", ["--redis", f"redis://127.0.0.1:{free_port()}/0", "--run", "r",
                                  "--connect-timeout", "0.2"], tmp_path / "no-redis.log")
    deadline = time.monotonic() + 240
    while not all(w.given_up for w in supervisor.workers) and time.monotonic() < deadline:
        supervisor.check()
        time.sleep(0.2)
    supervisor.close(finished=False)
    text = "\n".join(lines)
    bad, lost = supervisor.workers
    assert bad.given_up and bad.restarts == 0
    assert ("rollout worker bad-url (pid " in text and "exited with status 2: a usage error, "
            "which a restart would repeat; not restarted" in text), text
    assert lost.given_up and lost.restarts == 1
    assert "rollout worker no-redis (pid " in text and "exited with status 1; restarted it as " \
        "no-redis.r1 (pid " in text and "restart 1 of 1, rollout.workers.max_restarts)" in text
    assert ("rollout worker no-redis.r1 (pid " in text and "not restarted: it used its 1 "
            "restart(s)" in text), text
    assert "cannot reach Redis" in (tmp_path / "no-redis.log").read_text()
