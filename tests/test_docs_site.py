"""The documentation site: its generated reference pages are current and complete."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

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
