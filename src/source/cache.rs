//! A node-local cache of remote shards (`cache_dir=`, `cache_limit_bytes=`).
//!
//! A cached copy is tied to its object's identity (an [`Identity`]: size
//! and validator, the ETag or else the Last-Modified date), which a request
//! of this process confirms once per object and dataset (a HEAD of an S3
//! object, a GET of a resource's first byte; see [`Cache::confirmed`])
//! before the cache is looked at: a copy of another identity is never
//! served (a dataset made later in the same process, over an object
//! replaced since, confirms it again), and an object without a validator
//! is not cached.
//!
//! A shard read by a byte range holding all its samples (a manifest's or
//! sample counts' plain tar shards) is cached too: without a copy, the
//! whole object is read, written to the cache and its reader handed the
//! range only. A range of some of a shard's samples is read from a copy
//! if there is one, and never fills one (that would fetch the other
//! samples' bytes a second time in the epoch).
//!
//! A whole remote shard is written to a temporary file of the cache
//! (`.tmp-<pid>-<random>`) as its bytes stream to the reader, with no extra
//! pass. Once every byte was sent, the answer's size and validator are
//! checked against the identity, the validator and a trailer (size, CRC-32
//! of the bytes) are appended and the file is renamed to its final name, a
//! hash of the URL: only complete files ever carry a final name, and a
//! copy of the object's new version replaces the old one. A later read of
//! the shard, by any process of the node, checks the cached copy's
//! identity, size and CRC-32 under a shared `flock`, before a sample of it
//! is handed out (the pages already in memory through mappings, no byte
//! copied out), then reads it through the local source, which maps the
//! pages the check brought in: the copy is read from storage once per
//! open. A copy that fails the check is removed and the shard fetched
//! again. Eviction, least recently used first (a read sets the file's
//! access time), takes a non-blocking exclusive lock of each file and skips
//! those being read. A write that fails (a full disk, a file size limit)
//! stops caching that shard, with a warning; its bytes still stream to the
//! reader. No file of the cache is ever opened through a symbolic link
//! (see [`Dir`]), and a directory the cache makes is private to its user.

use std::collections::HashMap;
use std::ffi::CString;
use std::fs::File;
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::SystemTime;

use sha2::{Digest, Sha256};

use super::fetch::{FetchUnit, Tee};
use crate::config::CacheOptions;
use crate::error::{Error, Result};
use crate::fork::{self, ForkHandlers};
use crate::location::Location;
use crate::store::local;

/// What ends a cached file, after the shard's bytes and its validator: the
/// validator's length (`u32`), the shard's size (`u64`), the CRC-32 of its
/// bytes (`u32`), all little-endian, and this magic.
const MAGIC: &[u8; 8] = b"SSCACHE2";
const TAIL_LEN: u64 = 24;
/// The final names' suffix.
const SUFFIX: &str = ".shard";
/// The temporary names' prefix: `.tmp-<pid>-<random>`.
const TMP_PREFIX: &str = ".tmp-";
/// The file locked while evicting, so that one process evicts at a time.
const EVICT_LOCK: &str = ".evict.lock";
/// The mode of the files the cache makes (and, of a directory it makes, 0700).
const FILE_MODE: libc::c_uint = 0o600;

/// The suffix of the sample counts of a dataset's remote shards kept in the
/// cache (`count_samples=True`): a manifest, named after a hash of the
/// shards' URLs. Eviction leaves them (it takes `.shard` files only).
const COUNTS_SUFFIX: &str = ".counts.json";

/// The name the sample counts of the shards at `urls` are kept under.
fn counts_name(urls: &[&str]) -> String {
    let mut digest = Sha256::new();
    for url in urls {
        digest.update(url.as_bytes());
        digest.update(b"\n");
    }
    let hex: String = digest.finalize()[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("{hex}{COUNTS_SUFFIX}")
}

/// Keeps `manifest` (JSON: the sample counts of the remote shards at
/// `urls`) in the cache, replacing what was kept for them: written to a new
/// file, then renamed, never through a link. A failure only means the next
/// start reads the shards again, so it is not an error.
pub fn keep_counts(options: &CacheOptions, urls: &[&str], manifest: &str) {
    let Ok(dir) = Dir::open(&options.dir) else {
        return;
    };
    if dir.check_private().is_err() {
        return;
    }
    let tmp = tmp_name();
    let written = dir
        .create_new(&tmp)
        .and_then(|mut f| f.write_all(manifest.as_bytes()))
        .and_then(|()| dir.rename(&tmp, &counts_name(urls)));
    if written.is_err() {
        let _ = dir.remove(&tmp);
    }
}

/// The sample counts kept for the remote shards at `urls`, if any (never
/// read through a link).
pub fn kept_counts(options: &CacheOptions, urls: &[&str]) -> Option<String> {
    let dir = Dir::open(&options.dir).ok()?;
    dir.check_private().ok()?;
    let file = dir.open_file(&counts_name(urls), libc::O_RDONLY).ok()?;
    std::io::read_to_string(file).ok()
}

/// Makes the cache directory if needed (private to its user: 0700) and
/// checks that a file can be made in it; the error names the option.
pub fn prepare(options: &CacheOptions) -> Result<()> {
    let bad = |reason: String| Error::Config {
        name: "cache_dir",
        reason,
    };
    let path = &options.dir;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(path)
        .map_err(|e| bad(format!("cannot create {}: {e}", path.display())))?;
    let dir = Dir::open(path).map_err(|e| bad(format!("cannot open {}: {e}", path.display())))?;
    dir.check_private().map_err(bad)?;
    let probe = tmp_name();
    let written = dir
        .create_new(&probe)
        .and_then(|mut f| f.write_all(b"probe"));
    let _ = dir.remove(&probe);
    written.map_err(|e| bad(format!("cannot write in {}: {e}", path.display())))
}

/// The cache directory, opened. Every file of it is opened, made, renamed
/// and removed by a plain name relative to this descriptor, never through
/// a symbolic link: a link planted in the directory cannot make the cache
/// write (or truncate) a file elsewhere, or read one as a cached copy.
/// Files are only ever written when made here, with `O_EXCL`, under a name
/// no other process can guess.
#[derive(Debug)]
struct Dir {
    fd: OwnedFd,
    path: PathBuf,
}

/// `text` as a C string (a name with a NUL byte is an error).
fn c_string(text: &[u8]) -> std::io::Result<CString> {
    CString::new(text).map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))
}

/// `Ok` when a libc call returned `result` 0 or more, else its error.
fn checked(result: libc::c_int) -> std::io::Result<libc::c_int> {
    if result < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(result)
    }
}

impl Dir {
    /// Opens the directory at `path`.
    fn open(path: &Path) -> std::io::Result<Dir> {
        let name = c_string(path.as_os_str().as_bytes())?;
        let flags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC;
        // SAFETY: a NUL-terminated path; the descriptor returned is owned below.
        let fd = checked(unsafe { libc::open(name.as_ptr(), flags) })?;
        Ok(Dir {
            // SAFETY: `fd` was just opened and nothing else owns it.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
            path: path.to_owned(),
        })
    }

    /// Refuses a directory that another user owns or may write in: a copy
    /// planted there (its trailer can be computed from public facts) would
    /// be served as the shard.
    fn check_private(&self) -> std::result::Result<(), String> {
        // SAFETY: `stat` is plain data, filled in by `fstat` on a
        // descriptor this `Dir` owns.
        let mut info: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        checked(unsafe { libc::fstat(self.fd.as_raw_fd(), &mut info) })
            .map_err(|e| format!("cannot stat {}: {e}", self.path.display()))?;
        // SAFETY: `geteuid` has no preconditions.
        let me = unsafe { libc::geteuid() };
        if info.st_uid != me {
            return Err(format!(
                "{} belongs to another user (uid {}), who could plant cached copies there; \
                 use a directory of your own (shardstream makes a missing one private, 0700)",
                self.path.display(),
                info.st_uid
            ));
        }
        if info.st_mode & 0o022 != 0 {
            return Err(format!(
                "{} may be written by other users (mode {:o}), who could plant cached copies \
                 there; use a directory only you may write in (chmod go-w, or a new one: \
                 shardstream makes it 0700)",
                self.path.display(),
                info.st_mode & 0o7777
            ));
        }
        Ok(())
    }

    /// Opens `name` with `flags`, never following a symbolic link (one
    /// is `ELOOP`); a file it makes has mode 0600.
    fn open_file(&self, name: &str, flags: libc::c_int) -> std::io::Result<File> {
        let c_name = c_string(name.as_bytes())?;
        let flags = flags | libc::O_NOFOLLOW | libc::O_CLOEXEC;
        // SAFETY: a NUL-terminated name relative to a directory descriptor
        // this `Dir` owns; the descriptor returned is owned below.
        let fd = checked(unsafe {
            libc::openat(self.fd.as_raw_fd(), c_name.as_ptr(), flags, FILE_MODE)
        })?;
        // SAFETY: `fd` was just opened and nothing else owns it.
        Ok(File::from(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Makes `name`, which must not exist (not even as a link), for writing.
    fn create_new(&self, name: &str) -> std::io::Result<File> {
        self.open_file(name, libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL)
    }

    /// Removes `name` (a link itself, never what it points to).
    fn remove(&self, name: &str) -> std::io::Result<()> {
        let c_name = c_string(name.as_bytes())?;
        // SAFETY: a NUL-terminated name relative to a directory descriptor this `Dir` owns.
        checked(unsafe { libc::unlinkat(self.fd.as_raw_fd(), c_name.as_ptr(), 0) }).map(|_| ())
    }

    /// Renames `from` to `to`, replacing what `to` names (a link itself).
    fn rename(&self, from: &str, to: &str) -> std::io::Result<()> {
        let (c_from, c_to) = (c_string(from.as_bytes())?, c_string(to.as_bytes())?);
        let fd = self.fd.as_raw_fd();
        // SAFETY: NUL-terminated names relative to a directory descriptor this `Dir` owns.
        checked(unsafe { libc::renameat(fd, c_from.as_ptr(), fd, c_to.as_ptr()) }).map(|_| ())
    }

    /// The device and inode `name` is now (a link's own, not followed).
    fn identity(&self, name: &str) -> std::io::Result<(u64, u64)> {
        let c_name = c_string(name.as_bytes())?;
        let mut stat = std::mem::MaybeUninit::<libc::stat>::uninit();
        // SAFETY: a NUL-terminated name relative to a directory descriptor
        // this `Dir` owns, and a buffer of a `stat`'s size.
        checked(unsafe {
            libc::fstatat(
                self.fd.as_raw_fd(),
                c_name.as_ptr(),
                stat.as_mut_ptr(),
                libc::AT_SYMLINK_NOFOLLOW,
            )
        })?;
        // SAFETY: `fstatat` succeeded, so it filled the buffer in.
        let stat = unsafe { stat.assume_init() };
        #[allow(clippy::unnecessary_cast)]
        Ok((stat.st_dev as u64, stat.st_ino as u64))
    }
}

/// A temporary name no other process can guess: `.tmp-<pid>-<128 random bits>`
/// (the process id lets eviction remove those of processes that are gone).
fn tmp_name() -> String {
    let mut random = [0u8; 16];
    if aws_lc_rs::rand::fill(&mut random).is_err() {
        // The system's random source failed: still a name of its own.
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default();
        random = (now.as_nanos() ^ u128::from(std::process::id())).to_le_bytes();
    }
    let hex: String = random.iter().map(|b| format!("{b:02x}")).collect();
    format!("{TMP_PREFIX}{}-{hex}", std::process::id())
}

/// What a remote object is, as a request found it: its size and its
/// validator (the ETag, else the Last-Modified date). A cached copy is
/// served only for the identity it was filled under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Identity {
    size: u64,
    /// Without the quotes of an ETag.
    validator: String,
}

impl Identity {
    /// The identity of an object of `size` bytes answered with `etag` and
    /// `last_modified`; `None` with neither: such an object is not cached.
    pub(super) fn new(size: u64, etag: Option<&str>, last_modified: Option<&str>) -> Option<Self> {
        let validator = etag.or(last_modified)?.trim_matches('"');
        (!validator.is_empty()).then(|| Identity {
            size,
            validator: validator.to_owned(),
        })
    }

    /// The object's size.
    pub(super) fn size(&self) -> u64 {
        self.size
    }

    /// Whether this is the version an object was listed with, or that its
    /// manifest records (`listed`, an ETag), if any.
    fn is_listed(&self, listed: Option<&str>) -> bool {
        listed.is_none_or(|etag| etag.trim_matches('"') == self.validator)
    }

    /// Whether an answer with `validator` and `size` is this object.
    fn answered_by(&self, validator: Option<&str>, size: Option<u64>) -> bool {
        size == Some(self.size)
            && validator.map(|v| v.trim_matches('"')) == Some(self.validator.as_str())
    }
}

/// The identities of remote objects (by identity scope, the dataset's, and
/// URL) that a request of this process confirmed (`None`: the object has
/// no validator), and the process they belong to: a forked child confirms
/// its own.
type Confirmed = Option<(u32, HashMap<(u64, String), Option<Identity>>)>;

static CONFIRMED: Mutex<Confirmed> = Mutex::new(None);

thread_local! {
    /// The lock of [`CONFIRMED`], held by the forking thread while it forks.
    static HELD_ACROSS_FORK: std::cell::RefCell<Option<MutexGuard<'static, Confirmed>>> =
        const { std::cell::RefCell::new(None) };
}

/// Before a fork: takes the lock of [`CONFIRMED`], so that no other thread
/// holds it at the moment of the fork (a DataLoader worker would inherit
/// it locked and wait for it forever).
fn hold_across_fork() {
    let guard = CONFIRMED.lock().unwrap_or_else(|e| e.into_inner());
    HELD_ACROSS_FORK.with(|held| *held.borrow_mut() = Some(guard));
}

/// After a fork, in the parent and in the child: lets the lock go.
fn release_after_fork() {
    HELD_ACROSS_FORK.with(|held| *held.borrow_mut() = None);
}

/// This module's handlers around a `fork`.
static FORK_HANDLERS: ForkHandlers = ForkHandlers {
    prepare: Some(hold_across_fork),
    parent: Some(release_after_fork),
    child: Some(release_after_fork),
};

/// Runs `f` on this process's confirmed identities.
fn with_confirmed<T>(f: impl FnOnce(&mut HashMap<(u64, String), Option<Identity>>) -> T) -> T {
    static REGISTERED: std::sync::Once = std::sync::Once::new();
    REGISTERED.call_once(|| fork::register(&FORK_HANDLERS));
    let mut guard = CONFIRMED.lock().unwrap_or_else(|e| e.into_inner());
    let pid = std::process::id();
    let (_, map) = match &mut *guard {
        Some(confirmed) if confirmed.0 == pid => confirmed,
        other => other.insert((pid, HashMap::new())),
    };
    f(map)
}

/// The identity of the object at `url` a request of this process
/// confirmed for the dataset of identity scope `scope`, if one did
/// (`Some(None)`: it has no validator). Each object is checked once per
/// process and dataset: a copy filled or replaced later by another process
/// is checked against this identity.
fn confirmed(scope: u64, url: &str) -> Option<Option<Identity>> {
    with_confirmed(|map| map.get(&(scope, url.to_owned())).cloned())
}

/// Notes the identity a request of this process found for `url`, for the
/// dataset of identity scope `scope`.
fn confirm(scope: u64, url: &str, identity: Option<Identity>) {
    with_confirmed(|map| map.insert((scope, url.to_owned()), identity));
}

/// Forgets the identity of `url` in `scope`: an answer showed that it
/// changed, so the next open asks again.
fn forget(scope: u64, url: &str) {
    with_confirmed(|map| map.remove(&(scope, url.to_owned())));
}

/// A cache directory in use.
#[derive(Debug)]
pub(super) struct Cache {
    options: CacheOptions,
    dir: Arc<Dir>,
}

/// A cached copy being read: its shared lock is held while this lives.
pub(super) struct Hit {
    /// The cached file.
    pub(super) path: PathBuf,
    /// The unit to read from it: the same bytes, from the local file.
    pub(super) unit: FetchUnit,
    /// The copy, opened (never through a link), checked and locked.
    file: File,
}

impl Hit {
    /// Another descriptor of the checked copy, with its metadata, to read
    /// it through (never opened again by name); the lock stays held.
    pub(super) fn opened(&self) -> std::io::Result<(File, std::fs::Metadata)> {
        let file = self.file.try_clone()?;
        let meta = file.metadata()?;
        Ok((file, meta))
    }
}

fn warn(message: &str) {
    eprintln!("shardstream: warning: {message}");
}

/// Locks `file` (`LOCK_SH` or `LOCK_EX`) without waiting; `false` when
/// another process holds a lock in the way.
fn try_lock(file: &File, how: libc::c_int) -> bool {
    // SAFETY: flock on a file descriptor this `File` owns.
    unsafe { libc::flock(file.as_raw_fd(), how | libc::LOCK_NB) == 0 }
}

impl Cache {
    /// A cache in the (prepared) directory of `options`; `None`, with a
    /// warning, when the directory cannot be opened (shards then stream).
    pub(super) fn open(options: CacheOptions) -> Option<Self> {
        match Dir::open(&options.dir) {
            Ok(dir) => Some(Cache {
                options,
                dir: Arc::new(dir),
            }),
            Err(e) => {
                warn(&format!(
                    "cannot open the cache directory {} ({e}); shards are streamed, not cached",
                    options.dir.display()
                ));
                None
            }
        }
    }

    /// The identity of the object at `url` a request of this process
    /// confirmed for this cache's dataset, if one did (`Some(None)`: it has
    /// no validator).
    pub(super) fn confirmed(&self, url: &str) -> Option<Option<Identity>> {
        confirmed(self.options.identity_scope, url)
    }

    /// Notes the identity a request of this process found for `url`, for
    /// this cache's dataset.
    pub(super) fn confirm(&self, url: &str, identity: Option<Identity>) {
        confirm(self.options.identity_scope, url, identity);
    }

    /// The final name of `unit`'s shard, when it can be cached (a remote
    /// shard): a hash of its URL (the copy's identity is in its trailer).
    fn name_of(&self, unit: &FetchUnit) -> Option<String> {
        if matches!(unit.location, Location::Local(_)) {
            return None;
        }
        let name: String = Sha256::digest(unit.url.as_bytes())[..16]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        Some(format!("{name}{SUFFIX}"))
    }

    /// The cached copy of `unit`'s shard, of the object's `identity`,
    /// checked and locked for reading; `None` when there is none (a copy
    /// of another identity is left to be replaced; one that fails its
    /// check, or is not a regular file, a link among them, is removed).
    /// Blocking: it reads the whole copy once (see [`check`]). An object
    /// found to be another version than the one it was listed with, or
    /// that its manifest records, has no copy served: the read from the
    /// store says what changed.
    pub(super) fn lookup(&self, unit: &FetchUnit, identity: &Identity) -> Option<Hit> {
        if !identity.is_listed(unit.etag.as_deref()) {
            return None;
        }
        let name = self.name_of(unit)?;
        let path = self.dir.path.join(&name);
        let damaged = |reason: &str| {
            warn(&format!(
                "{}: the cached copy {} is damaged ({reason}); removed, fetching the shard again",
                unit.url,
                path.display()
            ));
            let _ = self.dir.remove(&name);
        };
        // Non-blocking: a FIFO planted under the name must not hang the open.
        let file = match self.dir.open_file(&name, libc::O_RDONLY | libc::O_NONBLOCK) {
            Ok(file) => file,
            Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
                damaged("a symbolic link, not followed");
                return None;
            }
            Err(_) => return None,
        };
        let held = file.metadata().ok()?;
        if !held.is_file() {
            damaged("not a regular file");
            return None;
        }
        if !try_lock(&file, libc::LOCK_SH) {
            return None;
        }
        // Evicted (or replaced) between the open and the lock: not this one.
        if self.dir.identity(&name).ok()? != (held.dev(), held.ino()) {
            return None;
        }
        let size = match check(&file, (&path, &unit.url), held.len(), identity, unit.size) {
            Ok(size) => size,
            Err(Mismatch::Other) => return None,
            Err(Mismatch::Damaged(reason)) => {
                damaged(&reason);
                return None;
            }
        };
        // The time of last use, for eviction: the access time, as the
        // modification time is part of the identity by-reference members
        // are checked against.
        let _ = file.set_times(std::fs::FileTimes::new().set_accessed(SystemTime::now()));
        let range = unit.range.clone().unwrap_or(0..size);
        Some(Hit {
            unit: FetchUnit {
                url: unit.url.clone(),
                location: Location::Local(path.clone()),
                range: Some(range),
                size: Some(size),
                etag: unit.etag.clone(),
                all_samples: false,
            },
            path,
            file,
        })
    }

    /// A temporary file to write `unit`'s shard (the object of `identity`)
    /// into as it streams: `None` for a byte range, a shard larger than
    /// the limit (with a warning), or when the file cannot be made.
    pub(super) fn fill(&self, unit: &FetchUnit, identity: Identity) -> Option<Fill> {
        if unit.range.is_some() {
            return None;
        }
        let target = self.name_of(unit)?;
        if self.over_limit(identity.size + identity.validator.len() as u64) {
            over_limit(&unit.url);
            return None;
        }
        let tmp = tmp_name();
        match self.dir.create_new(&tmp) {
            Ok(file) => Some(Fill {
                file: Some(file),
                tmp,
                target,
                url: unit.url.clone(),
                size: unit.size,
                etag: unit.etag.clone(),
                identity,
                scope: self.options.identity_scope,
                crc: crc32fast::Hasher::new(),
                written: 0,
                limit: self.options.limit_bytes,
                dir: self.dir.clone(),
            }),
            Err(e) => {
                warn(&format!(
                    "{}: cannot write in the cache ({e}); streamed, not cached",
                    unit.url
                ));
                None
            }
        }
    }

    /// Whether a copy of `len` bytes (a shard and its validator) would not
    /// fit under the limit.
    fn over_limit(&self, len: u64) -> bool {
        self.options
            .limit_bytes
            .is_some_and(|limit| len + TAIL_LEN > limit)
    }
}

fn over_limit(url: &str) {
    warn(&format!(
        "{url}: more than cache_limit_bytes; streamed, not cached"
    ));
}

/// Why a cached file is not served.
enum Mismatch {
    /// It is a copy of another identity (another version of the object).
    Other,
    /// It is damaged: why.
    Damaged(String),
}

/// Checks a cached file of `len` bytes holding a copy of the object of
/// `identity` (of `planned` bytes, when the plan knows): its tail, the
/// identity it was filled under, and the CRC-32 of its bytes. The shard's
/// size, when all is well. The bytes are read as
/// [`local::crc32_of_copy`] says: those already in memory through
/// mappings, with no copy, the others from the disk, once.
fn check(
    file: &File,
    (path, url): (&Path, &str),
    len: u64,
    identity: &Identity,
    planned: Option<u64>,
) -> std::result::Result<u64, Mismatch> {
    let damaged = |reason: String| Mismatch::Damaged(reason);
    let Some(at) = len.checked_sub(TAIL_LEN) else {
        return Err(damaged(format!("{len} bytes, shorter than its trailer")));
    };
    let mut tail = [0; TAIL_LEN as usize];
    file.read_exact_at(&mut tail, at)
        .map_err(|e| damaged(e.to_string()))?;
    let number = |range: std::ops::Range<usize>| {
        let mut bytes = [0; 8];
        bytes[..range.len()].copy_from_slice(&tail[range]);
        u64::from_le_bytes(bytes)
    };
    let (validator_len, size, crc) = (number(0..4), number(4..12), number(12..16));
    if &tail[16..] != MAGIC || size.checked_add(validator_len) != Some(at) {
        return Err(damaged("its trailer is not shardstream's".into()));
    }
    if validator_len != identity.validator.len() as u64 {
        // Another version, or a damaged length: nothing is allocated for it.
        return Err(Mismatch::Other);
    }
    let mut validator = vec![0; validator_len as usize];
    file.read_exact_at(&mut validator, size)
        .map_err(|e| damaged(e.to_string()))?;
    let other = size != identity.size
        || validator != identity.validator.as_bytes()
        || planned.is_some_and(|planned| planned != size);
    if other {
        return Err(Mismatch::Other);
    }
    let actual = local::crc32_of_copy(file, path, url, size).map_err(damaged)?;
    if u64::from(actual) != crc {
        return Err(damaged("its CRC-32 does not match its bytes".into()));
    }
    Ok(size)
}

/// A shard being written to the cache as it streams. Dropped before
/// [`Fill::commit`], its temporary file is removed.
pub(super) struct Fill {
    /// `None` once a write failed: the shard is not cached.
    file: Option<File>,
    /// The temporary file's name, and the final one.
    tmp: String,
    target: String,
    url: String,
    /// The size and ETag the plan knows, if any.
    size: Option<u64>,
    etag: Option<String>,
    /// The object's identity, as this process confirmed it.
    identity: Identity,
    /// The identity scope it was confirmed in (the dataset's).
    scope: u64,
    crc: crc32fast::Hasher,
    written: u64,
    limit: Option<u64>,
    dir: Arc<Dir>,
}

impl Fill {
    /// Writes the next bytes of the shard; a failure (a full disk) stops
    /// caching the shard, with a warning, and never the read.
    pub(super) fn write(&mut self, bytes: &[u8]) {
        let Some(file) = self.file.as_mut() else {
            return;
        };
        let after = self.written + bytes.len() as u64;
        let tail = TAIL_LEN + self.identity.validator.len() as u64;
        if self.limit.is_some_and(|limit| after + tail > limit) {
            over_limit(&self.url);
            self.file = None;
            let _ = self.dir.remove(&self.tmp);
            return;
        }
        match file.write_all(bytes) {
            Ok(()) => {
                self.crc.update(bytes);
                self.written += bytes.len() as u64;
            }
            Err(e) => {
                warn(&format!(
                    "{}: cannot write to the cache ({e}); streamed, not cached",
                    self.url
                ));
                self.file = None;
                let _ = self.dir.remove(&self.tmp);
            }
        }
    }

    /// Every byte was sent, and the source answered with `validator` and
    /// `size`: checks the sizes (the plan's, the answer's, the bytes
    /// written) and the validator against the identity (and the plan's
    /// ETag), then names the file. An answer of another identity forgets
    /// the one this process confirmed, so that the next open asks again.
    pub(super) fn commit(mut self, validator: Option<&str>, size: Option<u64>) {
        let Some(mut file) = self.file.take() else {
            return;
        };
        let written = Some(self.written);
        if !self.identity.answered_by(validator, size) {
            forget(self.scope, &self.url);
            return;
        }
        if size != written || self.size.is_some_and(|planned| Some(planned) != written) {
            return;
        }
        if let (Some(planned), Some(seen)) = (self.etag.as_deref(), validator) {
            if planned.trim_matches('"') != seen.trim_matches('"') {
                return;
            }
        }
        let validator = self.identity.validator.as_bytes();
        let mut trailer = Vec::with_capacity(validator.len() + TAIL_LEN as usize);
        trailer.extend_from_slice(validator);
        trailer.extend_from_slice(&(validator.len() as u32).to_le_bytes());
        trailer.extend_from_slice(&self.written.to_le_bytes());
        trailer.extend_from_slice(&self.crc.clone().finalize().to_le_bytes());
        trailer.extend_from_slice(MAGIC);
        if let Err(e) = file.write_all(&trailer) {
            warn(&format!(
                "{}: cannot write to the cache ({e}); streamed, not cached",
                self.url
            ));
            return;
        }
        drop(file);
        // A copy already there is of this object or of an older version of
        // it (or a link planted under the name): the rename replaces it,
        // never writing through a link.
        if self.dir.rename(&self.tmp, &self.target).is_err() {
            return;
        }
        if let Some(limit) = self.limit {
            evict(&self.dir, limit);
        }
    }
}

impl Tee for Fill {
    fn write(&mut self, bytes: &[u8]) {
        Fill::write(self, bytes);
    }

    fn commit(self: Box<Self>, validator: Option<&str>, size: Option<u64>) {
        Fill::commit(*self, validator, size);
    }
}

impl Drop for Fill {
    fn drop(&mut self) {
        // A no-op after a rename.
        let _ = self.dir.remove(&self.tmp);
    }
}

/// The eviction lock, opened (made if needed; a link planted under its
/// name is removed, never followed); `None` when it cannot be.
fn evict_lock(dir: &Dir) -> Option<File> {
    let open = || {
        dir.open_file(
            EVICT_LOCK,
            libc::O_RDONLY | libc::O_CREAT | libc::O_NONBLOCK,
        )
    };
    match open() {
        Ok(file) => Some(file),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            warn(&format!(
                "{}: a symbolic link named {EVICT_LOCK}, not followed; removed",
                dir.path.display()
            ));
            dir.remove(EVICT_LOCK).ok()?;
            open().ok()
        }
        Err(_) => None,
    }
}

/// Whether `name` is a copy's ([`Cache::name_of`]): 32 lowercase hex
/// digits and [`SUFFIX`].
fn is_copy_name(name: &str) -> bool {
    name.strip_suffix(SUFFIX).is_some_and(|hex| {
        hex.len() == 32 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    })
}

/// The process id in `name` when it is a temporary file's
/// ([`tmp_name`]: `.tmp-PID-` and 32 lowercase hex digits).
fn temporary_pid(name: &str) -> Option<i32> {
    let (pid, hex) = name.strip_prefix(TMP_PREFIX)?.split_once('-')?;
    let ours = hex.len() == 32 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    ours.then(|| pid.parse().ok()).flatten()
}

/// Removes cached files, least recently used first, until those left
/// take at most `limit` bytes; files being read (locked) are skipped.
/// Temporary files of processes that no longer run are removed too.
fn evict(dir: &Dir, limit: u64) {
    let Some(guard) = evict_lock(dir) else {
        return;
    };
    // SAFETY: flock on a file descriptor this `File` owns; released when it closes.
    if unsafe { libc::flock(guard.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return;
    }
    let Ok(entries) = std::fs::read_dir(&dir.path) else {
        return;
    };
    let mut files = Vec::new();
    let mut total = 0;
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        // The entry's own metadata: a link is not followed.
        let Ok(meta) = entry.metadata() else { continue };
        // Only files of the cache's own names: a directory that holds
        // other files (a scratch folder given as `cache_dir`) keeps them.
        if is_copy_name(&name) && meta.is_file() {
            total += meta.len();
            let used = meta.accessed().unwrap_or(SystemTime::UNIX_EPOCH);
            files.push((used, meta.len(), name));
        } else if let Some(pid) = temporary_pid(&name) {
            let gone = {
                let p = pid;
                // SAFETY: signal 0 only checks that the process exists.
                let sent = unsafe { libc::kill(p, 0) };
                sent != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
            };
            if gone {
                let _ = dir.remove(&name);
            }
        }
    }
    files.sort();
    for (_, len, name) in files {
        if total <= limit {
            break;
        }
        let Ok(file) = dir.open_file(&name, libc::O_RDONLY | libc::O_NONBLOCK) else {
            continue;
        };
        if try_lock(&file, libc::LOCK_EX) && dir.remove(&name).is_ok() {
            total -= len;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unit(url: &str, size: u64) -> FetchUnit {
        FetchUnit {
            url: url.into(),
            location: Location::Http(url.into()),
            range: None,
            size: Some(size),
            etag: Some("\"e1\"".into()),
            all_samples: false,
        }
    }

    fn identity(size: u64, etag: &str) -> Identity {
        Identity::new(size, Some(etag), None).unwrap()
    }

    fn cache(dir: &Path, limit: Option<u64>) -> Cache {
        let options = CacheOptions::new(dir.to_owned(), limit);
        prepare(&options).unwrap();
        Cache::open(options).unwrap()
    }

    fn fill_as(cache: &Cache, unit: &FetchUnit, bytes: &[u8], etag: &str) {
        let size = bytes.len() as u64;
        let mut fill = cache.fill(unit, identity(size, etag)).expect("cacheable");
        for part in bytes.chunks(7) {
            fill.write(part);
        }
        fill.commit(Some(etag), Some(size));
    }

    fn fill(cache: &Cache, unit: &FetchUnit, bytes: &[u8]) {
        fill_as(cache, unit, bytes, "\"e1\"");
    }

    #[test]
    fn a_complete_shard_is_found_and_a_partial_one_never() {
        let dir = tempfile::tempdir().unwrap();
        let cache = cache(dir.path(), None);
        let a = unit("http://h/a.tar", 100);
        let e1 = identity(100, "\"e1\"");
        assert!(cache.lookup(&a, &e1).is_none());
        let mut partial = cache.fill(&a, e1.clone()).unwrap();
        partial.write(&[1; 60]);
        assert!(cache.lookup(&a, &e1).is_none(), "half-written");
        drop(partial);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        fill(&cache, &a, &[2; 100]);
        let hit = cache.lookup(&a, &e1).expect("cached");
        assert_eq!(hit.unit.range, Some(0..100));
        assert_eq!(std::fs::read(&hit.path).unwrap()[..100], [2; 100]);
        // Another ETag or size is another object.
        assert!(cache.lookup(&a, &identity(100, "e2")).is_none());
        assert!(cache.lookup(&a, &identity(99, "e1")).is_none());
    }

    #[test]
    fn a_copy_of_another_version_is_never_served_and_is_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let cache = cache(dir.path(), None);
        let a = FetchUnit {
            size: None,
            etag: None,
            all_samples: false,
            ..unit("s3://b/a.tar", 100)
        };
        fill_as(&cache, &a, &[1; 100], "\"v1\"");
        // The same size, another ETag: the object was replaced.
        let v2 = identity(100, "\"v2\"");
        assert!(cache.lookup(&a, &v2).is_none());
        fill_as(&cache, &a, &[2; 100], "\"v2\"");
        let hit = cache.lookup(&a, &v2).expect("the new version is cached");
        assert_eq!(std::fs::read(&hit.path).unwrap()[..100], [2; 100]);
        drop(hit);
        assert!(cache.lookup(&a, &identity(100, "\"v1\"")).is_none());
        let copies = std::fs::read_dir(dir.path()).unwrap().count();
        assert_eq!(copies, 1, "the new copy replaced the old one");
    }

    #[test]
    fn a_copy_of_another_version_than_the_listed_one_is_not_served() {
        let dir = tempfile::tempdir().unwrap();
        let cache = cache(dir.path(), None);
        // A dataset without a manifest cached the object's current version.
        let unlisted = FetchUnit {
            etag: None,
            ..unit("s3://b/a.tar", 100)
        };
        let v2 = identity(100, "\"v2\"");
        fill_as(&cache, &unlisted, &[2; 100], "\"v2\"");
        assert!(cache.lookup(&unlisted, &v2).is_some());
        // A manifest that records the version before: its copy is not the
        // one listed, whatever the store says the object is now.
        let listed_v1 = FetchUnit {
            etag: Some("\"v1\"".into()),
            ..unlisted.clone()
        };
        assert!(cache.lookup(&listed_v1, &v2).is_none());
        let listed_v2 = FetchUnit {
            etag: Some("v2".into()),
            ..unlisted
        };
        assert!(cache.lookup(&listed_v2, &v2).is_some());
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            1,
            "the copy is kept"
        );
    }

    #[test]
    fn an_answer_of_another_identity_is_not_cached_and_is_asked_again() {
        let dir = tempfile::tempdir().unwrap();
        let cache = cache(dir.path(), None);
        let a = unit("http://h/other-identity.tar", 10);
        cache.confirm(&a.url, Some(identity(10, "\"e1\"")));
        let mut fill = cache.fill(&a, identity(10, "\"e1\"")).unwrap();
        fill.write(&[1; 10]);
        fill.commit(Some("\"other\""), Some(10));
        assert!(cache.lookup(&a, &identity(10, "\"e1\"")).is_none());
        assert_eq!(cache.confirmed(&a.url), None, "the next open asks again");
        // An answer of another size than the bytes written: not cached.
        let mut fill = cache.fill(&a, identity(10, "\"e1\"")).unwrap();
        fill.write(&[1; 9]);
        fill.commit(Some("\"e1\""), Some(10));
        assert!(cache.lookup(&a, &identity(10, "\"e1\"")).is_none());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn an_object_without_a_validator_has_no_identity() {
        assert_eq!(Identity::new(10, None, None), None);
        assert_eq!(Identity::new(10, Some("\"\""), None), None);
        let dated = Identity::new(10, None, Some("Tue, 24 Nov 2026 10:00:00 GMT")).unwrap();
        assert!(dated.answered_by(Some("Tue, 24 Nov 2026 10:00:00 GMT"), Some(10)));
        assert!(identity(10, "\"e1\"").answered_by(Some("e1"), Some(10)));
    }

    #[test]
    fn a_damaged_copy_is_removed() {
        let dir = tempfile::tempdir().unwrap();
        let cache = cache(dir.path(), None);
        let a = unit("http://h/a.tar", 100);
        let e1 = identity(100, "\"e1\"");
        fill(&cache, &a, &[2; 100]);
        let path = cache.lookup(&a, &e1).unwrap().path;
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[50] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        assert!(cache.lookup(&a, &e1).is_none());
        assert!(!path.exists());
        fill(&cache, &a, &[2; 100]);
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 1]).unwrap();
        assert!(cache.lookup(&a, &e1).is_none());
        assert!(!path.exists());
    }

    #[test]
    fn a_copy_that_is_a_link_is_removed_never_followed() {
        let dir = tempfile::tempdir().unwrap();
        let cache = cache(dir.path(), None);
        let a = unit("http://h/a.tar", 100);
        let e1 = identity(100, "\"e1\"");
        fill(&cache, &a, &[2; 100]);
        let path = cache.lookup(&a, &e1).unwrap().path;
        let outside = tempfile::tempdir().unwrap();
        let valid = outside.path().join("copy");
        std::fs::rename(&path, &valid).unwrap();
        std::os::unix::fs::symlink(&valid, &path).unwrap();
        assert!(cache.lookup(&a, &e1).is_none());
        assert!(
            std::fs::symlink_metadata(&path).is_err(),
            "the link is removed"
        );
        assert_eq!(std::fs::read(&valid).unwrap()[..100], [2; 100]);
    }

    #[test]
    fn eviction_keeps_the_limit_and_skips_files_being_read() {
        let dir = tempfile::tempdir().unwrap();
        let cache = cache(dir.path(), Some(300));
        let units: Vec<_> = (0..4)
            .map(|i| unit(&format!("http://h/{i}.tar"), 100))
            .collect();
        let e1 = identity(100, "\"e1\"");
        fill(&cache, &units[0], &[0; 100]);
        let reading = cache.lookup(&units[0], &e1).unwrap();
        for u in &units[1..] {
            fill(&cache, u, &[1; 100]);
        }
        assert!(reading.path.exists(), "a file being read is never evicted");
        let total: u64 = std::fs::read_dir(dir.path())
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().ends_with(SUFFIX))
            .map(|e| e.metadata().unwrap().len())
            .sum();
        assert!(total <= 300, "{total}");
        assert!(cache.lookup(&units[3], &e1).is_some(), "the newest stays");
    }

    /// A `cache_dir` that holds other files (a scratch folder): eviction
    /// took every `*.shard` and `.tmp-*` file for the cache's, deleted
    /// them and counted them against the limit.
    #[test]
    fn eviction_removes_and_counts_the_cache_s_own_files_only() {
        let dir = tempfile::tempdir().unwrap();
        let theirs = [
            "results.shard",
            ".tmp-2000000000-draft.txt",
            ".tmp-2000000000-0123456789abcdef0123456789ABCDEF",
            "0123456789abcdef0123456789abcdef.shard.bak",
        ];
        for name in theirs {
            std::fs::write(dir.path().join(name), [9; 1000]).unwrap();
        }
        let stale = ".tmp-2000000000-0123456789abcdef0123456789abcdef";
        std::fs::write(dir.path().join(stale), [9; 10]).unwrap();
        let cache = cache(dir.path(), Some(300));
        let e1 = identity(100, "\"e1\"");
        let units: Vec<_> = (0..2)
            .map(|i| unit(&format!("http://h/{i}.tar"), 100))
            .collect();
        for u in &units {
            fill(&cache, u, &[1; 100]);
        }
        for name in theirs {
            assert!(dir.path().join(name).exists(), "{name} is left alone");
        }
        assert!(
            !dir.path().join(stale).exists(),
            "a dead process's temporary file goes"
        );
        assert!(
            units.iter().all(|u| cache.lookup(u, &e1).is_some()),
            "theirs do not count"
        );
        assert!(is_copy_name("0123456789abcdef0123456789abcdef.shard"));
        assert_eq!(temporary_pid(stale), Some(2_000_000_000));
    }

    #[test]
    fn a_shard_larger_than_the_limit_is_not_cached() {
        let dir = tempfile::tempdir().unwrap();
        let cache = cache(dir.path(), Some(50));
        let a = unit("http://h/a.tar", 100);
        assert!(cache.fill(&a, identity(100, "\"e1\"")).is_none());
        // A body longer than the object's size: found out while it streams.
        let unknown = FetchUnit { size: None, ..a };
        let mut fill = cache.fill(&unknown, identity(20, "\"e1\"")).unwrap();
        fill.write(&[1; 20]);
        fill.write(&[1; 20]);
        fill.commit(Some("\"e1\""), Some(40));
        assert!(cache.lookup(&unknown, &identity(40, "\"e1\"")).is_none());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn files_the_cache_makes_are_private() {
        let parent = tempfile::tempdir().unwrap();
        let dir = parent.path().join("made");
        let cache = cache(&dir, None);
        fill(&cache, &unit("http://h/a.tar", 10), &[1; 10]);
        let mode = |p: &Path| std::fs::metadata(p).unwrap().mode() & 0o777;
        assert_eq!(mode(&dir), 0o700);
        for entry in std::fs::read_dir(&dir).unwrap().flatten() {
            assert_eq!(mode(&entry.path()), 0o600, "{:?}", entry.file_name());
        }
    }
}
