"""Plain data types shared by every component kind.

They are deliberately free of torch so that datasets, rewards and the CLI can use them
without importing heavy packages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

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


@dataclass
class Completion:
    """One generated response to a prompt.

    ``token_ids`` are the generated tokens (prompt excluded); ``logprobs`` the per-token
    log-probabilities under the sampling policy (after temperature), one per token.
    """

    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length"] = "stop"


@dataclass
class SamplingParams:
    """How a rollout engine samples completions."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 128
    stop: list[str] = field(default_factory=list)
    seed: int | None = None


@dataclass
class RolloutGroup:
    """The completions sampled for one prompt, with their rewards and advantages."""

    sample: Sample
    prompt_ids: list[int]
    completions: list[Completion]
    rewards: list[float] = field(default_factory=list)
    advantages: list[float] = field(default_factory=list)
    reward_components: dict[str, list[float | None]] = field(default_factory=dict)


Metrics = dict[str, float]
