"""``reasonctl rewards score`` and ``rewards agree``: a config's rewards on saved
completions, offline, and their agreement with human labels."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from reasonctl.cli.common import ConfigOption, SetOption, handle_errors


def rewards_app() -> typer.Typer:
    """The ``rewards`` sub-commands."""
    app = typer.Typer(no_args_is_help=True)
    app.command("score")(handle_errors(score_command))
    app.command("agree")(handle_errors(agree_command))
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


def agree_command(
    data: Annotated[Path, typer.Option(
        "--data", help="Completions file, as for `rewards score`.")],
    labels: Annotated[Path, typer.Option(
        "--labels", help="Human labels: one JSON value per completion row, in order: 1/0 "
        'or {"label": 1, "class": "..."}.')],
    config: ConfigOption = None,
    set_: SetOption = None,
    reward: Annotated[list[str] | None, typer.Option(
        "--reward", help="Check this reward of the config (repeatable); default: each.")
    ] = None,
    threshold: Annotated[float, typer.Option(
        "--threshold", help="A score at least this counts as 1 (good).")] = 0.5,
    output: Annotated[Path | None, typer.Option(
        "--output", help="The report (JSON); default outputs/rewards/<data name>."
        "agreement.json.")] = None,
) -> None:
    """How each reward of the config (rule, model or judge) agrees with human labels.

    Prints, per reward, the agreement and Cohen's kappa, a confusion table (human label
    by reward verdict, where `none` is no score, e.g. an unparseable verdict) and the
    agreement per class of the labels; writes them with every disagreeing row (what the
    reward read and why) to --output.
    """
    import json

    from rich.console import Console

    from reasonctl.cli import common
    from reasonctl.core.errors import UsageError, did_you_mean
    from reasonctl.core.reward_set import RewardSet
    from reasonctl.sdk.agreement import agreement, read_labels
    from reasonctl.sdk.scoring import ScoreReport, read_completions

    run_config = common.load(config, set_, values={})
    samples, completions = read_completions(data)
    human = read_labels(labels, len(completions))
    rewards = RewardSet.from_config(run_config, common.host().registry)
    names = reward or rewards.names
    for name in names:
        if name not in rewards.names:
            close = did_you_mean(name, rewards.names)
            raise UsageError(f"--reward {name!r} is not a reward of the config"
                             + (f" (did you mean {close!r}?)" if close else "")
                             + f"; its rewards: {', '.join(rewards.names)}")
    report = ScoreReport.of(rewards, samples, completions, explain=True)
    results = [agreement(report, human, name, threshold=threshold) for name in names]
    out = Console()
    for result in results:
        for table in agreement_tables(result):
            out.print(table)
    path = output or Path("outputs") / "rewards" / f"{data.stem}.agreement.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"data": str(data), "labels": str(labels),
                                "rewards": [r.to_dict() for r in results]},
                               indent=2, default=str), encoding="utf-8")
    out.print(f"report: {path}", highlight=False)


def agreement_tables(result: Any) -> list[Any]:
    """Rich tables of one :class:`~reasonctl.sdk.agreement.Agreement`: the confusion
    table, then the agreement per class (when the labels have classes)."""
    from rich.table import Table

    kappa = "-" if result.kappa is None else f"{result.kappa:.3f}"
    confusion = Table(title=f"{result.reward}: agreement {result.agree}/{result.rows} "
                            f"({result.rate:.1%}), kappa {kappa}")
    confusion.add_column("human label")
    for verdict in ("1", "0", "none"):
        confusion.add_column(f"reward {verdict}", justify="right")
    for label in ("1", "0"):
        confusion.add_row(label, *(str(result.confusion[label][v]) for v in ("1", "0", "none")))
    tables = [confusion]
    if result.by_class:
        classes = Table(title=f"{result.reward}: agreement per class")
        for column, justify in (("class", "left"), ("agree", "right"), ("rows", "right"),
                                ("agreement", "right")):
            classes.add_column(column, justify=justify)  # type: ignore[arg-type]
        for name, (agree, rows) in result.by_class.items():
            classes.add_row(name, str(agree), str(rows), f"{agree / rows:.0%}")
        tables.append(classes)
    return tables
