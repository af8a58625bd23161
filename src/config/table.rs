//! The one definition of every option: [`DATASET_OPTIONS`] and
//! [`S3_OPTIONS`] (name, Python type, default, text, and whether it decides
//! the sample order, from which the resume fingerprint is computed).

use crate::spec::DatasetFormat;

use super::store::StoreOptions;
use super::stream::StreamOptions;

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
pub static DATASET_OPTIONS: [OptionDef; 31] = [
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
        python_type: "int | None",
        default: || DefaultValue::None,
        doc: "bytes each worker reads ahead of its parser, across shard boundaries; `None`: \
              64 MiB where one process reads (`num_workers` 0 or 1), else 32 MiB each",
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
              around to fill the last rank (refused with `pack`, whose ranks take equal \
              sequences)",
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
        python_type: "Literal[\"auto\", \"tar\", \"parquet\", \"raw\", \"jsonl\"]",
        default: || DefaultValue::Str(DatasetFormat::default().name()),
        doc: "`\"auto\"` (Parquet for `*.parquet`, JSON lines for `*.jsonl` named, tar \
              otherwise), `\"tar\"`, `\"parquet\"`, `\"raw\"` or `\"jsonl\"`",
        order: SampleOrder::ThroughShards,
    },
    OptionDef {
        name: "decode",
        python_type: "bool | Mapping[str, Literal[\"bytes\", \"str\", \"int\", \"json\", \
                      \"numpy\", \"audio\", \"rgb8\"] | Image | ImageBoxes | AudioClip \
                      | Tokenizer] | None",
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
        name: "pack",
        python_type: "Pack | None",
        default: || DefaultValue::None,
        doc: "a `shardstream.Pack`: each document's token ids laid into fixed-length sequences, \
              handed out instead of the documents \
              ([docs/text.md](https://github.com/shardstream/shardstream/blob/main/docs/text.md#packing-into-fixed-length-sequences))",
        order: SampleOrder::Decides(|o, b| {
            if let Some(pack) = &o.pack {
                push_str(b, &pack.to_string());
            }
        }),
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
        doc: "the process that iterates (a DataLoader worker, the main process at `num_workers=0`; \
              and the main process on its first read of a reference) raises glibc's malloc \
              thresholds so each batch reuses the heap \
              ([details](https://github.com/shardstream/shardstream/blob/main/docs/internals.md#malloc-thresholds))",
        order: SampleOrder::No,
    },
    OptionDef {
        name: "read_next_epoch_early",
        python_type: "bool",
        default: || DefaultValue::Bool(true),
        doc: "in DataLoader workers with `persistent_workers=True`, a worker's next epoch (in a \
              `Mix`, each stream that epoch's mixture takes samples of) starts reading when its epoch ends, its read-ahead and first samples (with `batch_size`, \
              its whole first batch, decoded) held until the next iteration; in the main process (`num_workers=0`, torchdata.nodes) from the end of its second iteration on ([details](https://github.com/shardstream/shardstream/blob/main/docs/internals.md#how-the-epoch-is-planned)); \
              `False` starts it at the next iteration",
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
        self.order_bytes_by_option()
            .into_iter()
            .flat_map(|(_, bytes)| bytes)
            .collect()
    }

    /// [`StreamOptions::order_bytes`] option by option: each option's name
    /// and bytes, in the same order.
    pub fn order_bytes_by_option(&self) -> Vec<(&'static str, Vec<u8>)> {
        let mut parts = Vec::new();
        for holds in [true, false] {
            for def in &DATASET_OPTIONS {
                let push = match def.order {
                    SampleOrder::Holds(push) if holds => push,
                    SampleOrder::Decides(push) if !holds => push,
                    _ => continue,
                };
                let mut bytes = Vec::new();
                push(self, &mut bytes);
                parts.push((def.name, bytes));
            }
        }
        parts
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::super::store::Transport;
    use super::super::stream::CacheOptions;
    use super::super::values::{FieldDecoders, HttpHeaders, OnError, TableOutput};
    use super::*;
    use crate::plan::Remainder;

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
    fn fields() -> [(&'static str, &'static [&'static str], StreamOptions); 23] {
        let StreamOptions {
            seed: _,
            shuffle_shards: _,
            shuffle_buffer: _,
            shuffle_buffer_bytes: _,
            shuffle_initial: _,
            read_ahead_bytes: _,
            chunk_bytes: _,
            output_queue: _,
            output_batch: _,
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
            pack: _,
            plan_sequences: _,
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
                    read_ahead_bytes: Some(7),
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
                "plan_sequences",
                &[],
                StreamOptions {
                    plan_sequences: true,
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
                "output_batch",
                &["batch_size"],
                StreamOptions {
                    output_batch: 7,
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
            (
                "pack",
                &["pack"],
                StreamOptions {
                    pack: Some(std::sync::Arc::new(
                        crate::text::pack::PackSpec::new(
                            None,
                            8,
                            crate::text::pack::PackMode::Concat,
                            false,
                            0,
                        )
                        .expect("valid"),
                    )),
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
