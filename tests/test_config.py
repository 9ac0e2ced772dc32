"""Config layering, strict validation that reports every problem, and redaction."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict

import reasonctl
from reasonctl.core.config import load_config, parse_override
from reasonctl.core.errors import ConfigError
from reasonctl.core.plugins import PluginHost


class FancyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    beta: float = 0.1
    mode: str = "a"


class FancyPlugin:
    @reasonctl.hookimpl
    def register_algorithms(self, register):
        register("fancy", lambda cfg: cfg, config_model=FancyConfig)

    @reasonctl.hookimpl
    def register_backends(self, register):
        register("nullbackend", lambda cfg: cfg)


@pytest.fixture
def registry():
    host = PluginHost.load(entry_points=False)
    host.add_plugin(FancyPlugin(), name="fancy-plugin")
    return host.registry


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_precedence_set_over_env_over_files(tmp_path, registry, monkeypatch):
    base = write(tmp_path / "a.toml", '[train]\nlr = 0.1\nmax_steps = 5\n[run]\nname = "a"\n')
    later = write(tmp_path / "b.toml", "[train]\nlr = 0.2\n")
    names = {"algorithm": {"name": "fancy"}, "backend": {"name": "nullbackend"}}
    cfg = load_config([base, later], registry=registry, values=names)
    assert cfg.train.lr == 0.2 and cfg.train.max_steps == 5 and cfg.run.name == "a"
    monkeypatch.setenv("REASONCTL_TRAIN__LR", "0.3")
    cfg = load_config([base, later], registry=registry,
                      values={"algorithm": {"name": "fancy"}, "backend": {"name": "nullbackend"}})
    assert cfg.train.lr == 0.3
    cfg = load_config([base, later], ["train.lr=0.4"], registry=registry,
                      values={"algorithm": {"name": "fancy"}, "backend": {"name": "nullbackend"}})
    assert cfg.train.lr == 0.4


def test_plugin_sections_are_typed(tmp_path, registry, monkeypatch):
    monkeypatch.setenv("REASONCTL_ALGORITHM__FANCY__MODE", "b")
    cfg = load_config(
        [write(tmp_path / "c.toml", '[algorithm]\nname = "fancy"\n[algorithm.fancy]\nbeta = 2\n')],
        ["backend.name='nullbackend'"], registry=registry,
    )
    section = cfg.component_config("algorithm", "fancy")
    assert isinstance(section, FancyConfig) and section.beta == 2.0 and section.mode == "b"
    with pytest.raises(ConfigError) as info:
        load_config([], ["algorithm.name=fancy", "backend.name=nullbackend",
                         "algorithm.fancy.betta=1"], registry=registry)
    assert "algorithm.fancy.betta: unknown key; did you mean 'beta'?" in str(info.value)


def test_every_problem_reported_at_once(tmp_path, registry):
    bad = write(tmp_path / "bad.toml", "[trian]\nlr = 1\n[model]\ndtype = 'fp8'\n")
    with pytest.raises(ConfigError) as info:
        load_config([bad], ["train.lr=fast"], registry=registry,
                    values={"algorithm": {"name": "fancyy"}, "backend": {"name": "nullbackend"}})
    problems = info.value.problems
    text = "\n".join(problems)
    assert any(p.startswith("trian: unknown key; did you mean 'train'?") for p in problems), text
    assert any(p.startswith("train.lr:") and "'fast'" in p for p in problems), text
    assert any(p.startswith("model.dtype:") and "'fp8'" in p for p in problems), text
    assert any(p.startswith("algorithm.name: Unknown algorithm 'fancyy'") and
               "Did you mean 'fancy'?" in p for p in problems), text
    assert len(problems) == 4, text


def test_override_values_are_toml_literals():
    assert parse_override("train.lr=1e-5") == (["train", "lr"], 1e-5)
    assert parse_override("a.b=[1, 2]") == (["a", "b"], [1, 2])
    assert parse_override("a.b=true") == (["a", "b"], True)
    assert parse_override("a.b=hello world") == (["a", "b"], "hello world")
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_override("train.lr")


def test_missing_file_and_bad_toml_are_named(tmp_path, registry):
    with pytest.raises(ConfigError, match="nope.toml: file not found"):
        load_config([tmp_path / "nope.toml"], registry=registry)
    broken = write(tmp_path / "broken.toml", "[train\nlr = 1\n")
    with pytest.raises(ConfigError, match="broken.toml: invalid TOML"):
        load_config([broken], registry=registry)


def test_secrets_are_redacted(tmp_path, registry, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_supersecretvalue")
    cfg = load_config([], ["algorithm.name=fancy", "backend.name=nullbackend",
                           "run.name=job-hf_supersecretvalue",
                           'checkpoint.upload=["s3://bucket/hf_supersecretvalue"]'],
                      registry=registry)
    text = cfg.to_toml()
    assert "hf_supersecretvalue" not in text
    assert "***" in text
    assert "hf_supersecretvalue" in cfg.to_toml(redact=False)


def test_env_flags_of_the_cli_are_not_config_keys(registry, monkeypatch):
    monkeypatch.setenv("REASONCTL_STRICT_PLUGINS", "0")
    monkeypatch.setenv("REASONCTL_DISABLE_PLUGINS", "x")
    cfg = load_config([], ["algorithm.name=fancy", "backend.name=nullbackend"], registry=registry)
    assert cfg.algorithm.name == "fancy"
