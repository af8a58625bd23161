//! JSON-lines shards (`.jsonl`, `.jsonl.gz`, `.jsonl.zst`): one sample per
//! line, a JSON object whose keys are the sample's fields, each value as
//! Python's `json.loads` gives it ([`crate::json`]).
//!
//! A sample's `__key__` is the line's `"__key__"` string when it has one,
//! else its index in the shard; its span is the line's bytes (the line
//! break included), so a manifest (`shardstream index`) lets a read start
//! at any line of a plain shard. Lines holding only whitespace are passed
//! over (they are no sample), and the last line needs no line break. A
//! line that is not a JSON object, holds one of the names a sample is
//! given (`__url__`, `__id__`, `__seed__`), or is longer than
//! [`MAX_LINE_BYTES`] is a format error naming the shard, the line (when
//! the read started at the shard's start) and its byte offset.
//!
//! As for tar shards, a sample from a compressed shard is handed out only
//! once the stream's checksum covered its line, within the verify budget
//! ([`super::tar::read_samples_verified`]).

use std::io::{BufRead, BufReader, Read};
use std::ops::ControlFlow;

use super::verified::Outbox;
use super::{ByteSource, Outcome, Sample, SampleId, ShardRef, Value};
use crate::error::{Error, Result};

/// The longest line read (bytes, its line break included): a longer one,
/// or a file with no line break at all, is a format error rather than
/// memory without bound.
pub const MAX_LINE_BYTES: u64 = 256 << 20;

/// Bytes read from the stream at once.
const READ_BYTES: usize = 256 << 10;

/// The names a sample is given besides its fields that a line may not hold
/// ([`GIVEN_NAMES`](super::GIVEN_NAMES) but the key, which a line may give).
const RESERVED: [&str; 3] = ["__url__", super::SAMPLE_ID_FIELD, "__seed__"];

/// The key a line may give its sample.
const KEY: &str = "__key__";

/// Reads the lines of `reader` (a shard's stream, from its start or from
/// the start of a line, as `shard` says) and calls `on_sample` for each
/// sample in order. `verify_bytes` bounds the decoded bytes samples are
/// held over while a compressed stream's checksum is still to come.
pub fn read_samples<R: ByteSource>(
    reader: &mut R,
    shard: &ShardRef,
    verify_bytes: u64,
    mut on_sample: impl FnMut(Sample) -> ControlFlow<()>,
) -> Result<Outcome> {
    let mut outbox = Outbox::new(shard, verify_bytes, &mut on_sample);
    let mut lines = BufReader::with_capacity(READ_BYTES, &mut *reader);
    let from_start = shard.base_offset == 0 && shard.first_index == 0;
    let mut line = Vec::new();
    let (mut position, mut number, mut produced) = (0u64, 0u64, 0u64);
    let failure = loop {
        line.clear();
        let read = (&mut lines)
            .take(MAX_LINE_BYTES + 1)
            .read_until(b'\n', &mut line);
        let len = match read {
            Ok(0) => break None,
            Ok(len) => len as u64,
            Err(source) => {
                // The stream's own failure (a corrupt or cut compressed
                // stream, a store error), saying how many samples left
                // before their bytes were verified, if any did.
                if let Some(failed) = lines.get_mut().take_failure() {
                    return Err(outbox.unverified_note(failed));
                }
                return Err(Error::Read {
                    url: shard.url.to_string(),
                    offset: shard.base_offset + position,
                    source,
                });
            }
        };
        let start = position;
        position += len;
        number += 1;
        let at = Line {
            shard,
            offset: shard.base_offset + start,
            number: from_start.then_some(number),
        };
        if len > MAX_LINE_BYTES {
            break Some(at.error(too_long()));
        }
        if is_blank(&line) {
            continue;
        }
        let text = line.strip_suffix(b"\n").unwrap_or(&line);
        let text = text.strip_suffix(b"\r").unwrap_or(text);
        let index = shard.first_index + produced;
        let sample = match sample_of(text, &at, index) {
            Ok(sample) => Sample {
                length: len,
                ..sample
            },
            Err(error) => break Some(error),
        };
        produced += 1;
        let settled = lines.get_ref().settled();
        if outbox.offer(sample, position, settled, position).is_break() {
            return Ok(Outcome::Stopped);
        }
    };
    drop(lines);
    if let Some(error) = failure {
        return outbox.fail(reader, error);
    }
    let after_end = |error| {
        let reason = format!("bad data after the end of the stream ({error})");
        shard.format_error(shard.base_offset + position, None, reason)
    };
    if outbox.finish(reader, after_end)?.is_break() {
        return Ok(Outcome::Stopped);
    }
    Ok(Outcome::Completed { samples: produced })
}

/// The byte spans `(offset, length)` of the samples of a plain JSON-lines
/// shard read from its start, by the same rule as [`read_samples`] (blank
/// lines are none), without parsing the lines: a line that is not valid
/// JSON is counted here and refused when read.
pub fn sample_spans<R: Read>(reader: &mut R, shard: &ShardRef) -> Result<Vec<(u64, u64)>> {
    let mut lines = BufReader::with_capacity(READ_BYTES, reader);
    let mut spans = Vec::new();
    let mut line = Vec::new();
    let (mut position, mut number) = (0u64, 0u64);
    loop {
        line.clear();
        let read = (&mut lines)
            .take(MAX_LINE_BYTES + 1)
            .read_until(b'\n', &mut line);
        let len = match read {
            Ok(0) => return Ok(spans),
            Ok(len) => len as u64,
            Err(source) => {
                return Err(Error::Read {
                    url: shard.url.to_string(),
                    offset: position,
                    source,
                })
            }
        };
        number += 1;
        if len > MAX_LINE_BYTES {
            let at = Line {
                shard,
                offset: position,
                number: Some(number),
            };
            return Err(at.error(too_long()));
        }
        if !is_blank(&line) {
            spans.push((position, len));
        }
        position += len;
    }
}

/// Whether a line holds only whitespace (and so no sample).
fn is_blank(line: &[u8]) -> bool {
    line.iter().all(u8::is_ascii_whitespace)
}

fn too_long() -> String {
    format!("is longer than {MAX_LINE_BYTES} bytes (is the shard JSON lines?)")
}

/// Where a line is, for its errors.
struct Line<'a> {
    shard: &'a ShardRef,
    /// Its first byte's offset in the shard.
    offset: u64,
    /// Its number from 1, when the read started at the shard's start.
    number: Option<u64>,
}

impl Line<'_> {
    fn error(&self, what: String) -> Error {
        let line = match self.number {
            Some(n) => format!("line {n}"),
            None => "the line".to_owned(),
        };
        self.shard
            .format_error(self.offset, None, format!("{line} {what}"))
    }
}

/// The sample of one line's `text` (its line break left out), sample
/// `index` of the shard; its length is the caller's to set.
fn sample_of(text: &[u8], at: &Line<'_>, index: u64) -> Result<Sample> {
    let value = crate::json::decode(text).map_err(|reason| at.error(format!("is {reason}")))?;
    let Value::Map(mut fields) = value else {
        return Err(at.error(
            "is not a JSON object (a sample's fields are the keys of its line's object)".into(),
        ));
    };
    if let Some((name, _)) = fields.iter().find(|(name, _)| RESERVED.contains(&&**name)) {
        return Err(at.error(format!(
            "has the field {name:?}, a name shardstream gives each sample: rename it"
        )));
    }
    let key = match fields.iter().position(|(name, _)| name == KEY) {
        Some(at_key) => match fields.remove(at_key).1 {
            Value::Str(key) => key,
            _ => return Err(at.error(format!("has a {KEY:?} that is not a string"))),
        },
        None => index.to_string(),
    };
    Ok(Sample {
        id: SampleId {
            shard: at.shard.index,
            index,
        },
        key,
        url: at.shard.url.clone(),
        fields,
        offset: at.offset,
        length: 0,
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::format::compressed::TarStream;

    struct Plain<'a>(&'a [u8]);

    impl Read for Plain<'_> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            self.0.read(buf)
        }
    }

    impl ByteSource for Plain<'_> {}

    fn shard() -> ShardRef {
        ShardRef::whole(3, Arc::from("mem://s.jsonl"))
    }

    fn read_all(bytes: &[u8], shard: &ShardRef) -> Result<Vec<Sample>> {
        let mut samples = Vec::new();
        let outcome = read_samples(&mut Plain(bytes), shard, 1 << 20, |s| {
            samples.push(s);
            ControlFlow::Continue(())
        })?;
        assert_eq!(
            outcome,
            Outcome::Completed {
                samples: samples.len() as u64
            }
        );
        Ok(samples)
    }

    #[test]
    fn each_line_is_a_sample_with_its_span() {
        let text = b"{\"text\": \"a\", \"n\": 1}\r\n\n  \n{\"__key__\": \"k\", \"text\": \"b\"}\n{\"x\": [1, 2.5, null]}";
        let samples = read_all(text, &shard()).unwrap();
        assert_eq!(samples.len(), 3);
        let keys: Vec<&str> = samples.iter().map(|s| s.key.as_str()).collect();
        assert_eq!(keys, ["0", "k", "2"]);
        for (i, s) in samples.iter().enumerate() {
            assert_eq!(
                s.id,
                SampleId {
                    shard: 3,
                    index: i as u64
                }
            );
            let span = &text[s.offset as usize..(s.offset + s.length) as usize];
            // A span read alone gives the same sample.
            let alone = read_all(
                span,
                &ShardRef {
                    base_offset: s.offset,
                    first_index: s.id.index,
                    ..shard()
                },
            )
            .unwrap();
            assert_eq!(alone, vec![s.clone()]);
        }
        assert_eq!(
            samples[0].fields,
            vec![
                ("text".to_owned(), Value::Str("a".into())),
                ("n".to_owned(), Value::Int(1))
            ]
        );
        assert_eq!(
            samples[1].fields,
            vec![("text".to_owned(), Value::Str("b".into()))]
        );
        assert_eq!(
            samples[2].fields,
            vec![(
                "x".to_owned(),
                Value::List(vec![Value::Int(1), Value::Float(2.5), Value::Null])
            )]
        );
        assert!(read_all(b"", &shard()).unwrap().is_empty());
    }

    #[test]
    fn the_spans_are_those_of_the_samples_read() {
        let text = b"{\"a\": 1}\n\n \t\r\n{\"a\": 2}\r\n{\"a\": 3}";
        let samples = read_all(text, &shard()).unwrap();
        let spans = sample_spans(&mut &text[..], &shard()).unwrap();
        let read: Vec<(u64, u64)> = samples.iter().map(|s| (s.offset, s.length)).collect();
        assert_eq!(spans, read);
        assert_eq!(spans.len(), 3);
    }

    #[test]
    fn a_bad_line_is_named_by_number_and_offset() {
        let cases: [(&[u8], &str, u64); 5] = [
            (b"{\"a\": 1}\n{\"a\": \n", "line 2 is invalid JSON", 9),
            (b"{\"a\": 1}\n\n[1, 2]\n", "line 3 is not a JSON object", 10),
            (
                b"{\"__url__\": \"x\"}\n",
                "line 1 has the field \"__url__\"",
                0,
            ),
            (
                b"{\"__key__\": 5}\n",
                "line 1 has a \"__key__\" that is not a string",
                0,
            ),
            (b"{\"a\": 1}\n\xff\n", "line 2 is invalid JSON", 9),
        ];
        for (text, reason, offset) in cases {
            let message = read_all(text, &shard()).unwrap_err().to_string();
            assert!(message.contains(reason), "{message}");
            assert!(
                message.ends_with(&format!("at byte offset {offset}")),
                "{message}"
            );
        }
        // A read that starts inside the shard does not know line numbers.
        let inside = ShardRef {
            base_offset: 100,
            first_index: 7,
            ..shard()
        };
        let message = read_all(b"nope\n", &inside).unwrap_err().to_string();
        assert!(message.contains("the line is invalid JSON") && message.ends_with("offset 100"));
    }

    #[test]
    fn a_corrupt_gzip_stream_is_named_as_such_and_holds_its_samples_back() {
        let mut text = Vec::new();
        for i in 0..2000 {
            text.extend_from_slice(
                format!("{{\"i\": {i}, \"pad\": \"{}\"}}\n", "x".repeat(40)).as_bytes(),
            );
        }
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        std::io::Write::write_all(&mut encoder, &text).unwrap();
        let intact = encoder.finish().unwrap();
        let mut gz = intact.clone();
        let at = gz.len() - 6; // inside the CRC-32 of the trailer
        gz[at] ^= 0xff;
        let mut stream = TarStream::open(Plain(&gz), "mem://s.jsonl.gz").unwrap();
        let mut shard = shard();
        shard.compression = stream.compression();
        let mut handed = 0;
        let error = read_samples(&mut stream, &shard, 1 << 20, |_| {
            handed += 1;
            ControlFlow::Continue(())
        })
        .unwrap_err();
        assert!(matches!(error, Error::Decompress { .. }), "{error}");
        assert_eq!(handed, 0, "samples of a stream that failed its checksum");
        // With a verify budget smaller than the stream, samples leave
        // unverified, and the error says how many did.
        let mut stream = TarStream::open(Plain(&gz), "mem://s.jsonl.gz").unwrap();
        let mut handed = 0;
        let error = read_samples(&mut stream, &shard, 1, |_| {
            handed += 1;
            ControlFlow::Continue(())
        })
        .unwrap_err()
        .to_string();
        assert!(handed > 0);
        let note = format!("{handed} samples of this shard had already been handed out");
        assert!(error.contains(&note), "{error}");
        // Intact, every line comes.
        let mut stream = TarStream::open(Plain(&intact), "mem://s.jsonl.gz").unwrap();
        let read = read_samples(&mut stream, &shard, 1 << 20, |_| ControlFlow::Continue(()));
        assert_eq!(read.unwrap(), Outcome::Completed { samples: 2000 });
    }
}
