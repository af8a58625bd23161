//! Wires plan -> source -> format -> decode -> shuffle for one slot, on a
//! pipeline thread, and hands samples to the consumer through a bounded
//! queue. A shard is a tar archive, a raw object (one sample) or one row
//! group of a Parquet file (one sample per row, or Arrow batches). The
//! consumer keeps a [`Mirror`] of the pipeline's position, so a stream can
//! report its state after any sample and resume from it.
//!
//! A read that starts at a shard's first byte tells its compression by the
//! magic bytes ([`TarStream`](crate::format::compressed::TarStream)). A compressed shard cannot be entered
//! mid-way, so every read of one, a piece of it included, starts at its
//! first byte and skips the samples before the piece.

mod decode_pool;
mod event;
mod outbox;
mod packing;
mod reads;
mod worker;

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{RecvTimeoutError, TryRecvError};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use self::decode_pool::DecodePool;
use self::event::CompressedShards;
pub use self::event::{Event, TableBatch};
use self::outbox::{Delivery, Inbox, Message, Outbox, MAX_DELIVERY_GROUP};
use self::packing::{PackStage, Planned};
use self::reads::{read_list, Read};
use self::worker::Worker;
use crate::augment::{SampleContext, TRANSFORM_SEED_FIELD};
use crate::compression::Compression;
use crate::config::StreamOptions;
use crate::error::{Error, Result};
use crate::format::{SampleId, Value, SAMPLE_ID_FIELD};
use crate::plan::{order, Purpose, SlotSpec, WorkUnit};
use crate::shard::Shard;
use crate::shuffle::ShuffleBuffer;
use crate::source::{ReadAhead, ReadAheadOptions};
use crate::state::{self, Mirror, Resume, SkippedSamples, SlotState};
use crate::stats::{Counter, Counters};
use crate::text::counts;
use crate::text::pack::PackState;

/// The most decode threads a stream starts by itself (`decode_threads`
/// given explicitly may ask for more).
pub const MAX_AUTO_DECODE_THREADS: usize = 16;

/// The decode threads of a stream when `decode_threads` is not given: the
/// cores this process may run on, shared among its `num_workers` DataLoader
/// workers (1 when iterating in the main process) and among the processes
/// of the node when torchrun says how many there are (`LOCAL_WORLD_SIZE`),
/// at least 1 and at most [`MAX_AUTO_DECODE_THREADS`].
pub fn auto_decode_threads(num_workers: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let local_processes = std::env::var("LOCAL_WORLD_SIZE")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or(1);
    let sharers = num_workers.max(1).saturating_mul(local_processes);
    (cores / sharers).clamp(1, MAX_AUTO_DECODE_THREADS)
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

/// The samples of one slot for one epoch, produced on a background thread.
/// The threads start at the first [`SampleStream::poll`], or earlier at
/// [`SampleStream::start`] (so a stream can be made, and its state read, in
/// a process that is about to fork); dropping the stream stops them.
pub struct SampleStream {
    launch: Option<Launch>,
    /// Why the threads could not start, if they could not: the first
    /// [`SampleStream::poll`] returns it.
    launch_error: Option<Error>,
    /// Whether the threads could not start (kept once the error is taken).
    launch_failed: bool,
    /// When the first [`SampleStream::poll`] asked for an event: the
    /// pipeline's waits on a full queue count from then.
    asked: Arc<OnceLock<Instant>>,
    messages: Option<Inbox>,
    /// Events received and not yet handed out, in order.
    ready: VecDeque<Delivery>,
    cancelled: Arc<AtomicBool>,
    units: Vec<WorkUnit>,
    mirror: Mirror,
    identity: StateIdentity,
    compressed: CompressedShards,
    /// The dataset seed, when each sample gets its `__seed__` field
    /// (`sample_seed`).
    sample_seed: Option<u64>,
    /// Whether each sample gets its `__id__` field (`sample_ids`).
    sample_ids: bool,
    done: bool,
    finished: bool,
    counters: Arc<Counters>,
    /// The events the pipeline thread sent, those received here, and the
    /// difference last added to [`Counter::OutputQueued`].
    sent: Arc<AtomicU64>,
    received: u64,
    queued_counted: u64,
    /// Samples handed out and not yet added to [`Counter::Samples`]: added
    /// once the events received are all handed out (one add per group
    /// received), and when the stream is dropped.
    handed_uncounted: u64,
    /// What units that ended at a skipped error left out, not yet taken
    /// ([`SampleStream::take_skipped`]).
    skipped: Vec<SkippedSamples>,
    /// With `pack`: the documents are packed into sequences, handed out
    /// instead of them.
    pack: Option<PackStage>,
    /// Documents with no tokens the packer left out at the end (no
    /// sequence to carry them), not yet taken
    /// ([`SampleStream::take_empty_left_out`]).
    empty_left_out: Vec<SampleId>,
}

/// What the pipeline thread needs, kept until the stream starts.
struct Launch {
    reads: Vec<Read>,
    /// The documents a saved packer held, read again and sent first.
    replay: Vec<SampleId>,
    options: StreamOptions,
    rng: rand_chacha::ChaCha8Rng,
    counters: Arc<Counters>,
}

/// The parts of a state that do not change while streaming.
#[derive(Debug, Clone)]
struct StateIdentity {
    fingerprint: state::Fingerprint,
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
        let fingerprint = state::Fingerprint::of(shards, options);
        let saved_pack = match &resume {
            Some(Resume::Exact(state)) => {
                SavedPack::Exact(state.pack.clone(), state.sequences_left)
            }
            Some(Resume::Elastic(_)) => SavedPack::Elastic,
            None => SavedPack::Fresh,
        };
        // Every field of a resumed state is checked here, before any read.
        let state::Start {
            epoch,
            resumed_from,
            units,
            mirror,
            finished,
            peers,
            saved_under,
        } = state::resolve(shards, options, &fingerprint, epoch, &slot, resume)?;
        let fingerprint = saved_under.unwrap_or(fingerprint);
        let pack = pack_stage(
            shards,
            options,
            PackStart {
                slot: &slot,
                epoch,
                saved: saved_pack,
                resumed_from: resumed_from.as_deref(),
                peers: peers.as_deref(),
            },
        )?;
        let replay = pack.as_ref().map_or_else(Vec::new, PackStage::replay);
        let reads = read_list(shards, &units, &mirror, &replay, finished)?;
        let mut rng = order::rng_for(
            options.seed,
            epoch,
            Purpose::ShuffleBuffer { slot: slot.slot() },
        );
        rng.set_word_pos(mirror.rng_word_pos);
        Ok(SampleStream {
            launch_error: None,
            launch_failed: false,
            asked: Arc::default(),
            launch: Some(Launch {
                reads,
                replay,
                options: options.clone(),
                rng,
                counters: counters.clone(),
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
            sample_seed: options.sample_seed.then_some(options.seed),
            sample_ids: options.sample_ids,
            done: false,
            finished,
            counters,
            sent: Arc::default(),
            received: 0,
            queued_counted: 0,
            handed_uncounted: 0,
            skipped: Vec::new(),
            pack,
            empty_left_out: Vec::new(),
        })
    }

    /// Starts the I/O runtime and the pipeline thread.
    fn launch(&mut self, launch: Launch) -> Result<Inbox> {
        let Launch {
            reads,
            replay,
            options,
            rng,
            counters,
        } = launch;
        let fetches = reads.iter().filter_map(|r| r.fetch.clone()).collect();
        let budget = options.read_ahead_budget(self.identity.slot.num_workers);
        let mut read_ahead = ReadAhead::start(
            fetches,
            ReadAheadOptions {
                budget_bytes: budget,
                chunk_bytes: options.chunk_bytes,
                map_chunk_bytes: crate::store::local::MAP_CHUNK_BYTES,
                io_timeout: options.io_timeout,
                store: options.store.clone(),
                cache: options.cache.clone(),
            },
            counters.clone(),
        )?;
        let group_size = (options.output_queue / 4).clamp(1, MAX_DELIVERY_GROUP);
        let (outbox, rx) = Outbox::new(
            options.output_queue,
            group_size,
            options.output_batch,
            counters.clone(),
            self.sent.clone(),
            self.asked.clone(),
        );
        let hook = outbox.clone();
        read_ahead.before_wait(Arc::new(move || {
            let _ = hook.flush();
        }));
        let worker = Worker {
            read_ahead,
            reads,
            restore: self.mirror.buffer.clone(),
            replay,
            shuffle: options
                .shuffle_bounds()
                .map(|bounds| ShuffleBuffer::new(bounds, rng, self.mirror.produced)),
            on_error: options.on_error,
            verify_bytes: budget as u64,
            counters: counters.clone(),
            outbox,
            cancelled: self.cancelled.clone(),
            ops: Vec::new(),
            finished: self.finished,
            compressed: self.compressed.clone(),
            decode: DecodePool::new(
                options.decode.clone(),
                options
                    .decode_threads
                    .unwrap_or_else(|| auto_decode_threads(self.identity.slot.num_workers)),
                options.seed,
                self.identity.epoch,
                counters.clone(),
            ),
            pending: Vec::new(),
            columns: options.columns.clone(),
            table_output: options.table_output,
            batch_rows: options.batch_rows,
            read_past_end: false,
        };
        std::thread::Builder::new()
            .name("shardstream-pipeline".into())
            .spawn(move || worker.run())
            .map_err(|e| Error::Stopped(format!("cannot start the pipeline thread: {e}")))?;
        Ok(rx)
    }

    /// Starts the threads, if not started yet, so that reading begins
    /// before the first [`SampleStream::poll`] (the next epoch's stream,
    /// made while the training loop finishes an epoch). False if they
    /// could not start: the first poll returns why.
    pub fn start(&mut self) -> bool {
        if let Some(launch) = self.launch.take() {
            match self.launch(launch) {
                Ok(rx) => self.messages = Some(rx),
                Err(error) => {
                    self.launch_error = Some(error);
                    self.launch_failed = true;
                }
            }
        }
        !self.launch_failed
    }

    /// The work units this slot reads in the epoch, in order.
    pub fn units(&self) -> &[WorkUnit] {
        &self.units
    }

    /// The sequences a packed stream that plans them
    /// ([`StreamOptions::plans_sequences`]) still hands out: its whole plan
    /// before the first; `None` for any other stream.
    pub fn sequences_left(&self) -> Option<u64> {
        self.pack.as_ref().and_then(PackStage::sequences_left)
    }

    /// What the units that ended at an error skipped under
    /// `on_error="warn"` left out, since the last call: taken with the
    /// [`Event::Skipped`] of each.
    pub fn take_skipped(&mut self) -> Vec<SkippedSamples> {
        std::mem::take(&mut self.skipped)
    }

    /// The documents with no tokens a packed stream left out when its
    /// documents ended, since the last call: its packer held no tokens to
    /// make a sequence that carries them (one of padding only would give a
    /// loss of no tokens). Taken once the stream has ended.
    pub fn take_empty_left_out(&mut self) -> Vec<SampleId> {
        std::mem::take(&mut self.empty_left_out)
    }

    /// The epoch being streamed.
    pub fn epoch(&self) -> u64 {
        self.identity.epoch
    }

    /// The compression of shard `shard` (by its index in the dataset's
    /// list), once it was opened: `None` for a plain tar or not yet opened.
    pub fn shard_compression(&self, shard: usize) -> Option<Compression> {
        self.compressed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&shard)
            .copied()
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
            fingerprint: identity.fingerprint.whole.clone(),
            fingerprint_parts: identity.fingerprint.parts.clone(),
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
            // A packed stream has finished once its packer is empty too;
            // across ranks, once it has handed out its planned sequences.
            finished: match self.pack.as_ref().and_then(PackStage::sequences_left) {
                Some(left) => left == 0,
                None => self.finished && self.pack.as_ref().is_none_or(PackStage::holds_nothing),
            },
            resumed_from: identity.resumed_from.clone(),
            pack: self
                .pack
                .as_ref()
                .map(PackStage::state)
                .filter(|s| !s.is_empty()),
            sequences_left: self.pack.as_ref().and_then(PackStage::sequences_left),
        }
    }

    /// Waits at most `wait` for the next event (starting the threads on
    /// the first call): with `pack`, the next sequence.
    pub fn poll(&mut self, wait: Duration) -> Result<Poll> {
        if self.pack.is_none() {
            return self.poll_documents(wait);
        }
        loop {
            let Some(stage) = &mut self.pack else {
                return Ok(Poll::End);
            };
            if let Some(sequence) = stage.next_sequence() {
                self.counters.add(Counter::Samples, 1);
                return Ok(Poll::Ready(Event::Sample(sequence)));
            }
            if stage.is_done() {
                return Ok(Poll::End);
            }
            let polled = self.poll_delivery(wait);
            let finished = self.finished;
            let Some(stage) = &mut self.pack else {
                return Ok(Poll::End);
            };
            match polled.inspect_err(|_| stage.fail())? {
                Delivered::Ready(Delivery {
                    ops,
                    event: Event::Sample(doc),
                }) => {
                    // The document counts as handed out (its ops reach the
                    // mirror) once the packer has taken it: a state saved
                    // after a document that cannot be packed resumes at it.
                    // (The packer gives sequences their own `__id__`, and
                    // `sample_seed` is refused with `pack`.)
                    stage.take(doc)?;
                    self.apply(&ops);
                }
                Delivered::Ready(Delivery { ops, event }) => {
                    self.apply(&ops);
                    return Ok(Poll::Ready(self.with_seed(event)));
                }
                Delivered::Pending => return Ok(Poll::Pending),
                // After a failure the stream ends without its open sequences.
                Delivered::End if !finished => stage.fail(),
                Delivered::End => {
                    let left_out = stage.end()?;
                    self.empty_left_out.extend(left_out);
                }
            }
        }
    }

    /// [`SampleStream::poll`] of the documents, before packing.
    fn poll_documents(&mut self, wait: Duration) -> Result<Poll> {
        Ok(match self.poll_delivery(wait)? {
            Delivered::Ready(Delivery { ops, event }) => {
                self.apply(&ops);
                self.handed_uncounted += event.samples();
                if self.ready.is_empty() {
                    self.count_handed();
                }
                Poll::Ready(self.with_seed(event))
            }
            Delivered::Pending => Poll::Pending,
            Delivered::End => Poll::End,
        })
    }

    /// Adds the samples handed out since the last count to
    /// [`Counter::Samples`].
    fn count_handed(&mut self) {
        let handed = std::mem::take(&mut self.handed_uncounted);
        if handed > 0 {
            self.counters.add(Counter::Samples, handed);
        }
    }

    /// Applies the ops of a delivery to the mirror.
    fn apply(&mut self, ops: &[state::Op]) {
        let skipped = self.mirror.apply(ops, &self.units);
        self.skipped.extend(skipped);
    }

    /// The next delivery, its ops not yet applied to the mirror (those of
    /// the end are).
    fn poll_delivery(&mut self, wait: Duration) -> Result<Delivered> {
        if self.done {
            return Ok(Delivered::End);
        }
        self.asked.get_or_init(Instant::now);
        self.start();
        if let Some(error) = self.launch_error.take() {
            self.done = true;
            return Err(error);
        }
        if self.ready.is_empty() {
            let messages = self.messages.as_ref().expect("launched above");
            // Only a wait that has to block is timed: `next()` finding
            // events ready reads no clock.
            let received = match messages.try_recv() {
                Ok(message) => Ok(message),
                Err(TryRecvError::Disconnected) => Err(RecvTimeoutError::Disconnected),
                Err(TryRecvError::Empty) if wait.is_zero() => Err(RecvTimeoutError::Timeout),
                Err(TryRecvError::Empty) => {
                    let waiting = Instant::now();
                    let received = wait_for_message(|w| messages.recv_timeout(w), wait);
                    self.counters.add_since(Counter::NextWaitNanos, waiting);
                    received
                }
            };
            let message = match received {
                Ok(message) => message,
                Err(RecvTimeoutError::Timeout) => return Ok(Delivered::Pending),
                Err(RecvTimeoutError::Disconnected) => {
                    self.done = true;
                    return Err(Error::Stopped(
                        "the pipeline thread ended without finishing".into(),
                    ));
                }
            };
            match message {
                Message::Events(group) => {
                    self.received += group.len() as u64;
                    self.count_queued();
                    self.ready.extend(group);
                }
                Message::Failed(error) => {
                    self.done = true;
                    return Err(error);
                }
                Message::End(ops) => {
                    // Without a shuffle buffer the last units end after
                    // the last sample: their ops come with the end.
                    let skipped = self.mirror.apply(&ops, &self.units);
                    self.skipped.extend(skipped);
                    self.done = true;
                    self.finished = true;
                    return Ok(Delivered::End);
                }
            }
        }
        Ok(match self.ready.pop_front() {
            Some(delivery) => Delivered::Ready(delivery),
            None => Delivered::Pending,
        })
    }

    /// Brings [`Counter::OutputQueued`] up to date with the events sent
    /// and not yet received (a level shared by every stream counting in
    /// the same counters, so this stream adds its change).
    fn count_queued(&mut self) {
        let queued = self
            .sent
            .load(Ordering::Relaxed)
            .saturating_sub(self.received);
        if queued >= self.queued_counted {
            self.counters
                .add(Counter::OutputQueued, queued - self.queued_counted);
        } else {
            self.counters
                .sub(Counter::OutputQueued, self.queued_counted - queued);
        }
        self.queued_counted = queued;
    }

    /// `event` with its sample's `__seed__` field, when `sample_seed` is
    /// on, and its `__id__` field, when `sample_ids` is on: added here, as
    /// the sample leaves, so that the shuffle buffer and the read-ahead
    /// never hold them.
    fn with_seed(&self, event: Event) -> Event {
        match event {
            Event::Sample(mut sample) => {
                if let Some(seed) = self.sample_seed {
                    let context = SampleContext {
                        seed,
                        epoch: self.identity.epoch,
                        shard: sample.id.shard,
                        index: sample.id.index,
                    };
                    sample.fields.push((
                        TRANSFORM_SEED_FIELD.to_owned(),
                        Value::Int(context.transform_seed()),
                    ));
                }
                if self.sample_ids {
                    sample.fields.push((
                        SAMPLE_ID_FIELD.to_owned(),
                        sample_id_value(self.identity.epoch, sample.id),
                    ));
                }
                Event::Sample(sample)
            }
            event => event,
        }
    }
}

/// A sample's `__id__`: the tuple `(epoch, shard index, index in shard)`,
/// each an `int` (unsigned beyond `i64`).
fn sample_id_value(epoch: u64, id: SampleId) -> Value {
    let int = |n: u64| i64::try_from(n).map_or(Value::UInt(n), Value::Int);
    Value::Tuple(vec![int(epoch), int(id.shard as u64), int(id.index)])
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

/// How long a consumer waits for its next message before it counts as
/// idle and gives back the pages of the members it dropped.
const IDLE_AFTER: Duration = Duration::from_millis(10);

/// The next message `receive` (a receiver's `recv_timeout`) gives,
/// waiting for it up to `wait`. A wait past [`IDLE_AFTER`] gives back the
/// pages of the members this thread dropped
/// ([`crate::store::local::release_pending`]) rather than leaving them for
/// its next lot: a consumer that stops (an epoch's end, an evaluation)
/// holds none, while one waiting briefly on a busy pipeline keeps filling
/// whole lots.
fn wait_for_message(
    receive: impl Fn(Duration) -> std::result::Result<Message, RecvTimeoutError>,
    wait: Duration,
) -> std::result::Result<Message, RecvTimeoutError> {
    let brief = wait.min(IDLE_AFTER);
    match receive(brief) {
        Err(RecvTimeoutError::Timeout) if wait > brief => {
            crate::store::local::release_pending();
            receive(wait - brief)
        }
        received => received,
    }
}

impl Drop for SampleStream {
    fn drop(&mut self) {
        self.count_handed();
        self.cancelled.store(true, Ordering::SeqCst);
        self.counters
            .sub(Counter::OutputQueued, self.queued_counted);
    }
}

/// What the pipeline's channel brought, before the mirror takes its ops.
enum Delivered {
    /// An event, with the ops that lead to it.
    Ready(Delivery),
    /// Nothing yet.
    Pending,
    /// The channel ended (with the stream's last ops applied), or failed
    /// earlier.
    End,
}

/// What a resumed stream's packer starts from: an exact resume's own
/// state (and, across ranks, the sequences it still hands out), or, for an
/// elastic one, the old slots' (read from the states the plan was split
/// from, each slot once).
enum SavedPack {
    Fresh,
    Exact(Option<PackState>, Option<u64>),
    Elastic,
}

/// Where a stream's packing stage starts.
struct PackStart<'a> {
    slot: &'a SlotSpec,
    epoch: u64,
    saved: SavedPack,
    /// The slot states this epoch was split from (an elastic resume).
    resumed_from: Option<&'a [SlotState]>,
    /// Every slot's units, across ranks at the start of an epoch (or of
    /// the rest of one).
    peers: Option<&'a [Vec<WorkUnit>]>,
}

/// The packers of the old slots `resumed_from` dealt to new slot `at` of
/// `slots`: each old slot's packer goes whole to one new slot (old slots in
/// (rank, worker) order, dealt round the new ones), its documents read
/// again by that slot alone.
fn dealt_packers(resumed_from: &[SlotState], slots: usize, at: usize) -> PackState {
    let mut old: Vec<&SlotState> = resumed_from.iter().collect();
    old.sort_by_key(|s| (s.rank, s.worker_id));
    let mine = old
        .into_iter()
        .enumerate()
        .filter(|(i, _)| i % slots == at)
        .filter_map(|(_, s)| s.pack.clone());
    PackState::merge(mine)
}

/// The packing stage of a stream with `pack`, rebuilding what a resumed
/// state's packer held (an elastic resume: the packers of the old slots
/// dealt to this one). Across ranks the slot hands out the sequences
/// planned for it ([`counts::sequences_of_slot`]), the same number for
/// every rank's slot of this worker, so that no rank waits for another.
fn pack_stage(
    shards: &[Shard],
    options: &StreamOptions,
    start: PackStart<'_>,
) -> Result<Option<PackStage>> {
    let Some(spec) = &options.pack else {
        return Ok(None);
    };
    let PackStart {
        slot,
        epoch,
        saved,
        resumed_from,
        peers,
    } = start;
    let plans = options.plans_sequences(slot.world_size);
    counts::check_counted(shards, spec, options.pack_tokenizer_name(), plans)?;
    let exact = matches!(saved, SavedPack::Exact(..));
    let slots = slot.world_size * slot.num_workers;
    let (saved, saved_left) = match saved {
        SavedPack::Fresh => (None, None),
        SavedPack::Exact(saved, left) => (saved, left),
        SavedPack::Elastic => (
            Some(dealt_packers(
                resumed_from.unwrap_or_default(),
                slots,
                slot.slot(),
            )),
            None,
        ),
    };
    let field_error =
        |reason: String| Error::StateMismatch(format!("state field sequences_left: {reason}"));
    let left = match peers {
        Some(peers) if plans => {
            let carried = |at: usize| {
                resumed_from.map_or(0, |from| {
                    counts::tokens_of_state(&dealt_packers(from, slots, at))
                })
            };
            let planned = counts::sequences_of_slot(shards, spec, peers, carried, slot);
            match (saved_left, exact) {
                (Some(left), _) if left > planned => {
                    return Err(field_error(format!(
                        "{left}, more than the {planned} sequences the slot's plan gives"
                    )))
                }
                (Some(left), _) => Some(left),
                (None, true) => return Err(field_error(
                    "missing from the state of a packed stream that plans its sequences (across \
                         ranks, or in a mixture)"
                        .into(),
                )),
                (None, false) => Some(planned),
            }
        }
        _ if saved_left.is_some() => {
            return Err(field_error(
                "set, but the stream plans no sequences (one rank, outside a mixture)".into(),
            ))
        }
        _ => None,
    };
    let planned = left.map(|left| Planned {
        left,
        counts: shards.iter().map(|shard| shard.tokens().cloned()).collect(),
    });
    let ids_epoch = options.sample_ids.then_some(epoch);
    Ok(Some(PackStage::new(
        spec.clone(),
        saved,
        ids_epoch,
        planned,
    )))
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;
    use crate::store::local::{waiting_page_ranges, MappedMember};

    #[test]
    fn a_consumer_idle_past_a_moment_gives_its_dropped_members_pages_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shard.tar");
        std::fs::write(&path, vec![7u8; 1 << 20]).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        // SAFETY: a file of this test's own, not modified while mapped.
        let map = unsafe { memmap2::MmapOptions::new().populate().map(&file) }.unwrap();
        let chunk = Bytes::from_owner(map);
        drop(Bytes::from_owner(MappedMember::new(chunk, 0, 64 << 10)));
        assert_eq!(
            waiting_page_ranges(),
            1,
            "a dropped member's pages wait for a lot"
        );
        let (tx, messages) = std::sync::mpsc::channel::<Message>();
        // A message at hand: no wait, the lot keeps filling.
        tx.send(Message::Events(Vec::new())).unwrap();
        let waited = wait_for_message(|w| messages.recv_timeout(w), IDLE_AFTER * 5);
        assert!(matches!(waited, Ok(Message::Events(_))));
        assert_eq!(waiting_page_ranges(), 1, "no wait, the lot waits");
        // A wait that only a moment ends keeps the lot too.
        let waited = wait_for_message(|w| messages.recv_timeout(w), IDLE_AFTER / 2);
        assert!(matches!(waited, Err(RecvTimeoutError::Timeout)));
        assert_eq!(waiting_page_ranges(), 1, "a brief wait, the lot waits");
        let waited = wait_for_message(|w| messages.recv_timeout(w), IDLE_AFTER * 5);
        assert!(matches!(waited, Err(RecvTimeoutError::Timeout)));
        assert_eq!(waiting_page_ranges(), 0, "given back once idle");
    }
}
