"""First-party backends plugins."""
