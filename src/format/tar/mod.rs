//! WebDataset tar: members grouped into samples by key.
//!
//! For a regular member `dir/stem.ext.more`, the key is `dir/stem` (the
//! basename cut at its first dot) and the field is `ext.more`, lower-cased.
//! Consecutive members with the same key form one sample. Members without a
//! dot in their basename (or with an empty stem), directories and other
//! non-regular entries are skipped. GNU long names and PAX headers apply.

mod members;

use std::ops::ControlFlow;

use bytes::Bytes;

use self::members::Members;
use super::verified::Outbox;
use super::{ByteSource, Outcome, Sample, SampleId, ShardRef, Value, GIVEN_NAMES};
use crate::error::{Error, Result};

/// Splits a member path into `(key, field)` by the WebDataset rule, or
/// `None` when the member carries no field.
pub fn split_member(path: &str) -> Option<(&str, String)> {
    let base_start = path.rfind('/').map_or(0, |i| i + 1);
    let dot = base_start + path[base_start..].find('.')?;
    if dot == base_start || dot + 1 == path.len() {
        return None;
    }
    let field = &path[dot + 1..];
    let field = if field.is_ascii() {
        field.to_ascii_lowercase()
    } else {
        field.to_lowercase()
    };
    Some((&path[..dot], field))
}

/// Bytes of decoded tar [`read_samples`] holds back samples over while a
/// compressed stream's checksum is still to come.
pub const DEFAULT_VERIFY_BYTES: u64 = 32 << 20;

/// Reads a tar archive from `reader` and calls `on_sample` for each sample
/// in order, as [`read_samples_verified`] does with a verify budget of
/// [`DEFAULT_VERIFY_BYTES`].
pub fn read_samples<R: ByteSource>(
    reader: &mut R,
    shard: &ShardRef,
    on_sample: impl FnMut(Sample) -> ControlFlow<()>,
) -> Result<Outcome> {
    read_samples_verified(reader, shard, DEFAULT_VERIFY_BYTES, on_sample)
}

/// Reads a tar archive from `reader` and calls `on_sample` for each sample
/// in order.
///
/// When the reader checks its bytes (a compressed stream: a gzip member's
/// CRC-32 and length, a zstd frame's content checksum), a sample is handed
/// to `on_sample` only once the bytes it came from (up to the header that
/// ended it) passed that check, so a sample the checksum then rejects is
/// never handed out. The samples waiting for it are held within
/// `verify_bytes` of decoded tar: when the oldest one starts more than
/// `verify_bytes` before the read position, it is handed out unchecked, and
/// a later checksum failure says how many samples of its member or frame
/// were handed out so. A stream that fails a check drops every sample held.
///
/// When reading fails, the source's own error (missing shard, timeout,
/// corrupt compressed stream) is reported in preference to the tar
/// parser's; a compressed stream is first read to its end, so that damage
/// its checksum catches is reported as such rather than as the bad tar
/// header it decoded to.
///
/// A zero block where a header should be ends the archive only when
/// nothing but zeros follows it to the end of the stream (which is read to
/// check that); otherwise it is an error naming the block's offset.
pub fn read_samples_verified<R: ByteSource>(
    reader: &mut R,
    shard: &ShardRef,
    verify_bytes: u64,
    mut on_sample: impl FnMut(Sample) -> ControlFlow<()>,
) -> Result<Outcome> {
    let mut members = Members::new(&mut *reader);
    let mut grouper = Grouper::new(shard);
    let mut outbox = Outbox::new(shard, verify_bytes, &mut on_sample);
    let walked = walk_members(&mut members, shard, &mut grouper, &mut outbox);
    let (consumed, hit_eof) = (members.position(), members.hit_eof());
    let header_start = members.header_start();
    let outcome = match walked {
        Err(failure) => {
            let entries = grouper.entries_seen;
            let error = failure.into_error(shard, consumed, header_start, hit_eof, entries);
            return outbox.fail(reader, error);
        }
        Ok(outcome) => outcome,
    };
    if outcome == Outcome::Stopped {
        return Ok(outcome);
    }
    if consumed == 0 {
        if let Some(source) = reader.take_failure() {
            return Err(source);
        }
        return Err(shard.format_error(0, None, "empty file, not a tar archive"));
    }
    let after_end = |error| {
        let reason = format!("bad data after the end of the archive ({error})");
        shard.format_error(shard.base_offset + consumed, None, reason)
    };
    // The stream was read to its end and passed every check it makes.
    if outbox.finish(reader, after_end)?.is_break() {
        return Ok(Outcome::Stopped);
    }
    if let Some(sample) = grouper.finish() {
        if outbox.hand_out(sample).is_break() {
            return Ok(Outcome::Stopped);
        }
    }
    Ok(Outcome::Completed {
        samples: grouper.produced(),
    })
}

/// The byte spans `(offset, length)` of the samples of a plain tar archive
/// of `total` bytes, grouped by the same rule as [`read_samples`], from the
/// member headers alone: member data is skipped ([`ByteSource::skip`]), so
/// a source that seeks reads one block per member. Errors are those
/// [`read_samples`] reports for the same bytes.
pub fn sample_spans<R: ByteSource>(
    reader: &mut R,
    shard: &ShardRef,
    total: u64,
) -> Result<Vec<(u64, u64)>> {
    let mut members = Members::new(&mut *reader);
    let mut spans: Vec<(u64, u64)> = Vec::new();
    let mut key = String::new();
    let mut fields: Vec<String> = Vec::new();
    let mut entry_start = 0u64;
    let mut entries_seen = 0u64;
    let mut path = Vec::new();
    let walked: Result<(), Failure> = (|| {
        while let Some(member) = members.next_member(&mut path).map_err(Failure::Tar)? {
            entries_seen += 1;
            let (start, end) = (entry_start, member.end);
            entry_start = member.end;
            if !member.is_file {
                continue;
            }
            let header_offset = shard.base_offset + member.header_position;
            let name = std::str::from_utf8(&path).map_err(|_| {
                Failure::Member(shard.format_error(header_offset, None, "member name is not UTF-8"))
            })?;
            let Some((member_key, field)) = split_member(name) else {
                continue;
            };
            let available = total.saturating_sub(member.data_position);
            if available < member.size {
                return Err(Failure::Member(shard.format_error(
                    shard.base_offset + total,
                    Some(name.to_owned()),
                    format!(
                        "truncated tar archive: member data ends after {available} of {} bytes",
                        member.size
                    ),
                )));
            }
            match spans.last_mut() {
                Some(last) if member_key == key => {
                    if fields.contains(&field) {
                        return Err(Failure::Member(Error::DuplicateField {
                            url: shard.url.to_string(),
                            key: key.clone(),
                            field,
                            member: name.to_owned(),
                            offset: header_offset,
                            compression: shard.compression,
                        }));
                    }
                    fields.push(field);
                    last.1 = end - last.0;
                }
                _ => {
                    key.clear();
                    key.push_str(member_key);
                    fields.clear();
                    fields.push(field);
                    spans.push((start, end - start));
                }
            }
        }
        check_archive_end(&mut members, shard)
    })();
    if let Err(failure) = walked {
        let (consumed, hit_eof) = (members.position(), members.hit_eof());
        let header_start = members.header_start();
        if let Some(source) = reader.take_failure() {
            return Err(source);
        }
        return Err(failure.into_error(shard, consumed, header_start, hit_eof, entries_seen));
    }
    if members.position() == 0 {
        return Err(shard.format_error(0, None, "empty file, not a tar archive"));
    }
    Ok(spans)
}

/// A failure while walking members, before it knows the bytes consumed.
enum Failure {
    Tar(std::io::Error),
    Member(Error),
}

impl Failure {
    fn into_error(
        self,
        shard: &ShardRef,
        consumed: u64,
        header_start: u64,
        hit_eof: bool,
        entries_seen: u64,
    ) -> Error {
        match self {
            Failure::Member(e) => e,
            Failure::Tar(e) => {
                let truncated = hit_eof || e.kind() == std::io::ErrorKind::UnexpectedEof;
                let (offset, reason) = if entries_seen == 0 && !truncated {
                    (header_start, format!("not a tar archive ({e})"))
                } else if entries_seen == 0 {
                    (consumed, format!("not a tar archive ({e})"))
                } else if truncated {
                    (consumed, format!("truncated tar archive ({e})"))
                } else {
                    (header_start, format!("bad tar header ({e})"))
                };
                shard.format_error(shard.base_offset + offset, None, reason)
            }
        }
    }
}

fn walk_members<M: ByteSource, F: FnMut(Sample) -> ControlFlow<()>>(
    members: &mut Members<M>,
    shard: &ShardRef,
    grouper: &mut Grouper<'_>,
    outbox: &mut Outbox<'_, F>,
) -> Result<Outcome, Failure> {
    let base = shard.base_offset;
    // Where the current entry's headers (including GNU long-name and pax
    // headers) start, relative to the read's start.
    let mut entry_start = 0u64;
    // The current member's path, in one allocation reused for every member.
    let mut path = Vec::new();
    loop {
        let next = members.next_member(&mut path).map_err(Failure::Tar)?;
        let (settled, position) = (members.inner().settled(), members.position());
        if outbox.settle(settled, position).is_break() {
            return Ok(Outcome::Stopped);
        }
        let Some(member) = next else {
            break;
        };
        grouper.entries_seen += 1;
        let span = (base + entry_start, base + member.end);
        entry_start = member.end;
        if !member.is_file {
            continue;
        }
        let header_offset = base + member.header_position;
        let name = std::str::from_utf8(&path).map_err(|_| {
            Failure::Member(shard.format_error(header_offset, None, "member name is not UTF-8"))
        })?;
        let Some((key, field)) = split_member(name) else {
            continue;
        };
        // A member with a new key completes the previous sample, even if
        // this member's data turns out to be truncated.
        if let Some(done) = grouper.take_if_new_key(key) {
            if outbox.offer(done, position, settled, position).is_break() {
                return Ok(Outcome::Stopped);
            }
        }
        let size = member.size;
        let (data, read) = members.read_data(size);
        let data_offset = base + member.data_position;
        if let Err(e) = &read {
            if e.kind() == std::io::ErrorKind::OutOfMemory {
                return Err(Failure::Member(shard.format_error(
                    data_offset,
                    Some(name.to_owned()),
                    format!("member of {size} bytes: cannot hold its data in memory ({e})"),
                )));
            }
        }
        if read.is_err() || (data.len() as u64) < size {
            let offset = data_offset + data.len() as u64;
            let detail = read.err().map(|e| format!(": {e}")).unwrap_or_default();
            return Err(Failure::Member(shard.format_error(
                offset,
                Some(name.to_owned()),
                format!(
                    "truncated tar archive: member data ends after {} of {size} bytes{detail}",
                    data.len()
                ),
            )));
        }
        grouper
            .add(key, field, data, name, header_offset, span)
            .map_err(Failure::Member)?;
        if outbox
            .settle(members.inner().settled(), members.position())
            .is_break()
        {
            return Ok(Outcome::Stopped);
        }
    }
    check_archive_end(members, shard)?;
    Ok(Outcome::Completed {
        samples: grouper.produced(),
    })
}

/// Checks how the archive `members` walked to its end ended. A zero block
/// where a header should be ends it only if nothing but zeros follows. A
/// read that runs to the shard's end ([`ShardRef::to_end`]) and met no zero
/// block was cut short: every tar writer ends an archive with zero blocks,
/// and a shard truncated between members (a copy cut at a block boundary)
/// would otherwise read as a shorter archive, its last samples lost.
fn check_archive_end<M: ByteSource>(
    members: &mut Members<M>,
    shard: &ShardRef,
) -> Result<(), Failure> {
    match members.end_marker() {
        Some(marker) => match members.data_after_end().map_err(Failure::Tar)? {
            Some(at) => Err(Failure::Member(data_after_end_error(shard, marker, at))),
            None => Ok(()),
        },
        None if shard.to_end && members.position() > 0 => Err(Failure::Member(shard.format_error(
            shard.base_offset + members.position(),
            None,
            "truncated tar archive: the data ends here without the end-of-archive blocks \
                 (zero blocks) that a tar archive ends with",
        ))),
        None => Ok(()),
    }
}

/// The error for non-zero data at `at` after the zero block at `marker`
/// (offsets relative to the read's start) where a header should be.
fn data_after_end_error(shard: &ShardRef, marker: u64, at: u64) -> Error {
    let base = shard.base_offset;
    shard.format_error(
        base + marker,
        None,
        format!(
            "a zero block ends the archive here, but non-zero data follows at byte offset {} \
             (a zeroed or damaged member header, or data after the end-of-archive marker)",
            base + at
        ),
    )
}

/// Groups consecutive members with the same key into samples.
struct Grouper<'a> {
    shard: &'a ShardRef,
    current: Option<Sample>,
    next_index: u64,
    entries_seen: u64,
}

impl<'a> Grouper<'a> {
    fn new(shard: &'a ShardRef) -> Self {
        Grouper {
            shard,
            current: None,
            next_index: shard.first_index,
            entries_seen: 0,
        }
    }

    /// Samples started so far.
    fn produced(&self) -> u64 {
        self.next_index - self.shard.first_index
    }

    /// Takes the current sample out when `key` starts a new one.
    fn take_if_new_key(&mut self, key: &str) -> Option<Sample> {
        match &self.current {
            Some(current) if current.key != key => self.current.take(),
            _ => None,
        }
    }

    /// Adds one member to the current sample, or starts a new sample.
    fn add(
        &mut self,
        key: &str,
        field: String,
        data: Bytes,
        member: &str,
        offset: u64,
        (span_start, span_end): (u64, u64),
    ) -> Result<()> {
        if field.starts_with("__") && GIVEN_NAMES.contains(&field.as_str()) {
            return Err(self.shard.format_error(
                offset,
                Some(member.to_owned()),
                format!(
                    "field {field:?} is a name shardstream gives each sample: rename the \
                     member"
                ),
            ));
        }
        if let Some(current) = &mut self.current {
            debug_assert_eq!(current.key, key, "take_if_new_key first");
            if current.fields.iter().any(|(f, _)| *f == field) {
                return Err(Error::DuplicateField {
                    url: self.shard.url.to_string(),
                    key: key.to_owned(),
                    field,
                    member: member.to_owned(),
                    offset,
                    compression: self.shard.compression,
                });
            }
            current.fields.push((field, Value::Bytes(data)));
            current.length = span_end - current.offset;
            return Ok(());
        }
        self.current = Some(Sample {
            id: SampleId {
                shard: self.shard.index,
                index: self.next_index,
            },
            key: key.to_owned(),
            url: self.shard.url.clone(),
            fields: vec![(field, Value::Bytes(data))],
            offset: span_start,
            length: span_end - span_start,
        });
        self.next_index += 1;
        Ok(())
    }

    fn finish(&mut self) -> Option<Sample> {
        self.current.take()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn shard() -> ShardRef {
        ShardRef::whole(3, Arc::from("mem://test.tar"))
    }

    fn build(members: &[(&str, &[u8])]) -> Vec<u8> {
        let mut builder = ::tar::Builder::new(Vec::new());
        for (name, data) in members {
            let mut header = ::tar::Header::new_gnu();
            header.set_size(data.len() as u64);
            header.set_mode(0o644);
            header.set_entry_type(::tar::EntryType::Regular);
            builder.append_data(&mut header, name, *data).unwrap();
        }
        builder.into_inner().unwrap()
    }

    fn samples(bytes: &[u8]) -> Result<Vec<Sample>> {
        let mut out = Vec::new();
        read_samples(&mut { bytes }, &shard(), |s| {
            out.push(s);
            ControlFlow::Continue(())
        })?;
        Ok(out)
    }

    #[test]
    fn splits_at_first_dot_of_basename() {
        assert_eq!(
            split_member("a.b/c/x.SEG.JSON"),
            Some(("a.b/c/x", "seg.json".into()))
        );
        assert_eq!(split_member("noext"), None);
        assert_eq!(split_member("d/.hidden"), None);
        assert_eq!(split_member("d/x."), None);
        assert_eq!(split_member("x.wav"), Some(("x", "wav".into())));
        assert_eq!(split_member("x.ÄUDIO.Wav"), Some(("x", "äudio.wav".into())));
    }

    #[test]
    fn groups_consecutive_members() {
        let tar = build(&[
            ("a.wav", b"1"),
            ("a.json", b"2"),
            ("README", b"skipped"),
            ("dir/b.WAV", b"3"),
            ("a.txt", b"4"),
        ]);
        let got = samples(&tar).unwrap();
        let keys: Vec<_> = got.iter().map(|s| s.key.as_str()).collect();
        assert_eq!(keys, ["a", "dir/b", "a"]);
        assert_eq!(
            got[0].fields,
            vec![
                ("wav".into(), b"1".to_vec().into()),
                ("json".into(), b"2".to_vec().into())
            ]
        );
        assert_eq!(got[1].fields, vec![("wav".into(), b"3".to_vec().into())]);
        assert_eq!(got[2].id, SampleId { shard: 3, index: 2 });
        assert_eq!(&*got[0].url, "mem://test.tar");
    }

    #[test]
    fn spans_cover_each_sample_and_ranged_reads_reproduce_it() {
        let long = format!("{}/k.txt", "d".repeat(120));
        let tar = build(&[
            ("a.x", &[1u8; 700]),
            ("a.y", b"2"),
            ("skip", b"z"),
            (&long, b"3"),
            ("c.x", b"4"),
        ]);
        let all = samples(&tar).unwrap();
        assert_eq!((all[0].offset, all[0].length), (0, 512 + 1024 + 1024));
        assert_eq!(
            all[1].offset,
            all[0].length + 1024,
            "the skipped member is not in a span"
        );
        assert_eq!(all[2].offset, all[1].offset + all[1].length);
        for (i, sample) in all.iter().enumerate() {
            let range = sample.offset as usize..(sample.offset + sample.length) as usize;
            let mut part = &tar[range];
            let shard = ShardRef {
                base_offset: sample.offset,
                first_index: i as u64,
                to_end: false,
                ..shard()
            };
            let mut got = Vec::new();
            read_samples(&mut part, &shard, |s| {
                got.push(s);
                ControlFlow::Continue(())
            })
            .unwrap();
            assert_eq!(got, vec![sample.clone()]);
        }
    }

    #[test]
    fn long_gnu_names() {
        let long = format!("{}/sample.cls", "d".repeat(150));
        let got = samples(&build(&[(&long, b"7")])).unwrap();
        assert_eq!(got[0].key, format!("{}/sample", "d".repeat(150)));
    }

    #[test]
    fn duplicate_field_names_member() {
        let err = samples(&build(&[("a.wav", b"1"), ("a.WAV", b"2")])).unwrap_err();
        match err {
            Error::DuplicateField {
                key,
                field,
                member,
                offset,
                ..
            } => {
                assert_eq!(
                    (key.as_str(), field.as_str(), member.as_str()),
                    ("a", "wav", "a.WAV")
                );
                assert_eq!(offset, 1024);
            }
            other => panic!("{other}"),
        }
    }

    #[test]
    fn truncated_member_names_offset() {
        let tar = build(&[("a.wav", &[7u8; 2000]), ("b.wav", &[8u8; 2000])]);
        let cut = &tar[..512 + 1000];
        match samples(cut).unwrap_err() {
            Error::Format {
                offset,
                member,
                reason,
                ..
            } => {
                assert_eq!(offset, 1512);
                assert_eq!(member.as_deref(), Some("a.wav"));
                assert!(reason.contains("truncated"), "{reason}");
            }
            other => panic!("{other}"),
        }
    }

    #[test]
    fn complete_sample_before_a_truncated_member_is_produced() {
        let tar = build(&[
            ("a.x", &[1u8; 600]),
            ("a.y", b"2"),
            ("b.x", b"3"),
            ("c.x", &[4u8; 2000]),
        ]);
        let mut keys = Vec::new();
        let err = read_samples(&mut &tar[..tar.len() - 1500], &shard(), |s| {
            keys.push(s.key);
            ControlFlow::Continue(())
        })
        .unwrap_err();
        assert_eq!(keys, ["a", "b"]);
        assert!(err.to_string().contains("member \"c.x\""), "{err}");
    }

    #[test]
    fn cut_in_padding_is_truncated() {
        let tar = build(&[("a.x", &[1u8; 1000]), ("b.x", b"2")]);
        for cut in [1512, 1530, 1535] {
            let err = samples(&tar[..cut]).unwrap_err();
            assert!(err.to_string().contains("truncated"), "{cut}: {err}");
            assert!(err.to_string().contains("byte offset"), "{cut}: {err}");
        }
        let err = samples(&[b'x'; 100]).unwrap_err();
        assert!(err.to_string().contains("not a tar archive"), "{err}");
    }

    #[test]
    fn truncated_header() {
        let tar = build(&[("a.wav", &[7u8; 600]), ("b.wav", &[8u8; 10])]);
        let err = samples(&tar[..1536 + 100]).unwrap_err();
        assert!(err.to_string().contains("truncated"), "{err}");
    }

    #[test]
    fn not_a_tar() {
        let err = samples(&[b'x'; 4096]).unwrap_err();
        assert!(err.to_string().contains("not a tar archive"), "{err}");
        let err = samples(b"").unwrap_err();
        assert!(err.to_string().contains("empty file"), "{err}");
    }

    #[test]
    fn damage_a_compressed_stream_decodes_to_is_reported_as_damage() {
        use std::io::Write;
        let tar = build(&[("a.x", &[1u8; 700]), ("b.x", &[2u8; 700])]);
        // Stored deflate blocks hold the tar as it is: rename b.x in place,
        // which breaks its header checksum and the stream's CRC-32.
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::none());
        encoder.write_all(&tar).unwrap();
        let mut gz = encoder.finish().unwrap();
        let at = gz.windows(3).position(|w| w == b"b.x").unwrap();
        gz[at] = b'c';
        let mut stream =
            crate::format::compressed::TarStream::open(&gz[..], "mem://d.tar.gz").unwrap();
        let shard = ShardRef {
            compression: stream.compression(),
            ..shard()
        };
        let err = read_samples(&mut stream, &shard, |_| ControlFlow::Continue(())).unwrap_err();
        assert!(matches!(err, Error::Decompress { .. }), "{err}");
        assert!(err.to_string().contains("corrupt gzip stream"), "{err}");
    }

    #[test]
    fn tar_errors_in_a_compressed_stream_name_decompressed_offsets() {
        let tar = build(&[("a.x", &[1u8; 700]), ("b.x", &[2u8; 2000])]);
        let cut = &tar[..2048 + 1000];
        let zst = zstd::encode_all(cut, 1).unwrap();
        let mut stream =
            crate::format::compressed::TarStream::open(&zst[..], "mem://t.tar.zst").unwrap();
        let shard = ShardRef {
            compression: stream.compression(),
            ..shard()
        };
        let err = read_samples(&mut stream, &shard, |_| ControlFlow::Continue(())).unwrap_err();
        let message = err.to_string();
        assert!(
            message.contains("truncated tar archive")
                && message.contains("at byte offset 3048 of the decompressed zstd stream"),
            "{message}"
        );
    }

    /// Bytes no compressor shrinks, so that stored blocks hold them as
    /// they are and a byte flipped in them changes one decoded byte.
    fn noise(len: usize, seed: u64) -> Vec<u8> {
        let mut state = seed | 1;
        (0..len)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state as u8
            })
            .collect()
    }

    /// A tar of `count` one-member samples `s000.bin`, ... of noise.
    fn noise_tar(count: usize, len: usize) -> Vec<u8> {
        let members: Vec<(String, Vec<u8>)> = (0..count)
            .map(|i| (format!("s{i:03}.bin"), noise(len, i as u64 + 7)))
            .collect();
        let refs: Vec<(&str, &[u8])> = members
            .iter()
            .map(|(n, d)| (n.as_str(), d.as_slice()))
            .collect();
        build(&refs)
    }

    fn gzip_stored(data: &[u8]) -> Vec<u8> {
        use std::io::Write;
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::none());
        encoder.write_all(data).unwrap();
        encoder.finish().unwrap()
    }

    fn zstd_frame(data: &[u8], checksum: bool) -> Vec<u8> {
        use std::io::Write;
        let mut encoder = zstd::stream::Encoder::new(Vec::new(), 3).unwrap();
        encoder.include_checksum(checksum).unwrap();
        encoder.write_all(data).unwrap();
        encoder.finish().unwrap()
    }

    /// `compressed` with one bit flipped in the first copy of `needle`
    /// (bytes of the tar that its stored blocks hold as they are).
    fn flip_in(mut compressed: Vec<u8>, needle: &[u8]) -> Vec<u8> {
        let at = compressed
            .windows(needle.len())
            .position(|w| w == needle)
            .expect("the needle is stored as it is");
        compressed[at + needle.len() / 2] ^= 0x10;
        compressed
    }

    /// Reads `bytes` (told by their magic) with a verify budget; the keys
    /// handed out and the result.
    fn read_stream(bytes: &[u8], budget: u64) -> (Vec<String>, Result<Outcome>) {
        let mut stream =
            crate::format::compressed::TarStream::open(bytes, "mem://s.tar.x").unwrap();
        let shard = ShardRef {
            compression: stream.compression(),
            ..shard()
        };
        let mut keys = Vec::new();
        let result = read_samples_verified(&mut stream, &shard, budget, |s| {
            keys.push(s.key);
            ControlFlow::Continue(())
        });
        (keys, result)
    }

    #[test]
    fn no_sample_is_handed_out_before_its_checksum_passed() {
        let tar = noise_tar(6, 900);
        let damaged_data = &tar[2048 + 100..2048 + 132]; // inside s001.bin's data
        for compressed in [
            gzip_stored(&tar),
            zstd_frame(&tar, true),
            [gzip_stored(&tar[..4096]), gzip_stored(&tar[4096..])].concat(),
        ] {
            let (keys, result) = read_stream(&flip_in(compressed.clone(), damaged_data), 1 << 20);
            assert_eq!(
                keys,
                Vec::<String>::new(),
                "nothing before the failed check"
            );
            let error = result.unwrap_err();
            assert!(matches!(error, Error::Decompress { .. }), "{error}");
            assert!(!error.to_string().contains("handed out"), "{error}");
            // Intact, every sample, in order.
            let (keys, result) = read_stream(&compressed, 1 << 20);
            assert_eq!(keys.len(), 6);
            assert_eq!(result.unwrap(), Outcome::Completed { samples: 6 });
        }
    }

    #[test]
    fn samples_of_verified_members_are_handed_out_before_a_later_one_fails() {
        let tar = noise_tar(6, 900);
        // Member 1 ends after s002's data: s000 and s001 (each ended by a
        // header inside member 1) are verified when member 2 fails; s002,
        // ended by s003's header in member 2, is not.
        let split = 3 * 1536;
        let damaged_data = &tar[split + 512 + 100..split + 512 + 132]; // s003's data
        let gz = [gzip_stored(&tar[..split]), gzip_stored(&tar[split..])].concat();
        let (keys, result) = read_stream(&flip_in(gz, damaged_data), 1 << 20);
        assert_eq!(keys, ["s000", "s001"]);
        assert!(
            matches!(result, Err(Error::Decompress { .. })),
            "{result:?}"
        );
        let zst = [
            zstd_frame(&tar[..split], true),
            zstd_frame(&tar[split..], true),
        ]
        .concat();
        let (keys, result) = read_stream(&flip_in(zst, damaged_data), 1 << 20);
        assert_eq!(keys, ["s000", "s001"]);
        assert!(
            matches!(result, Err(Error::Decompress { .. })),
            "{result:?}"
        );
    }

    #[test]
    fn a_member_larger_than_the_verify_budget_hands_out_and_says_how_many() {
        let tar = noise_tar(20, 900);
        let damaged_data = &tar[512 * 37 + 100..512 * 37 + 132]; // s012's data
        let gz = flip_in(gzip_stored(&tar), damaged_data);
        let (keys, result) = read_stream(&gz, 5000);
        // A sample leaves once it starts more than 5000 bytes before the
        // read position; the damage shows only at the member's end, so all
        // but the last few are out by then.
        assert!((10..20).contains(&keys.len()), "{keys:?}");
        let message = result.unwrap_err().to_string();
        let note = format!(
            "{} samples of this shard had already been handed out before the checksum",
            keys.len()
        );
        assert!(message.contains(&note), "{message}");
        assert!(message.contains("5000-byte verify budget"), "{message}");
        // Intact, the same budget gives every sample.
        let (keys, result) = read_stream(&gzip_stored(&tar), 5000);
        assert_eq!(
            (keys.len(), result.unwrap()),
            (20, Outcome::Completed { samples: 20 })
        );
    }

    #[test]
    fn zstd_frames_without_a_checksum_hand_samples_out_as_decoded() {
        // Several blocks (at most 128 KiB of tar each): those before the
        // cut decode whole.
        let tar = noise_tar(200, 900);
        let unchecked = zstd_frame(&tar, false);
        let (keys, result) = read_stream(&unchecked[..unchecked.len() * 4 / 5], 1 << 20);
        assert!(keys.len() >= 50, "{}", keys.len());
        assert!(
            matches!(result, Err(Error::Decompress { .. })),
            "{result:?}"
        );
        let checked = zstd_frame(&tar, true);
        let (keys, result) = read_stream(&checked[..checked.len() * 4 / 5], 1 << 20);
        assert_eq!(keys, Vec::<String>::new());
        assert!(
            matches!(result, Err(Error::Decompress { .. })),
            "{result:?}"
        );
    }

    #[test]
    fn a_zero_block_followed_by_members_is_an_error_naming_it() {
        let tar = build(&[("a.x", b"1"), ("b.x", b"2"), ("c.x", b"3")]);
        // The first header wiped: formerly 0 samples and a completed shard.
        let mut wiped = tar.clone();
        wiped[..512].fill(0);
        let error = samples(&wiped).unwrap_err().to_string();
        assert!(
            error.contains(
                "a zero block ends the archive here, but non-zero data follows at byte offset 512"
            ) && error.contains("at byte offset 0"),
            "{error}"
        );
        // The second header wiped: "a" is not handed out either, as it may
        // have had more members.
        let mut wiped = tar.clone();
        wiped[1024..1536].fill(0);
        let mut keys = Vec::new();
        let error = read_samples(&mut &wiped[..], &shard(), |s| {
            keys.push(s.key);
            ControlFlow::Continue(())
        })
        .unwrap_err()
        .to_string();
        assert!(keys.is_empty(), "{keys:?}");
        assert!(
            error.contains("follows at byte offset 1536") && error.contains("at byte offset 1024"),
            "{error}"
        );
        // Data after the end-of-archive blocks.
        let mut trailing = tar.clone();
        trailing.extend_from_slice(b"junk");
        let error = samples(&trailing).unwrap_err().to_string();
        let at = format!("non-zero data follows at byte offset {}", tar.len());
        assert!(error.contains(&at), "{error}");
        // In a compressed stream, with offsets in the decompressed tar.
        let mut wiped = tar.clone();
        wiped[..512].fill(0);
        let (keys, result) = read_stream(&zstd_frame(&wiped, true), 1 << 20);
        let error = result.unwrap_err().to_string();
        assert!(keys.is_empty());
        assert!(
            error.contains("at byte offset 0 of the decompressed zstd stream"),
            "{error}"
        );
    }

    /// Counting from the headers finds what reading finds.
    #[test]
    fn sample_spans_report_the_same_end_of_archive_errors() {
        let tar = build(&[("a.x", b"1"), ("b.x", b"2"), ("c.x", b"3")]);
        let spans = |bytes: &[u8]| sample_spans(&mut { bytes }, &shard(), bytes.len() as u64);
        let mut wiped = tar.clone();
        wiped[1024..1536].fill(0);
        let mut trailing = tar.clone();
        trailing.extend_from_slice(b"junk");
        let mut huge = tar.clone();
        set_size_field(&mut huge, 1024, &[0x80, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 1]);
        for bad in [wiped, trailing, huge] {
            let counted = spans(&bad).unwrap_err().to_string();
            assert_eq!(counted, samples(&bad).unwrap_err().to_string());
        }
        let mut padded = tar.clone();
        padded.resize(tar.len() + 10240, 0);
        assert_eq!(spans(&padded).unwrap().len(), 3);
    }

    #[test]
    fn zeros_to_the_end_after_the_marker_are_padding() {
        let tar = build(&[("a.x", b"1"), ("b.x", b"2")]);
        for extra in [0, 1, 511, 10240, 1 << 20] {
            let mut padded = tar.clone();
            padded.resize(tar.len() + extra, 0);
            assert_eq!(samples(&padded).unwrap().len(), 2, "{extra}");
        }
        // One zero block, then the end of the file.
        assert_eq!(samples(&tar[..tar.len() - 512]).unwrap().len(), 2);
    }

    #[test]
    fn a_shard_cut_short_between_members_is_an_error_and_a_ranged_read_is_not() {
        let tar = build(&[("a.x", b"1"), ("a.y", b"2"), ("b.x", b"3"), ("c.x", b"4")]);
        let ends = |tar: &[u8]| {
            let mut members = Members::new(tar);
            let mut ends = Vec::new();
            while let Some(member) = members.next_member(&mut Vec::new()).unwrap() {
                ends.push(member.end);
            }
            ends
        };
        // Cut after each member: at a header block, as a copy cut at a block
        // boundary leaves it. (A cut inside a member's data or padding was
        // always an error.)
        for cut in ends(&tar) {
            let mut handed_out = Vec::new();
            let error = read_samples(&mut &tar[..cut as usize], &shard(), |s| {
                handed_out.push(s.key);
                ControlFlow::Continue(())
            })
            .unwrap_err();
            let message = error.to_string();
            assert!(
                message.contains("truncated tar archive") && message.contains("end-of-archive"),
                "{cut}: {message}"
            );
            assert!(message.contains(&format!("offset {cut}")), "{message}");
            // The sample being grouped when the data ended is not handed out
            // (its other fields may be what was cut).
            assert!(handed_out.len() < 3, "{cut}: {handed_out:?}");
            let spans = sample_spans(&mut &tar[..cut as usize], &shard(), cut).unwrap_err();
            assert_eq!(spans.to_string(), message);
        }
        // A byte range an index gave ends at a sample's end, not the shard's.
        let ranged = ShardRef {
            to_end: false,
            ..shard()
        };
        let cut = ends(&tar)[2] as usize;
        let got = read_samples(&mut &tar[..cut], &ranged, |_| ControlFlow::Continue(())).unwrap();
        assert_eq!(got, Outcome::Completed { samples: 2 });
    }

    /// Writes `field` into the size field of the header at `at`, and the
    /// header's checksum.
    fn set_size_field(tar: &mut [u8], at: usize, field: &[u8; 12]) {
        let header = &mut tar[at..at + 512];
        header[124..136].copy_from_slice(field);
        header[148..156].fill(b' ');
        let sum: u32 = header.iter().map(|&b| u32::from(b)).sum();
        header[148..155].copy_from_slice(format!("{sum:06o}\0").as_bytes());
    }

    #[test]
    fn a_size_of_2_to_the_64_or_more_is_an_error_naming_the_header() {
        let mut tar = build(&[("a.x", b"1"), ("b.x", b"hello"), ("c.x", b"3")]);
        // b.x's size as base-256: 2^64 + 5, whose low 8 bytes say 5.
        set_size_field(&mut tar, 1024, &[0x80, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 5]);
        let error = samples(&tar).unwrap_err().to_string();
        assert!(
            error.contains("bad tar header (numeric field size is a base-256 number of 2^64 or more) at byte offset 1024"),
            "{error}"
        );
    }

    /// A source that records the most room any append was given.
    struct Recording<'a> {
        bytes: &'a [u8],
        most_capacity: usize,
    }

    impl std::io::Read for Recording<'_> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            self.bytes.read(buf)
        }
    }

    impl ByteSource for Recording<'_> {
        fn read_append(&mut self, out: &mut Vec<u8>, max: usize) -> std::io::Result<usize> {
            self.most_capacity = self.most_capacity.max(out.capacity());
            self.bytes.read_append(out, max)
        }
    }

    /// A header claiming 2^50 bytes over a short input: an error naming the
    /// member, with no giant allocation on the way.
    #[test]
    fn a_huge_claimed_size_over_a_short_input_is_an_error_not_an_allocation() {
        let mut tar = build(&[("a.x", b"1"), ("b.x", &[7u8; 3000])]);
        // 2^50 in base-256.
        set_size_field(&mut tar, 1024, &[0x80, 0, 0, 0, 0, 4, 0, 0, 0, 0, 0, 0]);
        let mut source = Recording {
            bytes: &tar,
            most_capacity: 0,
        };
        let error = read_samples(&mut source, &shard(), |_| ControlFlow::Continue(()))
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("truncated tar archive") && error.contains("member \"b.x\""),
            "{error}"
        );
        assert!(
            source.most_capacity <= 64 << 20,
            "reserved {} bytes",
            source.most_capacity
        );
    }

    /// An endless stream of zeros.
    struct Zeros;

    impl std::io::Read for Zeros {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            buf.fill(0);
            Ok(buf.len())
        }
    }

    impl ByteSource for Zeros {}

    /// Set in the child process of
    /// `data_no_memory_can_hold_is_an_error_not_an_abort`.
    const MEMORY_LIMIT_CHILD: &str = "SHARDSTREAM_TEST_MEMORY_LIMIT_CHILD";

    /// A member (and a raw object) larger than the memory the process may
    /// have: an error, not an abort. The work runs in a child process
    /// under an address-space limit, so an abort fails this test rather
    /// than ending the test run, and no test beside it feels the limit.
    #[cfg(target_os = "linux")]
    #[test]
    fn data_no_memory_can_hold_is_an_error_not_an_abort() {
        const NAME: &str = "format::tar::tests::data_no_memory_can_hold_is_an_error_not_an_abort";
        if std::env::var_os(MEMORY_LIMIT_CHILD).is_none() {
            let output = std::process::Command::new(std::env::current_exe().unwrap())
                .args([NAME, "--exact", "--test-threads=1", "--nocapture"])
                .env(MEMORY_LIMIT_CHILD, "1")
                .output()
                .unwrap();
            let stdout = String::from_utf8_lossy(&output.stdout);
            let stderr = String::from_utf8_lossy(&output.stderr);
            assert!(
                output.status.success() && stdout.contains("1 passed"),
                "{:?}\n{stdout}\n{stderr}",
                output.status
            );
            return;
        }
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let vm_kib: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmSize:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap();
        let limit = (vm_kib << 10) + (768 << 20);
        let rlimit = libc::rlimit {
            rlim_cur: limit,
            rlim_max: limit,
        };
        // SAFETY: setrlimit reads the struct it is given.
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_AS, &rlimit) }, 0);

        let mut header = ::tar::Header::new_gnu();
        header.set_path("big.bin").unwrap();
        header.set_size(1 << 50);
        header.set_mode(0o644);
        header.set_cksum();
        let mut source = std::io::Read::chain(&header.as_bytes()[..], Zeros);
        let mut source = SourceOf(&mut source);
        let error = read_samples(&mut source, &shard(), |_| ControlFlow::Continue(()))
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("member of 1125899906842624 bytes: cannot hold its data in memory")
                && error.contains("member \"big.bin\""),
            "{error}"
        );
        let error = crate::format::blob::read_object(&mut Zeros, &shard())
            .unwrap_err()
            .to_string();
        assert!(error.contains("cannot allocate"), "{error}");
    }

    /// Any reader as a [`ByteSource`].
    struct SourceOf<R>(R);

    impl<R: std::io::Read> std::io::Read for SourceOf<R> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            self.0.read(buf)
        }
    }

    impl<R: std::io::Read> ByteSource for SourceOf<R> {}

    #[test]
    fn stop_ends_early() {
        let tar = build(&[("a.x", b"1"), ("b.x", b"2"), ("c.x", b"3")]);
        let mut n = 0;
        let outcome = read_samples(&mut &tar[..], &shard(), |_| {
            n += 1;
            ControlFlow::Break(())
        })
        .unwrap();
        assert_eq!((outcome, n), (Outcome::Stopped, 1));
    }
}
