//! The member reader under the tar format: reads one member header at a
//! time from a byte stream, in the forms WebDataset writers produce (ustar
//! with its name prefix, GNU with `L` long names, POSIX pax with `path` and
//! `size` records; octal or base-256 numbers), and leaves the member's data
//! for the caller to read. Its padding and anything the caller did not read
//! are skipped before the next header. A malformed pax record and a GNU
//! sparse member (whose bytes are not the file's) are errors.
//!
//! It keeps the stream position itself, so offsets in errors are exact, and
//! allocates nothing per member but what the caller keeps.

use std::io::{self, Read};

use bytes::Bytes;

use crate::format::{reserve_room, ByteSource};

/// Size of a tar block: headers are one block, data is padded to blocks.
const BLOCK: u64 = 512;

/// Longest GNU long name or pax header read (larger ones are refused, so a
/// damaged size field cannot make the reader buffer gigabytes).
const MAX_EXTENSION_BYTES: u64 = 1 << 20;

/// Bytes reserved at once for a member's data when they cannot be shared
/// with the source: all of them up to this, then more as they arrive, so a
/// damaged size field claiming more than the input holds reserves this much
/// at most.
const FIRST_RESERVE: u64 = 64 << 20;

/// Members up to this size get their buffer in one allocation, like any
/// other small value (an allocation this small failing ends the process
/// anyway); larger ones grow fallibly.
const SMALL_MEMBER: u64 = 1 << 20;

/// Bytes read at a time while checking what follows the end-of-archive
/// marker.
const TRAILER_CHUNK: usize = 16 << 10;

/// One member, after the extension headers that describe it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Member {
    /// Whether the member is a regular file (type flag `0`, NUL or `7`, a
    /// contiguous file: Python's `tarfile`, and so webdataset, reads all
    /// three as files).
    pub is_file: bool,
    /// Bytes of data that follow the header (a pax `size` record wins).
    pub size: u64,
    /// Where the member's own header starts.
    pub header_position: u64,
    /// Where its data starts.
    pub data_position: u64,
    /// Where its padded data ends, and the next header starts.
    pub end: u64,
}

/// Which header layout a block uses, by its magic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Layout {
    Ustar,
    Gnu,
    /// Pre-POSIX: a name only; no extension headers are recognised.
    Old,
}

/// Reads members from `R` and counts the bytes consumed.
pub struct Members<R> {
    inner: R,
    /// Bytes consumed so far.
    position: u64,
    /// Whether a read returned no bytes (the stream ended).
    hit_eof: bool,
    /// Where the next header starts.
    next_header: u64,
    /// Where the header being read (or last read) starts.
    header_start: u64,
    /// Where the zero block that ended the archive starts, once read.
    end_marker: Option<u64>,
    /// Pending GNU long name, pax records: they describe the next member.
    long_name: Option<Vec<u8>>,
    long_link: bool,
    pax: Option<Vec<u8>>,
}

impl<R: ByteSource> Members<R> {
    /// A reader at the start of an archive.
    pub fn new(inner: R) -> Self {
        Members {
            inner,
            position: 0,
            hit_eof: false,
            next_header: 0,
            header_start: 0,
            end_marker: None,
            long_name: None,
            long_link: false,
            pax: None,
        }
    }

    /// Bytes consumed so far.
    pub fn position(&self) -> u64 {
        self.position
    }

    /// Whether the stream ended while reading.
    pub fn hit_eof(&self) -> bool {
        self.hit_eof
    }

    /// Where the zero block that ended the archive starts, when a zero
    /// block (not the end of the stream) ended it.
    pub fn end_marker(&self) -> Option<u64> {
        self.end_marker
    }

    /// The stream the members are read from.
    pub fn inner(&self) -> &R {
        &self.inner
    }

    /// Where the header block being read, or the last one read, starts:
    /// for an error about a header, the offset of that header.
    pub fn header_start(&self) -> u64 {
        self.header_start
    }

    /// The next member, with its path written into `path`, or `None` at the
    /// end of the archive (end of stream or a zero block at a header; after
    /// a zero block, [`Members::data_after_end`] tells whether the rest is
    /// padding).
    pub fn next_member(&mut self, path: &mut Vec<u8>) -> io::Result<Option<Member>> {
        let mut header = [0u8; BLOCK as usize];
        loop {
            self.skip(self.next_header - self.position)?;
            let header_position = self.position;
            self.header_start = header_position;
            let read = self.read_block(&mut header)?;
            let byte_sum = if read { byte_sum(&header) } else { 0 };
            // No bytes, or a block of zeros (its bytes sum to 0): the end.
            if byte_sum == 0 {
                if self.long_name.is_some() || self.long_link || self.pax.is_some() {
                    return Err(io::Error::other(
                        "members found describing a future member but no future member found",
                    ));
                }
                if read {
                    self.end_marker = Some(header_position);
                }
                return Ok(None);
            }
            check_checksum(&header, byte_sum)?;
            let layout = match (&header[257..263], &header[263..265]) {
                (b"ustar\0", b"00") => Layout::Ustar,
                (b"ustar ", b" \0") => Layout::Gnu,
                _ => Layout::Old,
            };
            let type_flag = header[156];
            let is_extension = matches!(type_flag, b'L' | b'K' | b'x' | b'X' | b'g');
            let mut size = number(&header[124..136], "size")?;
            if !is_extension {
                if let Some(pax_size) = self.pax.as_deref().and_then(|p| pax_value(p, b"size")) {
                    size = std::str::from_utf8(pax_size)
                        .ok()
                        .and_then(|s| s.parse().ok())
                        .ok_or_else(|| {
                            io::Error::other(format!(
                                "pax size record {:?} is not a number",
                                String::from_utf8_lossy(pax_size)
                            ))
                        })?;
                }
            }
            let data_start = header_position + BLOCK;
            self.next_header = padded_end(data_start, size)?;
            if let Ok(ahead) = usize::try_from(self.next_header - self.position) {
                self.inner.prefetch(ahead, BLOCK as usize);
            }
            // Told by the type flag alone, whatever the magic, as `tarfile`
            // tells them (Solaris writes `X` for a pax header).
            match type_flag {
                b'L' => {
                    let name = self.read_extension(size, self.long_name.is_some())?;
                    self.long_name = Some(name);
                    continue;
                }
                b'K' => {
                    self.read_extension(size, self.long_link)?;
                    self.long_link = true;
                    continue;
                }
                b'x' | b'X' => {
                    let mut records = self.read_extension(size, self.pax.is_some())?;
                    records.truncate(check_pax_records(&records)?);
                    self.pax = Some(records);
                    continue;
                }
                _ => {}
            }
            let sparse_pax = self
                .pax
                .as_deref()
                .is_some_and(|p| pax_keys(p).any(|key| key.starts_with(b"GNU.sparse.")));
            if type_flag == b'S' || sparse_pax {
                // Its bytes are a sparse map and the data runs it places:
                // read as they are, they are not the file's.
                return Err(io::Error::other(
                    "a GNU sparse member, which shardstream does not read: write the shard \
                     without sparse files (GNU tar without --sparse, bsdtar with \
                     --no-read-sparse)",
                ));
            }
            path.clear();
            let (long_name, pax) = (self.long_name.take(), self.pax.take());
            if let Some(name) = &long_name {
                // A GNU long name ends at its first NUL, as tarfile reads it.
                let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
                path.extend_from_slice(&name[..end]);
            } else if let Some(pax_path) = pax.as_deref().and_then(|p| pax_value(p, b"path")) {
                path.extend_from_slice(pax_path);
            } else {
                header_path(&header, layout, path);
            }
            self.long_link = false;
            return Ok(Some(Member {
                is_file: matches!(type_flag, b'0' | 0 | b'7'),
                size,
                header_position,
                data_position: data_start,
                end: self.next_header,
            }));
        }
    }

    /// Reads the current member's `size` data bytes: shared with the source
    /// when it can share them, else copied into a new buffer. When the
    /// stream fails or ends first, the bytes hold what was read.
    pub fn read_data(&mut self, size: u64) -> (Bytes, io::Result<()>) {
        if let Ok(len) = usize::try_from(size) {
            match self.inner.read_shared(len) {
                Ok(Some(shared)) => {
                    self.position += size;
                    return (shared, Ok(()));
                }
                Ok(None) => {}
                Err(e) => return (Bytes::new(), Err(e)),
            }
        }
        // Small members are allocated as every other small value is; the
        // rest grows fallibly in `read_data_into`.
        let mut data = match usize::try_from(size) {
            Ok(len) if size <= SMALL_MEMBER => Vec::with_capacity(len),
            _ => Vec::new(),
        };
        let read = self.read_data_into(&mut data, size);
        (data.into(), read)
    }

    /// Appends the current member's `size` data bytes to `data`, which
    /// grows fallibly: memory it cannot get is an error of kind
    /// `OutOfMemory`, not an abort.
    fn read_data_into(&mut self, data: &mut Vec<u8>, size: u64) -> io::Result<()> {
        let start = data.len() as u64;
        loop {
            let left = size - (data.len() as u64 - start);
            if left == 0 {
                return Ok(());
            }
            let max = reserve_room(data, left, FIRST_RESERVE)?;
            match self.inner.read_append(data, max) {
                Ok(0) => {
                    self.hit_eof = true;
                    return Ok(());
                }
                Ok(n) => self.position += n as u64,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// After [`Members::next_member`] found a zero block where a header
    /// should be: reads the rest of the stream and returns the offset of its
    /// first byte that is not zero, if any (the zero block was then a
    /// damaged header, or data follows the archive). Reading stops there.
    pub fn data_after_end(&mut self) -> io::Result<Option<u64>> {
        let mut chunk = [0u8; TRAILER_CHUNK];
        loop {
            let n = match self.read(&mut chunk) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            if n == 0 {
                return Ok(None);
            }
            if let Some(at) = chunk[..n].iter().position(|&b| b != 0) {
                return Ok(Some(self.position - n as u64 + at as u64));
            }
        }
    }

    /// Reads one block; `false` when the stream ended before its first byte.
    fn read_block(&mut self, block: &mut [u8; BLOCK as usize]) -> io::Result<bool> {
        let mut filled = 0;
        while filled < block.len() {
            match self.read(&mut block[filled..]) {
                Ok(0) if filled == 0 => return Ok(false),
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "failed to read an entire block",
                    ))
                }
                Ok(n) => filled += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(true)
    }

    /// Reads a GNU long name or pax header's data.
    fn read_extension(&mut self, size: u64, duplicate: bool) -> io::Result<Vec<u8>> {
        if duplicate {
            return Err(io::Error::other(
                "two extension headers of one kind describe the same member",
            ));
        }
        if size > MAX_EXTENSION_BYTES {
            return Err(io::Error::other(format!(
                "extension header of {size} bytes (at most {MAX_EXTENSION_BYTES})"
            )));
        }
        let mut data = Vec::with_capacity(size as usize);
        self.read_data_into(&mut data, size)?;
        if (data.len() as u64) < size {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "extension header data ends early",
            ));
        }
        Ok(data)
    }

    /// Passes over `count` bytes (the source copies them only if it must).
    fn skip(&mut self, mut count: u64) -> io::Result<()> {
        while count > 0 {
            let max = usize::try_from(count).unwrap_or(usize::MAX);
            match self.inner.skip(max) {
                Ok(0) => {
                    self.hit_eof = true;
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "unexpected EOF during skip",
                    ));
                }
                Ok(n) => {
                    self.position += n as u64;
                    count -= n as u64;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

impl<R: Read> Read for Members<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.position += n as u64;
        self.hit_eof |= n == 0 && !buf.is_empty();
        Ok(n)
    }
}

/// Where data of `size` bytes starting at `start` ends, padded to a block.
fn padded_end(start: u64, size: u64) -> io::Result<u64> {
    size.checked_next_multiple_of(BLOCK)
        .and_then(|padded| start.checked_add(padded))
        .ok_or_else(|| io::Error::other("size overflow"))
}

/// The sum of a block's bytes, eight at a time: each word's bytes are
/// added in 16-bit lanes (64 words of at most 2 x 255 per lane stay below
/// 65536), then the four lanes are added.
fn byte_sum(block: &[u8; BLOCK as usize]) -> u32 {
    const LOW_BYTES: u64 = 0x00ff_00ff_00ff_00ff;
    let lanes = block
        .chunks_exact(8)
        .map(|word| u64::from_le_bytes(word.try_into().expect("8 bytes")))
        .fold(0u64, |lanes, word| {
            lanes + (word & LOW_BYTES) + ((word >> 8) & LOW_BYTES)
        });
    let sum =
        (lanes & 0xffff) + ((lanes >> 16) & 0xffff) + ((lanes >> 32) & 0xffff) + (lanes >> 48);
    u32::try_from(sum).expect("at most 512 x 255")
}

/// Checks a header's checksum: the sum of its bytes (`byte_sum`), the
/// checksum field counted as spaces.
fn check_checksum(header: &[u8; BLOCK as usize], byte_sum: u32) -> io::Result<()> {
    let field = &header[148..156];
    let field_sum: u32 = field.iter().map(|&b| u32::from(b)).sum();
    let sum = byte_sum - field_sum + 8 * u32::from(b' ');
    if number(field, "checksum")? != u64::from(sum) {
        return Err(io::Error::other("archive header checksum mismatch"));
    }
    Ok(())
}

/// A numeric header field: octal text (NUL- or space-terminated; empty is
/// 0, as Python's `tarfile` reads it), or base-256 when its first byte has
/// the high bit set (GNU: `0x80` then a big-endian number in the rest of
/// the field, the first byte's low 7 bits included; `0xff` a negative one).
/// A value that does not fit in 64 bits, or a negative one, is an error,
/// never the value modulo 2^64.
fn number(field: &[u8], name: &str) -> io::Result<u64> {
    if field[0] & 0x80 != 0 {
        if field[0] == 0xff {
            return Err(io::Error::other(format!(
                "numeric field {name} is a negative base-256 number"
            )));
        }
        let mut value = u64::from(field[0] & 0x7f);
        for &byte in &field[1..] {
            if value >> 56 != 0 {
                return Err(io::Error::other(format!(
                    "numeric field {name} is a base-256 number of 2^64 or more"
                )));
            }
            value = (value << 8) | u64::from(byte);
        }
        return Ok(value);
    }
    let text = until_nul(field);
    // The field's bytes are not quoted: in a file that is not a tar
    // archive they are the file's own content.
    let not_a_number = || {
        io::Error::other(format!(
            "numeric field {name} was not a number (octal digits)"
        ))
    };
    let mut value: u64 = 0;
    for &digit in text.trim_ascii() {
        if !(b'0'..=b'7').contains(&digit) {
            return Err(not_a_number());
        }
        value = value
            .checked_mul(8)
            .map(|v| v | u64::from(digit - b'0'))
            .ok_or_else(not_a_number)?;
    }
    Ok(value)
}

/// A header's own path: the ustar prefix joined to the name, or the name.
fn header_path(header: &[u8; BLOCK as usize], layout: Layout, path: &mut Vec<u8>) {
    if layout == Layout::Ustar {
        let prefix = until_nul(&header[345..500]);
        if !prefix.is_empty() {
            path.extend_from_slice(prefix);
            path.push(b'/');
        }
    }
    path.extend_from_slice(until_nul(&header[..100]));
}

fn until_nul(field: &[u8]) -> &[u8] {
    field
        .iter()
        .position(|&b| b == 0)
        .map_or(field, |end| &field[..end])
}

/// Checks a pax header's records (`"<length> key=value\n"` each) and gives
/// the length they take: NUL bytes may follow the last one (Python's
/// `tarfile` stops there too); anything else malformed is an error, not a
/// header read as if it had no records.
fn check_pax_records(records: &[u8]) -> io::Result<usize> {
    let mut at = 0;
    while at < records.len() {
        let rest = &records[at..];
        if rest.iter().all(|&b| b == 0) {
            break;
        }
        let record = pax_record(rest).ok_or_else(|| {
            io::Error::other(format!("pax header: the record at byte {at} is malformed"))
        })?;
        at += record;
    }
    Ok(at)
}

/// The length of the pax record `records` starts with, if it is well formed.
fn pax_record(records: &[u8]) -> Option<usize> {
    let space = records.iter().position(|&b| b == b' ')?;
    let length: usize = std::str::from_utf8(&records[..space]).ok()?.parse().ok()?;
    if length <= space + 1 || length > records.len() || records[length - 1] != b'\n' {
        return None;
    }
    records[space + 1..length - 1]
        .contains(&b'=')
        .then_some(length)
}

/// The `(key, value)` of each of `records` (checked by [`check_pax_records`]).
fn pax_pairs(mut records: &[u8]) -> impl Iterator<Item = (&[u8], &[u8])> {
    std::iter::from_fn(move || {
        let length = pax_record(records)?;
        let space = records.iter().position(|&b| b == b' ')?;
        let record = &records[space + 1..length - 1];
        records = &records[length..];
        let equals = record.iter().position(|&b| b == b'=')?;
        Some((&record[..equals], &record[equals + 1..]))
    })
}

/// The keys of `records`.
fn pax_keys(records: &[u8]) -> impl Iterator<Item = &[u8]> {
    pax_pairs(records).map(|(key, _)| key)
}

/// The value of the pax record `key` in `records` (checked by
/// [`check_pax_records`]; the last one when several name `key`, as tarfile
/// reads them), or `None` when it is absent.
fn pax_value<'a>(records: &'a [u8], key: &[u8]) -> Option<&'a [u8]> {
    pax_pairs(records)
        .filter(|(k, _)| *k == key)
        .map(|(_, value)| value)
        .last()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// What a reader saw of one member: path, regular file, size, data,
    /// header and data positions.
    type Seen = (Vec<u8>, bool, u64, Vec<u8>, u64, u64);

    fn read_all(bytes: &[u8]) -> io::Result<Vec<Seen>> {
        let mut members = Members::new(bytes);
        let mut path = Vec::new();
        let mut seen = Vec::new();
        while let Some(m) = members.next_member(&mut path)? {
            let (data, read) = members.read_data(m.size);
            read?;
            seen.push((
                path.clone(),
                m.is_file,
                m.size,
                data.to_vec(),
                m.header_position,
                m.data_position,
            ));
        }
        Ok(seen)
    }

    /// The same, as the `tar` crate reads it.
    fn read_with_tar_crate(bytes: &[u8]) -> Vec<Seen> {
        let mut archive = ::tar::Archive::new(bytes);
        let mut seen = Vec::new();
        for entry in archive.entries().unwrap() {
            let mut entry = entry.unwrap();
            let mut data = Vec::new();
            let path = entry.path_bytes().into_owned();
            let kind = entry.header().entry_type();
            let is_file = matches!(
                kind,
                ::tar::EntryType::Regular | ::tar::EntryType::Continuous
            );
            let size = entry.size();
            let positions = (entry.raw_header_position(), entry.raw_file_position());
            entry.read_to_end(&mut data).unwrap();
            seen.push((path, is_file, size, data, positions.0, positions.1));
        }
        seen
    }

    #[derive(Debug, Clone)]
    enum Kind {
        File(Vec<u8>),
        Directory,
        Symlink(String),
    }

    #[derive(Debug, Clone)]
    struct Entry {
        name: String,
        kind: Kind,
        /// 0: GNU, 1: ustar, 2: pre-POSIX header.
        layout: u8,
        /// A pax `path` record before the entry.
        pax_path: Option<String>,
    }

    fn entry() -> impl Strategy<Value = Entry> {
        let name = "[a-z]{1,8}(/[a-zA-Z0-9_]{1,40}){0,6}\\.[a-z]{1,5}";
        let kind = prop_oneof![
            4 => prop::collection::vec(any::<u8>(), 0..1500).prop_map(Kind::File),
            1 => Just(Kind::Directory),
            1 => "[a-z/]{1,150}".prop_map(Kind::Symlink),
        ];
        (
            name,
            kind,
            0u8..3,
            prop::option::weighted(0.2, "[a-z]{1,200}\\.x"),
        )
            .prop_map(|(name, kind, layout, pax_path)| Entry {
                name,
                kind,
                layout,
                pax_path,
            })
    }

    fn build(entries: &[Entry]) -> Vec<u8> {
        let mut builder = ::tar::Builder::new(Vec::new());
        for e in entries {
            if let Some(path) = &e.pax_path {
                builder
                    .append_pax_extensions([("path", path.as_bytes())])
                    .unwrap();
            }
            let mut header = match e.layout {
                0 => ::tar::Header::new_gnu(),
                1 => ::tar::Header::new_ustar(),
                _ => ::tar::Header::new_old(),
            };
            header.set_mode(0o644);
            let data: &[u8] = match &e.kind {
                Kind::File(data) => {
                    header.set_entry_type(::tar::EntryType::Regular);
                    data
                }
                Kind::Directory => {
                    header.set_entry_type(::tar::EntryType::Directory);
                    &[]
                }
                Kind::Symlink(target) => {
                    header.set_entry_type(::tar::EntryType::Symlink);
                    header.set_size(0);
                    builder.append_link(&mut header, &e.name, target).unwrap();
                    continue;
                }
            };
            header.set_size(data.len() as u64);
            builder.append_data(&mut header, &e.name, data).unwrap();
        }
        builder.into_inner().unwrap()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        #[test]
        fn byte_sum_adds_every_byte(bytes in prop::collection::vec(any::<u8>(), 512), fill in any::<bool>()) {
            let block: [u8; 512] = if fill { [0xff; 512] } else { bytes.try_into().unwrap() };
            prop_assert_eq!(byte_sum(&block), block.iter().map(|&b| u32::from(b)).sum::<u32>());
        }

        #[test]
        fn reads_what_the_tar_crate_writes_as_the_tar_crate_reads_it(
            entries in prop::collection::vec(entry(), 0..12),
        ) {
            let bytes = build(&entries);
            prop_assert_eq!(read_all(&bytes).unwrap(), read_with_tar_crate(&bytes));
        }

        #[test]
        fn a_cut_archive_gives_a_prefix_of_its_members_or_an_error(
            entries in prop::collection::vec(entry(), 1..6),
            cut in any::<prop::sample::Index>(),
        ) {
            let bytes = build(&entries);
            let full = read_all(&bytes).unwrap();
            let cut = cut.index(bytes.len());
            if let Ok(seen) = read_all(&bytes[..cut]) {
                prop_assert!(seen.len() <= full.len());
                prop_assert_eq!(&seen[..], &full[..seen.len()]);
            }
        }
    }

    fn header_block(name: &str, type_flag: u8, size_field: &[u8; 12]) -> [u8; 512] {
        let mut header = ::tar::Header::new_gnu();
        header.set_path(name).unwrap();
        header.set_mode(0o644);
        let bytes = header.as_mut_bytes();
        bytes[156] = type_flag;
        bytes[124..136].copy_from_slice(size_field);
        header.set_cksum();
        *header.as_bytes()
    }

    #[test]
    fn numeric_fields() {
        assert_eq!(number(b"0000644 \0", "mode").unwrap(), 0o644);
        assert_eq!(number(b"  17\0\0\0\0", "size").unwrap(), 0o17);
        assert_eq!(number(b"\0\0\0\0", "size").unwrap(), 0);
        assert_eq!(number(&[0x80, 0, 0, 0, 0, 0, 1, 2], "uid").unwrap(), 0x102);
        assert!(number(b"0009\0", "size").is_err());
        assert!(number(b"1 2\0", "size").is_err());
        assert!(number("7".repeat(23).as_bytes(), "size").is_err());
    }

    #[test]
    fn base_256_sizes() {
        let mut size = [0u8; 12];
        size[0] = 0x80;
        size[11] = 5;
        let mut bytes = header_block("a.txt", b'0', &size).to_vec();
        bytes.extend_from_slice(b"hello");
        bytes.resize(2048, 0);
        let seen = read_all(&bytes).unwrap();
        assert_eq!(seen.len(), 1);
        assert_eq!((seen[0].2, &seen[0].3[..]), (5, &b"hello"[..]));
    }

    #[test]
    fn a_pax_size_record_overrides_the_header() {
        let mut builder = ::tar::Builder::new(Vec::new());
        builder
            .append_pax_extensions([("size", &b"3"[..])])
            .unwrap();
        let mut header = ::tar::Header::new_ustar();
        header.set_size(0);
        // The header says 0 bytes; the pax record says 3, and they follow.
        builder.append_data(&mut header, "a.txt", &b""[..]).unwrap();
        let mut bytes = builder.into_inner().unwrap();
        let data_at = bytes.len() - 1024;
        bytes[data_at..data_at + 3].copy_from_slice(b"abc");
        let seen = read_all(&bytes).unwrap();
        assert_eq!((seen[0].2, &seen[0].3[..]), (3, &b"abc"[..]));
    }

    #[test]
    fn sparse_members_and_malformed_pax_records_are_errors() {
        let ok = header_block("b.txt", b'0', b"00000000002\0");
        let with_data = |header: &[u8], data: &[u8]| {
            let mut bytes = header.to_vec();
            let mut data = data.to_vec();
            data.resize(data.len().div_ceil(512) * 512, 0);
            bytes.extend_from_slice(&data);
            bytes
        };
        let tail = |mut bytes: Vec<u8>| {
            bytes.extend_from_slice(&with_data(&ok, b"ok"));
            bytes.resize(bytes.len() + 1024, 0);
            bytes
        };
        // A GNU sparse member (type S), and a pax one (GNU.sparse records).
        let gnu = tail(with_data(
            &header_block("s.bin", b'S', b"00000000004\0"),
            b"data",
        ));
        let records = b"22 GNU.sparse.major=1\n22 GNU.sparse.minor=0\n";
        let mut pax = with_data(&header_block("PaxHeader", b'x', b"00000000054\0"), records);
        pax.extend_from_slice(&with_data(
            &header_block("s.bin", b'0', b"00000000004\0"),
            b"data",
        ));
        for bytes in [gnu, tail(pax)] {
            let error = read_all(&bytes).unwrap_err().to_string();
            assert!(error.contains("sparse"), "{error}");
        }
        // Pax records: NUL padding after them is allowed; a record that is
        // malformed, or a size that is not a number, is an error.
        for (records, fails) in [
            (&b"14 path=b.jpg\n\0\0\0\0"[..], None),
            (
                &b"14 path=b.jpg\n5 x=y\n"[..],
                Some("the record at byte 14 is malformed"),
            ),
            (
                &b"14 path=b.jpg\nxx"[..],
                Some("the record at byte 14 is malformed"),
            ),
            (&b"12 size=abc\n"[..], Some("is not a number")),
        ] {
            let size = format!("{:011o}\0", records.len());
            let header = header_block("PaxHeader", b'x', size.as_bytes().try_into().unwrap());
            let mut bytes = with_data(&header, records);
            bytes.extend_from_slice(&with_data(
                &header_block("a.jpg", b'0', b"00000000001\0"),
                b"1",
            ));
            let got = read_all(&tail(bytes));
            match fails {
                None => assert_eq!(got.unwrap()[0].0, b"b.jpg"),
                Some(text) => {
                    let error = got.unwrap_err().to_string();
                    assert!(error.contains(text), "{error}");
                }
            }
        }
    }

    #[test]
    fn bad_checksums_and_numbers_are_errors() {
        let mut bytes = header_block("a.txt", b'0', b"00000000002\0").to_vec();
        bytes[0] = b'b';
        bytes.resize(2048, 0);
        let error = read_all(&bytes).unwrap_err();
        assert!(error.to_string().contains("checksum mismatch"), "{error}");
        let mut bytes = header_block("a.txt", b'0', b"0000000000z\0").to_vec();
        bytes.resize(2048, 0);
        let error = read_all(&bytes).unwrap_err();
        assert!(
            error.to_string().contains("size was not a number"),
            "{error}"
        );
    }

    /// Members `tarfile` (and so webdataset) reads otherwise than the `tar`
    /// crate: a contiguous file (type `7`) is a file, a GNU long name ends at
    /// its first NUL, of two pax `path` records the last wins, and an
    /// extension header is told by its type flag whatever its magic (a pax
    /// header without one, Solaris's `X`).
    #[test]
    fn members_read_as_tarfile_reads_them() {
        let mut bytes = Vec::new();
        let mut member = |name: &str, type_flag: u8, data: &[u8]| {
            let size = format!("{:011o}\0", data.len());
            let mut header = header_block(name, type_flag, size.as_bytes().try_into().unwrap());
            if name == "no-magic" {
                header[257..265].fill(0);
                let mut fixed = ::tar::Header::from_byte_slice(&header).clone();
                fixed.set_cksum();
                header = *fixed.as_bytes();
            }
            bytes.extend(header);
            let mut padded = data.to_vec();
            padded.resize(data.len().div_ceil(512) * 512, 0);
            bytes.extend(padded);
        };
        member("a.jpg", b'7', b"1");
        member("././@LongLink", b'L', b"long.jpg\0\0");
        member("short", b'0', b"2");
        member("pax", b'x', b"18 path=first.jpg\n19 path=second.jpg\n");
        member("plain.jpg", b'0', b"3");
        member("no-magic", b'x', b"16 path=old.jpg\n");
        member("a.jpg", b'0', b"4");
        member("pax", b'X', b"20 path=solaris.jpg\n");
        member("a.jpg", b'0', b"5");
        bytes.resize(bytes.len() + 1024, 0);
        let seen: Vec<(Vec<u8>, bool, Vec<u8>)> = read_all(&bytes)
            .unwrap()
            .into_iter()
            .map(|(path, is_file, _, data, _, _)| (path, is_file, data))
            .collect();
        assert_eq!(
            seen,
            [
                (b"a.jpg".to_vec(), true, b"1".to_vec()),
                (b"long.jpg".to_vec(), true, b"2".to_vec()),
                (b"second.jpg".to_vec(), true, b"3".to_vec()),
                (b"old.jpg".to_vec(), true, b"4".to_vec()),
                (b"solaris.jpg".to_vec(), true, b"5".to_vec()),
            ]
        );
    }

    #[test]
    fn an_extension_header_without_its_member_is_an_error() {
        let mut builder = ::tar::Builder::new(Vec::new());
        builder
            .append_pax_extensions([("path", &b"x.txt"[..])])
            .unwrap();
        let bytes = builder.into_inner().unwrap();
        let error = read_all(&bytes).unwrap_err();
        assert!(error.to_string().contains("no future member"), "{error}");
    }

    #[test]
    fn oversized_extension_headers_are_refused() {
        let size = format!("{:011o}\0", MAX_EXTENSION_BYTES + 1);
        let mut bytes =
            header_block("././@LongLink", b'L', size.as_bytes().try_into().unwrap()).to_vec();
        bytes.resize(4096, 0);
        let error = read_all(&bytes).unwrap_err();
        assert!(error.to_string().contains("extension header of"), "{error}");
    }

    #[test]
    fn skips_unread_data_and_counts_every_byte() {
        let bytes = build(&[
            Entry {
                name: "a.bin".into(),
                kind: Kind::File(vec![7; 1000]),
                layout: 0,
                pax_path: None,
            },
            Entry {
                name: "b.bin".into(),
                kind: Kind::File(vec![8; 10]),
                layout: 0,
                pax_path: None,
            },
        ]);
        let mut members = Members::new(&bytes[..]);
        let mut path = Vec::new();
        let first = members.next_member(&mut path).unwrap().unwrap();
        assert_eq!((first.size, first.end), (1000, 512 + 1024));
        let second = members.next_member(&mut path).unwrap().unwrap();
        assert_eq!((&path[..], second.header_position), (&b"b.bin"[..], 1536));
        let (data, read) = members.read_data(second.size);
        read.unwrap();
        assert_eq!(data, vec![8; 10]);
        assert!(members.next_member(&mut path).unwrap().is_none());
        assert_eq!(
            members.position(),
            2560 + 512,
            "the first end-of-archive block read"
        );
        assert!(!members.hit_eof());
    }
}
