"""Context parallelism on CPU (gloo): sequences split over 2 and 4 processes give the log-probs,
entropy and weight gradients of the unsplit model (Qwen2 padded and packed rows, Qwen3, the
Qwen2.5-VL language tower with images), and the fsdp backend with ``cp = 2`` follows the
single-process SFT and GRPO runs."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch

from reasonctl.core.types import ContentPart, Message, Sample

TEMPERATURE = 0.7


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _load(model_dir: str) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen2_5_VLForConditionalGeneration

    config = AutoConfig.from_pretrained(model_dir)
    cls = (Qwen2_5_VLForConditionalGeneration if config.model_type == "qwen2_5_vl"
           else AutoModelForCausalLM)
    return cls.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")


def _outputs(model_dir: str, batch: dict[str, torch.Tensor], group: Any = None
             ) -> dict[str, Any]:
    """Log-probs, entropy and the gradients of a loss using both (summed over ``group``)."""
    import torch.distributed as dist

    from reasonctl.backends.context_parallel import enable_context_parallel
    from reasonctl.backends.token_logprobs import TokenLogprobModel

    torch.manual_seed(0)
    model = _load(model_dir)
    policy = TokenLogprobModel(model, chunk_tokens=7)
    if group is not None:
        policy.context_parallel = enable_context_parallel(model, group)
    logprobs, entropy = policy(batch, True, TEMPERATURE)
    mask = batch["loss_mask"][:, 1:].float()
    ((logprobs - 0.1 * entropy) * mask).sum().backward()
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        if group is not None:
            dist.all_reduce(grad, group=group)
        grads[name] = grad
    return {"logprobs": logprobs.detach(), "entropy": entropy.detach(), "grads": grads}


def _worker(rank: int, world: int, port: int, cases_path: str, result_path: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        cases = torch.load(cases_path, weights_only=True)
        results = {name: _outputs(case["model_dir"], case["batch"], dist.group.WORLD)
                   for name, case in cases.items()}
        if rank == 0:
            torch.save(results, result_path)
    finally:
        dist.destroy_process_group()


def _chat(prompt: str, answer: str, image: Path | None = None) -> Sample:
    parts = [ContentPart("image", path=str(image))] if image is not None else []
    user = Message("user", [*parts, ContentPart("text", text=prompt)])
    return Sample([user, Message("assistant", [ContentPart("text", text=answer)])])


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[str, Any]:
    from data_factories import write_png
    from transformers import Qwen3Config

    from reasonctl.data.collate import collate
    from reasonctl.data.processing import ChatProcessor
    from reasonctl.models.tiny import build_tiny_tokenizer
    from reasonctl.models.tiny_vl import make_tiny_qwen2_5_vl_dir

    root = tmp_path_factory.mktemp("cp-cases")
    tokenizer = build_tiny_tokenizer()
    qwen3_dir = root / "qwen3"
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, tie_word_embeddings=True)
    torch.manual_seed(1)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(config).save_pretrained(qwen3_dir)
    tokenizer.save_pretrained(qwen3_dir)
    vl_dir = make_tiny_qwen2_5_vl_dir(root / "vl", seed=0)

    text = [_chat("reverse abc", "<answer>cba</answer>"),
            _chat("count the letters of context", "<answer>7</answer>"),
            _chat("hi", "ok")]
    processor = ChatProcessor.from_pretrained(tiny_model_dir, max_length=256)
    encoded = [processor.encode_sft(s) for s in text]
    images = [_chat("which picture?", f"<answer>{i}</answer>",
                    write_png(root / f"{i}.png", (56, 56), seed=i)) for i in range(2)]
    vl = ChatProcessor.from_pretrained(vl_dir, max_length=512)
    vl_encoded = [vl.encode_sft(s) for s in images]
    return {
        "qwen2_padded": {"model_dir": str(tiny_model_dir), "batch": collate(encoded, 0)},
        "qwen2_packed": {"model_dir": str(tiny_model_dir),
                         "batch": collate(encoded, 0, pack=True)},
        "qwen3": {"model_dir": str(qwen3_dir), "batch": collate(encoded[:2], 0)},
        "qwen2_5_vl": {"model_dir": str(vl_dir), "batch": collate(vl_encoded, 0)},
        "qwen2_5_vl_packed": {"model_dir": str(vl_dir),
                              "batch": collate(vl_encoded, 0, pack=True)},
    }


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_split_sequences_match_the_whole_model(world: int, cases: dict[str, Any],
                                               tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    cases_path, result_path = tmp_path / "cases.pt", tmp_path / "result.pt"
    torch.save(cases, cases_path)
    context = mp.get_context("spawn")
    port = _free_port()
    workers = [context.Process(target=_worker,
                               args=(r, world, port, str(cases_path), str(result_path)))
               for r in range(world)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=300)
    assert all(w.exitcode == 0 for w in workers), [w.exitcode for w in workers]
    results = torch.load(result_path, weights_only=True)
    for name, case in cases.items():
        want = _outputs(case["model_dir"], case["batch"])
        got = results[name]
        mask = case["batch"]["loss_mask"][:, 1:].bool()
        assert got["logprobs"].shape == want["logprobs"].shape, name
        torch.testing.assert_close(got["logprobs"][mask], want["logprobs"][mask],
                                   atol=1e-5, rtol=1e-4, msg=name)
        torch.testing.assert_close(got["entropy"][mask], want["entropy"][mask],
                                   atol=1e-5, rtol=1e-4, msg=name)
        assert got["grads"].keys() == want["grads"].keys()
        for param, grad in want["grads"].items():
            torch.testing.assert_close(got["grads"][param], grad, atol=1e-5, rtol=1e-3,
                                       msg=f"{name}: {param}")
