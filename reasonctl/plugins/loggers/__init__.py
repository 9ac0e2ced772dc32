"""Registration modules of the first-party loggers (``console``, ``jsonl``, ``tensorboard``,
``wandb``).

Each registers one logger and imports its implementation from :mod:`reasonctl.loggers`
only when the hook runs.
"""
