//! Which sequences a step of a packed rank sees, from the plan alone: each
//! DataLoader worker of the rank reads its slot's documents (planned by
//! their tokens, [`crate::text::counts`]) through its shuffle buffer
//! (replayed as [`super::explain`] replays it), packs them
//! ([`crate::text::pack::lay_out`]) and hands out its sequences, all of
//! them on one rank and the planned ones across ranks, in batches of
//! `batch_size`; the DataLoader hands out the workers' batches in turn. A
//! sequence is named by its pieces: which tokens of which documents it
//! holds.

use super::explain::{batch_of_step, BufferCheck, ExplainError, SavedPosition};
use super::verify_pack::{Arrival, Packing, PlanOptions};
use crate::format::SampleId;
use crate::plan::{PlanParams, ShardInfo};
use crate::state::runs_digest;
use crate::text::pack::{self, PackMode, SavedPiece};
use std::collections::HashSet;

/// The sequences of one step of a packed rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedStep {
    /// The DataLoader worker whose batch it is.
    pub worker: usize,
    /// The batch's number among that worker's batches of the epoch.
    pub worker_batch: u64,
    /// The number of the batch's first sequence among the worker's.
    pub first_sequence: u64,
    /// Each sequence's pieces, `[shard, index, first token, end token]`,
    /// in order.
    pub sequences: Vec<Vec<SavedPiece>>,
    /// Whether the worker's shuffle buffer's replay is known to be exact.
    pub buffer: BufferCheck,
}

/// One worker's epoch, replayed: the order its documents reached its
/// packer and the sequences it hands out.
struct Laid {
    order: Vec<(usize, u64)>,
    /// Every sequence its packer makes of them.
    sequences: Vec<Vec<SavedPiece>>,
    /// Those it hands out: across ranks its planned ones, on one all.
    planned: Option<u64>,
    check: BufferCheck,
}

impl Laid {
    /// The number of sequences it hands out.
    fn handed_out(&self) -> u64 {
        let all = self.sequences.len() as u64;
        self.planned.map_or(all, |planned| planned.min(all))
    }
}

/// The sequences of step `step` of rank `rank` (its batch number in the
/// epoch of `params`, or after the resume from `saved`; batches of
/// `batch_size` sequences), `packing`'s documents planned over shards of
/// `infos` (as the run plans them) and reaching each worker's packer
/// through `arrival`. Only the asked worker's order is replayed where the
/// workers' sequence counts are known without it (across ranks, the
/// planned ones; by concatenation, all its documents' tokens fill) and no
/// state is given; otherwise every worker's is, and the weakest check is
/// given. An exact resume hands out the sequences the epoch would have
/// from where each worker stood ([`handed_before`]).
pub fn explain_packed_step(
    packing: &Packing,
    arrival: Arrival,
    (params, infos): (&PlanParams, Vec<ShardInfo>),
    (rank, step, batch_size): (usize, u64, u64),
    saved: Option<&SavedPosition>,
) -> Result<PackedStep, ExplainError> {
    let options = PlanOptions {
        seed: params.seed,
        shuffle_shards: params.shuffle_shards,
        remainder: params.remainder,
    };
    let workers = params.num_workers;
    let (units, slots) =
        packing.plan_slots(infos, options, params.epoch, (params.world_size, workers));
    let lay = |worker: usize| -> Result<Laid, ExplainError> {
        let slot = rank * workers + worker;
        let (order, check) = packing
            .arrival_order(arrival, (params.seed, params.epoch), slot, &units[slot])
            .map_err(|position| ExplainError::BufferBytes { worker, position })?;
        let documents = order.iter().map(|&(shard, index)| {
            let tokens = packing.tokens_of(shard, index);
            (SampleId { shard, index }, tokens)
        });
        // Across ranks a slot hands out its planned sequences; on one, all.
        // Those past them are laid too: a saved packer's open sequences
        // are checked against them.
        let sequences =
            pack::lay_out(documents, &packing.spec, None).ok_or(ExplainError::TooLong)?;
        Ok(Laid {
            order,
            sequences,
            planned: slots[slot].handed_out,
            check,
        })
    };
    // A resume needs every worker's replay, to know where each stood.
    let known: Option<Vec<u64>> = (0..workers)
        .map(|worker| {
            let slot = &slots[rank * workers + worker];
            let all = (packing.spec.mode == PackMode::Concat).then_some(slot.at_least);
            slot.handed_out.or(all)
        })
        .collect::<Option<_>>()
        .filter(|_| saved.is_none());
    let (counts, mut laid, check) = match known {
        Some(counts) => (counts, Vec::new(), None),
        None => {
            let every = (0..workers).map(lay).collect::<Result<Vec<_>, _>>()?;
            let counts = every.iter().map(Laid::handed_out).collect();
            let check = every.iter().map(|l| l.check).reduce(weaker);
            (counts, every, check)
        }
    };
    // Where each worker's sequences go on: the epoch's start, or past
    // those it had handed out when the state was saved.
    let (offsets, first) = match saved {
        None => (vec![0; workers], 0),
        Some(saved) => {
            let offsets = (0..workers)
                .map(|worker| {
                    handed_before(&laid[worker], |s, i| packing.tokens_of(s, i), saved, worker)
                        .ok_or(ExplainError::NotThisPlan { worker })
                })
                .collect::<Result<Vec<u64>, _>>()?;
            (offsets, saved.next_worker % workers.max(1))
        }
    };
    let batches: Vec<u64> = counts
        .iter()
        .zip(&offsets)
        .map(|(n, handed)| (n - handed).div_ceil(batch_size))
        .collect();
    let Some((worker, round)) = batch_of_step(&batches, first, step) else {
        return Err(ExplainError::PastTheEnd {
            steps: batches.iter().sum(),
        });
    };
    let (sequences, check) = match laid.get_mut(worker) {
        Some(l) => (
            std::mem::take(&mut l.sequences),
            check.unwrap_or(BufferCheck::NoBuffer),
        ),
        None => {
            let l = lay(worker)?;
            (l.sequences, l.check)
        }
    };
    let from = offsets[worker] + round * batch_size;
    let to = (from + batch_size).min(counts[worker]);
    Ok(PackedStep {
        worker,
        worker_batch: from / batch_size,
        first_sequence: from,
        sequences: sequences[from.min(to) as usize..to as usize].to_vec(),
        buffer: check,
    })
}

/// The sequences worker `worker` had handed out when `saved` was saved,
/// its epoch replayed as `laid`. Its packer had taken the first `produced`
/// documents of its order (their digest the state's) and held pieces of
/// them in ready and open sequences: the sequences handed out are the
/// replayed ones the rest of those documents' tokens make up (across
/// ranks, also all but the sequences left), its ready ones come next,
/// whole, and each open one begins a later one (pieces without tokens,
/// which a packer without ids drops, left out of the comparisons).
/// `None` where the state does not fit the replay (another plan, order or
/// packing).
fn handed_before(
    laid: &Laid,
    tokens_of: impl Fn(usize, u64) -> u64,
    saved: &SavedPosition,
    worker: usize,
) -> Option<u64> {
    let produced = usize::try_from(*saved.produced.get(worker)?).ok()?;
    let taken = laid.order.get(..produced)?;
    let runs: Vec<(usize, std::ops::Range<u64>)> =
        taken.iter().map(|&(shard, i)| (shard, i..i + 1)).collect();
    if runs_digest(&runs) != *saved.digests.get(worker)? {
        return None;
    }
    let packer = saved.packed.get(worker)?;
    if packer.sequences_left.is_some() != laid.planned.is_some() {
        return None;
    }
    let held = &packer.held;
    let taken_set: HashSet<(usize, u64)> = taken.iter().copied().collect();
    let mut pieces = held.ready.iter().chain(&held.open).flatten();
    if !pieces.all(|p| taken_set.contains(&(p[0] as usize, p[1]))) {
        return None;
    }
    let tokens = |sequence: &Vec<SavedPiece>| sequence.iter().map(|p| p[3] - p[2]).sum::<u64>();
    let walk = || -> Option<usize> {
        let consumed: u64 = taken.iter().map(|&(s, i)| tokens_of(s, i)).sum();
        let held: u64 = held.ready.iter().chain(&held.open).map(tokens).sum();
        let mut rest = consumed.checked_sub(held)?;
        let mut handed = 0;
        while rest > 0 {
            rest = rest.checked_sub(tokens(laid.sequences.get(handed)?))?;
            handed += 1;
        }
        Some(handed)
    };
    let handed_out = usize::try_from(laid.handed_out()).ok()?;
    let handed = match packer.sequences_left.map(usize::try_from) {
        // With none left a packer saves nothing of what it took.
        Some(Ok(0)) => handed_out,
        Some(left) => {
            let handed = handed_out.checked_sub(left.ok()?)?;
            (walk()? == handed).then_some(handed)?
        }
        None => walk()?,
    };
    let with_tokens = |sequence: &Vec<SavedPiece>| -> Vec<SavedPiece> {
        sequence.iter().copied().filter(|p| p[3] > p[2]).collect()
    };
    let mut next = laid.sequences.get(handed..)?.iter().map(with_tokens);
    if !held
        .ready
        .iter()
        .all(|ready| next.next() == Some(with_tokens(ready)))
    {
        return None;
    }
    let mut later: Vec<Vec<SavedPiece>> = next.collect();
    for open in held.open.iter().map(with_tokens) {
        let at = later
            .iter()
            .position(|sequence| sequence.starts_with(&open))?;
        later.remove(at);
    }
    Some(handed as u64)
}

/// The weaker of two replays' checks: bytes unknown, then within them,
/// then no buffer.
fn weaker(a: BufferCheck, b: BufferCheck) -> BufferCheck {
    use BufferCheck::{BytesUnknown, NoBuffer, WithinBytes};
    match (a, b) {
        (BytesUnknown, _) | (_, BytesUnknown) => BytesUnknown,
        (WithinBytes, _) | (_, WithinBytes) => WithinBytes,
        (NoBuffer, NoBuffer) => NoBuffer,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::verify_pack::Decoded;
    use crate::plan::Remainder;
    use crate::shard::Shard;
    use crate::shuffle::ShuffleBounds;
    use crate::text::counts::tests::shard;
    use crate::text::pack::{PackMode, PackSpec};

    /// Documents through a shuffle buffer of 4 that lets 2 in first, none
    /// decoded.
    const ARRIVAL: Arrival = Arrival {
        buffer: Some(ShuffleBounds {
            max_items: 4,
            max_bytes: 1 << 20,
            initial: 2,
        }),
        decoded: Decoded::Nothing,
    };

    /// Epoch 1 of seed 4, shards shuffled, on `world_size` ranks of
    /// `num_workers` workers.
    fn params(world_size: usize, num_workers: usize) -> PlanParams {
        PlanParams {
            seed: 4,
            epoch: 1,
            shuffle_shards: true,
            world_size,
            num_workers,
            remainder: Remainder::Drop,
        }
    }

    fn packing(window: Option<usize>) -> Packing {
        let shards: Vec<Shard> = (0..3)
            .map(|s| {
                let counts = (0..10).map(|d| (s * 3 + d * 7) % 19).collect();
                shard(&format!("p-{s}.jsonl"), Some(counts))
            })
            .collect();
        let mode = window.map_or(PackMode::Concat, |window| PackMode::BestFit { window });
        let option = serde_json::json!({
            "seq_len": 6,
            "mode": if window.is_some() { "best_fit" } else { "concat" },
            "window": window.unwrap_or(0),
            "field": "ids",
        });
        let packing = Packing::from_option(&option, &shards).unwrap().unwrap();
        assert_eq!(
            packing.spec,
            PackSpec::new(Some("ids".into()), 6, mode, false, 0).unwrap()
        );
        packing
    }

    #[test]
    fn a_saved_packer_s_place_is_found_and_the_rest_of_the_epoch_follows() {
        use std::sync::Arc;

        use crate::ledger::explain::SavedPacker;
        use crate::ledger::verify_pack::tests::doc;
        use crate::state::runs_digest;
        use crate::text::pack::{PackState, Packer};

        let arrival = ARRIVAL;
        for window in [None, Some(2)] {
            let packing = packing(window);
            let infos = || packing.shards.iter().map(Shard::info).collect();
            for world_size in [1, 2] {
                let params = params(world_size, 1);
                let options = PlanOptions {
                    seed: 4,
                    shuffle_shards: true,
                    remainder: Remainder::Drop,
                };
                let (units, slots) = packing.plan_slots(infos(), options, 1, (world_size, 1));
                let (order, _) = packing
                    .arrival_order(arrival, (4, 1), 0, &units[0])
                    .unwrap();
                let explain = |packing: &Packing, step, saved: Option<&SavedPosition>| {
                    explain_packed_step(packing, arrival, (&params, infos()), (0, step, 1), saved)
                };
                let total = (0..)
                    .take_while(|&s| explain(&packing, s, None).is_ok())
                    .count();
                assert!(total > 4, "{total}");
                for handed in [0, 1, total / 2, total - 1, total] {
                    // The stream: its packer takes a document whenever no
                    // sequence is ready, until `handed` are handed out.
                    let mut packer = Packer::new(Arc::new(packing.spec.clone())).with_ids(1);
                    let (mut out, mut taken) = (0, 0);
                    while out < handed {
                        if packer.pop_pieces().is_some() {
                            out += 1;
                            continue;
                        }
                        match order.get(taken) {
                            Some(&d) => {
                                packer.push(&doc(d, packing.tokens_of(d.0, d.1))).unwrap();
                                taken += 1;
                            }
                            None if packer.is_empty() => break,
                            None => {
                                packer.finish();
                            }
                        }
                    }
                    assert_eq!(out, handed);
                    let left = slots[0].handed_out.map(|n| n - handed as u64);
                    let held = match left {
                        Some(0) => PackState::default(),
                        _ => packer.state(),
                    };
                    let runs: Vec<_> = order[..taken].iter().map(|&(s, i)| (s, i..i + 1)).collect();
                    let saved = SavedPosition {
                        produced: vec![taken as u64],
                        digests: vec![runs_digest(&runs)],
                        next_worker: 0,
                        packed: vec![SavedPacker {
                            held,
                            sequences_left: left,
                        }],
                    };
                    for step in 0..(total - handed) as u64 {
                        assert_eq!(
                            explain(&packing, step, Some(&saved)),
                            explain(&packing, handed as u64 + step, None),
                            "{window:?} {world_size} {handed} {step}"
                        );
                    }
                    let steps = (total - handed) as u64;
                    assert_eq!(
                        explain(&packing, steps, Some(&saved)),
                        Err(ExplainError::PastTheEnd { steps })
                    );
                }
            }
        }
    }

    #[test]
    fn a_saved_position_is_checked_against_the_replay() {
        use crate::ledger::explain::SavedPacker;
        use crate::text::pack::PackState;

        let packing = packing(None);
        let infos = || packing.shards.iter().map(Shard::info).collect();
        let params = params(1, 2);
        let explain = |step, saved: Option<&SavedPosition>| {
            explain_packed_step(&packing, ARRIVAL, (&params, infos()), (0, step, 2), saved)
        };
        // Saved before any document: the epoch from its start.
        let start = SavedPosition {
            produced: vec![0, 0],
            digests: vec![0, 0],
            next_worker: 0,
            packed: vec![SavedPacker::default(); 2],
        };
        let mut step = 0;
        while let Ok(fresh) = explain(step, None) {
            assert_eq!(explain(step, Some(&start)), Ok(fresh));
            step += 1;
        }
        assert_eq!(
            explain(step, Some(&start)),
            Err(ExplainError::PastTheEnd { steps: step })
        );
        // Held pieces no replayed document's first ones make up, or a
        // digest of other documents: not this plan.
        let holding = SavedPosition {
            packed: vec![
                SavedPacker {
                    held: PackState {
                        ready: vec![],
                        open: vec![vec![[0, 0, 0, 1]]],
                    },
                    sequences_left: None,
                },
                SavedPacker::default(),
            ],
            ..start.clone()
        };
        assert_eq!(
            explain(0, Some(&holding)),
            Err(ExplainError::NotThisPlan { worker: 0 })
        );
        let other = SavedPosition {
            digests: vec![0, 7],
            ..start
        };
        assert_eq!(
            explain(0, Some(&other)),
            Err(ExplainError::NotThisPlan { worker: 1 })
        );
    }

    #[test]
    fn a_rank_s_steps_hold_each_token_of_its_sequences_once_in_turn() {
        let arrival = ARRIVAL;
        for window in [None, Some(2)] {
            let packing = packing(window);
            let infos = || packing.shards.iter().map(Shard::info).collect();
            for world_size in [1, 2] {
                let params = params(world_size, 2);
                let mut seen = Vec::new();
                let mut per_worker = [0u64; 2];
                for rank in 0..world_size {
                    let mut step = 0;
                    while let Ok(found) = explain_packed_step(
                        &packing,
                        arrival,
                        (&params, infos()),
                        (rank, step, 3),
                        None,
                    ) {
                        assert_eq!(found.buffer, BufferCheck::WithinBytes);
                        assert!(!found.sequences.is_empty() && found.sequences.len() <= 3);
                        // The worker's batches come in order.
                        if rank == 0 {
                            assert_eq!(found.first_sequence, per_worker[found.worker]);
                            per_worker[found.worker] += found.sequences.len() as u64;
                        }
                        for sequence in &found.sequences {
                            let used: u64 = sequence.iter().map(|p| p[3] - p[2]).sum();
                            assert!(used <= packing.spec.capacity() as u64);
                            seen.extend(
                                sequence
                                    .iter()
                                    .flat_map(|&[s, i, a, b]| (a..b).map(move |t| (s, i, t))),
                            );
                        }
                        step += 1;
                    }
                    assert_eq!(
                        explain_packed_step(
                            &packing,
                            arrival,
                            (&params, infos()),
                            (rank, step, 3),
                            None
                        ),
                        Err(ExplainError::PastTheEnd { steps: step })
                    );
                }
                let total = seen.len();
                seen.sort_unstable();
                seen.dedup();
                assert_eq!(seen.len(), total, "no token twice");
                let all: u64 = (0..3)
                    .flat_map(|s| packing.shards[s].tokens().unwrap().counts.clone())
                    .sum();
                if world_size == 1 {
                    assert_eq!(total as u64, all, "one rank hands out every token");
                } else {
                    assert!(total as u64 <= all);
                }
            }
        }
    }
}
