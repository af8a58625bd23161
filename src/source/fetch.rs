//! What every store's reader shares: the chunks it sends a shard's reader,
//! the sender that counts them (and tees them into a cache file), the unit
//! it reads, and the budget and settings of its read-ahead ([`Fetcher`]).
//! The stores' readers (local files, S3, HTTP) depend on this module; it
//! depends on none of them (only on the local reader's fault guard).

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::config::StoreOptions;
use crate::error::{Error, Result};
use crate::location::Location;
use crate::stats::{Counter, Counters};
use crate::store::local::Guard;

/// Bytes of one shard, holding their share of the read-ahead budget until dropped.
pub(super) struct Chunk {
    /// The bytes.
    pub(super) bytes: Bytes,
    /// When the bytes are mapped from a local file (and may be shared):
    /// what a reader checks after copying bytes out of them.
    pub(super) mapped: Option<Guard>,
    /// The chunk's share of the budget, given back when it is dropped.
    pub(super) _permit: OwnedSemaphorePermit,
}

impl Chunk {
    /// Bytes read into memory of their own.
    pub(super) fn read(bytes: Vec<u8>, permit: OwnedSemaphorePermit) -> Self {
        Chunk {
            bytes: bytes.into(),
            mapped: None,
            _permit: permit,
        }
    }
}

pub(super) type ChunkResult = Result<Chunk>;

/// What a fetch task sends a shard's reader. The end of a unit is a message
/// of its own, with the byte count: a channel that closes without it means
/// the fetch stopped, never that the shard ended.
pub(super) enum Piece {
    /// The next bytes.
    Bytes(Chunk),
    /// Reading failed; nothing follows.
    Failed(Error),
    /// Every byte of the unit was sent: `bytes` in all.
    End { bytes: u64 },
}

/// The sending end of one unit's chunks. It counts the bytes it sends, so
/// that the unit's end tells the reader how many to expect.
pub(super) struct ChunkSender {
    tx: Sender<Piece>,
    sent: AtomicU64,
    failed: AtomicBool,
    /// Whether the reader was told the unit ended.
    ended: AtomicBool,
    /// When the fetch reads more than the reader asked for, the part of
    /// the bytes that the reader gets.
    window: Mutex<Option<Window>>,
    /// The cache file the bytes are also written to, if any.
    fill: Mutex<Option<Box<dyn Tee>>>,
    /// What the source answered with: its validator, and its size when
    /// the answer confirmed it.
    answered: Mutex<(Option<String>, Option<u64>)>,
}

impl ChunkSender {
    /// The sender of the chunks of one unit to `tx`.
    pub(super) fn new(tx: Sender<Piece>) -> Self {
        ChunkSender {
            tx,
            sent: AtomicU64::new(0),
            failed: AtomicBool::new(false),
            ended: AtomicBool::new(false),
            window: Mutex::new(None),
            fill: Mutex::new(None),
            answered: Mutex::new((None, None)),
        }
    }

    /// Also writes the bytes sent to `fill`, named once every byte was sent.
    pub(super) fn tee(&self, fill: Box<dyn Tee>) {
        *self.fill.lock().unwrap_or_else(|e| e.into_inner()) = Some(fill);
    }

    /// Hands the reader only the bytes `range` of the object, whose every
    /// byte is then sent, from its first (a whole object read into the
    /// cache for a range of it): the others go to the cache file only.
    /// The reader is told the unit ended once the range was sent.
    pub(super) fn window(&self, range: Range<u64>) {
        *self.window.lock().unwrap_or_else(|e| e.into_inner()) = Some(Window { range, at: 0 });
    }

    /// Notes what the source answered with: its validator, and its size
    /// when the answer confirmed it.
    pub(super) fn note_answer(&self, validator: Option<String>, size: Option<u64>) {
        *self.answered.lock().unwrap_or_else(|e| e.into_inner()) = (validator, size);
    }

    /// Sends bytes or an error; `Err` when the reader is gone. Once the
    /// reader was told the unit ended (its window was sent), bytes go to
    /// the cache file only, and an error only stops the copy.
    pub(super) fn send(&self, item: ChunkResult) -> std::result::Result<(), ConsumerGone> {
        let piece = match item {
            Ok(mut chunk) => {
                if let Some(fill) = self.fill.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
                    fill.write(&chunk.bytes);
                }
                let mut window = self.window.lock().unwrap_or_else(|e| e.into_inner());
                let mut window_sent = false;
                if let Some(window) = window.as_mut() {
                    let start = window.at;
                    window.at += chunk.bytes.len() as u64;
                    let within = |at: u64| (at.clamp(start, window.at) - start) as usize;
                    let (from, to) = (within(window.range.start), within(window.range.end));
                    chunk.bytes = chunk.bytes.slice(from..to);
                    window_sent = window.at >= window.range.end;
                }
                drop(window);
                if self.ended.load(Ordering::SeqCst) {
                    return Ok(());
                }
                self.sent
                    .fetch_add(chunk.bytes.len() as u64, Ordering::SeqCst);
                if !chunk.bytes.is_empty() {
                    self.tx
                        .send(Piece::Bytes(chunk))
                        .map_err(|_| ConsumerGone)?;
                }
                if window_sent {
                    self.end();
                }
                return Ok(());
            }
            Err(error) => {
                self.failed.store(true, Ordering::SeqCst);
                // Dropped: its temporary file is removed.
                self.fill.lock().unwrap_or_else(|e| e.into_inner()).take();
                if self.ended.load(Ordering::SeqCst) {
                    return Ok(());
                }
                Piece::Failed(error)
            }
        };
        self.tx.send(piece).map_err(|_| ConsumerGone)
    }

    /// Tells the reader that the unit ended, once.
    fn end(&self) {
        if !self.ended.swap(true, Ordering::SeqCst) {
            let _ = self.tx.send(Piece::End { bytes: self.sent() });
        }
    }

    /// Bytes sent so far.
    pub(super) fn sent(&self) -> u64 {
        self.sent.load(Ordering::SeqCst)
    }

    /// Tells the reader that every byte was sent (unless an error was,
    /// or it was told already), and keeps the cache file.
    pub(super) fn finish(&self) {
        if !self.failed.load(Ordering::SeqCst) {
            let fill = self.fill.lock().unwrap_or_else(|e| e.into_inner()).take();
            if let Some(fill) = fill {
                let answered = self.answered.lock().unwrap_or_else(|e| e.into_inner());
                fill.commit(answered.0.as_deref(), answered.1);
            }
            self.end();
        }
    }
}

/// The bytes of an object a reader gets when the fetch reads more.
struct Window {
    /// The bytes the reader gets.
    range: Range<u64>,
    /// Where the next bytes sent lie in the object.
    at: u64,
}

/// One read: a shard, or a byte range of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FetchUnit {
    /// Shard URL, for errors.
    pub url: String,
    /// Where its bytes are.
    pub location: Location,
    /// Bytes to read; `None` for the whole shard.
    pub range: Option<std::ops::Range<u64>>,
    /// The shard's size, when known.
    pub size: Option<u64>,
    /// The shard's ETag, when listed.
    pub etag: Option<String>,
    /// Whether `range` holds every sample of the shard (the rest of the
    /// object is no sample's: a tar archive's end), so that a cache may
    /// read the whole object instead without reading any byte twice.
    pub all_samples: bool,
}

/// Where the bytes a [`ChunkSender`] sends are also written (a cache
/// file being filled).
pub(super) trait Tee: Send {
    /// Writes the next bytes; a failure stops the copy, never the read.
    fn write(&mut self, bytes: &[u8]);
    /// Every byte was sent: keeps the copy, with the source's validator and
    /// confirmed size.
    fn commit(self: Box<Self>, validator: Option<&str>, size: Option<u64>);
}

/// Marker: the consumer has gone, stop fetching.
pub(super) struct ConsumerGone;

/// The budget and settings of one read-ahead, which every store's reader
/// takes: bytes are read only within the budget, in chunks of at most
/// `chunk_bytes`, and counted.
#[derive(Clone)]
pub(super) struct Fetcher {
    /// The read-ahead's byte budget, one permit per byte.
    pub(super) budget: Arc<Semaphore>,
    /// Set when the consumer has gone.
    pub(super) cancelled: Arc<AtomicBool>,
    /// The most bytes of one chunk.
    pub(super) chunk_bytes: usize,
    /// The most bytes of one chunk mapped from a local file.
    pub(super) map_chunk_bytes: usize,
    /// How long an open or a read may take.
    pub(super) io_timeout: Duration,
    /// Where reads are counted.
    pub(super) counters: Arc<Counters>,
    /// The budget's size.
    pub(super) budget_total: usize,
    /// The transport settings of remote reads.
    pub(super) store_options: Arc<StoreOptions>,
}

impl Fetcher {
    /// Waits for budget for `len` bytes; `None` once cancelled.
    pub(super) async fn reserve(&self, len: usize) -> Option<OwnedSemaphorePermit> {
        let permits = u32::try_from(len).expect("chunk_bytes fits u32");
        self.budget.clone().acquire_many_owned(permits).await.ok()
    }

    /// Adds `n` to `counter`.
    pub(super) fn count(&self, counter: Counter, n: u64) {
        self.counters.add(counter, n);
    }

    /// Records the bytes of the budget held now, if the most so far.
    pub(super) fn note_budget_held(&self) {
        let held = self.budget_total - self.budget.available_permits();
        self.counters
            .raise(Counter::ReadAheadPeakBytes, held as u64);
    }

    /// The read-ahead budget in bytes.
    pub(super) fn budget_bytes(&self) -> usize {
        self.budget_total
    }
}
