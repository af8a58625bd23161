//! The ledger on disk: one folder per generation (`gen-000000/`) holding
//! `meta.json` and one append-only file of step records per rank
//! (`rank-00000.bin`), read back whole. A record cut short at the end of a
//! file (the writer died mid-write) is left out and reported, never read.
//!
//! A record, little-endian: `u64` step, `u64` epoch, `u32` count, `u32`
//! kind ([`RecordKind`], with [`NARROW_IDS`] set when the ids are narrow),
//! then `count` sample ids, each a shard index and an index in the shard:
//! `u64` and `u64`, or `u32` and `u32` when narrow.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The `format` field of every generation's `meta.json`.
pub const LEDGER_FORMAT: &str = "shardstream.ledger";
/// The ledger version this build writes (in its tests) and reads, with the
/// versions before it: version 2 added [`NARROW_IDS`].
pub const LEDGER_VERSION: u32 = 2;
/// Bytes of a record's header (step, epoch, count, kind).
pub const HEADER_BYTES: usize = 24;
/// Bytes of one sample id in a record.
pub const ID_BYTES: usize = 16;
/// Bytes of one narrow sample id in a record.
pub const NARROW_ID_BYTES: usize = 8;
/// The bit of a record's kind that says its ids are narrow (`u32` shard
/// index and `u32` index in the shard; version 2 on).
pub const NARROW_IDS: u32 = 0x100;

/// A ledger that cannot be read: the file and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadError {
    /// The file or folder.
    pub path: String,
    /// What is wrong, and how to fix it where that can be said.
    pub reason: String,
}

impl fmt::Display for ReadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.reason)
    }
}

impl std::error::Error for ReadError {}

fn read_error(path: &Path, reason: impl Into<String>) -> ReadError {
    ReadError {
        path: path.display().to_string(),
        reason: reason.into(),
    }
}

/// What the dataset of a ledger was: what replaying its plan needs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DatasetMeta {
    /// The dataset spec, as given to the dataset.
    pub spec: Vec<String>,
    /// The options that decide the order of samples (and how the shards
    /// are found): `seed`, `shuffle_shards`, `remainder`, `manifest`,
    /// `format`, ...
    #[serde(default)]
    pub options: serde_json::Map<String, serde_json::Value>,
    /// Number of shards the dataset resolved to.
    #[serde(default)]
    pub shards: Option<usize>,
    /// Samples in one epoch, when every shard's count was known.
    #[serde(default)]
    pub samples: Option<u64>,
    /// The resume-state fingerprint of the dataset and options, if known.
    #[serde(default)]
    pub fingerprint: Option<String>,
    /// For a `Mix`: its streams and how it mixes them (`spec` and
    /// `options` are then empty). Its sample ids are [`MixMeta::id`]s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mix: Option<MixMeta>,
}

/// What a `Mix` was: its streams (each as a dataset's meta) and the
/// mixture's policy, weights and seed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MixMeta {
    /// Each stream's dataset.
    pub streams: Vec<DatasetMeta>,
    /// The streams' weights when the ledger was made.
    pub weights: Vec<f64>,
    /// `stop`, `restart` or `continue`.
    pub policy: String,
    /// The mixture's seed.
    pub seed: u64,
    /// The weights each epoch mixed by, as the ledger wrote them when it
    /// recorded the epoch's first step (`Mix.set_weights` changes them
    /// between epochs).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub weights_by_epoch: BTreeMap<u64, Vec<f64>>,
}

impl MixMeta {
    /// Whether `other` is the same mixture (streams, policy and seed),
    /// whatever weights each recorded.
    pub fn same_mixture(&self, other: &MixMeta) -> bool {
        (&self.streams, &self.policy, self.seed) == (&other.streams, &other.policy, other.seed)
    }

    /// The shard part of a mixture sample's id: pass `pass` over stream
    /// `stream`'s shard `shard`, the streams' shards numbered one after the
    /// other (`offsets[s]`: the shards of the streams before `s`; `total`:
    /// all of them). The id's epoch is the mixture's, its index the
    /// sample's in the shard.
    pub fn id(total: u64, offset: u64, pass: u64, shard: u64) -> u64 {
        pass * total + offset + shard
    }
}

impl DatasetMeta {
    /// Option `name` as a JSON value (`null` when not recorded).
    pub fn option(&self, name: &str) -> &serde_json::Value {
        self.options.get(name).unwrap_or(&serde_json::Value::Null)
    }
}

/// A generation's `meta.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Meta {
    /// Always [`LEDGER_FORMAT`].
    pub format: String,
    /// [`LEDGER_VERSION`] or an earlier version.
    pub version: u32,
    /// The generation's number (its folder's).
    pub generation: u64,
    /// The first step this generation records: its records of this step
    /// and later supersede every earlier generation's.
    pub start_step: u64,
    /// Ranks of the job.
    pub world_size: usize,
    /// DataLoader workers per rank.
    pub num_workers: usize,
    /// Whether `num_workers` was given or read from the loader (`track`),
    /// rather than taken as 1: what replays each worker's slot relies on.
    #[serde(default)]
    pub num_workers_known: bool,
    /// The dataset.
    pub dataset: DatasetMeta,
}

/// What a record says of its step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RecordKind {
    /// The step trained on its samples.
    Trained,
    /// The step's samples were drawn and deliberately not trained on
    /// (`Ledger.skip_steps`).
    Skipped,
    /// The rank reached the end of the epoch (no samples).
    EpochEnd,
}

impl RecordKind {
    fn from_code(code: u32) -> Option<Self> {
        match code {
            0 => Some(RecordKind::Trained),
            1 => Some(RecordKind::Skipped),
            2 => Some(RecordKind::EpochEnd),
            _ => None,
        }
    }

    /// The kind's code in a record.
    pub fn code(self) -> u32 {
        match self {
            RecordKind::Trained => 0,
            RecordKind::Skipped => 1,
            RecordKind::EpochEnd => 2,
        }
    }
}

/// One step of one rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// The optimizer step.
    pub step: u64,
    /// The epoch of the step's samples.
    pub epoch: u64,
    /// What the record says.
    pub kind: RecordKind,
    /// The samples, as `(shard index, index in shard)`.
    pub ids: Vec<(u64, u64)>,
}

impl Record {
    /// The record's bytes, as the writer appends them.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut bytes = Vec::with_capacity(HEADER_BYTES + ID_BYTES * self.ids.len());
        bytes.extend_from_slice(&self.step.to_le_bytes());
        bytes.extend_from_slice(&self.epoch.to_le_bytes());
        let count = u32::try_from(self.ids.len()).expect("at most u32::MAX samples a step");
        bytes.extend_from_slice(&count.to_le_bytes());
        bytes.extend_from_slice(&self.kind.code().to_le_bytes());
        for (shard, index) in &self.ids {
            bytes.extend_from_slice(&shard.to_le_bytes());
            bytes.extend_from_slice(&index.to_le_bytes());
        }
        bytes
    }
}

/// A record to encode: its head, and how many of the ids that follow in
/// the columns are its samples (0 for an epoch's end).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordHead {
    /// The optimizer step.
    pub step: u64,
    /// The epoch of the step's samples; `None`: its first sample's.
    pub epoch: Option<u64>,
    /// What the record says.
    pub kind: RecordKind,
    /// Its samples.
    pub count: usize,
}

/// A step whose samples are not all of the record's epoch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MixedEpochs {
    /// The step.
    pub step: u64,
    /// The epochs its samples are of, ascending.
    pub epochs: Vec<u64>,
}

impl fmt::Display for MixedEpochs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "a step's samples come from one epoch; step {} has samples of epochs {:?}",
            self.step, self.epochs
        )
    }
}

/// Appends the bytes of `heads`' records to `out`, as the writer appends
/// them: each head, then its `count` ids, taken in turn from `id(i)` =
/// `(epoch, shard, index)` for `i` in `0..` the heads' total count; narrow
/// ([`NARROW_IDS`]) when each of a record's shard indices and indices fits
/// in a `u32`. Every id's epoch must be its record's: otherwise nothing is
/// appended.
pub fn encode_records(
    heads: &[RecordHead],
    id: impl Fn(usize) -> (u64, u64, u64),
    out: &mut Vec<u8>,
) -> Result<(), MixedEpochs> {
    let total: usize = heads.iter().map(|h| h.count).sum();
    let start = out.len();
    out.reserve(heads.len() * HEADER_BYTES + total * NARROW_ID_BYTES);
    let mut next = 0usize;
    for head in heads {
        let ids = next..next + head.count;
        next = ids.end;
        let epoch = match head.epoch {
            Some(epoch) => epoch,
            None if head.count > 0 => id(ids.start).0,
            None => 0,
        };
        let mut narrow = head.count > 0;
        let mut mixed = false;
        for i in ids.clone() {
            let (of, shard, index) = id(i);
            mixed |= of != epoch;
            narrow &= (shard | index) >> 32 == 0;
        }
        if mixed {
            out.truncate(start);
            let mut epochs: Vec<u64> = ids.map(|i| id(i).0).collect();
            epochs.sort_unstable();
            epochs.dedup();
            return Err(MixedEpochs {
                step: head.step,
                epochs,
            });
        }
        let count = u32::try_from(head.count).expect("at most u32::MAX samples a step");
        let code = head.kind.code() | if narrow { NARROW_IDS } else { 0 };
        out.extend_from_slice(&head.step.to_le_bytes());
        out.extend_from_slice(&epoch.to_le_bytes());
        out.extend_from_slice(&count.to_le_bytes());
        out.extend_from_slice(&code.to_le_bytes());
        for i in ids {
            let (_, shard, index) = id(i);
            if narrow {
                out.extend_from_slice(&((index << 32) | shard).to_le_bytes());
            } else {
                out.extend_from_slice(&shard.to_le_bytes());
                out.extend_from_slice(&index.to_le_bytes());
            }
        }
    }
    Ok(())
}

/// The bytes at the end of a rank's file that do not make a whole record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct TornTail {
    /// Where the cut record starts.
    pub offset: u64,
    /// Its bytes present.
    pub bytes: u64,
}

/// The records of one rank's file.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RankLog {
    /// The records, in file order.
    pub records: Vec<Record>,
    /// A record cut short at the end, left out.
    pub torn: Option<TornTail>,
    /// The samples the rank's streams left out under `on_error="warn"`, and
    /// documents with no tokens no sequence carried (its skips file), in
    /// file order.
    pub error_skips: Vec<ErrorSkip>,
}

/// Samples a stream left out under `on_error="warn"`, or documents with no
/// tokens its packer had no sequence to carry ([`ErrorSkip::cause`]): a
/// line of a rank's skips file (`rank-RRRRR.skips.jsonl`), appended by the
/// process that left them out (a DataLoader worker, or the rank's own).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorSkip {
    /// The epoch (the ledger's: a mixture's for a `Mix`).
    pub epoch: u64,
    /// The shard index (the ledger's: numbered across a mixture's streams
    /// and passes for a `Mix`).
    pub shard: u64,
    /// The first sample left out.
    pub first: u64,
    /// The sample after the last left out; `None`: to the shard's end.
    pub end: Option<u64>,
    /// The DataLoader worker that met the error, if any.
    #[serde(default)]
    pub worker: Option<usize>,
    /// The error, as it was warned of.
    pub reason: String,
    /// Why the samples were left out (an error when not recorded).
    #[serde(default)]
    pub cause: SkipCause,
}

/// Why a stream left samples out ([`ErrorSkip::cause`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SkipCause {
    /// An error, under `on_error="warn"`.
    #[default]
    Error,
    /// Documents with no tokens that a packer had no sequence to carry:
    /// its stream held no other tokens.
    NoTokens,
}

impl ErrorSkip {
    /// Whether sample `(shard, index)` of `epoch` is one this skip left out.
    pub fn covers(&self, epoch: u64, (shard, index): (u64, u64)) -> bool {
        self.epoch == epoch
            && self.shard == shard
            && index >= self.first
            && self.end.is_none_or(|end| index < end)
    }
}

/// Parses a skips file's text; `path` names it in errors. A last line
/// without its newline (the writer died mid-write) is left out.
pub fn parse_error_skips(text: &str, path: &Path) -> Result<Vec<ErrorSkip>, ReadError> {
    let complete = match text.rfind('\n') {
        Some(end) => &text[..end],
        None => "",
    };
    complete
        .lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty())
        .map(|(number, line)| {
            serde_json::from_str(line).map_err(|e| {
                read_error(path, format!("line {}: not a skip record: {e}", number + 1))
            })
        })
        .collect()
}

/// Parses a rank file's bytes; `path` names it in errors. A record cut
/// short at the end is reported in [`RankLog::torn`]; a record of an
/// unknown kind is an error.
pub fn parse_records(bytes: &[u8], path: &Path) -> Result<RankLog, ReadError> {
    let mut log = RankLog::default();
    let mut at = 0usize;
    let u64_at = |i: usize| u64::from_le_bytes(bytes[i..i + 8].try_into().expect("8 bytes"));
    let u32_at = |i: usize| u32::from_le_bytes(bytes[i..i + 4].try_into().expect("4 bytes"));
    while at < bytes.len() {
        let left = bytes.len() - at;
        let torn = TornTail {
            offset: at as u64,
            bytes: left as u64,
        };
        if left < HEADER_BYTES {
            log.torn = Some(torn);
            break;
        }
        let (step, epoch, count, code) =
            (u64_at(at), u64_at(at + 8), u32_at(at + 16), u32_at(at + 20));
        let narrow = code & NARROW_IDS != 0;
        let Some(kind) = RecordKind::from_code(code & !NARROW_IDS) else {
            return Err(read_error(
                path,
                format!(
                    "the record at byte {at} has kind {code} (expected 0 trained, 1 skipped \
                     or 2 epoch end, plus {NARROW_IDS} for narrow ids): not a ledger file, \
                     or a damaged one"
                ),
            ));
        };
        if kind == RecordKind::EpochEnd && count != 0 {
            return Err(read_error(
                path,
                format!("the epoch-end record at byte {at} lists {count} samples (expected 0)"),
            ));
        }
        let id_bytes = if narrow { NARROW_ID_BYTES } else { ID_BYTES };
        let body = count as usize * id_bytes;
        if left - HEADER_BYTES < body {
            log.torn = Some(torn);
            break;
        }
        let ids = (0..count as usize)
            .map(|i| {
                let from = at + HEADER_BYTES + i * id_bytes;
                if narrow {
                    (u64::from(u32_at(from)), u64::from(u32_at(from + 4)))
                } else {
                    (u64_at(from), u64_at(from + 8))
                }
            })
            .collect();
        log.records.push(Record {
            step,
            epoch,
            kind,
            ids,
        });
        at += HEADER_BYTES + body;
    }
    Ok(log)
}

/// One generation: its meta and each rank's records.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    /// Its folder.
    pub dir: PathBuf,
    /// Its `meta.json`.
    pub meta: Meta,
    /// Each rank's records (`ranks[r]` for rank `r`; empty when the rank
    /// wrote no file).
    pub ranks: Vec<RankLog>,
}

/// The name of generation `generation`'s folder.
pub fn generation_dir_name(generation: u64) -> String {
    format!("gen-{generation:06}")
}

/// The name of rank `rank`'s file in a generation's folder.
pub fn rank_file_name(rank: usize) -> String {
    format!("rank-{rank:05}.bin")
}

/// The name of rank `rank`'s skips file in a generation's folder.
pub fn skips_file_name(rank: usize) -> String {
    format!("rank-{rank:05}.skips.jsonl")
}

/// Reads every generation of the ledger in `dir`, in generation order.
pub fn read_ledger(dir: &Path) -> Result<Vec<Generation>, ReadError> {
    let entries = std::fs::read_dir(dir).map_err(|e| {
        read_error(
            dir,
            format!("cannot list the ledger folder: {e} (give the folder passed to Ledger())"),
        )
    })?;
    let mut generations = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| read_error(dir, format!("cannot list: {e}")))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        // Folders `gen-` and decimal digits only, as `Ledger` names them
        // and looks for them (`gen-+1` or a file of such a name is not one).
        let Some(number) = name.strip_prefix("gen-") else {
            continue;
        };
        let digits = !number.is_empty() && number.bytes().all(|b| b.is_ascii_digit());
        if !digits || number.parse::<u64>().is_err() || !entry.path().is_dir() {
            continue;
        }
        // A folder left empty by a run stopped between making it and
        // writing its meta.json holds no record: nothing to verify.
        let path = entry.path();
        let empty = std::fs::read_dir(&path).is_ok_and(|mut inside| inside.next().is_none());
        if empty {
            continue;
        }
        generations.push(read_generation(&path)?);
    }
    if generations.is_empty() {
        return Err(read_error(
            dir,
            "holds no generation (gen-NNNNNN/meta.json): not a ledger folder",
        ));
    }
    generations.sort_by_key(|g| g.meta.generation);
    Ok(generations)
}

/// Reads one generation's folder.
pub fn read_generation(dir: &Path) -> Result<Generation, ReadError> {
    let meta_path = dir.join("meta.json");
    let text = std::fs::read_to_string(&meta_path)
        .map_err(|e| read_error(&meta_path, format!("cannot read: {e}")))?;
    let meta: Meta = serde_json::from_str(&text)
        .map_err(|e| read_error(&meta_path, format!("not a ledger meta.json: {e}")))?;
    if meta.format != LEDGER_FORMAT || !(1..=LEDGER_VERSION).contains(&meta.version) {
        return Err(read_error(
            &meta_path,
            format!(
                "expected format {LEDGER_FORMAT:?} version 1 to {LEDGER_VERSION}, got {:?} \
                 version {} (written by a newer shardstream?)",
                meta.format, meta.version
            ),
        ));
    }
    let expected = generation_dir_name(meta.generation);
    if dir
        .file_name()
        .is_some_and(|name| name != expected.as_str())
    {
        return Err(read_error(
            &meta_path,
            format!(
                "says generation {}, in a folder not named {expected}",
                meta.generation
            ),
        ));
    }
    // A layout no job could have (a value edited by hand) is refused
    // before anything is planned for it.
    if let Err(error) = crate::plan::SlotSpec::new(meta.world_size, 0, meta.num_workers, 0) {
        let reason = match error {
            crate::error::Error::Config { name, reason } => format!("{name}: {reason}"),
            other => other.to_string(),
        };
        return Err(read_error(&meta_path, reason));
    }
    let mut ranks = Vec::with_capacity(meta.world_size);
    for rank in 0..meta.world_size {
        let path = dir.join(rank_file_name(rank));
        let mut log = match std::fs::read(&path) {
            Ok(bytes) => parse_records(&bytes, &path)?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => RankLog::default(),
            Err(e) => return Err(read_error(&path, format!("cannot read: {e}"))),
        };
        let path = dir.join(skips_file_name(rank));
        log.error_skips = match std::fs::read_to_string(&path) {
            Ok(text) => parse_error_skips(&text, &path)?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(read_error(&path, format!("cannot read: {e}"))),
        };
        ranks.push(log);
    }
    Ok(Generation {
        dir: dir.to_owned(),
        meta,
        ranks,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(step: u64, kind: RecordKind, ids: &[(u64, u64)]) -> Record {
        Record {
            step,
            epoch: 3,
            kind,
            ids: ids.to_vec(),
        }
    }

    #[test]
    fn records_read_back_as_written() {
        let records = vec![
            record(0, RecordKind::Trained, &[(1, 2), (3, 4)]),
            record(1, RecordKind::Skipped, &[(5, 6)]),
            record(1, RecordKind::EpochEnd, &[]),
        ];
        let bytes: Vec<u8> = records.iter().flat_map(Record::to_bytes).collect();
        assert_eq!(bytes.len(), 3 * HEADER_BYTES + 3 * ID_BYTES);
        let log = parse_records(&bytes, Path::new("r")).unwrap();
        assert_eq!((log.records, log.torn), (records, None));
    }

    #[test]
    fn a_record_cut_short_is_left_out_and_reported() {
        let first = record(0, RecordKind::Trained, &[(1, 2)]).to_bytes();
        let second = record(1, RecordKind::Trained, &[(3, 4), (5, 6)]).to_bytes();
        for cut in [1, HEADER_BYTES - 1, HEADER_BYTES, second.len() - 1] {
            let bytes = [&first[..], &second[..cut]].concat();
            let log = parse_records(&bytes, Path::new("r")).unwrap();
            assert_eq!(log.records.len(), 1);
            assert_eq!(
                log.torn,
                Some(TornTail {
                    offset: first.len() as u64,
                    bytes: cut as u64
                })
            );
        }
    }

    #[test]
    fn narrow_ids_read_as_the_wide_ones() {
        let wide = record(3, RecordKind::Trained, &[(1, 2), (7, u64::from(u32::MAX))]);
        let mut narrow = wide.to_bytes()[..HEADER_BYTES].to_vec();
        narrow[20..24].copy_from_slice(&(NARROW_IDS | RecordKind::Trained.code()).to_le_bytes());
        for (shard, index) in &wide.ids {
            narrow.extend_from_slice(&(*shard as u32).to_le_bytes());
            narrow.extend_from_slice(&(*index as u32).to_le_bytes());
        }
        let log = parse_records(&narrow, Path::new("rank-00000.bin")).unwrap();
        assert_eq!((log.records, log.torn), (vec![wide], None));
        // Cut inside the narrow body: torn at the record's start.
        let log = parse_records(&narrow[..narrow.len() - 1], Path::new("r")).unwrap();
        assert_eq!(log.torn.map(|t| t.offset), Some(0));
    }

    #[test]
    fn encoded_records_read_back_narrow_where_they_fit() {
        let ids = [(3, 1, 2), (3, 7, 9), (3, 1 << 32, 0), (3, 5, 6)];
        let heads = [
            RecordHead {
                step: 4,
                epoch: None,
                kind: RecordKind::Trained,
                count: 2,
            },
            RecordHead {
                step: 5,
                epoch: Some(3),
                kind: RecordKind::Skipped,
                count: 2,
            },
            RecordHead {
                step: 5,
                epoch: Some(3),
                kind: RecordKind::EpochEnd,
                count: 0,
            },
        ];
        let mut bytes = Vec::new();
        encode_records(&heads, |i| ids[i], &mut bytes).unwrap();
        // The first record narrow, the second wide (a shard index past u32).
        assert_eq!(
            bytes.len(),
            3 * HEADER_BYTES + 2 * NARROW_ID_BYTES + 2 * ID_BYTES
        );
        let log = parse_records(&bytes, Path::new("r")).unwrap();
        let expected = vec![
            Record {
                step: 4,
                epoch: 3,
                kind: RecordKind::Trained,
                ids: vec![(1, 2), (7, 9)],
            },
            Record {
                step: 5,
                epoch: 3,
                kind: RecordKind::Skipped,
                ids: vec![(1 << 32, 0), (5, 6)],
            },
            Record {
                step: 5,
                epoch: 3,
                kind: RecordKind::EpochEnd,
                ids: vec![],
            },
        ];
        assert_eq!((log.records, log.torn), (expected, None));
    }

    #[test]
    fn a_step_of_two_epochs_is_refused_naming_the_step() {
        let ids = [(1, 0, 0), (1, 0, 1), (2, 0, 2)];
        let heads = [
            RecordHead {
                step: 0,
                epoch: None,
                kind: RecordKind::Trained,
                count: 1,
            },
            RecordHead {
                step: 1,
                epoch: None,
                kind: RecordKind::Trained,
                count: 2,
            },
        ];
        let mut bytes = b"kept".to_vec();
        let error = encode_records(&heads, |i| ids[i], &mut bytes).unwrap_err();
        assert_eq!(bytes, b"kept", "nothing appended");
        assert_eq!(
            error,
            MixedEpochs {
                step: 1,
                epochs: vec![1, 2]
            }
        );
        assert!(error
            .to_string()
            .contains("step 1 has samples of epochs [1, 2]"));
    }

    #[test]
    fn an_unknown_kind_is_an_error_naming_the_file_and_offset() {
        let mut bytes = record(0, RecordKind::Trained, &[]).to_bytes();
        bytes[20] = 9;
        let error = parse_records(&bytes, Path::new("gen-000000/rank-00000.bin")).unwrap_err();
        assert!(error.to_string().contains("rank-00000.bin"), "{error}");
        assert!(error.reason.contains("byte 0 has kind 9"), "{error}");
    }

    /// A skips file's lines parse; a last line cut short is left out; a
    /// bad line in the middle is named.
    #[test]
    fn skips_files_parse_and_a_cut_last_line_is_left_out() {
        let path = Path::new("rank-00000.skips.jsonl");
        let line =
            r#"{"epoch": 1, "shard": 2, "first": 3, "end": null, "worker": 0, "reason": "r"}"#;
        let text = format!("{line}\n{line}\n{{\"epoch\": 1, \"sh");
        let skips = parse_error_skips(&text, path).unwrap();
        assert_eq!(skips.len(), 2);
        assert!(skips[0].covers(1, (2, 3)) && skips[0].covers(1, (2, u64::MAX)));
        assert!(!skips[0].covers(1, (2, 2)) && !skips[0].covers(0, (2, 3)));
        // A line without its cause (an earlier version's) is an error's.
        assert_eq!(skips[0].cause, SkipCause::Error);
        let empty = line.replace('}', r#", "cause": "no_tokens"}"#);
        let skips = parse_error_skips(&format!("{empty}\n"), path).unwrap();
        assert_eq!(skips[0].cause, SkipCause::NoTokens);
        let error = parse_error_skips(&format!("{line}\nnot json\n{line}\n"), path).unwrap_err();
        assert!(
            error.reason.starts_with("line 2: not a skip record"),
            "{error}"
        );
    }
}
