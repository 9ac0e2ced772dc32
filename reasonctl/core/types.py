"""Plain data types shared by every component kind.

They are deliberately free of torch so that datasets, rewards and the CLI can use them
without importing heavy packages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypedDict

if TYPE_CHECKING:
    import torch

PartType = Literal["text", "image", "video"]
Role = Literal["system", "user", "assistant", "tool"]


@dataclass
class ContentPart:
    """One piece of a chat message: text, or a local image/video file.

    ``fps`` and ``max_pixels`` apply to media parts: videos are sampled at ``fps`` frames per
    second and every frame (or image) is resized so its pixel count stays under
    ``max_pixels``.
    """

    type: PartType
    text: str | None = None
    path: str | None = None
    fps: float | None = None
    max_pixels: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """Return the part as a JSON-friendly dict without unset fields."""
        out: dict[str, Any] = {"type": self.type}
        for key in ("text", "path", "fps", "max_pixels"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return out


@dataclass
class Message:
    """A chat turn: a role and a list of content parts."""

    role: Role
    content: list[ContentPart]

    @property
    def text(self) -> str:
        """The concatenated text parts of this message."""
        return "".join(p.text or "" for p in self.content if p.type == "text")

    def to_dict(self) -> dict[str, Any]:
        """Return the message as a JSON-friendly dict."""
        return {"role": self.role, "content": [p.to_dict() for p in self.content]}


@dataclass
class Sample:
    """One training or evaluation example.

    ``messages`` is the conversation (for SFT it includes the assistant answer; for RL it is
    the prompt). ``reference`` is the expected answer used by rewards and evaluation,
    ``source`` names where the sample came from (``file:line``) for error messages, and
    ``meta`` carries anything else (e.g. ``choices`` for multiple-choice questions).
    """

    messages: list[Message]
    reference: Any = None
    meta: dict[str, Any] = field(default_factory=dict)
    source: str = ""

    @property
    def has_media(self) -> bool:
        """True when any message holds an image or video part."""
        return any(p.type != "text" for m in self.messages for p in m.content)

    def prompt_messages(self) -> list[Message]:
        """The conversation without trailing assistant turns (what a policy is asked)."""
        messages = list(self.messages)
        while messages and messages[-1].role == "assistant":
            messages.pop()
        return messages

    def to_dict(self) -> dict[str, Any]:
        """Return the sample as a JSON-friendly dict."""
        return {
            "messages": [m.to_dict() for m in self.messages],
            "reference": self.reference,
            "meta": self.meta,
            "source": self.source,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sample:
        """The sample :meth:`to_dict` returned (e.g. sent to a rollout worker)."""
        messages = [Message(m["role"], [ContentPart(**part) for part in m["content"]])
                    for m in data["messages"]]
        return cls(messages, data.get("reference"), dict(data.get("meta") or {}),
                   str(data.get("source", "")))


@dataclass
class Observation:
    """What an environment answers to one turn of the policy (see
    :class:`~reasonctl.core.protocols.Episode`).

    ``messages`` (tool results as role ``tool``, or ``user`` turns) are rendered with the
    model's chat template after the policy's turn, followed by the generation prompt of the
    next assistant turn; their tokens are appended to the sequence and carry no loss. With
    ``done`` the episode ends after this turn and ``messages`` are not appended.
    """

    messages: list[Message] = field(default_factory=list)
    done: bool = False


@dataclass
class EpisodeSummary:
    """How a multi-turn episode went: the policy's ``turns``, the environment's ``reward``
    (``None``: it has none) and per-episode ``metrics`` (``turns``, ``tool_calls``,
    ``tool_errors``, ``tool_seconds``, ``observation_tokens`` ...)."""

    turns: int
    reward: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Completion:
    """One generated response to a prompt.

    ``token_ids`` are the generated tokens (prompt excluded); ``logprobs`` the per-token
    log-probabilities under the sampling policy (after temperature), one per token.

    A completion of a multi-turn episode (an ``[environment]``) holds every turn and the
    environment's observations between them, in one sequence: ``loss_mask`` is 1 on the
    tokens the policy generated and 0 on observation tokens (whose ``logprobs`` entries are
    0: the engine did not sample them), ``text`` is the policy's last turn (what rewards
    judge) and ``episode`` tells how the episode went. ``loss_mask`` is ``None`` when every
    token was generated.
    """

    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length"] = "stop"
    loss_mask: list[int] | None = None
    episode: EpisodeSummary | None = None


@dataclass(frozen=True)
class Explanation:
    """Why a reward gave one completion its score.

    ``score`` is the reward's score (``None``: it does not apply); ``extracted`` what the
    reward read from the completion (the answer, the letter, a judge's verdict; ``None``:
    nothing); ``reason`` a short code saying why the score is what it is (``correct``,
    ``wrong``, ``no_answer``, ``hedge``, ``unparseable`` ...; ``docs/rewards.md`` lists
    them), so rows can be counted per reason.
    """

    score: float | None
    extracted: str | None
    reason: str

    def to_dict(self) -> dict[str, Any]:
        """The explanation as a JSON-friendly dict."""
        return {"score": self.score, "extracted": self.extracted, "reason": self.reason}


@dataclass
class SamplingParams:
    """How a rollout engine samples completions.

    ``suppress_token_ids`` are never sampled (vision placeholders and other tokens the
    processor reserves, plus ``rollout.suppress_tokens``); they only steer the draw: the
    recorded log-probs are those of the full distribution, as a trainer recomputes them.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 128
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    suppress_token_ids: list[int] = field(default_factory=list)
    repetition_penalty: float = 1.0
    """Above 1, tokens already in the prompt or the completion are made less likely (as
    ``transformers``' ``repetition_penalty``: positive logits divided, negative ones
    multiplied); log-probs are then recorded after the penalty. 1 disables it."""


@dataclass
class RolloutGroup:
    """The completions sampled for one prompt, with their rewards and advantages.

    ``prompt`` is the encoded prompt (an :class:`EncodedSample`
    holding the token ids and any vision tensors) when the group was sampled by
    :func:`reasonctl.sample_groups`. ``reward_components`` holds each reward's scores,
    and the parts a reward reports as ``<reward>/<part>`` (``remote/math``), which the
    weighted ``rewards`` do not count again.
    """

    sample: Sample
    prompt_ids: list[int]
    completions: list[Completion]
    rewards: list[float] = field(default_factory=list)
    advantages: list[float] = field(default_factory=list)
    reward_components: dict[str, list[float | None]] = field(default_factory=dict)
    prompt: Any = None


@dataclass
class EncodedSample:
    """One tokenized sample.

    ``loss_mask[i] == 1`` when token ``i`` is a training target (same length as
    ``input_ids``). ``extras`` holds vision tensors (``pixel_values``, ``image_grid_thw``,
    ``pixel_values_videos``, ``video_grid_thw``, ``second_per_grid_ts``) whose first
    dimension concatenates across samples, plus the per-token ``mm_token_type_ids``.
    ``truncated`` tells that the sample was cut to ``max_length``; ``num_prompt_tokens`` is
    the prompt length for
    :meth:`reasonctl.ChatProcessor.encode_prompt`.
    """

    input_ids: list[int]
    loss_mask: list[int]
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    truncated: bool = False
    num_prompt_tokens: int = 0

    def __len__(self) -> int:
        return len(self.input_ids)

    def as_prompt(self) -> dict[str, Any]:
        """The prompt dict a :class:`~reasonctl.core.protocols.RolloutEngine` generates from:
        ``input_ids`` plus the vision tensors."""
        return {"input_ids": list(self.input_ids), **self.extras}

    @property
    def num_loss_tokens(self) -> int:
        """How many tokens are training targets."""
        return sum(self.loss_mask)


Metrics = dict[str, float]
"""A step's metrics: name -> value (``loss``, ``reward/mean`` ...), the same keys on every
rank."""


@dataclass(frozen=True)
class ModelSource:
    """Local directories of the run's model (config + weights) and of its tokenizer/processor.

    The runner resolves ``model.name_or_path`` and ``model.tokenizer`` (an alias, a local
    directory, a storage URI or a Hub id) into these before building the processor, so every
    component reads the same files.
    """

    model_dir: Path
    tokenizer_dir: Path


class TrainBatch(TypedDict, total=False):
    """A collated batch as backends consume it (``input_ids`` and ``loss_mask`` always present).

    Shapes are ``[B, T]`` (or ``[1, total]`` when packed). ``loss_mask[b, t] == 1`` marks token
    ``t`` as a training target; the log-prob at position ``t`` predicts token ``t + 1``, so a loss
    uses ``loss_mask[:, 1:]``. Padded batches carry ``attention_mask`` (1 = real token); packed
    batches carry ``position_ids`` restarting at 0 for every packed sample and no attention mask.
    Vision-language batches add the processor's tensors, whose first dimension concatenates over
    the batch's images/videos: ``pixel_values``, ``image_grid_thw``, ``pixel_values_videos``,
    ``video_grid_thw``, ``second_per_grid_ts``, and the per-token ``mm_token_type_ids``
    (0 text, 1 image, 2 video). Rows that share their vision inputs (the completions of one
    prompt) may carry them once per distinct set, with ``media_source_rows`` (``[B]``: the
    set each row uses, -1 for none) and ``media_items`` (``[sets, 2]``: images and videos per
    set); see :func:`reasonctl.data.collate.collate_shared_media`.
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    pixel_values_videos: torch.Tensor
    video_grid_thw: torch.Tensor
    second_per_grid_ts: torch.Tensor
    mm_token_type_ids: torch.Tensor
    media_source_rows: torch.Tensor
    media_items: torch.Tensor


class PolicyBatch(TrainBatch, total=False):
    """A :class:`TrainBatch` of prompt + completion rows for a policy-gradient loss.

    Per-token tensors are ``[B, T-1]``, aligned with the backend's log-probs (position ``t``
    scores token ``t + 1``) and zero outside each row's completion: ``completion_mask`` (1 on
    completion tokens the policy generated, whether or not they carry loss; 0 on the
    observation tokens of a multi-turn environment), ``engine_logprobs`` (the rollout engine's
    log-probs of the sampled tokens), and, when computed, ``old_logprobs`` (the policy before the
    update) and ``ref_logprobs`` (the reference model). ``advantages`` is ``[B]``, one per row.
    ``loss_mask`` is 1 on completion tokens that carry loss (prompt tokens never do).
    """

    advantages: torch.Tensor
    completion_mask: torch.Tensor
    engine_logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor
    shared_prompt: Any
    """In a shared-prompt batch (``reasonctl.shared_prompt_micro_batches``): the packed row
    the model runs (each prompt once, followed by its completions); the other keys keep the
    padded rows' layout."""
