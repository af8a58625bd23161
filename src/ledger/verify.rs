//! The verifier: a ledger's records checked against the plan they came
//! from. Pure: the ledger as read ([`super::file`]) and the dataset's shard
//! counts and order options in, a [`Report`] out.
//!
//! For each step the record of the latest generation whose `start_step` is
//! at or before it counts (a resumed run supersedes, job-wide, what the
//! earlier run recorded from its checkpoint on). Each epoch the records
//! cover is then replayed against the epoch's global sample sequence
//! (shards in [`plan::epoch_order`], samples in shard order): no sample
//! comes twice beyond what `remainder="pad"` repeats, no id lies outside
//! the dataset, every rank of a generation took as many steps in the
//! epoch, and a complete epoch left out no sample beyond what
//! `remainder="drop"` leaves out.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde::Serialize;

use super::file::{ErrorSkip, Generation, Record, RecordKind, SkipCause, TornTail};
use super::verify_pack::{Packing, PlanOptions, Proof, Unreplayed};
use crate::plan::{self, PlanParams, Remainder, ShardInfo};

/// The dataset a ledger is checked against: its shards' URLs and sample
/// counts, and the options that order an epoch.
#[derive(Debug, Clone)]
pub struct Dataset {
    /// Shard URLs, in listed order (shard index = position).
    pub urls: Vec<String>,
    /// Each shard's sample count.
    pub counts: Vec<u64>,
    /// The job's seed.
    pub seed: u64,
    /// Whether each epoch shuffles the shard order.
    pub shuffle_shards: bool,
    /// The remainder policy of equal-length epochs.
    pub remainder: Remainder,
    /// Whether the dataset packs its documents into sequences (`pack`):
    /// across ranks each slot then stops at its planned sequences, leaving
    /// out the documents of its last ones.
    pub packed: bool,
    /// The packing with the manifest's token counts: what checks those
    /// left-out documents against each slot's remainder (`None`: they are
    /// only counted).
    pub packing: Option<Packing>,
}

/// Where a sample was taken: a step of a rank in a generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Place {
    /// Generation number.
    pub generation: u64,
    /// Rank.
    pub rank: usize,
    /// Optimizer step.
    pub step: u64,
    /// Whether the step skipped its samples rather than trained on them.
    pub skipped: bool,
}

impl fmt::Display for Place {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let skipped = if self.skipped { " (skipped)" } else { "" };
        write!(
            f,
            "step {} of rank {} in generation {}{skipped}",
            self.step, self.rank, self.generation
        )
    }
}

/// A sample, named by its shard and index.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SampleName {
    /// Shard index.
    pub shard: u64,
    /// The shard's URL, when the shard is one of the dataset's.
    pub url: Option<String>,
    /// Index in the shard.
    pub index: u64,
    /// For a mixture: the stream and the pass over it (0, or a restart).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stream: Option<(usize, u64)>,
}

impl fmt::Display for SampleName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.url {
            Some(url) => write!(f, "sample {} of {url}", self.index)?,
            None => write!(f, "sample {} of shard index {}", self.index, self.shard)?,
        }
        match self.stream {
            Some((stream, pass)) => write!(f, " (stream {stream}, pass {pass})"),
            None => Ok(()),
        }
    }
}

/// What broke exactly-once.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Violation {
    /// A sample came twice in one epoch (beyond what padding repeats).
    Twice {
        /// The epoch.
        epoch: u64,
        /// The sample.
        sample: SampleName,
        /// Where it came first.
        first: Place,
        /// Where it came again.
        again: Place,
    },
    /// An id that is not one of the dataset's samples.
    NotInDataset {
        /// The epoch.
        epoch: u64,
        /// The id.
        sample: SampleName,
        /// Where it was recorded.
        place: Place,
    },
    /// A complete epoch left a sample out (beyond what `remainder="drop"`
    /// leaves out).
    Missing {
        /// The epoch.
        epoch: u64,
        /// The first sample left out, in epoch order.
        sample: SampleName,
        /// Samples left out beyond the remainder's allowance.
        count: u64,
        /// The generation whose plan held it (the epoch's first).
        generation: u64,
        /// The rank whose plan held it.
        rank: usize,
        /// The DataLoader worker of that rank whose plan held it.
        worker: usize,
    },
    /// A mixture's step took a sample that its plan does not take in the
    /// epoch (or takes fewer times).
    NotPlanned {
        /// The epoch.
        epoch: u64,
        /// The sample.
        sample: SampleName,
        /// Where it was recorded.
        place: Place,
    },
    /// A complete epoch of a mixture took another number of samples of a
    /// pass over a stream than its plan takes (a pass read in part).
    PassCount {
        /// The epoch.
        epoch: u64,
        /// The stream.
        stream: usize,
        /// The pass over it.
        pass: u64,
        /// Samples taken.
        taken: u64,
        /// Samples the plan takes.
        planned: u64,
    },
    /// The ranks of a generation took different numbers of steps in an epoch.
    UnequalSteps {
        /// The epoch.
        epoch: u64,
        /// The generation.
        generation: u64,
        /// Steps each rank took (index = rank).
        steps: Vec<u64>,
    },
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Violation::Twice {
                epoch,
                sample,
                first,
                again,
            } => write!(
                f,
                "{sample} came twice in epoch {epoch}: at {first} and again at {again}"
            ),
            Violation::NotInDataset {
                epoch,
                sample,
                place,
            } => write!(
                f,
                "{sample} (epoch {epoch}, at {place}) is not a sample of the dataset: \
                 the ledger was written over other data"
            ),
            Violation::Missing {
                epoch,
                sample,
                count,
                generation,
                rank,
                worker,
            } => write!(
                f,
                "epoch {epoch} is complete and {count} samples never came, the first \
                 {sample}, which the plan of generation {generation} gave to rank {rank} \
                 (worker {worker})"
            ),
            Violation::NotPlanned {
                epoch,
                sample,
                place,
            } => write!(
                f,
                "{sample} was taken at {place} in epoch {epoch}, which the mixture's plan \
                 does not take (or takes fewer times) in that epoch"
            ),
            Violation::PassCount {
                epoch,
                stream,
                pass,
                taken,
                planned,
            } => write!(
                f,
                "epoch {epoch} is complete and took {taken} samples of pass {pass} over \
                 stream {stream}, whose plan takes {planned}"
            ),
            Violation::UnequalSteps {
                epoch,
                generation,
                steps,
            } => write!(
                f,
                "in epoch {epoch} the ranks of generation {generation} took unequal numbers \
                 of steps: {steps:?} (by rank)"
            ),
        }
    }
}

/// One generation as verify saw it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GenerationSummary {
    /// Generation number.
    pub generation: u64,
    /// Its first step.
    pub start_step: u64,
    /// Its ranks.
    pub world_size: usize,
    /// Its DataLoader workers per rank.
    pub num_workers: usize,
    /// Its records that count (not superseded by a later generation).
    pub records: u64,
    /// Its records superseded by a later generation.
    pub superseded: u64,
}

/// A rank file whose last record was cut short.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct TornRecord {
    /// Generation number.
    pub generation: u64,
    /// Rank.
    pub rank: usize,
    /// The cut record.
    #[serde(flatten)]
    pub tail: TornTail,
}

/// A skip under `on_error="warn"`, with the rank and generation whose
/// skips file holds it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RecordedSkip {
    /// Generation number.
    pub generation: u64,
    /// Rank.
    pub rank: usize,
    /// What was left out, and why.
    #[serde(flatten)]
    pub skip: ErrorSkip,
}

/// One epoch's outcome.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct EpochReport {
    /// The epoch.
    pub epoch: u64,
    /// Whether the epoch ended (every rank of its last generation marked
    /// its end, or a later epoch began).
    pub complete: bool,
    /// Samples in the epoch's sequence.
    pub expected: u64,
    /// Samples trained on.
    pub trained: u64,
    /// Samples drawn and skipped (`Ledger.skip_steps`).
    pub skipped: u64,
    /// Distinct samples taken (trained or skipped).
    pub distinct: u64,
    /// Repeats that `remainder="pad"` accounts for.
    pub padded: u64,
    /// Samples left out that `remainder="drop"` accounts for (complete
    /// epochs).
    pub dropped: u64,
    /// Samples never taken that a stream left out under
    /// `on_error="warn"`, as its rank's skips file records (complete
    /// epochs).
    pub left_out_on_error: u64,
    /// Documents with no tokens never taken that a packed stream left out,
    /// having no sequence to carry them, as its rank's skips file records
    /// (complete epochs).
    pub left_out_no_tokens: u64,
    /// Steps (distinct step numbers) with samples.
    pub steps: u64,
    /// The generations with records in the epoch, in order.
    pub generations: Vec<u64>,
    /// Their world sizes, in the same order.
    pub world_sizes: Vec<usize>,
    /// Whether a complete epoch's samples were checked against the plan's
    /// (false for a mixture resumed onto another layout within the epoch,
    /// whose rest was split anew, and for documents packed across ranks:
    /// then no sample came twice is checked).
    pub coverage_checked: bool,
    /// Documents packed across ranks that no sequence handed out named:
    /// those of each slot's sequences past its planned number (complete
    /// epochs).
    pub packed_left_out: u64,
    /// Whether `packed_left_out` was checked against each slot's remainder
    /// (one layout, [`Packing::left_out`]: exactly, or within the
    /// bound by concatenation).
    pub packed_remainder_checked: bool,
    /// Whether they are exactly each slot's documents past its planned
    /// sequences, its order replayed (then `coverage_checked` too).
    pub packed_remainder_exact: bool,
    /// Why a slot's order was not replayed, when that keeps the proof of
    /// `packed_left_out` from being exact.
    pub packed_order_unreplayed: Option<String>,
    /// A mixture of packed streams whose epoch was not replayed: it takes
    /// a number of each stream's sequences, and which documents those hold
    /// depends on the packing (then no document came twice, and equal
    /// steps per rank, are checked; `expected` is 0). A replayed one is
    /// reported as a packed dataset's (`packed_remainder_exact`).
    pub sequences_mixed: bool,
    /// The epoch's first violation, if any.
    pub violation: Option<Violation>,
}

impl EpochReport {
    /// `"exactly once"`, `"in progress"` or `"VIOLATION"`.
    pub fn status(&self) -> &'static str {
        match (&self.violation, self.complete) {
            (Some(_), _) => "VIOLATION",
            (None, true) if self.sequences_mixed => {
                "at most once (a mixture of packed streams: which documents its sequences hold \
                 is not replayed)"
            }
            (None, true) if self.packed_remainder_exact => "exactly once",
            (None, true) if self.packed_remainder_checked && self.packed_left_out > 0 => {
                "at most once (packed across ranks: each worker's documents left out are within \
                 its remainder past its planned sequences, by the manifest's token counts)"
            }
            (None, true) if !self.coverage_checked && self.packed_left_out > 0 => {
                "at most once (packed across ranks: each worker's sequences past the planned \
                 number are left out)"
            }
            (None, true) if !self.coverage_checked => {
                "at most once (a mixture resumed onto another layout: its rest was split anew)"
            }
            (None, true) => "exactly once",
            (None, false) => "in progress (no repeat so far)",
        }
    }
}

/// What verify found.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Report {
    /// Whether every epoch checks.
    pub ok: bool,
    /// The generations, in order.
    pub generations: Vec<GenerationSummary>,
    /// Records cut short at the end of a rank file (left out).
    pub torn: Vec<TornRecord>,
    /// The skips under `on_error="warn"` the ledger records.
    pub error_skips: Vec<RecordedSkip>,
    /// Each epoch the ledger covers, in order.
    pub epochs: Vec<EpochReport>,
    /// The first violation (of the first epoch that has one).
    pub violation: Option<Violation>,
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let layouts: Vec<String> = self
            .generations
            .iter()
            .map(|g| {
                format!(
                    "{} (from step {}, {} ranks x {} workers)",
                    g.generation, g.start_step, g.world_size, g.num_workers
                )
            })
            .collect();
        writeln!(f, "generations: {}", layouts.join(", "))?;
        for torn in &self.torn {
            writeln!(
                f,
                "note: generation {} rank {}: a record cut short at byte {} ({} bytes) was \
                 left out (the process stopped while writing it)",
                torn.generation, torn.rank, torn.tail.offset, torn.tail.bytes
            )?;
        }
        for recorded in &self.error_skips {
            let s = &recorded.skip;
            let end = s
                .end
                .map_or_else(|| "its end".to_owned(), |end| end.to_string());
            let worker = s.worker.map(|w| format!(" worker {w}")).unwrap_or_default();
            let why = match s.cause {
                SkipCause::Error => "under on_error=\"warn\"",
                SkipCause::NoTokens => "(documents with no tokens)",
            };
            writeln!(
                f,
                "note: epoch {}: rank {}{worker} (generation {}) left out samples {} to {end} \
                 of shard index {} {why}: {}",
                s.epoch, recorded.rank, recorded.generation, s.first, s.shard, s.reason
            )?;
        }
        for e in &self.epochs {
            let skipped = if e.skipped > 0 {
                format!(" + {} skipped", e.skipped)
            } else {
                String::new()
            };
            let mut extra = match (e.padded, e.dropped) {
                (0, 0) => String::new(),
                (p, 0) => format!(", {p} repeated by pad"),
                (0, d) => format!(", {d} left out by drop"),
                (p, d) => format!(", {p} repeated by pad, {d} left out by drop"),
            };
            if e.left_out_on_error > 0 {
                extra += &format!(", {} left out by on_error=\"warn\"", e.left_out_on_error);
            }
            if e.left_out_no_tokens > 0 {
                extra += &format!(
                    ", {} with no tokens left out (no sequence to carry them)",
                    e.left_out_no_tokens
                );
            }
            if e.packed_left_out > 0 {
                extra += &format!(
                    ", {} left out past the planned sequences",
                    e.packed_left_out
                );
            }
            // A packed mixture's documents are not replayed: their number
            // is not known.
            let expected = if e.sequences_mixed {
                "?".to_owned()
            } else {
                e.expected.to_string()
            };
            let generations: Vec<String> = e.generations.iter().map(u64::to_string).collect();
            let ranks: Vec<String> = e.world_sizes.iter().map(usize::to_string).collect();
            writeln!(
                f,
                "epoch {}: {} of {} samples ({} trained{skipped}{extra}) in {} steps, ranks {}, \
                 generations {}: {}",
                e.epoch,
                e.distinct,
                expected,
                e.trained,
                e.steps,
                ranks.join("/"),
                generations.join(","),
                e.status()
            )?;
            if let Some(why) = &e.packed_order_unreplayed {
                writeln!(
                    f,
                    "note: epoch {}: a worker's order of documents was not replayed, so what it \
                     left out is not proved exact: {why}",
                    e.epoch
                )?;
            }
        }
        match &self.violation {
            Some(v) => writeln!(f, "FAILED: {v}"),
            None if self.epochs.is_empty() => writeln!(f, "ok: the ledger holds no step yet"),
            None if self
                .epochs
                .iter()
                .all(|e| e.coverage_checked || !e.complete) =>
            {
                // An epoch in progress is checked for repeats only: the
                // verdict says so rather than claim it whole.
                let open: Vec<String> = self
                    .epochs
                    .iter()
                    .filter(|e| !e.complete)
                    .map(|e| e.epoch.to_string())
                    .collect();
                match (open.as_slice(), open.len() == self.epochs.len()) {
                    ([], _) => writeln!(f, "ok: every sample exactly once"),
                    (_, true) => writeln!(
                        f,
                        "ok: no sample twice so far (epoch {} in progress)",
                        open.join(", ")
                    ),
                    (_, false) => writeln!(
                        f,
                        "ok: every sample exactly once in the epochs that ended; epoch {} in \
                         progress (no sample twice so far)",
                        open.join(", ")
                    ),
                }
            }
            None => writeln!(
                f,
                "ok: no sample twice (an epoch marked \"at most once\" is not checked for \
                 samples left out)"
            ),
        }
    }
}

/// A record that counts, with where it came from.
#[derive(Debug, Clone, Copy)]
pub(super) struct Entry<'a> {
    /// Index into the generations.
    pub(super) generation: usize,
    pub(super) rank: usize,
    pub(super) record: &'a Record,
}

/// Checks `generations` (as [`super::file::read_ledger`] gives them, in
/// generation order) against `dataset`.
pub fn verify(generations: &[Generation], dataset: &Dataset) -> Report {
    check_epochs(generations, |epoch, entries, later| {
        check_epoch(generations, dataset, epoch, entries, later)
    })
}

/// The report of `generations`, each epoch's records that count (in step
/// order) checked by `check(epoch, entries, a later epoch began)`.
pub(super) fn check_epochs<'a>(
    generations: &'a [Generation],
    mut check: impl FnMut(u64, &[Entry<'a>], bool) -> EpochReport,
) -> Report {
    let mut summaries: Vec<GenerationSummary> = generations
        .iter()
        .map(|g| GenerationSummary {
            generation: g.meta.generation,
            start_step: g.meta.start_step,
            world_size: g.meta.world_size,
            num_workers: g.meta.num_workers,
            records: 0,
            superseded: 0,
        })
        .collect();
    let mut torn = Vec::new();
    let mut error_skips = Vec::new();
    let mut by_epoch: BTreeMap<u64, Vec<Entry<'_>>> = BTreeMap::new();
    for (index, generation) in generations.iter().enumerate() {
        for (rank, log) in generation.ranks.iter().enumerate() {
            error_skips.extend(log.error_skips.iter().map(|skip| RecordedSkip {
                generation: generation.meta.generation,
                rank,
                skip: skip.clone(),
            }));
            if let Some(tail) = log.torn {
                torn.push(TornRecord {
                    generation: generation.meta.generation,
                    rank,
                    tail,
                });
            }
            for record in &log.records {
                if owner(generations, record.step) == Some(index) {
                    summaries[index].records += 1;
                    by_epoch.entry(record.epoch).or_default().push(Entry {
                        generation: index,
                        rank,
                        record,
                    });
                } else {
                    summaries[index].superseded += 1;
                }
            }
        }
    }
    let last_epoch = by_epoch.keys().next_back().copied();
    let epochs: Vec<EpochReport> = by_epoch
        .into_iter()
        .map(|(epoch, mut entries)| {
            entries.sort_by_key(|e| {
                let kind = e.record.kind == RecordKind::EpochEnd;
                (e.record.step, kind, e.generation, e.rank)
            });
            let later = last_epoch.is_some_and(|last| last > epoch);
            check(epoch, &entries, later)
        })
        .collect();
    let violation = epochs.iter().find_map(|e| e.violation.clone());
    Report {
        ok: violation.is_none(),
        generations: summaries,
        torn,
        error_skips,
        epochs,
        violation,
    }
}

/// The steps an epoch's records take, per generation and rank, and the
/// ranks that recorded the epoch's end.
#[derive(Default)]
pub(super) struct StepTally {
    steps: BTreeSet<u64>,
    steps_of: BTreeMap<(usize, usize), u64>,
    ended: BTreeSet<(usize, usize)>,
}

impl StepTally {
    /// Counts `entry`, its samples as trained or skipped in `report`;
    /// false for an epoch's end, which holds no samples.
    pub(super) fn count(&mut self, entry: &Entry<'_>, report: &mut EpochReport) -> bool {
        let record = entry.record;
        match record.kind {
            RecordKind::EpochEnd => {
                self.ended.insert((entry.generation, entry.rank));
                return false;
            }
            RecordKind::Trained => report.trained += record.ids.len() as u64,
            RecordKind::Skipped => report.skipped += record.ids.len() as u64,
        }
        self.steps.insert(record.step);
        *self
            .steps_of
            .entry((entry.generation, entry.rank))
            .or_default() += 1;
        true
    }

    /// Fills in `report`'s steps and whether its epoch is complete (every
    /// rank of the generation of its last step recorded its end, or a
    /// later epoch began), and names the ranks of a generation of `order`
    /// that took unequal steps in a complete one. Whether the epoch's
    /// coverage is to be checked next: complete, no violation.
    pub(super) fn finish(
        &self,
        generations: &[Generation],
        entries: &[Entry<'_>],
        order: &[usize],
        later_epoch: bool,
        report: &mut EpochReport,
    ) -> bool {
        report.steps = self.steps.len() as u64;
        let last = entries
            .iter()
            .filter(|e| e.record.kind != RecordKind::EpochEnd)
            .map(|e| (e.record.step, e.generation))
            .max()
            .map_or(order[order.len() - 1], |(_, g)| g);
        report.complete = later_epoch
            || (0..generations[last].meta.world_size)
                .all(|rank| self.ended.contains(&(last, rank)));
        if !report.complete || report.violation.is_some() {
            return false;
        }
        let unequal = order.iter().find_map(|&g| {
            let steps: Vec<u64> = (0..generations[g].meta.world_size)
                .map(|rank| self.steps_of.get(&(g, rank)).copied().unwrap_or(0))
                .collect();
            steps
                .iter()
                .any(|&n| n != steps[0])
                .then(|| Violation::UnequalSteps {
                    epoch: report.epoch,
                    generation: generations[g].meta.generation,
                    steps,
                })
        });
        report.violation = unequal;
        report.violation.is_none()
    }
}

/// Whether a stream left sample `(shard, index)` of `epoch` out under
/// `on_error="warn"`, as any rank's skips file of any generation records
/// (a resumed run does not read again what its state says was skipped).
pub(super) fn left_out_on_error(generations: &[Generation], epoch: u64, id: (u64, u64)) -> bool {
    error_skips(generations).any(|skip| skip.covers(epoch, id))
}

/// Every skip under `on_error="warn"` that `generations` record.
pub(super) fn error_skips(generations: &[Generation]) -> impl Iterator<Item = &ErrorSkip> {
    generations
        .iter()
        .flat_map(|g| &g.ranks)
        .flat_map(|log| &log.error_skips)
}

/// The generation (index) whose record of `step` counts: the latest whose
/// `start_step` is at or before it.
fn owner(generations: &[Generation], step: u64) -> Option<usize> {
    generations.iter().rposition(|g| g.meta.start_step <= step)
}

/// The epoch's global sample sequence: where each shard's samples start in it.
struct Sequence {
    /// Shards in epoch order.
    order: Vec<usize>,
    /// `starts[shard]`: the position of the shard's first sample.
    starts: Vec<u64>,
    /// The position of the first sample of each shard of `order`, in order.
    firsts: Vec<u64>,
    total: u64,
}

impl Sequence {
    fn new(dataset: &Dataset, epoch: u64) -> Self {
        let order = plan::epoch_order(dataset.counts.len(), &params(dataset, epoch, 1, 1));
        let mut starts = vec![0; dataset.counts.len()];
        let mut firsts = Vec::with_capacity(order.len());
        let mut total = 0u64;
        for &shard in &order {
            starts[shard] = total;
            firsts.push(total);
            total += dataset.counts[shard];
        }
        Sequence {
            order,
            starts,
            firsts,
            total,
        }
    }

    /// The position of sample `(shard, index)`, when it is one of the dataset's.
    fn position(&self, dataset: &Dataset, (shard, index): (u64, u64)) -> Option<u64> {
        let shard = usize::try_from(shard).ok()?;
        (index < *dataset.counts.get(shard)?).then(|| self.starts[shard] + index)
    }

    /// The sample at `position` (below the total): the last shard of the
    /// order that starts at or before it (a shard of no samples shares its
    /// start with the next one).
    fn sample_at(&self, position: u64) -> (usize, u64) {
        let at = self.firsts.partition_point(|&first| first <= position) - 1;
        (self.order[at], position - self.firsts[at])
    }
}

pub(super) fn params(
    dataset: &Dataset,
    epoch: u64,
    world_size: usize,
    num_workers: usize,
) -> PlanParams {
    PlanParams {
        seed: dataset.seed,
        epoch,
        shuffle_shards: dataset.shuffle_shards,
        world_size,
        num_workers,
        remainder: dataset.remainder,
    }
}

fn name(dataset: &Dataset, (shard, index): (u64, u64)) -> SampleName {
    SampleName {
        shard,
        url: usize::try_from(shard)
            .ok()
            .and_then(|s| dataset.urls.get(s).cloned()),
        index,
        stream: None,
    }
}

pub(super) fn place(generations: &[Generation], entry: &Entry<'_>) -> Place {
    Place {
        generation: generations[entry.generation].meta.generation,
        rank: entry.rank,
        step: entry.record.step,
        skipped: entry.record.kind == RecordKind::Skipped,
    }
}

fn check_epoch(
    generations: &[Generation],
    dataset: &Dataset,
    epoch: u64,
    entries: &[Entry<'_>],
    later_epoch: bool,
) -> EpochReport {
    let sequence = Sequence::new(dataset, epoch);
    let total = sequence.total;
    // The generations of the epoch, in the order they took it up.
    let mut order: Vec<usize> = Vec::new();
    for entry in entries {
        if !order.contains(&entry.generation) {
            order.push(entry.generation);
        }
    }
    // An epoch whose first step is the first step of a resumed generation
    // may have been planned by the generation before it: an elastic state
    // saved before the epoch's first batch was cut by that layout, whose
    // remainder then counts too.
    if let Some(&first) = order.first() {
        let first_step = entries.first().map(|e| e.record.step);
        if first > 0 && first_step == Some(generations[first].meta.start_step) {
            order.insert(0, first - 1);
        }
    }
    let layout = |g: usize| {
        (
            generations[g].meta.world_size,
            generations[g].meta.num_workers,
        )
    };
    let first = order[0];
    let (first_world, first_workers) = layout(first);
    // What the remainder policy allows: the first layout's exact drop or
    // pad; each change of layout within the epoch (an elastic resume)
    // cuts the rest anew, which may drop or pad up to `world_size - 1` more.
    let per_rank = plan::cut::samples_per_rank(total, first_world, dataset.remainder);
    let cut_total = per_rank * first_world as u64;
    let mut spare_layout_changes = 0u64;
    for pair in order.windows(2) {
        if layout(pair[0]) != layout(pair[1]) {
            spare_layout_changes += layout(pair[1]).0 as u64 - 1;
        }
    }
    let (mut spare_pad, mut spare_drop) = match dataset.remainder {
        Remainder::Pad => (spare_layout_changes, 0),
        Remainder::Drop => (0, spare_layout_changes),
    };
    // Repeats the first layout's padding makes: positions `0..pad` wrapped.
    let mut pad_left: BTreeMap<u64, u64> = BTreeMap::new();
    if dataset.remainder == Remainder::Pad && total > 0 {
        for j in 0..cut_total.saturating_sub(total) {
            *pad_left.entry(j % total).or_default() += 1;
        }
    }

    let mut report = EpochReport {
        epoch,
        complete: false,
        expected: total,
        trained: 0,
        skipped: 0,
        distinct: 0,
        padded: 0,
        dropped: 0,
        left_out_on_error: 0,
        left_out_no_tokens: 0,
        steps: 0,
        generations: order
            .iter()
            .map(|&g| generations[g].meta.generation)
            .collect(),
        world_sizes: order.iter().map(|&g| layout(g).0).collect(),
        coverage_checked: true,
        packed_left_out: 0,
        packed_remainder_checked: false,
        packed_remainder_exact: false,
        packed_order_unreplayed: None,
        sequences_mixed: false,
        violation: None,
    };
    // Packed across ranks, each slot stops at its planned sequences, cut
    // by tokens, never padded.
    let packed_across_ranks =
        dataset.packed && order.iter().any(|&g| generations[g].meta.world_size > 1);
    if packed_across_ranks {
        pad_left.clear();
        spare_pad = 0;
    }
    let mut seen = vec![0u8; usize::try_from(total).unwrap_or(usize::MAX)];
    let mut tally = StepTally::default();
    for entry in entries {
        if !tally.count(entry, &mut report) {
            continue;
        }
        let record = entry.record;
        for &id in &record.ids {
            let Some(position) = sequence.position(dataset, id) else {
                report.violation.get_or_insert(Violation::NotInDataset {
                    epoch,
                    sample: name(dataset, id),
                    place: place(generations, entry),
                });
                continue;
            };
            let count = &mut seen[position as usize];
            if *count == 0 {
                *count = 1;
                report.distinct += 1;
                continue;
            }
            *count = count.saturating_add(1);
            if let Some(left) = pad_left.get_mut(&position).filter(|left| **left > 0) {
                *left -= 1;
                report.padded += 1;
            } else if spare_pad > 0 {
                spare_pad -= 1;
                report.padded += 1;
            } else if report.violation.is_none() {
                let first_entry = entries
                    .iter()
                    .find(|e| e.record.ids.contains(&id))
                    .expect("seen before");
                report.violation = Some(Violation::Twice {
                    epoch,
                    sample: name(dataset, id),
                    first: place(generations, first_entry),
                    again: place(generations, entry),
                });
            }
        }
    }
    if !tally.finish(generations, entries, &order, later_epoch, &mut report) {
        return report;
    }
    // Samples never taken: the first layout's drop is the epoch's tail.
    let dropped_from = match dataset.remainder {
        Remainder::Drop => cut_total,
        Remainder::Pad => total,
    };
    // The epoch's skips under on_error="warn", of every generation.
    let skips: Vec<&ErrorSkip> = error_skips(generations)
        .filter(|skip| skip.epoch == epoch)
        .collect();
    // Under one layout whose worker count is known, what each slot leaves
    // out is checked against its remainder, the records that count being
    // those of an uninterrupted run: one generation, or an exact resume,
    // which continues the plan.
    let replayable = order
        .iter()
        .all(|&g| layout(g) == layout(first) && generations[g].meta.num_workers_known);
    let remainder_check = match &dataset.packing {
        Some(packing) if packed_across_ranks && replayable && skips.is_empty() => {
            let options = PlanOptions {
                seed: dataset.seed,
                shuffle_shards: dataset.shuffle_shards,
                remainder: dataset.remainder,
            };
            let handed = |shard: usize, index: u64| {
                sequence
                    .position(dataset, (shard as u64, index))
                    .is_some_and(|p| seen[p as usize] > 0)
            };
            let left = packing.left_out(options, epoch, (first_world, first_workers), handed);
            // A resume within the epoch (or at its start) may have planned
            // its rest anew (an elastic resume does, even onto the same
            // layout; the ledger does not tell it from an exact one):
            // records that are not the uninterrupted run's then leave the
            // epoch at most once, naming what the plan missed.
            match left {
                Err(left) if order.len() > 1 => {
                    let first = name(dataset, (left.first.0 as u64, left.first.1));
                    report.packed_order_unreplayed = Some(format!(
                        "{}; {} document(s) that plan's sequences end were not recorded, the \
                         first {first}",
                        Unreplayed::ResumedAnew,
                        left.count
                    ));
                    None
                }
                Ok(mut left)
                    if order.len() > 1 && left.unreplayed == Some(Unreplayed::NotTheRunsOrder) =>
                {
                    left.unreplayed = Some(Unreplayed::ResumedAnew);
                    Some(Ok(left))
                }
                left => Some(left),
            }
        }
        _ => None,
    };
    let mut first_missing = None;
    let mut missing = 0u64;
    for (position, &count) in seen.iter().enumerate() {
        if count > 0 {
            continue;
        }
        let position = position as u64;
        if packed_across_ranks {
            report.packed_left_out += 1;
            report.coverage_checked = false;
        } else if position >= dropped_from {
            report.dropped += 1;
        } else if let Some(skip) = (!skips.is_empty())
            .then(|| {
                let (shard, index) = sequence.sample_at(position);
                skips
                    .iter()
                    .find(|skip| skip.covers(epoch, (shard as u64, index)))
            })
            .flatten()
        {
            match skip.cause {
                SkipCause::Error => report.left_out_on_error += 1,
                SkipCause::NoTokens => report.left_out_no_tokens += 1,
            }
        } else if spare_drop > 0 {
            spare_drop -= 1;
            report.dropped += 1;
        } else {
            missing += 1;
            first_missing.get_or_insert(position);
        }
    }
    match remainder_check {
        Some(Err(left)) => {
            report.violation = Some(Violation::Missing {
                epoch,
                sample: name(dataset, (left.first.0 as u64, left.first.1)),
                count: left.count,
                generation: generations[first].meta.generation,
                rank: left.slot / first_workers,
                worker: left.slot % first_workers,
            });
            return report;
        }
        // Every document left out is one of a slot's.
        Some(Ok(left)) => {
            report.packed_remainder_checked =
                left.documents == report.packed_left_out && left.proof != Proof::Unchecked;
            // Each slot's order replayed: its documents left out are
            // exactly those past its planned sequences.
            report.packed_remainder_exact =
                report.packed_remainder_checked && left.proof == Proof::Exact;
            report.packed_order_unreplayed = left.unreplayed.map(|why| why.to_string());
            report.coverage_checked |= report.packed_remainder_exact;
        }
        None => {}
    }
    if let Some(position) = first_missing {
        let (shard, index) = sequence.sample_at(position);
        let plan = plan::plan_epoch(
            &dataset
                .counts
                .iter()
                .map(|&n| ShardInfo {
                    size: None,
                    samples: Some(n),
                })
                .collect::<Vec<_>>(),
            &params(dataset, epoch, first_world, first_workers),
        );
        let slot = plan
            .slots
            .iter()
            .position(|units| {
                units.iter().any(|u| {
                    u.shard == shard && u.samples.as_ref().is_some_and(|r| r.contains(&index))
                })
            })
            .unwrap_or(0);
        report.violation = Some(Violation::Missing {
            epoch,
            sample: name(dataset, (shard as u64, index)),
            count: missing,
            generation: generations[first].meta.generation,
            rank: slot / first_workers,
            worker: slot % first_workers,
        });
    }
    report
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::super::file::{
        DatasetMeta, ErrorSkip, Meta, RankLog, LEDGER_FORMAT, LEDGER_VERSION,
    };
    use super::super::verify_pack::tests::{counted_packing, slots_run, SlotsRun, BOUNDS, OPTIONS};
    use super::super::verify_pack::{Arrival, Decoded};
    use super::*;

    /// Three shards of 4, 3 and 5 samples, listed order.
    fn dataset(remainder: Remainder) -> Dataset {
        Dataset {
            urls: vec!["a.tar".into(), "b.tar".into(), "c.tar".into()],
            counts: vec![4, 3, 5],
            seed: 0,
            shuffle_shards: false,
            remainder,
            packed: false,
            packing: None,
        }
    }

    /// The epoch's sequence as ids.
    fn sequence(d: &Dataset) -> Vec<(u64, u64)> {
        (0..3u64)
            .flat_map(|s| (0..d.counts[s as usize]).map(move |i| (s, i)))
            .collect()
    }

    fn generation(number: u64, start_step: u64, world_size: usize) -> Generation {
        Generation {
            dir: PathBuf::from(format!("gen-{number:06}")),
            meta: Meta {
                format: LEDGER_FORMAT.into(),
                version: LEDGER_VERSION,
                generation: number,
                start_step,
                world_size,
                num_workers: 1,
                num_workers_known: false,
                dataset: DatasetMeta {
                    spec: vec![],
                    options: Default::default(),
                    shards: None,
                    samples: None,
                    fingerprint: None,
                    mix: None,
                },
            },
            ranks: vec![RankLog::default(); world_size],
        }
    }

    fn push(g: &mut Generation, rank: usize, step: u64, kind: RecordKind, ids: &[(u64, u64)]) {
        g.ranks[rank].records.push(Record {
            step,
            epoch: 0,
            kind,
            ids: ids.to_vec(),
        });
    }

    /// One rank trains `ids` in steps of `per_step` from `first_step`, then
    /// ends the epoch.
    fn run(g: &mut Generation, rank: usize, first_step: u64, ids: &[(u64, u64)], per_step: usize) {
        let mut step = first_step;
        for chunk in ids.chunks(per_step) {
            push(g, rank, step, RecordKind::Trained, chunk);
            step += 1;
        }
        push(g, rank, step.saturating_sub(1), RecordKind::EpochEnd, &[]);
    }

    #[test]
    fn a_whole_epoch_once_checks() {
        let d = dataset(Remainder::Drop);
        let mut g = generation(0, 0, 1);
        run(&mut g, 0, 0, &sequence(&d), 5);
        let report = verify(&[g], &d);
        assert!(report.ok, "{report}");
        assert!(report.epochs[0].complete);
        assert_eq!(report.epochs[0].distinct, 12);
        assert!(report.to_string().contains("exactly once"), "{report}");
    }

    #[test]
    fn documents_packed_across_ranks_may_be_left_out_but_not_repeated() {
        let d = Dataset {
            packed: true,
            packing: None,
            ..dataset(Remainder::Drop)
        };
        let all = sequence(&d);
        // Two ranks, as many steps each; each left its last documents out.
        let mut g = generation(0, 0, 2);
        run(&mut g, 0, 0, &all[..4], 2);
        run(&mut g, 1, 0, &all[6..10], 2);
        let report = verify(std::slice::from_ref(&g), &d);
        assert!(report.ok, "{report}");
        let epoch = &report.epochs[0];
        assert!(epoch.complete && !epoch.coverage_checked);
        assert_eq!((epoch.distinct, epoch.packed_left_out), (8, 4));
        assert!(epoch.status().contains("packed across ranks"), "{report}");
        assert!(report
            .to_string()
            .contains("4 left out past the planned sequences"));
        // A document twice is still a violation.
        let mut twice = generation(0, 0, 2);
        run(&mut twice, 0, 0, &all[..4], 2);
        run(&mut twice, 1, 0, &[all[6], all[7], all[8], all[0]], 2);
        let report = verify(std::slice::from_ref(&twice), &d);
        assert!(matches!(
            report.epochs[0].violation,
            Some(Violation::Twice { .. })
        ));
        // Cut by tokens, a packed plan never pads: `remainder="pad"` (11
        // samples on 2 ranks: one would be repeated, the first) excuses
        // no repeat.
        let padded = Dataset {
            remainder: Remainder::Pad,
            counts: vec![4, 3, 4],
            ..d.clone()
        };
        let report = verify(&[twice], &padded);
        assert!(matches!(
            report.epochs[0].violation,
            Some(Violation::Twice { .. })
        ));
        // On one rank every document is expected.
        let mut one = generation(0, 0, 1);
        run(&mut one, 0, 0, &all[..10], 2);
        let report = verify(&[one], &d);
        assert!(matches!(
            report.epochs[0].violation,
            Some(Violation::Missing { .. })
        ));
    }

    #[test]
    fn a_resumed_generation_supersedes_the_steps_from_its_start() {
        let d = dataset(Remainder::Drop);
        let all = sequence(&d);
        // Generation 0 took steps 0 to 2 (4 samples each) and died before
        // its epoch-end marker; generation 1 redid steps 1 and 2 from the
        // checkpoint of step 1.
        let mut g0 = generation(0, 0, 1);
        for (step, chunk) in all.chunks(4).enumerate() {
            push(&mut g0, 0, step as u64, RecordKind::Trained, chunk);
        }
        let mut g1 = generation(1, 1, 1);
        run(&mut g1, 0, 1, &all[4..], 4);
        let report = verify(&[g0, g1], &d);
        assert!(report.ok, "{report}");
        assert_eq!(report.generations[0].superseded, 2);
        assert_eq!(report.epochs[0].generations, [0, 1]);
    }

    /// Each rank's documents that `run` says its slots' sequences end (2
    /// ranks x 2 workers), sorted, in `steps` steps.
    fn rank_steps(run: &SlotsRun, steps: usize) -> Vec<Vec<Vec<(u64, u64)>>> {
        (0..2)
            .map(|rank| {
                let mut docs: Vec<(u64, u64)> = run.named[2 * rank]
                    .iter()
                    .chain(&run.named[2 * rank + 1])
                    .map(|&(s, i)| (s as u64, i))
                    .collect();
                docs.sort_unstable();
                (0..steps)
                    .map(|k| docs[k * docs.len() / steps..(k + 1) * docs.len() / steps].to_vec())
                    .collect()
            })
            .collect()
    }

    #[test]
    fn a_packed_epoch_resumed_within_it_is_replayed_as_one_run() {
        for window in [None, Some(3)] {
            let packing = Packing {
                arrival: Some(Arrival {
                    buffer: Some(BOUNDS),
                    decoded: Decoded::Nothing,
                }),
                ..counted_packing(window)
            };
            let run = slots_run(&packing, BOUNDS);
            let d = Dataset {
                urls: (0..4).map(|s| format!("p-{s}.jsonl")).collect(),
                counts: vec![12; 4],
                seed: OPTIONS.seed,
                shuffle_shards: OPTIONS.shuffle_shards,
                remainder: OPTIONS.remainder,
                packed: true,
                packing: Some(packing),
            };
            let ranks = rank_steps(&run, 4);
            let packed_generation = |number: u64, start_step: u64| {
                let mut g = generation(number, start_step, 2);
                (g.meta.num_workers, g.meta.num_workers_known) = (2, true);
                g
            };
            // Steps 0..3 of a run that crashed after its checkpoint at step
            // 2, and steps 2..4 of the run resumed from it: `lose` one
            // document of the resumed steps, or `repeat` one of the first.
            let resumed = |lose: Option<(u64, u64)>, repeat: Option<(u64, u64)>| {
                let (mut first, mut second) = (packed_generation(0, 0), packed_generation(1, 2));
                for (rank, steps) in ranks.iter().enumerate() {
                    for (step, ids) in steps[..3].iter().enumerate() {
                        push(&mut first, rank, step as u64, RecordKind::Trained, ids);
                    }
                    for (step, ids) in steps.iter().enumerate().skip(2) {
                        let mut ids = ids.clone();
                        ids.retain(|&id| Some(id) != lose);
                        ids.extend(repeat.filter(|_| rank == 1 && step == 3));
                        push(&mut second, rank, step as u64, RecordKind::Trained, &ids);
                    }
                    push(&mut second, rank, 3, RecordKind::EpochEnd, &[]);
                }
                verify(&[first, second], &d)
            };
            let report = resumed(None, None);
            assert!(report.ok, "{report}");
            let epoch = &report.epochs[0];
            assert_eq!(epoch.generations, [0, 1]);
            let left: usize = run.left.iter().map(Vec::len).sum();
            assert!(left > 0);
            assert_eq!(epoch.packed_left_out, left as u64);
            assert_eq!(epoch.status(), "exactly once", "{report}");
            // A document of the resumed steps lost: not the uninterrupted
            // plan's records, which an elastic resume's may be too; at most
            // once, naming the document.
            let lost = ranks[1][3][0];
            let report = resumed(Some(lost), None);
            assert!(report.ok, "{report}");
            let epoch = &report.epochs[0];
            assert!(epoch.status().starts_with("at most once"), "{report}");
            let note = epoch.packed_order_unreplayed.as_deref().unwrap();
            assert!(note.contains("not the uninterrupted plan's"), "{note}");
            let name = format!("sample {} of p-{}.jsonl", lost.1, lost.0);
            assert!(note.contains(&name), "{note}");
            // The same loss in one generation is a violation naming it.
            let mut one = packed_generation(0, 0);
            for (rank, steps) in ranks.iter().enumerate() {
                for (step, ids) in steps.iter().enumerate() {
                    let mut ids = ids.clone();
                    ids.retain(|&id| id != lost);
                    push(&mut one, rank, step as u64, RecordKind::Trained, &ids);
                }
                push(&mut one, rank, 3, RecordKind::EpochEnd, &[]);
            }
            let report = verify(&[one], &d);
            assert!(
                matches!(&report.violation, Some(Violation::Missing { sample, .. })
                    if sample.to_string() == name),
                "{report}"
            );
            // A document of the crashed run's counted steps again after
            // the resume is a repeat, whatever the plan.
            let report = resumed(None, Some(ranks[0][0][0]));
            assert!(
                matches!(report.violation, Some(Violation::Twice { .. })),
                "{report}"
            );
        }
    }

    #[test]
    fn a_sample_twice_is_named_with_both_places() {
        let d = dataset(Remainder::Drop);
        let all = sequence(&d);
        let mut g0 = generation(0, 0, 1);
        push(&mut g0, 0, 0, RecordKind::Trained, &all[..4]);
        push(&mut g0, 0, 1, RecordKind::Trained, &all[4..8]);
        // Resumed from step 2 with the state of step 1: samples 4..8 again.
        let mut g1 = generation(1, 2, 1);
        run(&mut g1, 0, 2, &all[4..], 4);
        let report = verify(&[g0, g1], &d);
        assert!(!report.ok);
        let Some(Violation::Twice {
            sample,
            first,
            again,
            ..
        }) = &report.violation
        else {
            panic!("{report}");
        };
        assert_eq!((sample.url.as_deref(), sample.index), (Some("b.tar"), 0));
        assert_eq!((first.generation, first.step), (0, 1));
        assert_eq!((again.generation, again.step), (1, 2));
        assert!(report.to_string().contains("sample 0 of b.tar came twice"));
    }

    #[test]
    fn a_sample_never_taken_in_a_complete_epoch_is_named_with_its_rank() {
        let d = dataset(Remainder::Drop);
        let all = sequence(&d);
        let mut g = generation(0, 0, 2);
        run(&mut g, 0, 0, &all[..6], 3);
        // Rank 1 skipped sample 1 of c.tar (position 8).
        let rank1: Vec<_> = all[6..]
            .iter()
            .copied()
            .filter(|&id| id != (2, 1))
            .collect();
        run(&mut g, 1, 0, &rank1, 3);
        let report = verify(&[g], &d);
        let Some(Violation::Missing {
            sample,
            rank,
            count,
            ..
        }) = &report.violation
        else {
            panic!("{report}");
        };
        assert_eq!((sample.shard, sample.index, *rank, *count), (2, 1, 1, 1));
    }

    #[test]
    fn drop_and_pad_remainders_are_accounted() {
        // 12 samples over 5 ranks: drop leaves the last 2 out, pad repeats
        // the first 3.
        let d = dataset(Remainder::Drop);
        let all = sequence(&d);
        let mut g = generation(0, 0, 5);
        for rank in 0..5 {
            run(&mut g, rank, 0, &all[rank * 2..rank * 2 + 2], 2);
        }
        let report = verify(&[g.clone()], &d);
        assert!(report.ok, "{report}");
        assert_eq!(report.epochs[0].dropped, 2);

        let d = dataset(Remainder::Pad);
        let mut padded = all.clone();
        padded.extend_from_slice(&all[..3]);
        let mut g = generation(0, 0, 5);
        for rank in 0..5 {
            run(&mut g, rank, 0, &padded[rank * 3..rank * 3 + 3], 3);
        }
        let report = verify(&[g.clone()], &d);
        assert!(report.ok, "{report}");
        assert_eq!(report.epochs[0].padded, 3);
        // A repeat outside the padding is a violation.
        g.ranks[4].records[0].ids[2] = (1, 1);
        assert!(matches!(
            verify(&[g], &d).violation,
            Some(Violation::Twice { .. })
        ));
    }

    #[test]
    fn an_epoch_without_its_end_is_in_progress_and_a_torn_record_is_reported() {
        let d = dataset(Remainder::Drop);
        let all = sequence(&d);
        let mut g = generation(0, 0, 1);
        push(&mut g, 0, 0, RecordKind::Trained, &all[..4]);
        g.ranks[0].torn = Some(TornTail {
            offset: 88,
            bytes: 30,
        });
        let report = verify(&[g], &d);
        assert!(report.ok, "{report}");
        assert!(!report.epochs[0].complete);
        assert_eq!(report.torn.len(), 1);
        assert!(report.to_string().contains("cut short at byte 88"));
    }

    #[test]
    fn unequal_steps_and_foreign_ids_are_violations() {
        let d = dataset(Remainder::Drop);
        let all = sequence(&d);
        let mut g = generation(0, 0, 2);
        run(&mut g, 0, 0, &all[..6], 3);
        run(&mut g, 1, 0, &all[6..], 6);
        let report = verify(&[g], &d);
        assert_eq!(
            report.violation,
            Some(Violation::UnequalSteps {
                epoch: 0,
                generation: 0,
                steps: vec![2, 1]
            })
        );
        let mut g = generation(0, 0, 1);
        push(&mut g, 0, 0, RecordKind::Trained, &[(0, 4)]);
        assert!(matches!(
            verify(&[g], &d).violation,
            Some(Violation::NotInDataset { .. })
        ));
    }

    #[test]
    fn skipped_steps_count_as_taken() {
        let d = dataset(Remainder::Drop);
        let all = sequence(&d);
        let mut g = generation(0, 0, 1);
        push(&mut g, 0, 0, RecordKind::Trained, &all[..6]);
        push(&mut g, 0, 1, RecordKind::Skipped, &all[6..]);
        push(&mut g, 0, 1, RecordKind::EpochEnd, &[]);
        let report = verify(&[g], &d);
        assert!(report.ok, "{report}");
        assert_eq!((report.epochs[0].trained, report.epochs[0].skipped), (6, 6));
    }

    /// Every position of an epoch's sequence names its sample, shards of
    /// no samples and a shuffled shard order included.
    #[test]
    fn each_position_names_its_sample() {
        for shuffle_shards in [false, true] {
            let d = Dataset {
                urls: (0..5).map(|i| format!("{i}.tar")).collect(),
                counts: vec![2, 0, 3, 0, 1],
                seed: 7,
                shuffle_shards,
                remainder: Remainder::Drop,
                packed: false,
                packing: None,
            };
            let sequence = Sequence::new(&d, 3);
            assert_eq!(sequence.total, 6);
            for position in 0..sequence.total {
                let (shard, index) = sequence.sample_at(position);
                assert_eq!(sequence.position(&d, (shard as u64, index)), Some(position));
            }
        }
    }

    /// Samples a stream left out under `on_error="warn"` (its rank's skips
    /// file) are accounted; only those: of another epoch, shard or range
    /// they are missing.
    #[test]
    fn samples_left_out_under_warn_are_accounted() {
        let d = dataset(Remainder::Drop);
        let all = sequence(&d);
        // Samples 1.. of b.tar (shard 1) and sample 2 of c.tar never came.
        let taken: Vec<(u64, u64)> = all
            .iter()
            .copied()
            .filter(|&(s, i)| !(s == 1 && i >= 1) && (s, i) != (2, 2))
            .collect();
        let skip = |epoch, shard, first, end| ErrorSkip {
            epoch,
            shard,
            first,
            end,
            worker: Some(0),
            reason: "bad".into(),
            cause: SkipCause::Error,
        };
        let check = |skips: Vec<ErrorSkip>| {
            let mut g = generation(0, 0, 1);
            run(&mut g, 0, 0, &taken, 4);
            g.ranks[0].error_skips = skips;
            verify(&[g], &d)
        };
        let report = check(vec![skip(0, 1, 1, None), skip(0, 2, 2, Some(3))]);
        assert!(report.ok, "{report}");
        assert_eq!(report.epochs[0].left_out_on_error, 3);
        assert_eq!(report.error_skips.len(), 2);
        assert!(
            report.to_string().contains("3 left out by on_error"),
            "{report}"
        );
        for (wrong, missing) in [
            (vec![skip(1, 1, 1, None), skip(0, 2, 2, Some(3))], 2),
            (vec![skip(0, 1, 2, None), skip(0, 2, 2, Some(3))], 1),
            (vec![skip(0, 1, 1, None), skip(0, 2, 3, None)], 1),
        ] {
            let report = check(wrong);
            assert!(
                matches!(report.violation, Some(Violation::Missing { count, .. }) if count == missing),
                "{report}"
            );
        }
        // Documents with no tokens a packer had no sequence for are counted
        // apart from errors, and named as such.
        let empty = ErrorSkip {
            cause: SkipCause::NoTokens,
            ..skip(0, 2, 2, Some(3))
        };
        let report = check(vec![skip(0, 1, 1, None), empty]);
        assert!(report.ok, "{report}");
        assert_eq!(
            (
                report.epochs[0].left_out_on_error,
                report.epochs[0].left_out_no_tokens
            ),
            (2, 1)
        );
        let text = report.to_string();
        assert!(
            text.contains("2 left out by on_error")
                && text.contains("1 with no tokens left out")
                && text.contains("of shard index 2 (documents with no tokens)"),
            "{text}"
        );
    }
}
