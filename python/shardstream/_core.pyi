"""Type stubs of the native core ``shardstream._core``."""

import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, final

import numpy as np
import numpy.typing as npt
from typing_extensions import Unpack

from shardstream.options import DatasetOptions

__all__ = [
    "MIX_FORMAT",
    "MIX_MAX_PASSES",
    "MIX_PASS_STRIDE",
    "MIX_VERSION",
    "ArrowExport",
    "AudioClip",
    "Counters",
    "DatasetSpecError",
    "DecodeFieldWarning",
    "EpochTable",
    "FieldDecodeError",
    "Image",
    "ImageBoxes",
    "LedgerRecords",
    "ManifestError",
    "ManifestIgnoredWarning",
    "ManifestMismatchError",
    "MixSlot",
    "ObjectChangedError",
    "Options",
    "Pack",
    "SampleSkippedWarning",
    "SampleStream",
    "ShardFormatError",
    "ShardList",
    "ShardNotFoundError",
    "ShardReadError",
    "ShardSkippedWarning",
    "ShardStreamError",
    "ShardWriteError",
    "ShardWriter",
    "SharedWeights",
    "StateMismatchError",
    "StorageAuthError",
    "StreamProcessError",
    "Tokenizer",
    "TransformError",
    "__version__",
    "_rebuild_shard_list",
    "check_layout",
    "check_mix",
    "check_mix_state",
    "check_state",
    "default_options",
    "default_s3_options",
    "default_writer_options",
    "mix_counts",
    "mix_order",
    "option_table",
    "plan_epoch",
    "plan_samples",
    "raise_malloc_thresholds",
    "read_ahead_budget",
    "resolve_shards",
    "run_cli",
    "s3_option_table",
    "write_manifest",
]

__version__: str
MIX_FORMAT: str
MIX_VERSION: int
MIX_PASS_STRIDE: int
MIX_MAX_PASSES: int

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

class ObjectChangedError(ShardReadError):
    """An object was replaced while it was being read (its ETag changed)."""

class ShardFormatError(ShardStreamError):
    """A shard is not a valid archive, is truncated or corrupt, or repeats a field within a key."""

class FieldDecodeError(ShardStreamError):
    """A field's bytes cannot be decoded by the decoder chosen for it."""

class ManifestError(ShardStreamError):
    """A manifest cannot be read or is inconsistent in itself."""

class ManifestMismatchError(ManifestError):
    """A shard does not match what the manifest says of it."""

class StateMismatchError(ShardStreamError):
    """A saved state does not fit this dataset, options or layout."""

class StreamProcessError(ShardStreamError):
    """An iterator was used in another process than the one that started it (a forked child)."""

class TransformError(ShardStreamError):
    """The dataset's transform raised on a sample (the original exception is its __cause__)."""

class ShardWriteError(ShardStreamError):
    """Writing a shard or its manifest failed; the shard was not left behind half-written."""

class ShardSkippedWarning(UserWarning):
    """A bad shard was skipped under on_error="warn"."""

class SampleSkippedWarning(ShardSkippedWarning):
    """A sample was left out: its transform raised under on_error="warn", or (with
    pack) it is a document with no tokens that no sequence carries."""

class DecodeFieldWarning(UserWarning):
    """A decode= key names no field of the samples (warned once per dataset and process)."""

class ManifestIgnoredWarning(UserWarning):
    """A manifest.json beside the shards is not a shardstream manifest and was not used."""

@final
class LedgerRecords:
    """Ledger records, encoded as the ledger file holds them, kept until taken."""

    def __new__(cls) -> LedgerRecords: ...
    @property
    def samples(self) -> int:
        """Samples in the records held."""
    def push_batch(self, step: int, kind: int, ids: Any) -> None:
        """Appends the record of ``step`` holding a Rust batch's ``(B, 3)`` ``int64`` ids;
        ``ValueError`` when its samples are of several epochs."""
    def push_tensors(self, step: int, kind: int, epoch: Any, shard: Any, index: Any) -> int:
        """Appends the record of ``step`` holding a DataLoader batch's three ``int64`` CPU
        tensor columns of ids; the samples now held, or 0 (nothing appended) for other
        columns."""
    def push(
        self,
        steps: list[int],
        epochs: list[int | None],
        kinds: list[int],
        counts: list[int],
        ids: Any,
    ) -> None:
        """Appends records ``(steps[r], epochs[r], kinds[r])`` (an epoch of ``None``: the
        record's first sample's), record ``r`` holding the next ``counts[r]`` samples of
        ``ids`` (``int64``: a ``(N, 3)`` array or its three columns)."""
    def take(self) -> bytes:
        """The records held, as bytes; the buffer is then empty."""

@final
class Counters:
    """Stream counters shared with DataLoader worker processes forked after their creation
    and, through their descriptor, with workers started by ``spawn`` or ``forkserver``."""

    def __new__(cls) -> Counters: ...
    def snapshot(self) -> dict[str, int]:
        """The counters as a dict of name to value, with the values derived from them
        (``parse_ns``, ``read_ahead_bytes``)."""
    def count_skipped(self) -> None:
        """Counts one sample skipped under ``on_error="warn"`` (its transform raised) in
        ``errors_skipped``."""
    def count_transform(self, nanos: int) -> None:
        """Counts ``nanos`` nanoseconds spent in the Python ``transform``."""
    def fd(self) -> int | None:
        """The descriptor of the counters' memory (``None``: shared with forked processes
        only)."""
    @staticmethod
    def _attach(fd: int) -> Counters:
        """The counters whose memory is the descriptor ``fd`` (taken over and closed)."""

@final
class EpochTable:
    """The epoch of each DataLoader worker's next iteration, by worker id, in memory shared
    with forked workers and, through its descriptor, with workers started by ``spawn`` or
    ``forkserver``."""

    capacity: int
    def __new__(cls) -> EpochTable: ...
    def get(self, worker: int) -> int:
        """The epoch of worker ``worker``'s next iteration."""
    def set_all(self, epoch: int) -> None:
        """Sets every entry to ``epoch``, and clears ``worker_began``."""
    def set_worker(self, worker: int, num_workers: int, epoch: int) -> None:
        """Sets entry ``worker`` of a DataLoader of ``num_workers`` workers, and every entry
        from ``num_workers`` on, to ``epoch``."""
    def mark_worker_began(self) -> None:
        """Records that a worker began an iteration."""
    def worker_began(self) -> bool:
        """Whether a worker began an iteration since ``set_all`` last ran."""
    def values(self) -> list[int]:
        """Every entry, in worker id order."""
    def fd(self) -> int | None:
        """The descriptor of the table's memory (``None``: shared with forked processes only)."""
    @staticmethod
    def _attach(fd: int) -> EpochTable:
        """The table whose memory is the descriptor ``fd`` (taken over and closed)."""
    @staticmethod
    def _from_values(values: list[int]) -> EpochTable:
        """A new, unshared table holding ``values``."""

@final
class SharedWeights:
    """A mixture's weights, in memory shared with forked workers and, through its
    descriptor, with workers started by ``spawn`` or ``forkserver``; read and written whole."""

    def __new__(cls, weights: list[float]) -> SharedWeights: ...
    def get(self, epoch: int) -> list[float]:
        """The weights epoch ``epoch`` mixes by."""
    def set(self, weights: list[float], epoch: int) -> None:
        """Makes ``weights`` those of epoch ``epoch`` and the ones after it (the epochs
        before take the weights epoch ``epoch - 1`` had)."""
    def _held(self) -> tuple[int, list[float], list[float]]:
        """The first epoch of the newest weights, the weights before it, and the newest."""
    @staticmethod
    def _from_parts(from_epoch: int, before: list[float], after: list[float]) -> SharedWeights:
        """A new, unshared table holding ``before`` before ``from_epoch``, ``after`` from it."""
    def fd(self) -> int | None:
        """The descriptor of the table's memory (``None``: shared with forked processes only)."""
    @staticmethod
    def _attach(fd: int) -> SharedWeights:
        """The table whose memory is the descriptor ``fd`` (taken over and closed)."""
    def __reduce__(self) -> tuple[Any, tuple[int, list[float], list[float]]]: ...

@final
class AudioClip:
    """Decode a WAV or FLAC field to a float32 clip of one fixed shape, on the decode
    threads: mixed to mono or picked channels, resampled to ``sample_rate``, cropped or
    padded to ``frames`` (or ``seconds``). The real frame count comes as the field
    ``<field>_frames``: ``decode={"wav": AudioClip(seconds=4.0)}`` (see docs/augment.md)."""

    def __new__(
        cls,
        *,
        sample_rate: int | None = None,
        channels: Literal["mono"] | Sequence[int] | None = None,
        frames: int | None = None,
        seconds: float | None = None,
        crop: Literal["random", "start", "center"] | None = None,
        pad: float | None = None,
    ) -> AudioClip: ...
    @property
    def sample_rate(self) -> int:
        """The output sample rate."""
    @property
    def channels(self) -> Literal["mono"] | list[int]:
        """``"mono"`` or the list of channel indices."""
    @property
    def frames(self) -> int:
        """Frames per clip."""
    @property
    def crop(self) -> Literal["random", "start", "center"]:
        """Where a longer clip is cut."""
    @property
    def pad(self) -> float:
        """The value of padded frames."""
    @property
    def shape(self) -> tuple[int] | tuple[int, int]:
        """``(frames,)`` for one channel, ``(channels, frames)`` for several."""
    def __getnewargs_ex__(self) -> tuple[tuple[()], dict[str, Any]]: ...
    def __eq__(self, value: object, /) -> bool: ...

@final
class Image:
    """Decode a JPEG or PNG field and crop, resize and flip it to one fixed shape, on the
    decode threads: ``decode={"jpg": Image(224, flip=0.5)}`` (see docs/augment.md)."""

    def __new__(
        cls,
        size: int | tuple[int, int] | None = None,
        *,
        crop: Literal["random_resized", "center", "resize"] | None = ...,
        scale: tuple[float, float] | None = None,
        ratio: tuple[float, float] | None = None,
        resize: int | None = None,
        flip: float | None = None,
        layout: Literal["CHW", "HWC"] | None = None,
    ) -> Image: ...
    @property
    def size(self) -> tuple[int, int] | None:
        """Output ``(height, width)``, or ``None`` with ``crop=None``."""
    @property
    def crop(self) -> Literal["random_resized", "center", "resize"] | None:
        """How the box is chosen."""
    @property
    def scale(self) -> tuple[float, float] | None:
        """The area range of ``random_resized`` boxes, else ``None``."""
    @property
    def ratio(self) -> tuple[float, float] | None:
        """The aspect ratio range of ``random_resized`` boxes, else ``None``."""
    @property
    def resize(self) -> int | None:
        """The shorter side before a ``center`` crop, else ``None``."""
    @property
    def flip(self) -> float:
        """The probability of a horizontal flip."""
    @property
    def layout(self) -> Literal["CHW", "HWC"]:
        """``"CHW"`` or ``"HWC"``."""
    def __getnewargs_ex__(self) -> tuple[tuple[tuple[int, int] | None], dict[str, Any]]: ...
    def __eq__(self, value: object, /) -> bool: ...

@final
class ImageBoxes:
    """Leave a JPEG field as it is and add ``<field>_box``, a float32 ``[x, y, width,
    height, flip]``: the source box and flip ``image`` would draw for that sample, for a
    batched decoder elsewhere (``shardstream.gpu.BatchImageDecoder``)."""

    def __new__(cls, image: Image) -> ImageBoxes: ...
    @property
    def image(self) -> Image:
        """The ``Image`` whose boxes these are."""
    def __getnewargs__(self) -> tuple[Image]: ...
    def __eq__(self, value: object, /) -> bool: ...

@final
class Pack:
    """Pack each document's token ids into sequences of ``seq_len + 1`` tokens:
    ``pack=Pack(2048)`` with ``decode={"text": Tokenizer(...)}`` hands out
    ``input_ids``, ``position_ids`` and ``cu_seqlens`` (see docs/text.md)."""

    def __new__(
        cls,
        seq_len: int,
        *,
        mode: Literal["concat", "best_fit"] | None = None,
        field: str | None = None,
        window: int | None = None,
        labels: bool | None = None,
        pad_id: int | None = None,
    ) -> Pack: ...
    @property
    def seq_len(self) -> int:
        """Tokens a step trains on."""
    @property
    def mode(self) -> Literal["concat", "best_fit"]:
        """``"concat"`` or ``"best_fit"``."""
    @property
    def field(self) -> str | None:
        """The field of token ids (``None``: the one ``decode`` tokenizes)."""
    @property
    def window(self) -> int | None:
        """Open sequences ``"best_fit"`` keeps (``None`` for ``"concat"``)."""
    @property
    def labels(self) -> bool:
        """Whether ``labels`` come apart from ``input_ids``."""
    @property
    def pad_id(self) -> int:
        """The id that fills the unused end of a sequence."""
    def __getnewargs_ex__(self) -> tuple[tuple[int], dict[str, Any]]: ...
    def __eq__(self, value: object, /) -> bool: ...

@final
class Tokenizer:
    """Tokenize a text field (a text value, or UTF-8 bytes) to an int32 array of token
    ids on the decode threads, with a Hugging Face ``tokenizer.json``:
    ``decode={"text": Tokenizer("tokenizer.json", eos="<|endoftext|>")}`` (see
    docs/text.md)."""

    def __new__(
        cls,
        source: str | os.PathLike[str],
        *,
        bos: int | str | None = None,
        eos: int | str | None = None,
        add_special_tokens: bool | None = None,
    ) -> Tokenizer: ...
    @staticmethod
    def from_str(
        json: str,
        bos: int | str | None = None,
        eos: int | str | None = None,
        add_special_tokens: bool | None = None,
    ) -> Tokenizer:
        """A tokenizer from the text of a ``tokenizer.json`` (what
        ``tokenizers.Tokenizer.to_str()`` gives)."""
    def encode(self, text: str) -> npt.NDArray[np.int32]:
        """The token ids of ``text``, as the decode threads give them: an int32 numpy
        array."""
    @property
    def bos(self) -> int | None:
        """The id put before every text, or ``None``."""
    @property
    def eos(self) -> int | None:
        """The id put after every text, or ``None``."""
    @property
    def add_special_tokens(self) -> bool:
        """Whether the tokenizer's own special tokens (its post-processor's) are added."""
    @property
    def vocab_size(self) -> int:
        """Tokens in the vocabulary, added tokens included."""
    def token_to_id(self, token: str) -> int | None:
        """The id of ``token``, or ``None`` when it is not in the vocabulary."""
    def to_str(self) -> str:
        """The text of the ``tokenizer.json``."""
    def __reduce__(
        self,
    ) -> tuple[Callable[..., Tokenizer], tuple[str, int | None, int | None, bool]]: ...
    def __eq__(self, value: object, /) -> bool: ...

@final
class Options:
    """Every dataset option, parsed and validated once; the others take their defaults.
    A value of the wrong type raises ``TypeError``, one out of range ``ValueError``,
    both naming the option."""

    def __new__(cls, **options: Unpack[DatasetOptions]) -> Options:
        """Names, types and defaults: ``option_table()``."""
    def to_dict(self) -> dict[str, Any]:
        """The value of every option, defaults included, by name."""
    def __getitem__(self, name: str, /) -> Any:
        """The value of option ``name`` (its default when not given)."""
    @property
    def batches(self) -> bool:
        """Whether batches are handed out (``batch_size``, or Arrow record batches)."""
    def __getnewargs_ex__(self) -> tuple[tuple[()], dict[str, Any]]:
        """Pickling keeps the keywords as given."""

@final
class ShardList:
    """The resolved shards of a dataset, with their sample counts (from a manifest, Parquet
    footers, or the headers of local tar shards), and the options they were resolved with."""

    def __new__(cls, specs: list[str], options: Options) -> ShardList: ...
    def __reduce__(
        self,
    ) -> tuple[Callable[..., ShardList], tuple[list[str], Options, str | None, bool, bytes]]:
        """Pickling keeps the resolved shards; see ``_rebuild_shard_list``."""
    @property
    def specs(self) -> list[str]:
        """The dataset spec, as given (before listing and expansion)."""
    @property
    def urls(self) -> list[str]:
        """Shard URLs, in order."""
    @property
    def sizes(self) -> list[int | None]:
        """Shard sizes in bytes (``None`` when unknown), in order."""
    @property
    def sample_counts(self) -> list[int] | None:
        """Sample counts per shard, or ``None`` when one is unknown."""
    @property
    def manifest_path(self) -> str | None:
        """The manifest in use, if any."""
    @property
    def kinds(self) -> list[str]:
        """What each shard holds: ``"tar"``, ``"raw"``, ``"jsonl"`` or ``"parquet"``
        (one row group)."""
    def count_samples(self) -> None:
        """Counts the samples of the local tar shards without counts, from their headers
        (unless ``count_samples=False``)."""
    def counted_locally(self) -> ShardList | None:
        """A copy with the local tar and JSON-lines shards counted from their headers, or
        ``None`` when none is left to count (or ``count_samples=False``); nothing remote
        is read."""
    def uncounted_remote(self) -> list[int]:
        """Positions of the tar shards without a sample count (remote shards no manifest
        describes), when ``count_samples=True`` asks for them to be read; else none."""
    def index_shards(self, positions: list[int], jobs: int) -> str:
        """Reads the shards at ``positions`` through, ``jobs`` at once; their manifest (JSON)."""
    def attach_counts(self, json: str) -> None:
        """Gives the shards ``json`` (a manifest from ``index_shards``) lists their sample
        indices, checking sizes and ETags."""
    def keep_counts(self, json: str) -> None:
        """Keeps ``json``, the remote shards' sample counts, in ``cache_dir`` (if set) for the
        next start."""
    @property
    def counted(self) -> bool:
        """Whether the local tar shards were counted from their headers."""
    def check_local_files(self) -> None:
        """Raises ``ShardNotFoundError`` or ``ManifestMismatchError`` if a local file of the
        shards (resolved by another process, maybe on another node) is missing here or differs
        from what the resolution says of it: one ``stat`` per local shard, nothing read."""
    def check_equal_length(self, world_size: int, mixture: bool = False) -> None:
        """Raises ``DatasetSpecError`` if ``world_size`` ranks cannot get the same number of
        samples (a shard's sample count is unknown), or ``ValueError`` naming ``pack`` if they
        cannot get the same number of packed sequences (the manifest has no token counts of
        the packed field, or counted them with another tokenizer)."""
    def samples_per_rank(self, world_size: int, remainder: str = "drop") -> int | None:
        """Samples each rank gets per epoch (with sample counts), else ``None``."""
    def __len__(self) -> int: ...

def _rebuild_shard_list(
    specs: list[str],
    options: Options,
    manifest: str | None,
    counted: bool,
    shards: bytes,
) -> ShardList:
    """Unpickles a ``ShardList`` (``shards`` as its pickling encoded them)."""

@final
class ArrowExport:
    """One record batch, exported once through the Arrow PyCapsule interface."""

    def __arrow_c_array__(self, requested_schema: object | None = None) -> tuple[object, object]:
        """The schema and array capsules; the batch can be taken once."""

_Slot = tuple[int, int, int, int]
_StreamOpener = Callable[[int, int, str | None], SampleStream]

@final
class MixSlot(Iterator[tuple[int, Any]]):
    """One slot's mixture for one epoch, fresh or resumed: its streams, its plan and
    where it stands; ``next()`` gives ``(stream, sample)``. A stream is opened with
    ``open(stream, epoch, resume)``; ``slot`` is ``(rank, world_size, worker_id,
    num_workers)``."""

    @staticmethod
    def fresh(
        open: _StreamOpener,
        streams: int,
        policy: str,
        seed: int,
        slot: _Slot,
        weights: list[float],
        epoch: int,
    ) -> MixSlot:
        """The slot's mixture of ``epoch`` under ``weights``, from its start."""
    @staticmethod
    def exact(
        open: _StreamOpener, streams: int, policy: str, seed: int, slot: _Slot, state: str
    ) -> MixSlot:
        """The rest of the slot's epoch from ``state`` (JSON), the slot's own mixture
        state, each of its counts checked against the plan."""
    @staticmethod
    def elastic(
        open: _StreamOpener,
        streams: int,
        policy: str,
        seed: int,
        slot: _Slot,
        states: str,
        weights: list[float] | None = None,
    ) -> MixSlot:
        """The rest of a job's epoch, split anew for this slot's layout: ``states``
        (JSON) holds every slot's mixture state of the job; ``weights`` the weights from
        here on (the states' own if ``None``)."""
    @property
    def epoch(self) -> int:
        """The mixture epoch."""
    def __len__(self) -> int:
        """The samples of the slot's order, taken or not."""
    def __iter__(self) -> MixSlot: ...
    def __next__(self) -> tuple[int, Any]:
        """The next ``(stream, sample)``."""
    def state(self) -> str:
        """The mixture state (JSON) as of the last sample handed out."""

@final
class SampleStream(Iterator[Any]):
    """The samples of one ``(rank, worker)`` slot for one epoch (dicts, collated batches or
    ``pyarrow.RecordBatch`` objects); its threads start at the first ``next()`` (or ``start()``)."""

    def __new__(
        cls,
        shards: ShardList,
        *,
        epoch: int = 0,
        world_size: int = 1,
        rank: int = 0,
        num_workers: int = 1,
        worker_id: int = 0,
        resume: str | None = None,
        counters: Counters | None = None,
        local_bytes: Callable[..., bytes] | None = None,
        shared_bytes: Callable[..., bytes] | None = None,
        on_skip: Callable[[int, int, int, int | None, str, str], object] | None = None,
        plan_sequences: bool = False,
        on_end: Callable[[], object] | None = None,
    ) -> SampleStream: ...
    @property
    def epoch(self) -> int:
        """The epoch streamed (a resumed stream takes it from the state)."""
    @property
    def units(self) -> list[tuple[int, int | None, int | None]]:
        """This slot's work units in order: ``(shard, first_sample, end_sample)``."""
    @property
    def started(self) -> bool:
        """Whether ``next()`` or ``start()`` has been called (its threads started)."""
    @property
    def planned_samples(self) -> int | None:
        """The samples the stream hands out (for a packed stream that plans its sequences,
        the sequences), ``None`` if a unit is a whole shard whose sample count is not known."""
    def start(self) -> bool:
        """Starts the stream's threads now: reading begins before the first
        ``next()``. False if they could not start (the first ``next()`` raises why)."""
    def retarget(self, other: SampleStream) -> bool:
        """Makes this stream, not yet started, stream what ``other`` would."""
    def state(self) -> str:
        """The state (JSON) as of the last sample handed out."""
    def __iter__(self) -> SampleStream: ...
    def __next__(self) -> Any:
        """The next sample (a dict), batch (a dict of columns) or record batch; raises
        ``StreamProcessError`` in a process other than the one that started the stream."""

def resolve_shards(specs: list[str]) -> list[tuple[str, int | None]]:
    """Resolves dataset specs to ``(url, size or None)`` pairs, in order."""

def check_layout(
    *,
    world_size: int | None,
    num_workers: int | None,
    rank: int | None = None,
    worker_id: int | None = None,
) -> None:
    """Checks a job's layout as far as it is given (``None``: known later)."""

def check_state(state: str) -> None:
    """Checks that ``state`` (JSON) is a shardstream state or a list of them."""

def plan_samples(
    counts: list[int],
    *,
    seed: int,
    epoch: int,
    world_size: int,
    num_workers: int,
    shuffle_shards: bool = True,
    remainder: str = "drop",
) -> list[list[tuple[int, int, int]]]:
    """The sample runs ``(shard, start, end)`` of every slot for one epoch (equal samples per
    rank)."""

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

def check_mix(policy: str, weights: list[float]) -> None:
    """Checks mixture weights and a policy name, naming the bad one."""

def check_mix_state(state: str, policy: str, seed: int, streams: int, prefix: str = "") -> None:
    """Checks ``state`` (JSON) as the state of one slot of a mixture of ``streams``
    streams under ``policy`` and ``seed``, naming the first field that is wrong (after
    ``prefix``) in a ``StateMismatchError``."""

def mix_counts(policy: str, weights: list[float], available: list[int]) -> list[int]:
    """How many samples each stream gives a slot to which the streams' plans give
    ``available`` samples, under ``policy``."""

def mix_order(
    policy: str,
    weights: list[float],
    counts: list[int],
    *,
    seed: int,
    epoch: int,
    slot: int,
    generation: int = 0,
) -> bytes:
    """The order in which a slot takes ``counts[s]`` samples of each stream ``s``: one
    byte per sample, the stream's index."""

def default_options() -> dict[str, Any]:
    """The default of every dataset option, by its keyword name."""

def read_ahead_budget(read_ahead_bytes: int | None, num_workers: int) -> int:
    """The read-ahead budget of each stream of a process among ``num_workers`` DataLoader
    workers (0: the main process): ``read_ahead_bytes`` when given, else what ``None``
    gives there; an invalid ``read_ahead_bytes`` raises ``ValueError`` naming the option."""

def option_table() -> list[dict[str, Any]]:
    """Every dataset option, in documentation order: a dict per option with its ``name``,
    Python ``type``, ``default``, ``doc`` (README's text), whether it ``affects_order``
    (which samples come in which order, so that a saved state must match it) and how
    (``order``: ``"holds"``, ``"decides"``, ``"shards"``, ``"layout"`` or ``"no"``)."""

def s3_option_table() -> list[dict[str, Any]]:
    """Every field of the ``s3=`` option (``shardstream.S3Config``), as ``option_table()``
    lists the dataset options (``doc``: the text of docs/sources.md's table)."""

def default_s3_options() -> dict[str, Any]:
    """The defaults of the ``s3=`` options (``shardstream.S3Config`` fields)."""

def default_writer_options() -> dict[str, Any]:
    """The default of every ``ShardWriter`` option, by its keyword name."""

@final
class ShardWriter:
    """Writes WebDataset shards (see ``shardstream.ShardWriter``)."""

    def __new__(
        cls,
        pattern: str,
        *,
        max_count: int | None = 100000,
        max_bytes: int | None = 3000000000,
        compression: Literal["gz", "zst"] | None = None,
        s3: Any = None,
    ) -> ShardWriter: ...
    def write(self, sample: dict[str, Any]) -> None:
        """Writes one sample: a dict with ``__key__`` (str) and its fields."""
    def close(self) -> None:
        """Completes the open shard and the manifest."""
    def abort(self) -> None:
        """Abandons the open shard; completed shards and their manifest stay."""
    def __len__(self) -> int:
        """Samples written."""
    @property
    def shards(self) -> int:
        """Shards completed."""
    @property
    def shard_urls(self) -> list[str]:
        """URLs (or paths) of the completed shards."""
    @property
    def manifest_url(self) -> str:
        """Where the manifest is written."""
    @property
    def manifest_json(self) -> str:
        """The manifest of the completed shards (JSON), as written beside them."""

def write_manifest(url: str, manifest: str, *, s3: Any = None) -> None:
    """Writes a manifest (JSON, checked as a manifest read is) to ``url``: a local path,
    renamed into place, or an ``s3://`` URL."""

def raise_malloc_thresholds() -> bool:
    """Sets glibc's mmap threshold to 32 MiB and trim threshold to 64 MiB in
    this process (where glibc's adaptive rule puts them after a 32 MiB block
    is freed). True if set; False where the C library is not glibc."""

def run_cli(argv: list[str]) -> int:
    """Runs the ``shardstream`` command line with ``argv`` (program name first)."""
