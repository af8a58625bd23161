//! The contract every remote store's objects keep (S3, HTTP(S), and the
//! GCS and Hub objects read over HTTPS): [`RangedObject`], one GET of a
//! byte range and the check of its answer, with the validator the reads
//! of an object are pinned to ([`Pinned`]), bounded retries with backoff
//! and jitter ([`Retries`]), and what a failure means ([`Failure`]). The
//! read-ahead (`source/`) streams ranges of such objects into its
//! budgeted chunks; nothing here knows of chunks or budgets.

use std::future::Future;
use std::ops::Range;
use std::pin::Pin;
use std::time::Instant;

use bytes::Bytes;

use crate::config::Transport;
use crate::error::Error;
use crate::hash::{splitmix64, Fnv1a, GOLDEN_GAMMA};
use crate::stats::Counters;

/// What a failed request or body means for the read.
pub(crate) enum Failure {
    /// Worth another attempt (throttling, 5xx, timeouts, resets).
    Retry(String),
    /// Final.
    Fatal(Error),
}

/// The most errors of a source chain looked at.
pub(crate) const MAX_CHAIN: usize = 16;

/// The messages of `error` and its sources, joined by ": " on one line,
/// leaving out a message that the one before already holds (wrappers often
/// repeat their source's). Display messages only, never a `Debug` dump.
pub(crate) fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut next = Some(error);
    for _ in 0..MAX_CHAIN {
        let Some(current) = next else { break };
        let text = current
            .to_string()
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ");
        if !text.is_empty() && !parts.last().is_some_and(|last| last.contains(&text)) {
            parts.push(text);
        }
        next = current.source();
    }
    parts.join(": ")
}

/// The messages of what caused `error` (its sources), or its own message
/// when it has no source: the generic words of a wrapper ("io error",
/// "dispatch failure") left out.
pub(crate) fn cause_chain(error: &(dyn std::error::Error + 'static)) -> String {
    match error.source() {
        Some(source) => error_chain(source),
        None => error_chain(error),
    }
}

/// Bounded retries with exponential backoff and full jitter.
pub(crate) struct Retries<'a> {
    transport: &'a Transport,
    attempt: u32,
    started: Instant,
    seed: u64,
}

impl<'a> Retries<'a> {
    pub(crate) fn new(transport: &'a Transport, url: &str, offset: u64) -> Self {
        let seed = Fnv1a::with_basis(offset ^ GOLDEN_GAMMA)
            .bytes(url.as_bytes())
            .finish();
        Retries {
            transport,
            attempt: 0,
            started: Instant::now(),
            seed,
        }
    }

    /// Waits before the next attempt, or gives the error when out of attempts or time.
    pub(crate) async fn wait(
        &mut self,
        url: &str,
        offset: u64,
        reason: String,
    ) -> Result<(), Error> {
        self.attempt += 1;
        if self.attempt >= self.transport.max_attempts
            || self.started.elapsed() >= self.transport.max_retry_time
        {
            return Err(Error::Read {
                url: url.to_owned(),
                offset,
                source: std::io::Error::other(format!(
                    "gave up after {} attempts: {reason}",
                    self.attempt
                )),
            });
        }
        let cap = self
            .transport
            .backoff_base
            .saturating_mul(1 << self.attempt.min(16))
            .min(self.transport.backoff_max);
        // Full jitter: a uniform draw from [0, cap) (splitmix64 of our own seed).
        self.seed = self.seed.wrapping_add(GOLDEN_GAMMA);
        let z = splitmix64(self.seed);
        let fraction = (z >> 11) as f64 / (1u64 << 53) as f64;
        tokio::time::sleep(cap.mul_f64(fraction)).await;
        Ok(())
    }
}

/// What is known of an object being read: its validator (every request
/// after the first is pinned to it: the ETag, else, over HTTP, the
/// Last-Modified date) and its size.
#[derive(Debug, Default, Clone)]
pub(crate) struct Pinned {
    /// The first answer's ETag.
    pub(crate) etag: Option<String>,
    /// The first answer's Last-Modified date (HTTP), used when it has no ETag.
    pub(crate) last_modified: Option<String>,
    /// The object's size.
    pub(crate) size: Option<u64>,
    /// Whether an answer gave `size`; else it is the size the object was
    /// listed with, which the first answer must confirm.
    pub(crate) confirmed: bool,
    /// The ETag the object was listed with, or that its manifest records,
    /// which its first answer must carry (else it is another version).
    pub(crate) listed_etag: Option<String>,
    /// Whether an answer's body runs past the part it was taken for (a
    /// server that ignores `Range` sent the whole object, or the whole unit
    /// was asked for, as of a resource that may have no validator): the
    /// rest of that body is read on rather than asked for again.
    pub(crate) ignores_range: bool,
}

impl Pinned {
    /// The validator every answer was pinned to: the ETag, else the
    /// Last-Modified date.
    pub(crate) fn validator(&self) -> Option<String> {
        self.etag.clone().or_else(|| self.last_modified.clone())
    }

    /// Nothing known but the size the object was listed with, if any.
    pub(crate) fn listed(size: Option<u64>) -> Self {
        Pinned {
            size,
            ..Pinned::default()
        }
    }

    /// Nothing known but the size and ETag the object was listed with (or
    /// that its manifest records), if any: its first answer must confirm
    /// both.
    pub(crate) fn expecting(size: Option<u64>, etag: Option<String>) -> Self {
        Pinned {
            listed_etag: etag,
            ..Pinned::listed(size)
        }
    }

    /// An error when the first answer (now confirmed) gave another ETag
    /// than the one the object was listed with (`listed_etag`).
    pub(crate) fn check_listed_etag(&self, url: &str, position: u64) -> Result<(), Error> {
        let Some(listed) = &self.listed_etag else {
            return Ok(());
        };
        if !self.confirmed || self.etag.as_ref() == Some(listed) {
            return Ok(());
        }
        let found = self.etag.as_deref().unwrap_or("none");
        Err(Error::Read {
            url: url.to_owned(),
            offset: position,
            source: std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "the object's ETag is {found}, not the {listed} it was listed with or that \
                     its manifest records: it changed since (if a manifest describes it, run \
                     `shardstream index` again)"
                ),
            ),
        })
    }
}

/// Where the body of an answer lies in the object.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Served {
    /// The object's size.
    pub(crate) size: u64,
    /// Where the body's bytes end in the object (exclusive).
    pub(crate) body_end: u64,
}

/// `bytes FIRST-LAST/TOTAL` (`TOTAL` may be `*`, unknown).
pub(crate) fn parse_content_range(text: &str) -> Option<(u64, u64, Option<u64>)> {
    let rest = text.trim().strip_prefix("bytes")?.trim_start();
    let (span, total) = rest.split_once('/')?;
    let (first, last) = span.trim().split_once('-')?;
    let total = match total.trim() {
        "*" => None,
        digits => Some(digits.parse().ok()?),
    };
    Some((first.trim().parse().ok()?, last.trim().parse().ok()?, total))
}

/// Checks that an answer to a GET from byte `from` (to `end`, exclusive;
/// `None`: to the object's end) carries exactly those bytes: a partial
/// answer (206) whose Content-Range starts at `from` and ends at `end` (or
/// at the object's end, when it ends first), its Content-Length the same;
/// or, for a GET from the first byte, the whole object (200) with its
/// length. Anything else (a whole object for a resume, a range starting
/// elsewhere) is refused, with the reason.
pub(crate) fn check_response(
    from: u64,
    end: Option<u64>,
    content_range: Option<&str>,
    content_length: Option<i64>,
) -> Result<Served, String> {
    let length = match content_length.map(u64::try_from) {
        Some(Ok(length)) => Some(length),
        Some(Err(_)) => return Err("the answer has a negative Content-Length".into()),
        None => None,
    };
    let Some(text) = content_range else {
        if from > 0 {
            return Err(format!(
                "asked for the bytes from byte offset {from}, the answer holds the whole object \
                 (no Content-Range)"
            ));
        }
        let size = length.ok_or("the answer has neither Content-Range nor Content-Length")?;
        return Ok(Served {
            size,
            body_end: size,
        });
    };
    let (first, last, total) = parse_content_range(text)
        .ok_or_else(|| format!("the answer has an unreadable Content-Range {text:?}"))?;
    let total = total.ok_or_else(|| {
        format!("the answer's Content-Range {text:?} does not give the object's size")
    })?;
    if first != from || last < first || last >= total {
        return Err(format!(
            "asked for the bytes from byte offset {from}, the answer holds bytes {first} to \
             {last} of {total}"
        ));
    }
    let body_end = last + 1;
    let wanted_end = end.unwrap_or(total).min(total);
    if body_end != wanted_end {
        return Err(format!(
            "asked for bytes {from} to {}, the answer holds bytes {first} to {last} of {total}",
            wanted_end.saturating_sub(1)
        ));
    }
    if length.is_some_and(|n| n != body_end - first) {
        return Err(format!(
            "the answer's Content-Length {} does not match its Content-Range {text:?}",
            length.unwrap_or(0)
        ));
    }
    Ok(Served {
        size: total,
        body_end,
    })
}

/// The next bytes of a body: `None` at its end, `Err` with the reason
/// when it breaks.
pub(crate) type NextBytes<'a> =
    Pin<Box<dyn Future<Output = Option<Result<Bytes, String>>> + Send + 'a>>;

/// The body of an answer, read a piece at a time (an HTTP body, an S3
/// object's byte stream).
pub(crate) trait Body: Send {
    /// The next bytes of the body.
    fn next_bytes(&mut self) -> NextBytes<'_>;
}

/// An answer taken for a read from some byte offset: where the read of it
/// stops, the leading body bytes to skip (those of a whole answer to a
/// request from a later offset), where its body ends in the object, and
/// the body.
pub(crate) struct Answer {
    /// Where the read stops in the object (exclusive).
    pub(crate) stop: u64,
    /// Body bytes before the offset asked for.
    pub(crate) skip: u64,
    /// Where the body ends in the object: past `stop` when the server sent
    /// the whole object for a range.
    pub(crate) body_end: u64,
    /// The body.
    pub(crate) body: Box<dyn Body>,
}

/// An object read by byte ranges (an S3 object, an HTTP(S) resource): how
/// to send one GET of a range of it and check its answer. `source::remote_reads::stream_range`
/// streams a range with such GETs, retried and resumed; `read_ranged`
/// reads a unit of any such object within the read-ahead budget as one
/// streaming request, the part queue (`queue.rs`) as parallel ranged requests.
pub(crate) trait RangedObject: Send + Sync + 'static {
    /// The object's URL, for errors.
    fn url(&self) -> &str;

    /// The retries, backoff and timeouts of its reads.
    fn transport(&self) -> &Transport;

    /// Where requests, bytes, resumes and retries are counted.
    fn counters(&self) -> &Counters;

    /// Told of each part of it a part queue issues, in the order issued,
    /// before the part's request is sent (a request may then be retried or
    /// resumed); nothing by default. The part queue's tests watch its
    /// issue order here.
    fn part_issued(&self, _part: &Range<u64>) {}

    /// Sends one GET of the bytes from `position` to `end` (exclusive;
    /// `None`: the object's end; with `clamp`, the object may end first),
    /// pinned to `pinned`'s validator, and takes its answer if it carries
    /// those bytes and fits what `pinned` knows (which it then learns).
    /// `Ok(None)`: the object is empty (a first read of unknown size).
    fn get(
        &self,
        position: u64,
        end: Option<u64>,
        clamp: bool,
        pinned: &mut Pinned,
    ) -> impl Future<Output = Result<Option<Answer>, Failure>> + Send;
}

/// Why the read of an object without a validator is not resumed.
const NO_VALIDATOR: &str = "the resource has neither ETag nor Last-Modified, so it is not \
     resumed: another request could be answered with another version of it";

/// The error of a read of `url` that stopped at `offset` (for `reason`)
/// and would need another request for an object without a validator.
pub(crate) fn unpinned(url: &str, offset: u64, reason: &str) -> Error {
    Error::Read {
        url: url.to_owned(),
        offset,
        source: std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            format!("{reason}; {NO_VALIDATOR}"),
        ),
    }
}

/// The error of a part of `url` (bytes `part`) that ended after `got` bytes.
pub(crate) fn short_part(url: &str, part: &Range<u64>, got: u64) -> Error {
    Error::Read {
        url: url.to_owned(),
        offset: part.start + got,
        source: std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            format!(
                "the part of bytes {} to {} ended after {got} bytes",
                part.start,
                part.end.saturating_sub(1)
            ),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn served(size: u64, body_end: u64) -> Result<Served, String> {
        Ok(Served { size, body_end })
    }

    #[test]
    fn a_resume_is_taken_only_as_the_range_asked_for() {
        let range = Some("bytes 1000-4999/5000");
        assert_eq!(
            check_response(1000, None, range, Some(4000)),
            served(5000, 5000)
        );
        assert_eq!(
            check_response(1000, Some(5000), range, None),
            served(5000, 5000)
        );
        // The object ends before the range asked for: the caller decides.
        assert_eq!(
            check_response(1000, Some(9000), range, Some(4000)),
            served(5000, 5000)
        );
        let refused = [
            // The whole object (200) for a resume.
            check_response(1000, None, None, Some(5000)),
            // Bytes from another offset.
            check_response(1000, None, Some("bytes 0-4999/5000"), Some(5000)),
            check_response(1000, None, Some("bytes 1500-4999/5000"), Some(3500)),
            // Fewer bytes than asked for, however consistently told.
            check_response(1000, None, Some("bytes 1000-2999/5000"), Some(2000)),
            check_response(1000, Some(4000), Some("bytes 1000-2999/5000"), Some(2000)),
            // A length that is not the range's.
            check_response(1000, None, range, Some(100)),
            // No size, or no sense.
            check_response(1000, None, Some("bytes 1000-4999/*"), Some(4000)),
            check_response(1000, None, Some("bytes 1000-999/5000"), Some(0)),
            check_response(1000, None, Some("bytes 1000-5000/5000"), Some(4001)),
            check_response(1000, None, Some("1000-4999/5000"), Some(4000)),
            check_response(1000, None, range, Some(-1)),
        ];
        for (i, answer) in refused.iter().enumerate() {
            let reason = answer.as_ref().expect_err(&format!("answer {i} refused"));
            assert!(!reason.contains('{'), "{reason}");
        }
    }

    #[test]
    fn a_read_from_the_first_byte_takes_the_whole_object() {
        assert_eq!(
            check_response(0, None, None, Some(5000)),
            served(5000, 5000)
        );
        // A ranged GET from the first byte answered with the whole object:
        // its first bytes are the ones asked for (the rest is left unread).
        assert_eq!(
            check_response(0, Some(100), None, Some(5000)),
            served(5000, 5000)
        );
        assert!(check_response(0, None, None, None).is_err());
    }

    #[test]
    fn content_ranges_are_parsed() {
        assert_eq!(parse_content_range("bytes 0-9/10"), Some((0, 9, Some(10))));
        assert_eq!(parse_content_range("bytes 5-9/*"), Some((5, 9, None)));
        assert_eq!(parse_content_range("bytes */10"), None);
        assert_eq!(parse_content_range("bytes 5-x/10"), None);
    }
}
