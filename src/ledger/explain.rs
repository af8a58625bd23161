//! Which samples a step of a rank sees, from the plan alone: each
//! DataLoader worker of the rank reads its slot's units in order, passes
//! them through its shuffle buffer (replayed with the slot's RNG, as the
//! pipeline draws it), and makes batches of `batch_size` consecutive
//! samples (the last one shorter), a whole shard counted by its sample
//! count; the DataLoader hands out the workers' batches in turn, worker 0
//! first, passing over a worker that has none left. From a saved state
//! (plans without a shuffle buffer), each worker goes on after the samples
//! it handed out, and the turn starts at the worker after the one whose
//! batch came last (as `StatefulDataLoader` resumes).
//!
//! A buffer also lets a sample out early when the samples it holds pass
//! its byte bound, which depends on their bytes: the replay is exact when
//! that never happens, which it checks where each held sample's bytes have
//! a known upper bound (a manifest's byte spans), and cannot check
//! otherwise.

use std::ops::{ControlFlow, Range};

use crate::byte_size::ByteSize;
use crate::plan::order::{rng_for, Purpose};
use crate::plan::{self, PlanParams, ShardInfo, SlotSpec, WorkUnit};
use crate::shard::{Shard, ShardKind};
use crate::shuffle::{ShuffleBounds, ShuffleBuffer};
use crate::state::{runs_digest, SlotState, STATE_FORMAT, TOKENS_PART};
use crate::text::pack::PackState;

/// The `format` of a loader state that gathers every rank's.
const RANK_STATES: &str = "shardstream.rank_states";

/// Where the DataLoader workers of a rank stood when a state was saved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SavedPosition {
    /// Samples each worker had handed out (its state's `produced`).
    pub produced: Vec<u64>,
    /// Each worker's state's digest of them.
    pub digests: Vec<u64>,
    /// The worker whose batch comes first after the resume.
    pub next_worker: usize,
    /// Of a packed stream (`pack`): what each worker's packer held, and
    /// the sequences it still handed out when planned across ranks; empty
    /// otherwise. `produced` then counts the documents its packer took.
    pub packed: Vec<SavedPacker>,
}

/// Where a worker's packer stood in a saved state.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SavedPacker {
    /// The pieces of documents it held: sequences ready, then open.
    pub held: PackState,
    /// Across ranks: the sequences it still handed out this epoch.
    pub sequences_left: Option<u64>,
}

/// Where the workers of a rank start.
#[derive(Clone, Copy)]
pub enum Start<'a> {
    /// At the epoch's start, through their shuffle buffers (none: `None`).
    Fresh(Option<&'a BufferReplay<'a>>),
    /// Where a saved state left them (a plan without a shuffle buffer).
    Saved(&'a SavedPosition),
}

/// The shuffle buffer of each worker, as explain replays it.
#[derive(Clone, Copy)]
pub struct BufferReplay<'a> {
    /// The dataset's bounds (`shuffle_buffer`, `shuffle_buffer_bytes`,
    /// `shuffle_initial`).
    pub bounds: ShuffleBounds,
    /// The bytes sample `(shard, index)` holds in the buffer at most, when
    /// known: from its byte span in the shard, a manifest's
    /// ([`undecoded_bytes_at_most`]).
    pub sample_bytes: &'a dyn Fn(usize, u64) -> Option<u64>,
}

/// Whether the replayed shuffle buffer is known to be exact.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BufferCheck {
    /// No shuffle buffer.
    NoBuffer,
    /// The samples it held stayed within its byte bound, by their known
    /// upper bounds: the replay is exact.
    WithinBytes,
    /// Some held sample's bytes are unknown: exact only if the samples it
    /// held stayed within its byte bound.
    BytesUnknown,
}

/// The samples of one step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepSamples {
    /// The DataLoader worker whose batch it is.
    pub worker: usize,
    /// The batch's number among that worker's batches of the epoch.
    pub worker_batch: u64,
    /// The samples, as `(shard index, index in shard)`, in batch order.
    pub samples: Vec<(usize, u64)>,
    /// Whether the shuffle buffer's replay is known to be exact.
    pub buffer: BufferCheck,
}

/// A saved state's `(epoch, world_size, num_workers)`, and where its
/// workers stood (`None`: at the epoch's start, the one before it finished).
pub type SavedAt = ((u64, usize, usize), Option<SavedPosition>);

/// `(epoch, world_size, num_workers)` and where the workers of rank `rank`
/// stood in a saved loader state: a `StatefulDataLoader`'s `state_dict()`
/// (its workers' dataset states, and the worker whose batch came last), a
/// dataset's own state, or every rank's loader state gathered
/// (`shardstream.rank_states`). `packed`: the state must be of a packed
/// stream (`explain --pack`), else must not be. The error says why the
/// state cannot be explained. A state whose every worker had finished its
/// epoch resumes into the next epoch from its start: that epoch, and no
/// position (`None`).
pub fn saved_position(
    value: &serde_json::Value,
    rank: usize,
    packed: bool,
) -> Result<SavedAt, String> {
    let value = match value.get("format").and_then(|f| f.as_str()) {
        Some(RANK_STATES) => value
            .get("ranks")
            .and_then(|ranks| ranks.get(rank))
            .ok_or_else(|| format!("the gathered states hold no loader state of rank {rank}"))?,
        _ => value,
    };
    let mut states = Vec::new();
    let mut last_worker = None;
    collect_states(value, &mut states, &mut last_worker)?;
    states.retain(|state| state.rank == rank);
    let Some(first) = states.first() else {
        return Err(format!(
            "the file holds no shardstream state of rank {rank}"
        ));
    };
    let (epoch, world_size, workers) = (first.epoch, first.world_size, first.num_workers);
    let finished = states.iter().all(|state| state.finished);
    let mut produced = vec![None; workers];
    let mut digests = vec![0; workers];
    let mut held = vec![SavedPacker::default(); if packed { workers } else { 0 }];
    for state in &states {
        if (state.epoch, state.world_size, state.num_workers) != (epoch, world_size, workers) {
            return Err(format!(
                "the states of rank {rank} are of several epochs or layouts"
            ));
        }
        if state.resumed_from.is_some() {
            return Err(
                "the state is of an elastic resume, whose workers do not read the \
                        plan's slots: explain answers for states of a run that started at \
                        its epoch's start (or resumed exactly)"
                    .into(),
            );
        }
        // A packed stream's parts name its token counts, whatever its
        // packer holds.
        let of_packed = state.fingerprint_parts.split(',').any(|part| {
            part.split_once('=')
                .is_some_and(|(name, _)| name == TOKENS_PART)
        }) || state.pack.is_some()
            || state.sequences_left.is_some();
        match (of_packed, packed) {
            (true, false) => {
                return Err(
                    "the state is of a packed stream (pack=Pack(...)), whose steps are \
                     sequences: give --pack SEQ_LEN (and --pack-field, --pack-mode, \
                     --pack-window) as the run had them"
                        .into(),
                )
            }
            (false, true) => {
                return Err("the state is not of a packed stream: leave out --pack".into())
            }
            _ => {}
        }
        // A packed explain replays each worker's shuffle buffer from the
        // epoch's start; the state only says how far it had gone. A
        // finished epoch's buffer is behind it.
        if !packed && !finished && (!state.buffer.is_empty() || state.rng_word_pos != "0") {
            return Err(
                "the state was saved with a shuffle buffer: which sample leaves it \
                        depends on the samples' bytes, not on the plan: explain answers for \
                        shuffle_buffer=0"
                    .into(),
            );
        }
        if state.skipped > 0 && !finished {
            return Err(format!(
                "worker {} skipped {} samples (on_error=\"warn\"): the plan alone does not \
                 say which",
                state.worker_id, state.skipped
            ));
        }
        let worker = state.worker_id;
        let (Some(slot), Some(digest)) = (produced.get_mut(worker), digests.get_mut(worker)) else {
            return Err(format!("worker {worker} is not one of {workers} workers"));
        };
        *slot = Some(state.produced);
        *digest = state.digest_value().map_err(|e| e.to_string())?;
        if packed {
            held[worker] = SavedPacker {
                held: state.pack.clone().unwrap_or_default(),
                sequences_left: state.sequences_left,
            };
        }
    }
    let produced = produced
        .iter()
        .enumerate()
        .map(|(worker, n)| {
            n.ok_or_else(|| format!("the file holds no state of worker {worker} of {workers}"))
        })
        .collect::<Result<Vec<u64>, String>>()?;
    if finished {
        let next = epoch
            .checked_add(1)
            .ok_or("the state finished the last epoch there is")?;
        return Ok(((next, world_size, workers), None));
    }
    let next_worker = last_worker.map_or(0, |w| (w + 1) % workers);
    let position = SavedPosition {
        produced,
        digests,
        next_worker,
        packed: held,
    };
    Ok(((epoch, world_size, workers), Some(position)))
}

/// The shardstream states in `value` (at any depth), and the first
/// `_last_yielded_worker_id` (a `StatefulDataLoader`'s).
fn collect_states(
    value: &serde_json::Value,
    states: &mut Vec<SlotState>,
    last_worker: &mut Option<usize>,
) -> Result<(), String> {
    match value {
        serde_json::Value::Object(map) => {
            if map.get("format").and_then(|f| f.as_str()) == Some(STATE_FORMAT) {
                let state = SlotState::from_json(&value.to_string()).map_err(|e| e.to_string())?;
                // Its layout checked before its numbers size anything.
                state.slot().map_err(|e| e.to_string())?;
                states.push(state);
                return Ok(());
            }
            if let Some(worker) = map.get("_last_yielded_worker_id").and_then(|w| w.as_u64()) {
                last_worker.get_or_insert(worker as usize);
            }
            map.values()
                .try_for_each(|v| collect_states(v, states, last_worker))
        }
        serde_json::Value::Array(items) => items
            .iter()
            .try_for_each(|v| collect_states(v, states, last_worker)),
        _ => Ok(()),
    }
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
    /// A saved worker's samples are not the first ones of its slot in this
    /// plan (another seed, dataset or options, or a state of a layout that
    /// was itself resumed elastically).
    NotThisPlan {
        /// The worker.
        worker: usize,
    },
    /// The samples a worker's shuffle buffer held may have passed its byte
    /// bound (by their upper bounds), which would let one out early: which
    /// one depends on their bytes.
    BufferBytes {
        /// The worker.
        worker: usize,
        /// The sample (of its slot, from 0) whose arrival may have passed it.
        position: u64,
    },
    /// A packed document holds more tokens than a replay lays out
    /// ([`crate::text::pack::MAX_LAID_TOKENS`], by the manifest's counts).
    TooLong,
}

/// The samples step `step` of `rank` sees with batches of `batch_size` (at
/// least 1), under `params`: the plan is made of `shards` as the dataset
/// knows them, and a whole shard that plan deals (no sample count known to
/// it) holds `counts[shard]` samples. Steps count from 0 at the epoch's
/// start, or, from a saved position, at the first step after resuming
/// from it.
pub fn explain_step(
    shards: &[ShardInfo],
    counts: &[Option<u64>],
    params: &PlanParams,
    rank: usize,
    step: u64,
    batch_size: u64,
    start: Start<'_>,
) -> Result<StepSamples, ExplainError> {
    let (saved, buffer) = match start {
        Start::Fresh(buffer) => (None, buffer),
        Start::Saved(saved) => (Some(saved), None),
    };
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
    let workers = runs.len();
    let (offsets, first) = match saved {
        None => (vec![0; workers], 0),
        Some(saved) => {
            for worker in 0..workers {
                let produced = saved.produced.get(worker).copied().unwrap_or(u64::MAX);
                let handed_out = (produced <= counts[worker])
                    .then(|| samples_between_runs(&runs[worker], 0..produced));
                if handed_out.map(|runs| runs_digest(&runs)) != saved.digests.get(worker).copied() {
                    return Err(ExplainError::NotThisPlan { worker });
                }
            }
            (saved.produced.clone(), saved.next_worker % workers.max(1))
        }
    };
    let batches: Vec<u64> = (0..workers)
        .map(|w| (counts[w] - offsets[w]).div_ceil(batch_size))
        .collect();
    let Some((worker, round)) = batch_of_step(&batches, first, step) else {
        return Err(ExplainError::PastTheEnd {
            steps: batches.iter().sum(),
        });
    };
    let from = offsets[worker] + round * batch_size;
    let to = (from + batch_size).min(counts[worker]);
    let (samples, check) = match buffer {
        None => (
            samples_between(&runs[worker], from..to),
            BufferCheck::NoBuffer,
        ),
        Some(buffer) => {
            let slot = rank * params.num_workers + worker;
            let rng = rng_for(params.seed, params.epoch, Purpose::ShuffleBuffer { slot });
            let (mut out, check) = shuffled(&runs[worker], buffer, rng, to)
                .map_err(|position| ExplainError::BufferBytes { worker, position })?;
            (out.split_off(from as usize), check)
        }
    };
    Ok(StepSamples {
        worker,
        worker_batch: from / batch_size,
        samples,
        buffer: check,
    })
}

/// The worker whose batch step `step` is, and its round (its batch among
/// those it has left), the workers having `batches` left each and the
/// turn starting at worker `first`: round `j` hands out the `j`-th
/// remaining batch of every worker that has one, in turn. `None` past the
/// last step.
pub(crate) fn batch_of_step(batches: &[u64], first: usize, step: u64) -> Option<(usize, u64)> {
    let workers = batches.len();
    if step >= batches.iter().sum() {
        return None;
    }
    let turn: Vec<usize> = (0..workers).map(|i| (first + i) % workers).collect();
    let mut left = step;
    let mut round = 0u64;
    loop {
        let active: Vec<usize> = turn
            .iter()
            .copied()
            .filter(|&w| batches[w] > round)
            .collect();
        if left < active.len() as u64 {
            return Some((active[left as usize], round));
        }
        left -= active.len() as u64;
        round += 1;
    }
}

/// A sample held by a replayed shuffle buffer: its shard and index, and
/// its bytes at most when known. The replay bounds the buffer by items
/// only, and checks the bytes apart.
struct Held {
    shard: usize,
    index: u64,
    bytes: Option<u64>,
}

impl ByteSize for Held {
    fn byte_size(&self) -> usize {
        0
    }
}

/// The bytes sample `index` of `shard` holds in a shuffle buffer at most,
/// undecoded, when a manifest gives its byte span: a tar sample's key,
/// field names and data lie within its span (its members' headers name
/// them, and the data follows); a JSON line's values take at most 8 bytes
/// for each 2 of the line (a number and the comma or bracket after it),
/// plus its key when the line names none (its index's digits). `None` for
/// other shards.
pub fn undecoded_bytes_at_most(shard: &Shard, index: u64) -> Option<u64> {
    let span = shard.index.as_ref()?.length(index);
    match shard.kind {
        ShardKind::Tar => Some(span),
        ShardKind::Lines => Some(span.saturating_mul(4).saturating_add(20)),
        ShardKind::Raw | ShardKind::Parquet(_) => None,
    }
}

/// The first `upto` samples a worker's shuffle buffer lets out of its
/// slot's `runs`, as the pipeline's buffer does with `rng` (the slot's),
/// and whether that is known to be exact; `Err(position)`: the held
/// samples' upper bounds pass the byte bound when the sample at
/// `position` arrives.
pub(crate) fn shuffled(
    runs: &[(usize, Range<u64>)],
    replay: &BufferReplay<'_>,
    rng: rand_chacha::ChaCha8Rng,
    upto: u64,
) -> Result<(Vec<(usize, u64)>, BufferCheck), u64> {
    let bounds = ShuffleBounds {
        max_bytes: usize::MAX,
        ..replay.bounds
    };
    let limit = u64::try_from(replay.bounds.max_bytes).unwrap_or(u64::MAX);
    let mut buffer = ShuffleBuffer::new(bounds, rng, 0);
    let mut out: Vec<(usize, u64)> = Vec::new();
    // The held samples' bytes at most, while every one is known.
    let mut held_bytes = Some(0u64);
    let inputs = runs
        .iter()
        .flat_map(|(shard, samples)| samples.clone().map(move |index| (*shard, index)));
    for (position, (shard, index)) in inputs.enumerate() {
        if out.len() as u64 >= upto {
            break;
        }
        let bytes = (replay.sample_bytes)(shard, index);
        let held = Held {
            shard,
            index,
            bytes,
        };
        // The buffer lets samples out while it holds its count; the
        // pipeline's goes on while the bytes held and the new sample's
        // pass the byte bound, which must not happen for the replay to
        // be exact.
        let _ = buffer.push(held, |evicted| {
            let item = evicted.item;
            held_bytes = held_bytes.zip(item.bytes).map(|(h, b)| h - b);
            out.push((item.shard, item.index));
            ControlFlow::Continue(())
        });
        held_bytes = held_bytes.zip(bytes).map(|(h, b)| h.saturating_add(b));
        if held_bytes.is_some_and(|total| total > limit) && buffer.len() > 1 {
            return Err(position as u64);
        }
    }
    while (out.len() as u64) < upto {
        let Some((_, item)) = buffer.pop_random() else {
            break;
        };
        out.push((item.shard, item.index));
    }
    out.truncate(upto as usize);
    let check = if held_bytes.is_some() {
        BufferCheck::WithinBytes
    } else {
        BufferCheck::BytesUnknown
    };
    Ok((out, check))
}

/// The samples at positions `range` of a slot's runs, in order.
fn samples_between(runs: &[(usize, Range<u64>)], range: Range<u64>) -> Vec<(usize, u64)> {
    samples_between_runs(runs, range)
        .into_iter()
        .flat_map(|(shard, samples)| samples.map(move |index| (shard, index)))
        .collect()
}

/// The samples at positions `range` of a slot's runs, as runs.
fn samples_between_runs(
    runs: &[(usize, Range<u64>)],
    range: Range<u64>,
) -> Vec<(usize, Range<u64>)> {
    let mut out = Vec::new();
    let mut at = 0u64;
    for (shard, samples) in runs {
        let len = samples.end - samples.start;
        let (from, to) = (range.start.max(at), range.end.min(at + len));
        if from < to {
            out.push((*shard, samples.start + from - at..samples.start + to - at));
        }
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
        let step = |n| explain_step(&s, &counts, &p, 0, n, 2, Start::Fresh(None)).unwrap();
        assert_eq!(step(0).samples, [(0, 0), (0, 1)]);
        assert_eq!((step(1).worker, step(1).samples), (1, vec![(0, 5), (1, 0)]));
        assert_eq!(step(2).samples, [(0, 2), (0, 3)]);
        assert_eq!(step(4).samples, [(0, 4)]);
        assert_eq!(step(5).samples, [(1, 3)]);
        assert_eq!(
            explain_step(&s, &counts, &p, 0, 6, 2, Start::Fresh(None)),
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
            while let Ok(samples) =
                explain_step(&s, &[None; 4], &p, rank, step, 2, Start::Fresh(None))
            {
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
    fn a_shuffle_buffer_reorders_each_worker_s_samples_as_the_pipeline_s_does() {
        let s = shards(&[40, 25, 35]);
        let p = PlanParams {
            shuffle_shards: true,
            seed: 5,
            ..params(2, 2)
        };
        let bounds = ShuffleBounds {
            max_items: 16,
            max_bytes: 1 << 20,
            initial: 4,
        };
        let unknown = |_: usize, _: u64| None;
        let replay = BufferReplay {
            bounds,
            sample_bytes: &unknown,
        };
        for rank in 0..2 {
            // Each worker's batches, in its order, from the plain plan.
            let plain = |step| explain_step(&s, &[None; 3], &p, rank, step, 3, Start::Fresh(None));
            let mut seen: Vec<Vec<(usize, u64)>> = vec![Vec::new(); 2];
            let mut step = 0;
            while let Ok(found) = explain_step(
                &s,
                &[None; 3],
                &p,
                rank,
                step,
                3,
                Start::Fresh(Some(&replay)),
            ) {
                assert_eq!(found.buffer, BufferCheck::BytesUnknown);
                // The same worker's turn as without a buffer.
                assert_eq!(plain(step).unwrap().worker, found.worker);
                seen[found.worker].extend(found.samples);
                step += 1;
            }
            assert!(plain(step).is_err(), "as many steps as without a buffer");
            for (worker, seen) in seen.iter().enumerate() {
                // The real buffer, fed the worker's samples in plan order.
                let slot = rank * 2 + worker;
                let rng = rng_for(5, 0, Purpose::ShuffleBuffer { slot });
                let mut buffer = ShuffleBuffer::new(bounds, rng, 0);
                let mut expected = Vec::new();
                let units = plan::plan_epoch(&s, &p).slots[slot].clone();
                for (shard, index) in units
                    .iter()
                    .flat_map(|u| u.samples.clone().unwrap().map(move |i| (u.shard, i)))
                {
                    let _ = buffer.push(
                        Held {
                            shard,
                            index,
                            bytes: None,
                        },
                        |e| {
                            expected.push((e.item.shard, e.item.index));
                            ControlFlow::Continue(())
                        },
                    );
                }
                while let Some((_, item)) = buffer.pop_random() {
                    expected.push((item.shard, item.index));
                }
                assert_eq!(seen, &expected);
                let mut in_order = expected.clone();
                in_order.sort_unstable();
                assert_ne!(in_order, expected, "the buffer reorders");
            }
        }
    }

    #[test]
    fn a_buffer_s_byte_bound_is_checked_by_the_samples_known_bytes() {
        let s = shards(&[50]);
        let p = params(1, 1);
        let bounds = ShuffleBounds {
            max_items: 10,
            max_bytes: 1000,
            initial: 10,
        };
        let step = |bytes: u64, step: u64| {
            let known = move |_: usize, _: u64| Some(bytes);
            let replay = BufferReplay {
                bounds,
                sample_bytes: &known,
            };
            explain_step(&s, &[None], &p, 0, step, 5, Start::Fresh(Some(&replay)))
        };
        // 10 held samples of 100 bytes: within the bound, to the last step.
        assert_eq!(step(100, 9).unwrap().buffer, BufferCheck::WithinBytes);
        // 101 bytes each: the 10th sample's arrival may pass it.
        assert_eq!(
            step(101, 0),
            Err(ExplainError::BufferBytes {
                worker: 0,
                position: 9
            })
        );
        // A single sample past the bound is held alone, as the buffer does.
        assert_eq!(
            step(5000, 0).unwrap_err(),
            ExplainError::BufferBytes {
                worker: 0,
                position: 1
            }
        );
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
        let step = |n| explain_step(&s, &counts, &p, 0, n, 2, Start::Fresh(None)).unwrap();
        assert_eq!((step(0).worker, step(0).samples), (0, vec![(0, 0), (0, 1)]));
        assert_eq!((step(1).worker, step(1).samples), (1, vec![(1, 0), (2, 0)]));
        assert_eq!(step(3).samples, [(2, 1)]);
        assert_eq!(
            explain_step(
                &s,
                &[Some(3), None, Some(2)],
                &p,
                0,
                0,
                2,
                Start::Fresh(None)
            ),
            Err(ExplainError::CountsUnknown)
        );
    }

    #[test]
    fn a_saved_position_goes_on_after_each_worker_s_samples_in_turn() {
        // As in the first test: worker 0 reads (0, 0..5), worker 1 (0, 5..6)
        // and (1, 0..4). Saved after steps 0, 1 and 2: worker 0 handed out
        // 4 samples, worker 1 two; worker 1's batch comes next.
        let s = shards(&[6, 4]);
        let p = params(1, 2);
        let counts = [None, None];
        let saved = SavedPosition {
            produced: vec![4, 2],
            digests: vec![
                runs_digest(&[(0, 0..4)]),
                runs_digest(&[(0, 5..6), (1, 0..1)]),
            ],
            next_worker: 1,
            packed: Vec::new(),
        };
        let step = |n| explain_step(&s, &counts, &p, 0, n, 2, Start::Saved(&saved));
        let whole = |n| explain_step(&s, &counts, &p, 0, n, 2, Start::Fresh(None)).unwrap();
        for n in 0..3 {
            assert_eq!(step(n).unwrap(), whole(n + 3), "step {n} after the resume");
        }
        assert_eq!(step(3), Err(ExplainError::PastTheEnd { steps: 3 }));
        // Another plan's samples are named, with the worker.
        let other = SavedPosition {
            digests: vec![runs_digest(&[(0, 1..5)]), saved.digests[1]],
            ..saved.clone()
        };
        let found = explain_step(&s, &counts, &p, 0, 0, 2, Start::Saved(&other));
        assert_eq!(found, Err(ExplainError::NotThisPlan { worker: 0 }));
        let too_many = SavedPosition {
            produced: vec![4, 9],
            ..saved
        };
        let found = explain_step(&s, &counts, &p, 0, 0, 2, Start::Saved(&too_many));
        assert_eq!(found, Err(ExplainError::NotThisPlan { worker: 1 }));
    }

    #[test]
    fn a_json_line_s_decoded_bytes_are_within_its_bound_and_may_pass_its_span() {
        let lines = [
            r#"{"ids":[1,2,3,4,5,6,7,8,9,0,1,2,3,4,5,6,7,8,9]}"#,
            r#"{"a":[[],[1],[1,2]],"b":[true,false,null],"c":1.5e300}"#,
            r#"{"t":"\u00e9\u00e9\n","u":{"v":[0,0]}}"#,
            r#"{}"#,
        ];
        let spans: Vec<u64> = lines.iter().map(|l| l.len() as u64 + 1).collect();
        let offsets = spans
            .iter()
            .scan(0, |at, &n| {
                *at += n;
                Some(*at - n)
            })
            .collect();
        let index = crate::shard::SampleIndex::from_parts(offsets, spans.clone(), None).unwrap();
        let shard = Shard {
            kind: ShardKind::Lines,
            index: Some(std::sync::Arc::new(index)),
            ..Shard::new("d.jsonl", Some(lines.len() as u64))
        };
        let mut past_span = false;
        for (i, line) in lines.iter().enumerate() {
            // A sample of the line as the format makes it: its fields, and
            // a key of its index's digits (the longest an index has).
            let fields = crate::json::decode(line.as_bytes()).unwrap();
            let bytes = (fields.byte_size() + u64::MAX.to_string().len()) as u64;
            let bound = undecoded_bytes_at_most(&shard, i as u64).unwrap();
            assert!(bytes <= bound, "line {i}: {bytes} > {bound}");
            past_span |= bytes > spans[i];
        }
        assert!(
            past_span,
            "a line of small ints decodes to more than its span"
        );
        let tar = Shard {
            kind: ShardKind::Tar,
            ..shard.clone()
        };
        assert_eq!(undecoded_bytes_at_most(&tar, 0), Some(spans[0]));
        let raw = Shard {
            kind: ShardKind::Raw,
            ..shard
        };
        assert_eq!(undecoded_bytes_at_most(&raw, 0), None);
    }
}
