"""The first-party dataset formats: each module holds a format's config model and factory.

Registered by the modules of :mod:`reasonctl.plugins.data`, which import these lazily.
"""
