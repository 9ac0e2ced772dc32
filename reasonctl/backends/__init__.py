"""Training backends: devices, parallelism, the model, optimizer and distributed state.

The plugin modules in :mod:`reasonctl.plugins.backends` register them; the implementations
here import torch and transformers, so plugin discovery never does.
"""
