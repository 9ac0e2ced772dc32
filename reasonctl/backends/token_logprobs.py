"""Per-token log-probabilities of a batch without materialising full-vocabulary logits.

The decoder runs once to produce hidden states; the output projection, log-softmax and
gather then run over chunks of tokens, so at most ``chunk_tokens x vocab`` float32 logits
exist at a time. With gradients, each chunk's logits are recomputed in backward (see
:mod:`reasonctl.backends.lm_head`), so training memory stays bounded the same way.

Alignment (shared with :mod:`reasonctl.data.processing`): ``logprobs[b, t]`` is
``log p(input_ids[b, t + 1] | input_ids[b, : t + 1])``, shape ``[B, T - 1]``.

With context parallelism (:mod:`reasonctl.backends.context_parallel`) the decoder returns
the hidden states of this rank's chunks of the sequence; their tokens are scored here and
gathered into the same ``[B, T - 1]`` result on every rank of the group.

A shared-prompt batch (its model inputs under ``batch["shared_prompt"]``, see
:func:`reasonctl.algorithms.policy_batch.shared_prompt_micro_batches`) runs as one packed
row holding each prompt once (:mod:`reasonctl.models.shared_prompt`); only completion
tokens are scored, and the result has the same ``[B, T - 1]`` layout.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from reasonctl.backends.lm_head import linear_token_logprobs
from reasonctl.models.packed_positions import is_packed_media_batch, packed_rope_positions
from reasonctl.models.shared_media import (
    accepts_encoder_outputs,
    per_row_media_inputs,
    shared_media_inputs,
    uses_shared_media,
)
from reasonctl.models.shared_prompt import LAYOUT_KWARG, SharedPromptInputs, rope_positions
from reasonctl.models.shared_prompt_attention import (
    enable_shared_prompt_attention,
    masks_skipped,
)
from reasonctl.models.varlen_attention import enable_vision_varlen_attention

if TYPE_CHECKING:
    from reasonctl.backends.context_parallel import ContextParallel

DEFAULT_CHUNK_TOKENS = 2048


@dataclass
class TokenLogprobs:
    """What a forward pass yields for a loss (implements ``TokenOutputs``)."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None = None


class TokenLogprobModel(nn.Module):
    """Wraps a Hugging Face causal-LM or vision-language model to return token log-probs.

    Its ``forward`` runs the whole computation (decoder, then chunked output projection),
    which lets a sharding wrapper such as FSDP2 treat it as the root module: parameters that
    live outside the decoder blocks (embeddings, final norm, output projection, vision
    tower) are gathered for exactly this call. It returns a plain ``(logprobs, entropy)``
    tuple because such wrappers hook backward onto the tensors they find in the output
    (a tuple is traversed; a dataclass is not on every torch version).
    """

    def __init__(self, hf_model: nn.Module, *, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> None:
        super().__init__()
        if chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens must be positive (got {chunk_tokens})")
        self.hf_model = hf_model
        self.chunk_tokens = chunk_tokens
        self.context_parallel: ContextParallel | None = None
        """Set by a backend that splits sequences over ranks (see the module docstring)."""
        self._input_names = accepted_inputs(decoder_of(hf_model))

    def forward(  # type: ignore[override]
        self,
        batch: dict[str, Any],
        with_entropy: bool = False,
        temperature: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs and entropy (``None`` unless asked) of ``batch["input_ids"][:, 1:]``."""
        if temperature <= 0:
            raise ValueError(f"temperature must be positive (got {temperature})")
        shared = batch.get("shared_prompt")
        if shared is not None:
            return self._shared_prompt_forward(shared, batch["loss_mask"].device,
                                               with_entropy, temperature)
        decoder = decoder_of(self.hf_model)
        inputs = {k: v for k, v in batch.items() if k in self._input_names}
        if "use_cache" in self._input_names:
            inputs["use_cache"] = False
        if is_packed_media_batch(batch):  # per-sample 3D rotary positions
            inputs["position_ids"] = packed_rope_positions(decoder, batch)
        if uses_shared_media(batch):  # the vision tower runs once per distinct image/video
            for key in ("pixel_values", "pixel_values_videos"):
                inputs.pop(key, None)
            if accepts_encoder_outputs(self._input_names):
                inputs.update(shared_media_inputs(decoder, batch))
            else:
                inputs.update(per_row_media_inputs(batch))
        unknown = set(inputs) - self._input_names
        if unknown:  # a keyword the forward lacks would vanish into its **kwargs unread
            raise TypeError(f"{type(decoder).__name__}.forward takes no {sorted(unknown)}; "
                            "this transformers release is too old for these inputs")
        head = self.hf_model.get_output_embeddings()
        parallel = self.context_parallel
        if parallel is None:
            hidden = decoder(**inputs).last_hidden_state
            outputs = chunked_token_logprobs(
                hidden[:, :-1], batch["input_ids"][:, 1:], head.weight,
                getattr(head, "bias", None), temperature=temperature,
                with_entropy=with_entropy, chunk_tokens=self.chunk_tokens,
            )
            return outputs.logprobs, outputs.entropy
        plan = parallel.active = parallel.plan(batch)
        try:
            hidden = decoder(**inputs).last_hidden_state
        finally:
            parallel.active = None
        # position t scores token t + 1; the last position (and the padding) scores nothing
        targets = F.pad(batch["input_ids"][:, 1:], (0, plan.padded - plan.length + 1))
        outputs = chunked_token_logprobs(
            hidden, targets.index_select(1, plan.index), head.weight,
            getattr(head, "bias", None), temperature=temperature, with_entropy=with_entropy,
            chunk_tokens=self.chunk_tokens,
        )
        width = plan.length - 1
        entropy = outputs.entropy
        # copies, not views of the padded gathers: FSDP2 warns that an in-place op on a
        # view its root returns would skip the view's backward hook
        return (plan.gather(outputs.logprobs)[:, :width].clone(),
                plan.gather(entropy)[:, :width].clone() if entropy is not None else None)


    def _shared_prompt_forward(self, packed: SharedPromptInputs, device: torch.device,
                               with_entropy: bool, temperature: float
                               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (and entropy) of a shared-prompt batch in the padded ``[B, T - 1]``
        layout of its rows."""
        if self.context_parallel is not None:
            raise ValueError("shared-prompt batches do not run with context parallelism")
        enable_shared_prompt_attention(self.hf_model)
        if device.type == "cuda":  # one flash call per vision block instead of per window
            enable_vision_varlen_attention(self.hf_model)
        decoder = decoder_of(self.hf_model)
        packed = packed.to(device)
        layout = packed.layout
        inputs: dict[str, Any] = {"input_ids": packed.input_ids, LAYOUT_KWARG: layout}
        inputs.update({k: v for k, v in packed.extras.items() if k in self._input_names})
        if "use_cache" in self._input_names:
            inputs["use_cache"] = False
        if hasattr(decoder, "get_rope_index"):  # Qwen-VL: text positions, then 3D rotary
            text = torch.arange(layout.length, device=device).unsqueeze(0)
            inputs["position_ids"] = torch.cat(
                [text, rope_positions(decoder, packed)]).unsqueeze(1)
        else:
            inputs["position_ids"] = layout.text_positions().to(device).unsqueeze(0)
        with masks_skipped():
            hidden = decoder(**inputs).last_hidden_state[0]
        head = self.hf_model.get_output_embeddings()
        outputs = chunked_token_logprobs(
            hidden.index_select(0, layout.score_index).unsqueeze(0),
            packed.input_ids[0].index_select(0, layout.target_index).unsqueeze(0),
            head.weight, getattr(head, "bias", None), temperature=temperature,
            with_entropy=with_entropy, chunk_tokens=self.chunk_tokens,
        )
        entropy = outputs.entropy
        return (layout.spread(outputs.logprobs[0]),
                layout.spread(entropy[0]) if entropy is not None else None)


def decoder_of(hf_model: nn.Module) -> nn.Module:
    """The module that maps inputs to final hidden states (``model.model`` for Qwen/LLaVA)."""
    base = getattr(hf_model, "base_model", None)
    if base is None or base is hf_model:
        raise TypeError(
            f"{type(hf_model).__name__} exposes no base model (base_model_prefix); only "
            "transformers models with a separate decoder and output projection are supported"
        )
    return base


def accepted_inputs(module: nn.Module) -> frozenset[str]:
    """Named parameters of ``module.forward`` (batch keys outside these are not model inputs)."""
    signature = inspect.signature(module.forward)
    return frozenset(
        name for name, p in signature.parameters.items()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and name != "labels"
    )


def chunked_token_logprobs(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> TokenLogprobs:
    """``log_softmax(hidden @ weight.T / temperature)`` gathered at ``targets``, in chunks.

    ``hidden`` is ``[B, T, H]`` and ``targets`` ``[B, T]``; results are float32 ``[B, T]``.
    The work is done by :func:`~reasonctl.backends.lm_head.linear_token_logprobs`, which
    recomputes each chunk's logits in backward instead of storing them.
    """
    if targets.numel() == 0:  # a batch of one-token sequences has nothing to predict
        empty = hidden.new_zeros(targets.shape, dtype=torch.float32)
        return TokenLogprobs(empty, empty.clone() if with_entropy else None)
    logprobs, entropy = linear_token_logprobs(
        hidden, targets, weight, bias, temperature=temperature, with_entropy=with_entropy,
        chunk_tokens=chunk_tokens,
    )
    return TokenLogprobs(logprobs, entropy)
