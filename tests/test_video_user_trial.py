"""What a user's first trial of the video features on data of their own turned up: Cosmos-
Reason1 RL sets saved by ``datasets`` (options of a struct column), RL rows whose answer
names no option, and the messages and files of runs on such data."""

from __future__ import annotations

from pathlib import Path

import pytest
from data_factories import write_chat_jsonl, write_tiny_mp4

from reasonctl.core.errors import DataError
from reasonctl.data.formats.hf import HfConfig
from reasonctl.data.formats.hf_dataset import build_hf_dataset
from reasonctl.data.formats.jsonl import JsonlConfig, build_jsonl_dataset
from reasonctl.data.prompting import layout_mcq
from reasonctl.rewards.choice import ChoiceConfig, choice_judgement

COLOURS = {"A": "red", "B": "green", "C": "blue", "D": "yellow"}


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_mp4(tmp_path_factory.mktemp("clips") / "clip.mp4", frames=4, fps=4)


def test_saved_rl_set_rows_with_fewer_options_get_no_null_option(
        tmp_path: Path, clip: Path) -> None:
    datasets = pytest.importorskip("datasets")
    three = {k: v for k, v in COLOURS.items() if k != "D"}
    rows = [{"video": str(clip), "qa_pairs": {"question": "Which colour?", "index2ans": options,
                                               "answer": answer}}
            for options, answer in ((COLOURS, "D"), (three, "A"))]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "rl"))
    sample = build_hf_dataset(HfConfig(name=str(tmp_path / "rl")))[1]
    assert sample.meta["qa_pairs"]["index2ans"] == three  # the struct held "D": None
    prompt = layout_mcq(sample).messages[-1].text
    assert prompt == "Which colour?\nA. red\nB. green\nC. blue"
    # "D" is no option of this row: naming it is no pick (the first commitment decides)
    assert choice_judgement("<answer>A</answer>", sample, ChoiceConfig()).score == 1.0
    assert choice_judgement("<answer>D</answer>", sample, ChoiceConfig()).answer is None


def test_an_rl_answer_that_names_no_option_is_a_bad_row(tmp_path: Path, clip: Path) -> None:
    def row(answer: object) -> dict:
        return {"video": str(clip), "qa_pairs": {
            "question": "Which colour?", "index2ans": {"A": "red", "B": "blue"},
            "answer": answer}}

    good = ["B", "(b)", "B. blue", "blue", 1]
    path = write_chat_jsonl(tmp_path / "rl.jsonl", [*map(row, good), row("Z"), row("purple")])
    with pytest.raises(DataError, match=r"rl.jsonl:6: 'qa_pairs' answer 'Z' names none of its "
                                        r"options \(A: red, B: blue\)"):
        build_jsonl_dataset(JsonlConfig(path=str(path)))
    from reasonctl.data.messages import sample_from_record
    from reasonctl.data.rows import RowOptions, build_samples, read_json_rows

    resolver = JsonlConfig(path=str(path)).resolver(path.parent, "jsonl")
    dataset = build_samples(read_json_rows(path), lambda r: sample_from_record(r.value, resolver),
                            RowOptions(on_bad_row="skip"))
    assert [s.source.rsplit(":", 1)[1] for s in dataset.samples] == ["1", "2", "3", "4", "5"]
    assert [where.rsplit(":", 1)[1] for where, _ in dataset.skipped] == ["6", "7"]
    for sample in dataset.samples:
        assert choice_judgement("<answer>B</answer>", sample, ChoiceConfig()).score == 1.0


def cli(args: list[str]) -> tuple[int, str]:
    from typer.testing import CliRunner

    from reasonctl.cli.app import build_app
    from reasonctl.core.plugins import PluginHost

    result = CliRunner().invoke(build_app(PluginHost.load()), args)
    return result.exit_code, result.output


def test_infer_names_the_flag_of_a_bad_file_and_exits_2(tmp_path: Path) -> None:
    broken = tmp_path / "broken.mp4"
    broken.write_bytes(b"not a video" * 20)
    base = ["infer", "--model", "tiny-random-vl", "--prompt", "What colour?",
            "--max-new-tokens", "2"]
    code, output = cli([*base, "--video", str(broken)])
    assert code == 2, output
    said = " ".join(output.split())
    assert f"--video: cannot read video {broken}: Invalid data found" in said
    assert "re-encode it (ffmpeg -i FILE" in said  # what to do about it
    code, output = cli([*base, "--video", str(tmp_path / "none.mp4")])
    assert code == 2, output
    assert "none.mp4: no such file" in " ".join(output.split())


def test_llava_rows_give_grpo_rewards_their_answer_as_reference(tmp_path: Path) -> None:
    from data_factories import write_png

    from reasonctl.data.formats.llava import LlavaConfig, build_llava_dataset
    from reasonctl.rewards.exact_match import ExactMatchConfig, exact_match_judgement

    write_png(tmp_path / "red.png")
    path = write_chat_jsonl(tmp_path / "llava.jsonl", [
        {"image": "red.png", "conversations": [
            {"from": "human", "value": "<image>\nWhat colour is shown?"},
            {"from": "gpt", "value": "Red."}]},
        {"image": "red.png", "reference": "red", "conversations": [
            {"from": "human", "value": "<image>\nColour?"}, {"from": "gpt", "value": "Red."}]},
        {"image": "red.png", "conversations": [  # Cosmos-Reason SFT answers reason first
            {"from": "human", "value": "<image>\nColour?"},
            {"from": "gpt",
             "value": "<think>\nIt looks red.\n</think>\n\n<answer>\nred\n</answer>"}]},
    ])
    first, second, third = build_llava_dataset(LlavaConfig(path=str(path))).samples
    assert (first.reference, second.reference) == ("Red.", "red")  # a given reference wins
    assert third.reference == "red"
    assert exact_match_judgement("<answer>red</answer>", third.reference,
                                 ExactMatchConfig()).score == 1.0
    # without it every reward returned None: GRPO trained on nothing, with only a warning
    assert exact_match_judgement("red.", first.reference, ExactMatchConfig()).score == 1.0


def test_a_bad_row_drawn_again_is_listed_and_counted_once(tmp_path: Path) -> None:
    import json

    from reasonctl.testing import run_context

    ctx = run_context({"data": {"on_bad_row": "skip"}}, output_dir=tmp_path)
    broken = ("train.jsonl:2", "cannot read video broken.mp4: Invalid data")
    for _epoch in range(3):  # each epoch (and each retry of a step) draws the row again
        ctx.record_skipped_row(*broken)
    ctx.record_skipped_row("train.jsonl:4", "the prompt has 2033 tokens ...")
    assert ctx.skipped_rows == 2  # as `reasonctl data check` counts the corpus's bad rows
    listed = [json.loads(line)["row"] for line in
              (tmp_path / "skipped_rows.jsonl").read_text().splitlines()]
    assert listed == ["train.jsonl:2", "train.jsonl:4"]


def test_an_hf_runs_eval_file_is_read_as_data_files(tmp_path: Path, clip: Path) -> None:
    pytest.importorskip("datasets")
    rows = [{"video": str(clip), "qa_pairs": {"question": "Which colour?", "index2ans": {
        "A": "red", "B": "blue"}, "answer": letter}} for letter in "AB"]
    path = write_chat_jsonl(tmp_path / "eval.jsonl", rows)
    # `reasonctl eval --data eval.jsonl` of a run whose data.format is "hf" sets its name;
    # it was looked up on the Hub (a ConnectionError traceback offline)
    dataset = build_hf_dataset(HfConfig(name=str(path)))
    assert [s.meta["qa_pairs"]["answer"] for s in dataset.samples] == ["A", "B"]
    assert dataset.samples[0].source == f"{path}[train]:0"


def test_data_check_of_a_missing_data_file_is_a_config_error(tmp_path: Path) -> None:
    config = tmp_path / "sft.toml"
    config.write_text(f'[model]\nname_or_path = "tiny-random-vl"\n[data]\nformat = "jsonl"\n'
                      f'[data.jsonl]\npath = "{tmp_path / "gone.jsonl"}"\n')
    code, output = cli(["data", "check", "--config", str(config)])
    assert code == 2, output  # as `reasonctl run` and `config validate` report it
    assert f"data.jsonl.path: '{tmp_path / 'gone.jsonl'}' does not exist" in output


def test_a_row_that_stops_a_run_while_encoding_says_how_to_skip_it(tmp_path: Path) -> None:
    from reasonctl.core.types import ContentPart, Message, Sample
    from reasonctl.sdk.api import run

    def chat(question: str, answer: str | None) -> Sample:
        turns = [Message("user", [ContentPart("text", text=question)])]
        if answer is not None:
            turns.append(Message("assistant", [ContentPart("text", text=answer)]))
        return Sample(turns, source=f"rows.jsonl:{len(question)}")

    config = {"run": {"output_dir": str(tmp_path), "seed": 0},
              "train": {"lr": 1e-3, "max_steps": 1, "global_batch_size": 2,
                        "micro_batch_size": 2},
              "data": {"shuffle": False}, "backend": {"name": "single", "device": "cpu"},
              "logging": {"loggers": []}, "checkpoint": {"export_final": False}}
    # found when the batch is encoded (as an unreadable video or an over-long prompt is),
    # not when the file is read: the error named the row but not the way to go on
    with pytest.raises(DataError, match=r'rows.jsonl:3: no assistant turn .* \(set '
                                        r'data.on_bad_row = "skip" to skip bad rows\)'):
        run(config, datasets=[chat("1+1", None), chat("2+2?", "4")])


def test_evaluations_before_and_after_grpo_do_not_share_a_results_dir() -> None:
    # the video quickstart evaluates outputs/quickstart_video_sft/export/final, then
    # outputs/quickstart_video_grpo/export/final, on one eval.jsonl: both went to
    # outputs/eval/eval, the second overwriting the first's predictions
    from reasonctl.evaluation.locations import default_results_dir, model_label

    sft, grpo = ("outputs/quickstart_video_sft/export/final",
                 "outputs/quickstart_video_grpo/export/final/")
    assert default_results_dir(None, sft) == Path("outputs/eval/quickstart_video_sft-final")
    assert default_results_dir(None, grpo) == Path("outputs/eval/quickstart_video_grpo-final")
    assert model_label("tiny-random-vl") == "tiny-random-vl"
    assert model_label("/models/Cosmos-Reason1-7B") == "Cosmos-Reason1-7B"
    assert default_results_dir("results", sft) == Path("results")  # eval.results_dir wins


def test_eval_data_without_output_writes_under_the_models_name(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    runs = tmp_path / "outputs"
    for run in ("sft", "grpo"):
        shutil.copytree(tiny_model_dir, runs / run / "export" / "final")
    data = write_chat_jsonl(tmp_path / "eval.jsonl", [{"prompt": "Q?", "reference": "A",
                                                        "choices": ["p", "q"]}])
    monkeypatch.chdir(tmp_path)
    for run in ("sft", "grpo"):
        code, output = cli(["eval", "--model", f"outputs/{run}/export/final", "--data",
                            str(data), "--set", "eval.max_new_tokens=2"])
        assert code == 0, output
    for run in ("sft", "grpo"):
        assert (tmp_path / "outputs" / "eval" / f"{run}-final" / "eval" /
                "predictions.jsonl").is_file()


def test_cosmos_rl_grpo_keys_point_to_reasonctl_keys(tmp_path: Path) -> None:
    from reasonctl.core.config import load_config
    from reasonctl.core.errors import ConfigError
    from reasonctl.core.plugins import PluginHost

    path = tmp_path / "rl.toml"  # the GRPO keys of cosmos-rl's post-training guide
    path.write_text('[policy]\nmodel_gradient_checkpointing = true\n'
                    '[rollout.parallelism]\ntp_size = 2\n'
                    '[train.train_policy]\nrollout_batch_size = 32\nkl_penalty = 0.01\n'
                    '[grpo]\nnum_samples_per_prompt = 4\n'
                    '[data]\nformat = "llava"\n[data.llava]\nmedia_path = "coco"\n')
    with pytest.raises(ConfigError) as caught:
        load_config(str(path), registry=PluginHost.load().registry)
    problems = "\n".join(caught.value.problems)
    for expected in (
        "model_gradient_checkpointing -> model.gradient_checkpointing",
        # the rollout's tensor parallelism is the engine's, not the trainer's backend
        "rollout.parallelism: unknown key; cosmos-rl's 'parallelism' is reasonctl's "
        "rollout.vllm.tensor_parallel_size",
        "tp_size -> rollout.vllm.tensor_parallel_size",
        "rollout_batch_size -> algorithm.grpo.prompts_per_step",
        "kl_penalty -> algorithm.grpo.kl_beta",
        "grpo: unknown key; cosmos-rl's 'grpo' is reasonctl's [algorithm.grpo]",
        "num_samples_per_prompt -> rollout.n",
        "data.llava.media_path: unknown key; cosmos-rl's 'media_path' is reasonctl's "
        "data.llava.media_root",
    ):
        assert expected in problems, problems


def test_the_video_quickstart_checks_data_with_models_that_exist() -> None:
    # `data check` of the GRPO config came before the SFT run that writes the GRPO config's
    # model, so the second command of the quickstart failed ("model ... not found")
    import re
    import tomllib

    root = Path(__file__).resolve().parents[1]
    page = (root / "docs" / "video.md").read_text()
    block = page.split("## The quickstart", 1)[1].split("```bash", 1)[1].split("```")[0]
    written: set[str] = {"tiny-random-vl", "tiny-random-qwen3-vl"}
    for line in block.splitlines():
        config = re.search(r"--config (\S+\.toml)", line)
        if config is None:
            continue
        values = tomllib.loads((root / config.group(1)).read_text())
        if " data check " in line or " run " in line:
            assert values["model"]["name_or_path"] in written, line
        if " run " in line:
            written.add(f"{values['run']['output_dir']}/export/final")


def test_grpo_stops_when_no_prompt_of_the_data_encodes(tmp_path: Path) -> None:
    from reasonctl.sdk.api import run

    broken = tmp_path / "broken.mp4"
    broken.write_bytes(b"not a video" * 20)
    rows = [{"video": str(broken), "qa_pairs": {"question": f"Colour {i}?", "index2ans": {
        "A": "red", "B": "blue"}, "answer": "A"}} for i in range(3)]
    data = write_chat_jsonl(tmp_path / "rl.jsonl", rows)
    config = {"run": {"output_dir": str(tmp_path / "out")},
              "model": {"name_or_path": "tiny-random-vl", "max_length": 128},
              "data": {"format": "jsonl", "on_bad_row": "skip", "jsonl": {"path": str(data)}},
              "algorithm": {"name": "grpo", "grpo": {"prompts_per_step": 2}},
              "rollout": {"n": 2, "max_new_tokens": 2}, "train": {"max_steps": 3},
              "rewards": {"components": [{"name": "choice"}]},
              "backend": {"name": "single", "device": "cpu"}, "logging": {"loggers": []},
              "checkpoint": {"export_final": False}}
    # every step skipped its update and the run "completed" with the starting weights
    with pytest.raises(DataError, match=r"no prompt of the data set could be encoded \(all 3 "
                                        r"rows read were skipped as bad\)"):
        run(config)
    listed = (tmp_path / "out" / "skipped_rows.jsonl").read_text().splitlines()
    assert len(listed) == 3
