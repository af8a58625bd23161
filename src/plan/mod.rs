//! The scheduler: a pure function from (shards, seed, epoch, slots) to the
//! ordered work units of every slot. No I/O, no clocks, no global state.

pub mod order;

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use crate::config::SlotSpec;
pub use order::Purpose;

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
}

/// One epoch's plan for the whole job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EpochPlan {
    /// The epoch's global order of shard indices.
    pub order: Vec<usize>,
    /// For each slot (`rank * num_workers + worker`), its shard indices in order.
    pub slots: Vec<Vec<usize>>,
}

impl EpochPlan {
    /// The shard indices of one slot, in the order it reads them.
    pub fn units_of(&self, slot: &SlotSpec) -> &[usize] {
        &self.slots[slot.slot()]
    }
}

/// Plans one epoch. `sizes[i]` is shard `i`'s size in bytes when known.
///
/// Shards are taken in the epoch order (a ChaCha shuffle of `(seed, epoch)`
/// when `shuffle_shards`) and each goes to the slot with the fewest bytes so
/// far (lowest slot on ties), so slots are balanced by bytes. Unknown sizes
/// count as the mean known size. With fewer shards than slots, some slots
/// get none.
pub fn plan_epoch(sizes: &[Option<u64>], params: &PlanParams) -> EpochPlan {
    let slot_count = (params.world_size * params.num_workers).max(1);
    let mut order: Vec<usize> = (0..sizes.len()).collect();
    if params.shuffle_shards {
        let mut rng = order::rng_for(params.seed, params.epoch, Purpose::ShardOrder);
        order::shuffle(&mut rng, &mut order);
    }
    let known: Vec<u64> = sizes.iter().flatten().copied().collect();
    let fallback = if known.is_empty() {
        1
    } else {
        (known.iter().map(|&s| u128::from(s)).sum::<u128>() / known.len() as u128) as u64
    };
    let mut load: BinaryHeap<Reverse<(u128, usize)>> =
        (0..slot_count).map(|slot| Reverse((0, slot))).collect();
    let mut slots = vec![Vec::new(); slot_count];
    for &shard in &order {
        let Reverse((bytes, slot)) = load.pop().expect("at least one slot");
        slots[slot].push(shard);
        let size = sizes[shard].unwrap_or(fallback).max(1);
        load.push(Reverse((bytes + u128::from(size), slot)));
    }
    EpochPlan { order, slots }
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
        }
    }

    proptest! {
        #[test]
        fn every_shard_in_exactly_one_slot(
            sizes in prop::collection::vec(prop::option::of(1u64..1_000_000), 0..200),
            world_size in 1usize..9,
            num_workers in 1usize..6,
            seed in any::<u64>(),
            epoch in 0u64..1000,
        ) {
            let plan = plan_epoch(&sizes, &params(seed, epoch, world_size, num_workers));
            prop_assert_eq!(plan.slots.len(), world_size * num_workers);
            let mut seen = vec![0u32; sizes.len()];
            for slot in &plan.slots {
                for &shard in slot {
                    seen[shard] += 1;
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
            let plan = plan_epoch(&vec![Some(10); n], &params(seed, 3, world_size, num_workers));
            let position: Vec<usize> = {
                let mut p = vec![0; n];
                for (i, &s) in plan.order.iter().enumerate() { p[s] = i; }
                p
            };
            for slot in &plan.slots {
                prop_assert!(slot.windows(2).all(|w| position[w[0]] < position[w[1]]));
            }
        }

        #[test]
        fn deterministic(
            sizes in prop::collection::vec(prop::option::of(1u64..1000), 0..100),
            world_size in 1usize..5, num_workers in 1usize..5, seed in any::<u64>(), epoch in any::<u64>(),
        ) {
            let p = params(seed, epoch, world_size, num_workers);
            prop_assert_eq!(plan_epoch(&sizes, &p), plan_epoch(&sizes, &p));
        }

        #[test]
        fn epochs_differ(n in 8usize..300, seed in any::<u64>(), epoch in 0u64..1_000_000) {
            let sizes = vec![Some(100); n];
            let a = plan_epoch(&sizes, &params(seed, epoch, 1, 1));
            let b = plan_epoch(&sizes, &params(seed, epoch + 1, 1, 1));
            prop_assert_ne!(a.order, b.order);
        }

        #[test]
        fn equal_sizes_balance_to_within_one_shard(
            n in 0usize..300, world_size in 1usize..7, num_workers in 1usize..5, seed in any::<u64>(),
        ) {
            let plan = plan_epoch(&vec![Some(7); n], &params(seed, 0, world_size, num_workers));
            let counts: Vec<usize> = plan.slots.iter().map(Vec::len).collect();
            let (lo, hi) = (counts.iter().min().unwrap(), counts.iter().max().unwrap());
            prop_assert!(hi - lo <= 1, "{:?}", counts);
        }
    }

    #[test]
    fn unshuffled_order_is_the_listed_order() {
        let p = PlanParams {
            shuffle_shards: false,
            ..params(5, 5, 2, 2)
        };
        let plan = plan_epoch(&[Some(1); 6], &p);
        assert_eq!(plan.order, (0..6).collect::<Vec<_>>());
        assert_eq!(plan.slots, vec![vec![0, 4], vec![1, 5], vec![2], vec![3]]);
    }

    #[test]
    fn bytes_balance_uneven_shards() {
        let p = PlanParams {
            shuffle_shards: false,
            ..params(0, 0, 2, 1)
        };
        let plan = plan_epoch(&[Some(100), Some(10), Some(10), Some(10)], &p);
        assert_eq!(plan.slots, vec![vec![0], vec![1, 2, 3]]);
    }
}
