"""The LoRA side of the PyTorch backends: merged weights, the reference, adapter exports.

With ``[model.lora]`` a backend's Hugging Face model carries peft adapters in place
(:func:`reasonctl.models.lora.apply_lora`), so its own parameter names are peft's
(``...q_proj.base_layer.weight``, ``...q_proj.lora_A.default.weight``,
``...embed_tokens.modules_to_save.default.weight``). Everything that leaves the backend
speaks plain Hugging Face names instead: :meth:`LoraState.merged` turns a stream of the
model's full tensors into the merged model's (``W + alpha / r * B @ A`` per adapted
layer, the trained copy of each module to save), and :meth:`LoraState.changed` yields only
the tensors that differ from the base model, computed from the adapters, for rollout
engines that hold the base weights already. The KL reference is the same module with the
adapters switched off (:meth:`LoraState.reference`): no second copy of the weights.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from reasonctl.backends.export import copy_tokenizer_files
from reasonctl.models.lora import ADAPTER, adapted_modules, apply_lora, saved_modules

if TYPE_CHECKING:
    from reasonctl.core.config import LoraSection
    from reasonctl.core.types import ModelSource

PEFT_PREFIX = "base_model.model."
"""Prefix of the Hugging Face model's names inside the ``PeftModel``."""
_PART = re.compile(
    rf"^(?P<module>.+)\.(?P<part>base_layer|lora_A\.{ADAPTER}|lora_B\.{ADAPTER}|original_module"
    rf"|modules_to_save\.{ADAPTER})\.(?P<param>[^.]+)$"
)
TensorView = Callable[[torch.Tensor], torch.Tensor]
"""Turns a (possibly sharded) parameter into its full tensor."""


class LoraState:
    """The adapters of a backend's model and what the backend does with them."""

    def __init__(self, peft_model: Any, section: LoraSection) -> None:
        self.peft_model = peft_model
        self.section = section
        self.hf_model = peft_model.get_base_model()
        self.layers = adapted_modules(self.hf_model)
        """Adapted linear layers by full module name."""
        self.saved = saved_modules(self.hf_model)
        """``modules_to_save`` wrappers by full module name."""

    @classmethod
    def attach(cls, hf_model: torch.nn.Module, section: LoraSection, *, seed: int,
               trainable_dtype: torch.dtype) -> LoraState:
        """Add adapters to ``hf_model`` (on the CPU or the meta device).

        The adapters are initialised from ``seed`` on a forked generator, so every backend
        and device starts from the same adapters and the run's random stream is untouched.
        Trainable parameters are cast to ``trainable_dtype``.
        """
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            peft_model = apply_lora(hf_model, section)
        for param in hf_model.parameters():
            if param.requires_grad and param.dtype != trainable_dtype:
                param.data = param.data.to(trainable_dtype)
        return cls(peft_model, section)

    # --- the reference policy ---------------------------------------------------------------

    def reference(self) -> contextlib.AbstractContextManager[Any]:
        """Within this block the model is the base model (adapters and saved copies off)."""
        return self.peft_model.disable_adapter()

    # --- weights out ------------------------------------------------------------------------

    def merged(self, named: Iterable[tuple[str, torch.Tensor]]
               ) -> Iterator[tuple[str, torch.Tensor]]:
        """The merged model's tensors by Hugging Face name from the adapted model's.

        ``named`` yields the adapted model's full tensors in state-dict order (each layer's
        base weight and factors are adjacent); every item of ``named`` is consumed.
        """
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in named:
            match = _PART.match(name)
            if match is None:
                yield name, tensor
                continue
            module, part, param = match["module"], match["part"], match["param"]
            if part == "original_module":
                continue
            if part.startswith("modules_to_save") or (part == "base_layer" and param != "weight"):
                yield f"{module}.{param}", tensor
                continue
            pieces = pending.setdefault(module, {})
            pieces[part.split(".")[0]] = tensor
            if len(pieces) == 3:
                del pending[module]
                yield f"{module}.weight", self._merge(module, pieces["base_layer"],
                                                      pieces["lora_A"], pieces["lora_B"])
        if pending:
            raise RuntimeError(f"incomplete LoRA tensors for {sorted(pending)}")

    def changed(self, full: TensorView) -> Iterator[tuple[str, torch.Tensor]]:
        """Only the merged tensors that differ from the base model, by Hugging Face name.

        Adapted layers' weights are computed from their base weight and factors; modules
        to save yield their trained copy (a tied output head as well). ``full`` gathers a
        sharded parameter (a collective under FSDP: every rank iterates to the end).
        """
        with torch.no_grad():
            for name, layer in self.layers.items():
                yield f"{name}.weight", self._merge(
                    name, full(layer.base_layer.weight), full(layer.lora_A[ADAPTER].weight),
                    full(layer.lora_B[ADAPTER].weight))
            for name, wrapper in self.saved.items():
                for param_name, param in wrapper.modules_to_save[ADAPTER].named_parameters():
                    yield f"{name}.{param_name}", full(param).detach()

    def _merge(self, module: str, weight: torch.Tensor, lora_a: torch.Tensor,
               lora_b: torch.Tensor) -> torch.Tensor:
        scaling = float(self.layers[module].scaling[ADAPTER])
        with torch.no_grad():
            delta = (lora_b.float() @ lora_a.float()) * scaling
            return (weight.float() + delta.to(weight.device)).to(weight.dtype)

    # --- exports ----------------------------------------------------------------------------

    def save_adapter(self, directory: Path, state: dict[str, torch.Tensor], *,
                     dtype: torch.dtype, base_model: str, source: ModelSource) -> Path:
        """Write a peft adapter directory from the adapted model's full ``state``.

        It loads with ``PeftModel.from_pretrained(base, directory)``; ``base_model`` is
        recorded as ``base_model_name_or_path``. Written under a temporary name and renamed
        when complete, with the tokenizer files of ``source`` beside it.
        """
        directory = Path(directory)
        tmp = directory.with_name(f".tmp-{directory.name}")
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        weights = {PEFT_PREFIX + k: (v.to(dtype) if v.is_floating_point() else v)
                   for k, v in state.items() if _PART.match(k) and "original_module" not in k
                   and ".base_layer." not in k}
        self.peft_model.save_pretrained(tmp, state_dict=weights, save_embedding_layers=False)
        config_file = tmp / "adapter_config.json"
        adapter_config = json.loads(config_file.read_text())
        adapter_config["base_model_name_or_path"] = base_model
        config_file.write_text(json.dumps(adapter_config, indent=2, sort_keys=True) + "\n")
        copy_tokenizer_files(tmp, [source.model_dir, source.tokenizer_dir])
        if directory.exists():
            shutil.rmtree(directory)
        tmp.rename(directory)
        return directory


def base_model_reference(name_or_path: str, source: ModelSource) -> str:
    """How an adapter directory names its base model: a Hub id as given, else the local
    directory the run trained from."""
    if re.fullmatch(r"[A-Za-z0-9][\w.\-]*/[\w.\-]+", name_or_path) and not Path(
            name_or_path).expanduser().exists():
        return name_or_path
    return str(Path(source.model_dir).resolve())


class AdaptersOff:
    """The reference policy of a LoRA model: the same module with its adapters switched off
    (the base model), used like :class:`~reasonctl.backends.reference.ReferenceWeights`."""

    def __init__(self, lora: LoraState) -> None:
        self.lora = lora

    def active(self) -> contextlib.AbstractContextManager[Any]:
        """Within this block the policy computes with the base weights only."""
        return self.lora.reference()
