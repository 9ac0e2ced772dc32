"""First-party loggers plugins."""
