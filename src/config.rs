//! Stream options, with defaults and validation in one place, and the one
//! definition of every dataset option ([`DATASET_OPTIONS`]).

use std::time::Duration;

use crate::decode::Decoder;
use crate::error::{Error, Result};
use crate::plan::Remainder;
use crate::spec::DatasetFormat;

/// What to do when a shard is missing, unreadable or malformed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnError {
    /// End the stream with the error.
    Raise,
    /// Skip the rest of the bad shard, report a warning and count it.
    Warn,
}

impl std::str::FromStr for OnError {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        [OnError::Raise, OnError::Warn]
            .into_iter()
            .find(|policy| policy.name() == s)
            .ok_or_else(|| Error::Config {
                name: "on_error",
                reason: format!("expected \"raise\" or \"warn\", got {s:?}"),
            })
    }
}

impl OnError {
    /// The policy's name, as the `on_error` option takes it.
    pub fn name(self) -> &'static str {
        match self {
            OnError::Raise => "raise",
            OnError::Warn => "warn",
        }
    }
}

/// Which decoder each field goes through; fields without one stay bytes.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FieldDecoders {
    /// Decoders chosen by field name.
    pub by_field: Vec<(String, Decoder)>,
    /// Fields not named in `by_field` take the default of their extension
    /// ([`crate::decode::default_for`]).
    pub defaults: bool,
}

impl FieldDecoders {
    /// The defaults by extension for every field.
    pub fn defaults() -> Self {
        FieldDecoders {
            by_field: Vec::new(),
            defaults: true,
        }
    }

    /// The decoder of `field`, if any.
    pub fn decoder_for(&self, field: &str) -> Option<Decoder> {
        match self.by_field.iter().find(|(name, _)| name == field) {
            Some((_, decoder)) => Some(decoder.clone()),
            None if self.defaults => crate::decode::default_for(field),
            None => None,
        }
    }

    /// Whether no field is decoded.
    pub fn is_empty(&self) -> bool {
        self.by_field.is_empty() && !self.defaults
    }
}

/// How rows of a table (Parquet) are handed out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TableOutput {
    /// One sample per row.
    #[default]
    Rows,
    /// Arrow record batches as they are decoded, rows in file order.
    Arrow,
}

impl TableOutput {
    /// The output's name, as the `batch_format` option takes it.
    pub fn name(self) -> &'static str {
        match self {
            TableOutput::Rows => "dict",
            TableOutput::Arrow => "arrow",
        }
    }
}

impl std::str::FromStr for TableOutput {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        [TableOutput::Rows, TableOutput::Arrow]
            .into_iter()
            .find(|output| output.name() == s)
            .ok_or_else(|| Error::Config {
                name: "batch_format",
                reason: format!("expected \"dict\" or \"arrow\", got {s:?}"),
            })
    }
}

/// Headers sent with every HTTP(S) request to a shard's own origin (never
/// to another host a redirect leads to). Values may be secrets: they are
/// never shown (`Debug` prints the names only) nor put in an error.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct HttpHeaders(pub Vec<(String, String)>);

impl std::fmt::Debug for HttpHeaders {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map()
            .entries(self.0.iter().map(|(name, _)| (name, "<hidden>")))
            .finish()
    }
}

impl HttpHeaders {
    /// Checks that every name and value can be sent, naming the header
    /// (never its value) that cannot.
    pub fn validate(&self) -> Result<()> {
        for (name, value) in &self.0 {
            let bad = |reason: String| Error::Config {
                name: "http_headers",
                reason,
            };
            let parsed = http::HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| bad(format!("{name:?} is not a valid header name")))?;
            if http::HeaderValue::from_str(value).is_err() {
                return Err(bad(format!(
                    "the value of {name:?} is not a valid header value (visible ASCII only, \
                     no line breaks)"
                )));
            }
            if [
                http::header::RANGE,
                http::header::IF_MATCH,
                http::header::HOST,
            ]
            .contains(&parsed)
            {
                return Err(bad(format!("{name:?} is set by shardstream itself")));
            }
        }
        Ok(())
    }
}

/// How every remote store is read: timeouts, retries, part size and
/// concurrency of S3, HTTP(S), GCS and Hub requests alike, and the headers
/// HTTP(S) requests add. Set through `S3Config` (`S3_OPTIONS`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transport {
    /// Longest wait to connect.
    pub connect_timeout: Duration,
    /// Longest wait for a response's headers.
    pub first_byte_timeout: Duration,
    /// Longest wait for the next bytes of a body.
    pub idle_timeout: Duration,
    /// Attempts per request, the first included.
    pub max_attempts: u32,
    /// Longest time spent retrying one request.
    pub max_retry_time: Duration,
    /// First backoff step; doubles per attempt, up to `backoff_max`.
    pub backoff_base: Duration,
    /// Largest backoff step.
    pub backoff_max: Duration,
    /// The largest ranged GET. Remote objects are read as parts: an
    /// object's first part is at most 256 KiB, each next one twice the one
    /// before, up to this size, or less so that 32 parts fit in the
    /// read-ahead budget.
    pub part_size: usize,
    /// Ranged GETs in flight at once per reading process (per DataLoader
    /// worker), across objects, at most. 1 reads one object at a time, as
    /// one streaming GET.
    pub max_concurrency: usize,
    /// Headers of HTTP(S) requests (not sent to S3).
    pub http_headers: HttpHeaders,
}

impl Transport {
    /// The largest part: the read-ahead budget is taken a part at a time,
    /// in permits counted in `u32`.
    pub const MAX_PART_SIZE: usize = u32::MAX as usize;
    /// The most ranged GETs in flight at once.
    pub const MAX_CONCURRENCY: usize = 256;
    /// The most attempts per request.
    pub const MAX_ATTEMPTS: u32 = 1000;
    /// The longest timeout, retry time or backoff step: a year.
    pub const MAX_DURATION: Duration = Duration::from_secs(365 * 24 * 3600);

    /// Checks every option against the range the code can use, naming the
    /// first one out of range.
    pub fn validate(&self) -> Result<()> {
        let out_of_range = |name: &'static str, reason: String| Err(Error::Config { name, reason });
        if !(1..=Self::MAX_PART_SIZE).contains(&self.part_size) {
            return out_of_range(
                "part_size",
                format!(
                    "must be from 1 to {} bytes (4 GiB - 1), got {}",
                    Self::MAX_PART_SIZE,
                    self.part_size
                ),
            );
        }
        if !(1..=Self::MAX_CONCURRENCY).contains(&self.max_concurrency) {
            return out_of_range(
                "max_concurrency",
                format!(
                    "must be from 1 to {}, got {}",
                    Self::MAX_CONCURRENCY,
                    self.max_concurrency
                ),
            );
        }
        if !(1..=Self::MAX_ATTEMPTS).contains(&self.max_attempts) {
            return out_of_range(
                "max_attempts",
                format!(
                    "must be from 1 to {}, got {}",
                    Self::MAX_ATTEMPTS,
                    self.max_attempts
                ),
            );
        }
        let durations = [
            ("connect_timeout", self.connect_timeout, true),
            ("first_byte_timeout", self.first_byte_timeout, true),
            ("idle_timeout", self.idle_timeout, true),
            ("max_retry_time", self.max_retry_time, false),
            ("backoff_base", self.backoff_base, false),
            ("backoff_max", self.backoff_max, false),
        ];
        for (name, value, positive) in durations {
            if value > Self::MAX_DURATION {
                return out_of_range(
                    name,
                    format!(
                        "must be at most {} seconds (a year), got {} seconds",
                        Self::MAX_DURATION.as_secs(),
                        value.as_secs_f64()
                    ),
                );
            }
            if positive && value.is_zero() {
                return out_of_range(name, "must be more than 0 seconds".into());
            }
        }
        self.http_headers.validate()
    }
}

impl Default for Transport {
    fn default() -> Self {
        Transport {
            connect_timeout: Duration::from_secs(10),
            first_byte_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(30),
            max_attempts: 10,
            max_retry_time: Duration::from_secs(120),
            backoff_base: Duration::from_millis(50),
            backoff_max: Duration::from_secs(5),
            part_size: 8 << 20,
            max_concurrency: 64,
            http_headers: HttpHeaders::default(),
        }
    }
}

/// How remote stores are reached: S3's (or an S3-compatible store's)
/// region, endpoint, addressing, profile and signing, and the [`Transport`]
/// every store reads with. S3 credentials come from the default chain:
/// environment, shared config and credentials files, SSO, web identity,
/// IMDS and ECS roles.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoreOptions {
    /// Region; `None` takes it from the environment or profile (else `us-east-1`).
    pub region: Option<String>,
    /// Endpoint URL of an S3-compatible store; `None` takes `AWS_ENDPOINT_URL` or AWS.
    pub endpoint_url: Option<String>,
    /// Path-style addressing (`endpoint/bucket/key`).
    pub path_style: bool,
    /// Named profile of the shared config files.
    pub profile: Option<String>,
    /// Send unsigned requests (public buckets).
    pub unsigned: bool,
    /// Timeouts, retries, parts and concurrency of every store.
    pub transport: Transport,
}

impl StoreOptions {
    /// Checks every option against the range the code can use, naming the
    /// first one out of range.
    pub fn validate(&self) -> Result<()> {
        self.transport.validate()
    }
}

/// The largest byte budget an option may set (read-ahead, shuffle buffer):
/// far above any machine's memory, far below what would overflow the
/// budget's counters.
pub const MAX_BUDGET_BYTES: u64 = 1 << 40;

/// The largest count of samples or rows an option may set.
pub const MAX_ITEMS: u64 = 1 << 32;

/// Options of one stream. Build with [`StreamOptions::builder`].
#[derive(Debug, Clone, PartialEq)]
pub struct StreamOptions {
    /// Seed for shard order and shuffle buffer.
    pub seed: u64,
    /// Shuffle the shard order every epoch.
    pub shuffle_shards: bool,
    /// Shuffle buffer size in samples; 0 disables sample shuffling.
    pub shuffle_buffer: usize,
    /// Byte budget of the shuffle buffer.
    pub shuffle_buffer_bytes: usize,
    /// Samples the shuffle buffer holds before its first sample leaves; it
    /// then grows by one per sample out until it holds `shuffle_buffer`.
    pub shuffle_initial: usize,
    /// Bytes read ahead of the parser, across shard boundaries.
    pub read_ahead_bytes: usize,
    /// Size of one read from storage.
    pub chunk_bytes: usize,
    /// Samples queued for the consumer. They are sent in groups of
    /// `output_queue / 4` (1 to 64), a group going out early once its
    /// samples hold 1 MiB, so up to one more group may wait.
    pub output_queue: usize,
    /// Longest wait for the next bytes of a shard.
    pub io_timeout: Duration,
    /// Error policy.
    pub on_error: OnError,
    /// Remainder policy of equal-length epochs (with a manifest).
    pub remainder: Remainder,
    /// How to reach every store: S3, HTTP(S), GCS and the Hub (the `s3=` option).
    pub store: StoreOptions,
    /// Field decoders applied to every sample.
    pub decode: FieldDecoders,
    /// Threads that decode a stream's fields (the pipeline thread
    /// included); `None`: as many as the cores allow, shared among the
    /// processes that decode (the pipeline's `auto_decode_threads`).
    pub decode_threads: Option<usize>,
    /// Table columns to read (all when `None`).
    pub columns: Option<Vec<String>>,
    /// How table rows are handed out.
    pub table_output: TableOutput,
    /// Rows per decoded table batch.
    pub batch_rows: usize,
    /// Where remote shards are cached, if anywhere.
    pub cache: Option<CacheOptions>,
    /// Give each sample a `__seed__` field: an int of 63 bits drawn from
    /// the sample's identity (seed, epoch, shard index, index in the
    /// shard), for Python transforms to draw their randomness from. It
    /// changes no sample's order, so resume states ignore it.
    pub sample_seed: bool,
    /// Give each sample a `__id__` field: `(epoch, shard index, index in
    /// the shard)`, the id a ledger records (`shardstream.Ledger`). It
    /// changes no sample's order, so resume states ignore it.
    pub sample_ids: bool,
}

/// A dataset option's default, as Python sees it.
#[derive(Debug, Clone, PartialEq)]
pub enum DefaultValue {
    /// `None`: not set.
    None,
    /// `True` or `False`.
    Bool(bool),
    /// A non-negative int.
    Int(u64),
    /// A number of seconds (a float).
    Seconds(f64),
    /// A str: the name of one of the option's choices.
    Str(&'static str),
}

/// Appends the bytes by which an option's value enters the resume
/// fingerprint ([`StreamOptions::order_bytes`]).
pub type OrderBytes = fn(&StreamOptions, &mut Vec<u8>);

/// Whether an option decides which samples a stream produces and in which
/// order, and so whether a saved state may resume with it changed. Every
/// option says which: a state saved with other values of an option that
/// decides it must be refused, never resumed into other samples.
#[derive(Clone, Copy)]
pub enum SampleOrder {
    /// It decides what each sample holds (which fields, decoded how): the
    /// fingerprint takes these bytes, before those of every
    /// [`SampleOrder::Decides`] option.
    Holds(OrderBytes),
    /// It decides which samples come when: the fingerprint takes these bytes.
    Decides(OrderBytes),
    /// It decides through the shard list (which shards, their kinds and
    /// sample counts), which the fingerprint takes whole.
    ThroughShards,
    /// It decides through the layout (data-parallel rank and world size),
    /// which a state records and is checked against.
    ThroughLayout,
    /// It does not: it changes how samples are read or handed out, not
    /// which come when, and a state resumes with it changed.
    No,
}

impl SampleOrder {
    /// Whether the option decides which samples come in which order.
    pub fn affects_order(self) -> bool {
        !matches!(self, SampleOrder::No)
    }

    /// A short name of the marker: `"holds"`, `"decides"`, `"shards"`,
    /// `"layout"` or `"no"`.
    pub fn name(self) -> &'static str {
        match self {
            SampleOrder::Holds(_) => "holds",
            SampleOrder::Decides(_) => "decides",
            SampleOrder::ThroughShards => "shards",
            SampleOrder::ThroughLayout => "layout",
            SampleOrder::No => "no",
        }
    }
}

/// One dataset option, defined once: the Python bindings take it by this
/// name, `default_options()` and `option_table()` list it, and a test holds
/// `shardstream.options.DatasetOptions`, `StreamingDataset`'s docstring and
/// README's options table to its name, type, default and text.
pub struct OptionDef {
    /// The keyword name.
    pub name: &'static str,
    /// Its Python type, as `shardstream.options.DatasetOptions` annotates it.
    pub python_type: &'static str,
    /// Its default, read from the value the core starts from.
    pub default: fn() -> DefaultValue,
    /// What it does, as README's options table says it (Markdown, one line).
    pub doc: &'static str,
    /// Whether it decides which samples come in which order.
    pub order: SampleOrder,
}

/// Appends `v` as the fingerprint takes a number: 8 bytes, little-endian.
fn push_u64(bytes: &mut Vec<u8>, v: u64) {
    bytes.extend_from_slice(&v.to_le_bytes());
}

/// Appends a str: its length, then its bytes.
fn push_str(bytes: &mut Vec<u8>, s: &str) {
    push_u64(bytes, s.len() as u64);
    bytes.extend_from_slice(s.as_bytes());
}

/// The options the core starts from, whose values are the defaults.
fn core() -> StreamOptions {
    StreamOptions::default()
}

/// Every dataset option, in documentation order. The resume fingerprint
/// takes the [`SampleOrder::Holds`] options in this order, then the
/// [`SampleOrder::Decides`] ones in this order: reordering them, or
/// changing their bytes, invalidates every saved state.
pub static DATASET_OPTIONS: [OptionDef; 29] = [
    OptionDef {
        name: "seed",
        python_type: "int",
        default: || DefaultValue::Int(core().seed),
        doc: "seed of the shard order and the shuffle buffer",
        order: SampleOrder::Decides(|o, b| push_u64(b, o.seed)),
    },
    OptionDef {
        name: "shuffle_shards",
        python_type: "bool",
        default: || DefaultValue::Bool(core().shuffle_shards),
        doc: "a new shard order every epoch",
        order: SampleOrder::Decides(|o, b| push_u64(b, u64::from(o.shuffle_shards))),
    },
    OptionDef {
        name: "shuffle_buffer",
        python_type: "int",
        default: || DefaultValue::Int(core().shuffle_buffer as u64),
        doc: "shuffle buffer size in samples; `0` disables it",
        order: SampleOrder::Decides(|o, b| push_u64(b, o.shuffle_buffer as u64)),
    },
    OptionDef {
        name: "shuffle_buffer_bytes",
        python_type: "int",
        default: || DefaultValue::Int(core().shuffle_buffer_bytes as u64),
        doc: "byte budget of the shuffle buffer",
        order: SampleOrder::Decides(|o, b| push_u64(b, o.shuffle_buffer_bytes as u64)),
    },
    OptionDef {
        name: "shuffle_initial",
        python_type: "int",
        default: || DefaultValue::Int(core().shuffle_initial as u64),
        doc: "samples the buffer holds before the first one leaves; it then grows to \
              `shuffle_buffer` ([details](https://github.com/shardstream/shardstream/blob/main/docs/internals.md#shuffle-buffer))",
        order: SampleOrder::Decides(|o, b| push_u64(b, o.shuffle_initial as u64)),
    },
    OptionDef {
        name: "read_ahead_bytes",
        python_type: "int",
        default: || DefaultValue::Int(core().read_ahead_bytes as u64),
        doc: "bytes each worker reads ahead of its parser, across shard boundaries",
        order: SampleOrder::No,
    },
    OptionDef {
        name: "on_error",
        python_type: "Literal[\"raise\", \"warn\"]",
        default: || DefaultValue::Str(core().on_error.name()),
        doc: "`\"warn\"` skips the rest of a bad shard with a `ShardSkippedWarning` and counts it",
        order: SampleOrder::No,
    },
    OptionDef {
        name: "io_timeout",
        python_type: "float",
        default: || DefaultValue::Seconds(core().io_timeout.as_secs_f64()),
        doc: "seconds to wait for the next bytes of a shard before `ShardReadError`",
        order: SampleOrder::No,
    },
    OptionDef {
        name: "manifest",
        python_type: "str | os.PathLike[str] | bool | None",
        default: || DefaultValue::None,
        doc: "a manifest from `shardstream index` (a path, or an `s3://`, `gs://`, `http(s)://` \
              or `hf://` URL); `None` uses `manifest.json` beside the shards if there is one \
              (local or remote), `False` none",
        order: SampleOrder::ThroughShards,
    },
    OptionDef {
        name: "remainder",
        python_type: "Literal[\"drop\", \"pad\"]",
        default: || DefaultValue::Str(core().remainder.name()),
        doc: "`\"drop\"` leaves out the last `total % world_size` samples, `\"pad\"` wraps \
              around to fill the last rank",
        order: SampleOrder::Decides(|o, b| push_u64(b, o.remainder as u64)),
    },
    OptionDef {
        name: "s3",
        python_type: "S3Config | Mapping[str, Any] | None",
        default: || DefaultValue::None,
        doc: "an `S3Config` or a dict of its fields",
        order: SampleOrder::No,
    },
    OptionDef {
        name: "http_headers",
        python_type: "Mapping[str, str] | None",
        default: || DefaultValue::None,
        doc: "headers of every `http(s)://` request, sent to the shard's own host only and \
              never shown ([more](#https-the-hugging-face-hub-google-cloud-storage-and-a-local-cache))",
        order: SampleOrder::No,
    },
    OptionDef {
        name: "format",
        python_type: "Literal[\"auto\", \"tar\", \"parquet\", \"raw\"]",
        default: || DefaultValue::Str(DatasetFormat::default().name()),
        doc: "`\"auto\"` (Parquet for `*.parquet`, tar otherwise), `\"tar\"`, `\"parquet\"` or \
              `\"raw\"`",
        order: SampleOrder::ThroughShards,
    },
    OptionDef {
        name: "decode",
        python_type: "bool | Mapping[str, Literal[\"bytes\", \"str\", \"int\", \"json\", \
                      \"numpy\", \"audio\", \"rgb8\"] | Image | AudioClip] | None",
        default: || DefaultValue::None,
        doc: "`True` for the default decoder of each extension, or `{field: decoder}`",
        order: SampleOrder::Holds(|o, b| {
            for (field, decoder) in &o.decode.by_field {
                push_str(b, field);
                b.extend_from_slice(decoder.describe().as_bytes());
            }
            push_u64(b, u64::from(o.decode.defaults));
        }),
    },
    OptionDef {
        name: "decode_threads",
        python_type: "int | None",
        default: || DefaultValue::None,
        doc: "threads decoding and transforming each stream's fields; `None`: the cores, shared \
              among the DataLoader workers (and torchrun's processes on the node)",
        order: SampleOrder::No,
    },
    OptionDef {
        name: "columns",
        python_type: "Sequence[str] | None",
        default: || DefaultValue::None,
        doc: "Parquet columns to read (all by default)",
        order: SampleOrder::Holds(|o, b| {
            for column in o.columns.iter().flatten() {
                push_str(b, column);
            }
        }),
    },
    OptionDef {
        name: "batch_format",
        python_type: "Literal[\"dict\", \"arrow\"]",
        default: || DefaultValue::Str(core().table_output.name()),
        doc: "`\"arrow\"`: Parquet rows as `pyarrow.RecordBatch` objects",
        order: SampleOrder::No,
    },
    OptionDef {
        name: "batch_size",
        python_type: "int | None",
        default: || DefaultValue::None,
        doc: "hand out batches of this many samples, collated in Rust (or Arrow batches of at \
              most this many rows)",
        order: SampleOrder::No,
    },
    OptionDef {
        name: "pack_bytes",
        python_type: "bool",
        default: || DefaultValue::Bool(false),
        doc: "with `batch_size`, each bytes field of a batch as one uint8 array plus \
              `<field>_offsets` ([docs/formats.md](https://github.com/shardstream/shardstream/blob/main/docs/formats.md))",
        order: SampleOrder::No,
    },
    OptionDef {
        name: "local_bytes_by_reference",
        python_type: "bool",
        default: || DefaultValue::Bool(true),
        doc: "in DataLoader workers, long members of local tar shards reach the main process \
              as a reference to their place in the file \
              ([details](https://github.com/shardstream/shardstream/blob/main/docs/internals.md#hand-over-by-reference)); \
              `False` hands them over as other members are",
        order: SampleOrder::No,
    },
    OptionDef {
        name: "worker_shared_memory_bytes",
        python_type: "int",
        default: || DefaultValue::Int(64 << 20),
        doc: "in DataLoader workers, long members of other shards (S3, HTTP, compressed, \
              cached) reach the main process through shared memory (`/dev/shm`), at most this \
              much per worker, the rest through the pipe \
              ([details](https://github.com/shardstream/shardstream/blob/main/docs/internals.md#hand-over-through-shared-memory)); \
              `0` pickles them through the pipe",
        order: SampleOrder::No,
    },
    OptionDef {
        name: "raise_malloc_thresholds",
        python_type: "bool",
        default: || DefaultValue::Bool(true),
        doc: "DataLoader workers (and the main process, on its first read of a reference) raise \
              glibc's malloc thresholds so each batch reuses the heap \
              ([details](https://github.com/shardstream/shardstream/blob/main/docs/internals.md#malloc-thresholds))",
        order: SampleOrder::No,
    },
    OptionDef {
        name: "count_samples",
        python_type: "bool | None",
        default: || DefaultValue::None,
        doc: "count local plain tar shards without a manifest from their headers at creation: \
              `None` when `world_size > 1`, `True` always (then `len()` works on one rank too; \
              remote shards without a manifest are read through once at start-up, spread over \
              the ranks: [cost](https://github.com/shardstream/shardstream/blob/main/docs/sources.md#equal-lengths-across-ranks-ddp)), \
              `False` never (shards dealt whole, balanced by bytes; one rank only)",
        order: SampleOrder::ThroughShards,
    },
    OptionDef {
        name: "transform",
        python_type: "Callable[[Any], Any] | None",
        default: || DefaultValue::None,
        doc: "a function applied to each sample (or Rust batch) in the process that iterates \
              ([Transforms](#transforms))",
        order: SampleOrder::No,
    },
    OptionDef {
        name: "sample_seed",
        python_type: "bool",
        default: || DefaultValue::Bool(core().sample_seed),
        doc: "each sample gets an `int` `__seed__` from `(seed, epoch, shard, index in shard)`, \
              for transforms' randomness ([Resume](#resume))",
        order: SampleOrder::No,
    },
    OptionDef {
        name: "sample_ids",
        python_type: "bool",
        default: || DefaultValue::Bool(core().sample_ids),
        doc: "each sample gets a `__id__` `(epoch, shard index, index in shard)`, which \
              `shardstream.Ledger` records \
              ([docs/ledger.md](https://github.com/shardstream/shardstream/blob/main/docs/ledger.md))",
        order: SampleOrder::No,
    },
    OptionDef {
        name: "model_parallel_size",
        python_type: "int",
        default: || DefaultValue::Int(1),
        doc: "ranks per model-parallel group, which read as one data-parallel rank \
              ([mixing](https://github.com/shardstream/shardstream/blob/main/docs/mixing.md#model-parallel-groups))",
        order: SampleOrder::ThroughLayout,
    },
    OptionDef {
        name: "cache_dir",
        python_type: "str | os.PathLike[str] | None",
        default: || DefaultValue::None,
        doc: "a directory where remote shards are kept as they stream, for later epochs and \
              every process of the node \
              ([more](#https-the-hugging-face-hub-google-cloud-storage-and-a-local-cache))",
        order: SampleOrder::No,
    },
    OptionDef {
        name: "cache_limit_bytes",
        python_type: "int | None",
        default: || DefaultValue::None,
        doc: "the most bytes `cache_dir` keeps, least recently used shards evicted first; \
              `None`: no limit",
        order: SampleOrder::No,
    },
];

/// The options [`StoreOptions`] starts from, whose values are the defaults.
fn core_s3() -> StoreOptions {
    StoreOptions::default()
}

/// Every field of the `s3=` option (`shardstream.S3Config`), in
/// documentation order, defined once as [`DATASET_OPTIONS`] are: a test
/// holds `S3Config` and the table of `docs/sources.md` to it. None decides
/// the sample order.
pub static S3_OPTIONS: [OptionDef; 12] = [
    OptionDef {
        name: "region",
        python_type: "str | None",
        default: || DefaultValue::None,
        doc: "from the environment or profile, else `us-east-1`",
        order: SampleOrder::No,
    },
    OptionDef {
        name: "endpoint_url",
        python_type: "str | None",
        default: || DefaultValue::None,
        doc: "an S3-compatible endpoint (`AWS_ENDPOINT_URL` otherwise)",
        order: SampleOrder::No,
    },
    OptionDef {
        name: "path_style",
        python_type: "bool",
        default: || DefaultValue::Bool(core_s3().path_style),
        doc: "`endpoint/bucket/key` addressing",
        order: SampleOrder::No,
    },
    OptionDef {
        name: "profile",
        python_type: "str | None",
        default: || DefaultValue::None,
        doc: "a named profile of the shared config files",
        order: SampleOrder::No,
    },
    OptionDef {
        name: "unsigned",
        python_type: "bool",
        default: || DefaultValue::Bool(core_s3().unsigned),
        doc: "unsigned requests for public buckets",
        order: SampleOrder::No,
    },
    OptionDef {
        name: "connect_timeout",
        python_type: "float",
        default: || DefaultValue::Seconds(core_s3().transport.connect_timeout.as_secs_f64()),
        doc: "seconds to connect",
        order: SampleOrder::No,
    },
    OptionDef {
        name: "first_byte_timeout",
        python_type: "float",
        default: || DefaultValue::Seconds(core_s3().transport.first_byte_timeout.as_secs_f64()),
        doc: "seconds to wait for a response's headers",
        order: SampleOrder::No,
    },
    OptionDef {
        name: "idle_timeout",
        python_type: "float",
        default: || DefaultValue::Seconds(core_s3().transport.idle_timeout.as_secs_f64()),
        doc: "seconds to wait for the next body bytes before resuming the body",
        order: SampleOrder::No,
    },
    OptionDef {
        name: "max_attempts",
        python_type: "int",
        default: || DefaultValue::Int(u64::from(core_s3().transport.max_attempts)),
        doc: "attempts per request, the first included",
        order: SampleOrder::No,
    },
    OptionDef {
        name: "max_retry_time",
        python_type: "float",
        default: || DefaultValue::Seconds(core_s3().transport.max_retry_time.as_secs_f64()),
        doc: "seconds spent retrying one request at most",
        order: SampleOrder::No,
    },
    OptionDef {
        name: "part_size",
        python_type: "int",
        default: || DefaultValue::Int(core_s3().transport.part_size as u64),
        doc: "a starting point and upper bound, not a fixed size: the largest part (the \
              budget's unit); an object's parts start at 256 KiB and double up to a size set \
              from the measured latency, bandwidth and read rate, between this size or less so \
              that 32 parts fit in `read_ahead_bytes`, and this size or less so that min(8, \
              `max_concurrency`) parts fit. Of an object with 8 MiB or more after its first \
              part, the parts may all come from one streaming GET instead, where the server \
              answers that faster than parallel GETs ([how](internals.md#s3))",
        order: SampleOrder::No,
    },
    OptionDef {
        name: "max_concurrency",
        python_type: "int",
        default: || DefaultValue::Int(core_s3().transport.max_concurrency as u64),
        doc: "an upper bound: ranged GETs in flight at once per worker, across objects; fewer \
              when the measured rate says parallel parts do not pay (a server that answers one \
              GET at a time); `1` reads one object at a time with one streaming GET",
        order: SampleOrder::No,
    },
];

impl StreamOptions {
    /// The options that decide which samples come in which order, as bytes
    /// for the resume fingerprint: those marked [`SampleOrder::Holds`] in
    /// [`DATASET_OPTIONS`], then those marked [`SampleOrder::Decides`],
    /// each in table order.
    pub fn order_bytes(&self) -> Vec<u8> {
        let mut bytes = Vec::new();
        for holds in [true, false] {
            for def in &DATASET_OPTIONS {
                match def.order {
                    SampleOrder::Holds(push) if holds => push(self, &mut bytes),
                    SampleOrder::Decides(push) if !holds => push(self, &mut bytes),
                    _ => {}
                }
            }
        }
        bytes
    }
}

/// A node-local cache of remote shards: where, and how large it may grow.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheOptions {
    /// The cache directory, shared by every process of the node.
    pub dir: std::path::PathBuf,
    /// Bytes of cached shards kept at most; `None`: no limit.
    pub limit_bytes: Option<u64>,
    /// The dataset these options were made for: each process checks the
    /// identity of a cached object once per dataset (a dataset made later
    /// in the same process checks it again, so that an object replaced
    /// since is never served from an older copy).
    pub identity_scope: u64,
}

impl CacheOptions {
    /// A cache in `dir` of at most `limit_bytes`, for a new dataset (with
    /// an identity scope of its own).
    pub fn new(dir: std::path::PathBuf, limit_bytes: Option<u64>) -> Self {
        static SCOPES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        CacheOptions {
            dir,
            limit_bytes,
            identity_scope: SCOPES.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        }
    }
}

impl Default for StreamOptions {
    fn default() -> Self {
        StreamOptions {
            seed: 0,
            shuffle_shards: true,
            shuffle_buffer: 1000,
            shuffle_buffer_bytes: 256 << 20,
            shuffle_initial: 100,
            read_ahead_bytes: 32 << 20,
            chunk_bytes: 1 << 20,
            output_queue: 256,
            io_timeout: Duration::from_secs(120),
            on_error: OnError::Raise,
            remainder: Remainder::Drop,
            store: StoreOptions::default(),
            decode: FieldDecoders::default(),
            decode_threads: None,
            columns: None,
            table_output: TableOutput::Rows,
            batch_rows: 8192,
            cache: None,
            sample_seed: false,
            sample_ids: false,
        }
    }
}

impl StreamOptions {
    /// Starts a builder with the defaults.
    pub fn builder() -> StreamOptionsBuilder {
        StreamOptionsBuilder {
            options: StreamOptions::default(),
        }
    }
}

/// Builder for [`StreamOptions`]; [`StreamOptionsBuilder::build`] validates.
#[derive(Debug, Clone)]
pub struct StreamOptionsBuilder {
    options: StreamOptions,
}

impl StreamOptionsBuilder {
    /// Sets the seed.
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.options.seed = seed;
        self
    }

    /// Turns per-epoch shard shuffling on or off.
    pub fn with_shuffle_shards(mut self, on: bool) -> Self {
        self.options.shuffle_shards = on;
        self
    }

    /// Sets the shuffle buffer size in samples (0 disables it).
    pub fn with_shuffle_buffer(mut self, samples: usize) -> Self {
        self.options.shuffle_buffer = samples;
        self
    }

    /// Sets the shuffle buffer's byte budget.
    pub fn with_shuffle_buffer_bytes(mut self, bytes: usize) -> Self {
        self.options.shuffle_buffer_bytes = bytes;
        self
    }

    /// Sets how many samples the shuffle buffer holds before its first
    /// sample leaves (it then grows to `shuffle_buffer`).
    pub fn with_shuffle_initial(mut self, samples: usize) -> Self {
        self.options.shuffle_initial = samples;
        self
    }

    /// Sets the read-ahead byte budget.
    pub fn with_read_ahead_bytes(mut self, bytes: usize) -> Self {
        self.options.read_ahead_bytes = bytes;
        self
    }

    /// Sets the size of one read.
    pub fn with_chunk_bytes(mut self, bytes: usize) -> Self {
        self.options.chunk_bytes = bytes;
        self
    }

    /// Sets how many samples wait for the consumer.
    pub fn with_output_queue(mut self, samples: usize) -> Self {
        self.options.output_queue = samples;
        self
    }

    /// Sets the longest wait for the next bytes of a shard.
    pub fn with_io_timeout(mut self, timeout: Duration) -> Self {
        self.options.io_timeout = timeout;
        self
    }

    /// Sets the error policy.
    pub fn with_on_error(mut self, policy: OnError) -> Self {
        self.options.on_error = policy;
        self
    }

    /// Sets the remainder policy of equal-length epochs.
    pub fn with_remainder(mut self, remainder: Remainder) -> Self {
        self.options.remainder = remainder;
        self
    }

    /// Sets how to reach S3 (keeping the HTTP headers set, unless `s3` has some).
    pub fn with_store(mut self, mut s3: StoreOptions) -> Self {
        if s3.transport.http_headers.0.is_empty() {
            s3.transport.http_headers =
                std::mem::take(&mut self.options.store.transport.http_headers);
        }
        self.options.store = s3;
        self
    }

    /// Sets the headers of HTTP(S) requests.
    pub fn with_http_headers(mut self, headers: HttpHeaders) -> Self {
        self.options.store.transport.http_headers = headers;
        self
    }

    /// Sets the cache of remote shards.
    pub fn with_cache(mut self, cache: Option<CacheOptions>) -> Self {
        self.options.cache = cache;
        self
    }

    /// Sets the field decoders.
    pub fn with_decode(mut self, decode: FieldDecoders) -> Self {
        self.options.decode = decode;
        self
    }

    /// Sets the threads that decode a stream's fields (`None`: as many as
    /// the cores allow, shared among the processes that decode).
    pub fn with_decode_threads(mut self, threads: Option<usize>) -> Self {
        self.options.decode_threads = threads;
        self
    }

    /// Sets the table columns to read.
    pub fn with_columns(mut self, columns: Option<Vec<String>>) -> Self {
        self.options.columns = columns;
        self
    }

    /// Sets how table rows are handed out.
    pub fn with_table_output(mut self, output: TableOutput) -> Self {
        self.options.table_output = output;
        self
    }

    /// Sets the rows per decoded table batch.
    pub fn with_batch_rows(mut self, rows: usize) -> Self {
        self.options.batch_rows = rows;
        self
    }

    /// Turns the per-sample `__seed__` field on or off.
    pub fn with_sample_seed(mut self, on: bool) -> Self {
        self.options.sample_seed = on;
        self
    }

    /// Turns the per-sample `__id__` field on or off.
    pub fn with_sample_ids(mut self, on: bool) -> Self {
        self.options.sample_ids = on;
        self
    }

    /// Validates and returns the options.
    pub fn build(self) -> Result<StreamOptions> {
        let o = self.options;
        let positive = |name: &'static str, value: usize| {
            if value == 0 {
                Err(Error::Config {
                    name,
                    reason: "must be at least 1".into(),
                })
            } else {
                Ok(())
            }
        };
        positive("shuffle_buffer_bytes", o.shuffle_buffer_bytes)?;
        positive("shuffle_initial", o.shuffle_initial)?;
        positive("read_ahead_bytes", o.read_ahead_bytes)?;
        positive("chunk_bytes", o.chunk_bytes)?;
        positive("output_queue", o.output_queue)?;
        positive("batch_rows", o.batch_rows)?;
        if let Some(threads) = o.decode_threads {
            positive("decode_threads", threads)?;
        }
        if o.table_output == TableOutput::Arrow && o.shuffle_buffer > 0 {
            return Err(Error::Config {
                name: "shuffle_buffer",
                reason: "Arrow batches keep their rows in file order: set shuffle_buffer=0 \
                         (row groups are still shuffled with shuffle_shards)"
                    .into(),
            });
        }
        if o.table_output == TableOutput::Arrow && !o.decode.is_empty() {
            return Err(Error::Config {
                name: "decode",
                reason: "field decoders apply to per-row output, not to Arrow batches".into(),
            });
        }
        if o.table_output == TableOutput::Arrow && o.sample_seed {
            return Err(Error::Config {
                name: "sample_seed",
                reason: "it adds a field to each sample, and Arrow batches hand out rows \
                         without per-sample fields: use batch_format=\"dict\""
                    .into(),
            });
        }
        if o.table_output == TableOutput::Arrow && o.sample_ids {
            return Err(Error::Config {
                name: "sample_ids",
                reason: "it adds a field to each sample, and Arrow batches hand out rows \
                         without per-sample fields: use batch_format=\"dict\""
                    .into(),
            });
        }
        o.store.validate()?;
        for (name, value) in [
            ("read_ahead_bytes", o.read_ahead_bytes),
            ("shuffle_buffer_bytes", o.shuffle_buffer_bytes),
        ] {
            if value as u64 > MAX_BUDGET_BYTES {
                return Err(Error::Config {
                    name,
                    reason: format!("must be at most {MAX_BUDGET_BYTES} (1 TiB), got {value}"),
                });
            }
        }
        for (name, value) in [
            ("shuffle_buffer", o.shuffle_buffer),
            ("shuffle_initial", o.shuffle_initial),
            ("output_queue", o.output_queue),
            ("batch_rows", o.batch_rows),
        ] {
            if value as u64 > MAX_ITEMS {
                return Err(Error::Config {
                    name,
                    reason: format!("must be at most {MAX_ITEMS}, got {value}"),
                });
            }
        }
        if o.chunk_bytes > u32::MAX as usize {
            return Err(Error::Config {
                name: "chunk_bytes",
                reason: format!("must be at most {}", u32::MAX),
            });
        }
        if o.io_timeout.is_zero() {
            return Err(Error::Config {
                name: "io_timeout",
                reason: "must be positive".into(),
            });
        }
        Ok(o)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The option named by the error of building with `s3`.
    fn refused(s3: StoreOptions) -> &'static str {
        match StreamOptions::builder().with_store(s3.clone()).build() {
            Err(Error::Config { name, reason }) => {
                // The same from the store options alone (listing, HEAD).
                assert!(matches!(s3.validate(), Err(Error::Config { name: n, .. }) if n == name));
                assert!(!reason.is_empty());
                name
            }
            Err(other) => panic!("not a config error: {other}"),
            Ok(_) => panic!("accepted: {s3:?}"),
        }
    }

    #[test]
    fn s3_options_out_of_the_range_the_code_can_use_are_refused_by_name() {
        let s3 = Transport::default;
        assert!(s3().validate().is_ok());
        let huge = Duration::from_secs(u64::MAX);
        let cases = [
            (
                Transport {
                    part_size: 0,
                    ..s3()
                },
                "part_size",
            ),
            (
                Transport {
                    part_size: 1 << 32,
                    ..s3()
                },
                "part_size",
            ),
            (
                Transport {
                    part_size: usize::MAX,
                    ..s3()
                },
                "part_size",
            ),
            (
                Transport {
                    max_concurrency: 0,
                    ..s3()
                },
                "max_concurrency",
            ),
            (
                Transport {
                    max_concurrency: usize::MAX,
                    ..s3()
                },
                "max_concurrency",
            ),
            (
                Transport {
                    max_attempts: 0,
                    ..s3()
                },
                "max_attempts",
            ),
            (
                Transport {
                    max_attempts: u32::MAX,
                    ..s3()
                },
                "max_attempts",
            ),
            (
                Transport {
                    connect_timeout: Duration::ZERO,
                    ..s3()
                },
                "connect_timeout",
            ),
            (
                Transport {
                    connect_timeout: huge,
                    ..s3()
                },
                "connect_timeout",
            ),
            (
                Transport {
                    first_byte_timeout: huge,
                    ..s3()
                },
                "first_byte_timeout",
            ),
            (
                Transport {
                    idle_timeout: Duration::ZERO,
                    ..s3()
                },
                "idle_timeout",
            ),
            (
                Transport {
                    max_retry_time: huge,
                    ..s3()
                },
                "max_retry_time",
            ),
            (
                Transport {
                    backoff_base: Duration::MAX,
                    ..s3()
                },
                "backoff_base",
            ),
            (
                Transport {
                    backoff_max: Duration::MAX,
                    ..s3()
                },
                "backoff_max",
            ),
        ];
        for (transport, name) in cases {
            let options = StoreOptions {
                transport,
                ..StoreOptions::default()
            };
            assert_eq!(refused(options), name);
        }
        let largest = Transport {
            part_size: Transport::MAX_PART_SIZE,
            max_concurrency: Transport::MAX_CONCURRENCY,
            max_attempts: Transport::MAX_ATTEMPTS,
            idle_timeout: Transport::MAX_DURATION,
            max_retry_time: Duration::ZERO,
            ..s3()
        };
        assert!(largest.validate().is_ok());
    }

    /// The dataset option named `name`.
    fn option_def(name: &str) -> Option<&'static OptionDef> {
        DATASET_OPTIONS.iter().find(|o| o.name == name)
    }

    #[test]
    fn option_names_are_unique_and_every_default_is_one_python_takes() {
        for table in [&DATASET_OPTIONS[..], &S3_OPTIONS[..]] {
            let mut names: Vec<&str> = table.iter().map(|o| o.name).collect();
            names.sort_unstable();
            names.dedup();
            assert_eq!(names.len(), table.len());
        }
        // The `s3=` fields listed with a default of `None` start unset.
        let s3 = StoreOptions::default();
        assert!(s3.region.is_none() && s3.endpoint_url.is_none() && s3.profile.is_none());
        assert!(S3_OPTIONS.iter().all(|o| !o.order.affects_order()));
        for def in DATASET_OPTIONS.iter().chain(&S3_OPTIONS) {
            assert!(
                !def.doc.is_empty() && !def.doc.contains('|'),
                "{}",
                def.name
            );
            if let DefaultValue::Str(choice) = (def.default)() {
                assert!(
                    def.python_type.contains(&format!("\"{choice}\"")),
                    "{}: {choice} is not one of {}",
                    def.name,
                    def.python_type
                );
            }
        }
        assert!(option_def("seed").is_some() && option_def("speed").is_none());
    }

    /// Every field of [`StreamOptions`] with the dataset options that set
    /// it and a value other than its default. The pattern names every field
    /// (no `..`): a field added to the struct does not compile here until it
    /// is listed, with its options.
    fn fields() -> [(&'static str, &'static [&'static str], StreamOptions); 20] {
        let StreamOptions {
            seed: _,
            shuffle_shards: _,
            shuffle_buffer: _,
            shuffle_buffer_bytes: _,
            shuffle_initial: _,
            read_ahead_bytes: _,
            chunk_bytes: _,
            output_queue: _,
            io_timeout: _,
            on_error: _,
            remainder: _,
            store: _,
            decode: _,
            decode_threads: _,
            columns: _,
            table_output: _,
            batch_rows: _,
            cache: _,
            sample_seed: _,
            sample_ids: _,
        } = StreamOptions::default();
        let d = StreamOptions::default;
        [
            ("seed", &["seed"], StreamOptions { seed: 1, ..d() }),
            (
                "shuffle_shards",
                &["shuffle_shards"],
                StreamOptions {
                    shuffle_shards: false,
                    ..d()
                },
            ),
            (
                "shuffle_buffer",
                &["shuffle_buffer"],
                StreamOptions {
                    shuffle_buffer: 7,
                    ..d()
                },
            ),
            (
                "shuffle_buffer_bytes",
                &["shuffle_buffer_bytes"],
                StreamOptions {
                    shuffle_buffer_bytes: 7,
                    ..d()
                },
            ),
            (
                "shuffle_initial",
                &["shuffle_initial"],
                StreamOptions {
                    shuffle_initial: 7,
                    ..d()
                },
            ),
            (
                "read_ahead_bytes",
                &["read_ahead_bytes"],
                StreamOptions {
                    read_ahead_bytes: 7,
                    ..d()
                },
            ),
            (
                "chunk_bytes",
                &[],
                StreamOptions {
                    chunk_bytes: 7,
                    ..d()
                },
            ),
            (
                "output_queue",
                &[],
                StreamOptions {
                    output_queue: 7,
                    ..d()
                },
            ),
            (
                "io_timeout",
                &["io_timeout"],
                StreamOptions {
                    io_timeout: Duration::from_secs(7),
                    ..d()
                },
            ),
            (
                "on_error",
                &["on_error"],
                StreamOptions {
                    on_error: OnError::Warn,
                    ..d()
                },
            ),
            (
                "remainder",
                &["remainder"],
                StreamOptions {
                    remainder: Remainder::Pad,
                    ..d()
                },
            ),
            (
                "s3",
                &["s3", "http_headers"],
                StreamOptions {
                    store: StoreOptions {
                        region: Some("eu-west-1".into()),
                        transport: Transport {
                            http_headers: HttpHeaders(vec![("a".into(), "b".into())]),
                            ..Transport::default()
                        },
                        ..StoreOptions::default()
                    },
                    ..d()
                },
            ),
            (
                "decode",
                &["decode"],
                StreamOptions {
                    decode: FieldDecoders::defaults(),
                    ..d()
                },
            ),
            (
                "decode_threads",
                &["decode_threads"],
                StreamOptions {
                    decode_threads: Some(2),
                    ..d()
                },
            ),
            (
                "columns",
                &["columns"],
                StreamOptions {
                    columns: Some(vec!["a".into()]),
                    ..d()
                },
            ),
            (
                "table_output",
                &["batch_format"],
                StreamOptions {
                    table_output: TableOutput::Arrow,
                    ..d()
                },
            ),
            (
                "batch_rows",
                &["batch_size"],
                StreamOptions {
                    batch_rows: 7,
                    ..d()
                },
            ),
            (
                "cache",
                &["cache_dir", "cache_limit_bytes"],
                StreamOptions {
                    cache: Some(CacheOptions::new("/tmp/cache".into(), Some(7))),
                    ..d()
                },
            ),
            (
                "sample_seed",
                &["sample_seed"],
                StreamOptions {
                    sample_seed: true,
                    ..d()
                },
            ),
            (
                "sample_ids",
                &["sample_ids"],
                StreamOptions {
                    sample_ids: true,
                    ..d()
                },
            ),
        ]
    }

    #[test]
    fn the_fingerprint_takes_exactly_the_fields_of_options_marked_as_deciding_the_order() {
        let base = StreamOptions::default().order_bytes();
        let mut fingerprinted = Vec::new();
        for (field, options, changed) in fields() {
            let defs: Vec<&OptionDef> = options
                .iter()
                .map(|name| option_def(name).unwrap_or_else(|| panic!("no option {name}")))
                .collect();
            let marked = defs
                .iter()
                .any(|d| matches!(d.order, SampleOrder::Holds(_) | SampleOrder::Decides(_)));
            assert_eq!(
                changed.order_bytes() != base,
                marked,
                "field {field}: options {options:?} are marked {:?}",
                defs.iter().map(|d| d.order.name()).collect::<Vec<_>>()
            );
            if marked {
                fingerprinted.extend_from_slice(options);
            }
        }
        // No option is fingerprinted but through a field it sets.
        for def in &DATASET_OPTIONS {
            if matches!(def.order, SampleOrder::Holds(_) | SampleOrder::Decides(_)) {
                assert!(fingerprinted.contains(&def.name), "{}", def.name);
            }
        }
    }
}
