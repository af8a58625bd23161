//! One queue of ranged parts over a read-ahead's whole byte budget. The
//! remote units of a slot (S3 objects, HTTP(S) resources) are cut into
//! parts in the order the parser reads them, and the parts are issued
//! strictly in that order, each once its bytes fit in the budget and a
//! request slot is free. So the part the parser needs next is always the
//! earliest issued one not yet delivered: a later part never holds budget
//! an earlier one waits for (the queue cannot deadlock), and the bytes of
//! parts (fetched or being fetched, not yet parsed) never exceed the budget.
//! An object's first part is small, so that parsing starts early and the
//! validator every later part is pinned to is known soon; part sizes then
//! double up to the size [`PartSizes`] sets from what the GETs so far
//! took. A server that answers a ranged GET with the whole object (it
//! ignores `Range`) is read by that one answer: each later part of the
//! object takes its bytes from the same body, in turn, within its budget.
//!
//! Parts are the unit of the budget, not necessarily of requests: the
//! [`Tuner`] measures the rate two ways of fetching the later parts
//! achieve, each part by a GET of its own (many at once) or every part in
//! turn from one GET that runs to the unit's end (a stream), and fetches
//! them the faster way, measuring both again now and then. A server that
//! answers GETs one at a time, each at a fixed cost (as local test servers
//! and some on-premises stores do), is read by one stream per object after
//! its first part; one that scales with concurrency keeps parallel parts.

mod sizes;
mod tuner;

use std::collections::{BTreeSet, VecDeque};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use tokio::sync::{mpsc, watch, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinHandle;

use super::fetch::{Chunk, ChunkSender, ConsumerGone, FetchUnit, Fetcher};
use super::remote_reads::{expected, stream_range, Tap, Target};
use crate::error::Error;
use crate::stats::Counter;
use crate::store::ranged::{short_part, Pinned, RangedObject};

use sizes::{PartSizes, FIRST_PART_BYTES};
use tuner::{Flight, Mode, Tuner, STREAM_MIN_BYTES};

/// The parts of a byte range, in order: the first of at most
/// [`FIRST_PART_BYTES`], each next one twice the one before, up to the
/// size [`PartSizes`] sets when it is cut.
#[derive(Debug, Clone)]
struct PartPlan {
    next: u64,
    end: u64,
    size: u64,
    sizes: Arc<PartSizes>,
    /// A part boundary: no part runs across it.
    boundary: u64,
}

impl PartPlan {
    /// The plan of `range` (end `u64::MAX`: to the object's end, set later
    /// with [`PartPlan::end_at`]).
    fn new(range: Range<u64>, sizes: Arc<PartSizes>) -> Self {
        PartPlan {
            next: range.start,
            end: range.end,
            size: FIRST_PART_BYTES.min(sizes.target()).max(1),
            sizes,
            boundary: u64::MAX,
        }
    }

    /// Makes `at` a part boundary: the part that would run across it ends
    /// there.
    fn boundary(&mut self, at: u64) {
        self.boundary = at;
    }

    /// Ends the plan at `end` (an object's size, once known), or where the
    /// parts planned so far end, whichever comes last.
    fn end_at(&mut self, end: u64) {
        self.end = end.max(self.next);
    }
}

impl Iterator for PartPlan {
    type Item = Range<u64>;

    fn next(&mut self) -> Option<Range<u64>> {
        if self.next >= self.end {
            return None;
        }
        let start = self.next;
        let mut end = start.saturating_add(self.size).min(self.end);
        if self.boundary > start {
            end = end.min(self.boundary);
        }
        self.next = end;
        self.size = self.size.saturating_mul(2).min(self.sizes.target()).max(1);
        Some(start..end)
    }
}

/// What an object's first part tells the later ones: the validator and
/// size they are pinned to (`Err`: the first part failed; its error is
/// delivered first).
type FirstAnswer = Option<Result<Pinned, ()>>;

/// The result of a part's fetch: its bytes and what the answer told.
type PartResult = Result<(Vec<u8>, Pinned), Error>;

/// Starts the fetch of a part of one object (the object's type erased).
type SpawnPart =
    Box<dyn Fn(Range<u64>, Issue, OwnedSemaphorePermit) -> JoinHandle<PartResult> + Send + Sync>;

/// A part's fetch task, its budget and its bytes.
struct PartTask {
    task: JoinHandle<PartResult>,
    permit: OwnedSemaphorePermit,
    range: Range<u64>,
}

/// A unit whose first part was issued, the rest of its parts not yet.
struct Opened {
    /// Its parts after the first.
    plan: PartPlan,
    /// Whether its size is learnt from the first part.
    clamp: bool,
    /// The budget its first part holds.
    first_bytes: u64,
    answer: watch::Receiver<FirstAnswer>,
    parts: mpsc::UnboundedSender<PartTask>,
    stopped: Arc<AtomicBool>,
    spawn: SpawnPart,
}

/// The parts of every remote unit of a read-ahead, issued in plan order
/// within the read-ahead's budget, at most `max_concurrency` requests at
/// once. The first part of the next units may go ahead of the rest of the
/// unit before them (the look-ahead), so that their validator (and, for an
/// object of unknown size, size) is known when their later parts are
/// issued; the look-ahead holds at most the budget less two of the largest
/// parts, so the part the parser needs next always finds budget once the
/// parts before it are parsed.
pub(super) struct PartQueue {
    slots: Arc<Semaphore>,
    sizes: Arc<PartSizes>,
    tuner: Arc<Tuner>,
    /// Budget the look-ahead may hold.
    allowance: u64,
    /// Units opened ahead of the oldest open one, at most.
    window: usize,
    /// Units whose later parts are not issued yet, oldest first.
    opened: VecDeque<Opened>,
}

impl PartQueue {
    /// A queue over `fetcher`'s budget.
    pub(super) fn new(fetcher: &Fetcher) -> Self {
        let options = &fetcher.store_options;
        let budget = fetcher.budget_bytes() as u64;
        let sizes = PartSizes::new(
            budget,
            options.transport.part_size as u64,
            options.transport.max_concurrency,
        );
        let sizes = Arc::new(sizes);
        PartQueue {
            slots: Arc::new(Semaphore::new(options.transport.max_concurrency.max(1))),
            allowance: budget.saturating_sub(2 * sizes.ceiling()),
            tuner: Arc::new(Tuner::new(
                budget,
                options.transport.max_concurrency,
                sizes.clone(),
            )),
            sizes,
            window: look_ahead_units(options.transport.max_concurrency),
            opened: VecDeque::new(),
        }
    }

    /// Adds `unit` (read from `object`) to the queue: issues its first
    /// part, after the later parts of the units before it unless the
    /// look-ahead has room; gives the task that delivers its parts to `tx`,
    /// in order, and ends the unit. `Err` once the read-ahead is cancelled.
    pub(super) async fn push<O: RangedObject>(
        &mut self,
        fetcher: &Fetcher,
        object: Arc<O>,
        unit: &FetchUnit,
        tx: Arc<ChunkSender>,
    ) -> Result<JoinHandle<Result<(), ConsumerGone>>, ConsumerGone> {
        fetcher.count(Counter::ShardsOpened, 1);
        let range = unit
            .range
            .clone()
            .unwrap_or(0..unit.size.unwrap_or(u64::MAX));
        // Of unknown size, the object may end within the first part.
        let clamp = range.end == u64::MAX;
        let unit_end = range.end;
        let mut plan = PartPlan::new(range, self.sizes.clone());
        let first = plan.next();
        let first_bytes = first.as_ref().map_or(0, |p| p.end - p.start);
        while let Some(oldest) = self.opened.front() {
            let waiting = oldest.clamp && !oldest.answer.borrow().is_some();
            let ahead = self.opened.len();
            let room = ahead <= self.window
                && self.look_ahead_bytes() + first_bytes <= self.allowance
                && (ahead == 1 || waiting);
            if room {
                break;
            }
            self.issue_oldest(fetcher).await?;
        }
        let (parts_tx, parts_rx) = mpsc::unbounded_channel();
        let stopped = Arc::new(AtomicBool::new(false));
        let deliverer = tokio::spawn(deliver(parts_rx, tx, stopped.clone(), unit.url.clone()));
        let Some(first) = first else {
            return Ok(deliverer);
        };
        let (answer_tx, answer) = watch::channel(None);
        let shared = Arc::new(Shared {
            tap: Tap::default(),
            ended: watch::Sender::new(BTreeSet::new()),
            sizes: self.sizes.clone(),
        });
        let spawn: SpawnPart = Box::new(move |part, issue, slot| {
            object.part_issued(&part);
            tokio::spawn(fetch_part(
                object.clone(),
                part,
                issue,
                slot,
                shared.clone(),
            ))
        });
        let role = Role::First {
            pinned: expected(unit),
            clamp,
            answer: answer_tx,
            rest: (!clamp).then(|| unit_end.saturating_sub(first.end)),
        };
        let (permit, slot) = self.reserve(fetcher, first_bytes).await?;
        // The first part asks for its own bytes only, so that the answer
        // tells whether the server takes `Range` (and the validator)
        // before any later part is fetched either way.
        let flight = self.tuner.first(&fetcher.cancelled).await;
        let issue = Issue { role, flight };
        let task = spawn(first.clone(), issue, slot);
        let _ = parts_tx.send(PartTask {
            task,
            permit,
            range: first,
        });
        self.opened.push_back(Opened {
            plan,
            clamp,
            first_bytes,
            answer,
            parts: parts_tx,
            stopped,
            spawn,
        });
        Ok(deliverer)
    }

    /// Issues the later parts of every open unit, oldest first.
    pub(super) async fn drain(&mut self, fetcher: &Fetcher) -> Result<(), ConsumerGone> {
        while !self.opened.is_empty() {
            self.issue_oldest(fetcher).await?;
        }
        Ok(())
    }

    /// Budget held by the first parts of the units opened after the oldest.
    fn look_ahead_bytes(&self) -> u64 {
        self.opened.iter().skip(1).map(|o| o.first_bytes).sum()
    }

    /// Waits for budget for `len` bytes and a request slot.
    async fn reserve(
        &self,
        fetcher: &Fetcher,
        len: u64,
    ) -> Result<(OwnedSemaphorePermit, OwnedSemaphorePermit), ConsumerGone> {
        let permit = fetcher.reserve(len as usize).await.ok_or(ConsumerGone)?;
        fetcher.note_budget_held();
        let slot = self
            .slots
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| ConsumerGone)?;
        Ok((permit, slot))
    }

    /// Issues the later parts of the oldest open unit, in order, each once
    /// budget and a request slot are free (of an object of unknown size,
    /// once its first part told the size).
    async fn issue_oldest(&mut self, fetcher: &Fetcher) -> Result<(), ConsumerGone> {
        let Some(mut unit) = self.opened.pop_front() else {
            return Ok(());
        };
        if unit.clamp {
            match first_answer(unit.answer.clone()).await {
                Some(pinned) => unit.plan.end_at(pinned.size.unwrap_or(0)),
                // The first part's error is delivered; nothing follows it.
                None => return Ok(()),
            }
        }
        let unit_end = unit.plan.end;
        let mut plan = unit.plan;
        // Where the stream the parts are read from ends: a probe's ends
        // with its parts, any other with the unit, its parts following it.
        let mut stream: Option<u64> = None;
        // Of a small unit, a few parts at most: each by a GET of its own.
        let streamable = unit_end.saturating_sub(plan.next) >= STREAM_MIN_BYTES;
        while let Some(part) = plan.next() {
            if unit.stopped.load(Ordering::SeqCst) {
                break;
            }
            let len = part.end - part.start;
            let (permit, slot) = self.reserve(fetcher, len).await?;
            let (link, reach, flight) = match stream {
                _ if !streamable => (Link::Own, part.end, self.tuner.track()),
                Some(end) if part.start < end && end == unit_end => {
                    (Link::Follows, end, self.tuner.track())
                }
                Some(end) if part.start < end => {
                    let (_, flight) = self.tuner.next(&part, unit_end, &fetcher.cancelled).await;
                    (Link::Follows, end, flight)
                }
                _ => match self.tuner.next(&part, unit_end, &fetcher.cancelled).await {
                    (Mode::Parts, flight) => (Link::Own, part.end, flight),
                    (Mode::Stream, flight) => {
                        let end = match flight.probe {
                            // Through the probe's parts, which end there.
                            Some(probe) => {
                                let left = self.tuner.probe_left(probe) as usize;
                                let end =
                                    plan.clone().take(left).last().map_or(part.end, |p| p.end);
                                plan.boundary(end);
                                end
                            }
                            None => unit_end,
                        };
                        stream = Some(end);
                        (Link::Starts, end, flight)
                    }
                },
            };
            let role = Role::Later {
                first: unit.answer.clone(),
                link,
                reach,
                unit_end,
            };
            let task = (unit.spawn)(part.clone(), Issue { role, flight }, slot);
            let sent = unit.parts.send(PartTask {
                task,
                permit,
                range: part,
            });
            if let Err(mpsc::error::SendError(refused)) = sent {
                refused.task.abort();
                break;
            }
        }
        Ok(())
    }
}

/// Units opened ahead of the oldest open one, at most, with
/// `max_concurrency` requests: fewer than the units a read-ahead keeps in
/// flight (`max_concurrency`), so that the oldest unit in flight never
/// waits for parts not issued yet.
pub(super) fn look_ahead_units(max_concurrency: usize) -> usize {
    max_concurrency.saturating_sub(2)
}

/// What the object's first part learnt, once it is done; `None` if it failed.
async fn first_answer(mut answer: watch::Receiver<FirstAnswer>) -> Option<Pinned> {
    let done = answer.wait_for(Option::is_some).await.ok()?;
    done.clone()?.ok()
}

/// A part's place in its object's read.
enum Role {
    /// The first part: it learns the validator (and, with `clamp`, the
    /// size) and tells the later parts through `answer`.
    First {
        pinned: Pinned,
        clamp: bool,
        answer: watch::Sender<FirstAnswer>,
        /// The unit's bytes after the part (`None`: the object's, once its
        /// size is known).
        rest: Option<u64>,
    },
    /// A later part, pinned to what the first one learnt (`first`), whose
    /// GET asks for the bytes up to `reach` (the end of the part, or of
    /// the stream it starts or follows), of a unit that ends at
    /// `unit_end` (`u64::MAX`: the object's end).
    Later {
        first: watch::Receiver<FirstAnswer>,
        link: Link,
        reach: u64,
        unit_end: u64,
    },
}

/// How a later part gets its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Link {
    /// By a GET of its own bytes.
    Own,
    /// By a GET that runs on to the unit's end, for the parts after it.
    Starts,
    /// From the body of the part before it, once that part ended (by a
    /// GET to the unit's end if none is kept).
    Follows,
}

/// How a part is fetched: its place, and how its tuner counts it.
struct Issue {
    role: Role,
    flight: Flight,
}

/// What the parts of one object share: the body of an answer kept for
/// the part after the one it was taken for, the offsets the parts that
/// ended so far end at (a part that follows another waits for its start
/// there), and the queue's part sizes.
struct Shared {
    tap: Tap,
    ended: watch::Sender<BTreeSet<u64>>,
    sizes: Arc<PartSizes>,
}

/// One part into memory: every byte of `range` (with a first part of an
/// object of unknown size, up to the object's end), or an error. Holds its
/// request slot until done. A later part that follows the part before it
/// (and every later part of an object whose server ignores `Range`, or
/// that has no validator) waits for that part to end and reads on from its
/// answer's body; one that starts a stream asks for the bytes up to the
/// unit's end and keeps the rest of the body for the part after it.
async fn fetch_part<O: RangedObject>(
    object: Arc<O>,
    range: Range<u64>,
    Issue { role, mut flight }: Issue,
    _slot: OwnedSemaphorePermit,
    shared: Arc<Shared>,
) -> PartResult {
    // Of a first part: the unit's bytes after it, if known yet.
    let mut first_of = None;
    let (mut pinned, clamp, answer, follows, reach) = match role {
        Role::First {
            pinned,
            clamp,
            answer,
            rest,
        } => {
            first_of = Some(rest);
            (pinned, clamp, Some(answer), false, range.end)
        }
        Role::Later {
            first,
            link,
            reach,
            unit_end,
        } => match first_answer(first).await {
            Some(pinned) => {
                // A server that ignores `Range`, or an object without a
                // validator (never spliced from two answers): every part
                // reads on from the body before it.
                let whole = pinned.ignores_range || pinned.validator().is_none();
                let follows = link == Link::Follows || whole;
                let reach = if whole { unit_end } else { reach };
                (pinned, false, None, follows, reach)
            }
            None => {
                return Err(Error::Stopped(format!(
                    "{}: the object's first part failed",
                    object.url()
                )))
            }
        },
    };
    if follows {
        // The part before this one ends where this one starts; it tells
        // so however it ends.
        let mut ended = shared.ended.subscribe();
        if ended
            .wait_for(|at| at.contains(&range.start))
            .await
            .is_err()
        {
            return Err(Error::Stopped("stream cancelled".into()));
        }
        shared.ended.send_modify(|at| {
            at.remove(&range.start);
        });
    }
    let mut buffer = Target::Buffer(Vec::with_capacity((range.end - range.start) as usize));
    let sizes = &shared.sizes;
    let timed = std::sync::Mutex::new(Vec::new());
    let result = stream_range(
        &*object,
        (range.clone(), reach),
        clamp,
        &mut pinned,
        &mut buffer,
        (Some(&shared.tap), &|sample| {
            sizes.record(sample);
            if first_of.is_some() {
                timed.lock().unwrap_or_else(|e| e.into_inner()).push(sample);
            }
        }),
    )
    .await;
    // A first part read by one GET: the tuner's first measure of one GET
    // (the flight is still in the air, so no probe has started on it).
    let timed = timed.into_inner().unwrap_or_else(|e| e.into_inner());
    if let (Some(rest), [sample]) = (first_of, timed.as_slice()) {
        let rest = rest.or_else(|| pinned.size.map(|size| size.saturating_sub(range.end)));
        if let Some(rest) = rest {
            flight.first_get(*sample, rest);
        }
    }
    shared.ended.send_modify(|at| {
        at.insert(range.end);
    });
    let outcome = match (result, buffer) {
        (Ok(Ok(())), Target::Buffer(bytes)) => {
            let end = match pinned.size {
                Some(size) if clamp => range.end.min(size).max(range.start),
                _ => range.end,
            };
            if bytes.len() as u64 == end - range.start {
                Ok((bytes, pinned))
            } else {
                Err(short_part(object.url(), &range, bytes.len() as u64))
            }
        }
        (Ok(Err(error)), _) => Err(error),
        (Err(ConsumerGone), _) | (_, Target::Chunks { .. }) => {
            Err(Error::Stopped("stream cancelled".into()))
        }
    };
    if let Some(answer) = answer {
        answer.send_replace(Some(
            outcome.as_ref().map(|(_, p)| p.clone()).map_err(|_| ()),
        ));
    }
    flight.ok = outcome.is_ok();
    outcome
}

/// Delivers a unit's parts to its reader in order as they arrive, then
/// ends the unit; at the first error (sent on) or once the reader is gone,
/// stops: the parts still in flight are aborted and no more are issued.
async fn deliver(
    mut parts: mpsc::UnboundedReceiver<PartTask>,
    tx: Arc<ChunkSender>,
    stopped: Arc<AtomicBool>,
    url: String,
) -> Result<(), ConsumerGone> {
    let mut first = true;
    while let Some(PartTask {
        task,
        mut permit,
        range,
    }) = parts.recv().await
    {
        let result = task.await.unwrap_or_else(|join| {
            let reason = if join.is_panic() {
                "the part's fetch task panicked"
            } else {
                "the part's fetch task was cancelled"
            };
            Err(Error::Read {
                url: url.clone(),
                offset: range.start,
                source: std::io::Error::other(reason),
            })
        });
        let sent = match result {
            Ok((bytes, pinned)) => {
                if first {
                    tx.note_answer(pinned.validator(), pinned.size.filter(|_| pinned.confirmed));
                    first = false;
                }
                // A first part cut short by the object's end gives back
                // the budget it does not use.
                let unused = permit.num_permits() - bytes.len();
                if unused > 0 {
                    drop(permit.split(unused));
                }
                bytes.is_empty() || tx.send(Ok(Chunk::read(bytes, permit))).is_ok()
            }
            Err(error) => {
                let _ = tx.send(Err(error));
                false
            }
        };
        if !sent {
            stopped.store(true, Ordering::SeqCst);
            parts.close();
            while let Ok(part) = parts.try_recv() {
                part.task.abort();
            }
            return Ok(());
        }
    }
    tx.finish();
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::io::Read;
    use std::sync::Mutex;
    use std::time::{Duration, Instant};

    use bytes::Bytes;
    use proptest::prelude::*;

    use super::super::ShardReader;
    use super::sizes::tests::sample;
    use super::sizes::{part_cap, part_ceiling};
    use super::*;
    use crate::config::{StoreOptions, Transport};
    use crate::format::ByteSource;
    use crate::location::Location;
    use crate::stats::Counters;
    use crate::store::ranged::{Answer, Body, Failure, NextBytes};

    /// An object in memory: it logs every part issued of it and every
    /// request, answers after a few scheduler turns, and fails the request of the part at `fail_at`.
    /// With `ignore_range`, it answers every GET with the whole object
    /// (as a web server that ignores `Range` does), its body breaking once
    /// at `break_at`. With `serial`, GETs are answered one at a time, each
    /// after 2 ms (a server that copies the object for each, as moto does).
    struct MemoryObject {
        url: String,
        bytes: Arc<Vec<u8>>,
        issued: PartLog,
        log: PartLog,
        fail_at: Option<u64>,
        ignore_range: bool,
        serial: Option<Arc<tokio::sync::Mutex<()>>>,
        break_at: Mutex<Option<u64>>,
        transport: Transport,
        counters: Counters,
    }

    /// Parts by object URL, in the order issued or requested.
    type PartLog = Arc<Mutex<Vec<(String, Range<u64>)>>>;

    /// A body of `bytes[at..end]`, sent in pieces of 10,000 bytes, that
    /// breaks at `break_at`.
    struct MemoryBody {
        bytes: Arc<Vec<u8>>,
        at: usize,
        end: usize,
        break_at: Option<usize>,
    }

    impl Body for MemoryBody {
        fn next_bytes(&mut self) -> NextBytes<'_> {
            Box::pin(async move {
                tokio::task::yield_now().await;
                if self.break_at == Some(self.at) {
                    return Some(Err("connection reset".into()));
                }
                if self.at >= self.end {
                    return None;
                }
                let mut to = (self.at + 10_000).min(self.end);
                if let Some(cut) = self.break_at.filter(|&b| b > self.at) {
                    to = to.min(cut);
                }
                let piece = Bytes::copy_from_slice(&self.bytes[self.at..to]);
                self.at = to;
                Some(Ok(piece))
            })
        }
    }

    impl RangedObject for MemoryObject {
        fn url(&self) -> &str {
            &self.url
        }

        fn transport(&self) -> &Transport {
            &self.transport
        }

        fn counters(&self) -> &Counters {
            &self.counters
        }

        fn part_issued(&self, part: &Range<u64>) {
            self.issued
                .lock()
                .unwrap()
                .push((self.url.clone(), part.clone()));
        }

        async fn get(
            &self,
            position: u64,
            end: Option<u64>,
            clamp: bool,
            pinned: &mut Pinned,
        ) -> Result<Option<Answer>, Failure> {
            let range = position..end.unwrap_or(u64::MAX);
            self.log
                .lock()
                .unwrap()
                .push((self.url.clone(), range.clone()));
            let size = self.bytes.len() as u64;
            if let Some(serial) = &self.serial {
                let _one_at_a_time = serial.lock().await;
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            let turns = (range.start / 997 + size) % 7;
            for _ in 0..turns {
                tokio::task::yield_now().await;
            }
            if self.fail_at == Some(range.start) {
                return Err(Failure::Fatal(Error::Read {
                    url: self.url.clone(),
                    offset: range.start,
                    source: std::io::Error::other("gave up"),
                }));
            }
            // Every request after an object's first is pinned to its ETag.
            assert!(
                pinned.etag.is_some() || range.start == 0,
                "{}: part {range:?} not pinned",
                self.url,
            );
            pinned.etag = Some(format!("etag-{}", self.url));
            pinned.size = Some(size);
            pinned.confirmed = true;
            let stop = if clamp || end.is_none() {
                range.end.min(size)
            } else {
                range.end
            };
            assert!(stop <= size, "{}: {range:?} past {size}", self.url);
            let (from, skip, body_end) = if self.ignore_range {
                (0, position, size)
            } else {
                (position, 0, stop)
            };
            let break_at = self.break_at.lock().unwrap().take();
            Ok(Some(Answer {
                stop,
                skip,
                body_end,
                body: Box::new(MemoryBody {
                    bytes: self.bytes.clone(),
                    at: from as usize,
                    end: body_end as usize,
                    break_at: break_at.map(|b| b as usize),
                }),
            }))
        }
    }

    fn fetcher(budget: usize, part_size: usize, max_concurrency: usize) -> Fetcher {
        Fetcher {
            budget: Arc::new(Semaphore::new(budget)),
            cancelled: Arc::new(AtomicBool::new(false)),
            chunk_bytes: 1 << 20,
            map_chunk_bytes: 1 << 20,
            io_timeout: Duration::from_secs(20),
            counters: Arc::new(Counters::new()),
            budget_total: budget,
            store_options: Arc::new(StoreOptions {
                transport: Transport {
                    part_size,
                    max_concurrency,
                    ..Transport::default()
                },
                ..StoreOptions::default()
            }),
        }
    }

    fn content(seed: usize, len: usize) -> Vec<u8> {
        (0..len)
            .map(|i| ((i * 31 + seed * 7) % 251) as u8)
            .collect()
    }

    /// What a read of objects through one queue saw: each object's bytes
    /// (or its error's offset), the parts in the order issued, the
    /// budget's peak.
    struct Run {
        read: Vec<Result<Vec<u8>, u64>>,
        log: Vec<(String, Range<u64>)>,
        requests: Vec<(String, Range<u64>)>,
        peak: u64,
    }

    /// What the server of the objects does wrong: fails the request of
    /// object `fail.0`'s part at `fail.1`; ignores `Range`, each object's
    /// first body breaking at `break_at`; answers one GET at a time
    /// (`serial`).
    #[derive(Default, Clone, Copy)]
    struct Faults {
        fail: Option<(usize, u64)>,
        ignore_range: bool,
        break_at: Option<u64>,
        serial: bool,
    }

    /// Reads objects of `sizes` (`listed`: with their sizes known) through
    /// one queue, the way a read-ahead does, by a reader that takes
    /// `read_len` bytes at a time.
    fn read_through_queue(
        sizes: &[usize],
        listed: bool,
        (budget, part_size, max_concurrency): (usize, usize, usize),
        faults: Faults,
        read_len: usize,
    ) -> Run {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let fetcher = fetcher(budget, part_size, max_concurrency);
        let counters = fetcher.counters.clone();
        let log = Arc::new(Mutex::new(Vec::new()));
        let issued = Arc::new(Mutex::new(Vec::new()));
        let serial = Arc::new(tokio::sync::Mutex::new(()));
        let objects: Vec<_> = sizes
            .iter()
            .enumerate()
            .map(|(i, &len)| {
                let object = MemoryObject {
                    url: format!("mem://{i}"),
                    bytes: Arc::new(content(i, len)),
                    issued: issued.clone(),
                    log: log.clone(),
                    fail_at: faults.fail.filter(|f| f.0 == i).map(|f| f.1),
                    ignore_range: faults.ignore_range,
                    serial: faults.serial.then(|| serial.clone()),
                    break_at: Mutex::new(faults.break_at),
                    transport: Transport {
                        backoff_base: Duration::from_millis(1),
                        backoff_max: Duration::from_millis(2),
                        ..Transport::default()
                    },
                    counters: Counters::new(),
                };
                let unit = FetchUnit {
                    url: object.url.clone(),
                    location: Location::Http(object.url.clone()),
                    range: None,
                    size: listed.then_some(len as u64),
                    etag: None,
                    all_samples: false,
                };
                (Arc::new(object), unit)
            })
            .collect();
        let (shard_tx, shards) = std::sync::mpsc::channel();
        let count = objects.len();
        let mut queue = PartQueue::new(&fetcher);
        runtime.spawn(async move {
            let mut in_flight = VecDeque::new();
            for (object, unit) in objects {
                let (tx, rx) = std::sync::mpsc::channel();
                shard_tx
                    .send(ShardReader::new(&unit, rx, fetcher.io_timeout))
                    .ok();
                let sender = Arc::new(ChunkSender::new(tx));
                let Ok(task) = queue.push(&fetcher, object, &unit, sender).await else {
                    return;
                };
                in_flight.push_back(task);
                while in_flight.len() > max_concurrency {
                    let _ = in_flight.pop_front().unwrap().await;
                }
            }
            let _ = queue.drain(&fetcher).await;
            for task in in_flight {
                let _ = task.await;
            }
        });
        let mut read = Vec::new();
        for _ in 0..count {
            let mut reader = shards.recv_timeout(Duration::from_secs(20)).unwrap();
            let mut bytes = Vec::new();
            let mut buffer = vec![0; read_len];
            let outcome = loop {
                match reader.read(&mut buffer) {
                    Ok(0) => break Ok(bytes),
                    Ok(n) => bytes.extend_from_slice(&buffer[..n]),
                    Err(_) => match reader.take_failure() {
                        Some(Error::Read { offset, .. }) => break Err(offset),
                        other => panic!("unexpected {other:?}"),
                    },
                }
            };
            read.push(outcome);
        }
        runtime.shutdown_timeout(Duration::from_secs(2));
        let requests = log.lock().unwrap().clone();
        let issued = issued.lock().unwrap().clone();
        assert!(
            requests.len() >= issued.len().min(1),
            "parts were requested"
        );
        Run {
            read,
            log: issued,
            requests,
            peak: counters.snapshot().get(Counter::ReadAheadPeakBytes),
        }
    }

    /// Checks the order parts were issued in: each object's parts in order and
    /// once; a part of a later object before a part of an earlier one only
    /// if it is that later object's first part (the look-ahead).
    fn check_order(log: &[(String, Range<u64>)]) {
        let mut seen = HashSet::new();
        let mut next: std::collections::HashMap<&str, u64> = Default::default();
        for (i, (url, range)) in log.iter().enumerate() {
            assert!(seen.insert((url, range.start)), "{url} {range:?} twice");
            let at = next.entry(url).or_insert(0);
            assert_eq!(range.start, *at, "{url}: parts out of order");
            *at = range.end;
            if range.start > 0 {
                let index: usize = url[6..].parse().unwrap();
                for (other, earlier) in &log[..i] {
                    let other_index: usize = other[6..].parse().unwrap();
                    assert!(
                        other_index <= index || earlier.start == 0,
                        "{other} {earlier:?} went before {url} {range:?}"
                    );
                }
            }
        }
    }
    /// Part sizes fixed at `cap`.
    fn fixed(cap: u64) -> Arc<PartSizes> {
        Arc::new(PartSizes::new(1 << 62, cap, 1))
    }

    fn plan(range: Range<u64>, cap: u64) -> Vec<Range<u64>> {
        PartPlan::new(range, fixed(cap)).collect()
    }
    #[test]
    fn large_objects_arrive_whole_whichever_way_their_parts_go() {
        let sizes = [9_000_000, 10_500_000, 8_800_000];
        let budget = 2 << 20;
        for (listed, serial) in [(true, false), (false, false), (true, true), (false, true)] {
            let faults = Faults {
                serial,
                ..Faults::default()
            };
            let run = read_through_queue(&sizes, listed, (budget, 256 << 10, 8), faults, 65_536);
            for (i, read) in run.read.iter().enumerate() {
                assert_eq!(read.as_ref().unwrap(), &content(i, sizes[i]), "object {i}");
            }
            assert!(run.peak <= budget as u64, "{}", run.peak);
            check_order(&run.log);
            if !serial {
                continue;
            }
            // Parts gain nothing over a stream from a server that answers
            // one GET at a time: a stream is taken, a GET past its first
            // part, whatever size the parts were.
            let parts_in = |url: &String, get: &Range<u64>| {
                let within = |(u, p): &&(String, Range<u64>)| {
                    u == url && get.start <= p.start && p.end <= get.end
                };
                run.log.iter().filter(within).count()
            };
            assert!(run.requests.iter().any(|(u, r)| parts_in(u, r) > 1));
        }
    }

    #[test]
    fn the_first_part_stands_in_for_the_first_stream_probe_whether_or_not_the_size_is_listed() {
        let sizes = [9_000_000];
        for listed in [true, false] {
            let faults = Faults::default();
            let run = read_through_queue(&sizes, listed, (8 << 20, 1 << 20, 8), faults, 65_536);
            assert_eq!(run.read[0].as_ref().unwrap(), &content(0, sizes[0]));
            // The first GET after the first part is a probe of parts: it
            // asks for one part's bytes, not a stream's over four.
            let first_later = run.requests.iter().find(|(_, r)| r.start > 0).unwrap();
            let part = run.log.iter().find(|(_, p)| p.start == first_later.1.start);
            assert_eq!(
                part.map(|(_, p)| p.end),
                Some(first_later.1.end),
                "listed {listed}: {first_later:?}"
            );
        }
    }

    #[test]
    fn a_server_that_ignores_range_is_read_by_one_answer_per_object() {
        let sizes = [3_000_000, 700_000, 0, 250_000];
        let budget = 512 << 10;
        for (break_at, gets) in [(None, [1, 1, 1, 1]), (Some(1_000_003), [2, 1, 1, 1])] {
            let faults = Faults {
                ignore_range: true,
                break_at,
                ..Faults::default()
            };
            for listed in [true, false] {
                let run = read_through_queue(&sizes, listed, (budget, 64 << 10, 8), faults, 5000);
                for (i, read) in run.read.iter().enumerate() {
                    assert_eq!(read.as_ref().unwrap(), &content(i, sizes[i]), "object {i}");
                    let url = format!("mem://{i}");
                    let requests = run.requests.iter().filter(|(u, _)| *u == url).count();
                    // An empty object listed as such is not asked for.
                    let expected = if listed && sizes[i] == 0 { 0 } else { gets[i] };
                    assert_eq!(requests, expected, "GETs of object {i}");
                }
                // Many parts, each within the budget, read from one body.
                assert!(run.log.len() > 40, "{}", run.log.len());
                assert!(run.peak <= budget as u64, "{}", run.peak);
                check_order(&run.log);
            }
        }
    }

    #[test]
    fn parts_start_small_and_double_up_to_the_cap() {
        let mib = 1 << 20;
        let parts = plan(0..5 * mib, mib);
        let sizes: Vec<u64> = parts.iter().map(|p| p.end - p.start).collect();
        assert_eq!(sizes, [256 << 10, 512 << 10, mib, mib, mib, mib, 256 << 10]);
        assert_eq!(plan(100..100, mib), []);
        assert_eq!(plan(7..9, mib), vec![7..9; 1]);
        // A cap below the first part's size.
        assert_eq!(plan(0..10, 4), [0..4, 4..8, 8..10]);
    }

    #[test]
    fn a_plan_of_unknown_end_ends_at_the_size_learnt() {
        let mut parts = PartPlan::new(0..u64::MAX, fixed(1 << 20));
        assert_eq!(parts.next(), Some(0..FIRST_PART_BYTES));
        parts.end_at(FIRST_PART_BYTES + 10);
        assert_eq!(parts.next(), Some(FIRST_PART_BYTES..FIRST_PART_BYTES + 10));
        assert_eq!(parts.next(), None);
        // An object that ended within the first part.
        let mut parts = PartPlan::new(0..u64::MAX, fixed(1 << 20));
        parts.next();
        parts.end_at(5);
        assert_eq!(parts.next(), None);
    }

    #[test]
    fn every_object_arrives_whole_within_the_budget_in_order() {
        let sizes = [700_000, 0, 5, 300_000, 1_000_000, 64 << 10, 123_457];
        for listed in [true, false] {
            let budget = 256 << 10;
            let run = read_through_queue(
                &sizes,
                listed,
                (budget, 8 << 20, 8),
                Faults::default(),
                4096,
            );
            for (i, read) in run.read.iter().enumerate() {
                assert_eq!(read.as_ref().unwrap(), &content(i, sizes[i]), "object {i}");
            }
            assert!(run.peak <= budget as u64 && run.peak > 0, "{}", run.peak);
            check_order(&run.log);
            // Parts of 64 KiB (the cap the budget sets) at most.
            assert!(run.log.iter().all(|(_, r)| r.end - r.start <= 64 << 10));
        }
    }

    #[test]
    fn a_failed_part_mid_queue_is_its_objects_error_and_the_next_objects_arrive() {
        let sizes = [200_000, 500_000, 300_000];
        let fail_at = 256 << 10;
        let run = read_through_queue(
            &sizes,
            true,
            (1 << 20, 32 << 10, 6),
            Faults {
                fail: Some((1, fail_at)),
                ..Faults::default()
            },
            1000,
        );
        assert_eq!(run.read[0].as_ref().unwrap(), &content(0, sizes[0]));
        assert_eq!(run.read[1], Err(fail_at));
        assert_eq!(run.read[2].as_ref().unwrap(), &content(2, sizes[2]));
    }

    #[test]
    fn a_budget_of_one_part_does_not_deadlock() {
        let sizes = [100_000, 90_000, 250_000];
        // One part of the budget's size at a time; no look-ahead room.
        let run = read_through_queue(
            &sizes,
            true,
            (32 << 10, 32 << 10, 4),
            Faults::default(),
            333,
        );
        for (i, read) in run.read.iter().enumerate() {
            assert_eq!(read.as_ref().unwrap(), &content(i, sizes[i]));
        }
        assert!(run.peak <= 32 << 10);
        check_order(&run.log);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        #[test]
        fn any_objects_arrive_whole_within_any_budget(
            sizes in proptest::collection::vec(0usize..400_000, 1..6),
            listed in any::<bool>(),
            budget in 1usize..2_000_000,
            part_size in 1usize..300_000,
            max_concurrency in 2usize..12,
            read_len in 1usize..70_000,
            ignore_range in any::<bool>(),
            break_at in proptest::option::of(0u64..400_000),
        ) {
            // Parts are at least 1 KiB here, to keep each case short.
            let part_size = part_size.max(1024);
            let budget = budget.max(part_size.min(64 << 10));
            let faults = Faults { ignore_range, break_at, ..Faults::default() };
            let run = read_through_queue(
                &sizes, listed, (budget, part_size, max_concurrency), faults, read_len,
            );
            for (i, read) in run.read.iter().enumerate() {
                prop_assert_eq!(read.as_ref().unwrap(), &content(i, sizes[i]));
            }
            prop_assert!(run.peak <= budget as u64);
            check_order(&run.log);
            let ceiling = part_ceiling(budget as u64, part_size as u64, max_concurrency);
            prop_assert!(run.log.iter().all(|(_, r)| r.end - r.start <= ceiling));
            if ignore_range {
                // One GET per object, two where its body broke.
                prop_assert!(run.requests.len() <= 2 * sizes.len());
            }
        }
    }

    proptest! {
        #[test]
        fn parts_cover_the_range_once_in_order_within_the_sizes_set(
            start in 0u64..1 << 40,
            len in 0u64..64 << 20,
            budget in 1u64..1 << 30,
            part_size in 1u64..1 << 32,
            max_concurrency in 1usize..100,
            samples in proptest::collection::vec((0u64..200, 0u64..1 << 26, 0u64..500), 0..40),
        ) {
            let floor = part_cap(budget, part_size);
            let ceiling = part_ceiling(budget, part_size, max_concurrency);
            prop_assert!(floor >= 1 && floor <= budget.max(1) && floor <= part_size);
            prop_assert!(ceiling >= floor && ceiling <= part_size.max(floor));
            let sizes = Arc::new(PartSizes::new(budget, part_size, max_concurrency));
            let parts = PartPlan::new(start..start + len, sizes.clone());
            let mut samples = samples.into_iter();
            let start_at = Instant::now();
            let mut next = start;
            let mut previous = 0;
            for (i, part) in parts.enumerate() {
                prop_assert_eq!(part.start, next);
                let size = part.end - part.start;
                prop_assert!(size >= 1 && size <= ceiling);
                if i == 0 {
                    prop_assert!(size <= FIRST_PART_BYTES);
                } else {
                    // At most twice the part before.
                    prop_assert!(size <= 2 * previous);
                }
                // GETs measured between parts change the sizes after.
                if let Some((first_byte, bytes, transfer)) = samples.next() {
                    let at = start_at + Duration::from_millis(transfer * i as u64);
                    sizes.record_at(sample(first_byte, bytes, transfer), at);
                }
                let target = sizes.target();
                prop_assert!(target >= floor && target <= ceiling);
                previous = size;
                next = part.end;
            }
            prop_assert_eq!(next, start + len);
        }
    }
}
