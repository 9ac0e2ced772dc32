"""The rule-based rewards and the answer readers they share.

- :mod:`~reasonctl.rewards.answers`: pure functions of text (tags, ``\\boxed{}``, exact
  numbers, folding);
- :mod:`~reasonctl.rewards.math_answers`: reading and comparing final math answers, with
  :mod:`~reasonctl.rewards.math_judge` running ``math-verify`` in a time-limited child
  process (:mod:`~reasonctl.rewards.math_worker`);
- :mod:`~reasonctl.rewards.choice_answers`: the option a multiple-choice response commits
  to; :mod:`~reasonctl.rewards.choice`: a sample's options and correct letter;
- one module per reward, each holding its config model: ``format``, ``choice``, ``math``,
  ``exact_match``, ``length``; :mod:`~reasonctl.rewards.base` is what they share (with
  the reason codes their explanations give);
- the model rewards ``reward_model`` and ``judge`` (:mod:`~reasonctl.rewards.model_rewards`
  is what they share, :mod:`~reasonctl.rewards.templates` their prompt templates);
- :mod:`~reasonctl.rewards.remote`: ``remote``, scores from a reward service
  (:mod:`reasonctl.reward_service`).

Evaluation judges answers with these rewards (:mod:`reasonctl.evaluation.answers`), so it
scores exactly as training rewards. They are registered by :mod:`reasonctl.plugins.rewards`;
nothing here imports it.
"""
