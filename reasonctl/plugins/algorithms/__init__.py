"""First-party algorithms plugins."""
