"""Running the multi-turn episodes of a rollout, token in and token out.

:func:`run_episodes` takes encoded prompts and an :class:`~reasonctl.core.protocols.
Environment` and returns, like :meth:`RolloutEngine.generate`, ``params.n`` completions
per prompt, each now a whole episode:

1. The first turn is one ``generate`` call for every prompt (``n`` samples each, so each
   prompt is prefilled once); each sample starts an episode on its prompt's sample.
2. Each episode's turn goes to its environment (:meth:`Episode.step`, in a thread pool of
   ``concurrency`` so tools of different episodes run at once). The observation's
   messages are rendered by the chat template into tokens
   (:class:`~reasonctl.environments.observations.ObservationRenderer`) and appended to
   the episode's sequence with loss mask 0 and log-prob 0.
3. The episodes still going generate their next turn together: each prompt is the whole
   sequence so far (its token ids, never re-tokenized), through
   :func:`~reasonctl.core.protocols.generate_continuation`, which lets an engine reuse
   what it computed for the sequence in the previous call.

The environment sees every turn. An episode ends when its environment says ``done`` (the
``tools`` environment: a turn without a tool call), after ``max_turns`` turns (the last
observation is then not appended), or with finish reason ``length`` when a turn is cut
(by ``rollout.max_new_tokens`` or by the episode's budget of ``max_completion_tokens``
tokens after the prompt) or an observation would leave no room for another turn. Its
completion holds every token after the prompt, the policy's last turn as ``text``, the
per-token ``loss_mask`` and an :class:`~reasonctl.core.types.EpisodeSummary` (turns, the
environment's reward, metrics). Sampling seeds differ per turn and are derived from
``params.seed``, so the same inputs and seed give the same episodes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from reasonctl.core.errors import ReasonctlError
from reasonctl.core.protocols import Environment, Episode, RolloutEngine, generate_continuation
from reasonctl.core.types import Completion, EpisodeSummary, Observation, Sample, SamplingParams
from reasonctl.environments.observations import ObservationRenderer

if TYPE_CHECKING:
    from reasonctl.core.config import RunConfig
    from reasonctl.core.protocols import RunContext


UNBOUNDED = 1 << 40
"""``max_completion_tokens`` of a run that sets none."""


@dataclass(frozen=True)
class EpisodeLimits:
    """How long an episode may run: ``max_turns`` turns of the policy and
    ``max_completion_tokens`` tokens after the prompt (generated and observation tokens;
    default: no bound); ``concurrency`` episodes are stepped at once."""

    max_turns: int = 4
    max_completion_tokens: int = UNBOUNDED
    concurrency: int = 8


@dataclass
class _Running:
    """One episode being run: its sequence after the prompt and how it went so far."""

    sample: Sample
    prompt: dict[str, Any]
    episode: Episode
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    turns: int = 0
    last_text: str = ""
    cut: bool = False
    finish: str | None = None
    observation_tokens: int = 0
    step_seconds: float = 0.0

    def add_turn(self, completion: Completion, budget: int) -> None:
        """Append a generated turn, cut to ``budget`` tokens; a turn cut by that budget or
        by ``max_new_tokens`` is the episode's last (``cut``)."""
        ids, logprobs = list(completion.token_ids), list(completion.logprobs)
        self.cut = completion.finish_reason == "length" or len(ids) > budget
        self.token_ids += ids[:budget]
        self.logprobs += logprobs[:budget]
        self.loss_mask += [1] * len(ids[:budget])
        self.turns += 1
        self.last_text = completion.text

    def add_observation(self, ids: list[int]) -> None:
        """Append observation tokens: no loss, no engine log-prob."""
        self.token_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.loss_mask += [0] * len(ids)
        self.observation_tokens += len(ids)

    def next_prompt(self) -> dict[str, Any]:
        """The whole sequence so far as the prompt of the next turn."""
        prompt = dict(self.prompt)
        prompt["input_ids"] = list(self.prompt["input_ids"]) + self.token_ids
        return _extend_per_token(prompt, len(prompt["input_ids"]))

    def completion(self) -> Completion:
        """The finished episode as one completion."""
        metrics = dict(self.episode.metrics())
        generated = sum(self.loss_mask)
        metrics.update({"turns": float(self.turns),
                        "observation_tokens": float(self.observation_tokens),
                        "generated_tokens": float(generated),
                        "step_seconds": self.step_seconds})
        summary = EpisodeSummary(turns=self.turns, reward=self.episode.reward(),
                                 metrics=metrics)
        return Completion(self.last_text, self.token_ids, self.logprobs,
                          "length" if self.finish == "length" else "stop",
                          loss_mask=self.loss_mask, episode=summary)


def run_episodes(
    engine: RolloutEngine,
    environment: Environment,
    tokenizer: Any,
    samples: Sequence[Sample],
    prompts: Sequence[dict[str, Any]],
    params: SamplingParams,
    limits: EpisodeLimits,
) -> list[list[Completion]]:
    """``params.n`` episodes per prompt (see the module docstring); ``prompts[i]`` is the
    encoded prompt (``EncodedSample.as_prompt()``) of ``samples[i]``; observations are
    rendered with ``tokenizer``'s chat template (the processor's tokenizer)."""
    renderer = renderer_for(tokenizer)
    if len(samples) != len(prompts):
        raise ValueError(f"run_episodes got {len(prompts)} prompts for {len(samples)} samples")
    if not prompts:
        return []
    first = engine.generate(list(prompts), _turn_params(params, 0, limits.max_completion_tokens))
    groups: list[list[_Running]] = []
    for sample, prompt, completions in zip(samples, prompts, first, strict=True):
        group = []
        for completion in completions:
            running = _Running(sample, prompt, environment.start(sample))
            running.add_turn(completion, limits.max_completion_tokens)
            group.append(running)
        groups.append(group)
    pending = [e for group in groups for e in group]
    with ThreadPoolExecutor(max_workers=limits.concurrency,
                            thread_name_prefix="episode-step") as pool:
        turn = 1
        while pending:
            observations = list(pool.map(_step, pending))
            waiting = [e for e, seen in zip(pending, observations, strict=True)
                       if _observe(e, seen, renderer, limits)]
            if not waiting:
                break
            budget = max(limits.max_completion_tokens - len(e.token_ids) for e in waiting)
            results = generate_continuation(engine, [e.next_prompt() for e in waiting],
                                            _turn_params(replace(params, n=1), turn, budget))
            for episode, completions in zip(waiting, results, strict=True):
                episode.add_turn(completions[0],
                                 limits.max_completion_tokens - len(episode.token_ids))
            pending = waiting
            turn += 1
    return [[e.completion() for e in group] for group in groups]


def episode_limits(config: RunConfig) -> EpisodeLimits:
    """The ``[environment]`` limits of a run."""
    section = config.environment
    return EpisodeLimits(
        max_turns=section.max_turns,
        max_completion_tokens=section.max_completion_tokens or UNBOUNDED,
        concurrency=section.concurrency,
    )


def renderer_for(tokenizer: Any) -> ObservationRenderer:
    """An observation renderer for ``tokenizer``'s chat template and end-of-turn token."""
    eos = getattr(tokenizer, "eos_token_id", None)
    return ObservationRenderer(tokenizer, end_of_turn_ids=[eos] if isinstance(eos, int) else [])


def episodes_for_run(ctx: RunContext, samples: Sequence[Sample],
                     prompts: Sequence[dict[str, Any]], params: SamplingParams
                     ) -> list[list[Completion]]:
    """:func:`run_episodes` with the run's engine, environment, processor and limits."""
    if ctx.engine is None or ctx.environment is None or ctx.processor is None:
        raise ReasonctlError("running episodes needs the run's rollout engine, environment "
                             "and processor")
    return run_episodes(ctx.engine, ctx.environment, ctx.processor.tokenizer,
                        samples, prompts, params,
                        episode_limits(ctx.config))


def _step(episode: _Running) -> Observation:
    """The environment's answer to the episode's last turn."""
    started = time.perf_counter()
    try:
        observation = episode.episode.step(episode.last_text)
    except Exception as exc:
        where = f" ({episode.sample.source})" if episode.sample.source else ""
        raise ReasonctlError(f"the environment failed on a turn of an episode{where}: "
                             f"{type(exc).__name__}: {exc}") from exc
    episode.step_seconds += time.perf_counter() - started
    if not isinstance(observation, Observation):
        raise ReasonctlError(f"Episode.step returned {type(observation).__name__}; return a "
                             "reasonctl Observation")
    return observation


def _observe(episode: _Running, observation: Observation, renderer: ObservationRenderer,
             limits: EpisodeLimits) -> bool:
    """Append the observation to a stepped episode; True when it goes on to another turn
    (its environment is not done, the turn was not cut, turns and tokens are left)."""
    if observation.done or not observation.messages or episode.cut \
            or episode.turns >= limits.max_turns:
        episode.finish = "length" if episode.cut else "stop"
        return False
    last = episode.token_ids[-1] if episode.token_ids else None
    ids = renderer.tokens(observation.messages, last_token=last)
    if len(episode.token_ids) + len(ids) >= limits.max_completion_tokens:
        episode.finish = "length"  # no room left for the observation and an answer
        return False
    episode.add_observation(ids)
    return True


def _turn_params(params: SamplingParams, turn: int, budget: int) -> SamplingParams:
    """Sampling of turn ``turn``: its own seed, at most ``budget`` new tokens."""
    from reasonctl.core.seeds import mix_seed

    seed = params.seed if params.seed is None or turn == 0 else mix_seed(params.seed, turn)
    return replace(params, seed=seed, max_new_tokens=max(1, min(params.max_new_tokens, budget)))


def _extend_per_token(prompt: dict[str, Any], length: int) -> dict[str, Any]:
    """Per-token vision extras (token types) padded with 0 (text) to ``length``."""
    from reasonctl.data.processing import PER_TOKEN_EXTRAS

    for key in PER_TOKEN_EXTRAS & prompt.keys():
        value = prompt[key]
        prompt[key] = value.new_zeros(length)
        prompt[key][: value.shape[-1]] = value
    return prompt
