"""Multi-turn rollout throughput: episodes with a simulated tool against single-turn rollouts.

Both sides sample from the same random Qwen2.5-shaped model with the ``hf`` engine (the
``single`` backend's module, shared as in GRPO) on the same random prompts, at
temperature 1 with the same stop string: the word tokenizer's text ends a turn at the
first word starting with ``--turn-stop`` (``w123``: about one word in 137), at most
``--new-tokens`` tokens per turn.

- **single-turn**: one ``generate`` call, ``--n`` samples per prompt (a rollout without an
  environment);
- **multi-turn**: :func:`reasonctl.run_episodes` with an environment that answers each
  of the first ``--turns - 1`` turns after ``--tool-latency`` seconds (a ``time.sleep``
  in the episode's step: the simulated tool, all episodes' tools at once) with an
  observation of ``--observation-words`` words, and ends the episode after ``--turns``
  turns. The engine continues each episode in the cache slot that holds it
  (``generate_continuation``);
- **multi-turn, re-prefilled**: the same, but every turn prefills the whole sequence
  again (``generate`` for every turn), to show what continuing in the slot saves.

Tokens/s counts generated tokens (observation tokens excluded) over wall time, tool
latency included; each side runs once untimed (warm-up: compilation, graph capture), then
``--repeats`` times, and its figure is the median run's. The target (issue 38): multi-turn
at the 0.5B and 7B shapes at least 80% of single-turn tokens/s on one H200.

    python -m bench.agent_rollout --size 0.5b
    python -m bench.agent_rollout --size 7b
    python -m bench.agent_rollout --size tiny --prompts 4 --n 2 --new-tokens 32 --repeats 1

The last line printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.common import (
    build_model_dir,
    emit,
    environment,
    log,
    now,
    random_rows,
    reasonctl_backend,
    tokenizer_dir,
)


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="0.5b", choices=["0.5b", "1.5b", "7b", "tiny"])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4, help="Samples (episodes) per prompt.")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=512, help="Per turn at most.")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--turn-stop", default="w123",
                        help="Stop string ending a turn (a word prefix of the bench tokenizer).")
    parser.add_argument("--tool-latency", type=float, default=0.05,
                        help="Seconds each simulated tool call takes.")
    parser.add_argument("--observation-words", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--root", type=Path, default=Path("outputs/bench"))
    return parser.parse_args()


class SimulatedTool:
    """An environment whose tool takes ``latency`` seconds and answers with ``words``
    words, for ``turns`` turns (see the module docstring)."""

    def __init__(self, turns: int, latency: float, words: int) -> None:
        self.turns, self.latency, self.words = turns, latency, words

    def start(self, sample: Any) -> SimulatedEpisode:
        return SimulatedEpisode(self)


class SimulatedEpisode:
    def __init__(self, tool: SimulatedTool) -> None:
        self.tool = tool
        self.turns = 0

    def step(self, turn: str) -> Any:
        from reasonctl import ContentPart, Message, Observation

        self.turns += 1
        if self.turns >= self.tool.turns:
            return Observation(done=True)
        time.sleep(self.tool.latency)
        text = " ".join(f"w{(self.turns * 7919 + i) % 1000}" for i in range(self.tool.words))
        return Observation([Message("user", [ContentPart("text", text=text)])])

    def reward(self) -> float | None:
        return None

    def metrics(self) -> dict[str, float]:
        return {}


def main() -> None:
    """Run the three sides and print the JSON summary."""
    args = parse_args()
    from reasonctl import ContentPart, EpisodeLimits, Message, Sample, SamplingParams, run_episodes
    from reasonctl.rollout.factory import build_hf_engine

    model_dir = build_model_dir(args.root, args.size)
    episodes = args.prompts * args.n
    backend, ctx = reasonctl_backend(model_dir, args.root / "agent-rollout", values={
        "rollout": {"hf": {"max_batch_size": max(episodes, 1)}}})
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir(model_dir))
    engine = build_hf_engine(ctx.component_config("rollout", "hf"), ctx=ctx)
    prompts = [{"input_ids": row} for row in random_rows(args.prompts, args.prompt_len, seed=1)]
    samples = [Sample([Message("user", [ContentPart("text", text="")])])] * args.prompts
    params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.new_tokens,
                            stop=[args.turn_stop])
    limits = EpisodeLimits(max_turns=args.turns, concurrency=max(episodes, 1))
    tool = SimulatedTool(args.turns, args.tool_latency, args.observation_words)

    def single(seed: int) -> tuple[float, int]:
        started = now()
        groups = engine.generate(prompts, replace(params, seed=seed))
        return now() - started, sum(len(c.token_ids) for g in groups for c in g)

    def multi(seed: int, *, continuing: bool) -> tuple[float, int]:
        original = engine.generate_continuation
        if not continuing:  # every turn prefills its whole sequence again
            engine.generate_continuation = engine.generate
        try:
            started = now()
            groups = run_episodes(engine, tool, tokenizer, samples, prompts,
                                  replace(params, seed=seed), limits)
            seconds = now() - started
        finally:
            engine.generate_continuation = original
        generated = sum(sum(c.loss_mask or []) for g in groups for c in g)
        turns = statistics.fmean(c.episode.turns for g in groups for c in g if c.episode)
        log(f"  {'continued' if continuing else 're-prefilled'}: {generated} tokens, "
            f"{turns:.2f} turns per episode in {seconds:.2f}s")
        return seconds, generated

    sides = {"single_turn": lambda seed: single(seed),
             "multi_turn": lambda seed: multi(seed, continuing=True),
             "multi_turn_reprefill": lambda seed: multi(seed, continuing=False)}
    results: dict[str, Any] = {}
    for name, run in sides.items():
        run(0)  # warm-up
        timed = sorted((run(seed) for seed in range(1, args.repeats + 1)),
                       key=lambda r: r[1] / r[0])
        seconds, tokens = timed[len(timed) // 2]
        results[name] = {"tokens_per_s": round(tokens / seconds, 1), "tokens": tokens,
                         "seconds": round(seconds, 3)}
        log(f"{name}: {results[name]}")
    single_rate = results["single_turn"]["tokens_per_s"]
    emit({
        "bench": "agent_rollout", "size": args.size, "prompts": args.prompts, "n": args.n,
        "prompt_len": args.prompt_len, "new_tokens_per_turn": args.new_tokens,
        "turns": args.turns, "turn_stop": args.turn_stop, "tool_latency_s": args.tool_latency,
        "observation_words": args.observation_words, "decode": engine.last_stats.decode,
        **results,
        "multi_vs_single": round(results["multi_turn"]["tokens_per_s"] / single_rate, 3),
        "reprefill_vs_single": round(
            results["multi_turn_reprefill"]["tokens_per_s"] / single_rate, 3),
        "target_multi_vs_single": 0.8,
        "environment": environment(),
    })
    backend.close()


if __name__ == "__main__":
    main()
