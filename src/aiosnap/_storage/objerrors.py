"""What an object store's failure means, said once, at the boundary (``ObjectStorage._call``).

obstore raises its own exception types, whose text is the Rust client's ("Generic S3
error: Error performing HEAD http://... in 4.7s, after 20 retries ..."). Here each
becomes aiosnap's error naming the URL the user gave and what to do:

- **Credentials** -- none configured, refused (401, 403), or the instance metadata
  service that was to provide them failed -- are a permanent RemoteStorageError, never
  retried: no retry brings credentials. boto3 (the sweep of unfinished uploads) says
  ``NoCredentialsError`` for the same.
- **A missing bucket** is permanent too (``no_bucket``).
- **An endpoint that cannot be reached** (refused, reset, timed out) is transient:
  retried until the storage's deadline, then said with the endpoint's address.

Missing credentials are told before the first request where they can be: an S3 store
with no credentials configured gets them from the instance metadata service only, and
obstore retries that service, unanswered, until the deadline; ``check_credentials``
asks it once, with a one-second timeout, as boto3 does, and says at once that there
are none.
"""

from __future__ import annotations

import os
import re
import socket
import urllib.parse
from typing import Any

from .._base.errors import RemoteStorageError

#: How S3, GCS and Azure say that a bucket (a container) does not exist.
NO_BUCKET = re.compile(r"NoSuchBucket|ContainerNotFound|bucket does not exist|The specified bucket", re.I)
#: Where a credential source speaks in an error: the instance metadata services (EC2,
#: ECS, GCE), STS, OAuth token exchanges, and the words the clients use.
_CREDENTIALS = re.compile(
    r"169\.254\.169\.254|169\.254\.170\.2|metadata\.google\.internal|latest/api/token|security-credentials"
    r"|AssumeRole|sts\.[a-z0-9-]*\.?amazonaws|oauth2|credential|unauthenticated|InvalidAccessKeyId"
    r"|SignatureDoesNotMatch|AccessDenied|AuthorizationFailure|AuthenticationFailed|NoCredentials",
    re.I,
)
#: obstore's own text of a request that failed: the method and URL it tried.
_PERFORMING = re.compile(r"Error performing (?P<method>[A-Z]+) (?P<url>\S+)")
#: What to set, per provider.
_HINT = (
    "set them in the environment (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY; GOOGLE_SERVICE_ACCOUNT; "
    "AZURE_STORAGE_ACCOUNT_NAME and AZURE_STORAGE_ACCOUNT_KEY) or pass them to aiosnap.storage.from_url"
)
#: The seconds the instance metadata service gets to answer (boto3's default too).
METADATA_TIMEOUT = 1.0
_S3_KEYS = ("access_key_id", "secret_access_key", "token", "session_token", "skip_signature")
_S3_ENV = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_SKIP_SIGNATURE",
)


def permanent(message: str) -> RemoteStorageError:
    """A RemoteStorageError that no retry can help."""
    error = RemoteStorageError(message)
    error.permanent = True
    return error


def translate(path: str, exc: BaseException, deadline: float) -> RemoteStorageError:
    """obstore's failure of a call on ``path`` (after its own retries), in words."""
    name = type(exc).__name__
    text = str(exc)
    first = (text.strip().splitlines() or [name])[0]
    if name in ("UnauthenticatedError", "PermissionDeniedError") or _CREDENTIALS.search(text):
        return permanent(f"{path}: no usable credentials: {_HINT} ({_short(first)})")
    performing = _PERFORMING.search(text)
    if performing is not None:
        where = urllib.parse.urlsplit(performing["url"])
        reason = first.rpartition(" - ")[2] if " - " in first else first
        return RemoteStorageError(
            f"{path}: cannot reach the object store at {where.scheme}://{where.netloc} "
            f"({_short(reason)}), retried for up to {deadline:g} s"
        )
    return RemoteStorageError(f"{path}: {name}: {_short(first)}")


def _short(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_credentials(scheme: str, bucket: str, options: dict[str, Any]) -> None:
    """Raise a permanent RemoteStorageError at once where an S3 store has no
    credentials: none configured in ``options`` or the environment, and no instance
    metadata service answering (not a cloud machine). Other stores, and S3 stores with
    any credential source configured, are left to obstore."""
    if scheme not in ("s3", "s3a") or _s3_configured(options):
        return
    endpoint = (
        options.get("metadata_endpoint")
        or options.get("aws_metadata_endpoint")
        or os.environ.get("AWS_METADATA_ENDPOINT")
        or "http://169.254.169.254"
    )
    where = urllib.parse.urlsplit(str(endpoint))
    try:
        with socket.create_connection((where.hostname or "", where.port or 80), timeout=METADATA_TIMEOUT):
            return  # an instance metadata service: obstore asks it for credentials
    except OSError as exc:
        raise permanent(
            f"{scheme}://{bucket}: no credentials: none in the environment or the options, and no instance "
            f"metadata service at {where.netloc} to provide them ({exc.strerror or type(exc).__name__}); "
            f"{_HINT}"
        ) from None


def _s3_configured(options: dict[str, Any]) -> bool:
    if options.get("credential_provider") is not None or options.get("config"):
        return True
    keys = {k.lower().removeprefix("aws_") for k in options}
    if keys & set(_S3_KEYS):
        return True
    return any(os.environ.get(name) for name in _S3_ENV)
