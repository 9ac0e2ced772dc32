"""Config layering, strict validation that reports every problem, and redaction."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict, Field

import reasonctl
from reasonctl.core.config import (
    ConfigWarning,
    InputFile,
    config_json_schema,
    is_secret_key,
    load_config,
    load_config_with_sources,
    parse_override,
    redact_secrets,
    redact_text,
)
from reasonctl.core.errors import ConfigError
from reasonctl.core.plugins import PluginHost

SELECT = ["algorithm.name=fancy", "backend.name=nullbackend"]


class FancyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    beta: float = 0.1
    mode: str = "a"


class Inner(BaseModel):  # no extra="forbid", as a hurried plugin author writes it
    depth: int = 1


class LaxConfig(BaseModel):  # no extra="forbid" either
    gamma: float = 0.5
    inner: Inner = Field(default_factory=Inner)
    ceiling: float = float("inf")  # a default may be infinite; a value a user sets may not


class OpenConfig(BaseModel):  # says extra="allow" itself: free keys stay allowed
    model_config = ConfigDict(extra="allow")
    level: int = 0


class KeywordOptions(BaseModel):  # a reward's options, no extra="forbid"
    keywords: list[str] = Field(default_factory=list)
    min_hits: int = 1
    token_env: str = "KEYWORD_SERVICE_TOKEN"
    key_column: str = "answer"


class PathsConfig(BaseModel):
    vocab: InputFile = "vocab.txt"


class FancyPlugin:
    @reasonctl.hookimpl
    def register_algorithms(self, register):
        register("fancy", lambda cfg: cfg, config_model=FancyConfig)
        register("lax", lambda cfg: cfg, config_model=LaxConfig)

    @reasonctl.hookimpl
    def register_backends(self, register):
        register("nullbackend", lambda cfg: cfg)
        register("open", lambda cfg: cfg, config_model=OpenConfig)

    @reasonctl.hookimpl
    def register_rewards(self, register):
        register("keyword", lambda cfg: cfg, config_model=KeywordOptions)
        register("plain", lambda cfg: cfg)

    @reasonctl.hookimpl
    def register_datasets(self, register):
        register("vocabset", lambda cfg, **_: cfg, config_model=PathsConfig)


@pytest.fixture
def registry():
    host = PluginHost.load(entry_points=False)
    host.add_plugin(FancyPlugin(), name="fancy-plugin")
    return host.registry


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def problems_of(*args, **kwargs) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(*args, **kwargs)
    return info.value.problems


# --- sources and precedence ----------------------------------------------------------------


def test_precedence_set_over_flags_over_env_over_files(tmp_path, registry):
    base = write(tmp_path / "a.toml", '[train]\nlr = 0.1\nmax_steps = 5\n[run]\nname = "a"\n')
    later = write(tmp_path / "b.toml", "[train]\nlr = 0.2\n")
    names = {"algorithm": {"name": "fancy"}, "backend": {"name": "nullbackend"}}
    cfg = load_config([base, later], registry=registry, values=names, environ={})
    assert cfg.train.lr == 0.2 and cfg.train.max_steps == 5 and cfg.run.name == "a"
    env = {"REASONCTL_TRAIN__LR": "0.3", "REASONCTL_ALGORITHM__NAME": "lax",
           "REASONCTL_RUN__NAME": "from-env"}
    cfg = load_config([base, later], registry=registry, values=names, environ=env)
    assert cfg.train.lr == 0.3 and cfg.run.name == "from-env"
    assert cfg.algorithm.name == "fancy"  # the flag (--algo) beats the environment
    cfg = load_config([base, later], ["train.lr=0.4", "algorithm.name=lax"], registry=registry,
                      values=names, environ=env)
    assert cfg.train.lr == 0.4 and cfg.algorithm.name == "lax"  # --set beats both


def test_a_later_file_replaces_lists_with_a_warning_naming_both(tmp_path, registry):
    first = write(tmp_path / "first.toml", '[[rewards.components]]\nname = "plain"\n'
                  '[[rewards.components]]\nname = "keyword"\n[checkpoint]\nupload = ["/tmp/x"]\n')
    second = write(tmp_path / "second.toml", '[[rewards.components]]\nname = "plain"\n')
    seen: list[str] = []
    cfg, sources = load_config_with_sources([first, second], SELECT, registry=registry,
                                            environ={}, on_warning=seen.append)
    assert [c.name for c in cfg.rewards.components] == ["plain"]
    (warning,) = seen
    assert warning.startswith("rewards.components:") and "first.toml" in warning
    assert "second.toml" in warning
    assert sources.source_of(("rewards", "components")) == str(second)
    assert sources.source_of(("checkpoint", "upload")) == str(first)
    assert sources.source_of(("algorithm", "name")) == "--set algorithm.name=fancy"
    assert sources.source_of(("train", "lr")) is None  # a default
    with pytest.warns(ConfigWarning, match="lists are replaced"):
        load_config([first, second], SELECT, registry=registry, environ={})


def test_override_values_are_toml_literals():
    assert parse_override("train.lr=1e-5") == (["train", "lr"], 1e-5)
    assert parse_override("a.b=[1, 2]") == (["a", "b"], [1, 2])
    assert parse_override("a.b=true") == (["a", "b"], True)
    assert parse_override("a.b=hello world") == (["a", "b"], "hello world")
    assert parse_override("run.name=2024-01-02") == (["run", "name"], "2024-01-02")
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_override("train.lr")
    with pytest.raises(ConfigError, match="empty key segment"):
        parse_override("train..lr=1")


def test_environment_values_parse_like_set_and_problems_name_the_variable(registry):
    cfg = load_config([], SELECT, registry=registry,
                      environ={"REASONCTL_TRAIN__BETAS": "[0.8, 0.9]",
                               "REASONCTL_ALGORITHM__FANCY__MODE": "b",
                               "REASONCTL_STRICT_PLUGINS": "0", "REASONCTL_CACHE": "/tmp/c"})
    assert cfg.train.betas == (0.8, 0.9)
    assert cfg.component_config("algorithm", "fancy").mode == "b"
    env = {
        "REASONCTL_TRAIN__BETAS": "(0.9,0.99)",
        "REASONCTL_TRIAN__LR": "1",
        "REASONCTL_TRAIN__LRR": "1",
        "REASONCTL_RUN__SEED": "nan",
        "REASONCTL_TRAIN__": "1",
        "REASONCTL_STRICT_PLUGIN": "1",
    }
    problems = problems_of([], SELECT, registry=registry, environ=env)
    text = "\n".join(problems)
    assert any(p.startswith("REASONCTL_TRAIN__BETAS: Input should be a valid tuple") and
               "'(0.9,0.99)'" in p for p in problems), text
    assert any(p.startswith("REASONCTL_TRIAN__LR: unknown config section 'trian'; did you mean "
                            "REASONCTL_TRAIN__LR?") for p in problems), text
    assert any(p.startswith("REASONCTL_TRAIN__LRR: unknown key; did you mean 'lr'?")
               for p in problems), text
    assert any(p.startswith("REASONCTL_RUN__SEED:") for p in problems), text
    assert any(p.startswith("REASONCTL_TRAIN__: empty name segment") for p in problems), text
    assert any("did you mean REASONCTL_STRICT_PLUGINS?" in p for p in problems), text
    assert len(problems) == 6, text


def test_credential_variables_are_not_config_and_only_close_names_get_a_suggestion(
        tmp_path, registry):
    named = write(tmp_path / "named.toml", '[[rewards.components]]\nname = "keyword"\n'
                                           'token_env = "REASONCTL_SVC__KEY"\n')
    env = {"REASONCTL_REWARD_TOKEN": "0123456789abcdef", "REASONCTL_API_KEY": "sk-123456",
           "REASONCTL_SVC__KEY": "named-by-the-config", "REASONCTL_HOME": "/tmp/h",
           "REASONCTL_TOKEN": "abcdef123456"}
    cfg = load_config([named], SELECT, registry=registry, environ=env)
    assert cfg.rewards.components[0].name == "keyword"
    # the variable a config names is a credential only for that config
    problems = problems_of([], SELECT, registry=registry, environ=env)
    assert problems == ["REASONCTL_SVC__KEY: unknown config section 'svc' (sections: "
                        + problems[0].split("(sections: ")[1]], problems
    # nothing close: no suggestion and no problem; close: the close name only
    close = problems_of([], SELECT, registry=registry,
                        environ={"REASONCTL_CACH": "/c", "REASONCTL_DISABLE_PLUGIN": "x"})
    assert close == ["REASONCTL_CACH: unknown variable; did you mean REASONCTL_CACHE?",
                     "REASONCTL_DISABLE_PLUGIN: unknown variable; did you mean "
                     "REASONCTL_DISABLE_PLUGINS?"]


def test_file_problems_name_the_file(tmp_path, registry):
    assert problems_of([tmp_path / "nope.toml"], SELECT, registry=registry, environ={}) == [
        f"{tmp_path / 'nope.toml'}: file not found (cwd: {Path.cwd()})"]
    broken = write(tmp_path / "broken.toml", "[train\nlr = 1\n")
    (problem,) = problems_of([broken], SELECT, registry=registry, environ={})
    assert problem.startswith(f"{broken}: invalid TOML")
    latin = tmp_path / "latin.toml"
    latin.write_bytes('[run]\nname = "caf\u00e9"\n'.encode("latin-1"))
    (problem,) = problems_of([latin], SELECT, registry=registry, environ={})
    assert problem.startswith(f"{latin}: not UTF-8 text (byte 0xe9 on line 2)")
    (problem,) = problems_of([tmp_path], SELECT, registry=registry, environ={})
    assert problem == f"{tmp_path}: is a directory; --config takes a TOML file"
    empty = write(tmp_path / "empty.toml", "")
    assert load_config([empty], SELECT, registry=registry, environ={}).train.lr == 1e-5


# --- strict schema --------------------------------------------------------------------------


def test_every_problem_reported_at_once(tmp_path, registry):
    bad = write(tmp_path / "bad.toml", "[trian]\nlr = 1\n[model]\ndtype = 'fp8'\n")
    problems = problems_of([bad], ["train.lr=fast"], registry=registry, environ={},
                           values={"algorithm": {"name": "fancyy"},
                                   "backend": {"name": "nullbackend"}})
    text = "\n".join(problems)
    assert any(p.startswith("trian: unknown key; did you mean 'train'?") for p in problems), text
    assert any(p.startswith("train.lr:") and "'fast'" in p for p in problems), text
    assert any(p.startswith("model.dtype:") and "'fp8'" in p for p in problems), text
    assert any(p.startswith("algorithm.name: Unknown algorithm 'fancyy'") and
               "Did you mean 'fancy'?" in p for p in problems), text
    assert len(problems) == 4, text


@pytest.mark.parametrize(("override", "expected"), [
    ("train.lr=nan", "train.lr: Input should be a finite number (got NaN)"),
    ("train.lr=inf", "train.lr: Input should be a finite number (got Infinity)"),
    ("train.lr=0", "train.lr: Input should be greater than 0 (got 0)"),
    ("train.lr=true", "train.lr: Input should be a valid number (got true)"),
    ("train.betas=[0.9, 1.0]", "train.betas.1: Input should be less than 1 (got 1.0)"),
    ("train.betas=[-0.1, 0.9]", "train.betas.0: Input should be greater than or equal to 0"),
    ("train.betas=[0.9]", "train.betas.1: item 1 is missing: too few items (got [0.9])"),
    ("train.adam_eps=0", "train.adam_eps: Input should be greater than 0 (got 0)"),
    ("train.epochs=1.5", "train.epochs: Input should be a valid integer (got 1.5)"),
    ("train.epochs='3'", "train.epochs: Input should be a valid integer (got '3')"),
    ("train.max_grad_norm=-inf", "train.max_grad_norm: Input should be a finite number"),
    ("run.seed=-1", "run.seed: Input should be greater than or equal to 0 (got -1)"),
    ("run.output_dir=''", "run.output_dir: String should have at least 1 character (got '')"),
    ("run.resume=3", "run.resume: Input should be a valid boolean or a valid string (got 3)"),
    ("data.shuffle='yes'", "data.shuffle: Input should be a valid boolean (got 'yes')"),
    ("model.freeze=['(open']", "model.freeze: Value error, '(open' is not a regular expression"),
    ("backend.device=gpu", "backend.device: Value error, expected auto, cpu, cuda, cuda:N or mps"),
    ("rewards.components=[{weight = 1}]", "rewards.components.0.name: required key is missing"),
])
def test_values_out_of_range_are_reported(registry, override, expected):
    (problem,) = problems_of([], [*SELECT, override], registry=registry, environ={})
    assert problem.startswith(expected), problem


def test_plugin_sections_reject_unknown_keys_even_without_forbid(registry):
    cfg = load_config([], [*SELECT, "algorithm.lax.gamma=0.25", "algorithm.lax.inner.depth=3",
                           "backend.open.anything=1"], registry=registry, environ={})
    lax = cfg.component_config("algorithm", "lax")
    assert type(lax) is LaxConfig and type(lax.inner) is Inner  # the author's own classes
    assert (lax.gamma, lax.inner.depth) == (0.25, 3)
    assert cfg.component_config("backend", "open").model_extra == {"anything": 1}
    problems = problems_of([], [*SELECT, "algorithm.lax.gama=1", "algorithm.lax.inner.deph=2",
                                "algorithm.fancy.betta=1"], registry=registry, environ={})
    assert sorted(p.split(" (valid keys")[0] for p in problems) == [
        "algorithm.fancy.betta: unknown key; did you mean 'beta'?",
        "algorithm.lax.gama: unknown key; did you mean 'gamma'?",
        "algorithm.lax.inner.deph: unknown key; did you mean 'depth'?",
    ]
    problems = problems_of([], [*SELECT, "algorithm.lax.gamma=nan", "algorithm.lax.ceiling=inf",
                                "algorithm.fancy.beta=-inf"], registry=registry, environ={})
    assert sorted(problems) == [
        "algorithm.fancy.beta: Input should be a finite number (got -Infinity)",
        "algorithm.lax.ceiling: Input should be a finite number (got Infinity)",
        "algorithm.lax.gamma: Input should be a finite number (got NaN)",
    ]


def test_reward_options_are_checked_with_everything_else(registry):
    entries = ('rewards.components=[{name = "keyword", min_hits = "many", keywordz = ["a"]}, '
               '{name = "plain", weight = 2, extra = 1}]')
    problems = problems_of([], [*SELECT, entries, "trian.lr=1"], registry=registry, environ={})
    text = "\n".join(problems)
    assert any(p.startswith("rewards.components.0.min_hits: Input should be a valid integer")
               for p in problems), text
    assert any(p.startswith("rewards.components.0.keywordz: unknown key; did you mean "
                            "'keywords'?") for p in problems), text
    assert "rewards.components.1.extra: reward 'plain' takes no options" in problems, text
    assert any(p.startswith("trian: unknown key") for p in problems), text
    assert len(problems) == 4, text
    cfg = load_config([], [*SELECT, 'rewards.components=[{name = "keyword", min_hits = 2}]'],
                      registry=registry, environ={})
    ((entry, options),) = cfg.reward_configs(registry)
    assert type(options) is KeywordOptions and options.min_hits == 2


def test_schema_lists_every_reward_with_its_options(registry):
    schema = config_json_schema(registry)
    variants = {v["title"]: v for v in schema["$defs"]["RewardComponent"]["anyOf"]}
    assert set(variants) == {"keyword", "plain", "module:function"}
    keyword = variants["keyword"]
    assert keyword["properties"]["name"] == {"const": "keyword"}
    assert {"weight", "keywords", "min_hits", "token_env"} <= set(keyword["properties"])
    assert keyword["additionalProperties"] is False
    assert schema["$defs"]["LaxConfig"]["additionalProperties"] is False  # validation forbids
    assert schema["properties"]["train"]


# --- secrets --------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["token", "hf_token", "api_key", "apiKey", "AWS_SECRET_ACCESS_KEY",
                                 "access_key", "accessKeyId", "private-key", "password",
                                 "db.passwd", "client_secret", "credentials", "x-api-key"])
def test_secret_keys_by_segment(key):
    assert is_secret_key(key)


@pytest.mark.parametrize("key", ["tokenizer", "max_tokens", "max_new_tokens", "keywords",
                                 "key_column", "pad_token", "eos_token", "token_env",
                                 "password_file", "monkey", "keys", "secretary_count"])
def test_ordinary_keys_are_not_secret(key):
    assert not is_secret_key(key)


def test_text_redaction_covers_urls_assignments_and_env_values(monkeypatch):
    monkeypatch.setenv("MY_SERVICE_API_KEY", "sk-live-abcdef123456")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    text = redact_text("push https://alice:hunter22@example.com/x and s3://AKIA1:s3cr3t@b/k "
                       "with token=abc123xyz, key sk-live-abcdef123456, tokenizer=qwen-tok")
    assert "hunter22" not in text and "alice" not in text and "s3cr3t" not in text
    assert "abc123xyz" not in text and "sk-live-abcdef123456" not in text
    assert "https://***@example.com/x" in text and "tokenizer=qwen-tok" in text
    assert redact_text("TOKENIZERS_PARALLELISM is false") == "TOKENIZERS_PARALLELISM is false"
    # where a secret comes from is not the secret; a value that only starts with $ is
    for hint in ("export REASONCTL_REWARD_TOKEN=$(openssl rand -hex 32)", "TOKEN=${HF_TOKEN}",
                 "api_key=$MY_KEY"):
        assert redact_text(hint) == hint
    assert redact_text("password=$ecret-value") == "password=***"


def test_saved_config_reproduces_the_run_and_hides_secrets(monkeypatch):
    host = PluginHost.load()  # the saved file names the default components explicitly
    host.add_plugin(FancyPlugin(), name="fancy-plugin")
    registry = host.registry
    monkeypatch.setenv("KEYWORD_SERVICE_TOKEN", "kw-service-secret-42")
    overrides = [*SELECT, "model.tokenizer='my-tokenizer'", "rollout.max_new_tokens=64",
                 "rollout.stop=['</answer>']",
                 'rewards.components=[{name = "keyword", keywords = ["key", "token"], '
                 'key_column = "question", token_env = "KEYWORD_SERVICE_TOKEN"}]',
                 "run.name='job-kw-service-secret-42'", "checkpoint.upload=['s3://u:pw@bucket/x']"]
    cfg = load_config([], overrides, registry=registry, environ={})
    saved = cfg.to_toml()
    assert "kw-service-secret-42" not in saved and ":pw@" not in saved
    shown = json.dumps(cfg.to_dict())
    for readable in ("my-tokenizer", '"max_new_tokens": 64', '"keywords": ["key", "token"]',
                     '"key_column": "question"', '"token_env": "KEYWORD_SERVICE_TOKEN"'):
        assert readable in shown
    plain = load_config([], [o for o in overrides if not o.startswith(("run.name", "checkpoint"))],
                        registry=registry, environ={})
    reloaded = reasonctl_config_from_text(plain.to_toml(), registry)
    assert reloaded.to_dict(redact=False) == plain.to_dict(redact=False)
    assert "kw-service-secret-42" in cfg.to_toml(redact=False)


def reasonctl_config_from_text(text: str, registry):
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as handle:
        handle.write(text)
    try:
        return load_config([handle.name], registry=registry, environ={})
    finally:
        Path(handle.name).unlink()


def test_secret_keys_are_redacted_in_nested_data():
    data = {"storage": {"hf": {"token": "hf_abc", "private": True}},
            "x": [{"api_key": "k1", "max_tokens": 5}], "pad_token": "<pad>"}
    assert redact_secrets(data) == {"storage": {"hf": {"token": "***", "private": True}},
                                    "x": [{"api_key": "***", "max_tokens": 5}],
                                    "pad_token": "<pad>"}
