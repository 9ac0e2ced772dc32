"""Multi-turn episodes with tools: the episode runner, tool calls, built-in tools, sandbox.

- :mod:`~reasonctl.environments.episodes` runs the episodes of a rollout, token in, token
  out: the policy's turns and the environment's observations form one sequence per
  episode, observation tokens masked out of the loss (:func:`run_episodes`).
- :mod:`~reasonctl.environments.observations` turns an observation's messages into the
  tokens the model's chat template puts after a turn (tool role, next generation prompt).
- :mod:`~reasonctl.environments.tool_calls` reads tool calls in the Qwen format
  (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``).
- :mod:`~reasonctl.environments.tools_env` is the built-in ``tools`` environment with
  :mod:`~reasonctl.environments.calculator` and Python run in
  :mod:`~reasonctl.environments.sandbox` (a separate, confined process per call).

Importing this package imports neither torch nor transformers.
"""
