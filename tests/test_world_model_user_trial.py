"""What a new user of world-model RL runs into: commands from the docs on their own
pipelines and data, and the mistakes people bring from cosmos-rl and flow_grpo configs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.diffusion_support import tiny_pipelines  # noqa: F401


def _cli() -> Any:
    from typer.testing import CliRunner

    from reasonctl.cli.app import build_app
    from reasonctl.core.plugins import PluginHost

    app = build_app(PluginHost.load())
    runner = CliRunner()
    return lambda *args: runner.invoke(app, [str(a) for a in args])


def _lora_export(base: Path, out: Path) -> Path:
    """A LoRA export as ``reasonctl run`` writes it with ``export = "adapter"``: diffusers'
    ``pytorch_lora_weights.safetensors`` and the manifest naming the base pipeline."""
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    transformer = SD3Transformer2DModel.from_pretrained(base / "transformer")
    transformer.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_v"]))
    with torch.no_grad():
        for name, param in transformer.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    StableDiffusion3Pipeline.save_lora_weights(
        out, transformer_lora_layers=get_peft_model_state_dict(transformer))
    (out / "reasonctl_lora.json").write_text(json.dumps(
        {"base_model": str(base), "pipeline": "StableDiffusion3Pipeline", "lora": {}}))
    return out


def test_infer_generates_from_a_lora_adapter_export(
        tmp_path: Path, tiny_pipelines: dict[str, Path]) -> None:  # noqa: F811
    from PIL import Image

    base = tiny_pipelines["sd3"]
    export = _lora_export(base, tmp_path / "export")
    invoke = _cli()
    common = ["--prompt", "a red square", "--height", 32, "--width", 32, "--steps", 2]
    plain = invoke("infer", "--model", base, *common, "--output", tmp_path / "base.png")
    adapted = invoke("infer", "--model", export, *common, "--output", tmp_path / "lora.png")
    assert plain.exit_code == 0, plain.output
    assert adapted.exit_code == 0, adapted.output
    before = np.asarray(Image.open(tmp_path / "base.png"), dtype=np.int16)
    after = np.asarray(Image.open(tmp_path / "lora.png"), dtype=np.int16)
    assert np.abs(before - after).max() > 0  # the adapters were applied


def _write_config(path: Path, config: dict[str, Any]) -> Path:
    import tomli_w

    path.write_text(tomli_w.dumps(config))
    return path


def test_a_pipeline_of_an_unsupported_class_is_a_config_error_before_loading(
        tmp_path: Path) -> None:
    from tests.diffusion_support import run_config

    pipe = tmp_path / "flux"
    (pipe / "transformer").mkdir(parents=True)
    (pipe / "model_index.json").write_text(json.dumps(
        {"_class_name": "FluxPipeline", "transformer": ["diffusers", "FluxTransformer2DModel"]}))
    (pipe / "transformer" / "config.json").write_text('{"_class_name": "FluxTransformer2DModel"}')
    config = _write_config(tmp_path / "run.toml", run_config(tmp_path / "out", pipe))
    for command in ("run", "config validate"):
        result = _cli()(*command.split(), "--config", config)
        assert result.exit_code == 2, result.output
        assert "model.name_or_path" in result.output
        assert "FluxTransformer2DModel" in result.output
        assert "SD3Transformer2DModel" in result.output  # what is supported


def test_keys_from_cosmos_rl_and_flow_grpo_configs_are_answered_with_ours(
        tmp_path: Path) -> None:
    from tests.diffusion_support import run_config

    config = run_config(tmp_path / "out", Path("tiny-random-sd3"),
                        lora={"r": 8, "lora_alpha": 16, "init_lora_weights": "gaussian"})
    config["algorithm"]["flow_grpo"].update(
        timestep_fraction=0.5, num_steps=10, same_latent=True, mini_batch=2, data_beta=0.1,
        guidance=4.5, beta=0.004)
    result = _cli()("config", "validate", "--config",
                    _write_config(tmp_path / "run.toml", config))
    assert result.exit_code == 2, result.output
    lines = {line.split(": unknown key; ")[0].strip(" -"): line.split(": unknown key; ")[1]
             for line in result.output.splitlines() if ": unknown key; " in line}
    expected = {
        "model.lora.r": "write rank", "model.lora.lora_alpha": "write alpha",
        "model.lora.init_lora_weights": "write init",
        "algorithm.flow_grpo.timestep_fraction": "write train_fraction",
        "algorithm.flow_grpo.num_steps": "write sample_steps",
        "algorithm.flow_grpo.same_latent": "write shared_noise",
        "algorithm.flow_grpo.mini_batch": "write mini_batches",  # not GRPO's key
        "algorithm.flow_grpo.data_beta": "algorithm.name = 'ddrl'",
        "algorithm.flow_grpo.guidance": "write guidance_scale",
        "algorithm.flow_grpo.beta": "write kl_beta",
    }
    assert set(lines) == set(expected), result.output
    for path, hint in expected.items():
        assert hint in lines[path], (path, lines[path])
    # a cosmos-rl diffusion config pasted whole: its tables list reasonctl's keys
    pasted = {"policy": {"model_name_or_path": "sd3", "lora": {"lora_alpha": 64},
                         "diffusers": {"timestep_fraction": 0.99,
                                       "sample": {"eval_num_steps": 40}}}}
    result = _cli()("config", "validate", "--config",
                    _write_config(tmp_path / "pasted.toml", pasted))
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    for hint in ("diffusers.timestep_fraction -> algorithm.flow_grpo.train_fraction",
                 "diffusers.sample.eval_num_steps -> algorithm.flow_grpo.eval_steps",
                 "lora.lora_alpha -> model.lora.alpha"):
        assert hint in text, text


def test_the_remote_reward_checks_token_rewards_and_media_with_the_service_when_built(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    import time

    import reasonctl
    from reasonctl.core.errors import RewardError, UsageError
    from reasonctl.core.types import ContentPart, Message, Sample
    from reasonctl.rewards.remote import RemoteConfig, remote_reward
    from tests.service_support import TOKEN, InProcessService, service_config

    def remote(**options: Any) -> Any:
        return remote_reward(RemoteConfig(url=url, **options))

    monkeypatch.setenv("REASONCTL_REWARD_TOKEN", TOKEN)
    samples = [Sample([Message("user", [ContentPart("text", text="a red square")])])]
    white = [np.full((1, 4, 4, 3), 255, np.uint8)]  # an image model's sample, as a clip
    registry = reasonctl.plugin_host().registry
    with InProcessService(service_config([{"name": "brightness"}]), registry) as service:
        url = service.url
        with pytest.raises(UsageError, match='scores video there, and this reward sends '
                                             'image; set media_type = "video"'):
            remote(rewards={"brightness": 1.0}, media_type="image")
        with pytest.raises(UsageError, match="'brightnes' is not served there \\(did you "
                                             "mean 'brightness'\\?\\)"):
            remote(rewards={"brightnes": 1.0}, media_type="video")
        reward = remote(rewards={"brightness": 1.0}, media_type="video", on_error="zero")
        assert reward(white, samples) == [1.0]
        # a refused request is not a failed one: on_error = "zero" does not hide it
        reward.client._client.headers["Authorization"] = "Bearer another-token-0123456789"
        with pytest.raises(RewardError, match="refused the token in REASONCTL_REWARD_TOKEN"):
            reward(white, samples)
        monkeypatch.setenv("REASONCTL_REWARD_TOKEN", "another-token-0123456789")
        with pytest.raises(UsageError, match="refused the token in REASONCTL_REWARD_TOKEN "
                                             "\\(HTTP 401\\); export there a token"):
            remote(rewards={"brightness": 1.0}, media_type="video")
    # the service is down: built with a warning, each batch fails within the timeout
    reward = remote(rewards={"brightness": 1.0}, media_type="video", timeout=2)
    start = time.monotonic()
    with pytest.raises(RewardError, match="did not accept the request before the deadline"):
        reward(white, samples)
    assert time.monotonic() - start < 10


def test_data_check_reads_a_video_text_set_and_names_clips_too_short_for_ddrl(
        tmp_path: Path) -> None:
    from tests.diffusion_support import run_config, write_clip, write_video_text

    root = write_video_text(tmp_path / "clips", {"short1": "a cat", "short2": "a dog"},
                            frames=5)
    write_clip(root / "videos" / "long.mp4", 200, frames=9)
    (root / "metas" / "long.txt").write_text("a white room\n")
    config = run_config(tmp_path / "out", Path("tiny-random-wan"), algorithm="ddrl", frames=9)
    config["data"] = {"format": "video_text", "video_text": {"root": str(root)}}
    ddrl = _write_config(tmp_path / "ddrl.toml", config)
    result = _cli()("data", "check", "--config", ddrl)
    assert result.exit_code == 1, result.output
    assert "rows: 3 read, 1 usable, 2 bad" in result.output
    assert "short1.mp4: has 5 frame(s), algorithm.ddrl.frames = 9 are read" in result.output
    # FlowGRPO reads no clip (text-to-video): the same files are all usable
    config["algorithm"] = {"name": "flow_grpo", "flow_grpo": config["algorithm"]["ddrl"]}
    flow = _write_config(tmp_path / "flow.toml", config)
    result = _cli()("data", "check", "--config", flow)
    assert result.exit_code == 0, result.output
    assert "rows: 3 read, 3 usable, 0 bad" in result.output


def test_embeddings_the_model_cannot_take_are_found_before_the_first_step(
        tmp_path: Path, tiny_pipelines: dict[str, Path]) -> None:  # noqa: F811
    from safetensors.torch import save_file

    import reasonctl
    from reasonctl.core.errors import DataError
    from tests.diffusion_support import run_config, write_video_text

    root = write_video_text(tmp_path / "clips", {"a": "a cat", "b": "a dog", "c": "a room"})
    (root / "text_embeddings").mkdir()
    save_file({"prompt_embeds": torch.zeros(6, 32)}, root / "text_embeddings" / "a.safetensors")
    save_file({"prompt_embeds": torch.zeros(512, 1024)},
              root / "text_embeddings" / "b.safetensors")  # another encoder's (T5-XXL-like)
    config = run_config(tmp_path / "out", tiny_pipelines["wan"], frames=5, steps=1)
    config["data"] = {"format": "video_text", "video_text": {"root": str(root)}}
    with pytest.raises(DataError, match=r"b\.safetensors: prompt_embeds has shape \[512, "
                                        r"1024\], but WanTransformer3DModel takes") as error:
        reasonctl.run(config)
    assert "a.safetensors" not in str(error.value)
    assert not (tmp_path / "out" / "metrics.jsonl").exists()  # no step ran
    config["data"]["on_bad_row"] = "skip"
    result = reasonctl.run(config)
    assert result.status == "completed" and result.skipped_rows == 1
    skipped = (tmp_path / "out" / "skipped_rows.jsonl").read_text()
    assert "b.safetensors" in skipped and "a.safetensors" not in skipped


def test_the_remote_reward_takes_a_list_of_reward_names() -> None:
    from pydantic import ValidationError

    from reasonctl.rewards.remote import RemoteConfig

    config = RemoteConfig(url="http://127.0.0.1:1", rewards=["brightness", "color"])
    assert config.rewards == {"brightness": 1.0, "color": 1.0}
    with pytest.raises(ValidationError):
        RemoteConfig(url="http://127.0.0.1:1", rewards=[1, 2])


def test_train_steps_out_of_range_are_named_at_their_key_with_the_fix(tmp_path: Path) -> None:
    from tests.diffusion_support import run_config

    config = run_config(tmp_path / "out", Path("tiny-random-sd3"), train_steps=[0, 9],
                        train_fraction=1.0, prompts_per_step=2, mini_batches=4)
    result = _cli()("config", "validate", "--config",
                    _write_config(tmp_path / "run.toml", config))
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert ("algorithm.flow_grpo.train_steps: [9] outside 0..3 (sample_steps = 4; indices "
            "count from 0): drop them or raise sample_steps (got [0, 9])") in text
    assert "algorithm.flow_grpo.mini_batches: 4 cannot exceed prompts_per_step (2)" in text
    assert "Value error" not in text and "{" not in text  # no dump of the whole section


def test_an_sd3_resolution_beyond_its_position_embeddings_is_a_usage_error(
        tiny_pipelines: dict[str, Path]) -> None:  # noqa: F811
    result = _cli()("infer", "--model", tiny_pipelines["sd3"], "--prompt", "x",
                    "--height", 1024, "--width", 32, "--steps", 1)
    assert result.exit_code == 2, result.output
    assert ("--height: 1024 is more than this SD3Transformer2DModel takes (512: "
            "pos_embed_max_size 32") in " ".join(result.output.split())
