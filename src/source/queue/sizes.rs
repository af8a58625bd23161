//! How large the parts of a queue's objects are: [`PartSizes`] sets them
//! from the latency and bandwidth its GETs measured, between a floor the
//! budget sets ([`part_cap`]) and a ceiling ([`part_ceiling`]).

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::Instant;

use super::super::remote_reads::Sample;

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
/// over the time they took to complete; until two GETs are measured, and
/// while the queue probes how to fetch parts ([`PartSizes::probing`]),
/// parts are [`part_cap`]. Which bytes a part holds never changes what is
/// read.
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
    /// Whether probes run ([`PartSizes::probing`]).
    probing: bool,
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
    pub(super) fn record_at(&self, sample: Sample, now: Instant) {
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

    /// Whether probes of the ways to fetch parts run (`on`): while they
    /// do, parts are [`part_cap`]; either way the fetch rate is measured
    /// afresh from the next GETs (the queue held parts back for the
    /// probes), and latency and bandwidth are kept.
    pub(super) fn probing(&self, on: bool) {
        let mut estimate = self.estimate.lock().unwrap_or_else(|e| e.into_inner());
        estimate.completed.clear();
        estimate.probing = on;
    }

    /// The size of the next parts, from the estimates so far.
    pub(super) fn target(&self) -> u64 {
        let estimate = self.estimate.lock().unwrap_or_else(|e| e.into_inner());
        match (estimate.latency_bandwidth, estimate.rate()) {
            _ if estimate.probing => self.floor,
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

#[cfg(test)]
pub(super) mod tests {
    use std::time::Duration;

    use super::*;

    /// A GET that took `first_byte_ms` to answer and `transfer_ms` for `bytes`.
    pub(in crate::source::queue) fn sample(
        first_byte_ms: u64,
        bytes: u64,
        transfer_ms: u64,
    ) -> Sample {
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
}
