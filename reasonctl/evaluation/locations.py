"""Where ``reasonctl eval`` writes its results when no directory is given.

Results go under ``eval.results_dir`` or ``outputs/eval/<model>``, where ``<model>`` names
the model so that evaluations of two models do not overwrite each other: the directory's
name, or for a run's export (``<run>/export/final``, ``<run>/export/step_N``) the run's
name with the export's (``quickstart_video_sft-final``), since every run's export is
called ``final``.
"""

from __future__ import annotations

from pathlib import Path


def model_label(model: str) -> str:
    """A short name of ``model`` (a directory, an alias or a URI) for results paths."""
    path = Path(model.rstrip("/"))
    if path.parent.name == "export" and path.parent.parent.name:
        return f"{path.parent.parent.name}-{path.name}"
    return path.name or model


def default_results_dir(results_dir: str | None, model: str) -> Path:
    """``results_dir`` (``eval.results_dir``) if set, else ``outputs/eval/<model label>``."""
    return Path(results_dir) if results_dir else Path("outputs") / "eval" / model_label(model)
