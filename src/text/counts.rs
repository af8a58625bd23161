//! Packing across ranks: the sequences each slot hands out in an epoch,
//! planned before any byte is read from the documents' token counts (what
//! `shardstream index --count-tokens` records in the manifest).
//!
//! A slot whose documents (and the pieces a resumed packer carries) hold
//! `T` tokens makes at least `ceil(T / (seq_len + 1))` sequences, in either
//! mode: no sequence holds more than `seq_len + 1` tokens. Every slot of
//! worker `w` hands out the least of that bound over the ranks, so every
//! rank takes the same number of steps; what a slot would make past it is
//! left out of the epoch (the remainder: a few sequences per worker).

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::plan::{SampleWeights, SlotSpec, WorkUnit};
use crate::shard::{Shard, ShardKind, ShardTokens};
use crate::text::pack::{PackSpec, PackState};

/// The documents' token counts as the plan weighs them: a packed dataset
/// whose shards all have them cuts each slot near-equal tokens, so that
/// the slots' sequence counts differ little and few are left out.
struct TokenWeights(Vec<Arc<ShardTokens>>);

impl SampleWeights for TokenWeights {
    fn weight(&self, shard: usize, index: u64) -> u64 {
        usize::try_from(index)
            .ok()
            .and_then(|i| self.0.get(shard)?.counts.get(i).copied())
            .unwrap_or(0)
    }
}

/// The weights a packed dataset's plans cut by: its documents' token
/// counts when every shard has them, of the packed field and tokenizer
/// ([`check_counted`]); `None` otherwise (the plans cut by documents).
pub fn token_weights(
    shards: &[Shard],
    spec: &PackSpec,
    tokenizer: Option<String>,
) -> Option<Arc<dyn SampleWeights>> {
    check_counted(shards, spec, tokenizer, true).ok()?;
    let counts = shards
        .iter()
        .map(|shard| shard.tokens().cloned())
        .collect::<Option<Vec<_>>>()?;
    Some(Arc::new(TokenWeights(counts)))
}

/// Checks that a stream packing by `spec` over `shards` can plan its
/// sequences when it is `planned` to (across ranks, or in a mixture:
/// the stream options' `plans_sequences`); otherwise it needs
/// nothing. Planned, every shard's manifest entry must give each document's token
/// count of the packed field, counted with `tokenizer` (the dataset's
/// tokenizer of that field, as a manifest names it; `None` when the field
/// holds ids already).
pub fn check_counted(
    shards: &[Shard],
    spec: &PackSpec,
    tokenizer: Option<String>,
    planned: bool,
) -> Result<()> {
    if !planned {
        return Ok(());
    }
    let field = spec.field_name();
    let format = if shards
        .iter()
        .any(|s| matches!(s.kind, ShardKind::Parquet(_)))
    {
        " --format parquet"
    } else {
        ""
    };
    let index_command = match &tokenizer {
        Some(_) => format!(
            "`shardstream index SPEC -o manifest.json{format} --count-tokens {field} \
             --tokenizer tokenizer.json` (with the Tokenizer's --bos, --eos, \
             --no-special-tokens)"
        ),
        None => format!("`shardstream index SPEC -o manifest.json{format} --count-tokens {field}`"),
    };
    for shard in shards {
        let tokens = shard.tokens();
        let reason = match tokens {
            None => "it has no token counts".to_owned(),
            Some(tokens) if tokens.field != field => {
                format!("its token counts are of field {:?}", tokens.field)
            }
            Some(tokens) if tokens.tokenizer != tokenizer => format!(
                "its token counts were made with {}, the dataset tokenizes with {}",
                tokens.tokenizer.as_deref().unwrap_or("no tokenizer"),
                tokenizer.as_deref().unwrap_or("no tokenizer")
            ),
            Some(_) => continue,
        };
        return Err(Error::Config {
            name: "pack",
            reason: format!(
                "across ranks (and in a mixture) a packed stream hands out the number of \
                 sequences planned from each document's token count in the manifest, so that \
                 every rank hands out as many; for shard {}, {reason}: index the dataset with \
                 {index_command}",
                shard.url
            ),
        });
    }
    Ok(())
}

/// Tokens of the documents of `units` (0 for a document without a count,
/// which [`check_counted`] rules out).
pub fn tokens_of_units(shards: &[Shard], units: &[WorkUnit]) -> u64 {
    units
        .iter()
        .map(|unit| {
            let Some(tokens) = shards[unit.shard].tokens() else {
                return 0;
            };
            let counts = &tokens.counts;
            let range = match &unit.samples {
                Some(samples) => {
                    let end = (samples.end as usize).min(counts.len());
                    (samples.start as usize).min(end)..end
                }
                None => 0..counts.len(),
            };
            counts[range]
                .iter()
                .fold(0u64, |sum, &n| sum.saturating_add(n))
        })
        .fold(0u64, u64::saturating_add)
}

/// Tokens held by the pieces of a saved packer.
pub fn tokens_of_state(state: &PackState) -> u64 {
    state
        .ready
        .iter()
        .chain(&state.open)
        .flatten()
        .map(|piece| piece[3].saturating_sub(piece[2]))
        .fold(0u64, u64::saturating_add)
}

/// The sequences `slot` hands out this epoch: the least, over the ranks,
/// of the sequences its worker's slot of that rank makes at least, given
/// each slot's units (`units[rank * num_workers + worker]`) and the tokens
/// its resumed packer carries (`carried(slot index)`).
pub fn sequences_of_slot(
    shards: &[Shard],
    spec: &PackSpec,
    units: &[Vec<WorkUnit>],
    carried: impl Fn(usize) -> u64,
    slot: &SlotSpec,
) -> u64 {
    let capacity = spec.capacity() as u64;
    (0..slot.world_size)
        .map(|rank| rank * slot.num_workers + slot.worker_id)
        .map(|at| {
            let tokens = tokens_of_units(shards, &units[at]).saturating_add(carried(at));
            tokens.div_ceil(capacity)
        })
        .min()
        .unwrap_or(0)
}

/// What one slot of a packed epoch holds: its documents, their tokens, the
/// sequences it packs at least (`ceil(tokens / (seq_len + 1))`), and,
/// across ranks, the sequences it hands out ([`sequences_of_slot`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackedSlot {
    /// Documents of the slot's units.
    pub documents: u64,
    /// Their tokens.
    pub tokens: u64,
    /// The fewest sequences the slot's packer makes of them.
    pub at_least: u64,
    /// The sequences the slot hands out when they are planned (across
    /// ranks): the least of `at_least` over the ranks' slots of its worker.
    pub handed_out: Option<u64>,
}

/// Every slot's [`PackedSlot`] of a fresh epoch whose slots
/// (`rank * num_workers + worker`) read `units` of `shards`, packed by
/// `spec` from the token counts [`check_counted`] checked; the sequences
/// are planned when `world_size > 1`, as a packed stream plans them
/// ([`sequences_of_slot`], each slot's bound taken once here).
pub fn packed_slots(
    shards: &[Shard],
    spec: &PackSpec,
    units: &[Vec<WorkUnit>],
    world_size: usize,
) -> Vec<PackedSlot> {
    let num_workers = (units.len() / world_size.max(1)).max(1);
    let capacity = spec.capacity() as u64;
    let mut slots: Vec<PackedSlot> = units
        .iter()
        .map(|slot_units| {
            let documents = slot_units
                .iter()
                .map(|unit| match &unit.samples {
                    Some(samples) => samples.end - samples.start,
                    None => shards[unit.shard].info().samples.unwrap_or(0),
                })
                .fold(0u64, u64::saturating_add);
            let tokens = tokens_of_units(shards, slot_units);
            PackedSlot {
                documents,
                tokens,
                at_least: tokens.div_ceil(capacity),
                handed_out: None,
            }
        })
        .collect();
    if world_size > 1 {
        let least: Vec<u64> = (0..num_workers)
            .map(|worker| {
                slots
                    .iter()
                    .skip(worker)
                    .step_by(num_workers)
                    .map(|slot| slot.at_least)
                    .min()
                    .unwrap_or(0)
            })
            .collect();
        for (at, slot) in slots.iter_mut().enumerate() {
            slot.handed_out = Some(least[at % num_workers]);
        }
    }
    slots
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::shard::SampleIndex;
    use crate::shard::ShardTokens;
    use crate::text::pack::PackMode;

    /// A JSON-lines shard whose documents hold `counts` tokens of `ids`,
    /// counted without a tokenizer (`None`: no counts).
    pub(crate) fn shard(url: &str, counts: Option<Vec<u64>>) -> Shard {
        let n = counts.as_ref().map_or(2, Vec::len) as u64;
        let index = SampleIndex::from_parts((0..n).collect(), vec![1; n as usize], None)
            .unwrap()
            .with_tokens(counts.map(|counts| {
                Arc::new(ShardTokens {
                    field: "ids".into(),
                    tokenizer: None,
                    counts,
                })
            }));
        Shard {
            kind: ShardKind::Lines,
            index: Some(Arc::new(index)),
            ..Shard::new(url, Some(n))
        }
    }

    fn spec(field: &str) -> PackSpec {
        PackSpec::new(Some(field.into()), 7, PackMode::Concat, false, 0).unwrap()
    }

    fn unit(shard: usize, samples: std::ops::Range<u64>) -> WorkUnit {
        WorkUnit {
            shard,
            samples: Some(samples),
        }
    }

    #[test]
    fn each_worker_hands_out_the_least_over_the_ranks() {
        let shards = vec![
            shard("a.jsonl", Some(vec![8, 8, 8, 1])),
            shard("b.jsonl", Some(vec![20, 3])),
        ];
        let spec = spec("ids");
        // Two ranks of two workers; slot = rank * 2 + worker.
        let units = vec![
            vec![unit(0, 0..2)],                // 16 tokens: 2 sequences of 8
            vec![unit(0, 2..4)],                // 9 tokens: 2
            vec![unit(1, 0..1)],                // 20 tokens: 3
            vec![unit(1, 1..2), unit(0, 3..4)], // 4 tokens: 1
        ];
        let of = |rank, worker| {
            let slot = SlotSpec::new(2, rank, 2, worker).unwrap();
            sequences_of_slot(&shards, &spec, &units, |_| 0, &slot)
        };
        assert_eq!([of(0, 0), of(1, 0)], [2, 2]);
        assert_eq!([of(0, 1), of(1, 1)], [1, 1]);
        // Tokens a resumed packer carries count too.
        let slot = SlotSpec::new(2, 1, 2, 1).unwrap();
        let carried = |at: usize| if at == 3 { 13 } else { 0 };
        assert_eq!(sequences_of_slot(&shards, &spec, &units, carried, &slot), 2);
        assert_eq!(
            tokens_of_units(
                &shards,
                &[WorkUnit {
                    shard: 1,
                    samples: None
                }]
            ),
            23
        );
        let state = PackState {
            ready: vec![vec![[0, 0, 0, 8]]],
            open: vec![vec![[0, 1, 2, 5], [1, 1, 0, 3]]],
        };
        assert_eq!(tokens_of_state(&state), 14);
    }

    #[test]
    fn packed_slots_count_documents_tokens_and_the_planned_sequences() {
        let shards = vec![
            shard("a.jsonl", Some(vec![8, 8, 8, 1])),
            shard("b.jsonl", Some(vec![20, 3])),
        ];
        let spec = spec("ids");
        let units = vec![
            vec![unit(0, 0..2)],
            vec![unit(0, 2..4)],
            vec![unit(1, 0..1)],
            vec![unit(1, 1..2), unit(0, 3..4)],
        ];
        let slot = |documents, tokens, at_least, handed_out| PackedSlot {
            documents,
            tokens,
            at_least,
            handed_out,
        };
        // The same as each slot's stream plans.
        for at in 0..4 {
            let slot = SlotSpec::new(2, at / 2, 2, at % 2).unwrap();
            let planned = sequences_of_slot(&shards, &spec, &units, |_| 0, &slot);
            assert_eq!(
                packed_slots(&shards, &spec, &units, 2)[at].handed_out,
                Some(planned)
            );
        }
        assert_eq!(
            packed_slots(&shards, &spec, &units, 2),
            [
                slot(2, 16, 2, Some(2)),
                slot(2, 9, 2, Some(1)),
                slot(1, 20, 3, Some(2)),
                slot(2, 4, 1, Some(1)),
            ]
        );
        // One rank: nothing is planned, every slot hands out what it packs.
        let whole = vec![vec![
            WorkUnit {
                shard: 1,
                samples: None,
            },
            unit(0, 0..4),
        ]];
        assert_eq!(
            packed_slots(&shards, &spec, &whole, 1),
            [slot(6, 48, 6, None)]
        );
    }

    #[test]
    fn packing_across_ranks_needs_counts_of_the_packed_field() {
        let counted = vec![
            shard("a.jsonl", Some(vec![1, 2])),
            shard("b.jsonl", Some(vec![3])),
        ];
        check_counted(&counted, &spec("ids"), None, true).unwrap();
        let refused = |shards: &[Shard], field: &str| {
            check_counted(shards, &spec(field), None, true)
                .unwrap_err()
                .to_string()
        };
        let bare = vec![counted[0].clone(), shard("b.jsonl", None)];
        let error = refused(&bare, "ids");
        assert!(
            error.contains("option pack") && error.contains("across ranks (and in a mixture)"),
            "{error}"
        );
        assert!(
            error.contains("shard b.jsonl, it has no token counts"),
            "{error}"
        );
        assert!(error.contains("--count-tokens ids`"), "{error}");
        assert!(refused(&counted, "text").contains("token counts are of field \"ids\""));
        let tokenized = check_counted(
            &counted,
            &spec("ids"),
            Some("Tokenizer(digest=0x2)".into()),
            true,
        )
        .unwrap_err()
        .to_string();
        assert!(
            tokenized.contains(
                "made with no tokenizer, the dataset tokenizes with Tokenizer(digest=0x2)"
            ),
            "{tokenized}"
        );
        assert!(
            tokenized.contains("--count-tokens ids --tokenizer tokenizer.json"),
            "{tokenized}"
        );
        // One rank plans nothing.
        check_counted(&bare, &spec("ids"), None, false).unwrap();
    }
}
