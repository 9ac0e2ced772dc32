"""The results of ``reasonctl eval --config``: accuracy table, ``summary.json``,
``accuracy.csv`` and ``accuracy.png`` (a bar chart per benchmark).

The overall row is the accuracy over all samples of all benchmarks. The chart is drawn
with matplotlib's Agg canvas (no ``pyplot``), so it works headless.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reasonctl.evaluation.scoring import reason_counts

if TYPE_CHECKING:
    from rich.table import Table

    from reasonctl.evaluation.benchmark import BenchmarkReport

SUMMARY_FILE = "summary.json"
CSV_FILE = "accuracy.csv"
CHART_FILE = "accuracy.png"
CSV_COLUMNS = ("dataset", "answer_format", "samples", "correct", "accuracy")


def summary_rows(report: BenchmarkReport) -> list[dict[str, Any]]:
    """One row per benchmark, then ``overall``: samples, correct, accuracy and the
    predictions per reason (``reasons``)."""
    rows = [{"dataset": b.name, "answer_format": b.answer_format,
             "samples": len(b.predictions), "correct": b.correct, "accuracy": b.accuracy,
             "reasons": reason_counts(b.predictions)}
            for b in report.benchmarks]
    samples = sum(r["samples"] for r in rows)
    correct = sum(r["correct"] for r in rows)
    rows.append({"dataset": "overall", "answer_format": "", "samples": samples,
                 "correct": correct, "accuracy": correct / samples if samples else 0.0,
                 "reasons": reason_counts([p for b in report.benchmarks
                                           for p in b.predictions])})
    return rows


def write_summary(report: BenchmarkReport) -> dict[str, Path]:
    """Write ``summary.json``, ``accuracy.csv`` and ``accuracy.png`` into the results
    directory; return their paths by kind (``summary``, ``csv``, ``chart``)."""
    directory = report.results_dir
    directory.mkdir(parents=True, exist_ok=True)
    rows = summary_rows(report)
    summary = {"model": report.model, "benchmarks": rows[:-1], "overall": rows[-1]}
    paths = {"summary": directory / SUMMARY_FILE, "csv": directory / CSV_FILE,
             "chart": directory / CHART_FILE}
    paths["summary"].write_text(json.dumps(summary, indent=2), encoding="utf-8")
    with paths["csv"].open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({key: row[key] for key in CSV_COLUMNS}
                            | {"accuracy": f"{row['accuracy']:.4f}"})
    draw_accuracy_chart(rows, paths["chart"], title=f"Accuracy - {report.model}")
    return paths


def draw_accuracy_chart(rows: list[dict[str, Any]], output: Path, *, title: str) -> Path:
    """A bar per row (accuracy in percent, labelled), written atomically to ``output``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = [str(r["dataset"]) for r in rows]
    values = [100 * float(r["accuracy"]) for r in rows]
    figure = Figure(figsize=(max(4.0, 1.2 * len(rows) + 1.5), 3.6), dpi=100,
                    layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots()
    colors = ["#4C72B0"] * (len(rows) - 1) + ["#55A868"]
    bars = axes.bar(names, values, color=colors)
    axes.bar_label(bars, labels=[f"{v:.1f}%" for v in values], padding=2, fontsize=8)
    axes.set_ylim(0, 105)
    axes.set_ylabel("accuracy (%)")
    axes.set_title(title, fontsize=9)
    axes.tick_params(axis="x", labelrotation=20, labelsize=8)
    temporary = output.with_name(output.stem + ".tmp.png")
    figure.savefig(temporary)
    os.replace(temporary, output)
    return output


def benchmark_table(report: BenchmarkReport) -> Table:
    """A rich table: one row per benchmark, then the overall accuracy."""
    from rich.table import Table

    table = Table(title=f"Accuracy - {report.model}")
    for column, justify in (("dataset", "left"), ("answer format", "left"),
                            ("samples", "right"), ("correct", "right"),
                            ("accuracy", "right")):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    rows = summary_rows(report)
    for row in rows[:-1]:
        table.add_row(row["dataset"], row["answer_format"], str(row["samples"]),
                      str(row["correct"]), f"{100 * row['accuracy']:.1f}%")
    overall = rows[-1]
    table.add_section()
    table.add_row("overall", "", str(overall["samples"]), str(overall["correct"]),
                  f"{100 * overall['accuracy']:.1f}%", style="bold")
    return table
