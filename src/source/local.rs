//! Local files (plain paths and `file://` URLs).

use std::path::Path;
use std::sync::mpsc::Sender;

use tokio::io::{AsyncReadExt, AsyncSeekExt};

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
    let mut file = match tokio::fs::File::open(path).await {
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
    if offset > 0 {
        if let Err(source) = file.seek(std::io::SeekFrom::Start(offset)).await {
            return report(Error::Read {
                url: url.to_owned(),
                offset,
                source,
            });
        }
    }
    while offset < end {
        let want = usize::try_from(end - offset)
            .map_or(fetcher.chunk_bytes, |left| left.min(fetcher.chunk_bytes));
        let Some(permit) = fetcher.reserve(want).await else {
            return Err(ConsumerGone);
        };
        let mut bytes = vec![0u8; want];
        let mut filled = 0;
        while filled < bytes.len() {
            match file.read(&mut bytes[filled..]).await {
                Ok(0) => break,
                Ok(n) => filled += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(source) => {
                    let offset = offset + filled as u64;
                    return report(Error::Read {
                        url: url.to_owned(),
                        offset,
                        source,
                    });
                }
            }
        }
        if filled == 0 {
            return Ok(());
        }
        bytes.truncate(filled);
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
