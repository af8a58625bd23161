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

use crate::config::StreamOptions;
use crate::decode::Decoder;
use crate::error::{Error, Result};
use crate::format::SampleId;
use crate::plan::{SlotSpec, WorkUnit};
use crate::shard::{Shard, ShardKind};
use crate::text::pack::{PackSpec, PackState};

/// Checks that a packed stream of `options` over `shards` on `world_size`
/// ranks can plan its sequences: on one rank it needs nothing; across
/// ranks every shard's manifest entry must give each document's token
/// count of the packed field, counted with the dataset's tokenizer of that
/// field (or without one, when the field holds ids already).
pub fn check_counted(shards: &[Shard], options: &StreamOptions, world_size: usize) -> Result<()> {
    let Some(spec) = &options.pack else {
        return Ok(());
    };
    if world_size <= 1 {
        return Ok(());
    }
    let field = spec.field_name();
    let tokenizer = match options.decode.decoder_for(field) {
        Some(Decoder::Tokenizer(tokenizer)) => Some(tokenizer.to_string()),
        _ => None,
    };
    let index_command = match &tokenizer {
        Some(_) => format!(
            "`shardstream index SPEC -o manifest.json --count-tokens {field} --tokenizer \
             tokenizer.json` (with the Tokenizer's --bos, --eos, --no-special-tokens)"
        ),
        None => format!("`shardstream index SPEC -o manifest.json --count-tokens {field}`"),
    };
    for shard in shards {
        if matches!(shard.kind, ShardKind::Parquet(_)) {
            return Err(Error::Config {
                name: "pack",
                reason: format!(
                    "across {world_size} ranks every rank must hand out the same number of \
                     sequences, planned from each document's token count in the manifest, and \
                     {} is a Parquet row group, whose token counts no manifest records yet: \
                     pack Parquet text on one rank",
                    shard.url
                ),
            });
        }
        let tokens = shard.index.as_ref().and_then(|index| index.tokens());
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
                "across {world_size} ranks every rank must hand out the same number of \
                 sequences, planned from each document's token count in the manifest; for \
                 shard {}, {reason}: index the dataset with {index_command}",
                shard.url
            ),
        });
    }
    Ok(())
}

/// The token count the manifest records for document `id`, if any.
pub fn recorded(shards: &[Shard], id: SampleId) -> Option<u64> {
    let tokens = shards.get(id.shard)?.index.as_ref()?.tokens()?;
    tokens.counts.get(usize::try_from(id.index).ok()?).copied()
}

/// Tokens of the documents of `units` (0 for a document without a count,
/// which [`check_counted`] rules out).
pub fn tokens_of_units(shards: &[Shard], units: &[WorkUnit]) -> u64 {
    units
        .iter()
        .map(|unit| {
            let Some(tokens) = shards[unit.shard].index.as_ref().and_then(|i| i.tokens()) else {
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
            counts[range].iter().sum::<u64>()
        })
        .sum()
}

/// Tokens held by the pieces of a saved packer.
pub fn tokens_of_state(state: &PackState) -> u64 {
    state
        .ready
        .iter()
        .chain(&state.open)
        .flatten()
        .map(|piece| piece[3].saturating_sub(piece[2]))
        .sum()
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
            let tokens = tokens_of_units(shards, &units[at]) + carried(at);
            tokens.div_ceil(capacity)
        })
        .min()
        .unwrap_or(0)
}
