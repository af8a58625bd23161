//! Wires plan -> source -> format -> decode -> shuffle for one slot, on a
//! pipeline thread, and hands samples to the consumer through a bounded
//! queue. A shard is a tar archive, a raw object (one sample) or one row
//! group of a Parquet file (one sample per row, or Arrow batches). The
//! consumer keeps a [`Mirror`] of the pipeline's position, so a stream can
//! report its state after any sample and resume from it.
//!
//! A read that starts at a shard's first byte tells its compression by the
//! magic bytes ([`TarStream`]). A compressed shard cannot be entered
//! mid-way, so every read of one, a piece of it included, starts at its
//! first byte and skips the samples before the piece.

use std::collections::{HashMap, HashSet, VecDeque};
use std::ops::{ControlFlow, Range};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arrow_array::RecordBatch;

use crate::byte_size::ByteSize;
use crate::compression::Compression;
use crate::config::{FieldDecoders, OnError, StreamOptions, TableOutput};
use crate::error::{Error, Result};
use crate::format::{
    blob, parquet, read_append_to_end, tar, ByteSource, Sample, SampleId, ShardRef, TarStream,
    Value,
};
use crate::plan::{order, Purpose, SlotSpec, WorkUnit};
use crate::shard::{RowGroup, SampleIndex, Shard, ShardKind};
use crate::shuffle::{ShuffleBounds, ShuffleBuffer};
use crate::source::{FetchUnit, ReadAhead, ReadAheadOptions, ShardReader};
use crate::state::{self, Mirror, Op, Resume, SlotState};
use crate::stats::{Counter, Counters};

/// Rows of one row group as an Arrow record batch.
#[derive(Debug)]
pub struct TableBatch {
    /// The Parquet file's URL.
    pub url: Arc<str>,
    /// Index in the file of the batch's first row.
    pub first_row: u64,
    /// The rows.
    pub batch: RecordBatch,
}

/// What the stream yields besides samples.
#[derive(Debug)]
pub enum Event {
    /// The next sample.
    Sample(Sample),
    /// The next rows of a table, with `TableOutput::Arrow`.
    Batch(TableBatch),
    /// A bad shard was skipped under `on_error="warn"`; the rest goes on.
    Skipped(Error),
}

/// The result of waiting a bounded time for the next event.
#[derive(Debug)]
pub enum Poll {
    /// An event arrived.
    Ready(Event),
    /// Nothing arrived within the wait; ask again.
    Pending,
    /// The stream has ended.
    End,
}

enum Message {
    /// Events in order, each with the ops that lead to it.
    Events(Vec<Delivery>),
    Failed(Error),
    End,
}

/// One event and the state ops that lead to it.
struct Delivery {
    ops: Vec<Op>,
    event: Event,
}

/// The pipeline's end of the channel to the consumer. Events go in groups,
/// so the consumer wakes once per group rather than once per sample: a
/// group is sent when it is full, and before the pipeline waits for bytes
/// that have not arrived, so nothing ready waits behind storage.
#[derive(Clone)]
struct Outbox(Arc<Mutex<OutboxState>>);

struct OutboxState {
    tx: SyncSender<Message>,
    group: Vec<Delivery>,
    group_size: usize,
    /// A send failed: the consumer is gone.
    gone: bool,
}

impl Outbox {
    /// An outbox of groups of `group_size` events, and the consumer's end.
    fn new(queued: usize, group_size: usize) -> (Self, Receiver<Message>) {
        let group_size = group_size.max(1);
        let (tx, rx) = mpsc::sync_channel(queued.div_ceil(group_size).max(1));
        let state = OutboxState {
            tx,
            group: Vec::with_capacity(group_size),
            group_size,
            gone: false,
        };
        (Outbox(Arc::new(Mutex::new(state))), rx)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, OutboxState> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues `event` with the ops gathered so far (taken from `ops`);
    /// `Break` once the consumer is gone.
    fn send(&self, ops: &mut Vec<Op>, event: Event) -> ControlFlow<()> {
        let mut state = self.lock();
        if state.gone {
            return ControlFlow::Break(());
        }
        state.group.push(Delivery {
            ops: std::mem::take(ops),
            event,
        });
        if state.group.len() >= state.group_size {
            state.flush()
        } else {
            ControlFlow::Continue(())
        }
    }

    /// Sends the queued events now; `Break` once the consumer is gone.
    fn flush(&self) -> ControlFlow<()> {
        self.lock().flush()
    }

    /// Sends the queued events, then `last`.
    fn finish(&self, last: Message) {
        let mut state = self.lock();
        if state.flush().is_continue() {
            let _ = state.tx.send(last);
        }
    }
}

impl OutboxState {
    fn flush(&mut self) -> ControlFlow<()> {
        if self.gone {
            return ControlFlow::Break(());
        }
        if self.group.is_empty() {
            return ControlFlow::Continue(());
        }
        let group = std::mem::replace(&mut self.group, Vec::with_capacity(self.group_size));
        if self.tx.send(Message::Events(group)).is_err() {
            self.gone = true;
            return ControlFlow::Break(());
        }
        ControlFlow::Continue(())
    }
}

/// Events per message to the consumer, at most.
const MAX_DELIVERY_GROUP: usize = 16;

/// The samples of one slot for one epoch, produced on a background thread.
/// The threads start at the first [`SampleStream::poll`] (so a stream can
/// be made, and its state read, in a process that is about to fork);
/// dropping the stream stops them.
pub struct SampleStream {
    launch: Option<Launch>,
    messages: Option<Receiver<Message>>,
    /// Events received and not yet handed out, in order.
    ready: VecDeque<Delivery>,
    cancelled: Arc<AtomicBool>,
    units: Vec<WorkUnit>,
    mirror: Mirror,
    identity: StateIdentity,
    compressed: CompressedShards,
    done: bool,
    finished: bool,
}

/// The compression of each compressed shard read so far, by shard index.
type CompressedShards = Arc<Mutex<HashMap<usize, Compression>>>;

/// What the pipeline thread needs, kept until the stream starts.
struct Launch {
    reads: Vec<Read>,
    options: StreamOptions,
    rng: rand_chacha::ChaCha8Rng,
    counters: Arc<Counters>,
}

/// The parts of a state that do not change while streaming.
#[derive(Debug, Clone)]
struct StateIdentity {
    fingerprint: String,
    epoch: u64,
    slot: SlotSpec,
    resumed_from: Option<Vec<SlotState>>,
}

impl SampleStream {
    /// Plans the epoch for `slot`, from the epoch's start or from `resume`
    /// (a resumed stream takes its epoch from the state). No thread starts
    /// before the first [`SampleStream::poll`].
    pub fn new(
        shards: &[Shard],
        options: &StreamOptions,
        epoch: u64,
        slot: SlotSpec,
        counters: Arc<Counters>,
        resume: Option<Resume>,
    ) -> Result<Self> {
        let fingerprint = state::fingerprint(shards, options);
        // Every field of a resumed state is checked here, before any read.
        let state::Start {
            epoch,
            resumed_from,
            units,
            mirror,
            finished,
        } = state::resolve(shards, options, &fingerprint, epoch, &slot, resume)?;
        let reads = if finished {
            Vec::new()
        } else {
            read_list(shards, &units, &mirror)?
        };
        let mut rng = order::rng_for(
            options.seed,
            epoch,
            Purpose::ShuffleBuffer { slot: slot.slot() },
        );
        rng.set_word_pos(mirror.rng_word_pos);
        Ok(SampleStream {
            launch: Some(Launch {
                reads,
                options: options.clone(),
                rng,
                counters,
            }),
            messages: None,
            ready: VecDeque::new(),
            cancelled: Arc::new(AtomicBool::new(false)),
            units,
            mirror,
            identity: StateIdentity {
                fingerprint,
                epoch,
                slot,
                resumed_from,
            },
            compressed: CompressedShards::default(),
            done: false,
            finished,
        })
    }

    /// Starts the I/O runtime and the pipeline thread.
    fn launch(&mut self, launch: Launch) -> Result<Receiver<Message>> {
        let Launch {
            reads,
            options,
            rng,
            counters,
        } = launch;
        let fetches = reads.iter().filter_map(|r| r.fetch.clone()).collect();
        let mut read_ahead = ReadAhead::start(
            fetches,
            ReadAheadOptions {
                budget_bytes: options.read_ahead_bytes,
                chunk_bytes: options.chunk_bytes,
                io_timeout: options.io_timeout,
                s3: options.s3.clone(),
                cache: options.cache.clone(),
            },
            counters.clone(),
        )?;
        let group_size = (options.output_queue / 4).clamp(1, MAX_DELIVERY_GROUP);
        let (outbox, rx) = Outbox::new(options.output_queue, group_size);
        let hook = outbox.clone();
        read_ahead.before_wait(Arc::new(move || {
            let _ = hook.flush();
        }));
        let worker = Worker {
            read_ahead,
            reads,
            restore: self.mirror.buffer.clone(),
            shuffle: (options.shuffle_buffer > 0).then(|| {
                let bounds = ShuffleBounds {
                    max_items: options.shuffle_buffer,
                    max_bytes: options.shuffle_buffer_bytes,
                    initial: options.shuffle_initial,
                };
                ShuffleBuffer::new(bounds, rng, self.mirror.produced)
            }),
            on_error: options.on_error,
            verify_bytes: options.read_ahead_bytes as u64,
            counters,
            outbox,
            cancelled: self.cancelled.clone(),
            ops: Vec::new(),
            finished: self.finished,
            compressed: self.compressed.clone(),
            decode: options.decode.clone(),
            pending: Vec::new(),
            decode_threads: std::thread::available_parallelism().map_or(1, |n| n.get().min(4)),
            columns: options.columns.clone(),
            table_output: options.table_output,
            batch_rows: options.batch_rows,
        };
        std::thread::Builder::new()
            .name("shardstream-pipeline".into())
            .spawn(move || worker.run())
            .map_err(|e| Error::Stopped(format!("cannot start the pipeline thread: {e}")))?;
        Ok(rx)
    }

    /// The work units this slot reads in the epoch, in order.
    pub fn units(&self) -> &[WorkUnit] {
        &self.units
    }

    /// The epoch being streamed.
    pub fn epoch(&self) -> u64 {
        self.identity.epoch
    }

    /// The compression of every compressed shard opened so far, by shard
    /// index (known before any of the shard's samples is handed out).
    pub fn compressed_shards(&self) -> HashMap<usize, Compression> {
        self.compressed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The state as of the last sample handed out: resuming from it gives
    /// exactly the samples that would have followed.
    pub fn state(&self) -> SlotState {
        let (identity, mirror) = (&self.identity, &self.mirror);
        SlotState {
            format: state::STATE_FORMAT.into(),
            version: state::STATE_VERSION,
            fingerprint: identity.fingerprint.clone(),
            epoch: identity.epoch,
            world_size: identity.slot.world_size,
            rank: identity.slot.rank,
            num_workers: identity.slot.num_workers,
            worker_id: identity.slot.worker_id,
            produced: mirror.produced,
            skipped: mirror.skipped,
            cursor: mirror.cursor,
            buffer: mirror
                .buffer
                .iter()
                .map(|id| [id.shard as u64, id.index])
                .collect(),
            rng_word_pos: mirror.rng_word_pos.to_string(),
            digest: state::format_digest(mirror.digest),
            finished: self.finished,
            resumed_from: identity.resumed_from.clone(),
        }
    }

    /// Waits at most `wait` for the next event (starting the threads on
    /// the first call).
    pub fn poll(&mut self, wait: Duration) -> Result<Poll> {
        if self.done {
            return Ok(Poll::End);
        }
        if let Some(launch) = self.launch.take() {
            match self.launch(launch) {
                Ok(rx) => self.messages = Some(rx),
                Err(error) => {
                    self.done = true;
                    return Err(error);
                }
            }
        }
        if self.ready.is_empty() {
            let messages = self.messages.as_ref().expect("launched above");
            let message = match messages.recv_timeout(wait) {
                Ok(message) => message,
                Err(RecvTimeoutError::Timeout) => return Ok(Poll::Pending),
                Err(RecvTimeoutError::Disconnected) => {
                    self.done = true;
                    return Err(Error::Stopped(
                        "the pipeline thread ended without finishing".into(),
                    ));
                }
            };
            match message {
                Message::Events(group) => self.ready.extend(group),
                Message::Failed(error) => {
                    self.done = true;
                    return Err(error);
                }
                Message::End => {
                    self.done = true;
                    self.finished = true;
                    return Ok(Poll::End);
                }
            }
        }
        let Some(Delivery { ops, event }) = self.ready.pop_front() else {
            return Ok(Poll::Pending);
        };
        self.mirror.apply(&ops, &self.units);
        Ok(Poll::Ready(event))
    }
}

impl Iterator for SampleStream {
    type Item = Result<Event>;

    /// Blocks until the next event (the pipeline bounds every wait on storage).
    fn next(&mut self) -> Option<Self::Item> {
        loop {
            match self.poll(Duration::from_secs(1)) {
                Ok(Poll::Ready(event)) => return Some(Ok(event)),
                Ok(Poll::Pending) => continue,
                Ok(Poll::End) => return None,
                Err(e) => return Some(Err(e)),
            }
        }
    }
}

impl Drop for SampleStream {
    fn drop(&mut self) {
        self.cancelled.store(true, Ordering::SeqCst);
    }
}

/// What to do with the samples of one read.
#[derive(Debug)]
enum ReadPurpose {
    /// Samples of the unit at this position, within `samples` (shard indices).
    Unit {
        position: usize,
        samples: Range<u64>,
    },
    /// Samples the shuffle buffer held when the state was saved.
    Restore { wanted: HashSet<u64> },
}

/// One read of the pipeline: a unit (or part of one), or a restore read.
#[derive(Debug)]
struct Read {
    shard: usize,
    /// `None` when there is nothing to read (an empty unit).
    fetch: Option<FetchUnit>,
    /// Index of the first sample the read starts at.
    first_index: u64,
    /// The sample index, to check ranged reads against.
    index: Option<Arc<SampleIndex>>,
    /// What the shard holds.
    kind: ShardKind,
    purpose: ReadPurpose,
}

/// The reads that stream `units` from the mirror's cursor on, after the
/// reads that bring back the samples its buffer held.
fn read_list(shards: &[Shard], units: &[WorkUnit], mirror: &Mirror) -> Result<Vec<Read>> {
    let mut reads = Vec::new();
    let mut held: Vec<(usize, Vec<u64>)> = Vec::new();
    for id in &mirror.buffer {
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

fn make_read(
    shard_index: usize,
    shard: &Shard,
    samples: Range<u64>,
    purpose: ReadPurpose,
) -> Result<Read> {
    let index = shard.index.clone();
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
                None => (Some(index.byte_range(&(samples.start..end))), samples.start),
            }
        }
        None => match &shard.kind {
            ShardKind::Parquet(group) => (Some(group.span.clone()), 0),
            _ => (None, 0),
        },
    };
    Ok(Read {
        shard: shard_index,
        fetch: Some(FetchUnit {
            url: shard.url.clone(),
            location: shard.location(),
            range,
            size: shard.size,
            etag: shard.etag.clone(),
        }),
        first_index,
        index,
        kind: shard.kind.clone(),
        purpose,
    })
}

/// The pipeline thread's state.
struct Worker {
    read_ahead: ReadAhead,
    reads: Vec<Read>,
    restore: Vec<SampleId>,
    shuffle: Option<ShuffleBuffer<Sample>>,
    on_error: OnError,
    /// Decoded tar bytes over which samples of a compressed shard wait for
    /// its checksum (the read-ahead budget).
    verify_bytes: u64,
    counters: Arc<Counters>,
    outbox: Outbox,
    cancelled: Arc<AtomicBool>,
    /// Ops not yet sent to the consumer.
    ops: Vec<Op>,
    finished: bool,
    compressed: CompressedShards,
    decode: FieldDecoders,
    /// Accepted samples waiting to be decoded together.
    pending: Vec<(usize, Sample)>,
    decode_threads: usize,
    columns: Option<Vec<String>>,
    table_output: TableOutput,
    batch_rows: usize,
}

/// Samples decoded together.
const DECODE_BATCH: usize = 32;

/// Bytes a batch of pending samples must hold to be decoded on several threads.
const PARALLEL_DECODE_BYTES: usize = 256 << 10;

/// Why a read stopped before its archive ended.
enum Stop {
    /// The consumer is gone.
    Gone,
    /// The read has every sample it wanted.
    Enough,
    /// A sample does not match the manifest or cannot be decoded.
    Failed(Error),
}

impl Worker {
    fn run(mut self) {
        let final_message = if self.finished {
            Message::End
        } else {
            match self.stream() {
                Ok(ControlFlow::Break(())) => return,
                Ok(ControlFlow::Continue(())) => Message::End,
                Err(error) => Message::Failed(error),
            }
        };
        self.outbox.finish(final_message);
    }

    fn stream(&mut self) -> Result<ControlFlow<()>> {
        let reads = std::mem::take(&mut self.reads);
        let mut restored: HashMap<SampleId, Sample> = HashMap::new();
        let mut restoring = !self.restore.is_empty();
        for read in &reads {
            if self.cancelled.load(Ordering::SeqCst) {
                return Ok(ControlFlow::Break(()));
            }
            if restoring && matches!(read.purpose, ReadPurpose::Unit { .. }) {
                self.refill_buffer(&mut restored)?;
                restoring = false;
            }
            if self.read_one(read, &mut restored)?.is_break() {
                return Ok(ControlFlow::Break(()));
            }
        }
        if restoring {
            self.refill_buffer(&mut restored)?;
        }
        if let Some(buffer) = &mut self.shuffle {
            while let Some((index, sample)) = buffer.pop_random() {
                let rng_word_pos = buffer.rng_word_pos();
                self.ops.push(Op::Pop {
                    index,
                    rng_word_pos,
                });
                if send_sample(&self.outbox, &mut self.ops, &self.counters, sample).is_break() {
                    return Ok(ControlFlow::Break(()));
                }
            }
        }
        Ok(ControlFlow::Continue(()))
    }

    /// Puts the restored samples back into the buffer, in the saved order.
    fn refill_buffer(&mut self, restored: &mut HashMap<SampleId, Sample>) -> Result<()> {
        let mut items = Vec::with_capacity(self.restore.len());
        for id in &self.restore {
            let sample = restored.remove(id).ok_or_else(|| {
                Error::StateMismatch(format!(
                    "state field buffer: sample {} of shard {} held by the saved shuffle buffer is not in the data",
                    id.index, id.shard
                ))
            })?;
            items.push(sample);
        }
        let buffer = self.shuffle.as_mut().ok_or_else(|| {
            Error::StateMismatch("the state holds samples but shuffling is off".into())
        })?;
        buffer.refill(items);
        Ok(())
    }

    fn read_one(
        &mut self,
        read: &Read,
        restored: &mut HashMap<SampleId, Sample>,
    ) -> Result<ControlFlow<()>> {
        let Some(fetch) = &read.fetch else {
            if let ReadPurpose::Unit { position, .. } = read.purpose {
                self.ops.push(Op::UnitDone { unit: position });
            }
            return Ok(ControlFlow::Continue(()));
        };
        let Some(reader) = self.read_ahead.next_shard()? else {
            return Err(Error::Stopped(
                "the source ended before the last shard".into(),
            ));
        };
        let mut shard = ShardRef {
            index: read.shard,
            url: Arc::from(reader.url()),
            base_offset: fetch.range.as_ref().map_or(0, |r| r.start),
            first_index: read.first_index,
            compression: None,
        };
        let mut stop = None;
        let result = match &read.kind {
            ShardKind::Tar => self.read_tar(read, reader, &mut shard, restored, &mut stop),
            ShardKind::Raw => self.read_raw(read, reader, &shard, restored, &mut stop),
            ShardKind::Parquet(group) => match self.table_output {
                TableOutput::Rows => {
                    self.read_rows(read, group, reader, &shard, restored, &mut stop)
                }
                TableOutput::Arrow => self.send_batches(read, group, reader, &shard, &mut stop),
            },
        };
        // Samples taken before the read ended (or failed) are decoded and
        // delivered first; a decode error among them came first.
        if matches!(stop, Some(Stop::Gone)) {
            self.pending.clear();
        } else if let Err(stopped) = self.flush_decoded() {
            stop = Some(stopped);
        }
        let outcome = match (result, stop) {
            (_, Some(Stop::Gone)) => return Ok(ControlFlow::Break(())),
            (_, Some(Stop::Failed(error))) => Err(error),
            (Ok(_), Some(Stop::Enough)) => Ok(()),
            (Ok(Some(samples)), None) => self.check_complete(read, &shard, samples),
            (Ok(None), None) => return Ok(ControlFlow::Break(())),
            (Err(error), _) => Err(error),
        };
        self.settle(read, outcome)
    }

    /// Streams the samples of a tar shard (plain or compressed) into
    /// [`Worker::accept`]; `Some(count)` when the archive ended.
    fn read_tar(
        &mut self,
        read: &Read,
        reader: ShardReader,
        shard: &mut ShardRef,
        restored: &mut HashMap<SampleId, Sample>,
        stop: &mut Option<Stop>,
    ) -> Result<Option<u64>> {
        let mut stream = self.open_stream(read, reader, shard)?;
        let outcome =
            tar::read_samples_verified(&mut stream, shard, self.verify_bytes, |sample| {
                self.accept(read, sample, restored, stop)
            })?;
        Ok(match outcome {
            tar::Outcome::Completed { samples } => Some(samples),
            tar::Outcome::Stopped => None,
        })
    }

    /// Reads a raw object as its one sample.
    fn read_raw(
        &mut self,
        read: &Read,
        mut reader: ShardReader,
        shard: &ShardRef,
        restored: &mut HashMap<SampleId, Sample>,
        stop: &mut Option<Stop>,
    ) -> Result<Option<u64>> {
        let sample = blob::read_object(&mut reader, shard)?;
        let _ = self.accept(read, sample, restored, stop);
        Ok(Some(1))
    }

    /// Decodes a row group and streams its rows as samples.
    fn read_rows(
        &mut self,
        read: &Read,
        group: &RowGroup,
        reader: ShardReader,
        shard: &ShardRef,
        restored: &mut HashMap<SampleId, Sample>,
        stop: &mut Option<Stop>,
    ) -> Result<Option<u64>> {
        let mut rows = 0;
        for batch in self.decode_row_group(group, reader, shard)? {
            let batch = batch?;
            let mut samples = parquet::batch_to_samples(shard, "", &batch, rows)?;
            rows += batch.num_rows() as u64;
            for sample in &mut samples {
                sample.key = (group.first_row + sample.id.index).to_string();
            }
            for sample in samples {
                if self.accept(read, sample, restored, stop).is_break() {
                    return Ok(None);
                }
            }
        }
        Ok(Some(rows))
    }

    /// Decodes a row group and sends the rows of the read's range as Arrow
    /// batches (no shuffle buffer: options forbid one with Arrow output).
    fn send_batches(
        &mut self,
        read: &Read,
        group: &RowGroup,
        reader: ShardReader,
        shard: &ShardRef,
        stop: &mut Option<Stop>,
    ) -> Result<Option<u64>> {
        let ReadPurpose::Unit { position, samples } = &read.purpose else {
            return Err(Error::StateMismatch(
                "Arrow batches are not shuffled, yet the state holds buffered rows".into(),
            ));
        };
        let mut rows = 0;
        for batch in self.decode_row_group(group, reader, shard)? {
            let batch = batch?;
            let first = rows;
            rows += batch.num_rows() as u64;
            let start = samples.start.clamp(first, rows);
            let end = samples.end.clamp(first, rows);
            if start < end {
                let slice = batch.slice((start - first) as usize, (end - start) as usize);
                for index in start..end {
                    let id = SampleId {
                        shard: read.shard,
                        index,
                    };
                    self.ops.push(Op::Push {
                        unit: *position,
                        id,
                    });
                    self.ops.push(Op::Pop {
                        index: 0,
                        rng_word_pos: 0,
                    });
                }
                let event = Event::Batch(TableBatch {
                    url: shard.url.clone(),
                    first_row: group.first_row + start,
                    batch: slice,
                });
                if self.outbox.send(&mut self.ops, event).is_break() {
                    *stop = Some(Stop::Gone);
                    return Ok(None);
                }
                self.counters.add(Counter::Samples, end - start);
            }
            if rows >= samples.end {
                *stop = Some(Stop::Enough);
                return Ok(None);
            }
        }
        Ok(Some(rows))
    }

    /// The record batches of one row group, read whole from `reader`.
    fn decode_row_group(
        &self,
        group: &RowGroup,
        mut reader: ShardReader,
        shard: &ShardRef,
    ) -> Result<parquet::RowGroupBatches> {
        let mut bytes = Vec::with_capacity((group.span.end - group.span.start) as usize);
        if let Err(source) = read_append_to_end(&mut reader, &mut bytes) {
            return Err(reader.take_failure().unwrap_or(Error::Read {
                url: shard.url.to_string(),
                offset: group.span.start + bytes.len() as u64,
                source,
            }));
        }
        parquet::read_row_group(
            shard,
            &group.metadata,
            group.index,
            self.columns.as_deref(),
            group.span.start,
            bytes.into(),
            self.batch_rows,
        )
    }

    /// Takes one sample of a read: checks it against the manifest, keeps it
    /// for a restore, or decodes it and sends it through the shuffle buffer.
    /// `Break` (with `stop` set) ends the read.
    fn accept(
        &mut self,
        read: &Read,
        sample: Sample,
        restored: &mut HashMap<SampleId, Sample>,
        stop: &mut Option<Stop>,
    ) -> ControlFlow<()> {
        let id = sample.id;
        if let Some(index) = &read.index {
            if id.index >= index.len() || sample.offset != index.offset(id.index) {
                *stop = Some(Stop::Failed(Error::ManifestMismatch {
                    url: sample.url.to_string(),
                    reason: format!(
                        "sample {} ({:?}) starts at byte offset {}, the manifest says {}",
                        id.index,
                        sample.key,
                        sample.offset,
                        if id.index < index.len() {
                            index.offset(id.index).to_string()
                        } else {
                            "it does not exist".into()
                        }
                    ),
                }));
                return ControlFlow::Break(());
            }
        }
        let position = match &read.purpose {
            ReadPurpose::Restore { wanted } => {
                if wanted.contains(&id.index) {
                    match decode_sample(&self.decode, sample) {
                        Ok(sample) => {
                            restored.insert(id, sample);
                        }
                        Err(error) => {
                            *stop = Some(Stop::Failed(error));
                            return ControlFlow::Break(());
                        }
                    }
                }
                if id.index + 1 >= read_end(wanted) {
                    *stop = Some(Stop::Enough);
                    return ControlFlow::Break(());
                }
                return ControlFlow::Continue(());
            }
            ReadPurpose::Unit { position, samples } => {
                if id.index < samples.start {
                    return ControlFlow::Continue(());
                }
                if id.index >= samples.end {
                    *stop = Some(Stop::Enough);
                    return ControlFlow::Break(());
                }
                *position
            }
        };
        if self.decode.is_empty() {
            if self.deliver(position, sample).is_break() {
                *stop = Some(Stop::Gone);
                return ControlFlow::Break(());
            }
        } else {
            self.pending.push((position, sample));
            if self.pending.len() >= DECODE_BATCH {
                if let Err(stopped) = self.flush_decoded() {
                    *stop = Some(stopped);
                    return ControlFlow::Break(());
                }
            }
        }
        if let ReadPurpose::Unit { samples, .. } = &read.purpose {
            if id.index + 1 >= samples.end {
                *stop = Some(Stop::Enough);
                return ControlFlow::Break(());
            }
        }
        ControlFlow::Continue(())
    }

    /// Puts a sample (decoded) through the shuffle buffer, or sends it
    /// when there is none; `Break` when the consumer is gone.
    fn deliver(&mut self, position: usize, sample: Sample) -> ControlFlow<()> {
        let id = sample.id;
        let (outbox, counters, ops) = (&self.outbox, &self.counters, &mut self.ops);
        // Same order as the buffer: evictions first, then the new sample.
        match &mut self.shuffle {
            Some(buffer) => {
                while buffer.is_full_for(sample.byte_size()) {
                    let (index, evicted) = buffer.pop_random().expect("a full buffer holds items");
                    ops.push(Op::Pop {
                        index,
                        rng_word_pos: buffer.rng_word_pos(),
                    });
                    send_sample(outbox, ops, counters, evicted)?;
                }
                buffer.insert(sample);
                ops.push(Op::Push { unit: position, id });
                ControlFlow::Continue(())
            }
            None => {
                ops.push(Op::Push { unit: position, id });
                ops.push(Op::Pop {
                    index: 0,
                    rng_word_pos: 0,
                });
                send_sample(outbox, ops, counters, sample)
            }
        }
    }

    /// Decodes the pending samples, on several threads when they are
    /// large, and delivers them in their order. The first decode error
    /// stops the delivery there, as if the samples were decoded one by one.
    fn flush_decoded(&mut self) -> Result<(), Stop> {
        let pending = std::mem::take(&mut self.pending);
        for (position, decoded) in decode_all(&self.decode, pending, self.decode_threads) {
            let sample = decoded.map_err(Stop::Failed)?;
            if self.deliver(position, sample).is_break() {
                return Err(Stop::Gone);
            }
        }
        Ok(())
    }

    /// The tar bytes of a read: a read from the shard's first byte tells
    /// the compression by the magic bytes (and checks it against the
    /// manifest); a ranged read inside a plain shard is taken as it is.
    fn open_stream(
        &self,
        read: &Read,
        reader: ShardReader,
        shard: &mut ShardRef,
    ) -> Result<TarStream<ShardReader>> {
        if shard.base_offset > 0 {
            return Ok(TarStream::plain(reader, &shard.url));
        }
        let stream = TarStream::open(reader, &shard.url)?;
        shard.compression = stream.compression();
        check_compression(read, shard)?;
        if let Some(compression) = shard.compression {
            self.compressed
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(read.shard, compression);
        }
        Ok(stream)
    }

    /// Ends a read: counts a completed shard, or under `on_error="warn"`
    /// skips a bad one with a [`Event::Skipped`]; other errors end the stream.
    fn settle(&mut self, read: &Read, outcome: Result<()>) -> Result<ControlFlow<()>> {
        match outcome {
            Ok(()) => {
                self.counters.add(Counter::ShardsCompleted, 1);
                if let ReadPurpose::Unit { position, .. } = read.purpose {
                    self.ops.push(Op::UnitDone { unit: position });
                }
                Ok(ControlFlow::Continue(()))
            }
            Err(error) if self.on_error == OnError::Warn && error.is_shard_error() => {
                self.counters.add(Counter::ErrorsSkipped, 1);
                if let ReadPurpose::Unit { position, .. } = read.purpose {
                    self.ops.push(Op::UnitDone { unit: position });
                }
                Ok(self.outbox.send(&mut self.ops, Event::Skipped(error)))
            }
            Err(error) => Err(error),
        }
    }

    /// After a read with a manifest ended with its archive: did it hold
    /// every sample the manifest promised?
    fn check_complete(&self, read: &Read, shard: &ShardRef, produced: u64) -> Result<()> {
        let Some(index) = &read.index else {
            // Without a manifest a resumed cursor is checked against the
            // shard here: a cursor past its end would silently skip nothing.
            if let (ReadPurpose::Unit { samples, .. }, ShardKind::Tar) = (&read.purpose, &read.kind)
            {
                if produced < samples.start {
                    return Err(Error::StateMismatch(format!(
                        "state field cursor.next_sample: {} is past the end of {}, which holds {produced} samples",
                        samples.start, shard.url
                    )));
                }
            }
            return Ok(());
        };
        let end = match &read.purpose {
            ReadPurpose::Unit { samples, .. } => samples.end.min(index.len()),
            ReadPurpose::Restore { wanted } => read_end(wanted),
        };
        let expected = end - read.first_index;
        if produced < expected {
            let held = match read.fetch.as_ref().and_then(|f| f.range.clone()) {
                Some(range) => format!("bytes {}..{} hold", range.start, range.end),
                None => "the shard holds".into(),
            };
            return Err(Error::ManifestMismatch {
                url: shard.url.to_string(),
                reason: format!("{held} {produced} samples, the manifest says {expected}"),
            });
        }
        Ok(())
    }
}

/// With a manifest, a read from a shard's first byte must find the
/// compression the manifest records.
fn check_compression(read: &Read, shard: &ShardRef) -> Result<()> {
    let Some(index) = &read.index else {
        return Ok(());
    };
    if index.compression() == shard.compression {
        return Ok(());
    }
    let describe = |c: Option<Compression>| match c {
        Some(c) => format!("a {c} stream"),
        None => "an uncompressed tar".to_owned(),
    };
    Err(Error::ManifestMismatch {
        url: shard.url.to_string(),
        reason: format!(
            "the shard is {}, the manifest says {}",
            describe(shard.compression),
            describe(index.compression())
        ),
    })
}

/// Runs each field of `sample` through its decoder, if it has one.
fn decode_sample(decoders: &FieldDecoders, mut sample: Sample) -> Result<Sample> {
    if decoders.is_empty() {
        return Ok(sample);
    }
    for (field, value) in &mut sample.fields {
        let Some(decoder) = decoders.decoder_for(field) else {
            continue;
        };
        // Table columns may already be typed: nulls stay null, a text
        // column goes to a decoder named for it, and the defaults by
        // extension leave other typed values alone.
        let named = decoders.by_field.iter().any(|(name, _)| name == field);
        let bytes = match std::mem::replace(value, Value::Null) {
            Value::Bytes(bytes) => bytes,
            Value::Null => continue,
            Value::Str(text) if named => text.into_bytes().into(),
            other if !named => {
                *value = other;
                continue;
            }
            _ => {
                return Err(Error::Decode {
                    url: sample.url.to_string(),
                    key: sample.key.clone(),
                    field: field.clone(),
                    decoder: decoder.name(),
                    reason: "the value is neither bytes nor text".into(),
                })
            }
        };
        // A view of a mapped local shard is checked after it is decoded:
        // pages lost to the file being cut short read as zeros.
        let view = crate::source::MappedView::of(&bytes);
        let decoded = decoder.decode(bytes);
        if let Some(view) = view {
            view.verify()?;
        }
        *value = decoded.map_err(|e| Error::Decode {
            url: sample.url.to_string(),
            key: sample.key.clone(),
            field: field.clone(),
            decoder: decoder.name(),
            reason: e.reason,
        })?;
    }
    Ok(sample)
}

/// Decodes `samples` (each with its unit position), keeping their order:
/// on up to `threads` threads when they hold enough bytes to be worth it.
fn decode_all(
    decoders: &FieldDecoders,
    mut samples: Vec<(usize, Sample)>,
    threads: usize,
) -> Vec<(usize, Result<Sample>)> {
    let decode = |part: Vec<(usize, Sample)>| -> Vec<(usize, Result<Sample>)> {
        part.into_iter()
            .map(|(position, sample)| (position, decode_sample(decoders, sample)))
            .collect()
    };
    let bytes: usize = samples.iter().map(|(_, s)| s.byte_size()).sum();
    let threads = threads.min(samples.len());
    if threads <= 1 || bytes < PARALLEL_DECODE_BYTES {
        return decode(samples);
    }
    let per_thread = samples.len().div_ceil(threads);
    let mut parts = Vec::with_capacity(threads);
    while samples.len() > per_thread {
        let rest = samples.split_off(per_thread);
        parts.push(std::mem::replace(&mut samples, rest));
    }
    parts.push(samples);
    std::thread::scope(|scope| {
        let running: Vec<_> = parts
            .into_iter()
            .map(|part| scope.spawn(move || decode(part)))
            .collect();
        running
            .into_iter()
            .flat_map(|thread| thread.join().expect("decoders turn panics into errors"))
            .collect()
    })
}

fn read_end(wanted: &HashSet<u64>) -> u64 {
    wanted.iter().max().map_or(0, |m| m.saturating_add(1))
}

/// Sends a sample with the ops that lead to it; `Break` when the consumer is gone.
fn send_sample(
    outbox: &Outbox,
    ops: &mut Vec<Op>,
    counters: &Counters,
    sample: Sample,
) -> ControlFlow<()> {
    outbox.send(ops, Event::Sample(sample))?;
    counters.add(Counter::Samples, 1);
    ControlFlow::Continue(())
}
