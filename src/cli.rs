//! The `shardstream` command line: `inspect` a shard, `index` a dataset
//! into a manifest, print a `plan`, `write` shards from files or Parquet,
//! `verify` a sample ledger and `explain` which samples a step sees.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::Value;

use crate::byte_size::ByteSize;
use crate::compression::Compression;
use crate::config::{StoreOptions, StreamOptions};
use crate::dataset::{self, resolve, DatasetOptions, Resolved, Resolving};
use crate::error::{Error, Result};
use crate::index;
use crate::ledger;
use crate::ledger::explain::{BufferCheck, BufferReplay, SavedPosition, Start};
use crate::ledger::verify_pack::{Arrival, Decoded, Packing, PlanOptions};
use crate::manifest::{self, ManifestChoice};
use crate::pipeline::SampleStream;
use crate::plan::{self, PlanParams, Remainder, ShardInfo, SlotSpec};
use crate::shard::{Shard, ShardKind};
use crate::spec::DatasetFormat;
use crate::stats::{Counter, Counters};
use crate::text::pack::{self, PackMode};
use crate::text::tokenizer::{TokenRef, TokenizerSpec};
use crate::write::{inputs, FieldValue, ShardWriter, WriterOptions};

#[derive(Debug, Parser)]
#[command(
    name = "shardstream",
    version,
    about = "Inspect shards, index datasets, print epoch plans, write shards, verify ledgers, measure the loader"
)]
struct Cli {
    #[command(flatten)]
    s3: S3Args,
    #[command(subcommand)]
    command: Command,
}

/// How to reach `s3://` shards (credentials come from the default AWS chain).
#[derive(Debug, clap::Args)]
struct S3Args {
    /// S3 region.
    #[arg(long, global = true)]
    s3_region: Option<String>,
    /// Endpoint URL of an S3-compatible store (default: AWS_ENDPOINT_URL or AWS).
    #[arg(long, global = true)]
    s3_endpoint_url: Option<String>,
    /// Path-style addressing.
    #[arg(long, global = true)]
    s3_path_style: bool,
    /// Named profile of the shared AWS config files.
    #[arg(long, global = true)]
    s3_profile: Option<String>,
    /// Unsigned requests (public buckets).
    #[arg(long, global = true)]
    s3_unsigned: bool,
}

impl S3Args {
    fn options(&self) -> StoreOptions {
        StoreOptions {
            region: self.s3_region.clone(),
            endpoint_url: self.s3_endpoint_url.clone(),
            path_style: self.s3_path_style,
            profile: self.s3_profile.clone(),
            unsigned: self.s3_unsigned,
            ..StoreOptions::default()
        }
    }
}

#[derive(Debug, Subcommand)]
enum Command {
    /// List a shard's samples: keys, fields and sizes (gzip and zstd
    /// shards are decompressed as they are read).
    Inspect {
        /// Shard path, file:// or s3:// URL.
        shard: String,
        /// Print at most this many samples (totals still cover the whole shard).
        #[arg(long)]
        limit: Option<usize>,
    },
    /// Scan shards and write a manifest: sizes, mtimes, sample counts and
    /// each sample's byte offset and length.
    Index {
        /// Dataset spec, as StreamingDataset takes it: paths, file:// URLs,
        /// brace ranges, directories, s3:// URLs and prefixes, http(s)://,
        /// hf://datasets/ and gs:// URLs.
        #[arg(required = true)]
        spec: Vec<String>,
        /// Where to write the manifest: a file path (its folder must exist
        /// and be writable; checked before any shard is read) or an s3://
        /// URL (beside the shards, `manifest.json`, is where datasets find it).
        #[arg(short, long)]
        output: PathBuf,
        /// Shards read at once. An interrupted run resumes from the journal
        /// beside the manifest (`<output>.partial`): the shards it indexed
        /// are not read again.
        #[arg(short, long, default_value_t = index::DEFAULT_JOBS, value_parser = clap::value_parser!(u16).range(1..=1024))]
        jobs: u16,
        /// What the shards are (the dataset's `format`): tar shards,
        /// JSON-lines shards (`.jsonl`, `.jsonl.gz`, `.jsonl.zst`), whose
        /// samples are their lines, or Parquet files, whose samples are
        /// their rows (with `--count-tokens` only: the footer gives the
        /// rows, the manifest their token counts).
        #[arg(long, default_value = "tar", value_parser = ["tar", "jsonl", "parquet"])]
        format: String,
        /// Also record each sample's token count in this field (what
        /// `pack=Pack(...)` needs across ranks): the ids `--tokenizer`
        /// makes of its text, or, without `--tokenizer`, the token ids it
        /// holds (a list of ints or a 1-D integer array).
        #[arg(long, value_name = "FIELD")]
        count_tokens: Option<String>,
        /// The `tokenizer.json` that tokenizes the counted field, as the
        /// dataset's `Tokenizer` does (with the same `--bos`, `--eos` and
        /// `--no-special-tokens`).
        #[arg(long, value_name = "FILE", requires = "count_tokens")]
        tokenizer: Option<PathBuf>,
        /// Token put before every text (an id or the token's text), as
        /// `Tokenizer(bos=...)`.
        #[arg(long, requires = "tokenizer")]
        bos: Option<String>,
        /// Token put after every text (an id or the token's text), as
        /// `Tokenizer(eos=...)`.
        #[arg(long, requires = "tokenizer")]
        eos: Option<String>,
        /// The tokenizer's post-processor adds no special tokens, as
        /// `Tokenizer(add_special_tokens=False)`.
        #[arg(long, requires = "tokenizer")]
        no_special_tokens: bool,
    },
    /// Print which shards (or sample runs) each (rank, worker) slot reads in an epoch.
    Plan {
        /// Dataset spec: paths, file:// URLs, brace ranges, directories.
        #[arg(required = true)]
        spec: Vec<String>,
        /// What the shards are (the dataset's `format`).
        #[arg(long, default_value = "auto", value_parser = ["auto", "tar", "parquet", "raw", "jsonl"])]
        format: String,
        /// Number of processes (ranks).
        #[arg(long, default_value_t = 1)]
        world_size: usize,
        /// DataLoader workers per process.
        #[arg(long, default_value_t = 1)]
        workers: usize,
        /// Seed.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Epoch.
        #[arg(long, default_value_t = 0)]
        epoch: u64,
        /// Keep the listed shard order instead of shuffling it per epoch.
        #[arg(long)]
        no_shuffle: bool,
        /// Manifest to plan with (default: `manifest.json` beside the shards, if any).
        #[arg(long, conflicts_with = "no_manifest")]
        manifest: Option<PathBuf>,
        /// Use no manifest, even when one is beside the shards.
        #[arg(long)]
        no_manifest: bool,
        /// With several ranks, do not count the samples of local tar shards
        /// from their headers (as with `count_samples=False`): without a
        /// manifest the plan is then refused.
        #[arg(long)]
        no_count: bool,
        /// With a manifest: drop the samples that do not divide evenly among
        /// ranks, or pad by wrapping around.
        #[arg(long, default_value = "drop", value_parser = ["drop", "pad"])]
        remainder: String,
        /// Plan as a dataset packed into sequences of SEQ_LEN tokens
        /// (`pack=Pack(SEQ_LEN)`) does, from the documents' token counts in
        /// the manifest (`shardstream index --count-tokens`): with several
        /// ranks the slots are cut by tokens, and each slot's documents,
        /// tokens and sequences are printed.
        #[arg(long, value_name = "SEQ_LEN")]
        pack: Option<usize>,
        /// The packed field (default: the field the manifest's token counts
        /// are of).
        #[arg(long, requires = "pack", value_name = "FIELD")]
        pack_field: Option<String>,
    },
    /// Prove from a sample ledger (shardstream.Ledger) that each epoch trained
    /// every sample exactly once, or name the first violation.
    ///
    /// Exit status: 0 when every epoch checks, 1 on a violation, 2 when the
    /// ledger or the dataset cannot be read.
    Verify {
        /// The ledger folder (the one given to shardstream.Ledger).
        ledger: PathBuf,
        /// Dataset spec, when not the one the ledger recorded (the data moved).
        spec: Vec<String>,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Show which samples step S of rank R sees (and from which DataLoader
    /// worker), from the plan alone.
    Explain {
        /// Dataset spec: paths, file:// URLs, brace ranges, directories, URLs.
        #[arg(required = true)]
        spec: Vec<String>,
        /// What the shards are (the dataset's `format`).
        #[arg(long, default_value = "auto", value_parser = ["auto", "tar", "parquet", "raw", "jsonl"])]
        format: String,
        /// Epoch.
        #[arg(long, default_value_t = 0)]
        epoch: u64,
        /// Rank.
        #[arg(long, default_value_t = 0)]
        rank: usize,
        /// Step within the epoch, from 0 (the rank's batch number).
        #[arg(long)]
        step: u64,
        /// Samples per batch (the DataLoader's batch_size).
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
        batch_size: u64,
        /// Number of processes (ranks).
        #[arg(long, default_value_t = 1)]
        world_size: usize,
        /// DataLoader workers per process (0 counts as 1: the main process).
        #[arg(long, default_value_t = 1)]
        num_workers: usize,
        /// Seed.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Keep the listed shard order instead of shuffling it per epoch.
        #[arg(long)]
        no_shuffle: bool,
        /// Plan as the dataset's count_samples=True does on one rank (with
        /// several ranks, or a manifest, it always does).
        #[arg(long)]
        count_samples: bool,
        /// The dataset's shuffle_buffer (samples; 0: none).
        #[arg(long, default_value_t = StreamOptions::default().shuffle_buffer)]
        shuffle_buffer: usize,
        /// The dataset's shuffle_buffer_bytes.
        #[arg(long, default_value_t = StreamOptions::default().shuffle_buffer_bytes)]
        shuffle_buffer_bytes: usize,
        /// The dataset's shuffle_initial.
        #[arg(long, default_value_t = StreamOptions::default().shuffle_initial)]
        shuffle_initial: usize,
        /// Drop the samples that do not divide evenly among ranks, or pad.
        #[arg(long, default_value = "drop", value_parser = ["drop", "pad"])]
        remainder: String,
        /// Manifest to plan with (default: `manifest.json` beside the shards, if any).
        #[arg(long, conflicts_with = "no_manifest")]
        manifest: Option<PathBuf>,
        /// Use no manifest, even when one is beside the shards.
        #[arg(long)]
        no_manifest: bool,
        /// A saved loader state (JSON: a `StatefulDataLoader`'s
        /// `state_dict()`, a dataset's, or every rank's, gathered): the
        /// epoch, world size and workers come from it, and `--step` counts
        /// from the first step after resuming from it.
        #[arg(long, conflicts_with_all = ["epoch", "world_size", "num_workers"])]
        state: Option<PathBuf>,
        /// The dataset packs its documents into sequences of SEQ_LEN
        /// tokens (`pack=Pack(SEQ_LEN)`): name the pieces of documents each
        /// sequence of the step holds, from the documents' token counts in
        /// the manifest (`shardstream index --count-tokens`); `--batch-size`
        /// counts sequences. With `--state`, after the resume: each
        /// worker's place is found from the documents its packer had taken
        /// and held.
        #[arg(long, value_name = "SEQ_LEN")]
        pack: Option<usize>,
        /// The packed field (default: the field the manifest's token counts
        /// are of).
        #[arg(long, requires = "pack", value_name = "FIELD")]
        pack_field: Option<String>,
        /// The packing's mode (`Pack(mode=...)`).
        #[arg(long, requires = "pack", value_parser = ["concat", "best_fit"])]
        pack_mode: Option<String>,
        /// The open sequences `"best_fit"` keeps (`Pack(window=...)`;
        /// default 64).
        #[arg(long, requires = "pack")]
        pack_window: Option<usize>,
    },
    /// Write WebDataset shards (and their manifest) from a folder of files,
    /// grouped into samples by name (`dir/a.jpg` + `dir/a.cls` is sample
    /// `dir/a`), or from Parquet files (one sample per row).
    Write {
        /// A folder of files, or a Parquet file or folder of Parquet files
        /// (with --key-column).
        src: PathBuf,
        /// Shard pattern: `out/shard-%06d.tar` or `s3://bucket/prefix/shard-%06d.tar`.
        dest: String,
        /// Labels joined by key: a CSV file (a header row with a `__key__`
        /// or `key` column; other columns become fields, e.g. `cls`) or a
        /// JSON-lines file (objects with `__key__` or `key`). A label for a
        /// key with no files is an error.
        #[arg(long, conflicts_with_all = ["key_column", "columns"])]
        labels: Option<PathBuf>,
        /// Parquet: the column holding each row's key.
        #[arg(long)]
        key_column: Option<String>,
        /// Parquet: the columns to write, comma-separated, each `column` or
        /// `field=column` (default: every column but the key).
        #[arg(long, value_delimiter = ',', requires = "key_column")]
        columns: Option<Vec<String>>,
        /// Samples per shard at most (0: no limit).
        #[arg(long, default_value_t = 100_000)]
        max_count: u64,
        /// Tar bytes per shard at most, before compression (0: no limit).
        #[arg(long, default_value_t = 3_000_000_000)]
        max_bytes: u64,
        /// Compression (default: as the pattern's suffix says).
        #[arg(long, value_parser = ["gz", "zst"])]
        compression: Option<String>,
    },
    /// Measure the loader on a dataset: samples/s, MB/s, CPU per sample and
    /// the stage that bounds it (runs in the Python package: `shardstream
    /// bench --help` there lists its options).
    Bench {
        /// The command's arguments, read by the Python package.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

/// Set by [`interrupt`]: `write` stops before its next sample.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// Whether the running command looks at [`INTERRUPTED`] (`write`, once it
/// writes).
static STOPS_WHEN_INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// Asks the command [`run`] is running to stop (its caller was
/// interrupted: Ctrl-C in the Python entry point); true if it will.
/// `write` stops before its next sample with an error, its open shard
/// aborted (no `.partial` file left) and the manifest of its completed
/// shards written; the other commands do not look at it.
pub fn interrupt() -> bool {
    INTERRUPTED.store(true, Ordering::SeqCst);
    STOPS_WHEN_INTERRUPTED.load(Ordering::SeqCst)
}

/// An error once [`interrupt`] was called.
fn check_interrupted() -> Result<()> {
    if INTERRUPTED.load(Ordering::SeqCst) {
        return Err(Error::Stopped("interrupted".into()));
    }
    Ok(())
}

/// Runs the CLI on `args` (program name first); returns the exit code.
pub fn run<I, T>(args: I) -> i32
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    INTERRUPTED.store(false, Ordering::SeqCst);
    STOPS_WHEN_INTERRUPTED.store(false, Ordering::SeqCst);
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return e.exit_code();
        }
    };
    let mut out = std::io::stdout().lock();
    let s3 = cli.s3.options();
    let result = match cli.command {
        Command::Write {
            src,
            dest,
            labels,
            key_column,
            columns,
            max_count,
            max_bytes,
            compression,
        } => {
            let options = WriterOptions {
                max_count: (max_count > 0).then_some(max_count),
                max_bytes: (max_bytes > 0).then_some(max_bytes),
                compression: match compression.as_deref() {
                    Some("gz") => Some(Compression::Gzip),
                    Some(_) => Some(Compression::Zstd),
                    None => None,
                },
                store: s3.clone(),
            };
            let source = match key_column {
                Some(key_column) => WriteSource::Parquet {
                    key_column,
                    columns,
                },
                None => WriteSource::Folder { labels },
            };
            write_shards(&src, &dest, source, options, &mut out)
        }
        Command::Inspect { shard, limit } => inspect(&shard, limit, &s3, &mut out),
        Command::Bench { .. } => {
            eprintln!(
                "error: `shardstream bench` runs in the Python package: install it \
                 (`pip install shardstream`) and run `shardstream bench` from there"
            );
            return 2;
        }
        Command::Verify { ledger, spec, json } => {
            return verify_ledger(&ledger, &spec, json, &s3, &mut out);
        }
        Command::Explain {
            spec,
            epoch,
            rank,
            step,
            batch_size,
            world_size,
            num_workers,
            seed,
            no_shuffle,
            count_samples,
            shuffle_buffer,
            shuffle_buffer_bytes,
            shuffle_initial,
            remainder,
            manifest,
            no_manifest,
            state,
            format,
            pack,
            pack_field,
            pack_mode,
            pack_window,
        } => {
            let saved = state
                .as_deref()
                .map(|path| saved_state(path, rank, pack.is_some()))
                .transpose();
            remainder.parse().and_then(|remainder| {
                let saved = saved?;
                let format: DatasetFormat = format.parse()?;
                let (epoch, world_size, num_workers) = match &saved {
                    Some((layout, _)) => *layout,
                    None => (epoch, world_size, num_workers),
                };
                let stream = StreamOptions::builder()
                    .with_seed(seed)
                    .with_shuffle_shards(!no_shuffle)
                    .with_shuffle_buffer(shuffle_buffer)
                    .with_shuffle_buffer_bytes(shuffle_buffer_bytes)
                    .with_shuffle_initial(shuffle_initial)
                    .with_remainder(remainder)
                    .with_store(s3.clone());
                let options = DatasetOptions::builder(stream)
                    .with_format(format)
                    .with_manifest(manifest_choice(manifest.as_deref(), no_manifest))
                    .with_count_samples(count_samples.then_some(true))
                    .build()
                    .map_err(named_as_flag)?;
                let params = options
                    .stream()
                    .plan_params(epoch, world_size, num_workers.max(1));
                let mode = match (pack_mode.as_deref(), pack_window) {
                    (Some("best_fit"), window) => PackMode::BestFit {
                        window: window.unwrap_or(pack::DEFAULT_WINDOW),
                    },
                    (_, None) => PackMode::Concat,
                    (_, Some(_)) => {
                        return Err(Error::Config {
                            name: "--pack-window",
                            reason: "it is the open sequences of --pack-mode best_fit".into(),
                        })
                    }
                };
                let step = ExplainStep {
                    rank,
                    step,
                    batch_size,
                    resumed: saved.is_some(),
                    saved: saved.and_then(|(_, position)| position),
                    pack: pack.map(|seq_len| (seq_len, pack_field, mode)),
                };
                explain(&spec, &options, &params, &step, &mut out)
            })
        }
        Command::Index {
            spec,
            output,
            jobs,
            format,
            count_tokens,
            tokenizer,
            bos,
            eos,
            no_special_tokens,
        } => format.parse().and_then(|format| {
            let counting = count_tokens
                .map(|field| {
                    let tokenizer = tokenizer
                        .map(|path| {
                            load_tokenizer(
                                &path,
                                bos.as_deref(),
                                eos.as_deref(),
                                !no_special_tokens,
                            )
                        })
                        .transpose()?;
                    Ok::<_, Error>(index::TokenCounting { field, tokenizer })
                })
                .transpose()?;
            let job = IndexJob {
                format,
                output: &output,
                jobs: usize::from(jobs),
                counting: counting.as_ref(),
            };
            index(&spec, &job, &s3, &mut out)
        }),
        Command::Plan {
            spec,
            world_size,
            workers,
            seed,
            epoch,
            no_shuffle,
            manifest,
            no_manifest,
            no_count,
            remainder,
            format,
            pack,
            pack_field,
        } => remainder.parse().and_then(|remainder| {
            let format: DatasetFormat = format.parse()?;
            let stream = StreamOptions::builder()
                .with_seed(seed)
                .with_shuffle_shards(!no_shuffle)
                .with_remainder(remainder)
                .with_store(s3.clone());
            let options = DatasetOptions::builder(stream)
                .with_format(format)
                .with_manifest(manifest_choice(manifest.as_deref(), no_manifest))
                .with_count_samples(no_count.then_some(false))
                .build()
                .map_err(named_as_flag)?;
            let params = options.stream().plan_params(epoch, world_size, workers);
            let pack = pack.map(|seq_len| (seq_len, pack_field));
            print_plan(&spec, &options, &params, pack, &mut out)
        }),
    };
    match result {
        Ok(()) => 0,
        // The caller says so (`shardstream: interrupted`); 128 + SIGINT.
        Err(_) if INTERRUPTED.load(Ordering::SeqCst) => 130,
        Err(e) => {
            eprintln!("error: {e}");
            1
        }
    }
}

/// Streams `shards` in listed order, one sample at a time, with a progress
/// bar over their (stored, maybe compressed) bytes; calls `each` per sample.
/// Returns the compression of each compressed shard, by shard index.
fn scan(
    shards: &[Shard],
    store_options: &StoreOptions,
    mut each: impl FnMut(&crate::format::Sample, &ProgressBar) -> Result<()>,
) -> Result<HashMap<usize, Compression>> {
    let total = shards.iter().filter_map(|s| s.size).sum::<u64>();
    let options = index::scan_options(store_options, None)?;
    let counters = Arc::new(Counters::new());
    let slot = SlotSpec::new(1, 0, 1, 0)?;
    let mut stream = SampleStream::new(shards, &options, 0, slot, counters.clone(), None)?;
    let progress = ProgressBar::new(total).with_style(
        ProgressStyle::with_template("{bar:40} {bytes}/{total_bytes} {bytes_per_sec} {msg}")
            .expect("valid template"),
    );
    progress.enable_steady_tick(Duration::from_millis(200));
    for event in stream.by_ref() {
        let sample = index::scanned_sample(event)?;
        each(&sample, &progress)?;
        progress.set_position(counters.snapshot().get(Counter::BytesRead));
    }
    progress.finish_and_clear();
    Ok(stream.compressed_shards())
}

fn inspect(
    url: &str,
    limit: Option<usize>,
    store_options: &StoreOptions,
    out: &mut dyn Write,
) -> Result<()> {
    let mut shards = resolve::resolve_with(&[url.to_owned()], store_options)?;
    // A remote shard named outright is resolved without a request: its
    // size comes from a HEAD (S3) or a GET of its first byte (HTTP).
    crate::store::describe_remote_objects(store_options, &mut shards)?;
    let total = shards.iter().filter_map(|s| s.size).sum::<u64>();
    let (mut samples, mut field_bytes) = (0u64, 0u64);
    let compressed = scan(&shards, store_options, |sample, progress| {
        samples += 1;
        field_bytes += sample
            .fields
            .iter()
            .map(|(_, v)| v.byte_size() as u64)
            .sum::<u64>();
        if limit.is_none_or(|n| samples <= n as u64) {
            let fields: Vec<String> = sample
                .fields
                .iter()
                .map(|(name, value)| format!("{name}:{}", value.byte_size()))
                .collect();
            progress.suspend(|| writeln!(out, "{}\t{}", sample.key, fields.join(" ")))?;
        }
        Ok(())
    })?;
    let stored = match compressed.get(&0) {
        Some(compression) => format!("{compression}-compressed"),
        None => "uncompressed".into(),
    };
    writeln!(
        out,
        "{samples} samples, {field_bytes} bytes of fields, {total} bytes in the shard ({stored})"
    )?;
    Ok(())
}

/// What `index` is asked to do besides the spec.
struct IndexJob<'a> {
    format: DatasetFormat,
    output: &'a std::path::Path,
    jobs: usize,
    counting: Option<&'a index::TokenCounting>,
}

/// The tokenizer of `--tokenizer PATH` with its `--bos`, `--eos` (an id, or
/// a token's text) and special-tokens choice, or a `Config` error naming
/// the option.
fn load_tokenizer(
    path: &std::path::Path,
    bos: Option<&str>,
    eos: Option<&str>,
    add_special_tokens: bool,
) -> Result<Arc<TokenizerSpec>> {
    let json = std::fs::read_to_string(path).map_err(|e| Error::Config {
        name: "--tokenizer",
        reason: format!("cannot read {}: {e}", path.display()),
    })?;
    let token = |text: &str| match text.parse::<u32>() {
        Ok(id) => TokenRef::Id(id),
        Err(_) => TokenRef::Text(text.to_owned()),
    };
    TokenizerSpec::new(json, bos.map(token), eos.map(token), add_special_tokens)
        .map(Arc::new)
        .map_err(|e| Error::Config {
            name: match e.parameter {
                "bos" => "--bos",
                "eos" => "--eos",
                _ => "--tokenizer",
            },
            reason: match e.parameter {
                "json" => format!("{}: {}", path.display(), e.reason),
                _ => e.reason,
            },
        })
}

fn index(
    specs: &[String],
    job: &IndexJob<'_>,
    store_options: &StoreOptions,
    out: &mut dyn Write,
) -> Result<()> {
    let output = job.output;
    let progress = IndexBar {
        bar: ProgressBar::new(0),
        shards: AtomicUsize::new(0),
        done: AtomicUsize::new(0),
    };
    let report = index::index_dataset(
        specs,
        job.format,
        output,
        store_options,
        job.jobs,
        job.counting,
        &progress,
    )?;
    progress.bar.finish_and_clear();
    let resumed = match report.resumed {
        0 => String::new(),
        n => format!(" ({n} from the journal of an earlier run)"),
    };
    writeln!(
        out,
        "indexed {} shards{resumed}, {} samples into {}",
        report.shards,
        report.samples,
        output.display()
    )?;
    Ok(())
}

/// A progress bar over an index run's bytes, with its shards done.
struct IndexBar {
    bar: ProgressBar,
    shards: AtomicUsize,
    done: AtomicUsize,
}

impl index::IndexProgress for IndexBar {
    fn start(&self, shards: usize, bytes: u64) {
        self.shards.store(shards, Ordering::Relaxed);
        self.bar.set_length(bytes);
        self.bar.set_style(
            ProgressStyle::with_template("{bar:40} {bytes}/{total_bytes} {bytes_per_sec} {msg}")
                .expect("valid template"),
        );
        self.bar.set_message(format!("0/{shards} shards"));
        self.bar.enable_steady_tick(Duration::from_millis(200));
    }
    fn read(&self, bytes: u64) {
        self.bar.set_position(bytes);
    }
    fn shard_done(&self) {
        let done = self.done.fetch_add(1, Ordering::Relaxed) + 1;
        let shards = self.shards.load(Ordering::Relaxed);
        self.bar.set_message(format!("{done}/{shards} shards"));
    }
}

/// Prints `specs`' plan for `params`; with `pack` (the sequence length and
/// the packed field, if named) as a packed dataset plans it
/// ([`print_packed_plan`]).
fn print_plan(
    specs: &[String],
    options: &DatasetOptions,
    params: &PlanParams,
    pack: Option<(usize, Option<String>)>,
    out: &mut dyn Write,
) -> Result<()> {
    SlotSpec::new(params.world_size, 0, params.num_workers, 0)?;
    if let Some((seq_len, field)) = pack {
        // The token counts are read on one rank too; the plan is the run's.
        let RunsPlan {
            shards,
            infos,
            manifest,
        } = runs_plan(specs, options, params)?;
        let packing = counted_packing(
            &shards,
            manifest.as_deref(),
            (seq_len, field, PackMode::Concat),
        )?;
        return print_packed_plan(&packing, infos, manifest.as_deref(), params, out);
    }
    let count = options.count_samples() != Some(false) && params.world_size > 1;
    let Resolved {
        shards, attached, ..
    } = dataset::resolve_shards(&resolving(specs, options), count)?;
    if let Some(reason) = &attached.ignored {
        eprintln!("warning: {reason}");
    }
    let manifest_path = attached.used;
    if params.world_size > 1 {
        if let Some(uncounted) = crate::dataset::count::first_uncounted(&shards) {
            return Err(crate::dataset::count::counts_needed(
                uncounted,
                params.world_size,
            ));
        }
    }
    let infos: Vec<_> = shards.iter().map(Shard::info).collect();
    let plan = plan::plan_epoch(&infos, params);
    let remainder = if params.remainder == Remainder::Pad {
        "pad"
    } else {
        "drop"
    };
    let basis = match (&manifest_path, plan.samples_per_rank) {
        (Some(path), Some(n)) => {
            format!("{n} samples per rank (remainder: {remainder}), manifest {path}")
        }
        (None, Some(n)) => {
            format!("{n} samples per rank (remainder: {remainder}), counted from the local shards")
        }
        _ => "balanced by bytes; samples: unknown (no manifest)".into(),
    };
    write_plan_header(shards.len(), params, &basis, out)?;
    for (slot, units) in plan.slots.iter().enumerate() {
        let bytes: u64 = units.iter().filter_map(|u| shards[u.shard].size).sum();
        let unknown = units
            .iter()
            .filter(|u| shards[u.shard].size.is_none())
            .count();
        let unknown_note = if unknown > 0 {
            format!(" (+{unknown} of unknown size)")
        } else {
            String::new()
        };
        let rank_worker = format!(
            "rank {} worker {}",
            slot / params.num_workers,
            slot % params.num_workers
        );
        if plan.samples_per_rank.is_some() {
            let samples: u64 = units
                .iter()
                .filter_map(|u| u.samples.as_ref())
                .map(|r| r.end - r.start)
                .sum();
            writeln!(
                out,
                "{rank_worker}: {} pieces, {samples} samples",
                units.len()
            )?;
        } else {
            writeln!(
                out,
                "{rank_worker}: {} shards, {bytes} bytes{unknown_note}",
                units.len()
            )?;
        }
        write_units(&shards, units, out)?;
    }
    Ok(())
}

/// Prints a plan's first line: the layout of `params` over `shards`
/// shards, then `basis` (what the slots are cut by).
fn write_plan_header(
    shards: usize,
    params: &PlanParams,
    basis: &str,
    out: &mut dyn Write,
) -> Result<()> {
    writeln!(
        out,
        "{shards} shards, world_size {}, {} workers per rank, seed {}, epoch {}; {basis}",
        params.world_size, params.num_workers, params.seed, params.epoch
    )?;
    Ok(())
}

/// Prints a slot's `units` of `shards`, one a line: a shard (a Parquet
/// file's row group named with its file), or its run of samples.
fn write_units(shards: &[Shard], units: &[plan::WorkUnit], out: &mut dyn Write) -> Result<()> {
    for unit in units {
        let shard = &shards[unit.shard];
        let name = match &shard.kind {
            ShardKind::Parquet(group) => format!("{} row group {}", shard.url, group.index),
            _ => shard.url.clone(),
        };
        match &unit.samples {
            Some(r) => writeln!(out, "  {name} samples {}..{}", r.start, r.end)?,
            None => writeln!(out, "  {name}")?,
        }
    }
    Ok(())
}

/// The packing `(seq_len, field, mode)` of `shards` (their manifest named
/// `manifest`), from the token counts their manifest records (of `field`,
/// by default the field they are of); the error names `--pack` and says
/// how to record them.
fn counted_packing(
    shards: &[Shard],
    manifest: Option<&str>,
    pack: (usize, Option<String>, PackMode),
) -> Result<Packing> {
    let as_flag = |reason: String| Error::Config {
        name: "--pack",
        reason,
    };
    let named = |(parameter, reason): (&str, String)| Error::Config {
        name: match parameter {
            "window" => "--pack-window",
            "field" => "--pack-field",
            _ => "--pack",
        },
        reason,
    };
    match Packing::new(shards, pack).map_err(named)? {
        Some(packing) => Ok(packing),
        None => {
            let found = match manifest {
                Some(path) => format!("{path} has none"),
                None => "no manifest is in use (none beside the shards; name one with --manifest)"
                    .into(),
            };
            Err(as_flag(format!(
                "a packed dataset's plan reads the documents' token counts from its manifest, \
                 and {found}: index the dataset with `shardstream index SPEC -o manifest.json \
                 --count-tokens FIELD` (and the Tokenizer's --tokenizer, --bos, --eos)"
            )))
        }
    }
}

/// Prints the plan of `packing`'s shards (their manifest named
/// `manifest`), planned over `infos` as the run plans them, packed as a
/// packed dataset plans it: with several ranks each slot's documents cut
/// by their token counts and its sequences the least over the ranks'
/// slots of its worker, so every rank takes as many steps; at least the
/// tokens past them are the epoch's remainder.
fn print_packed_plan(
    packing: &Packing,
    infos: Vec<ShardInfo>,
    manifest: Option<&str>,
    params: &PlanParams,
    out: &mut dyn Write,
) -> Result<()> {
    let (shards, spec) = (&packing.shards, &packing.spec);
    let (seq_len, field) = (spec.seq_len, spec.field_name());
    let manifest = manifest.unwrap_or_default();
    let options = PlanOptions {
        seed: params.seed,
        shuffle_shards: params.shuffle_shards,
        remainder: params.remainder,
    };
    let (units, slots) = packing.plan_slots(
        infos,
        options,
        params.epoch,
        (params.world_size, params.num_workers),
    );
    let tokens = slots
        .iter()
        .map(|s| s.tokens)
        .fold(0u64, u64::saturating_add);
    let sequences = if params.world_size > 1 {
        let per_rank: u64 = slots[..params.num_workers]
            .iter()
            .filter_map(|s| s.handed_out)
            .sum();
        // A slot hands out at most `capacity` tokens a sequence.
        let capacity = spec.capacity() as u64;
        let left: u64 = slots
            .iter()
            .map(|s| {
                let most = s.handed_out.unwrap_or(0).saturating_mul(capacity);
                s.tokens.saturating_sub(most)
            })
            .sum();
        let share = 100.0 * left as f64 / tokens.max(1) as f64;
        format!(
            "{per_rank} sequences per rank; at least {left} of the epoch's {tokens} tokens \
             ({share:.2}%) are its remainder"
        )
    } else {
        let at_least: u64 = slots.iter().map(|s| s.at_least).sum();
        format!(
            "one rank, whose slots hand out every sequence they pack: at least {at_least} \
             sequences of the epoch's {tokens} tokens"
        )
    };
    let basis = format!(
        "packed into sequences of {seq_len} + 1 tokens by the token counts of {field:?} in \
         {manifest}: {sequences}"
    );
    write_plan_header(shards.len(), params, &basis, out)?;
    for (at, (slot_units, slot)) in units.iter().zip(&slots).enumerate() {
        let sequences = match slot.handed_out {
            Some(n) => format!("{n} sequences (it packs at least {})", slot.at_least),
            None => format!("at least {} sequences", slot.at_least),
        };
        writeln!(
            out,
            "rank {} worker {}: {} pieces, {} documents, {} tokens, {sequences}",
            at / params.num_workers,
            at % params.num_workers,
            slot_units.len(),
            slot.documents,
            slot.tokens
        )?;
        write_units(shards, slot_units, out)?;
    }
    Ok(())
}

/// Resolves `specs` with every shard's sample count (from a manifest or the
/// headers of local tar shards), as a dataset of several ranks does.
/// How a command resolves `specs` with `options`: strictly, as a dataset
/// with `on_error="raise"` does.
fn resolving<'a>(specs: &'a [String], options: &'a DatasetOptions) -> Resolving<'a> {
    Resolving {
        specs,
        store_options: &options.stream().store,
        format: options.format(),
        manifest: options.manifest(),
        strict: true,
    }
}

/// An error naming the command-line flag of a dataset option (for the
/// options a command takes as flags), instead of the option.
fn named_as_flag(error: Error) -> Error {
    let flag = |name: &'static str| match name {
        "shuffle_buffer" => "--shuffle-buffer",
        "shuffle_buffer_bytes" => "--shuffle-buffer-bytes",
        "shuffle_initial" => "--shuffle-initial",
        other => other,
    };
    match error {
        Error::Config { name, reason } => Error::Config {
            name: flag(name),
            reason,
        },
        other => other,
    }
}

/// `specs` resolved with `options` and counted, every shard's sample count
/// known (or the error naming the first shard without one).
fn resolve_counted(specs: &[String], options: &DatasetOptions) -> Result<Vec<Shard>> {
    let Resolved {
        shards, attached, ..
    } = dataset::resolve_shards(&resolving(specs, options), true)?;
    if let Some(reason) = &attached.ignored {
        eprintln!("warning: {reason}");
    }
    check_counted(&shards)?;
    Ok(shards)
}

/// The shards of a dataset as a run of `params` plans them, with their
/// counts for the commands that name samples.
struct RunsPlan {
    /// Every shard, with its sample count (and token counts, from its
    /// manifest).
    shards: Vec<Shard>,
    /// What the run plans over: the counted shards with several ranks or
    /// `count_samples=True`; otherwise the shards as resolved without
    /// counting (whole shards dealt, unless an attached manifest counted
    /// them), as one rank's run plans.
    infos: Vec<ShardInfo>,
    /// The manifest that counted them, if any.
    manifest: Option<String>,
}

/// Resolves `specs` as the dataset does for `params`, then counts every
/// shard it can (a remote `manifest.json` beside the shards, the headers
/// of local tar shards), warning of a manifest passed over.
fn runs_plan(specs: &[String], options: &DatasetOptions, params: &PlanParams) -> Result<RunsPlan> {
    let how = resolving(specs, options);
    let Resolved {
        shards: planned,
        attached,
        ..
    } = dataset::resolve_shards(&how, false)?;
    let mut shards = planned.clone();
    let (beside, _) = dataset::count_shards(&how, &mut shards, attached.used.is_some())?;
    if let Some(reason) = attached.ignored.as_ref().or(beside.ignored.as_ref()) {
        eprintln!("warning: {reason}");
    }
    let infos = if params.world_size > 1 || options.count_samples() == Some(true) {
        shards.iter().map(Shard::info).collect()
    } else {
        planned.iter().map(Shard::info).collect()
    };
    Ok(RunsPlan {
        shards,
        infos,
        manifest: attached.used.or(beside.used),
    })
}

/// Refuses `shards` unless every one has a sample count.
fn check_counted(shards: &[Shard]) -> Result<()> {
    match crate::dataset::count::first_uncounted(shards) {
        None => Ok(()),
        Some(uncounted) => Err(Error::Config {
            name: "SPEC",
            reason: format!(
                "the sample count of {} is unknown: write a manifest with \
                 `shardstream index SPEC -o manifest.json` beside the shards",
                uncounted.url
            ),
        }),
    }
}

/// What a ledger is checked against: a dataset, or a `Mix` of them.
enum LedgerData {
    /// A `StreamingDataset`.
    Dataset(ledger::verify::Dataset),
    /// A `Mix`.
    Mix(ledger::verify_mix::MixDataset),
}

/// The dataset a ledger recorded (or `specs`, when given: a dataset's
/// only), resolved with its sample counts and the order options the ledger
/// recorded; each stream of a mixture the same way.
fn ledger_dataset(
    generations: &[ledger::file::Generation],
    specs: &[String],
    store_options: &StoreOptions,
) -> std::result::Result<LedgerData, String> {
    let last = &generations[generations.len() - 1];
    let meta = &last.meta.dataset;
    for g in generations {
        let same_mixture = match (&g.meta.dataset.mix, &meta.mix) {
            (Some(a), Some(b)) => a.same_mixture(b),
            (a, b) => a.is_none() && b.is_none(),
        };
        if g.meta.dataset.spec != meta.spec
            || g.meta.dataset.options != meta.options
            || !same_mixture
        {
            return Err(format!(
                "{} and {} recorded different datasets or options: verify checks one \
                 dataset; move the generations of another job to their own folder",
                g.dir.display(),
                last.dir.display()
            ));
        }
    }
    let Some(mix) = &meta.mix else {
        let specs = if specs.is_empty() { &meta.spec } else { specs };
        return resolved_dataset(meta, specs, store_options).map(LedgerData::Dataset);
    };
    if !specs.is_empty() {
        return Err(
            "the ledger is of a Mix: verify resolves each stream's spec as the ledger \
             recorded it (give no SPEC)"
                .into(),
        );
    }
    let streams = mix
        .streams
        .iter()
        .enumerate()
        .map(|(i, stream)| {
            resolved_dataset(stream, &stream.spec, store_options)
                .map_err(|e| format!("stream {i}: {e}"))
        })
        .collect::<std::result::Result<Vec<_>, String>>()?;
    // Each epoch is replayed with the weights its generations recorded.
    Ok(LedgerData::Mix(ledger::verify_mix::MixDataset {
        streams,
        policy: mix.policy.parse().map_err(|e: Error| e.to_string())?,
        weights: mix.weights.clone(),
        seed: mix.seed,
    }))
}

/// `meta`'s dataset resolved from `specs`, with its sample counts (checked
/// against the ones `meta` recorded) and order options.
fn resolved_dataset(
    meta: &ledger::file::DatasetMeta,
    specs: &[String],
    store_options: &StoreOptions,
) -> std::result::Result<ledger::verify::Dataset, String> {
    let defaults = StreamOptions::default();
    let format = match meta_option(meta, "format", "a format name", Value::as_str)? {
        Some(name) => name.parse().map_err(|e: Error| e.to_string())?,
        None => DatasetFormat::Auto,
    };
    let choice = meta_option(
        meta,
        "manifest",
        "a path, false or true",
        |value| match value {
            Value::String(path) => Some(manifest::choice_of(path)),
            Value::Bool(false) => Some(ManifestChoice::Off),
            Value::Bool(true) => Some(ManifestChoice::Auto),
            _ => None,
        },
    )?;
    let remainder = match meta_option(meta, "remainder", "a remainder name", Value::as_str)? {
        Some(name) => name.parse().map_err(|e: Error| e.to_string())?,
        None => defaults.remainder,
    };
    let seed = meta_option(meta, "seed", "an int of at least 0", Value::as_u64)?;
    let shuffle_shards = meta_option(meta, "shuffle_shards", "true or false", Value::as_bool)?;
    let stream = StreamOptions::builder()
        .with_seed(seed.unwrap_or(defaults.seed))
        .with_shuffle_shards(shuffle_shards.unwrap_or(defaults.shuffle_shards))
        .with_remainder(remainder)
        .with_store(store_options.clone());
    let options = DatasetOptions::builder(stream)
        .with_format(format)
        .with_manifest(choice.unwrap_or(ManifestChoice::Auto))
        .build()
        .map_err(|e| e.to_string())?;
    let shards = resolve_counted(specs, &options).map_err(|e| e.to_string())?;
    let counts: Vec<u64> = shards
        .iter()
        .map(|s| s.info().samples.unwrap_or(0))
        .collect();
    let total: u64 = counts.iter().sum();
    if meta.shards.is_some_and(|n| n != shards.len()) || meta.samples.is_some_and(|n| n != total) {
        return Err(format!(
            "the dataset resolves to {} shards of {total} samples, and the ledger was written \
             over {} shards of {} samples: give the spec it was written with",
            shards.len(),
            meta.shards.map_or("?".into(), |n| n.to_string()),
            meta.samples.map_or("?".into(), |n| n.to_string()),
        ));
    }
    let packing = Packing::from_option(meta.option("pack"), &shards)
        .map_err(|reason| format!("the ledger's meta.json: {reason}"))?
        .map(|mut packing| {
            let tokenizer = packing.tokenizer.as_deref();
            packing.arrival = Arrival::recorded(meta, packing.spec.field_name(), tokenizer);
            packing
        });
    Ok(ledger::verify::Dataset {
        urls: shards.into_iter().map(|s| s.url).collect(),
        counts,
        seed: options.stream().seed,
        shuffle_shards: options.stream().shuffle_shards,
        remainder: options.stream().remainder,
        packed: !meta.option("pack").is_null(),
        packing,
    })
}

/// Option `name` of a ledger's `meta.json`, as `read` takes it: `None`
/// when the meta leaves it out (`null`, or absent: written by a version
/// before the option); a value `read` does not take is an error naming the
/// field, never a default (the verdict would be about another plan).
fn meta_option<'m, T>(
    meta: &'m ledger::file::DatasetMeta,
    name: &str,
    expected: &str,
    read: impl FnOnce(&'m Value) -> Option<T>,
) -> std::result::Result<Option<T>, String> {
    let value = meta.option(name);
    if value.is_null() {
        return Ok(None);
    }
    read(value).map(Some).ok_or_else(|| {
        format!("the ledger's meta.json: dataset option {name} is {value}, not {expected}")
    })
}

/// `shardstream verify`: prints the report; 0 when every epoch checks, 1
/// on a violation, 2 when the ledger or the dataset cannot be read.
fn verify_ledger(
    dir: &std::path::Path,
    specs: &[String],
    json: bool,
    store_options: &StoreOptions,
    out: &mut dyn Write,
) -> i32 {
    let checked = ledger::file::read_ledger(dir)
        .map_err(|e| e.to_string())
        .and_then(|generations| {
            Ok(match ledger_dataset(&generations, specs, store_options)? {
                LedgerData::Dataset(dataset) => ledger::verify::verify(&generations, &dataset),
                LedgerData::Mix(mix) => ledger::verify_mix::verify_mix(&generations, &mix),
            })
        });
    let report = match checked {
        Ok(report) => report,
        Err(reason) => {
            eprintln!("error: {reason}");
            return 2;
        }
    };
    let written = if json {
        serde_json::to_string_pretty(&report)
            .map_err(std::io::Error::other)
            .and_then(|text| writeln!(out, "{text}"))
    } else {
        write!(out, "{report}")
    };
    match written {
        Err(e) => {
            eprintln!("error: cannot write the report: {e}");
            2
        }
        Ok(()) if report.ok => 0,
        Ok(()) => 1,
    }
}

/// The step `shardstream explain` asks about.
struct ExplainStep {
    rank: usize,
    step: u64,
    batch_size: u64,
    /// Whether the step is of a run resumed from a saved state (`--state`).
    resumed: bool,
    /// Where the rank's workers stood in that state; `None` too when it
    /// had finished its epoch (the resumed run starts the next one).
    saved: Option<SavedPosition>,
    /// The packing (`--pack`): sequence length, field and mode.
    pack: Option<(usize, Option<String>, PackMode)>,
}

/// `(epoch, world_size, num_workers)` and the workers' position of rank
/// `rank` in the loader state saved at `path` (`--state`), of a packed
/// stream when `packed` (`--pack`).
fn saved_state(path: &Path, rank: usize, packed: bool) -> Result<ledger::explain::SavedAt> {
    let config = |reason: String| Error::Config {
        name: "--state",
        reason,
    };
    let text = std::fs::read_to_string(path)
        .map_err(|e| config(format!("cannot read {}: {e}", path.display())))?;
    let value: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| config(format!("{} is not JSON: {e}", path.display())))?;
    ledger::explain::saved_position(&value, rank, packed).map_err(config)
}

fn explain(
    specs: &[String],
    options: &DatasetOptions,
    params: &PlanParams,
    ask: &ExplainStep,
    out: &mut dyn Write,
) -> Result<()> {
    SlotSpec::new(params.world_size, ask.rank, params.num_workers, 0)?;
    let RunsPlan {
        shards,
        infos,
        manifest,
    } = runs_plan(specs, options, params)?;
    check_counted(&shards)?;
    let counts: Vec<Option<u64>> = shards.iter().map(|s| s.info().samples).collect();
    if let Some(pack) = &ask.pack {
        let packing = counted_packing(&shards, manifest.as_deref(), pack.clone())?;
        return explain_packed(&packing, options, (params, infos), ask, out);
    }
    // A held sample's bytes, by its span in the shard (a manifest's).
    let sample_bytes = |shard: usize, index: u64| {
        ledger::explain::undecoded_bytes_at_most(shards.get(shard)?, index)
    };
    let shuffle = options.stream().shuffle_bounds();
    let replay = shuffle.map(|bounds| BufferReplay {
        bounds,
        sample_bytes: &sample_bytes,
    });
    let start = match (&ask.saved, &replay) {
        // A state holding samples handed out was saved without a buffer
        // (one with a buffer is refused when read): it goes on from there.
        (Some(saved), Some(_)) if saved.produced.iter().all(|&n| n == 0) => {
            Start::Fresh(replay.as_ref())
        }
        (Some(saved), _) => Start::Saved(saved),
        (None, replay) => Start::Fresh(replay.as_ref()),
    };
    let step = ledger::explain::explain_step(
        &infos,
        &counts,
        params,
        ask.rank,
        ask.step,
        ask.batch_size,
        start,
    )
    .map_err(|error| explain_error(error, options, params, ask))?;
    let after = if ask.resumed { " after the resume" } else { "" };
    writeln!(
        out,
        "epoch {} rank {} step {}{after}: worker {} (its batch {}), {} samples",
        params.epoch,
        ask.rank,
        ask.step,
        step.worker,
        step.worker_batch,
        step.samples.len()
    )?;
    note_unchecked_buffer(step.buffer, options);
    for (shard, index) in step.samples {
        let at = match &shards[shard].index {
            Some(spans) => format!(" (bytes {}+{})", spans.offset(index), spans.length(index)),
            None => String::new(),
        };
        writeln!(out, "  {} sample {index}{at}", shards[shard].url)?;
    }
    Ok(())
}

/// `shardstream explain --pack`: the sequences of the step, each named by
/// the pieces of documents it holds. The documents reach each worker's
/// packer through its shuffle buffer, undecoded but for the counted field
/// when its counts were made with a tokenizer.
fn explain_packed(
    packing: &Packing,
    options: &DatasetOptions,
    (params, infos): (&PlanParams, Vec<ShardInfo>),
    ask: &ExplainStep,
    out: &mut dyn Write,
) -> Result<()> {
    let arrival = Arrival {
        buffer: options.stream().shuffle_bounds(),
        decoded: if packing.tokenizer.is_some() {
            Decoded::CountedField
        } else {
            Decoded::Nothing
        },
    };
    let step = ledger::explain_pack::explain_packed_step(
        packing,
        arrival,
        (params, infos),
        (ask.rank, ask.step, ask.batch_size),
        ask.saved.as_ref(),
    )
    .map_err(|error| explain_error(error, options, params, ask))?;
    let after = if ask.resumed { " after the resume" } else { "" };
    writeln!(
        out,
        "epoch {} rank {} step {}{after}: worker {} (its batch {}), {} sequences of {} + 1 tokens",
        params.epoch,
        ask.rank,
        ask.step,
        step.worker,
        step.worker_batch,
        step.sequences.len(),
        packing.spec.seq_len,
    )?;
    note_unchecked_buffer(step.buffer, options);
    for (at, pieces) in step.sequences.iter().enumerate() {
        let number = step.first_sequence + at as u64;
        writeln!(out, "  sequence {number} of worker {}:", step.worker)?;
        for &[shard, index, start, end] in pieces {
            let shard = shard as usize;
            let tokens = packing.tokens_of(shard, index);
            writeln!(
                out,
                "    {} sample {index} tokens {start}..{end} of {tokens}",
                packing.shards[shard].url
            )?;
        }
    }
    Ok(())
}

/// Says on stderr that the step's shuffle buffer was replayed by its
/// sample count alone, when the samples' bytes were not known.
fn note_unchecked_buffer(buffer: BufferCheck, options: &DatasetOptions) {
    if buffer == BufferCheck::BytesUnknown {
        eprintln!(
            "note: the shuffle buffer is replayed by its sample count; this is exact unless \
             the samples it held passed {} bytes (shuffle_buffer_bytes), which explain cannot \
             check without a manifest (`shardstream index`) giving each sample's byte span",
            options.stream().shuffle_buffer_bytes
        );
    }
}

/// Why explain cannot name the step's samples, as the flag to change.
fn explain_error(
    error: ledger::explain::ExplainError,
    options: &DatasetOptions,
    params: &PlanParams,
    ask: &ExplainStep,
) -> Error {
    use ledger::explain::ExplainError;
    match error {
        ExplainError::NotThisPlan { worker } if ask.pack.is_some() => Error::Config {
            name: "--state",
            reason: format!(
                "the documents worker {worker} of rank {} had packed, or the sequences it had \
                 handed out, are not those of its slot in this plan: give the dataset's spec, \
                 --seed, --no-shuffle, --shuffle-buffer, --shuffle-buffer-bytes, \
                 --shuffle-initial, --remainder and the --pack options as the run had them",
                ask.rank
            ),
        },
        ExplainError::NotThisPlan { worker } => Error::Config {
            name: "--state",
            reason: format!(
                "the samples worker {worker} of rank {} had handed out are not the first \
                 ones of its slot in this plan: give the dataset's spec, --seed, \
                 --no-shuffle, --remainder and --count-samples as the run had them",
                ask.rank
            ),
        },
        ExplainError::PastTheEnd { steps } => Error::Config {
            name: "--step",
            reason: format!(
                "rank {} takes {steps} steps in epoch {}{} (steps 0 to {}), not {}",
                ask.rank,
                params.epoch,
                if ask.resumed { " after the resume" } else { "" },
                steps.saturating_sub(1),
                ask.step
            ),
        },
        ExplainError::BufferBytes { worker, position } => Error::Config {
            name: "--shuffle-buffer-bytes",
            reason: format!(
                "the samples worker {worker}'s shuffle buffer holds may pass {} bytes \
                 when sample {position} of its slot arrives (by their bytes at most, from \
                 their byte spans in the manifest), which lets a sample out early: which one \
                 depends on their \
                 bytes, so the plan alone cannot name this step's samples; the ledger \
                 (sample_ids=True) records what each step saw",
                options.stream().shuffle_buffer_bytes
            ),
        },
        ExplainError::CountsUnknown => Error::Config {
            name: "SPEC",
            reason: "the plan deals whole shards (sample counts unknown): index the \
                     dataset with `shardstream index`"
                .into(),
        },
        ExplainError::TooLong => Error::Config {
            name: "--pack",
            reason: format!(
                "a document holds more than {} tokens by the manifest's counts, more than \
                 explain lays out: the manifest does not describe these documents",
                pack::MAX_LAID_TOKENS
            ),
        },
    }
}

/// Where `shardstream write` takes its samples from.
enum WriteSource {
    /// A folder of files, with an optional labels file.
    Folder { labels: Option<PathBuf> },
    /// Parquet rows.
    Parquet {
        key_column: String,
        columns: Option<Vec<String>>,
    },
}

/// A progress bar over `total` samples.
fn sample_progress(total: u64) -> ProgressBar {
    let progress = ProgressBar::new(total).with_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} samples {per_sec} {msg}")
            .expect("valid template"),
    );
    progress.enable_steady_tick(Duration::from_millis(200));
    progress
}

fn write_shards(
    src: &std::path::Path,
    dest: &str,
    source: WriteSource,
    options: WriterOptions,
    out: &mut dyn Write,
) -> Result<()> {
    let mut writer = ShardWriter::new(dest, options)?;
    STOPS_WHEN_INTERRUPTED.store(true, Ordering::SeqCst);
    let mut notes = Vec::new();
    match source {
        WriteSource::Folder { labels } => {
            if !src.is_dir() {
                return Err(Error::Config {
                    name: "SRC",
                    reason: format!(
                        "{} is not a folder (Parquet input needs --key-column)",
                        src.display()
                    ),
                });
            }
            let folder = inputs::group_folder(src)?;
            let mut labels = match &labels {
                Some(path) => Some((path, inputs::read_labels(path)?)),
                None => None,
            };
            if let Some((path, labels)) = &labels {
                let keys: std::collections::HashSet<&str> =
                    folder.samples.iter().map(|(k, _)| k.as_str()).collect();
                if let Some((key, line)) = labels
                    .order
                    .iter()
                    .find(|(k, _)| !keys.contains(k.as_str()))
                {
                    return Err(Error::Config {
                        name: "--labels",
                        reason: format!(
                            "{} line {line}: key {key:?} has no files in {}",
                            path.display(),
                            src.display()
                        ),
                    });
                }
            }
            if folder.samples.is_empty() {
                return Err(Error::Config {
                    name: "SRC",
                    reason: format!("{} holds no files named KEY.EXTENSION", src.display()),
                });
            }
            let progress = sample_progress(folder.samples.len() as u64);
            let mut unlabelled = 0u64;
            for (key, files) in &folder.samples {
                let mut fields = Vec::with_capacity(files.len() + 1);
                for (field, path) in files {
                    let bytes = std::fs::read(path).map_err(|e| Error::Config {
                        name: "SRC",
                        reason: format!("cannot read {}: {e}", path.display()),
                    })?;
                    fields.push((field.clone(), FieldValue::Bytes(bytes)));
                }
                if let Some((_, labels)) = &mut labels {
                    match labels.by_key.remove(key) {
                        Some(label_fields) => fields.extend(label_fields),
                        None => unlabelled += 1,
                    }
                }
                check_interrupted()?;
                writer.write(key, fields)?;
                progress.inc(1);
            }
            progress.finish_and_clear();
            if !folder.skipped.is_empty() {
                notes.push(format!(
                    "{} files without an extension skipped (e.g. {})",
                    folder.skipped.len(),
                    folder.skipped[0].display()
                ));
            }
            if unlabelled > 0 {
                notes.push(format!("{unlabelled} samples have no labels"));
            }
        }
        WriteSource::Parquet {
            key_column,
            columns,
        } => {
            let files: Vec<PathBuf> = if src.is_dir() {
                let mut files: Vec<PathBuf> = std::fs::read_dir(src)
                    .map_err(|e| Error::Config {
                        name: "SRC",
                        reason: format!("cannot list {}: {e}", src.display()),
                    })?
                    .filter_map(|e| e.ok().map(|e| e.path()))
                    .filter(|p| crate::spec::is_parquet_name(&p.to_string_lossy()))
                    .collect();
                files.sort();
                files
            } else {
                vec![src.to_owned()]
            };
            if files.is_empty() {
                return Err(Error::Config {
                    name: "SRC",
                    reason: format!("{} holds no .parquet files", src.display()),
                });
            }
            let columns: Option<Vec<(String, String)>> = columns.map(|list| {
                list.iter()
                    .map(|c| match c.split_once('=') {
                        Some((field, column)) => (field.to_owned(), column.to_owned()),
                        None => (c.clone(), c.clone()),
                    })
                    .collect()
            });
            let progress = sample_progress(inputs::parquet_row_count(&files)?);
            inputs::parquet_rows(&files, &key_column, columns.as_deref(), |key, fields| {
                check_interrupted()?;
                writer.write(&key, fields)?;
                progress.inc(1);
                Ok(())
            })?;
            progress.finish_and_clear();
        }
    }
    writer.close()?;
    writeln!(
        out,
        "wrote {} samples into {} shards; manifest {}",
        writer.samples(),
        writer.shards(),
        writer.manifest_url()
    )?;
    for note in notes {
        writeln!(out, "note: {note}")?;
    }
    Ok(())
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        Error::Stopped(format!("cannot write output: {e}"))
    }
}

/// The manifest a command's `--manifest PATH` / `--no-manifest` choose:
/// that one, none, or the one beside the shards.
fn manifest_choice(manifest: Option<&std::path::Path>, no_manifest: bool) -> ManifestChoice {
    match (manifest, no_manifest) {
        (Some(path), _) => manifest::choice_of(&path.to_string_lossy()),
        (None, true) => ManifestChoice::Off,
        (None, false) => ManifestChoice::Auto,
    }
}
