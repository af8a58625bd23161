//! Local files (plain paths and `file://` URLs). A regular file is mapped
//! into memory a chunk at a time, its pages populated on a blocking
//! thread, so that the parser finds them resident and no byte is copied to
//! reach it; anything that cannot be mapped (a pipe, a file system without
//! `mmap`) is read into chunks instead.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Seek};
use std::path::Path;
use std::sync::{Arc, Mutex};

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
    path: &Path,
    tx: &ChunkSender,
) -> Result<(), ConsumerGone> {
    let url = unit.url.as_str();
    // A failed send means the shard's reader is gone: nothing more to do.
    let report = |error: Error| {
        let _ = tx.send(Err(error));
        Ok(())
    };
    let file = match tokio::fs::File::open(path).await {
        Ok(file) => file,
        Err(e) => return report(Error::from_open(url, e)),
    };
    let meta = file.metadata().await.ok();
    if meta.as_ref().is_some_and(|m| m.is_dir()) {
        let source = std::io::Error::other("is a directory");
        return report(Error::Read {
            url: url.to_owned(),
            offset: 0,
            source,
        });
    }
    fetcher.count(Counter::ShardsOpened, 1);
    let (mut offset, end) = match &unit.range {
        Some(range) => (range.start, range.end),
        None => (0, u64::MAX),
    };
    let mut file = file.into_std().await;
    if let Some(meta) = meta.filter(|m| m.is_file()) {
        let size = meta.len();
        let local = Arc::new(LocalFile {
            // Absolute, so that another process (a DataLoader's main
            // process) finds the file whatever its working directory.
            path: std::path::absolute(path).unwrap_or_else(|_| path.to_owned()),
            identity: FileIdentity::of(&meta),
        });
        let mapping = (file, local);
        let (open, unmapped) = map_chunks(fetcher, mapping, offset, end.min(size), tx).await?;
        let Some(unmapped) = unmapped else {
            return Ok(());
        };
        (file, offset) = (open, unmapped);
    }
    read_chunks(fetcher, unit, file, offset, end, tx).await
}

/// Maps `file` from `offset` to `end` a chunk at a time and sends the
/// chunks. Gives the file back with the offset of a chunk that could not be
/// mapped, for reading to take over; `None` once done (or once the shard's
/// reader is gone).
async fn map_chunks(
    fetcher: &Fetcher,
    (mut file, local): (File, Arc<LocalFile>),
    mut offset: u64,
    end: u64,
    tx: &ChunkSender,
) -> Result<(File, Option<u64>), ConsumerGone> {
    while offset < end {
        let want = usize::try_from(end - offset)
            .map_or(fetcher.chunk_bytes, |left| left.min(fetcher.chunk_bytes));
        let Some(permit) = fetcher.reserve(want).await else {
            return Err(ConsumerGone);
        };
        let (open, mapped) = map_chunk(file, local.clone(), offset, want).await?;
        file = open;
        let Some(bytes) = mapped else {
            return Ok((file, Some(offset)));
        };
        fetcher.count(Counter::BytesRead, want as u64);
        let chunk = Chunk {
            bytes,
            mapped: true,
            _permit: permit,
        };
        if tx.send(Ok(chunk)).is_err() {
            return Ok((file, None));
        }
        offset += want as u64;
    }
    Ok((file, None))
}

/// Maps `len` bytes of `file` from `offset` with their pages populated (read
/// from disk if they are not cached), on a blocking thread; gives the file
/// back, and `None` if it cannot be mapped. The blocking task fails only
/// when the runtime is shutting down, its consumer gone.
async fn map_chunk(
    file: File,
    local: Arc<LocalFile>,
    offset: u64,
    len: usize,
) -> Result<(File, Option<Bytes>), ConsumerGone> {
    let work = move || {
        // SAFETY: the range lies within the file's size when it was
        // opened; shards are not modified while they are read (a file
        // truncated under a mapping is the one way to fault, as with any
        // memory-mapped reader).
        let map = unsafe {
            memmap2::MmapOptions::new()
                .offset(offset)
                .len(len)
                .populate()
                .map(&file)
        };
        let chunk = map
            .ok()
            .map(|map| MappedChunk::register(map, local, offset));
        (file, chunk)
    };
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|_| ConsumerGone)
}

/// Reads `file` from `offset` to `end` (or its end) sequentially into
/// chunks sent to `tx`; errors are sent too.
async fn read_chunks(
    fetcher: &Fetcher,
    unit: &FetchUnit,
    mut file: File,
    mut offset: u64,
    end: u64,
    tx: &ChunkSender,
) -> Result<(), ConsumerGone> {
    let mut seek_to = (offset > 0).then_some(offset);
    while offset < end {
        let want = usize::try_from(end - offset)
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
        if filled == 0 {
            return Ok(());
        }
        offset += filled as u64;
        fetcher.count(Counter::BytesRead, filled as u64);
        let mut permit = permit;
        if filled < want {
            drop(permit.split(want - filled));
        }
        if tx.send(Ok(Chunk::read(bytes, permit))).is_err() || filled < want {
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

/// A mapped chunk's place: its length, its file and its offset there.
type MappedPlace = (usize, Arc<LocalFile>, u64);

/// The chunks of local shards mapped in this process, by start address.
static MAPPED_CHUNKS: Mutex<BTreeMap<usize, MappedPlace>> = Mutex::new(BTreeMap::new());

type MappedChunksGuard = std::sync::MutexGuard<'static, BTreeMap<usize, MappedPlace>>;

fn mapped_chunks() -> MappedChunksGuard {
    static FORK_HANDLERS: std::sync::Once = std::sync::Once::new();
    FORK_HANDLERS.call_once(|| {
        // SAFETY: registers three `extern "C"` functions that only lock and
        // unlock the list on the forking thread (see `hold_across_fork`).
        unsafe {
            libc::pthread_atfork(
                Some(hold_across_fork),
                Some(release_after_fork),
                Some(release_after_fork),
            );
        }
    });
    MAPPED_CHUNKS.lock().unwrap_or_else(|e| e.into_inner())
}

thread_local! {
    /// The list's lock, held by the forking thread while it forks.
    static HELD_ACROSS_FORK: std::cell::RefCell<Option<MappedChunksGuard>> =
        const { std::cell::RefCell::new(None) };
}

/// Before a fork: takes the list's lock, so that no other thread holds it
/// at the moment of the fork (a DataLoader worker would inherit it locked
/// and wait for it forever).
extern "C" fn hold_across_fork() {
    let guard = MAPPED_CHUNKS.lock().unwrap_or_else(|e| e.into_inner());
    HELD_ACROSS_FORK.with(|held| *held.borrow_mut() = Some(guard));
}

/// After a fork, in the parent and in the child: lets the lock go.
extern "C" fn release_after_fork() {
    HELD_ACROSS_FORK.with(|held| held.borrow_mut().take());
}

/// Where `bytes` lie in a local shard, when they are a view of one of its
/// mapped chunks (a member handed out without a copy); `None` otherwise.
/// The caller holds `bytes`, so the chunk stays mapped while this looks.
pub fn file_origin(bytes: &[u8]) -> Option<FileOrigin> {
    let address = bytes.as_ptr() as usize;
    let chunks = mapped_chunks();
    let (&start, (len, file, offset)) = chunks.range(..=address).next_back()?;
    (address + bytes.len() <= start + len).then(|| FileOrigin {
        file: file.clone(),
        offset: offset + (address - start) as u64,
    })
}

/// A chunk of a local file mapped into memory, listed in [`MAPPED_CHUNKS`]
/// from when it is made until it is unmapped.
struct MappedChunk {
    map: memmap2::Mmap,
}

impl MappedChunk {
    /// `map` (of `file` from `offset`), listed, as shared bytes.
    fn register(map: memmap2::Mmap, file: Arc<LocalFile>, offset: u64) -> Bytes {
        mapped_chunks().insert(map.as_ptr() as usize, (map.len(), file, offset));
        Bytes::from_owner(MappedChunk { map })
    }
}

impl AsRef<[u8]> for MappedChunk {
    fn as_ref(&self) -> &[u8] {
        &self.map
    }
}

impl Drop for MappedChunk {
    /// Takes the chunk off the list before its map is dropped (unmapped), so
    /// that no lookup finds an address that may be mapped again.
    fn drop(&mut self) {
        mapped_chunks().remove(&(self.map.as_ptr() as usize));
    }
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
