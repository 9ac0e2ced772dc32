"""The composer of a run, above the core and the implementations it builds from.

:mod:`~reasonctl.runtime.runner` drives a training run; :mod:`~reasonctl.runtime.composition`
builds its parts (backend, processor, dataset, rewards, engine or rollout workers, evaluator)
through the registry and runs the pre-flight checks. ``reasonctl.core`` defines the contract
and imports nothing of this package or of any implementation.
"""
