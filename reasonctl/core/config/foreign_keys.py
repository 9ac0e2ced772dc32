"""Key names users bring from cosmos-rl configs, and reasonctl's key for each.

A config model may add hints for its own section with a class attribute ``foreign_keys``
(``ClassVar[dict[str, str]]``, key -> what to write instead); they win over these.

An unknown key that is one of these gets a hint naming what to write instead; an unknown
table (``[train.ckpt]``, ``[policy]`` ...) also lists the hints of the keys inside it, so
one validation run shows how to translate the whole section.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

COSMOS_RL_KEYS: dict[str, str] = {
    # data
    "annotation_path": "data.llava.path (data.format = 'llava')",
    "media_path": "data.<format>.media_root",
    "dataset": "[data] with data.format (e.g. [data.hf] name/subset/split)",
    "subset": "data.hf.subset",
    "train_policy": "[algorithm.sft] / [algorithm.grpo] and [data]",
    "model_max_length": "model.max_length",
    "model_gradient_checkpointing": "model.gradient_checkpointing",
    # model and run
    "policy": "[model] (model.name_or_path ...) and [backend]",
    "model_name_or_path": "model.name_or_path",
    "output_dir": "run.output_dir",
    "experiment_name": "run.name",
    "project_name": "logging.wandb.project",
    # training
    "epoch": "train.epochs",
    "train_batch_per_replica": "train.global_batch_size (all processes together) with "
                               "train.micro_batch_size",
    "optm_lr": "train.lr",
    "optm_weight_decay": "train.weight_decay",
    "optm_grad_norm_clip": "train.max_grad_norm",
    "optm_warmup_steps": "train.warmup_steps",
    "optm_betas": "train.betas",
    # checkpoints
    "ckpt": "[checkpoint]",
    "enable_checkpoint": "checkpoint.every_steps (0 disables periodic checkpoints)",
    "save_freq": "checkpoint.every_steps",
    "max_keep": "checkpoint.keep",
    "save_mode": "checkpoint.async_save = true",
    "export_safetensors": "checkpoint.export_final (a Hugging Face model directory)",
    "upload_hf": "checkpoint.upload = ['hf://org/repo']",
    "hf_repo_name": "checkpoint.upload = ['hf://org/repo']",
    "upload_s3": "checkpoint.upload = ['s3://bucket/prefix']",
    "s3_bucket": "checkpoint.upload = ['s3://bucket/prefix']",
    "s3_prefix": "checkpoint.upload = ['s3://bucket/prefix']",
    # parallelism
    "parallelism": "[backend] (backend.name = 'fsdp' and --nproc-per-node N)",
    "dp_shard_size": "--nproc-per-node N with backend.name = 'fsdp'",
    "tp_size": "backend.megatron.tp (or backend.fsdp.tp)",
    "pp_size": "backend.megatron.pp",
    # RL
    "grpo": "[algorithm.grpo] (with algorithm.name = 'grpo')",
    "n_generation": "rollout.n",
    "num_samples_per_prompt": "rollout.n",
    "rollout_batch_size": "algorithm.grpo.prompts_per_step",
    "kl_penalty": "algorithm.grpo.kl_beta",
    "mu_iterations": "algorithm.grpo.ppo_epochs",
    "max_response_length": "rollout.max_new_tokens",
    "mini_batch": "algorithm.grpo.mini_batches (algorithm.flow_grpo.mini_batches for a "
                  "diffusion model)",
    # diffusion models ([policy.diffusers] ...)
    "diffusers": "[algorithm.flow_grpo] or [algorithm.ddrl] (algorithm.name), with "
                 "model.name_or_path a diffusers pipeline directory",
    "is_diffusers": "model.name_or_path naming a diffusers pipeline directory (its "
                    "model_index.json says so)",
    "timestep_fraction": "algorithm.flow_grpo.train_fraction (or train_steps)",
    "eval_num_steps": "algorithm.flow_grpo.eval_steps",
    "inference_size": "algorithm.flow_grpo.height and width",
    "max_prompt_length": "algorithm.flow_grpo.max_text_tokens",
    "advantage_high": "algorithm.flow_grpo.adv_clip_max",
    "advantage_low": "algorithm.flow_grpo.adv_clip_max",
    "lora": "[model.lora]",
    "lora_alpha": "model.lora.alpha",
}
"""cosmos-rl key (its last segment) -> where the setting lives in reasonctl."""

COSMOS_RL_PATHS: dict[str, str] = {
    "rollout.parallelism": "rollout.vllm.tensor_parallel_size (or "
                           "rollout.workers.tensor_parallel for separate workers)",
    "rollout.parallelism.tp_size": "rollout.vllm.tensor_parallel_size",
}
"""cosmos-rl keys whose meaning depends on their table (dotted path -> reasonctl's key);
looked up before :data:`COSMOS_RL_KEYS` (``tp_size`` of the rollout is not the trainer's)."""


def foreign_key_hint(key: str, value: Any = None, path: str = "",
                     section_keys: Mapping[str, str] | None = None) -> str | None:
    """The hint for an unknown ``key`` that cosmos-rl users write (``value`` is what the
    config gave it: for a table, its keys get hints too; ``path`` is its dotted location,
    for the keys whose meaning depends on it); ``None`` for other keys.

    ``section_keys`` are the hints of the section the key is in (a config model's
    ``foreign_keys``: ``{"their key": "what to write here instead"}``); they win over the
    general ones, since a key's meaning can depend on the section."""
    if section_keys and key in section_keys:
        return f"for {key!r} write {section_keys[key]}"
    target = COSMOS_RL_PATHS.get(path) or COSMOS_RL_KEYS.get(key)
    parts = path.split(".")
    if target and len(parts) == 3 and parts[0] == "data":  # [data.llava] media_path
        target = target.replace("data.<format>", f"data.{parts[1]}")
    inner = list(_nested_hints(value, "", path))
    if target is None and not inner:
        return None
    text = f"cosmos-rl's {key!r} is reasonctl's {target}" if target else \
        f"this looks like a cosmos-rl section ({key!r})"
    if inner:
        text += "; inside it: " + ", ".join(inner)
    return text


def _nested_hints(value: Any, prefix: str, base: str = "") -> list[str]:
    if not isinstance(value, Mapping):
        return []
    out = []
    for key, inner in value.items():
        path = f"{prefix}{key}"
        target = COSMOS_RL_PATHS.get(f"{base}.{path}") or COSMOS_RL_KEYS.get(key)
        if target:
            out.append(f"{path} -> {target}")
        out += _nested_hints(inner, f"{path}.", base)
    return out
