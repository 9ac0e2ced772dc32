"""The first-party metric loggers and what they share.

- :mod:`~reasonctl.loggers.console`, :mod:`~reasonctl.loggers.jsonl`,
  :mod:`~reasonctl.loggers.tensorboard`, :mod:`~reasonctl.loggers.wandb`: one logger each,
  with its config model and the ``build_*`` factory its registration module registers;
- :mod:`~reasonctl.loggers.metric_names`: the key metrics and the names they go by;
- :mod:`~reasonctl.loggers.metrics_file`: the ``metrics.jsonl`` format, and
  :func:`~reasonctl.loggers.metrics_file.read_metrics` to read a run's metrics back;
- :mod:`~reasonctl.loggers.plot`: the end-of-run training curves.

They are registered by :mod:`reasonctl.plugins.loggers`; nothing here imports it.
"""
