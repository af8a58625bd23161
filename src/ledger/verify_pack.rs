//! Packing across ranks in the ledger's proof: which documents of a
//! complete epoch a packer leaves out. Each slot hands out the sequences
//! planned for it from the manifest's token counts ([`crate::text::counts`])
//! and stops, so the documents it leaves out are those past what its
//! handed-out sequences end.
//!
//! Where the order the slot's documents reach its packer is replayed (its
//! shuffle buffer with the slot's RNG, as `explain` replays it, known to
//! stay within its byte bound; or no buffer), the documents handed out
//! must be exactly those the planned sequences end, the packer laid out by
//! the documents' counts ([`pack::lay_out`]): the proof is exact. The
//! replay rests on what the run checked as it read (each document's span
//! and token count against the manifest) and on the options and worker
//! count the ledger recorded. Otherwise, by concatenation, it is a bound:
//! concatenation fills every sequence but its stream's last, so what the
//! handed-out sequences ended falls short of them by less than the one
//! document they cut, and a slot that hands out all it packs leaves
//! nothing out; a lost document shorter than the cut one's handed part
//! fits that bound. Best fit without the order is not checked.

use super::explain::{self, BufferCheck, BufferReplay};
use super::file::DatasetMeta;
use crate::error::Error;
use crate::format::SampleId;
use crate::plan::order::{rng_for, Purpose};
use crate::plan::resume::Replanner;
use crate::plan::{Remainder, ShardInfo, WorkUnit};
use crate::shard::Shard;
use crate::shuffle::ShuffleBounds;
use crate::text::counts;
use crate::text::pack::{self, PackMode, PackSpec};
use std::collections::HashSet;
use std::ops::Range;

/// A packed dataset, as verify and explain replay its plan.
#[derive(Debug, Clone)]
pub struct Packing {
    /// The dataset's shards, with their manifest's token counts.
    pub shards: Vec<Shard>,
    /// The packing: its sequences' capacity and the field counted.
    pub spec: PackSpec,
    /// The tokenizer the counts were made with (`None`: ids counted).
    pub tokenizer: Option<String>,
    /// How each slot's documents reached its packer, when known: what
    /// replays their order.
    pub arrival: Option<Arrival>,
}

/// How a slot's documents reach its packer, as the ledger's options say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Arrival {
    /// The shuffle buffer's bounds (`None`: no buffer, the plan's order).
    pub buffer: Option<ShuffleBounds>,
    /// What decoding adds to a document's bytes in the buffer.
    pub decoded: Decoded,
}

impl Arrival {
    /// How a packed dataset's documents reached its packer, by the options
    /// a ledger recorded (`meta`): its shuffle buffer, and whether its
    /// decoders (`decode`) only tokenize `field`, the counted one, with
    /// `tokenizer` (the counts' own); `None` when the buffer's options
    /// are not recorded.
    pub fn recorded(meta: &DatasetMeta, field: &str, tokenizer: Option<&str>) -> Option<Arrival> {
        let number = |name| usize::try_from(meta.option(name).as_u64()?).ok();
        let items = number("shuffle_buffer")?;
        let buffer = if items == 0 {
            None
        } else {
            Some(ShuffleBounds {
                max_items: items,
                max_bytes: number("shuffle_buffer_bytes")?,
                initial: number("shuffle_initial")?,
            })
        };
        // A Tokenizer is recorded as its repr, which the counts name too.
        let counted = |decoder: &serde_json::Value| {
            tokenizer.is_some_and(|name| decoder.as_str() == Some(name))
        };
        let decoded = match meta.options.get("decode") {
            Some(serde_json::Value::Null | serde_json::Value::Bool(false)) => Decoded::Nothing,
            Some(serde_json::Value::Object(decoders))
                if decoders.len() == 1 && decoders.get(field).is_some_and(counted) =>
            {
                Decoded::CountedField
            }
            // Other decoders, or none recorded.
            _ => Decoded::Other,
        };
        Some(Arrival { buffer, decoded })
    }
}

/// What the dataset's decoders make of a document before its shuffle
/// buffer holds it: what bounds its bytes there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decoded {
    /// Nothing is decoded: a document holds its undecoded bytes
    /// ([`explain::undecoded_bytes_at_most`]).
    Nothing,
    /// Only the counted field, tokenized as the manifest counted it: at
    /// most 8 bytes more for each of its tokens.
    CountedField,
    /// Other decoders, whose output's bytes are not known: the buffer's
    /// order is not replayed.
    Other,
}

/// What a complete epoch's slots left out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeftOut {
    /// Documents no handed-out sequence ended.
    pub documents: u64,
    /// What the check of them amounts to (the weakest of its slots').
    pub proof: Proof,
    /// Why the order of the first slot not proved exact was not replayed.
    pub unreplayed: Option<Unreplayed>,
}

/// Why a slot's order was not replayed: what keeps its proof from being
/// exact.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unreplayed {
    /// The ledger did not record the shuffle buffer's options.
    OptionsNotRecorded,
    /// Decoders other than the counted field's tokenizer (or none
    /// recorded): the bytes a document holds in the buffer are not known.
    DecodersUnknown,
    /// The shards give no byte spans (Parquet, or no manifest spans).
    NoByteSpans,
    /// The documents the buffer held may pass `shuffle_buffer_bytes`.
    ByteBound,
    /// The records hand out a document the replay leaves out: the replay
    /// is not the run's order.
    NotTheRunsOrder,
    /// The epoch was resumed within it or at its start, and its records
    /// are not those of the uninterrupted plan (an elastic resume plans
    /// the rest anew).
    ResumedAnew,
    /// A document holds more tokens than a replay lays out
    /// ([`pack::MAX_LAID_TOKENS`], by the manifest's counts).
    TooLong,
}

impl std::fmt::Display for Unreplayed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Unreplayed::OptionsNotRecorded => {
                "the ledger does not record the shuffle buffer's options"
            }
            Unreplayed::DecodersUnknown => {
                "the dataset decodes more than the counted field with its tokenizer, so the \
                 bytes its shuffle buffer held are not known"
            }
            Unreplayed::NoByteSpans => {
                "its shards give no byte spans (Parquet, or a manifest without them), so the \
                 bytes its shuffle buffer held are not known"
            }
            Unreplayed::ByteBound => {
                "the documents its shuffle buffer held may pass shuffle_buffer_bytes, which \
                 lets one out early"
            }
            Unreplayed::NotTheRunsOrder => {
                "the records hand out a document the replayed order leaves out, so the \
                 replay is not the run's order (were the ledger's options and num_workers \
                 the run's?)"
            }
            Unreplayed::ResumedAnew => {
                "the epoch was resumed (within it or at its start) and its records are not the \
                 uninterrupted plan's: an elastic resume plans the rest anew, an exact one \
                 continues the plan (or were the ledger's options and num_workers the run's?)"
            }
            Unreplayed::TooLong => {
                "a document holds more tokens by the manifest's counts than a replay lays out"
            }
        })
    }
}

/// What checking a slot's documents left out amounts to, weakest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Proof {
    /// Not checked: `"best_fit"` (its sequences are not full) without its
    /// order replayed.
    Unchecked,
    /// Within the bound concatenation leaves: less than the one document
    /// the last handed-out sequence cut.
    Bounded,
    /// Exactly the documents past the planned sequences, the order
    /// replayed (or none left out).
    Exact,
}

/// The documents of one slot that the remainder does not account for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unaccounted {
    /// The slot (`rank * num_workers + worker`).
    pub slot: usize,
    /// Its first document left out, `(shard, index)`.
    pub first: (usize, u64),
    /// Its documents left out.
    pub count: u64,
}

/// The plan's options that the proof replays with the packing.
#[derive(Debug, Clone, Copy)]
pub struct PlanOptions {
    /// The job's seed.
    pub seed: u64,
    /// Whether each epoch shuffles the shard order.
    pub shuffle_shards: bool,
    /// The remainder policy.
    pub remainder: Remainder,
}

impl Packing {
    /// The packing a ledger's `pack` option describes (`{"seq_len": ...,
    /// "mode": ..., "window": ..., "field": ...}`), over `shards` with
    /// their manifest's token counts of the packed field. `Ok(None)` where
    /// nothing is packed (`null`) or nothing can be replayed: a ledger of an
    /// earlier version that recorded
    /// the option as text (`Pack(...)`), best fit recorded without its
    /// window, or shards without those counts. An option of another form is
    /// an error naming its field: read as "nothing to replay", it would
    /// weaken the verdict to "at most once" without a word.
    pub fn from_option(
        pack: &serde_json::Value,
        shards: &[Shard],
    ) -> std::result::Result<Option<Packing>, String> {
        use serde_json::Value;
        if pack.is_null() || pack.as_str().is_some_and(|text| text.starts_with("Pack(")) {
            return Ok(None);
        }
        let Some(object) = pack.as_object() else {
            return Err(format!(
                "dataset option pack is {pack}, not an object of seq_len and mode"
            ));
        };
        let given = |name: &str| object.get(name).filter(|v| !v.is_null());
        let wrong = |name: &str, expected: &str| {
            let value = object.get(name).unwrap_or(&Value::Null);
            format!("dataset option pack.{name} is {value}, not {expected}")
        };
        let size = |name: &str| {
            given(name)
                .and_then(Value::as_u64)
                .and_then(|n| usize::try_from(n).ok())
        };
        let seq_len = size("seq_len")
            .filter(|&n| n > 0)
            .ok_or_else(|| wrong("seq_len", "an int of at least 1"))?;
        let window = match given("window") {
            None => None,
            Some(_) => Some(size("window").ok_or_else(|| wrong("window", "an int"))?),
        };
        let mode = match (given("mode").and_then(Value::as_str), window) {
            (Some("concat"), _) => PackMode::Concat,
            (Some("best_fit"), Some(window)) => PackMode::BestFit { window },
            (Some("best_fit"), None) => return Ok(None),
            _ => return Err(wrong("mode", "concat or best_fit")),
        };
        let field = match given("field") {
            None => None,
            Some(name) => Some(
                name.as_str()
                    .ok_or_else(|| wrong("field", "a field name"))?
                    .to_owned(),
            ),
        };
        Packing::new(shards, (seq_len, field, mode)).map_err(|(name, reason)| match name {
            "pack" => format!("dataset option pack: {reason}"),
            name => format!("dataset option pack.{name}: {reason}"),
        })
    }

    /// The packing `(seq_len, field, mode)` of `shards` by their manifest's
    /// token counts of `field` (by default the field they count);
    /// `Ok(None)` when no shard has counts; `Err((parameter, reason))`
    /// when a parameter is wrong (`"seq_len"`, `"window"`, `"field"`) or
    /// the counts are not of that field (`"pack"`).
    pub fn new(
        shards: &[Shard],
        (seq_len, field, mode): (usize, Option<String>, PackMode),
    ) -> std::result::Result<Option<Packing>, (&'static str, String)> {
        let Some(counted) = shards.iter().find_map(Shard::tokens) else {
            return Ok(None);
        };
        let field = field.unwrap_or_else(|| counted.field.clone());
        let spec = PackSpec::new(Some(field), seq_len, mode, false, 0)?;
        let tokenizer = counted.tokenizer.clone();
        counts::check_counted(shards, &spec, tokenizer.clone(), true).map_err(|e| match e {
            Error::Config { reason, .. } => ("pack", reason),
            other => ("pack", other.to_string()),
        })?;
        Ok(Some(Packing {
            shards: shards.to_vec(),
            spec,
            tokenizer,
            arrival: None,
        }))
    }

    /// The order slot `slot`'s documents (`slot_units`) reach its packer
    /// in `epoch` through `arrival`, and whether that is known to be
    /// exact; `Err(position)`: the held documents' upper bounds pass the
    /// buffer's byte bound when the one at `position` arrives.
    pub(crate) fn arrival_order(
        &self,
        arrival: Arrival,
        (seed, epoch): (u64, u64),
        slot: usize,
        slot_units: &[WorkUnit],
    ) -> Result<(Vec<(usize, u64)>, BufferCheck), u64> {
        let runs: Vec<(usize, Range<u64>)> = slot_units
            .iter()
            .map(|unit| (unit.shard, self.samples_of(unit)))
            .collect();
        let Some(bounds) = arrival.buffer else {
            let order = runs
                .iter()
                .flat_map(|(shard, samples)| samples.clone().map(move |i| (*shard, i)))
                .collect();
            return Ok((order, BufferCheck::NoBuffer));
        };
        let sample_bytes = |shard: usize, index: u64| {
            let shard = self.shards.get(shard)?;
            let undecoded = explain::undecoded_bytes_at_most(shard, index)?;
            match arrival.decoded {
                Decoded::Nothing => Some(undecoded),
                Decoded::CountedField => {
                    let tokens = shard.tokens()?.counts.get(usize::try_from(index).ok()?)?;
                    Some(undecoded.saturating_add(tokens.saturating_mul(8)))
                }
                Decoded::Other => None,
            }
        };
        let replay = BufferReplay {
            bounds,
            sample_bytes: &sample_bytes,
        };
        let documents = runs.iter().map(|(_, s)| s.end - s.start).sum();
        let rng = rng_for(seed, epoch, Purpose::ShuffleBuffer { slot });
        explain::shuffled(&runs, &replay, rng, documents)
    }

    /// Each slot's units of `epoch` over shards of `infos` (the dataset's
    /// counted ones, or as a run on one rank plans them), planned for
    /// `world_size` x `num_workers` slots by the documents' tokens, and
    /// what it packs and hands out.
    pub(crate) fn plan_slots(
        &self,
        infos: Vec<ShardInfo>,
        options: PlanOptions,
        epoch: u64,
        (world_size, num_workers): (usize, usize),
    ) -> (Vec<Vec<WorkUnit>>, Vec<counts::PackedSlot>) {
        let weights = counts::token_weights(&self.shards, &self.spec, self.tokenizer.clone());
        let units = Replanner::new(
            infos,
            options.seed,
            options.shuffle_shards,
            options.remainder,
        )
        .with_weights(weights)
        .plan(epoch, world_size, num_workers);
        let slots = counts::packed_slots(&self.shards, &self.spec, &units, world_size);
        (units, slots)
    }

    /// The samples of `unit`: its range, or its whole shard.
    fn samples_of(&self, unit: &WorkUnit) -> Range<u64> {
        unit.samples
            .clone()
            .unwrap_or_else(|| 0..self.shards[unit.shard].info().samples.unwrap_or(0))
    }

    /// Document `index` of `shard`'s tokens (0 when not counted).
    pub(crate) fn tokens_of(&self, shard: usize, index: u64) -> u64 {
        self.shards[shard]
            .tokens()
            .and_then(|t| t.counts.get(usize::try_from(index).ok()?).copied())
            .unwrap_or(0)
    }

    /// The documents of `epoch`, planned for `world_size` x `num_workers`
    /// slots, that no handed-out sequence ended (`handed(shard, index)`
    /// false), when each slot's are its remainder (exactly, where its
    /// order is replayed; within the bound otherwise, by concatenation);
    /// otherwise the first slot whose are not.
    pub fn left_out(
        &self,
        options: PlanOptions,
        epoch: u64,
        (world_size, num_workers): (usize, usize),
        handed: impl Fn(usize, u64) -> bool,
    ) -> Result<LeftOut, Unaccounted> {
        let infos = self.shards.iter().map(Shard::info).collect();
        let (units, slots) = self.plan_slots(infos, options, epoch, (world_size, num_workers));
        let mut left = LeftOut {
            documents: 0,
            proof: Proof::Exact,
            unreplayed: None,
        };
        for (slot, (slot_units, planned)) in units.iter().zip(&slots).enumerate() {
            let sequences = planned.handed_out.unwrap_or(planned.at_least);
            // Exact where the order is known to be.
            let replayed = match self.known_order(options.seed, epoch, slot, slot_units) {
                Ok(order) => self.replayed(slot, &order, sequences, &handed)?,
                Err(why) => Err(why),
            };
            let (count, proof) = match replayed {
                Ok(count) => (count, Proof::Exact),
                Err(why) => {
                    let (count, proof) = self.bounded(slot, slot_units, planned, &handed)?;
                    // The records disagreeing with a replay is said before
                    // any other reason.
                    if proof != Proof::Exact
                        && (left.unreplayed.is_none() || why == Unreplayed::NotTheRunsOrder)
                    {
                        left.unreplayed = Some(why);
                    }
                    (count, proof)
                }
            };
            left.documents += count;
            left.proof = left.proof.min(proof);
        }
        Ok(left)
    }

    /// The order slot `slot`'s documents reached its packer in `epoch`,
    /// when the replay is known to be exact; otherwise why it is not.
    pub(crate) fn known_order(
        &self,
        seed: u64,
        epoch: u64,
        slot: usize,
        slot_units: &[WorkUnit],
    ) -> Result<Vec<(usize, u64)>, Unreplayed> {
        let arrival = self.arrival.ok_or(Unreplayed::OptionsNotRecorded)?;
        match self.arrival_order(arrival, (seed, epoch), slot, slot_units) {
            Ok((order, BufferCheck::WithinBytes | BufferCheck::NoBuffer)) => Ok(order),
            Ok((_, BufferCheck::BytesUnknown)) if arrival.decoded == Decoded::Other => {
                Err(Unreplayed::DecodersUnknown)
            }
            Ok((_, BufferCheck::BytesUnknown)) => Err(Unreplayed::NoByteSpans),
            Err(_) => Err(Unreplayed::ByteBound),
        }
    }

    /// A slot's documents left out, its documents reaching its packer in
    /// `order`: those its first `sequences` sequences end must be handed
    /// out. `Ok(Err(why))` when it cannot tell: a document handed out past
    /// them (the replay is not the run's order), or one too long to lay
    /// out.
    pub(crate) fn replayed(
        &self,
        slot: usize,
        order: &[(usize, u64)],
        sequences: u64,
        handed: &impl Fn(usize, u64) -> bool,
    ) -> Result<Result<u64, Unreplayed>, Unaccounted> {
        let tokens = |shard, index| self.tokens_of(shard, index);
        let ended = match self.spec.mode {
            PackMode::Concat => Some(ended_by(
                order,
                tokens,
                sequences,
                self.spec.capacity() as u64,
            )),
            PackMode::BestFit { .. } => packer_ends(order, tokens, &self.spec, sequences),
        };
        let Some(ended) = ended else {
            return Ok(Err(Unreplayed::TooLong));
        };
        let (mut missing, mut extra, mut count) = (0u64, false, 0u64);
        let mut first_missing = None;
        for (&(shard, index), &ended) in order.iter().zip(&ended) {
            let got = handed(shard, index);
            count += u64::from(!got);
            extra |= got && !ended;
            if ended && !got {
                missing += 1;
                first_missing.get_or_insert((shard, index));
            }
        }
        match (extra, first_missing) {
            (true, _) => Ok(Err(Unreplayed::NotTheRunsOrder)),
            (false, Some(first)) => Err(Unaccounted {
                slot,
                first,
                count: missing,
            }),
            (false, None) => Ok(Ok(count)),
        }
    }

    /// A slot's documents left out, its order not replayed: within the
    /// bound by concatenation, unchecked by best fit (none left out is
    /// exact either way).
    fn bounded(
        &self,
        slot: usize,
        slot_units: &[WorkUnit],
        planned: &counts::PackedSlot,
        handed: &impl Fn(usize, u64) -> bool,
    ) -> Result<(u64, Proof), Unaccounted> {
        let documents: Vec<(usize, u64)> = slot_units
            .iter()
            .flat_map(|unit| self.samples_of(unit).map(move |index| (unit.shard, index)))
            .collect();
        let count = documents.iter().filter(|&&(s, i)| !handed(s, i)).count() as u64;
        let proof = match self.spec.mode {
            _ if count == 0 => Proof::Exact,
            PackMode::BestFit { .. } => Proof::Unchecked,
            // A slot whose documents hold no token makes no sequence, so
            // none of them is recorded.
            PackMode::Concat if planned.at_least == 0 => Proof::Bounded,
            PackMode::Concat => {
                let sequences = planned.handed_out.unwrap_or(planned.at_least);
                if sequences >= planned.at_least {
                    let first = documents.iter().copied().find(|&(s, i)| !handed(s, i));
                    return Err(Unaccounted {
                        slot,
                        first: first.unwrap_or_default(),
                        count,
                    });
                }
                self.bound_of(slot, &documents, sequences, handed)?
            }
        };
        Ok((count, proof))
    }

    /// Whether a concatenating slot of `documents` that handed out
    /// `sequences` (fewer than it packs) left out no more than its
    /// remainder: full sequences of its documents in order, what they
    /// ended and the part of the one they cut (less than all of it) fill
    /// them exactly.
    fn bound_of(
        &self,
        slot: usize,
        documents: &[(usize, u64)],
        sequences: u64,
        handed: &impl Fn(usize, u64) -> bool,
    ) -> Result<Proof, Unaccounted> {
        let (mut ended, mut longest_left, mut count) = (0u64, 0u64, 0u64);
        let mut first = None;
        for &(shard, index) in documents {
            let n = self.tokens_of(shard, index);
            if handed(shard, index) {
                ended = ended.saturating_add(n);
            } else {
                longest_left = longest_left.max(n);
                count += 1;
                first.get_or_insert((shard, index));
            }
        }
        let filled = sequences.saturating_mul(self.spec.capacity() as u64);
        let cut_one = filled
            .checked_sub(ended)
            .is_some_and(|part| part < longest_left.max(1));
        match first {
            None => Ok(Proof::Exact),
            Some(first) if !cut_one => Err(Unaccounted { slot, first, count }),
            Some(_) => Ok(Proof::Bounded),
        }
    }
}

/// Which of a slot's documents, in the order they reached its packer
/// (`order`, with `tokens` each), its first `sequences` sequences of
/// `capacity` tokens end, as a concatenating packer with ids records them:
/// a document whose last token falls within them, and a document without
/// tokens where the packer places it (in the sequence open when it comes,
/// else in the last one filled, or in the first). What [`packer_ends`]
/// finds, without making the sequences.
fn ended_by(
    order: &[(usize, u64)],
    tokens: impl Fn(usize, u64) -> u64,
    sequences: u64,
    capacity: u64,
) -> Vec<bool> {
    let room = sequences.saturating_mul(capacity);
    let mut used = 0u64;
    order
        .iter()
        .map(|&(shard, index)| {
            let n = tokens(shard, index);
            if n > 0 {
                used = used.saturating_add(n);
                return used <= room;
            }
            let sequence = match (used, used % capacity) {
                (0, _) => 0,
                (_, 0) => used / capacity - 1,
                _ => used / capacity,
            };
            sequence < sequences
        })
        .collect()
}

/// Which of a slot's documents, in the order they reached its packer
/// (`order`, with `tokens` each), the first `sequences` sequences a packed
/// stream by `spec` hands out end (their last token, or a document without
/// tokens, in one of those sequences: what its ids name). `None` when a
/// document is too long to lay out ([`pack::lay_out`]).
fn packer_ends(
    order: &[(usize, u64)],
    tokens: impl Fn(usize, u64) -> u64,
    spec: &PackSpec,
    sequences: u64,
) -> Option<Vec<bool>> {
    let documents = order
        .iter()
        .map(|&(shard, index)| (SampleId { shard, index }, tokens(shard, index)));
    let laid = pack::lay_out(documents, spec, Some(sequences))?;
    let ended: HashSet<(usize, u64)> = laid
        .iter()
        .flatten()
        .filter(|&&[shard, index, _, end]| end == tokens(shard as usize, index))
        .map(|&[shard, index, _, _]| (shard as usize, index))
        .collect();
    Some(order.iter().map(|d| ended.contains(d)).collect())
}

#[cfg(test)]
pub(super) mod tests {
    use std::collections::HashSet;
    use std::ops::ControlFlow;
    use std::sync::Arc;

    use proptest::prelude::*;

    use super::*;
    use crate::byte_size::ByteSize;
    use crate::format::Sample;
    use crate::shuffle::ShuffleBuffer;
    use crate::text::counts::tests::shard;
    use crate::text::pack::Packer;
    use crate::value::{ArrayData, Value};

    /// A document: `(shard, index)`.
    pub(in crate::ledger) type Document = (usize, u64);

    /// The plan options of these tests.
    pub(in crate::ledger) const OPTIONS: PlanOptions = PlanOptions {
        seed: 3,
        shuffle_shards: true,
        remainder: Remainder::Drop,
    };

    /// The documents concatenation hands out of each slot of 2 ranks x 2
    /// workers, its documents taken in plan order (those whose last token
    /// falls within the slot's planned sequences), and each slot's left out.
    fn concat_handed(packing: &Packing) -> (HashSet<Document>, Vec<Vec<Document>>) {
        let infos = packing.shards.iter().map(Shard::info).collect();
        let weights = counts::token_weights(&packing.shards, &packing.spec, None);
        let units = Replanner::new(infos, OPTIONS.seed, true, Remainder::Drop)
            .with_weights(weights)
            .plan(0, 2, 2);
        let slots = counts::packed_slots(&packing.shards, &packing.spec, &units, 2);
        let capacity = packing.spec.capacity() as u64;
        let (mut handed, mut left) = (HashSet::new(), Vec::new());
        for (slot_units, slot) in units.iter().zip(&slots) {
            let room = slot.handed_out.unwrap() * capacity;
            let (mut end, mut slot_left) = (0, Vec::new());
            for unit in slot_units {
                let counts = &packing.shards[unit.shard].tokens().unwrap().counts;
                for index in unit.samples.clone().unwrap() {
                    end += counts[index as usize];
                    if end <= room {
                        handed.insert((unit.shard, index));
                    } else {
                        slot_left.push((unit.shard, index));
                    }
                }
            }
            left.push(slot_left);
        }
        (handed, left)
    }

    #[test]
    fn what_concatenation_leaves_out_is_the_remainder_and_a_lost_document_is_not() {
        let shards: Vec<Shard> = (0..4)
            .map(|s| {
                let counts = (0..12).map(|d| 1 + (s * 7 + d * 5) % 23).collect();
                shard(&format!("p-{s}.jsonl"), Some(counts))
            })
            .collect();
        let spec = PackSpec::new(Some("ids".into()), 7, PackMode::Concat, false, 0).unwrap();
        let option = serde_json::json!({"seq_len": 7, "mode": "concat", "field": "ids"});
        let packing = Packing::from_option(&option, &shards)
            .unwrap()
            .expect("counted, concat");
        assert_eq!(packing.spec, spec);
        let (handed, left) = concat_handed(&packing);
        let count = left.iter().map(Vec::len).sum::<usize>() as u64;
        assert!(count > 0, "some slot packs more than it hands out");
        let found = packing.left_out(OPTIONS, 0, (2, 2), |s, i| handed.contains(&(s, i)));
        assert_eq!(
            found,
            Ok(LeftOut {
                documents: count,
                proof: Proof::Bounded,
                unreplayed: Some(Unreplayed::OptionsNotRecorded)
            })
        );
        // The records of a slot with a remainder lost its documents: the
        // shortfall is more than the one document the sequences cut.
        let slot = left.iter().position(|l| !l.is_empty()).unwrap();
        let infos: Vec<_> = shards.iter().map(Shard::info).collect();
        let units = Replanner::new(infos, OPTIONS.seed, true, Remainder::Drop)
            .with_weights(counts::token_weights(&shards, &spec, None))
            .plan(0, 2, 2);
        let lost: HashSet<Document> = units[slot]
            .iter()
            .flat_map(|u| u.samples.clone().unwrap().map(move |i| (u.shard, i)))
            .collect();
        let found = packing.left_out(OPTIONS, 0, (2, 2), |s, i| {
            !lost.contains(&(s, i)) && handed.contains(&(s, i))
        });
        assert!(
            matches!(found, Err(Unaccounted { slot: at, count, .. }) if at == slot && count == lost.len() as u64),
            "{found:?}"
        );
        // A slot that hands out all it packs leaves nothing out.
        let found = packing.left_out(OPTIONS, 0, (1, 1), |s, i| (s, i) != (0, 0));
        assert_eq!(
            found,
            Err(Unaccounted {
                slot: 0,
                first: (0, 0),
                count: 1
            })
        );
        // Best fit without its window, or an option recorded as text,
        // replays nothing.
        let best_fit = serde_json::json!({"seq_len": 7, "mode": "best_fit", "field": "ids"});
        assert!(Packing::from_option(&best_fit, &shards).unwrap().is_none());
        let text = serde_json::json!("Pack(seq_len=7)");
        assert!(Packing::from_option(&text, &shards).unwrap().is_none());
        // Any other form is an error naming its field, not "nothing to
        // replay" (which would weaken the verdict).
        for (option, named) in [
            (serde_json::json!(1), "pack is 1"),
            (serde_json::json!("yes"), "pack is \"yes\""),
            (serde_json::json!({}), "pack.seq_len is null"),
            (
                serde_json::json!({"seq_len": 0, "mode": "concat"}),
                "pack.seq_len is 0",
            ),
            (
                serde_json::json!({"seq_len": 7, "mode": "zip"}),
                "pack.mode is \"zip\"",
            ),
            (
                serde_json::json!({"seq_len": 7, "mode": "best_fit", "window": "4"}),
                "pack.window",
            ),
            (
                serde_json::json!({"seq_len": 7, "mode": "concat", "field": 3}),
                "pack.field is 3",
            ),
        ] {
            let error = Packing::from_option(&option, &shards)
                .map(|_| ())
                .unwrap_err();
            assert!(error.contains(named), "{option}: {error}");
        }
    }

    /// Document `(shard, index)` with `n` tokens of `ids`.
    /// Document `(shard, index)` of `n` token ids, as a stream hands it
    /// to its packer.
    pub(in crate::ledger) fn doc((shard, index): Document, n: u64) -> Sample {
        Sample {
            id: SampleId { shard, index },
            key: format!("{shard}-{index}"),
            url: Arc::from("mem://d"),
            fields: vec![("ids".into(), Value::List(vec![Value::Int(1); n as usize]))],
            offset: 0,
            length: 0,
        }
    }

    /// The documents a packed stream's first `sequences` sequences name
    /// (`__id__`), its packer by `spec` fed `order` (documents of token
    /// ids) as the stream feeds it: a sequence taken whenever one is
    /// ready, and no document once the planned ones are out.
    fn stream_ends(
        order: &[Document],
        tokens: impl Fn(Document) -> u64,
        spec: &PackSpec,
        sequences: u64,
    ) -> HashSet<Document> {
        let mut packer = Packer::new(Arc::new(spec.clone())).with_ids(0);
        let mut out = Vec::new();
        let mut docs = order.iter();
        while (out.len() as u64) < sequences {
            if let Some(sequence) = packer.pop() {
                out.push(sequence);
                continue;
            }
            match docs.next() {
                Some(&d) => {
                    packer.push(&doc(d, tokens(d))).unwrap();
                }
                None if packer.is_empty() => break,
                None => {
                    packer.finish();
                }
            }
        }
        let ids = |sequence: &Sample| -> Vec<Document> {
            let Some((_, Value::Array(array))) =
                sequence.fields.iter().find(|(name, _)| name == "__id__")
            else {
                panic!("no ids");
            };
            let ArrayData::I64(rows) = &array.data else {
                panic!("ids of another type");
            };
            rows.chunks(3)
                .map(|r| (r[1] as usize, r[2] as u64))
                .collect()
        };
        out.iter().flat_map(ids).collect()
    }

    fn pack_spec(seq_len: usize, window: Option<usize>) -> PackSpec {
        let mode = window.map_or(PackMode::Concat, |window| PackMode::BestFit { window });
        PackSpec::new(Some("ids".into()), seq_len, mode, false, 0).unwrap()
    }

    proptest! {
        /// What `ended_by` (concatenation) and `packer_ends` (either mode)
        /// say a slot's sequences end is what a packer with ids names,
        /// documents without tokens and longer than a sequence included,
        /// for every number of sequences up to all it makes.
        #[test]
        fn the_replay_names_what_the_packer_names(
            lens in proptest::collection::vec(prop_oneof![Just(0u64), 1u64..20], 0..30),
            seq_len in 1usize..9,
            window in proptest::option::of(1usize..4),
            share in 0.0f64..=1.0,
        ) {
            let order: Vec<Document> = (0..lens.len() as u64).map(|i| (0, i)).collect();
            let spec = pack_spec(seq_len, window);
            let capacity = spec.capacity() as u64;
            let at_least = lens.iter().sum::<u64>().div_ceil(capacity);
            let sequences = (at_least as f64 * share).round() as u64;
            let tokens = |(_, i): Document| lens[i as usize];
            let named = stream_ends(&order, tokens, &spec, sequences);
            let said = |ended: Vec<bool>| -> HashSet<Document> {
                order
                    .iter()
                    .zip(&ended)
                    .filter_map(|(&d, &e)| e.then_some(d))
                    .collect()
            };
            let replayed = packer_ends(&order, |s, i| tokens((s, i)), &spec, sequences);
            prop_assert_eq!(said(replayed.unwrap()), named.clone());
            if window.is_none() {
                let ended = ended_by(&order, |s, i| tokens((s, i)), sequences, capacity);
                prop_assert_eq!(said(ended), named);
            }
        }
    }

    /// A held document in the oracle's shuffle buffer.
    struct Held(Document);

    impl ByteSize for Held {
        fn byte_size(&self) -> usize {
            0
        }
    }

    /// Four shards of 12 documents of 1 to 23 tokens.
    fn counted_shards() -> Vec<Shard> {
        (0..4)
            .map(|s| {
                let counts = (0..12).map(|d| 1 + (s * 7 + d * 5) % 23).collect();
                shard(&format!("p-{s}.jsonl"), Some(counts))
            })
            .collect()
    }

    #[test]
    fn with_the_order_replayed_every_lost_document_is_named() {
        for window in [None, Some(3)] {
            replayed_in_either_mode(window);
        }
    }

    /// The packing of [`counted_shards`] in 7-token sequences
    /// (concatenation, or best fit over `window`), without the options of
    /// the shuffle buffer its documents came through.
    pub(in crate::ledger) fn counted_packing(window: Option<usize>) -> Packing {
        let option = match window {
            None => serde_json::json!({"seq_len": 7, "mode": "concat", "field": "ids"}),
            Some(w) => {
                serde_json::json!({"seq_len": 7, "mode": "best_fit", "window": w, "field": "ids"})
            }
        };
        let packing = Packing::from_option(&option, &counted_shards())
            .unwrap()
            .unwrap();
        assert_eq!(packing.spec, pack_spec(7, window));
        packing
    }

    /// A shuffle buffer of 5 documents that lets 2 in before the first
    /// one out, its bytes never the bound.
    pub(in crate::ledger) const BOUNDS: ShuffleBounds = ShuffleBounds {
        max_items: 5,
        max_bytes: 1 << 20,
        initial: 2,
    };

    /// What each slot of 2 ranks x 2 workers hands out in epoch 0
    /// ([`OPTIONS`]).
    pub(in crate::ledger) struct SlotsRun {
        /// Each slot's units of the plan.
        pub(in crate::ledger) units: Vec<Vec<WorkUnit>>,
        /// Each slot's planned sequences.
        pub(in crate::ledger) slots: Vec<counts::PackedSlot>,
        /// The documents each slot's handed-out sequences end.
        pub(in crate::ledger) named: Vec<HashSet<Document>>,
        /// Each slot's documents past them, in the order they came.
        pub(in crate::ledger) left: Vec<Vec<Document>>,
    }

    /// What each slot's stream hands out under `packing`: its units
    /// through the real shuffle buffer (`bounds`, the slot's RNG), then a
    /// packer with ids.
    pub(in crate::ledger) fn slots_run(packing: &Packing, bounds: ShuffleBounds) -> SlotsRun {
        let shards = &packing.shards;
        let infos = shards.iter().map(Shard::info).collect();
        let units = Replanner::new(infos, OPTIONS.seed, true, Remainder::Drop)
            .with_weights(counts::token_weights(shards, &packing.spec, None))
            .plan(0, 2, 2);
        let slots = counts::packed_slots(shards, &packing.spec, &units, 2);
        let tokens = |(s, i): Document| shards[s].tokens().unwrap().counts[i as usize];
        let (mut named, mut left) = (Vec::new(), Vec::new());
        for (slot, slot_units) in units.iter().enumerate() {
            let rng = rng_for(OPTIONS.seed, 0, Purpose::ShuffleBuffer { slot });
            let mut buffer = ShuffleBuffer::new(bounds, rng, 0);
            let mut order = Vec::new();
            for unit in slot_units {
                for index in unit.samples.clone().unwrap() {
                    let _ = buffer.push(Held((unit.shard, index)), |e| {
                        order.push(e.item.0);
                        ControlFlow::Continue(())
                    });
                }
            }
            while let Some((_, Held(d))) = buffer.pop_random() {
                order.push(d);
            }
            let sequences = slots[slot].handed_out.unwrap();
            let ends = stream_ends(&order, tokens, &packing.spec, sequences);
            left.push(
                order
                    .iter()
                    .copied()
                    .filter(|d| !ends.contains(d))
                    .collect(),
            );
            named.push(ends);
        }
        SlotsRun {
            units,
            slots,
            named,
            left,
        }
    }

    fn replayed_in_either_mode(window: Option<usize>) {
        let shards = counted_shards();
        let bounds = BOUNDS;
        let arrival = Arrival {
            buffer: Some(bounds),
            decoded: Decoded::Nothing,
        };
        let unreplayed = counted_packing(window);
        let packing = Packing {
            arrival: Some(arrival),
            ..unreplayed.clone()
        };
        let SlotsRun {
            units,
            slots,
            named,
            left,
        } = slots_run(&packing, bounds);
        let tokens = |(s, i): Document| shards[s].tokens().unwrap().counts[i as usize];
        let handed: HashSet<Document> = named.iter().flatten().copied().collect();
        let count = left.iter().map(Vec::len).sum::<usize>() as u64;
        assert!(count > 0);
        let found = packing.left_out(OPTIONS, 0, (2, 2), |s, i| handed.contains(&(s, i)));
        let exact = LeftOut {
            documents: count,
            proof: Proof::Exact,
            unreplayed: None,
        };
        assert_eq!(found, Ok(exact));
        // A short document lost from a slot with a remainder: within the
        // bound (concatenation), and named by the replay.
        let (slot, lost) = (0..units.len())
            .filter(|&slot| !left[slot].is_empty())
            .flat_map(|slot| named[slot].iter().map(move |&d| (slot, d)))
            .min_by_key(|&(_, d)| (tokens(d), d))
            .unwrap();
        let kept = |s: usize, i: u64| (s, i) != lost && handed.contains(&(s, i));
        let unchecked = |why| LeftOut {
            documents: count + 1,
            proof: if window.is_some() {
                Proof::Unchecked
            } else {
                Proof::Bounded
            },
            unreplayed: Some(why),
        };
        assert_eq!(
            unreplayed.left_out(OPTIONS, 0, (2, 2), kept),
            Ok(unchecked(Unreplayed::OptionsNotRecorded)),
            "without the order, the loss passes"
        );
        assert_eq!(
            packing.left_out(OPTIONS, 0, (2, 2), kept),
            Err(Unaccounted {
                slot,
                first: lost,
                count: 1
            })
        );
        // Decoders of unknown output, or a byte bound the held documents
        // may pass: the order is not replayed.
        for (arrival, why) in [
            (
                Arrival {
                    decoded: Decoded::Other,
                    ..arrival
                },
                Unreplayed::DecodersUnknown,
            ),
            (
                Arrival {
                    buffer: Some(ShuffleBounds {
                        max_bytes: 40,
                        ..bounds
                    }),
                    ..arrival
                },
                Unreplayed::ByteBound,
            ),
        ] {
            let found = Packing {
                arrival: Some(arrival),
                ..unreplayed.clone()
            }
            .left_out(OPTIONS, 0, (2, 2), kept);
            assert_eq!(found, Ok(unchecked(why)));
        }
        // Records that hand out a document the replay leaves out: not the
        // run's order, and best fit checks no more (in a slot leaving others
        // out: were it the slot's only one, every document came once).
        if window.is_some() {
            let slot_left = left.iter().find(|l| l.len() > 1).expect("several left out");
            let past = slot_left[0];
            let with_past = |s: usize, i: u64| (s, i) == past || handed.contains(&(s, i));
            let expected = LeftOut {
                documents: count - 1,
                proof: Proof::Unchecked,
                unreplayed: Some(Unreplayed::NotTheRunsOrder),
            };
            assert_eq!(
                packing.left_out(OPTIONS, 0, (2, 2), with_past),
                Ok(expected)
            );
        }
        // No buffer: the plan's order.
        let in_plan_order = |s: usize, i: u64| {
            let slot = units
                .iter()
                .position(|u| {
                    u.iter()
                        .any(|u| u.shard == s && u.samples.as_ref().unwrap().contains(&i))
                })
                .unwrap();
            let order: Vec<Document> = units[slot]
                .iter()
                .flat_map(|u| u.samples.clone().unwrap().map(move |i| (u.shard, i)))
                .collect();
            stream_ends(
                &order,
                tokens,
                &packing.spec,
                slots[slot].handed_out.unwrap(),
            )
            .contains(&(s, i))
        };
        let plain = Packing {
            arrival: Some(Arrival {
                buffer: None,
                decoded: Decoded::Other,
            }),
            ..unreplayed.clone()
        };
        let found = plain.left_out(OPTIONS, 0, (2, 2), in_plan_order);
        assert!(
            matches!(found, Ok(LeftOut { proof: Proof::Exact, documents, .. }) if documents > 0),
            "{found:?}"
        );
    }

    #[test]
    fn the_arrival_is_read_from_the_ledger_s_options() {
        let meta = |options: serde_json::Value| -> DatasetMeta {
            serde_json::from_value(serde_json::json!({"spec": [], "options": options})).unwrap()
        };
        let buffer = serde_json::json!({
            "shuffle_buffer": 8, "shuffle_buffer_bytes": 4096, "shuffle_initial": 3
        });
        let tokenizer = "Tokenizer(digest=0x1f, bos=None, eos=0, add_special_tokens=True)";
        let with = |decode: Option<serde_json::Value>| {
            let mut options = buffer.clone();
            if let Some(decode) = decode {
                options["decode"] = decode;
            }
            Arrival::recorded(&meta(options), "text", Some(tokenizer))
        };
        let bounds = Some(ShuffleBounds {
            max_items: 8,
            max_bytes: 4096,
            initial: 3,
        });
        let arrival = |decoded| {
            Some(Arrival {
                buffer: bounds,
                decoded,
            })
        };
        assert_eq!(
            with(Some(serde_json::Value::Null)),
            arrival(Decoded::Nothing)
        );
        assert_eq!(
            with(Some(serde_json::json!({"text": tokenizer}))),
            arrival(Decoded::CountedField)
        );
        let other = "Tokenizer(digest=0x2e, bos=None, eos=0, add_special_tokens=True)";
        for decode in [
            None,
            Some(serde_json::json!(true)),
            Some(serde_json::json!({"title": tokenizer})),
            Some(serde_json::json!({"text": other})),
            Some(serde_json::json!({"text": tokenizer, "title": tokenizer})),
            Some(serde_json::json!({"text": "json"})),
        ] {
            assert_eq!(with(decode), arrival(Decoded::Other));
        }
        let off = meta(serde_json::json!({"shuffle_buffer": 0, "decode": null}));
        assert_eq!(
            Arrival::recorded(&off, "text", None),
            Some(Arrival {
                buffer: None,
                decoded: Decoded::Nothing
            })
        );
        // A ledger that did not record the buffer's options.
        assert_eq!(
            Arrival::recorded(&meta(serde_json::json!({})), "text", None),
            None
        );
    }
}
