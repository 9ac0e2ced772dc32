"""The typed sections of a run's configuration and :class:`RunConfig`, which holds them.

Every section forbids unknown keys and rejects NaN and infinity; value constraints that
need nothing outside the config (``train.lr > 0``, ``betas`` in ``[0, 1)``, ``seed >= 0``)
live here, next to the fields. Checks of the outside world (files, devices) are in
:mod:`reasonctl.core.config.preflight`.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from reasonctl.core.config.markers import InputPath
from reasonctl.core.config.placement import Placement, RolloutWorkersSection
from reasonctl.core.config.redaction import redact_secrets
from reasonctl.core.config.section import DEVICE_PATTERN, STRICT, Section

if TYPE_CHECKING:
    from reasonctl.core.registry import Registry

AnswerFormat = Literal["letter", "reasoning", "free", "math"]

MAX_SEED = 2**63 - 1

Probability = Annotated[float, Field(ge=0, lt=1)]


class RunSection(Section):
    """``[run]``: identity and place of the run."""

    name: str = Field(default="run", min_length=1)
    output_dir: str = Field(default="outputs/run", min_length=1)
    seed: int = Field(default=0, ge=0, le=MAX_SEED)
    resume: bool | str = Field(
        default=False,
        description="true: newest complete checkpoint in output_dir; a path: that checkpoint.",
    )
    resume_with_changes: bool = Field(
        default=False,
        description="Resume even though the model, data, train, algorithm, rollout or rewards "
        "settings differ from the checkpoint's: print what changed and apply the new values. "
        "Without it such a resume is refused.",
    )
    on_signal: Literal["checkpoint", "exit"] = "checkpoint"


LoraPreset = Literal["all-linear", "attention", "mlp"]
MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*$")
"""A plain dotted module name (``q_proj``, ``self_attn.q_proj``); anything else is a regex."""


class LoraSection(Section):
    """``[model.lora]``: train low-rank adapters (peft LoRA) instead of the full weights.

    Present (even empty) means on. The base weights stay frozen; only the adapters and the
    ``modules_to_save`` train, checkpoints hold only those, and the KL reference of RL is
    the base model with the adapters switched off. The same section adapts the diffusion
    transformer of a diffusers pipeline (``flow_grpo``, ``ddrl``): presets then name its
    blocks' attention and feed-forward projections, and ``export = "adapter"`` writes a
    diffusers LoRA file (``load_lora_weights``) instead of a peft directory.
    """

    foreign_keys: ClassVar[dict[str, str]] = {
        "r": "rank", "lora_alpha": "alpha", "lora_dropout": "dropout",
        "init_lora_weights": "init ('kaiming' or 'gaussian')"}
    """peft's ``LoraConfig`` names (cosmos-rl's ``[policy.lora]``) and the keys here."""

    rank: int = Field(default=16, gt=0, description="Rank r of each adapter.")
    alpha: float = Field(
        default=32.0, gt=0, description="Scaling numerator: updates are scaled by alpha / rank."
    )
    dropout: float = Field(default=0.0, ge=0, lt=1, description="Dropout on adapter inputs.")
    target_modules: LoraPreset | list[str] = Field(
        default="all-linear",
        description="A preset of the model family (Qwen2/2.5/3, Qwen2-VL/2.5-VL/3-VL "
        "language tower): 'all-linear' (attention and MLP projections), 'attention' "
        "(q/k/v/o) or 'mlp' (gate/up/down); for a diffusion transformer the linear layers "
        "of its blocks' attention (to_q/k/v, to_out.0, add_*_proj) and feed-forward "
        "networks. Or a list of linear module names (q_proj, self_attn.o_proj, to_out.0: "
        "matched at the end of the full name) and regexes (searched in the full name, "
        "e.g. 'layers\\.1[0-9]\\..*proj$').",
    )
    include_vision: bool = Field(
        default=False,
        description="Also adapt the vision tower of a vision-language model (frozen by "
        "default); presets then add its attention and MLP projections.",
    )
    modules_to_save: list[str] = Field(
        default_factory=list,
        description="Modules trained in full next to the adapters (e.g. embed_tokens; its "
        "tied output head follows), by module name.",
    )
    export: Literal["merged", "adapter"] = Field(
        default="merged",
        description="merged: a Hugging Face model (a diffusers pipeline directory for a "
        "diffusion transformer) with the adapters merged into the weights; adapter: a peft "
        "adapter directory for PeftModel.from_pretrained on the base model (for a diffusion "
        "transformer a diffusers LoRA file for the pipeline's load_lora_weights).",
    )
    init: Literal["kaiming", "gaussian"] = Field(
        default="kaiming",
        description="Initial A matrices: kaiming-uniform (peft's default) or gaussian (as "
        "the FlowGRPO reference code); B starts at zero either way, so training starts "
        "from the base model.",
    )

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list):
            if not value:
                raise ValueError("list at least one module name or regex, or use a preset")
            for entry in value:
                if not MODULE_NAME.match(entry):
                    try:
                        re.compile(entry)
                    except re.error as exc:
                        raise ValueError(
                            f"{entry!r} is neither a module name nor a regular expression: {exc}"
                        ) from exc
        return value

    @field_validator("modules_to_save")
    @classmethod
    def _names(cls, value: list[str]) -> list[str]:
        for entry in value:
            if not MODULE_NAME.match(entry):
                raise ValueError(f"{entry!r} is not a module name (e.g. 'embed_tokens')")
        return value


class ModelSection(Section):
    """``[model]``: what to train."""

    name_or_path: str = Field(default="tiny-random", min_length=1)
    tokenizer: str | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    attention: Literal["sdpa", "eager", "flash_attention_2", "flex_attention"] = "sdpa"
    gradient_checkpointing: bool | Literal["auto"] = Field(
        default=False, description="Recompute activations in backward to save memory. "
        "\"auto\": a diffusion transformer checkpoints only the blocks memory needs "
        "(measured at the first update); a language model checkpoints all (as true).")
    trust_remote_code: bool = False
    max_length: int = Field(default=2048, gt=0)
    freeze: list[str] = Field(default_factory=list, description="Regexes of frozen params.")
    trainable: list[str] = Field(
        default_factory=list, description="If set, only params matching these regexes train."
    )
    lora: LoraSection | None = Field(
        default=None, description="Train LoRA adapters instead of the full weights."
    )

    @field_validator("freeze", "trainable")
    @classmethod
    def _compile(cls, patterns: list[str]) -> list[str]:
        for pattern in patterns:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"{pattern!r} is not a regular expression: {exc}") from exc
        return patterns

    @model_validator(mode="after")
    def _lora_alone(self) -> ModelSection:
        if self.lora is not None and (self.freeze or self.trainable):
            raise ValueError(
                "model.freeze / model.trainable select full weights to train and cannot be "
                "combined with [model.lora]; with LoRA the base is frozen and "
                "model.lora.modules_to_save names modules to train in full"
            )
        return self


class DataSection(Section):
    """``[data]``: training data; the format's own keys go in ``[data.<format>]``."""

    format: str = Field(default="jsonl", min_length=1)
    on_bad_row: Literal["error", "skip"] = "error"
    shuffle: bool = True
    max_samples: int | None = Field(default=None, gt=0)
    packing: bool = False
    system_prompt: str | None = None
    prompt_template: str | None = None


class TrainSection(Section):
    """``[train]``: optimisation."""

    lr: float = Field(default=1e-5, gt=0)
    max_steps: int | None = Field(default=None, gt=0)
    epochs: int = Field(default=1, gt=0)
    global_batch_size: int = Field(default=8, gt=0)
    micro_batch_size: int = Field(default=1, gt=0)
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = Field(default=0, ge=0)
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)
    weight_decay: float = Field(default=0.0, ge=0)
    betas: tuple[Probability, Probability] = Field(default=(0.9, 0.999), strict=False)
    adam_eps: float = Field(default=1e-8, gt=0)
    max_grad_norm: float = Field(default=1.0, ge=0, description="0 disables clipping.")
    compile: bool = False
    on_nonfinite: Literal["stop", "skip"] = Field(
        default="stop",
        description="A step whose loss or gradient norm is NaN or infinite: 'stop' ends the "
        "run with an error (checkpoints intact, nothing exported); 'skip' leaves the weights "
        "unchanged, counts the step and goes on.",
    )


class AlgorithmSection(Section):
    """``[algorithm]``: which algorithm; its own keys go in ``[algorithm.<name>]``."""

    name: str = Field(default="sft", min_length=1)


class BackendSection(Section):
    """``[backend]``: which parallelism backend; its keys go in ``[backend.<name>]``."""

    name: str = Field(default="single", min_length=1)
    device: str = Field(default="auto", description="auto, cpu, cuda or cuda:N (also mps).")
    cpu_threads: int | None = Field(
        default=None, gt=0,
        description="Torch threads per process when the device is the CPU. Unset: "
        "OMP_NUM_THREADS when exported, else 1 (small models run fastest on one thread; "
        "raise it for bigger models on an idle machine).",
    )

    @field_validator("device")
    @classmethod
    def _known_device(cls, device: str) -> str:
        if not DEVICE_PATTERN.match(device):
            raise ValueError("expected auto, cpu, cuda, cuda:N or mps")
        return device


class RolloutSection(Section):
    """``[rollout]``: sampling for RL and evaluation; engine keys in ``[rollout.<engine>]``,
    separate rollout workers in ``[rollout.workers]``."""

    engine: str = Field(default="hf", min_length=1)
    placement: Placement = Field(
        default="colocated",
        description="colocated: generate in the trainer processes. separate: rollout "
        "workers on their own devices, connected through Redis ([rollout.workers]).",
    )
    workers: RolloutWorkersSection = Field(default_factory=RolloutWorkersSection)
    n: int = Field(default=8, gt=0)
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)
    max_new_tokens: int = Field(default=256, gt=0)
    stop: list[str] = Field(default_factory=list)
    suppress_tokens: list[str | int] = Field(
        default_factory=list,
        description="Tokens (strings or ids) never sampled, besides those the processor "
        "reserves (vision placeholders and markers, <|im_start|>, padding).",
    )


class EnvironmentSection(Section):
    """``[environment]``: multi-turn episodes with tools; the environment's own keys go in
    ``[environment.<name>]``. Without ``name`` every rollout is one turn."""

    name: str | None = Field(
        default=None, min_length=1,
        description="The environment rollouts run episodes in (e.g. 'tools'); unset: "
        "single-turn rollouts.")
    max_turns: int = Field(
        default=4, gt=0,
        description="Policy turns per episode at most; each turn generates up to "
        "rollout.max_new_tokens tokens.")
    max_completion_tokens: int | None = Field(
        default=None, gt=0,
        description="Tokens after the prompt per episode at most, generated and observation "
        "tokens together; an episode that reaches it ends with finish reason 'length'. "
        "Default: no bound beyond max_turns turns of rollout.max_new_tokens and the "
        "environment's own limits on observations.")
    reward_weight: float = Field(
        default=1.0, description="Weight of the environment's own reward (component "
        "'environment') in the total; environments without one add nothing.")
    concurrency: int = Field(
        default=8, gt=0,
        description="Episodes whose turns the environment answers at once (threads), so "
        "tool calls of different episodes run in parallel.")


class RewardComponent(BaseModel):
    """One ``[[rewards.components]]`` entry; extra keys go to the reward's config model."""

    model_config = ConfigDict(extra="allow", validate_assignment=True, allow_inf_nan=False,
                              strict=True)

    name: str = Field(min_length=1)
    weight: float = 1.0


class RewardsSection(Section):
    """``[rewards]``: the weighted reward terms and what to do when one raises."""

    components: list[RewardComponent] = Field(default_factory=list)
    on_error: Literal["raise", "zero"] = "raise"


class CheckpointSection(Section):
    """``[checkpoint]``: saving, pruning, exporting and uploading."""

    every_steps: int = Field(default=0, ge=0, description="0 disables periodic checkpoints.")
    keep: int = Field(default=2, gt=0)
    async_save: bool = Field(
        default=False,
        description="Copy the checkpoint state to host memory and write it in a background "
        "thread while training goes on; it is committed (renamed, pruned, uploaded) once "
        "written. The megatron backend always writes synchronously.",
    )
    export_final: bool = True
    export_every_checkpoint: bool = False
    export_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    upload: list[str] = Field(default_factory=list, description="Storage URIs to upload to.")
    upload_when: Literal["final", "every"] = "final"
    upload_attempts: int = Field(
        default=3, gt=0,
        description="Attempts per uploaded directory or file (each attempt also retries as "
        "[storage.<scheme>] says); errors that cannot succeed (no credentials, access "
        "denied, no such bucket) are not retried.",
    )
    upload_wait_s: float = Field(
        default=900.0, gt=0,
        description="Longest the end of the run waits for pending uploads; what is not "
        "uploaded by then is reported and kept locally to push later (reasonctl upload).",
    )


class LoggingSection(Section):
    """``[logging]``: metric sinks; each logger's keys go in ``[logging.<name>]``."""

    loggers: list[str] = Field(default_factory=lambda: ["console", "jsonl"])
    every_steps: int = Field(default=1, gt=0)
    plot: bool = True


class EvalDataset(Section):
    """One ``[[eval.datasets]]`` entry: a benchmark that ``reasonctl eval`` scores."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
                      description="Names the results sub-directory and the table row.")
    path: str = Field(min_length=1, description="Data file, directory or dataset name.")
    format: str | None = Field(default=None, description="Data format (default data.format).")
    answer_format: AnswerFormat | None = Field(
        default=None, description="Default eval.answer_format.")
    max_samples: int | None = Field(default=None, gt=0)
    fps: float | None = Field(default=None, gt=0, description="Default eval.fps.")
    max_pixels: int | None = Field(default=None, gt=0, description="Default eval.max_pixels.")


class EvalSection(Section):
    """``[eval]``: evaluation data, generation settings and answer judging."""

    data: Annotated[str | None, InputPath("file")] = Field(
        default=None, description="Evaluation file (JSON Lines), checked before the run."
    )
    every_steps: int = Field(default=0, ge=0)
    answer_format: AnswerFormat = Field(
        default="reasoning",
        description="How answers are judged: letter (choice reward), math (math reward), "
        "free (exact_match reward), reasoning (an <answer> block, judged by the reward that "
        "fits the sample).",
    )
    max_samples: int | None = Field(default=None, gt=0)
    temperature: float = Field(default=0.0, ge=0, description="0 = greedy decoding.")
    max_new_tokens: int | None = Field(
        default=None, gt=0, description="Defaults to rollout.max_new_tokens."
    )
    repetition_penalty: float = Field(default=1.0, gt=0, description="1 = none.")
    seed: int = Field(default=0, ge=0, description="Sampling seed of reasonctl eval.")
    datasets: list[EvalDataset] = Field(
        default_factory=list, description="Benchmarks scored by reasonctl eval --config.")
    results_dir: str | None = Field(
        default=None, description="One JSON per sample, summary, CSV and chart "
        "(default outputs/eval/<model name>).")
    resume: bool = Field(
        default=True, description="Skip samples already scored with the same settings.")
    batch_size: int = Field(default=32, gt=0, description="Samples per generation call.")
    fps: float | None = Field(default=None, gt=0,
                              description="Video frames per second for the datasets.")
    max_pixels: int | None = Field(default=None, gt=0,
                                   description="Pixels per image or frame for the datasets.")


class StorageSection(Section):
    """``[storage]``: per-scheme settings in ``[storage.<scheme>]``."""


class RunConfig(BaseModel):
    """The whole configuration of a run.

    Build one with :func:`~reasonctl.core.config.load_config`, which adds the plugin
    sections and applies the sources in order; constructing it directly validates only
    the given values.
    """

    model_config = STRICT

    run: RunSection = Field(default_factory=RunSection)
    model: ModelSection = Field(default_factory=ModelSection)
    data: DataSection = Field(default_factory=DataSection)
    train: TrainSection = Field(default_factory=TrainSection)
    algorithm: AlgorithmSection = Field(default_factory=AlgorithmSection)
    backend: BackendSection = Field(default_factory=BackendSection)
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    environment: EnvironmentSection = Field(default_factory=EnvironmentSection)
    rewards: RewardsSection = Field(default_factory=RewardsSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    logging: LoggingSection = Field(default_factory=LoggingSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    storage: StorageSection = Field(default_factory=StorageSection)

    def component_config(self, section: str, name: str) -> Any:
        """The typed config of component ``name`` in ``section`` (defaults when absent)."""
        holder = getattr(self, section)
        value = getattr(holder, field_name(name), None)
        if value is not None:
            return value
        field = type(holder).model_fields.get(field_name(name))
        if field is None:
            return None
        model = model_in(field.annotation)
        return model() if model is not None else None

    def reward_configs(self, registry: Registry) -> list[tuple[RewardComponent, Any]]:
        """Each reward entry with its extra keys validated by the reward's config model."""
        out = []
        for entry in self.rewards.components:
            if ":" in entry.name:  # a module:function path takes no options
                out.append((entry, None))
                continue
            spec = registry.get("reward", entry.name)
            out.append((entry, spec.make_config(dict(entry.model_extra or {}))))
        return out

    def to_dict(self, *, redact: bool = True) -> dict[str, Any]:
        """The config as plain data; secrets replaced by ``***`` unless ``redact=False``."""
        data = self.model_dump(mode="json", by_alias=True, exclude_none=False)
        return redact_secrets(data) if redact else data

    def to_toml(self, *, redact: bool = True) -> str:
        """The config as TOML text (``None`` values omitted), redacted by default.

        Loading the unredacted text back gives an equal config; so does the redacted text
        when the config holds no secret values.
        """
        import tomli_w

        return tomli_w.dumps(drop_none(self.to_dict(redact=redact)))


def field_name(name: str) -> str:
    """The Python field name of a component section called ``name``."""
    return name.replace("-", "_").replace(".", "_")


def model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside an annotation such as ``Model | None`` (or ``None``)."""
    for arg in getattr(annotation, "__args__", (annotation,)):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def drop_none(data: Any) -> Any:
    """``data`` without ``None`` values (TOML has no null)."""
    if isinstance(data, dict):
        return {k: drop_none(v) for k, v in data.items() if v is not None}
    if isinstance(data, list):
        return [drop_none(v) for v in data if v is not None]
    return data
