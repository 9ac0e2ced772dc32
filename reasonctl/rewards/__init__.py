"""The rule-based rewards and the answer parsers they share.

- :mod:`~reasonctl.rewards.answers`: pure functions of text that extract and compare
  answers (tags, ``\\boxed{}``, multiple-choice letters, numbers); evaluation scores with
  them too, so it judges answers exactly as training rewards them;
- :mod:`~reasonctl.rewards.choice`: resolving a sample's options and correct letter;
- one module per reward, each holding its config model: ``format``, ``choice``, ``math``,
  ``exact_match``, ``length``; :mod:`~reasonctl.rewards.base` is what they share;
- :mod:`~reasonctl.rewards.remote`: ``remote``, scores from a reward service
  (:mod:`reasonctl.reward_service`).

They are registered by :mod:`reasonctl.plugins.rewards`; nothing here imports it.
"""
