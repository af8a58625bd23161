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

use std::collections::{BTreeSet, VecDeque};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, watch, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinHandle;

use super::fetch::{Chunk, ChunkSender, ConsumerGone, FetchUnit, Fetcher};
use super::ranged::{expected, stream_range, Sample, Tap, Target};
use crate::error::Error;
use crate::stats::Counter;
use crate::store::ranged::{short_part, Pinned, RangedObject};

/// The first part of an object, at most: small, so that parsing starts
/// after one short request.
pub(super) const FIRST_PART_BYTES: u64 = 256 << 10;

/// Parts of the smallest size that fit in the budget at once, at least
/// (unless that would make parts smaller than [`MIN_PART_CAP`]): enough
/// requests in flight to cover a first-byte latency, each short enough that
/// a per-connection bandwidth limit does not hold its budget long.
pub(super) const PARTS_PER_BUDGET: u64 = 32;

/// The smallest floor the budget sets on part sizes (a smaller
/// `part_size`, or budget, still applies).
const MIN_PART_CAP: u64 = 64 << 10;

/// Parts of the largest size that fit in the budget at once, at least
/// (and no fewer than `max_concurrency` allows).
pub(super) const STREAMS: u64 = 8;

/// The weight of the newest GET in the running estimates of latency and
/// bandwidth.
const NEWEST_WEIGHT: f64 = 0.25;

/// The rate parts are sized to sustain, over the rate they are fetched at.
const HEADROOM: f64 = 1.5;

/// The GETs over which the rate parts are fetched at is measured.
const RATE_WINDOW: usize = 32;

/// The size parts never need to go below: `part_size`, or less so that
/// [`PARTS_PER_BUDGET`] parts fit in `budget`; never more than the budget,
/// never 0. Part sizes start there before any GET is measured.
pub(super) fn part_cap(budget: u64, part_size: u64) -> u64 {
    (budget / PARTS_PER_BUDGET)
        .max(MIN_PART_CAP)
        .min(part_size)
        .min(budget)
        .max(1)
}

/// The largest part: `part_size`, or less so that `budget` holds
/// min([`STREAMS`], `max_concurrency`) parts; never below [`part_cap`].
pub(super) fn part_ceiling(budget: u64, part_size: u64, max_concurrency: usize) -> u64 {
    (budget / (max_concurrency as u64).clamp(1, STREAMS))
        .min(part_size)
        .max(part_cap(budget, part_size))
}

/// The size of the parts of every object of a queue, set from what its
/// GETs took. With budget `B`, parts of size `S` each taking the latency
/// `L` (time to the answer) and then `S/bw` (`bw`: bytes per second of a
/// body), the budget sustains `B / (L + S/bw)`; parts are the largest that
/// still sustain [`HEADROOM`] times the rate `R` parts are fetched at:
/// `S = bw · (B / 1.5R − L)`, within [`part_cap`] and [`part_ceiling`]. On
/// a server close by (`L` small, `bw` large) parts grow to the ceiling
/// (fewer GETs, less CPU); where `L` is large against the time the budget
/// lasts, they stay at the floor, so that many GETs are in flight to cover
/// the latency. `L` and `bw` are running estimates, each GET weighing
/// [`NEWEST_WEIGHT`]; `R` is the bytes of the last [`RATE_WINDOW`] GETs
/// over the time they took to complete; until two GETs are measured, parts
/// are [`part_cap`]. Which bytes a part holds never changes what is read.
#[derive(Debug)]
pub(super) struct PartSizes {
    budget: u64,
    floor: u64,
    ceiling: u64,
    estimate: Mutex<Estimate>,
}

/// What the GETs of a queue measured so far.
#[derive(Debug, Default)]
struct Estimate {
    /// Latency (seconds) and bandwidth (bytes per second), once measured.
    latency_bandwidth: Option<(f64, f64)>,
    /// When each of the last GETs completed, and its bytes.
    completed: VecDeque<(Instant, u64)>,
}

impl Estimate {
    /// Bytes per second over the GETs in the window (those after the first).
    fn rate(&self) -> Option<f64> {
        let (first, last) = (self.completed.front()?, self.completed.back()?);
        let span = last.0.duration_since(first.0).as_secs_f64();
        let bytes: u64 = self.completed.iter().skip(1).map(|c| c.1).sum();
        (span > 0.0).then(|| bytes as f64 / span)
    }
}

impl PartSizes {
    /// The sizes of parts over `budget`, at most `part_size`, with
    /// `max_concurrency` requests.
    pub(super) fn new(budget: u64, part_size: u64, max_concurrency: usize) -> Self {
        PartSizes {
            budget,
            floor: part_cap(budget, part_size),
            ceiling: part_ceiling(budget, part_size, max_concurrency),
            estimate: Mutex::new(Estimate::default()),
        }
    }

    /// Takes a GET's timing into the estimates, as completed now.
    pub(super) fn record(&self, sample: Sample) {
        self.record_at(sample, Instant::now());
    }

    /// Takes a GET's timing into the estimates, as completed at `now` (a
    /// body too short to time gives its latency only).
    fn record_at(&self, sample: Sample, now: Instant) {
        let latency = sample.first_byte.as_secs_f64();
        let transfer = sample.transfer.as_secs_f64();
        let rate = (transfer > 0.0 && sample.bytes > 0).then(|| sample.bytes as f64 / transfer);
        let mut estimate = self.estimate.lock().unwrap_or_else(|e| e.into_inner());
        estimate.latency_bandwidth = Some(match estimate.latency_bandwidth {
            None => (latency, rate.unwrap_or(0.0)),
            Some((l, bw)) => (
                l + NEWEST_WEIGHT * (latency - l),
                rate.map_or(bw, |r| {
                    if bw > 0.0 {
                        bw + NEWEST_WEIGHT * (r - bw)
                    } else {
                        r
                    }
                }),
            ),
        });
        if estimate.completed.len() == RATE_WINDOW {
            estimate.completed.pop_front();
        }
        estimate.completed.push_back((now, sample.bytes));
    }

    /// The size of the next parts, from the estimates so far.
    pub(super) fn target(&self) -> u64 {
        let estimate = self.estimate.lock().unwrap_or_else(|e| e.into_inner());
        match (estimate.latency_bandwidth, estimate.rate()) {
            (Some((latency, bandwidth)), Some(rate)) => self.size_for(latency, bandwidth, rate),
            _ => self.floor,
        }
    }

    /// The part size for `latency` seconds, `bandwidth` and a fetch `rate`
    /// (bytes per second).
    fn size_for(&self, latency: f64, bandwidth: f64, rate: f64) -> u64 {
        let spare = self.budget as f64 / (HEADROOM * rate) - latency;
        if spare.is_nan() || spare <= 0.0 {
            return self.floor;
        }
        ((bandwidth * spare).min(self.ceiling as f64) as u64).clamp(self.floor, self.ceiling)
    }

    /// The largest part.
    pub(super) fn ceiling(&self) -> u64 {
        self.ceiling
    }
}

/// The bytes of a unit after its first part from which its later parts
/// may be read as a stream: below, a few parts at most hold them.
const STREAM_MIN_BYTES: u64 = 8 << 20;

/// Later parts in each probe of a way of fetching them.
const PROBE_PARTS: u32 = 4;

/// The longest a probe, or the end of the GETs before it, is waited for.
const PROBE_LIMIT: Duration = Duration::from_secs(2);

/// How often a probe's end is looked for while parts wait for it.
const PROBE_POLL: Duration = Duration::from_millis(1);

/// Parts fetched the way chosen before both ways are probed again, the
/// first time; doubled each time the choice stands, up to [`MAX_HOLD`].
const FIRST_HOLD: u64 = 64;

/// The most parts fetched between two rounds of probes.
const MAX_HOLD: u64 = 1 << 16;

/// How much faster than one stream parallel parts must be to be taken:
/// a server that does not serve them faster gets the fewer requests.
const MARGIN: f64 = 1.25;

/// How far past its own parts a probe of parts is projected: to at most
/// this many times [`PROBE_PARTS`] parts in flight (fewer where the budget
/// or `max_concurrency` hold fewer).
const PROJECTION_REACH: u32 = 4;

/// How the later parts of an object (all but the first) are fetched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    /// Each part by a GET of its own, as many at once as the budget and
    /// `max_concurrency` allow.
    Parts,
    /// Every part in turn from one GET that runs to the unit's end.
    Stream,
}

impl Mode {
    fn other(self) -> Mode {
        match self {
            Mode::Parts => Mode::Stream,
            Mode::Stream => Mode::Parts,
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Chooses how the later parts of a queue's objects (of units of at least
/// [`STREAM_MIN_BYTES`] after their first part) are fetched, from the
/// rate each way achieves. A probe fetches [`PROBE_PARTS`] later parts one
/// way: it starts once no part of the queue is in flight, no part goes out
/// while it is measured, so that it has the server to itself.
///
/// A stream's probe measures one GET: the time to its answer and the rate
/// of its body ([`OneGet`]). A probe of parts measures how much four GETs
/// at once gain over the same parts fetched one after another (the time
/// [`OneGet`] gives them): a server that serves GETs side by side, each at
/// its own connection's rate (S3, a remote store), gains about four times;
/// one whose total stays flat (a server on this machine answering one GET
/// at a time) gains nothing. The gain fits Amdahl's law, which projects
/// the parts' rate to the parts the queue keeps in flight (the budget and
/// `max_concurrency` allow, at most [`PROJECTION_REACH`] times the probe's).
/// A probe of parts that could no longer win even if its parts ended now
/// is cut short. The first round probes a stream, then parts; parts are
/// taken if they are at least [`MARGIN`] times faster, else the stream,
/// for a hold of [`FIRST_HOLD`] parts, after which both ways are probed
/// again (the way not chosen first); the hold doubles each time the choice
/// stands. No wait lasts longer than about [`PROBE_LIMIT`]. Which way a
/// part is fetched never changes which bytes it holds.
#[derive(Debug)]
pub(super) struct Tuner {
    state: Mutex<Tuning>,
    /// The queue's budget (bytes) and its most requests in flight: what
    /// bounds the parts a probe of parts is projected to.
    budget: u64,
    max_concurrency: u32,
}

/// One GET at a time, as a stream's probe measured it.
#[derive(Debug, Clone, Copy, PartialEq)]
struct OneGet {
    /// Seconds from the request to its answer's first byte.
    latency: f64,
    /// Bytes per second of its body.
    bandwidth: f64,
}

impl OneGet {
    /// Seconds one GET at a time would take for `parts` parts of `bytes`
    /// bytes in all.
    fn serial_seconds(self, parts: u32, bytes: u64) -> f64 {
        f64::from(parts) * self.latency + bytes as f64 / self.bandwidth
    }
}

/// What a [`Tuner`] measured and decided so far.
#[derive(Debug)]
struct Tuning {
    /// The way parts are fetched outside probes.
    chosen: Mode,
    /// The probes still to run before the next choice, in order.
    queued: VecDeque<Mode>,
    /// The probe under way.
    probe: Option<Probe>,
    /// Each way's rate (bytes per second) in its last probe (of parts:
    /// as projected).
    rates: [Option<f64>; 2],
    /// One GET at a time, from the last stream probe measured whole.
    one_get: Option<OneGet>,
    /// Parts to fetch the way chosen before the next probes.
    until_probe: u64,
    /// What `until_probe` is set to at the next choice that stands.
    hold: u64,
    /// Probes started so far (each probe's id).
    probes: u64,
    /// Parts of the queue in flight.
    active: u32,
    /// Since when the next probe waits for the parts in flight to end.
    quiet_wait: Option<Instant>,
}

/// A probe: its parts issued, not yet ended, and their bytes.
#[derive(Debug)]
struct Probe {
    id: u64,
    mode: Mode,
    issued: u32,
    pending: u32,
    bytes: u64,
    /// The bytes of its first part, and from there to its unit's end.
    first_bytes: u64,
    span: u64,
    /// When its first part was issued.
    started: Instant,
    /// When its first part to end ended, and its last.
    first_end: Option<Instant>,
    last_end: Option<Instant>,
    /// Whether a part of it failed or was cancelled (no rate is taken).
    failed: bool,
}

impl Probe {
    /// Whether it is measured at `now`: every part ended, or (a probe of
    /// parts) it could not reach [`MARGIN`] times `stream_rate` even if
    /// its parts ended now, or it took [`PROBE_LIMIT`].
    fn measured(&self, now: Instant, stream_rate: Option<f64>, projection: Projection) -> bool {
        let elapsed = now.saturating_duration_since(self.started);
        let behind = self.mode == Mode::Parts
            && stream_rate.is_some_and(|rate| self.rate(now, projection) < MARGIN * rate);
        self.pending == 0 || behind || elapsed >= PROBE_LIMIT
    }

    /// The rate (bytes per second) it measured, at `now` (as if its parts
    /// in flight ended now). Of parts: as projected (see [`Tuner`]), or
    /// without a [`OneGet`] their bytes over the time from the first issue
    /// to the last end. Of a stream, whose GET is paid once per unit: the
    /// rate of reading the rest of the first part's unit, from the time
    /// to its first part's end and the rate of the parts after it.
    fn rate(&self, now: Instant, projection: Projection) -> f64 {
        let last = self.last_end.filter(|_| self.pending == 0).unwrap_or(now);
        let seconds = |from: Instant, to: Instant| to.saturating_duration_since(from).as_secs_f64();
        let elapsed = seconds(self.started, last).max(1e-6);
        let whole = self.bytes as f64 / elapsed;
        if self.mode == Mode::Parts {
            return projection.rate(self.issued, self.bytes, elapsed);
        }
        let Some(first_end) = self.first_end else {
            return whole;
        };
        let (flow_bytes, flow_time) = (self.bytes - self.first_bytes, seconds(first_end, last));
        if self.pending > 0 || flow_bytes == 0 || flow_time <= 0.0 {
            return whole;
        }
        let rest = self.span.saturating_sub(self.first_bytes) as f64;
        let time = seconds(self.started, first_end) + rest * flow_time / flow_bytes as f64;
        (self.span as f64 / time.max(1e-6)).max(whole)
    }

    /// One GET, from a stream's probe whose parts all ended well: its
    /// body's rate after the first part, and the time to its answer (the
    /// first part's end less that part's transfer).
    fn one_get(&self) -> Option<OneGet> {
        let (first_end, last_end) = (self.first_end?, self.last_end?);
        if self.mode != Mode::Stream || self.failed || self.pending > 0 {
            return None;
        }
        let flow_bytes = self
            .bytes
            .checked_sub(self.first_bytes)
            .filter(|&b| b > 0)?;
        let flow_time = last_end.saturating_duration_since(first_end).as_secs_f64();
        let bandwidth = (flow_time > 0.0).then(|| flow_bytes as f64 / flow_time)?;
        let answered = first_end
            .saturating_duration_since(self.started)
            .as_secs_f64();
        let latency = (answered - self.first_bytes as f64 / bandwidth).max(0.0);
        Some(OneGet { latency, bandwidth })
    }
}

/// What a probe of parts is projected with: one GET at a time as measured
/// (if it was), and the parts the queue keeps in flight.
#[derive(Debug, Clone, Copy)]
struct Projection {
    one_get: Option<OneGet>,
    reach: f64,
}

impl Projection {
    /// The rate of `parts` parts of `bytes` in all fetched at once in
    /// `elapsed` seconds, projected to `reach` parts in flight. Their gain
    /// over one GET at a time, `s = serial / elapsed`, fits Amdahl's law
    /// `s(k) = k / (1 + (k - 1) c)` at `k = parts`, which gives the part
    /// `c` of a GET's time that does not overlap with others'; `s(reach)`
    /// times the one-at-a-time rate is the projection. No gain (`s <= 1`),
    /// or no [`OneGet`]: the rate measured.
    fn rate(self, parts: u32, bytes: u64, elapsed: f64) -> f64 {
        let measured = bytes as f64 / elapsed;
        let Some(one_get) = self.one_get else {
            return measured;
        };
        let serial = one_get.serial_seconds(parts, bytes);
        let gain = serial / elapsed;
        let k = f64::from(parts);
        if gain <= 1.0 || k < 2.0 || !serial.is_finite() {
            return measured;
        }
        let contention = ((k / gain - 1.0) / (k - 1.0)).clamp(0.0, 1.0);
        let reach = self.reach.max(k);
        let projected = reach / (1.0 + (reach - 1.0) * contention);
        (bytes as f64 / serial * projected).max(measured)
    }
}

/// What the next part does: goes out the given way (as part of the probe
/// given), or waits.
#[derive(Debug, PartialEq, Eq)]
enum Step {
    Issue(Mode, Option<u64>),
    Wait,
}

/// A part in flight, as its [`Tuner`] counts it: tells the tuner when it
/// ends, however it ends (a fetch task cancelled ends it as failed).
pub(super) struct Flight {
    tuner: Arc<Tuner>,
    probe: Option<u64>,
    ok: bool,
}

impl Drop for Flight {
    fn drop(&mut self) {
        self.tuner.ended(self.probe, self.ok, Instant::now());
    }
}

impl Tuner {
    /// A tuner of a queue over `budget` bytes with at most
    /// `max_concurrency` requests in flight.
    pub(super) fn new(budget: u64, max_concurrency: usize) -> Self {
        Tuner {
            state: Mutex::new(Tuning {
                chosen: Mode::Parts,
                queued: VecDeque::from([Mode::Stream, Mode::Parts]),
                probe: None,
                rates: [None; 2],
                one_get: None,
                until_probe: 0,
                hold: FIRST_HOLD / 2,
                probes: 0,
                active: 0,
                quiet_wait: None,
            }),
            budget,
            max_concurrency: u32::try_from(max_concurrency).unwrap_or(u32::MAX),
        }
    }

    /// How a probe of parts with `bytes` in `parts` parts is projected:
    /// to the parts of that size the budget and `max_concurrency` keep in
    /// flight, at most [`PROJECTION_REACH`] times [`PROBE_PARTS`].
    fn projection(&self, tuning: &Tuning, parts: u32, bytes: u64) -> Projection {
        let part = (bytes / u64::from(parts.max(1))).max(1);
        let fit = u32::try_from(self.budget / part).unwrap_or(u32::MAX);
        let reach = fit
            .min(self.max_concurrency)
            .clamp(1, PROJECTION_REACH * PROBE_PARTS);
        Projection {
            one_get: tuning.one_get,
            reach: f64::from(reach),
        }
    }

    /// The projection of the probe under way (if any).
    fn probe_projection(&self, tuning: &Tuning) -> Projection {
        let (issued, bytes) = tuning
            .probe
            .as_ref()
            .map_or((1, 1), |p| (p.issued, p.bytes));
        self.projection(tuning, issued, bytes)
    }

    /// Lets an object's first part (never part of a probe) go, once no
    /// probe is being measured.
    pub(super) async fn first(self: &Arc<Self>, cancelled: &AtomicBool) -> Flight {
        self.wait_for(cancelled, |tuner, now| tuner.step_first(now))
            .await
            .1
    }

    /// How the next later part, `part` of a unit ending at `unit_end`, is
    /// fetched: waits while a probe is being measured, or waits to start.
    pub(super) async fn next(
        self: &Arc<Self>,
        part: &Range<u64>,
        unit_end: u64,
        cancelled: &AtomicBool,
    ) -> (Mode, Flight) {
        let (len, span) = (part.end - part.start, unit_end.saturating_sub(part.start));
        self.wait_for(cancelled, |tuner, now| tuner.step(len, span, now))
            .await
    }

    /// Takes `step`'s answer, waiting while it says so (at most about
    /// twice [`PROBE_LIMIT`], less once `cancelled`).
    async fn wait_for(
        self: &Arc<Self>,
        cancelled: &AtomicBool,
        step: impl Fn(&Tuner, Instant) -> Step,
    ) -> (Mode, Flight) {
        let turns = 2 * PROBE_LIMIT.as_millis() / PROBE_POLL.as_millis().max(1);
        let mut outcome = None;
        for _ in 0..turns {
            match step(self, Instant::now()) {
                Step::Issue(mode, probe) => {
                    outcome = Some((mode, probe));
                    break;
                }
                Step::Wait if cancelled.load(Ordering::SeqCst) => break,
                Step::Wait => tokio::time::sleep(PROBE_POLL).await,
            }
        }
        let (mode, probe) = outcome.unwrap_or_else(|| {
            let mut tuning = self.lock();
            tuning.active += 1;
            (tuning.chosen, None)
        });
        let flight = Flight {
            tuner: self.clone(),
            probe,
            ok: false,
        };
        (mode, flight)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Tuning> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// What an object's first part does at `now`.
    fn step_first(&self, now: Instant) -> Step {
        let mut tuning = self.lock();
        let stream_rate = tuning.rates[Mode::Stream.index()];
        let projection = self.probe_projection(&tuning);
        let measuring = tuning.probe.as_ref().is_some_and(|probe| {
            probe.issued == PROBE_PARTS && !probe.measured(now, stream_rate, projection)
        });
        if measuring {
            return Step::Wait;
        }
        tuning.active += 1;
        Step::Issue(Mode::Parts, None)
    }

    /// What the next later part of `len` bytes, `span` bytes from its
    /// unit's end, does at `now`.
    fn step(&self, len: u64, span: u64, now: Instant) -> Step {
        let mut tuning = self.lock();
        // A probe ends, the next starts, and the part goes: a few turns.
        for _ in 0..6 {
            let stream_rate = tuning.rates[Mode::Stream.index()];
            let projection = self.probe_projection(&tuning);
            if let Some(probe) = tuning.probe.as_mut() {
                if probe.issued < PROBE_PARTS {
                    if probe.issued == 0 {
                        probe.started = now;
                        (probe.first_bytes, probe.span) = (len, span.max(len));
                    }
                    probe.issued += 1;
                    probe.pending += 1;
                    probe.bytes = probe.bytes.saturating_add(len);
                    let issue = Step::Issue(probe.mode, Some(probe.id));
                    tuning.active += 1;
                    return issue;
                }
                if !probe.measured(now, stream_rate, projection) {
                    return Step::Wait;
                }
                tuning.conclude(now, projection);
            } else if !tuning.queued.is_empty() {
                // A probe starts with the server to itself.
                let since = *tuning.quiet_wait.get_or_insert(now);
                if tuning.active > 0 && now.saturating_duration_since(since) < PROBE_LIMIT {
                    return Step::Wait;
                }
                tuning.quiet_wait = None;
                let mode = tuning.queued.pop_front().unwrap_or(Mode::Parts);
                tuning.probes += 1;
                tuning.probe = Some(Probe {
                    id: tuning.probes,
                    mode,
                    issued: 0,
                    pending: 0,
                    bytes: 0,
                    first_bytes: 0,
                    span: 0,
                    started: now,
                    first_end: None,
                    last_end: None,
                    failed: false,
                });
            } else if tuning.until_probe == 0 {
                let chosen = tuning.chosen;
                tuning.queued.extend([chosen.other(), chosen]);
            } else {
                tuning.until_probe -= 1;
                tuning.active += 1;
                return Step::Issue(tuning.chosen, None);
            }
        }
        tuning.active += 1;
        Step::Issue(tuning.chosen, None)
    }

    /// A part ended at `now` (`ok`: with its bytes), of `probe` if given.
    fn ended(&self, probe: Option<u64>, ok: bool, now: Instant) {
        let mut tuning = self.lock();
        tuning.active = tuning.active.saturating_sub(1);
        let Some(probe) = probe else {
            return;
        };
        if let Some(current) = tuning.probe.as_mut().filter(|p| p.id == probe) {
            current.pending = current.pending.saturating_sub(1);
            current.failed |= !ok;
            current.first_end.get_or_insert(now);
            current.last_end = Some(now);
        }
    }

    /// Counts a part that goes out whatever the probes (one that follows a
    /// stream to its unit's end).
    pub(super) fn track(self: &Arc<Self>) -> Flight {
        self.lock().active += 1;
        Flight {
            tuner: self.clone(),
            probe: None,
            ok: false,
        }
    }

    /// The parts probe `probe` takes after those issued so far (0 once it
    /// is over).
    pub(super) fn probe_left(&self, probe: u64) -> u32 {
        let tuning = self.lock();
        match &tuning.probe {
            Some(current) if current.id == probe => PROBE_PARTS - current.issued,
            _ => 0,
        }
    }
}

impl Tuning {
    /// Takes the probe under way as measured at `now` (of parts: with
    /// `projection`); chooses once no probe is left in the round.
    fn conclude(&mut self, now: Instant, projection: Projection) {
        let Some(probe) = self.probe.take() else {
            return;
        };
        if !probe.failed {
            self.rates[probe.mode.index()] = Some(probe.rate(now, projection));
        }
        if let Some(one_get) = probe.one_get() {
            self.one_get = Some(one_get);
        }
        if !self.queued.is_empty() {
            return;
        }
        let (parts, stream) = (
            self.rates[Mode::Parts.index()],
            self.rates[Mode::Stream.index()],
        );
        let choice = match (parts, stream) {
            (Some(parts), Some(stream)) if parts > MARGIN * stream => Mode::Parts,
            (_, Some(_)) => Mode::Stream,
            _ => self.chosen,
        };
        if choice != self.chosen {
            self.chosen = choice;
            self.hold = FIRST_HOLD;
        } else {
            self.hold = self.hold.saturating_mul(2).clamp(1, MAX_HOLD);
        }
        self.until_probe = self.hold;
    }
}

/// The parts of a byte range, in order: the first of at most
/// [`FIRST_PART_BYTES`], each next one twice the one before, up to the
/// size [`PartSizes`] sets when it is cut.
#[derive(Debug, Clone)]
pub(super) struct PartPlan {
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
    pub(super) fn new(range: Range<u64>, sizes: Arc<PartSizes>) -> Self {
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
    pub(super) fn boundary(&mut self, at: u64) {
        self.boundary = at;
    }

    /// Ends the plan at `end` (an object's size, once known), or where the
    /// parts planned so far end, whichever comes last.
    pub(super) fn end_at(&mut self, end: u64) {
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
        let options = &fetcher.s3_options;
        let budget = fetcher.budget_bytes() as u64;
        let sizes = PartSizes::new(
            budget,
            options.transport.part_size as u64,
            options.transport.max_concurrency,
        );
        PartQueue {
            slots: Arc::new(Semaphore::new(options.transport.max_concurrency.max(1))),
            allowance: budget.saturating_sub(2 * sizes.ceiling()),
            sizes: Arc::new(sizes),
            tuner: Arc::new(Tuner::new(budget, options.transport.max_concurrency)),
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
    let (mut pinned, clamp, answer, follows, reach) = match role {
        Role::First {
            pinned,
            clamp,
            answer,
        } => (pinned, clamp, Some(answer), false, range.end),
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
    let result = stream_range(
        &*object,
        (range.clone(), reach),
        clamp,
        &mut pinned,
        &mut buffer,
        (Some(&shared.tap), &|sample| sizes.record(sample)),
    )
    .await;
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
    use std::time::Duration;

    use bytes::Bytes;
    use proptest::prelude::*;

    use super::super::ShardReader;
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
    /// at `break_at`.
    struct MemoryObject {
        url: String,
        bytes: Arc<Vec<u8>>,
        issued: PartLog,
        log: PartLog,
        fail_at: Option<u64>,
        ignore_range: bool,
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
            io_timeout: Duration::from_secs(20),
            counters: Arc::new(Counters::new()),
            budget_total: budget,
            s3_options: Arc::new(StoreOptions {
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
    /// first body breaking at `break_at`.
    #[derive(Default, Clone, Copy)]
    struct Faults {
        fail: Option<(usize, u64)>,
        ignore_range: bool,
        break_at: Option<u64>,
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

    fn sample(first_byte_ms: u64, bytes: u64, transfer_ms: u64) -> Sample {
        Sample {
            first_byte: Duration::from_millis(first_byte_ms),
            bytes,
            transfer: Duration::from_millis(transfer_ms),
        }
    }

    #[test]
    fn parts_grow_on_a_low_latency_server_and_stay_small_on_a_high_latency_one() {
        let mib = 1 << 20;
        // The defaults: 32 MiB, 8 MiB parts, 64 requests.
        let sizes = PartSizes::new(32 * mib, 8 * mib, 64);
        assert_eq!((sizes.target(), sizes.ceiling()), (mib, 4 * mib));
        // 20 ms to the answer, 100 MB/s, fetched at 450 MB/s: the budget
        // lasts 49.7 ms at 675 MB/s, 29.7 ms of it past the latency.
        let proxied = sizes.size_for(0.020, 1e8, 4.5e8);
        assert!((2_971_000..2_971_050).contains(&proxied), "{proxied}");
        // 2 ms, 1 GB/s, at 700 MB/s: the ceiling.
        assert_eq!(sizes.size_for(0.002, 1e9, 7e8), 4 * mib);
        // 30 ms, 80 MB/s, at 1 GB/s: the latency outlasts the budget.
        assert_eq!(sizes.size_for(0.030, 8e7, 1e9), mib);
        assert_eq!(sizes.size_for(0.0, 1e9, 0.0), 4 * mib);
        // Measured: 20 ms and 100 MB/s for each GET of 1 MB, one GET
        // completing every 2.5 ms (400 MB/s).
        let start = Instant::now();
        for i in 0..40 {
            let at = start + Duration::from_micros(2500 * i);
            sizes.record_at(sample(20, 1_000_000, 10), at);
        }
        // B / 1.5R - L = 55.9 ms - 20 ms, at 100 MB/s.
        let measured = sizes.target();
        assert!((3_592_400..3_592_410).contains(&measured), "{measured}");
        // One GET is no rate yet.
        let one = PartSizes::new(32 * mib, 8 * mib, 64);
        one.record(sample(1, 1000, 1));
        assert_eq!(one.target(), mib);
        // Fewer requests than streams: larger parts, never past part_size.
        assert_eq!(part_ceiling(32 * mib, 8 * mib, 2), 8 * mib);
        assert_eq!(part_ceiling(32 * mib, 2 * mib, 64), 2 * mib);
        // A small budget: the floor.
        assert_eq!(part_ceiling(256 << 10, 8 * mib, 64), 64 << 10);
    }

    /// Drives `tuner` through a probe of `mode` whose four parts of 1 MiB,
    /// `span` bytes from their unit's end, are issued at `start` and end
    /// at the offsets (ms) given; the instant the last ended.
    fn probe(tuner: &Tuner, mode: Mode, start: Instant, ends_ms: [u64; 4]) -> Instant {
        let mib = 1 << 20;
        let mut id = None;
        for _ in 0..4 {
            match tuner.step(mib, 64 * mib, start) {
                Step::Issue(m, Some(probe)) if m == mode => id = Some(probe),
                other => panic!("{other:?} in a probe of {mode:?}"),
            }
        }
        assert_eq!(tuner.step(mib, 64 * mib, start), Step::Wait);
        for ms in ends_ms {
            tuner.ended(id, true, start + Duration::from_millis(ms));
        }
        start + Duration::from_millis(ends_ms[3])
    }

    #[test]
    fn the_tuner_streams_where_parts_are_not_faster_and_keeps_parts_where_they_are() {
        let mib = 1 << 20;
        // A server that answers one GET at a time, each 100 ms: the stream
        // probe's first part ends after 10 ms and the stream runs on at
        // 100 MiB/s; the parts probe is cut short once behind it.
        let serial = Tuner::new(64 << 20, 64);
        let t0 = Instant::now();
        let t1 = probe(&serial, Mode::Stream, t0, [10, 20, 30, 40]);
        let t2 = t1 + Duration::from_millis(1);
        let mut id = None;
        for _ in 0..4 {
            match serial.step(mib, 64 * mib, t2) {
                Step::Issue(Mode::Parts, Some(probe)) => id = Some(probe),
                other => panic!("{other:?}"),
            }
        }
        serial.ended(id, true, t2 + Duration::from_millis(100));
        assert_eq!(
            serial.step(mib, 64 * mib, t2 + Duration::from_millis(20)),
            Step::Wait
        );
        // 45 ms in, 4 MiB is behind 100 MiB/s: the stream is taken.
        let t3 = t2 + Duration::from_millis(45);
        assert_eq!(
            serial.step(mib, 64 * mib, t3),
            Step::Issue(Mode::Stream, None)
        );
        assert_eq!(serial.lock().chosen, Mode::Stream);
        // The parts still in flight end; the stream holds FIRST_HOLD parts,
        // then both ways are probed again, parts first.
        for _ in 0..3 {
            serial.ended(id, true, t3);
        }
        for _ in 1..FIRST_HOLD {
            assert_eq!(
                serial.step(mib, 64 * mib, t3),
                Step::Issue(Mode::Stream, None)
            );
        }
        // Parts in flight (the hold's) are waited for before a probe.
        assert_eq!(serial.step(mib, 64 * mib, t3), Step::Wait);
        for _ in 0..FIRST_HOLD + 1 {
            serial.ended(None, true, t3);
        }
        assert!(matches!(
            serial.step(mib, 64 * mib, t3),
            Step::Issue(Mode::Parts, Some(_))
        ));

        // A remote store: 30 ms to the first part's end, a stream of
        // 25 MiB/s; four parts at once all end after 60 ms (66 MiB/s).
        let remote = Tuner::new(64 << 20, 64);
        let t1 = probe(&remote, Mode::Stream, t0, [30, 70, 110, 150]);
        let t2 = probe(&remote, Mode::Parts, t1, [55, 58, 59, 60]);
        assert_eq!(
            remote.step(mib, 64 * mib, t2),
            Step::Issue(Mode::Parts, None)
        );
        assert_eq!(remote.lock().chosen, Mode::Parts);
    }

    #[test]
    fn parallel_parts_are_taken_behind_a_cap_per_connection_and_not_from_a_flat_server() {
        let mib = 1 << 20;
        let ms = Duration::from_millis;
        // 20 ms to the first byte, 100 MiB/s per connection (S3, the bench
        // server's proxy): four parts at once end after 33-36 ms, only 1.15
        // times the stream's rate, but each kept its connection's rate: the
        // queue's 16 parts in flight would be several times the stream.
        let capped = Tuner::new(64 << 20, 64);
        let t0 = Instant::now();
        let t1 = probe(&capped, Mode::Stream, t0, [30, 40, 50, 60]);
        let t2 = probe(&capped, Mode::Parts, t1, [33, 34, 35, 36]);
        let one_get = capped
            .lock()
            .one_get
            .expect("the stream probe measured one GET");
        assert!((one_get.latency - 0.02).abs() < 1e-3, "{one_get:?}");
        assert!(
            (one_get.bandwidth / mib as f64 - 100.0).abs() < 1.0,
            "{one_get:?}"
        );
        assert_eq!(
            capped.step(mib, 64 * mib, t2),
            Step::Issue(Mode::Parts, None)
        );
        let rates = capped.lock().rates;
        let (parts, stream) = (rates[0].unwrap(), rates[1].unwrap());
        assert!(parts > 2.0 * stream, "parts {parts}, stream {stream}");

        // A server whose total stays flat: it answers one GET at a time,
        // each after 20 ms (a server on this machine copying the object),
        // bodies at 200 MiB/s. Once the parts can no longer win, even if
        // they ended at once, the probe is cut short and the stream taken.
        let flat = Tuner::new(64 << 20, 64);
        let t1 = probe(&flat, Mode::Stream, t0, [25, 30, 35, 40]);
        let t2 = t1 + ms(1);
        let mut id = None;
        for _ in 0..4 {
            match flat.step(mib, 64 * mib, t2) {
                Step::Issue(Mode::Parts, Some(probe)) => id = Some(probe),
                other => panic!("{other:?}"),
            }
        }
        flat.ended(id, true, t2 + ms(25));
        assert_eq!(flat.step(mib, 64 * mib, t2 + ms(30)), Step::Wait);
        assert_eq!(
            flat.step(mib, 64 * mib, t2 + ms(50)),
            Step::Issue(Mode::Stream, None)
        );
        assert_eq!(flat.lock().chosen, Mode::Stream);
    }

    #[test]
    fn a_projection_never_falls_below_the_rate_measured_and_equals_it_at_the_probe_size() {
        let one_get = Some(OneGet {
            latency: 0.02,
            bandwidth: 100e6,
        });
        for elapsed in [0.01, 0.03, 0.05, 0.08, 0.2, 1.0] {
            let measured = 4e6 / elapsed;
            let at_probe = Projection {
                one_get,
                reach: 4.0,
            }
            .rate(4, 4_000_000, elapsed);
            assert!((at_probe - measured).abs() <= 1e-6 * measured, "{elapsed}");
            let mut last = at_probe;
            for reach in [8.0, 16.0, 64.0] {
                let projected = Projection { one_get, reach }.rate(4, 4_000_000, elapsed);
                assert!(projected >= last, "{elapsed} {reach}");
                last = projected;
            }
            // No gain over one GET at a time (0.12 s serially): no projection.
            if elapsed >= 0.12 {
                assert_eq!(last, measured);
            }
            let unmeasured = Projection {
                one_get: None,
                reach: 64.0,
            };
            assert_eq!(unmeasured.rate(4, 4_000_000, elapsed), measured);
        }
    }

    #[test]
    fn a_failed_probe_gives_no_rate_and_no_wait_outlasts_the_limit() {
        let mib = 1 << 20;
        let tuner = Tuner::new(64 << 20, 64);
        let t0 = Instant::now();
        let mut id = None;
        for _ in 0..4 {
            if let Step::Issue(Mode::Stream, probe) = tuner.step(mib, 64 * mib, t0) {
                id = probe;
            }
        }
        tuner.ended(id, false, t0);
        for _ in 0..3 {
            tuner.ended(id, true, t0 + Duration::from_millis(5));
        }
        // Measured, without a rate: the parts probe follows; its parts
        // never end, and it counts as measured after PROBE_LIMIT.
        let t1 = t0 + Duration::from_millis(6);
        for _ in 0..4 {
            assert!(matches!(
                tuner.step(mib, 64 * mib, t1),
                Step::Issue(Mode::Parts, Some(_))
            ));
        }
        assert_eq!(tuner.step(mib, 64 * mib, t1 + PROBE_LIMIT / 2), Step::Wait);
        let late = t1 + PROBE_LIMIT;
        assert_eq!(
            tuner.step(mib, 64 * mib, late),
            Step::Issue(Mode::Parts, None)
        );
        assert_eq!(tuner.lock().rates[Mode::Stream.index()], None);
        // A first part waits only while a probe is measured.
        assert_eq!(tuner.step_first(late), Step::Issue(Mode::Parts, None));
    }

    #[test]
    fn large_objects_arrive_whole_whichever_way_their_parts_go() {
        let sizes = [9_000_000, 10_500_000, 8_800_000];
        let budget = 2 << 20;
        for listed in [true, false] {
            let faults = Faults::default();
            let run = read_through_queue(&sizes, listed, (budget, 256 << 10, 8), faults, 65_536);
            for (i, read) in run.read.iter().enumerate() {
                assert_eq!(read.as_ref().unwrap(), &content(i, sizes[i]), "object {i}");
            }
            assert!(run.peak <= budget as u64, "{}", run.peak);
            check_order(&run.log);
            // The first probe is a stream: a GET past its first part.
            let ceiling = part_ceiling(budget as u64, 256 << 10, 8);
            assert!(run.requests.iter().any(|(_, r)| r.end - r.start > ceiling));
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
    fn the_cap_lets_many_parts_share_the_budget() {
        let mib = 1 << 20;
        // The defaults: 32 MiB, 8 MiB parts.
        assert_eq!(part_cap(32 * mib, 8 * mib), mib);
        assert_eq!(part_cap(1 << 30, 8 * mib), 8 * mib);
        assert_eq!(part_cap(256 << 10, 128 << 10), 64 << 10);
        assert_eq!(part_cap(16 << 10, 8 * mib), 16 << 10);
        assert_eq!(part_cap(32 * mib, 1), 1);
        assert_eq!(part_cap(0, 0), 1);
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
