"""The CLI as a user runs it: subprocesses, exit codes, plugin discovery, import cost."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fake_dist import make_distribution

ROOT = Path(__file__).resolve().parents[1]


def cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None,
        timeout: float = 120) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "reasonctl", *args], capture_output=True,
                          text=True, env=full_env, cwd=cwd, timeout=timeout)


def with_path(*paths: Path) -> dict[str, str]:
    existing = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": os.pathsep.join([*map(str, paths), existing]).rstrip(os.pathsep)}


def test_help_and_plugins_do_not_import_torch():
    for args in (["--help"], ["plugins", "--json"]):
        out = subprocess.run([sys.executable, "-X", "importtime", "-m", "reasonctl", *args],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines()
                    if line.startswith("import time:")}
        assert "torch" not in imported and "transformers" not in imported


def test_plugins_json_lists_every_kind_with_owner():
    out = cli("plugins", "--json")
    assert out.returncode == 0, out.stderr
    listing = json.loads(out.stdout)
    kinds = listing["components"]
    for kind in ("dataset", "reward", "algorithm", "backend", "storage", "rollout_engine",
                 "logger"):
        assert kinds.get(kind), f"no {kind} registered"
        assert all(c["distribution"] == "reasonctl" for c in kinds[kind])


def test_config_validate_reports_all_problems(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[trian]\nlr = 0.1\n")
    out = cli("config", "validate", "--config", str(bad), "--algo", "grpoo",
              "--set", "train.lr=fast")
    assert out.returncode == 2, out.stderr
    err = " ".join(out.stderr.split())
    assert "trian: unknown key; did you mean 'train'?" in err
    assert "train.lr:" in err and "'fast'" in err
    assert "Unknown algorithm 'grpoo'" in err and "Did you mean 'grpo'?" in err


def test_error_messages_with_brackets_print_literally(capsys):
    import typer

    from reasonctl.cli.common import fail

    # e.g. a gloo error names its source file in brackets; rich would read it as markup
    for message in ("gloo [/pair.cc:553] Connection closed by peer", "worker [rank0]: boom"):
        with pytest.raises(typer.Exit) as exit_info:
            fail(message)
        assert exit_info.value.exit_code == 1
        assert message in capsys.readouterr().err


def test_set_beats_environment_beats_file(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[train]\nlr = 0.1\n")
    env = {"REASONCTL_TRAIN__LR": "0.2"}
    shown = json.loads(cli("config", "show", "--json", "--config", str(cfg), env=env).stdout)
    assert shown["train"]["lr"] == 0.2
    out = cli("config", "show", "--json", "--config", str(cfg), "--set", "train.lr=0.3", env=env)
    assert json.loads(out.stdout)["train"]["lr"] == 0.3


def test_config_show_hides_secrets():
    env = {"AWS_SECRET_ACCESS_KEY": "aws-secret-value-123", "HF_TOKEN": "hf_token_value_456",
           "AWS_ACCESS_KEY_ID": "AKIAEXAMPLEKEY"}
    out = cli("config", "show", "--set", "run.name='x-hf_token_value_456'",
              "--set", "checkpoint.upload=['s3://b/aws-secret-value-123']", env=env)
    assert out.returncode == 0, out.stderr
    for secret in env.values():
        assert secret not in out.stdout + out.stderr


def test_broken_plugin_never_bricks_the_cli(tmp_path):
    site = make_distribution(tmp_path / "site", "reasonctl-broken", "0.3.1",
                             {"broken_plugin": "raise RuntimeError('boom at import')\n"},
                             {"broken": "broken_plugin"})
    out = cli("plugins", env=with_path(site))
    assert out.returncode == 0
    assert "boom at import" in out.stdout + out.stderr
    assert "reasonctl-broken 0.3.1" in " ".join((out.stdout + out.stderr).split())
    strict = cli("--strict-plugins", "plugins", env=with_path(site))
    assert strict.returncode != 0 and "boom at import" in strict.stderr
    env_strict = cli("plugins", env={**with_path(site), "REASONCTL_STRICT_PLUGINS": "1"})
    assert env_strict.returncode != 0


def test_schema_version_and_env():
    schema = json.loads(cli("config", "schema").stdout)
    assert "train" in schema["properties"]
    assert "sft" in json.dumps(schema)  # plugin sections are part of the schema
    version = cli("--version")
    assert version.returncode == 0 and version.stdout.startswith("reasonctl ")
    env = json.loads(cli("env", "--json").stdout)
    assert env["packages"]["torch"] != "not installed" and "video" in env["extras"]


@pytest.fixture(scope="module")
def third_party_site(tmp_path_factory):
    import shutil

    target = tmp_path_factory.mktemp("third-party")
    source = tmp_path_factory.mktemp("third-party-src") / "plugin"
    shutil.copytree(ROOT / "examples" / "third_party_plugin", source)  # builds stay out of the repo
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--no-build-isolation", "--target", str(target), str(source)],
                   check=True, capture_output=True, timeout=300)
    return target


def test_third_party_plugin_is_discovered(third_party_site, tmp_path):
    env = with_path(third_party_site)
    listing = json.loads(cli("plugins", "--json", env=env).stdout)
    owners = {(c["name"], c["distribution"], c["version"])
              for kind in ("dataset", "reward") for c in listing["components"][kind]}
    assert ("csvqa", "reasonctl-csvqa", "0.3.0") in owners
    assert ("keyword", "reasonctl-csvqa", "0.3.0") in owners
    help_text = cli("--help", env=env).stdout
    assert "Plugins" in help_text and "csvqa-preview" in help_text
    data = tmp_path / "q.csv"
    data.write_text("question,answer\nWhat is 2+2?,4\nCapital of France?,Paris\n")
    preview = cli("csvqa-preview", str(data), env=env)
    assert preview.returncode == 0 and "2 samples" in preview.stdout
    version = cli("--version", env=env).stdout
    assert "reasonctl-csvqa 0.3.0" in version


@pytest.mark.slow
def test_third_party_components_are_used_in_a_run(third_party_site, tiny_model_dir, tmp_path):
    data = tmp_path / "q.csv"
    rows = [f"Say {w} twice,{w} {w}" for w in ("red", "blue", "green", "gold")] * 4
    data.write_text("question,answer\n" + "\n".join(rows) + "\n")
    out = tmp_path / "run"
    result = cli(
        "run", "--algo", "sft", "--output-dir", str(out),
        "--set", f"model.name_or_path='{tiny_model_dir}'",
        "--set", "data.format='csvqa'", "--set", f"data.csvqa.path='{data}'",
        "--set", "train.max_steps=8", "--set", "train.lr=3e-3",
        "--set", "train.global_batch_size=4", "--set", "train.micro_batch_size=4",
        "--set", "logging.loggers=['jsonl']", "--set", "checkpoint.export_final=false",
        env=with_path(third_party_site), timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 8 and losses[-1] < losses[0]
    import tomllib

    saved = tomllib.loads((out / "config.toml").read_text())
    assert saved["data"]["format"] == "csvqa" and saved["data"]["csvqa"]["path"] == str(data)
