//! Compressed shards: a gzip or zstd stream is told by its magic bytes (not
//! by the shard's name) and decoded as it is read, a buffer at a time, so a
//! shard is never held whole in memory nor written to a temporary file.
//!
//! Each gzip member and each zstd frame is decoded on its own, so that the
//! stream knows where its checks ran: a gzip member's CRC-32 and length are
//! checked at its end, a zstd frame's content checksum (when the frame has
//! one) at its end. [`ByteSource::settled`] says up to which decoded byte
//! those checks have passed, so that the tar reader can hold back samples
//! until the bytes they came from are verified.

use std::io::{self, BufRead, BufReader, Read};

use bytes::Bytes;

use super::{read_append_by_reading, skip_by_reading, ByteSource};
use crate::compression::Compression;
use crate::error::{Error, Result};

/// Bytes read before deciding how a stream is compressed.
const MAGIC_LEN: usize = 4;
/// Compressed bytes buffered ahead of the decoder.
const INPUT_BUFFER: usize = 128 * 1024;

/// The shard's own bytes, the peeked magic bytes first, counted as the
/// decoder takes them.
struct Counted<R> {
    inner: R,
    head: [u8; MAGIC_LEN],
    head_len: usize,
    head_pos: usize,
    /// Bytes handed on, the peeked ones included.
    count: u64,
    hit_eof: bool,
    /// The source itself failed (missing shard, timeout, ...).
    failed: bool,
}

impl<R> Counted<R> {
    /// `inner`, whose first `head_len` bytes were already read into `head`.
    fn new(inner: R, head: [u8; MAGIC_LEN], head_len: usize) -> Self {
        Counted {
            inner,
            head,
            head_len,
            head_pos: 0,
            count: 0,
            hit_eof: false,
            failed: false,
        }
    }
}

impl<R> Counted<R> {
    /// At most `max` of the peeked bytes not handed out yet, counted as
    /// handed out; `None` once they all are.
    fn take_head(&mut self, max: usize) -> Option<&[u8]> {
        if self.head_pos == self.head_len {
            return None;
        }
        let start = self.head_pos;
        let n = max.min(self.head_len - start);
        self.head_pos += n;
        self.count += n as u64;
        Some(&self.head[start..start + n])
    }

    /// Counts what a read, skip or append of at most `max` bytes of the
    /// inner source gave.
    fn count_inner(
        &mut self,
        max: usize,
        result: std::io::Result<usize>,
    ) -> std::io::Result<usize> {
        match result {
            Ok(n) => {
                self.count += n as u64;
                self.hit_eof |= n == 0 && max > 0;
                Ok(n)
            }
            Err(e) => {
                self.failed = true;
                Err(e)
            }
        }
    }
}

impl<R: Read> Read for Counted<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if let Some(head) = self.take_head(buf.len()) {
            buf[..head.len()].copy_from_slice(head);
            return Ok(head.len());
        }
        let result = self.inner.read(buf);
        self.count_inner(buf.len(), result)
    }
}

enum Decoder<R> {
    Plain(Counted<R>),
    Gzip(Box<GzipMembers<R>>),
    Zstd(Box<ZstdFrames<R>>),
}

/// The first error a decoder returned, returned again by every later read:
/// a decoder is not read past its first failure.
#[derive(Debug, Clone)]
struct Sticky(io::ErrorKind, String);

impl Sticky {
    fn of(error: &io::Error) -> Self {
        Sticky(error.kind(), error.to_string())
    }

    fn error(&self) -> io::Error {
        io::Error::new(self.0, self.1.clone())
    }
}

/// The members of a gzip stream, one after another, each decoded by a
/// decoder of its own, so that the end of each member, where its CRC-32 and
/// length are checked, is known (a multi-member decoder hides it).
struct GzipMembers<R> {
    /// The current member's decoder; `None` only while it is replaced.
    decoder: Option<flate2::bufread::GzDecoder<BufReader<Counted<R>>>>,
    /// Decoded bytes handed out.
    out: u64,
    /// Decoded bytes of the members whose CRC-32 and length matched.
    verified: u64,
    /// The zero bytes the decoded bytes so far end with, up to
    /// [`TAR_END_BYTES`].
    zeros_at_end: u64,
    /// The last member was verified and no bytes follow it.
    ended: bool,
    failed: Option<Sticky>,
}

impl<R: Read> GzipMembers<R> {
    fn new(input: BufReader<Counted<R>>) -> Self {
        GzipMembers {
            decoder: Some(flate2::bufread::GzDecoder::new(input)),
            out: 0,
            verified: 0,
            zeros_at_end: 0,
            ended: false,
            failed: None,
        }
    }

    fn input(&self) -> &BufReader<Counted<R>> {
        self.decoder.as_ref().expect("a member decoder").get_ref()
    }

    fn input_mut(&mut self) -> &mut BufReader<Counted<R>> {
        self.decoder.as_mut().expect("a member decoder").get_mut()
    }

    fn fail(&mut self, error: io::Error) -> io::Error {
        if error.kind() != io::ErrorKind::Interrupted {
            self.failed = Some(Sticky::of(&error));
        }
        error
    }
}

impl<R: Read> Read for GzipMembers<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if let Some(failed) = &self.failed {
            return Err(failed.error());
        }
        if buf.is_empty() {
            return Ok(0);
        }
        loop {
            if self.ended {
                return Ok(0);
            }
            let decoder = self.decoder.as_mut().expect("a member decoder");
            match decoder.read(buf) {
                Ok(0) => {
                    // The decoder returns the end of a member only once its
                    // CRC-32 and length matched the bytes it decoded.
                    self.verified = self.out;
                    // Zeros after a member are padding only once the tar
                    // it holds has ended (its end-of-archive blocks):
                    // after anything else they may be a zeroed tail.
                    let input = decoder.get_mut();
                    let at_end = if self.zeros_at_end >= TAR_END_BYTES {
                        skip_zeros(input)
                    } else {
                        input.fill_buf().map(|rest| rest.is_empty())
                    };
                    match at_end {
                        Ok(true) => self.ended = true,
                        Ok(false) => {
                            // What follows must start another member: else
                            // the stream has ended and other bytes follow.
                            let another = match decoder.get_mut().fill_buf() {
                                Ok(head) => head.starts_with(&GZIP_MAGIC[..head.len().min(2)]),
                                Err(e) => return Err(self.fail(e)),
                            };
                            if !another {
                                let error =
                                    io::Error::new(io::ErrorKind::InvalidData, TrailingData);
                                return Err(self.fail(error));
                            }
                            let input = self.decoder.take().expect("a member decoder");
                            let next = flate2::bufread::GzDecoder::new(input.into_inner());
                            self.decoder = Some(next);
                        }
                        Err(e) => return Err(self.fail(e)),
                    }
                }
                Ok(n) => {
                    self.out += n as u64;
                    // Counted up to TAR_END_BYTES: the last of them only.
                    let tail = &buf[n.saturating_sub(TAR_END_BYTES as usize)..n];
                    self.zeros_at_end = match tail.iter().rposition(|&b| b != 0) {
                        Some(last) => (tail.len() - 1 - last) as u64,
                        None => (self.zeros_at_end + n as u64).min(TAR_END_BYTES),
                    };
                    return Ok(n);
                }
                Err(e) => return Err(self.fail(e)),
            }
        }
    }
}

/// The first bytes of a gzip member.
const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

/// Bytes after a gzip stream's last member that do not start another one.
#[derive(Debug)]
struct TrailingData;

impl std::fmt::Display for TrailingData {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("bytes after the end of the gzip stream are not another gzip member")
    }
}

impl std::error::Error for TrailingData {}

/// The zero bytes a tar archive ends with, at least: its two end-of-archive
/// blocks.
const TAR_END_BYTES: u64 = 1024;

/// Consumes the zero bytes at the start of `input`, as `gzip` and Python's
/// `gzip` module do after a member (the zero padding tape blocking leaves
/// after a `.tar.gz`, which carries no data); `true` if `input` ends there,
/// `false` if another member's bytes follow.
fn skip_zeros(input: &mut impl BufRead) -> io::Result<bool> {
    loop {
        let rest = input.fill_buf()?;
        if rest.is_empty() {
            return Ok(true);
        }
        let zeros = rest.iter().take_while(|&&b| b == 0).count();
        let more = zeros < rest.len();
        input.consume(zeros);
        if more {
            return Ok(false);
        }
    }
}

/// Bytes of a zstd frame's start that say whether it has a content
/// checksum: the magic number and the frame header descriptor.
const ZSTD_FRAME_HEAD: usize = 5;

/// The frames of a zstd stream, decoded by one context whose frame ends are
/// watched, so that the end of each frame, where its content checksum (if
/// it has one) is checked, is known.
struct ZstdFrames<R> {
    input: BufReader<Counted<R>>,
    decoder: zstd::stream::raw::Decoder<'static>,
    /// Some of the current frame was fed to the decoder, not its end.
    in_frame: bool,
    /// A frame ended: the next one starts with a fresh session.
    ended_one: bool,
    /// The current frame's first bytes.
    head: [u8; ZSTD_FRAME_HEAD],
    head_len: usize,
    /// Decoded bytes handed out.
    out: u64,
    /// Decoded bytes of the frames that ended (checksum matched, if any).
    frames_end: u64,
    failed: Option<Sticky>,
}

impl<R: Read> ZstdFrames<R> {
    fn new(input: BufReader<Counted<R>>) -> io::Result<Self> {
        Ok(ZstdFrames {
            input,
            decoder: zstd::stream::raw::Decoder::new()?,
            in_frame: false,
            ended_one: false,
            head: [0; ZSTD_FRAME_HEAD],
            head_len: 0,
            out: 0,
            frames_end: 0,
            failed: None,
        })
    }

    /// Whether the current frame carries a content checksum: bit 2 of its
    /// frame header descriptor. Skippable frames (magic `0x184D2A5?`) have
    /// none (and decode to nothing). Unknown until its head was read.
    fn checksummed(&self) -> Option<bool> {
        if self.head_len < ZSTD_FRAME_HEAD {
            return None;
        }
        let magic = u32::from_le_bytes(self.head[..4].try_into().expect("4 bytes"));
        if magic & 0xFFFF_FFF0 == 0x184D_2A50 {
            return Some(false);
        }
        Some(self.head[4] & 0x04 != 0)
    }

    /// Decoded bytes that no check still to come covers: the ends of the
    /// frames that ended, or everything decoded inside a frame that has no
    /// checksum.
    fn settled(&self) -> u64 {
        if self.in_frame && self.checksummed() == Some(false) {
            self.out
        } else {
            self.frames_end
        }
    }

    fn fail(&mut self, error: io::Error) -> io::Error {
        if error.kind() != io::ErrorKind::Interrupted {
            self.failed = Some(Sticky::of(&error));
        }
        error
    }
}

/// Rounds of decoding that consumed and produced nothing before the
/// decoder is taken to be stuck.
const ZSTD_MAX_IDLE_ROUNDS: u32 = 64;

impl<R: Read> Read for ZstdFrames<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        use zstd::stream::raw::{InBuffer, Operation, OutBuffer};
        if let Some(failed) = &self.failed {
            return Err(failed.error());
        }
        if buf.is_empty() {
            return Ok(0);
        }
        let mut idle = 0;
        loop {
            let input = match self.input.fill_buf() {
                Ok(input) => input,
                Err(e) => return Err(self.fail(e)),
            };
            let at_end = input.is_empty();
            if at_end && !self.in_frame {
                return Ok(0);
            }
            if !at_end && !self.in_frame {
                if self.ended_one {
                    if let Err(e) = self.decoder.reinit() {
                        return Err(self.fail(e));
                    }
                }
                self.in_frame = true;
                self.head_len = 0;
            }
            // With no input left this flushes what the decoder holds.
            let mut src = InBuffer::around(input);
            let mut dst = OutBuffer::around(&mut *buf);
            let hint = self.decoder.run(&mut src, &mut dst);
            let (consumed, written) = (src.pos(), dst.pos());
            let take = (ZSTD_FRAME_HEAD - self.head_len).min(consumed);
            self.head[self.head_len..self.head_len + take].copy_from_slice(&input[..take]);
            self.head_len += take;
            self.input.consume(consumed);
            let hint = match hint {
                Ok(hint) => hint,
                Err(e) => return Err(self.fail(e)),
            };
            self.out += written as u64;
            if hint == 0 {
                // The frame is decoded and flushed; its checksum, if it
                // has one, matched.
                self.in_frame = false;
                self.ended_one = true;
                self.frames_end = self.out;
            }
            if written > 0 {
                return Ok(written);
            }
            if at_end && self.in_frame {
                let error = io::Error::new(io::ErrorKind::UnexpectedEof, "incomplete frame");
                return Err(self.fail(error));
            }
            idle = if consumed == 0 { idle + 1 } else { 0 };
            if idle > ZSTD_MAX_IDLE_ROUNDS {
                let error = io::Error::other("the decoder makes no progress");
                return Err(self.fail(error));
            }
        }
    }
}

/// A shard's tar bytes: the stream as read, or decoded from gzip or zstd.
/// A decoding error is kept as a [`Error::Decompress`] naming the shard and
/// both offsets, handed out by [`ByteSource::take_failure`].
pub struct TarStream<R> {
    decoder: Decoder<R>,
    url: String,
    /// Tar bytes handed out.
    produced: u64,
    failure: Option<Error>,
}

impl<R: ByteSource> TarStream<R> {
    /// Reads the first bytes of `source` (the start of shard `url`) and
    /// decodes the rest by what they say: gzip, zstd or a plain tar.
    pub fn open(mut source: R, url: &str) -> Result<Self> {
        let mut head = [0u8; MAGIC_LEN];
        let mut head_len = 0;
        while head_len < MAGIC_LEN {
            match source.read(&mut head[head_len..]) {
                Ok(0) => break,
                Ok(n) => head_len += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    return Err(source.take_failure().unwrap_or_else(|| Error::Read {
                        url: url.to_owned(),
                        offset: head_len as u64,
                        source: e,
                    }))
                }
            }
        }
        let counted = Counted::new(source, head, head_len);
        let decoder = match Compression::detect(&head[..head_len]) {
            None => Decoder::Plain(counted),
            Some(Compression::Gzip) => Decoder::Gzip(Box::new(GzipMembers::new(
                BufReader::with_capacity(INPUT_BUFFER, counted),
            ))),
            Some(Compression::Zstd) => {
                let buffered = BufReader::with_capacity(INPUT_BUFFER, counted);
                let frames = ZstdFrames::new(buffered).map_err(|e| Error::Decompress {
                    url: url.to_owned(),
                    compression: Compression::Zstd,
                    compressed_offset: 0,
                    tar_offset: 0,
                    reason: format!("cannot start the zstd decoder ({e})"),
                })?;
                Decoder::Zstd(Box::new(frames))
            }
        };
        Ok(TarStream {
            decoder,
            url: url.to_owned(),
            produced: 0,
            failure: None,
        })
    }

    /// `source` read as it is, with no detection: for a read that starts
    /// inside an uncompressed shard.
    pub fn plain(source: R, url: &str) -> Self {
        TarStream {
            decoder: Decoder::Plain(Counted::new(source, [0; MAGIC_LEN], 0)),
            url: url.to_owned(),
            produced: 0,
            failure: None,
        }
    }
}

impl<R: Read> TarStream<R> {
    /// The stream's compression; `None` for a plain tar.
    pub fn compression(&self) -> Option<Compression> {
        match self.decoder {
            Decoder::Plain(_) => None,
            Decoder::Gzip(_) => Some(Compression::Gzip),
            Decoder::Zstd(_) => Some(Compression::Zstd),
        }
    }

    /// The shard's bytes and those of them buffered but not yet decoded.
    fn source(&self) -> (&Counted<R>, usize) {
        match &self.decoder {
            Decoder::Plain(counted) => (counted, 0),
            Decoder::Gzip(members) => (members.input().get_ref(), members.input().buffer().len()),
            Decoder::Zstd(frames) => (frames.input.get_ref(), frames.input.buffer().len()),
        }
    }

    /// The error for a decoder's failure, naming both offsets.
    fn decode_error(&self, compression: Compression, error: &std::io::Error) -> Error {
        let (counted, buffered) = self.source();
        let what = if counted.hit_eof || error.kind() == std::io::ErrorKind::UnexpectedEof {
            "truncated"
        } else {
            "corrupt"
        };
        let reason = if error.get_ref().is_some_and(|e| e.is::<TrailingData>()) {
            error.to_string()
        } else {
            format!("{what} {compression} stream ({error})")
        };
        Error::Decompress {
            url: self.url.clone(),
            compression,
            compressed_offset: counted.count - buffered as u64,
            tar_offset: self.produced,
            reason,
        }
    }
}

impl<R: Read> Read for TarStream<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let result = match &mut self.decoder {
            Decoder::Plain(counted) => counted.read(buf),
            Decoder::Gzip(decoder) => decoder.read(buf),
            Decoder::Zstd(decoder) => decoder.read(buf),
        };
        match result {
            Ok(n) => {
                self.produced += n as u64;
                Ok(n)
            }
            Err(e) => {
                if let Some(compression) = self.compression() {
                    if !self.source().0.failed && self.failure.is_none() {
                        self.failure = Some(self.decode_error(compression, &e));
                    }
                }
                Err(e)
            }
        }
    }
}

impl<R: ByteSource> Counted<R> {
    /// Passes the hint on, past the peeked bytes still to hand out.
    fn prefetch(&self, ahead: usize, len: usize) {
        let held = self.head_len - self.head_pos;
        if let Some(ahead) = ahead.checked_sub(held) {
            self.inner.prefetch(ahead, len);
        }
    }

    /// Like `read`, passing over the bytes without copying them.
    fn skip(&mut self, max: usize) -> std::io::Result<usize> {
        if let Some(head) = self.take_head(max) {
            return Ok(head.len());
        }
        let result = self.inner.skip(max);
        self.count_inner(max, result)
    }

    /// Like `read`, appending to `out` without zeroing it first.
    fn read_append(&mut self, out: &mut Vec<u8>, max: usize) -> std::io::Result<usize> {
        if let Some(head) = self.take_head(max) {
            out.extend_from_slice(head);
            return Ok(head.len());
        }
        let result = self.inner.read_append(out, max);
        self.count_inner(max, result)
    }

    /// Shares the inner source's bytes once the peeked ones are handed out.
    fn read_shared(&mut self, len: usize) -> std::io::Result<Option<Bytes>> {
        if self.head_pos < self.head_len {
            return Ok(None);
        }
        match self.inner.read_shared(len) {
            Ok(Some(bytes)) => {
                self.count += bytes.len() as u64;
                Ok(Some(bytes))
            }
            Ok(None) => Ok(None),
            Err(e) => {
                self.failed = true;
                Err(e)
            }
        }
    }
}

impl<R: ByteSource> ByteSource for TarStream<R> {
    /// A plain stream skips without copying; a decoded one decodes the
    /// bytes it passes over.
    fn skip(&mut self, max: usize) -> std::io::Result<usize> {
        match &mut self.decoder {
            Decoder::Plain(counted) => {
                let n = counted.skip(max)?;
                self.produced += n as u64;
                Ok(n)
            }
            Decoder::Gzip(_) | Decoder::Zstd(_) => skip_by_reading(self, max),
        }
    }

    /// A plain stream appends the source's bytes directly; a decoded one
    /// decodes through a scratch buffer.
    fn read_append(&mut self, out: &mut Vec<u8>, max: usize) -> std::io::Result<usize> {
        match &mut self.decoder {
            Decoder::Plain(counted) => {
                let n = counted.read_append(out, max)?;
                self.produced += n as u64;
                Ok(n)
            }
            Decoder::Gzip(_) | Decoder::Zstd(_) => read_append_by_reading(self, out, max),
        }
    }

    /// A plain stream shares the source's bytes; decoded ones are new.
    fn read_shared(&mut self, len: usize) -> std::io::Result<Option<Bytes>> {
        match &mut self.decoder {
            Decoder::Plain(counted) => {
                let shared = counted.read_shared(len)?;
                if let Some(bytes) = &shared {
                    self.produced += bytes.len() as u64;
                }
                Ok(shared)
            }
            Decoder::Gzip(_) | Decoder::Zstd(_) => Ok(None),
        }
    }

    /// A plain stream passes the hint on; decoded bytes are not known ahead.
    fn prefetch(&self, ahead: usize, len: usize) {
        if let Decoder::Plain(counted) = &self.decoder {
            counted.prefetch(ahead, len);
        }
    }

    fn take_failure(&mut self) -> Option<Error> {
        let source = match &mut self.decoder {
            Decoder::Plain(counted) => counted.inner.take_failure(),
            Decoder::Gzip(members) => members.input_mut().get_mut().inner.take_failure(),
            Decoder::Zstd(frames) => frames.input.get_mut().inner.take_failure(),
        };
        source.or_else(|| self.failure.take())
    }

    /// Decodes what follows the archive's end, so that the stream's own
    /// check (gzip's CRC-32 and length, zstd's checksum when present) runs.
    fn check_trailer(&mut self) -> std::io::Result<()> {
        if self.compression().is_some() {
            std::io::copy(self, &mut std::io::sink())?;
        }
        Ok(())
    }

    /// A plain stream has no check: every byte is settled. A gzip stream
    /// has checked the members that ended; a zstd stream the frames that
    /// ended, and a frame without a checksum has nothing left to check.
    fn settled(&self) -> u64 {
        match &self.decoder {
            Decoder::Plain(_) => u64::MAX,
            Decoder::Gzip(members) => members.verified,
            Decoder::Zstd(frames) => frames.settled(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn gzip(data: &[u8]) -> Vec<u8> {
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        encoder.write_all(data).unwrap();
        encoder.finish().unwrap()
    }

    /// With a content checksum, as the `zstd` command line writes by default.
    fn zstd(data: &[u8]) -> Vec<u8> {
        let mut encoder = zstd::stream::Encoder::new(Vec::new(), 3).unwrap();
        encoder.include_checksum(true).unwrap();
        encoder.write_all(data).unwrap();
        encoder.finish().unwrap()
    }

    /// Bytes that are not compressible: a tar of random data would not
    /// shrink either.
    fn noise(len: usize) -> Vec<u8> {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        (0..len)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state as u8
            })
            .collect()
    }

    fn decode(bytes: &[u8]) -> (Option<Compression>, Result<Vec<u8>>) {
        let mut stream = TarStream::open(bytes, "mem://s.tar.x").unwrap();
        let compression = stream.compression();
        let mut out = Vec::new();
        let result = match stream.read_to_end(&mut out) {
            Ok(_) => Ok(out),
            Err(e) => Err(stream
                .take_failure()
                .unwrap_or_else(|| panic!("no failure kept: {e}"))),
        };
        (compression, result)
    }

    #[test]
    fn detects_by_magic_bytes() {
        assert_eq!(
            Compression::detect(&[0x1f, 0x8b, 8, 0]),
            Some(Compression::Gzip)
        );
        assert_eq!(
            Compression::detect(&[0x28, 0xb5, 0x2f, 0xfd]),
            Some(Compression::Zstd)
        );
        assert_eq!(Compression::detect(&[0x28, 0xb5, 0x2f]), None);
        assert_eq!(Compression::detect(&[0x1f]), None);
        assert_eq!(Compression::detect(b"a.txt\0\0\0"), None);
        assert_eq!(Compression::detect(b""), None);
    }

    #[test]
    fn decodes_gzip_zstd_and_plain() {
        let data = noise(300_000);
        for (bytes, expected) in [
            (gzip(&data), Some(Compression::Gzip)),
            (zstd(&data), Some(Compression::Zstd)),
            (data.clone(), None),
        ] {
            let (compression, out) = decode(&bytes);
            assert_eq!(compression, expected);
            assert!(out.unwrap() == data, "{expected:?}");
        }
        let (compression, out) = decode(b"ab");
        assert_eq!((compression, out.unwrap()), (None, b"ab".to_vec()));
    }

    /// `pzstd` starts every file with a skippable frame (its frame sizes):
    /// such a stream was read as plain bytes, not a tar.
    #[test]
    fn a_zstd_stream_starting_with_a_skippable_frame_decodes() {
        let data = noise(20_000);
        for magic in [0x184d_2a50u32, 0x184d_2a5f] {
            let mut bytes = magic.to_le_bytes().to_vec();
            bytes.extend(4u32.to_le_bytes());
            bytes.extend(b"meta");
            bytes.extend(zstd(&data));
            let (compression, out) = decode(&bytes);
            assert_eq!(compression, Some(Compression::Zstd));
            assert!(out.unwrap() == data);
        }
        assert_eq!(Compression::detect(&[0x60, 0x2a, 0x4d, 0x18]), None);
    }

    #[test]
    fn concatenated_members_and_frames_decode_whole() {
        let (a, b) = (noise(1000), vec![7u8; 5000]);
        let whole: Vec<u8> = [a.clone(), b.clone()].concat();
        let gz = [gzip(&a), gzip(&b)].concat();
        assert!(decode(&gz).1.unwrap() == whole);
        let zst = [zstd(&a), zstd(&b)].concat();
        assert!(decode(&zst).1.unwrap() == whole);
    }

    #[test]
    fn zero_padding_after_gzip_members_is_skipped_and_garbage_is_not() {
        // Each ends as a tar does, with its end-of-archive blocks.
        let ended = |mut bytes: Vec<u8>| {
            bytes.extend([0; TAR_END_BYTES as usize]);
            bytes
        };
        let (a, b) = (ended(noise(1000)), ended(vec![7u8; 5000]));
        let whole: Vec<u8> = [a.clone(), b.clone()].concat();
        // After the last member (a tape block's padding), between members,
        // and more zeros than one buffer holds.
        for zeros in [1, 512, 10_240, 200_000] {
            let padded = [gzip(&a), vec![0; zeros]].concat();
            assert!(decode(&padded).1.unwrap() == a, "{zeros}");
            let between = [gzip(&a), vec![0; zeros], gzip(&b), vec![0; zeros]].concat();
            assert!(decode(&between).1.unwrap() == whole, "{zeros}");
        }
        // The compressed offset an error names lies within 10 bytes of `at`.
        let fails_near = |bytes: &[u8], at: u64| match decode(bytes).1.unwrap_err() {
            Error::Decompress {
                compressed_offset, ..
            } => assert!(
                (at..=at + 10).contains(&compressed_offset),
                "{compressed_offset}, expected near {at}"
            ),
            other => panic!("{other:?}"),
        };
        // Zeros then something that is not a member: where the zeros end.
        let garbage = [gzip(&a), vec![0; 512], b"not gzip".to_vec()].concat();
        fails_near(&garbage, gzip(&a).len() as u64 + 512);
        // Zeros after data that does not end as a tar does (a member cut
        // where a tar header starts, the file's tail zeroed): an error
        // where the zeros start, not a shorter stream.
        let cut = gzip(&noise(1000));
        fails_near(&[cut.clone(), vec![0; 512]].concat(), cut.len() as u64);
        // zstd gives no such leave: zeros after a frame are an error.
        let zst = [zstd(&a), vec![0; 512]].concat();
        assert!(decode(&zst).1.is_err());
        // Not "truncated": the stream is whole, other bytes follow it.
        for bytes in [
            garbage,
            [cut, vec![0; 512]].concat(),
            [gzip(&a), b"x".to_vec()].concat(),
        ] {
            let Err(Error::Decompress { reason, .. }) = decode(&bytes).1 else {
                panic!("not a decompression error")
            };
            assert_eq!(
                reason,
                "bytes after the end of the gzip stream are not another gzip member"
            );
        }
    }

    #[test]
    fn truncated_streams_name_both_offsets() {
        let data = noise(400_000);
        for bytes in [gzip(&data), zstd(&data)] {
            let cut = &bytes[..bytes.len() / 2];
            match decode(cut).1.unwrap_err() {
                Error::Decompress {
                    url,
                    compressed_offset,
                    tar_offset,
                    reason,
                    ..
                } => {
                    assert_eq!(url, "mem://s.tar.x");
                    assert!(reason.starts_with("truncated"), "{reason}");
                    assert!(compressed_offset <= cut.len() as u64, "{compressed_offset}");
                    assert!(
                        tar_offset > 0 && tar_offset < data.len() as u64,
                        "{tar_offset}"
                    );
                }
                other => panic!("{other}"),
            }
        }
    }

    #[test]
    fn corrupt_streams_are_errors_not_panics() {
        let data = noise(200_000);
        for bytes in [gzip(&data), zstd(&data)] {
            for at in [12, bytes.len() / 3, bytes.len() - 6] {
                let mut bad = bytes.clone();
                for b in &mut bad[at..at + 4] {
                    *b ^= 0x5a;
                }
                let (_, out) = decode(&bad);
                match out {
                    Err(Error::Decompress { reason, .. }) => {
                        assert!(reason.starts_with("corrupt"), "{reason}")
                    }
                    Ok(_) => panic!("corruption at {at} went unnoticed"),
                    Err(other) => panic!("{other}"),
                }
            }
        }
    }

    #[test]
    fn gzip_checksum_is_checked() {
        let data = vec![b'x'; 10_000];
        let mut bytes = gzip(&data);
        let crc_at = bytes.len() - 8;
        bytes[crc_at] ^= 1;
        let err = decode(&bytes).1.unwrap_err().to_string();
        assert!(err.contains("corrupt gzip stream"), "{err}");
        assert!(err.contains("compressed byte offset"), "{err}");
        assert!(
            err.contains("byte offset 10000 of the decompressed stream"),
            "{err}"
        );
    }

    /// What `settled` said after each read of at most `step` bytes: the
    /// bytes handed out so far and the settled offset.
    fn settled_steps(bytes: &[u8], step: usize) -> Vec<(u64, u64)> {
        let mut stream = TarStream::open(bytes, "mem://s.tar.x").unwrap();
        let (mut out, mut steps) = (0u64, Vec::new());
        let mut buf = vec![0u8; step];
        loop {
            let n = stream.read(&mut buf).unwrap();
            if n == 0 {
                return steps;
            }
            out += n as u64;
            steps.push((out, stream.settled()));
        }
    }

    #[test]
    fn settled_follows_the_ends_of_members_and_checksummed_frames() {
        let (a, b) = (noise(3000), noise(5000));
        let zstd_unchecked = |data: &[u8]| zstd::encode_all(data, 3).unwrap();
        for (bytes, ends) in [
            ([gzip(&a), gzip(&b)].concat(), Some([3000, 8000])),
            ([zstd(&a), zstd(&b)].concat(), Some([3000, 8000])),
            ([zstd_unchecked(&a), zstd_unchecked(&b)].concat(), None),
        ] {
            let steps = settled_steps(&bytes, 1000);
            assert_eq!(steps.last().unwrap().0, 8000);
            for &(out, settled) in &steps {
                match ends {
                    // Only what a passed check covers, never more.
                    // Only the end of a checked member or frame, and once
                    // past the first, at least that one.
                    Some(ends) => {
                        assert!(settled == 0 || ends.contains(&settled), "{out}: {settled}");
                        assert!(settled <= out, "{out}: {settled}");
                        assert!(out <= 3000 || settled >= 3000, "{out}: {settled}");
                    }
                    // Without a checksum, everything decoded.
                    None => assert_eq!(settled, out),
                }
            }
            let mut stream = TarStream::open(&bytes[..], "mem://s.tar.x").unwrap();
            std::io::copy(&mut stream, &mut std::io::sink()).unwrap();
            assert_eq!(stream.settled(), 8000);
        }
        let plain = TarStream::open(&b"abc"[..], "mem://s.tar").unwrap();
        assert_eq!(plain.settled(), u64::MAX);
    }

    #[test]
    fn skippable_zstd_frames_are_passed_over() {
        let (a, b) = (noise(3000), noise(5000));
        let mut skippable = vec![0x5a, 0x2a, 0x4d, 0x18, 6, 0, 0, 0];
        skippable.extend_from_slice(b"ignore");
        let bytes = [zstd(&a), skippable, zstd(&b)].concat();
        assert!(decode(&bytes).1.unwrap() == [a, b].concat());
    }

    #[test]
    fn a_failed_decoder_keeps_failing() {
        let data = noise(100_000);
        for bytes in [gzip(&data), zstd(&data)] {
            let cut = &bytes[..bytes.len() / 2];
            let mut stream = TarStream::open(cut, "mem://s.tar.x").unwrap();
            assert!(std::io::copy(&mut stream, &mut std::io::sink()).is_err());
            let mut buf = [0u8; 10];
            assert!(
                stream.read(&mut buf).is_err(),
                "no clean end after a failure"
            );
        }
    }

    #[test]
    fn source_failures_win_over_decoder_errors() {
        struct Failing(Vec<u8>, usize, bool);
        impl Read for Failing {
            fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
                if self.1 >= self.0.len() / 2 {
                    self.2 = true;
                    return Err(std::io::Error::other("gone"));
                }
                let n = buf.len().min(1000).min(self.0.len() - self.1);
                buf[..n].copy_from_slice(&self.0[self.1..self.1 + n]);
                self.1 += n;
                Ok(n)
            }
        }
        impl ByteSource for Failing {
            fn take_failure(&mut self) -> Option<Error> {
                self.2.then(|| Error::Stopped("source failed".into()))
            }
        }
        let bytes = gzip(&noise(100_000));
        let mut stream = TarStream::open(Failing(bytes, 0, false), "u").unwrap();
        assert!(std::io::copy(&mut stream, &mut std::io::sink()).is_err());
        assert!(matches!(stream.take_failure(), Some(Error::Stopped(_))));
    }
}
