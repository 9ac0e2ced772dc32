"""reasonctl."""
