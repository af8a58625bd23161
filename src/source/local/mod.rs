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

mod opener;
mod pages;
mod sigbus;

pub(super) use pages::MappedMember;
pub(super) use sigbus::Guard;

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Seek};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;

use super::fetch::{Chunk, ChunkSender, ConsumerGone, FetchUnit, Fetcher, SHARE_MIN_BYTES};
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

/// Opens `path` on the process's opener thread (see [`opener::OPENER`]) and waits
/// for it. An open that has not returned after `stuck_after` makes every
/// later one fail at once, with an error naming the shard and the file
/// that blocks, until it returns. `Err` when the runtime is shutting down.
async fn open(
    url: &str,
    path: &Path,
    stuck_after: Duration,
) -> Result<Result<(File, std::fs::Metadata), Error>, ConsumerGone> {
    register_fork_handlers();
    let reply = match opener::request_open(path, stuck_after) {
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
    let page = pages::page_size();
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

/// The lock of the mapped chunks' list (fork handlers registered first).
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
    Option<std::sync::MutexGuard<'static, Option<opener::Opener>>>,
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
    let opener = opener::OPENER.lock().unwrap_or_else(|e| e.into_inner());
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
    if !sigbus::any_fault() {
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
        if bytes.len() < SHARE_MIN_BYTES {
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
        let slot = sigbus::claim_slot(start, map.len())?;
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
        sigbus::release_slot(self.guard.slot);
    }
}

/// Installs the SIGBUS handler if it is not the process's action now (see
/// [`sigbus::install_handler`]), under the mapped chunks' lock; `false` if
/// it cannot be installed (chunks are then read rather than mapped).
fn fault_handler_installed() -> bool {
    let _serialised = mapped_chunks();
    sigbus::install_handler()
}

#[cfg(test)]
mod tests {
    use super::pages::page_size;

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
            s3: crate::config::StoreOptions::default(),
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
