"""``S3Config``: how shardstream reaches S3 or an S3-compatible store."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ._core import default_s3_options

__all__ = ["S3Config"]

# Defined once, in the Rust core (``shardstream._core.s3_option_table()``).
_DEFAULTS = default_s3_options()


@dataclass(frozen=True, kw_only=True)
class S3Config:
    """Options for ``s3://`` shards. Credentials come from the default AWS
    chain (environment, shared config and credentials files, SSO, web
    identity, IMDS and ECS roles), never from here, so no secret is ever part
    of this object or its ``repr``.

    Attributes:
        region: AWS region; ``None`` takes it from the environment or profile
            (else ``us-east-1``).
        endpoint_url: an S3-compatible endpoint; ``None`` takes
            ``AWS_ENDPOINT_URL`` or AWS itself.
        path_style: path-style addressing (``endpoint/bucket/key``).
        profile: a named profile of the shared config files.
        unsigned: send unsigned requests (public buckets).
        connect_timeout: seconds to connect.
        first_byte_timeout: seconds to wait for a response's headers.
        idle_timeout: seconds to wait for the next bytes of a body before
            resuming it with a Range request.
        max_attempts: attempts per request, the first included (1 to 1000).
            Credentials that cannot be found, or that the store rejects,
            are not retried: they raise ``StorageAuthError`` at once.
        max_retry_time: seconds spent retrying one request at most.
        part_size: the largest ranged GET, in bytes. Objects are read as
            parts issued in reading order over all of ``read_ahead_bytes``:
            an object's first part is at most 256 KiB, each next one twice
            the one before, up to this size, or less so that 32 parts fit in
            ``read_ahead_bytes``. At most 4 GiB - 1.
        max_concurrency: ranged GETs in flight at once per worker, across
            objects, at most (1 to 256); 1 reads one object at a time as one
            streaming GET.

    Timeouts are above 0 and every duration at most a year; a value out of
    range raises ``ValueError`` naming the option when a dataset is made.
    """

    region: str | None = _DEFAULTS["region"]
    endpoint_url: str | None = _DEFAULTS["endpoint_url"]
    path_style: bool = _DEFAULTS["path_style"]
    profile: str | None = _DEFAULTS["profile"]
    unsigned: bool = _DEFAULTS["unsigned"]
    connect_timeout: float = _DEFAULTS["connect_timeout"]
    first_byte_timeout: float = _DEFAULTS["first_byte_timeout"]
    idle_timeout: float = _DEFAULTS["idle_timeout"]
    max_attempts: int = _DEFAULTS["max_attempts"]
    max_retry_time: float = _DEFAULTS["max_retry_time"]
    part_size: int = _DEFAULTS["part_size"]
    max_concurrency: int = _DEFAULTS["max_concurrency"]

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict."""
        return asdict(self)
