//! Stream counters and the epoch table. Both live in shared memory, so
//! DataLoader worker processes forked after their creation add to the same
//! counters the parent reads and advance the same epochs; that memory is
//! also a file descriptor that can be handed to processes started with
//! `spawn` or `forkserver`.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};

/// One counter of [`Counters`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counter {
    /// Shards opened for reading.
    ShardsOpened,
    /// Shards read to their end.
    ShardsCompleted,
    /// Samples (or Arrow rows, or packed sequences) delivered to the consumer.
    Samples,
    /// Bytes read from storage (local files, object stores): cached
    /// copies are not counted here, but in [`Counter::CacheBytes`].
    BytesRead,
    /// Bad shards, and samples whose transform raised, skipped under
    /// `on_error="warn"`.
    ErrorsSkipped,
    /// Requests (GETs) sent to an object store.
    Requests,
    /// Requests or bodies retried.
    Retries,
    /// Bodies resumed mid-way with a Range request.
    Resumes,
    /// The most bytes of one read-ahead's budget held at once by ranged
    /// parts (being fetched, or fetched and not yet parsed): a high-water
    /// mark, not a sum.
    ReadAheadPeakBytes,
    /// Shards (or byte ranges of them) read from a cached copy (`cache_dir`).
    CacheHits,
    /// Bytes read from cached copies.
    CacheBytes,
    /// Nanoseconds the pipeline thread waited for bytes (or the next
    /// shard) from the read-ahead: the storage stage.
    StorageWaitNanos,
    /// Nanoseconds the pipeline thread ran, whatever it did: parsing,
    /// waiting for storage, decoding, waiting for the consumer.
    PipelineNanos,
    /// Nanoseconds the pipeline thread spent decoding (its decode
    /// threads' batches included).
    DecodeNanos,
    /// Nanoseconds of decoding summed over the threads that decode.
    DecodeBusyNanos,
    /// Nanoseconds the pipeline thread waited because the queue to the
    /// consumer was full.
    OutputWaitNanos,
    /// Nanoseconds in the Python `transform`.
    TransformNanos,
    /// Nanoseconds turning samples into Python objects (measured on a
    /// share of the samples and scaled up).
    HandoffNanos,
    /// Nanoseconds `next()` waited for the pipeline.
    NextWaitNanos,
    /// Bytes the format parsers took from the read-ahead.
    ParsedBytes,
    /// Bytes of the samples that went through the field decoders.
    DecodedBytes,
    /// Samples in the queue between the pipeline thread and `next()`
    /// (a level, not a sum).
    OutputQueued,
}

impl Counter {
    /// Every counter, in [`Stats`] order.
    pub const ALL: [Counter; 22] = [
        Counter::ShardsOpened,
        Counter::ShardsCompleted,
        Counter::Samples,
        Counter::BytesRead,
        Counter::ErrorsSkipped,
        Counter::Requests,
        Counter::Retries,
        Counter::Resumes,
        Counter::ReadAheadPeakBytes,
        Counter::CacheHits,
        Counter::CacheBytes,
        Counter::StorageWaitNanos,
        Counter::PipelineNanos,
        Counter::DecodeNanos,
        Counter::DecodeBusyNanos,
        Counter::OutputWaitNanos,
        Counter::TransformNanos,
        Counter::HandoffNanos,
        Counter::NextWaitNanos,
        Counter::ParsedBytes,
        Counter::DecodedBytes,
        Counter::OutputQueued,
    ];

    /// The counter's name in `stats()`.
    pub fn name(self) -> &'static str {
        match self {
            Counter::ShardsOpened => "shards_opened",
            Counter::ShardsCompleted => "shards_completed",
            Counter::Samples => "samples",
            Counter::BytesRead => "bytes_read",
            Counter::ErrorsSkipped => "errors_skipped",
            Counter::Requests => "requests",
            Counter::Retries => "retries",
            Counter::Resumes => "resumed_bodies",
            Counter::ReadAheadPeakBytes => "read_ahead_peak_bytes",
            Counter::CacheHits => "cache_hits",
            Counter::CacheBytes => "cache_bytes",
            Counter::StorageWaitNanos => "storage_wait_ns",
            Counter::PipelineNanos => "pipeline_ns",
            Counter::DecodeNanos => "decode_ns",
            Counter::DecodeBusyNanos => "decode_busy_ns",
            Counter::OutputWaitNanos => "output_wait_ns",
            Counter::TransformNanos => "transform_ns",
            Counter::HandoffNanos => "handoff_ns",
            Counter::NextWaitNanos => "next_wait_ns",
            Counter::ParsedBytes => "parsed_bytes",
            Counter::DecodedBytes => "decoded_bytes",
            Counter::OutputQueued => "output_queue_samples",
        }
    }
}

const COUNT: usize = Counter::ALL.len();

/// A snapshot of the counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Values in [`Counter::ALL`] order.
    pub values: [u64; COUNT],
}

impl Stats {
    /// `(name, value)` pairs.
    pub fn entries(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
        Counter::ALL
            .iter()
            .map(|c| (c.name(), self.values[*c as usize]))
    }

    /// The value of one counter.
    pub fn get(&self, counter: Counter) -> u64 {
        self.values[counter as usize]
    }

    /// The counters' `(name, value)` pairs, then the values derived from
    /// them: `parse_ns`, the pipeline thread's time not spent waiting for
    /// storage, decoding or waiting for the consumer (parsing the format,
    /// checking samples, the shuffle buffer), and `read_ahead_bytes`, the
    /// bytes fetched and not yet taken by the parsers.
    pub fn report(&self) -> Vec<(&'static str, u64)> {
        let mut pairs: Vec<_> = self.entries().collect();
        let parse = self.get(Counter::PipelineNanos).saturating_sub(
            self.get(Counter::StorageWaitNanos)
                + self.get(Counter::DecodeNanos)
                + self.get(Counter::OutputWaitNanos),
        );
        let fetched = self.get(Counter::BytesRead) + self.get(Counter::CacheBytes);
        pairs.push(("parse_ns", parse));
        pairs.push((
            "read_ahead_bytes",
            fetched.saturating_sub(self.get(Counter::ParsedBytes)),
        ));
        pairs
    }
}

/// `duration` in whole nanoseconds (saturating).
pub fn nanos(duration: std::time::Duration) -> u64 {
    u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX)
}

/// `len` atomics in memory shared with the processes it is forked or
/// handed to.
///
/// The memory is a file (`memfd` on Linux) mapped shared, so besides being
/// inherited by forked children its descriptor ([`SharedCells::fd`]) can be
/// passed to a process started another way (`spawn`, `forkserver`), which
/// maps the same memory with [`SharedCells::attach`]. Where no such file can
/// be made, the cells are a shared anonymous mapping (forked children
/// only), or, failing that, private memory.
struct SharedCells {
    cells: *mut AtomicU64,
    len: usize,
    /// The file the cells are mapped from, if any.
    file: Option<OwnedFd>,
    /// Whether `cells` is a mapping (else a leaked boxed slice).
    mapped: bool,
}

// SAFETY: the cells are atomics, valid for the life of `SharedCells`.
unsafe impl Send for SharedCells {}
// SAFETY: as above; all access is through atomic operations.
unsafe impl Sync for SharedCells {}

/// A fresh memory file of `bytes` bytes named `name`, closed on exec.
#[cfg(target_os = "linux")]
fn memory_file(name: &std::ffi::CStr, bytes: usize) -> std::io::Result<OwnedFd> {
    // SAFETY: a NUL-terminated name and valid flags; the result is checked.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just opened and is owned by nobody else.
    let file = unsafe { OwnedFd::from_raw_fd(fd) };
    let len = libc::off_t::try_from(bytes).expect("a small memory file");
    // SAFETY: sizes the file just made (zero-filled).
    if unsafe { libc::ftruncate(file.as_raw_fd(), len) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(file)
}

#[cfg(not(target_os = "linux"))]
fn memory_file(_name: &std::ffi::CStr, _bytes: usize) -> std::io::Result<OwnedFd> {
    Err(std::io::ErrorKind::Unsupported.into())
}

/// Maps `bytes` bytes of `fd` (or anonymous memory for `None`) shared.
fn map_shared(fd: Option<BorrowedFd<'_>>, bytes: usize) -> std::io::Result<*mut AtomicU64> {
    let (flags, raw) = match fd {
        Some(fd) => (libc::MAP_SHARED, fd.as_raw_fd()),
        None => (libc::MAP_SHARED | libc::MAP_ANONYMOUS, -1),
    };
    // SAFETY: a fresh shared mapping, checked for failure; the memory is
    // zero-filled or holds atomics written through another mapping, both
    // valid AtomicU64 values.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            bytes,
            libc::PROT_READ | libc::PROT_WRITE,
            flags,
            raw,
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    Ok(ptr.cast())
}

impl SharedCells {
    fn bytes(len: usize) -> usize {
        len * std::mem::size_of::<AtomicU64>()
    }

    /// `len` new cells, every one 0, in a memory file named `name` where
    /// one can be made.
    fn new(len: usize, name: &std::ffi::CStr) -> Self {
        let bytes = Self::bytes(len);
        if let Ok(file) = memory_file(name, bytes) {
            if let Ok(cells) = map_shared(Some(file.as_fd()), bytes) {
                return SharedCells {
                    cells,
                    len,
                    file: Some(file),
                    mapped: true,
                };
            }
        }
        if let Ok(cells) = map_shared(None, bytes) {
            return SharedCells {
                cells,
                len,
                file: None,
                mapped: true,
            };
        }
        let boxed: Box<[AtomicU64]> = (0..len).map(|_| AtomicU64::new(0)).collect();
        SharedCells {
            cells: Box::into_raw(boxed).cast(),
            len,
            file: None,
            mapped: false,
        }
    }

    /// The `len` cells whose memory file is `file` (from [`SharedCells::fd`]
    /// of cells in another process); a file of another size is refused as
    /// not being `what`.
    fn attach(file: OwnedFd, len: usize, what: &str) -> std::io::Result<Self> {
        let bytes = Self::bytes(len);
        // SAFETY: a zeroed `stat` is a valid value of the plain C struct.
        let mut stat: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fstat of a descriptor we own into that struct.
        if unsafe { libc::fstat(file.as_raw_fd(), &mut stat) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        if u64::try_from(stat.st_size).ok() != Some(bytes as u64) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("not {what}: {} bytes, expected {bytes}", stat.st_size),
            ));
        }
        let cells = map_shared(Some(file.as_fd()), bytes)?;
        Ok(SharedCells {
            cells,
            len,
            file: Some(file),
            mapped: true,
        })
    }

    /// The memory file, for [`SharedCells::attach`] in another process;
    /// `None` when the cells are shared with forked children only.
    fn fd(&self) -> Option<BorrowedFd<'_>> {
        self.file.as_ref().map(AsFd::as_fd)
    }

    fn cell(&self, index: usize) -> &AtomicU64 {
        assert!(index < self.len, "shared cell {index} of {}", self.len);
        // SAFETY: `cells` points at `len` atomics; checked above.
        unsafe { &*self.cells.add(index) }
    }
}

impl Drop for SharedCells {
    fn drop(&mut self) {
        if self.mapped {
            // SAFETY: unmaps the mapping made in `new` or `attach`, once.
            unsafe {
                libc::munmap(self.cells.cast(), Self::bytes(self.len));
            }
        } else {
            // SAFETY: re-owns the boxed slice leaked in `new`, once.
            drop(unsafe {
                Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.cells, self.len))
            });
        }
    }
}

/// Atomic counters, in memory shared with forked child processes and,
/// through its descriptor ([`Counters::fd`]), with processes started by
/// `spawn` or `forkserver` ([`Counters::attach`]).
pub struct Counters {
    cells: SharedCells,
}

impl Counters {
    /// New zeroed counters in shared memory.
    pub fn new() -> Self {
        Counters {
            cells: SharedCells::new(COUNT, c"shardstream-counters"),
        }
    }

    /// The counters whose memory file is `file` (from [`Counters::fd`] of
    /// counters in another process): both add to and read the same values.
    pub fn attach(file: OwnedFd) -> std::io::Result<Self> {
        Ok(Counters {
            cells: SharedCells::attach(file, COUNT, "stream counters")?,
        })
    }

    /// The memory file, for [`Counters::attach`] in another process; `None`
    /// when the counters are shared with forked children only.
    pub fn fd(&self) -> Option<BorrowedFd<'_>> {
        self.cells.fd()
    }

    fn cell(&self, counter: Counter) -> &AtomicU64 {
        self.cells.cell(counter as usize)
    }

    /// Adds `n` to `counter`.
    pub fn add(&self, counter: Counter, n: u64) {
        self.cell(counter).fetch_add(n, Ordering::Relaxed);
    }

    /// Adds the nanoseconds since `since` to `counter`.
    pub fn add_since(&self, counter: Counter, since: std::time::Instant) {
        self.add(counter, nanos(since.elapsed()));
    }

    /// Subtracts `n` from `counter` (a level that went down).
    pub fn sub(&self, counter: Counter, n: u64) {
        self.cell(counter).fetch_sub(n, Ordering::Relaxed);
    }

    /// Raises `counter` to `value` if it is lower (a high-water mark).
    pub fn raise(&self, counter: Counter, value: u64) {
        self.cell(counter).fetch_max(value, Ordering::Relaxed);
    }

    /// Reads every counter.
    pub fn snapshot(&self) -> Stats {
        let mut stats = Stats::default();
        for c in Counter::ALL {
            stats.values[c as usize] = self.cell(c).load(Ordering::Relaxed);
        }
        stats
    }
}

impl Default for Counters {
    fn default() -> Self {
        Counters::new()
    }
}

impl std::fmt::Debug for Counters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.snapshot().entries()).finish()
    }
}

/// Entries of an [`Epochs`] table: DataLoader worker ids it can serve.
pub const EPOCH_TABLE_LEN: usize = 1024;

/// The epoch of each DataLoader worker's next iteration, by worker id, in
/// memory shared with the processes the table is forked or handed to
/// (through its descriptor, [`Epochs::fd`] and [`Epochs::attach`]); and,
/// in one more cell, whether a worker has begun an iteration since the
/// process that made the table last set every entry
/// ([`Epochs::worker_began`]).
pub struct Epochs {
    cells: SharedCells,
}

impl Epochs {
    /// A new table, every entry 0.
    pub fn new() -> Self {
        Epochs {
            cells: SharedCells::new(EPOCH_TABLE_LEN + 1, c"shardstream-epochs"),
        }
    }

    /// A new table holding `values` (shorter: the rest 0; longer: an error).
    pub fn from_values(values: &[u64]) -> std::result::Result<Self, String> {
        if values.len() > EPOCH_TABLE_LEN {
            return Err(format!(
                "an epoch table has {EPOCH_TABLE_LEN} entries, got {}",
                values.len()
            ));
        }
        let table = Epochs::new();
        for (i, &value) in values.iter().enumerate() {
            table.cell(i).store(value, Ordering::SeqCst);
        }
        Ok(table)
    }

    /// The table whose memory file is `file` (from [`Epochs::fd`] of a
    /// table in another process): both see and advance the same entries.
    pub fn attach(file: OwnedFd) -> std::io::Result<Self> {
        Ok(Epochs {
            cells: SharedCells::attach(file, EPOCH_TABLE_LEN + 1, "an epoch table")?,
        })
    }

    /// The memory file, for [`Epochs::attach`] in another process; `None`
    /// when the table is shared with forked children only.
    pub fn fd(&self) -> Option<BorrowedFd<'_>> {
        self.cells.fd()
    }

    fn cell(&self, index: usize) -> &AtomicU64 {
        self.cells.cell(index)
    }

    /// Entry `worker` (below [`EPOCH_TABLE_LEN`]).
    pub fn get(&self, worker: usize) -> u64 {
        self.cell(worker).load(Ordering::SeqCst)
    }

    /// Sets every entry to `epoch`, and clears [`Epochs::worker_began`].
    pub fn set_all(&self, epoch: u64) {
        for i in 0..EPOCH_TABLE_LEN {
            self.cell(i).store(epoch, Ordering::SeqCst);
        }
        self.cell(EPOCH_TABLE_LEN).store(0, Ordering::SeqCst);
    }

    /// Records that a worker began an iteration ([`Epochs::worker_began`]).
    pub fn mark_worker_began(&self) {
        self.cell(EPOCH_TABLE_LEN).store(1, Ordering::SeqCst);
    }

    /// Whether a worker began an iteration since [`Epochs::set_all`] last
    /// ran (or since the table was made).
    pub fn worker_began(&self) -> bool {
        self.cell(EPOCH_TABLE_LEN).load(Ordering::SeqCst) != 0
    }

    /// Sets entry `worker` of a DataLoader with `num_workers` workers, and
    /// every entry from `num_workers` on (no worker of that DataLoader
    /// reads them: a later one with more workers starts from there), to
    /// `epoch`. `worker` must be below `num_workers` and
    /// [`EPOCH_TABLE_LEN`].
    pub fn set_worker(&self, worker: usize, num_workers: usize, epoch: u64) {
        assert!(worker < num_workers, "worker {worker} of {num_workers}");
        self.cell(worker).store(epoch, Ordering::SeqCst);
        for i in num_workers..EPOCH_TABLE_LEN {
            self.cell(i).store(epoch, Ordering::SeqCst);
        }
    }

    /// Every entry, in worker id order.
    pub fn values(&self) -> Vec<u64> {
        (0..EPOCH_TABLE_LEN).map(|i| self.get(i)).collect()
    }
}

impl Default for Epochs {
    fn default() -> Self {
        Epochs::new()
    }
}

/// Weights a [`SharedWeights`] table holds at most (a mixture's streams).
pub const SHARED_WEIGHTS_LEN: usize = 255;

/// Reads of a [`SharedWeights`] table tried while a write is under way
/// before giving up (a writer stopped mid-write leaves it so for ever).
const SHARED_WEIGHTS_TRIES: u32 = 1_000_000;

/// A mixture's weights, in memory shared with the processes the table is
/// forked or handed to (through its descriptor, [`SharedWeights::fd`] and
/// [`SharedWeights::attach`]): DataLoader workers that persist across
/// epochs read the weights of the epoch they start from it. Each write
/// gives the weights from an epoch on (the epochs before take those of the
/// one just before it), so a worker that starts its epoch late still mixes
/// it by the weights it was begun with. Written and read whole (a sequence lock): a reader never
/// sees part of a write.
///
/// Cells: the write sequence (odd while a write is under way), the first
/// epoch of the new weights, the number of weights, then the weights of the
/// epochs before it, then the new ones (each weight's bits).
pub struct SharedWeights {
    cells: SharedCells,
}

/// Cells of a [`SharedWeights`] table.
const SHARED_WEIGHTS_CELLS: usize = 3 + 2 * SHARED_WEIGHTS_LEN;

/// What a [`SharedWeights`] table holds: the weights of the epochs before
/// `from`, and of `from` on.
struct WeightsFrom {
    from: u64,
    before: Vec<f64>,
    after: Vec<f64>,
}

impl SharedWeights {
    /// A new table holding `weights` for every epoch (at most
    /// [`SHARED_WEIGHTS_LEN`]).
    pub fn new(weights: &[f64]) -> std::result::Result<Self, String> {
        let table = SharedWeights {
            cells: SharedCells::new(SHARED_WEIGHTS_CELLS, c"shardstream-weights"),
        };
        table.set(weights, 0)?;
        Ok(table)
    }

    /// The table whose memory file is `file` (from [`SharedWeights::fd`]
    /// of a table in another process): both see the same weights.
    pub fn attach(file: OwnedFd) -> std::io::Result<Self> {
        Ok(SharedWeights {
            cells: SharedCells::attach(file, SHARED_WEIGHTS_CELLS, "a weights table")?,
        })
    }

    /// The memory file, for [`SharedWeights::attach`] in another process;
    /// `None` when the table is shared with forked children only.
    pub fn fd(&self) -> Option<BorrowedFd<'_>> {
        self.cells.fd()
    }

    /// Makes `weights` (at most [`SHARED_WEIGHTS_LEN`]) the weights of
    /// epoch `from` and the ones after it; the epochs before take the
    /// weights epoch `from - 1` had (those of the epochs just begun). A write under way in another thread or process is
    /// waited for.
    pub fn set(&self, weights: &[f64], from: u64) -> std::result::Result<(), String> {
        if weights.len() > SHARED_WEIGHTS_LEN {
            return Err(format!(
                "a weights table holds at most {SHARED_WEIGHTS_LEN} weights, got {}",
                weights.len()
            ));
        }
        let sequence = self.cells.cell(0);
        let mut tries = 0;
        let start = loop {
            let seen = sequence.load(Ordering::SeqCst);
            if seen.is_multiple_of(2)
                && sequence
                    .compare_exchange(seen, seen + 1, Ordering::SeqCst, Ordering::SeqCst)
                    .is_ok()
            {
                break seen;
            }
            tries += 1;
            if tries >= SHARED_WEIGHTS_TRIES {
                return Err(Self::busy());
            }
            std::thread::yield_now();
        };
        // The lock is held: the cells hold the last whole write. The epochs
        // before `from` keep what they mixed by (a first write, or one of
        // another count of streams, gives them the new weights too).
        let held = self.held();
        let before = if start == 0 || held.after.len() != weights.len() {
            weights.to_vec()
        } else {
            held.of(from.saturating_sub(1)).to_vec()
        };
        self.cells.cell(1).store(from, Ordering::SeqCst);
        self.cells
            .cell(2)
            .store(weights.len() as u64, Ordering::SeqCst);
        for (i, (old, new)) in before.iter().zip(weights).enumerate() {
            self.cells
                .cell(3 + i)
                .store(old.to_bits(), Ordering::SeqCst);
            self.cells
                .cell(3 + SHARED_WEIGHTS_LEN + i)
                .store(new.to_bits(), Ordering::SeqCst);
        }
        sequence.store(start + 2, Ordering::SeqCst);
        Ok(())
    }

    /// The weights epoch `epoch` mixes by, as the last whole write left
    /// them.
    pub fn get(&self, epoch: u64) -> std::result::Result<Vec<f64>, String> {
        let (from, before, after) = self.held_whole()?;
        Ok(WeightsFrom {
            from,
            before,
            after,
        }
        .of(epoch)
        .to_vec())
    }

    /// The first epoch of the newest weights, the weights of the epochs
    /// before it, and the newest, as the last whole write left them.
    pub fn held_whole(&self) -> std::result::Result<(u64, Vec<f64>, Vec<f64>), String> {
        let sequence = self.cells.cell(0);
        for _ in 0..SHARED_WEIGHTS_TRIES {
            let before = sequence.load(Ordering::SeqCst);
            if before.is_multiple_of(2) {
                let held = self.held();
                if sequence.load(Ordering::SeqCst) == before {
                    return Ok((held.from, held.before, held.after));
                }
            }
            std::thread::yield_now();
        }
        Err(Self::busy())
    }

    /// The cells as they stand (whole only under the sequence's check).
    fn held(&self) -> WeightsFrom {
        let from = self.cells.cell(1).load(Ordering::SeqCst);
        let len = (self.cells.cell(2).load(Ordering::SeqCst) as usize).min(SHARED_WEIGHTS_LEN);
        let read = |first: usize| -> Vec<f64> {
            (0..len)
                .map(|i| f64::from_bits(self.cells.cell(first + i).load(Ordering::SeqCst)))
                .collect()
        };
        WeightsFrom {
            from,
            before: read(3),
            after: read(3 + SHARED_WEIGHTS_LEN),
        }
    }

    fn busy() -> String {
        "the mixture's weights stayed mid-write: a process stopped while setting them".into()
    }
}

impl WeightsFrom {
    /// The weights of `epoch`.
    fn of(&self, epoch: u64) -> &[f64] {
        if epoch >= self.from {
            &self.after
        } else {
            &self.before
        }
    }
}

impl std::fmt::Debug for SharedWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedWeights")
            .field("shareable", &self.fd().is_some())
            .finish()
    }
}

impl std::fmt::Debug for Epochs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Epochs")
            .field("first", &self.get(0))
            .field("shareable", &self.fd().is_some())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_weights_are_read_whole_across_threads_and_attached_copies() {
        let table = std::sync::Arc::new(SharedWeights::new(&[5.0; 40]).unwrap());
        assert_eq!(table.get(0).unwrap(), vec![5.0; 40]);
        assert!(SharedWeights::new(&[1.0; SHARED_WEIGHTS_LEN + 1]).is_err());
        // A reader sees each write whole: every weight of one write is the
        // same number, for the epochs from it and the ones before.
        let writer = {
            let table = table.clone();
            std::thread::spawn(move || {
                for n in 0..2000u32 {
                    table.set(&[f64::from(n); 40], u64::from(n)).unwrap();
                }
            })
        };
        for epoch in 0..2000 {
            let seen = table.get(epoch).unwrap();
            assert!(seen.windows(2).all(|w| w[0] == w[1]), "{seen:?}");
        }
        writer.join().unwrap();
        // Epoch 1999 on mix by the last write, 1998 by the one before.
        assert_eq!(table.get(1999).unwrap(), vec![1999.0; 40]);
        assert_eq!(table.get(1998).unwrap(), vec![1998.0; 40]);
        if let Some(fd) = table.fd() {
            let other = SharedWeights::attach(fd.try_clone_to_owned().unwrap()).unwrap();
            table.set(&[0.5; 40], 3000).unwrap();
            assert_eq!(other.get(3000).unwrap(), vec![0.5; 40]);
            assert_eq!(other.get(2999).unwrap(), vec![1999.0; 40]);
        }
    }

    #[test]
    fn adds_and_reads() {
        let c = Counters::new();
        c.add(Counter::Samples, 3);
        c.add(Counter::Samples, 4);
        c.add(Counter::BytesRead, 10);
        let s = c.snapshot();
        assert_eq!(s.get(Counter::Samples), 7);
        assert_eq!(s.get(Counter::BytesRead), 10);
        assert_eq!(s.get(Counter::ErrorsSkipped), 0);
    }

    #[test]
    fn report_derives_parse_time_and_read_ahead_bytes() {
        let c = Counters::new();
        c.add(Counter::PipelineNanos, 100);
        c.add(Counter::StorageWaitNanos, 30);
        c.add(Counter::DecodeNanos, 20);
        c.add(Counter::OutputWaitNanos, 10);
        c.add(Counter::BytesRead, 500);
        c.add(Counter::CacheBytes, 100);
        c.add(Counter::ParsedBytes, 450);
        c.add(Counter::OutputQueued, 5);
        c.sub(Counter::OutputQueued, 3);
        let report: std::collections::HashMap<_, _> = c.snapshot().report().into_iter().collect();
        assert_eq!(report["parse_ns"], 40);
        assert_eq!(report["read_ahead_bytes"], 150);
        assert_eq!(report["output_queue_samples"], 2);
        assert_eq!(report.len(), Counter::ALL.len() + 2);
    }

    #[test]
    fn forked_child_adds_to_parent() {
        let c = Counters::new();
        // SAFETY: the child only does an atomic add and `_exit`s.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            c.add(Counter::Samples, 5);
            unsafe { libc::_exit(0) };
        }
        let mut status = 0;
        // SAFETY: waits for the child forked above.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert_eq!(c.snapshot().get(Counter::Samples), 5);
    }

    #[test]
    fn counters_attached_by_descriptor_share_values() {
        let c = Counters::new();
        let fd = c
            .fd()
            .expect("a memory file on Linux")
            .try_clone_to_owned()
            .unwrap();
        let other = Counters::attach(fd).unwrap();
        other.add(Counter::Samples, 5);
        c.add(Counter::Samples, 2);
        assert_eq!(other.snapshot().get(Counter::Samples), 7);
        assert_eq!(c.snapshot(), other.snapshot());
        let epochs = Epochs::new();
        let wrong = epochs.fd().unwrap().try_clone_to_owned().unwrap();
        assert!(
            Counters::attach(wrong).is_err(),
            "an epoch table is not counters"
        );
    }

    #[test]
    fn epochs_set_and_read() {
        let e = Epochs::new();
        assert!(e.values().iter().all(|&v| v == 0));
        e.set_all(4);
        e.set_worker(1, 3, 9);
        assert_eq!(&e.values()[..5], &[4, 9, 4, 9, 9]);
        assert_eq!(e.get(EPOCH_TABLE_LEN - 1), 9);
        let copy = Epochs::from_values(&e.values()).unwrap();
        assert_eq!(copy.values(), e.values());
        copy.set_all(0);
        assert_eq!(e.get(0), 4, "a copy is independent");
        assert!(Epochs::from_values(&[0; EPOCH_TABLE_LEN + 1]).is_err());
    }

    #[test]
    fn epochs_attached_by_descriptor_share_entries() {
        let e = Epochs::new();
        let fd = e
            .fd()
            .expect("a memory file on Linux")
            .try_clone_to_owned()
            .unwrap();
        let other = Epochs::attach(fd).unwrap();
        other.set_worker(0, 2, 7);
        assert_eq!((e.get(0), e.get(1), e.get(2)), (7, 0, 7));
        assert!(!e.worker_began());
        other.mark_worker_began();
        assert!(
            e.worker_began(),
            "a worker's iteration is seen where the table was made"
        );
        other.set_worker(1, 2, 8);
        assert!(e.worker_began(), "a worker's entry leaves the mark");
        e.set_all(8);
        assert!(!other.worker_began(), "setting every entry clears the mark");
        let wrong = tempfile::tempfile().unwrap();
        assert!(Epochs::attach(wrong.into()).is_err());
    }

    #[test]
    fn forked_child_advances_parent_epochs() {
        let e = Epochs::new();
        // SAFETY: the child only does atomic stores and `_exit`s.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            e.set_worker(0, 1, 3);
            unsafe { libc::_exit(0) };
        }
        let mut status = 0;
        // SAFETY: waits for the child forked above.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert_eq!((e.get(0), e.get(1)), (3, 3));
    }
}
