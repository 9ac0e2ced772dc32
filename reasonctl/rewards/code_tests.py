"""``code_tests``: run a completion's code against the sample's unit tests, in the sandbox.

The code is the completion's last fenced code block (```` ```python ```` or a bare
```` ``` ````), else its whole text. The tests are ``meta["tests"]`` (configurable): one
program, or a list of programs (for example one ``assert`` each). Each test runs in its
own confined process (:class:`~reasonctl.environments.sandbox.Sandbox`, as the ``python``
tool of the ``tools`` environment) as the code followed by the test; it passes when the
process exits with status 0 within the limits. The score is the fraction of tests passed
(with ``partial_credit = false``: 1 only when all pass); a sample without tests is not
scored (``None``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from pydantic import Field

from reasonctl.core.errors import ConfigError
from reasonctl.core.types import Sample
from reasonctl.environments.config import SandboxConfig
from reasonctl.environments.sandbox import Sandbox, SandboxUnavailableError
from reasonctl.rewards.base import RewardConfig

_FENCED = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.S | re.I)


class CodeTestsConfig(RewardConfig):
    """Options of the ``code_tests`` reward."""

    tests_key: str = Field(default="tests", min_length=1,
                           description="The sample's meta key holding the tests.")
    partial_credit: bool = Field(
        default=True, description="Score the fraction of tests passed; false: 1 only when "
        "every test passes.")
    workers: int = Field(default=4, gt=0, description="Test processes run at once.")
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)


def extract_code(completion: str) -> str:
    """The last fenced code block of ``completion``, else the whole text."""
    blocks = _FENCED.findall(completion)
    return blocks[-1] if blocks else completion


class CodeTestsReward:
    """Fraction of the sample's tests that the completion's code passes (see the module)."""

    def __init__(self, config: CodeTestsConfig) -> None:
        self.config = config
        try:
            self.sandbox = Sandbox.checked(config.sandbox,
                                           where="[[rewards.components]] code_tests sandbox")
        except SandboxUnavailableError as exc:
            raise ConfigError([f"rewards.components: code_tests: {exc}"]) from exc

    def __call__(self, completions: Sequence[str], samples: Sequence[Sample]
                 ) -> list[float | None]:
        """Score each completion against its sample's tests."""
        jobs = []
        for index, (completion, sample) in enumerate(zip(completions, samples, strict=True)):
            code = extract_code(completion)
            for test in self._tests(sample):
                jobs.append((index, code + "\n\n" + test))
        with ThreadPoolExecutor(max_workers=self.config.workers) as pool:
            passed = list(pool.map(lambda job: self.sandbox.run(job[1]).ok, jobs))
        counts: dict[int, list[bool]] = {}
        for (index, _), ok in zip(jobs, passed, strict=True):
            counts.setdefault(index, []).append(ok)
        scores: list[float | None] = []
        for index in range(len(completions)):
            results = counts.get(index)
            if not results:
                scores.append(None)
            elif self.config.partial_credit:
                scores.append(sum(results) / len(results))
            else:
                scores.append(1.0 if all(results) else 0.0)
        return scores

    def _tests(self, sample: Sample) -> list[str]:
        tests = sample.meta.get(self.config.tests_key)
        if isinstance(tests, str):
            return [tests] if tests.strip() else []
        if isinstance(tests, list):
            return [t for t in tests if isinstance(t, str) and t.strip()]
        return []
