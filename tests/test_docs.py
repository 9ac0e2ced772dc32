"""The plugin author's guide (``docs/plugins.md``) runs, uses only the public API and covers
the whole contract.

Conventions of code blocks in the guide:

- A ```` ```python ```` block runs, as a module of its own (``__name__`` is a fresh module
  name registered in ``sys.modules``, so ``sys.modules[__name__]`` is the block's module and
  can be registered as a plugin), in a fresh temporary working directory.
- A ```` ```python ```` block whose fence directly follows a line ``<!-- continue -->`` (an
  HTML comment, invisible when the guide is rendered) runs in the module of the block
  before it: the chain of blocks is one test, named after the line of its first block.
- A ```` ```py ```` block is a sketch: it must compile but does not run (for code that
  needs hardware, a cluster, or pytest itself).
- Any other fence (```` ```toml ````, ```` ```text ````, ```` ```bash ````) is not checked.

Every ``python`` and ``py`` block may use only ``reasonctl.__all__`` and the testing kit
``reasonctl.testing``, like a plugin author who has not read reasonctl's internals.
"""

from __future__ import annotations

import re
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.public_api import private_uses

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "plugins.md"
CONTINUE = "<!-- continue -->"
FENCE = re.compile(r"^```(\w*)\s*$")


@dataclass
class Block:
    """One fenced code block: its language, first code line (1-based) and text."""

    language: str
    line: int
    code: str
    continues: bool = False


@dataclass
class Chain:
    """Blocks that run one after the other in one module."""

    blocks: list[Block] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{GUIDE.name}:{self.blocks[0].line}"


def read_blocks(text: str) -> list[Block]:
    """Every fenced block of a Markdown text."""
    lines = text.splitlines()
    blocks: list[Block] = []
    index = 0
    while index < len(lines):
        match = FENCE.match(lines[index])
        if not match:
            index += 1
            continue
        previous = next((lines[i].strip() for i in range(index - 1, -1, -1)
                         if lines[i].strip()), "")
        end = next(i for i in range(index + 1, len(lines)) if lines[i].strip() == "```")
        blocks.append(Block(match.group(1), index + 2, "\n".join(lines[index + 1 : end]),
                            continues=previous == CONTINUE))
        index = end + 1
    return blocks


def python_chains(blocks: list[Block]) -> list[Chain]:
    """The ``python`` blocks grouped into chains by ``<!-- continue -->`` markers."""
    chains: list[Chain] = []
    for block in blocks:
        if block.language != "python":
            continue
        if block.continues:
            assert chains, f"{GUIDE.name}:{block.line}: {CONTINUE} before the first block"
            chains[-1].blocks.append(block)
        else:
            chains.append(Chain([block]))
    return chains


GUIDE_TEXT = GUIDE.read_text(encoding="utf-8")
BLOCKS = read_blocks(GUIDE_TEXT)
CHAINS = python_chains(BLOCKS)


def _compiled(block: Block) -> types.CodeType:
    """The block compiled so tracebacks show the guide's own line numbers."""
    return compile("\n" * (block.line - 1) + block.code, str(GUIDE), "exec")


@pytest.fixture
def one_torch_thread():
    """Tiny models run faster on one thread, and much faster on a busy machine."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("chain", CHAINS, ids=[c.name for c in CHAINS])
def test_guide_examples_run(chain: Chain, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                            one_torch_thread: None) -> None:
    monkeypatch.chdir(tmp_path)
    name = f"plugins_md_line_{chain.blocks[0].line}"
    module = types.ModuleType(name)
    module.__file__ = str(GUIDE)
    monkeypatch.setitem(sys.modules, name, module)
    for block in chain.blocks:
        exec(_compiled(block), module.__dict__)


def test_guide_sketches_compile() -> None:
    sketches = [b for b in BLOCKS if b.language == "py"]
    assert sketches
    for block in sketches:
        _compiled(block)


def test_guide_uses_only_the_public_api() -> None:
    problems = [p for b in BLOCKS if b.language in ("python", "py")
                for p in private_uses("\n" * (b.line - 1) + b.code, filename=GUIDE.name,
                                      allowed_modules=["reasonctl.testing"])]
    assert not problems, "the guide must use only reasonctl.__all__:\n" + "\n".join(problems)


def test_guide_covers_every_hook_protocol_and_public_name() -> None:
    """Each hook, Protocol (optional capabilities included) and public name appears as code."""
    import reasonctl
    from reasonctl.core import protocols
    from reasonctl.core.plugins import HOOK_NAMES

    spans = re.findall(r"`([^`\n]+)`", GUIDE_TEXT) + [b.code for b in BLOCKS]
    mentioned = {word for span in spans for word in re.findall(r"\w+", span)}
    expected = {*HOOK_NAMES, *protocols.__all__, *reasonctl.__all__}
    missing = sorted(expected - mentioned - {"PROTOCOLS", "algorithm_needs", "skipped_row_reports"})
    assert not missing, f"docs/plugins.md does not mention: {', '.join(missing)}"


def test_every_reasonctl_name_the_guide_mentions_is_public() -> None:
    """Prose too: a ``reasonctl.x.y`` the guide sends authors to must be ``reasonctl.<public>``
    (or the testing kit), never an internal module."""
    import reasonctl

    public = {*reasonctl.__all__, "testing", "__all__"}
    problems = [f"{GUIDE.name}:{GUIDE_TEXT.count(chr(10), 0, m.start()) + 1}: {m.group(0)}"
                for m in re.finditer(r"\breasonctl\.(\w+)(?:\.\w+)*", GUIDE_TEXT)
                if m.group(1) not in public]
    assert not problems, "the guide names internals:\n" + "\n".join(problems)


def test_the_readme_links_the_guide() -> None:
    assert "(docs/plugins.md)" in (ROOT / "README.md").read_text(encoding="utf-8")


def test_continue_markers_are_understood() -> None:
    text = "x\n```python\na = 1\n```\n\n<!-- continue -->\n```python\nb = a\n```\n```py\nc\n```\n"
    blocks = read_blocks(text)
    assert [(b.language, b.line, b.continues) for b in blocks] == [
        ("python", 3, False), ("python", 8, True), ("py", 11, False)]
    assert [len(c.blocks) for c in python_chains(blocks)] == [2]
