"""Storage implementations, one per URI scheme: :mod:`~reasonctl.storage.local` (``file``),
:mod:`~reasonctl.storage.s3` (``s3``) and :mod:`~reasonctl.storage.hub` (``hf``).

Each keeps its config model in a module that imports no optional package, so the
registration modules in :mod:`reasonctl.plugins.storage` can register it cheaply; the
clients that need ``boto3`` or ``huggingface_hub`` are imported only when a URI of their
scheme is used. The scheme-independent parts (URI parsing, retries, the model cache) are
in :mod:`reasonctl.core.storage`.
"""
