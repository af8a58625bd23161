//! Local files (plain paths and `file://` URLs).

use std::fs::File;
use std::io::{Read, Seek};
use std::path::Path;
use std::sync::mpsc::Sender;

use super::{Chunk, ChunkResult, ConsumerGone, FetchUnit, Fetcher};
use crate::error::Error;
use crate::stats::Counter;

/// Reads `path` (or the unit's byte range of it) sequentially into chunks
/// sent to `tx`; errors are sent too. Stops early, without error, when the
/// shard's reader is dropped.
pub(super) async fn read_file(
    fetcher: &Fetcher,
    unit: &FetchUnit,
    path: &Path,
    tx: &Sender<ChunkResult>,
) -> Result<(), ConsumerGone> {
    let url = unit.url.as_str();
    // A failed send means the shard's reader is gone: nothing more to do.
    let report = |error: Error| {
        let _ = tx.send(Err(error));
        Ok(())
    };
    let file = match tokio::fs::File::open(path).await {
        Ok(file) => file,
        Err(e) => return report(Error::from_open(url, e)),
    };
    if let Ok(meta) = file.metadata().await {
        if meta.is_dir() {
            let source = std::io::Error::other("is a directory");
            return report(Error::Read {
                url: url.to_owned(),
                offset: 0,
                source,
            });
        }
    }
    fetcher.count(Counter::ShardsOpened, 1);
    let (mut offset, end) = match &unit.range {
        Some(range) => (range.start, range.end),
        None => (0, u64::MAX),
    };
    let mut file = file.into_std().await;
    let mut seek_to = (offset > 0).then_some(offset);
    while offset < end {
        let want = usize::try_from(end - offset)
            .map_or(fetcher.chunk_bytes, |left| left.min(fetcher.chunk_bytes));
        let Some(permit) = fetcher.reserve(want).await else {
            return Err(ConsumerGone);
        };
        let bytes = match read_chunk(file, seek_to.take(), want).await {
            Ok((open, bytes)) => {
                file = open;
                bytes
            }
            Err((filled, source)) => {
                return report(Error::Read {
                    url: url.to_owned(),
                    offset: offset + filled,
                    source,
                })
            }
        };
        let filled = bytes.len();
        if filled == 0 {
            return Ok(());
        }
        offset += filled as u64;
        fetcher.count(Counter::BytesRead, filled as u64);
        let mut permit = permit;
        if filled < want {
            drop(permit.split(want - filled));
        }
        let chunk = Chunk {
            bytes,
            _permit: permit,
        };
        if tx.send(Ok(chunk)).is_err() || filled < want {
            return Ok(());
        }
    }
    Ok(())
}

/// Reads up to `want` bytes (after seeking to `seek_to`, if given) on a
/// blocking thread, straight into a new chunk: `std::fs::File` reads into
/// the chunk's spare capacity, with no zeroing and no intermediate buffer.
/// A failed read gives the bytes of the chunk it got first, and the error.
async fn read_chunk(
    file: File,
    seek_to: Option<u64>,
    want: usize,
) -> Result<(File, Vec<u8>), (u64, std::io::Error)> {
    let work = move || {
        if let Some(at) = seek_to {
            (&file)
                .seek(std::io::SeekFrom::Start(at))
                .map_err(|e| (0, e))?;
        }
        let mut bytes = Vec::with_capacity(want);
        match (&file).take(want as u64).read_to_end(&mut bytes) {
            Ok(_) => Ok((file, bytes)),
            Err(e) => Err((bytes.len() as u64, e)),
        }
    };
    match tokio::task::spawn_blocking(work).await {
        Ok(done) => done,
        Err(join) => Err((
            0,
            std::io::Error::other(format!("file read stopped: {join}")),
        )),
    }
}
