"""Type stubs of the native core ``shardstream._core``."""

from collections.abc import Iterator
from typing import Any, Literal, final

__all__ = [
    "Counters",
    "DatasetSpecError",
    "SampleStream",
    "ShardFormatError",
    "ShardNotFoundError",
    "ShardReadError",
    "ShardSkippedWarning",
    "ShardStreamError",
    "StorageAuthError",
    "__version__",
    "default_options",
    "plan_epoch",
    "resolve_shards",
    "run_cli",
]

__version__: str

class ShardStreamError(Exception):
    """Base class of shardstream errors."""

class DatasetSpecError(ShardStreamError):
    """The dataset spec cannot be parsed or names no shards."""

class ShardNotFoundError(ShardStreamError):
    """A shard does not exist."""

class StorageAuthError(ShardStreamError):
    """The storage denied access to a shard."""

class ShardReadError(ShardStreamError):
    """Reading a shard failed or stalled."""

class ShardFormatError(ShardStreamError):
    """A shard is not a valid archive, is truncated, or repeats a field within a key."""

class ShardSkippedWarning(UserWarning):
    """A bad shard was skipped under on_error="warn"."""

@final
class Counters:
    """Stream counters shared with DataLoader worker processes forked after their creation."""

    def __new__(cls) -> Counters: ...
    def snapshot(self) -> dict[str, int]:
        """The counters as a dict of name to value."""

@final
class SampleStream(Iterator[dict[str, Any]]):
    """The samples of one ``(rank, worker)`` slot for one epoch."""

    def __new__(
        cls,
        shards: list[tuple[str, int | None]],
        *,
        epoch: int = 0,
        world_size: int = 1,
        rank: int = 0,
        num_workers: int = 1,
        worker_id: int = 0,
        seed: int | None = None,
        shuffle_shards: bool | None = None,
        shuffle_buffer: int | None = None,
        shuffle_buffer_bytes: int | None = None,
        read_ahead_bytes: int | None = None,
        on_error: Literal["raise", "warn"] | None = None,
        io_timeout: float | None = None,
        counters: Counters | None = None,
    ) -> SampleStream: ...
    @property
    def units(self) -> list[int]:
        """Indices (into the shard list) of the shards this stream reads, in order."""
    def __iter__(self) -> SampleStream: ...
    def __next__(self) -> dict[str, Any]: ...

def resolve_shards(specs: list[str]) -> list[tuple[str, int | None]]:
    """Resolves dataset specs to ``(url, size or None)`` pairs, in order."""

def plan_epoch(
    sizes: list[int | None],
    *,
    seed: int,
    epoch: int,
    world_size: int,
    num_workers: int,
    shuffle_shards: bool = True,
) -> list[list[int]]:
    """The shard indices of every slot (``rank * num_workers + worker``) for one epoch."""

def default_options() -> dict[str, Any]:
    """The default stream options, by their Python keyword names."""

def run_cli(argv: list[str]) -> int:
    """Runs the ``shardstream`` command line with ``argv`` (program name first)."""
