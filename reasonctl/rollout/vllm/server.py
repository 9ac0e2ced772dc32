"""The vLLM engine in server mode: generate through a vLLM server, push weights to it.

The server is one reasonctl started (:class:`~.launch.ServerProcess`, typically on GPUs
the trainer does not use: ``[rollout.vllm.server] devices``) or one already running
(``[rollout.vllm.server] url``). Prompts go to ``/v1/completions`` as token ids, one
request per prompt, sent concurrently (the server batches them); each answer carries the
sampled token ids and their log-probs.

A weight update pauses the server (running requests finish first), sends every tensor
over the ``reasonctl_gloo`` transfer (:class:`~.sender.GlooWeightSender`, connected on
the first update to every worker the server runs), resets its prefix cache and resumes
it. With several training processes (FSDP) every rank gathers the weights (a
collective), rank 0 alone sends them, and all ranks wait for the update before
generating again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from reasonctl.core.types import Completion, SamplingParams
from reasonctl.rollout.vllm import params as vparams
from reasonctl.rollout.vllm.http import ServerClient, ServerError
from reasonctl.rollout.vllm.launch import ServerProcess
from reasonctl.rollout.vllm.sender import GlooWeightSender

MAX_CONCURRENT_REQUESTS = 64


class VLLMServerEngine:
    """Generates through the vLLM server behind ``client`` and pushes weights to it.

    ``process`` is the server when this engine started it (stopped by :meth:`close`).
    ``is_sender`` is true on the training process that sends the weights (rank 0);
    ``barrier`` (all training ranks) follows each update. ``transfer_host``,
    ``transfer_timeout_s``, ``bucket_bytes`` and ``dtype`` configure the weight transfer.
    """

    shares_policy_weights = False

    def __init__(self, client: ServerClient, *, eos_token_ids: Iterable[int],
                 process: ServerProcess | None = None, is_sender: bool = True,
                 barrier: Callable[[], None] | None = None, transfer_host: str = "127.0.0.1",
                 transfer_timeout_s: float = 1800.0, bucket_bytes: int = 512 << 20,
                 dtype: torch.dtype | None = None) -> None:
        self.client = client
        self.process = process
        self.stop_token_ids = sorted(set(eos_token_ids))
        self.is_sender = is_sender
        self.barrier = barrier
        self.transfer_host = transfer_host
        self.transfer_timeout_s = transfer_timeout_s
        self.bucket_bytes = bucket_bytes
        self.dtype = dtype
        self.sender: GlooWeightSender | None = None
        models = client.request("GET", "/v1/models").get("data") or []
        if not models:
            raise ServerError(f"the vLLM server at {client.base_url} serves no model")
        self.model_name = str(models[0]["id"])

    # --- the RolloutEngine protocol ------------------------------------------------------

    def generate(self, prompts: Sequence[dict[str, Any]], params: SamplingParams
                 ) -> list[list[Completion]]:
        """Sample ``params.n`` completions for each prompt's ``input_ids``."""
        vparams.check_prompts(prompts, params)
        bodies = [
            {"model": self.model_name, "prompt": list(p["input_ids"]),
             "return_token_ids": True,
             **vparams.request_fields(params, stop_token_ids=self.stop_token_ids,
                                      seed=vparams.prompt_seed(params, index))}
            for index, p in enumerate(prompts)
        ]
        if not bodies:
            return []
        workers = min(len(bodies), MAX_CONCURRENT_REQUESTS)
        with ThreadPoolExecutor(max_workers=workers) as pool:
            answers = list(pool.map(self.client.completions, bodies))
        results = []
        for answer in answers:
            choices = sorted(answer.get("choices") or [], key=lambda c: c["index"])
            if len(choices) != params.n:
                raise ServerError(f"the vLLM server returned {len(choices)} completions "
                                  f"for a prompt; asked for {params.n}")
            results.append([vparams.completion_from_choice(c) for c in choices])
        return results

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Send the trainer's full weights to the server (rank 0; other ranks only gather)."""
        if self.is_sender:
            if self.sender is None:
                sender = GlooWeightSender(
                    self.client, host=self.transfer_host, workers=self.client.world_size(),
                    timeout_s=self.transfer_timeout_s, bucket_bytes=self.bucket_bytes,
                    dtype=self.dtype,
                )
                sender.connect()
                self.sender = sender
            self.client.pause()
            try:
                self.sender.send(named_tensors)
                self.client.reset_prefix_cache()
            finally:
                self.client.resume()
        else:
            for _ in named_tensors:  # the gather is a collective of all ranks
                pass
        if self.barrier is not None:
            self.barrier()

    # --- lifecycle -----------------------------------------------------------------------

    def close(self) -> None:
        """Leave the weight transfer and stop the server if this engine started it."""
        if self.sender is not None:
            self.sender.close()
            self.sender = None
        if self.process is not None:
            self.process.stop()
            self.process = None
