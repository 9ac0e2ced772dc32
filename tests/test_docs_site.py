"""The documentation site: it builds with warnings as errors (broken links and anchors,
pages left out of the navigation), and its generated reference pages are current."""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _reference_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_reference",
                                                  ROOT / "scripts" / "docs_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_api_reference_lists_every_public_name_and_is_current() -> None:
    import reasonctl

    script = _reference_script()
    written = script.API_PAGE.read_text(encoding="utf-8")
    assert written == script.render_api(), (
        "docs/reference/api.md is not current: run python scripts/docs_reference.py")
    listed = set(re.findall(r"^### (\w+)$", written, flags=re.MULTILINE))
    assert listed == set(reasonctl.__all__) - {"__version__"}
    for name in ("StorageError", "streams_samples", "RolloutWorkers", "check_storage_access",
                 "ChecksAccess"):
        assert name in listed


def test_the_configuration_reference_is_current_and_covers_every_section() -> None:
    from reasonctl.core.config import RunConfig

    script = _reference_script()
    written = script.CONFIG_PAGE.read_text(encoding="utf-8")
    assert written == script.render_configuration(), (
        "docs/reference/configuration.md is not current: run python scripts/docs_reference.py")
    for section in RunConfig.model_fields:
        assert f"## `[{section}]`" in written
    for table in ("[algorithm.grpo]", "[backend.fsdp]", "[rollout.vllm.server]",
                  "[[rewards.components]]", "[[eval.datasets]]", "[storage.s3]"):
        assert f"`{table}`" in written
    assert "| `kl_beta` | number | `0.0` | KL penalty weight" in written


def test_the_site_builds_strict(tmp_path: Path) -> None:
    import subprocess

    pytest.importorskip("mkdocs", reason="the docs extra is not installed (pip install -e "
                                         "'.[docs]')")
    pytest.importorskip("material", reason="the docs extra is not installed")
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                            str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                           env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    assert (tmp_path / "site" / "plugins" / "index.html").is_file()


def test_every_page_is_in_the_navigation() -> None:
    import yaml

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))

    def pages(entries: object) -> set[str]:
        if isinstance(entries, str):
            return {entries}
        if isinstance(entries, list):
            return set().union(*(pages(e) for e in entries))
        if isinstance(entries, dict):
            return set().union(*(pages(v) for v in entries.values()))
        return set()

    in_nav = pages(config["nav"])
    on_disk = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert in_nav == on_disk
