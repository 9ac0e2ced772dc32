"""First-party data plugins."""
