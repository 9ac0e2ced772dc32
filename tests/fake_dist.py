"""Create installed distributions on disk (dist-info + modules) for discovery tests."""

from __future__ import annotations

from pathlib import Path


def make_distribution(
    site: Path, name: str, version: str, modules: dict[str, str], entry_points: dict[str, str]
) -> Path:
    """Write modules and a ``<name>-<version>.dist-info`` declaring ``reasonctl`` entry points.

    The dist-info also lists the modules as the distribution's top-level packages, so
    ``importlib.metadata.packages_distributions()`` maps them to ``name``.

    ``site`` behaves like a site-packages directory once it is on ``sys.path`` /
    ``PYTHONPATH``: ``importlib.metadata`` finds the distribution exactly as if pip had
    installed it.
    """
    site.mkdir(parents=True, exist_ok=True)
    for module, code in modules.items():
        (site / f"{module}.py").write_text(code)
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines = ["[reasonctl]"] + [f"{k} = {v}" for k, v in entry_points.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    top_level = sorted({module.split(".")[0] for module in modules})
    (info / "top_level.txt").write_text("\n".join(top_level) + "\n")
    return site
