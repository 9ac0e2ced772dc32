"""Core of reasonctl: the plugin contract, config, runner and checkpoints. Imports no plugin."""
