"""``S3Config``: how shardstream reaches S3 or an S3-compatible store."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["S3Config"]


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

    region: str | None = None
    endpoint_url: str | None = None
    path_style: bool = False
    profile: str | None = None
    unsigned: bool = False
    connect_timeout: float = 10.0
    first_byte_timeout: float = 30.0
    idle_timeout: float = 30.0
    max_attempts: int = 10
    max_retry_time: float = 120.0
    part_size: int = 8 << 20
    max_concurrency: int = 64

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict."""
        return asdict(self)
