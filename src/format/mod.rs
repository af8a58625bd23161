//! Bytes in, samples out. Formats read from any `std::io::Read` handed to
//! them and never open files or connections themselves.

pub mod blob;
pub mod compressed;
pub mod lines;
pub mod parquet;
pub mod tar;
mod verified;

use std::sync::Arc;

use bytes::Bytes;

use crate::byte_size::ByteSize;
use crate::compression::Compression;
pub use crate::value::Value;

/// How reading a shard's stream of samples (tar, JSON lines) ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The shard ended; this many samples were produced.
    Completed {
        /// Samples produced.
        samples: u64,
    },
    /// The callback asked to stop.
    Stopped,
}

/// Stable identity of a sample: its shard and its position in that shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SampleId {
    /// Index of the shard in the dataset's shard list.
    pub shard: usize,
    /// Index of the sample within its shard.
    pub index: u64,
}

/// The field that carries a sample's id when `sample_ids` is on: an
/// `(epoch, shard index, index in shard)` tuple on a sample, its `(K, 3)`
/// `int64` rows on a packed sequence.
pub const SAMPLE_ID_FIELD: &str = "__id__";

/// The names shardstream gives each sample besides its fields: `__key__`,
/// `__url__`, and the [`SAMPLE_ID_FIELD`] and `__seed__` that options add.
/// A shard's field may not take one (it would replace the name, or the
/// name it): a tar member or Parquet column so named is a format error, and
/// a JSON line may give only its `__key__`, as a string.
pub const GIVEN_NAMES: [&str; 4] = ["__key__", "__url__", SAMPLE_ID_FIELD, "__seed__"];

/// The field that carries a packed sequence's epoch when `sample_ids` is
/// on (a `(1,)` `int64` array): what a ledger records a step by when no
/// document ends in it (its `__id__` has no rows).
pub const SEQUENCE_EPOCH_FIELD: &str = "__epoch__";

/// One sample: a key, the shard it came from, and its fields in member order.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Stable id.
    pub id: SampleId,
    /// `__key__`.
    pub key: String,
    /// `__url__`: the shard's URL.
    pub url: Arc<str>,
    /// Field name and value, in order: a tar member's lower-cased
    /// extension and its bytes, or a decoded value.
    pub fields: Vec<(String, Value)>,
    /// Byte offset of the sample's first header in the shard (in the
    /// decompressed tar, for a compressed shard).
    pub offset: u64,
    /// Bytes from `offset` to the end of the sample's last member; a read
    /// of exactly this range yields this sample alone.
    pub length: u64,
}

impl ByteSize for Sample {
    fn byte_size(&self) -> usize {
        self.key.len()
            + self
                .fields
                .iter()
                .map(|(k, v)| k.len() + v.byte_size())
                .sum::<usize>()
    }
}

/// The shard a format is reading: its index and URL, for ids and errors,
/// and where the bytes handed over start within it.
#[derive(Debug, Clone)]
pub struct ShardRef {
    /// Index in the dataset's shard list.
    pub index: usize,
    /// URL, shared by every sample of the shard.
    pub url: Arc<str>,
    /// Byte offset in the shard of the first byte read.
    pub base_offset: u64,
    /// Index in the shard of the first sample read.
    pub first_index: u64,
    /// The shard's compression: offsets are then in the decompressed tar.
    pub compression: Option<Compression>,
    /// Whether the bytes handed over run to the shard's end, so that a tar
    /// archive's end-of-archive blocks are among them (not a byte range an
    /// index gave).
    pub to_end: bool,
}

impl ShardRef {
    /// A shard read from its start.
    pub fn whole(index: usize, url: Arc<str>) -> Self {
        ShardRef {
            index,
            url,
            base_offset: 0,
            first_index: 0,
            compression: None,
            to_end: true,
        }
    }

    /// A [`crate::error::Error::Format`] about this shard.
    pub fn format_error(
        &self,
        offset: u64,
        member: Option<String>,
        reason: impl Into<String>,
    ) -> crate::error::Error {
        crate::error::Error::Format {
            url: self.url.to_string(),
            offset,
            compression: self.compression,
            member,
            reason: reason.into(),
        }
    }
}

/// A byte stream a format reads from, which may know better than the
/// format why reading failed.
pub trait ByteSource: std::io::Read {
    /// The source's own error behind the last failed read, if any.
    fn take_failure(&mut self) -> Option<crate::error::Error> {
        None
    }

    /// Reads on past the end of the archive when the stream has a trailer
    /// to check (a compressed stream's checksum); plain bytes have none.
    fn check_trailer(&mut self) -> std::io::Result<()> {
        Ok(())
    }

    /// Where the checks the stream makes of its own bytes (a compressed
    /// stream's checksums) have reached: every byte handed out before this
    /// offset passed them, or has no check still to come. Bytes at or past
    /// it may yet fail one. Plain bytes have no check: `u64::MAX`.
    fn settled(&self) -> u64 {
        u64::MAX
    }

    /// Passes over at most `max` bytes and returns how many (0 at the end
    /// of the stream), like `read` without handing the bytes out; sources
    /// that hold their bytes in memory skip without copying them.
    fn skip(&mut self, max: usize) -> std::io::Result<usize> {
        skip_by_reading(self, max)
    }

    /// Appends at most `max` bytes to `out` and returns how many (0 at the
    /// end of the stream), like `read` into `out`'s spare room; sources
    /// that hold their bytes in memory copy them once, without first
    /// zeroing the room as `Read::read_to_end` does for other readers.
    fn read_append(&mut self, out: &mut Vec<u8>, max: usize) -> std::io::Result<usize> {
        read_append_by_reading(self, out, max)
    }

    /// The next `len` bytes, handed out without copying them when the
    /// source can share them (a local shard's bytes mapped from the file);
    /// `None`, with nothing consumed, when it cannot: the caller then reads
    /// them with [`ByteSource::read_append`].
    fn read_shared(&mut self, _len: usize) -> std::io::Result<Option<Bytes>> {
        Ok(None)
    }

    /// A hint that the bytes from `ahead` to `ahead + len` past the current
    /// position will be read soon: sources that hold them in memory ask the
    /// CPU to cache them; others ignore it.
    fn prefetch(&self, _ahead: usize, _len: usize) {}
}

/// Appends the rest of `reader` to `out` with [`ByteSource::read_append`].
/// When reading fails, `out` holds the bytes read before the failure.
pub fn read_append_to_end<R: ByteSource + ?Sized>(
    reader: &mut R,
    out: &mut Vec<u8>,
) -> std::io::Result<()> {
    loop {
        match reader.read_append(out, usize::MAX) {
            Ok(0) => return Ok(()),
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// Makes room in `out` for the next bytes of a value of which `left` bytes
/// are still to come, and returns that room (at most `left`). It grows `out`
/// with `try_reserve`, so that a size no memory can hold is an error of kind
/// `OutOfMemory`, not an abort: by all of `left` up to `first`, then by as
/// much again as `out` holds (so a damaged size field claiming terabytes
/// over a short input costs `first` bytes at most, and a long value is
/// copied about once as it grows, as with `Vec`'s own growth).
#[inline]
pub(crate) fn reserve_room(out: &mut Vec<u8>, left: u64, first: u64) -> std::io::Result<usize> {
    let left = usize::try_from(left).unwrap_or(usize::MAX);
    if out.capacity() == out.len() && left > 0 {
        let grow = left.min(out.len().max(usize::try_from(first).unwrap_or(usize::MAX)));
        out.try_reserve_exact(grow).map_err(|e| {
            std::io::Error::new(
                std::io::ErrorKind::OutOfMemory,
                format!(
                    "cannot allocate {} bytes ({e})",
                    out.len().saturating_add(grow)
                ),
            )
        })?;
    }
    Ok((out.capacity() - out.len()).min(left))
}

/// Appends at most `max` bytes of `reader` to `out`, read through a scratch
/// buffer; returns how many.
fn read_append_by_reading(
    reader: &mut (impl std::io::Read + ?Sized),
    out: &mut Vec<u8>,
    max: usize,
) -> std::io::Result<usize> {
    let mut scratch = [0u8; 16 << 10];
    let len = max.min(scratch.len());
    let n = reader.read(&mut scratch[..len])?;
    out.extend_from_slice(&scratch[..n]);
    Ok(n)
}

/// Asks the CPU to bring `bytes[ahead..ahead + len]` (the part of it that
/// exists) into cache. The tar reader does this for the next header while it
/// works on the current member, so that header's first read does not stall
/// on memory; on other architectures it does nothing.
pub(crate) fn prefetch_range(bytes: &[u8], ahead: usize, len: usize) {
    #[cfg(target_arch = "x86_64")]
    if let Some(rest) = bytes.get(ahead..) {
        for line in rest[..len.min(rest.len())].chunks(64) {
            // SAFETY: a prefetch is a hint to the cache: it reads nothing
            // the program sees and cannot fault; `sse` is part of x86_64.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                    line.as_ptr().cast(),
                );
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (bytes, ahead, len);
}

/// Passes over at most `max` bytes of `reader` by reading them into a
/// scratch buffer; returns how many.
fn skip_by_reading(
    reader: &mut (impl std::io::Read + ?Sized),
    max: usize,
) -> std::io::Result<usize> {
    let mut discard = [0u8; 4096];
    let len = max.min(discard.len());
    reader.read(&mut discard[..len])
}

impl ByteSource for &[u8] {
    fn prefetch(&self, ahead: usize, len: usize) {
        prefetch_range(self, ahead, len);
    }

    fn skip(&mut self, max: usize) -> std::io::Result<usize> {
        let n = max.min(self.len());
        *self = &self[n..];
        Ok(n)
    }

    fn read_append(&mut self, out: &mut Vec<u8>, max: usize) -> std::io::Result<usize> {
        let (taken, rest) = self.split_at(max.min(self.len()));
        out.extend_from_slice(taken);
        *self = rest;
        Ok(taken.len())
    }
}

impl<S: ByteSource + ?Sized> ByteSource for &mut S {
    fn take_failure(&mut self) -> Option<crate::error::Error> {
        (**self).take_failure()
    }

    fn check_trailer(&mut self) -> std::io::Result<()> {
        (**self).check_trailer()
    }

    fn settled(&self) -> u64 {
        (**self).settled()
    }

    fn skip(&mut self, max: usize) -> std::io::Result<usize> {
        (**self).skip(max)
    }

    fn read_append(&mut self, out: &mut Vec<u8>, max: usize) -> std::io::Result<usize> {
        (**self).read_append(out, max)
    }

    fn read_shared(&mut self, len: usize) -> std::io::Result<Option<Bytes>> {
        (**self).read_shared(len)
    }

    fn prefetch(&self, ahead: usize, len: usize) {
        (**self).prefetch(ahead, len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The hint takes any offset and length, in or past the bytes, without
    /// panicking and without changing what is read next.
    #[test]
    fn prefetch_takes_any_range() {
        let bytes: Vec<u8> = (0..100).collect();
        let mut source = &bytes[..];
        for (ahead, len) in [(0, 0), (0, 512), (99, 512), (100, 1), (5000, 512)] {
            source.prefetch(ahead, len);
        }
        source.prefetch(usize::MAX, usize::MAX);
        let mut first = [0u8; 3];
        std::io::Read::read_exact(&mut source, &mut first).unwrap();
        assert_eq!(first, [0, 1, 2]);
    }

    /// A source that only reads, in short reads, so appends go through the
    /// scratch buffer of the default `read_append`.
    struct Trickle<'a>(&'a [u8]);

    impl std::io::Read for Trickle<'_> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            let n = buf.len().min(self.0.len()).min(7000);
            buf[..n].copy_from_slice(&self.0[..n]);
            self.0 = &self.0[n..];
            Ok(n)
        }
    }

    impl ByteSource for Trickle<'_> {}

    /// Appends take at most `max` bytes, keep what `out` held, and give 0
    /// at the end, from memory and through reads alike.
    #[test]
    fn read_append_appends_at_most_max() {
        let bytes: Vec<u8> = (0..50_000u32).map(|i| (i % 251) as u8).collect();
        let mut slice = &bytes[..];
        let mut out = vec![9];
        assert_eq!(slice.read_append(&mut out, 10).unwrap(), 10);
        assert_eq!(out[1..], bytes[..10]);
        read_append_to_end(&mut slice, &mut out).unwrap();
        assert_eq!(out[1..], bytes[..]);
        assert_eq!(slice.read_append(&mut out, 10).unwrap(), 0);

        let mut trickle = Trickle(&bytes);
        let mut out = vec![9];
        assert_eq!(trickle.read_append(&mut out, 10).unwrap(), 10);
        let n = trickle.read_append(&mut out, usize::MAX).unwrap();
        assert!((1..=16 << 10).contains(&n), "{n}");
        read_append_to_end(&mut trickle, &mut out).unwrap();
        assert_eq!(out[1..], bytes[..]);
    }
}
