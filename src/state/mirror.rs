//! The consumer's mirror of the pipeline: the [`Op`]s the pipeline reports
//! in order, the [`Mirror`] of its position they keep, and the
//! [`SkippedSamples`] a unit skipped under `on_error="warn"` left out.

use super::digest::{add_mod, id_hash, mul_mod, range_hash, shard_key};
use super::saved::{Cursor, SlotState};
use crate::error::Result;
use crate::format::SampleId;
use crate::plan::WorkUnit;

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
    /// against a dataset: see `resolve`).
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::check::passed;

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
}
