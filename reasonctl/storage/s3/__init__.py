"""S3 and S3-compatible object storage: ``s3://bucket/prefix``.

Endpoint, region and credentials come from the standard AWS sources (environment such as
``AWS_ENDPOINT_URL``, ``AWS_REGION``/``AWS_DEFAULT_REGION``, ``AWS_ACCESS_KEY_ID``,
``AWS_PROFILE``; ``~/.aws/config`` and ``~/.aws/credentials``; instance roles) unless
``[storage.s3]`` sets the endpoint or region. Credentials are never part of the config.
Request-level retries follow the AWS settings (``AWS_MAX_ATTEMPTS``, ``AWS_RETRY_MODE``);
on top of them every file is retried with exponential backoff.

- :mod:`~reasonctl.storage.s3.config`: the ``[storage.s3]`` model and URI parsing (no boto3);
- :mod:`~reasonctl.storage.s3.client`: :class:`S3Storage` (imports ``boto3``,
  ``pip install 'reasonctl[s3]'``);
- :mod:`~reasonctl.storage.s3.digest`: sizes, sha256 and ETags computed locally;
- :mod:`~reasonctl.storage.s3.errors`: retryable failures and their explanations.

This package's ``__init__`` imports nothing, so importing the config does not load boto3.
"""
