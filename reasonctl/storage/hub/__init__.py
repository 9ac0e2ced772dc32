"""Hugging Face Hub storage: ``hf://owner/repo[@revision][/path]``.

``hf://datasets/owner/repo/...`` addresses a dataset repository. The repository (and the
branch named by ``@revision``) is created on first upload. The token comes from
``HF_TOKEN`` or the cached ``hf auth login``; it is never part of the config and never
printed.

- :mod:`~reasonctl.storage.hub.config`: the ``[storage.hf]`` model and URI parsing;
- :mod:`~reasonctl.storage.hub.client`: :class:`HubStorage` (imports ``huggingface_hub``,
  ``pip install 'reasonctl[hub]'``).

This package's ``__init__`` imports nothing, so importing the config does not load the
Hub client.
"""
