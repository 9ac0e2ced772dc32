"""S3 failures: which are worth retrying, and what a user should do about each.

Imports ``botocore``; needs ``boto3`` (the ``s3`` extra) like the client.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from reasonctl.core.errors import require
from reasonctl.core.storage import StorageError, describe_error

require("boto3", extra="s3", what="s3:// storage")
from botocore.exceptions import (  # noqa: E402
    ClientError,
    EndpointConnectionError,
    NoCredentialsError,
)

_RETRYABLE_CODES = {
    "RequestTimeout", "SlowDown", "Throttling", "ThrottlingException", "InternalError",
    "ServiceUnavailable", "RequestTimeTooSkewed", "BadDigest", "IncompleteBody",
}


class S3IntegrityError(StorageError):
    """An object's size, ETag or checksum does not match the local file."""


class TransferFailed(StorageError):
    """Some files of a transfer failed; ``failures`` maps each object URI to its error."""

    def __init__(self, action: str, where: str, total: int, failures: dict[str, BaseException]):
        self.failures = failures
        shown = list(failures.items())[:5]
        lines = "; ".join(f"{uri}: {explain_error(exc)}" for uri, exc in shown)
        more = f" (and {len(failures) - len(shown)} more)" if len(failures) > len(shown) else ""
        super().__init__(f"{len(failures)} of {total} file(s) failed to {action} {where}: "
                         f"{lines}{more}", permanent=not self.retryable)

    @property
    def retryable(self) -> bool:
        """True when at least one failure may succeed on another attempt."""
        return any(is_retryable(exc) for exc in self.failures.values())


def error_code(exc: ClientError) -> tuple[str, int]:
    """The error code and HTTP status of a botocore ``ClientError``."""
    code = str(exc.response.get("Error", {}).get("Code", ""))
    status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return code, status


def is_retryable(exc: BaseException) -> bool:
    """Whether another attempt may succeed (network and server errors, not denials)."""
    if isinstance(exc, TransferFailed):
        return exc.retryable
    if isinstance(exc, (NoCredentialsError, FileNotFoundError, IsADirectoryError,
                        PermissionError)):
        return False
    if isinstance(exc, ClientError):
        code, status = error_code(exc)
        return status >= 500 or status in (408, 429) or code in _RETRYABLE_CODES
    if isinstance(exc, StorageError):
        return not exc.permanent
    return True


def explain_error(exc: BaseException, bucket: str = "") -> str:
    """A one-line description of an S3 failure with what to do about it."""
    if isinstance(exc, NoCredentialsError):
        return ("no AWS credentials found; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                "AWS_PROFILE, or run `aws configure`")
    if isinstance(exc, EndpointConnectionError):
        url = urlsplit(str(exc.kwargs.get("endpoint_url", "")))
        return (f"cannot reach the S3 endpoint {url.scheme}://{url.netloc}; check "
                "storage.s3.endpoint_url / AWS_ENDPOINT_URL and the network")
    if isinstance(exc, ClientError):
        code, status = error_code(exc)
        if code == "NoSuchBucket":
            name = bucket or exc.response.get("Error", {}).get("BucketName", "")
            return (f"bucket {name!r} does not exist; create it (e.g. `aws s3 mb s3://{name}`) "
                    "or fix the URI")
        if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch"):
            return ("the server rejected the credentials; check AWS_ACCESS_KEY_ID/"
                    "AWS_SECRET_ACCESS_KEY or the AWS profile")
        if code in ("AccessDenied", "Forbidden"):
            return ("access denied; the credentials need s3:ListBucket, s3:GetObject, "
                    "s3:PutObject (and s3:DeleteObject to delete) on this bucket")
        if code == "403" or status == 403:  # a HEAD request: the reply carries no reason
            return ("HTTP 403 (forbidden): the credentials are not valid for this endpoint "
                    "(check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or the AWS profile) or "
                    "lack s3:ListBucket, s3:GetObject and s3:PutObject on this bucket")
    return describe_error(exc)
