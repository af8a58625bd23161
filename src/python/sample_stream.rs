//! The sample iterator of one `(rank, worker)` slot.

use std::ffi::CString;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pyo3::prelude::*;

use super::blocking::blocking;
use super::convert::{batch_to_dict, record_batch_to_py, sample_to_dict, BytesOut, NameCache};
use super::counters::Counters;
use super::errors::{
    panic_to_py, to_py, SampleSkippedWarning, ShardSkippedWarning, ShardStreamError,
    StreamProcessError,
};
use super::shard_list::{check_counts, ShardList};
use crate::collate::{collate, flatten_bounds, join_rows};
use crate::config::StreamOptions;
use crate::fork::{self, ForkHandlers};
use crate::format::{Sample, SampleId};
use crate::pipeline::{Event, Poll, SampleStream as Stream};
use crate::plan::SlotSpec;
use crate::state::{Resume, SkippedSamples, SlotState};
use crate::stats;

/// How long one wait for a sample lasts before Python signals are checked.
const POLL_INTERVAL: Duration = Duration::from_millis(100);

/// One sample handed out in this many is timed (its time counted this many
/// times over), so that timing costs next to nothing per sample; every
/// batch is timed.
const HANDOFF_TIMED_EVERY: u32 = 16;

/// The samples of one `(rank, worker)` slot for one epoch, as dicts with
/// `__key__`, `__url__` and one value per field (`bytes` unless decoded),
/// or collated batches of them, or `pyarrow.RecordBatch` objects. Its
/// threads start at the first `next()` (or at `start()`).
#[pyclass(module = "shardstream._core")]
pub struct SampleStream {
    inner: Mutex<Stream>,
    epoch: u64,
    batch_size: Option<usize>,
    /// Whether batches pack each bytes field into one buffer (`pack_bytes`).
    pack_bytes: bool,
    /// With `pack`, the tokens of each sequence: a batch's `cu_seqlens`
    /// are made one array over its flattened tokens.
    sequence_width: Option<usize>,
    /// An error met after part of a batch was collected, raised next time.
    pending_error: Mutex<Option<crate::Error>>,
    /// Samples taken from the stream and not yet handed out: kept across
    /// calls, so an exception (a signal, a warning turned error) between
    /// taking and handing out loses none.
    held: Mutex<Vec<Sample>>,
    /// Shards skipped while samples were collected, with what each left
    /// out: warned of (and told to `on_skip`) after the wait.
    skipped: Mutex<Vec<(crate::Error, Vec<SkippedSamples>)>>,
    /// Documents with no tokens the packer left out at the end: warned of
    /// (and told to `on_skip`) after the wait.
    empty_left_out: Mutex<Vec<SampleId>>,
    /// Called with `(epoch, shard, first, end, reason, cause)` for each
    /// skip (`end` `None`: to the shard's end; `cause` `"error"`, or
    /// `"no_tokens"` for documents with no tokens a packer left out),
    /// before its warning.
    on_skip: Option<Py<PyAny>>,
    /// Called with no argument once, when the stream ends, before `next()`
    /// says so (never after the stream failed); an `Exception` it raises
    /// is reported as unraisable, and the stream still ends.
    on_end: Mutex<Option<Py<PyAny>>>,
    /// What makes the `bytes` that local shards' long members are handed out
    /// as (in a DataLoader worker), if any: see [`BytesOut::Worker`].
    local_bytes: Option<Py<PyAny>>,
    /// What makes the `bytes` that other long members are handed out as (in
    /// a DataLoader worker), if any: see [`BytesOut::Worker`].
    shared_bytes: Option<Py<PyAny>>,
    /// The URL and field-name `str` objects shared by the dicts handed out.
    names: Mutex<NameCache>,
    /// Set while a `next()` runs: a second thread's `next()` is refused.
    busy: AtomicBool,
    /// The process that started the stream's threads (0: not started). A
    /// forked child has none of them: it must not wait on their channel.
    started_in: AtomicU32,
    /// Where the hand-off's time is counted.
    counters: Arc<stats::Counters>,
    /// Samples handed out one by one, to time one in [`HANDOFF_TIMED_EVERY`].
    handed: AtomicU32,
}

/// The right to run `next()`, held for the length of one call.
struct NextTurn<'a>(&'a AtomicBool);

impl<'a> NextTurn<'a> {
    /// Takes the turn, unless another thread holds it.
    fn take(busy: &'a AtomicBool) -> Option<Self> {
        busy.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .ok()
            .map(|_| NextTurn(busy))
    }
}

impl Drop for NextTurn<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// What one wait with the GIL released brought.
enum Collected {
    /// The held samples make a batch (or one sample).
    Full,
    /// Rows of a table, as Arrow.
    Table(crate::pipeline::TableBatch),
    /// Nothing more yet: check for signals and wait again.
    Pending,
    /// The stream ended.
    End,
    /// The stream failed.
    Failed(crate::Error),
}

#[pymethods]
impl SampleStream {
    /// The stream of one slot: `shards` with their options, for `epoch`
    /// (or the epoch of `resume`, a state JSON), at slot `(rank, worker_id)`
    /// of `world_size` ranks of `num_workers` workers. `local_bytes` makes
    /// the `bytes` of local shards' long members (see `LocalBytes`),
    /// `shared_bytes` those of the other long members (see `SharedBytes`).
    /// `on_skip(epoch, shard, first, end, reason, cause)` is called for
    /// each bad shard skipped under `on_error="warn"` with the samples it
    /// left out (`first..end` of the shard; `end` `None` when its count is
    /// unknown; `cause` `"error"`), and with `pack` for the documents with
    /// no tokens left out at the end because the packer held no tokens to
    /// carry them (`cause` `"no_tokens"`, before a `SampleSkippedWarning`).
    /// `plan_sequences`: with `pack`, the stream hands out the sequences
    /// planned from the token counts on one rank too (a mixture's stream).
    /// `on_end()` is called once when the stream ends, by the `next()`
    /// that finds the end: the one that hands out the last samples if they
    /// are fewer than a batch (before they are collated, so a failure to
    /// collate them comes after it), else the one that raises
    /// `StopIteration`; never after the stream failed. What it raises is
    /// reported with `sys.unraisablehook`.
    #[new]
    #[pyo3(signature = (
        shards, *, epoch = 0, world_size = 1, rank = 0, num_workers = 1, worker_id = 0,
        resume = None, counters = None, local_bytes = None, shared_bytes = None, on_skip = None,
        plan_sequences = false, on_end = None,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        shards: PyRef<'_, ShardList>,
        epoch: u64,
        world_size: usize,
        rank: usize,
        num_workers: usize,
        worker_id: usize,
        resume: Option<&str>,
        counters: Option<PyRef<'_, Counters>>,
        local_bytes: Option<Py<PyAny>>,
        shared_bytes: Option<Py<PyAny>>,
        on_skip: Option<Py<PyAny>>,
        plan_sequences: bool,
        on_end: Option<Py<PyAny>>,
    ) -> PyResult<Self> {
        let options = shards.options.bind(py).get();
        let slot = SlotSpec::new(world_size, rank, num_workers, worker_id).map_err(to_py)?;
        check_counts(&shards.shards, world_size).map_err(to_py)?;
        let resume = resume.map(parse_resume).transpose().map_err(to_py)?;
        let counters =
            counters.map_or_else(|| Arc::new(stats::Counters::new()), |c| c.inner.clone());
        let planned;
        let stream_options = if plan_sequences {
            planned = StreamOptions {
                plan_sequences,
                ..options.dataset.stream().clone()
            };
            &planned
        } else {
            options.dataset.stream()
        };
        let stream = Stream::new(
            &shards.shards,
            stream_options,
            epoch,
            slot,
            counters.clone(),
            resume,
        )
        .map_err(to_py)?;
        Ok(SampleStream {
            epoch: stream.epoch(),
            inner: Mutex::new(stream),
            batch_size: options.dataset.batch_size(),
            pack_bytes: options.dataset.pack_bytes(),
            sequence_width: options.dataset.stream().pack.as_ref().map(|p| p.width()),
            pending_error: Mutex::new(None),
            held: Mutex::new(Vec::new()),
            skipped: Mutex::new(Vec::new()),
            empty_left_out: Mutex::new(Vec::new()),
            on_skip,
            on_end: Mutex::new(on_end),
            local_bytes,
            shared_bytes,
            names: Mutex::new(NameCache::default()),
            busy: AtomicBool::new(false),
            started_in: AtomicU32::new(0),
            counters,
            handed: AtomicU32::new(0),
        })
    }

    /// The epoch streamed (a resumed stream takes it from the state).
    #[getter]
    pub(super) fn epoch(&self) -> u64 {
        self.epoch
    }

    /// This slot's work units in order: `(shard, first_sample, end_sample)`,
    /// the sample bounds `None` for a whole shard.
    #[getter]
    fn units(&self) -> Vec<(usize, Option<u64>, Option<u64>)> {
        let stream = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        stream
            .units()
            .iter()
            .map(|u| {
                let (start, end) = u
                    .samples
                    .as_ref()
                    .map_or((None, None), |r| (Some(r.start), Some(r.end)));
                (u.shard, start, end)
            })
            .collect()
    }

    /// Whether `next()` or `start()` has been called (its threads started).
    #[getter]
    fn started(&self) -> bool {
        self.started_in.load(Ordering::SeqCst) != 0
    }

    /// The samples the stream hands out (for a packed stream that plans its
    /// sequences, the sequences), `None` if a unit is a whole shard whose
    /// sample count is not known.
    #[getter(planned_samples)]
    fn planned_samples_of_stream(&self) -> Option<u64> {
        self.planned_samples()
    }

    /// Starts the stream's threads in this process now, without waiting
    /// for a sample: reading begins before the first `next()` (a
    /// DataLoader worker's next epoch, while the training loop finishes
    /// this one). False if they could not start (the first `next()` raises
    /// why). Raises `StreamProcessError` if the stream was started in
    /// another process.
    fn start(&self, py: Python<'_>) -> PyResult<bool> {
        let pid = process_id();
        match self
            .started_in
            .compare_exchange(0, pid, Ordering::SeqCst, Ordering::SeqCst)
        {
            Ok(_) => {}
            Err(started) if started == pid => {}
            Err(started) => return Err(started_elsewhere(started)),
        }
        blocking(py, || {
            Ok(self.inner.lock().unwrap_or_else(|e| e.into_inner()).start())
        })
    }

    /// Makes this stream, not yet started, stream what `other` (of the same
    /// dataset, also not started) would: its epoch, plan and resume. The
    /// iterator a DataLoader already holds then reads the epoch that
    /// `set_epoch` set after it was made. Returns false, changing nothing,
    /// when either stream has started.
    fn retarget(&mut self, mut other: PyRefMut<'_, SampleStream>) -> bool {
        let started = |s: &SampleStream| s.started_in.load(Ordering::SeqCst) != 0;
        if started(self) || started(&other) {
            return false;
        }
        std::mem::swap(
            self.inner.get_mut().unwrap_or_else(|e| e.into_inner()),
            other.inner.get_mut().unwrap_or_else(|e| e.into_inner()),
        );
        std::mem::swap(&mut self.epoch, &mut other.epoch);
        true
    }

    /// The state (JSON) as of the last sample handed out.
    fn state(&self) -> String {
        self.slot_state().to_json()
    }

    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    /// The next sample (a dict), batch (a dict of columns) or record batch.
    /// Raises `StreamProcessError` in a process other than the one whose
    /// `next()` started the stream (a forked child: the threads that feed
    /// the stream stayed in the parent).
    fn __next__<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        // First: a parent's `next()` running in another thread at the fork
        // leaves the child's copy busy (and its locks held) for ever.
        let pid = process_id();
        // The first call starts the stream's threads: it waits with the GIL
        // released from the outset. Later calls first take what is already
        // received without releasing it (most calls find a sample there).
        let mut wait = POLL_INTERVAL;
        match self
            .started_in
            .compare_exchange(0, pid, Ordering::SeqCst, Ordering::SeqCst)
        {
            Ok(_) => {}
            Err(started) if started == pid => wait = Duration::ZERO,
            Err(started) => return Err(started_elsewhere(started)),
        }
        let Some(_turn) = NextTurn::take(&self.busy) else {
            return Err(ShardStreamError::new_err(
                "this stream's next() is already running in another thread; iterate a stream \
                 from one thread at a time (like a generator)",
            ));
        };
        if let Some(error) = self
            .pending_error
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            return Err(to_py(error));
        }
        let want = self.batch_size.unwrap_or(1);
        loop {
            let collect = || {
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.collect(want, wait)))
            };
            let collected = if wait.is_zero() {
                collect()
            } else {
                py.detach(collect)
            }
            .map_err(|panic| panic_to_py(panic.as_ref()))?;
            let skipped =
                std::mem::take(&mut *self.skipped.lock().unwrap_or_else(|e| e.into_inner()));
            for (error, left_out) in skipped {
                if let Some(on_skip) = &self.on_skip {
                    let reason = error.to_string();
                    for s in left_out {
                        on_skip
                            .call1(py, (self.epoch, s.shard, s.first, s.end, &reason, "error"))?;
                    }
                }
                warn_skipped(py, &error)?;
            }
            let empty = std::mem::take(
                &mut *self
                    .empty_left_out
                    .lock()
                    .unwrap_or_else(|e| e.into_inner()),
            );
            if !empty.is_empty() {
                self.report_empty_left_out(py, &empty)?;
            }
            let held = || std::mem::take(&mut *self.held.lock().unwrap_or_else(|e| e.into_inner()));
            match collected {
                Collected::Full => return self.hand_out(py, held()).map(Some),
                Collected::Table(table) => return record_batch_to_py(py, table.batch).map(Some),
                Collected::Pending if wait.is_zero() => wait = POLL_INTERVAL,
                Collected::Pending => py.check_signals()?,
                Collected::End => {
                    // Called as soon as the end is known, with the last
                    // samples still to hand out (a batch short of
                    // `batch_size`): the next epoch's reads start a call
                    // sooner.
                    let on_end = self.on_end.lock().unwrap_or_else(|e| e.into_inner()).take();
                    if let Some(on_end) = on_end {
                        // The epoch ended whatever the callback raises,
                        // but an interrupt (not an `Exception`) goes on.
                        match on_end.call0(py) {
                            Err(error)
                                if error.is_instance_of::<pyo3::exceptions::PyException>(py) =>
                            {
                                error.write_unraisable(py, Some(on_end.bind(py)));
                            }
                            Err(interrupt) => return Err(interrupt),
                            Ok(_) => {}
                        }
                    }
                    let samples = held();
                    if samples.is_empty() {
                        return Ok(None);
                    }
                    return self.hand_out(py, samples).map(Some);
                }
                Collected::Failed(error) => {
                    // A failed stream does not end: the next epoch is not
                    // started after it.
                    self.on_end.lock().unwrap_or_else(|e| e.into_inner()).take();
                    let samples = held();
                    if samples.is_empty() {
                        return Err(to_py(error));
                    }
                    // The samples were taken from the stream: hand them out,
                    // and raise at the next call.
                    *self.pending_error.lock().unwrap_or_else(|e| e.into_inner()) = Some(error);
                    return self.hand_out(py, samples).map(Some);
                }
            }
        }
    }
}

impl SampleStream {
    /// The state as of the last sample handed out.
    pub(super) fn slot_state(&self) -> SlotState {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).state()
    }

    /// The samples this slot's units give, `None` if a unit is a whole
    /// shard whose sample count is not known; for a packed stream that
    /// plans its sequences, the sequences it hands out (before the first).
    pub(super) fn planned_samples(&self) -> Option<u64> {
        let stream = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(sequences) = stream.sequences_left() {
            return Some(sequences);
        }
        stream
            .units()
            .iter()
            .map(|u| u.samples.as_ref().map(|r| r.end - r.start))
            .sum()
    }

    /// Waits at most `wait` for each event (with the GIL released unless
    /// `wait` is zero) until `want` samples are held or something else
    /// happens.
    fn collect(&self, want: usize, wait: Duration) -> Collected {
        let mut stream = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        if held.len() >= want {
            return Collected::Full;
        }
        loop {
            match stream.poll(wait) {
                Ok(Poll::Ready(Event::Sample(sample))) => {
                    held.push(sample);
                    if held.len() >= want {
                        return Collected::Full;
                    }
                }
                Ok(Poll::Ready(Event::Batch(table))) => return Collected::Table(table),
                Ok(Poll::Ready(Event::Skipped(error))) => {
                    let left_out = stream.take_skipped();
                    self.skipped
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push((error, left_out));
                    if held.is_empty() {
                        return Collected::Pending;
                    }
                }
                Ok(Poll::Pending) => return Collected::Pending,
                Ok(Poll::End) => {
                    let empty = stream.take_empty_left_out();
                    self.empty_left_out
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .extend(empty);
                    return Collected::End;
                }
                Err(error) => return Collected::Failed(error),
            }
        }
    }

    /// Tells `on_skip` of the documents with no tokens the packer left out
    /// (`ids`), then warns of them with a `SampleSkippedWarning`.
    fn report_empty_left_out(&self, py: Python<'_>, ids: &[SampleId]) -> PyResult<()> {
        let reason = "a document with no tokens: the stream's packer held no tokens to make a \
                      sequence that carries it";
        let runs = id_runs(ids);
        if let Some(on_skip) = &self.on_skip {
            for &(shard, first, end) in &runs {
                on_skip.call1(
                    py,
                    (self.epoch, shard, first, Some(end), reason, "no_tokens"),
                )?;
            }
        }
        let named: Vec<String> = runs
            .iter()
            .take(3)
            .map(|(shard, first, end)| format!("samples {first} to {end} of shard index {shard}"))
            .collect();
        let more = if runs.len() > 3 { ", ..." } else { "" };
        let message = format!(
            "left out {} document(s) with no tokens ({}{more}): this stream's packer held no \
             tokens to make a sequence that carries them",
            ids.len(),
            named.join(", ")
        );
        let message = CString::new(message)
            .unwrap_or_else(|_| c"left out documents with no tokens".to_owned());
        PyErr::warn(
            py,
            py.get_type::<SampleSkippedWarning>().as_any(),
            &message,
            1,
        )
    }

    /// One sample as a dict, or a batch collated (GIL released) as
    /// columns, its time counted ([`stats::Counter::HandoffNanos`]).
    fn hand_out<'py>(&self, py: Python<'py>, samples: Vec<Sample>) -> PyResult<Bound<'py, PyAny>> {
        let scale = if self.batch_size.is_some() {
            1
        } else if self.next_handed().is_multiple_of(HANDOFF_TIMED_EVERY) {
            HANDOFF_TIMED_EVERY
        } else {
            return self.convert(py, samples);
        };
        let started = Instant::now();
        let out = self.convert(py, samples);
        let spent = stats::nanos(started.elapsed());
        self.counters.add(
            stats::Counter::HandoffNanos,
            spent.saturating_mul(u64::from(scale)),
        );
        out
    }

    /// The number of samples handed out one by one before this one (one
    /// `next()` runs at a time: no read-modify-write needed).
    fn next_handed(&self) -> u32 {
        let handed = self.handed.load(Ordering::Relaxed);
        self.handed.store(handed.wrapping_add(1), Ordering::Relaxed);
        handed
    }

    /// [`SampleStream::hand_out`], untimed.
    fn convert<'py>(&self, py: Python<'py>, samples: Vec<Sample>) -> PyResult<Bound<'py, PyAny>> {
        let local = self.local_bytes.as_ref().map(|c| c.bind(py));
        let shared = self.shared_bytes.as_ref().map(|c| c.bind(py));
        let out = if local.is_none() && shared.is_none() {
            BytesOut::Plain
        } else {
            BytesOut::Worker { local, shared }
        };
        if self.batch_size.is_none() {
            let Some(sample) = samples.into_iter().next() else {
                return Err(panic_to_py(&"a sample to hand out went missing"));
            };
            let mut names = self.names.lock().unwrap_or_else(|e| e.into_inner());
            return sample_to_dict(py, sample, out, &mut names).map(Bound::into_any);
        }
        let (pack_bytes, width) = (self.pack_bytes, self.sequence_width);
        let batch = blocking(py, || {
            let mut batch = collate(samples, pack_bytes)?;
            if let Some(width) = width {
                flatten_bounds(&mut batch, "cu_seqlens", width);
                join_rows(&mut batch, crate::format::SAMPLE_ID_FIELD);
            }
            Ok::<_, crate::Error>(batch)
        })?;
        let mut names = self.names.lock().unwrap_or_else(|e| e.into_inner());
        batch_to_dict(py, batch, out, &mut names).map(Bound::into_any)
    }
}

/// This process's id, asked of the system once per process rather than at
/// every `next()` (a system call): a fork's child forgets the parent's.
fn process_id() -> u32 {
    static REGISTERED: std::sync::Once = std::sync::Once::new();
    static FORK_HANDLERS: ForkHandlers = ForkHandlers {
        prepare: None,
        parent: None,
        child: Some(forget_process_id),
    };
    // Registered before the first id is kept, so no fork can copy a kept id
    // into a child without clearing it there.
    REGISTERED.call_once(|| fork::register(&FORK_HANDLERS));
    match PROCESS_ID.load(Ordering::SeqCst) {
        0 => {
            let pid = std::process::id();
            PROCESS_ID.store(pid, Ordering::SeqCst);
            pid
        }
        pid => pid,
    }
}

/// This process's id once asked for (0: not yet, or forgotten at a fork).
static PROCESS_ID: AtomicU32 = AtomicU32::new(0);

/// In a fork's child: the parent's id is not this process's.
fn forget_process_id() {
    PROCESS_ID.store(0, Ordering::SeqCst);
}

/// The error of a stream used in a process other than the one that
/// started it (a forked child has none of its threads).
fn started_elsewhere(started: u32) -> PyErr {
    StreamProcessError::new_err(format!(
        "this stream was started in process {started}; create a new iterator in this process"
    ))
}

/// Warns that the rest of a bad shard was skipped.
fn warn_skipped(py: Python<'_>, error: &crate::Error) -> PyResult<()> {
    let message = CString::new(format!("skipped the rest of a bad shard: {error}"))
        .unwrap_or_else(|_| c"skipped the rest of a bad shard".to_owned());
    PyErr::warn(
        py,
        py.get_type::<ShardSkippedWarning>().as_any(),
        &message,
        1,
    )
}

/// The runs of consecutive samples of one shard that `ids` (in any
/// order) make, by shard and sample: `(shard, first, end)`.
fn id_runs(ids: &[SampleId]) -> Vec<(usize, u64, u64)> {
    let mut sorted = ids.to_vec();
    sorted.sort_unstable_by_key(|id| (id.shard, id.index));
    let mut runs: Vec<(usize, u64, u64)> = Vec::new();
    for id in &sorted {
        match runs.last_mut() {
            Some((shard, _, end)) if *shard == id.shard && *end == id.index => *end += 1,
            _ => runs.push((id.shard, id.index, id.index + 1)),
        }
    }
    runs
}

/// A state JSON: one slot's state (exact resume) or a list of every slot's
/// state of a layout (elastic resume).
pub(super) fn parse_resume(json: &str) -> crate::Result<Resume> {
    if json.trim_start().starts_with('[') {
        let values: Vec<serde_json::Value> = serde_json::from_str(json).map_err(|e| {
            crate::Error::StateMismatch(format!("not a list of shardstream states: {e}"))
        })?;
        let states = values
            .iter()
            .map(|v| SlotState::from_json(&v.to_string()))
            .collect::<crate::Result<Vec<_>>>()?;
        Ok(Resume::Elastic(states))
    } else {
        Ok(Resume::Exact(SlotState::from_json(json)?))
    }
}
