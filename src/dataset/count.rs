//! Sample counts of local plain tar shards, read from their member headers
//! when no manifest gives them (and of local plain JSON-lines shards, from
//! their line breaks): with counts, the plan gives every rank the same
//! number of samples, and `len()` is known. Reading one 512-byte header per
//! member and seeking over its data is cheap next to reading the shard.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::compression::Compression;
use crate::error::{Error, Result};
use crate::format::{lines, tar, ByteSource, ShardRef};
use crate::location::Location;
use crate::shard::{SampleIndex, Shard, ShardKind};

/// A local file read block by block, that seeks over what it skips.
struct SeekingFile {
    file: File,
    position: u64,
    len: u64,
}

impl Read for SeekingFile {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.file.read(buf)?;
        self.position += n as u64;
        Ok(n)
    }
}

impl ByteSource for SeekingFile {
    fn skip(&mut self, max: usize) -> std::io::Result<usize> {
        let n = (max as u64).min(self.len.saturating_sub(self.position));
        self.file.seek(SeekFrom::Current(n as i64))?;
        self.position += n;
        Ok(n as usize)
    }
}

/// Whether `shard` can be counted here: a local tar or JSON-lines shard
/// without a sample index (compression is told by its first bytes, when it
/// is counted).
pub fn countable(shard: &Shard) -> bool {
    shard.kind.has_manifest_spans()
        && shard.index.is_none()
        && matches!(shard.location(), Location::Local(_))
}

/// The sample index of the local shard `shard` (the `index`-th), or `None`
/// when it is compressed (its headers cannot be reached without
/// decompressing it).
fn count_one(index: usize, shard: &Shard) -> Result<Option<SampleIndex>> {
    let Location::Local(path) = shard.location() else {
        return Ok(None);
    };
    // Only regular files: opening a FIFO or a device could block for ever.
    let meta = std::fs::metadata(&path).map_err(|e| Error::from_open(&shard.url, e))?;
    if !meta.file_type().is_file() {
        return Ok(None);
    }
    let mut file = File::open(&path).map_err(|e| Error::from_open(&shard.url, e))?;
    let read_error = |offset: u64, source: std::io::Error| Error::Read {
        url: shard.url.clone(),
        offset,
        source,
    };
    let len = file.metadata().map_err(|e| read_error(0, e))?.len();
    let mut head = [0u8; 4];
    let got = file.read(&mut head).map_err(|e| read_error(0, e))?;
    if Compression::detect(&head[..got]).is_some() {
        return Ok(None);
    }
    file.seek(SeekFrom::Start(0))
        .map_err(|e| read_error(0, e))?;
    let mut source = SeekingFile {
        file,
        position: 0,
        len,
    };
    let shard_ref = ShardRef::whole(index, Arc::from(shard.url.as_str()));
    let spans = match shard.kind {
        ShardKind::Lines => lines::sample_spans(&mut source, &shard_ref)?,
        _ => tar::sample_spans(&mut source, &shard_ref, len)?,
    };
    Ok(Some(SampleIndex::from_spans(&spans)))
}

/// What [`count_local_tar`] did.
#[derive(Debug, Default)]
pub struct Counted {
    /// Shards counted.
    pub counted: usize,
    /// Why each shard that could not be counted was skipped (not `strict`).
    pub skipped: Vec<Error>,
}

/// Gives every local plain tar shard of `shards` that has no sample index
/// one, read from its headers. A shard that cannot be counted (missing,
/// unreadable or malformed) is an error when `strict`; else it is skipped:
/// it gets no samples, so that every rank plans the same epoch without it,
/// and the error (naming the shard and offset) is returned in
/// [`Counted::skipped`] for the caller to warn of.
pub fn count_local_tar(shards: &mut [Shard], strict: bool) -> Result<Counted> {
    let todo: Vec<usize> = (0..shards.len())
        .filter(|&i| countable(&shards[i]))
        .collect();
    if todo.is_empty() {
        return Ok(Counted::default());
    }
    // Several shards at once: on a cold disk or a network file system each
    // header read waits for the device, not for a core.
    let threads = todo.len().min(COUNT_THREADS);
    let next = AtomicUsize::new(0);
    let view: &[Shard] = shards;
    let mut results: Vec<(usize, Result<Option<SampleIndex>>)> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| {
                    let mut out = Vec::new();
                    loop {
                        let at = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&index) = todo.get(at) else { break };
                        out.push((index, count_one(index, &view[index])));
                    }
                    out
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().unwrap_or_default())
            .collect()
    });
    if results.len() != todo.len() {
        return Err(Error::Stopped(
            "a thread counting the samples of local shards failed".into(),
        ));
    }
    results.sort_by_key(|(index, _)| *index);
    let mut done = Counted::default();
    for (index, result) in results {
        match result {
            Ok(Some(sample_index)) => {
                shards[index].index = Some(Arc::new(sample_index));
                done.counted += 1;
            }
            Ok(None) => {}
            Err(error) if strict => return Err(error),
            Err(error) => {
                shards[index].index = Some(Arc::new(SampleIndex::from_spans(&[])));
                done.skipped.push(error);
            }
        }
    }
    Ok(done)
}

/// Shards counted at once.
const COUNT_THREADS: usize = 8;

/// Whether the local file at `path` starts as a gzip or zstd stream.
fn is_compressed(path: &std::path::Path) -> bool {
    let mut head = [0u8; 4];
    let got = File::open(path).and_then(|mut f| f.read(&mut head));
    got.is_ok_and(|n| Compression::detect(&head[..n]).is_some())
}

/// The first shard whose sample count is unknown, if any.
pub fn first_uncounted(shards: &[Shard]) -> Option<&Shard> {
    shards.iter().find(|s| s.info().samples.is_none())
}

/// The error for a job of `world_size > 1` ranks over shards whose sample
/// counts are unknown (`uncounted`): ranks would get different numbers of
/// samples and the job would hang at its last step.
pub fn counts_needed(uncounted: &Shard, world_size: usize) -> Error {
    let why = match (uncounted.location(), uncounted.size) {
        (Location::S3 { .. } | Location::Http(_), _) => "it is remote, and counting would read it",
        (Location::Local(_), None) => "it does not exist",
        (Location::Local(path), Some(_)) if is_compressed(&path) => {
            "it is compressed, and counting would decompress it"
        }
        (Location::Local(_), Some(_)) => {
            "it was not counted (count_samples=False, or it is not a regular file)"
        }
    };
    let format = if uncounted.kind == ShardKind::Lines {
        " --format jsonl"
    } else {
        ""
    };
    let fix = match uncounted.location() {
        Location::S3 { bucket, key } => {
            let folder = format!(
                "s3://{bucket}/{}",
                &key[..key.rfind('/').map_or(0, |i| i + 1)]
            );
            format!(
                "run `shardstream index {folder}{format} -o {folder}manifest.json` once: datasets \
                 find the manifest beside the shards (or pass manifest= its path or URL)"
            )
        }
        _ => format!(
            "run `shardstream index SPEC{format} -o DIR/manifest.json` once and put the \
             manifest beside the shards (or pass manifest= its path or URL)"
        ),
    };
    Error::Spec {
        spec: uncounted.url.clone(),
        reason: format!(
            "with world_size {world_size} every rank must get the same number of samples, which \
             needs every shard's sample count, and {} has none ({why}); {fix}",
            uncounted.url
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ops::ControlFlow;

    fn write_tar(path: &std::path::Path, members: &[(&str, usize)]) {
        let mut builder = ::tar::Builder::new(File::create(path).unwrap());
        for (name, size) in members {
            let mut header = ::tar::Header::new_gnu();
            header.set_size(*size as u64);
            header.set_mode(0o644);
            header.set_entry_type(::tar::EntryType::Regular);
            builder
                .append_data(&mut header, name, &vec![7u8; *size][..])
                .unwrap();
        }
        builder.finish().unwrap();
    }

    #[test]
    fn counted_spans_equal_the_spans_of_a_full_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.tar");
        let long = format!("{}/x.txt", "d".repeat(150));
        write_tar(
            &path,
            &[
                ("a.wav", 1000),
                ("a.json", 3),
                ("README", 9),
                (&long, 5),
                ("b.cls", 1),
                ("c.txt", 0),
            ],
        );
        let url = path.to_str().unwrap().to_owned();
        let mut shards = vec![Shard::new(url.clone(), Some(0))];
        assert_eq!(count_local_tar(&mut shards, true).unwrap().counted, 1);
        let index = shards[0].index.clone().unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let mut full = Vec::new();
        tar::read_samples(&mut &bytes[..], &ShardRef::whole(0, url.into()), |s| {
            full.push((s.offset, s.length));
            ControlFlow::Continue(())
        })
        .unwrap();
        assert_eq!(full.len(), 4);
        let counted: Vec<_> = (0..index.len())
            .map(|i| (index.offset(i), index.length(i)))
            .collect();
        assert_eq!(counted, full);
    }

    #[test]
    fn compressed_and_remote_shards_stay_uncounted() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.tar.gz");
        std::fs::write(&path, [0x1f, 0x8b, 8, 0, 0, 0]).unwrap();
        let mut shards = vec![
            Shard::new(path.to_str().unwrap(), Some(6)),
            Shard::new("s3://b/k.tar", None),
        ];
        assert_eq!(count_local_tar(&mut shards, true).unwrap().counted, 0);
        let missing = first_uncounted(&shards).unwrap();
        let message = counts_needed(missing, 2).to_string();
        assert!(message.contains("compressed") && message.contains("shardstream index"));
    }

    #[test]
    fn truncated_and_duplicate_fields_are_errors_when_strict_else_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let cut = dir.path().join("cut.tar");
        write_tar(&cut, &[("a.wav", 4000)]);
        let bytes = std::fs::read(&cut).unwrap();
        std::fs::write(&cut, &bytes[..2048]).unwrap();
        let dup = dir.path().join("dup.tar");
        write_tar(&dup, &[("a.wav", 1), ("a.wav", 1)]);
        for path in [&cut, &dup] {
            let mut shards = vec![Shard::new(path.to_str().unwrap(), Some(1))];
            let error = count_local_tar(&mut shards, true).unwrap_err();
            assert!(
                error.to_string().contains(path.to_str().unwrap()),
                "{error}"
            );
            // Not strict: skipped (no samples), the error kept to warn of.
            let done = count_local_tar(&mut shards, false).unwrap();
            assert_eq!(done.counted, 0);
            assert_eq!(done.skipped.len(), 1);
            assert_eq!(done.skipped[0].to_string(), error.to_string());
            assert_eq!(shards[0].info().samples, Some(0));
        }
    }
}
