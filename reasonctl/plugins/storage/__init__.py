"""First-party storage plugins."""
