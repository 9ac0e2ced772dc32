"""``reasonctl eval``: accuracy of a model on a data set, overall and per source."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def eval_command(
    model: Annotated[str, typer.Option("--model", help="Model directory or storage URI.")],
    data: Annotated[str, typer.Option("--data", help="Evaluation data file (jsonl, llava).")],
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
    output: Annotated[
        Path | None, typer.Option("--output", help="Directory for predictions.jsonl.")
    ] = None,
    max_samples: Annotated[int | None, typer.Option("--max-samples", min=1)] = None,
    seed: Annotated[int, typer.Option("--seed")] = 0,
) -> None:
    """Generate one answer per sample (greedy unless ``eval.temperature`` is set), parse
    it per ``--answer-format``, and print the accuracy table.

    Writes ``predictions.jsonl`` (prompt, response, parsed answer, reference, correct,
    source) and ``summary.json`` to ``--output`` (default ``outputs/eval/<data name>``).
    The same model, data, config and seed give the same predictions.
    """
    from rich.console import Console

    from reasonctl.cli import common
    from reasonctl.evaluation.scoring import accuracy_table, write_report
    from reasonctl.evaluation.standalone import evaluate

    run_config = common.load(config, set_, values={})
    report = evaluate(
        run_config, common.host().registry, model=model, data=data,
        answer_format=answer_format, max_samples=max_samples, seed=seed,
    )
    directory = write_report(report, output or Path("outputs") / "eval" / Path(data).stem)
    console = Console()
    console.print(accuracy_table(report))
    console.print(f"predictions: {directory / 'predictions.jsonl'}", highlight=False)
