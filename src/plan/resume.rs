//! Resume planning: the plan of any epoch for any layout of a dataset, what
//! a slot had not read when it stopped, and that rest of an epoch cut anew
//! for another layout (an elastic resume). Pure, next to the epoch cut
//! ([`super::cut`]); checking a saved state against these plans stays with
//! the state's model.

use std::sync::Arc;

use super::cut::{self, Piece, Remainder, SampleWeights};
use super::{
    plan_epoch, plan_epoch_weighted, slot_units, units_of_pieces, PlanParams, ShardInfo, SlotSpec,
    WorkUnit,
};

/// The plans of one dataset's epochs, for any layout: the shards as the
/// plan knows them and the options that shape the plan, and, when its
/// plans cut by weight (packing across ranks), the samples' weights.
pub struct Replanner {
    shards: Vec<ShardInfo>,
    seed: u64,
    shuffle_shards: bool,
    remainder: Remainder,
    weights: Option<Arc<dyn SampleWeights>>,
}

impl Replanner {
    /// The plans of `shards` with these options.
    pub fn new(
        shards: Vec<ShardInfo>,
        seed: u64,
        shuffle_shards: bool,
        remainder: Remainder,
    ) -> Self {
        Replanner {
            shards,
            seed,
            shuffle_shards,
            remainder,
            weights: None,
        }
    }

    /// The same plans, those of several ranks cut by the samples'
    /// `weights` (each slot near-equal weight, [`plan_epoch_weighted`]) when
    /// given; one rank's plans stay cut by samples.
    pub fn with_weights(mut self, weights: Option<Arc<dyn SampleWeights>>) -> Self {
        self.weights = weights;
        self
    }

    /// The weights the plans of `world_size` ranks cut by, if any.
    fn weights_for(&self, world_size: usize) -> Option<&dyn SampleWeights> {
        self.weights.as_deref().filter(|_| world_size > 1)
    }

    /// Whether every shard's sample count is known (what an elastic resume
    /// needs).
    pub fn counts_known(&self) -> bool {
        self.shards.iter().all(|s| s.samples.is_some())
    }

    /// How many shards the dataset has.
    pub fn shard_count(&self) -> usize {
        self.shards.len()
    }

    /// The sample count of shard `shard` (below [`Replanner::shard_count`]),
    /// where known.
    pub fn samples_of(&self, shard: usize) -> Option<u64> {
        self.shards[shard].samples
    }

    fn params(&self, epoch: u64, world_size: usize, num_workers: usize) -> PlanParams {
        PlanParams {
            seed: self.seed,
            epoch,
            shuffle_shards: self.shuffle_shards,
            world_size,
            num_workers,
            remainder: self.remainder,
        }
    }

    /// Every slot's units of `epoch` for `world_size` x `num_workers` slots.
    pub fn plan(&self, epoch: u64, world_size: usize, num_workers: usize) -> Vec<Vec<WorkUnit>> {
        let params = self.params(epoch, world_size, num_workers);
        match self.weights_for(world_size) {
            Some(weights) => plan_epoch_weighted(&self.shards, &params, weights).slots,
            None => plan_epoch(&self.shards, &params).slots,
        }
    }

    /// Every slot's units of `epoch` as they were planned before the
    /// shards' samples were counted (whole shards dealt by bytes,
    /// [`plan_epoch`] without counts), each unit given its shard's count
    /// known now: the plan of a state saved then.
    pub fn plan_without_counts(
        &self,
        epoch: u64,
        world_size: usize,
        num_workers: usize,
    ) -> Vec<Vec<WorkUnit>> {
        let uncounted: Vec<ShardInfo> = self
            .shards
            .iter()
            .map(|s| ShardInfo {
                samples: None,
                ..*s
            })
            .collect();
        let params = self.params(epoch, world_size, num_workers);
        let mut slots = plan_epoch(&uncounted, &params).slots;
        for unit in slots.iter_mut().flatten() {
            unit.samples = self.shards[unit.shard].samples.map(|n| 0..n);
        }
        slots
    }

    /// `slot`'s units of `epoch`, planned without the other slots' (but
    /// for a cut by weight, which weighs every slot's samples).
    pub fn slot_plan(&self, epoch: u64, slot: &SlotSpec) -> Vec<WorkUnit> {
        if self.weights_for(slot.world_size).is_some() {
            return self
                .plan(epoch, slot.world_size, slot.num_workers)
                .swap_remove(slot.slot());
        }
        let params = self.params(epoch, slot.world_size, slot.num_workers);
        slot_units(&self.shards, &params, slot)
    }

    /// Every slot's units when `rest` (the samples an epoch had not handed
    /// out, in order) is cut anew for `world_size` x `num_workers` slots:
    /// equal per rank, as an epoch is cut.
    pub fn recut(
        &self,
        rest: &[Piece],
        world_size: usize,
        num_workers: usize,
    ) -> Vec<Vec<WorkUnit>> {
        match self.weights_for(world_size) {
            Some(weights) => units_of_pieces(cut::cut_runs_weighted(
                rest,
                world_size * num_workers,
                weights,
            )),
            None => units_of_pieces(cut::cut_runs(rest, world_size, num_workers, self.remainder)),
        }
    }

    /// `slot`'s units of [`Replanner::recut`], cut without the other slots'
    /// (but for a cut by weight).
    pub fn slot_recut(&self, rest: &[Piece], slot: &SlotSpec) -> Vec<WorkUnit> {
        if self.weights_for(slot.world_size).is_some() {
            return self
                .recut(rest, slot.world_size, slot.num_workers)
                .swap_remove(slot.slot());
        }
        let layout = (slot.world_size, slot.num_workers);
        let pieces = cut::cut_runs_slot(rest, layout, self.remainder, slot.slot());
        units_of_pieces(vec![pieces]).swap_remove(0)
    }
}

/// What a slot whose units are `units` had not read when it stopped at the
/// unit at position `unit`, before its sample `next_sample` (`None`: at the
/// unit's start): the rest of that unit, then the later units, in order.
/// Units of unknown length (whole shards) are left out: only cut plans,
/// whose units all know their samples, are resumed elastically.
pub fn unread(units: &[WorkUnit], unit: usize, next_sample: Option<u64>) -> Vec<Piece> {
    let mut runs = Vec::new();
    for (position, work) in units.iter().enumerate().skip(unit) {
        let Some(full) = work.samples.clone() else {
            continue;
        };
        let start = match next_sample {
            Some(next) if position == unit => next.max(full.start),
            _ => full.start,
        };
        if start < full.end {
            runs.push(Piece {
                shard: work.shard,
                samples: start..full.end,
            });
        }
    }
    runs
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::*;

    /// Each sample of `pieces` with how many times it appears.
    fn samples<'a>(pieces: impl IntoIterator<Item = &'a Piece>) -> BTreeMap<(usize, u64), u32> {
        let mut seen = BTreeMap::new();
        for piece in pieces {
            for i in piece.samples.clone() {
                *seen.entry((piece.shard, i)).or_insert(0) += 1;
            }
        }
        seen
    }

    fn pieces_of(units: &[WorkUnit]) -> Vec<Piece> {
        units
            .iter()
            .map(|u| Piece {
                shard: u.shard,
                samples: u.samples.clone().unwrap(),
            })
            .collect()
    }

    fn slots(world_size: usize, num_workers: usize) -> impl Iterator<Item = SlotSpec> {
        (0..world_size).flat_map(move |rank| {
            (0..num_workers)
                .map(move |worker| SlotSpec::new(world_size, rank, num_workers, worker).unwrap())
        })
    }

    proptest! {
        /// Every slot of a layout stops somewhere in its units; what they
        /// had read and what `unread` gives split each slot's samples in
        /// two, and the unread samples of all slots, cut anew for another
        /// layout, reach each of its slots exactly once, equal per rank.
        #[test]
        fn the_rest_of_an_epoch_recut_for_any_layout_is_every_unread_sample_once(
            counts in prop::collection::vec(0u64..40, 1..24),
            (world_size, num_workers) in (1usize..5, 1usize..4),
            (new_world, new_workers) in (1usize..6, 1usize..4),
            stops in prop::collection::vec((0usize..30, 0u64..45), 20),
            seed in any::<u64>(),
            epoch in 0u64..4,
        ) {
            let shards = counts
                .iter()
                .map(|&n| ShardInfo { size: Some(n * 100), samples: Some(n) })
                .collect();
            let replanner = Replanner::new(shards, seed, true, Remainder::Drop);
            prop_assert!(replanner.counts_known());
            let plan = replanner.plan(epoch, world_size, num_workers);
            let mut rest = Vec::new();
            let mut read = Vec::new();
            for (units, &(unit, offset)) in plan.iter().zip(stops.iter().cycle()) {
                // Stop at a unit (or past the last) and a sample within it.
                let unit = unit % (units.len() + 1);
                let next = units.get(unit).and_then(|u| {
                    let samples = u.samples.clone().unwrap();
                    let len = samples.end - samples.start;
                    (offset % (len + 1) > 0).then(|| samples.start + offset % (len + 1))
                });
                let unread = unread(units, unit, next);
                let slot_read: Vec<Piece> = units[..unit.min(units.len())]
                    .iter()
                    .map(|u| Piece { shard: u.shard, samples: u.samples.clone().unwrap() })
                    .chain(next.map(|n| Piece {
                        shard: units[unit].shard,
                        samples: units[unit].samples.as_ref().unwrap().start..n,
                    }))
                    .collect();
                // Read and unread are this slot's samples, each once.
                let both = samples(slot_read.iter().chain(&unread));
                prop_assert!(both.values().all(|&n| n == 1));
                let own = samples(&pieces_of(units));
                prop_assert_eq!(both, own);
                rest.extend(unread);
                read.extend(slot_read);
            }
            let total_rest: u64 = rest.iter().map(|p| p.samples.end - p.samples.start).sum();
            let recut = replanner.recut(&rest, new_world, new_workers);
            prop_assert_eq!(recut.len(), new_world * new_workers);
            let per_rank = total_rest / new_world as u64;
            for rank in 0..new_world {
                let n: u64 = recut[rank * new_workers..(rank + 1) * new_workers]
                    .iter()
                    .flatten()
                    .map(|u| u.samples.as_ref().map_or(0, |s| s.end - s.start))
                    .sum();
                prop_assert_eq!(n, per_rank);
            }
            // No sample twice, none that was read, none outside the rest.
            let given: Vec<Piece> = recut.iter().flat_map(|units| pieces_of(units)).collect();
            let given = samples(&given);
            prop_assert!(given.values().all(|&n| n == 1));
            let unread_samples = samples(&rest);
            let read_samples = samples(&read);
            for sample in given.keys() {
                prop_assert!(unread_samples.contains_key(sample));
                prop_assert!(!read_samples.contains_key(sample));
            }
            prop_assert_eq!(given.len() as u64, per_rank * new_world as u64);
            // Each slot alone gets its part of the whole cut.
            for (i, slot) in slots(new_world, new_workers).enumerate() {
                prop_assert_eq!(&replanner.slot_recut(&rest, &slot), &recut[i]);
            }
            for (i, slot) in slots(world_size, num_workers).enumerate() {
                prop_assert_eq!(&replanner.slot_plan(epoch, &slot), &plan[i]);
            }
        }

        /// The plan of a state saved before the samples were counted: the
        /// whole shards each slot was dealt then, each with all its
        /// samples counted now.
        #[test]
        fn a_plan_without_counts_deals_whole_shards_as_before_they_were_counted(
            counts in prop::collection::vec(0u64..40, 1..24),
            sizes in prop::collection::vec(1u64..10_000, 24),
            (world_size, num_workers) in (1usize..4, 1usize..5),
            seed in any::<u64>(),
            epoch in 0u64..4,
        ) {
            let info = |n: &u64, size: &u64, counted: bool| ShardInfo {
                size: Some(*size),
                samples: counted.then_some(*n),
            };
            let shards = |counted| counts.iter().zip(&sizes).map(|(n, s)| info(n, s, counted)).collect();
            let before = Replanner::new(shards(false), seed, true, Remainder::Drop)
                .plan(epoch, world_size, num_workers);
            let now = Replanner::new(shards(true), seed, true, Remainder::Drop)
                .plan_without_counts(epoch, world_size, num_workers);
            prop_assert_eq!(before.len(), now.len());
            for (then, now) in before.iter().zip(&now) {
                prop_assert_eq!(then.len(), now.len());
                for (then, now) in then.iter().zip(now) {
                    prop_assert_eq!(then.shard, now.shard);
                    prop_assert_eq!(then.samples.clone(), None);
                    prop_assert_eq!(now.samples.clone(), Some(0..counts[now.shard]));
                }
            }
        }
    }

    #[test]
    fn unread_skips_what_the_cursor_passed_and_units_of_unknown_length() {
        let units = vec![
            WorkUnit {
                shard: 3,
                samples: Some(0..10),
            },
            WorkUnit {
                shard: 1,
                samples: None,
            },
            WorkUnit {
                shard: 0,
                samples: Some(5..9),
            },
            WorkUnit {
                shard: 2,
                samples: Some(0..4),
            },
        ];
        let piece = |shard, samples| Piece { shard, samples };
        assert_eq!(
            unread(&units, 0, Some(7)),
            vec![piece(3, 7..10), piece(0, 5..9), piece(2, 0..4)]
        );
        assert_eq!(
            unread(&units, 2, None),
            vec![piece(0, 5..9), piece(2, 0..4)]
        );
        // A next sample before the unit's start reads the whole unit; one
        // at its end, none of it.
        assert_eq!(
            unread(&units, 2, Some(1)),
            vec![piece(0, 5..9), piece(2, 0..4)]
        );
        assert_eq!(unread(&units, 2, Some(9)), vec![piece(2, 0..4)]);
        assert_eq!(unread(&units, 4, None), vec![]);
    }
}
