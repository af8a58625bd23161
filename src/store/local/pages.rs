//! Pages of mapped chunks: the page size, and a member's bytes that give
//! back, when dropped, the pages only they hold, so that a chunk kept
//! mapped by a few samples still in the shuffle buffer holds their pages,
//! not the whole chunk's.
//!
//! Each thread gives dropped members' pages back in lots of up to
//! [`RELEASE_LOT`] ranges (or [`RELEASE_LOT_BYTES`]), and gives back what
//! waits when it is about to wait for its next sample
//! ([`release_pending`]) or ends. A lot is one `process_madvise` call
//! where the kernel takes `MADV_DONTNEED` that way (Linux 6.13 and later),
//! one `madvise` per range otherwise. Each release from a mapping costs a
//! TLB shootdown on every core running the process; a lot costs one
//! (Linux 6.16 and later) instead of one per member, which at workers 0 on
//! 80 KB members was half the consuming thread's time
//! (docs/performance.md, "Where the CPU goes at workers 0 on audio").

use std::cell::RefCell;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

use bytes::Bytes;

use crate::fork::ForkHandlers;

/// The most dropped members' page ranges a thread holds before giving
/// them back in one call (the kernel's `process_madvise` takes up to
/// `IOV_MAX`, 1024).
pub(super) const RELEASE_LOT: usize = 32;

/// The most bytes of dropped members' pages a thread holds before giving
/// them back, so that a lot of large members is not held for long.
const RELEASE_LOT_BYTES: usize = 4 << 20;

/// A member's bytes inside a chunk mapped from a file. Holding it keeps the
/// chunk mapped; dropping it drops the pages that hold only this member's
/// bytes from the mapping, so that a chunk kept mapped by a few samples
/// still in the shuffle buffer holds their pages, not the whole chunk's.
pub(crate) struct MappedMember {
    chunk: Bytes,
    start: usize,
    len: usize,
}

impl MappedMember {
    /// The `len` bytes of `chunk` from `start`.
    pub(crate) fn new(chunk: Bytes, start: usize, len: usize) -> Self {
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
        let Some(pages) = whole_pages(begin, self.len, page_size()) else {
            return;
        };
        // The chunk goes with its range, keeping its mapping until the
        // range is given back: a range released after its mapping went
        // could drop pages of whatever was mapped there since.
        let mut waiting = Some((std::mem::take(&mut self.chunk), pages));
        // Where this thread's lot is not at hand (its thread-locals are
        // gone, or it is being given back), the range goes back at once.
        let _ = PENDING.try_with(|pending| {
            if let Ok(mut pending) = pending.try_borrow_mut() {
                if let Some((chunk, pages)) = waiting.take() {
                    pending.push(chunk, pages);
                }
            }
        });
        if let Some(range) = waiting {
            release(std::slice::from_ref(&range));
        }
    }
}

/// Dropped members' page ranges waiting to be given back, each with its
/// chunk (which keeps the range mapped until then).
struct PendingReleases {
    /// Each waiting range, with the chunk it lies in.
    ranges: Vec<(Bytes, Range<usize>)>,
    /// The bytes of the waiting ranges.
    bytes: usize,
}

impl PendingReleases {
    /// Adds a range; gives the lot back once it is full.
    fn push(&mut self, chunk: Bytes, pages: Range<usize>) {
        self.bytes += pages.len();
        self.ranges.push((chunk, pages));
        if self.ranges.len() >= RELEASE_LOT || self.bytes >= RELEASE_LOT_BYTES {
            self.release_all();
        }
    }

    /// Gives every waiting range back, then lets their chunks go.
    fn release_all(&mut self) {
        if self.ranges.is_empty() {
            return;
        }
        release(&self.ranges);
        self.ranges.clear();
        self.bytes = 0;
    }
}

impl Drop for PendingReleases {
    fn drop(&mut self) {
        self.release_all();
    }
}

thread_local! {
    /// This thread's dropped members' pages not yet given back.
    static PENDING: RefCell<PendingReleases> = const {
        RefCell::new(PendingReleases {
            ranges: Vec::new(),
            bytes: 0,
        })
    };
}

/// Gives back the pages this thread's dropped members still hold, which
/// otherwise wait for its next lot: called by a consumer that has waited a
/// moment for its next sample, so that one that stops (an epoch's end, an
/// evaluation between epochs) holds none.
pub(crate) fn release_pending() {
    let _ = PENDING.try_with(|pending| {
        if let Ok(mut pending) = pending.try_borrow_mut() {
            pending.release_all();
        }
    });
}

/// How many dropped members' page ranges wait in this thread's lot.
#[cfg(test)]
pub(crate) fn waiting_page_ranges() -> usize {
    PENDING.with(|pending| pending.borrow().ranges.len())
}

/// Drops the pages of `ranges` from their mappings: all in one
/// `process_madvise` call where the kernel takes it, one `madvise` each
/// for whatever that call did not cover.
fn release(ranges: &[(Bytes, Range<usize>)]) {
    let covered = release_in_one_call(ranges);
    for pages in left_out(ranges.iter().map(|(_, pages)| pages), covered) {
        // SAFETY: the whole pages of `pages` lie inside a chunk's mapping,
        // which the chunk beside them keeps mapped, and hold only a
        // dropped member's bytes. Dropping pages of a read-only file
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

/// The ranges, of `ranges` in order, that a call which covered the first
/// `covered` bytes of them did not cover whole.
fn left_out<'a>(
    ranges: impl Iterator<Item = &'a Range<usize>>,
    mut covered: usize,
) -> impl Iterator<Item = &'a Range<usize>> {
    ranges.filter(move |pages| {
        let whole = covered >= pages.len();
        covered = if whole { covered - pages.len() } else { 0 };
        !whole
    })
}

/// Whether `process_madvise` refused `MADV_DONTNEED` on this process
/// (kernels before 6.13, or a seccomp filter): every release is then one
/// `madvise` per range.
pub(super) static ONE_CALL_REFUSED: AtomicBool = AtomicBool::new(false);

/// A pidfd of this process, opened at the first lot (-1: none yet).
/// Closed and forgotten in a forked child, whose pidfd it is not.
static SELF_PIDFD: AtomicI32 = AtomicI32::new(-1);

/// Drops the pages of the leading ranges of `ranges` with one
/// `process_madvise` call; the bytes it covered, in order (0 where the
/// call is refused).
fn release_in_one_call(ranges: &[(Bytes, Range<usize>)]) -> usize {
    if ranges.len() < 2 || ranges.len() > RELEASE_LOT || ONE_CALL_REFUSED.load(Ordering::Relaxed) {
        return 0;
    }
    let Some(pidfd) = self_pidfd() else {
        return 0;
    };
    let mut vectors = [libc::iovec {
        iov_base: std::ptr::null_mut(),
        iov_len: 0,
    }; RELEASE_LOT];
    for (vector, (_, pages)) in vectors.iter_mut().zip(ranges) {
        vector.iov_base = pages.start as *mut libc::c_void;
        vector.iov_len = pages.len();
    }
    // SAFETY: as `release`'s `madvise`, for each range; `vectors` holds
    // `ranges.len()` initialised entries and outlives the call.
    let done = unsafe {
        libc::syscall(
            libc::SYS_process_madvise,
            pidfd,
            vectors.as_ptr(),
            ranges.len(),
            libc::MADV_DONTNEED,
            0,
        )
    };
    if done < 0 {
        let refused = std::io::Error::last_os_error().raw_os_error();
        if matches!(refused, Some(libc::EINVAL | libc::ENOSYS | libc::EPERM)) {
            ONE_CALL_REFUSED.store(true, Ordering::Relaxed);
        }
        return 0;
    }
    usize::try_from(done).unwrap_or(0)
}

/// This process's pidfd, opened once (and again in a forked child).
fn self_pidfd() -> Option<libc::c_int> {
    let known = SELF_PIDFD.load(Ordering::Acquire);
    if known >= 0 {
        return Some(known);
    }
    // SAFETY: opens a pidfd of this process; no pointer is passed.
    let opened = unsafe { libc::syscall(libc::SYS_pidfd_open, libc::getpid(), 0) };
    if opened < 0 {
        // A kernel before 5.3, or a filter that refuses it; other
        // failures (out of descriptors) may pass.
        let refused = std::io::Error::last_os_error().raw_os_error();
        if matches!(refused, Some(libc::EINVAL | libc::ENOSYS | libc::EPERM)) {
            ONE_CALL_REFUSED.store(true, Ordering::Relaxed);
        }
        return None;
    }
    let opened = libc::c_int::try_from(opened).ok()?;
    match SELF_PIDFD.compare_exchange(-1, opened, Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) => Some(opened),
        Err(other) => {
            // Another thread opened one first: keep that one.
            // SAFETY: `opened` is this call's own descriptor.
            unsafe { libc::close(opened) };
            Some(other)
        }
    }
}

/// This module's handlers around a `fork`, registered with the local
/// store's (before any chunk is mapped).
pub(super) static FORK_HANDLERS: ForkHandlers = ForkHandlers {
    prepare: None,
    parent: None,
    child: Some(forget_parents_pidfd),
};

/// In a forked child: closes the parent's pidfd, so that the child's
/// next lot opens its own (a lot is never given to another process; the
/// kernel would refuse it anyway). The descriptor is this module's own,
/// inherited by the fork a moment ago, unless code outside it closed that
/// number and opened another since, which nothing here does.
fn forget_parents_pidfd() {
    let parents = SELF_PIDFD.swap(-1, Ordering::AcqRel);
    if parents >= 0 {
        // SAFETY: the descriptor this module opened, inherited by the fork.
        unsafe { libc::close(parents) };
    }
}

/// The whole pages (of `page` bytes) within the `len` bytes at address
/// `begin`, if there are any.
pub(super) fn whole_pages(begin: usize, len: usize, page: usize) -> Option<std::ops::Range<usize>> {
    let first = begin.next_multiple_of(page);
    let last = (begin + len) / page * page;
    (last > first).then_some(first..last)
}

/// The size of a memory page.
pub(super) fn page_size() -> usize {
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
        fn what_a_call_left_out_is_every_range_past_what_it_covered_whole(
            lengths in proptest::collection::vec(1usize..10, 0..40),
            covered_share in 0.0f64..1.2,
        ) {
            let mut ranges = Vec::new();
            let mut start = 0;
            for length in &lengths {
                ranges.push(start..start + length);
                start += length + 1;
            }
            let total: usize = lengths.iter().sum();
            let covered = (total as f64 * covered_share) as usize;
            let left: Vec<_> = left_out(ranges.iter(), covered).cloned().collect();
            // The ranges covered whole are a leading run, within `covered`;
            // the rest are all left out, the one covered in part included.
            let whole = ranges.len() - left.len();
            prop_assert_eq!(&left[..], &ranges[whole..]);
            prop_assert!(lengths[..whole].iter().sum::<usize>() <= covered);
            if let Some(first) = lengths.get(whole) {
                prop_assert!(lengths[..whole].iter().sum::<usize>() + first > covered);
            }
        }

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
}
