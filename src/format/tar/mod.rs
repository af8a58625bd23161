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
use super::{ByteSource, Sample, SampleId, ShardRef, Value};
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

/// How reading a shard ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The archive ended; this many samples were produced.
    Completed {
        /// Samples produced.
        samples: u64,
    },
    /// The callback asked to stop.
    Stopped,
}

/// Reads a tar archive from `reader` and calls `on_sample` for each sample
/// in order. When reading fails, the source's own error (missing shard,
/// timeout, corrupt compressed stream) is reported in preference to the tar
/// parser's; a compressed stream is first read to its end, so that damage
/// its checksum catches is reported as such rather than as the bad tar
/// header it decoded to.
pub fn read_samples<R: ByteSource>(
    reader: &mut R,
    shard: &ShardRef,
    mut on_sample: impl FnMut(Sample) -> ControlFlow<()>,
) -> Result<Outcome> {
    let mut members = Members::new(&mut *reader);
    let mut grouper = Grouper::new(shard);
    let walked = walk_members(&mut members, shard, &mut grouper, &mut on_sample);
    let (consumed, hit_eof) = (members.position(), members.hit_eof());
    let mut source_error = || reader.take_failure();
    let outcome = match walked {
        Err(failure) => {
            if let Some(source) = source_error() {
                return Err(source);
            }
            if reader.check_trailer().is_err() {
                if let Some(source) = reader.take_failure() {
                    return Err(source);
                }
            }
            return Err(failure.into_error(shard, consumed, hit_eof, grouper.entries_seen));
        }
        Ok(outcome) => outcome,
    };
    if outcome == Outcome::Stopped {
        return Ok(outcome);
    }
    if consumed == 0 {
        if let Some(source) = source_error() {
            return Err(source);
        }
        return Err(shard.format_error(0, None, "empty file, not a tar archive"));
    }
    if let Err(error) = reader.check_trailer() {
        if let Some(source) = reader.take_failure() {
            return Err(source);
        }
        return Err(shard.format_error(
            shard.base_offset + consumed,
            None,
            format!("bad data after the end of the archive ({error})"),
        ));
    }
    if let Some(sample) = grouper.finish() {
        if on_sample(sample).is_break() {
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
        Ok(())
    })();
    if let Err(failure) = walked {
        let (consumed, hit_eof) = (members.position(), members.hit_eof());
        if let Some(source) = reader.take_failure() {
            return Err(source);
        }
        return Err(failure.into_error(shard, consumed, hit_eof, entries_seen));
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
        hit_eof: bool,
        entries_seen: u64,
    ) -> Error {
        match self {
            Failure::Member(e) => e,
            Failure::Tar(e) => {
                let reason = if entries_seen == 0 {
                    format!("not a tar archive ({e})")
                } else if hit_eof || e.kind() == std::io::ErrorKind::UnexpectedEof {
                    format!("truncated tar archive ({e})")
                } else {
                    format!("bad tar header ({e})")
                };
                shard.format_error(shard.base_offset + consumed, None, reason)
            }
        }
    }
}

fn walk_members<R: ByteSource>(
    members: &mut Members<R>,
    shard: &ShardRef,
    grouper: &mut Grouper<'_>,
    on_sample: &mut impl FnMut(Sample) -> ControlFlow<()>,
) -> Result<Outcome, Failure> {
    let base = shard.base_offset;
    // Where the current entry's headers (including GNU long-name and pax
    // headers) start, relative to the read's start.
    let mut entry_start = 0u64;
    // The current member's path, in one allocation reused for every member.
    let mut path = Vec::new();
    while let Some(member) = members.next_member(&mut path).map_err(Failure::Tar)? {
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
            if on_sample(done).is_break() {
                return Ok(Outcome::Stopped);
            }
        }
        let size = member.size;
        let (data, read) = members.read_data(size);
        if read.is_err() || (data.len() as u64) < size {
            let offset = base + member.data_position + data.len() as u64;
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
    }
    Ok(Outcome::Completed {
        samples: grouper.produced(),
    })
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
        let mut stream = crate::format::TarStream::open(&gz[..], "mem://d.tar.gz").unwrap();
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
        let mut stream = crate::format::TarStream::open(&zst[..], "mem://t.tar.zst").unwrap();
        let shard = ShardRef {
            compression: stream.compression(),
            ..shard()
        };
        let err = read_samples(&mut stream, &shard, |_| ControlFlow::Continue(())).unwrap_err();
        let message = err.to_string();
        assert!(
            message.contains("truncated tar archive")
                && message.contains("at byte offset 3048 of the decompressed zstd tar"),
            "{message}"
        );
    }

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
