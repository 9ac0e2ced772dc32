"""The colocated vLLM engine: ``vllm.LLM`` inside the training process.

With one worker (``tensor_parallel_size = 1``) the engine runs fully in this process
(vLLM's in-process engine core, ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` while it is built),
and :meth:`VLLMColocatedEngine.update_weights` hands the trainer's tensors to the model's
``load_weights`` directly through the ``reasonctl_inprocess`` weight-transfer backend.
With tensor parallelism vLLM runs its workers as processes and the weights reach them in
packed buckets over a gloo group (:class:`~.sender.GlooWeightSender`). Either way the
update goes through vLLM's weight-update protocol (start, update, finish) and the prefix
cache is reset after it.

On CUDA with ``sleep_level > 0`` the engine sleeps after every rollout (level 1: weights
to host memory, KV cache dropped; level 2: both dropped) and wakes for the next weight
update or rollout, so the trainer has the memory during its update.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from reasonctl.core.types import Completion, SamplingParams
from reasonctl.rollout.vllm import params as vparams
from reasonctl.rollout.vllm.sender import GlooWeightSender


@contextmanager
def _environment(**values: str):  # type: ignore[no-untyped-def]
    """Set environment variables for the duration of the block."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class VLLMColocatedEngine:
    """Generates with ``vllm.LLM`` in this process and takes new weights in place.

    ``engine_args`` are ``vllm.LLM`` keywords (:meth:`VLLMRolloutConfig.engine_args`, with
    the weight-transfer backend chosen here); ``eos_token_ids`` end completions;
    ``sleep_level`` (0-2) releases device memory between rollouts where vLLM's sleep mode
    works (CUDA); ``transfer_timeout_s`` and ``bucket_bytes`` configure the gloo transfer
    to worker processes.
    """

    shares_policy_weights = False

    def __init__(self, engine_args: dict[str, Any], *, eos_token_ids: Iterable[int],
                 sleep_level: int = 0, transfer_timeout_s: float = 1800.0,
                 bucket_bytes: int = 512 << 20) -> None:
        from vllm import LLM
        from vllm.config import WeightTransferConfig

        from reasonctl.rollout.vllm.transfer import (
            GLOO_BACKEND,
            INPROCESS_BACKEND,
            register_backends,
        )

        register_backends()
        args = dict(engine_args)
        self.in_process = args.get("tensor_parallel_size", 1) == 1
        backend = INPROCESS_BACKEND if self.in_process else GLOO_BACKEND
        args["weight_transfer_config"] = WeightTransferConfig(backend=backend)
        self.sleep_level = sleep_level if torch.cuda.is_available() else 0
        if self.sleep_level:
            args["enable_sleep_mode"] = True
        self.stop_token_ids = sorted(set(eos_token_ids))
        self.dtype = getattr(torch, str(args.get("dtype", "float32")))
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if self.in_process else {}
        with _environment(**env):
            self.llm = LLM(**args)
        self.asleep = False
        self.weights_awake = True
        self.weights_dropped = False
        self.last_seconds = 0.0
        self.sender: GlooWeightSender | None = None
        if self.in_process:
            self.llm.init_weight_transfer_engine({"init_info": {"pid": os.getpid()}})
        else:
            self.sender = GlooWeightSender(
                _OfflineControl(self.llm), host="127.0.0.1",
                workers=int(args.get("tensor_parallel_size", 1)),
                timeout_s=transfer_timeout_s, bucket_bytes=bucket_bytes, dtype=self.dtype,
            )
            self.sender.connect()

    # --- the RolloutEngine protocol ------------------------------------------------------

    def generate(self, prompts: Sequence[dict[str, Any]], params: SamplingParams
                 ) -> list[list[Completion]]:
        """Sample ``params.n`` completions for each prompt's ``input_ids``."""
        from vllm import SamplingParams as VLLMSamplingParams

        vparams.check_prompts(prompts, params)
        if not prompts:
            return []
        if self.weights_dropped:
            raise RuntimeError(
                "the vllm engine dropped its weights when it went to sleep "
                "(sleep_level = 2): load weights with update_weights before generating, "
                "or use sleep_level = 1"
            )
        self._wake()
        started = time.perf_counter()
        requests = [{"prompt_token_ids": list(p["input_ids"])} for p in prompts]
        sampling = [
            VLLMSamplingParams(**vparams.request_fields(
                params, stop_token_ids=self.stop_token_ids,
                seed=vparams.prompt_seed(params, index)))
            for index in range(len(prompts))
        ]
        outputs = self.llm.generate(requests, sampling, use_tqdm=False)
        results = [[vparams.completion_from_output(o) for o in out.outputs] for out in outputs]
        self.last_seconds = time.perf_counter() - started
        self._sleep()
        return results

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the trainer's full weights (by Hugging Face name) into the engine."""
        if self.asleep and not self.weights_awake:
            self.llm.wake_up(tags=["weights"])
            self.weights_awake = True
        if self.sender is not None:
            self.sender.send(named_tensors)
        else:
            from reasonctl.rollout.vllm.transfer import stage, unstage

            ticket = stage(named_tensors)
            try:
                self.llm.start_weight_update()
                self.llm.update_weights({"update_info": {"ticket": ticket}})
                self.llm.finish_weight_update()
            finally:
                unstage(ticket)
        self.weights_dropped = False
        if not self.asleep:
            self.llm.reset_prefix_cache()

    # --- lifecycle -----------------------------------------------------------------------

    def close(self) -> None:
        """Shut the engine down and release its memory."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None  # type: ignore[assignment]
        if self.sender is not None:
            self.sender.close()
        engine = getattr(llm, "llm_engine", None)
        shutdown = getattr(engine, "shutdown", None)
        if callable(shutdown):
            shutdown()
        del llm

    def _wake(self) -> None:
        if self.asleep:
            self.llm.wake_up(tags=None if not self.weights_awake else ["kv_cache"])
            self.asleep = False
            self.weights_awake = True
            self.llm.reset_prefix_cache()

    def _sleep(self) -> None:
        if self.sleep_level:
            self.llm.sleep(level=self.sleep_level)
            self.asleep = True
            self.weights_awake = False
            self.weights_dropped = self.sleep_level == 2


class _OfflineControl:
    """vLLM's weight-update protocol on an in-process ``LLM`` (the sender's control plane)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self) -> None:
        self.llm.finish_weight_update()
