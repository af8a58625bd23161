//! Pages of mapped chunks: the page size, and a member's bytes that give
//! back, when dropped, the pages only they hold, so that a chunk kept
//! mapped by a few samples still in the shuffle buffer holds their pages,
//! not the whole chunk's.

use bytes::Bytes;

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
