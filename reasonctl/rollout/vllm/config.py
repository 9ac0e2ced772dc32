"""``[rollout.vllm]``: how the vLLM rollout engine runs, and the vLLM engine arguments it
implies.

Torch- and vLLM-free, so registering the engine and validating configs import neither.
:meth:`VLLMRolloutConfig.engine_args` is the one place that turns this section into vLLM
engine arguments: the colocated engine passes them to ``vllm.LLM``, the server launcher
turns them into ``--flags`` of vLLM's OpenAI-compatible server.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

SERVED_MODEL_NAME = "reasonctl-policy"
"""The name a server launched by reasonctl serves the policy under."""

INPROCESS_BACKEND = "reasonctl_inprocess"
"""vLLM weight-transfer backend for a worker in the trainer's process (:mod:`.transfer`)."""

GLOO_BACKEND = "reasonctl_gloo"
"""vLLM weight-transfer backend for worker processes, over gloo (:mod:`.transfer`)."""


class VLLMServerConfig(BaseModel):
    """``[rollout.vllm.server]``: the vLLM server of ``mode = "server"``."""

    model_config = ConfigDict(extra="forbid")

    url: str | None = Field(
        default=None,
        description="Base URL of a running vLLM OpenAI-compatible server to connect to "
        "(e.g. 'http://10.0.0.5:8000'); it must have been started with "
        "VLLM_SERVER_DEV_MODE=1, --logprobs-mode processed_logprobs and "
        "--weight-transfer-config '{\"backend\": \"reasonctl_gloo\"}', with reasonctl "
        "installed beside vLLM. Unset: reasonctl starts the server itself.",
    )
    host: str = Field(default="127.0.0.1", min_length=1,
                      description="Address a launched server listens on.")
    port: int = Field(default=0, ge=0, le=65535,
                      description="Port of a launched server; 0 picks a free one.")
    devices: str | None = Field(
        default=None,
        description="CUDA_VISIBLE_DEVICES of a launched server (e.g. '4,5,6,7'), so it "
        "runs on GPUs the trainer does not use. Unset: inherited.",
    )
    extra_args: list[str] = Field(
        default_factory=list,
        description="More command-line arguments for a launched server "
        "(e.g. ['--max-num-batched-tokens', '8192']).",
    )
    startup_timeout_s: float = Field(default=900.0, gt=0,
                                     description="How long a launched server may take "
                                     "to answer /health.")
    request_timeout_s: float = Field(default=1800.0, gt=0,
                                     description="Timeout of one HTTP request.")
    transfer_host: str = Field(
        default="127.0.0.1", min_length=1,
        description="Address of this (trainer) machine as the server's workers reach "
        "it: weights travel over a gloo group whose store the trainer opens here.",
    )
    api_key_env: str | None = Field(
        default=None,
        description="Environment variable holding the server's API key (sent as a "
        "bearer token; given to a launched server as --api-key).",
    )


class VLLMRolloutConfig(BaseModel):
    """``[rollout.vllm]``: where vLLM runs and the engine settings that matter for RL."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["colocated", "server"] = Field(
        default="colocated",
        description="colocated: the engine lives in the training process and takes the "
        "new weights in place after each optimizer step. server: generate through a vLLM "
        "OpenAI-compatible server (launched by reasonctl, or [rollout.vllm.server] url) "
        "and push the weights to it.",
    )
    tensor_parallel_size: int = Field(default=1, ge=1,
                                      description="GPUs one engine shards the model over.")
    gpu_memory_utilization: float = Field(
        default=0.5, gt=0, le=1,
        description="Fraction of each GPU vLLM may use (weights, activations, KV cache). "
        "Colocated, the rest is the trainer's.",
    )
    max_num_seqs: int = Field(default=256, gt=0,
                              description="Sequences scheduled together at most.")
    max_model_len: int | None = Field(
        default=None, gt=0,
        description="Longest prompt + completion in tokens; unset: the model's own limit.",
    )
    enable_prefix_caching: bool = Field(
        default=True,
        description="Reuse the KV cache of shared prompt prefixes (the n samples of a "
        "prompt share it). The cache is reset after every weight update.",
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        default="auto",
        description="Weights and activations of the engine; auto: model.dtype's compute "
        "dtype (bfloat16 on CUDA, float32 elsewhere).",
    )
    enforce_eager: bool = Field(default=False,
                                description="Skip CUDA graph capture (faster start).")
    seed: int | None = Field(default=None, ge=0,
                             description="The engine's seed; unset: run.seed.")
    sleep_level: Literal[0, 1, 2] = Field(
        default=1,
        description="Colocated on CUDA: release the engine's GPU memory between rollouts "
        "(vLLM sleep mode) so the trainer has it during the update. 1 offloads the "
        "weights to host memory and drops the KV cache; 2 drops the weights too (the "
        "next weight update must then bring every weight); 0 keeps everything. Sleep "
        "mode is CUDA-only: on other devices nothing is released.",
    )
    kv_cache_memory_gib: float | None = Field(
        default=None, gt=0,
        description="KV cache size per engine in GiB, instead of deriving it from "
        "gpu_memory_utilization (on CPU: instead of vLLM's default share of memory).",
    )
    transfer_bucket_mib: int = Field(
        default=512, gt=0,
        description="Weights sent to worker processes (server mode, or tensor "
        "parallelism) travel in packed buckets of this many MiB.",
    )
    server: VLLMServerConfig = Field(default_factory=VLLMServerConfig)

    def engine_args(self, *, model_dir: str, dtype: str, seed: int,
                    weight_transfer_backend: str) -> dict[str, Any]:
        """vLLM engine arguments (``vllm.LLM`` keywords) for the model in ``model_dir``.

        ``dtype`` is the resolved dtype name (``bfloat16``, ``float32`` ...), ``seed`` the
        resolved seed; log-probs are recorded after temperature (``processed_logprobs``),
        the convention of reasonctl's engines.
        """
        args: dict[str, Any] = {
            "model": model_dir,
            "tokenizer": model_dir,
            "dtype": dtype,
            "seed": seed,
            "tensor_parallel_size": self.tensor_parallel_size,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "max_num_seqs": self.max_num_seqs,
            "enable_prefix_caching": self.enable_prefix_caching,
            "enforce_eager": self.enforce_eager,
            "logprobs_mode": "processed_logprobs",
            "weight_transfer_config": {"backend": weight_transfer_backend},
        }
        if self.max_model_len is not None:
            args["max_model_len"] = self.max_model_len
        if self.kv_cache_memory_gib is not None:
            args["kv_cache_memory_bytes"] = int(self.kv_cache_memory_gib * 2**30)
        return args
