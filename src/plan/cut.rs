//! Equal-length cutting: the epoch's global sample sequence (shards in
//! epoch order, samples in shard order) is cut into `world_size` equal
//! contiguous runs, and each run into `num_workers` near-equal contiguous
//! runs, cutting shards at sample boundaries.

use std::ops::Range;

/// What to do with the samples that do not divide evenly among ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Remainder {
    /// Leave the last `total % world_size` samples of the epoch out.
    #[default]
    Drop,
    /// Fill the last rank up by wrapping around to the epoch's first samples.
    Pad,
}

impl std::str::FromStr for Remainder {
    type Err = crate::error::Error;

    fn from_str(s: &str) -> crate::error::Result<Self> {
        [Remainder::Drop, Remainder::Pad]
            .into_iter()
            .find(|remainder| remainder.name() == s)
            .ok_or_else(|| crate::error::Error::Config {
                name: "remainder",
                reason: format!("expected \"drop\" or \"pad\", got {s:?}"),
            })
    }
}

impl Remainder {
    /// The policy's name, as the `remainder` option takes it.
    pub fn name(self) -> &'static str {
        match self {
            Remainder::Drop => "drop",
            Remainder::Pad => "pad",
        }
    }
}

/// A contiguous run of samples of one shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Piece {
    /// Shard index.
    pub shard: usize,
    /// Sample indices within the shard.
    pub samples: Range<u64>,
}

/// Samples every rank gets for `total` samples in the epoch.
pub fn samples_per_rank(total: u64, world_size: usize, remainder: Remainder) -> u64 {
    let world = world_size as u64;
    match remainder {
        Remainder::Drop => total / world,
        Remainder::Pad if total == 0 => 0,
        Remainder::Pad => total.div_ceil(world),
    }
}

/// The range of a rank's run given to `worker` of `num_workers`
/// (the first `n % num_workers` workers get one more sample).
fn worker_share(n: u128, num_workers: usize, worker: usize) -> Range<u128> {
    let (k, w) = (num_workers as u128, worker as u128);
    let (base, extra) = (n / k, n % k);
    let start = w * base + w.min(extra);
    start..start + base + u128::from(w < extra)
}

/// Cuts the epoch into pieces per slot (`rank * num_workers + worker`).
/// `order` is the epoch's shard order and `counts[shard]` its sample count.
pub fn cut_epoch(
    order: &[usize],
    counts: &[u64],
    world_size: usize,
    num_workers: usize,
    remainder: Remainder,
) -> Vec<Vec<Piece>> {
    cut_runs(
        &epoch_runs(order, counts),
        world_size,
        num_workers,
        remainder,
    )
}

/// The pieces of one slot (`rank * num_workers + worker`) of
/// [`cut_epoch`], computed without the other slots'.
pub fn cut_epoch_slot(
    order: &[usize],
    counts: &[u64],
    (world_size, num_workers): (usize, usize),
    remainder: Remainder,
    slot: usize,
) -> Vec<Piece> {
    Cut::new(&epoch_runs(order, counts), world_size, remainder).slot(num_workers, slot)
}

/// The epoch's runs: samples `0..counts[shard]` of each shard in `order`.
fn epoch_runs(order: &[usize], counts: &[u64]) -> Vec<Piece> {
    order
        .iter()
        .map(|&shard| Piece {
            shard,
            samples: 0..counts[shard],
        })
        .collect()
}

/// Cuts a sequence of sample runs into equal pieces per rank, then per worker.
/// Positions in the sequence are counted in `u128`, so no sample count,
/// however large, overflows.
pub fn cut_runs(
    runs: &[Piece],
    world_size: usize,
    num_workers: usize,
    remainder: Remainder,
) -> Vec<Vec<Piece>> {
    let cut = Cut::new(runs, world_size, remainder);
    (0..world_size * num_workers)
        .map(|slot| cut.slot(num_workers, slot))
        .collect()
}

/// The pieces of one slot of [`cut_runs`], computed without the other slots'.
pub fn cut_runs_slot(
    runs: &[Piece],
    (world_size, num_workers): (usize, usize),
    remainder: Remainder,
    slot: usize,
) -> Vec<Piece> {
    Cut::new(runs, world_size, remainder).slot(num_workers, slot)
}

/// What each sample weighs when a cut balances weight rather than
/// samples: packing across ranks cuts by the documents' token counts.
pub trait SampleWeights: Send + Sync {
    /// The weight of sample `index` of shard `shard`.
    fn weight(&self, shard: usize, index: u64) -> u64;
}

/// Cuts a sequence of sample runs into `slots` contiguous pieces of
/// near-equal weight: each sample goes to the slot whose share of the total
/// weight its middle falls in, so a slot's weight is within one sample's of
/// an equal share. Every sample goes to a slot (nothing is dropped); with
/// no weight at all, every sample goes to the first.
pub fn cut_runs_weighted(
    runs: &[Piece],
    slots: usize,
    weights: &dyn SampleWeights,
) -> Vec<Vec<Piece>> {
    let layout = Cut::new(runs, 1, Remainder::Drop);
    let bounds = weighted_bounds(runs, slots, weights);
    bounds
        .windows(2)
        .map(|slot| pieces_between(runs, &layout.starts, layout.total, slot[0]..slot[1]))
        .collect()
}

/// The global position of each slot's first sample under
/// [`cut_runs_weighted`], then the total.
fn weighted_bounds(runs: &[Piece], slots: usize, weights: &dyn SampleWeights) -> Vec<u128> {
    let samples = || {
        runs.iter().flat_map(|run| {
            run.samples
                .clone()
                .map(move |i| u128::from(weights.weight(run.shard, i)))
        })
    };
    let total: u128 = samples().sum();
    let slots = slots.max(1);
    let mut bounds = vec![0u128];
    let (mut position, mut before) = (0u128, 0u128);
    for weight in samples() {
        // The slot of the sample's middle, in halves of a weight unit.
        let slot = if total == 0 {
            0
        } else {
            ((2 * before + weight) * slots as u128 / (2 * total)).min(slots as u128 - 1) as usize
        };
        while bounds.len() <= slot {
            bounds.push(position);
        }
        position += 1;
        before += weight;
    }
    while bounds.len() <= slots {
        bounds.push(position);
    }
    bounds
}

/// A sequence of runs laid out for cutting among `world_size` ranks.
struct Cut<'a> {
    runs: &'a [Piece],
    /// The global position of each run's first sample.
    starts: Vec<u128>,
    total: u128,
    per_rank: u128,
}

impl<'a> Cut<'a> {
    fn new(runs: &'a [Piece], world_size: usize, remainder: Remainder) -> Self {
        let len = |run: &Piece| u128::from(run.samples.end.saturating_sub(run.samples.start));
        let mut starts = Vec::with_capacity(runs.len());
        let mut total = 0u128;
        for run in runs {
            starts.push(total);
            total += len(run);
        }
        let world = world_size as u128;
        let per_rank = match remainder {
            Remainder::Drop => total / world,
            Remainder::Pad if total == 0 => 0,
            Remainder::Pad => total.div_ceil(world),
        };
        Cut {
            runs,
            starts,
            total,
            per_rank,
        }
    }

    /// The pieces of `slot` (`rank * num_workers + worker`).
    fn slot(&self, num_workers: usize, slot: usize) -> Vec<Piece> {
        let (rank, worker) = ((slot / num_workers) as u128, slot % num_workers);
        let share = worker_share(self.per_rank, num_workers, worker);
        let from = rank * self.per_rank + share.start;
        pieces_between(
            self.runs,
            &self.starts,
            self.total,
            from..from + (share.end - share.start),
        )
    }
}

/// The pieces covering global positions `range` (wrapping past `total`).
fn pieces_between(runs: &[Piece], starts: &[u128], total: u128, range: Range<u128>) -> Vec<Piece> {
    let mut pieces: Vec<Piece> = Vec::new();
    let mut position = range.start;
    while position < range.end {
        let wrapped = position % total;
        let run = starts.partition_point(|&s| s <= wrapped) - 1;
        let run_len = u128::from(runs[run].samples.end - runs[run].samples.start);
        let within = wrapped - starts[run];
        let take = (run_len - within).min(range.end - position);
        // Both lie within the run's `u64` range.
        let first = runs[run].samples.start + within as u64;
        let piece = Piece {
            shard: runs[run].shard,
            samples: first..first + take as u64,
        };
        match pieces.last_mut() {
            Some(last) if last.shard == piece.shard && last.samples.end == piece.samples.start => {
                last.samples.end = piece.samples.end;
            }
            _ => pieces.push(piece),
        }
        position += take;
    }
    pieces
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Weights by shard, one per sample.
    struct Listed(Vec<Vec<u64>>);

    impl SampleWeights for Listed {
        fn weight(&self, shard: usize, index: u64) -> u64 {
            self.0[shard][index as usize]
        }
    }

    fn count(pieces: &[Piece]) -> u64 {
        pieces.iter().map(|p| p.samples.end - p.samples.start).sum()
    }

    proptest! {
        /// A weighted cut gives every sample of the runs to exactly one
        /// slot, in order (slot after slot), and each slot's weight is
        /// within the heaviest sample's of an equal share.
        #[test]
        fn a_weighted_cut_gives_each_sample_once_in_near_equal_weights(
            weights in prop::collection::vec(prop::collection::vec(0u64..200, 0..30), 1..12),
            slots in 1usize..20,
            skip in 0u64..5,
        ) {
            let runs: Vec<Piece> = (0..weights.len())
                .rev()
                .map(|shard| Piece {
                    shard,
                    samples: (skip.min(weights[shard].len() as u64))..weights[shard].len() as u64,
                })
                .collect();
            let listed = Listed(weights.clone());
            let cut = cut_runs_weighted(&runs, slots, &listed);
            prop_assert_eq!(cut.len(), slots);
            let flat: Vec<(usize, u64)> = cut
                .iter()
                .flatten()
                .flat_map(|p| p.samples.clone().map(move |i| (p.shard, i)))
                .collect();
            let all: Vec<(usize, u64)> = runs
                .iter()
                .flat_map(|p| p.samples.clone().map(move |i| (p.shard, i)))
                .collect();
            prop_assert_eq!(flat, all);
            let weighed = &weights;
            let weigh = |pieces: &[Piece]| -> u64 {
                pieces
                    .iter()
                    .flat_map(|p| p.samples.clone().map(move |i| weighed[p.shard][i as usize]))
                    .sum()
            };
            let weigh = &weigh;
            let total: u64 = cut.iter().map(|p| weigh(p)).sum();
            let heaviest = weighed.iter().flatten().copied().max().unwrap_or(0);
            for pieces in &cut {
                let share = total as f64 / slots as f64;
                prop_assert!((weigh(pieces) as f64 - share).abs() <= heaviest as f64 + 1e-9,
                    "{} vs a share of {}", weigh(pieces), share);
            }
        }

        #[test]
        fn one_slot_alone_is_that_slot_of_the_whole_cut(
            counts in prop::collection::vec(0u64..50, 1..40),
            world_size in 1usize..9,
            num_workers in 1usize..5,
            pad in any::<bool>(),
            skip in 0u64..10,
        ) {
            let remainder = if pad { Remainder::Pad } else { Remainder::Drop };
            let order: Vec<usize> = (0..counts.len()).rev().collect();
            let layout = (world_size, num_workers);
            let whole = cut_epoch(&order, &counts, world_size, num_workers, remainder);
            prop_assert_eq!(whole.len(), world_size * num_workers);
            for (slot, pieces) in whole.iter().enumerate() {
                prop_assert_eq!(&cut_epoch_slot(&order, &counts, layout, remainder, slot), pieces);
            }
            // Runs that start mid-shard (a resume's rest of an epoch).
            let runs: Vec<Piece> = order
                .iter()
                .map(|&shard| Piece { shard, samples: skip.min(counts[shard])..counts[shard] })
                .collect();
            let whole = cut_runs(&runs, world_size, num_workers, remainder);
            for (slot, pieces) in whole.iter().enumerate() {
                prop_assert_eq!(&cut_runs_slot(&runs, layout, remainder, slot), pieces);
            }
        }

        #[test]
        fn every_sample_once_equal_per_rank_contiguous(
            counts in prop::collection::vec(0u64..50, 1..40),
            world_size in 1usize..9,
            num_workers in 1usize..5,
        ) {
            let order: Vec<usize> = (0..counts.len()).rev().collect();
            let total: u64 = counts.iter().sum();
            let slots = cut_epoch(&order, &counts, world_size, num_workers, Remainder::Drop);
            let per_rank = total / world_size as u64;
            // Equal counts per rank.
            for rank in 0..world_size {
                let n: u64 = slots[rank * num_workers..(rank + 1) * num_workers].iter().map(|s| count(s)).sum();
                prop_assert_eq!(n, per_rank);
            }
            // Concatenated in slot order, the pieces are the epoch sequence's prefix.
            let mut expected = Vec::new();
            for &s in &order {
                for i in 0..counts[s] { expected.push((s, i)); }
            }
            let got: Vec<(usize, u64)> = slots.iter().flatten()
                .flat_map(|p| p.samples.clone().map(move |i| (p.shard, i))).collect();
            prop_assert_eq!(&got[..], &expected[..(per_rank * world_size as u64) as usize]);
        }

        #[test]
        fn pad_covers_every_sample_with_equal_ranks(
            counts in prop::collection::vec(0u64..30, 1..20),
            world_size in 1usize..12,
            num_workers in 1usize..4,
        ) {
            let order: Vec<usize> = (0..counts.len()).collect();
            let total: u64 = counts.iter().sum();
            let slots = cut_epoch(&order, &counts, world_size, num_workers, Remainder::Pad);
            let per_rank = if total == 0 { 0 } else { total.div_ceil(world_size as u64) };
            let mut seen = std::collections::HashMap::new();
            for rank in 0..world_size {
                let rank_slots = &slots[rank * num_workers..(rank + 1) * num_workers];
                prop_assert_eq!(rank_slots.iter().map(|s| count(s)).sum::<u64>(), per_rank);
                for p in rank_slots.iter().flatten() {
                    prop_assert!(p.samples.end <= counts[p.shard]);
                    for i in p.samples.clone() { *seen.entry((p.shard, i)).or_insert(0u64) += 1; }
                }
            }
            prop_assert_eq!(seen.len() as u64, total);
            let extra: u64 = seen.values().map(|n| n - 1).sum();
            prop_assert_eq!(extra, per_rank * world_size as u64 - total);
        }

        #[test]
        fn workers_of_a_rank_differ_by_at_most_one(n in 0u128..1000, k in 1usize..9) {
            let sizes: Vec<u128> = (0..k).map(|w| { let r = worker_share(n, k, w); r.end - r.start }).collect();
            prop_assert_eq!(sizes.iter().sum::<u128>(), n);
            prop_assert!(sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1);
        }
    }

    #[test]
    fn cuts_shards_at_sample_boundaries() {
        // Shard 1 (6 samples) comes first in the epoch, then shard 0 (4).
        let slots = cut_epoch(&[1, 0], &[4, 6], 2, 1, Remainder::Drop);
        assert_eq!(
            slots,
            vec![
                vec![Piece {
                    shard: 1,
                    samples: 0..5
                }],
                vec![
                    Piece {
                        shard: 1,
                        samples: 5..6
                    },
                    Piece {
                        shard: 0,
                        samples: 0..4
                    }
                ],
            ]
        );
    }

    #[test]
    fn counts_past_u64_do_not_overflow() {
        let counts = [u64::MAX, u64::MAX, 4];
        for remainder in [Remainder::Drop, Remainder::Pad] {
            let slots = cut_epoch(&[2, 0, 1], &counts, 3, 2, remainder);
            let total: u128 = slots
                .iter()
                .flatten()
                .map(|p| {
                    assert!(p.samples.start < p.samples.end && p.samples.end <= counts[p.shard]);
                    u128::from(p.samples.end - p.samples.start)
                })
                .sum();
            let all = 2 * u128::from(u64::MAX) + 4;
            let expected = match remainder {
                Remainder::Drop => all / 3 * 3,
                Remainder::Pad => all.div_ceil(3) * 3,
            };
            assert_eq!(total, expected);
        }
    }

    #[test]
    fn remainder_policies() {
        let drop = cut_epoch(&[0], &[5], 2, 1, Remainder::Drop);
        assert_eq!(
            drop[1],
            vec![Piece {
                shard: 0,
                samples: 2..4
            }]
        );
        let pad = cut_epoch(&[0], &[5], 2, 1, Remainder::Pad);
        assert_eq!(
            pad[1],
            vec![
                Piece {
                    shard: 0,
                    samples: 3..5
                },
                Piece {
                    shard: 0,
                    samples: 0..1
                }
            ]
        );
    }
}
