"""The reasonctl command line (typer)."""
