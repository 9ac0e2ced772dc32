"""The recipes under ``examples/recipes/`` validate as users will run them: every layout of
every recipe passes ``reasonctl config validate --nproc-per-node N`` (the launcher's layout
check included) against config-only stand-ins of the real models, placed where the recipe
pages say to download them; the stand-ins carry the real architectures' sizes (checked on
the meta device, so no weights are ever built)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "examples" / "recipes"
SHAPES = RECIPES / "shapes"

MODELS = {
    "models/Qwen2.5-7B-Instruct": "qwen2_5_7b_instruct",
    "models/Qwen2.5-VL-7B-Instruct": "qwen2_5_vl_7b_instruct",
    "models/Qwen3-VL-8B-Instruct": "qwen3_vl_8b_instruct",
    "models/Cosmos-Predict2.5-2B-diffusers": "cosmos_predict2_5_2b",
    # the SFT stage's exports, which the GRPO stage starts from
    "outputs/cosmos_reason1_sft/export/final": "qwen2_5_vl_7b_instruct",
    "outputs/cosmos_reason2_sft/export/final": "qwen3_vl_8b_instruct",
}
"""Where docs/recipes/*.md put each model, and the shape standing in for it."""
DATA_FILES = ["data/gsm8k/main/train-00000-of-00001.parquet",
              "data/math/data/train-00000-of-00001.parquet", "data/predict_prompts.jsonl"]
DATA_DIRS = ["data/cosmos_reason1_sft/robovqa", "data/cosmos_reason1_rl/robovqa"]
"""The data paths the recipe pages download or write."""

CUDA_ONLY = "backend.name: 'megatron' needs CUDA GPUs"
NO_REDIS_SERVER = "rollout.workers.redis_url: unset, so `reasonctl run` starts redis-server"
"""Problems of this machine, not of a recipe: no GPU, no redis-server installed."""

VARIANTS = [
    ("qwen2_5_7b_math", ["grpo"], 8),
    ("qwen2_5_7b_math", ["grpo", "one_gpu"], 1),
    ("qwen2_5_7b_math", ["grpo", "megatron"], 8),
    ("qwen2_5_7b_math", ["grpo", "separate"], 4),
    ("qwen2_5_7b_math", ["grpo", "math_data"], 8),
    ("qwen2_5_7b_math", ["grpo", "math_data", "one_gpu"], 1),
    *[(recipe, files, n) for recipe in ("cosmos_reason1", "cosmos_reason2") for files, n in (
        (["sft"], 8), (["sft", "sft_one_gpu"], 1), (["grpo"], 8),
        (["grpo", "grpo_one_gpu"], 1), (["grpo", "grpo_separate"], 4))],
    ("cosmos_predict2_5", ["flow_grpo"], 8),
    ("cosmos_predict2_5", ["flow_grpo", "one_gpu"], 1),
]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A working directory laid out as the recipe pages say, models as config-only dirs."""
    root = tmp_path_factory.mktemp("recipes")
    for target, shape in MODELS.items():
        shutil.copytree(SHAPES / shape, root / target)
    for name in DATA_FILES:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).touch()
    for name in DATA_DIRS:
        (root / name).mkdir(parents=True)
    return root


def validate(workspace: Path, monkeypatch: pytest.MonkeyPatch, recipe: str,
             files: list[str], processes: int, *extra: str) -> tuple[int, str]:
    """``reasonctl config validate`` of the recipe's files, run from ``workspace``."""
    from reasonctl.cli import common
    from reasonctl.cli.app import build_app

    monkeypatch.chdir(workspace)
    # the recipe pages have users export the reward service's token before they run
    monkeypatch.setenv("REASONCTL_REWARD_TOKEN", "recipe-test-token")
    args = ["config", "validate", "--nproc-per-node", str(processes), *extra]
    for name in files:
        args += ["--config", str(RECIPES / recipe / f"{name}.toml")]
    result = CliRunner().invoke(build_app(common.init_host(strict=False)), args)
    return result.exit_code, result.output


@pytest.mark.parametrize(("recipe", "files", "processes"), VARIANTS,
                         ids=[f"{r}-{'+'.join(f)}-{n}" for r, f, n in VARIANTS])
def test_every_recipe_layout_validates(workspace: Path, monkeypatch: pytest.MonkeyPatch,
                                       recipe: str, files: list[str], processes: int) -> None:
    code, output = validate(workspace, monkeypatch, recipe, files, processes)
    expected = [text for text, needed in ((CUDA_ONLY, "megatron" in files),
                                          (NO_REDIS_SERVER, shutil.which("redis-server") is None
                                           and any("separate" in f for f in files)))
                if needed and not _has_cuda()]
    if not expected:
        assert code == 0 and output.startswith("ok:"), output  # and no warning before it
        return
    problems = [line for line in output.splitlines() if line.strip().startswith("- ")]
    assert code == 2 and len(problems) == len(expected), output
    assert all(any(text in line for line in problems) for text in expected), output


def test_layouts_that_do_not_fit_the_real_models_are_named(
        workspace: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stand-ins' real sizes reach the launcher's check: Qwen2.5-VL-7B's 28 heads do
    not split over 8 tensor-parallel ranks; 64 prompts do not split over 6 processes."""
    code, output = validate(workspace, monkeypatch, "cosmos_reason1", ["sft"], 8,
                            "--set", "backend.fsdp.tp=8")
    assert code == 2 and "backend.fsdp.tp: 8 does not divide the model's " \
        "num_attention_heads (28), num_key_value_heads (4)" in output, output
    code, output = validate(workspace, monkeypatch, "qwen2_5_7b_math", ["grpo"], 6)
    assert code == 2 and "prompts_per_step: 64 must be a positive multiple of the number " \
        "of data-parallel processes (6)" in output, output
    code, output = validate(workspace, monkeypatch, "qwen2_5_7b_math", ["grpo", "one_gpu"], 8)
    assert code == 2 and "the 'single' backend runs one process, not 8" in output, output


def test_the_reward_service_of_the_world_model_recipe_checks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from reasonctl.cli import common
    from reasonctl.cli.app import build_app

    monkeypatch.setenv("REASONCTL_REWARD_TOKEN", "0123456789abcdef" * 2)
    result = CliRunner().invoke(build_app(common.init_host(strict=False)), [
        "serve-rewards", "--config", str(RECIPES / "cosmos_predict2_5" / "reward_service.toml"),
        "--check"])
    assert result.exit_code == 0 and "serves brightness" in result.output, result.output


@pytest.mark.parametrize(("shape", "billions"), [
    ("qwen2_5_7b_instruct", 7.62), ("qwen2_5_vl_7b_instruct", 8.29),
    ("qwen3_vl_8b_instruct", 8.77), ("cosmos_predict2_5_2b", 2.06),
])
def test_shapes_have_the_published_parameter_counts(shape: str, billions: float) -> None:
    """Built on the meta device: sizes without storage."""
    import torch

    path = SHAPES / shape
    with torch.device("meta"):
        if (path / "model_index.json").is_file():
            from diffusers import CosmosTransformer3DModel

            model = CosmosTransformer3DModel.from_config(
                CosmosTransformer3DModel.load_config(path / "transformer"))
        else:
            from transformers import AutoConfig

            from reasonctl.models.loading import auto_model_class

            config = AutoConfig.from_pretrained(path)
            model = auto_model_class(config).from_config(config)
    count = sum(p.numel() for p in model.parameters())
    assert all(p.is_meta for p in model.parameters())
    assert count / 1e9 == pytest.approx(billions, abs=0.01)


def _has_cuda() -> bool:
    from reasonctl.backends.layout import cuda_present

    return cuda_present()
