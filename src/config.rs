//! Stream options, with defaults and validation in one place.

use std::time::Duration;

use crate::decode::Decoder;
use crate::error::{Error, Result};
use crate::plan::Remainder;

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
        match s {
            "raise" => Ok(OnError::Raise),
            "warn" => Ok(OnError::Warn),
            other => Err(Error::Config {
                name: "on_error",
                reason: format!("expected \"raise\" or \"warn\", got {other:?}"),
            }),
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

/// How to reach S3 (or an S3-compatible store). Credentials come from the
/// default chain: environment, shared config and credentials files, SSO,
/// web identity, IMDS and ECS roles. The timeouts, retries, part size and
/// concurrency apply to HTTP(S) shards too, which add their headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct S3Options {
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

impl S3Options {
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

impl Default for S3Options {
    fn default() -> Self {
        S3Options {
            region: None,
            endpoint_url: None,
            path_style: false,
            profile: None,
            unsigned: false,
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
    /// `output_queue / 4` (1 to 16), so up to one more group may wait.
    pub output_queue: usize,
    /// Longest wait for the next bytes of a shard.
    pub io_timeout: Duration,
    /// Error policy.
    pub on_error: OnError,
    /// Remainder policy of equal-length epochs (with a manifest).
    pub remainder: Remainder,
    /// How to reach S3.
    pub s3: S3Options,
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
}

/// A node-local cache of remote shards: where, and how large it may grow.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheOptions {
    /// The cache directory, shared by every process of the node.
    pub dir: std::path::PathBuf,
    /// Bytes of cached shards kept at most; `None`: no limit.
    pub limit_bytes: Option<u64>,
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
            output_queue: 64,
            io_timeout: Duration::from_secs(120),
            on_error: OnError::Raise,
            remainder: Remainder::Drop,
            s3: S3Options::default(),
            decode: FieldDecoders::default(),
            decode_threads: None,
            columns: None,
            table_output: TableOutput::Rows,
            batch_rows: 8192,
            cache: None,
            sample_seed: false,
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
    pub fn with_s3(mut self, s3: S3Options) -> Self {
        let kept = std::mem::take(&mut self.options.s3.http_headers);
        let http_headers = if s3.http_headers.0.is_empty() {
            kept
        } else {
            s3.http_headers.clone()
        };
        self.options.s3 = S3Options { http_headers, ..s3 };
        self
    }

    /// Sets the headers of HTTP(S) requests.
    pub fn with_http_headers(mut self, headers: HttpHeaders) -> Self {
        self.options.s3.http_headers = headers;
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
        o.s3.validate()?;
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
    fn refused(s3: S3Options) -> &'static str {
        match StreamOptions::builder().with_s3(s3.clone()).build() {
            Err(Error::Config { name, reason }) => {
                // The same from the S3 options alone (listing, HEAD).
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
        let s3 = S3Options::default;
        assert!(s3().validate().is_ok());
        let huge = Duration::from_secs(u64::MAX);
        let cases = [
            (
                S3Options {
                    part_size: 0,
                    ..s3()
                },
                "part_size",
            ),
            (
                S3Options {
                    part_size: 1 << 32,
                    ..s3()
                },
                "part_size",
            ),
            (
                S3Options {
                    part_size: usize::MAX,
                    ..s3()
                },
                "part_size",
            ),
            (
                S3Options {
                    max_concurrency: 0,
                    ..s3()
                },
                "max_concurrency",
            ),
            (
                S3Options {
                    max_concurrency: usize::MAX,
                    ..s3()
                },
                "max_concurrency",
            ),
            (
                S3Options {
                    max_attempts: 0,
                    ..s3()
                },
                "max_attempts",
            ),
            (
                S3Options {
                    max_attempts: u32::MAX,
                    ..s3()
                },
                "max_attempts",
            ),
            (
                S3Options {
                    connect_timeout: Duration::ZERO,
                    ..s3()
                },
                "connect_timeout",
            ),
            (
                S3Options {
                    connect_timeout: huge,
                    ..s3()
                },
                "connect_timeout",
            ),
            (
                S3Options {
                    first_byte_timeout: huge,
                    ..s3()
                },
                "first_byte_timeout",
            ),
            (
                S3Options {
                    idle_timeout: Duration::ZERO,
                    ..s3()
                },
                "idle_timeout",
            ),
            (
                S3Options {
                    max_retry_time: huge,
                    ..s3()
                },
                "max_retry_time",
            ),
            (
                S3Options {
                    backoff_base: Duration::MAX,
                    ..s3()
                },
                "backoff_base",
            ),
            (
                S3Options {
                    backoff_max: Duration::MAX,
                    ..s3()
                },
                "backoff_max",
            ),
        ];
        for (options, name) in cases {
            assert_eq!(refused(options), name);
        }
        let largest = S3Options {
            part_size: S3Options::MAX_PART_SIZE,
            max_concurrency: S3Options::MAX_CONCURRENCY,
            max_attempts: S3Options::MAX_ATTEMPTS,
            idle_timeout: S3Options::MAX_DURATION,
            max_retry_time: Duration::ZERO,
            ..s3()
        };
        assert!(largest.validate().is_ok());
    }
}
