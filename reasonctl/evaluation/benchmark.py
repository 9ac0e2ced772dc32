"""``reasonctl eval --config eval.toml``: several benchmarks, one JSON per sample, resumable.

The benchmarks are the config's ``[[eval.datasets]]`` entries (name, path, format,
``answer_format``, ``max_samples``, ``fps``, ``max_pixels``); generation follows ``[eval]``
(``temperature``, ``max_new_tokens``, ``repetition_penalty``, ``seed``, ``batch_size``)
and ``[rollout]``, through the registered rollout engine built as in training
(:func:`~reasonctl.evaluation.standalone.evaluation_context`). For each benchmark,
``<results_dir>/<name>/<index>.json`` holds one sample's prompt, response, extracted answer,
reference, verdict and the generation settings; it is written (atomically) as soon as its
batch is generated.

With ``eval.resume`` (the default) a sample whose file exists with the same generation
settings and the same prompt and reference is not generated again; its saved response is
judged again, so verdicts always follow the current scoring rules. With ``temperature > 0``
the samples generated after a resume are drawn with other seeds than an uninterrupted run
would use. :mod:`reasonctl.evaluation.summary` then writes the accuracy table, CSV and chart.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reasonctl.algorithms.rollouts import mix_seed
from reasonctl.core.errors import ConfigError, ReasonctlError
from reasonctl.core.types import Sample
from reasonctl.evaluation.answers import AnswerScorer, evaluation_sample
from reasonctl.evaluation.locations import default_results_dir
from reasonctl.evaluation.scoring import Prediction, sampling_for_eval, score_samples
from reasonctl.runtime.composition import build_dataset, build_rollout_engine

if TYPE_CHECKING:
    from reasonctl.core.config import RunConfig
    from reasonctl.core.config.schema import EvalDataset
    from reasonctl.core.protocols import RunContext
    from reasonctl.core.registry import Registry

SETTINGS_KEY = "settings"
SAMPLE_KEY = "sample_key"


@dataclass
class BenchmarkResult:
    """The predictions of one benchmark, in sample order, and how many were reused."""

    name: str
    answer_format: str
    predictions: list[Prediction] = field(default_factory=list)
    reused: int = 0

    @property
    def correct(self) -> int:
        """Correct predictions."""
        return sum(p.correct for p in self.predictions)

    @property
    def accuracy(self) -> float:
        """Fraction of correct predictions (0 for none)."""
        return self.correct / len(self.predictions) if self.predictions else 0.0


@dataclass
class BenchmarkReport:
    """Every benchmark of one ``reasonctl eval --config`` run."""

    model: str
    results_dir: Path
    benchmarks: list[BenchmarkResult] = field(default_factory=list)


def run_benchmarks(
    config: RunConfig,
    registry: Registry,
    *,
    model: str | None = None,
    results_dir: str | Path | None = None,
    max_samples: int | None = None,
    seed: int | None = None,
    info: Callable[[str], None] = print,
) -> BenchmarkReport:
    """Evaluate ``model`` (default ``model.name_or_path``) on every ``[[eval.datasets]]``
    benchmark (see the module docstring) and return the report."""
    from reasonctl.environments.episodes import episode_limits
    from reasonctl.evaluation.standalone import evaluation_context

    entries = config.eval.datasets
    if not entries:
        raise ConfigError(["eval.datasets: no benchmarks; add [[eval.datasets]] entries with "
                           "name and path, or pass --data FILE"])
    model_name = model or config.model.name_or_path
    directory = (Path(results_dir) if results_dir
                 else default_results_dir(config.eval.results_dir, model_name))
    ctx = evaluation_context(config, registry, model=model)
    report = BenchmarkReport(model=model_name, results_dir=directory)
    engine = None
    base_seed = config.eval.seed if seed is None else seed
    params = sampling_for_eval(config, seed=base_seed)
    for index, entry in enumerate(entries):
        samples = _samples(ctx, entry, index, max_samples)
        answer_format = entry.answer_format or config.eval.answer_format
        scorer = AnswerScorer.from_config(answer_format, config, registry)
        settings = _settings(config, entry, model_name, params)
        result = BenchmarkResult(entry.name, answer_format)
        folder = directory / entry.name
        saved = _saved(folder, settings) if config.eval.resume else {}
        keys = [_sample_key(s) for s in samples]
        todo = [i for i in range(len(samples)) if saved.get(i, {}).get(SAMPLE_KEY) != keys[i]]
        result.reused = len(samples) - len(todo)
        info(f"{entry.name}: {len(samples)} samples, {result.reused} already scored, "
             f"{len(todo)} to generate")
        by_index: dict[int, Prediction] = {}
        for i in range(len(samples)):
            if i not in todo:
                by_index[i] = _rejudged(saved[i], samples[i], scorer)
        batch_size = config.eval.batch_size
        for start in range(0, len(todo), batch_size):
            chunk = todo[start : start + batch_size]
            if engine is None:
                engine = build_rollout_engine(ctx)
            chunk_params = replace(params, seed=mix_seed(base_seed, chunk[0]))
            generated = score_samples(engine, ctx.processor, [samples[i] for i in chunk],
                                      answer_format=answer_format, params=chunk_params,
                                      default_source=entry.name, scorer=scorer,
                                      environment=ctx.environment,
                                      limits=episode_limits(config)
                                      if ctx.environment is not None else None)
            for i, prediction in zip(chunk, generated.predictions, strict=True):
                by_index[i] = prediction
                _write_json(folder / f"{i:06d}.json", {
                    "index": i, "dataset": entry.name, **asdict(prediction),
                    SAMPLE_KEY: keys[i], SETTINGS_KEY: settings,
                })
        result.predictions = [by_index[i] for i in range(len(samples))]
        report.benchmarks.append(result)
    return report


def _samples(ctx: RunContext, entry: EvalDataset, index: int,
             max_samples: int | None) -> list[Sample]:
    config = ctx.config
    fmt = entry.format or config.data.format
    if fmt != "hf" and not Path(entry.path).exists():
        raise ConfigError([f"eval.datasets.{index}.path: {entry.path} does not exist "
                           f"(benchmark {entry.name!r})"])
    media = {"fps": entry.fps or config.eval.fps,
             "max_pixels": entry.max_pixels or config.eval.max_pixels}
    dataset = build_dataset(ctx, path=entry.path, format_name=fmt,
                            media={k: v for k, v in media.items() if v is not None})
    if len(dataset) == 0:
        raise ReasonctlError(f"benchmark {entry.name!r}: {entry.path} holds no samples")
    limit = max_samples or entry.max_samples or config.eval.max_samples
    count = len(dataset) if limit is None else min(limit, len(dataset))
    return [dataset[i] for i in range(count)]


def _settings(config: RunConfig, entry: EvalDataset, model: str, params: Any) -> dict[str, Any]:
    """What a saved response depends on besides its sample: model, generation, media."""
    sampling = asdict(params)
    sampling.pop("seed")
    return {
        "model": model,
        "sampling": sampling,
        "fps": entry.fps or config.eval.fps,
        "max_pixels": entry.max_pixels or config.eval.max_pixels,
        "system_prompt": config.data.system_prompt,
        "prompt_template": config.data.prompt_template,
        **({"environment": config.to_dict()["environment"]} if config.environment.name else {}),
    }


def _sample_key(sample: Sample) -> str:
    """A digest of the sample's messages (text and media paths) and reference."""
    content = [[m.role, [(p.type, p.text, p.path, p.fps, p.max_pixels) for p in m.content]]
               for m in sample.messages]
    text = json.dumps([content, sample.reference, sample.meta.get("choices"),
                       sample.meta.get("options"), sample.meta.get("qa_pairs")],
                      sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _saved(folder: Path, settings: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """The saved records of ``folder`` made with ``settings``, by sample index (unreadable
    or torn files are ignored: their samples are generated again)."""
    found: dict[int, dict[str, Any]] = {}
    if not folder.is_dir():
        return found
    for path in folder.glob("*.json"):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and record.get(SETTINGS_KEY) == settings \
                and isinstance(record.get("index"), int):
            found[record["index"]] = record
    return found


def _rejudged(record: dict[str, Any], sample: Sample, scorer: AnswerScorer) -> Prediction:
    judged = evaluation_sample(sample)
    reward, judgement = scorer.judge(record["response"], judged)
    return Prediction(
        prompt=record.get("prompt", ""), response=record["response"],
        extracted=judgement.answer, reference=judged.reference,
        correct=judgement.score == 1.0, source=record.get("source", ""),
        finish_reason=record.get("finish_reason", "stop"), sample=sample.source, reward=reward,
        reason=judgement.reason, episode=dict(record.get("episode") or {}),
    )


def _write_json(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(record, ensure_ascii=False, indent=1, default=str),
                         encoding="utf-8")
    os.replace(temporary, path)
