//! Local files (plain paths and `file://` URLs): how they are opened and
//! mapped. Files are opened on one thread per process (see [`open`]), so
//! that an `open` that never returns (a pipe with no writer, a hung
//! network mount) holds that one thread, not one per attempt. A regular
//! file is mapped into memory a chunk at a time ([`map_chunk`]), its pages
//! populated on a blocking thread, so that the parser finds them resident
//! and no byte is copied to reach it; each mapped chunk is listed with its
//! file and offset, so that bytes handed out without a copy can name
//! their place ([`file_origin`]), and with the fault handler (`sigbus`),
//! so that a file cut short while mapped is an error, never zeros. The
//! read-ahead (`source/`) sends the chunks on, and reads what
//! cannot be mapped (a pipe, a file system without `mmap`).

mod opener;
mod pages;
mod sigbus;

#[cfg(test)]
pub(crate) use pages::waiting_page_ranges;
pub(crate) use pages::{release_pending, MappedMember};
pub(crate) use sigbus::Guard;

use std::collections::BTreeMap;
use std::fs::File;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;

use crate::error::Error;
use crate::fork::{self, ForkHandlers};

/// The most bytes of a local file mapped at once (less when the read-ahead
/// budget is smaller). Each mapping costs a `mmap`, populating its pages,
/// a `munmap` with its TLB shootdown once its last member's pages go back
/// (with their thread's lot: see `pages`), and a
/// thread hand-off, and a member that crosses a mapping's end is copied:
/// over audio epochs at workers 0 (80 KB members, 2 cores) 4 MiB
/// mappings took 10% less CPU and delivered 17-24% more samples per
/// second than 1 MiB ones (docs/performance.md, "Larger mappings of local
/// shards").
pub const MAP_CHUNK_BYTES: usize = 4 << 20;

/// The shortest member handed out as a view of its mapped chunk (and, in
/// a DataLoader worker, as a reference to its place in the file) rather
/// than copied.
pub const SHARE_MIN_BYTES: usize = 16 << 10;

/// Opens `path` on the process's opener thread (see [`opener::OPENER`]) and waits
/// for it. An open that has not returned after `stuck_after` makes every
/// later one fail at once, with an error naming the shard and the file
/// that blocks, until it returns. `None` when the runtime is shutting down.
pub(crate) async fn open(
    url: &str,
    path: &Path,
    stuck_after: Duration,
) -> Option<Result<(File, std::fs::Metadata), Error>> {
    register_fork_handlers();
    let reply = match opener::request_open(path, stuck_after) {
        Ok(reply) => reply,
        Err(refused) => {
            let source = std::io::Error::new(std::io::ErrorKind::TimedOut, refused);
            return Some(Err(Error::Read {
                url: url.to_owned(),
                offset: 0,
                source,
            }));
        }
    };
    match reply.await {
        Ok(Ok(opened)) => Some(Ok(opened)),
        Ok(Err(e)) => Some(Err(Error::from_open(url, e))),
        Err(_) => None,
    }
}

/// What became of one chunk to map.
pub(crate) enum MapOutcome {
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
/// handler; gives the file back. `None` when the runtime is shutting
/// down (the blocking task did not run).
pub(crate) async fn map_chunk(
    file: File,
    local: Arc<LocalFile>,
    offset: u64,
    len: usize,
) -> Option<(File, MapOutcome)> {
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
    tokio::task::spawn_blocking(work).await.ok()
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
pub(crate) fn crc32_of_copy(file: &File, path: &Path, url: &str, len: u64) -> Result<u32, String> {
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
    /// The identity of the file `meta` describes.
    pub(crate) fn of(meta: &std::fs::Metadata) -> Self {
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
    static REGISTERED: std::sync::Once = std::sync::Once::new();
    REGISTERED.call_once(|| {
        fork::register(&FORK_HANDLERS);
        fork::register(&pages::FORK_HANDLERS);
    });
}

/// This module's handlers around a `fork`.
static FORK_HANDLERS: ForkHandlers = ForkHandlers {
    prepare: Some(hold_across_fork),
    parent: Some(release_after_fork),
    child: Some(release_after_fork),
};

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
fn hold_across_fork() {
    let chunks = MAPPED_CHUNKS.lock().unwrap_or_else(|e| e.into_inner());
    let opener = opener::OPENER.lock().unwrap_or_else(|e| e.into_inner());
    HELD_ACROSS_FORK.with(|held| *held.borrow_mut() = (Some(chunks), Some(opener)));
}

/// After a fork, in the parent and in the child: lets the locks go.
fn release_after_fork() {
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
pub(crate) fn cut_short(url: &str, offset: u64) -> Error {
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
/// and in the fault handler's `sigbus::SLOTS` from when it is made until it is
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
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};

    use super::pages::{page_size, ONE_CALL_REFUSED, RELEASE_LOT};

    use super::*;

    /// The resident size, in kB, of this process's mapping that holds `address`.
    fn mapping_rss_kb(address: usize) -> u64 {
        mapped_rss_kb(address).unwrap_or_else(|| panic!("no mapping holds {address:#x}"))
    }

    /// The resident size, in kB, of this process's mapping that holds
    /// `address`, if one does.
    fn mapped_rss_kb(address: usize) -> Option<u64> {
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
                    return Some(kb.trim().trim_end_matches("kB").trim().parse().unwrap());
                }
            }
        }
        None
    }

    /// A mapping that says when it is unmapped.
    struct WatchedMap {
        map: memmap2::Mmap,
        unmapped: Arc<AtomicBool>,
    }

    impl AsRef<[u8]> for WatchedMap {
        fn as_ref(&self) -> &[u8] {
            &self.map
        }
    }

    impl Drop for WatchedMap {
        fn drop(&mut self) {
            self.unmapped.store(true, SeqCst);
        }
    }

    /// A populated mapping of a file of `pages` pages, as a chunk, and
    /// whether it was unmapped.
    fn mapped_chunk(dir: &Path, pages: usize) -> (Bytes, Arc<AtomicBool>) {
        let path = dir.join("shard.tar");
        std::fs::write(&path, vec![7u8; pages * page_size()]).unwrap();
        let file = File::open(&path).unwrap();
        // SAFETY: a file of this test's own, not modified while mapped.
        let map = unsafe { memmap2::MmapOptions::new().populate().map(&file) }.unwrap();
        let unmapped = Arc::new(AtomicBool::new(false));
        let chunk = Bytes::from_owner(WatchedMap {
            map,
            unmapped: unmapped.clone(),
        });
        (chunk, unmapped)
    }

    /// Each of `count` members of `chunk`: two whole pages of its own,
    /// a page apart.
    fn two_page_members(chunk: &Bytes, count: usize) -> Vec<Bytes> {
        let page = page_size();
        (0..count)
            .map(|i| Bytes::from_owner(MappedMember::new(chunk.clone(), 3 * i * page, 2 * page)))
            .collect()
    }

    /// The exit status of our forked `child`, killed if it has not ended
    /// within 10 s (`doing` says what it was doing).
    fn wait_for_child(child: libc::pid_t, doing: &str) -> i32 {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let mut status = 0;
        loop {
            // SAFETY: waits for (or, past the deadline, kills) our own child.
            let done = unsafe { libc::waitpid(child, &mut status, libc::WNOHANG) };
            if done == child {
                return status;
            }
            if std::time::Instant::now() > deadline {
                unsafe { libc::kill(child, libc::SIGKILL) };
                unsafe { libc::waitpid(child, &mut status, 0) };
                panic!("the child {doing} for 10 s");
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }

    #[test]
    fn dropped_members_give_their_pages_back_a_lot_at_a_time_and_keep_the_mapping_till_then() {
        let page_kb = (page_size() / 1024) as u64;
        let dir = tempfile::tempdir().unwrap();
        let (chunk, unmapped) = mapped_chunk(dir.path(), 3 * RELEASE_LOT + 3);
        let address = chunk.as_ptr() as usize;
        let full_kb = mapping_rss_kb(address);
        let mut members = two_page_members(&chunk, RELEASE_LOT + 1);
        let last = members.pop().unwrap();
        // The chunk's own handle goes first: the members' ranges must
        // keep it mapped until they are given back.
        drop(chunk);
        let lot_but_one = members.split_off(1);
        drop(lot_but_one);
        assert_eq!(mapping_rss_kb(address), full_kb, "a lot not full yet");
        drop(members);
        assert_eq!(
            mapping_rss_kb(address),
            full_kb - 2 * RELEASE_LOT as u64 * page_kb,
            "the full lot given back at once"
        );
        // The last member's range waits for the next lot, and keeps the
        // mapping: the range of a mapping that went is never released.
        drop(last);
        assert!(
            !unmapped.load(SeqCst),
            "the mapping outlives its waiting range"
        );
        release_pending();
        assert!(
            unmapped.load(SeqCst),
            "the mapping goes with its last range"
        );
    }

    #[test]
    fn a_thread_that_ends_gives_its_lot_back() {
        let page_kb = (page_size() / 1024) as u64;
        let dir = tempfile::tempdir().unwrap();
        let (chunk, _) = mapped_chunk(dir.path(), 3 * RELEASE_LOT + 3);
        let address = chunk.as_ptr() as usize;
        let full_kb = mapping_rss_kb(address);
        let mut members = two_page_members(&chunk, 3);
        // A member held here keeps the chunk mapped.
        let held = members.pop().unwrap();
        std::thread::spawn(move || drop(members)).join().unwrap();
        assert_eq!(
            mapping_rss_kb(address),
            full_kb - 4 * page_kb,
            "the ended thread's waiting ranges went back"
        );
        drop((held, chunk));
    }

    #[test]
    fn a_forked_child_gives_its_pages_back_with_its_own_pidfd() {
        register_fork_handlers();
        let dir = tempfile::tempdir().unwrap();
        // A lot given back here opens this process's pidfd.
        let (chunk, _) = mapped_chunk(dir.path(), 3 * RELEASE_LOT + 3);
        drop(two_page_members(&chunk, RELEASE_LOT));
        release_pending();
        let one_call = !ONE_CALL_REFUSED.load(SeqCst);
        // SAFETY: the child drops members of a mapping it inherited,
        // reads its own smaps and leaves with `_exit`.
        let child = unsafe { libc::fork() };
        if child == 0 {
            // The child leaves with `_exit` whatever happens, never going
            // on as a copy of the test harness.
            let code =
                std::panic::catch_unwind(|| child_gives_a_lot_back(&chunk, one_call)).unwrap_or(6);
            // SAFETY: leaves the forked child without running the
            // parent's exit handlers.
            unsafe { libc::_exit(code) };
        }
        assert!(child > 0, "fork failed");
        let status = wait_for_child(child, "gave a lot back");
        assert!(libc::WIFEXITED(status), "the child did not exit");
        assert_eq!(
            libc::WEXITSTATUS(status),
            0,
            "3: nothing mapped, 4: pages kept, 5: the child's lot refused, 6: a panic"
        );
    }

    /// In a forked child: gives a lot of `chunk`'s members back; 0 when
    /// their pages went, in one call if `one_call` (the parent's did).
    fn child_gives_a_lot_back(chunk: &Bytes, one_call: bool) -> i32 {
        let address = chunk.as_ptr() as usize;
        let page_kb = (page_size() / 1024) as u64;
        // A shared file mapping's pages are not copied by the fork: touch
        // each, so that the child holds them all.
        let sum: u64 = chunk.iter().map(|&byte| u64::from(byte)).sum();
        let before = mapped_rss_kb(address).unwrap_or(0);
        drop(two_page_members(chunk, RELEASE_LOT));
        let after = mapped_rss_kb(address).unwrap_or(0);
        if sum == 0 || before != chunk.len() as u64 / 1024 {
            3
        } else if after + 2 * RELEASE_LOT as u64 * page_kb != before {
            4
        } else if one_call && ONE_CALL_REFUSED.load(SeqCst) {
            5
        } else {
            0
        }
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
        let status = wait_for_child(child, "waited for the list's lock");
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
        release_pending();
        assert_eq!(mapping_rss_kb(address), full_kb, "a clone still holds it");
        drop(copy);
        release_pending();
        assert_eq!(mapping_rss_kb(address), full_kb - (9 * page / 1024) as u64);
        // The chunk still reads as the file: dropped pages map in again.
        assert_eq!(&chunk[..], &content[..]);
    }
}
