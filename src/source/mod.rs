//! Where bytes come from. A [`ReadAhead`] reads the units of one slot on
//! its own runtime, running ahead of the parser across shard boundaries
//! within a byte budget, and hands each shard over, in order, as a
//! [`ShardReader`] (a blocking `std::io::Read` with a bounded wait). Local
//! files are read one after another; up to `max_concurrency` S3 objects are
//! fetched at once, each within its own share of the budget, so a slow
//! first byte or a per-connection bandwidth limit is paid in parallel.

mod local;
mod s3;

pub use local::{file_origin, verify_view, FileIdentity, FileOrigin, LocalFile, MappedView};

use std::collections::VecDeque;
use std::io::Read;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::config::S3Options;
use crate::error::{Error, Result};
use crate::format::parquet::{self, FooterDecode};
use crate::format::ByteSource;
use crate::spec::Location;
use crate::stats::{Counter, Counters};
use ::parquet::file::metadata::ParquetMetaData;

/// Bytes of one shard, holding their share of the read-ahead budget until dropped.
struct Chunk {
    bytes: Bytes,
    /// When the bytes are mapped from a local file (and may be shared):
    /// what a reader checks after copying bytes out of them.
    mapped: Option<local::Guard>,
    _permit: OwnedSemaphorePermit,
}

impl Chunk {
    /// Bytes read into memory of their own.
    fn read(bytes: Vec<u8>, permit: OwnedSemaphorePermit) -> Self {
        Chunk {
            bytes: bytes.into(),
            mapped: None,
            _permit: permit,
        }
    }
}

/// Members at least this long, in a chunk mapped from a local file, are
/// handed out as a view of the chunk rather than copied out of it: no byte
/// of them is copied before Python makes its `bytes`. Shorter ones cost
/// less to copy than to keep a chunk mapped for.
pub const SHARE_MIN_BYTES: usize = 16 << 10;

type ChunkResult = Result<Chunk>;

/// One read: a shard, or a byte range of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FetchUnit {
    /// Shard URL, for errors.
    pub url: String,
    /// Where its bytes are.
    pub location: Location,
    /// Bytes to read; `None` for the whole shard.
    pub range: Option<std::ops::Range<u64>>,
    /// The shard's size, when known.
    pub size: Option<u64>,
}

/// Settings of a [`ReadAhead`].
#[derive(Debug, Clone)]
pub struct ReadAheadOptions {
    /// Bytes fetched but not yet parsed, at most.
    pub budget_bytes: usize,
    /// Size of one read.
    pub chunk_bytes: usize,
    /// Longest wait of a [`ShardReader`] for its next bytes.
    pub io_timeout: Duration,
    /// How to reach S3.
    pub s3: S3Options,
}

/// Runs on the reading thread before it waits for bytes (or a shard) that
/// have not arrived yet.
pub type BeforeWait = Arc<dyn Fn() + Send + Sync>;

/// Reads a slot's shards in order, ahead of the consumer.
pub struct ReadAhead {
    shards: Receiver<ShardReader>,
    cancelled: Arc<AtomicBool>,
    runtime: Option<tokio::runtime::Runtime>,
    io_timeout: Duration,
    before_wait: Option<BeforeWait>,
}

impl ReadAhead {
    /// Starts reading `units` (in this order) on a new I/O runtime.
    pub fn start(
        units: Vec<FetchUnit>,
        options: ReadAheadOptions,
        counters: Arc<Counters>,
    ) -> Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .max_blocking_threads(2)
            .thread_name("shardstream-io")
            .enable_all()
            .build()
            .map_err(|e| Error::Stopped(format!("cannot start the I/O runtime: {e}")))?;
        let chunk_bytes = options.chunk_bytes.min(options.budget_bytes).max(1);
        let budget_total = options.budget_bytes.max(chunk_bytes);
        let cancelled = Arc::new(AtomicBool::new(false));
        let (shard_tx, shard_rx) = mpsc::channel();
        let task = Fetcher {
            budget: Arc::new(Semaphore::new(budget_total)),
            cancelled: cancelled.clone(),
            chunk_bytes,
            io_timeout: options.io_timeout,
            counters,
            budget_total,
            s3_options: Arc::new(options.s3),
            s3: Arc::new(tokio::sync::OnceCell::new()),
        };
        runtime.spawn(task.run(units, shard_tx));
        Ok(ReadAhead {
            shards: shard_rx,
            cancelled,
            runtime: Some(runtime),
            io_timeout: options.io_timeout,
            before_wait: None,
        })
    }

    /// Has `hook` run before this read-ahead, or a shard reader it hands
    /// out, waits for what has not arrived yet.
    pub fn before_wait(&mut self, hook: BeforeWait) {
        self.before_wait = Some(hook);
    }

    /// The reader of the next unit, `None` after the last one.
    pub fn next_shard(&self) -> Result<Option<ShardReader>> {
        let next = wait_for(&self.shards, self.io_timeout, self.before_wait.as_deref());
        match next {
            Ok(mut reader) => {
                reader.before_wait = self.before_wait.clone();
                Ok(Some(reader))
            }
            Err(RecvTimeoutError::Disconnected) => Ok(None),
            Err(RecvTimeoutError::Timeout) => Err(Error::Stopped(format!(
                "no shard opened within {:?}",
                self.io_timeout
            ))),
        }
    }
}

impl Drop for ReadAhead {
    fn drop(&mut self) {
        self.cancelled.store(true, Ordering::SeqCst);
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_timeout(Duration::from_secs(2));
        }
    }
}

/// Reads shards into chunks, within a byte budget of its own.
#[derive(Clone)]
struct Fetcher {
    budget: Arc<Semaphore>,
    cancelled: Arc<AtomicBool>,
    chunk_bytes: usize,
    io_timeout: Duration,
    counters: Arc<Counters>,
    budget_total: usize,
    s3_options: Arc<S3Options>,
    /// Made at the first S3 unit, in the reading process.
    s3: Arc<tokio::sync::OnceCell<Arc<s3::S3Client>>>,
}

impl Fetcher {
    /// Reads `units`, handing their readers over in order, with up to
    /// `max_concurrency` S3 units (one local unit) in flight.
    async fn run(self, units: Vec<FetchUnit>, shard_tx: Sender<ShardReader>) {
        let mut in_flight = VecDeque::new();
        for unit in units {
            let ahead = match unit.location {
                Location::S3 { .. } => self.s3_options.max_concurrency.max(1),
                Location::Local(_) => 1,
            };
            while in_flight.len() >= ahead {
                let Some(task) = in_flight.pop_front() else {
                    break;
                };
                if !matches!(task.await, Ok(Ok(()))) {
                    return;
                }
            }
            if self.cancelled.load(Ordering::SeqCst) {
                return;
            }
            let (chunk_tx, chunk_rx) = mpsc::channel();
            let reader = ShardReader {
                url: unit.url.clone(),
                chunks: chunk_rx,
                current: Bytes::new(),
                mapped: None,
                position: 0,
                offset: unit.range.as_ref().map_or(0, |r| r.start),
                io_timeout: self.io_timeout,
                failure: None,
                before_wait: None,
            };
            if shard_tx.send(reader).is_err() {
                return;
            }
            let share = self.share(ahead);
            in_flight.push_back(tokio::spawn(
                async move { share.read(&unit, &chunk_tx).await },
            ));
        }
        for task in in_flight {
            if !matches!(task.await, Ok(Ok(()))) {
                return;
            }
        }
    }

    /// A fetcher for one of `ways` units in flight, with that share of the budget.
    fn share(&self, ways: usize) -> Fetcher {
        let bytes = (self.budget_total / ways).max(self.chunk_bytes);
        Fetcher {
            budget: if ways == 1 {
                self.budget.clone()
            } else {
                Arc::new(Semaphore::new(bytes))
            },
            budget_total: bytes,
            ..self.clone()
        }
    }

    /// Reads one unit into chunks sent to `chunk_tx`.
    async fn read(
        &self,
        unit: &FetchUnit,
        chunk_tx: &Sender<ChunkResult>,
    ) -> Result<(), ConsumerGone> {
        match &unit.location {
            Location::Local(path) => local::read_file(self, unit, path, chunk_tx).await,
            Location::S3 { bucket, key } => {
                let client = self
                    .s3
                    .get_or_init(|| async { Arc::new(s3::S3Client::new(&self.s3_options).await) })
                    .await;
                s3::read_object(self, client, unit, (bucket, key), chunk_tx).await
            }
        }
    }

    /// Waits for budget for `len` bytes; `None` once cancelled.
    async fn reserve(&self, len: usize) -> Option<OwnedSemaphorePermit> {
        let permits = u32::try_from(len).expect("chunk_bytes fits u32");
        self.budget.clone().acquire_many_owned(permits).await.ok()
    }

    /// Budget for `len` bytes if it is free now.
    fn try_reserve(&self, len: usize) -> Option<OwnedSemaphorePermit> {
        let permits = u32::try_from(len).expect("chunk_bytes fits u32");
        self.budget.clone().try_acquire_many_owned(permits).ok()
    }

    fn count(&self, counter: Counter, n: u64) {
        self.counters.add(counter, n);
    }

    /// The read-ahead budget in bytes.
    fn budget_bytes(&self) -> usize {
        self.budget_total
    }
}

/// Runs `work` with a fresh S3 client on a runtime made for it and shut
/// down before returning, so no thread outlives the call (DataLoader
/// workers may fork next).
fn with_s3_client<T>(
    options: &S3Options,
    work: impl AsyncFnOnce(&s3::S3Client) -> Result<T>,
) -> Result<T> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::Stopped(format!("cannot start the I/O runtime: {e}")))?;
    let result = runtime.block_on(async {
        let client = s3::S3Client::new(options).await;
        work(&client).await
    });
    runtime.shutdown_timeout(Duration::from_secs(5));
    result
}

/// Fills in the size and ETag of the S3 shards that lack a size (HEAD each).
pub fn describe_s3_objects(options: &S3Options, shards: &mut [crate::spec::Shard]) -> Result<()> {
    let unknown =
        |s: &crate::spec::Shard| s.size.is_none() && matches!(s.location(), Location::S3 { .. });
    if !shards.iter().any(unknown) {
        return Ok(());
    }
    with_s3_client(options, async |client| {
        for shard in shards.iter_mut().filter(|s| unknown(s)) {
            if let Location::S3 { bucket, key } = shard.location() {
                let (size, etag) = client.head(&shard.url, &bucket, &key).await?;
                shard.size = Some(size);
                shard.etag = etag;
            }
        }
        Ok(())
    })
}

/// Lists `s3://bucket/prefix/` specs: for each `(position, url, bucket,
/// prefix)`, the objects whose keys `keep` takes, sorted by key, as shards
/// with their sizes and ETags.
pub fn list_s3_prefixes(
    options: &S3Options,
    listings: &[(usize, String, String, String)],
    keep: fn(&str) -> bool,
) -> Result<Vec<Vec<crate::spec::Shard>>> {
    with_s3_client(options, async |client| {
        let mut all = Vec::with_capacity(listings.len());
        for (_, url, bucket, prefix) in listings {
            let objects = client.list(url, bucket, prefix, keep).await?;
            all.push(
                objects
                    .into_iter()
                    .map(|(key, size, etag)| crate::spec::Shard {
                        etag,
                        ..crate::spec::Shard::new(format!("s3://{bucket}/{key}"), Some(size))
                    })
                    .collect(),
            );
        }
        Ok(all)
    })
}

/// Reads the footer of each Parquet file (`files` have known sizes): a
/// probe of its last bytes, then the whole footer when it is longer. The
/// reads run on a runtime that is shut down before returning.
pub fn read_footers(
    files: &[&crate::spec::Shard],
    s3: &S3Options,
) -> Result<Vec<Arc<ParquetMetaData>>> {
    let size = |file: &crate::spec::Shard| file.size.unwrap_or(0);
    let probes = files
        .iter()
        .map(|f| parquet::FOOTER_PROBE.min(size(f)))
        .collect::<Vec<_>>();
    let mut footers = Vec::with_capacity(files.len());
    let mut longer = Vec::new();
    for (i, tail) in read_tails(files, &probes, s3)?.into_iter().enumerate() {
        match parquet::decode_footer(&files[i].url, size(files[i]), &tail)? {
            FooterDecode::Metadata(metadata) => footers.push(Some(metadata)),
            FooterDecode::NeedTail(len) => {
                footers.push(None);
                longer.push((i, len));
            }
        }
    }
    if !longer.is_empty() {
        let retry: Vec<&crate::spec::Shard> = longer.iter().map(|&(i, _)| files[i]).collect();
        let lens: Vec<u64> = longer.iter().map(|&(_, len)| len).collect();
        for ((i, _), tail) in longer.iter().zip(read_tails(&retry, &lens, s3)?) {
            let file = files[*i];
            match parquet::decode_footer(&file.url, size(file), &tail)? {
                FooterDecode::Metadata(metadata) => footers[*i] = Some(metadata),
                FooterDecode::NeedTail(_) => {
                    return Err(file_format_error(
                        file,
                        "the footer length changed between reads",
                    ))
                }
            }
        }
    }
    Ok(footers.into_iter().flatten().collect())
}

fn file_format_error(file: &crate::spec::Shard, reason: &str) -> Error {
    Error::Format {
        url: file.url.clone(),
        offset: file.size.unwrap_or(0),
        compression: None,
        member: None,
        reason: reason.to_owned(),
    }
}

/// The last `lens[i]` bytes of each file, read through a [`ReadAhead`]
/// that is dropped (its runtime shut down) before returning.
fn read_tails(files: &[&crate::spec::Shard], lens: &[u64], s3: &S3Options) -> Result<Vec<Vec<u8>>> {
    let units = files
        .iter()
        .zip(lens)
        .map(|(file, &len)| {
            let size = file.size.unwrap_or(0);
            FetchUnit {
                url: file.url.clone(),
                location: file.location(),
                range: Some(size - len.min(size)..size),
                size: file.size,
            }
        })
        .collect();
    let defaults = crate::config::StreamOptions::default();
    let read_ahead = ReadAhead::start(
        units,
        ReadAheadOptions {
            budget_bytes: defaults.read_ahead_bytes,
            chunk_bytes: defaults.chunk_bytes,
            io_timeout: defaults.io_timeout,
            s3: s3.clone(),
        },
        Arc::new(Counters::new()),
    )?;
    let mut tails = Vec::with_capacity(files.len());
    for file in files {
        let mut reader = read_ahead
            .next_shard()?
            .ok_or_else(|| Error::Stopped(format!("{}: the footer read ended early", file.url)))?;
        let mut tail = Vec::new();
        if let Err(error) = reader.read_to_end(&mut tail) {
            let size = file.size.unwrap_or(0);
            let start = size - lens[tails.len()].min(size);
            return Err(reader.take_failure().unwrap_or(Error::Read {
                url: file.url.clone(),
                offset: start + tail.len() as u64,
                source: error,
            }));
        }
        tails.push(tail);
    }
    Ok(tails)
}

/// The next item of `rx`, running `before_wait` first if it has to wait,
/// and waiting at most `timeout`.
fn wait_for<T>(
    rx: &Receiver<T>,
    timeout: Duration,
    before_wait: Option<&(dyn Fn() + Send + Sync)>,
) -> std::result::Result<T, RecvTimeoutError> {
    match rx.try_recv() {
        Ok(item) => Ok(item),
        Err(TryRecvError::Disconnected) => Err(RecvTimeoutError::Disconnected),
        Err(TryRecvError::Empty) => {
            if let Some(hook) = before_wait {
                hook();
            }
            rx.recv_timeout(timeout)
        }
    }
}

/// Marker: the consumer has gone, stop fetching.
struct ConsumerGone;

/// A blocking reader of one shard's bytes, fed by the [`ReadAhead`].
pub struct ShardReader {
    url: String,
    chunks: Receiver<ChunkResult>,
    current: Bytes,
    /// When `current` is mapped from a local file, its guard.
    mapped: Option<local::Guard>,
    position: usize,
    offset: u64,
    io_timeout: Duration,
    failure: Option<Error>,
    before_wait: Option<BeforeWait>,
}

impl ShardReader {
    /// The shard's URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    fn fail(&mut self, error: Error) -> std::io::Error {
        let message = error.to_string();
        self.failure = Some(error);
        std::io::Error::other(message)
    }
}

impl ByteSource for ShardReader {
    fn take_failure(&mut self) -> Option<Error> {
        self.failure.take()
    }

    fn prefetch(&self, ahead: usize, len: usize) {
        if let Some(unread) = self.current.get(self.position..) {
            crate::format::prefetch_range(unread, ahead, len);
        }
    }

    fn skip(&mut self, max: usize) -> std::io::Result<usize> {
        Ok(self.next_bytes(max)?.len())
    }

    fn read_append(&mut self, out: &mut Vec<u8>, max: usize) -> std::io::Result<usize> {
        let bytes = self.next_bytes(max)?;
        out.extend_from_slice(bytes);
        let read = bytes.len();
        self.check_read(read)?;
        Ok(read)
    }

    /// Hands out `len` bytes of at least [`SHARE_MIN_BYTES`] that lie
    /// within the current chunk, when it is mapped from a local file.
    fn read_shared(&mut self, len: usize) -> std::io::Result<Option<Bytes>> {
        if len < SHARE_MIN_BYTES || !self.fill()? || self.mapped.is_none() {
            return Ok(None);
        }
        if self.current.len() - self.position < len {
            return Ok(None);
        }
        let member = local::MappedMember::new(self.current.clone(), self.position, len);
        self.position += len;
        self.offset += len as u64;
        Ok(Some(Bytes::from_owner(member)))
    }
}

impl ShardReader {
    /// At most `max` unread bytes of the current chunk (waiting for the
    /// next chunk if needed), counted as read; empty at the end of the shard.
    fn next_bytes(&mut self, max: usize) -> std::io::Result<&[u8]> {
        if max == 0 || !self.fill()? {
            return Ok(&[]);
        }
        let start = self.position;
        let n = max.min(self.current.len() - start);
        self.position += n;
        self.offset += n as u64;
        Ok(&self.current[start..start + n])
    }

    /// Checks that the `read` bytes just copied out of the current chunk
    /// (those before `position`) came from the file: a mapped chunk of a
    /// file cut short reads as zeros where its pages were lost.
    fn check_read(&mut self, read: usize) -> std::io::Result<()> {
        let Some(guard) = self.mapped else {
            return Ok(());
        };
        let begin = self.current.as_ptr() as usize + self.position - read;
        match guard.check(begin, read) {
            Ok(()) => Ok(()),
            Err(offset) => Err(self.fail(local::cut_short(&self.url, offset))),
        }
    }

    /// Waits until the current chunk has unread bytes; `false` at the end
    /// of the shard.
    fn fill(&mut self) -> std::io::Result<bool> {
        while self.position == self.current.len() {
            match wait_for(&self.chunks, self.io_timeout, self.before_wait.as_deref()) {
                Ok(Ok(chunk)) => {
                    self.current = chunk.bytes;
                    self.mapped = chunk.mapped;
                    self.position = 0;
                }
                Ok(Err(error)) => return Err(self.fail(error)),
                Err(RecvTimeoutError::Disconnected) => return Ok(false),
                Err(RecvTimeoutError::Timeout) => {
                    let error = Error::Timeout {
                        url: self.url.clone(),
                        offset: self.offset,
                        after: self.io_timeout,
                    };
                    return Err(self.fail(error));
                }
            }
        }
        Ok(true)
    }
}

impl Read for ShardReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let bytes = self.next_bytes(buf.len())?;
        buf[..bytes.len()].copy_from_slice(bytes);
        let read = bytes.len();
        self.check_read(read)?;
        Ok(read)
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn read_ahead(path: &Path, chunk_bytes: usize) -> ReadAhead {
        let unit = FetchUnit {
            url: path.display().to_string(),
            location: Location::Local(path.to_owned()),
            range: None,
            size: None,
        };
        let options = ReadAheadOptions {
            budget_bytes: 4 * chunk_bytes,
            chunk_bytes,
            io_timeout: Duration::from_secs(20),
            s3: S3Options::default(),
        };
        ReadAhead::start(vec![unit], options, Arc::new(Counters::new())).unwrap()
    }

    fn content(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 31 % 251) as u8).collect()
    }

    #[test]
    fn long_members_of_a_mapped_chunk_are_shared_and_the_rest_is_read() {
        let chunk = 128 << 10;
        let bytes = content(2 * chunk + 5000);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shard.tar");
        std::fs::write(&path, &bytes).unwrap();
        let read_ahead = read_ahead(&path, chunk);
        let mut reader = read_ahead.next_shard().unwrap().unwrap();

        assert!(reader.read_shared(1000).unwrap().is_none(), "too short");
        let mut head = vec![0; 1000];
        reader.read_exact(&mut head).unwrap();
        assert_eq!(head, bytes[..1000]);
        let shared = reader
            .read_shared(100_000)
            .unwrap()
            .expect("within the chunk");
        assert_eq!(shared, bytes[1000..101_000]);
        let origin = file_origin(&shared).expect("a view of the mapped file");
        assert_eq!(
            (origin.file.path.as_path(), origin.offset),
            (path.as_path(), 1000)
        );
        let identity = origin.file.identity;
        assert_eq!(identity.size, bytes.len() as u64);
        assert_eq!(file_origin(&shared[10..20]).map(|o| o.offset), Some(1010));
        assert!(file_origin(&head).is_none(), "copied bytes have no origin");
        // Past the end of the chunk: not shared, and nothing is consumed.
        assert!(reader.read_shared(50_000).unwrap().is_none());
        let mut rest = Vec::new();
        reader.read_to_end(&mut rest).unwrap();
        assert_eq!(rest, bytes[101_000..]);
    }

    #[test]
    fn a_pipe_is_read_and_never_shared() {
        let bytes = content(300_000);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pipe.tar");
        let fifo = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
        // SAFETY: creates a named pipe at a path this test owns.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        let writer = {
            let (path, bytes) = (path.clone(), bytes.clone());
            std::thread::spawn(move || std::fs::write(path, bytes).unwrap())
        };
        let read_ahead = read_ahead(&path, 1 << 20);
        let mut reader = read_ahead.next_shard().unwrap().unwrap();
        assert!(reader.read_shared(100_000).unwrap().is_none());
        let mut all = Vec::new();
        reader.read_to_end(&mut all).unwrap();
        assert_eq!(all, bytes);
        writer.join().unwrap();
    }
}
