//! Read planning: which bytes of which shard each read of a slot fetches,
//! and what it does with their samples. Pure: no I/O, no threads.

use std::collections::HashSet;
use std::ops::Range;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::format::SampleId;
use crate::plan::WorkUnit;
use crate::shard::{SampleIndex, Shard, ShardKind};
use crate::source::FetchUnit;
use crate::state::Mirror;

/// What to do with the samples of one read.
#[derive(Debug)]
pub(super) enum ReadPurpose {
    /// Samples of the unit at this position, within `samples` (shard indices).
    Unit {
        /// Position of the unit in the slot's unit list.
        position: usize,
        /// Sample indices of the read.
        samples: Range<u64>,
    },
    /// Samples the shuffle buffer held when the state was saved.
    Restore {
        /// Indices in the shard of the held samples.
        wanted: HashSet<u64>,
    },
}

/// One read of the pipeline: a unit (or part of one), or a restore read.
#[derive(Debug)]
pub(super) struct Read {
    /// Index of the shard in the dataset.
    pub(super) shard: usize,
    /// `None` when there is nothing to read (an empty unit).
    pub(super) fetch: Option<FetchUnit>,
    /// Index of the first sample the read starts at.
    pub(super) first_index: u64,
    /// The sample index, to check ranged reads against.
    pub(super) index: Option<Arc<SampleIndex>>,
    /// What the shard holds.
    pub(super) kind: ShardKind,
    /// What to do with its samples.
    pub(super) purpose: ReadPurpose,
}

/// The reads that stream `units` from the mirror's cursor on (none once
/// the slot has `finished`), after the reads that bring back the samples
/// its buffer held and the documents a saved packer held (`replay`).
pub(super) fn read_list(
    shards: &[Shard],
    units: &[WorkUnit],
    mirror: &Mirror,
    replay: &[SampleId],
    finished: bool,
) -> Result<Vec<Read>> {
    let mut reads = Vec::new();
    let mut held: Vec<(usize, Vec<u64>)> = Vec::new();
    for id in mirror.buffer.iter().chain(replay) {
        match held.iter_mut().find(|(shard, _)| *shard == id.shard) {
            Some((_, indices)) => indices.push(id.index),
            None => held.push((id.shard, vec![id.index])),
        }
    }
    for (shard_index, indices) in held {
        let shard = shards.get(shard_index).ok_or_else(|| {
            Error::StateMismatch(format!(
                "the state holds a sample of shard {shard_index}, the dataset has {}",
                shards.len()
            ))
        })?;
        let span = *indices.iter().min().expect("non-empty")
            ..indices.iter().max().expect("non-empty").saturating_add(1);
        reads.push(make_read(
            shard_index,
            shard,
            span,
            ReadPurpose::Restore {
                wanted: indices.into_iter().collect(),
            },
        )?);
    }
    if finished {
        return Ok(reads);
    }
    for (position, unit) in units.iter().enumerate().skip(mirror.cursor.unit) {
        let shard = shards.get(unit.shard).ok_or_else(|| {
            Error::StateMismatch(format!(
                "work unit {position} is of shard {}, the dataset has {}",
                unit.shard,
                shards.len()
            ))
        })?;
        let full = unit.samples.clone().unwrap_or(0..u64::MAX);
        let start = match mirror.cursor.next_sample {
            Some(next) if position == mirror.cursor.unit => next.max(full.start),
            _ => full.start,
        };
        let samples = start..full.end;
        reads.push(make_read(
            unit.shard,
            shard,
            samples.clone(),
            ReadPurpose::Unit { position, samples },
        )?);
    }
    Ok(reads)
}

/// The read of `samples` of `shard`: the byte range a manifest gives for
/// them in a plain shard, the row group's span, or the whole shard.
fn make_read(
    shard_index: usize,
    shard: &Shard,
    samples: Range<u64>,
    purpose: ReadPurpose,
) -> Result<Read> {
    let index = shard.index.clone();
    let mut all_samples = false;
    let (range, first_index) = match &index {
        Some(index) => {
            let end = samples.end.min(index.len());
            if samples.start >= end {
                return Ok(Read {
                    shard: shard_index,
                    fetch: None,
                    first_index: samples.start,
                    index: None,
                    kind: shard.kind.clone(),
                    purpose,
                });
            }
            match index.compression() {
                // Offsets in a compressed shard are offsets in its
                // decompressed tar: read it from its start.
                Some(_) => (None, 0),
                None => {
                    all_samples = samples.start == 0 && end == index.len();
                    (
                        Some(index.read_range(&(samples.start..end), shard.size)),
                        samples.start,
                    )
                }
            }
        }
        None => match &shard.kind {
            ShardKind::Parquet(group) => (Some(group.span.clone()), 0),
            _ => (None, 0),
        },
    };
    // A row group's size is its span's, not its file's.
    let size = match &shard.kind {
        ShardKind::Parquet(_) => None,
        ShardKind::Tar | ShardKind::Raw | ShardKind::Lines => shard.size,
    };
    Ok(Read {
        shard: shard_index,
        fetch: Some(FetchUnit {
            url: shard.url.clone(),
            location: shard.location(),
            range,
            size,
            etag: shard.etag.clone(),
            all_samples,
        }),
        first_index,
        index,
        kind: shard.kind.clone(),
        purpose,
    })
}

/// One past the last index of `wanted`.
pub(super) fn read_end(wanted: &HashSet<u64>) -> u64 {
    wanted.iter().max().map_or(0, |m| m.saturating_add(1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compression::Compression;
    use crate::format::SampleId;
    use crate::state::Cursor;

    /// Shard 0 plain with a manifest (4 samples of 100 bytes), shard 1
    /// without one, shard 2 gzip-compressed with a manifest.
    fn shards() -> Vec<Shard> {
        let spans: Vec<(u64, u64)> = (0..4).map(|i| (i * 100, 100)).collect();
        let mut plain = Shard::new("a.tar", Some(1024));
        plain.index = Some(Arc::new(SampleIndex::from_spans(&spans)));
        let mut gz = Shard::new("c.tar.gz", Some(300));
        gz.index = SampleIndex::from_parts(
            vec![0, 512, 1024],
            vec![512, 512, 512],
            Some(Compression::Gzip),
        )
        .map(Arc::new);
        vec![plain, Shard::new("b.tar", Some(5000)), gz]
    }

    fn unit(shard: usize, samples: Option<Range<u64>>) -> WorkUnit {
        WorkUnit { shard, samples }
    }

    /// Shard, byte range (`None` without a fetch), first index, and the
    /// samples or wanted indices of a read.
    type Summary = (usize, Option<Option<Range<u64>>>, u64, String);

    fn summary(reads: &[Read]) -> Vec<Summary> {
        reads
            .iter()
            .map(|r| {
                let what = match &r.purpose {
                    ReadPurpose::Unit { position, samples } => {
                        format!("unit {position} {samples:?}")
                    }
                    ReadPurpose::Restore { wanted } => {
                        let mut wanted: Vec<_> = wanted.iter().copied().collect();
                        wanted.sort();
                        format!("restore {wanted:?}")
                    }
                };
                let range = r.fetch.as_ref().map(|f| f.range.clone());
                (r.shard, range, r.first_index, what)
            })
            .collect()
    }

    /// A manifest's plain shard is read by byte range from the piece's
    /// first sample to the next piece's (the shard's end after its last
    /// sample); a shard without one, or a compressed one, from its first
    /// byte; a piece past a shard's last sample fetches nothing.
    #[test]
    fn byte_ranges_follow_the_manifest() {
        let units = [
            unit(0, Some(1..3)),
            unit(1, None),
            unit(2, Some(1..2)),
            unit(0, Some(4..9)),
            unit(0, None),
        ];
        let reads = read_list(&shards(), &units, &Mirror::start(), &[], false).unwrap();
        let all = 0..u64::MAX;
        assert_eq!(
            summary(&reads),
            [
                (0, Some(Some(100..300)), 1, "unit 0 1..3".into()),
                (1, Some(None), 0, format!("unit 1 {all:?}")),
                (2, Some(None), 0, "unit 2 1..2".into()),
                (0, None, 4, "unit 3 4..9".into()),
                (0, Some(Some(0..1024)), 0, format!("unit 4 {all:?}")),
            ]
        );
        assert_eq!(reads[0].fetch.as_ref().unwrap().size, Some(1024));
        // Only the read of every sample of a plain shard holds them all.
        let all: Vec<bool> = reads
            .iter()
            .flat_map(|r| &r.fetch)
            .map(|f| f.all_samples)
            .collect();
        assert_eq!(all, [false, false, false, true]);
        assert!(reads[1].index.is_none() && reads[0].index.is_some());
    }

    /// A resumed mirror's held samples come back first, one read per
    /// shard (in the order the buffer first holds them) spanning them;
    /// then the units from the cursor on, the cursor's unit from its next
    /// sample.
    #[test]
    fn a_resume_restores_the_buffer_then_goes_on_from_the_cursor() {
        let mut mirror = Mirror::start();
        mirror.buffer = [(1, 7), (0, 2), (1, 3)]
            .into_iter()
            .map(|(shard, index)| SampleId { shard, index })
            .collect();
        mirror.cursor = Cursor {
            unit: 1,
            next_sample: Some(2),
        };
        let units = [unit(1, None), unit(0, Some(0..4)), unit(1, Some(10..20))];
        let reads = read_list(&shards(), &units, &mirror, &[], false).unwrap();
        assert_eq!(
            summary(&reads),
            [
                (1, Some(None), 0, "restore [3, 7]".into()),
                (0, Some(Some(200..300)), 2, "restore [2]".into()),
                (0, Some(Some(200..1024)), 2, "unit 1 2..4".into()),
                (1, Some(None), 0, "unit 2 10..20".into()),
            ]
        );
        assert_eq!(read_end(&[3, 7].into_iter().collect()), 8);
        assert_eq!(read_end(&HashSet::new()), 0);
    }

    /// A unit or a held sample of a shard the dataset does not have is a
    /// state mismatch naming it, not a panic.
    #[test]
    fn shards_out_of_range_are_state_errors() {
        let error =
            read_list(&shards(), &[unit(5, None)], &Mirror::start(), &[], false).unwrap_err();
        assert!(
            matches!(&error, Error::StateMismatch(m) if m.contains("shard 5")),
            "{error}"
        );
        let mut mirror = Mirror::start();
        mirror.buffer = vec![SampleId { shard: 9, index: 0 }];
        let error = read_list(&shards(), &[], &mirror, &[], false).unwrap_err();
        assert!(
            matches!(&error, Error::StateMismatch(m) if m.contains("shard 9")),
            "{error}"
        );
    }
}
