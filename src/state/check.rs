//! Checking a loaded state against the dataset and the plan before
//! anything is read: [`resolve`] plans a slot's stream, fresh or resumed
//! ([`Resume`]), and gives where it starts ([`Start`]); [`fingerprint`]
//! names the dataset and the options a state was saved for.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ops::Range;

use super::digest::{add_mod, id_hash, range_hash, sub_mod};
use super::mirror::Mirror;
use super::saved::{field_error, parse_decimal, parse_digest, Cursor, SlotState};
use crate::config::{OnError, StreamOptions};
use crate::error::{Error, Result};
use crate::hash::Fnv1a;
use crate::plan::cut::Piece;
use crate::plan::resume::{self, Replanner};
use crate::plan::{SlotSpec, WorkUnit};
use crate::shard::{Shard, ShardKind};

/// RNG words the shuffle buffer may draw beyond two per sample handed out:
/// a draw takes one `u64` (two words) and is redrawn only on a rejection,
/// whose chance is below `shuffle_buffer / 2^64` per draw.
const SPARE_RNG_WORDS: u128 = 64;

/// Fingerprint of the dataset (URLs, sizes, sample spans) and of the options
/// that decide which samples come in which order
/// ([`StreamOptions::order_bytes`]: each option of
/// [`crate::config::DATASET_OPTIONS`] says whether it does). Options that
/// change only what a sample carries, not which samples come when
/// (`sample_seed`, the I/O and output options), are left out: a state
/// resumes with them changed.
pub fn fingerprint(shards: &[Shard], options: &StreamOptions) -> String {
    Fingerprint::of(shards, options).whole
}

/// The fingerprint part of the shard list ([`Fingerprint::parts`]).
const SHARDS_PART: &str = "shards";

/// The fingerprint part of the documents' token counts (with `pack`).
pub(crate) const TOKENS_PART: &str = "token_counts";

/// Feeds the shards' token counts (field, tokenizer, counts; a marker for
/// a shard without) to `h`.
fn hash_token_counts(h: &mut Fnv1a, shards: &[Shard]) {
    for shard in shards {
        match shard.tokens() {
            None => {
                h.u64(u64::MAX);
            }
            Some(tokens) => {
                h.u64(tokens.field.len() as u64)
                    .bytes(tokens.field.as_bytes());
                let tokenizer = tokens.tokenizer.as_deref().unwrap_or_default();
                h.u64(tokenizer.len() as u64).bytes(tokenizer.as_bytes());
                h.u64(tokens.counts.len() as u64);
                for &count in &tokens.counts {
                    h.u64(count);
                }
            }
        }
    }
}

/// Feeds the shard list (URLs, sizes, sample spans, kinds) to `h`; with
/// `counted` false, as it was before any sample span was known.
fn hash_shards(h: &mut Fnv1a, shards: &[Shard], counted: bool) {
    h.u64(shards.len() as u64);
    for shard in shards {
        h.u64(shard.url.len() as u64).bytes(shard.url.as_bytes());
        h.u64(shard.size.map_or(u64::MAX, |s| s));
        match shard.index.as_ref().filter(|_| counted) {
            None => {
                h.u64(u64::MAX);
            }
            Some(index) => {
                h.u64(index.len());
                for i in 0..index.len() {
                    h.u64(index.offset(i)).u64(index.length(i));
                }
            }
        }
    }
    for shard in shards {
        match &shard.kind {
            ShardKind::Tar => h.u64(0),
            ShardKind::Raw => h.u64(1),
            ShardKind::Lines => h.u64(4),
            ShardKind::Parquet(group) => h.u64(3).u64(group.index as u64).u64(group.rows),
        };
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
    /// A packed stream that plans its sequences (across ranks, or in a
    /// mixture) and starts its epoch (or the rest of one, after an elastic
    /// resume): every slot's units, by slot index, to plan how many
    /// sequences each hands out.
    pub peers: Option<Vec<Vec<WorkUnit>>>,
    /// The fingerprint this stream's states are saved under when not the
    /// dataset's: a state saved before the shards' samples were counted
    /// resumes its epoch as planned then, and so must its later states.
    pub saved_under: Option<Fingerprint>,
}

/// Plans `slot`'s stream for `epoch`, or for the epoch of `resume` after
/// checking every field of its states against the dataset (`shards`,
/// whose fingerprint with `options` is `fingerprint`) and the plan.
pub fn resolve(
    shards: &[Shard],
    options: &StreamOptions,
    fingerprint: &Fingerprint,
    epoch: u64,
    slot: &SlotSpec,
    resume: Option<Resume>,
) -> Result<Start> {
    let dataset = Dataset::new(shards, options, fingerprint);
    let plans_sequences = options.plans_sequences(slot.world_size);
    match resume {
        None if plans_sequences => {
            let peers = dataset.plans.plan(epoch, slot.world_size, slot.num_workers);
            Ok(Start {
                epoch,
                resumed_from: None,
                units: peers[slot.slot()].clone(),
                mirror: Mirror::start(),
                finished: false,
                peers: Some(peers),
                saved_under: None,
            })
        }
        None => Ok(Start {
            epoch,
            resumed_from: None,
            units: dataset.plans.slot_plan(epoch, slot),
            mirror: Mirror::start(),
            finished: false,
            peers: None,
            saved_under: None,
        }),
        Some(Resume::Exact(state)) => {
            let planned = check_exact(&state, fingerprint, slot)?;
            // A packed slot that plans its sequences is checked against
            // every slot's plan (`sequences_left` is bounded by it).
            let layout = (slot.world_size, slot.num_workers);
            let (units, peers) = match (&state.resumed_from, plans_sequences) {
                (None, false) => (dataset.slot_plan(state.epoch, slot, planned), None),
                (None, true) => {
                    let peers = dataset.plans.plan(state.epoch, layout.0, layout.1);
                    (peers[slot.slot()].clone(), Some(peers))
                }
                (Some(from), across) => {
                    let split = dataset.split(from, "resumed_from", Some(state.epoch))?;
                    if across {
                        let peers = dataset.plans.recut(&split.remaining, layout.0, layout.1);
                        (peers[slot.slot()].clone(), Some(peers))
                    } else {
                        (dataset.plans.slot_recut(&split.remaining, slot), None)
                    }
                }
            };
            dataset.check_slot(&state, &units, "", planned)?;
            Ok(Start {
                epoch: state.epoch,
                mirror: Mirror::from_state(&state)?,
                finished: state.finished,
                resumed_from: state.resumed_from,
                units,
                peers,
                saved_under: match planned {
                    Planned::AsNow => None,
                    Planned::WithoutCounts => fingerprint.uncounted().cloned(),
                },
            })
        }
        Some(Resume::Elastic(states)) => {
            // Always split anew, even onto the same layout: the old slots
            // may have produced different amounts.
            let split = dataset.split(&states, "slots", None)?;
            let (units, peers) = if plans_sequences {
                let peers =
                    dataset
                        .plans
                        .recut(&split.remaining, slot.world_size, slot.num_workers);
                (peers[slot.slot()].clone(), Some(peers))
            } else {
                (dataset.plans.slot_recut(&split.remaining, slot), None)
            };
            Ok(Start {
                epoch: split.epoch,
                resumed_from: Some(split.states),
                units,
                mirror: Mirror::start(),
                finished: false,
                peers,
                saved_under: None,
            })
        }
    }
}

/// Checks that `state` was saved by this dataset and options, for this
/// slot, and says whether its epoch was planned before the shards' samples
/// were counted.
fn check_exact(state: &SlotState, fingerprint: &Fingerprint, slot: &SlotSpec) -> Result<Planned> {
    let planned = check_fingerprint(state, fingerprint, "")?;
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
    Ok(planned)
}

/// How the epoch of a checked state was planned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Planned {
    /// As this dataset plans it.
    AsNow,
    /// Before the shards' samples were counted (whole shards dealt by
    /// bytes, [`Replanner::plan_without_counts`]): the state was saved
    /// before a manifest or `count_samples` counted them.
    WithoutCounts,
}

/// Checks that `state` was saved for this dataset and options (counted
/// or not yet), and says how its epoch was planned.
fn check_fingerprint(
    state: &SlotState,
    fingerprint: &Fingerprint,
    prefix: &str,
) -> Result<Planned> {
    if state.fingerprint == fingerprint.whole {
        return Ok(Planned::AsNow);
    }
    if fingerprint
        .uncounted()
        .is_some_and(|uncounted| uncounted.whole == state.fingerprint)
    {
        return Ok(Planned::WithoutCounts);
    }
    // What differs, when the state says what its fingerprint covered (the
    // shard list as it is, or as it was before its samples were counted).
    let saved: HashMap<&str, &str> = parts_of(&state.fingerprint_parts).collect();
    let uncounted = fingerprint.uncounted().map_or("", |u| u.parts.as_str());
    let same_uncounted = |name: &str, saved: &str| {
        name == SHARDS_PART && parts_of(uncounted).any(|part| part == (name, saved))
    };
    let differing: Vec<&str> = parts_of(&fingerprint.parts)
        .filter(|(name, here)| {
            saved
                .get(name)
                .is_some_and(|saved| saved != here && !same_uncounted(name, saved))
        })
        .map(|(name, _)| match name {
            SHARDS_PART => "the shard list",
            option => option,
        })
        .collect();
    let what = match differing.as_slice() {
        [] => "another dataset or options".to_owned(),
        [one] if *one == "the shard list" => "another dataset (the shard list differs)".to_owned(),
        [one] => format!("other options ({one} differs)"),
        many => format!("another dataset or options ({} differ)", many.join(", ")),
    };
    Err(field_error(
        prefix,
        "fingerprint",
        format!(
            "the state was saved for {what} (fingerprint {} here, {:?} in the state)",
            fingerprint.whole, state.fingerprint
        ),
    ))
}

/// The `(name, hash)` pairs of a [`Fingerprint::parts`] text (nothing for
/// an empty one; a malformed pair is passed over: the parts only name what
/// differs, the whole fingerprint is what is checked).
fn parts_of(parts: &str) -> impl Iterator<Item = (&str, &str)> {
    parts.split(',').filter_map(|pair| pair.split_once('='))
}

/// A dataset's [`fingerprint`] with its parts: what a state is checked
/// against.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fingerprint {
    /// The whole fingerprint (16 hex digits), as states hold it.
    pub whole: String,
    /// What it covers, part by part, as states hold it:
    /// `shards=<8 hex>,<option>=<8 hex>,...`, 32 bits of each part's own
    /// FNV-1a hash: the shard list, then each option that decides the
    /// order ([`StreamOptions::order_bytes_by_option`]). One text, made
    /// once per stream, so that a state (taken as often as every batch)
    /// carries it at the cost of one string.
    pub parts: String,
    /// The fingerprint the shards had before their samples were counted
    /// (a state saved then planned its epoch without counts); `None` when
    /// none is counted, or with `pack`.
    uncounted: Option<Box<Fingerprint>>,
}

impl Fingerprint {
    /// The fingerprint of `shards` read with `options`, and its parts, in
    /// one pass over the shard list; and, when some shard's samples are
    /// counted (a manifest, `count_samples`) and the epoch is not packed,
    /// the fingerprint the same shards had uncounted.
    pub fn of(shards: &[Shard], options: &StreamOptions) -> Self {
        let counted = options.pack.is_none() && shards.iter().any(|s| s.index.is_some());
        Fingerprint {
            uncounted: counted.then(|| Box::new(Self::hashed(shards, options, false))),
            ..Self::hashed(shards, options, true)
        }
    }

    /// The fingerprint of `shards` (their sample spans, if `counted`)
    /// read with `options`, without its uncounted form.
    fn hashed(shards: &[Shard], options: &StreamOptions, counted: bool) -> Self {
        let short = |h: &Fnv1a| format!("{:08x}", h.finish() as u32);
        let mut whole = Fnv1a::new();
        hash_shards(&mut whole, shards, counted);
        let mut parts = vec![format!("{SHARDS_PART}={}", short(&whole))];
        if options.pack.is_some() {
            // Packing plans by the manifest's token counts: a state is of
            // the counts it was planned with.
            let mut tokens = Fnv1a::new();
            hash_token_counts(&mut tokens, shards);
            whole.u64(tokens.finish());
            parts.push(format!("{TOKENS_PART}={}", short(&tokens)));
        }
        for (name, bytes) in options.order_bytes_by_option() {
            whole.bytes(&bytes);
            parts.push(format!("{name}={}", short(Fnv1a::new().bytes(&bytes))));
        }
        Fingerprint {
            whole: format!("{:016x}", whole.finish()),
            parts: parts.join(","),
            uncounted: None,
        }
    }

    /// The fingerprint of a state saved while the shards' samples were not
    /// counted: this one's uncounted form, if the shards are counted now.
    pub fn uncounted(&self) -> Option<&Fingerprint> {
        self.uncounted.as_deref()
    }
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
    fingerprint: &'a Fingerprint,
    /// The dataset's plans for any layout.
    plans: Replanner,
}

impl<'a> Dataset<'a> {
    fn new(shards: &[Shard], options: &'a StreamOptions, fingerprint: &'a Fingerprint) -> Self {
        Dataset {
            options,
            fingerprint,
            plans: Replanner::new(
                shards.iter().map(Shard::info).collect(),
                options.seed,
                options.shuffle_shards,
                options.remainder,
            )
            .with_weights(options.pack.as_ref().and_then(|spec| {
                crate::text::counts::token_weights(shards, spec, options.pack_tokenizer_name())
            })),
        }
    }

    /// Every slot's units of `epoch` for `layout` (`world_size`,
    /// `num_workers`), planned as a state's epoch was.
    fn plan(&self, epoch: u64, layout: (usize, usize), planned: Planned) -> Vec<Vec<WorkUnit>> {
        match planned {
            Planned::AsNow => self.plans.plan(epoch, layout.0, layout.1),
            Planned::WithoutCounts => self.plans.plan_without_counts(epoch, layout.0, layout.1),
        }
    }

    /// `slot`'s units of `epoch`, planned as a state's epoch was.
    fn slot_plan(&self, epoch: u64, slot: &SlotSpec, planned: Planned) -> Vec<WorkUnit> {
        match planned {
            Planned::AsNow => self.plans.slot_plan(epoch, slot),
            Planned::WithoutCounts => self
                .plan(epoch, (slot.world_size, slot.num_workers), planned)
                .swap_remove(slot.slot()),
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
        let planned = check_fingerprint(first, self.fingerprint, &format!("{path}[0]."))?;
        for (i, state) in states.iter().enumerate() {
            let prefix = format!("{path}[{i}].");
            if check_fingerprint(state, self.fingerprint, &prefix)? != planned {
                return Err(field_error(
                    &prefix,
                    "fingerprint",
                    format!(
                        "differs from {path}[0]'s: one state was saved before the shards' \
                         samples were counted, the other after"
                    ),
                ));
            }
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
                "elastic resume needs sample counts: give the dataset a manifest \
                 (`shardstream index`) or count_samples=True"
                    .into(),
            ));
        }
        let mut slot_units = match &first.resumed_from {
            None => self.plan(epoch, (world_size, num_workers), planned),
            Some(from) => {
                let inner = self.split(from, &format!("{path}[0].resumed_from"), Some(epoch))?;
                self.plans.recut(&inner.remaining, world_size, num_workers)
            }
        };
        let mut remaining = Vec::new();
        for (slot, &i) in by_slot.iter().enumerate() {
            let state = &states[i];
            let units = std::mem::take(&mut slot_units[slot]);
            self.check_slot(state, &units, &format!("{path}[{i}]."), planned)?;
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
    fn check_slot(
        &self,
        state: &SlotState,
        units: &[WorkUnit],
        prefix: &str,
        planned: Planned,
    ) -> Result<()> {
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
        // A packed slot across ranks finishes when it has handed out its
        // planned sequences, wherever its cursor is.
        match state.sequences_left {
            Some(left) if state.finished != (left == 0) => {
                return Err(error(
                    "finished",
                    format!("{}, yet sequences_left is {left}", state.finished),
                ));
            }
            Some(_) => {}
            None if state.finished && (held > 0 || cursor.unit < units.len()) => {
                return Err(error(
                    "finished",
                    format!(
                        "true, yet the state holds {held} samples and its cursor is at work unit {} of {}",
                        cursor.unit,
                        units.len()
                    ),
                ));
            }
            None => {}
        }
        // Saved uncounted under on_error="warn", the state did not count
        // the samples a skipped shard left out: its count and digest are
        // of no plan with counts.
        let countable = planned == Planned::AsNow || self.options.on_error == OnError::Raise;
        match passed(units, cursor) {
            _ if !countable => {}
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

    /// A state's shard number as an index of the dataset's shards, or why
    /// it is not one.
    fn shard_index(&self, shard: u64) -> std::result::Result<usize, String> {
        usize::try_from(shard)
            .ok()
            .filter(|&s| s < self.plans.shard_count())
            .ok_or_else(|| {
                format!(
                    "shard {shard} is not below the dataset's {} shards",
                    self.plans.shard_count()
                )
            })
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
            let shard_index = self.shard_index(shard).map_err(error)?;
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
        // The packer's pieces: of documents the slot handed out (passed, and
        // not held by the buffer; after an elastic resume, also those of the
        // old slots, outside this slot's units), no token twice.
        let Some(pack) = &state.pack else {
            return Ok(());
        };
        // Each document's token ranges, with the field that names each.
        type Ranges = Vec<(u64, u64, String)>;
        let mut pieces: HashMap<(u64, u64), Ranges> = HashMap::new();
        let sequences = (pack
            .ready
            .iter()
            .enumerate()
            .map(|(i, p)| (format!("pack.ready[{i}]"), p)))
        .chain(
            pack.open
                .iter()
                .enumerate()
                .map(|(i, p)| (format!("pack.open[{i}]"), p)),
        );
        for (name, sequence) in sequences {
            for (j, &[shard, index, start, end]) in sequence.iter().enumerate() {
                let field = format!("{name}[{j}]");
                let error = |reason: String| field_error(prefix, &field, reason);
                let shard_index = self.shard_index(shard).map_err(error)?;
                // After an elastic resume the packer may hold documents the
                // old slots handed out, outside this slot's units.
                let from_old_slots = state.resumed_from.is_some()
                    && !units.iter().any(|u| {
                        u.shard == shard_index
                            && u.samples.as_ref().is_none_or(|r| r.contains(&index))
                    });
                if seen.contains(&(shard, index))
                    || !(has_read(shard_index, index) || from_old_slots)
                {
                    return Err(error(format!(
                        "sample {index} of shard {shard} is not among the samples the slot has \
                         handed out"
                    )));
                }
                if start > end {
                    return Err(error(format!("tokens {start}..{end} run backwards")));
                }
                pieces
                    .entry((shard, index))
                    .or_default()
                    .push((start, end, field));
            }
        }
        for ((shard, index), mut ranges) in pieces {
            ranges.sort();
            for pair in ranges.windows(2) {
                let ((first, end, _), (start, last, field)) = (&pair[0], &pair[1]);
                if start < end || (first, end) == (start, last) {
                    return Err(field_error(
                        prefix,
                        field,
                        format!("it holds tokens of sample {index} of shard {shard} that another piece holds"),
                    ));
                }
            }
        }
        Ok(())
    }
}

/// The number of samples the cursor has passed in `units` and their
/// digest, when every unit passed knows its samples.
pub(super) fn passed(units: &[WorkUnit], cursor: Cursor) -> Option<(u64, u64)> {
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
    fn a_fingerprint_that_differs_names_what_differs() {
        let cases = pinned_cases();
        let (shards, defaults) = &cases[0];
        let saved_with = |shards: &[Shard], options: &StreamOptions, parts: bool| {
            let fingerprint = Fingerprint::of(shards, options);
            SlotState {
                format: super::super::STATE_FORMAT.into(),
                version: super::super::STATE_VERSION,
                fingerprint: fingerprint.whole,
                fingerprint_parts: if parts {
                    fingerprint.parts
                } else {
                    String::new()
                },
                epoch: 0,
                world_size: 1,
                rank: 0,
                num_workers: 1,
                worker_id: 0,
                produced: 0,
                skipped: 0,
                cursor: Cursor {
                    unit: 0,
                    next_sample: None,
                },
                buffer: Vec::new(),
                rng_word_pos: "0".into(),
                digest: "0000000000000000".into(),
                finished: false,
                resumed_from: None,
                pack: None,
                sequences_left: None,
            }
        };
        let here = Fingerprint::of(shards, defaults);
        let message =
            |state: &SlotState| check_fingerprint(state, &here, "").unwrap_err().to_string();
        let seeded = StreamOptions::builder().with_seed(9).build().unwrap();
        let seeded_state = saved_with(shards, &seeded, true);
        let error = message(&seeded_state);
        assert!(
            error.contains("saved for other options (seed differs)"),
            "{error}"
        );
        let (_, changed) = &cases[1];
        let error = message(&saved_with(shards, changed, true));
        for name in ["seed", "shuffle_buffer", "decode", "columns", "remainder"] {
            assert!(error.contains(name), "{name}: {error}");
        }
        let error = message(&saved_with(&shards[..1], defaults, true));
        assert!(
            error.contains("another dataset (the shard list differs)"),
            "{error}"
        );
        // A state saved without its parts: the fingerprint alone.
        let error = message(&saved_with(shards, &seeded, false));
        assert!(
            error.contains("another dataset or options (fingerprint"),
            "{error}"
        );
        assert!(check_fingerprint(&saved_with(shards, defaults, true), &here, "").is_ok());
        let parts: Vec<(&str, &str)> = parts_of(&here.parts).collect();
        assert_eq!(parts.len(), 1 + defaults.order_bytes_by_option().len());
        assert_eq!(parts[0].0, "shards");
        assert!(parts.iter().all(|(_, part)| part.len() == 8), "{parts:?}");
    }

    #[test]
    fn a_state_saved_before_the_shards_were_counted_is_of_the_uncounted_plan() {
        let (shards, options) = pinned_cases().swap_remove(0);
        let uncounted: Vec<Shard> = shards
            .iter()
            .map(|s| Shard {
                index: None,
                ..s.clone()
            })
            .collect();
        let counted = Fingerprint::of(&shards, &options);
        let before = Fingerprint::of(&uncounted, &options);
        assert!(before.uncounted().is_none());
        assert_eq!(counted.uncounted(), Some(&before));
        assert_ne!(counted.whole, before.whole);
        let state = |fingerprint: &Fingerprint| SlotState {
            fingerprint: fingerprint.whole.clone(),
            ..SlotState::from_json(&format!(
                r#"{{"format":"shardstream.state","version":2,"fingerprint":"","epoch":0,
                "world_size":1,"rank":0,"num_workers":1,"worker_id":0,"produced":0,"skipped":0,
                "cursor":{{"unit":0,"next_sample":null}},"buffer":[],"rng_word_pos":"0",
                "digest":"{:016x}","finished":false}}"#,
                0
            ))
            .unwrap()
        };
        assert_eq!(
            check_fingerprint(&state(&before), &counted, "").unwrap(),
            Planned::WithoutCounts
        );
        assert_eq!(
            check_fingerprint(&state(&counted), &counted, "").unwrap(),
            Planned::AsNow
        );
        // Not the other way round: a state saved with counts is of a plan
        // the uncounted dataset cannot make.
        assert!(check_fingerprint(&state(&counted), &before, "").is_err());
        // Saved uncounted with another seed: the seed is what differs.
        let seeded = StreamOptions::builder().with_seed(9).build().unwrap();
        let other = Fingerprint::of(&uncounted, &seeded);
        let error = check_fingerprint(
            &SlotState {
                fingerprint_parts: other.parts.clone(),
                ..state(&other)
            },
            &counted,
            "",
        )
        .unwrap_err()
        .to_string();
        assert!(error.contains("other options (seed differs)"), "{error}");
    }
}
