"""Programmatic API beyond the top-level functions."""
