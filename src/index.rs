//! Indexing a dataset into a manifest (`shardstream index`): several shards
//! streamed at once, each once, with progress shown, and a journal beside
//! the manifest so that an interrupted run resumes without reading again
//! the shards it had indexed.
//!
//! The shards are spread over `jobs` streams as the plan spreads them over
//! DataLoader workers (whole shards, balanced by bytes, in listed order), so
//! each is read sequentially with its read-ahead. When a shard is done its
//! entry is appended to the journal (one JSON line, flushed); a later run
//! over the same output takes the entries whose shard has the same URL,
//! size, ETag and modification time, and reads only the others. The journal
//! is removed once the manifest is written.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};

use crate::compression::Compression;
use crate::config::FieldDecoders;
use crate::config::{StoreOptions, StreamOptions};
use crate::dataset::resolve;
use crate::decode::Decoder;
use crate::error::{Error, Result};
use crate::format::Sample;
use crate::location::Location;
use crate::manifest::{self, Manifest, ManifestChoice, ShardEntry};
use crate::pipeline::{Event, SampleStream};
use crate::plan::SlotSpec;
use crate::shard::{Shard, ShardKind, ShardTokens};
use crate::spec::{is_parquet_name, DatasetFormat};
use crate::stats::{Counter, Counters};
use crate::text::pack::token_count;
use crate::text::tokenizer::TokenizerSpec;

/// What `--count-tokens` counts in each sample: the token ids of `field`,
/// made by `tokenizer` when one is given (a text field), or the ids the
/// field holds already (a list of ints or a 1-D integer array).
#[derive(Debug, Clone)]
pub struct TokenCounting {
    /// The field counted.
    pub field: String,
    /// The tokenizer of the field's text, if it is text.
    pub tokenizer: Option<Arc<TokenizerSpec>>,
}

impl TokenCounting {
    /// The tokenizer as a manifest records it (`None`: ids already).
    fn tokenizer_name(&self) -> Option<String> {
        self.tokenizer.as_ref().map(|t| t.to_string())
    }

    /// Whether `tokens` were counted this way.
    fn counted(&self, tokens: &ShardTokens) -> bool {
        tokens.field == self.field && tokens.tokenizer == self.tokenizer_name()
    }
}

/// Streams at once when none is asked for: enough to keep an object
/// store's bandwidth busy with each shard read sequentially.
pub const DEFAULT_JOBS: u16 = 8;

/// How an index run went, for the command line to report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexReport {
    /// Shards in the manifest.
    pub shards: usize,
    /// Of those, shards taken from an earlier run's journal (not read).
    pub resumed: usize,
    /// Samples in the manifest.
    pub samples: u64,
}

/// What watches an index run: told the bytes to read once, then, from any
/// thread, the bytes read so far and each shard done.
pub trait IndexProgress: Sync {
    /// The run reads `bytes` over `shards` shards.
    fn start(&self, shards: usize, bytes: u64);
    /// `bytes` of the shards have been read so far.
    fn read(&self, bytes: u64);
    /// One more shard is indexed.
    fn shard_done(&self);
}

/// Indexes the dataset of `specs` into a manifest at `output` (a path or a
/// supported URL), reading up to `jobs` shards at once and resuming from
/// the journal of an interrupted run over the same output. A local
/// `output` that cannot be written is refused first ([`check_output`]).
pub fn index_dataset(
    specs: &[String],
    format: DatasetFormat,
    output: &Path,
    store_options: &StoreOptions,
    jobs: usize,
    counting: Option<&TokenCounting>,
    progress: &dyn IndexProgress,
) -> Result<IndexReport> {
    check_output(output)?;
    let parquet = format == DatasetFormat::Parquet;
    if !matches!(
        format,
        DatasetFormat::Tar | DatasetFormat::Jsonl | DatasetFormat::Parquet
    ) {
        return Err(Error::Config {
            name: "--format",
            reason: format!(
                "a manifest describes tar, JSON-lines or Parquet shards, not {:?}",
                format.name()
            ),
        });
    }
    if parquet && counting.is_none() {
        return Err(Error::Config {
            name: "--count-tokens",
            reason: "a Parquet file's footer gives its row counts; its manifest entry records \
                     its rows' token counts, so `--format parquet` needs `--count-tokens FIELD`"
                .into(),
        });
    }
    // A dataset's resolution (as `StreamingDataset` and `plan` resolve):
    // braces, directories, prefixes, `hf://`, `gs://` and `http(s)://`,
    // with the same errors, a missing local shard among them, before any
    // shard is scanned. Listings keep the names of `format`; a Parquet
    // file named among tar or JSON-lines shards is refused (its footer
    // gives counts), and Parquet files become their row groups.
    let (mut shards, _) =
        resolve::resolve_indexed(specs, store_options, format, &ManifestChoice::Off, true)?;
    if !parquet {
        if let Some(parquet) = shards.iter().find(|s| is_parquet_name(&s.url)) {
            return Err(Error::Spec {
                spec: parquet.url.clone(),
                reason: "a manifest describes a Parquet file only with its rows' token counts \
                         (`--format parquet --count-tokens FIELD`); its footer gives its row \
                         counts"
                    .into(),
            });
        }
    }
    crate::store::describe_remote_objects(store_options, &mut shards)?;
    // One manifest entry per shard, or per Parquet file (its row groups).
    let mut files: Vec<Vec<usize>> = Vec::new();
    for (i, shard) in shards.iter().enumerate() {
        match (&shard.kind, files.last_mut()) {
            (ShardKind::Parquet(group), Some(last))
                if group.index > 0 && shards[last[0]].url == shard.url =>
            {
                last.push(i)
            }
            _ => files.push(vec![i]),
        }
    }
    let identities = files
        .iter()
        .map(|file| Identity::of(&shards[file[0]], output))
        .collect::<Result<Vec<_>>>()?;

    let journal_path = journal_path(output);
    let mut entries: Vec<Option<ShardEntry>> = vec![None; files.len()];
    let earlier = read_journal(&journal_path);
    let mut resumed = 0;
    for (slot, identity) in entries.iter_mut().zip(&identities) {
        let counted_alike = |e: &ShardEntry| match (counting, &e.tokens) {
            (None, None) => true,
            (Some(counting), Some(tokens)) => counting.counted(tokens),
            _ => false,
        };
        if let Some(entry) = earlier
            .iter()
            .find(|e| identity.matches(e) && counted_alike(e) && e.row_groups.is_some() == parquet)
        {
            *slot = Some(entry.clone());
            resumed += 1;
        }
    }
    let mut journal = Journal::create(&journal_path, entries.iter().flatten())?;
    // A Parquet file whose row groups hold no rows gives no piece to read
    // (the plan has nothing of it): its entry is made here.
    for (f, file) in files.iter().enumerate() {
        let groups: Vec<&Shard> = file.iter().map(|&i| &shards[i]).collect();
        let empty = |shard: &&Shard| matches!(&shard.kind, ShardKind::Parquet(g) if g.rows == 0);
        if entries[f].is_none() && parquet && groups.iter().all(empty) {
            let nothing = groups.iter().map(|_| ScannedShard::default()).collect();
            let entry = identities[f].parquet_entry(&groups, nothing, counting)?;
            journal.append(&entry)?;
            entries[f] = Some(entry);
        }
    }

    // The shards to read, each with its entry and its place in it (a row
    // group of no rows has nothing to read).
    let rows = |shard: &Shard| match &shard.kind {
        ShardKind::Parquet(group) => group.rows,
        _ => 1,
    };
    let todo: Vec<(usize, usize)> = (0..files.len())
        .filter(|&f| entries[f].is_none())
        .flat_map(|f| (0..files[f].len()).map(move |part| (f, part)))
        .filter(|&(f, part)| rows(&shards[files[f][part]]) > 0)
        .collect();
    let todo_shards: Vec<Shard> = todo
        .iter()
        .map(|&(f, part)| shards[files[f][part]].clone())
        .collect();
    // What each shard's pieces gave so far (a row group may come in
    // several); a shard is done once its pieces hold its rows (one piece
    // for a tar or JSON-lines shard, which the plan never cuts here).
    let mut parts: Vec<Vec<Vec<ScannedShard>>> = files
        .iter()
        .map(|file| file.iter().map(|_| Vec::new()).collect())
        .collect();
    let whole = |shard: &Shard, pieces: &[ScannedShard]| match &shard.kind {
        ShardKind::Parquet(group) => {
            pieces.iter().map(|p| p.tokens.len() as u64).sum::<u64>() >= group.rows
        }
        _ => !pieces.is_empty(),
    };
    let scan = Scan {
        store_options,
        jobs,
        counting,
        progress,
    };
    scan.run(&todo_shards, |scanned| {
        let (f, part) = todo[scanned.shard];
        parts[f][part].push(scanned);
        let done =
            |(part, pieces): (usize, &Vec<ScannedShard>)| whole(&shards[files[f][part]], pieces);
        if !done((part, &parts[f][part])) {
            return Ok(false);
        }
        if !parts[f].iter().enumerate().all(done) {
            return Ok(true);
        }
        let scanned: Vec<ScannedShard> = parts[f]
            .iter_mut()
            .map(|pieces| {
                pieces.sort_by_key(|p| p.first);
                let mut joined = pieces.drain(..).reduce(|mut a, b| {
                    a.offsets.extend(b.offsets);
                    a.lengths.extend(b.lengths);
                    a.tokens.extend(b.tokens);
                    a
                });
                joined.take().unwrap_or_default()
            })
            .collect();
        let entry = if parquet {
            let groups: Vec<&Shard> = files[f].iter().map(|&i| &shards[i]).collect();
            identities[f].parquet_entry(&groups, scanned, counting)?
        } else {
            let scanned = scanned.into_iter().next().expect("one part per shard");
            identities[f].entry(scanned, counting)
        };
        journal.append(&entry)?;
        entries[f] = Some(entry);
        Ok(true)
    })?;

    if let Some(f) = entries.iter().position(Option::is_none) {
        return Err(Error::Stopped(format!(
            "{} was not read through: the manifest is not written",
            shards[files[f][0]].url
        )));
    }
    let entries: Vec<ShardEntry> = entries.into_iter().flatten().collect();
    let samples = entries.iter().map(|e| e.samples).sum();
    let manifest = Manifest::new(entries);
    let target = output.to_string_lossy();
    if target.contains("://") && !target.starts_with("file://") {
        crate::store::write_small_object(store_options, &target, manifest.to_json().into_bytes())?;
    } else {
        manifest.save(output)?;
    }
    drop(journal);
    // The manifest holds it all now; a journal left behind is only stale.
    let _ = std::fs::remove_file(&journal_path);
    Ok(IndexReport {
        shards: files.len(),
        resumed,
        samples,
    })
}

/// The manifest entries of the shards of `shards` at `positions`, each read
/// through once, up to `jobs` at once: what `shardstream index` records for
/// them, with their URLs as listed (`count_samples=True` on remote shards).
pub fn index_shards(
    shards: &[Shard],
    positions: &[usize],
    store_options: &StoreOptions,
    jobs: usize,
) -> Result<Vec<ShardEntry>> {
    let mut picked: Vec<Shard> = positions.iter().map(|&i| shards[i].clone()).collect();
    // A remote shard named outright (not listed) has no size yet.
    if picked.iter().any(|shard| shard.size.is_none()) {
        crate::store::describe_remote_objects(store_options, &mut picked)?;
    }
    let identities = picked
        .iter()
        .map(|shard| {
            Ok(Identity {
                url: shard.url.clone(),
                ..Identity::of(shard, Path::new(""))?
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let mut entries: Vec<Option<ShardEntry>> = vec![None; picked.len()];
    let scan = Scan {
        store_options,
        jobs,
        counting: None,
        progress: &Silent,
    };
    scan.run(&picked, |scanned| {
        let at = scanned.shard;
        entries[at] = Some(identities[at].entry(scanned, None));
        Ok(true)
    })?;
    Ok(entries.into_iter().flatten().collect())
}

/// Progress nobody watches.
pub(crate) struct Silent;

impl IndexProgress for Silent {
    fn start(&self, _shards: usize, _bytes: u64) {}
    fn read(&self, _bytes: u64) {}
    fn shard_done(&self) {}
}

/// Refuses a local manifest path `output` that the run could not write at
/// its end: a directory (or a path ending in `/`), a path whose folder is
/// missing or is not a folder, or a folder this process cannot create a
/// file in (tried with a file of its own, removed at once). The error
/// names the `--output` option and what is wrong. URLs are let be.
pub fn check_output(output: &Path) -> Result<()> {
    let target = output.to_string_lossy();
    if target.contains("://") && !target.starts_with("file://") {
        return Ok(());
    }
    let local = Path::new(target.strip_prefix("file://").unwrap_or(&target));
    let bad = |reason: String| Error::Config {
        name: "--output",
        reason,
    };
    if target.ends_with('/') || local.is_dir() {
        let folder = target.trim_end_matches('/');
        return Err(bad(format!(
            "{folder}/ is a directory; name the manifest file, e.g. {folder}/manifest.json \
             (beside the shards is where datasets find it)"
        )));
    }
    let folder = match local.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    };
    match std::fs::metadata(folder) {
        Ok(meta) if meta.is_dir() => {}
        Ok(_) => {
            return Err(bad(format!(
                "{} is not a directory: write the manifest into a folder",
                folder.display()
            )))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(bad(format!(
                "{} does not exist: create it first, or write the manifest elsewhere",
                folder.display()
            )))
        }
        Err(e) => {
            return Err(bad(format!("cannot read {}: {e}", folder.display())));
        }
    }
    let name = local.file_name().unwrap_or_default().to_string_lossy();
    let probe = folder.join(format!(".{name}.{}.check", std::process::id()));
    let created = OpenOptions::new().write(true).create_new(true).open(&probe);
    match created {
        Ok(file) => {
            drop(file);
            let _ = std::fs::remove_file(&probe);
            Ok(())
        }
        // Another run's probe of the same name: the folder takes files.
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(bad(format!(
            "cannot write in {}: {e}; write the manifest where you can create files",
            folder.display()
        ))),
    }
}

/// Where the journal of an index run writing `output` lives: beside a local
/// manifest, `<manifest>.partial`; for a manifest written to a URL, in the
/// working directory, named after the URL.
pub fn journal_path(output: &Path) -> PathBuf {
    let target = output.to_string_lossy();
    if target.contains("://") && !target.starts_with("file://") {
        let name: String = target
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '.' || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        PathBuf::from(format!("shardstream-index-{name}.partial"))
    } else {
        let local = target.strip_prefix("file://").map_or(output, Path::new);
        let mut name = local.as_os_str().to_owned();
        name.push(".partial");
        PathBuf::from(name)
    }
}

/// What identifies a shard's content between runs: the fields of its
/// manifest entry that do not come from reading it.
struct Identity {
    url: String,
    size: u64,
    etag: Option<String>,
    mtime_ns: Option<u64>,
}

impl Identity {
    fn of(shard: &Shard, output: &Path) -> Result<Self> {
        let mtime_ns = match shard.location() {
            Location::Local(path) => manifest::mtime_ns(&path),
            Location::S3 { .. } | Location::Http(_) => None,
        };
        let size = match &shard.kind {
            ShardKind::Parquet(group) => Some(group.file_size),
            _ => shard.size,
        };
        let size = size.ok_or_else(|| Error::NotFound {
            url: shard.url.clone(),
            source: std::io::ErrorKind::NotFound.into(),
        })?;
        Ok(Identity {
            url: manifest::entry_url(shard, output),
            size,
            etag: shard.etag.clone(),
            mtime_ns,
        })
    }

    /// Whether a journal entry describes this very shard: the same URL,
    /// size, ETag and modification time (a shard without either validator
    /// is read again).
    fn matches(&self, entry: &ShardEntry) -> bool {
        (self.etag.is_some() || self.mtime_ns.is_some())
            && entry.url == self.url
            && entry.size == self.size
            && entry.etag == self.etag
            && entry.mtime_ns == self.mtime_ns
    }

    fn entry(&self, scanned: ScannedShard, counting: Option<&TokenCounting>) -> ShardEntry {
        let tokens = counting.map(|counting| ShardTokens {
            field: counting.field.clone(),
            tokenizer: counting.tokenizer_name(),
            counts: scanned.tokens,
        });
        ShardEntry {
            url: self.url.clone(),
            size: self.size,
            etag: self.etag.clone(),
            mtime_ns: self.mtime_ns,
            compression: scanned.compression,
            samples: scanned.offsets.len() as u64,
            offsets: scanned.offsets,
            lengths: scanned.lengths,
            tokens,
            row_groups: None,
        }
    }
}

impl Identity {
    /// The entry of a Parquet file from its row groups `groups` (in
    /// order) and what reading each gave: the rows of each row group and
    /// their token counts. An error when a row group gave another number
    /// of rows than its footer says.
    fn parquet_entry(
        &self,
        groups: &[&Shard],
        scanned: Vec<ScannedShard>,
        counting: Option<&TokenCounting>,
    ) -> Result<ShardEntry> {
        let mut rows = Vec::with_capacity(groups.len());
        let mut counts = Vec::new();
        for (shard, part) in groups.iter().zip(scanned) {
            let ShardKind::Parquet(group) = &shard.kind else {
                unreachable!("a Parquet file's entry is of its row groups")
            };
            if part.tokens.len() as u64 != group.rows {
                return Err(Error::ManifestMismatch {
                    url: shard.url.clone(),
                    reason: format!(
                        "row group {} gave {} rows, its footer says {}",
                        group.index,
                        part.tokens.len(),
                        group.rows
                    ),
                });
            }
            rows.push(group.rows);
            counts.extend(part.tokens);
        }
        let samples = rows.iter().sum();
        let tokens = counting.map(|counting| ShardTokens {
            field: counting.field.clone(),
            tokenizer: counting.tokenizer_name(),
            counts,
        });
        Ok(ShardEntry {
            url: self.url.clone(),
            size: self.size,
            etag: self.etag.clone(),
            mtime_ns: self.mtime_ns,
            compression: None,
            samples,
            offsets: Vec::new(),
            lengths: Vec::new(),
            tokens,
            row_groups: Some(rows),
        })
    }
}

/// The entries of an earlier run's journal: every line that is a whole,
/// consistent entry, up to the first that is not (a run stopped while
/// writing one leaves a cut line). No journal, no entries.
fn read_journal(path: &Path) -> Vec<ShardEntry> {
    let Ok(file) = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
    else {
        return Vec::new();
    };
    let mut entries = Vec::new();
    for line in BufReader::new(file).lines() {
        let Ok(line) = line else { break };
        match serde_json::from_str::<ShardEntry>(&line) {
            Ok(entry) if entry.check().is_ok() => entries.push(entry),
            _ => break,
        }
    }
    entries
}

/// The journal being written: one JSON line per shard indexed, each flushed
/// as soon as the shard is done.
struct Journal {
    file: File,
    path: PathBuf,
}

impl Journal {
    /// Starts the journal anew at `path` with the `kept` entries of an
    /// earlier run (written to a new file, then renamed over the old one,
    /// so a cut line of the earlier run is gone).
    fn create<'a>(path: &Path, kept: impl Iterator<Item = &'a ShardEntry>) -> Result<Self> {
        let fresh = {
            let mut name = path.as_os_str().to_owned();
            name.push(".new");
            PathBuf::from(name)
        };
        let io = |e: std::io::Error| journal_error(path, e);
        // A new file of our own (`O_EXCL`: never through a link planted
        // there), renamed over the journal (a link itself is replaced).
        let _ = std::fs::remove_file(&fresh);
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&fresh)
            .map_err(io)?;
        for entry in kept {
            writeln!(file, "{}", journal_line(entry)).map_err(io)?;
        }
        file.flush().map_err(io)?;
        std::fs::rename(&fresh, path).map_err(io)?;
        Ok(Journal {
            file,
            path: path.to_owned(),
        })
    }

    fn append(&mut self, entry: &ShardEntry) -> Result<()> {
        writeln!(self.file, "{}", journal_line(entry))
            .and_then(|()| self.file.flush())
            .map_err(|e| journal_error(&self.path, e))
    }
}

/// A failure to write the journal at `path`: the run stops, since it could
/// not resume from what it has indexed.
fn journal_error(path: &Path, error: std::io::Error) -> Error {
    Error::Write {
        url: path.display().to_string(),
        offset: 0,
        reason: format!("the index journal cannot be written: {error}"),
    }
}

fn journal_line(entry: &ShardEntry) -> String {
    serde_json::to_string(entry).expect("a manifest entry serialises")
}

/// One shard, or a piece of one, read through: its samples' spans, token
/// counts (when counted) and its compression. A Parquet row group, whose
/// rows the plan knows, may come in pieces from several streams.
#[derive(Default)]
struct ScannedShard {
    /// Index of the shard in the list scanned.
    shard: usize,
    /// Index in the shard of the piece's first sample.
    first: u64,
    offsets: Vec<u64>,
    lengths: Vec<u64>,
    tokens: Vec<u64>,
    compression: Option<Compression>,
}

/// A scan of shards through: the stores' settings, the streams at once,
/// what to count and who watches.
struct Scan<'a> {
    store_options: &'a StoreOptions,
    jobs: usize,
    counting: Option<&'a TokenCounting>,
    progress: &'a dyn IndexProgress,
}

impl Scan<'_> {
    /// Reads `shards` through, up to `jobs` at once, and hands each one
    /// (or piece of one) done to `done` (on the calling thread, in the
    /// order they finish), which says whether it finished a shard (for the
    /// progress shown). The first error stops every stream and is returned.
    fn run(
        &self,
        shards: &[Shard],
        mut done: impl FnMut(ScannedShard) -> Result<bool>,
    ) -> Result<()> {
        let progress = self.progress;
        progress.start(shards.len(), shards.iter().filter_map(|s| s.size).sum());
        if shards.is_empty() {
            return Ok(());
        }
        let jobs = self.jobs.clamp(1, shards.len());
        let options = scan_options(self.store_options, self.counting)?;
        let counters = Arc::new(Counters::new());
        let stop = AtomicBool::new(false);
        let (sender, receiver) = mpsc::channel::<Result<ScannedShard>>();
        std::thread::scope(|scope| {
            for job in 0..jobs {
                let sender = sender.clone();
                let slot = SlotStream {
                    shards,
                    options: &options,
                    counters: &counters,
                    stop: &stop,
                    field: self.counting.map(|c| c.field.as_str()),
                    progress,
                };
                scope.spawn(move || {
                    if let Err(e) = slot.scan(jobs, job, &sender) {
                        let _ = sender.send(Err(e));
                    }
                });
            }
            drop(sender);
            let mut outcome = Ok(());
            for message in receiver {
                if outcome.is_err() {
                    continue;
                }
                outcome = message.and_then(&mut done).map(|finished| {
                    if finished {
                        progress.shard_done();
                    }
                });
                if outcome.is_err() {
                    stop.store(true, Ordering::SeqCst);
                }
            }
            outcome
        })
    }
}

/// What one stream of a scan shares with the others.
#[derive(Clone, Copy)]
struct SlotStream<'a> {
    shards: &'a [Shard],
    options: &'a StreamOptions,
    counters: &'a Arc<Counters>,
    stop: &'a AtomicBool,
    /// The field whose tokens are counted, if any.
    field: Option<&'a str>,
    progress: &'a dyn IndexProgress,
}

impl SlotStream<'_> {
    /// Streams the shards the plan gives worker `job` of `jobs`, sending
    /// each one as it is done; returns early, without error, once `stop` is
    /// set.
    fn scan(
        self,
        jobs: usize,
        job: usize,
        sender: &mpsc::Sender<Result<ScannedShard>>,
    ) -> Result<()> {
        let slot = SlotSpec::new(1, 0, jobs, job)?;
        let mut stream = SampleStream::new(
            self.shards,
            self.options,
            0,
            slot,
            self.counters.clone(),
            None,
        )?;
        let order: Vec<(usize, u64)> = stream
            .units()
            .iter()
            .map(|unit| (unit.shard, unit.samples.as_ref().map_or(0, |s| s.start)))
            .collect();
        let mut next = 0;
        let mut scanned = ScannedShard::default();
        let finish =
            |(shard, first): (usize, u64), scanned: &mut ScannedShard, stream: &SampleStream| {
                let done = ScannedShard {
                    shard,
                    first,
                    offsets: std::mem::take(&mut scanned.offsets),
                    lengths: std::mem::take(&mut scanned.lengths),
                    tokens: std::mem::take(&mut scanned.tokens),
                    compression: stream.shard_compression(shard),
                };
                sender.send(Ok(done)).is_ok()
            };
        while let Some(event) = stream.next() {
            if self.stop.load(Ordering::SeqCst) {
                return Ok(());
            }
            let sample = scanned_sample(event)?;
            // Shards before this sample's are done (an empty one too).
            while order
                .get(next)
                .is_some_and(|&(shard, _)| shard != sample.id.shard)
            {
                if !finish(order[next], &mut scanned, &stream) {
                    return Ok(());
                }
                next += 1;
            }
            scanned.offsets.push(sample.offset);
            scanned.lengths.push(sample.length);
            if let Some(field) = self.field {
                scanned.tokens.push(token_count(&sample, field)? as u64);
            }
            self.progress
                .read(self.counters.snapshot().get(Counter::BytesRead));
        }
        while next < order.len() {
            if !finish(order[next], &mut scanned, &stream) {
                return Ok(());
            }
            next += 1;
        }
        self.progress
            .read(self.counters.snapshot().get(Counter::BytesRead));
        Ok(())
    }
}

/// The stream options of a scan of shards through: listed order, no
/// shuffle buffer, the given S3 settings, and, when tokens are counted,
/// the counted field decoded alone: by the tokenizer, or else by its
/// extension (a `.npy` of ids becomes an array); the other fields stay
/// bytes.
pub fn scan_options(
    store_options: &StoreOptions,
    counting: Option<&TokenCounting>,
) -> Result<StreamOptions> {
    let builder = StreamOptions::builder()
        .with_shuffle_shards(false)
        .with_shuffle_buffer(0)
        .with_store(store_options.clone());
    let builder = match counting {
        None => builder,
        Some(counting) => {
            let decoder = match &counting.tokenizer {
                Some(spec) => Some(Decoder::Tokenizer(spec.clone())),
                None => crate::decode::default_for(&counting.field),
            };
            builder.with_decode(FieldDecoders {
                by_field: decoder
                    .map(|decoder| (counting.field.clone(), decoder))
                    .into_iter()
                    .collect(),
                defaults: false,
            })
        }
    };
    builder.build()
}

/// The sample an event of a scan carries: a shard skipped is its error
/// here, and Arrow batches are not for the command line.
pub fn scanned_sample(event: Result<Event>) -> Result<Sample> {
    match event? {
        Event::Sample(sample) => Ok(sample),
        Event::Skipped(error) => Err(error),
        Event::Batch(table) => Err(Error::Stopped(format!(
            "{}: Arrow batches are not for the command line",
            table.url
        ))),
    }
}
