//! HTTP(S) resources read by byte ranges ([`RangedObject`]): one GET of a
//! range, pinned to the first answer's validator (a strong ETag, else the
//! Last-Modified date), its answer checked to hold exactly the bytes asked
//! for; a resource without a validator is read by one GET, never resumed.

use std::sync::Arc;

use http::header::{self, HeaderName};
use http::{Method, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;

use super::{
    announces_empty, coded, coding, has_validator, is_strong, origin, status_failure, Answer,
    HttpClient,
};
use crate::config::Transport;
use crate::error::Error;
use crate::stats::Counters;
use crate::store::ranged::{
    self, check_response, error_chain, Body, Failure, NextBytes, Pinned, RangedObject,
};

/// The headers of a GET from byte `from` to `end` (exclusive; `None`: the
/// end), pinned to what `pinned` knows.
pub(super) fn range_headers(
    from: u64,
    end: Option<u64>,
    pinned: &Pinned,
) -> Vec<(HeaderName, String)> {
    let mut headers = Vec::new();
    match (from, end) {
        (0, None) => {}
        (from, None) => headers.push((header::RANGE, format!("bytes={from}-"))),
        (from, Some(end)) => headers.push((
            header::RANGE,
            format!("bytes={from}-{}", end.saturating_sub(1)),
        )),
    }
    match (&pinned.etag, &pinned.last_modified) {
        (Some(etag), _) if is_strong(etag) => headers.push((header::IF_MATCH, etag.clone())),
        (_, Some(date)) => headers.push((header::IF_UNMODIFIED_SINCE, date.clone())),
        _ => {}
    }
    headers
}

/// Takes an answer for the read of `url` at `position` (to `end`; with
/// `clamp`, or without `end`, the resource may end first), whose GET asked
/// for the bytes to `asked` (`end`, or further: the unit's end), if it
/// carries the bytes asked for, in no content coding, and fits what is
/// known of the resource; gives where the read stops, how many leading body
/// bytes to skip (those of a whole answer, `200`, to a request from
/// `position`) and where the body ends in the resource.
pub(super) fn accept(
    url: &str,
    position: u64,
    (asked, end, clamp): (Option<u64>, Option<u64>, bool),
    answer: &Answer,
    pinned: &mut Pinned,
) -> Result<(u64, u64, u64), Failure> {
    if !matches!(answer.status.as_u16(), 200 | 206) {
        return Err(status_failure(url, position, answer.status));
    }
    if let Some(coding) = coding(&answer.headers) {
        return Err(Failure::Fatal(coded(url, position, &coding)));
    }
    let text = |name| answer.headers.get(name).and_then(|v| v.to_str().ok());
    let (etag, last_modified) = (text(header::ETAG), text(header::LAST_MODIFIED));
    let changed = match (&pinned.etag, &pinned.last_modified) {
        (Some(pinned), _) => etag != Some(pinned.as_str()),
        (None, Some(pinned)) => last_modified != Some(pinned.as_str()),
        (None, None) => false,
    };
    if changed {
        return Err(Failure::Fatal(Error::Changed {
            url: url.to_owned(),
            offset: position,
        }));
    }
    let length = text(header::CONTENT_LENGTH).and_then(|l| l.parse::<i64>().ok());
    let ignored_range = answer.status == StatusCode::OK && position > 0;
    let (size, skip, body_end) = if ignored_range {
        // The server ignored Range: the whole resource, the same version
        // (its validator matched), read past the bytes already delivered.
        let size = length.and_then(|l| u64::try_from(l).ok()).ok_or_else(|| {
            Failure::Retry("a whole answer to a resume has no Content-Length".into())
        })?;
        if size < position {
            return Err(Failure::Retry(format!(
                "a whole answer of {size} bytes to a resume from byte offset {position}"
            )));
        }
        (size, position, size)
    } else {
        let served = check_response(position, asked, text(header::CONTENT_RANGE), length)
            .map_err(Failure::Retry)?;
        (served.size, 0, served.body_end)
    };
    let invalid = |reason: String| {
        Failure::Fatal(Error::Read {
            url: url.to_owned(),
            offset: position,
            source: std::io::Error::new(std::io::ErrorKind::InvalidData, reason),
        })
    };
    match pinned.size {
        Some(listed) if listed != size && !pinned.confirmed => {
            return Err(invalid(format!(
                "the resource is {size} bytes, not the {listed} bytes it was listed with or \
                 that its manifest records: it changed since (if a manifest describes it, run \
                 `shardstream index` again)"
            )))
        }
        Some(known) if known != size => {
            return Err(Failure::Retry(format!(
                "the answer gives the resource's size as {size} bytes, an earlier one as {known}"
            )))
        }
        _ => {}
    }
    pinned.size = Some(size);
    pinned.confirmed = true;
    if pinned.etag.is_none() && pinned.last_modified.is_none() {
        pinned.etag = etag.map(str::to_owned);
        pinned.last_modified = last_modified.map(str::to_owned);
    }
    match end {
        None => Ok((size, skip, body_end)),
        Some(end) if end <= size => Ok((end, skip, body_end)),
        Some(_) if clamp => Ok((size, skip, body_end)),
        Some(end) => Err(invalid(format!(
            "bytes up to byte offset {end} were asked for, the resource holds {size}"
        ))),
    }
}

/// One resource being read.
struct Resource {
    client: Arc<HttpClient>,
    counters: Arc<Counters>,
    url: String,
    /// Where the unit read ends (exclusive; `None`: the resource's end).
    end: Option<u64>,
}

impl Resource {
    /// Whether the first GET of a resource of `url`'s origin may ask for its
    /// first part only: the last first answer from there had a validator.
    fn pinnable(&self) -> bool {
        let Ok(url) = url::Url::parse(&self.url) else {
            return false;
        };
        let known = self
            .client
            .pinnable
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        known.contains(&origin(&url))
    }

    /// Notes whether the first answer for this resource had a validator.
    fn note_pinnable(&self, pinnable: bool) {
        let Ok(url) = url::Url::parse(&self.url) else {
            return;
        };
        let mut known = self
            .client
            .pinnable
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if pinnable {
            known.insert(origin(&url));
        } else {
            known.remove(&origin(&url));
        }
    }
}

impl Body for Incoming {
    fn next_bytes(&mut self) -> NextBytes<'_> {
        Box::pin(async move {
            loop {
                match self.frame().await? {
                    Ok(frame) => {
                        if let Ok(bytes) = frame.into_data() {
                            return Some(Ok(bytes));
                        }
                    }
                    Err(e) => return Some(Err(error_chain(&e))),
                }
            }
        })
    }
}

impl RangedObject for Resource {
    fn url(&self) -> &str {
        &self.url
    }

    fn transport(&self) -> &Transport {
        &self.client.transport
    }

    fn counters(&self) -> &Counters {
        &self.counters
    }

    async fn get(
        &self,
        position: u64,
        end: Option<u64>,
        clamp: bool,
        pinned: &mut Pinned,
    ) -> Result<Option<ranged::Answer>, Failure> {
        let url = self.url.as_str();
        let first = !pinned.confirmed && pinned.validator().is_none();
        if !first && pinned.validator().is_none() {
            // Another request could be answered by another version.
            let reason = format!("the read stopped at byte offset {position}");
            return Err(Failure::Fatal(ranged::unpinned(url, position, &reason)));
        }
        // The first GET asks for the whole unit (its body then read on by
        // the unit's parts, in turn), unless the resource's origin gives
        // validators: then for the first part only, the later parts pinned
        // to its validator.
        let mut whole = first && !self.pinnable();
        let answer = loop {
            let asked = if whole { self.end } else { end };
            let headers = range_headers(position, asked, pinned);
            let answer = self
                .client
                .send(&Method::GET, url, position, &headers)
                .await?;
            let part_only = answer.status == StatusCode::PARTIAL_CONTENT
                && answer
                    .headers
                    .get(header::CONTENT_RANGE)
                    .and_then(|v| v.to_str().ok())
                    .and_then(ranged::parse_content_range)
                    .is_some_and(|(_, last, total)| {
                        let unit_end = self.end.unwrap_or(u64::MAX).min(total.unwrap_or(u64::MAX));
                        last.saturating_add(1) < unit_end
                    });
            if first && !whole && part_only && !has_validator(&answer.headers) {
                // No validator to pin the other parts to: asked again for
                // the whole unit, this answer left unread.
                self.note_pinnable(false);
                whole = true;
                continue;
            }
            break answer;
        };
        if answer.status == StatusCode::RANGE_NOT_SATISFIABLE
            && position == 0
            && clamp
            && pinned.size.is_none()
            && announces_empty(&answer.headers)
        {
            // A range from the first byte is unsatisfiable only in an
            // empty resource.
            pinned.size = Some(0);
            pinned.confirmed = true;
            return Ok(None);
        }
        let asked = if whole { self.end } else { end };
        let (stop, skip, body_end) = accept(url, position, (asked, end, clamp), &answer, pinned)?;
        if first {
            self.note_pinnable(pinned.validator().is_some());
        }
        Ok(Some(ranged::Answer {
            stop,
            skip,
            body_end,
            body: Box::new(answer.body),
        }))
    }
}

impl HttpClient {
    /// The resource at `url` read up to `end` (exclusive; `None`: to its
    /// end), to be read by ranges, its reads counted in `counters`.
    pub(crate) fn resource(
        self: &Arc<Self>,
        counters: Arc<Counters>,
        url: &str,
        end: Option<u64>,
    ) -> Arc<impl RangedObject> {
        Arc::new(Resource {
            client: self.clone(),
            counters,
            url: url.to_owned(),
            end,
        })
    }
}
