//! Stream counters. They live in shared anonymous memory, so DataLoader
//! worker processes forked after their creation add to the same numbers the
//! parent reads.

use std::sync::atomic::{AtomicU64, Ordering};

/// One counter of [`Counters`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counter {
    /// Shards opened for reading.
    ShardsOpened,
    /// Shards read to their end.
    ShardsCompleted,
    /// Samples produced.
    Samples,
    /// Bytes read from storage.
    BytesRead,
    /// Bad shards skipped under `on_error="warn"`.
    ErrorsSkipped,
    /// Requests (GETs) sent to an object store.
    Requests,
    /// Requests or bodies retried.
    Retries,
    /// Bodies resumed mid-way with a Range request.
    Resumes,
}

impl Counter {
    /// Every counter, in [`Stats`] order.
    pub const ALL: [Counter; 8] = [
        Counter::ShardsOpened,
        Counter::ShardsCompleted,
        Counter::Samples,
        Counter::BytesRead,
        Counter::ErrorsSkipped,
        Counter::Requests,
        Counter::Retries,
        Counter::Resumes,
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
}

/// Atomic counters, in memory shared with forked child processes.
pub struct Counters {
    cells: *mut AtomicU64,
    mapped: bool,
}

// SAFETY: the cells are atomics, valid for the life of `Counters`.
unsafe impl Send for Counters {}
// SAFETY: as above; all access is through atomic operations.
unsafe impl Sync for Counters {}

impl Counters {
    /// New zeroed counters in a shared anonymous mapping (heap if mapping fails).
    pub fn new() -> Self {
        let size = COUNT * std::mem::size_of::<AtomicU64>();
        // SAFETY: an anonymous shared mapping, checked for failure; it is
        // zero-filled, which is a valid AtomicU64 value.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            let boxed: Box<[AtomicU64; COUNT]> = Box::default();
            return Counters {
                cells: Box::into_raw(boxed).cast(),
                mapped: false,
            };
        }
        Counters {
            cells: ptr.cast(),
            mapped: true,
        }
    }

    fn cell(&self, counter: Counter) -> &AtomicU64 {
        // SAFETY: `cells` points at COUNT atomics and the index is below COUNT.
        unsafe { &*self.cells.add(counter as usize) }
    }

    /// Adds `n` to `counter`.
    pub fn add(&self, counter: Counter, n: u64) {
        self.cell(counter).fetch_add(n, Ordering::Relaxed);
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

impl Drop for Counters {
    fn drop(&mut self) {
        if self.mapped {
            // SAFETY: unmaps the mapping made in `new`, once.
            unsafe {
                libc::munmap(self.cells.cast(), COUNT * std::mem::size_of::<AtomicU64>());
            }
        } else {
            // SAFETY: re-owns the box leaked in `new`, once.
            drop(unsafe { Box::from_raw(self.cells.cast::<[AtomicU64; COUNT]>()) });
        }
    }
}

impl std::fmt::Debug for Counters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.snapshot().entries()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
