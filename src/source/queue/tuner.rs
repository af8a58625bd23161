//! How the later parts of a queue's objects are fetched: the [`Tuner`]
//! probes each part by a GET of its own against every part from one GET
//! (a stream), takes the faster ([`Mode`]) and probes again now and then.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::super::remote_reads::Sample;
use super::sizes::PartSizes;

/// The bytes of a unit after its first part from which its later parts
/// may be read as a stream: below, a few parts at most hold them.
pub(super) const STREAM_MIN_BYTES: u64 = 8 << 20;

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

/// The most of the queue's time rounds of probes take: a round (from the
/// wait for its first probe's quiet to its choice) is followed by at least
/// `1 / PROBE_SHARE - 1` times its length without probes. A round keeps
/// few parts in flight, which behind a first-byte latency costs about the
/// budget's worth of reading per latency: taken as often as the hold alone
/// allows, rounds took half of a read's time behind 20 ms.
const PROBE_SHARE: f64 = 0.05;

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
/// is cut short. The first round takes an object's first part's GET as
/// its stream probe where it can ([`Tuner::first_get`]), else probes a
/// stream; then it probes parts. Parts are
/// taken if they are at least [`MARGIN`] times faster, else the stream,
/// for a hold of [`FIRST_HOLD`] parts, after which both ways are probed
/// again (the way not chosen first); the hold doubles each time the choice
/// stands, and lasts at least long enough that rounds of probes take at
/// most [`PROBE_SHARE`] of the time. A probe is measured at its last
/// part's end (or earlier, cut short, at the next part's step). No wait
/// lasts longer than about [`PROBE_LIMIT`]. Which way a part is fetched
/// never changes which bytes it holds.
#[derive(Debug)]
pub(super) struct Tuner {
    state: Mutex<Tuning>,
    /// The queue's part sizes: the floor while a round of probes runs,
    /// from a fetch rate measured afresh after it (the parts held back
    /// while probes ran are no rate).
    sizes: Arc<PartSizes>,
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
    /// When the round of probes under way began (its first wait for quiet).
    round_started: Option<Instant>,
    /// The earliest the next round of probes may begin.
    next_round: Option<Instant>,
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
    /// The probe the part belongs to, if any.
    pub(super) probe: Option<u64>,
    /// Whether the part's GET succeeded (set when it ends).
    pub(super) ok: bool,
}

impl Flight {
    /// The GET of an object's first part (this flight) took `sample`; its
    /// unit holds `rest` bytes after the part: see [`Tuner::first_get`].
    pub(super) fn first_get(&self, sample: Sample, rest: u64) {
        self.tuner.first_get(sample, rest);
    }
}

impl Drop for Flight {
    fn drop(&mut self) {
        self.tuner.ended(self.probe, self.ok, Instant::now());
    }
}

impl Tuner {
    /// A tuner of a queue over `budget` bytes with at most
    /// `max_concurrency` requests in flight.
    pub(super) fn new(budget: u64, max_concurrency: usize, sizes: Arc<PartSizes>) -> Self {
        Tuner {
            sizes,
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
                round_started: None,
                next_round: None,
            }),
            budget,
            max_concurrency: u32::try_from(max_concurrency).unwrap_or(u32::MAX),
        }
    }

    /// An object's first part's GET took `sample`, its unit holding `rest`
    /// bytes after the part. Before the first probe starts, a first part
    /// of a unit long enough to stream (`rest` at least
    /// [`STREAM_MIN_BYTES`]) whose body was timed stands in for the first
    /// round's stream probe: its time to the answer and body rate are one
    /// GET at a time ([`OneGet`]), and a stream's rate is that of one GET
    /// over `rest`. The round then probes parts only, and starts as soon
    /// as the first parts end: behind a first-byte latency the stream
    /// probe cost a latency and four parts' bodies at one connection's
    /// rate before anything else was read. Later rounds probe both ways.
    fn first_get(&self, sample: Sample, rest: u64) {
        let transfer = sample.transfer.as_secs_f64();
        if rest < STREAM_MIN_BYTES || sample.bytes == 0 || transfer <= 0.0 {
            return;
        }
        let mut tuning = self.lock();
        let first_round = tuning.probes == 0 && tuning.one_get.is_none();
        if !first_round || tuning.queued.front() != Some(&Mode::Stream) {
            return;
        }
        let one_get = OneGet {
            latency: sample.first_byte.as_secs_f64(),
            bandwidth: sample.bytes as f64 / transfer,
        };
        tuning.queued.pop_front();
        tuning.one_get = Some(one_get);
        tuning.rates[Mode::Stream.index()] = Some(rest as f64 / one_get.serial_seconds(1, rest));
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
                if tuning.conclude(now, projection) {
                    self.sizes.probing(false);
                }
            } else if !tuning.queued.is_empty() {
                // A probe starts with the server to itself.
                let since = *tuning.quiet_wait.get_or_insert(now);
                tuning.round_started.get_or_insert(since);
                if tuning.active > 0 && now.saturating_duration_since(since) < PROBE_LIMIT {
                    return Step::Wait;
                }
                tuning.quiet_wait = None;
                let mode = tuning.queued.pop_front().unwrap_or(Mode::Parts);
                self.sizes.probing(true);
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
            } else if tuning.until_probe == 0 && tuning.next_round.is_none_or(|at| now >= at) {
                let chosen = tuning.chosen;
                tuning.queued.extend([chosen.other(), chosen]);
            } else {
                tuning.until_probe = tuning.until_probe.saturating_sub(1);
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
        let Some(current) = tuning.probe.as_mut().filter(|p| p.id == probe) else {
            return;
        };
        current.pending = current.pending.saturating_sub(1);
        current.failed |= !ok;
        current.first_end.get_or_insert(now);
        current.last_end = Some(now);
        // Its last part ended: measured now, whether or not a later part
        // comes to take the next step (objects too small to probe may
        // follow, or none).
        if current.pending == 0 && current.issued == PROBE_PARTS {
            let projection = self.probe_projection(&tuning);
            if tuning.conclude(now, projection) {
                self.sizes.probing(false);
            }
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
    /// `projection`); chooses once no probe is left in the round, and then
    /// gives `true`.
    fn conclude(&mut self, now: Instant, projection: Projection) -> bool {
        let Some(probe) = self.probe.take() else {
            return false;
        };
        if !probe.failed {
            self.rates[probe.mode.index()] = Some(probe.rate(now, projection));
        }
        if let Some(one_get) = probe.one_get() {
            self.one_get = Some(one_get);
        }
        if !self.queued.is_empty() {
            return false;
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
        if let Some(started) = self.round_started.take() {
            // At most what a round takes: two waits for quiet and two
            // probes, each bounded by PROBE_LIMIT.
            let round = now.saturating_duration_since(started).min(4 * PROBE_LIMIT);
            self.next_round = Some(now + round.mul_f64(1.0 / PROBE_SHARE - 1.0));
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::super::sizes::tests::sample;
    use super::*;

    /// A tuner over `budget` with parts of at most 8 MiB.
    fn tuner(budget: u64, max_concurrency: usize) -> Tuner {
        let sizes = PartSizes::new(budget, 8 << 20, max_concurrency);
        Tuner::new(budget, max_concurrency, Arc::new(sizes))
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
        let serial = tuner(64 << 20, 64);
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
        // and lasts until the round (t0 to t3) was PROBE_SHARE of the time;
        // then both ways are probed again, parts first.
        for _ in 0..3 {
            serial.ended(id, true, t3);
        }
        for _ in 0..2 * FIRST_HOLD {
            assert_eq!(
                serial.step(mib, 64 * mib, t3),
                Step::Issue(Mode::Stream, None)
            );
        }
        let round = t3.duration_since(t0);
        let t4 = t3 + round.mul_f64(1.0 / PROBE_SHARE - 1.0);
        assert_eq!(
            serial.step(mib, 64 * mib, t4 - Duration::from_millis(1)),
            Step::Issue(Mode::Stream, None)
        );
        // Parts in flight (the hold's) are waited for before a probe.
        assert_eq!(serial.step(mib, 64 * mib, t4), Step::Wait);
        for _ in 0..2 * FIRST_HOLD + 2 {
            serial.ended(None, true, t4);
        }
        assert!(matches!(
            serial.step(mib, 64 * mib, t4),
            Step::Issue(Mode::Parts, Some(_))
        ));

        // A remote store: 30 ms to the first part's end, a stream of
        // 25 MiB/s; four parts at once all end after 60 ms (66 MiB/s).
        let remote = tuner(64 << 20, 64);
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
        let capped = tuner(64 << 20, 64);
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
        let flat = tuner(64 << 20, 64);
        let t1 = probe(&flat, Mode::Stream, t0, [25, 30, 35, 40]);
        parts_lose_on_a_flat_server(&flat, t1 + ms(1), ms(50));
    }

    /// Drives `flat` through a probe of four parts of 1 MiB from `start`
    /// on a server that answers one GET at a time, 25 ms each: the first
    /// ends after 25 ms, and by `late` the probe is cut short and the
    /// stream taken.
    fn parts_lose_on_a_flat_server(flat: &Tuner, start: Instant, late: Duration) {
        let mib = 1 << 20;
        let ms = Duration::from_millis;
        let mut id = None;
        for _ in 0..4 {
            match flat.step(mib, 64 * mib, start) {
                Step::Issue(Mode::Parts, Some(probe)) => id = Some(probe),
                other => panic!("{other:?}"),
            }
        }
        flat.ended(id, true, start + ms(25));
        assert_eq!(flat.step(mib, 64 * mib, start + ms(30)), Step::Wait);
        assert_eq!(
            flat.step(mib, 64 * mib, start + late),
            Step::Issue(Mode::Stream, None)
        );
        assert_eq!(flat.lock().chosen, Mode::Stream);
    }

    #[test]
    fn a_first_part_stands_in_for_the_first_stream_probe_and_each_server_kind_gets_its_way() {
        let mib = 1 << 20;
        let ms = Duration::from_millis;
        // Behind 20 ms and 100 MB/s per connection, the first part's GET:
        // 256 KiB in 2.6 ms. It is one GET at a time, and the stream's rate
        // over the 20 MiB after it; the round probes parts at once.
        let capped = tuner(64 << 20, 64);
        // A first part's GET: 20 ms to its answer, its 256 KiB in `us`.
        let first_part = |us| Sample {
            first_byte: ms(20),
            bytes: 256 << 10,
            transfer: Duration::from_micros(us),
        };
        let first = first_part(2_621);
        capped.first_get(first, 20 * mib);
        {
            let tuning = capped.lock();
            let one_get = tuning.one_get.expect("one GET measured");
            assert!((one_get.latency - 0.02).abs() < 1e-9, "{one_get:?}");
            assert!(
                (one_get.bandwidth / 100e6 - 1.0).abs() < 1e-3,
                "{one_get:?}"
            );
            let stream = tuning.rates[Mode::Stream.index()].expect("a stream's rate");
            let expected = (20 * mib) as f64 / (0.02 + (20 * mib) as f64 / 100e6);
            assert!(
                (stream / expected - 1.0).abs() < 1e-3,
                "{stream} {expected}"
            );
            assert_eq!(tuning.queued, VecDeque::from([Mode::Parts]));
        }
        // Four parts at once each keep their connection's rate: parts.
        let t0 = Instant::now();
        let t1 = probe(&capped, Mode::Parts, t0, [31, 32, 33, 34]);
        assert_eq!(
            capped.step(mib, 64 * mib, t1),
            Step::Issue(Mode::Parts, None)
        );
        // Later rounds probe both ways again: a later first part changes
        // nothing.
        capped.first_get(first, 20 * mib);
        assert_eq!(capped.lock().queued, VecDeque::new());
        assert_eq!(capped.lock().probes, 1);

        // A server that answers one GET at a time, each after 20 ms, bodies
        // at 200 MiB/s: four parts at once end 25 ms apart; once they can
        // no longer win, the probe is cut short and the stream taken.
        let flat = tuner(64 << 20, 64);
        flat.first_get(first_part(1_250), 20 * mib);
        parts_lose_on_a_flat_server(&flat, t0, ms(60));
    }

    #[test]
    fn a_first_part_too_short_to_stream_or_untimed_leaves_the_stream_probe_queued() {
        let tuner = tuner(64 << 20, 64);
        let timed = sample(20, 256 << 10, 3);
        tuner.first_get(timed, STREAM_MIN_BYTES - 1);
        tuner.first_get(sample(20, 256 << 10, 0), 64 << 20);
        tuner.first_get(sample(20, 0, 3), 64 << 20);
        let tuning = tuner.lock();
        assert!(tuning.one_get.is_none() && tuning.rates == [None, None]);
        assert_eq!(tuning.queued, VecDeque::from([Mode::Stream, Mode::Parts]));
    }

    #[test]
    fn parts_are_the_floor_while_probes_run_and_sized_from_a_fresh_rate_after() {
        let mib = 1 << 20;
        let capped = tuner(32 * mib, 64);
        let floor = super::super::sizes::part_cap(32 * mib, 8 * mib);
        // 1 MB GETs completing every `every_ms` from `from` (behind 20 ms).
        let complete = |from: Instant, every_ms: u64| {
            for i in 0..8 {
                let at = from + Duration::from_millis(every_ms * i);
                capped.sizes.record_at(sample(20, 1_000_000, 10), at);
            }
        };
        // Before the round: one every 40 ms (25 MB/s, as when the queue
        // holds parts back for probes) makes parts large.
        let t0 = Instant::now();
        complete(t0, 40);
        assert!(capped.sizes.target() > floor, "{}", capped.sizes.target());
        let t1 = probe(&capped, Mode::Stream, t0, [30, 40, 50, 60]);
        // While the round runs, parts are the floor and GETs no rate.
        assert_eq!(capped.sizes.target(), floor);
        complete(t1, 40);
        assert_eq!(capped.sizes.target(), floor);
        let t2 = probe(&capped, Mode::Parts, t1, [33, 34, 35, 36]);
        // The round is over once its last part ended, though no later part
        // came to take a step (objects too small to probe may follow): the
        // rate is measured afresh, from the floor.
        {
            let tuning = capped.lock();
            assert_eq!(tuning.chosen, Mode::Parts);
            assert!(tuning.probe.is_none() && tuning.round_started.is_none());
        }
        assert_eq!(capped.sizes.target(), floor);
        // One every ms (1 GB/s) behind 20 ms: the floor sustains it.
        complete(t2, 1);
        assert_eq!(capped.sizes.target(), floor);
        // Measured again: a slower rate makes parts larger.
        complete(t2 + Duration::from_millis(10), 40);
        assert!(capped.sizes.target() > floor, "{}", capped.sizes.target());
        assert_eq!(
            capped.step(mib, 64 * mib, t2),
            Step::Issue(Mode::Parts, None)
        );
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
        let tuner = tuner(64 << 20, 64);
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
}
