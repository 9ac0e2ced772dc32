"""Dataset formats: jsonl, llava, hf and video_folder, through the installed plugins."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from reasonctl.core.config import load_config
from reasonctl.core.errors import DataError
from reasonctl.core.lifecycle import LifecycleHooks
from reasonctl.core.protocols import RunContext
from reasonctl.core.types import ContentPart
from reasonctl.runtime.composition import build_dataset
from tests.data_factories import write_chat_jsonl, write_png


@pytest.fixture
def build(plugin_host, tmp_path):
    """``build(format, config_dict, **data_options)`` as a run builds it: through the plugin
    registry, with the ``[data]`` options applied by the run's dataset view."""

    def make(name: str, config: dict[str, Any], **data: Any):
        values = {"data": {"format": name, name: config, **data},
                  "run": {"output_dir": str(tmp_path / "run")}}
        run_config = load_config([], registry=plugin_host.registry, values=values)
        ctx = RunContext(config=run_config, registry=plugin_host.registry,
                         hooks=LifecycleHooks(None), output_dir=tmp_path / "run")
        return build_dataset(ctx)

    return make


def parts(sample) -> list[tuple[str, str]]:
    """(role, type:value) pairs for compact assertions."""
    out = []
    for message in sample.messages:
        for part in message.content:
            value = part.text if part.type == "text" else Path(part.path).name
            out.append((message.role, f"{part.type}:{value}"))
    return out


# --- jsonl ----------------------------------------------------------------------------


def test_jsonl_accepts_chat_typed_parts_and_prompt_rows(tmp_path, build):
    write_png(tmp_path / "media" / "cat.png")
    (tmp_path / "media" / "clip.mp4").write_bytes(b"not decoded at load time")
    path = write_chat_jsonl(tmp_path / "train.jsonl", [
        {"messages": [{"role": "user", "content": "2+2?"},
                      {"role": "assistant", "content": "4"}], "reference": "4"},
        {"messages": [{"role": "user", "content": [
            {"type": "video", "video": "clip.mp4", "fps": 4},
            {"type": "image", "path": "cat.png"},
            {"type": "text", "text": "What?"}]},
            {"role": "assistant", "content": "A cat."}], "meta": {"split": "a"}},
        {"prompt": "Say hi", "response": "hi", "choices": ["A", "B"]},
        {"prompt": "1+1?", "reference": "2"},
        {"prompt": "3+3?", "answer": "6", "system": "Be terse."},
    ])
    dataset = build("jsonl", {"path": str(path), "media_root": str(tmp_path / "media"),
                              "fps": 2.0, "max_pixels": 50176})
    assert len(dataset) == 5 and dataset.skipped_rows == 0
    first, media, pair, rl, with_system = (dataset[i] for i in range(5))
    assert parts(first) == [("user", "text:2+2?"), ("assistant", "text:4")]
    assert first.reference == "4" and first.source == f"{path}:1"
    assert parts(media) == [("user", "video:clip.mp4"), ("user", "image:cat.png"),
                            ("user", "text:What?"), ("assistant", "text:A cat.")]
    video, image = media.messages[0].content[:2]
    assert video.path == str(tmp_path / "media" / "clip.mp4")
    assert (video.fps, video.max_pixels) == (4.0, 50176)  # part fps wins over the default
    assert (image.fps, image.max_pixels) == (2.0, 50176)
    assert media.meta == {"split": "a"}
    assert parts(pair) == [("user", "text:Say hi"), ("assistant", "text:hi")]
    assert pair.meta == {"choices": ["A", "B"]} and pair.reference is None
    assert parts(rl) == [("user", "text:1+1?")] and rl.reference == "2"
    assert rl.prompt_messages() == rl.messages
    assert parts(with_system)[0] == ("system", "text:Be terse.")
    assert with_system.reference == "6"


def test_jsonl_bad_rows_stop_with_file_line_or_are_skipped(tmp_path, build):
    path = write_chat_jsonl(tmp_path / "rows.jsonl", [
        {"prompt": "ok", "response": "fine"},
        "{not json",
        "",
        {"messages": [{"role": "robot", "content": "beep"}]},
        {"question": "wrong layout"},
        {"prompt": "fine too"},
    ])
    with pytest.raises(DataError, match=rf"^{path}:2: invalid JSON"):
        build("jsonl", {"path": str(path)})
    dataset = build("jsonl", {"path": str(path)}, on_bad_row="skip")
    assert [s.source for s in list(dataset)] == [f"{path}:1", f"{path}:6"]
    assert dataset.skipped_rows == 3
    with pytest.raises(DataError, match=r"rows.jsonl:4: messages\[0\] has role 'robot'"):
        build("jsonl", {"path": str(write_chat_jsonl(tmp_path / "rows.jsonl", [
            {"prompt": "a"}, {"prompt": "b"}, {"prompt": "c"},
            {"messages": [{"role": "robot", "content": "beep"}]}]))})


def test_jsonl_missing_media_names_the_full_path(tmp_path, build):
    path = write_chat_jsonl(tmp_path / "data" / "rows.jsonl", [
        {"messages": [{"role": "user", "content": [{"type": "image", "image": "imgs/x.png"}]}]},
    ])
    expected = tmp_path / "data" / "imgs" / "x.png"  # relative to the data file by default
    with pytest.raises(DataError, match=rf"rows.jsonl:1: .*image file not found: {expected}"):
        build("jsonl", {"path": str(path)})
    with pytest.raises(DataError, match=r"URL"):
        build("jsonl", {"path": str(write_chat_jsonl(tmp_path / "u.jsonl", [
            {"prompt": [{"type": "image", "image": "https://x.org/a.png"}]}]))})


def test_jsonl_data_options_limit_and_rewrite_prompts(tmp_path, build):
    path = write_chat_jsonl(tmp_path / "a.jsonl", [{"prompt": f"q{i}"} for i in range(5)])
    second = write_chat_jsonl(tmp_path / "b.jsonl", [{"prompt": "other"}])
    dataset = build("jsonl", {"path": [str(path), str(second)]}, max_samples=3,
                    system_prompt="SYS", prompt_template="Question: {prompt}\nThink first.")
    assert len(dataset) == 3
    assert parts(dataset[1]) == [("system", "text:SYS"),
                                 ("user", "text:Question: q1\nThink first.")]
    both = build("jsonl", {"path": [str(path), str(second)]}, prompt_template="Be brief.")
    assert len(both) == 6 and parts(both[5]) == [("user", "text:other\nBe brief.")]
    with pytest.raises(DataError, match="data.jsonl.path: data file not found"):
        build("jsonl", {"path": str(tmp_path / "nope.jsonl")})


# --- llava ----------------------------------------------------------------------------


def test_llava_tags_place_media_where_they_appear(tmp_path, build):
    for name in ("a.png", "b.png", "c.png"):
        write_png(tmp_path / "imgs" / name)
    (tmp_path / "imgs" / "v.mp4").write_bytes(b"x")
    rows = [
        {"id": "one", "image": "a.png", "conversations": [
            {"from": "human", "value": "<image>\nWhat is this?"},
            {"from": "gpt", "value": "A dog."}]},
        {"id": "two", "images": ["b.png", "c.png"], "video": "v.mp4", "conversations": [
            {"from": "system", "value": "You see."},
            {"from": "human", "value": "Compare <image> with <image>. Then <video>"},
            {"from": "gpt", "value": "Same."}]},
        {"id": "three", "image": "a.png", "conversations": [
            {"from": "human", "value": "No tag here"}, {"from": "gpt", "value": "ok"}]},
    ]
    annotation = tmp_path / "ann" / "llava.json"
    annotation.parent.mkdir()
    annotation.write_text(json.dumps(rows, indent=2))
    dataset = build("llava", {"path": str(annotation), "media_root": str(tmp_path / "imgs")})
    one, two, three = list(dataset)
    assert parts(one) == [("user", "image:a.png"), ("user", "text:What is this?"),
                          ("assistant", "text:A dog.")]
    assert one.meta == {"id": "one"}
    assert parts(two) == [
        ("system", "text:You see."), ("user", "text:Compare"), ("user", "image:b.png"),
        ("user", "text:with"), ("user", "image:c.png"), ("user", "text:. Then"),
        ("user", "video:v.mp4"), ("assistant", "text:Same."),
    ]
    assert parts(three)[:2] == [("user", "image:a.png"), ("user", "text:No tag here")]
    # Each element of a JSON array is located at the line where it starts.
    lines = annotation.read_text().splitlines()
    start_of_two = next(i for i, line in enumerate(lines, 1) if '"two"' in line) - 1
    assert two.source == f"{annotation}:{start_of_two}"


def test_llava_tag_count_mismatch_and_missing_image(tmp_path, build):
    write_png(tmp_path / "a.png")
    annotation = tmp_path / "llava.json"
    rows = [
        {"image": "a.png", "conversations": [{"from": "human", "value": "<image><image>"},
                                             {"from": "gpt", "value": "x"}]},
        {"image": "gone.png", "conversations": [{"from": "human", "value": "<image>"}]},
        {"conversation": []},
        {"image": "a.png", "conversations": [{"from": "human", "value": "<image> ok"}]},
    ]
    annotation.write_text("[\n" + ",\n".join(json.dumps(r) for r in rows) + "\n]\n")
    with pytest.raises(DataError, match=r"llava.json:2: the text has 2 <image> tag\(s\) but"):
        build("llava", {"path": str(annotation)})
    dataset = build("llava", {"path": str(annotation)}, on_bad_row="skip")
    assert len(dataset) == 1 and dataset.skipped_rows == 3
    assert dataset[0].source == f"{annotation}:5"
    with pytest.raises(DataError, match=rf"image file not found: {tmp_path / 'gone.png'}"):
        build("llava", {"path": str(_only(annotation, rows[1]))})


def _only(annotation: Path, row: dict) -> Path:
    path = annotation.with_name("single.json")
    path.write_text(json.dumps([row]))
    return path


# --- hf -------------------------------------------------------------------------------


def test_hf_saved_dataset_with_split_slicing_and_column_mapping(tmp_path, build):
    datasets = pytest.importorskip("datasets")
    rows = [{"question": f"q{i}", "label": str(i), "solution": f"s{i}"} for i in range(6)]
    train = datasets.Dataset.from_list(rows)
    datasets.DatasetDict({"train": train, "test": train.select(range(2))}).save_to_disk(
        str(tmp_path / "dd")
    )
    columns = {"prompt": "question", "response": "solution", "reference": "label"}
    dataset = build("hf", {"name": str(tmp_path / "dd"), "split": "train[2:5]",
                           "columns": columns})
    assert [parts(s) for s in list(dataset)][0] == [("user", "text:q2"),
                                                      ("assistant", "text:s2")]
    assert [s.reference for s in list(dataset)] == ["2", "3", "4"]
    assert dataset[0].source == f"{tmp_path / 'dd'}[train]:2"
    assert len(build("hf", {"name": str(tmp_path / "dd"), "split": "test",
                            "columns": columns})) == 2
    assert len(build("hf", {"name": str(tmp_path / "dd"), "split": "train[:50%]",
                            "columns": columns})) == 3
    with pytest.raises(DataError, match=r"column\(s\) nope not in .*available: question"):
        build("hf", {"name": str(tmp_path / "dd"), "columns": {"prompt": "nope"}})
    with pytest.raises(DataError, match=r"no split 'validation'"):
        build("hf", {"name": str(tmp_path / "dd"), "split": "validation"})


def test_hf_data_files_messages_and_embedded_images(tmp_path, build):
    datasets = pytest.importorskip("datasets")
    data_file = write_chat_jsonl(tmp_path / "chat.jsonl", [
        {"conv": [{"role": "user", "content": f"hi {i}"},
                  {"role": "assistant", "content": f"yo {i}"}]} for i in range(4)
    ])
    dataset = build("hf", {"data_files": str(data_file), "split": "train[:3]",
                           "columns": {"messages": "conv"}})
    assert len(dataset) == 3
    assert parts(dataset[2]) == [("user", "text:hi 2"), ("assistant", "text:yo 2")]
    png = write_png(tmp_path / "img.png", size=(8, 8))
    with_images = datasets.Dataset.from_dict(
        {"img": [str(png)], "q": ["what?"]}
    ).cast_column("img", datasets.Image())
    with_images.save_to_disk(str(tmp_path / "imgs"))
    png.unlink()  # only the bytes embedded in the dataset remain
    sample = build("hf", {"name": str(tmp_path / "imgs"),
                          "columns": {"image": "img", "prompt": "q"}})[0]
    image = sample.messages[0].content[0]
    assert image.type == "image" and Path(image.path).is_file()
    from PIL import Image

    assert Image.open(image.path).size == (8, 8)


# --- video_folder ---------------------------------------------------------------------


def test_video_folder_matches_videos_to_metas(tmp_path, build):
    root = tmp_path / "ds"
    suffix = ".camera_front_wide_120fov.mp4"
    for name in ("a", "b", "c", "d"):
        (root / "videos").mkdir(parents=True, exist_ok=True)
        (root / "videos" / f"{name}{suffix}").write_bytes(b"x")
    (root / "videos" / "notes.txt").write_text("ignored")
    (root / "metas").mkdir()
    (root / "metas" / "a.label.json").write_text(json.dumps({"caption": "A car turns."}))
    (root / "metas" / "b.label.json").write_text(
        json.dumps({"caption": "Rain.", "weather": "wet"})
    )
    (root / "metas" / "d.label.json").write_text('{"caption": broken')
    config = {"root": str(root), "video_suffix": suffix, "meta_suffix": ".label.json",
              "field": "caption", "prompt": "Describe clip {id}.", "answer": "{meta}",
              "fps": 4}
    with pytest.raises(DataError) as excinfo:
        build("video_folder", config)
    message = str(excinfo.value)
    assert message.startswith(f"{root / 'videos' / ('c' + suffix)}:1: no meta file")
    assert str(root / "metas" / "c.label.json") in message
    dataset = build("video_folder", config, on_bad_row="skip")
    assert dataset.skipped_rows == 2 and len(dataset) == 2
    a, b = list(dataset)
    assert parts(a) == [("user", f"video:a{suffix}"), ("user", "text:Describe clip a."),
                        ("assistant", "text:A car turns.")]
    assert a.reference == "A car turns." and a.messages[0].content[0].fps == 4.0
    whole = build("video_folder", {**config, "field": None}, on_bad_row="skip")
    assert json.loads(whole[0].reference) == {"caption": "A car turns."}
    keyed = build("video_folder", {**config, "answer": "{caption} ({id})"}, on_bad_row="skip")
    assert keyed[1].reference == "Rain. (b)"
    with pytest.raises(DataError, match=r"a.label.json:1: the answer template uses \{weather\}"):
        build("video_folder", {**config, "field": None, "answer": "{weather}"})


def test_video_folder_plain_text_metas_by_default(tmp_path, build):
    (tmp_path / "videos").mkdir()
    (tmp_path / "metas").mkdir()
    (tmp_path / "videos" / "x.mp4").write_bytes(b"x")
    (tmp_path / "metas" / "x.txt").write_text("  A quiet street.\n")
    sample = build("video_folder", {"root": str(tmp_path)})[0]
    assert sample.messages[0].content == [
        ContentPart("video", path=str(tmp_path / "videos" / "x.mp4")),
        ContentPart("text", text="Describe what you see in this video."),
    ]
    assert sample.reference == "A quiet street."
