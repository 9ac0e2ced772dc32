"""Training algorithm implementations (SFT, GRPO family) and their shared data helpers.

The plugin modules in :mod:`reasonctl.plugins.algorithms` register them; see
:mod:`reasonctl.algorithms.sampling` for the reproducible data order every algorithm uses.
"""
