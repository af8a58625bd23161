//! The options of one stream ([`StreamOptions`]) and their defaults, and
//! the node-local cache's ([`CacheOptions`]).

use std::time::Duration;

use crate::plan::{PlanParams, Remainder};
use crate::shuffle::ShuffleBounds;

use super::store::StoreOptions;
use super::values::{FieldDecoders, OnError, TableOutput};

/// The largest byte budget an option may set (read-ahead, shuffle buffer):
/// far above any machine's memory, far below what would overflow the
/// budget's counters.
pub const MAX_BUDGET_BYTES: u64 = 1 << 40;

/// The read-ahead budget of a stream when `read_ahead_bytes` is not given,
/// in a process that shares the reading with other DataLoader workers.
pub const READ_AHEAD_BYTES: usize = 32 << 20;

/// The read-ahead budget of a stream when `read_ahead_bytes` is not given,
/// in a process that reads alone (the main process, or a single worker):
/// behind a first-byte latency the bytes in flight bound a read's rate
/// (32 MiB of 1 MiB parts behind 20 ms and 100 MB/s per connection, about
/// 1.1 GB/s), and no other worker's read-ahead is beside it.
pub const READ_AHEAD_BYTES_ALONE: usize = 64 << 20;

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
    /// Bytes read ahead of the parser, across shard boundaries; `None`:
    /// set by the processes that read ([`StreamOptions::read_ahead_budget`]).
    pub read_ahead_bytes: Option<usize>,
    /// Size of one read from storage (a local file is mapped in larger
    /// chunks: `MAP_CHUNK_BYTES` of the local store).
    pub chunk_bytes: usize,
    /// Samples queued for the consumer. They are sent in groups of
    /// `output_queue / 4` (1 to 64), a group going out early once its
    /// samples hold 1 MiB, so up to one more group may wait.
    pub output_queue: usize,
    /// Samples the consumer takes at a time (the dataset's `batch_size`
    /// for dict batches; 0 for samples one by one). Until that many wait,
    /// the queue to the consumer takes more groups whatever their bytes,
    /// so that a whole batch can be ready before it is asked for (a next
    /// epoch's first batch, read early).
    pub output_batch: usize,
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
    /// Pack each document's token ids into fixed-length sequences (the
    /// `pack` option), handed out instead of the documents.
    pub pack: Option<std::sync::Arc<crate::text::pack::PackSpec>>,
    /// With `pack`, hand out the sequences planned from the manifest's
    /// token counts on one rank too (a mixture's streams: the mixture's
    /// order is planned from every stream's count before any byte is
    /// read). Across ranks a packed stream always does. Set by no option.
    pub plan_sequences: bool,
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

impl StreamOptions {
    /// The read-ahead budget of a stream in one of `num_workers` DataLoader
    /// workers (0: the main process): `read_ahead_bytes`, or where it is
    /// not given [`READ_AHEAD_BYTES_ALONE`] with `num_workers` 0 or 1, else
    /// [`READ_AHEAD_BYTES`].
    pub fn read_ahead_budget(&self, num_workers: usize) -> usize {
        self.read_ahead_bytes.unwrap_or(if num_workers <= 1 {
            READ_AHEAD_BYTES_ALONE
        } else {
            READ_AHEAD_BYTES
        })
    }

    /// Whether a packed stream of a job of `world_size` ranks hands out the
    /// sequences planned from the token counts (and no more): across ranks,
    /// or when [`StreamOptions::plan_sequences`] asks for it.
    pub fn plans_sequences(&self, world_size: usize) -> bool {
        self.pack.is_some() && (world_size > 1 || self.plan_sequences)
    }

    /// The tokenizer that makes the packed field's ids, as a manifest's
    /// token counts name it (`Tokenizer(digest=..., ...)`); `None` when the
    /// field holds ids already, or nothing is packed.
    pub fn pack_tokenizer_name(&self) -> Option<String> {
        let field = self.pack.as_ref()?.field_name();
        match self.decode.decoder_for(field) {
            Some(crate::decode::Decoder::Tokenizer(tokenizer)) => Some(tokenizer.to_string()),
            _ => None,
        }
    }

    /// The shuffle buffer's bounds; `None` without a buffer
    /// (`shuffle_buffer` 0).
    pub fn shuffle_bounds(&self) -> Option<ShuffleBounds> {
        (self.shuffle_buffer > 0).then_some(ShuffleBounds {
            max_items: self.shuffle_buffer,
            max_bytes: self.shuffle_buffer_bytes,
            initial: self.shuffle_initial,
        })
    }

    /// The plan of `epoch` for `world_size` ranks of `num_workers` slots
    /// each, in the shard order and with the remainder these options give.
    pub fn plan_params(&self, epoch: u64, world_size: usize, num_workers: usize) -> PlanParams {
        PlanParams {
            seed: self.seed,
            epoch,
            shuffle_shards: self.shuffle_shards,
            world_size,
            num_workers,
            remainder: self.remainder,
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
            read_ahead_bytes: None,
            chunk_bytes: 1 << 20,
            output_queue: 256,
            output_batch: 0,
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
            pack: None,
            plan_sequences: false,
        }
    }
}
