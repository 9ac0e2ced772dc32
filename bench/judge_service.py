"""Judge throughput: the ``judge`` reward served by ``reasonctl serve-rewards`` against
``transformers``' batched ``generate``, in the same job on the same model and prompts.

The judge is a random Qwen2.5-shaped model (``--size``: ``0.5b``, ``7b``, or ``tiny`` for a
CPU smoke run) with the word tokenizer of :mod:`bench.common`. Every judgment is one
prompt of ``--prompt-len`` random words (half the question, half the completion, through
the judge's rubric ``{prompt} {completion}``) answered greedily with ``--new-tokens``
tokens.

1. Baseline: ``model.generate`` (greedy, ``min_new_tokens = max_new_tokens``) on the same
   prompts in batches of ``--batch-size``, left-padded; judgments/s over the whole set,
   each judgment's latency that of its batch.
2. Parity: the judge reward's own engine in this process on ``--parity`` prompts: how many
   replies equal ``generate``'s greedy ones, and how long they are (a random model may end
   a reply early; the summary reports the mean length so the two sides can be compared).
3. Service: ``reasonctl serve-rewards`` in a process of its own serving ``judge``
   (``[batching] max_batch = --batch-size``, ``max_wait_ms = --max-wait-ms``), with
   ``--concurrency`` clients each sending requests of ``--completions`` completions until
   ``--requests`` requests are judged; judgments/s over wall time, p50/p99 latency of a
   request from enqueue to its scores.

    python -m bench.judge_service --size 0.5b --device cuda:0
    python -m bench.judge_service --size tiny --device cpu --requests 8 --completions 4 \\
        --concurrency 2 --prompt-len 32 --new-tokens 8 --batch-size 8     # CPU smoke

The last line printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import (
    build_model_dir,
    emit,
    environment,
    free_memory,
    log,
    now,
    random_rows,
    tokenizer_dir,
    words,
)

TEMPLATE = "{prompt} {completion}"
TOKEN = "bench-token-0123456789abcdef"


def parse_args() -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="0.5b", choices=["0.5b", "7b", "tiny"])
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--completions", type=int, default=8,
                        help="Completions per request.")
    parser.add_argument("--concurrency", type=int, default=32, help="Clients at once.")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=256,
                        help="Judgments generated together (both sides).")
    parser.add_argument("--max-wait-ms", type=float, default=20.0)
    parser.add_argument("--parity", type=int, default=8)
    parser.add_argument("--out", default="/tmp/reasonctl-bench")
    return parser.parse_args()


def prompts(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(question, completion) texts of every judgment."""
    total = args.requests * args.completions
    half = args.prompt_len // 2
    rows = random_rows(total, args.prompt_len, seed=1)
    return [(words(row[:half]), words(row[half:])) for row in rows]


def percentile(values: list[float], point: float) -> float:
    """Nearest-rank percentile of ``values``."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(point / 100 * len(ordered)) - 1))]


def baseline(model_dir: Path, texts: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """``generate`` in batches: judgments/s and per-judgment latency (its batch's)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir(model_dir))
    tokenizer.padding_side = "left"
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(args.device).eval()
    kwargs = {"do_sample": False, "max_new_tokens": args.new_tokens,
              "min_new_tokens": args.new_tokens, "pad_token_id": tokenizer.pad_token_id}

    def run(batch: list[str]) -> torch.Tensor:
        encoded = tokenizer(batch, return_tensors="pt", padding=True).to(args.device)
        with torch.inference_mode():
            out = held["model"].generate(**encoded, **kwargs)
        return out[:, encoded["input_ids"].shape[1]:]

    held = {"model": model}
    del model
    run(texts[: min(len(texts), args.batch_size)])  # warm-up
    latencies: list[float] = []
    replies: list[list[int]] = []
    started = now()
    for start in range(0, len(texts), args.batch_size):
        batch = texts[start : start + args.batch_size]
        begun = now()
        generated = run(batch)
        latencies += [now() - begun] * len(batch)
        replies += generated.tolist()
    seconds = now() - started
    held.clear()
    free_memory()
    return {"judgments_per_s": len(texts) / seconds, "seconds": seconds,
            "latency_p50_s": percentile(latencies, 50), "latency_p99_s": percentile(latencies, 99),
            "replies": replies, "new_tokens": args.new_tokens}


def judge_options(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The served (and the in-process) judge's options."""
    return {"model": str(model_dir), "tokenizer": str(tokenizer_dir(model_dir)),
            "template": TEMPLATE, "chat": False, "max_new_tokens": args.new_tokens,
            "max_prompt_tokens": args.prompt_len + 8, "batch_size": args.batch_size,
            "device": args.device}


def parity(model_dir: Path, pairs: list[tuple[str, str]], expected: list[list[int]],
           args: argparse.Namespace) -> dict[str, Any]:
    """The judge reward's engine in this process on the first prompts."""
    from reasonctl.core.types import ContentPart, Message, Sample
    from reasonctl.rewards.judge import JudgeConfig, JudgeReward

    judge = JudgeReward(JudgeConfig(**judge_options(model_dir, args)))
    count = min(args.parity, len(pairs))
    samples = [Sample([Message("user", [ContentPart("text", text=q)])]) for q, _ in pairs[:count]]
    ids = [judge.prompt_ids(c, s) for (_, c), s in zip(pairs[:count], samples, strict=True)]
    groups = judge.engine.generate([{"input_ids": i} for i in ids], _greedy(args))
    lengths = [len(group[0].token_ids) for group in groups]
    same = sum(group[0].token_ids == want[: len(group[0].token_ids)]
               and len(group[0].token_ids) == len(want)
               for group, want in zip(groups, expected, strict=False))
    judge.close()
    del judge
    free_memory()
    return {"prompts": count, "identical_replies": same,
            "mean_reply_tokens": statistics.fmean(lengths) if lengths else 0.0}


def _greedy(args: argparse.Namespace) -> Any:
    from reasonctl.core.types import SamplingParams

    return SamplingParams(n=1, temperature=0.0, max_new_tokens=args.new_tokens, seed=0)


def free_port() -> int:
    """A free TCP port of 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_service(model_dir: Path, args: argparse.Namespace, workdir: Path
                  ) -> tuple[subprocess.Popen[bytes], str]:
    """``reasonctl serve-rewards`` serving the judge; waits until it is healthy."""
    import httpx
    import tomli_w

    port = free_port()
    config = {"server": {"log_format": "text"},
              "limits": {"max_pending": 100_000, "deadline_s": 3600},
              "batching": {"max_batch": args.batch_size, "max_wait_ms": args.max_wait_ms},
              "rewards": {"components": [{"name": "judge", **judge_options(model_dir, args)}]}}
    path = workdir / "service.toml"
    path.write_text(tomli_w.dumps(config))
    env = {**os.environ, "REASONCTL_REWARD_TOKEN": TOKEN}
    log_file = (workdir / "service.log").open("wb")
    process = subprocess.Popen([sys.executable, "-m", "reasonctl", "serve-rewards", "--config",
                                str(path), "--port", str(port)], env=env, stdout=log_file,
                               stderr=log_file)
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + 1800
    while time.monotonic() < end:
        if process.poll() is not None:
            raise RuntimeError(f"the service exited; see {workdir / 'service.log'}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    process.kill()
    raise TimeoutError("the service did not start")


def served(url: str, pairs: list[tuple[str, str]], args: argparse.Namespace) -> dict[str, Any]:
    """Judgments/s and request latency of the service under ``--concurrency`` clients."""
    import httpx

    from reasonctl.core.types import ContentPart, Message, Sample
    from reasonctl.reward_service.client import RewardServiceClient
    from reasonctl.reward_service.wire import encode_request

    bodies = []
    for start in range(0, len(pairs), args.completions):
        chunk = pairs[start : start + args.completions]
        samples = [Sample([Message("user", [ContentPart("text", text=q)])]) for q, _ in chunk]
        bodies.append(encode_request({"judge": 1.0}, [c for _, c in chunk], samples))
    client = RewardServiceClient(url, TOKEN)

    def judge(body: bytes) -> float:
        begun = time.perf_counter()
        deadline = time.monotonic() + 3600
        answer = client.wait(client.enqueue(body, deadline=deadline), deadline=deadline)
        if answer.get("status") != "done":
            raise RuntimeError(f"a request failed: {answer}")
        return time.perf_counter() - begun

    judge(bodies[0])  # warm-up (compilation, graph capture)
    queue = list(range(len(bodies)))
    lock = threading.Lock()
    latencies: list[float] = []

    def client_loop() -> None:
        while True:
            with lock:
                if not queue:
                    return
                index = queue.pop()
            seconds = judge(bodies[index])
            with lock:
                latencies.append(seconds)

    threads = [threading.Thread(target=client_loop) for _ in range(args.concurrency)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - started
    stats = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"},
                      timeout=30).json()
    client.close()
    return {"judgments_per_s": len(pairs) / seconds, "seconds": seconds,
            "latency_p50_s": percentile(latencies, 50),
            "latency_p99_s": percentile(latencies, 99),
            "mean_batch": stats["rewards"]["judge"]["mean_batch"]}


def main() -> None:
    """Run the baseline, the parity check and the service; print the JSON summary."""
    args = parse_args()
    root = Path(args.out)
    model_dir = build_model_dir(root, args.size)
    pairs = prompts(args)
    texts = [TEMPLATE.format(prompt=q, completion=c) for q, c in pairs]
    log(f"baseline: generate on {len(texts)} judgments")
    base = baseline(model_dir, texts, args)
    log(f"baseline: {base['judgments_per_s']:.2f} judgments/s")
    check = parity(model_dir, pairs, base.pop("replies"), args)
    log(f"parity: {check}")
    with tempfile.TemporaryDirectory(prefix="judge-bench-") as workdir:
        process, url = start_service(model_dir, args, Path(workdir))
        try:
            service = served(url, pairs, args)
        finally:
            process.terminate()
            process.wait(120)
    log(f"service: {service['judgments_per_s']:.2f} judgments/s")
    emit({"bench": "judge_service", "size": args.size, "device": args.device,
          "requests": args.requests, "completions_per_request": args.completions,
          "concurrency": args.concurrency, "prompt_len": args.prompt_len,
          "new_tokens": args.new_tokens, "batch_size": args.batch_size,
          "service": service, "generate": base, "parity": check,
          "speedup": service["judgments_per_s"] / base["judgments_per_s"],
          "environment": environment()})


if __name__ == "__main__":
    main()
