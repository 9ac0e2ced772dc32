"""The data Cosmos-Reason users have, as they have it: RL ``qa_pairs`` rows, SFT rows with
``conversations`` as JSON text, label columns turned into answers by templates, video
folders with spaced meta keys; and ``reasonctl data check`` on a corpus of broken files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from data_factories import write_chat_jsonl, write_tiny_mp4

from reasonctl.core.errors import DataError
from reasonctl.core.types import Sample
from reasonctl.data.formats.hf import HfConfig
from reasonctl.data.formats.hf_dataset import build_hf_dataset
from reasonctl.data.formats.jsonl import JsonlConfig, build_jsonl_dataset
from reasonctl.data.formats.video_folder import VideoFolderConfig, build_video_folder_dataset
from reasonctl.data.prompting import layout_mcq
from reasonctl.rewards.choice import ChoiceConfig, choice_judgement

QA = {"question": "What does the robot do next?",
      "index2ans": {"A": "picks up the cup", "B": "opens the drawer"}, "answer": "B"}


def parts(sample: Sample) -> list[tuple[str, str]]:
    return [(p.type, p.text if p.type == "text" else Path(p.path or "").name)
            for m in sample.messages for p in m.content]


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_mp4(tmp_path_factory.mktemp("clips") / "clip.mp4", frames=8, fps=4)


def test_cosmos_rl_qa_pairs_rows_need_no_prompt(tmp_path: Path, clip: Path) -> None:
    path = write_chat_jsonl(tmp_path / "rl.jsonl", [
        {"video": str(clip), "qa_pairs": QA},
        {"video": str(clip), "qa_pairs": json.dumps([QA])},  # JSON text, a list of one
    ])
    dataset = build_jsonl_dataset(JsonlConfig(path=str(path)))
    for sample in dataset.samples:
        assert parts(sample) == [("video", "clip.mp4"), ("text", QA["question"])]
        prompt = layout_mcq(sample).messages[0].text
        assert prompt == f"{QA['question']}\nA. picks up the cup\nB. opens the drawer"
        config = ChoiceConfig()
        assert choice_judgement("<answer>B</answer>", sample, config).score == 1.0
        assert choice_judgement("<answer>A</answer>", sample, config).score == 0.0
    bad = write_chat_jsonl(tmp_path / "bad.jsonl", [{"video": str(clip), "qa_pairs": {
        "question": "Which?", "index2ans": {"A": "x"}}}])
    with pytest.raises(DataError, match=r"bad.jsonl:1: 'qa_pairs' has no 'answer'"):
        build_jsonl_dataset(JsonlConfig(path=str(bad)))


def test_hf_sft_rows_with_json_text_conversations_and_a_video_column(
        tmp_path: Path, clip: Path) -> None:
    datasets = pytest.importorskip("datasets")
    conversations = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What happens in the clip?"},
        {"role": "assistant", "content": "<think>grey frames</think><answer>it fades</answer>"},
    ]
    nested = [{"role": "user", "content": [{"type": "video", "video": "clip.mp4"},
                                           {"type": "text", "text": "And here?"}]},
              {"role": "assistant", "content": "same"}]
    table = datasets.Dataset.from_dict({
        "id": ["a", "b"],
        "video": ["clip.mp4", "clip.mp4"],
        "conversations": [json.dumps(conversations), json.dumps(nested)],
    })
    table.save_to_disk(str(tmp_path / "sft"))
    notes: list[str] = []
    with pytest.warns(UserWarning, match=r"1 row\(s\) give the same file twice"):
        dataset = build_hf_dataset(HfConfig(name=str(tmp_path / "sft"),
                                            media_root=str(clip.parent)))
    first, second = dataset.samples
    assert parts(first) == [("text", "You are a helpful assistant."), ("video", "clip.mp4"),
                            ("text", "What happens in the clip?"),
                            ("text", "<think>grey frames</think><answer>it fades</answer>")]
    assert first.meta["id"] == "a"
    # the video is both a column and a part of the conversation: used once
    assert parts(second) == [("video", "clip.mp4"), ("text", "And here?"), ("text", "same")]
    assert not notes


def test_hf_label_column_becomes_question_and_answer_by_template(
        tmp_path: Path, clip: Path) -> None:
    datasets = pytest.importorskip("datasets")
    table = datasets.Dataset.from_dict({"video": [str(clip)] * 3, "label": [1, 0, 1],
                                        "time of event": [2.5, 0.0, 1.0]})
    table.to_parquet(str(tmp_path / "nexar.parquet"))
    config = HfConfig(
        data_files=str(tmp_path / "nexar.parquet"),
        prompt="Is there a collision in this video? Answer yes or no.",
        answer="{label}", value_names={"label": {"0": "no", "1": "yes"}},
    )
    dataset = build_hf_dataset(config)
    assert [s.messages[-1].text for s in dataset.samples] == ["yes", "no", "yes"]
    assert [s.reference for s in dataset.samples] == ["yes", "no", "yes"]
    assert parts(dataset.samples[0])[:2] == [
        ("video", "clip.mp4"), ("text", "Is there a collision in this video? Answer yes or no.")]
    assert dataset.samples[0].meta["time of event"] == 2.5
    spaced = build_hf_dataset(config.model_copy(update={"answer": "{label} at {time of event}"}))
    assert spaced.samples[0].messages[-1].text == "yes at 2.5"
    typo = config.model_copy(update={"answer": "{lable}"})
    with pytest.raises(DataError, match=r"nexar.parquet\[train\]:0: the answer template uses "
                                        r"\{lable\} but the row has only label"):
        build_hf_dataset(typo)


def test_jsonl_columns_and_integer_answers(tmp_path: Path) -> None:
    path = write_chat_jsonl(tmp_path / "qa.jsonl", [
        {"question": "2+2?", "solution": 4},
        {"question": "Is water wet?", "solution": True},
    ])
    config = JsonlConfig(path=str(path), columns={"prompt": "question", "answer": "solution"})
    first, second = build_jsonl_dataset(config).samples
    assert parts(first) == [("text", "2+2?"), ("text", "4")] and first.reference == 4
    assert second.messages[-1].text == "yes" and second.reference is True


def test_video_folder_templates_take_keys_with_spaces(tmp_path: Path, clip: Path) -> None:
    (tmp_path / "videos").mkdir()
    (tmp_path / "metas").mkdir()
    (tmp_path / "videos" / "c1.camera_front_wide_120fov.mp4").write_bytes(clip.read_bytes())
    meta = {"collision type": "rear-end", "weather": {"rain": True}}
    (tmp_path / "metas" / "c1.label.json").write_text(json.dumps(meta))
    config = VideoFolderConfig(root=str(tmp_path),
                               video_suffix=".camera_front_wide_120fov.mp4",
                               meta_suffix=".label.json", prompt="Describe {{the}} crash.",
                               answer="{collision type}; weather {weather}")
    (sample,) = build_video_folder_dataset(config).samples
    assert sample.messages[0].text == "Describe {the} crash."
    assert sample.reference == 'rear-end; weather {"rain": true}'


def test_a_file_that_is_not_utf8_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "latin1.jsonl"
    good = json.dumps({"prompt": "fine", "answer": "ok"}).encode()
    path.write_bytes(good + b"\n" + '{"prompt": "caf\u00e9", "answer": "x"}'.encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1.jsonl:2: not UTF-8 text \(byte 0xe9 at "
                                        r"column 16\); save the file as UTF-8"):
        build_jsonl_dataset(JsonlConfig(path=str(path)))


def write_broken_corpus(root: Path, clip: Path) -> tuple[Path, list[str]]:
    """SFT rows: good ones and one of each kind of problem; returns the file and the
    expected ``file:line`` of every bad row."""
    (root / "broken.mp4").write_bytes(b"\x00not a video" * 50)
    long_prompt = "word " * 300
    rows: list[Any] = [
        {"prompt": [{"type": "video", "video": str(clip)}, "What is shown?"], "answer": "grey"},
        '{"prompt": "unterminated',
        {"prompt": [{"type": "video", "video": "missing.mp4"}, "?"], "answer": "x"},
        {"prompt": [{"type": "video", "video": "broken.mp4"}, "?"], "answer": "x"},
        {"prompt": long_prompt, "answer": "cut off"},
        {"messages": [{"role": "user", "content": "no answer here"}]},
        {"prompt": "Fine?", "answer": "fine"},
    ]
    path = write_chat_jsonl(root / "train.jsonl", rows)
    with path.open("ab") as handle:
        handle.write(b'{"prompt": "caf\xe9", "answer": "x"}\n')
    return path, [f"{path}:{n}" for n in (2, 3, 4, 5, 6, 8)]


def test_data_check_names_every_bad_row(tmp_path: Path, clip: Path) -> None:
    path, bad = write_broken_corpus(tmp_path, clip)
    config = tmp_path / "sft.toml"
    config.write_text(
        f'[model]\nname_or_path = "tiny-random-vl"\nmax_length = 256\n'
        f'[data]\nformat = "jsonl"\n[data.jsonl]\npath = "{path}"\nfps = 2.0\n'
        '[algorithm]\nname = "sft"\n')
    out = subprocess.run([sys.executable, "-m", "reasonctl", "data", "check", "--config",
                          str(config), "--workers", "2"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr
    text = out.stdout
    assert "rows: 8 read, 2 usable, 6 bad" in text, text + out.stderr
    assert "media read: 2 video(s), 0 image(s)" in text  # and one not found
    listed = [line.strip() for line in text.splitlines() if line.startswith("  /")]
    assert [line.rsplit(": ", 1)[0].split(": ")[0] for line in listed] == bad
    reasons = "\n".join(listed)
    for expected in ("invalid JSON", "video file not found", "cannot read video",
                     "the answer is cut off", "no assistant turn", "not UTF-8 text"):
        assert expected in reasons
    assert "tokens per sample: p50" in text
    # as RL prompts, the rows without an answer are fine and a long text prompt is cut
    from reasonctl.core.config import load_config
    from reasonctl.core.plugins import PluginHost
    from reasonctl.data.check import check_data

    registry = PluginHost.load().registry
    rl = check_data(load_config(str(config), ["algorithm.name='grpo'"], registry=registry),
                    registry)
    assert (rl.rows, rl.samples, len(rl.bad), rl.truncated) == (8, 4, 4, 1)


def test_cosmos_rl_key_names_point_to_reasonctl_keys(tmp_path: Path) -> None:
    from reasonctl.core.config import load_config
    from reasonctl.core.errors import ConfigError
    from reasonctl.core.plugins import PluginHost

    path = tmp_path / "cosmos.toml"
    path.write_text('[train]\nepoch = 3\ntrain_batch_per_replica = 4\n'
                    '[train.ckpt]\nsave_freq = 10\nmax_keep = 2\n'
                    '[policy]\nmodel_name_or_path = "x"\n[policy.parallelism]\ndp_shard_size = 4\n'
                    '[data]\nformat = "llava"\n[data.llava]\nannotation_path = "a.json"\n')
    with pytest.raises(ConfigError) as caught:
        load_config(str(path), registry=PluginHost.load().registry)
    problems = "\n".join(caught.value.problems)
    for expected in (
        "train.epoch: unknown key; cosmos-rl's 'epoch' is reasonctl's train.epochs",
        "train.train_batch_per_replica: unknown key; cosmos-rl's 'train_batch_per_replica' is "
        "reasonctl's train.global_batch_size",
        "train.ckpt: unknown key; cosmos-rl's 'ckpt' is reasonctl's [checkpoint]; inside it: "
        "save_freq -> checkpoint.every_steps, max_keep -> checkpoint.keep",
        "parallelism.dp_shard_size -> --nproc-per-node N",
        "data.llava.annotation_path: unknown key; cosmos-rl's 'annotation_path' is reasonctl's "
        "data.llava.path",
    ):
        assert expected in problems
