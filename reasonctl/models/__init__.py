"""Model loading and the tiny built-in models used by the quickstart and tests."""
