"""First-party rollout plugins."""
