//! Stream state for exact and elastic resume. The consumer keeps a mirror
//! of the pipeline's position (cursor, shuffle buffer ids, RNG word
//! position, and a checksum of what was handed out) as of the last sample
//! it handed out; restoring re-reads only the samples the buffer held. The
//! JSON form is documented by `schemas/state.schema.json`.
//!
//! A loaded state is never trusted: [`resolve`] checks every field against
//! the dataset and the plan before anything is read, so a damaged, edited or
//! mismatched state is an [`Error::StateMismatch`] naming the field, never a
//! panic, a repeated sample or a silently shorter epoch.

pub mod mix;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Display;
use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::config::StreamOptions;
use crate::error::{Error, Result};
use crate::format::SampleId;
use crate::hash::{splitmix64, Fnv1a, GOLDEN_GAMMA};
use crate::plan::cut::Piece;
use crate::plan::resume::{self, Replanner};
use crate::plan::{self, SlotSpec, WorkUnit};
use crate::shard::{Shard, ShardKind};

/// The `format` field of every state.
pub const STATE_FORMAT: &str = "shardstream.state";
/// The state version this build reads and writes.
pub const STATE_VERSION: u32 = 2;

/// RNG words the shuffle buffer may draw beyond two per sample handed out:
/// a draw takes one `u64` (two words) and is redrawn only on a rejection,
/// whose chance is below `shuffle_buffer / 2^64` per draw.
const SPARE_RNG_WORDS: u128 = 64;

/// Where a slot's reading stands: the next sample to read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Cursor {
    /// Position of the current work unit in the slot's unit list.
    pub unit: usize,
    /// Index in its shard of the next sample to read; `None` at the unit's start.
    pub next_sample: Option<u64>,
}

/// The state of one slot's stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlotState {
    /// Always [`STATE_FORMAT`].
    pub format: String,
    /// Always [`STATE_VERSION`].
    pub version: u32,
    /// Fingerprint of the dataset and the options that shape the epoch.
    pub fingerprint: String,
    /// Epoch.
    pub epoch: u64,
    /// Number of processes.
    pub world_size: usize,
    /// Rank.
    pub rank: usize,
    /// Workers per process.
    pub num_workers: usize,
    /// Worker id.
    pub worker_id: usize,
    /// Samples this slot has handed out.
    pub produced: u64,
    /// Samples of this slot's units passed over because their shard was
    /// skipped under `on_error="warn"` (counted where sample counts are known).
    pub skipped: u64,
    /// Next sample to read.
    pub cursor: Cursor,
    /// Ids `[shard, index]` held by the shuffle buffer, in buffer order.
    pub buffer: Vec<[u64; 2]>,
    /// The shuffle RNG's word position (decimal).
    pub rng_word_pos: String,
    /// Order-independent checksum (16 hex digits) of the ids of the samples
    /// handed out or skipped.
    pub digest: String,
    /// The slot has handed out its last sample.
    pub finished: bool,
    /// When this epoch was itself resumed elastically: the states it resumed from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resumed_from: Option<Vec<SlotState>>,
}

impl SlotState {
    /// Parses and checks a state's form (its fit to a dataset is checked by [`resolve`]).
    pub fn from_json(json: &str) -> Result<Self> {
        let value: serde_json::Value = serde_json::from_str(json)
            .map_err(|e| Error::StateMismatch(format!("not a shardstream state: {e}")))?;
        // The format and version first, so that a state of another version
        // is named as such rather than by the first field it lacks.
        let format = value.get("format").and_then(|v| v.as_str());
        let version = value.get("version").and_then(|v| v.as_u64());
        if let (Some(STATE_FORMAT), Some(version)) = (format, version) {
            if version != u64::from(STATE_VERSION) {
                return Err(Error::StateMismatch(format!(
                    "state field version: this build reads version {STATE_VERSION} states, \
                     the state is version {version} (saved by another shardstream version)"
                )));
            }
        }
        let state: SlotState = serde_json::from_value(value)
            .map_err(|e| Error::StateMismatch(format!("not a shardstream state: {e}")))?;
        state.check_format()?;
        Ok(state)
    }

    /// The state as JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("a state serialises")
    }

    fn check_format(&self) -> Result<()> {
        if self.format != STATE_FORMAT || self.version != STATE_VERSION {
            return Err(Error::StateMismatch(format!(
                "expected format {STATE_FORMAT:?} version {STATE_VERSION}, got {:?} version {}",
                self.format, self.version
            )));
        }
        if let Some(from) = &self.resumed_from {
            from.iter().try_for_each(SlotState::check_format)?;
        }
        Ok(())
    }

    /// The slot layout the state was saved with.
    pub fn slot(&self) -> Result<SlotSpec> {
        self.checked_slot("")
    }

    /// The slot layout, each number checked; `prefix` names the state in errors.
    fn checked_slot(&self, prefix: &str) -> Result<SlotSpec> {
        if self.world_size == 0 {
            return Err(field_error(prefix, "world_size", "must be at least 1"));
        }
        if self.world_size > plan::slot::MAX_WORLD_SIZE {
            return Err(field_error(
                prefix,
                "world_size",
                format!(
                    "{} is above {}",
                    self.world_size,
                    plan::slot::MAX_WORLD_SIZE
                ),
            ));
        }
        if self.num_workers == 0 {
            return Err(field_error(prefix, "num_workers", "must be at least 1"));
        }
        if self.world_size.saturating_mul(self.num_workers) > plan::slot::MAX_SLOTS {
            return Err(field_error(
                prefix,
                "num_workers",
                format!(
                    "{} x world_size {} is above {} slots",
                    self.num_workers,
                    self.world_size,
                    plan::slot::MAX_SLOTS
                ),
            ));
        }
        if self.rank >= self.world_size {
            return Err(field_error(
                prefix,
                "rank",
                format!("{} is not below world_size {}", self.rank, self.world_size),
            ));
        }
        if self.worker_id >= self.num_workers {
            return Err(field_error(
                prefix,
                "worker_id",
                format!(
                    "{} is not below num_workers {}",
                    self.worker_id, self.num_workers
                ),
            ));
        }
        Ok(SlotSpec {
            world_size: self.world_size,
            rank: self.rank,
            num_workers: self.num_workers,
            worker_id: self.worker_id,
        })
    }

    /// Held sample ids.
    pub fn buffer_ids(&self) -> Vec<SampleId> {
        self.buffer
            .iter()
            .map(|&[shard, index]| SampleId {
                shard: usize::try_from(shard).unwrap_or(usize::MAX),
                index,
            })
            .collect()
    }

    /// The RNG word position.
    pub fn word_pos(&self) -> Result<u128> {
        parse_decimal(&self.rng_word_pos).ok_or_else(|| {
            field_error(
                "",
                "rng_word_pos",
                format!(
                    "{:?} is not a decimal number below 2^128",
                    self.rng_word_pos
                ),
            )
        })
    }

    /// The checksum of the samples handed out or skipped.
    pub fn digest_value(&self) -> Result<u64> {
        parse_digest(&self.digest).ok_or_else(|| {
            field_error(
                "",
                "digest",
                format!(
                    "{:?} is not 16 hexadecimal digits below 2^61 - 1",
                    self.digest
                ),
            )
        })
    }
}

/// The error for a state field; `prefix` names the state within a list
/// (`slots[2].`, `resumed_from[0].`), empty for a single state.
fn field_error(prefix: &str, field: &str, reason: impl Display) -> Error {
    Error::StateMismatch(format!("state field {prefix}{field}: {reason}"))
}

fn parse_decimal(text: &str) -> Option<u128> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

fn parse_digest(text: &str) -> Option<u64> {
    if text.len() != 16 || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u64::from_str_radix(text, 16).ok().filter(|&d| d < P)
}

/// A digest as the state's 16 hex digits.
pub(crate) fn format_digest(digest: u64) -> String {
    format!("{digest:016x}")
}

// Digests: sample `i` of shard `s` hashes to `c_s * g_s^i` in the integers
// modulo the prime 2^61 - 1 (`c_s`, `g_s` drawn from `s`), and a digest is
// the sum of the hashes of its ids. The sum does not depend on the order of
// the ids, the sum over a run of samples has a closed form (a geometric
// series), and the next sample of a shard hashes with one multiplication.

/// The Mersenne prime 2^61 - 1.
const P: u64 = (1 << 61) - 1;

fn mul_mod(a: u64, b: u64) -> u64 {
    let x = u128::from(a) * u128::from(b);
    let folded = ((x & u128::from(P)) + (x >> 61)) as u64;
    let r = (folded & P) + (folded >> 61);
    if r >= P {
        r - P
    } else {
        r
    }
}

fn add_mod(a: u64, b: u64) -> u64 {
    let s = a + b;
    if s >= P {
        s - P
    } else {
        s
    }
}

fn sub_mod(a: u64, b: u64) -> u64 {
    add_mod(a, P - b)
}

fn pow_mod(mut base: u64, mut exp: u64) -> u64 {
    let mut result = 1;
    while exp > 0 {
        if exp & 1 == 1 {
            result = mul_mod(result, base);
        }
        base = mul_mod(base, base);
        exp >>= 1;
    }
    result
}

/// `(c, g)` of a shard: `c` in `1..P`, `g` in `2..P`.
fn shard_key(shard: u64) -> (u64, u64) {
    let c = 1 + splitmix64(shard ^ GOLDEN_GAMMA) % (P - 1);
    let g = 2 + splitmix64(shard ^ 0xd1b5_4a32_d192_ed03) % (P - 2);
    (c, g)
}

/// A sample id's share of a digest.
fn id_hash(shard: u64, index: u64) -> u64 {
    let (c, g) = shard_key(shard);
    mul_mod(c, pow_mod(g, index))
}

/// The digest of the samples of `runs` (`(shard, samples)`), as a state's
/// `digest` holds it for the samples a slot handed out.
pub fn runs_digest(runs: &[(usize, Range<u64>)]) -> u64 {
    runs.iter().fold(0, |digest, (shard, samples)| {
        add_mod(digest, range_hash(*shard as u64, samples.clone()))
    })
}

/// The digest of a run of samples of one shard.
fn range_hash(shard: u64, samples: Range<u64>) -> u64 {
    if samples.start >= samples.end {
        return 0;
    }
    let (c, g) = shard_key(shard);
    // c g^a (g^n - 1) / (g - 1); g - 1 is in 1..P - 1, so invertible.
    let series = mul_mod(
        sub_mod(pow_mod(g, samples.end - samples.start), 1),
        pow_mod(g - 1, P - 2),
    );
    mul_mod(mul_mod(c, pow_mod(g, samples.start)), series)
}

/// Fingerprint of the dataset (URLs, sizes, sample spans) and of the options
/// that decide which samples come in which order
/// ([`StreamOptions::order_bytes`]: each option of
/// [`crate::config::DATASET_OPTIONS`] says whether it does). Options that
/// change only what a sample carries, not which samples come when
/// (`sample_seed`, the I/O and output options), are left out: a state
/// resumes with them changed.
pub fn fingerprint(shards: &[Shard], options: &StreamOptions) -> String {
    let mut h = Fnv1a::new();
    h.u64(shards.len() as u64);
    for shard in shards {
        h.u64(shard.url.len() as u64).bytes(shard.url.as_bytes());
        h.u64(shard.size.map_or(u64::MAX, |s| s));
        match &shard.index {
            None => h.u64(u64::MAX),
            Some(index) => {
                h.u64(index.len());
                for i in 0..index.len() {
                    h.u64(index.offset(i)).u64(index.length(i));
                }
                &mut h
            }
        };
    }
    for shard in shards {
        match &shard.kind {
            ShardKind::Tar => h.u64(0),
            ShardKind::Raw => h.u64(1),
            ShardKind::Parquet(group) => h.u64(3).u64(group.index as u64).u64(group.rows),
        };
    }
    h.bytes(&options.order_bytes());
    format!("{:016x}", h.finish())
}

/// A change to the consumer's mirror of the pipeline, in pipeline order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// A sample of the unit at `unit` entered the shuffle buffer.
    Push {
        /// Unit position.
        unit: usize,
        /// The sample.
        id: SampleId,
    },
    /// The unit at `unit` has been read to its end.
    UnitDone {
        /// Unit position.
        unit: usize,
    },
    /// The unit at `unit` ended at an error skipped under
    /// `on_error="warn"`: what it had left is skipped.
    UnitSkipped {
        /// Unit position.
        unit: usize,
    },
    /// The buffer item at `index` was handed out (swap-removed); the RNG then
    /// stood at `rng_word_pos`.
    Pop {
        /// Index in the buffer.
        index: usize,
        /// RNG word position after the draw.
        rng_word_pos: u128,
    },
}

/// The samples a unit left out when it ended at an error skipped under
/// `on_error="warn"`: `first..end` of shard `shard` (`end` `None`: to the
/// shard's end, its count unknown).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SkippedSamples {
    /// Index of the shard in the dataset.
    pub shard: usize,
    /// The first sample left out.
    pub first: u64,
    /// The sample after the last left out, when the unit's count is known.
    pub end: Option<u64>,
}

/// The consumer's copy of the pipeline position as of the last sample handed out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mirror {
    /// Samples handed out.
    pub produced: u64,
    /// Samples of units skipped under `on_error="warn"` (where counts are known).
    pub skipped: u64,
    /// Next sample to read.
    pub cursor: Cursor,
    /// Buffer ids in buffer order.
    pub buffer: Vec<SampleId>,
    /// RNG word position.
    pub rng_word_pos: u128,
    /// Checksum of the ids handed out or skipped.
    pub digest: u64,
    /// The digest share of each held id, in buffer order.
    held: Vec<u64>,
    /// The last id pushed, its share and its shard's `g`: the next sample
    /// of the shard hashes with one multiplication.
    last_push: Option<(SampleId, u64, u64)>,
}

impl Mirror {
    /// The mirror at the start of a slot's epoch.
    pub fn start() -> Self {
        Mirror {
            produced: 0,
            skipped: 0,
            cursor: Cursor {
                unit: 0,
                next_sample: None,
            },
            buffer: Vec::new(),
            rng_word_pos: 0,
            digest: 0,
            held: Vec::new(),
            last_push: None,
        }
    }

    /// The mirror a saved state describes (its fields parsed, not checked
    /// against a dataset: see [`resolve`]).
    pub fn from_state(state: &SlotState) -> Result<Self> {
        let buffer = state.buffer_ids();
        Ok(Mirror {
            produced: state.produced,
            skipped: state.skipped,
            cursor: state.cursor,
            held: buffer
                .iter()
                .map(|id| id_hash(id.shard as u64, id.index))
                .collect(),
            buffer,
            rng_word_pos: state.word_pos()?,
            digest: state.digest_value()?,
            last_push: None,
        })
    }

    /// Applies the ops of one message to the mirror of a slot reading
    /// `units`; a `Pop` counts one sample handed out. Returns what each
    /// [`Op::UnitSkipped`] left out.
    pub fn apply(&mut self, ops: &[Op], units: &[WorkUnit]) -> Vec<SkippedSamples> {
        let mut skips = Vec::new();
        for op in ops {
            match *op {
                Op::Push { unit, id } => {
                    let (hash, g) = match self.last_push {
                        Some((last, hash, g))
                            if last.shard == id.shard
                                && last.index.checked_add(1) == Some(id.index) =>
                        {
                            (mul_mod(hash, g), g)
                        }
                        _ => (
                            id_hash(id.shard as u64, id.index),
                            shard_key(id.shard as u64).1,
                        ),
                    };
                    self.last_push = Some((id, hash, g));
                    self.buffer.push(id);
                    self.held.push(hash);
                    self.cursor = Cursor {
                        unit,
                        next_sample: Some(id.index.saturating_add(1)),
                    };
                }
                Op::UnitDone { unit } | Op::UnitSkipped { unit } => {
                    // What the unit had left when it ended was skipped.
                    let from = match self.cursor {
                        Cursor {
                            unit: at,
                            next_sample: Some(next),
                        } if at == unit => Some(next),
                        _ => None,
                    };
                    let work = units.get(unit);
                    if let Some((work, samples)) =
                        work.and_then(|w| w.samples.as_ref().map(|s| (w, s)))
                    {
                        let from = from.map_or(samples.start, |next| next.max(samples.start));
                        let left = from..samples.end.max(from);
                        self.skipped = self.skipped.saturating_add(left.end - left.start);
                        self.digest = add_mod(self.digest, range_hash(work.shard as u64, left));
                    }
                    if let (Op::UnitSkipped { .. }, Some(work)) = (op, work) {
                        let (start, end) = work
                            .samples
                            .as_ref()
                            .map_or((0, None), |s| (s.start, Some(s.end)));
                        let first = from.map_or(start, |next| next.max(start));
                        skips.push(SkippedSamples {
                            shard: work.shard,
                            first,
                            end: end.map(|end| end.max(first)),
                        });
                    }
                    self.cursor = Cursor {
                        unit: unit + 1,
                        next_sample: None,
                    };
                }
                Op::Pop {
                    index,
                    rng_word_pos,
                } => {
                    self.buffer.swap_remove(index);
                    let hash = self.held.swap_remove(index);
                    self.digest = add_mod(self.digest, hash);
                    self.rng_word_pos = rng_word_pos;
                    self.produced = self.produced.saturating_add(1);
                }
            }
        }
        skips
    }
}

/// What a stream resumes from (made once per stream: its size does not matter).
#[derive(Debug, Clone)]
#[allow(clippy::large_enum_variant)]
pub enum Resume {
    /// The state of this very slot, saved with the same layout: the rest of
    /// the epoch comes in exactly the uninterrupted order.
    Exact(SlotState),
    /// The states of every slot of another layout: the samples they had not
    /// handed out are split anew.
    Elastic(Vec<SlotState>),
}

/// Where a slot's stream starts, every field of a resumed state checked.
#[derive(Debug, Clone)]
pub struct Start {
    /// The epoch streamed (a resumed stream's comes from its state).
    pub epoch: u64,
    /// The slot states this epoch was split from, after an elastic resume.
    pub resumed_from: Option<Vec<SlotState>>,
    /// The slot's work units, in order.
    pub units: Vec<WorkUnit>,
    /// The position to start from.
    pub mirror: Mirror,
    /// The saved stream had handed out its last sample.
    pub finished: bool,
}

/// Plans `slot`'s stream for `epoch`, or for the epoch of `resume` after
/// checking every field of its states against the dataset (`shards`,
/// whose fingerprint with `options` is `fingerprint`) and the plan.
pub fn resolve(
    shards: &[Shard],
    options: &StreamOptions,
    fingerprint: &str,
    epoch: u64,
    slot: &SlotSpec,
    resume: Option<Resume>,
) -> Result<Start> {
    let dataset = Dataset::new(shards, options, fingerprint);
    match resume {
        None => Ok(Start {
            epoch,
            resumed_from: None,
            units: dataset.plans.slot_plan(epoch, slot),
            mirror: Mirror::start(),
            finished: false,
        }),
        Some(Resume::Exact(state)) => {
            check_exact(&state, fingerprint, slot)?;
            let units = match &state.resumed_from {
                None => dataset.plans.slot_plan(state.epoch, slot),
                Some(from) => {
                    let split = dataset.split(from, "resumed_from", Some(state.epoch))?;
                    dataset.plans.slot_recut(&split.remaining, slot)
                }
            };
            dataset.check_slot(&state, &units, "")?;
            Ok(Start {
                epoch: state.epoch,
                mirror: Mirror::from_state(&state)?,
                finished: state.finished,
                resumed_from: state.resumed_from,
                units,
            })
        }
        Some(Resume::Elastic(states)) => {
            // Always split anew, even onto the same layout: the old slots
            // may have produced different amounts.
            let split = dataset.split(&states, "slots", None)?;
            let units = dataset.plans.slot_recut(&split.remaining, slot);
            Ok(Start {
                epoch: split.epoch,
                resumed_from: Some(split.states),
                units,
                mirror: Mirror::start(),
                finished: false,
            })
        }
    }
}

/// Checks that `state` was saved by this dataset and options, for this slot.
pub fn check_exact(state: &SlotState, fingerprint: &str, slot: &SlotSpec) -> Result<()> {
    check_fingerprint(state, fingerprint, "")?;
    let saved = (
        state.world_size,
        state.rank,
        state.num_workers,
        state.worker_id,
    );
    let here = (slot.world_size, slot.rank, slot.num_workers, slot.worker_id);
    if saved != here {
        let field = if saved.0 != here.0 {
            "world_size"
        } else if saved.2 != here.2 {
            "num_workers"
        } else if saved.1 != here.1 {
            "rank"
        } else {
            "worker_id"
        };
        return Err(field_error(
            "",
            field,
            format!(
                "the state is for rank {} worker {} of {} x {} slots, this stream is rank {} worker {} of {} x {}",
                state.rank,
                state.worker_id,
                state.world_size,
                state.num_workers,
                slot.rank,
                slot.worker_id,
                slot.world_size,
                slot.num_workers
            ),
        ));
    }
    Ok(())
}

fn check_fingerprint(state: &SlotState, fingerprint: &str, prefix: &str) -> Result<()> {
    if state.fingerprint != fingerprint {
        return Err(field_error(
            prefix,
            "fingerprint",
            format!(
                "the state was saved for another dataset or options (fingerprint {} here, {:?} in the state)",
                fingerprint, state.fingerprint
            ),
        ));
    }
    Ok(())
}

/// The slot states of one elastic resume, checked, and what they had not
/// handed out.
struct Split {
    /// Their epoch.
    epoch: u64,
    /// One state per slot, in slot order.
    states: Vec<SlotState>,
    /// The samples not handed out, as runs in slot order: each slot's held
    /// buffer samples, then the rest of its current unit, then its later units.
    remaining: Vec<Piece>,
}

/// What states are checked against.
struct Dataset<'a> {
    options: &'a StreamOptions,
    fingerprint: &'a str,
    /// The dataset's plans for any layout.
    plans: Replanner,
}

impl<'a> Dataset<'a> {
    fn new(shards: &[Shard], options: &'a StreamOptions, fingerprint: &'a str) -> Self {
        Dataset {
            options,
            fingerprint,
            plans: Replanner::new(
                shards.iter().map(Shard::info).collect(),
                options.seed,
                options.shuffle_shards,
                options.remainder,
            ),
        }
    }

    /// Checks that `states` (named `path` in errors) are every slot of one
    /// layout, for this dataset and one epoch (`epoch`, when given), each
    /// state fitting its slot's plan, and returns what they had not handed out.
    fn split(&self, states: &[SlotState], path: &str, epoch: Option<u64>) -> Result<Split> {
        let Some(first) = states.first() else {
            return Err(Error::StateMismatch(format!(
                "state field {path}: empty; an elastic resume needs the state of every slot of the saved job"
            )));
        };
        let layout = (first.epoch, first.world_size, first.num_workers);
        for (i, state) in states.iter().enumerate() {
            let prefix = format!("{path}[{i}].");
            check_fingerprint(state, self.fingerprint, &prefix)?;
            for (field, value, expected) in [
                ("epoch", state.epoch, layout.0),
                ("world_size", state.world_size as u64, layout.1 as u64),
                ("num_workers", state.num_workers as u64, layout.2 as u64),
            ] {
                if value != expected {
                    return Err(field_error(
                        &prefix,
                        field,
                        format!("{value}, but {path}[0] has {expected}: the slot states are of different epochs or layouts"),
                    ));
                }
            }
            state.checked_slot(&prefix)?;
            if state.resumed_from != first.resumed_from {
                return Err(field_error(
                    &prefix,
                    "resumed_from",
                    format!(
                        "differs from {path}[0]'s: the slot states come from different resumes"
                    ),
                ));
            }
        }
        if let Some(epoch) = epoch {
            if layout.0 != epoch {
                return Err(field_error(
                    &format!("{path}[0]."),
                    "epoch",
                    format!(
                        "{}, but the state resumed from it is of epoch {epoch}",
                        layout.0
                    ),
                ));
            }
        }
        let (epoch, world_size, num_workers) = layout;
        let by_slot = self.every_slot(states, path, world_size, num_workers)?;
        if !self.plans.counts_known() {
            return Err(Error::StateMismatch(
                "elastic resume needs sample counts: build a manifest with `shardstream index`"
                    .into(),
            ));
        }
        let mut slot_units = match &first.resumed_from {
            None => self.plans.plan(epoch, world_size, num_workers),
            Some(from) => {
                let inner = self.split(from, &format!("{path}[0].resumed_from"), Some(epoch))?;
                self.plans.recut(&inner.remaining, world_size, num_workers)
            }
        };
        let mut remaining = Vec::new();
        for (slot, &i) in by_slot.iter().enumerate() {
            let state = &states[i];
            let units = std::mem::take(&mut slot_units[slot]);
            self.check_slot(state, &units, &format!("{path}[{i}]."))?;
            if !state.finished {
                remaining.extend(remaining_of(state, &units));
            }
        }
        Ok(Split {
            epoch,
            states: by_slot.iter().map(|&i| states[i].clone()).collect(),
            remaining,
        })
    }

    /// For each slot of the layout in order, the position in `states` of
    /// its state: each slot once (a state given twice counts once; two
    /// different states of one slot are an error).
    fn every_slot(
        &self,
        states: &[SlotState],
        path: &str,
        world_size: usize,
        num_workers: usize,
    ) -> Result<Vec<usize>> {
        let mut by_slot: BTreeMap<(usize, usize), usize> = BTreeMap::new();
        for (i, state) in states.iter().enumerate() {
            let key = (state.rank, state.worker_id);
            match by_slot.get(&key) {
                Some(&j) if states[j] != *state => {
                    return Err(field_error(
                        &format!("{path}[{i}]."),
                        "rank",
                        format!(
                            "a second, different state of rank {} worker {} (the first is {path}[{j}])",
                            state.rank, state.worker_id
                        ),
                    ));
                }
                Some(_) => {}
                None => {
                    by_slot.insert(key, i);
                }
            }
        }
        let expected = world_size.checked_mul(num_workers);
        if expected != Some(by_slot.len()) {
            // The first slot missing (ranks and workers are below the
            // layout's, so one is missing when there are fewer).
            let missing = (0..world_size)
                .flat_map(|rank| (0..num_workers).map(move |worker| (rank, worker)))
                .find(|key| !by_slot.contains_key(key))
                .unwrap_or((0, 0));
            return Err(Error::StateMismatch(format!(
                "state field {path}: elastic resume needs the state of every one of the {world_size} x {num_workers} slots, got {} distinct (rank {} worker {} is missing)",
                by_slot.len(),
                missing.0,
                missing.1
            )));
        }
        Ok(by_slot.into_values().collect())
    }

    /// Checks the position fields of `state` (named by `prefix`) against
    /// the units of its slot: the cursor lies within them, the buffer holds
    /// distinct samples the cursor has passed, no more than the shuffle
    /// buffer holds, and what the cursor has passed is exactly what was
    /// handed out, held or skipped (by count and by checksum).
    fn check_slot(&self, state: &SlotState, units: &[WorkUnit], prefix: &str) -> Result<()> {
        let error = |field: &str, reason: String| field_error(prefix, field, reason);
        let word_pos = parse_decimal(&state.rng_word_pos).ok_or_else(|| {
            error(
                "rng_word_pos",
                format!(
                    "{:?} is not a decimal number below 2^128",
                    state.rng_word_pos
                ),
            )
        })?;
        let digest = parse_digest(&state.digest).ok_or_else(|| {
            error(
                "digest",
                format!(
                    "{:?} is not 16 hexadecimal digits below 2^61 - 1",
                    state.digest
                ),
            )
        })?;
        let held = state.buffer.len();
        if held > self.options.shuffle_buffer {
            return Err(error(
                "buffer",
                format!(
                    "holds {held} samples, more than the shuffle buffer's {}",
                    self.options.shuffle_buffer
                ),
            ));
        }
        let cursor = state.cursor;
        self.check_cursor(cursor, units, prefix)?;
        self.check_buffer(state, units, prefix)?;
        if state.finished && (held > 0 || cursor.unit < units.len()) {
            return Err(error(
                "finished",
                format!(
                    "true, yet the state holds {held} samples and its cursor is at work unit {} of {}",
                    cursor.unit,
                    units.len()
                ),
            ));
        }
        match passed(units, cursor) {
            Some((count, passed_digest)) => {
                let accounted =
                    u128::from(state.produced) + held as u128 + u128::from(state.skipped);
                if accounted != u128::from(count) {
                    return Err(error(
                        "produced",
                        format!(
                            "{} handed out + {held} held + {} skipped is not the {count} samples the cursor has passed",
                            state.produced, state.skipped
                        ),
                    ));
                }
                let held_digest = state.buffer.iter().fold(0u64, |sum, &[shard, index]| {
                    add_mod(sum, id_hash(shard, index))
                });
                if sub_mod(passed_digest, held_digest) != digest {
                    return Err(error(
                        "digest",
                        "does not match the samples the cursor has passed less those the buffer holds".into(),
                    ));
                }
            }
            None if state.skipped != 0 => {
                return Err(error(
                    "skipped",
                    format!(
                        "{}, but skips are counted only where sample counts are known",
                        state.skipped
                    ),
                ));
            }
            None => {}
        }
        let draws = 2 * u128::from(state.produced);
        let rng_fits = if self.options.shuffle_buffer == 0 {
            word_pos == 0
        } else {
            (draws..=draws + SPARE_RNG_WORDS).contains(&word_pos)
        };
        if !rng_fits {
            return Err(error(
                "rng_word_pos",
                format!(
                    "{word_pos} does not fit {} samples handed out (shuffle_buffer {})",
                    state.produced, self.options.shuffle_buffer
                ),
            ));
        }
        Ok(())
    }

    fn check_cursor(&self, cursor: Cursor, units: &[WorkUnit], prefix: &str) -> Result<()> {
        let error = |field: &str, reason: String| field_error(prefix, field, reason);
        let Some(unit) = units.get(cursor.unit) else {
            if cursor.unit > units.len() {
                return Err(error(
                    "cursor.unit",
                    format!(
                        "{} is past the slot's {} work units",
                        cursor.unit,
                        units.len()
                    ),
                ));
            }
            if let Some(next) = cursor.next_sample {
                return Err(error(
                    "cursor.next_sample",
                    format!(
                        "{next}, but the cursor is past the slot's last work unit (null expected)"
                    ),
                ));
            }
            return Ok(());
        };
        let Some(next) = cursor.next_sample else {
            return Ok(());
        };
        // After reading sample i of the unit the cursor stands at i + 1.
        let within = match &unit.samples {
            Some(samples) => samples.start < next && next <= samples.end,
            None => {
                next >= 1
                    && self
                        .plans
                        .samples_of(unit.shard)
                        .is_none_or(|count| next <= count)
            }
        };
        if !within {
            let of = match &unit.samples {
                Some(samples) => format!("samples {}..{}", samples.start, samples.end),
                None => match self.plans.samples_of(unit.shard) {
                    Some(count) => format!("the {count} samples"),
                    None => "the samples".into(),
                },
            };
            return Err(error(
                "cursor.next_sample",
                format!(
                    "{next} does not follow one of {of} of shard {} (work unit {})",
                    unit.shard, cursor.unit
                ),
            ));
        }
        Ok(())
    }

    fn check_buffer(&self, state: &SlotState, units: &[WorkUnit], prefix: &str) -> Result<()> {
        let cursor = state.cursor;
        // The units the cursor has reached, by shard: (position, samples).
        type Reached = Vec<(usize, Option<Range<u64>>)>;
        let mut reached: HashMap<usize, Reached> = HashMap::new();
        for (position, unit) in units.iter().enumerate().take(cursor.unit.saturating_add(1)) {
            reached
                .entry(unit.shard)
                .or_default()
                .push((position, unit.samples.clone()));
        }
        let has_read = |shard: usize, index: u64| {
            reached.get(&shard).is_some_and(|at| {
                at.iter().any(|(position, samples)| {
                    let samples = samples.clone().unwrap_or(0..u64::MAX);
                    if *position < cursor.unit {
                        samples.contains(&index)
                    } else {
                        index >= samples.start
                            && cursor.next_sample.is_some_and(|next| index < next)
                    }
                })
            })
        };
        let mut seen = HashSet::with_capacity(state.buffer.len());
        for (i, &[shard, index]) in state.buffer.iter().enumerate() {
            let error = |reason: String| field_error(prefix, &format!("buffer[{i}]"), reason);
            let shard_index = usize::try_from(shard)
                .ok()
                .filter(|&s| s < self.plans.shard_count())
                .ok_or_else(|| {
                    error(format!(
                        "shard {shard} is not below the dataset's {} shards",
                        self.plans.shard_count()
                    ))
                })?;
            if let Some(count) = self.plans.samples_of(shard_index) {
                if index >= count {
                    return Err(error(format!(
                        "sample {index} of shard {shard} is not below the shard's {count} samples"
                    )));
                }
            }
            if !seen.insert((shard, index)) {
                return Err(error(format!(
                    "sample {index} of shard {shard} is held twice"
                )));
            }
            if !has_read(shard_index, index) {
                return Err(error(format!(
                    "sample {index} of shard {shard} is not among the samples the slot's cursor has passed"
                )));
            }
        }
        Ok(())
    }
}

/// The number of samples the cursor has passed in `units` and their
/// digest, when every unit passed knows its samples.
fn passed(units: &[WorkUnit], cursor: Cursor) -> Option<(u64, u64)> {
    let (mut count, mut digest) = (0u64, 0u64);
    let current = match cursor.next_sample {
        Some(next) => units
            .get(cursor.unit)
            .map(|u| (u.shard, u.samples.as_ref().map(|s| s.start..next))),
        None => None,
    };
    let whole = units
        .iter()
        .take(cursor.unit)
        .map(|u| (u.shard, u.samples.clone()));
    for (shard, samples) in whole.chain(current) {
        let samples = samples?;
        count = count.checked_add(samples.end.saturating_sub(samples.start))?;
        digest = add_mod(digest, range_hash(shard as u64, samples));
    }
    Some((count, digest))
}

/// What a checked slot state had not handed out: its held samples, then
/// the rest of its current unit, then its later units.
fn remaining_of(state: &SlotState, units: &[WorkUnit]) -> Vec<Piece> {
    let held = state.buffer_ids().into_iter().map(|id| Piece {
        shard: id.shard,
        samples: id.index..id.index + 1,
    });
    held.chain(resume::unread(
        units,
        state.cursor.unit,
        state.cursor.next_sample,
    ))
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fixed shards and option sets whose fingerprints are pinned.
    fn pinned_cases() -> Vec<(Vec<Shard>, StreamOptions)> {
        use std::str::FromStr;
        let mut indexed = Shard::new("s3://bucket/train/b.tar", Some(4096));
        indexed.index = Some(std::sync::Arc::new(crate::shard::SampleIndex::from_spans(
            &[(0, 1024), (1024, 2048)],
        )));
        let shards = vec![Shard::new("data/a.tar", Some(10240)), indexed];
        let changed = StreamOptions::builder()
            .with_seed(7)
            .with_shuffle_shards(false)
            .with_shuffle_buffer(10)
            .with_shuffle_buffer_bytes(1 << 20)
            .with_shuffle_initial(3)
            .with_remainder(crate::plan::Remainder::Pad)
            .with_decode(crate::config::FieldDecoders {
                by_field: vec![
                    (
                        "jpg".into(),
                        crate::decode::Decoder::from_str("rgb8").unwrap(),
                    ),
                    (
                        "json".into(),
                        crate::decode::Decoder::from_str("json").unwrap(),
                    ),
                ],
                defaults: false,
            })
            .with_columns(Some(vec!["a".into(), "bc".into()]))
            .build()
            .unwrap();
        let defaults_decoded = StreamOptions::builder()
            .with_decode(crate::config::FieldDecoders::defaults())
            .build()
            .unwrap();
        vec![
            (shards.clone(), StreamOptions::default()),
            (shards.clone(), changed),
            (shards, defaults_decoded),
        ]
    }

    #[test]
    fn fingerprints_of_saved_states_stay_the_same() {
        let got: Vec<String> = pinned_cases()
            .iter()
            .map(|(shards, options)| fingerprint(shards, options))
            .collect();
        // Values of the hand-written fingerprint that states were saved with.
        assert_eq!(
            got,
            ["535b1d9102e3c622", "4e7d9214f96a76ed", "b2926d8c8cf1954b"]
        );
    }

    #[test]
    fn mirror_follows_pushes_and_pops() {
        let id = |index| SampleId { shard: 2, index };
        let units = [
            WorkUnit {
                shard: 2,
                samples: Some(0..5),
            },
            WorkUnit {
                shard: 0,
                samples: Some(0..1),
            },
        ];
        let mut mirror = Mirror::start();
        mirror.apply(
            &[
                Op::Push { unit: 0, id: id(0) },
                Op::Push { unit: 0, id: id(1) },
                Op::Push { unit: 0, id: id(2) },
                Op::Pop {
                    index: 0,
                    rng_word_pos: 9,
                },
            ],
            &units,
        );
        assert_eq!(mirror.buffer, vec![id(2), id(1)]);
        assert_eq!(
            mirror.cursor,
            Cursor {
                unit: 0,
                next_sample: Some(3)
            }
        );
        assert_eq!(mirror.digest, id_hash(2, 0));
        // The unit ends early (a skipped shard): samples 3 and 4 are skipped.
        let skips = mirror.apply(
            &[
                Op::UnitSkipped { unit: 0 },
                Op::Pop {
                    index: 1,
                    rng_word_pos: 12,
                },
            ],
            &units,
        );
        assert_eq!(
            skips,
            [SkippedSamples {
                shard: 2,
                first: 3,
                end: Some(5)
            }]
        );
        assert_eq!(mirror.buffer, vec![id(2)]);
        assert_eq!((mirror.produced, mirror.rng_word_pos), (2, 12));
        assert_eq!(mirror.skipped, 2);
        assert_eq!(
            mirror.digest,
            [0, 1, 3, 4]
                .iter()
                .fold(0u64, |s, &i| add_mod(s, id_hash(2, i)))
        );
        assert_eq!(
            mirror.cursor,
            Cursor {
                unit: 1,
                next_sample: None
            }
        );
        assert_eq!(
            passed(&units, mirror.cursor),
            Some((5, range_hash(2, 0..5)))
        );
    }

    #[test]
    fn digests_do_not_depend_on_order() {
        let a = range_hash(3, 0..10);
        let b = (0..10).rev().fold(0u64, |s, i| add_mod(s, id_hash(3, i)));
        assert_eq!(a, b);
        assert_ne!(id_hash(3, 4), id_hash(4, 3));
        assert_eq!(range_hash(3, 4..4), 0);
        assert_eq!(
            add_mod(range_hash(3, 0..4), range_hash(3, 4..10)),
            range_hash(3, 0..10)
        );
        // A run of any length sums in closed form.
        let huge = range_hash(7, 5..u64::MAX);
        assert_eq!(
            add_mod(huge, id_hash(7, u64::MAX)),
            add_mod(
                range_hash(7, 0..u64::MAX),
                sub_mod(id_hash(7, u64::MAX), range_hash(7, 0..5))
            )
        );
        assert_eq!(parse_digest(&format_digest(a)), Some(a));
        assert_eq!(parse_digest("+0000000000000a"), None);
        assert_eq!(parse_decimal("+5"), None);
        assert_eq!(parse_decimal(&u128::MAX.to_string()), Some(u128::MAX));
        assert_eq!(
            parse_decimal("340282366920938463463374607431768211456"),
            None
        );
    }

    #[test]
    fn state_json_round_trips() {
        let state = SlotState {
            format: STATE_FORMAT.into(),
            version: STATE_VERSION,
            fingerprint: "00ff".into(),
            epoch: 3,
            world_size: 2,
            rank: 1,
            num_workers: 2,
            worker_id: 0,
            produced: 17,
            skipped: 2,
            cursor: Cursor {
                unit: 1,
                next_sample: Some(4),
            },
            buffer: vec![[1, 2], [0, 9]],
            rng_word_pos: u128::MAX.to_string(),
            digest: format_digest(P - 1),
            finished: false,
            resumed_from: None,
        };
        let back = SlotState::from_json(&state.to_json()).unwrap();
        assert_eq!(back, state);
        assert_eq!(back.word_pos().unwrap(), u128::MAX);
        assert_eq!(back.digest_value().unwrap(), P - 1);
        let beyond = SlotState {
            digest: format_digest(P),
            ..state.clone()
        };
        assert!(beyond.digest_value().is_err());
        assert!(SlotState::from_json("{}").is_err());
        let bad_slot = SlotState {
            rank: 2,
            ..state.clone()
        };
        let err = bad_slot.slot().unwrap_err();
        assert!(matches!(err, Error::StateMismatch(_)), "{err}");
        assert!(err.to_string().contains("field rank"), "{err}");
        // A layout past the limits is refused before anything is planned for it.
        for (world_size, num_workers, field) in [
            (100_000_000_000, 1, "field world_size"),
            (1 << 20, 1 << 10, "field num_workers"),
        ] {
            let huge = SlotState {
                world_size,
                num_workers,
                rank: 0,
                worker_id: 0,
                ..state.clone()
            };
            let err = huge.slot().unwrap_err();
            assert!(err.to_string().contains(field), "{err}");
        }
    }
}
