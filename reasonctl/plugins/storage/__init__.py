"""Registration modules of the first-party storage schemes (``file``, ``s3``, ``hf``).

Each registers one scheme and imports its implementation from :mod:`reasonctl.storage`
only when the hook or the factory runs.
"""
