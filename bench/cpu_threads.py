"""CPU thread count of a tiny-model run: the default (one thread) against one per core.

Runs the text SFT quickstart (``examples/configs/quickstart_sft.toml``, the built-in tiny
model) as users run it, ``python -m reasonctl run`` in a process of its own, once with
``backend.cpu_threads = 1`` (the default when ``OMP_NUM_THREADS`` is not exported) and once
with one thread per core (torch's own default), alternating ``--repeats`` times, and
reports the median wall time of each and their ratio. ``OMP_NUM_THREADS`` is removed from
the runs' environment so the config key decides.

    python -m bench.cpu_threads                      # 20 steps, 3 repeats
    python -m bench.cpu_threads --steps 5 --repeats 1

The last line printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import emit, log

REPO = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    return parser.parse_args()


def timed_run(threads: int, steps: int, out: Path) -> float:
    """Wall seconds of one quickstart run with ``threads`` CPU threads."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    command = [sys.executable, "-m", "reasonctl", "run", "--config",
               str(REPO / "examples/configs/quickstart_sft.toml"),
               "--set", f"run.output_dir='{out}'", "--set", f"train.max_steps={steps}",
               "--set", "backend.device='cpu'", "--set", f"backend.cpu_threads={threads}",
               "--set", "checkpoint.export_final=false", "--set", "logging.loggers=['jsonl']",
               "--set", "logging.plot=false"]
    started = time.perf_counter()
    subprocess.run(command, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def main() -> None:
    """Measure and print the summary."""
    args = parse_args()
    cores = os.cpu_count() or 1
    times: dict[int, list[float]] = {1: [], cores: []}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for threads in times:
                seconds = timed_run(threads, args.steps, Path(tmp) / f"{threads}-{repeat}")
                times[threads].append(seconds)
                log(f"threads {threads}: {seconds:.1f} s")
    one, many = statistics.median(times[1]), statistics.median(times[cores])
    emit({"bench": "cpu_threads", "steps": args.steps, "cores": cores,
          "seconds_one_thread": one, "seconds_per_core": many,
          "per_core_over_one_thread": many / one, "runs": times})


if __name__ == "__main__":
    main()
