//! Writing WebDataset shards: samples in, tar shards out (plain, gzip or
//! zstd), locally or to S3, rolling over to the next shard at a sample
//! count or byte size, with the manifest `shardstream index` would write
//! kept up to date beside them after every completed shard.
//!
//! A shard is only ever seen whole: a local shard is written under a
//! temporary name and renamed when complete; an S3 shard is a multipart
//! upload completed at its end. A shard that is not completed (an error, an
//! [`ShardWriter::abort`], a writer dropped without
//! [`ShardWriter::close`]) is removed or its upload aborted; the completed
//! shards and the manifest describing exactly them stay.

mod encode;
#[cfg(feature = "cli")]
pub mod inputs;
mod pattern;
mod sink;

use std::collections::HashSet;
use std::io::Write;
use std::sync::Arc;

pub use encode::{check_field, check_key, python_float_json, python_float_text, FieldValue};
pub use pattern::{Destination, ShardPattern};
pub use sink::forked_reason;

use crate::compression::Compression;
use crate::config::StoreOptions;
use crate::error::{Error, Result};
use crate::manifest::{Manifest, ShardEntry};
use encode::invalid;
use sink::{S3Target, Sink};

/// Size of a tar block.
const BLOCK: u64 = 512;
/// The end-of-archive marker: two zero blocks.
const END_OF_ARCHIVE: u64 = 2 * BLOCK;
/// The longest member name held in a GNU header itself; a longer one goes
/// in a long-name entry before it.
const GNU_NAME_BYTES: usize = 100;

/// How the writer cuts and stores shards.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriterOptions {
    /// Samples per shard, at most.
    pub max_count: Option<u64>,
    /// Tar bytes per shard (before compression, headers and end marker
    /// included), at most, unless one sample alone is larger.
    pub max_bytes: Option<u64>,
    /// How shards are compressed (`None`: as the pattern's suffix says).
    pub compression: Option<Compression>,
    /// How to reach S3 (its `part_size` is the upload's part size, at least 5 MiB).
    pub store: StoreOptions,
}

impl Default for WriterOptions {
    /// webdataset's defaults: 100 000 samples or 3 GB per shard.
    fn default() -> Self {
        WriterOptions {
            max_count: Some(100_000),
            max_bytes: Some(3_000_000_000),
            compression: None,
            store: StoreOptions::default(),
        }
    }
}

/// The tar bytes one member takes: its header (and a long-name entry when
/// its name does not fit the header), its data and the data's padding.
fn member_bytes(name_len: usize, data_len: usize) -> u64 {
    let padded = |n: u64| n.div_ceil(BLOCK) * BLOCK;
    let long_name = if name_len > GNU_NAME_BYTES {
        BLOCK + padded(name_len as u64 + 1)
    } else {
        0
    };
    long_name + BLOCK + padded(data_len as u64)
}

/// Where the tar bytes of the open shard go (through its compressor), and
/// how many have gone.
enum Encoder {
    Plain(Sink),
    Gzip(flate2::write::GzEncoder<Sink>),
    Zstd(zstd::stream::write::Encoder<'static, Sink>),
}

impl Encoder {
    fn new(sink: Sink, compression: Option<Compression>) -> std::io::Result<Self> {
        Ok(match compression {
            None => Encoder::Plain(sink),
            Some(Compression::Gzip) => Encoder::Gzip(flate2::write::GzEncoder::new(
                sink,
                flate2::Compression::default(),
            )),
            Some(Compression::Zstd) => Encoder::Zstd(zstd::stream::write::Encoder::new(sink, 3)?),
        })
    }

    fn sink_mut(&mut self) -> &mut Sink {
        match self {
            Encoder::Plain(s) => s,
            Encoder::Gzip(e) => e.get_mut(),
            Encoder::Zstd(e) => e.get_mut(),
        }
    }

    /// Ends the compressed stream; gives back the sink.
    fn finish(self) -> std::io::Result<Sink> {
        match self {
            Encoder::Plain(s) => Ok(s),
            Encoder::Gzip(e) => e.finish(),
            Encoder::Zstd(e) => e.finish(),
        }
    }
}

impl Write for Encoder {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        match self {
            Encoder::Plain(s) => s.write(bytes),
            Encoder::Gzip(e) => e.write(bytes),
            Encoder::Zstd(e) => e.write(bytes),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Encoder::Plain(s) => s.flush(),
            Encoder::Gzip(e) => e.flush(),
            Encoder::Zstd(e) => e.flush(),
        }
    }
}

/// The tar stream of the open shard, counting its (uncompressed) bytes:
/// the sample offsets of the manifest.
struct Counted {
    inner: Encoder,
    position: u64,
}

impl Write for Counted {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(bytes)?;
        self.position += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// The shard being written.
struct OpenShard {
    url: String,
    tar: tar::Builder<Counted>,
    offsets: Vec<u64>,
    lengths: Vec<u64>,
}

impl OpenShard {
    /// Bytes of tar written so far.
    fn position(&self) -> u64 {
        self.tar.get_ref().position
    }

    /// Leaves nothing of the shard behind (see [`Sink::poison`]).
    fn abandon(mut self) {
        self.tar.get_mut().inner.sink_mut().poison();
        drop(self);
    }
}

/// Where the writer is in its life.
#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    Open,
    Closed,
    /// A write failed; the message says how.
    Failed(String),
}

/// The error of an I/O failure of shard `url` at `offset`: the crate's
/// error when one travels inside it (a failed upload), else a write error.
fn io_error(url: &str, offset: u64, e: std::io::Error) -> Error {
    let reason = e.to_string();
    match e.into_inner().map(|inner| inner.downcast::<Error>()) {
        Some(Ok(error)) => *error,
        _ => Error::Write {
            url: url.to_owned(),
            offset,
            reason,
        },
    }
}

/// Writes samples into shards named by a pattern; see the module docs.
pub struct ShardWriter {
    pattern: ShardPattern,
    options: WriterOptions,
    s3: Option<Arc<S3Target>>,
    open: Option<OpenShard>,
    next_number: u64,
    /// Every key written, so that none is written twice.
    keys: HashSet<String>,
    /// The manifest entries of the completed shards.
    entries: Vec<ShardEntry>,
    samples: u64,
    state: State,
    /// The modification time of every member (the writer's start).
    mtime: u64,
    /// The process the writer was made in (`std::process::id`): a forked
    /// child shares its open files and must neither write nor remove them.
    pid: u32,
}

/// Writes `manifest` to `url`: a local path or `file://` URL (under a
/// temporary name, synced and renamed into place) or an `s3://` URL (one
/// `PutObject`, with the retries of `s3`).
pub fn write_manifest(url: &str, manifest: &Manifest, store_options: &StoreOptions) -> Result<()> {
    let json = manifest.to_json().into_bytes();
    if url.contains("://") && !url.starts_with("file://") {
        return crate::store::write_small_object(store_options, url, json);
    }
    let path = std::path::Path::new(url.strip_prefix("file://").unwrap_or(url));
    // A bare file name is in the current directory, which is synced.
    let path = match path.parent() {
        Some(dir) if dir.as_os_str().is_empty() => std::path::Path::new(".").join(path),
        _ => path.to_path_buf(),
    };
    sink::put_whole(None, "", &path.display().to_string(), json)
}

impl ShardWriter {
    /// A writer of shards named by `pattern` (`out/shard-%06d.tar`,
    /// `s3://bucket/prefix/shard-%06d.tar`); checks the pattern and options,
    /// and makes the local directory if it is missing.
    pub fn new(pattern: &str, options: WriterOptions) -> Result<Self> {
        for (name, value) in [
            ("max_count", options.max_count),
            ("max_bytes", options.max_bytes),
        ] {
            if value == Some(0) {
                return Err(Error::Config {
                    name,
                    reason: "must be at least 1 (or None for no limit)".into(),
                });
            }
        }
        options.store.validate()?;
        let pattern = ShardPattern::parse(pattern, options.compression)?;
        let s3 = match &pattern.destination {
            Destination::Local { dir } => {
                std::fs::create_dir_all(dir).map_err(|e| Error::Write {
                    url: dir.display().to_string(),
                    offset: 0,
                    reason: format!("cannot make the directory: {e}"),
                })?;
                None
            }
            Destination::S3 { .. } => {
                // Worker threads carry the parts in flight while the
                // writer's thread fills the next one.
                let runtime = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .thread_name("shardstream-upload")
                    .enable_all()
                    .build()
                    .map_err(|e| Error::Stopped(format!("cannot start the I/O runtime: {e}")))?;
                let client = runtime.block_on(crate::store::s3::S3Client::new(&options.store));
                let target = S3Target {
                    runtime: Arc::new(runtime),
                    client: Arc::new(client),
                    pid: std::process::id(),
                };
                if let Destination::S3 { bucket, .. } = &pattern.destination {
                    sink::check_bucket(&target, bucket)?;
                }
                Some(Arc::new(target))
            }
        };
        let mtime = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        Ok(ShardWriter {
            pattern,
            options,
            s3,
            open: None,
            next_number: 0,
            keys: HashSet::new(),
            entries: Vec::new(),
            samples: 0,
            state: State::Open,
            mtime,
            pid: std::process::id(),
        })
    }

    /// Samples written (those of the open shard included).
    pub fn samples(&self) -> u64 {
        self.samples
    }

    /// URLs of the completed shards, in order.
    pub fn shard_urls(&self) -> Vec<String> {
        self.entries
            .iter()
            .map(|e| match &self.pattern.destination {
                Destination::Local { dir } => dir.join(&e.url).display().to_string(),
                Destination::S3 { .. } => e.url.clone(),
            })
            .collect()
    }

    /// Where the manifest goes: a local path or an `s3://` URL.
    pub fn manifest_url(&self) -> String {
        match &self.pattern.destination {
            Destination::Local { .. } => self.pattern.manifest_name(),
            Destination::S3 { bucket, .. } => {
                format!("s3://{bucket}/{}", self.pattern.manifest_name())
            }
        }
    }

    /// Shards completed.
    pub fn shards(&self) -> usize {
        self.entries.len()
    }

    /// How shards are compressed.
    pub fn compression(&self) -> Option<Compression> {
        self.pattern.compression
    }

    /// Whether this process is a child forked from the writer's.
    fn forked(&self) -> bool {
        std::process::id() != self.pid
    }

    fn usable(&self) -> Result<()> {
        if self.forked() {
            return Err(Error::Write {
                url: self
                    .open
                    .as_ref()
                    .map_or_else(|| self.manifest_url(), |open| open.url.clone()),
                offset: 0,
                reason: forked_reason(self.pid),
            });
        }
        match &self.state {
            State::Open => Ok(()),
            State::Closed => Err(Error::Stopped("the shard writer is closed".into())),
            State::Failed(why) => Err(Error::Stopped(format!(
                "the shard writer stopped after an earlier failure ({why}); its completed shards and manifest are kept"
            ))),
        }
    }

    /// Writes one sample: checks its key and field names, encodes its
    /// values (see [`FieldValue`]), and appends its members to the open
    /// shard, first completing that shard when the sample would take it
    /// past a limit. A sample refused for its key, names or values leaves
    /// the writer as it was.
    pub fn write(&mut self, key: &str, fields: Vec<(String, FieldValue)>) -> Result<()> {
        self.usable()?;
        check_key(key)?;
        if fields.is_empty() {
            return Err(invalid(
                Some(key),
                None,
                "a sample needs a field besides __key__ (a key alone writes no tar member)".into(),
            ));
        }
        for (i, (field, _)) in fields.iter().enumerate() {
            check_field(key, field)?;
            if fields[..i].iter().any(|(f, _)| f == field) {
                return Err(invalid(
                    Some(key),
                    Some(field),
                    "the field is given twice".into(),
                ));
            }
        }
        if self.keys.contains(key) {
            return Err(invalid(
                Some(key),
                None,
                "this key was already written by this writer: readers would merge the two samples or yield two with one key".into(),
            ));
        }
        let mut members = Vec::with_capacity(fields.len());
        for (field, value) in fields {
            let data = encode::encode(key, &field, value)?;
            members.push((format!("{key}.{field}"), data));
        }
        let sample_bytes: u64 = members
            .iter()
            .map(|(n, d)| member_bytes(n.len(), d.len()))
            .sum();
        if let Some(open) = &self.open {
            let full_count = self
                .options
                .max_count
                .is_some_and(|n| open.offsets.len() as u64 >= n);
            let full_bytes = self
                .options
                .max_bytes
                .is_some_and(|n| open.position() + sample_bytes + END_OF_ARCHIVE > n);
            if full_count || full_bytes {
                self.finish_shard()?;
            }
        }
        if self.open.is_none() {
            self.start_shard()?;
        }
        let open = self.open.as_mut().expect("a shard is open");
        let start = open.position();
        let mut written = Ok(());
        for (name, data) in &members {
            let mut header = tar::Header::new_gnu();
            header.set_size(data.len() as u64);
            header.set_mode(0o444);
            header.set_mtime(self.mtime);
            header.set_uid(0);
            header.set_gid(0);
            header.set_entry_type(tar::EntryType::Regular);
            written = header
                .set_username("bigdata")
                .and_then(|()| header.set_groupname("bigdata"))
                .and_then(|()| open.tar.append_data(&mut header, name, data.as_slice()));
            if written.is_err() {
                break;
            }
        }
        if let Err(e) = written {
            let error = io_error(&open.url, open.position(), e);
            self.fail(&error);
            return Err(error);
        }
        let end = open.position();
        debug_assert_eq!(end - start, sample_bytes, "member sizes as predicted");
        open.offsets.push(start);
        open.lengths.push(end - start);
        self.keys.insert(key.to_owned());
        self.samples += 1;
        Ok(())
    }

    fn start_shard(&mut self) -> Result<()> {
        let number = self.next_number;
        let name = self.pattern.name(number);
        let sink = match (&self.pattern.destination, &self.s3) {
            (Destination::S3 { bucket, .. }, Some(target)) => Sink::s3(
                target.clone(),
                bucket,
                &name,
                self.options.store.transport.part_size,
            ),
            _ => Sink::local(std::path::Path::new(&name))?,
        };
        let url = self.pattern.url(number);
        let encoder =
            Encoder::new(sink, self.pattern.compression).map_err(|e| io_error(&url, 0, e))?;
        self.open = Some(OpenShard {
            url,
            tar: tar::Builder::new(Counted {
                inner: encoder,
                position: 0,
            }),
            offsets: Vec::new(),
            lengths: Vec::new(),
        });
        self.next_number += 1;
        Ok(())
    }

    /// Completes the open shard (end marker, compressor, rename or upload)
    /// and rewrites the manifest with it.
    fn finish_shard(&mut self) -> Result<()> {
        let Some(open) = self.open.take() else {
            return Ok(());
        };
        let OpenShard {
            url,
            tar,
            offsets,
            lengths,
        } = open;
        let position = tar.get_ref().position;
        let stored = tar
            .into_inner()
            .and_then(|counted| counted.inner.finish())
            .map_err(|e| io_error(&url, position, e))
            .and_then(Sink::commit);
        let stored = match stored {
            Ok(stored) => stored,
            Err(error) => {
                self.fail(&error);
                return Err(error);
            }
        };
        let entry_url = match &self.pattern.destination {
            Destination::Local { .. } => std::path::Path::new(&url)
                .file_name()
                .map_or_else(|| url.clone(), |n| n.to_string_lossy().into_owned()),
            Destination::S3 { .. } => url.clone(),
        };
        self.entries.push(ShardEntry {
            url: entry_url,
            size: stored.size,
            etag: stored.etag,
            mtime_ns: stored.mtime_ns,
            compression: self.pattern.compression,
            samples: offsets.len() as u64,
            offsets,
            lengths,
            tokens: None,
            row_groups: None,
        });
        if let Err(error) = self.save_manifest() {
            self.fail(&error);
            return Err(error);
        }
        Ok(())
    }

    /// The manifest of the completed shards as JSON: what `manifest.json`
    /// beside them holds.
    pub fn manifest_json(&self) -> String {
        Manifest::new(self.entries.clone()).to_json()
    }

    /// Writes the manifest of the completed shards beside them.
    fn save_manifest(&self) -> Result<()> {
        let json = self.manifest_json();
        let bucket = match &self.pattern.destination {
            Destination::S3 { bucket, .. } => bucket.as_str(),
            Destination::Local { .. } => "",
        };
        sink::put_whole(
            self.s3.as_deref(),
            bucket,
            &self.pattern.manifest_name(),
            json.into_bytes(),
        )
    }

    /// Abandons the open shard and refuses later writes.
    fn fail(&mut self, error: &Error) {
        if let Some(open) = self.open.take() {
            open.abandon();
        }
        self.state = State::Failed(error.to_string());
    }

    /// Completes the open shard and the manifest; later writes are refused.
    /// Closing again does nothing.
    pub fn close(&mut self) -> Result<()> {
        if self.state == State::Closed {
            return Ok(());
        }
        self.usable()?;
        let result = self.finish_shard();
        if result.is_ok() {
            self.state = State::Closed;
        }
        result
    }

    /// Abandons the open shard (its temporary file removed, or its upload
    /// aborted), keeping the completed shards and their manifest; later
    /// writes are refused.
    pub fn abort(&mut self) {
        if self.forked() {
            // The open shard's file and upload are the parent's: nothing
            // of it is flushed, removed or aborted from here.
            if let Some(open) = self.open.take() {
                std::mem::forget(open);
            }
            return;
        }
        if let Some(open) = self.open.take() {
            open.abandon();
        }
        if self.state == State::Open {
            self.state = State::Closed;
        }
    }
}

impl std::fmt::Debug for ShardWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardWriter")
            .field("pattern", &self.pattern)
            .field("samples", &self.samples)
            .field("shards", &self.entries.len())
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

impl Drop for ShardWriter {
    /// A writer dropped without [`ShardWriter::close`] aborts: its open
    /// shard is not completed (nothing says its samples were all written).
    fn drop(&mut self) {
        self.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::tar::sample_spans;
    use crate::format::ShardRef;

    fn text(s: &str) -> FieldValue {
        FieldValue::Text(s.into())
    }

    fn options(max_count: Option<u64>, max_bytes: Option<u64>) -> WriterOptions {
        WriterOptions {
            max_count,
            max_bytes,
            ..WriterOptions::default()
        }
    }

    #[test]
    fn predicted_member_sizes_match_what_tar_writes() {
        for name_len in [1, 99, 100, 101, 200, 511, 512, 513] {
            for data_len in [0, 1, 511, 512, 513] {
                let mut builder = tar::Builder::new(Vec::new());
                let mut header = tar::Header::new_gnu();
                header.set_size(data_len as u64);
                let name = "k".repeat(name_len);
                builder
                    .append_data(&mut header, &name, vec![7u8; data_len].as_slice())
                    .unwrap();
                let bytes = builder.into_inner().unwrap();
                assert_eq!(
                    bytes.len() as u64,
                    member_bytes(name_len, data_len) + END_OF_ARCHIVE,
                    "name {name_len}, data {data_len}"
                );
            }
        }
    }

    #[test]
    fn shards_roll_over_and_the_manifest_matches_the_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let pattern = format!("{}/s-%03d.tar", dir.path().display());
        let mut writer = ShardWriter::new(&pattern, options(Some(3), None)).unwrap();
        for i in 0..7 {
            let long = "x".repeat(i * 150);
            writer
                .write(
                    &format!("k{i}{long}"),
                    vec![("txt".into(), text(&"a".repeat(i * 300)))],
                )
                .unwrap();
        }
        writer.close().unwrap();
        let manifest = Manifest::load(&dir.path().join("manifest.json")).unwrap();
        assert_eq!(
            manifest
                .shards
                .iter()
                .map(|e| e.samples)
                .collect::<Vec<_>>(),
            [3, 3, 1]
        );
        for entry in &manifest.shards {
            let bytes = std::fs::read(dir.path().join(&entry.url)).unwrap();
            assert_eq!(bytes.len() as u64, entry.size);
            let shard = ShardRef::whole(0, entry.url.as_str().into());
            let spans = sample_spans(&mut bytes.as_slice(), &shard, bytes.len() as u64).unwrap();
            let (offsets, lengths): (Vec<u64>, Vec<u64>) = spans.into_iter().unzip();
            assert_eq!((&offsets, &lengths), (&entry.offsets, &entry.lengths));
        }
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(
            names.len(),
            4,
            "three shards and the manifest, nothing else: {names:?}"
        );
    }

    #[test]
    fn max_bytes_bounds_each_shard_unless_one_sample_is_larger() {
        let dir = tempfile::tempdir().unwrap();
        let pattern = format!("{}/s-%d.tar", dir.path().display());
        let mut writer = ShardWriter::new(&pattern, options(None, Some(4096))).unwrap();
        for (i, size) in [1000, 1000, 1000, 9000, 10].into_iter().enumerate() {
            writer
                .write(
                    &format!("k{i}"),
                    vec![("bin".into(), FieldValue::Bytes(vec![1; size]))],
                )
                .unwrap();
        }
        writer.close().unwrap();
        let manifest = Manifest::load(&dir.path().join("manifest.json")).unwrap();
        let counts: Vec<_> = manifest.shards.iter().map(|e| e.samples).collect();
        assert_eq!(counts, [2, 1, 1, 1]);
        for entry in &manifest.shards {
            assert!(entry.size <= 4096 || entry.samples == 1, "{entry:?}");
        }
    }

    #[test]
    fn refused_samples_leave_the_writer_usable_and_a_drop_leaves_no_partial_shard() {
        let dir = tempfile::tempdir().unwrap();
        let pattern = format!("{}/s-%d.tar.gz", dir.path().display());
        let mut writer = ShardWriter::new(&pattern, options(Some(2), None)).unwrap();
        assert_eq!(writer.compression(), Some(Compression::Gzip));
        for i in 0..3 {
            writer
                .write(&format!("k{i}"), vec![("txt".into(), text("a"))])
                .unwrap();
        }
        let err = writer
            .write("k0", vec![("txt".into(), text("a"))])
            .unwrap_err();
        assert!(err.to_string().contains("already written"), "{err}");
        let err = writer
            .write("k9", vec![("TXT".into(), text("a"))])
            .unwrap_err();
        assert!(err.to_string().contains("\"txt\""), "{err}");
        assert!(writer.write("k9", vec![]).is_err());
        assert_eq!(writer.samples(), 3);
        drop(writer);
        let mut names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, ["manifest.json", "s-0.tar.gz"]);
        let manifest = Manifest::load(&dir.path().join("manifest.json")).unwrap();
        assert_eq!(manifest.shards[0].samples, 2);
        assert_eq!(manifest.shards[0].compression, Some(Compression::Gzip));
    }

    #[test]
    fn options_are_checked_at_construction() {
        let err = ShardWriter::new("x-%d.tar", options(Some(0), None)).unwrap_err();
        assert!(
            matches!(
                err,
                Error::Config {
                    name: "max_count",
                    ..
                }
            ),
            "{err}"
        );
        let err = ShardWriter::new("x-%d.tar", options(None, Some(0))).unwrap_err();
        assert!(
            matches!(
                err,
                Error::Config {
                    name: "max_bytes",
                    ..
                }
            ),
            "{err}"
        );
    }
}
