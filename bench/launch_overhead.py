"""What ``reasonctl run --nproc-per-node N`` costs at start-up, and what a restart costs.

The CPU quickstart (``examples/configs/quickstart_sft.toml``, fsdp backend, a few steps, no
checkpoints or export) is run two ways in the same job, alternating:

- ``launcher``: ``reasonctl run --backend fsdp --nproc-per-node N`` (the launcher: config
  check, output lock, then the workers);
- ``direct``: the same ``N`` worker commands started by this script with the variables
  ``torch.distributed`` reads (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` on
  a free port): no launcher at all, the floor any launcher adds to.

Both report wall time from start to exit; ``overhead_s`` is the difference of the medians.
``first_worker_s`` is the time from the start of the command to its first worker process
(the launcher's own start-up: config checks, output lock, importing and starting torch's
agent, the rendezvous), a figure that the training time's noise does not reach.
With ``--compare-tree DIR`` a third way, ``launcher@DIR``, runs the launcher of another
checkout of reasonctl (``PYTHONPATH=DIR``; e.g. the commit before a launcher change) in the
same alternation, and ``vs_tree_s`` is the difference of the two launchers' medians.
With ``--restart``, one more launcher run (``--max-restarts 1``) SIGKILLs rank 1 once step
``--kill-step`` is logged and reports the time from the kill to the first step logged after
the restart (``restart_s``: the group torn down, the rendezvous again, the workers rebuilt
and the checkpoint loaded).

    python -m bench.launch_overhead                     # CPU smoke: 2 processes, 4 steps
    python -m bench.launch_overhead --repeats 5 --steps 8 --restart
    python -m bench.launch_overhead --compare-tree /tmp/reasonctl-before   # (git worktree)
    python -m bench.launch_overhead --device cuda --nproc 2 --restart   # two GPUs (NCCL)

The last line printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import emit, environment, log

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "examples" / "configs" / "quickstart_sft.toml"


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--restart", action="store_true",
                        help="also measure one restart after a SIGKILL (--max-restarts 1)")
    parser.add_argument("--kill-step", type=int, default=3)
    parser.add_argument("--compare-tree", default=None,
                        help="another reasonctl checkout whose launcher runs in the same job")
    parser.add_argument("--out", default="outputs/bench_launch_overhead")
    return parser.parse_args()


def run_args(args: argparse.Namespace, out: Path, *extra: str) -> list[str]:
    """The ``reasonctl run`` arguments of the quickstart, shortened to ``--steps``."""
    return ["run", "--backend", "fsdp", "--config", str(QUICKSTART), "--output-dir", str(out),
            "--set", f"train.max_steps={args.steps}", "--set", "checkpoint.every_steps=0",
            "--set", "checkpoint.export_final=false", "--set", "logging.loggers=['jsonl']",
            "--set", f"backend.device='{args.device}'", *extra]


def environ() -> dict[str, str]:
    """This process's environment with one thread per worker (as the launcher sets it)."""
    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def timed_launcher(args: argparse.Namespace, out: Path, tree: str | None = None
                   ) -> tuple[float, float]:
    """Seconds of ``reasonctl run --nproc-per-node N`` from start to exit, and from start
    to its first worker process (with ``tree``: that checkout's reasonctl)."""
    command = [sys.executable, "-m", "reasonctl",
               *run_args(args, out, "--nproc-per-node", str(args.nproc))]
    env = environ()
    if tree is not None:  # run from there: `python -m` puts the working directory first
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [tree, env.get("PYTHONPATH")]))
    started = time.perf_counter()
    proc = subprocess.Popen(command, cwd=tree or REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    first_worker = None
    while first_worker is None and proc.poll() is None:
        if children(proc.pid):
            first_worker = time.perf_counter() - started
        time.sleep(0.01)
    _, err = proc.communicate()
    elapsed = time.perf_counter() - started
    if proc.returncode != 0 or first_worker is None:
        raise SystemExit(f"launcher run failed ({proc.returncode}):\n{err[-4000:]}")
    return elapsed, first_worker


def children(pid: int) -> list[int]:
    """The running child processes of ``pid`` (from ``/proc``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if stat[stat.rfind(")") + 2:].split()[1] == str(pid):
                found.append(int(entry.name))
    return found


def timed_direct(args: argparse.Namespace, out: Path) -> tuple[float, float]:
    """Seconds of the same workers started directly (static rendezvous, no launcher), and
    0 to the first worker."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    base = {**environ(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "WORLD_SIZE": str(args.nproc), "LOCAL_WORLD_SIZE": str(args.nproc),
            "GROUP_RANK": "0"}
    started = time.perf_counter()
    workers = [subprocess.Popen([sys.executable, "-m", "reasonctl", *run_args(args, out)],
                                cwd=REPO, env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
               for r in range(args.nproc)]
    codes = [w.wait() for w in workers]
    elapsed = time.perf_counter() - started
    if any(codes):
        raise SystemExit(f"direct run failed {codes}:\n{workers[0].stderr.read()[-4000:]}")
    return elapsed, 0.0


KILL_SITE = """
import os, signal, time
if os.environ.get("RANK") == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
    import reasonctl.core.lifecycle as _lifecycle
    _original = _lifecycle.LifecycleHooks.on_step_end

    def _on_step_end(self, ctx, step, metrics):
        _original(self, ctx, step, metrics)
        if step == int(os.environ["BENCH_KILL_STEP"]) + 1:
            with open(os.environ["BENCH_KILL_FILE"], "w") as handle:
                handle.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)

    _lifecycle.LifecycleHooks.on_step_end = _on_step_end
"""


def timed_restart(args: argparse.Namespace, out: Path) -> dict[str, float]:
    """One launcher run with ``--max-restarts 1`` whose rank 1 is SIGKILLed in step
    ``kill_step + 1`` (a checkpoint at ``kill_step``): seconds from the kill to the end of
    the first step of the restarted group (that step's own time included)."""
    site = out.parent / "kill_site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(KILL_SITE)
    kill_file = out.parent / "killed_at"
    kill_file.unlink(missing_ok=True)
    env = {**environ(), "BENCH_KILL_STEP": str(args.kill_step), "BENCH_KILL_FILE": str(kill_file),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    steps = max(args.steps, args.kill_step + 3)
    command = [sys.executable, "-m", "reasonctl",
               *run_args(args, out, "--nproc-per-node", str(args.nproc), "--max-restarts", "1",
                         "--set", f"checkpoint.every_steps={args.kill_step}",
                         "--set", f"train.max_steps={steps}")]
    started = time.perf_counter()
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    total = time.perf_counter() - started
    if proc.returncode != 0 or not kill_file.exists():
        raise SystemExit(f"restart run failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    rows = {row["step"]: row for row in map(json.loads, (out / "metrics.jsonl").open())}
    first = rows[args.kill_step + 1]
    return {"restart_s": float(first["time"]) - float(kill_file.read_text()),
            "first_step_s": float(first["step_time_s"]), "total_s": total}


def main() -> None:
    """Alternate launcher and direct runs; print the JSON summary."""
    args = parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    ways: dict[str, Callable[[argparse.Namespace, Path], tuple[float, float]]] = {
        "launcher": timed_launcher, "direct": timed_direct}
    if args.compare_tree:
        tree = str(Path(args.compare_tree).resolve())
        ways[f"launcher@{tree}"] = lambda a, o: timed_launcher(a, o, tree)
    times: dict[str, list[float]] = {way: [] for way in ways}
    first: dict[str, list[float]] = {way: [] for way in ways}
    for repeat in range(args.repeats):
        for index, (way, timed) in enumerate(ways.items()):
            seconds, to_worker = timed(args, out / f"way{index}-{repeat}")
            times[way].append(seconds)
            first[way].append(to_worker)
            log(f"{way} #{repeat}: {seconds:.2f} s (first worker after {to_worker:.2f} s)")
    medians = {way: statistics.median(values) for way, values in times.items()}
    summary: dict[str, Any] = {
        "bench": "launch_overhead", **environment(), "nproc": args.nproc, "steps": args.steps,
        "device": args.device, "seconds": times, "median_s": medians,
        "overhead_s": medians["launcher"] - medians["direct"],
        "first_worker_s": first,
        "first_worker_median_s": {way: statistics.median(v) for way, v in first.items()},
    }
    if args.compare_tree:
        summary["vs_tree_s"] = medians["launcher"] - medians[list(ways)[-1]]
    if args.restart:
        summary["restart"] = timed_restart(args, out / "restart")
        log(f"restart: {summary['restart']['restart_s']:.2f} s from the kill to the next step")
    emit(summary)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    main()
