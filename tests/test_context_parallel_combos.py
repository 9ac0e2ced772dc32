"""Language-model context parallelism combined with LoRA and with tensor parallelism: peft
adapters on a sequence split over 2 gloo processes get the unsplit model's log-probs and
adapter gradients, and SFT with ``cp = 2`` x ``tp = 2`` on 4 processes follows the
single-process run."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_context_parallel import (
    _chat,
    _free_port,
    _launch,
    _losses,
    _run_in_process,
    _sft_config,
)


def _lora_outputs(model_dir: str, batch: dict[str, torch.Tensor], group: Any = None
                  ) -> dict[str, Any]:
    """Log-probs and adapter gradients of a LoRA model (gradients summed over ``group``)."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from reasonctl.backends.context_parallel import enable_context_parallel
    from reasonctl.backends.lora import LoraState
    from reasonctl.backends.token_logprobs import TokenLogprobModel
    from reasonctl.core.config import LoraSection

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="sdpa")
    LoraState.attach(model, LoraSection(rank=4, alpha=8), seed=3,
                     trainable_dtype=torch.float32)
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():  # nonzero B factors, so the A factors get gradients too
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
    policy = TokenLogprobModel(model, chunk_tokens=7)
    if group is not None:
        policy.context_parallel = enable_context_parallel(model, group)
    logprobs, _ = policy(batch, False, 1.0)
    (logprobs * batch["loss_mask"][:, 1:].float()).sum().backward()
    grads = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            assert param.grad is None, name
            continue
        grad = param.grad.clone()
        if group is not None:
            dist.all_reduce(grad, group=group)
        grads[name] = grad
    return {"logprobs": logprobs.detach(), "grads": grads}


def _worker(rank: int, port: int, model_dir: str, batch_path: str, result_path: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        batch = torch.load(batch_path, weights_only=True)
        result = _lora_outputs(model_dir, batch, dist.group.WORLD)
        if rank == 0:
            torch.save(result, result_path)
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_lora_on_split_sequences_matches_the_whole_model(tiny_model_dir: Path,
                                                         tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    from reasonctl.data.collate import collate
    from reasonctl.data.processing import ChatProcessor

    processor = ChatProcessor.from_pretrained(tiny_model_dir, max_length=256)
    samples = [_chat("reverse abc", "<answer>cba</answer>"),
               _chat("count the letters of context", "<answer>7</answer>")]
    batch = collate([processor.encode_sft(s) for s in samples], 0)
    batch_path, result_path = tmp_path / "batch.pt", tmp_path / "result.pt"
    torch.save(batch, batch_path)
    context = mp.get_context("spawn")
    port = _free_port()
    workers = [context.Process(target=_worker, args=(r, port, str(tiny_model_dir),
                                                     str(batch_path), str(result_path)))
               for r in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=300)
    assert all(w.exitcode == 0 for w in workers), [w.exitcode for w in workers]
    got = torch.load(result_path, weights_only=True)
    want = _lora_outputs(str(tiny_model_dir), batch)
    mask = batch["loss_mask"][:, 1:].bool()
    torch.testing.assert_close(got["logprobs"][mask], want["logprobs"][mask], atol=1e-5,
                               rtol=1e-4)
    assert want["grads"] and all("lora_" in name for name in want["grads"])
    assert got["grads"].keys() == want["grads"].keys()
    for name, grad in want["grads"].items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(got["grads"][name], grad, atol=1e-6, rtol=1e-3, msg=name)


@pytest.mark.slow
@pytest.mark.distributed
def test_sft_with_cp_and_tp_pairs_matches_one_process(tmp_path: Path,
                                                      tiny_model_dir: Path) -> None:
    """``cp = 2`` x ``tp = 2`` on 4 processes: each holds half the heads of half of every
    sequence; the losses are the single-device run's."""
    config = _sft_config(tmp_path, tiny_model_dir)
    single, grid = tmp_path / "single", tmp_path / "cp2tp2"
    _run_in_process(config, f"run.output_dir={single}", "backend.name=single",
                    "checkpoint.every_steps=0")
    _launch(config, grid, "--set", "backend.fsdp.cp=2", "--set", "backend.fsdp.tp=2",
            "--set", "checkpoint.every_steps=0", processes=4)
    want, got = _losses(single), _losses(grid)
    assert sorted(got) == [1, 2, 3, 4]
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=1e-4), step
