"""First-party plugins, discovered through entry points like any third-party plugin."""
