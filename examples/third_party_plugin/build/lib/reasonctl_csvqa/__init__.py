"""Example third-party reasonctl plugin."""
