//! Local files (plain paths and `file://` URLs).

use std::path::Path;
use std::sync::mpsc::Sender;

use tokio::io::AsyncReadExt;

use super::{Chunk, ChunkResult, ConsumerGone, Fetcher};
use crate::error::Error;
use crate::stats::Counter;

/// Reads `path` sequentially into chunks sent to `tx`; errors are sent too.
/// Stops early, without error, when the shard's reader is dropped.
pub(super) async fn read_file(
    fetcher: &Fetcher,
    url: &str,
    path: &Path,
    tx: &Sender<ChunkResult>,
) -> Result<(), ConsumerGone> {
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
    let mut offset = 0u64;
    loop {
        let Some(permit) = fetcher.reserve(fetcher.chunk_bytes).await else {
            return Err(ConsumerGone);
        };
        let mut bytes = vec![0u8; fetcher.chunk_bytes];
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
        if filled < fetcher.chunk_bytes {
            drop(permit.split(fetcher.chunk_bytes - filled));
        }
        if tx
            .send(Ok(Chunk {
                bytes,
                _permit: permit,
            }))
            .is_err()
            || filled < fetcher.chunk_bytes
        {
            return Ok(());
        }
    }
}
