//! Packing across ranks in the ledger's proof: which documents of a
//! complete epoch a concatenating packer may leave out. Each slot hands
//! out the sequences planned for it from the manifest's token counts
//! ([`crate::text::counts`]) and stops; concatenation fills every sequence
//! but its stream's last, so what the slot's handed-out sequences ended
//! falls short of them by less than the one document they cut, and a slot
//! that hands out all it packs leaves nothing out. More left out than
//! that is a loss; a lost document shorter than the cut one's handed part
//! fits the bound (the order within a slot is not replayed), so this is a
//! bound on the remainder, not a proof of exactly once.

use crate::plan::resume::Replanner;
use crate::plan::Remainder;
use crate::shard::Shard;
use crate::text::counts;
use crate::text::pack::{PackMode, PackSpec};

/// A dataset packed by concatenation, as verify replays its plan.
#[derive(Debug, Clone)]
pub struct Packing {
    /// The dataset's shards, with their manifest's token counts.
    pub shards: Vec<Shard>,
    /// The packing: its sequences' capacity and the field counted.
    pub spec: PackSpec,
    /// The tokenizer the counts were made with (`None`: ids counted).
    pub tokenizer: Option<String>,
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
    /// "mode": ..., "field": ...}`), over `shards` with their manifest's
    /// token counts of the packed field (by default the field counted);
    /// `None` for `"best_fit"` (its sequences are not full), a ledger that
    /// recorded the option as text, or shards without counts.
    pub fn from_option(pack: &serde_json::Value, shards: &[Shard]) -> Option<Packing> {
        let pack = pack.as_object()?;
        if pack.get("mode")?.as_str()? != "concat" {
            return None;
        }
        let seq_len = usize::try_from(pack.get("seq_len")?.as_u64()?).ok()?;
        let counted = shards.iter().find_map(Shard::tokens)?;
        let field = match pack.get("field").and_then(|f| f.as_str()) {
            Some(field) => field.to_owned(),
            None => counted.field.clone(),
        };
        let spec = PackSpec::new(Some(field), seq_len, PackMode::Concat, false, 0).ok()?;
        let tokenizer = counted.tokenizer.clone();
        counts::check_counted(shards, &spec, tokenizer.clone(), true).ok()?;
        Some(Packing {
            shards: shards.to_vec(),
            spec,
            tokenizer,
        })
    }

    /// The documents of `epoch`, planned for `world_size` x `num_workers`
    /// slots, that no handed-out sequence ended (`handed(shard, index)`
    /// false), when each slot's are its remainder; otherwise the first
    /// slot whose are not.
    pub fn left_out(
        &self,
        options: PlanOptions,
        epoch: u64,
        (world_size, num_workers): (usize, usize),
        handed: impl Fn(usize, u64) -> bool,
    ) -> Result<u64, Unaccounted> {
        let infos = self.shards.iter().map(Shard::info).collect();
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
        let capacity = self.spec.capacity() as u64;
        let mut total = 0u64;
        for (slot, (slot_units, planned)) in units.iter().zip(&slots).enumerate() {
            let (mut ended, mut longest_left, mut count) = (0u64, 0u64, 0u64);
            let mut first = None;
            for unit in slot_units {
                let tokens = self.shards[unit.shard].tokens();
                let samples = unit
                    .samples
                    .clone()
                    .unwrap_or_else(|| 0..self.shards[unit.shard].info().samples.unwrap_or(0));
                for index in samples {
                    let n = tokens
                        .and_then(|t| t.counts.get(usize::try_from(index).ok()?).copied())
                        .unwrap_or(0);
                    if handed(unit.shard, index) {
                        ended = ended.saturating_add(n);
                    } else {
                        longest_left = longest_left.max(n);
                        count += 1;
                        first.get_or_insert((unit.shard, index));
                    }
                }
            }
            let Some(first) = first else {
                continue;
            };
            // A slot whose documents hold no token makes no sequence, so
            // none of them is recorded.
            if planned.at_least == 0 {
                total += count;
                continue;
            }
            let sequences = planned.handed_out.unwrap_or(planned.at_least);
            let filled = sequences.saturating_mul(capacity);
            // Full sequences of the slot's documents in order: what they
            // ended and the part of the one they cut (less than all of it)
            // fill them exactly.
            let cut_one = filled
                .checked_sub(ended)
                .is_some_and(|part| part < longest_left.max(1));
            if sequences >= planned.at_least || !cut_one {
                return Err(Unaccounted { slot, first, count });
            }
            total += count;
        }
        Ok(total)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;
    use crate::text::counts::tests::shard;

    /// A document: `(shard, index)`.
    type Document = (usize, u64);

    const OPTIONS: PlanOptions = PlanOptions {
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
        let packing = Packing::from_option(&option, &shards).expect("counted, concat");
        assert_eq!(packing.spec, spec);
        let (handed, left) = concat_handed(&packing);
        let count = left.iter().map(Vec::len).sum::<usize>() as u64;
        assert!(count > 0, "some slot packs more than it hands out");
        let found = packing.left_out(OPTIONS, 0, (2, 2), |s, i| handed.contains(&(s, i)));
        assert_eq!(found, Ok(count));
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
        // Another mode, or an option recorded as text, replays nothing.
        let best_fit = serde_json::json!({"seq_len": 7, "mode": "best_fit", "field": "ids"});
        assert!(Packing::from_option(&best_fit, &shards).is_none());
        assert!(Packing::from_option(&serde_json::json!("Pack(seq_len=7)"), &shards).is_none());
    }
}
