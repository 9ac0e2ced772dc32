"""``reasonctl eval``: accuracy of a model on a data set, or on the benchmarks of a config."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def eval_command(
    model: Annotated[str | None, typer.Option(
        "--model", help="Model directory or storage URI (default: model.name_or_path).")] = None,
    data: Annotated[str | None, typer.Option(
        "--data", help="One evaluation data file (jsonl, llava); without it, the config's "
        "benchmarks (eval.datasets) are evaluated.")] = None,
    answer_format: Annotated[
        str | None,
        typer.Option("--answer-format",
                     help="letter | reasoning | free | math (default: eval.answer_format)"),
    ] = None,
    config: Annotated[list[str] | None, typer.Option(
        "--config", "-c", help="TOML config file; repeat to deep-merge (later wins)."
    )] = None,
    set_: Annotated[list[str] | None, typer.Option(
        "--set", "-s", help="Override a key: --set rollout.max_new_tokens=512."
    )] = None,
    output: Annotated[Path | None, typer.Option(
        "--output", "--results-dir",
        help="Results directory (default <eval.results_dir or outputs/eval/<model>>/<data "
        "name> with --data, eval.results_dir or outputs/eval/<model> for benchmarks).",
    )] = None,
    max_samples: Annotated[int | None, typer.Option("--max-samples", min=1)] = None,
    seed: Annotated[int | None, typer.Option("--seed", help="Default eval.seed.")] = None,
) -> None:
    """Generate one answer per sample (greedy unless ``eval.temperature`` is set), judge it
    with the reward of its answer format, and print the accuracy table.

    With ``--data``: writes ``predictions.jsonl`` (prompt, response, the extracted answer
    and the reason of its verdict, reference, correct, source) and ``summary.json``
    (accuracy, per source, predictions per reason) to ``--output``. Without it, evaluates
    every benchmark of the config (eval.datasets): one JSON per sample under
    ``<results dir>/<benchmark>/`` (already scored samples are skipped when
    ``eval.resume``), then ``summary.json``, ``accuracy.csv`` and ``accuracy.png``.
    The same model, data, config and seed give the same predictions.
    """
    from rich.console import Console

    from reasonctl.cli import common

    run_config = common.load(config, set_, values={})
    console = Console()
    if data is None:
        from reasonctl.evaluation.benchmark import run_benchmarks
        from reasonctl.evaluation.summary import benchmark_table, write_summary

        if answer_format is not None:
            common.fail("--answer-format applies to --data; set answer_format in [eval] or "
                        "in each [[eval.datasets]] entry", code=2)
        report = run_benchmarks(run_config, common.host().registry, model=model,
                                results_dir=output, max_samples=max_samples, seed=seed,
                                info=lambda message: common.console.print(message,
                                                                          highlight=False))
        paths = write_summary(report)
        console.print(benchmark_table(report))
        console.print(f"results: {report.results_dir} (accuracy: {paths['csv'].name}, "
                      f"{paths['chart'].name})", highlight=False)
        return
    from reasonctl.evaluation.scoring import accuracy_table, write_report
    from reasonctl.evaluation.standalone import evaluate

    if model is None:
        model = run_config.model.name_or_path
    report = evaluate(
        run_config, common.host().registry, model=model, data=data,
        answer_format=answer_format, max_samples=max_samples,
        seed=run_config.eval.seed if seed is None else seed,
    )
    from reasonctl.evaluation.locations import default_results_dir

    directory = write_report(report, output or default_results_dir(
        run_config.eval.results_dir, model) / Path(data).stem)
    console.print(accuracy_table(report))
    console.print(f"predictions: {directory / 'predictions.jsonl'}", highlight=False)
