"""The reward service: ``reasonctl serve-rewards`` scores completions for trainers elsewhere.

Trainers send batches with the ``remote`` reward (:mod:`reasonctl.rewards.remote`); the
service scores them with any reward of the registry (text rewards for GRPO, media rewards
for world-model RL, third-party plugins alike), batching across requests.

- :mod:`~.config`: the service's own strict config file;
- :mod:`~.auth`: bearer tokens from the environment or a file, checked in constant time;
- :mod:`~.wire`: the request format (JSON header + ``.npy`` array, never pickle);
- :mod:`~.store`: the queue and results in memory; :mod:`~.redis_store` in Redis;
- :mod:`~.workers`: batching workers (threads or device-pinned processes);
- :mod:`~.metrics`, :mod:`~.logs`: ``/metrics`` and structured logs;
- :mod:`~.app`: the HTTP routes; :mod:`~.server`: everything together under uvicorn;
- :mod:`~.client`: the HTTP client the ``remote`` reward uses.

Importing this package imports nothing heavy; the server needs ``pip install
'reasonctl[serve]'``.
"""
