"""``reasonctl rewards score``: a config's rewards on saved completions, offline."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from reasonctl.cli.common import ConfigOption, SetOption, handle_errors


def rewards_app() -> typer.Typer:
    """The ``rewards`` sub-commands."""
    app = typer.Typer(no_args_is_help=True)
    app.command("score")(handle_errors(score_command))
    return app


def score_command(
    data: Annotated[Path, typer.Option(
        "--data", help="Completions file: JSON Lines rows with prompt, reference, completion "
        "(and optional options/choices, meta).")],
    config: ConfigOption = None,
    set_: SetOption = None,
    output: Annotated[Path | None, typer.Option(
        "--output", help="Per-row scores (JSON Lines); default "
        "outputs/rewards/<data name>.scores.jsonl.")] = None,
    explain: Annotated[bool, typer.Option(
        "--explain", help="Record per row and reward what was extracted and the reason "
        "of its score, and count rows per reason.")] = False,
) -> None:
    """Score each completion with the config's rewards (rewards.components), as training would.

    Prints the mean, spread and coverage of each reward and of the weighted total, and
    writes one JSON line per completion (source, completion, reference, scores, total;
    with --explain also explanations: {reward: {extracted, reason}}).
    """
    from rich.console import Console
    from rich.table import Table

    from reasonctl.cli import common
    from reasonctl.core.reward_set import RewardSet
    from reasonctl.sdk.scoring import ScoreReport, read_completions

    run_config = common.load(config, set_, values={})
    samples, completions = read_completions(data)
    report = ScoreReport.of(RewardSet.from_config(run_config, common.host().registry),
                            samples, completions, explain=explain)
    path = report.write_jsonl(output or Path("outputs") / "rewards" / f"{data.stem}.scores.jsonl")
    metrics = report.metrics
    out = Console()
    table = Table(title=f"Rewards on {len(completions)} completions - {data.name}")
    for column, justify in (("reward", "left"), ("weight", "right"), ("mean", "right"),
                            ("std", "right"), ("coverage", "right")):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for name, weight in report.weights.items():
        mean = metrics.get(f"reward/{name}/mean")
        std = metrics.get(f"reward/{name}/std")
        table.add_row(name, f"{weight:g}", "-" if mean is None else f"{mean:.4f}",
                      "-" if std is None else f"{std:.4f}",
                      f"{metrics[f'reward/{name}/coverage']:.0%}")
    table.add_section()
    table.add_row("total", "", f"{metrics['reward/mean']:.4f}", f"{metrics['reward/std']:.4f}",
                  "", style="bold")
    out.print(table)
    if explain:
        out.print(reasons_table(report.reason_counts(), len(completions)))
    if report.scores.errors:
        out.print(f"{len(report.scores.errors)} completion(s) failed and scored 0 "
                  "(rewards.on_error = \"zero\")", highlight=False)
    out.print(f"scores: {path}", highlight=False)


def reasons_table(counts: dict[str, dict[str, int]], rows: int) -> Any:
    """A rich table: per reward, how many rows were scored for each reason."""
    from rich.table import Table

    table = Table(title="Why: rows per reason")
    for column, justify in (("reward", "left"), ("reason", "left"), ("rows", "right"),
                            ("share", "right")):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for name, reasons in counts.items():
        for index, (reason, count) in enumerate(reasons.items()):
            table.add_row(name if index == 0 else "", reason, str(count),
                          f"{count / rows:.0%}" if rows else "-")
        table.add_section()
    return table
