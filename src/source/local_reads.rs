//! The read-ahead's reads of local files (plain paths and `file://` URLs,
//! and cached copies of remote shards): a regular file is sent on as the
//! chunks `crate::store::local` maps, within the read-ahead's budget;
//! anything that cannot be mapped (a pipe, a file system without `mmap`)
//! is read into chunks instead. A regular file is delivered whole as of
//! its size when opened (or the range asked for): a file that ends sooner
//! is an error naming the offset, never a shorter shard.

use std::fs::File;
use std::io::{Read, Seek};
use std::path::Path;
use std::sync::Arc;

use super::fetch::{Chunk, ChunkSender, ConsumerGone, FetchUnit, Fetcher};
use crate::error::Error;
use crate::stats::Counter;
use crate::store::local::{map_chunk, open, FileIdentity, LocalFile, MapOutcome};

/// Sends the bytes of `path` (or the unit's byte range of it), in order, as
/// chunks to `tx`; errors are sent too. Stops early, without error, when
/// the shard's reader is dropped.
pub(super) async fn read_file(
    fetcher: &Fetcher,
    unit: &FetchUnit,
    (path, by_reference): (&Path, bool),
    tx: &ChunkSender,
) -> Result<(), ConsumerGone> {
    let url = unit.url.as_str();
    // A failed send means the shard's reader is gone: nothing more to do.
    let report = |error: Error| {
        let _ = tx.send(Err(error));
        Ok(())
    };
    let (file, meta) = match open(url, path, fetcher.io_timeout)
        .await
        .ok_or(ConsumerGone)?
    {
        Ok(opened) => opened,
        Err(error) => return report(error),
    };
    read_opened(fetcher, unit, (path, by_reference), (file, meta), tx).await
}

/// As [`read_file`], of `file` (with its metadata `meta`) already opened
/// at `path` (a cached copy, opened and checked by the cache). The bytes
/// of a file whose members may leave by reference (a shard of its own) are
/// counted as `bytes_read`, those of a cached copy as `cache_bytes`.
pub(super) async fn read_opened(
    fetcher: &Fetcher,
    unit: &FetchUnit,
    (path, by_reference): (&Path, bool),
    (file, meta): (File, std::fs::Metadata),
    tx: &ChunkSender,
) -> Result<(), ConsumerGone> {
    let url = unit.url.as_str();
    let report = |error: Error| {
        let _ = tx.send(Err(error));
        Ok(())
    };
    if meta.is_dir() {
        let source = std::io::Error::other("is a directory");
        return report(Error::Read {
            url: url.to_owned(),
            offset: 0,
            source,
        });
    }
    fetcher.count(Counter::ShardsOpened, 1);
    let (offset, asked_end) = match &unit.range {
        Some(range) => (range.start, Some(range.end)),
        None => (0, None),
    };
    if !meta.is_file() {
        // A pipe or a device: its size is not known before its end.
        let end = Expected {
            end: asked_end.unwrap_or(u64::MAX),
            size_at_open: None,
        };
        let counter = bytes_counter(by_reference);
        return read_chunks(fetcher, (unit, counter), file, offset, end, tx).await;
    }
    let size = meta.len();
    let end = Expected {
        end: asked_end.unwrap_or(size),
        size_at_open: Some(size),
    };
    if end.end > size {
        return report(end.short(url, size, size));
    }
    let local = Arc::new(LocalFile {
        // Absolute, so that another process (a DataLoader's main
        // process) finds the file whatever its working directory.
        path: std::path::absolute(path).unwrap_or_else(|_| path.to_owned()),
        identity: FileIdentity::of(&meta),
        url: url.to_owned(),
        by_reference,
    });
    let (file, unmapped) = match map_chunks(fetcher, (file, local), offset, end, tx).await? {
        Mapped::Done => return Ok(()),
        Mapped::Failed(error) => return report(error),
        Mapped::Unmappable(file, at) => (file, at),
    };
    let counter = bytes_counter(by_reference);
    read_chunks(fetcher, (unit, counter), file, unmapped, end, tx).await
}

/// The counter of the bytes read from a file: `bytes_read` for a shard's
/// own file (whose members may leave by reference), `cache_bytes` for a
/// cached copy (whose members never do).
fn bytes_counter(by_reference: bool) -> Counter {
    if by_reference {
        Counter::BytesRead
    } else {
        Counter::CacheBytes
    }
}

/// Where a read must end: `end`, and the file's size when it was opened
/// (`None` for a pipe or a device, whose `end` may be `u64::MAX`: its end).
#[derive(Debug, Clone, Copy)]
struct Expected {
    end: u64,
    size_at_open: Option<u64>,
}

impl Expected {
    /// The error for a file found `now` bytes long, its bytes delivered up
    /// to `at`, short of `self.end`.
    fn short(&self, url: &str, at: u64, now: u64) -> Error {
        let reason = match self.size_at_open {
            Some(size) if now < size => format!(
                "the file shrank while it was read: it has {now} bytes now, \
                 {size} when it was opened"
            ),
            _ => format!(
                "the file ends at byte {now}, before the end of the range asked for (byte {})",
                self.end
            ),
        };
        Error::Read {
            url: url.to_owned(),
            offset: at,
            source: std::io::Error::new(std::io::ErrorKind::UnexpectedEof, reason),
        }
    }
}

/// The outcome of mapping a file's chunks.
enum Mapped {
    /// Every chunk was sent (or the shard's reader is gone).
    Done,
    /// The file ended early; the chunks before that point were sent.
    Failed(Error),
    /// A chunk could not be mapped: the file back, and the chunk's offset,
    /// for reading to take over.
    Unmappable(File, u64),
}

/// Maps `file` from `offset` to `end.end` a chunk at a time and sends the
/// chunks.
async fn map_chunks(
    fetcher: &Fetcher,
    (mut file, local): (File, Arc<LocalFile>),
    mut offset: u64,
    end: Expected,
    tx: &ChunkSender,
) -> Result<Mapped, ConsumerGone> {
    while offset < end.end {
        let want = usize::try_from(end.end - offset).map_or(fetcher.map_chunk_bytes, |left| {
            left.min(fetcher.map_chunk_bytes)
        });
        let Some(mut permit) = fetcher.reserve(want).await else {
            return Err(ConsumerGone);
        };
        let (open, mapped) = map_chunk(file, local.clone(), offset, want)
            .await
            .ok_or(ConsumerGone)?;
        file = open;
        let (bytes, guard, size_now) = match mapped {
            MapOutcome::Mapped(bytes, guard, size_now) => (bytes, guard, size_now),
            MapOutcome::Unmappable => return Ok(Mapped::Unmappable(file, offset)),
            MapOutcome::Gone(size_now) => {
                return Ok(Mapped::Failed(end.short(&local.url, offset, size_now)))
            }
        };
        let got = bytes.len();
        fetcher.count(bytes_counter(local.by_reference), got as u64);
        if got < want {
            drop(permit.split(want - got));
        }
        let chunk = Chunk {
            bytes,
            mapped: Some(guard),
            _permit: permit,
        };
        if tx.send(Ok(chunk)).is_err() {
            return Ok(Mapped::Done);
        }
        offset += got as u64;
        if got < want {
            return Ok(Mapped::Failed(end.short(&local.url, offset, size_now)));
        }
    }
    Ok(Mapped::Done)
}

/// Reads `file` from `offset` to `end.end` (or, for a pipe, its end)
/// sequentially into chunks sent to `tx`; errors are sent too, and a file
/// that ends before `end.end` is one. The bytes are counted in `counter`.
async fn read_chunks(
    fetcher: &Fetcher,
    (unit, counter): (&FetchUnit, Counter),
    mut file: File,
    mut offset: u64,
    end: Expected,
    tx: &ChunkSender,
) -> Result<(), ConsumerGone> {
    let mut seek_to = (offset > 0).then_some(offset);
    while offset < end.end {
        let want = usize::try_from(end.end - offset)
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
                let _ = tx.send(Err(Error::Read {
                    url: unit.url.clone(),
                    offset: offset + filled,
                    source,
                }));
                return Ok(());
            }
        };
        let filled = bytes.len();
        offset += filled as u64;
        fetcher.count(counter, filled as u64);
        let mut permit = permit;
        if filled < want {
            drop(permit.split(want - filled));
        }
        if filled > 0 && tx.send(Ok(Chunk::read(bytes, permit))).is_err() {
            return Ok(());
        }
        if filled < want {
            // The end of the file. A pipe's end is the end of its shard; a
            // regular file, or a range, must reach `end.end`.
            if end.end != u64::MAX {
                let _ = tx.send(Err(end.short(&unit.url, offset, offset)));
            }
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::store::local::{verify_view, MappedView};

    fn read_ahead(
        path: &Path,
        range: Option<std::ops::Range<u64>>,
        chunk: usize,
        budget: usize,
    ) -> super::super::ReadAhead {
        let unit = FetchUnit {
            url: path.display().to_string(),
            location: crate::location::Location::Local(path.to_owned()),
            range,
            size: None,
            etag: None,
            all_samples: false,
        };
        let options = super::super::ReadAheadOptions {
            budget_bytes: budget,
            chunk_bytes: chunk,
            map_chunk_bytes: chunk,
            io_timeout: Duration::from_secs(20),
            store: crate::config::StoreOptions::default(),
            cache: None,
        };
        let counters = Arc::new(crate::stats::Counters::new());
        super::super::ReadAhead::start(vec![unit], options, counters).unwrap()
    }

    /// Bytes with no zero among them, so that a zero read is a lost byte.
    fn content(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 31 % 251 + 1) as u8).collect()
    }

    /// Reads `reader` to its end or its error: the bytes read, and the
    /// error's offset and message.
    fn read_all(reader: &mut super::super::ShardReader) -> (Vec<u8>, Option<(u64, String)>) {
        use crate::format::ByteSource;
        let mut all = Vec::new();
        let mut buf = vec![0; 64 << 10];
        loop {
            match reader.read(&mut buf) {
                Ok(0) => return (all, None),
                Ok(n) => all.extend_from_slice(&buf[..n]),
                Err(_) => {
                    let failure = reader.take_failure().expect("the error is kept");
                    let offset = match &failure {
                        Error::Read { offset, .. } => *offset,
                        other => panic!("not a read error: {other}"),
                    };
                    return (all, Some((offset, failure.to_string())));
                }
            }
        }
    }

    #[test]
    fn a_file_cut_short_under_its_mapped_chunk_is_a_read_error_not_a_sigbus() {
        // SAFETY: sysconf reads a constant of the system.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
        let bytes = content(4 << 20);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shard.tar");
        std::fs::write(&path, &bytes).unwrap();
        let read_ahead = read_ahead(&path, None, 1 << 20, 4 << 20);
        let mut reader = read_ahead.next_shard().unwrap().unwrap();
        let mut head = vec![0; 1000];
        reader.read_exact(&mut head).unwrap();
        assert_eq!(head, bytes[..1000]);
        // A member handed out as a view of the mapped chunk, before the cut.
        use crate::format::ByteSource;
        let view = reader.read_shared(200_000).unwrap().expect("a view");
        let pinned = MappedView::of(&view).expect("a view of a mapped chunk");

        std::fs::File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(2 * page as u64)
            .unwrap();
        // Touching the view's lost pages faults: they read as zeros, and the
        // check after the read says where the file's bytes end.
        let zeros = view.iter().filter(|&&b| b == 0).count();
        assert!(zeros > 0, "the lost pages read as zeros");
        let error = pinned
            .verify()
            .expect_err("the view lost pages")
            .to_string();
        assert!(
            error.contains(&format!("byte offset {}", 2 * page)) && error.contains("cut short"),
            "{error}"
        );
        assert_eq!(
            verify_view(&view[..2 * page - 1000]).map_err(|e| e.to_string()),
            Ok(()),
            "the bytes before the cut are the file's"
        );

        let (rest, failure) = read_all(&mut reader);
        let (offset, message) = failure.expect("an error, not a shorter shard");
        assert_eq!(offset, 201_000, "{message}");
        assert!(
            message.contains("shard.tar") && message.contains("cut short"),
            "{message}"
        );
        assert!(
            rest.len() < 64 << 10,
            "no bytes after the cut: {}",
            rest.len()
        );
    }

    #[test]
    fn a_file_that_shrinks_before_its_next_chunk_is_mapped_is_a_read_error() {
        let bytes = content(4 << 20);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shard.tar");
        std::fs::write(&path, &bytes).unwrap();
        // A budget of one chunk: the next is mapped once this one is done.
        let read_ahead = read_ahead(&path, None, 1 << 20, 1 << 20);
        let mut reader = read_ahead.next_shard().unwrap().unwrap();
        let mut head = vec![0; 1000];
        reader.read_exact(&mut head).unwrap();
        let cut = (3 << 20) / 2;
        std::fs::File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(cut)
            .unwrap();
        let (rest, failure) = read_all(&mut reader);
        let (offset, message) = failure.expect("an error, not a shorter shard");
        assert_eq!(offset, cut, "{message}");
        // Found by the size check before the next chunk is mapped, or, when
        // the I/O thread had mapped it already, by the fault on its lost
        // pages: either way an error at the cut, never a shorter shard.
        assert!(
            (message.contains("shrank") && message.contains(&format!("{cut} bytes now")))
                || message.contains("cut short"),
            "{message}"
        );
        assert_eq!([head, rest].concat(), bytes[..cut as usize]);
    }

    #[test]
    fn a_range_past_the_end_of_the_file_is_a_read_error_naming_the_offset() {
        let bytes = content(10_000);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shard.tar");
        std::fs::write(&path, &bytes).unwrap();
        let past = read_ahead(&path, Some(5000..20_000), 1 << 20, 4 << 20);
        let mut reader = past.next_shard().unwrap().unwrap();
        let (read, failure) = read_all(&mut reader);
        let (offset, message) = failure.expect("an error, not a shorter range");
        assert_eq!(offset, 10_000, "{message}");
        assert!(
            message.contains("before the end of the range asked for (byte 20000)"),
            "{message}"
        );
        assert!(read.is_empty());

        // A range within the file is read whole.
        let within = read_ahead(&path, Some(5000..10_000), 1 << 20, 4 << 20);
        let mut reader = within.next_shard().unwrap().unwrap();
        assert_eq!(read_all(&mut reader), (bytes[5000..].to_vec(), None));
    }

    #[test]
    fn a_pipe_that_ends_before_the_range_asked_for_is_a_read_error() {
        let bytes = content(200_000);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pipe.tar");
        let fifo = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
        // SAFETY: creates a named pipe at a path this test owns.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        let writer = {
            let (path, bytes) = (path.clone(), bytes.clone());
            std::thread::spawn(move || std::fs::write(path, bytes).unwrap())
        };
        let read_ahead = read_ahead(&path, Some(0..300_000), 64 << 10, 1 << 20);
        let mut reader = read_ahead.next_shard().unwrap().unwrap();
        let (read, failure) = read_all(&mut reader);
        writer.join().unwrap();
        let (offset, message) = failure.expect("an error, not a shorter range");
        assert_eq!(offset, 200_000, "{message}");
        assert!(
            message.contains("before the end of the range asked for (byte 300000)"),
            "{message}"
        );
        assert_eq!(read, bytes);
    }
}
