//! The serde model of a saved slot state: [`SlotState`] and its
//! [`Cursor`], the format and version every state carries, and the parsing
//! of the fields held as text (the RNG word position, the digest).

use std::fmt::Display;

use serde::{Deserialize, Serialize};

use super::digest::P;
use crate::error::{Error, Result};
use crate::format::SampleId;
use crate::plan::{self, SlotSpec};
use crate::text::pack::PackState;

/// The `format` field of every state.
pub const STATE_FORMAT: &str = "shardstream.state";
/// The state version this build reads and writes.
pub const STATE_VERSION: u32 = 2;
/// A state's epoch is below this, as `set_epoch`'s is: the top bit of an
/// epoch table entry says that its process has a loaded state pending, and
/// the epoch after the last one must fit below it too.
pub const EPOCH_LIMIT: u64 = (1 << 63) - 1;

/// Where a slot's reading stands: the next sample to read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Cursor {
    /// Position of the current work unit in the slot's unit list.
    pub unit: usize,
    /// Index in its shard of the next sample to read; `None` at the unit's start.
    pub next_sample: Option<u64>,
}

/// The state of one slot's stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlotState {
    /// Always [`STATE_FORMAT`].
    pub format: String,
    /// Always [`STATE_VERSION`].
    pub version: u32,
    /// Fingerprint of the dataset and the options that shape the epoch.
    pub fingerprint: String,
    /// What the fingerprint covers, part by part
    /// (`shards=<8 hex>,<option>=<8 hex>,...`, as the checker's
    /// `Fingerprint` renders them):
    /// names what differs when the fingerprint does. Empty (absent from
    /// the JSON) in states saved before it.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub fingerprint_parts: String,
    /// Epoch.
    pub epoch: u64,
    /// Number of processes.
    pub world_size: usize,
    /// Rank.
    pub rank: usize,
    /// Workers per process.
    pub num_workers: usize,
    /// Worker id.
    pub worker_id: usize,
    /// Samples this slot has handed out.
    pub produced: u64,
    /// Samples of this slot's units passed over because their shard was
    /// skipped under `on_error="warn"` (counted where sample counts are known).
    pub skipped: u64,
    /// Next sample to read.
    pub cursor: Cursor,
    /// Ids `[shard, index]` held by the shuffle buffer, in buffer order.
    pub buffer: Vec<[u64; 2]>,
    /// The shuffle RNG's word position (decimal).
    pub rng_word_pos: String,
    /// Order-independent checksum (16 hex digits) of the ids of the samples
    /// handed out or skipped.
    pub digest: String,
    /// The slot has handed out its last sample.
    pub finished: bool,
    /// When this epoch was itself resumed elastically: the states it resumed from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resumed_from: Option<Vec<SlotState>>,
    /// With `pack`: the documents the packer held (handed out by the
    /// stream, not yet in a sequence handed out), as pieces. Absent when it
    /// held none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pack: Option<PackState>,
    /// With `pack` across ranks: the sequences the slot still hands out
    /// this epoch (planned from the manifest's token counts, equal for
    /// every rank's slot of this worker). Absent on one rank.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sequences_left: Option<u64>,
}

impl SlotState {
    /// Parses and checks a state's form (its fit to a dataset is checked by `resolve`).
    pub fn from_json(json: &str) -> Result<Self> {
        let value: serde_json::Value = serde_json::from_str(json)
            .map_err(|e| Error::StateMismatch(format!("not a shardstream state: {e}")))?;
        // The format and version first, so that a state of another version
        // is named as such rather than by the first field it lacks.
        let format = value.get("format").and_then(|v| v.as_str());
        let version = value.get("version").and_then(|v| v.as_u64());
        if let (Some(STATE_FORMAT), Some(version)) = (format, version) {
            if version != u64::from(STATE_VERSION) {
                return Err(Error::StateMismatch(format!(
                    "state field version: this build reads version {STATE_VERSION} states, \
                     the state is version {version} (saved by another shardstream version)"
                )));
            }
        }
        let state: SlotState = serde_json::from_value(value)
            .map_err(|e| Error::StateMismatch(format!("not a shardstream state: {e}")))?;
        state.check_format()?;
        Ok(state)
    }

    /// The state as JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("a state serialises")
    }

    fn check_format(&self) -> Result<()> {
        if self.format != STATE_FORMAT || self.version != STATE_VERSION {
            return Err(Error::StateMismatch(format!(
                "expected format {STATE_FORMAT:?} version {STATE_VERSION}, got {:?} version {}",
                self.format, self.version
            )));
        }
        if self.epoch >= EPOCH_LIMIT {
            return Err(field_error(
                "",
                "epoch",
                format!("{} is not below 2^63 - 1", self.epoch),
            ));
        }
        if let Some(from) = &self.resumed_from {
            from.iter().try_for_each(SlotState::check_format)?;
        }
        Ok(())
    }

    /// The slot layout the state was saved with.
    pub fn slot(&self) -> Result<SlotSpec> {
        self.checked_slot("")
    }

    /// The slot layout, each number checked; `prefix` names the state in errors.
    pub(super) fn checked_slot(&self, prefix: &str) -> Result<SlotSpec> {
        if self.world_size == 0 {
            return Err(field_error(prefix, "world_size", "must be at least 1"));
        }
        if self.world_size > plan::slot::MAX_WORLD_SIZE {
            return Err(field_error(
                prefix,
                "world_size",
                format!(
                    "{} is above {}",
                    self.world_size,
                    plan::slot::MAX_WORLD_SIZE
                ),
            ));
        }
        if self.num_workers == 0 {
            return Err(field_error(prefix, "num_workers", "must be at least 1"));
        }
        if self.world_size.saturating_mul(self.num_workers) > plan::slot::MAX_SLOTS {
            return Err(field_error(
                prefix,
                "num_workers",
                format!(
                    "{} x world_size {} is above {} slots",
                    self.num_workers,
                    self.world_size,
                    plan::slot::MAX_SLOTS
                ),
            ));
        }
        if self.rank >= self.world_size {
            return Err(field_error(
                prefix,
                "rank",
                format!("{} is not below world_size {}", self.rank, self.world_size),
            ));
        }
        if self.worker_id >= self.num_workers {
            return Err(field_error(
                prefix,
                "worker_id",
                format!(
                    "{} is not below num_workers {}",
                    self.worker_id, self.num_workers
                ),
            ));
        }
        Ok(SlotSpec {
            world_size: self.world_size,
            rank: self.rank,
            num_workers: self.num_workers,
            worker_id: self.worker_id,
        })
    }

    /// Held sample ids.
    pub fn buffer_ids(&self) -> Vec<SampleId> {
        self.buffer
            .iter()
            .map(|&[shard, index]| SampleId {
                shard: usize::try_from(shard).unwrap_or(usize::MAX),
                index,
            })
            .collect()
    }

    /// The RNG word position.
    pub fn word_pos(&self) -> Result<u128> {
        parse_decimal(&self.rng_word_pos).ok_or_else(|| {
            field_error(
                "",
                "rng_word_pos",
                format!(
                    "{:?} is not a decimal number below 2^128",
                    self.rng_word_pos
                ),
            )
        })
    }

    /// The checksum of the samples handed out or skipped.
    pub fn digest_value(&self) -> Result<u64> {
        parse_digest(&self.digest).ok_or_else(|| {
            field_error(
                "",
                "digest",
                format!(
                    "{:?} is not 16 hexadecimal digits below 2^61 - 1",
                    self.digest
                ),
            )
        })
    }
}

/// The error for a state field; `prefix` names the state within a list
/// (`slots[2].`, `resumed_from[0].`), empty for a single state.
pub(super) fn field_error(prefix: &str, field: &str, reason: impl Display) -> Error {
    Error::StateMismatch(format!("state field {prefix}{field}: {reason}"))
}

pub(super) fn parse_decimal(text: &str) -> Option<u128> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

pub(super) fn parse_digest(text: &str) -> Option<u64> {
    if text.len() != 16 || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u64::from_str_radix(text, 16).ok().filter(|&d| d < P)
}

/// A digest as the state's 16 hex digits.
pub(crate) fn format_digest(digest: u64) -> String {
    format!("{digest:016x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_json_round_trips() {
        let state = SlotState {
            format: STATE_FORMAT.into(),
            version: STATE_VERSION,
            fingerprint: "00ff".into(),
            fingerprint_parts: "shards=00001234,seed=0000abcd".into(),
            epoch: 3,
            world_size: 2,
            rank: 1,
            num_workers: 2,
            worker_id: 0,
            produced: 17,
            skipped: 2,
            cursor: Cursor {
                unit: 1,
                next_sample: Some(4),
            },
            buffer: vec![[1, 2], [0, 9]],
            rng_word_pos: u128::MAX.to_string(),
            digest: format_digest(P - 1),
            finished: false,
            resumed_from: None,
            pack: Some(crate::text::pack::PackState {
                ready: vec![vec![[1, 2, 0, 5]]],
                open: vec![vec![[0, 9, 3, 4], [1, 2, 5, 6]]],
            }),
            sequences_left: Some(3),
        };
        let back = SlotState::from_json(&state.to_json()).unwrap();
        assert_eq!(back, state);
        assert_eq!(back.word_pos().unwrap(), u128::MAX);
        assert_eq!(back.digest_value().unwrap(), P - 1);
        let beyond = SlotState {
            digest: format_digest(P),
            ..state.clone()
        };
        assert!(beyond.digest_value().is_err());
        assert!(SlotState::from_json("{}").is_err());
        let bad_slot = SlotState {
            rank: 2,
            ..state.clone()
        };
        let err = bad_slot.slot().unwrap_err();
        assert!(matches!(err, Error::StateMismatch(_)), "{err}");
        assert!(err.to_string().contains("field rank"), "{err}");
        // A layout past the limits is refused before anything is planned for it.
        for (world_size, num_workers, field) in [
            (100_000_000_000, 1, "field world_size"),
            (1 << 20, 1 << 10, "field num_workers"),
        ] {
            let huge = SlotState {
                world_size,
                num_workers,
                rank: 0,
                worker_id: 0,
                ..state.clone()
            };
            let err = huge.slot().unwrap_err();
            assert!(err.to_string().contains(field), "{err}");
        }
    }
}
