//! The verifier of a `Mix`'s ledger: each record's ids name a pass over a
//! stream's sample ([`super::file::MixMeta`]), and each epoch the records
//! cover is checked against the mixture's plan. No sample of a pass comes
//! twice (beyond what a stream's `remainder="pad"` repeats), no id lies
//! outside the streams, every rank of a generation took as many steps, and
//! a complete epoch took exactly the samples the plan gives each slot: for
//! each stream and pass, the first samples of the slot's part of that
//! stream's epoch, as many as the slot's mixture takes ([`SlotPlan`]). An
//! epoch resumed onto another layout is checked for the first three only:
//! an elastic resume splits the mixture's rest anew. A mixture of packed
//! streams takes sequences: where each slot's order of documents is
//! replayed (`Packing::known_order`), the documents the sequences it
//! takes of each pass end must be exactly those recorded
//! (`replay_packed`); otherwise the first three only.

use std::collections::{HashMap, HashSet};

use super::file::Generation;
use super::verify::{
    check_epochs, error_skips, left_out_on_error, params, place, Dataset, Entry, EpochReport,
    Report, SampleName, StepTally, Violation,
};
use super::verify_pack::{Packing, PlanOptions, Unaccounted, Unreplayed as PackOrder};
use crate::plan::mix::{pass_epoch, Policy, SlotMixture, SlotPlan, MAX_PASSES};
use crate::plan::{self, cut, Remainder, ShardInfo, WorkUnit};
use crate::shard::Shard;

/// The mixture a ledger is checked against.
#[derive(Debug, Clone)]
pub struct MixDataset {
    /// Each stream, as a dataset.
    pub streams: Vec<Dataset>,
    /// What the mixture does when a stream runs out.
    pub policy: Policy,
    /// The streams' weights, where a generation's meta gives none.
    pub weights: Vec<f64>,
    /// The mixture's seed.
    pub seed: u64,
}

/// A mixture's sample: the pass, the stream, the shard (in the stream's
/// list) and the index in the shard.
type MixSample = (u64, usize, usize, u64);

impl MixDataset {
    /// The weights `epoch` mixed by, as `generation` (the one holding the
    /// epoch's first record that counts) recorded them: the epoch's own
    /// (`weights_by_epoch`), else the generation's.
    fn weights_for<'a>(&'a self, generation: &'a Generation, epoch: u64) -> &'a [f64] {
        match &generation.meta.dataset.mix {
            Some(meta) => meta.weights_by_epoch.get(&epoch).unwrap_or(&meta.weights),
            None => &self.weights,
        }
    }

    /// Where each stream's shards start in the mixture's numbering, and
    /// after the last one: the shards of every stream.
    fn offsets(&self) -> Vec<u64> {
        let mut offsets = vec![0u64];
        for stream in &self.streams {
            offsets.push(offsets[offsets.len() - 1] + stream.counts.len() as u64);
        }
        offsets
    }

    /// The pass, stream and shard that an id's shard names, if any.
    fn shard_of(&self, offsets: &[u64], id_shard: u64) -> Option<(u64, usize, usize)> {
        let total = *offsets.last()?;
        if total == 0 {
            return None;
        }
        let (pass, rest) = (id_shard / total, id_shard % total);
        let stream = offsets.partition_point(|&o| o <= rest) - 1;
        let shard = usize::try_from(rest - offsets[stream]).ok()?;
        (pass < MAX_PASSES).then_some((pass, stream, shard))
    }

    /// The sample an id names, when it is one of the streams'.
    fn sample(&self, offsets: &[u64], (id_shard, index): (u64, u64)) -> Option<MixSample> {
        let (pass, stream, shard) = self.shard_of(offsets, id_shard)?;
        (index < self.streams[stream].counts[shard]).then_some((pass, stream, shard, index))
    }

    /// The id (`(shard, index)` in the mixture's numbering) of a sample.
    fn id_of(offsets: &[u64], (pass, stream, shard, index): MixSample) -> (u64, u64) {
        let total = offsets.last().copied().unwrap_or(0);
        (pass * total + offsets[stream] + shard as u64, index)
    }

    /// The name of an id, in errors.
    fn name(&self, offsets: &[u64], (id_shard, index): (u64, u64)) -> SampleName {
        match self.shard_of(offsets, id_shard) {
            Some((pass, stream, shard)) => SampleName {
                shard: shard as u64,
                url: self.streams[stream].urls.get(shard).cloned(),
                index,
                stream: Some((stream, pass)),
            },
            None => SampleName {
                shard: id_shard,
                url: None,
                index,
                stream: None,
            },
        }
    }
}

/// Checks `generations` (a `Mix`'s ledger, in generation order) against `mix`.
pub fn verify_mix(generations: &[Generation], mix: &MixDataset) -> Report {
    let offsets = mix.offsets();
    check_epochs(generations, |epoch, entries, later| {
        check_mix_epoch(generations, mix, &offsets, epoch, entries, later)
    })
}

fn check_mix_epoch(
    generations: &[Generation],
    mix: &MixDataset,
    offsets: &[u64],
    epoch: u64,
    entries: &[Entry<'_>],
    later_epoch: bool,
) -> EpochReport {
    let mut order: Vec<usize> = Vec::new();
    for entry in entries {
        if !order.contains(&entry.generation) {
            order.push(entry.generation);
        }
    }
    let layout = |g: usize| {
        (
            generations[g].meta.world_size,
            generations[g].meta.num_workers,
        )
    };
    let first_layout = layout(order[0]);
    let same_layout = order.iter().all(|&g| layout(g) == first_layout);
    let mut report = EpochReport {
        epoch,
        complete: false,
        expected: 0,
        trained: 0,
        skipped: 0,
        distinct: 0,
        padded: 0,
        dropped: 0,
        left_out_on_error: 0,
        left_out_no_tokens: 0,
        steps: 0,
        generations: order
            .iter()
            .map(|&g| generations[g].meta.generation)
            .collect(),
        world_sizes: order.iter().map(|&g| layout(g).0).collect(),
        coverage_checked: same_layout,
        packed_left_out: 0,
        packed_remainder_checked: false,
        packed_remainder_exact: false,
        packed_order_unreplayed: None,
        sequences_mixed: false,
        violation: None,
    };
    // Repeats a stream's padding may make in one pass, by the first layout
    // (a packed stream's slots are cut by tokens, never padded).
    let pad_allowance = |stream: usize| -> u64 {
        let dataset = &mix.streams[stream];
        let total: u64 = dataset.counts.iter().sum();
        match dataset.remainder {
            Remainder::Pad if !dataset.packed => {
                let per_rank = cut::samples_per_rank(total, first_layout.0, Remainder::Pad);
                per_rank * first_layout.0 as u64 - total
            }
            Remainder::Pad | Remainder::Drop => 0,
        }
    };
    let mut pads: HashMap<(u64, usize), u64> = HashMap::new();
    // Each sample taken: how often, and the entry that took it first.
    let mut seen: HashMap<MixSample, (u64, usize)> = HashMap::new();
    let mut tally = StepTally::default();
    for (at, entry) in entries.iter().enumerate() {
        if !tally.count(entry, &mut report) {
            continue;
        }
        let record = entry.record;
        for &id in &record.ids {
            let Some(sample) = mix.sample(offsets, id) else {
                report.violation.get_or_insert(Violation::NotInDataset {
                    epoch,
                    sample: mix.name(offsets, id),
                    place: place(generations, entry),
                });
                continue;
            };
            let (count, first) = seen.entry(sample).or_insert((0, at));
            *count += 1;
            if *count == 1 {
                report.distinct += 1;
                continue;
            }
            let (pass, stream, _, _) = sample;
            let left = pads
                .entry((pass, stream))
                .or_insert_with(|| pad_allowance(stream));
            if *left > 0 {
                *left -= 1;
                report.padded += 1;
            } else if report.violation.is_none() {
                report.violation = Some(Violation::Twice {
                    epoch,
                    sample: mix.name(offsets, id),
                    first: place(generations, &entries[*first]),
                    again: place(generations, entry),
                });
            }
        }
    }
    if !tally.finish(generations, entries, &order, later_epoch, &mut report) {
        return report;
    }
    if mix.streams.iter().any(|s| s.packed) {
        // The mixture takes a number of each stream's sequences: which
        // documents they hold depends on the packing, replayed where each
        // slot's order is known (one layout, its workers known, no skip),
        // else only no document twice is checked. The records that count
        // are replayed as an uninterrupted run's: a resume within the
        // epoch may have planned its rest anew (an elastic one does, even
        // onto the same layout), and records that are not the
        // uninterrupted run's then leave the epoch at most once.
        report.sequences_mixed = true;
        report.coverage_checked = false;
        let replayable = same_layout
            && order.iter().all(|&g| generations[g].meta.num_workers_known)
            && !error_skips(generations).any(|skip| skip.epoch == epoch);
        if !replayable {
            return report;
        }
        // Resumed within the epoch, or at its first step (a state saved
        // before it may have been elastic).
        let resumed = order.len() > 1
            || entries.first().is_some_and(|e| {
                order[0] > 0 && e.record.step == generations[order[0]].meta.start_step
            });
        let weights = mix.weights_for(&generations[order[0]], epoch);
        let taken = |sample: &MixSample| seen.contains_key(sample);
        let replayed = match replay_packed(mix, weights, epoch, first_layout, taken) {
            Some(Err(Unreplayed::Missing(..))) if resumed => {
                Some(Err(Unreplayed::Order(PackOrder::ResumedAnew)))
            }
            Some(Err(Unreplayed::Order(PackOrder::NotTheRunsOrder))) if resumed => {
                Some(Err(Unreplayed::Order(PackOrder::ResumedAnew)))
            }
            replayed => replayed,
        };
        match replayed {
            None => {}
            Some(Err(Unreplayed::Missing(stream, pass, left))) => {
                let (shard, index) = left.first;
                let id = MixDataset::id_of(offsets, (pass, stream, shard, index));
                let workers = first_layout.1.max(1);
                report.violation = Some(Violation::Missing {
                    epoch,
                    sample: mix.name(offsets, id),
                    count: left.count,
                    generation: generations[order[0]].meta.generation,
                    rank: left.slot / workers,
                    worker: left.slot % workers,
                });
            }
            Some(Err(Unreplayed::Order(why))) => {
                report.packed_order_unreplayed = Some(why.to_string());
            }
            Some(Ok(replayed)) => {
                // A document taken that no planned sequence ended.
                let extra = seen
                    .iter()
                    .filter(|(sample, _)| !replayed.ended.contains(sample))
                    .min_by_key(|(_, (_, at))| *at);
                if let Some((&sample, &(_, at))) = extra {
                    if resumed {
                        report.packed_order_unreplayed = Some(PackOrder::ResumedAnew.to_string());
                        return report;
                    }
                    report.violation = Some(Violation::NotPlanned {
                        epoch,
                        sample: mix.name(offsets, MixDataset::id_of(offsets, sample)),
                        place: place(generations, &entries[at]),
                    });
                    return report;
                }
                report.sequences_mixed = false;
                report.expected = replayed.ended.len() as u64;
                report.packed_left_out = replayed.left_out;
                report.packed_remainder_checked = true;
                report.packed_remainder_exact = true;
                report.coverage_checked = true;
            }
        }
        return report;
    }
    if !same_layout {
        return report;
    }
    let weights = mix.weights_for(&generations[order[0]], epoch);
    let Some(planned) = planned_samples(mix, weights, epoch, first_layout) else {
        // The mixture cannot be planned (it could not have run): left unchecked.
        report.coverage_checked = false;
        return report;
    };
    report.expected = planned.passes.values().map(|p| p.take).sum();
    let workers = first_layout.1;
    let id_of = |sample: MixSample| MixDataset::id_of(offsets, sample);
    let is_cut = |(pass, stream, _, _): MixSample| {
        planned.passes.get(&(pass, stream)).is_some_and(|p| p.cut)
    };
    // A sample taken that the plan does not take (or takes fewer times).
    let extra = entries
        .iter()
        .enumerate()
        .flat_map(|(at, e)| e.record.ids.iter().map(move |&id| (at, id)))
        .find(|&(_, id)| {
            mix.sample(offsets, id).is_some_and(|sample| {
                let planned = planned.samples.get(&sample).map_or(0, |(n, _)| *n);
                let taken = seen.get(&sample).map_or(0, |(n, _)| *n);
                planned == 0 || (taken > planned && !is_cut(sample))
            })
        });
    if let Some((at, id)) = extra {
        report.violation = Some(Violation::NotPlanned {
            epoch,
            sample: mix.name(offsets, id),
            place: place(generations, &entries[at]),
        });
        return report;
    }
    // A pass the plan cuts: as many samples as it takes.
    let mut cut: Vec<(&(u64, usize), &PassTake)> =
        planned.passes.iter().filter(|(_, p)| p.cut).collect();
    cut.sort_unstable_by_key(|(key, _)| **key);
    for (&(pass, stream), pass_take) in cut {
        let taken: u64 = seen
            .iter()
            .filter(|((p, s, _, _), _)| (*p, *s) == (pass, stream))
            .map(|(_, (n, _))| n)
            .sum();
        // A stream that skipped a bad shard under on_error="warn" passes
        // over its remaining places in the order: fewer are taken.
        let skipped_in_pass = || {
            error_skips(generations).any(|skip| {
                skip.epoch == epoch
                    && mix
                        .shard_of(offsets, skip.shard)
                        .is_some_and(|(p, s, _)| (p, s) == (pass, stream))
            })
        };
        if taken < pass_take.take && skipped_in_pass() {
            report.left_out_on_error += pass_take.take - taken;
            continue;
        }
        if taken != pass_take.take {
            report.violation = Some(Violation::PassCount {
                epoch,
                stream,
                pass,
                taken,
                planned: pass_take.take,
            });
            return report;
        }
    }
    let mut missing: Vec<(usize, MixSample)> = Vec::new();
    for (&sample, &(n, slot)) in &planned.samples {
        let taken = seen.get(&sample).map_or(0, |(taken, _)| *taken);
        if is_cut(sample) || taken >= n {
            continue;
        }
        if left_out_on_error(generations, epoch, id_of(sample)) {
            report.left_out_on_error += n - taken;
        } else {
            missing.push((slot, sample));
        }
    }
    missing.sort_unstable();
    if let Some(&(slot, sample)) = missing.first() {
        report.violation = Some(Violation::Missing {
            epoch,
            sample: mix.name(offsets, id_of(sample)),
            count: missing.len() as u64,
            generation: generations[order[0]].meta.generation,
            rank: slot / workers.max(1),
            worker: slot % workers.max(1),
        });
    }
    report
}

/// What the replay of a packed mixture's epoch found: every slot's order
/// of each pass over each stream replayed, and what its taken sequences
/// end.
struct PackedReplay {
    /// The documents the sequences the mixture takes end: exactly those
    /// it hands out.
    ended: HashSet<MixSample>,
    /// The documents of those passes' parts that they leave out: past the
    /// sequences the mixture takes of each slot's part.
    left_out: u64,
}

/// Why a packed mixture's epoch is not proved exactly once by its replay.
enum Unreplayed {
    /// Documents stream `.0`'s pass `.1` must have handed out (its taken
    /// sequences end them, the order replayed) that no record names.
    Missing(usize, u64, Unaccounted),
    /// A slot's order is not known (the first reason met, a disagreement
    /// with the records first).
    Order(PackOrder),
}

/// Replays `epoch` of the packed mixture `mix` mixed by `weights` on
/// `layout`: each slot takes as many sequences of each pass over each
/// stream as its mixture plans from the streams' planned sequences, and
/// those sequences, laid out from the slot's order of documents (its
/// shuffle buffer replayed), end exactly the documents the records name
/// (`taken`). `None` when a stream's packing or plan is not known.
fn replay_packed(
    mix: &MixDataset,
    weights: &[f64],
    epoch: u64,
    layout: (usize, usize),
    taken: impl Fn(&MixSample) -> bool,
) -> Option<Result<PackedReplay, Unreplayed>> {
    let packings = mix
        .streams
        .iter()
        .map(|d| d.packing.as_ref())
        .collect::<Option<Vec<&Packing>>>()?;
    let mut plans = PackedPasses {
        mix,
        packings: &packings,
        epoch,
        layout,
        passes: HashMap::new(),
    };
    let mut replay = PackedReplay {
        ended: HashSet::new(),
        left_out: 0,
    };
    let mut unknown: Option<PackOrder> = None;
    for slot in 0..layout.0 * layout.1 {
        let takes = slot_takes(mix, weights, epoch, slot, |stream, pass| {
            plans.pass(stream, pass)?.sequences.get(slot).copied()
        })?;
        for (stream, pass, take) in takes {
            let dataset = &mix.streams[stream];
            let stream_epoch = pass_epoch(epoch, pass).ok()?;
            let units = plans.pass(stream, pass)?.units.get(slot)?;
            let packing = packings[stream];
            let handed = |shard: usize, index: u64| taken(&(pass, stream, shard, index));
            let order = match packing.known_order(dataset.seed, stream_epoch, slot, units) {
                Ok(order) => order,
                Err(why) => {
                    unknown.get_or_insert(why);
                    continue;
                }
            };
            match packing.replayed(slot, &order, take, &handed) {
                Err(missing) => return Some(Err(Unreplayed::Missing(stream, pass, missing))),
                Ok(Err(why)) => {
                    // A disagreement with the records is said first.
                    if unknown.is_none() || why == PackOrder::NotTheRunsOrder {
                        unknown = Some(why);
                    }
                }
                Ok(Ok(not_handed)) => {
                    replay.left_out += not_handed;
                    for &(shard, index) in &order {
                        if handed(shard, index) {
                            replay.ended.insert((pass, stream, shard, index));
                        }
                    }
                }
            }
        }
    }
    Some(match unknown {
        Some(why) => Err(Unreplayed::Order(why)),
        None => Ok(replay),
    })
}

/// What slot `slot`'s mixture of `epoch` (mixed by `weights`) takes of
/// each pass over each stream, as `(stream, pass, taken)` in stream then
/// pass order, from `length(stream, pass)`: the slot's part of that pass
/// (samples, or a packed stream's sequences). Under "stop" the slot takes
/// fewer than its first pass holds; under "restart" its last pass is cut.
/// `None` when a length is not known or the mixture cannot be planned.
fn slot_takes(
    mix: &MixDataset,
    weights: &[f64],
    epoch: u64,
    slot: usize,
    mut length: impl FnMut(usize, u64) -> Option<u64>,
) -> Option<Vec<(usize, u64, u64)>> {
    let streams = mix.streams.len();
    let mixture = SlotMixture {
        policy: mix.policy,
        weights,
        key: (mix.seed, epoch),
        slot: u32::try_from(slot).ok()?,
        generation: 0,
    };
    let first = (0..streams)
        .map(|stream| length(stream, 0))
        .collect::<Option<Vec<u64>>>()?;
    let mut failed = false;
    let plan = SlotPlan::new(mixture, vec![0; streams], &first, |stream, pass| {
        let part = length(stream, pass);
        failed |= part.is_none();
        Ok(part.unwrap_or(0))
    })
    .ok()?;
    if failed {
        return None;
    }
    let mut takes = Vec::new();
    for (stream, passes) in plan.passes.iter().enumerate() {
        let mut left = *plan.counts.get(stream)?;
        for (pass, &read) in passes.iter().enumerate() {
            let take = read.min(left);
            left -= take;
            takes.push((stream, pass as u64, take));
        }
    }
    Some(takes)
}

/// A pass over a packed stream, planned: each slot's units, and the
/// sequences it hands out (planned on one rank too, as a mixture's packed
/// stream plans them).
struct PackedPass {
    units: Vec<Vec<WorkUnit>>,
    sequences: Vec<u64>,
}

/// The passes over a packed mixture's streams, each planned once.
struct PackedPasses<'a> {
    mix: &'a MixDataset,
    packings: &'a [&'a Packing],
    epoch: u64,
    layout: (usize, usize),
    passes: HashMap<(usize, u64), PackedPass>,
}

impl PackedPasses<'_> {
    /// Pass `pass` over stream `stream`; `None` past the last epoch.
    fn pass(&mut self, stream: usize, pass: u64) -> Option<&PackedPass> {
        if !self.passes.contains_key(&(stream, pass)) {
            let dataset = &self.mix.streams[stream];
            let options = PlanOptions {
                seed: dataset.seed,
                shuffle_shards: dataset.shuffle_shards,
                remainder: dataset.remainder,
            };
            let packing = self.packings[stream];
            let infos = packing.shards.iter().map(Shard::info).collect();
            let stream_epoch = pass_epoch(self.epoch, pass).ok()?;
            let (units, slots) = packing.plan_slots(infos, options, stream_epoch, self.layout);
            let sequences = slots
                .iter()
                .map(|s| s.handed_out.unwrap_or(s.at_least))
                .collect();
            self.passes
                .insert((stream, pass), PackedPass { units, sequences });
        }
        self.passes.get(&(stream, pass))
    }
}

/// Each stream's plan of each pass over it, made once for every slot.
struct StreamPlans<'a> {
    mix: &'a MixDataset,
    infos: Vec<Vec<ShardInfo>>,
    epoch: u64,
    layout: (usize, usize),
    plans: HashMap<(usize, u64), Vec<Vec<WorkUnit>>>,
}

impl StreamPlans<'_> {
    /// The units of `slot` in pass `pass` over stream `stream`.
    fn slot(&mut self, stream: usize, pass: u64, slot: usize) -> Option<&[WorkUnit]> {
        if !self.plans.contains_key(&(stream, pass)) {
            let stream_epoch = pass_epoch(self.epoch, pass).ok()?;
            let dataset = &self.mix.streams[stream];
            let params = params(dataset, stream_epoch, self.layout.0, self.layout.1);
            let slots = plan::plan_epoch(&self.infos[stream], &params).slots;
            self.plans.insert((stream, pass), slots);
        }
        self.plans
            .get(&(stream, pass))?
            .get(slot)
            .map(Vec::as_slice)
    }

    /// The samples of `slot` in pass `pass` over stream `stream`.
    fn length(&mut self, stream: usize, pass: u64, slot: usize) -> Option<u64> {
        let units = self.slot(stream, pass, slot)?;
        Some(
            units
                .iter()
                .map(|u| u.samples.as_ref().map_or(0, |r| r.end - r.start))
                .sum(),
        )
    }
}

/// What the mixture's plan takes of one pass over one stream.
#[derive(Debug, Clone, Copy, Default)]
struct PassTake {
    /// Samples taken, over every slot.
    take: u64,
    /// Whether some slot takes fewer than its part of the pass holds
    /// ("stop", or the last pass under "restart"): which ones it takes
    /// then depends on the stream's shuffle buffer, whose order the bytes
    /// of the samples can change, so only their number is checked.
    cut: bool,
}

/// What the mixture's plan takes in an epoch.
struct Planned {
    /// Each sample of the passes read: how many times, and the first slot
    /// that reads it (of a cut pass: every sample of the slots' parts).
    samples: HashMap<MixSample, (u64, usize)>,
    /// Each pass over each stream, by `(pass, stream)`.
    passes: HashMap<(u64, usize), PassTake>,
}

/// What the mixture's plan takes in `epoch` with `(world_size,
/// num_workers)`. `None` when the mixture cannot be planned.
fn planned_samples(
    mix: &MixDataset,
    weights: &[f64],
    epoch: u64,
    layout: (usize, usize),
) -> Option<Planned> {
    let infos = mix
        .streams
        .iter()
        .map(|d| {
            d.counts
                .iter()
                .map(|&n| ShardInfo {
                    size: None,
                    samples: Some(n),
                })
                .collect()
        })
        .collect();
    let mut plans = StreamPlans {
        mix,
        infos,
        epoch,
        layout,
        plans: HashMap::new(),
    };
    let mut planned = Planned {
        samples: HashMap::new(),
        passes: HashMap::new(),
    };
    for slot in 0..layout.0 * layout.1 {
        let takes = slot_takes(mix, weights, epoch, slot, |stream, pass| {
            plans.length(stream, pass, slot)
        })?;
        for (stream, pass, take) in takes {
            // The slot's part of the pass (restart's last pass is
            // read in part).
            let part = plans.length(stream, pass, slot)?;
            let totals = planned.passes.entry((pass, stream)).or_default();
            totals.take += take;
            totals.cut |= take < part;
            let samples = plans.slot(stream, pass, slot)?.iter().flat_map(|u| {
                let range = u.samples.clone().unwrap_or(0..0);
                range.map(move |index| (u.shard, index))
            });
            for (shard, index) in samples {
                let entry = planned
                    .samples
                    .entry((pass, stream, shard, index))
                    .or_insert((0, slot));
                entry.0 += 1;
            }
        }
    }
    Some(planned)
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::super::file::{
        DatasetMeta, Meta, MixMeta, RankLog, Record, RecordKind, LEDGER_FORMAT, LEDGER_VERSION,
    };
    use super::*;

    /// Two streams: shards of 4 and 3 samples; one shard of 5.
    fn mix(policy: Policy) -> MixDataset {
        let stream = |urls: &[&str], counts: Vec<u64>, seed| Dataset {
            urls: urls.iter().map(|u| u.to_string()).collect(),
            counts,
            seed,
            shuffle_shards: true,
            remainder: Remainder::Drop,
            packed: false,
            packing: None,
        };
        MixDataset {
            streams: vec![
                stream(&["a0.tar", "a1.tar"], vec![4, 3], 1),
                stream(&["b0.tar"], vec![5], 2),
            ],
            policy,
            weights: vec![0.5, 0.5],
            seed: 7,
        }
    }

    fn generation(number: u64, start_step: u64, ranks: Vec<Vec<Record>>) -> Generation {
        Generation {
            dir: PathBuf::from(format!("gen-{number:06}")),
            meta: Meta {
                format: LEDGER_FORMAT.into(),
                version: LEDGER_VERSION,
                generation: number,
                start_step,
                world_size: ranks.len(),
                num_workers: 1,
                num_workers_known: false,
                dataset: DatasetMeta {
                    spec: Vec::new(),
                    options: Default::default(),
                    shards: None,
                    samples: None,
                    fingerprint: None,
                    mix: None,
                },
            },
            ranks: ranks
                .into_iter()
                .map(|records| RankLog {
                    records,
                    ..RankLog::default()
                })
                .collect(),
        }
    }

    /// The ids one rank (of `world_size`, one worker) takes in `epoch`, in
    /// the plan's order within each stream and pass, as records of
    /// `batch` samples (streams taken one after the other: verify does not
    /// check the order within a slot).
    fn planned_ids(m: &MixDataset, epoch: u64, world_size: usize, rank: usize) -> Vec<(u64, u64)> {
        let planned = planned_samples(m, &m.weights, epoch, (world_size, 1)).unwrap();
        let offsets = m.offsets();
        let id = |(pass, stream, shard, index): MixSample| {
            (pass * offsets[2] + offsets[stream] + shard as u64, index)
        };
        let mut samples: Vec<(&MixSample, &(u64, usize))> = planned.samples.iter().collect();
        samples.sort_unstable();
        let mut ids = Vec::new();
        // Of a cut pass, as many as it takes (verify checks their number):
        // the rank's share of them, by the plan's first slot of each.
        let mut left: HashMap<(u64, usize), u64> = planned
            .passes
            .iter()
            .map(|(key, p)| (*key, p.take / world_size as u64))
            .collect();
        for (&sample, &(n, slot)) in samples {
            let (pass, stream, _, _) = sample;
            if slot != rank {
                continue;
            }
            if planned.passes[&(pass, stream)].cut {
                let left = left.get_mut(&(pass, stream)).unwrap();
                if *left == 0 {
                    continue;
                }
                *left -= 1;
            }
            ids.extend(std::iter::repeat_n(id(sample), n as usize));
        }
        ids
    }

    /// Steps of `batch` samples from `first_step`, then the epoch's end.
    fn records(epoch: u64, ids: &[(u64, u64)], batch: usize, first_step: u64) -> Vec<Record> {
        let mut out = steps(epoch, ids, batch, first_step);
        let last = out.last().map_or(first_step, |r| r.step);
        out.push(Record {
            step: last,
            epoch,
            kind: RecordKind::EpochEnd,
            ids: Vec::new(),
        });
        out
    }

    /// Steps of `batch` samples from `first_step`.
    fn steps(epoch: u64, ids: &[(u64, u64)], batch: usize, first_step: u64) -> Vec<Record> {
        ids.chunks(batch)
            .enumerate()
            .map(|(i, chunk)| Record {
                step: first_step + i as u64,
                epoch,
                kind: RecordKind::Trained,
                ids: chunk.to_vec(),
            })
            .collect()
    }

    #[test]
    fn each_epoch_is_replayed_with_the_weights_it_mixed_by() {
        // Epoch 1 mixed by other weights (set_weights between epochs).
        let mut changed = mix(Policy::Stop);
        changed.weights = vec![0.1, 0.9];
        let ids = [
            planned_ids(&mix(Policy::Stop), 0, 1, 0),
            planned_ids(&changed, 1, 1, 0),
        ];
        let mut ranks = records(0, &ids[0], 2, 0);
        ranks.extend(records(1, &ids[1], 2, 100));
        let m = mix(Policy::Stop);
        let with = |g: Generation, weights: Vec<f64>, by_epoch: &[(u64, Vec<f64>)]| {
            let mut g = g;
            g.meta.dataset.mix = Some(MixMeta {
                streams: Vec::new(),
                weights,
                policy: "stop".into(),
                seed: 7,
                weights_by_epoch: by_epoch.iter().cloned().collect(),
            });
            g
        };
        let unrecorded = [with(
            generation(0, 0, vec![ranks.clone()]),
            vec![0.5, 0.5],
            &[],
        )];
        assert!(
            !verify_mix(&unrecorded, &m).ok,
            "replayed with the first weights"
        );
        let recorded = [with(
            generation(0, 0, vec![ranks.clone()]),
            vec![0.5, 0.5],
            &[(0, vec![0.5, 0.5]), (1, vec![0.1, 0.9])],
        )];
        let report = verify_mix(&recorded, &m);
        assert!(report.ok, "{:?}", report.violation);
        assert!(report
            .epochs
            .iter()
            .all(|e| e.coverage_checked && e.complete));
        // A generation whose epoch-1 records a later one supersedes (from
        // step 100) wrote other weights for it: the later one's count.
        let mut cut_short = records(0, &ids[0], 2, 0);
        cut_short.extend(steps(1, &ids[1][..4], 2, 100));
        let first = with(
            generation(0, 0, vec![cut_short]),
            vec![0.5, 0.5],
            &[(0, vec![0.5, 0.5]), (1, vec![0.9, 0.1])],
        );
        let later = with(
            generation(1, 100, vec![records(1, &ids[1], 2, 100)]),
            vec![0.1, 0.9],
            &[(1, vec![0.1, 0.9])],
        );
        let report = verify_mix(&[first, later], &m);
        assert!(report.ok, "{:?}", report.violation);
    }

    #[test]
    fn each_policy_s_planned_samples_verify_and_a_missing_or_extra_one_is_named() {
        for policy in [Policy::Stop, Policy::Restart, Policy::Continue] {
            let m = mix(policy);
            // Two ranks with equal sample counts: equal steps of 2.
            let ids: Vec<Vec<(u64, u64)>> = (0..2).map(|r| planned_ids(&m, 3, 2, r)).collect();
            assert_eq!(ids[0].len(), ids[1].len(), "{policy:?}");
            let ranks = ids.iter().map(|ids| records(3, ids, 2, 0)).collect();
            let report = verify_mix(&[generation(0, 0, ranks)], &m);
            assert!(report.ok, "{policy:?}: {:?}", report.violation);
            assert!(report.epochs[0].coverage_checked && report.epochs[0].complete);
            assert_eq!(
                report.epochs[0].distinct,
                (ids[0].len() * 2) as u64,
                "{policy:?}"
            );
            // The last sample of rank 1 left out: named as missing.
            let short: Vec<Vec<Record>> = vec![
                records(3, &ids[0][1..], 2, 0),
                records(3, &ids[1][..ids[1].len() - 1], 2, 0),
            ];
            let report = verify_mix(&[generation(0, 0, short)], &m);
            assert!(
                matches!(
                    report.violation,
                    Some(Violation::Missing { count: 2, .. } | Violation::PassCount { .. })
                ),
                "{policy:?}: {:?}",
                report.violation
            );
        }
        // Under restart a stream's second pass is read: its ids say so.
        let m = mix(Policy::Restart);
        let ids = planned_ids(&m, 0, 1, 0);
        let offsets = m.offsets();
        assert!(ids.iter().any(|(shard, _)| *shard >= offsets[2]), "{ids:?}");
        // Stop reads the longer stream in part: one more of its samples is
        // one more than its plan takes of that pass.
        let m = mix(Policy::Stop);
        let ids = planned_ids(&m, 0, 1, 0);
        let unread = (0..4)
            .map(|index| (0u64, index))
            .chain((0..3).map(|index| (1, index)))
            .find(|id| !ids.contains(id))
            .unwrap_or_else(|| panic!("stop leaves a sample unread: {ids:?}"));
        let more = [ids.clone(), vec![unread]].concat();
        let report = verify_mix(&[generation(0, 0, vec![records(0, &more, 4, 0)])], &m);
        assert_eq!(
            report.violation,
            Some(Violation::PassCount {
                epoch: 0,
                stream: 0,
                pass: 0,
                taken: 6,
                planned: 5
            })
        );
        // A second pass, which stop never reads: named, with its stream and pass.
        let second = (offsets[2] + 2, 0);
        let more = [ids, vec![second]].concat();
        let report = verify_mix(&[generation(0, 0, vec![records(0, &more, 4, 0)])], &m);
        let Some(Violation::NotPlanned { sample, .. }) = &report.violation else {
            panic!("{:?}", report.violation);
        };
        assert_eq!(sample.stream, Some((1, 1)), "{sample}");
        assert!(
            sample.to_string().contains("(stream 1, pass 1)"),
            "{sample}"
        );
    }

    #[test]
    fn a_sample_taken_twice_across_a_resume_is_named_and_an_elastic_epoch_is_at_most_once() {
        let m = mix(Policy::Continue);
        let ids = planned_ids(&m, 0, 1, 0);
        // Generation 1 resumed at step 2 but took the step-1 samples again.
        let first = steps(0, &ids[..4], 2, 0);
        let again = records(0, &ids[2..], 2, 2);
        let report = verify_mix(
            &[generation(0, 0, vec![first]), generation(1, 2, vec![again])],
            &m,
        );
        assert!(
            matches!(report.violation, Some(Violation::Twice { .. })),
            "{:?}",
            report.violation
        );
        // The same ids taken once each by 1 rank then 2 ranks: no repeat,
        // and the coverage left unchecked (the rest was split anew).
        let (head, tail) = ids.split_at(4);
        let half = tail.len() / 2;
        let report = verify_mix(
            &[
                generation(0, 0, vec![steps(0, head, 2, 0)]),
                generation(
                    1,
                    2,
                    vec![
                        records(0, &tail[..half], half.max(1), 2),
                        records(0, &tail[half..half * 2], half.max(1), 2),
                    ],
                ),
            ],
            &m,
        );
        assert!(report.ok, "{:?}", report.violation);
        assert!(!report.epochs[0].coverage_checked);
        assert!(report.epochs[0].status().starts_with("at most once"));
    }
}
