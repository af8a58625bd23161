//! Which samples a step of a rank sees, from the plan alone (plans without
//! a shuffle buffer): each DataLoader worker of the rank reads its slot's
//! units in order and makes batches of `batch_size` consecutive samples
//! (the last one shorter), a whole shard counted by its sample count; the DataLoader hands out the workers' batches in
//! turn, worker 0 first, passing over a worker that has none left.

use std::ops::Range;

use crate::plan::{self, PlanParams, ShardInfo, SlotSpec, WorkUnit};

/// The samples of one step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepSamples {
    /// The DataLoader worker whose batch it is.
    pub worker: usize,
    /// The batch's number among that worker's batches of the epoch.
    pub worker_batch: u64,
    /// The samples, as `(shard index, index in shard)`, in batch order.
    pub samples: Vec<(usize, u64)>,
}

/// Why a step cannot be explained.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExplainError {
    /// A shard the plan deals whole has no known sample count.
    CountsUnknown,
    /// The rank's epoch has fewer steps.
    PastTheEnd {
        /// Steps the rank takes in the epoch.
        steps: u64,
    },
}

/// The samples step `step` (counted from 0 at the epoch's start) of `rank`
/// sees with batches of `batch_size` (at least 1), under `params`: the
/// plan is made of `shards` as the dataset knows them, and a whole shard
/// that plan deals (no sample count known to it) holds `counts[shard]`
/// samples.
pub fn explain_step(
    shards: &[ShardInfo],
    counts: &[Option<u64>],
    params: &PlanParams,
    rank: usize,
    step: u64,
    batch_size: u64,
) -> Result<StepSamples, ExplainError> {
    let workers: Vec<Vec<WorkUnit>> = (0..params.num_workers)
        .map(|worker| {
            let slot = SlotSpec {
                world_size: params.world_size,
                rank,
                num_workers: params.num_workers,
                worker_id: worker,
            };
            plan::slot_units(shards, params, &slot)
        })
        .collect();
    let runs: Vec<Vec<(usize, Range<u64>)>> = workers
        .iter()
        .map(|units| {
            units
                .iter()
                .map(|u| {
                    let whole = counts[u.shard].map(|n| 0..n);
                    u.samples.clone().or(whole).map(|r| (u.shard, r))
                })
                .collect::<Option<Vec<_>>>()
        })
        .collect::<Option<_>>()
        .ok_or(ExplainError::CountsUnknown)?;
    let counts: Vec<u64> = runs
        .iter()
        .map(|r| r.iter().map(|(_, s)| s.end - s.start).sum())
        .collect();
    let batches: Vec<u64> = counts.iter().map(|n| n.div_ceil(batch_size)).collect();
    let total: u64 = batches.iter().sum();
    if step >= total {
        return Err(ExplainError::PastTheEnd { steps: total });
    }
    // Round `j` hands out batch `j` of every worker that has one.
    let mut left = step;
    let mut round = 0u64;
    loop {
        let active: Vec<usize> = (0..batches.len()).filter(|&w| batches[w] > round).collect();
        if left < active.len() as u64 {
            let worker = active[left as usize];
            let from = round * batch_size;
            let to = (from + batch_size).min(counts[worker]);
            return Ok(StepSamples {
                worker,
                worker_batch: round,
                samples: samples_between(&runs[worker], from..to),
            });
        }
        left -= active.len() as u64;
        round += 1;
    }
}

/// The samples at positions `range` of a slot's runs, in order.
fn samples_between(runs: &[(usize, Range<u64>)], range: Range<u64>) -> Vec<(usize, u64)> {
    let mut out = Vec::new();
    let mut at = 0u64;
    for (shard, samples) in runs {
        let len = samples.end - samples.start;
        let (from, to) = (range.start.max(at), range.end.min(at + len));
        out.extend((from..to.max(from)).map(|p| (*shard, samples.start + p - at)));
        at += len;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::Remainder;

    fn shards(counts: &[u64]) -> Vec<ShardInfo> {
        counts
            .iter()
            .map(|&n| ShardInfo {
                size: None,
                samples: Some(n),
            })
            .collect()
    }

    fn params(world_size: usize, num_workers: usize) -> PlanParams {
        PlanParams {
            seed: 0,
            epoch: 0,
            shuffle_shards: false,
            world_size,
            num_workers,
            remainder: Remainder::Drop,
        }
    }

    #[test]
    fn steps_come_from_the_workers_in_turn() {
        // One rank, 2 workers: worker 0 reads samples 0..5 of shard 0,
        // worker 1 samples 5..6 of shard 0 and 0..4 of shard 1.
        let s = shards(&[6, 4]);
        let p = params(1, 2);
        let counts = [None, None];
        let step = |n| explain_step(&s, &counts, &p, 0, n, 2).unwrap();
        assert_eq!(step(0).samples, [(0, 0), (0, 1)]);
        assert_eq!((step(1).worker, step(1).samples), (1, vec![(0, 5), (1, 0)]));
        assert_eq!(step(2).samples, [(0, 2), (0, 3)]);
        assert_eq!(step(4).samples, [(0, 4)]);
        assert_eq!(step(5).samples, [(1, 3)]);
        assert_eq!(
            explain_step(&s, &counts, &p, 0, 6, 2),
            Err(ExplainError::PastTheEnd { steps: 6 })
        );
    }

    #[test]
    fn every_sample_of_a_rank_comes_in_exactly_one_step() {
        let s = shards(&[7, 3, 9, 1]);
        let p = PlanParams {
            shuffle_shards: true,
            ..params(2, 3)
        };
        for rank in 0..2 {
            let mut seen = Vec::new();
            let mut step = 0;
            while let Ok(samples) = explain_step(&s, &[None; 4], &p, rank, step, 2) {
                seen.extend(samples.samples);
                step += 1;
            }
            let mut expected: Vec<(usize, u64)> = (0..3)
                .flat_map(|w| plan::plan_epoch(&s, &p).slots[rank * 3 + w].clone())
                .flat_map(|u| u.samples.unwrap().map(move |i| (u.shard, i)))
                .collect();
            seen.sort_unstable();
            expected.sort_unstable();
            assert_eq!(seen, expected);
        }
    }

    #[test]
    fn whole_shards_are_batched_with_their_counts() {
        // Balanced by bytes: shard 0 to worker 0, shards 1 and 2 to worker 1.
        let s: Vec<ShardInfo> = [30, 10, 10]
            .iter()
            .map(|&size| ShardInfo {
                size: Some(size),
                samples: None,
            })
            .collect();
        let p = params(1, 2);
        let counts = [Some(3), Some(1), Some(2)];
        let step = |n| explain_step(&s, &counts, &p, 0, n, 2).unwrap();
        assert_eq!((step(0).worker, step(0).samples), (0, vec![(0, 0), (0, 1)]));
        assert_eq!((step(1).worker, step(1).samples), (1, vec![(1, 0), (2, 0)]));
        assert_eq!(step(3).samples, [(2, 1)]);
        assert_eq!(
            explain_step(&s, &[Some(3), None, Some(2)], &p, 0, 0, 2),
            Err(ExplainError::CountsUnknown)
        );
    }
}
