//! Reads of ranges of remote objects ([`RangedObject`], `crate::store`)
//! into the read-ahead: the body-streaming loop every read of a range goes
//! through ([`stream_range`]), retried and resumed, its bytes cut into
//! budgeted chunks, and one streaming read of a unit ([`read_ranged`];
//! parallel parts are the part queue's, `queue/`).

use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::fetch::{Chunk, ChunkSender, ConsumerGone, FetchUnit, Fetcher};
use crate::error::Error;
use crate::stats::Counter;
use crate::store::ranged::{unpinned, Answer, Body, Failure, Pinned, RangedObject, Retries};

/// Where body bytes go.
pub(super) enum Target<'a> {
    /// Budgeted chunks of `chunk_bytes`, sent to a shard reader.
    Chunks {
        tx: &'a ChunkSender,
        budget: &'a Arc<Semaphore>,
        chunk_bytes: usize,
        chunk: Vec<u8>,
        permit: Option<OwnedSemaphorePermit>,
    },
    /// One buffer, for a part whose budget is already held.
    Buffer(Vec<u8>),
}

impl Target<'_> {
    pub(super) async fn push(&mut self, mut bytes: Bytes) -> Result<(), ConsumerGone> {
        match self {
            Target::Buffer(buffer) => {
                buffer.extend_from_slice(&bytes);
                Ok(())
            }
            Target::Chunks {
                tx,
                budget,
                chunk_bytes,
                chunk,
                permit,
            } => {
                while !bytes.is_empty() {
                    if permit.is_none() {
                        let n = u32::try_from(*chunk_bytes).expect("chunk_bytes fits u32");
                        *permit = Some(
                            budget
                                .clone()
                                .acquire_many_owned(n)
                                .await
                                .map_err(|_| ConsumerGone)?,
                        );
                        chunk.reserve_exact(*chunk_bytes);
                    }
                    let take = bytes.len().min(*chunk_bytes - chunk.len());
                    chunk.extend_from_slice(&bytes.split_to(take));
                    if chunk.len() == *chunk_bytes {
                        let held = permit.take().expect("reserved above");
                        tx.send(Ok(Chunk::read(std::mem::take(chunk), held)))?;
                    }
                }
                Ok(())
            }
        }
    }

    /// Sends a partly filled chunk, giving back the budget it does not use.
    pub(super) fn flush(&mut self) -> Result<(), ConsumerGone> {
        if let Target::Chunks {
            tx,
            chunk_bytes,
            chunk,
            permit,
            ..
        } = self
        {
            if let Some(mut held) = permit.take() {
                if chunk.is_empty() {
                    return Ok(());
                }
                drop(held.split(*chunk_bytes - chunk.len()));
                let partial = Chunk::read(std::mem::take(chunk), held);
                tx.send(Ok(partial))?;
            }
        }
        Ok(())
    }
}

/// What one GET of a part took: the time to its answer, then the bytes of
/// its body read and the time they took.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Sample {
    /// From sending the request to its answer.
    pub(super) first_byte: Duration,
    /// Body bytes read after it.
    pub(super) bytes: u64,
    /// The time those bytes took.
    pub(super) transfer: Duration,
}

/// The body of a whole answer to a range (a server that ignores `Range`),
/// kept where the read of one part stopped for the part after it.
#[derive(Default)]
pub(super) struct Tap {
    kept: Mutex<Option<Kept>>,
}

/// A body kept: the offset of its next bytes, those of them already
/// received, and where the body ends in the object (where its GET asked
/// it to end, or the object's end).
struct Kept {
    at: u64,
    pending: Bytes,
    body: Box<dyn Body>,
    body_end: u64,
}

impl Tap {
    /// The body kept at byte offset `at`, with the bytes of it already
    /// received and where it ends, if any.
    fn take(&self, at: u64) -> Option<(Bytes, Box<dyn Body>, u64)> {
        let mut kept = self.kept.lock().unwrap_or_else(|e| e.into_inner());
        match kept.take() {
            Some(Kept {
                at: offset,
                pending,
                body,
                body_end,
            }) if offset == at => Some((pending, body, body_end)),
            other => {
                *kept = other;
                None
            }
        }
    }

    /// Keeps `body`, whose next bytes (after `pending`) are at `at` and
    /// which ends at `body_end`.
    fn keep(&self, at: u64, pending: Bytes, body: Box<dyn Body>, body_end: u64) {
        let kept = Kept {
            at,
            pending,
            body,
            body_end,
        };
        *self.kept.lock().unwrap_or_else(|e| e.into_inner()) = Some(kept);
    }
}

/// Streams the bytes `range` of `object` (end `u64::MAX`: to the object's
/// end; with `clamp`, to the range's end or the object's, whichever comes
/// first) into `target`, retrying failed requests and resuming a broken
/// body from the last byte received, pinned to `pinned`'s validator; the
/// read ends only where the range (or the object) does. Each GET asks for
/// the bytes up to `reach` (at least the range's end; `u64::MAX`: the
/// object's end), so that one GET may serve the reads of the bytes after
/// the range too. An answer whose body runs past the range (`reach` lies
/// past it, or the server sent the whole object) is kept in `tap`, if
/// given, for the read of the bytes after the range, which takes it from
/// there rather than send another GET. Each GET's timing goes to `on_get`.
pub(super) async fn stream_range<O: RangedObject>(
    object: &O,
    (range, reach): (Range<u64>, u64),
    clamp: bool,
    pinned: &mut Pinned,
    target: &mut Target<'_>,
    (tap, on_get): (Option<&Tap>, &(dyn Fn(Sample) + Sync)),
) -> Result<Result<(), Error>, ConsumerGone> {
    let (transport, counters, url) = (object.transport(), object.counters(), object.url());
    let reach = reach.max(range.end);
    let ask = (reach != u64::MAX).then_some(reach);
    let mut end = (range.end != u64::MAX).then_some(range.end);
    let mut position = range.start;
    let mut retries = Retries::new(transport, url, range.start);
    loop {
        if end.is_some_and(|e| position >= e) {
            return Ok(Ok(()));
        }
        let kept = tap.and_then(|tap| tap.take(position));
        let (answer, mut pending, first_byte) = match kept {
            Some((pending, body, body_end)) => {
                // Where the body ends: the end its GET asked for (a
                // stream's), not the object's, which lies further on.
                let stop = end.unwrap_or(body_end).min(body_end);
                let answer = Answer {
                    stop,
                    skip: 0,
                    body_end,
                    body,
                };
                (Ok(Some(answer)), pending, None)
            }
            None => {
                counters.add(Counter::Requests, 1);
                let sent = Instant::now();
                // Past the range when asked to; else to where the read stops.
                let asked = if reach > range.end { ask } else { end };
                let answer = object.get(position, asked, clamp, pinned).await;
                (answer, Bytes::new(), Some(sent.elapsed()))
            }
        };
        let reason = match answer {
            Ok(None) => return Ok(Ok(())),
            Ok(Some(Answer {
                stop: answered,
                mut skip,
                body_end,
                mut body,
            })) => {
                if let Err(error) = pinned.check_listed_etag(url, position) {
                    return Ok(Err(error));
                }
                // The read stops at the range's end, the GET's at `answered`.
                let stop = answered.min(end.unwrap_or(u64::MAX));
                end = Some(stop);
                let runs_on = body_end > stop;
                pinned.ignores_range |= body_end > answered;
                let (from, started) = (position, Instant::now());
                let broke = loop {
                    if position == stop && skip == 0 && runs_on {
                        if let Some(tap) = tap {
                            tap.keep(position, std::mem::take(&mut pending), body, body_end);
                        }
                        break None;
                    }
                    let next = if pending.is_empty() {
                        match tokio::time::timeout(transport.idle_timeout, body.next_bytes()).await
                        {
                            Ok(Some(Ok(bytes))) => {
                                counters.add(Counter::BytesRead, bytes.len() as u64);
                                bytes
                            }
                            Ok(Some(Err(reason))) => {
                                break Some(format!("the body broke: {reason}"))
                            }
                            Ok(None) if position < stop => {
                                break Some(format!(
                                    "the body ended early, at byte offset {position}"
                                ))
                            }
                            Ok(None) => break None,
                            Err(_) => {
                                break Some(format!(
                                    "no body bytes for {:?}",
                                    transport.idle_timeout
                                ))
                            }
                        }
                    } else {
                        std::mem::take(&mut pending)
                    };
                    let mut bytes = next;
                    let skipped = skip.min(bytes.len() as u64);
                    let _ = bytes.split_to(skipped as usize);
                    skip -= skipped;
                    // Past `stop` only when the whole object was sent for
                    // a range: the rest is kept for the next read, or left.
                    let room = stop - position;
                    if bytes.len() as u64 > room {
                        pending = bytes.split_off(room as usize);
                        if !runs_on {
                            position += bytes.len() as u64;
                            target.push(bytes).await?;
                            break None;
                        }
                    }
                    position += bytes.len() as u64;
                    if !bytes.is_empty() {
                        target.push(bytes).await?;
                    }
                };
                if let (Some(first_byte), None) = (first_byte, &broke) {
                    on_get(Sample {
                        first_byte,
                        bytes: position - from,
                        transfer: started.elapsed(),
                    });
                }
                let Some(reason) = broke else {
                    return Ok(Ok(()));
                };
                if pinned.validator().is_none() {
                    // Nothing to pin a resume to: never spliced.
                    return Ok(Err(unpinned(url, position, &reason)));
                }
                counters.add(Counter::Resumes, 1);
                reason
            }
            Err(Failure::Fatal(error)) => {
                return Ok(Err(gone_means_changed(error, pinned, url, position)))
            }
            Err(Failure::Retry(reason)) => reason,
        };
        if let Err(error) = retries.wait(url, position, reason).await {
            return Ok(Err(error));
        }
        counters.add(Counter::Retries, 1);
    }
}

/// `error` as the read at `position` of an object that an earlier answer
/// pinned (`pinned`) sees it: the object gone (a GCS generation or an S3
/// key deleted, a 404) means it changed while it was read.
fn gone_means_changed(error: Error, pinned: &Pinned, url: &str, position: u64) -> Error {
    match error {
        Error::NotFound { .. } if pinned.confirmed && pinned.validator().is_some() => {
            Error::Changed {
                url: url.to_owned(),
                offset: position,
            }
        }
        other => other,
    }
}

/// What is known of `unit`'s object before its first answer: the size and
/// ETag it was listed with, or that its manifest records, which that answer
/// must confirm, for a byte range as for the whole object.
pub(super) fn expected(unit: &FetchUnit) -> Pinned {
    Pinned::expecting(unit.size, unit.etag.clone())
}

/// The object a remote unit is read as: an S3 object or an HTTP(S)
/// resource (GCS and the Hub included), either one read through the same
/// [`RangedObject`] calls.
pub(super) enum RemoteObject<S, H> {
    /// An S3 object.
    S3(Arc<S>),
    /// An HTTP(S) resource.
    Http(Arc<H>),
}

impl<S: RangedObject, H: RangedObject> RangedObject for RemoteObject<S, H> {
    fn url(&self) -> &str {
        match self {
            RemoteObject::S3(o) => o.url(),
            RemoteObject::Http(o) => o.url(),
        }
    }

    fn transport(&self) -> &crate::config::Transport {
        match self {
            RemoteObject::S3(o) => o.transport(),
            RemoteObject::Http(o) => o.transport(),
        }
    }

    fn counters(&self) -> &crate::stats::Counters {
        match self {
            RemoteObject::S3(o) => o.counters(),
            RemoteObject::Http(o) => o.counters(),
        }
    }

    fn part_issued(&self, part: &Range<u64>) {
        match self {
            RemoteObject::S3(o) => o.part_issued(part),
            RemoteObject::Http(o) => o.part_issued(part),
        }
    }

    async fn get(
        &self,
        position: u64,
        end: Option<u64>,
        clamp: bool,
        pinned: &mut Pinned,
    ) -> Result<Option<Answer>, Failure> {
        match self {
            RemoteObject::S3(o) => o.get(position, end, clamp, pinned).await,
            RemoteObject::Http(o) => o.get(position, end, clamp, pinned).await,
        }
    }
}

/// Reads the unit's object (or byte range of it) as one streaming GET
/// (resumed where it breaks) into budgeted chunks sent to `tx`, so that
/// parsing starts with its first bytes. Used with `max_concurrency` 1;
/// otherwise the part queue (`queue/`) reads remote units as parts.
pub(super) async fn read_ranged<O: RangedObject>(
    fetcher: &Fetcher,
    object: Arc<O>,
    unit: &FetchUnit,
    tx: &ChunkSender,
) -> Result<(), ConsumerGone> {
    fetcher.count(Counter::ShardsOpened, 1);
    let range = unit
        .range
        .clone()
        .unwrap_or(0..unit.size.unwrap_or(u64::MAX));
    let mut pinned = expected(unit);
    let mut target = Target::Chunks {
        tx,
        budget: &fetcher.budget,
        chunk_bytes: fetcher.chunk_bytes,
        chunk: Vec::new(),
        permit: None,
    };
    let reach = range.end;
    let result = match stream_range(
        &*object,
        (range, reach),
        false,
        &mut pinned,
        &mut target,
        (None, &|_| {}),
    )
    .await
    {
        Err(ConsumerGone) => return Ok(()),
        Ok(result) => result,
    };
    tx.note_answer(pinned.validator(), pinned.size.filter(|_| pinned.confirmed));
    if target.flush().is_err() {
        return Ok(());
    }
    if let Err(error) = result {
        let _ = tx.send(Err(error));
    }
    Ok(())
}
