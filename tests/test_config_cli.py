"""The ``config`` commands as a user meets them: malformed inputs of every kind exit 2 with
every problem named and no traceback; ``show --sources``; warnings; secrets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.fake_dist import make_distribution

BASE = """
[run]
output_dir = "{out}"
[data]
format = "jsonl"
[data.jsonl]
path = "{data}"
[algorithm]
name = "sft"
[backend]
device = "cpu"
"""

# (id, file overlaid on the valid base, environment, extra arguments, text the output must hold)
CASES: list[tuple[str, str | None, dict[str, str], list[str], str]] = [
    ("lr-word", '[train]\nlr = "fast"', {}, [], "train.lr:"),
    ("lr-nan", "[train]\nlr = nan", {}, [], "train.lr: Input should be a finite number"),
    ("lr-inf", "[train]\nlr = inf", {}, [], "train.lr: Input should be a finite number"),
    ("lr-negative", "[train]\nlr = -1e-5", {}, [], "train.lr: Input should be greater than 0"),
    ("lr-zero", "[train]\nlr = 0", {}, [], "train.lr: Input should be greater than 0"),
    ("lr-bool", "[train]\nlr = true", {}, [], "train.lr: Input should be a valid number"),
    ("betas-short", "[train]\nbetas = [0.9]", {}, [], "train.betas.1:"),
    ("betas-long", "[train]\nbetas = [0.9, 0.99, 0.5]", {}, [], "train.betas:"),
    ("betas-one", "[train]\nbetas = [0.9, 1.0]", {}, [], "train.betas.1: Input should be less"),
    ("betas-text", '[train]\nbetas = "0.9,0.99"', {}, [], "train.betas:"),
    ("betas-nan", "[train]\nbetas = [nan, 0.9]", {}, [], "train.betas.0:"),
    ("eps-zero", "[train]\nadam_eps = 0", {}, [], "train.adam_eps:"),
    ("eps-neg-inf", "[train]\nadam_eps = -inf", {}, [], "train.adam_eps:"),
    ("epochs-float", "[train]\nepochs = 1.5", {}, [], "train.epochs:"),
    ("max-steps-zero", "[train]\nmax_steps = 0", {}, [], "train.max_steps:"),
    ("batch-negative", "[train]\nglobal_batch_size = -8", {}, [], "train.global_batch_size:"),
    ("min-lr-ratio", "[train]\nmin_lr_ratio = 2", {}, [], "train.min_lr_ratio:"),
    ("weight-decay", "[train]\nweight_decay = -0.1", {}, [], "train.weight_decay:"),
    ("grad-norm-nan", "[train]\nmax_grad_norm = nan", {}, [], "train.max_grad_norm:"),
    ("schedule-typo", '[train]\nschedule = "cosin"', {}, [], "train.schedule:"),
    ("warmup-negative", "[train]\nwarmup_steps = -1", {}, [], "train.warmup_steps:"),
    ("train-key-typo", "[train]\nlearning_rate = 1e-5", {}, [], "train.learning_rate: unknown"),
    ("seed-negative", "[run]\nseed = -1", {}, [], "run.seed:"),
    ("seed-float", "[run]\nseed = 1.5", {}, [], "run.seed:"),
    ("resume-int", "[run]\nresume = 3", {}, [], "run.resume:"),
    ("output-empty", '[run]\noutput_dir = ""', {}, [], "run.output_dir:"),
    ("on-signal", '[run]\non_signal = "ignore"', {}, [], "run.on_signal:"),
    ("name-int", "[run]\nname = 5", {}, [], "run.name:"),
    ("dtype", '[model]\ndtype = "fp8"', {}, [], "model.dtype:"),
    ("max-length-zero", "[model]\nmax_length = 0", {}, [], "model.max_length:"),
    ("freeze-string", '[model]\nfreeze = "x"', {}, [], "model.freeze:"),
    ("freeze-regex", '[model]\nfreeze = ["(unclosed"]', {}, [], "model.freeze:"),
    ("remote-code-text", '[model]\ntrust_remote_code = "yes"', {}, [], "model.trust_remote_code"),
    ("format-typo", '[data]\nformat = "jsonll"', {}, [], "data.format: Unknown dataset 'jsonll'"),
    ("max-samples-zero", "[data]\nmax_samples = 0", {}, [], "data.max_samples:"),
    ("bad-row", '[data]\non_bad_row = "ignore"', {}, [], "data.on_bad_row:"),
    ("shuffle-int", "[data]\nshuffle = 2", {}, [], "data.shuffle:"),
    ("jsonl-key-typo", '[data.jsonl]\npaths = "x"', {}, [], "data.jsonl.paths: unknown key"),
    ("jsonl-path-int", "[data.jsonl]\npath = 5", {}, [], "data.jsonl.path:"),
    ("jsonl-fps", "[data.jsonl]\nfps = -1", {}, [], "data.jsonl.fps:"),
    ("temperature", "[rollout]\ntemperature = -1", {}, [], "rollout.temperature:"),
    ("top-p-zero", "[rollout]\ntop_p = 0", {}, [], "rollout.top_p:"),
    ("top-p-big", "[rollout]\ntop_p = 1.5", {}, [], "rollout.top_p:"),
    ("n-zero", "[rollout]\nn = 0", {}, [], "rollout.n:"),
    ("engine-typo", '[rollout]\nengine = "hff"', {}, [], "Unknown rollout engine 'hff'"),
    ("stop-string", '[rollout]\nstop = "x"', {}, [], "rollout.stop:"),
    ("rollout-hf-typo", "[rollout.hf]\nmax_batch_sz = 4", {}, [], "rollout.hf.max_batch_sz"),
    ("algo-typo", '[algorithm]\nname = "grpoo"', {}, [], "Unknown algorithm 'grpoo'"),
    ("grpo-key-typo", "[algorithm.grpo]\nkl_betaa = 1", {}, [], "algorithm.grpo.kl_betaa"),
    ("grpo-type", '[algorithm.grpo]\nkl_beta = "high"', {}, [], "algorithm.grpo.kl_beta:"),
    ("sft-literal", '[algorithm.sft]\nloss_reduction = "mean"', {}, [], "algorithm.sft.loss_"),
    ("backend-typo", '[backend]\nname = "fsdpp"', {}, [], "Unknown backend 'fsdpp'"),
    ("device-word", '[backend]\ndevice = "gpu"', {}, [], "backend.device:"),
    ("fsdp-key-typo", "[backend.fsdp]\nshardd = 1", {}, [], "backend.fsdp.shardd"),
    ("on-error", '[rewards]\non_error = "ignore"', {}, [], "rewards.on_error:"),
    ("components-table", '[rewards]\ncomponents = {name = "math"}', {}, [], "rewards.components"),
    ("reward-typo", '[[rewards.components]]\nname = "maths"', {}, [], "Unknown reward 'maths'"),
    ("reward-no-name", "[[rewards.components]]\nweight = 1", {}, [], "rewards.components.0.name"),
    ("reward-weight-nan", '[[rewards.components]]\nname = "math"\nweight = nan', {}, [],
     "rewards.components.0.weight"),
    ("reward-option-typo", '[[rewards.components]]\nname = "math"\nrequire_boxd = true', {}, [],
     "rewards.components.0.require_boxd"),
    ("reward-option-type",
     '[[rewards.components]]\nname = "length"\nmax_length = "long"\nbuffer = 1', {}, [],
     "rewards.components.0.max_length"),
    ("reward-callable", '[[rewards.components]]\nname = "no_module_xyz:fn"', {}, [],
     "rewards.components.0.name"),
    ("reward-name-int", "[[rewards.components]]\nname = 5", {}, [], "rewards.components.0.name"),
    ("keep-zero", "[checkpoint]\nkeep = 0", {}, [], "checkpoint.keep:"),
    ("upload-string", '[checkpoint]\nupload = "s3://b"', {}, [], "checkpoint.upload:"),
    ("every-negative", "[checkpoint]\nevery_steps = -1", {}, [], "checkpoint.every_steps:"),
    ("upload-when", '[checkpoint]\nupload_when = "never"', {}, [], "checkpoint.upload_when:"),
    ("loggers-string", '[logging]\nloggers = "console"', {}, [], "logging.loggers:"),
    ("logger-typo", '[logging]\nloggers = ["consol"]', {}, [], "Unknown logger 'consol'"),
    ("log-every-zero", "[logging]\nevery_steps = 0", {}, [], "logging.every_steps:"),
    ("answer-format", '[eval]\nanswer_format = "xml"', {}, [], "eval.answer_format:"),
    ("eval-temperature", "[eval]\ntemperature = -0.5", {}, [], "eval.temperature:"),
    ("s3-part-size", "[storage.s3]\npart_size_mb = 1", {}, [], "storage.s3.part_size_mb"),
    ("s3-endpoint-creds", '[storage.s3]\nendpoint_url = "http://u:pw@h:9000"', {}, [],
     "storage.s3.endpoint_url"),
    ("storage-unknown", "[storage.sftp]\nx = 1", {}, [], "storage.sftp: unknown key"),
    ("plugin-nan", "[storage.hf]\nbackoff_s = nan", {}, [], "storage.hf.backoff_s"),
    ("section-typo", "[trian]\nlr = 1", {}, [], "trian: unknown key; did you mean 'train'?"),
    ("top-level-key", "lr = 1", {}, [], "lr: unknown key"),
    ("section-scalar", "train = 5", {}, [], "train:"),
    ("nested-unknown", "[train.extra]\nx = 1", {}, [], "train.extra: unknown key"),
    ("bad-toml-header", "[train\nlr = 1", {}, [], "invalid TOML"),
    ("bad-toml-value", "[train]\nlr = ", {}, [], "invalid TOML"),
    ("duplicate-key", "[train]\nlr = 1\nlr = 2", {}, [],
     "invalid TOML: duplicate key 'train.lr' on line 3 (first set on line 2)"),
    ("duplicate-table", "[train]\nlr = 1\n\n[train]\nepochs = 2", {}, [],
     "invalid TOML: [train] on line 4 defines 'train' again"),
    ("output-in-proc", '[run]\noutput_dir = "/proc/reasonctl-out"', {}, [],
     "run.output_dir: cannot create '/proc/reasonctl-out': no file can be created in /proc"),
    ("model-missing", '[model]\nname_or_path = "./no-such-model"', {}, [],
     "model.name_or_path: './no-such-model' does not exist"),
    ("env-word", None, {"REASONCTL_TRAIN__LR": "fast"}, [], "REASONCTL_TRAIN__LR:"),
    ("env-tuple", None, {"REASONCTL_TRAIN__BETAS": "(0.9,0.99)"}, [], "REASONCTL_TRAIN__BETAS:"),
    ("env-short", None, {"REASONCTL_TRAIN__BETAS": "[0.9]"}, [], "REASONCTL_TRAIN__BETAS"),
    ("env-section", None, {"REASONCTL_TRIAN__LR": "1"}, [], "did you mean REASONCTL_TRAIN__LR?"),
    ("env-key", None, {"REASONCTL_TRAIN__LRR": "1"}, [], "REASONCTL_TRAIN__LRR: unknown key"),
    ("env-empty-key", None, {"REASONCTL_TRAIN__": "1"}, [], "REASONCTL_TRAIN__: empty name"),
    ("env-empty-section", None, {"REASONCTL___LR": "1"}, [], "REASONCTL___LR: empty name"),
    ("env-nan", None, {"REASONCTL_TRAIN__LR": "nan"}, [], "REASONCTL_TRAIN__LR:"),
    ("env-seed", None, {"REASONCTL_RUN__SEED": "-3"}, [], "REASONCTL_RUN__SEED:"),
    ("env-algo", None, {"REASONCTL_ALGORITHM__NAME": "grpoo"}, [], "Unknown algorithm 'grpoo'"),
    ("env-plugin-key", None, {"REASONCTL_ALGORITHM__GRPO__BETAA": "1"}, [],
     "REASONCTL_ALGORITHM__GRPO__BETAA"),
    ("env-whole-section", None, {"REASONCTL_TRAIN": "lr"}, [], "REASONCTL_TRAIN: set keys"),
    ("env-process-typo", None, {"REASONCTL_STRICT_PLUGIN": "1"}, [],
     "did you mean REASONCTL_STRICT_PLUGINS?"),
    ("env-too-deep", None, {"REASONCTL_TRAIN__LR__X": "1"}, [], "REASONCTL_TRAIN__LR__X"),
    ("env-rewards", None, {"REASONCTL_REWARDS__COMPONENTS": '[{name = "maths"}]'}, [],
     "Unknown reward 'maths'"),
    ("set-no-value", None, {}, ["--set", "train.lr"], "expected KEY=VALUE"),
    ("set-empty-key", None, {}, ["--set", "=1"], "empty key segment"),
    ("set-double-dot", None, {}, ["--set", "train..lr=1"], "empty key segment"),
    ("set-word", None, {}, ["--set", "train.lr=fast"], "train.lr:"),
    ("flag-algo", None, {}, ["--algo", "grpoo"], "Unknown algorithm 'grpoo'"),
    ("missing-file", None, {}, ["--config", "does-not-exist.toml"], "file not found"),
    ("data-missing", '[data.jsonl]\npath = "gone.jsonl"', {}, [], "data.jsonl.path: 'gone.jsonl'"),
    ("output-is-file", '[run]\noutput_dir = "{data}"', {}, [], "run.output_dir:"),
    ("upload-no-bucket", '[checkpoint]\nupload = ["s3://"]', {}, [], "checkpoint.upload.0:"),
    ("upload-scheme", '[checkpoint]\nupload = ["sftp://h/x"]', {}, [], "unknown storage scheme"),
    ("upload-hf", '[checkpoint]\nupload = ["hf://owner"]', {}, [], "checkpoint.upload.0:"),
    ("resume-missing", '[run]\nresume = "ckpt/step_5"', {}, [], "run.resume:"),
    ("micro-batch", "[train]\nglobal_batch_size = 8\nmicro_batch_size = 3", {}, [],
     "train.global_batch_size: 8 is not a multiple"),
    ("eval-data", '[eval]\ndata = "missing-eval.jsonl"', {}, [], "eval.data:"),
    ("video-root-file", '[data]\nformat = "video_folder"\n[data.video_folder]\nroot = "{data}"',
     {}, [], "data.video_folder.root:"),
]


@pytest.fixture(scope="module")
def app():
    from reasonctl.cli import common
    from reasonctl.cli.app import build_app

    return build_app(common.init_host(strict=False))


@pytest.fixture
def base(tmp_path: Path) -> tuple[Path, Path]:
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "2+2?", "response": "4"}\n')
    config = tmp_path / "base.toml"
    config.write_text(BASE.format(out=tmp_path / "out", data=data))
    return config, data


def invoke(app, args: list[str], env: dict[str, str] | None = None):
    result = CliRunner().invoke(app, args, env=env)
    return result, result.output + (getattr(result, "stderr", "") or "")


def test_the_base_config_is_valid(app, base):
    result, output = invoke(app, ["config", "validate", "--config", str(base[0])])
    assert result.exit_code == 0, output
    assert output.startswith("ok: algorithm=sft")


@pytest.mark.parametrize(("case", "text", "env", "args", "expected"), CASES,
                         ids=[case[0] for case in CASES])
def test_malformed_input_exits_2_naming_the_problem(app, base, tmp_path, case, text, env, args,
                                                    expected):
    config, data = base
    files = ["--config", str(config)]
    if text is not None:
        overlay = tmp_path / f"{case}.toml"
        overlay.write_text(text.replace("{data}", str(data)))
        files += ["--config", str(overlay)]
    result, output = invoke(app, ["config", "validate", *files, *args], env=env)
    assert result.exit_code == 2, output
    assert isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in output
    assert expected in output, output


def test_the_reward_service_token_is_not_a_config_variable(app, base):
    env = {"REASONCTL_REWARD_TOKEN": "3f9a0c1d2e4b5a6978877665544332211", "REASONCTL_HOME": "/h"}
    for args in (["config", "validate"], ["data", "check"]):
        result, output = invoke(app, [*args, "--config", str(base[0])], env=env)
        assert result.exit_code == 0, output
        assert "REASONCTL_" not in output, output


def test_non_utf8_empty_and_directory_configs(app, base, tmp_path):
    latin = tmp_path / "latin.toml"
    latin.write_bytes('[run]\nname = "caf\u00e9"\n'.encode("latin-1"))
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    for path, expected in ((latin, "not UTF-8 text"), (tmp_path, "is a directory"),
                           (empty, "data.jsonl.path: not set")):
        result, output = invoke(app, ["config", "validate", "--config", str(path)])
        assert result.exit_code == 2 and expected in output and "Traceback" not in output, output


def test_every_problem_of_a_config_is_listed(app, base, tmp_path):
    overlay = tmp_path / "two.toml"
    overlay.write_text('[trian]\nlr = 1\n[[rewards.components]]\nname = "length"\n'
                       'max_length = "long"\nbuffer = 4\n')
    result, output = invoke(app, ["config", "validate", "-c", str(base[0]), "-c", str(overlay)],
                            env={"REASONCTL_TRAIN__BETAS": "[0.9, 2]"})
    assert result.exit_code == 2
    assert "(3 problem(s))" in output
    assert "trian: unknown key; did you mean 'train'?" in output
    assert "rewards.components.0.max_length: Input should be a valid integer" in output
    assert "REASONCTL_TRAIN__BETAS (train.betas.1): Input should be less than 1" in output


def test_unknown_keys_and_missing_files_are_reported_in_one_round(app, base, tmp_path):
    gone, gone_eval = tmp_path / "gone.jsonl", tmp_path / "gone-eval.jsonl"
    overlay = tmp_path / "mixed.toml"
    overlay.write_text(f'[trian]\nlr = 1\n[train]\nlr = "fast"\n[data.jsonl]\npath = "{gone}"\n'
                       f'[eval]\ndata = "{gone_eval}"\n[[rewards.components]]\nname = "math"\n'
                       'require_boxd = true\n')
    for command in (["config", "validate"], ["run"]):
        result, output = invoke(app, [*command, "-c", str(base[0]), "-c", str(overlay)])
        assert result.exit_code == 2, output
        said = " ".join(output.split())
        assert "(5 problem(s))" in said, output
        for expected in ("trian: unknown key", "train.lr: Input should be a valid number",
                         f"data.jsonl.path: '{gone}' does not exist",
                         f"eval.data: '{gone_eval}' does not exist",
                         "rewards.components.0.require_boxd: unknown key"):
            assert expected in said, output
    # a value left out as invalid is not reported again by the checks of the world
    overlay.write_text("[data.jsonl]\npath = 5\n[run]\noutput_dir = 7\n")
    result, output = invoke(app, ["config", "validate", "-c", str(base[0]), "-c", str(overlay)])
    assert result.exit_code == 2 and "(2 problem(s))" in output, output


def test_show_sources_marks_where_values_came_from(app, base, tmp_path):
    overlay = tmp_path / "overlay.toml"
    overlay.write_text('[[rewards.components]]\nname = "format"\n[train]\nlr = 0.5\n')
    first = tmp_path / "first.toml"
    first.write_text('[[rewards.components]]\nname = "math"\n')
    result, output = invoke(
        app, ["config", "show", "--sources", "-c", str(base[0]), "-c", str(first),
              "-c", str(overlay), "--algo", "grpo", "--set", "run.seed=3"],
        env={"REASONCTL_TRAIN__MAX_STEPS": "7", "REASONCTL_ALGORITHM__NAME": "sft"},
    )
    assert result.exit_code == 0, output
    lines = output.splitlines()
    assert f"train.lr = 0.5  # {overlay}" in lines
    assert "train.max_steps = 7  # REASONCTL_TRAIN__MAX_STEPS" in lines
    assert 'algorithm.name = "grpo"  # command-line flags' in lines
    assert "run.seed = 3  # --set run.seed=3" in lines
    assert "train.epochs = 1  # default" in lines
    assert f'rewards.components = [{{name = "format", weight = 1.0}}]  # {overlay}' in lines
    assert any(line.startswith("warning: rewards.components: the list from") and
               str(first) in line and str(overlay) in line for line in lines), output
    result, output = invoke(app, ["config", "show", "--json", "--sources", "-c", str(base[0])])
    shown = json.loads(result.stdout)
    assert shown["sources"]["data.format"] == str(base[0])
    assert shown["config"]["data"]["format"] == "jsonl"


def test_show_redacts_secrets_and_keeps_ordinary_keys(app, base):
    env = {"HF_TOKEN": "hf_secret_value_123", "MY_API_KEY": "sk-another-secret-9"}
    result, output = invoke(app, [
        "config", "show", "-c", str(base[0]),
        "--set", "checkpoint.upload=['https://user:pass-123@host/x']",
        "--set", "run.name='run-sk-another-secret-9'", "--set", "model.tokenizer='tok-a'",
        "--set", "rollout.max_new_tokens=12",
    ], env=env)
    assert result.exit_code == 0, output
    for secret in ("hf_secret_value_123", "sk-another-secret-9", "pass-123"):
        assert secret not in output
    assert 'tokenizer = "tok-a"' in output and "max_new_tokens = 12" in output


def test_unexpected_errors_print_a_redacted_traceback(monkeypatch, capsys):
    import typer

    from reasonctl.cli.common import handle_errors

    monkeypatch.setenv("HF_TOKEN", "hf_traceback_secret_77")

    @handle_errors
    def boom() -> None:
        raise RuntimeError("could not reach https://bob:pw-42@hub.example with hf_traceback_"
                           "secret_77")

    with pytest.raises(typer.Exit) as info:
        boom()
    err = capsys.readouterr().err
    assert info.value.exit_code == 1
    assert "Traceback" in err and "RuntimeError" in err
    assert "hf_traceback_secret_77" not in err and "pw-42" not in err


def test_validate_warns_about_plugins_that_failed_to_load(tmp_path, base):
    site = make_distribution(tmp_path / "site", "reasonctl-broken", "0.3.1",
                             {"broken_plugin": "raise RuntimeError('boom at import')\n"},
                             {"broken": "broken_plugin"})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH",
                                                                                  "")])}
    out = subprocess.run([sys.executable, "-m", "reasonctl", "config", "validate", "-c",
                          str(base[0])], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    err = " ".join(out.stderr.split())
    assert err.startswith("warning: plugin 'broken' (reasonctl-broken 0.3.1)")
    assert "boom at import" in err and out.stdout.startswith("ok:")


def test_flags_beat_environment_in_a_real_process(base):
    env = {**os.environ, "REASONCTL_ALGORITHM__NAME": "sft", "REASONCTL_TRAIN__LR": "0.2"}
    out = subprocess.run([sys.executable, "-m", "reasonctl", "config", "show", "--json", "-c",
                          str(base[0]), "--algo", "grpo", "--set", "train.lr=0.3"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)
    assert shown["algorithm"]["name"] == "grpo" and shown["train"]["lr"] == 0.3


def test_run_stops_on_an_unusable_output_or_model_directory_before_starting(base, tmp_path):
    empty = tmp_path / "empty-model"
    empty.mkdir()
    for override, expected in (
            ("run.output_dir='/proc/reasonctl-out'",
             "run.output_dir: cannot create '/proc/reasonctl-out'"),
            (f"model.name_or_path='{empty}'", f"model.name_or_path: '{empty}' is an empty "
                                               "directory")):
        out = subprocess.run([sys.executable, "-m", "reasonctl", "run", "-c", str(base[0]),
                              "--set", override], capture_output=True, text=True, timeout=120)
        assert out.returncode == 2, out.stderr[-2000:]
        assert "Traceback" not in out.stderr and expected in " ".join(out.stderr.split())
    assert not (tmp_path / "out").exists()


def test_run_checks_the_world_before_loading_anything(base, tmp_path):
    gone = tmp_path / "gone.jsonl"
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "reasonctl", "run", "-c",
                          str(base[0]), "--set", f"data.jsonl.path='{gone}'"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"data.jsonl.path: '{gone}' does not exist" in out.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines()
                if line.startswith("import time:")}
    assert "torch" not in imported and "transformers" not in imported


def test_paths_the_system_rejects_are_problems_too(app, base, tmp_path):
    long_name = "x" * 300
    result, output = invoke(app, [
        "config", "validate", "-c", str(base[0]), "-c", str(tmp_path / long_name),
        "--set", f"run.output_dir='{tmp_path / long_name}'",
        "--set", 'eval.data="bad\\u0000name"', "--set", f"run.resume='{long_name}'",
    ])
    assert result.exit_code == 2 and "Traceback" not in output, output
    assert f"{long_name}: cannot read the config file: File name too long" in output
    result, output = invoke(app, ["config", "validate", "-c", str(base[0]),
                                  "--set", f"run.output_dir='{tmp_path / long_name}'",
                                  "--set", f"run.resume='{long_name}'",
                                  "--set", 'eval.data="bad\\u0000name"'])
    assert result.exit_code == 2 and "Traceback" not in output, output
    for key in ("run.output_dir:", "run.resume:", "eval.data:"):
        assert key in output
