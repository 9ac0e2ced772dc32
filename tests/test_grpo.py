"""GRPO end to end on the tiny model: metrics, KL, dynamic sampling, masking, resume, learning."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import reasonctl
from reasonctl.core.types import Sample

REPO = Path(__file__).resolve().parents[1]


def _write_prompts(path: Path, count: int = 8) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(count):
        letter = "AB"[i % 2]
        rows.append({"prompt": f"Item {i}. Reply with the letter {letter}.", "reference": letter,
                     "meta": {"kind": "const" if i % 4 == 3 else "var"}})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _config(tmp_path: Path, model_dir: Path, **grpo: Any) -> dict[str, Any]:
    data = _write_prompts(tmp_path / "prompts.jsonl")
    return {
        "run": {"output_dir": str(tmp_path / "run"), "seed": 0},
        "model": {"name_or_path": str(model_dir), "max_length": 64},
        "data": {"format": "jsonl", "jsonl": {"path": str(data)}},
        "algorithm": {"name": "grpo", "grpo": {"prompts_per_step": 2, **grpo}},
        "rollout": {"n": 4, "max_new_tokens": 6, "temperature": 1.0},
        "train": {"lr": 1e-2, "max_steps": 3, "micro_batch_size": 3},
        "backend": {"name": "single", "device": "cpu"},
        "checkpoint": {"export_final": False},
        "logging": {"loggers": ["jsonl"]},
    }


def byte_parity(completion: str, sample: Sample) -> float:
    """A reward with spread: 1 when the UTF-8 bytes sum to an even number (about half of any
    completions, whatever their length); constant for 'const' rows."""
    if sample.meta.get("kind") == "const":
        return 1.0
    return float(sum(completion.encode()) % 2 == 0)


def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


EXPECTED_METRICS = {
    "reward/mean", "reward/std", "reward/byte_parity/mean", "entropy", "clip_frac/low",
    "clip_frac/high", "response_length/mean", "response_length/max", "rollout/zero_std_frac",
    "rollout/tokens_per_s", "rollout/logprob_gap", "time/rollout_s", "time/reward_s",
    "time/update_s", "loss", "grad_norm", "lr",
}


def test_grpo_with_kl_reports_metrics_and_keeps_logprobs_consistent(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    config = _config(tmp_path, tiny_model_dir, kl_beta=0.1, kl_estimator="k3")
    result = reasonctl.run(config, rewards=[byte_parity])
    assert result.status == "completed" and result.steps == 3
    steps = _metrics(tmp_path / "run")
    for row in steps:
        assert EXPECTED_METRICS | {"kl"} <= set(row)
        assert row["rollout/logprob_gap"] < 1e-3
        assert row["response_length/max"] <= 6
    assert steps[0]["kl"] == pytest.approx(0.0, abs=1e-7)  # policy == reference before updates
    assert steps[-1]["kl"] > 0.0


def test_grpo_without_kl_builds_no_reference(tmp_path: Path, tiny_model_dir: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from reasonctl.backends.single import SingleDeviceBackend

    def refuse(self: Any) -> None:
        raise AssertionError("kl_beta = 0 must not build a reference model")

    monkeypatch.setattr(SingleDeviceBackend, "build_reference_model", refuse, raising=False)
    result = reasonctl.run(_config(tmp_path, tiny_model_dir, scale_rewards="batch"),
                           rewards=[byte_parity])
    assert result.status == "completed"
    last = _metrics(tmp_path / "run")[-1]
    assert EXPECTED_METRICS <= set(last) and "kl" not in last


def test_dynamic_sampling_replaces_zero_variance_groups(tmp_path: Path,
                                                        tiny_model_dir: Path) -> None:
    config = _config(tmp_path, tiny_model_dir, dynamic_sampling=True, max_sampling_rounds=6)
    reasonctl.run(config, rewards=[byte_parity])
    steps = _metrics(tmp_path / "run")
    assert all(row["rollout/groups_kept"] == 2 for row in steps)
    assert any(row["rollout/zero_std_frac"] > 0 for row in steps)
    assert all(row["rollout/sampling_rounds"] > 1 for row in steps
               if row["rollout/zero_std_frac"] > 0)


def test_overlong_filtering_leaves_truncated_completions_without_loss(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    config = _config(tmp_path, tiny_model_dir, mask_truncated=True)
    config["rollout"]["max_new_tokens"] = 2  # the random model never ends this early
    config["checkpoint"]["export_final"] = True
    result = reasonctl.run(config, rewards=[byte_parity])
    steps = _metrics(tmp_path / "run")
    for row in steps:  # a step updates only when some completion ended on its own
        assert (row["response_length/truncated_frac"] == 1.0) == (row.get("update/skipped") == 1)
    assert sum(row["response_length/truncated_frac"] == 1.0 for row in steps) >= 2
    assert result.export_dir is not None
    if all(row.get("update/skipped") == 1 for row in steps):
        _assert_same_weights(result.export_dir, tiny_model_dir)


def _assert_same_weights(left: Path, right: Path) -> None:
    from safetensors.torch import load_file

    a = {k: v for f in sorted(left.glob("*.safetensors")) for k, v in load_file(f).items()}
    b = {k: v for f in sorted(right.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert a.keys() == b.keys()
    assert all(a[k].float().equal(b[k].float()) for k in a)


def test_gspo_sum_norm_with_several_updates_per_rollout(tmp_path: Path,
                                                        tiny_model_dir: Path) -> None:
    from reasonctl.core.config import ConfigWarning

    config = _config(tmp_path, tiny_model_dir, importance_level="sequence",
                     loss_aggregation="seq-mean-token-sum-norm", scale_rewards="none",
                     ppo_epochs=2, mini_batches=2, epsilon_high=0.28)
    config["train"]["max_steps"] = 2
    with pytest.warns(ConfigWarning, match="weights each sequence by its length"):
        reasonctl.run(config, rewards=[byte_parity])
    for row in _metrics(tmp_path / "run"):
        assert row["update/optimizer_steps"] == 4
        assert row["rollout/logprob_gap"] < 1e-3


def test_separate_engine_copy_is_synced_before_each_rollout(tmp_path: Path,
                                                            tiny_model_dir: Path) -> None:
    config = _config(tmp_path, tiny_model_dir)
    config["rollout"]["hf"] = {"share_weights": False}
    config["eval"] = {"data": str(tmp_path / "prompts.jsonl"), "every_steps": 2,
                      "answer_format": "letter", "max_samples": 4}
    reasonctl.run(config, rewards=[byte_parity])
    steps = _metrics(tmp_path / "run")
    # after the first update the policy changed; a stale copy would show a large gap
    assert all(row["rollout/logprob_gap"] < 1e-3 for row in steps)
    assert [("eval/accuracy" in row) for row in steps] == [False, True, False]
    assert 0.0 <= steps[1]["eval/prompts/accuracy"] <= 1.0


def test_one_process_fsdp_grpo_equals_single_backend(tmp_path: Path,
                                                     tiny_model_dir: Path) -> None:
    """FSDP in one process shards nothing but wraps the model: the engine must use its own
    synced copy and the run must equal the single-device one, KL reference included."""
    losses = {}
    for backend in ("single", "fsdp"):
        config = _config(tmp_path / backend, tiny_model_dir, kl_beta=0.1)
        config["backend"]["name"] = backend
        reasonctl.run(config, rewards=[byte_parity])
        losses[backend] = [row["loss"] for row in _metrics(tmp_path / backend / "run")]
    # a first on-policy step's loss is 0 up to the engine's rounding (advantages sum to 0 per
    # group; mismatch weights 1 +- 1e-7), hence the absolute tolerance
    assert losses["fsdp"] == pytest.approx(losses["single"], rel=1e-4, abs=1e-6)


@pytest.mark.slow
def test_resumed_run_matches_the_uninterrupted_one(tmp_path: Path, tiny_model_dir: Path) -> None:
    full = _config(tmp_path / "full", tiny_model_dir)
    full["train"]["max_steps"] = 4
    reasonctl.run(full, rewards=[byte_parity])
    first = _config(tmp_path / "part", tiny_model_dir)
    first["train"]["max_steps"] = 4
    first["checkpoint"]["every_steps"] = 2
    stopped = dict(first, train={**first["train"], "max_steps": 2})
    reasonctl.run(stopped, rewards=[byte_parity])
    resumed = dict(first, run={**first["run"], "resume": True})
    reasonctl.run(resumed, rewards=[byte_parity])
    expected = _metrics(tmp_path / "full" / "run")
    got = _metrics(tmp_path / "part" / "run")
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for key in ("reward/mean", "response_length/mean", "loss", "entropy"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in expected], rel=1e-5)


@pytest.mark.slow
def test_quickstart_reward_rises_and_export_beats_the_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from reasonctl.core.plugins import PluginHost
    from reasonctl.evaluation.standalone import evaluate

    monkeypatch.chdir(REPO)
    out = tmp_path / "quickstart"
    config = reasonctl.load_config(
        REPO / "examples/configs/quickstart_grpo.toml",
        overrides=[f"run.output_dir={json.dumps(str(out))}", "checkpoint.every_steps=0",
                   'logging.loggers=["jsonl"]'],
    )
    result = reasonctl.run(config)
    steps = _metrics(out)
    rewards = [row["reward/mean"] for row in steps]
    assert sum(rewards[-5:]) / 5 - sum(rewards[:5]) / 5 >= 0.3
    periodic = [row["eval/accuracy"] for row in steps if "eval/accuracy" in row]
    assert len(periodic) == len(steps) // 30 and periodic[-1] >= 0.5
    registry = PluginHost.load().registry
    held_out = str(REPO / "examples/data/quickstart_grpo_eval.jsonl")
    trained = evaluate(config, registry, model=str(result.export_dir), data=held_out,
                       answer_format="letter")
    start = evaluate(config, registry, model="tiny-random", data=held_out,
                     answer_format="letter")
    assert trained.accuracy > start.accuracy
    assert trained.accuracy >= 0.5


def test_mcq_layout_writes_lettered_options_once() -> None:
    from reasonctl.core.types import ContentPart, Message
    from reasonctl.data.prompting import layout_mcq, option_lines

    assert option_lines({"A": "cat", "B": " dog "}) == "A. cat\nB. dog"
    video = ContentPart("video", path="clip.mp4")
    sample = Sample([Message("user", [video, ContentPart("text", text="Is it safe?")])],
                    reference="B", meta={"choices": ["yes", "no"]})
    laid = layout_mcq(sample)
    assert laid.messages[0].content[0] is video
    assert laid.messages[0].text == "Is it safe?\nA. yes\nB. no"
    assert layout_mcq(laid).messages[0].text == laid.messages[0].text  # idempotent
    assert sample.messages[0].text == "Is it safe?"  # the original is untouched

    qa = Sample([Message("user", [video])], meta={"qa_pairs": [
        {"question": "What moves?", "index2ans": {"A": "a car", "B": "a bike"}, "answer": "A"}
    ]})
    assert layout_mcq(qa).messages[0].text == "What moves?\nA. a car\nB. a bike"

    placed = Sample([Message("user", [ContentPart(
        "text", text="What moves?\n{choices}\nAnswer with the letter.")])],
        reference={"question": "What moves?", "index2ans": {"A": "car", "B": "bike"},
                   "answer": "B"})
    assert layout_mcq(placed).messages[0].text == (
        "What moves?\nA. car\nB. bike\nAnswer with the letter."
    )
    plain = Sample([Message("user", [ContentPart("text", text="2+2?")])], reference="4")
    assert layout_mcq(plain) is plain


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("tp", [1, 2])
def test_two_process_fsdp_grpo_with_kl_and_dynamic_sampling(tmp_path: Path, tiny_model_dir: Path,
                                                             tp: int) -> None:
    """Two processes as two data-parallel ranks, or as one tensor-parallel pair."""
    import os
    import subprocess
    import sys

    data = _write_prompts(tmp_path / "prompts.jsonl")
    config = tmp_path / "grpo.toml"
    config.write_text(f"""
[model]
name_or_path = "{tiny_model_dir}"
max_length = 64
[data]
format = "jsonl"
[data.jsonl]
path = "{data}"
[algorithm]
name = "grpo"
[algorithm.grpo]
prompts_per_step = 4
kl_beta = 0.1
dynamic_sampling = true
max_sampling_rounds = 8
[rollout]
n = 4
max_new_tokens = 3
[train]
lr = 1e-2
max_steps = 3
micro_batch_size = 4
[backend]
device = "cpu"
[[rewards.components]]
name = "length"
max_length = 3
buffer = 3
[checkpoint]
export_final = false
[logging]
loggers = ["jsonl"]
plot = false
""")
    out = tmp_path / "run"
    command = [sys.executable, "-m", "reasonctl", "run", "--backend", "fsdp",
               "--nproc-per-node", "2", "--config", str(config), "--output-dir", str(out),
               "--set", f"backend.fsdp.tp={tp}"]
    proc = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    steps = _metrics(out)
    assert [row["step"] for row in steps] == [1, 2, 3]
    assert steps[0]["kl"] == pytest.approx(0.0, abs=1e-7)
    for row in steps:  # the engine's own copy is refreshed from the sharded policy
        assert row["rollout/logprob_gap"] < 1e-3
        # per data rank, after dropping equal-reward groups (the pair shares all 4 prompts)
        kept = row["rollout/groups_kept"]
        assert kept == 2 if tp == 1 else 1 <= kept <= 4
    assert steps[-1]["kl"] > 0.0


def test_in_loop_evaluation_is_shown_on_the_console_and_plotted(
        tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from reasonctl.loggers.metrics_file import read_metrics
    from reasonctl.loggers.plot import choose_panels

    config = _config(tmp_path, tiny_model_dir)
    config["eval"] = {"data": str(tmp_path / "prompts.jsonl"), "every_steps": 2,
                      "answer_format": "letter", "max_samples": 4}
    config["logging"] = {"loggers": ["console", "jsonl"], "every_steps": 3}
    reasonctl.run(config, rewards=[byte_parity])
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    # the evaluation at step 2 is logged although logging.every_steps is 3
    assert [row["step"] for row in records] == [2, 3]
    accuracy = records[0]["eval/accuracy"]
    assert f"step 2/3 eval: accuracy {accuracy:.4g}" in capsys.readouterr().err
    assert ("evaluation", "eval/accuracy") in choose_panels(records)
    assert (tmp_path / "run" / "training_curves.png").stat().st_size > 0
