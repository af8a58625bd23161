//! The scheduler: a pure function from (shards, seed, epoch, slots) to the
//! ordered work units of every slot. No I/O, no clocks, no global state.

pub mod cut;
pub mod mix;
pub mod order;
pub mod resume;
pub mod slot;

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::ops::Range;

pub use cut::{Remainder, SampleWeights};
pub use order::Purpose;
pub use slot::SlotSpec;

/// What the plan knows of a shard before reading it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ShardInfo {
    /// Size in bytes, when known.
    pub size: Option<u64>,
    /// Number of samples, when a manifest gives it.
    pub samples: Option<u64>,
}

/// One unit of work: a whole shard, or a run of its samples.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkUnit {
    /// Shard index.
    pub shard: usize,
    /// Sample indices to read; `None` for the whole shard.
    pub samples: Option<Range<u64>>,
}

/// Inputs of a plan that do not depend on the slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanParams {
    /// Seed of the job.
    pub seed: u64,
    /// Epoch number.
    pub epoch: u64,
    /// Shuffle the shard order (per epoch) or keep the listed order.
    pub shuffle_shards: bool,
    /// Number of processes.
    pub world_size: usize,
    /// DataLoader workers per process.
    pub num_workers: usize,
    /// Remainder policy of equal-length epochs (with sample counts).
    pub remainder: Remainder,
}

/// One epoch's plan for the whole job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EpochPlan {
    /// The epoch's global order of shard indices.
    pub order: Vec<usize>,
    /// For each slot (`rank * num_workers + worker`), its work units in order.
    pub slots: Vec<Vec<WorkUnit>>,
    /// Samples every rank gets, when sample counts are known.
    pub samples_per_rank: Option<u64>,
}

impl EpochPlan {
    /// The work units of one slot, in the order it reads them.
    pub fn units_of(&self, slot: &SlotSpec) -> &[WorkUnit] {
        &self.slots[slot.slot()]
    }
}

/// The epoch's shard order: a ChaCha shuffle of `(seed, epoch)`, or the
/// listed order.
pub fn epoch_order(shard_count: usize, params: &PlanParams) -> Vec<usize> {
    let mut order: Vec<usize> = (0..shard_count).collect();
    if params.shuffle_shards {
        let mut rng = order::rng_for(params.seed, params.epoch, Purpose::ShardOrder);
        order::shuffle(&mut rng, &mut order);
    }
    order
}

/// Plans one epoch.
///
/// When every shard's sample count is known (a manifest), the epoch's
/// global sample sequence is cut into equal contiguous runs per rank and
/// near-equal runs per worker ([`cut`]): every rank gets the same number of
/// samples. Otherwise whole shards are dealt in epoch order, each to the
/// slot with the fewest bytes so far (lowest slot on ties): slots are
/// balanced by bytes, unknown sizes counting as the mean known size, and
/// with fewer shards than slots some slots get none.
pub fn plan_epoch(shards: &[ShardInfo], params: &PlanParams) -> EpochPlan {
    let order = epoch_order(shards.len(), params);
    let counts: Option<Vec<u64>> = shards.iter().map(|s| s.samples).collect();
    if let (Some(counts), false) = (counts, shards.is_empty()) {
        let total = counts.iter().fold(0u64, |sum, &n| sum.saturating_add(n));
        let pieces = cut::cut_epoch(
            &order,
            &counts,
            params.world_size,
            params.num_workers,
            params.remainder,
        );
        let slots = units_of_pieces(pieces);
        return EpochPlan {
            order,
            slots,
            samples_per_rank: Some(cut::samples_per_rank(
                total,
                params.world_size,
                params.remainder,
            )),
        };
    }
    let sizes: Vec<Option<u64>> = shards.iter().map(|s| s.size).collect();
    let slots = balance_by_bytes(
        &order,
        &sizes,
        (params.world_size * params.num_workers).max(1),
    );
    EpochPlan {
        order,
        slots,
        samples_per_rank: None,
    }
}

/// Plans one epoch cut by the samples' `weights` rather than their
/// number (packing across ranks: the documents' token counts): the
/// epoch's global sample sequence (shards in epoch order, a shard of
/// unknown count taken as empty) is cut into one contiguous run per slot
/// of near-equal weight ([`cut::cut_runs_weighted`]); no sample is left
/// out, and ranks get different numbers of samples.
pub fn plan_epoch_weighted(
    shards: &[ShardInfo],
    params: &PlanParams,
    weights: &dyn SampleWeights,
) -> EpochPlan {
    let order = epoch_order(shards.len(), params);
    let runs: Vec<cut::Piece> = order
        .iter()
        .map(|&shard| cut::Piece {
            shard,
            samples: 0..shards[shard].samples.unwrap_or(0),
        })
        .collect();
    let slots = (params.world_size * params.num_workers).max(1);
    EpochPlan {
        slots: units_of_pieces(cut::cut_runs_weighted(&runs, slots, weights)),
        order,
        samples_per_rank: None,
    }
}

/// The work units of `slot` alone in the epoch: the same as
/// `plan_epoch(shards, params).units_of(slot)`. With sample counts (every
/// plan of several ranks) only this slot is cut, so a job of many slots
/// costs each stream its own units, not a list per slot.
pub fn slot_units(shards: &[ShardInfo], params: &PlanParams, slot: &SlotSpec) -> Vec<WorkUnit> {
    let counts: Option<Vec<u64>> = shards.iter().map(|s| s.samples).collect();
    match (counts, shards.is_empty()) {
        (Some(counts), false) => {
            let order = epoch_order(shards.len(), params);
            let pieces = cut::cut_epoch_slot(
                &order,
                &counts,
                (params.world_size, params.num_workers),
                params.remainder,
                slot.slot(),
            );
            units_of_pieces(vec![pieces]).swap_remove(0)
        }
        _ => plan_epoch(shards, params).slots.swap_remove(slot.slot()),
    }
}

/// Each slot's sample runs as work units.
pub fn units_of_pieces(pieces: Vec<Vec<cut::Piece>>) -> Vec<Vec<WorkUnit>> {
    pieces
        .into_iter()
        .map(|slot| {
            slot.into_iter()
                .map(|p| WorkUnit {
                    shard: p.shard,
                    samples: Some(p.samples),
                })
                .collect()
        })
        .collect()
}

fn balance_by_bytes(
    order: &[usize],
    sizes: &[Option<u64>],
    slot_count: usize,
) -> Vec<Vec<WorkUnit>> {
    let known: Vec<u64> = sizes.iter().flatten().copied().collect();
    let fallback = if known.is_empty() {
        1
    } else {
        (known.iter().map(|&s| u128::from(s)).sum::<u128>() / known.len() as u128) as u64
    };
    let mut load: BinaryHeap<Reverse<(u128, usize)>> =
        (0..slot_count).map(|slot| Reverse((0, slot))).collect();
    let mut slots = vec![Vec::new(); slot_count];
    for &shard in order {
        let Reverse((bytes, slot)) = load.pop().expect("at least one slot");
        slots[slot].push(WorkUnit {
            shard,
            samples: None,
        });
        let size = sizes[shard].unwrap_or(fallback).max(1);
        load.push(Reverse((bytes + u128::from(size), slot)));
    }
    slots
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn params(seed: u64, epoch: u64, world_size: usize, num_workers: usize) -> PlanParams {
        PlanParams {
            seed,
            epoch,
            shuffle_shards: true,
            world_size,
            num_workers,
            remainder: Remainder::Drop,
        }
    }

    fn sized(sizes: &[Option<u64>]) -> Vec<ShardInfo> {
        sizes
            .iter()
            .map(|&size| ShardInfo {
                size,
                samples: None,
            })
            .collect()
    }

    fn shard_ids(slot: &[WorkUnit]) -> Vec<usize> {
        slot.iter().map(|u| u.shard).collect()
    }

    proptest! {
        #[test]
        fn a_slot_planned_alone_gets_its_units_of_the_whole_plan(
            shards in prop::collection::vec(
                (prop::option::of(1u64..1_000_000), prop::option::of(0u64..40)), 0..60),
            world_size in 1usize..7,
            num_workers in 1usize..5,
            seed in any::<u64>(),
            epoch in 0u64..1000,
        ) {
            let infos: Vec<ShardInfo> = shards
                .iter()
                .map(|&(size, samples)| ShardInfo { size, samples })
                .collect();
            let p = params(seed, epoch, world_size, num_workers);
            let plan = plan_epoch(&infos, &p);
            for rank in 0..world_size {
                for worker in 0..num_workers {
                    let slot = SlotSpec::new(world_size, rank, num_workers, worker).unwrap();
                    prop_assert_eq!(&slot_units(&infos, &p, &slot), plan.units_of(&slot));
                }
            }
        }

        #[test]
        fn every_shard_in_exactly_one_slot(
            sizes in prop::collection::vec(prop::option::of(1u64..1_000_000), 0..200),
            world_size in 1usize..9,
            num_workers in 1usize..6,
            seed in any::<u64>(),
            epoch in 0u64..1000,
        ) {
            let plan = plan_epoch(&sized(&sizes), &params(seed, epoch, world_size, num_workers));
            prop_assert_eq!(plan.slots.len(), world_size * num_workers);
            let mut seen = vec![0u32; sizes.len()];
            for slot in &plan.slots {
                for unit in slot {
                    prop_assert!(unit.samples.is_none());
                    seen[unit.shard] += 1;
                }
            }
            prop_assert!(seen.iter().all(|&n| n == 1));
            let mut sorted = plan.order.clone();
            sorted.sort_unstable();
            prop_assert_eq!(sorted, (0..sizes.len()).collect::<Vec<_>>());
        }

        #[test]
        fn slots_follow_the_epoch_order(
            n in 0usize..100, world_size in 1usize..5, num_workers in 1usize..5, seed in any::<u64>(),
        ) {
            let plan = plan_epoch(&sized(&vec![Some(10); n]), &params(seed, 3, world_size, num_workers));
            let position: Vec<usize> = {
                let mut p = vec![0; n];
                for (i, &s) in plan.order.iter().enumerate() { p[s] = i; }
                p
            };
            for slot in &plan.slots {
                let ids = shard_ids(slot);
                prop_assert!(ids.windows(2).all(|w| position[w[0]] < position[w[1]]));
            }
        }

        #[test]
        fn deterministic(
            sizes in prop::collection::vec(prop::option::of(1u64..1000), 0..100),
            world_size in 1usize..5, num_workers in 1usize..5, seed in any::<u64>(), epoch in any::<u64>(),
        ) {
            let p = params(seed, epoch, world_size, num_workers);
            prop_assert_eq!(plan_epoch(&sized(&sizes), &p), plan_epoch(&sized(&sizes), &p));
        }

        #[test]
        fn epochs_differ(n in 8usize..300, seed in any::<u64>(), epoch in 0u64..1_000_000) {
            let sizes = vec![Some(100); n];
            let a = plan_epoch(&sized(&sizes), &params(seed, epoch, 1, 1));
            let b = plan_epoch(&sized(&sizes), &params(seed, epoch + 1, 1, 1));
            prop_assert_ne!(a.order, b.order);
        }

        #[test]
        fn equal_sizes_balance_to_within_one_shard(
            n in 0usize..300, world_size in 1usize..7, num_workers in 1usize..5, seed in any::<u64>(),
        ) {
            let plan = plan_epoch(&sized(&vec![Some(7); n]), &params(seed, 0, world_size, num_workers));
            let counts: Vec<usize> = plan.slots.iter().map(Vec::len).collect();
            let (lo, hi) = (counts.iter().min().unwrap(), counts.iter().max().unwrap());
            prop_assert!(hi - lo <= 1, "{:?}", counts);
        }
    }

    #[test]
    fn known_counts_give_equal_ranks() {
        let shards: Vec<ShardInfo> = [3u64, 50, 7, 1, 20]
            .iter()
            .map(|&n| ShardInfo {
                size: Some(n * 1000),
                samples: Some(n),
            })
            .collect();
        let plan = plan_epoch(&shards, &params(1, 1, 3, 2));
        assert_eq!(plan.samples_per_rank, Some(27));
        for rank in 0..3 {
            let n: u64 = plan.slots[rank * 2..rank * 2 + 2]
                .iter()
                .flatten()
                .map(|u| u.samples.as_ref().map_or(0, |r| r.end - r.start))
                .sum();
            assert_eq!(n, 27);
        }
    }

    #[test]
    fn unshuffled_order_is_the_listed_order() {
        let p = PlanParams {
            shuffle_shards: false,
            ..params(5, 5, 2, 2)
        };
        let plan = plan_epoch(&sized(&[Some(1); 6]), &p);
        assert_eq!(plan.order, (0..6).collect::<Vec<_>>());
        let ids: Vec<Vec<usize>> = plan.slots.iter().map(|s| shard_ids(s)).collect();
        assert_eq!(ids, vec![vec![0, 4], vec![1, 5], vec![2], vec![3]]);
    }

    #[test]
    fn bytes_balance_uneven_shards() {
        let p = PlanParams {
            shuffle_shards: false,
            ..params(0, 0, 2, 1)
        };
        let plan = plan_epoch(&sized(&[Some(100), Some(10), Some(10), Some(10)]), &p);
        let ids: Vec<Vec<usize>> = plan.slots.iter().map(|s| shard_ids(s)).collect();
        assert_eq!(ids, vec![vec![0], vec![1, 2, 3]]);
    }
}
