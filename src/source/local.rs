//! Local files (plain paths and `file://` URLs). A regular file is mapped
//! into memory a chunk at a time, its pages populated on a blocking
//! thread, so that the parser finds them resident and no byte is copied to
//! reach it; anything that cannot be mapped (a pipe, a file system without
//! `mmap`) is read into chunks instead. Files are opened on one thread per
//! process (see [`open`]), so that an `open` that never returns (a pipe
//! with no writer, a hung network mount) holds that one thread, not one per
//! attempt. A regular file is delivered whole as of its size when opened
//! (or the range asked for): a file that ends sooner is an error naming
//! the offset, never a shorter shard.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Seek};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::{Chunk, ChunkSender, ConsumerGone, FetchUnit, Fetcher};
use crate::error::Error;
use crate::stats::Counter;

/// Sends the bytes of `path` (or the unit's byte range of it), in order, as
/// chunks to `tx`; errors are sent too. Stops early, without error, when
/// the shard's reader is dropped.
pub(super) async fn read_file(
    fetcher: &Fetcher,
    unit: &FetchUnit,
    (path, by_reference): (&Path, bool),
    tx: &ChunkSender,
) -> Result<(), ConsumerGone> {
    let url = unit.url.as_str();
    // A failed send means the shard's reader is gone: nothing more to do.
    let report = |error: Error| {
        let _ = tx.send(Err(error));
        Ok(())
    };
    let (file, meta) = match open(url, path, fetcher.io_timeout).await? {
        Ok(opened) => opened,
        Err(error) => return report(error),
    };
    read_opened(fetcher, unit, (path, by_reference), (file, meta), tx).await
}

/// As [`read_file`], of `file` (with its metadata `meta`) already opened
/// at `path` (a cached copy, opened and checked by the cache). The bytes
/// of a file whose members may leave by reference (a shard of its own) are
/// counted as `bytes_read`, those of a cached copy as `cache_bytes`.
pub(super) async fn read_opened(
    fetcher: &Fetcher,
    unit: &FetchUnit,
    (path, by_reference): (&Path, bool),
    (file, meta): (File, std::fs::Metadata),
    tx: &ChunkSender,
) -> Result<(), ConsumerGone> {
    let url = unit.url.as_str();
    let report = |error: Error| {
        let _ = tx.send(Err(error));
        Ok(())
    };
    if meta.is_dir() {
        let source = std::io::Error::other("is a directory");
        return report(Error::Read {
            url: url.to_owned(),
            offset: 0,
            source,
        });
    }
    fetcher.count(Counter::ShardsOpened, 1);
    let (offset, asked_end) = match &unit.range {
        Some(range) => (range.start, Some(range.end)),
        None => (0, None),
    };
    if !meta.is_file() {
        // A pipe or a device: its size is not known before its end.
        let end = Expected {
            end: asked_end.unwrap_or(u64::MAX),
            size_at_open: None,
        };
        let counter = bytes_counter(by_reference);
        return read_chunks(fetcher, (unit, counter), file, offset, end, tx).await;
    }
    let size = meta.len();
    let end = Expected {
        end: asked_end.unwrap_or(size),
        size_at_open: Some(size),
    };
    if end.end > size {
        return report(end.short(url, size, size));
    }
    let local = Arc::new(LocalFile {
        // Absolute, so that another process (a DataLoader's main
        // process) finds the file whatever its working directory.
        path: std::path::absolute(path).unwrap_or_else(|_| path.to_owned()),
        identity: FileIdentity::of(&meta),
        url: url.to_owned(),
        by_reference,
    });
    let (file, unmapped) = match map_chunks(fetcher, (file, local), offset, end, tx).await? {
        Mapped::Done => return Ok(()),
        Mapped::Failed(error) => return report(error),
        Mapped::Unmappable(file, at) => (file, at),
    };
    let counter = bytes_counter(by_reference);
    read_chunks(fetcher, (unit, counter), file, unmapped, end, tx).await
}

/// The counter of the bytes read from a file: `bytes_read` for a shard's
/// own file (whose members may leave by reference), `cache_bytes` for a
/// cached copy (whose members never do).
fn bytes_counter(by_reference: bool) -> Counter {
    if by_reference {
        Counter::BytesRead
    } else {
        Counter::CacheBytes
    }
}

/// Where a read must end: `end`, and the file's size when it was opened
/// (`None` for a pipe or a device, whose `end` may be `u64::MAX`: its end).
#[derive(Debug, Clone, Copy)]
struct Expected {
    end: u64,
    size_at_open: Option<u64>,
}

impl Expected {
    /// The error for a file found `now` bytes long, its bytes delivered up
    /// to `at`, short of `self.end`.
    fn short(&self, url: &str, at: u64, now: u64) -> Error {
        let reason = match self.size_at_open {
            Some(size) if now < size => format!(
                "the file shrank while it was read: it has {now} bytes now, \
                 {size} when it was opened"
            ),
            _ => format!(
                "the file ends at byte {now}, before the end of the range asked for (byte {})",
                self.end
            ),
        };
        Error::Read {
            url: url.to_owned(),
            offset: at,
            source: std::io::Error::new(std::io::ErrorKind::UnexpectedEof, reason),
        }
    }
}

/// How a file opened on the opener thread comes back: the file and its
/// metadata, or the error of `open` (or `fstat`).
type Opened = std::io::Result<(File, std::fs::Metadata)>;

/// Opens `path` on the process's opener thread (see [`OPENER`]) and waits
/// for it. An open that has not returned after `stuck_after` makes every
/// later one fail at once, with an error naming the shard and the file
/// that blocks, until it returns. `Err` when the runtime is shutting down.
async fn open(
    url: &str,
    path: &Path,
    stuck_after: Duration,
) -> Result<Result<(File, std::fs::Metadata), Error>, ConsumerGone> {
    let reply = match request_open(path, stuck_after) {
        Ok(reply) => reply,
        Err(refused) => {
            let source = std::io::Error::new(std::io::ErrorKind::TimedOut, refused);
            return Ok(Err(Error::Read {
                url: url.to_owned(),
                offset: 0,
                source,
            }));
        }
    };
    match reply.await {
        Ok(Ok(opened)) => Ok(Ok(opened)),
        Ok(Err(e)) => Ok(Err(Error::from_open(url, e))),
        Err(_) => Err(ConsumerGone),
    }
}

/// The thread that opens local files for this process, while it runs.
///
/// `open` of a pipe with no writer, or of a file on a hung network or FUSE
/// mount, never returns, and nothing can cancel it. On a blocking thread
/// of the reading runtime each such attempt would keep that thread, and
/// the runtime it belongs to (its descriptors), alive for good. Opens run
/// on this one thread instead: a blocked open holds it, the runtimes shut
/// down cleanly, and later opens fail at once (see [`request_open`])
/// rather than each leaving a thread behind. A file that opens after its
/// reader has gone is closed. The thread ends after [`OPENER_IDLE`] without
/// work; the next open starts another.
static OPENER: Mutex<Option<Opener>> = Mutex::new(None);

/// How long the opener thread waits for work before it ends.
const OPENER_IDLE: Duration = Duration::from_millis(50);

/// The running opener thread, as its clients see it.
struct Opener {
    /// The process it runs in: a forked child has none.
    pid: u32,
    /// Where to send it requests.
    requests: std::sync::mpsc::Sender<OpenRequest>,
    /// The path it is opening now, and since when.
    busy: Option<(PathBuf, Instant)>,
    /// Tells this thread from a later one.
    generation: u64,
}

/// One file to open, and where to send the outcome.
struct OpenRequest {
    path: PathBuf,
    reply: tokio::sync::oneshot::Sender<Opened>,
}

fn opener() -> std::sync::MutexGuard<'static, Option<Opener>> {
    register_fork_handlers();
    OPENER.lock().unwrap_or_else(|e| e.into_inner())
}

/// Hands `path` to the opener thread (starting one if none runs in this
/// process) and gives the receiver of the outcome; refuses, with the
/// reason, when the thread has been blocked in an open for `stuck_after`.
fn request_open(
    path: &Path,
    stuck_after: Duration,
) -> Result<tokio::sync::oneshot::Receiver<Opened>, String> {
    let (reply, outcome) = tokio::sync::oneshot::channel();
    let mut request = OpenRequest {
        path: path.to_owned(),
        reply,
    };
    let mut current = opener();
    let pid = std::process::id();
    if let Some(running) = current.as_ref().filter(|o| o.pid == pid) {
        if let Some((blocked, since)) = &running.busy {
            let waited = since.elapsed();
            if waited >= stuck_after {
                return Err(format!(
                    "open timed out: opening {} has not returned for {:.1} s (a pipe with \
                     no writer, or a hung file system); no local shard can be opened in this \
                     process until it does",
                    blocked.display(),
                    waited.as_secs_f64()
                ));
            }
        }
        match running.requests.send(request) {
            Ok(()) => return Ok(outcome),
            // The thread has ended (it cannot while it is listed): start another.
            Err(returned) => request = returned.0,
        }
    }
    static GENERATION: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let generation = GENERATION.fetch_add(1, Ordering::Relaxed);
    let (requests, incoming) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("shardstream-open".into())
        .spawn(move || serve_opens(&incoming, generation))
        .map_err(|e| format!("cannot start a thread to open the file: {e}"))?;
    // The receiver lives until the thread ends, which it does only after
    // taking itself off the list under this lock.
    let _ = requests.send(request);
    *current = Some(Opener {
        pid,
        requests,
        busy: None,
        generation,
    });
    Ok(outcome)
}

/// The opener thread: opens each requested file whose requester still
/// waits, until no request comes for [`OPENER_IDLE`].
fn serve_opens(incoming: &std::sync::mpsc::Receiver<OpenRequest>, generation: u64) {
    let ours = |o: &Option<Opener>| o.as_ref().is_some_and(|o| o.generation == generation);
    loop {
        let request = match incoming.recv_timeout(OPENER_IDLE) {
            Ok(request) => request,
            Err(_) => {
                // Requests are sent under the lock: none arrives after this look.
                let mut current = opener();
                match incoming.try_recv() {
                    Ok(request) => request,
                    Err(_) => {
                        if ours(&current) {
                            *current = None;
                        }
                        return;
                    }
                }
            }
        };
        if request.reply.is_closed() {
            continue;
        }
        let set_busy = |busy: Option<(PathBuf, Instant)>| {
            if let Some(running) = opener().as_mut().filter(|o| o.generation == generation) {
                running.busy = busy;
            }
        };
        set_busy(Some((request.path.clone(), Instant::now())));
        let opened = File::open(&request.path).and_then(|file| {
            let meta = file.metadata()?;
            Ok((file, meta))
        });
        set_busy(None);
        // A requester that has gone drops (closes) the file with the reply.
        let _ = request.reply.send(opened);
    }
}

/// The outcome of mapping a file's chunks.
enum Mapped {
    /// Every chunk was sent (or the shard's reader is gone).
    Done,
    /// The file ended early; the chunks before that point were sent.
    Failed(Error),
    /// A chunk could not be mapped: the file back, and the chunk's offset,
    /// for reading to take over.
    Unmappable(File, u64),
}

/// Maps `file` from `offset` to `end.end` a chunk at a time and sends the
/// chunks.
async fn map_chunks(
    fetcher: &Fetcher,
    (mut file, local): (File, Arc<LocalFile>),
    mut offset: u64,
    end: Expected,
    tx: &ChunkSender,
) -> Result<Mapped, ConsumerGone> {
    while offset < end.end {
        let want = usize::try_from(end.end - offset)
            .map_or(fetcher.chunk_bytes, |left| left.min(fetcher.chunk_bytes));
        let Some(mut permit) = fetcher.reserve(want).await else {
            return Err(ConsumerGone);
        };
        let (open, mapped) = map_chunk(file, local.clone(), offset, want).await?;
        file = open;
        let (bytes, guard, size_now) = match mapped {
            MapOutcome::Mapped(bytes, guard, size_now) => (bytes, guard, size_now),
            MapOutcome::Unmappable => return Ok(Mapped::Unmappable(file, offset)),
            MapOutcome::Gone(size_now) => {
                return Ok(Mapped::Failed(end.short(&local.url, offset, size_now)))
            }
        };
        let got = bytes.len();
        fetcher.count(bytes_counter(local.by_reference), got as u64);
        if got < want {
            drop(permit.split(want - got));
        }
        let chunk = Chunk {
            bytes,
            mapped: Some(guard),
            _permit: permit,
        };
        if tx.send(Ok(chunk)).is_err() {
            return Ok(Mapped::Done);
        }
        offset += got as u64;
        if got < want {
            return Ok(Mapped::Failed(end.short(&local.url, offset, size_now)));
        }
    }
    Ok(Mapped::Done)
}

/// What became of one chunk to map.
enum MapOutcome {
    /// The chunk, mapped and listed for the fault handler (shorter than
    /// asked when the file has shrunk), and the file's size before it was
    /// mapped.
    Mapped(Bytes, Guard, u64),
    /// The file now ends at or before the chunk's offset (at this size).
    Gone(u64),
    /// The chunk cannot be mapped: read it instead.
    Unmappable,
}

/// Maps `len` bytes of `file` from `offset` (fewer if the file now ends
/// sooner) with their pages populated (read from disk if they are not
/// cached), on a blocking thread, and lists the mapping for the fault
/// handler; gives the file back. The blocking task fails only when the
/// runtime is shutting down, its consumer gone.
async fn map_chunk(
    file: File,
    local: Arc<LocalFile>,
    offset: u64,
    len: usize,
) -> Result<(File, MapOutcome), ConsumerGone> {
    let work = move || {
        // The file as it is now: a chunk is mapped only over bytes it
        // still has, so a file that has shrunk since it was opened is
        // found here rather than by a fault.
        let size_now = match file.metadata() {
            Ok(meta) => meta.len(),
            Err(_) => return (file, MapOutcome::Unmappable),
        };
        let available = size_now.saturating_sub(offset);
        if available == 0 {
            return (file, MapOutcome::Gone(size_now));
        }
        let len = usize::try_from(available).map_or(len, |available| available.min(len));
        if !fault_handler_installed() {
            return (file, MapOutcome::Unmappable);
        }
        // SAFETY: the range lay within the file a moment ago. Should the
        // file be cut short while it is mapped, the pages past its new end
        // fault; the fault handler installed above (see `on_sigbus`) puts
        // a page of zeros in their place and marks the chunk, and every
        // reader of the chunk's bytes checks that mark after copying them
        // (see `Guard::check`), so that no zero it put there is handed out.
        let map = unsafe {
            memmap2::MmapOptions::new()
                .offset(offset)
                .len(len)
                .populate()
                .map(&file)
        };
        let outcome = map
            .ok()
            .and_then(|map| MappedChunk::register(map, local, offset))
            .map_or(MapOutcome::Unmappable, |(bytes, guard)| {
                MapOutcome::Mapped(bytes, guard, size_now)
            });
        (file, outcome)
    };
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|_| ConsumerGone)
}

/// How much of a file [`crc32_of_copy`] looks at a time.
const CRC_WINDOW_BYTES: usize = 16 << 20;
/// How much of a window not in the page cache it reads at a time.
const READ_PIECE_BYTES: usize = 1 << 20;

/// The CRC-32 of the first `len` bytes of `file` (the cached copy at
/// `path` of the shard `url`), a window at a time. A window whose pages
/// are all in the page cache is read through a mapping of it: no byte is
/// copied out, and the shard's chunks are then mapped from the same pages
/// (see [`map_chunk`]). Any other window is read with `pread`, whose
/// read-ahead takes it from the disk in large reads (faulting a mapping in
/// takes it a few pages at a time: over 256 MiB of copies not in the page
/// cache, 0.43 s against 0.25 s); the pages it brings in are again those
/// the chunks are mapped from. Either way the copy is read from storage
/// once. An error when the file was cut short while it was read.
pub(super) fn crc32_of_copy(file: &File, path: &Path, url: &str, len: u64) -> Result<u32, String> {
    use std::os::unix::fs::FileExt;
    let mappable = fault_handler_installed();
    let local = file.metadata().ok().map(|meta| {
        Arc::new(LocalFile {
            path: std::path::absolute(path).unwrap_or_else(|_| path.to_owned()),
            identity: FileIdentity::of(&meta),
            url: url.to_owned(),
            by_reference: false,
        })
    });
    let mut crc = crc32fast::Hasher::new();
    let mut buffer = Vec::new();
    let mut offset = 0;
    while offset < len {
        let want = usize::try_from(len - offset)
            .map_or(CRC_WINDOW_BYTES, |left| left.min(CRC_WINDOW_BYTES));
        let resident = match (&local, mappable) {
            (Some(local), true) => map_resident(file, local, offset, want),
            _ => None,
        };
        match resident {
            Some((bytes, guard)) => {
                crc.update(&bytes);
                if let Err(at) = guard.check(bytes.as_ptr() as usize, bytes.len()) {
                    return Err(format!(
                        "it was cut short at byte {at} while it was checked"
                    ));
                }
            }
            None => {
                // In pieces that stay in the CPU's cache between the copy
                // and the CRC.
                buffer.resize(READ_PIECE_BYTES.min(want), 0);
                let mut at = offset;
                while at < offset + want as u64 {
                    let piece = (offset + want as u64 - at).min(buffer.len() as u64) as usize;
                    file.read_exact_at(&mut buffer[..piece], at)
                        .map_err(|e| e.to_string())?;
                    crc.update(&buffer[..piece]);
                    at += piece as u64;
                }
            }
        }
        offset += want as u64;
    }
    Ok(crc.finalize())
}

/// `len` bytes of `file` from `offset`, mapped and listed for the fault
/// handler, when every page of them is in the page cache; `None` otherwise.
fn map_resident(
    file: &File,
    local: &Arc<LocalFile>,
    offset: u64,
    len: usize,
) -> Option<(Bytes, Guard)> {
    // SAFETY: as in `map_chunk`: a page lost to the file being cut short
    // reads as zeros, and the caller's guard check finds it.
    let map = unsafe {
        memmap2::MmapOptions::new()
            .offset(offset)
            .len(len)
            .map(file)
    }
    .ok()?;
    let page = page_size();
    let mut pages = vec![0u8; len.div_ceil(page)];
    // SAFETY: the range is the mapping's own, and `pages` has one byte per
    // page of it, as mincore asks.
    let asked =
        unsafe { libc::mincore(map.as_ptr() as *mut libc::c_void, len, pages.as_mut_ptr()) };
    if asked != 0 || pages.iter().any(|p| p & 1 == 0) {
        return None;
    }
    MappedChunk::register(map, local.clone(), offset)
}

/// Reads `file` from `offset` to `end.end` (or, for a pipe, its end)
/// sequentially into chunks sent to `tx`; errors are sent too, and a file
/// that ends before `end.end` is one. The bytes are counted in `counter`.
async fn read_chunks(
    fetcher: &Fetcher,
    (unit, counter): (&FetchUnit, Counter),
    mut file: File,
    mut offset: u64,
    end: Expected,
    tx: &ChunkSender,
) -> Result<(), ConsumerGone> {
    let mut seek_to = (offset > 0).then_some(offset);
    while offset < end.end {
        let want = usize::try_from(end.end - offset)
            .map_or(fetcher.chunk_bytes, |left| left.min(fetcher.chunk_bytes));
        let Some(permit) = fetcher.reserve(want).await else {
            return Err(ConsumerGone);
        };
        let bytes = match read_chunk(file, seek_to.take(), want).await {
            Ok((open, bytes)) => {
                file = open;
                bytes
            }
            Err((filled, source)) => {
                let _ = tx.send(Err(Error::Read {
                    url: unit.url.clone(),
                    offset: offset + filled,
                    source,
                }));
                return Ok(());
            }
        };
        let filled = bytes.len();
        offset += filled as u64;
        fetcher.count(counter, filled as u64);
        let mut permit = permit;
        if filled < want {
            drop(permit.split(want - filled));
        }
        if filled > 0 && tx.send(Ok(Chunk::read(bytes, permit))).is_err() {
            return Ok(());
        }
        if filled < want {
            // The end of the file. A pipe's end is the end of its shard; a
            // regular file, or a range, must reach `end.end`.
            if end.end != u64::MAX {
                let _ = tx.send(Err(end.short(&unit.url, offset, offset)));
            }
            return Ok(());
        }
    }
    Ok(())
}

/// Reads up to `want` bytes (after seeking to `seek_to`, if given) on a
/// blocking thread, straight into a new chunk: `std::fs::File` reads into
/// the chunk's spare capacity, with no zeroing and no intermediate buffer.
/// A failed read gives the bytes of the chunk it got first, and the error.
async fn read_chunk(
    file: File,
    seek_to: Option<u64>,
    want: usize,
) -> Result<(File, Vec<u8>), (u64, std::io::Error)> {
    let work = move || {
        if let Some(at) = seek_to {
            (&file)
                .seek(std::io::SeekFrom::Start(at))
                .map_err(|e| (0, e))?;
        }
        let mut bytes = Vec::with_capacity(want);
        match (&file).take(want as u64).read_to_end(&mut bytes) {
            Ok(_) => Ok((file, bytes)),
            Err(e) => Err((bytes.len() as u64, e)),
        }
    };
    match tokio::task::spawn_blocking(work).await {
        Ok(done) => done,
        Err(join) => Err((
            0,
            std::io::Error::other(format!("file read stopped: {join}")),
        )),
    }
}

/// A local shard file whose chunks are mapped: its path, and what
/// identifies this version of it.
#[derive(Debug)]
pub struct LocalFile {
    /// The file's path, made absolute.
    pub path: std::path::PathBuf,
    /// Its identity when it was opened.
    pub identity: FileIdentity,
    /// The shard's URL, as given, for errors.
    pub url: String,
    /// Whether its members may reach another process as a reference to
    /// their place in the file: not for a cached copy of a remote shard,
    /// which eviction may delete before that process reads it.
    pub by_reference: bool,
}

/// What tells one version of a file from another: device, inode, size and
/// modification time (as `os.stat` gives them: `st_dev`, `st_ino`,
/// `st_size`, `st_mtime_ns`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileIdentity {
    /// `st_dev`.
    pub dev: u64,
    /// `st_ino`.
    pub ino: u64,
    /// `st_size`.
    pub size: u64,
    /// `st_mtime_ns`.
    pub mtime_ns: i64,
}

impl FileIdentity {
    fn of(meta: &std::fs::Metadata) -> Self {
        use std::os::unix::fs::MetadataExt;
        FileIdentity {
            dev: meta.dev(),
            ino: meta.ino(),
            size: meta.size(),
            mtime_ns: meta
                .mtime()
                .saturating_mul(1_000_000_000)
                .saturating_add(meta.mtime_nsec()),
        }
    }
}

/// Where bytes handed out from a mapped local shard lie in its file.
#[derive(Debug, Clone)]
pub struct FileOrigin {
    /// The file.
    pub file: Arc<LocalFile>,
    /// The offset of the bytes' first byte in it.
    pub offset: u64,
}

/// A mapped chunk's place: its length, its file, its offset there and its
/// entry in the fault handler's list.
type MappedPlace = (usize, Arc<LocalFile>, u64, Guard);

/// The chunks of local shards mapped in this process, by start address.
static MAPPED_CHUNKS: Mutex<BTreeMap<usize, MappedPlace>> = Mutex::new(BTreeMap::new());

type MappedChunksGuard = std::sync::MutexGuard<'static, BTreeMap<usize, MappedPlace>>;

fn mapped_chunks() -> MappedChunksGuard {
    register_fork_handlers();
    MAPPED_CHUNKS.lock().unwrap_or_else(|e| e.into_inner())
}

/// Registers, once, the functions that hold this module's locks across a
/// `fork` (see [`hold_across_fork`]).
fn register_fork_handlers() {
    static FORK_HANDLERS: std::sync::Once = std::sync::Once::new();
    FORK_HANDLERS.call_once(|| {
        // SAFETY: registers three `extern "C"` functions that only lock and
        // unlock this module's locks on the forking thread.
        unsafe {
            libc::pthread_atfork(
                Some(hold_across_fork),
                Some(release_after_fork),
                Some(release_after_fork),
            );
        }
    });
}

/// The locks held by the forking thread while it forks.
type HeldLocks = (
    Option<MappedChunksGuard>,
    Option<std::sync::MutexGuard<'static, Option<Opener>>>,
);

thread_local! {
    /// The locks held by the forking thread while it forks.
    static HELD_ACROSS_FORK: std::cell::RefCell<HeldLocks> =
        const { std::cell::RefCell::new((None, None)) };
}

/// Before a fork: takes this module's locks (never held one inside the
/// other), so that no other thread holds one at the moment of the fork (a
/// DataLoader worker would inherit it locked and wait for it forever).
extern "C" fn hold_across_fork() {
    let chunks = MAPPED_CHUNKS.lock().unwrap_or_else(|e| e.into_inner());
    let opener = OPENER.lock().unwrap_or_else(|e| e.into_inner());
    HELD_ACROSS_FORK.with(|held| *held.borrow_mut() = (Some(chunks), Some(opener)));
}

/// After a fork, in the parent and in the child: lets the locks go.
extern "C" fn release_after_fork() {
    HELD_ACROSS_FORK.with(|held| *held.borrow_mut() = (None, None));
}

/// Where `bytes` lie in a local shard, when they are a view of one of its
/// mapped chunks (a member handed out without a copy); `None` otherwise.
/// The caller holds `bytes`, so the chunk stays mapped while this looks.
pub fn file_origin(bytes: &[u8]) -> Option<FileOrigin> {
    let (file, offset, _) = mapped_place(bytes)?;
    Some(FileOrigin { file, offset })
}

/// The file, the offset and the chunk's guard of `bytes`, when they lie
/// within one mapped chunk.
fn mapped_place(bytes: &[u8]) -> Option<(Arc<LocalFile>, u64, Guard)> {
    let address = bytes.as_ptr() as usize;
    let chunks = mapped_chunks();
    let (&start, (len, file, offset, guard)) = chunks.range(..=address).next_back()?;
    (address + bytes.len() <= start + len)
        .then(|| (file.clone(), offset + (address - start) as u64, *guard))
}

/// Checks, after they were read, that `bytes` are what the file held: when
/// they are a view of a mapped chunk (a long member), that no page of them
/// was lost to the file being cut short. The caller holds `bytes`.
pub fn verify_view(bytes: &[u8]) -> Result<(), Error> {
    std::sync::atomic::fence(Ordering::SeqCst);
    if FAULTS.load(Ordering::SeqCst) == 0 {
        return Ok(());
    }
    let Some((file, _, guard)) = mapped_place(bytes) else {
        return Ok(());
    };
    guard
        .check(bytes.as_ptr() as usize, bytes.len())
        .map_err(|offset| cut_short(&file.url, offset))
}

/// A view of a mapped chunk, held while something reads it (a decoder),
/// so that what it read can be checked afterwards (see [`verify_view`]).
pub struct MappedView(Bytes);

impl MappedView {
    /// `bytes` held, when they are a view of a mapped chunk.
    pub fn of(bytes: &Bytes) -> Option<Self> {
        if bytes.len() < super::SHARE_MIN_BYTES {
            return None; // Shorter members are never views.
        }
        mapped_place(bytes).map(|_| MappedView(bytes.clone()))
    }

    /// Checks that no byte of the view was lost while it was read.
    pub fn verify(&self) -> Result<(), Error> {
        verify_view(&self.0)
    }
}

/// The error for bytes from `offset` on lost to a file cut short while it
/// was mapped.
pub(super) fn cut_short(url: &str, offset: u64) -> Error {
    Error::Read {
        url: url.to_owned(),
        offset,
        source: std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "the file was cut short while it was read (its bytes from here on are gone)",
        ),
    }
}

/// A chunk of a local file mapped into memory, listed in [`MAPPED_CHUNKS`]
/// and in the fault handler's [`SLOTS`] from when it is made until it is
/// unmapped.
struct MappedChunk {
    map: memmap2::Mmap,
    guard: Guard,
}

impl MappedChunk {
    /// `map` (of `file` from `offset`), listed, as shared bytes, with its
    /// guard; `None` (unmapped) when the fault handler's list is full.
    fn register(map: memmap2::Mmap, file: Arc<LocalFile>, offset: u64) -> Option<(Bytes, Guard)> {
        let start = map.as_ptr() as usize;
        let mut chunks = mapped_chunks();
        let slot = claim_slot(start, map.len())?;
        let guard = Guard {
            slot,
            start,
            offset,
        };
        chunks.insert(start, (map.len(), file, offset, guard));
        drop(chunks);
        Some((Bytes::from_owner(MappedChunk { map, guard }), guard))
    }
}

impl AsRef<[u8]> for MappedChunk {
    fn as_ref(&self) -> &[u8] {
        &self.map
    }
}

impl Drop for MappedChunk {
    /// Takes the chunk off the lists before its map is dropped (unmapped),
    /// so that no lookup finds an address that may be mapped again.
    fn drop(&mut self) {
        let mut chunks = mapped_chunks();
        chunks.remove(&(self.map.as_ptr() as usize));
        release_slot(self.guard.slot);
    }
}

// The fault handler.
//
// A mapped file that is cut short (truncated, or rewritten in place by a
// tool that truncates first) loses the pages past its new end from every
// mapping of it, and touching one raises SIGBUS, whose default action ends
// the process. Reading with `pread` instead would cost a copy of every
// byte: over a 300 MB epoch of 60-100 KB members, page cache warm, 95 ms of
// CPU mapped against 200-250 ms read into chunks (and 240-320 ms read into
// anonymous mappings so that members could still be shared). So the
// chunks stay mapped, and this handler turns the fault into an error:
//
// - Every mapped chunk is listed in `SLOTS`, a fixed array that the handler
//   reads without a lock (a sequence count per slot tells it a slot being
//   written).
// - On SIGBUS at an address inside a listed chunk, the handler notes the
//   lowest lost page in the chunk's slot, counts the fault in `FAULTS`, maps
//   a page of zeros over the faulting page (`mmap` with `MAP_FIXED`: a
//   system call, safe in a signal handler) and returns, so the access
//   completes and reads zeros.
// - Every reader of mapped bytes checks, after copying them, that the
//   chunk lost no page at or before its range (`Guard::check`, one atomic
//   load while `FAULTS` is 0) and raises `ShardReadError` naming the shard
//   and offset otherwise: the zeros never reach a sample.
// - Any other SIGBUS (not in a listed chunk, or sent with `kill`) goes to
//   the handler that was installed before this one (Python's
//   `faulthandler`, torch's DataLoader worker handler), which is put back
//   first, or to the default action. The handler is installed again over
//   one installed later (checked before each chunk is mapped), and a chunk
//   is read rather than mapped if it cannot be installed or the list is
//   full.

/// A mapped chunk's entry in [`SLOTS`], with what locates its bytes in the
/// file: what a reader of the chunk checks after copying bytes out of it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Guard {
    slot: usize,
    /// The chunk's first address.
    start: usize,
    /// The file offset of its first byte.
    offset: u64,
}

impl Guard {
    /// `Ok` when the `len` bytes at `begin` (inside the chunk), already
    /// read, came from the file; otherwise the file offset from which they
    /// may not have (pages lost to the file being cut short read as zeros).
    pub(super) fn check(&self, begin: usize, len: usize) -> Result<(), u64> {
        if len == 0 {
            return Ok(());
        }
        std::sync::atomic::fence(Ordering::SeqCst);
        if FAULTS.load(Ordering::SeqCst) == 0 {
            return Ok(());
        }
        let lost = SLOTS[self.slot].lost.load(Ordering::SeqCst);
        if begin + len <= lost {
            return Ok(());
        }
        Err(self.offset + (begin.max(lost) - self.start) as u64)
    }
}

/// One mapped chunk as the fault handler sees it.
struct Slot {
    /// Odd while the slot is written.
    sequence: AtomicUsize,
    /// The chunk's first address; 0 when the slot is free.
    start: AtomicUsize,
    /// Its end (exclusive).
    end: AtomicUsize,
    /// The first address of the lowest page lost to a fault, or
    /// `usize::MAX` (while the slot is taken).
    lost: AtomicUsize,
}

/// Slots for this many chunks mapped at once (past it, chunks are read).
const SLOT_COUNT: usize = 8192;

static SLOTS: [Slot; SLOT_COUNT] = [const {
    Slot {
        sequence: AtomicUsize::new(0),
        start: AtomicUsize::new(0),
        end: AtomicUsize::new(0),
        // Set to `usize::MAX` when the slot is taken; all zeros until then,
        // so that the array takes no room in the library file.
        lost: AtomicUsize::new(0),
    }
}; SLOT_COUNT];

/// Slots `0..SLOTS_USED` have been used (the handler looks no further).
static SLOTS_USED: AtomicUsize = AtomicUsize::new(0);

/// Free slots below [`SLOTS_USED`]; changed only under the
/// [`MAPPED_CHUNKS`] lock.
static FREE_SLOTS: Mutex<Vec<usize>> = Mutex::new(Vec::new());

/// Faults the handler has turned into pages of zeros in this process.
static FAULTS: AtomicUsize = AtomicUsize::new(0);

/// Writes a slot (under the [`MAPPED_CHUNKS`] lock), so that the handler
/// never takes a half-written slot for a whole one.
fn write_slot(slot: usize, start: usize, end: usize) {
    let entry = &SLOTS[slot];
    let sequence = entry.sequence.load(Ordering::Relaxed);
    entry.sequence.store(sequence + 1, Ordering::Relaxed);
    std::sync::atomic::fence(Ordering::Release);
    entry.start.store(start, Ordering::Relaxed);
    entry.end.store(end, Ordering::Relaxed);
    entry.lost.store(usize::MAX, Ordering::Relaxed);
    entry.sequence.store(sequence + 2, Ordering::Release);
}

/// Lists the `len` bytes mapped at `start` for the handler (the caller
/// holds the [`MAPPED_CHUNKS`] lock); `None` when every slot is taken.
fn claim_slot(start: usize, len: usize) -> Option<usize> {
    let mut free = FREE_SLOTS.lock().unwrap_or_else(|e| e.into_inner());
    let slot = match free.pop() {
        Some(slot) => slot,
        None => {
            let used = SLOTS_USED.load(Ordering::Relaxed);
            if used == SLOT_COUNT {
                return None;
            }
            used
        }
    };
    write_slot(slot, start, start + len.next_multiple_of(page_size()));
    SLOTS_USED.fetch_max(slot + 1, Ordering::Release);
    Some(slot)
}

/// Takes a chunk off the handler's list (the caller holds the
/// [`MAPPED_CHUNKS`] lock), before it is unmapped.
fn release_slot(slot: usize) {
    write_slot(slot, 0, 0);
    FREE_SLOTS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(slot);
}

/// The listed chunk that holds `address`, read without a lock.
fn slot_holding(address: usize) -> Option<&'static Slot> {
    let used = SLOTS_USED.load(Ordering::Acquire).min(SLOT_COUNT);
    SLOTS[..used].iter().find(|entry| {
        let before = entry.sequence.load(Ordering::Acquire);
        let (start, end) = (
            entry.start.load(Ordering::Relaxed),
            entry.end.load(Ordering::Relaxed),
        );
        std::sync::atomic::fence(Ordering::Acquire);
        let after = entry.sequence.load(Ordering::Relaxed);
        before % 2 == 0 && before == after && start != 0 && (start..end).contains(&address)
    })
}

/// The page size, for the handler (set before it is installed).
static HANDLER_PAGE: AtomicUsize = AtomicUsize::new(0);

/// The SIGBUS action that was in place before the handler: where other
/// faults go. Set before each install; never freed (a handler running on
/// another thread may read it).
static PREVIOUS: AtomicPtr<libc::sigaction> = AtomicPtr::new(std::ptr::null_mut());

/// Set while a SIGBUS that is not ours is passed on: one that comes back
/// to this handler (a previous handler that raises it again) goes to the
/// default action rather than round in a loop.
static PASSING_ON: AtomicBool = AtomicBool::new(false);

/// Installs the handler if it is not the process's SIGBUS action now (the
/// first time, or after another library installed its own over it);
/// `false` if it cannot be installed. Installs run under the
/// [`MAPPED_CHUNKS`] lock, so they do not race each other.
fn fault_handler_installed() -> bool {
    let _serialised = mapped_chunks();
    let ours = on_sigbus as *const () as libc::sighandler_t;
    // SAFETY: `sigaction` with a null new action only reads the current one
    // into a zeroed struct of ours.
    let mut current: libc::sigaction = unsafe { std::mem::zeroed() };
    if unsafe { libc::sigaction(libc::SIGBUS, std::ptr::null(), &mut current) } != 0 {
        return false;
    }
    if current.sa_sigaction == ours {
        return true;
    }
    HANDLER_PAGE.store(page_size(), Ordering::SeqCst);
    PREVIOUS.store(Box::into_raw(Box::new(current)), Ordering::SeqCst);
    // SAFETY: a zeroed `sigaction` with an empty mask is valid; the handler
    // is an `extern "C"` function of the signature SA_SIGINFO asks for.
    let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
    action.sa_sigaction = ours;
    action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
    unsafe { libc::sigemptyset(&mut action.sa_mask) };
    let mut replaced: libc::sigaction = unsafe { std::mem::zeroed() };
    if unsafe { libc::sigaction(libc::SIGBUS, &action, &mut replaced) } != 0 {
        return false;
    }
    if replaced.sa_sigaction != current.sa_sigaction {
        // Another action came in between: pass faults on to that one.
        PREVIOUS.store(Box::into_raw(Box::new(replaced)), Ordering::SeqCst);
    }
    PASSING_ON.store(false, Ordering::SeqCst);
    true
}

/// The SIGBUS handler (see the comment above [`Guard`]). Uses only atomics
/// and async-signal-safe system calls.
extern "C" fn on_sigbus(
    signal: libc::c_int,
    info: *mut libc::siginfo_t,
    context: *mut libc::c_void,
) {
    let errno = errno_location();
    // SAFETY: reads the thread's errno, to give it back unchanged.
    let saved = unsafe { errno.map(|e| *e) };
    // SAFETY: the kernel passes a valid `siginfo_t` with SA_SIGINFO; a
    // positive code is a fault of this thread's own, whose address field
    // is the faulting address.
    let fault = unsafe { info.as_ref() }
        .filter(|info| info.si_code > 0)
        .map(|info| unsafe { info.si_addr() } as usize);
    let handled = fault.is_some_and(zero_fill);
    if !handled {
        // SAFETY: passes the handler's own arguments on.
        unsafe { pass_on(signal, info, context) };
    }
    if let (Some(errno), Some(saved)) = (errno, saved) {
        // SAFETY: as above.
        unsafe { *errno = saved };
    }
}

/// When `address` lies in a listed chunk: notes the lost page, maps a
/// page of zeros over it and gives `true`.
fn zero_fill(address: usize) -> bool {
    let Some(entry) = slot_holding(address) else {
        return false;
    };
    let page = HANDLER_PAGE.load(Ordering::SeqCst);
    if page == 0 {
        return false;
    }
    let first = address / page * page;
    // Marked before the zeros can be read: a reader that reads them then
    // sees the mark.
    entry.lost.fetch_min(first, Ordering::SeqCst);
    FAULTS.fetch_add(1, Ordering::SeqCst);
    // SAFETY: replaces one page of a chunk mapping of ours (which stays
    // mapped: the faulting access holds it) with a private anonymous page
    // of zeros, read-only like the mapping.
    let mapped = unsafe {
        libc::mmap(
            first as *mut libc::c_void,
            page,
            libc::PROT_READ,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
            -1,
            0,
        )
    };
    mapped != libc::MAP_FAILED
}

/// Passes a SIGBUS that is not ours to the action installed before the
/// handler, after putting that action back in place; or, the second time
/// round or with no such action, to the default action.
///
/// # Safety
/// Called from the handler, with its arguments.
unsafe fn pass_on(signal: libc::c_int, info: *mut libc::siginfo_t, context: *mut libc::c_void) {
    let previous = PREVIOUS.load(Ordering::SeqCst);
    let sent = unsafe { info.as_ref() }.is_none_or(|info| info.si_code <= 0);
    if PASSING_ON.swap(true, Ordering::SeqCst) || previous.is_null() {
        // SAFETY: a zeroed action is SIG_DFL with an empty mask.
        let mut default: libc::sigaction = unsafe { std::mem::zeroed() };
        default.sa_sigaction = libc::SIG_DFL;
        unsafe { libc::sigaction(signal, &default, std::ptr::null_mut()) };
        if sent {
            // Delivered when the handler returns (SIGBUS is blocked in it).
            unsafe { libc::raise(signal) };
        }
        // A fault happens again when the handler returns, to the default.
        return;
    }
    // SAFETY: `previous` came from `Box::into_raw` and is never freed.
    let previous = unsafe { &*previous };
    unsafe { libc::sigaction(signal, previous, std::ptr::null_mut()) };
    match previous.sa_sigaction {
        libc::SIG_DFL => {
            if sent {
                unsafe { libc::raise(signal) };
            }
        }
        libc::SIG_IGN => {}
        handler if previous.sa_flags & libc::SA_SIGINFO != 0 => {
            // SAFETY: an action installed with SA_SIGINFO has this signature.
            let handler: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                unsafe { std::mem::transmute(handler) };
            handler(signal, info, context);
        }
        handler => {
            // SAFETY: an action installed without SA_SIGINFO has this signature.
            let handler: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(handler) };
            handler(signal);
        }
    }
}

/// The calling thread's `errno`.
fn errno_location() -> Option<*mut libc::c_int> {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    // SAFETY: returns the calling thread's errno address.
    return Some(unsafe { libc::__errno_location() });
    #[cfg(any(target_os = "macos", target_os = "ios", target_os = "freebsd"))]
    // SAFETY: as above.
    return Some(unsafe { libc::__error() });
    #[allow(unreachable_code)]
    None
}
/// A member's bytes inside a chunk mapped from a file. Holding it keeps the
/// chunk mapped; dropping it drops the pages that hold only this member's
/// bytes from the mapping, so that a chunk kept mapped by a few samples
/// still in the shuffle buffer holds their pages, not the whole chunk's.
pub(super) struct MappedMember {
    chunk: Bytes,
    start: usize,
    len: usize,
}

impl MappedMember {
    /// The `len` bytes of `chunk` from `start`.
    pub(super) fn new(chunk: Bytes, start: usize, len: usize) -> Self {
        assert!(start + len <= chunk.len(), "member within its chunk");
        MappedMember { chunk, start, len }
    }
}

impl AsRef<[u8]> for MappedMember {
    fn as_ref(&self) -> &[u8] {
        &self.chunk[self.start..self.start + self.len]
    }
}

impl Drop for MappedMember {
    fn drop(&mut self) {
        let begin = self.chunk.as_ptr() as usize + self.start;
        if let Some(pages) = whole_pages(begin, self.len, page_size()) {
            // SAFETY: the whole pages of `pages` lie inside the
            // chunk's mapping, which `self.chunk` keeps mapped, and hold
            // only this member's bytes. Dropping pages of a read-only file
            // mapping loses nothing: a later read maps them again from the
            // file. A failure leaves the pages mapped, which is harmless.
            unsafe {
                libc::madvise(
                    pages.start as *mut libc::c_void,
                    pages.len(),
                    libc::MADV_DONTNEED,
                );
            }
        }
    }
}

/// The whole pages (of `page` bytes) within the `len` bytes at address
/// `begin`, if there are any.
fn whole_pages(begin: usize, len: usize, page: usize) -> Option<std::ops::Range<usize>> {
    let first = begin.next_multiple_of(page);
    let last = (begin + len) / page * page;
    (last > first).then_some(first..last)
}

/// The size of a memory page.
fn page_size() -> usize {
    static PAGE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    // SAFETY: sysconf only reads a configuration value.
    *PAGE.get_or_init(|| {
        usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096)
    })
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn read_ahead(
        path: &Path,
        range: Option<std::ops::Range<u64>>,
        chunk: usize,
        budget: usize,
    ) -> super::super::ReadAhead {
        let unit = FetchUnit {
            url: path.display().to_string(),
            location: crate::location::Location::Local(path.to_owned()),
            range,
            size: None,
            etag: None,
        };
        let options = super::super::ReadAheadOptions {
            budget_bytes: budget,
            chunk_bytes: chunk,
            io_timeout: Duration::from_secs(20),
            s3: crate::config::S3Options::default(),
            cache: None,
        };
        let counters = Arc::new(crate::stats::Counters::new());
        super::super::ReadAhead::start(vec![unit], options, counters).unwrap()
    }

    /// Bytes with no zero among them, so that a zero read is a lost byte.
    fn content(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 31 % 251 + 1) as u8).collect()
    }

    /// Reads `reader` to its end or its error: the bytes read, and the
    /// error's offset and message.
    fn read_all(reader: &mut super::super::ShardReader) -> (Vec<u8>, Option<(u64, String)>) {
        use crate::format::ByteSource;
        let mut all = Vec::new();
        let mut buf = vec![0; 64 << 10];
        loop {
            match reader.read(&mut buf) {
                Ok(0) => return (all, None),
                Ok(n) => all.extend_from_slice(&buf[..n]),
                Err(_) => {
                    let failure = reader.take_failure().expect("the error is kept");
                    let offset = match &failure {
                        Error::Read { offset, .. } => *offset,
                        other => panic!("not a read error: {other}"),
                    };
                    return (all, Some((offset, failure.to_string())));
                }
            }
        }
    }

    #[test]
    fn a_file_cut_short_under_its_mapped_chunk_is_a_read_error_not_a_sigbus() {
        let page = page_size();
        let bytes = content(4 << 20);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shard.tar");
        std::fs::write(&path, &bytes).unwrap();
        let read_ahead = read_ahead(&path, None, 1 << 20, 4 << 20);
        let mut reader = read_ahead.next_shard().unwrap().unwrap();
        let mut head = vec![0; 1000];
        reader.read_exact(&mut head).unwrap();
        assert_eq!(head, bytes[..1000]);
        // A member handed out as a view of the mapped chunk, before the cut.
        use crate::format::ByteSource;
        let view = reader.read_shared(200_000).unwrap().expect("a view");
        let pinned = MappedView::of(&view).expect("a view of a mapped chunk");

        std::fs::File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(2 * page as u64)
            .unwrap();
        // Touching the view's lost pages faults: they read as zeros, and the
        // check after the read says where the file's bytes end.
        let zeros = view.iter().filter(|&&b| b == 0).count();
        assert!(zeros > 0, "the lost pages read as zeros");
        let error = pinned
            .verify()
            .expect_err("the view lost pages")
            .to_string();
        assert!(
            error.contains(&format!("byte offset {}", 2 * page)) && error.contains("cut short"),
            "{error}"
        );
        assert_eq!(
            verify_view(&view[..2 * page - 1000]).map_err(|e| e.to_string()),
            Ok(()),
            "the bytes before the cut are the file's"
        );

        let (rest, failure) = read_all(&mut reader);
        let (offset, message) = failure.expect("an error, not a shorter shard");
        assert_eq!(offset, 201_000, "{message}");
        assert!(
            message.contains("shard.tar") && message.contains("cut short"),
            "{message}"
        );
        assert!(
            rest.len() < 64 << 10,
            "no bytes after the cut: {}",
            rest.len()
        );
    }

    #[test]
    fn a_file_that_shrinks_before_its_next_chunk_is_mapped_is_a_read_error() {
        let bytes = content(4 << 20);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shard.tar");
        std::fs::write(&path, &bytes).unwrap();
        // A budget of one chunk: the next is mapped once this one is done.
        let read_ahead = read_ahead(&path, None, 1 << 20, 1 << 20);
        let mut reader = read_ahead.next_shard().unwrap().unwrap();
        let mut head = vec![0; 1000];
        reader.read_exact(&mut head).unwrap();
        let cut = (3 << 20) / 2;
        std::fs::File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(cut)
            .unwrap();
        let (rest, failure) = read_all(&mut reader);
        let (offset, message) = failure.expect("an error, not a shorter shard");
        assert_eq!(offset, cut, "{message}");
        // Found by the size check before the next chunk is mapped, or, when
        // the I/O thread had mapped it already, by the fault on its lost
        // pages: either way an error at the cut, never a shorter shard.
        assert!(
            (message.contains("shrank") && message.contains(&format!("{cut} bytes now")))
                || message.contains("cut short"),
            "{message}"
        );
        assert_eq!([head, rest].concat(), bytes[..cut as usize]);
    }

    #[test]
    fn a_range_past_the_end_of_the_file_is_a_read_error_naming_the_offset() {
        let bytes = content(10_000);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shard.tar");
        std::fs::write(&path, &bytes).unwrap();
        let past = read_ahead(&path, Some(5000..20_000), 1 << 20, 4 << 20);
        let mut reader = past.next_shard().unwrap().unwrap();
        let (read, failure) = read_all(&mut reader);
        let (offset, message) = failure.expect("an error, not a shorter range");
        assert_eq!(offset, 10_000, "{message}");
        assert!(
            message.contains("before the end of the range asked for (byte 20000)"),
            "{message}"
        );
        assert!(read.is_empty());

        // A range within the file is read whole.
        let within = read_ahead(&path, Some(5000..10_000), 1 << 20, 4 << 20);
        let mut reader = within.next_shard().unwrap().unwrap();
        assert_eq!(read_all(&mut reader), (bytes[5000..].to_vec(), None));
    }

    #[test]
    fn a_pipe_that_ends_before_the_range_asked_for_is_a_read_error() {
        let bytes = content(200_000);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pipe.tar");
        let fifo = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
        // SAFETY: creates a named pipe at a path this test owns.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        let writer = {
            let (path, bytes) = (path.clone(), bytes.clone());
            std::thread::spawn(move || std::fs::write(path, bytes).unwrap())
        };
        let read_ahead = read_ahead(&path, Some(0..300_000), 64 << 10, 1 << 20);
        let mut reader = read_ahead.next_shard().unwrap().unwrap();
        let (read, failure) = read_all(&mut reader);
        writer.join().unwrap();
        let (offset, message) = failure.expect("an error, not a shorter range");
        assert_eq!(offset, 200_000, "{message}");
        assert!(
            message.contains("before the end of the range asked for (byte 300000)"),
            "{message}"
        );
        assert_eq!(read, bytes);
    }

    #[test]
    fn the_handler_finds_listed_chunks_only() {
        let page = page_size();
        let _chunks = mapped_chunks();
        let slot = claim_slot(1 << 40, 3 * page + 1).expect("a free slot");
        assert!(std::ptr::eq(slot_holding(1 << 40).unwrap(), &SLOTS[slot]));
        assert!(
            slot_holding((1 << 40) + 4 * page - 1).is_some(),
            "its last page"
        );
        assert!(slot_holding((1 << 40) + 4 * page).is_none());
        assert!(slot_holding((1 << 40) - 1).is_none());
        release_slot(slot);
        assert!(slot_holding(1 << 40).is_none());
    }

    proptest! {
        #[test]
        fn whole_pages_are_the_aligned_pages_inside_the_range(
            begin in 0usize..1 << 20,
            len in 0usize..1 << 16,
            shift in 9u32..14,
        ) {
            let page = 1usize << shift;
            match whole_pages(begin, len, page) {
                Some(pages) => {
                    prop_assert_eq!(pages.start % page, 0);
                    prop_assert_eq!(pages.end % page, 0);
                    prop_assert!(begin <= pages.start && pages.end <= begin + len);
                    // No whole page is left out at either end.
                    prop_assert!(pages.start - begin < page);
                    prop_assert!(begin + len - pages.end < page);
                }
                None => {
                    let first = begin.next_multiple_of(page);
                    prop_assert!(first + page > begin + len);
                }
            }
        }
    }

    /// The resident size, in kB, of this process's mapping that holds `address`.
    fn mapping_rss_kb(address: usize) -> u64 {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut inside = false;
        for line in smaps.lines() {
            let range = line.split_whitespace().next().unwrap_or("");
            if let Some((start, end)) = range.split_once('-') {
                if let (Ok(start), Ok(end)) = (
                    usize::from_str_radix(start, 16),
                    usize::from_str_radix(end, 16),
                ) {
                    inside = (start..end).contains(&address);
                    continue;
                }
            }
            if inside {
                if let Some(kb) = line.strip_prefix("Rss:") {
                    return kb.trim().trim_end_matches("kB").trim().parse().unwrap();
                }
            }
        }
        panic!("no mapping holds {address:#x}");
    }

    #[test]
    fn a_child_forked_while_another_thread_holds_the_list_can_use_it() {
        drop(mapped_chunks());
        let (locked_tx, locked_rx) = std::sync::mpsc::channel();
        let holder = std::thread::spawn(move || {
            let guard = mapped_chunks();
            locked_tx.send(()).unwrap();
            std::thread::sleep(std::time::Duration::from_millis(200));
            drop(guard);
        });
        locked_rx.recv().unwrap();
        // SAFETY: the child only looks the list up and leaves with `_exit`.
        let child = unsafe { libc::fork() };
        if child == 0 {
            let found = file_origin(&[0u8; 8]).is_some();
            unsafe { libc::_exit(if found { 2 } else { 0 }) };
        }
        assert!(child > 0, "fork failed");
        holder.join().unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let mut status = 0;
        loop {
            // SAFETY: waits for (or, past the deadline, kills) our own child.
            let done = unsafe { libc::waitpid(child, &mut status, libc::WNOHANG) };
            if done == child {
                break;
            }
            if std::time::Instant::now() > deadline {
                unsafe { libc::kill(child, libc::SIGKILL) };
                unsafe { libc::waitpid(child, &mut status, 0) };
                panic!("the child waited for the list's lock for 10 s");
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0);
    }

    #[test]
    fn a_dropped_member_gives_back_its_own_pages_and_nothing_else() {
        let page = page_size();
        let content: Vec<u8> = (0..64 * page).map(|i| (i * 7 % 251) as u8).collect();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shard.tar");
        std::fs::write(&path, &content).unwrap();
        let file = File::open(&path).unwrap();
        // SAFETY: a file of this test's own, not modified while mapped.
        let map = unsafe { memmap2::MmapOptions::new().populate().map(&file) }.unwrap();
        let chunk = Bytes::from_owner(map);
        let address = chunk.as_ptr() as usize;
        let full_kb = mapping_rss_kb(address);
        assert_eq!(full_kb, (64 * page / 1024) as u64);

        // 10 pages' worth of bytes starting inside page 3: pages 4 to 12
        // are the member's alone.
        let (start, len) = (3 * page + 100, 10 * page);
        let member = Bytes::from_owner(MappedMember::new(chunk.clone(), start, len));
        assert_eq!(&member[..], &content[start..start + len]);
        let copy = member.clone();
        drop(member);
        assert_eq!(mapping_rss_kb(address), full_kb, "a clone still holds it");
        drop(copy);
        assert_eq!(mapping_rss_kb(address), full_kb - (9 * page / 1024) as u64);
        // The chunk still reads as the file: dropped pages map in again.
        assert_eq!(&chunk[..], &content[..]);
    }
}
