"""An observation's tokens: what the model's chat template puts after the policy's turn.

Earlier turns are never tokenized again (their tokens are what the policy generated), so
an observation is rendered as a *suffix*: the chat template renders a stand-in
conversation whose assistant turn is a marker, followed by the observation's messages and
the generation prompt; the text after the marker is the end of the policy's turn (unless
the policy ended it itself, with an end-of-turn token), the observation in the
template's own form (Qwen: ``<|im_start|>user\\n<tool_response>...`` for role ``tool``)
and the start of the next assistant turn. That text is tokenized alone; it begins with
a special token, so no token spans the boundary.

Special-token strings inside an observation's content (a tool printing
``<|im_start|>system``) are defanged (a zero-width space after their first character), so
tool output can never forge a turn of the conversation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from reasonctl.core.types import Message

MARKER = "\u2063reasonctl-turn-end\u2063"
ZERO_WIDTH_SPACE = "\u200b"


class ObservationRenderer:
    """Renders observations with ``tokenizer``'s chat template (see the module docstring).

    ``end_of_turn_ids`` are the tokens that end a turn when the policy samples them (the
    engine's end-of-sequence ids): a turn that ended with one is not closed again.
    """

    def __init__(self, tokenizer: Any, *, end_of_turn_ids: Sequence[int] = ()) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(f"{type(tokenizer).__name__} has no chat template to render "
                             "observations with")
        self.tokenizer = tokenizer
        self.end_texts = {i: tokenizer.decode([i], skip_special_tokens=False)
                          for i in end_of_turn_ids}
        specials = set(getattr(tokenizer, "all_special_tokens", []) or [])
        specials.update(str(t) for t in (getattr(tokenizer, "added_tokens_decoder", {}) or {})
                        .values() if getattr(t, "special", False))
        self.specials = sorted((s for s in specials if len(s) > 1), key=len, reverse=True)

    def tokens(self, messages: Sequence[Message], *, last_token: int | None) -> list[int]:
        """Token ids of ``messages`` after a turn whose last token is ``last_token`` (None
        for an empty turn), through the next assistant turn's generation prompt."""
        text = self.text(messages, last_token=last_token)
        encoded = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return list(encoded)

    def text(self, messages: Sequence[Message], *, last_token: int | None) -> str:
        """The text :meth:`tokens` tokenizes."""
        conversation: list[dict[str, Any]] = [
            {"role": "user", "content": "?"},
            {"role": "assistant", "content": MARKER},
        ]
        conversation += [{"role": m.role, "content": self.defang(m.text)} for m in messages]
        rendered = self.tokenizer.apply_chat_template(conversation, tokenize=False,
                                                      add_generation_prompt=True)
        at = rendered.find(MARKER)
        if at < 0:
            raise ValueError("the chat template drops the assistant turn's text; cannot "
                             "render observations after a turn with it")
        suffix = rendered[at + len(MARKER):]
        ended = self.end_texts.get(last_token) if last_token is not None else None
        if ended and suffix.startswith(ended):  # the policy closed its turn itself
            suffix = suffix[len(ended):]
        return suffix

    def defang(self, content: str) -> str:
        """``content`` with every special-token string broken by a zero-width space."""
        for special in self.specials:
            if special in content:
                content = content.replace(special, special[0] + ZERO_WIDTH_SPACE + special[1:])
        return content
