"""Parts of the ``vllm`` rollout engine that need no vLLM: its config section and the
engine arguments it implies, the server's command line, sampling fields and completions
in vLLM's terms, the gloo weight transfer between two real process-group ranks, and the
errors a run gets before vLLM is involved."""

from __future__ import annotations

import json
import sys
import threading
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from reasonctl.core.errors import ConfigError, MissingDependencyError
from reasonctl.core.types import SamplingParams
from reasonctl.rollout.vllm import gloo
from reasonctl.rollout.vllm.config import GLOO_BACKEND, VLLMRolloutConfig
from reasonctl.rollout.vllm.launch import server_arguments
from reasonctl.rollout.vllm.params import (
    check_prompts,
    completion_from_choice,
    prompt_seed,
    request_fields,
)
from reasonctl.rollout.vllm.sender import GlooWeightSender


def _load(values: dict[str, Any]) -> Any:
    from reasonctl.core.config import load_config
    from reasonctl.core.plugins import PluginHost

    return load_config(values=values, registry=PluginHost.load().registry, environ={})


def test_the_plugin_registers_the_engine_and_its_config_section() -> None:
    config = _load({"rollout": {"engine": "vllm", "vllm": {
        "mode": "server", "tensor_parallel_size": 2, "server": {"devices": "2,3"}}}})
    section = config.component_config("rollout", "vllm")
    assert isinstance(section, VLLMRolloutConfig)
    assert (section.mode, section.tensor_parallel_size, section.server.devices) == (
        "server", 2, "2,3")


def test_every_bad_key_and_value_of_the_section_is_named() -> None:
    with pytest.raises(ConfigError) as error:
        _load({"rollout": {"engine": "vllm", "vllm": {
            "mode": "remote", "tensor_parallel_size": 0, "gpu_memory_utilizaton": 0.3,
            "sleep_level": 3, "server": {"port": 70000, "hots": "x"}}}})
    text = "\n".join(error.value.problems)
    for path in ("rollout.vllm.mode", "rollout.vllm.tensor_parallel_size",
                 "rollout.vllm.gpu_memory_utilizaton", "rollout.vllm.sleep_level",
                 "rollout.vllm.server.port", "rollout.vllm.server.hots"):
        assert path in text, path
    assert "gpu_memory_utilization" in text  # the did-you-mean


def test_engine_args_and_the_servers_command_line() -> None:
    config = VLLMRolloutConfig(gpu_memory_utilization=0.3, enable_prefix_caching=False,
                               kv_cache_memory_gib=0.5, max_model_len=4096)
    args = config.engine_args(model_dir="/m", dtype="bfloat16", seed=7,
                              weight_transfer_backend=GLOO_BACKEND)
    assert args["logprobs_mode"] == "processed_logprobs"
    assert args["kv_cache_memory_bytes"] == 2**29 and args["max_model_len"] == 4096
    argv = server_arguments(args, host="127.0.0.1", port=8123, served_name="policy")
    pairs = dict(zip(argv[::2], argv[1::2], strict=False))
    assert pairs["--model"] == "/m" and pairs["--port"] == "8123"
    assert pairs["--gpu-memory-utilization"] == "0.3" and pairs["--seed"] == "7"
    assert "--no-enable-prefix-caching" in argv and "--enforce-eager" not in argv
    assert "--no-enforce-eager" in argv
    transfer = argv[argv.index("--weight-transfer-config") + 1]
    assert json.loads(transfer) == {"backend": GLOO_BACKEND}


def test_sampling_fields_seeds_and_completions() -> None:
    params = SamplingParams(n=4, temperature=0.7, top_k=0, max_new_tokens=9, stop=["</a>"],
                            seed=3)
    fields = request_fields(params, stop_token_ids={5, 2}, seed=prompt_seed(params, 1))
    assert fields["stop_token_ids"] == [2, 5] and fields["logprobs"] == 0
    assert fields["include_stop_str_in_output"] and fields["max_tokens"] == 9
    assert "logit_bias" not in fields
    suppressed = request_fields(replace(params, suppress_token_ids=[7, 9]), stop_token_ids=(),
                                seed=None)
    assert suppressed["logit_bias"] == {7: -100.0, 9: -100.0}
    seeds = [prompt_seed(params, i) for i in range(100)]
    samples = {s + i for s in seeds for i in range(params.n)}  # vLLM seeds sample i with s + i
    assert len(samples) == 100 * params.n
    assert prompt_seed(SamplingParams(), 0) is None
    done = completion_from_choice({"index": 0, "text": "ab</a>", "token_ids": [1, 2, 3],
                                   "logprobs": {"token_logprobs": [-0.5, -1.0, -0.1]},
                                   "finish_reason": "stop"})
    assert (done.token_ids, done.logprobs, done.finish_reason) == (
        [1, 2, 3], [-0.5, -1.0, -0.1], "stop")
    with pytest.raises(RuntimeError, match="finish reason 'abort'"):
        completion_from_choice({"index": 0, "text": "", "token_ids": [],
                                "logprobs": {"token_logprobs": []}, "finish_reason": "abort"})
    with pytest.raises(ValueError, match="rollout.engine = 'hf'"):
        check_prompts([{"input_ids": [1], "pixel_values": torch.zeros(1)}], params)
    with pytest.raises(ValueError, match="top_p"):
        check_prompts([{"input_ids": [1]}], SamplingParams(top_p=0.0))


class _Receiver:
    """The worker side of the transfer as a plain rank-1 member of the group: it joins in
    ``init_weight_transfer_engine`` and receives each bucket in ``update_weights``."""

    def __init__(self) -> None:
        self.group: Any = None
        self.received: dict[str, torch.Tensor] = {}
        self.calls: list[str] = []

    def init_weight_transfer_engine(self, info: dict[str, Any]) -> None:
        self.group = gloo.open_group(info["master_address"], info["master_port"],
                                     rank=info["rank_offset"], world_size=info["world_size"],
                                     timeout_s=info["timeout_s"])

    def start_weight_update(self) -> None:
        self.calls.append("start")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        layout = gloo.BucketLayout(**update_info)
        buffer = torch.empty(layout.nbytes, dtype=torch.uint8)
        gloo.broadcast(self.group, buffer)
        self.received.update({n: t.clone() for n, t in gloo.unpack(buffer, layout)})
        self.calls.append("update")

    def finish_weight_update(self) -> None:
        self.calls.append("finish")


def test_gloo_transfer_delivers_every_tensor_in_buckets_cast_to_the_engine_dtype() -> None:
    generator = torch.Generator().manual_seed(0)
    weights = {
        "embed.weight": torch.randn(37, 16, generator=generator),
        "layers.0.norm.weight": torch.randn(16, generator=generator),
        "layers.0.proj.weight": torch.randn(16, 48, generator=generator).t(),  # a view
        "step": torch.tensor([3, 1, 4], dtype=torch.int64),
    }
    receiver = _Receiver()
    sender = GlooWeightSender(receiver, host="127.0.0.1", workers=1, timeout_s=60,
                              bucket_bytes=2048, dtype=torch.bfloat16)
    sender.connect()
    sender.send(iter(weights.items()))
    assert receiver.calls[0] == "start" and receiver.calls[-1] == "finish"
    assert receiver.calls.count("update") >= 2  # several buckets
    assert set(receiver.received) == set(weights)
    for name, tensor in weights.items():
        got = receiver.received[name]
        expected = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        assert got.dtype == expected.dtype and torch.equal(got, expected), name
    sender.close()


def test_a_missing_vllm_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from reasonctl.rollout.vllm.factory import build_vllm_engine
    from reasonctl.testing import make_tiny_model_dir, run_context

    model_dir = make_tiny_model_dir(tmp_path / "model")
    ctx = run_context({"model": {"name_or_path": str(model_dir)},
                       "backend": {"device": "cpu"}, "rollout": {"engine": "vllm"}},
                      output_dir=tmp_path / "run")
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(MissingDependencyError, match=r"pip install -e .*\[vllm\]"):
        build_vllm_engine(VLLMRolloutConfig(), ctx=ctx)


def test_colocated_mode_with_several_training_processes_points_to_server_mode(
        tmp_path: Path) -> None:
    from reasonctl.rollout.vllm.factory import build_vllm_engine
    from reasonctl.testing import make_tiny_model_dir, run_context

    model_dir = make_tiny_model_dir(tmp_path / "model")
    backend = SimpleNamespace(world_size=2, rank=0, device=torch.device("cpu"),
                              barrier=threading.Barrier(1).wait)
    ctx = run_context({"model": {"name_or_path": str(model_dir)},
                       "rollout": {"engine": "vllm"}}, output_dir=tmp_path / "run",
                      backend=backend)
    with pytest.raises(ConfigError, match="mode = 'server'"):
        build_vllm_engine(VLLMRolloutConfig(), ctx=ctx)
    with pytest.raises(ConfigError, match="rollout.vllm.server.port"):
        build_vllm_engine(VLLMRolloutConfig(mode="server"), ctx=ctx)


def test_both_engines_are_closed_by_the_runner_at_run_end() -> None:
    from reasonctl import Closes
    from reasonctl.rollout.vllm.engine import VLLMColocatedEngine
    from reasonctl.rollout.vllm.server import VLLMServerEngine

    # the runner calls close() on an engine that has it (Closes): the colocated engine
    # shuts vLLM down, the server engine stops the server it started
    assert issubclass(VLLMColocatedEngine, Closes)
    assert issubclass(VLLMServerEngine, Closes)
