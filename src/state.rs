//! Stream state for exact and elastic resume. The consumer keeps a mirror
//! of the pipeline's position (cursor, shuffle buffer ids, RNG word
//! position) as of the last sample it handed out; restoring re-reads only
//! the samples the buffer held. The JSON form is documented by
//! `schemas/state.schema.json`.

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::config::{SlotSpec, StreamOptions};
use crate::error::{Error, Result};
use crate::format::SampleId;
use crate::plan::cut::{self, Piece};
use crate::plan::{self, PlanParams, WorkUnit};
use crate::spec::{Shard, ShardKind};

/// The `format` field of every state.
pub const STATE_FORMAT: &str = "shardstream.state";
/// The state version this build reads and writes.
pub const STATE_VERSION: u32 = 1;

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
    /// Next sample to read.
    pub cursor: Cursor,
    /// Ids `[shard, index]` held by the shuffle buffer, in buffer order.
    pub buffer: Vec<[u64; 2]>,
    /// The shuffle RNG's word position (decimal).
    pub rng_word_pos: String,
    /// The slot has handed out its last sample.
    pub finished: bool,
    /// When this epoch was itself resumed elastically: the states it resumed from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resumed_from: Option<Vec<SlotState>>,
}

impl SlotState {
    /// Parses and checks a state.
    pub fn from_json(json: &str) -> Result<Self> {
        let state: SlotState = serde_json::from_str(json)
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
        SlotSpec::new(self.world_size, self.rank, self.num_workers, self.worker_id)
    }

    /// Held sample ids.
    pub fn buffer_ids(&self) -> Vec<SampleId> {
        self.buffer
            .iter()
            .map(|&[shard, index]| SampleId {
                shard: shard as usize,
                index,
            })
            .collect()
    }

    /// The RNG word position.
    pub fn word_pos(&self) -> Result<u128> {
        self.rng_word_pos
            .parse()
            .map_err(|_| Error::StateMismatch(format!("bad rng_word_pos {:?}", self.rng_word_pos)))
    }
}

/// A 64-bit FNV-1a hash, stable across platforms and versions.
struct Fnv(u64);

impl Fnv {
    fn new() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }

    fn bytes(&mut self, bytes: &[u8]) -> &mut Self {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
        self
    }

    fn u64(&mut self, v: u64) -> &mut Self {
        self.bytes(&v.to_le_bytes())
    }
}

/// Fingerprint of the dataset (URLs, sizes, sample spans) and of the options
/// that decide which samples come in which order.
pub fn fingerprint(shards: &[Shard], options: &StreamOptions) -> String {
    let mut h = Fnv::new();
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
            ShardKind::ParquetFile => h.u64(2),
            ShardKind::Parquet(group) => h.u64(3).u64(group.index as u64).u64(group.rows),
        };
    }
    for (field, decoder) in &options.decode.by_field {
        h.u64(field.len() as u64).bytes(field.as_bytes());
        h.bytes(decoder.name().as_bytes());
    }
    h.u64(u64::from(options.decode.defaults));
    for column in options.columns.iter().flatten() {
        h.u64(column.len() as u64).bytes(column.as_bytes());
    }
    h.u64(options.seed)
        .u64(u64::from(options.shuffle_shards))
        .u64(options.shuffle_buffer as u64)
        .u64(options.shuffle_buffer_bytes as u64)
        .u64(options.shuffle_initial as u64)
        .u64(options.remainder as u64);
    format!("{:016x}", h.0)
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
    /// The unit at `unit` has been read to its end (or skipped).
    UnitDone {
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

/// The consumer's copy of the pipeline position as of the last sample handed out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mirror {
    /// Samples handed out.
    pub produced: u64,
    /// Next sample to read.
    pub cursor: Cursor,
    /// Buffer ids in buffer order.
    pub buffer: Vec<SampleId>,
    /// RNG word position.
    pub rng_word_pos: u128,
}

impl Mirror {
    /// The mirror at the start of a slot's epoch.
    pub fn start() -> Self {
        Mirror {
            produced: 0,
            cursor: Cursor {
                unit: 0,
                next_sample: None,
            },
            buffer: Vec::new(),
            rng_word_pos: 0,
        }
    }

    /// The mirror a saved state describes.
    pub fn from_state(state: &SlotState) -> Result<Self> {
        Ok(Mirror {
            produced: state.produced,
            cursor: state.cursor,
            buffer: state.buffer_ids(),
            rng_word_pos: state.word_pos()?,
        })
    }

    /// Applies the ops of one message; a `Pop` counts one sample handed out.
    pub fn apply(&mut self, ops: &[Op]) {
        for op in ops {
            match *op {
                Op::Push { unit, id } => {
                    self.buffer.push(id);
                    self.cursor = Cursor {
                        unit,
                        next_sample: Some(id.index + 1),
                    };
                }
                Op::UnitDone { unit } => {
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
                    self.rng_word_pos = rng_word_pos;
                    self.produced += 1;
                }
            }
        }
    }
}

/// What a stream resumes from.
#[derive(Debug, Clone)]
pub enum Resume {
    /// The state of this very slot, saved with the same layout: the rest of
    /// the epoch comes in exactly the uninterrupted order.
    Exact(SlotState),
    /// The states of every slot of another layout: the samples they had not
    /// handed out are split anew.
    Elastic(Vec<SlotState>),
}

/// Checks that `state` fits this dataset, options, epoch and slot.
pub fn check_exact(state: &SlotState, fingerprint: &str, slot: &SlotSpec) -> Result<()> {
    if state.fingerprint != fingerprint {
        return Err(Error::StateMismatch(format!(
            "the state was saved for another dataset or options (fingerprint {} here, {} in the state)",
            fingerprint, state.fingerprint
        )));
    }
    let saved = state.slot()?;
    if saved != *slot {
        return Err(Error::StateMismatch(format!(
            "the state is for rank {} worker {} of {} x {} slots, this stream is rank {} worker {} of {} x {}",
            saved.rank,
            saved.worker_id,
            saved.world_size,
            saved.num_workers,
            slot.rank,
            slot.worker_id,
            slot.world_size,
            slot.num_workers
        )));
    }
    Ok(())
}

/// The units a slot reads in `epoch`: from the plan, or, after an elastic
/// resume, from splitting what the saved slots had not handed out.
pub fn slot_units(
    shards: &[Shard],
    options: &StreamOptions,
    epoch: u64,
    slot: &SlotSpec,
    resumed_from: Option<&[SlotState]>,
) -> Result<Vec<WorkUnit>> {
    match resumed_from {
        None => {
            let infos: Vec<_> = shards.iter().map(Shard::info).collect();
            let params = plan_params(options, epoch, slot.world_size, slot.num_workers);
            Ok(plan::plan_epoch(&infos, &params).units_of(slot).to_vec())
        }
        Some(states) => {
            let runs = remaining_runs(shards, options, states)?;
            let slots = cut::cut_runs(&runs, slot.world_size, slot.num_workers, options.remainder);
            Ok(slots[slot.slot()]
                .iter()
                .map(|p| WorkUnit {
                    shard: p.shard,
                    samples: Some(p.samples.clone()),
                })
                .collect())
        }
    }
}

fn plan_params(
    options: &StreamOptions,
    epoch: u64,
    world_size: usize,
    num_workers: usize,
) -> PlanParams {
    PlanParams {
        seed: options.seed,
        epoch,
        shuffle_shards: options.shuffle_shards,
        world_size,
        num_workers,
        remainder: options.remainder,
    }
}

/// Checks that `states` are every slot of one layout, for this dataset and
/// one epoch, and returns them in slot order.
pub fn check_elastic(
    mut states: Vec<SlotState>,
    fingerprint: &str,
) -> Result<(u64, Vec<SlotState>)> {
    let first = states
        .first()
        .ok_or_else(|| Error::StateMismatch("no slot states to resume from".into()))?;
    let (epoch, world_size, num_workers) = (first.epoch, first.world_size, first.num_workers);
    for state in &states {
        if state.fingerprint != fingerprint {
            return Err(Error::StateMismatch(format!(
                "a slot state was saved for another dataset or options (fingerprint {} here, {} in the state)",
                fingerprint, state.fingerprint
            )));
        }
        if (state.epoch, state.world_size, state.num_workers) != (epoch, world_size, num_workers) {
            return Err(Error::StateMismatch(
                "the slot states are of different epochs or layouts".into(),
            ));
        }
        if state.resumed_from != first.resumed_from {
            return Err(Error::StateMismatch(
                "the slot states come from different resumes".into(),
            ));
        }
        state.slot()?;
    }
    states.sort_by_key(|s| (s.rank, s.worker_id));
    states.dedup_by_key(|s| (s.rank, s.worker_id));
    if states.len() != world_size * num_workers {
        return Err(Error::StateMismatch(format!(
            "elastic resume needs the state of every one of the {} x {} slots, got {} distinct",
            world_size,
            num_workers,
            states.len()
        )));
    }
    Ok((epoch, states))
}

/// The samples the saved slots had not handed out, as runs in slot order:
/// each slot's held buffer samples, then the rest of its current unit, then
/// its later units.
fn remaining_runs(
    shards: &[Shard],
    options: &StreamOptions,
    states: &[SlotState],
) -> Result<Vec<Piece>> {
    let counts: Option<Vec<u64>> = shards.iter().map(|s| s.info().samples).collect();
    let counts = counts.ok_or_else(|| {
        Error::StateMismatch(
            "elastic resume needs sample counts: build a manifest with `shardstream index`".into(),
        )
    })?;
    let mut runs = Vec::new();
    for state in states {
        let slot = state.slot()?;
        let units = slot_units(
            shards,
            options,
            state.epoch,
            &slot,
            state.resumed_from.as_deref(),
        )?;
        if state.finished {
            continue;
        }
        for id in state.buffer_ids() {
            runs.push(Piece {
                shard: id.shard,
                samples: id.index..id.index + 1,
            });
        }
        for (position, unit) in units.iter().enumerate().skip(state.cursor.unit) {
            let full: Range<u64> = unit.samples.clone().unwrap_or(0..counts[unit.shard]);
            let start = match state.cursor.next_sample {
                Some(next) if position == state.cursor.unit => next.max(full.start),
                _ => full.start,
            };
            if start < full.end {
                runs.push(Piece {
                    shard: unit.shard,
                    samples: start..full.end,
                });
            }
        }
    }
    Ok(runs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mirror_follows_pushes_and_pops() {
        let id = |index| SampleId { shard: 2, index };
        let mut mirror = Mirror::start();
        mirror.apply(&[
            Op::Push { unit: 0, id: id(0) },
            Op::Push { unit: 0, id: id(1) },
            Op::Push { unit: 0, id: id(2) },
            Op::Pop {
                index: 0,
                rng_word_pos: 9,
            },
        ]);
        assert_eq!(mirror.buffer, vec![id(2), id(1)]);
        assert_eq!(
            mirror.cursor,
            Cursor {
                unit: 0,
                next_sample: Some(3)
            }
        );
        mirror.apply(&[
            Op::UnitDone { unit: 0 },
            Op::Pop {
                index: 1,
                rng_word_pos: 12,
            },
        ]);
        assert_eq!(mirror.buffer, vec![id(2)]);
        assert_eq!((mirror.produced, mirror.rng_word_pos), (2, 12));
        assert_eq!(
            mirror.cursor,
            Cursor {
                unit: 1,
                next_sample: None
            }
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
            cursor: Cursor {
                unit: 1,
                next_sample: Some(4),
            },
            buffer: vec![[1, 2], [0, 9]],
            rng_word_pos: u128::MAX.to_string(),
            finished: false,
            resumed_from: None,
        };
        let back = SlotState::from_json(&state.to_json()).unwrap();
        assert_eq!(back, state);
        assert_eq!(back.word_pos().unwrap(), u128::MAX);
        assert!(SlotState::from_json("{}").is_err());
    }
}
