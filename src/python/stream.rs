//! The sample iterator, the shard list, shared counters and the pure
//! helpers exposed to Python.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyTuple};

use super::blocking::{blocking, interruptible};
use super::convert::{batch_to_dict, record_batch_to_py, sample_to_dict, BytesOut};
use super::errors::{
    panic_to_py, to_py, ManifestIgnoredWarning, ShardSkippedWarning, ShardStreamError,
    StreamProcessError,
};
use super::options::Options;
use crate::collate::collate;
use crate::config::OnError;
use crate::format::Sample;
use crate::pipeline::{Event, Poll, SampleStream as Stream};
use crate::plan::{self, cut, PlanParams, Remainder, SlotSpec};
use crate::resolve;
use crate::shard::{Shard, ShardKind};
use crate::state::{Resume, SlotState};
use crate::stats;

/// How long one wait for a sample lasts before Python signals are checked.
const POLL_INTERVAL: Duration = Duration::from_millis(100);

/// Stream counters shared with DataLoader worker processes forked after
/// their creation.
#[pyclass(module = "shardstream._core")]
pub struct Counters {
    inner: Arc<stats::Counters>,
}

#[pymethods]
impl Counters {
    #[new]
    fn new() -> Self {
        Counters {
            inner: Arc::new(stats::Counters::new()),
        }
    }

    /// The counters as a dict of name to value.
    fn snapshot<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let dict = PyDict::new(py);
        for (name, value) in self.inner.snapshot().entries() {
            dict.set_item(name, value)?;
        }
        Ok(dict)
    }

    /// Pickling (spawned workers) gives fresh counters: only forked
    /// processes share them.
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<(Bound<'py, PyAny>, ())> {
        Ok((slf.get_type().into_any(), ()))
    }
}

/// The epoch of each DataLoader worker's next iteration, by worker id (see
/// [`stats::Epochs`]): shared with workers forked after its creation, and,
/// through its descriptor, with workers started by `spawn` or `forkserver`.
#[pyclass(module = "shardstream._core")]
pub struct EpochTable {
    inner: stats::Epochs,
}

impl EpochTable {
    fn check_worker(worker: usize) -> PyResult<()> {
        if worker >= stats::EPOCH_TABLE_LEN {
            return Err(PyValueError::new_err(format!(
                "DataLoader worker {worker}: epochs are kept for at most {} workers",
                stats::EPOCH_TABLE_LEN
            )));
        }
        Ok(())
    }
}

#[pymethods]
impl EpochTable {
    /// A new table, every entry 0.
    #[new]
    fn new() -> Self {
        EpochTable {
            inner: stats::Epochs::new(),
        }
    }

    /// The number of entries: DataLoader worker ids the table serves.
    #[classattr]
    fn capacity() -> usize {
        stats::EPOCH_TABLE_LEN
    }

    /// The epoch of worker `worker`'s next iteration.
    fn get(&self, worker: usize) -> PyResult<u64> {
        Self::check_worker(worker)?;
        Ok(self.inner.get(worker))
    }

    /// Sets every entry to `epoch`.
    fn set_all(&self, epoch: u64) {
        self.inner.set_all(epoch);
    }

    /// Sets entry `worker` of a DataLoader of `num_workers` workers, and
    /// every entry from `num_workers` on, to `epoch`.
    fn set_worker(&self, worker: usize, num_workers: usize, epoch: u64) -> PyResult<()> {
        Self::check_worker(worker)?;
        if worker >= num_workers {
            return Err(PyValueError::new_err(format!(
                "worker {worker} of a DataLoader of {num_workers} workers"
            )));
        }
        self.inner.set_worker(worker, num_workers, epoch);
        Ok(())
    }

    /// Every entry, in worker id order.
    fn values(&self) -> Vec<u64> {
        self.inner.values()
    }

    /// The descriptor of the table's memory, to hand to a process started
    /// by `spawn` or `forkserver`; `None` where the table can only be
    /// shared with forked processes.
    fn fd(&self) -> Option<i32> {
        self.inner.fd().map(|fd| fd.as_raw_fd())
    }

    /// The table whose memory is the descriptor `fd` (which the table takes
    /// over and closes), as [`EpochTable::fd`] gave it in another process.
    #[staticmethod]
    fn _attach(fd: i32) -> PyResult<Self> {
        if fd < 0 {
            return Err(PyValueError::new_err(format!("invalid descriptor {fd}")));
        }
        // SAFETY: the caller hands the descriptor over (documented above).
        let file = unsafe { OwnedFd::from_raw_fd(fd) };
        let inner = stats::Epochs::attach(file).map_err(|e| {
            PyValueError::new_err(format!("descriptor {fd} is not an epoch table: {e}"))
        })?;
        Ok(EpochTable { inner })
    }

    /// A new, unshared table holding `values`.
    #[staticmethod]
    fn _from_values(values: Vec<u64>) -> PyResult<Self> {
        let inner = stats::Epochs::from_values(&values).map_err(PyValueError::new_err)?;
        Ok(EpochTable { inner })
    }

    /// Plain pickling gives an unshared copy of the entries (the DataLoader
    /// hands workers the shared table through `multiprocessing`'s own
    /// pickler, see `shardstream.dataset`).
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<(Bound<'py, PyAny>, (Vec<u64>,))> {
        let rebuild = slf.get_type().getattr("_from_values")?;
        Ok((rebuild, (slf.borrow().inner.values(),)))
    }
}

/// The resolved shards of a dataset, with their sample counts (from a
/// manifest, Parquet footers, or the headers of local tar shards), and the
/// options they were resolved with.
#[pyclass(module = "shardstream._core")]
pub struct ShardList {
    shards: Arc<Vec<Shard>>,
    specs: Vec<String>,
    manifest: Option<PathBuf>,
    options: Py<Options>,
    /// Whether the local tar shards were counted from their headers.
    counted: bool,
}

#[pymethods]
impl ShardList {
    /// Resolves `specs` with the dataset's `options` (`manifest`, `format`,
    /// `s3`, `on_error`): lists directories and prefixes, reads Parquet
    /// footers and the manifest, and counts the samples of local tar
    /// shards that no manifest describes when `count_samples=True`. With
    /// `on_error="raise"` a local shard that is missing, or malformed when
    /// counted, is an error here.
    #[new]
    fn new(py: Python<'_>, specs: Vec<String>, options: Py<Options>) -> PyResult<Self> {
        let o = options.get();
        let strict = o.stream.on_error == OnError::Raise;
        let (s3, format, choice) = (o.stream.s3.clone(), o.format, o.manifest.clone());
        let arrow = o.stream.table_output == crate::config::TableOutput::Arrow;
        let count = o.count_samples == Some(true);
        let owned_specs = specs.clone();
        let (shards, attached) = interruptible(py, move || {
            let (mut shards, attached) =
                resolve::resolve_indexed(&owned_specs, &s3, format, &choice, strict)?;
            if count {
                crate::count::count_local_tar(&mut shards, strict)?;
            }
            if arrow {
                if let Some(shard) = shards
                    .iter()
                    .find(|s| !matches!(s.kind, ShardKind::Parquet(_)))
                {
                    return Err(crate::Error::Config {
                        name: "batch_format",
                        reason: format!(
                            "\"arrow\" hands out Parquet record batches, and {} is not a Parquet file",
                            shard.url
                        ),
                    });
                }
            }
            Ok((shards, attached))
        })?;
        if let Some(reason) = &attached.ignored {
            let message = CString::new(format!("{reason} (manifest=False stops looking for one)"))
                .unwrap_or_else(|_| c"a manifest.json beside the shards was not used".to_owned());
            let category = py.get_type::<ManifestIgnoredWarning>();
            PyErr::warn(py, category.as_any(), &message, 2)?;
        }
        let manifest = attached.used;
        Ok(ShardList {
            shards: Arc::new(shards),
            specs,
            manifest,
            options,
            counted: count,
        })
    }

    /// Counts the samples of the local tar shards that have no counts yet
    /// (unless `count_samples=False`): a job of several ranks needs them.
    /// With `on_error="raise"` a malformed shard is an error here.
    fn count_samples(&mut self, py: Python<'_>) -> PyResult<()> {
        let o = self.options.get();
        if self.counted || o.count_samples == Some(false) {
            return Ok(());
        }
        let strict = o.stream.on_error == OnError::Raise;
        let mut shards = (*self.shards).clone();
        let shards = interruptible(py, move || {
            crate::count::count_local_tar(&mut shards, strict)?;
            Ok(shards)
        })?;
        self.shards = Arc::new(shards);
        self.counted = true;
        Ok(())
    }

    /// Whether the local tar shards were counted from their headers.
    #[getter]
    fn counted(&self) -> bool {
        self.counted
    }

    /// Raises if a job of `world_size` ranks cannot give every rank the
    /// same number of samples (a shard's sample count is unknown).
    fn check_equal_length(&self, world_size: usize) -> PyResult<()> {
        check_counts(&self.shards, world_size).map_err(to_py)
    }

    /// What each shard holds: `"tar"`, `"raw"` or `"parquet"` (one row group).
    #[getter]
    fn kinds(&self) -> Vec<&'static str> {
        self.shards
            .iter()
            .map(|s| match s.kind {
                ShardKind::Tar => "tar",
                ShardKind::Raw => "raw",
                ShardKind::Parquet(_) => "parquet",
            })
            .collect()
    }

    /// Shard URLs, in order.
    #[getter]
    fn urls(&self) -> Vec<String> {
        self.shards.iter().map(|s| s.url.clone()).collect()
    }

    /// Shard sizes in bytes (`None` when unknown), in order.
    #[getter]
    fn sizes(&self) -> Vec<Option<u64>> {
        self.shards.iter().map(|s| s.size).collect()
    }

    /// Sample counts per shard from the manifest, or `None` without one.
    #[getter]
    fn sample_counts(&self) -> Option<Vec<u64>> {
        self.shards.iter().map(|s| s.info().samples).collect()
    }

    /// The manifest in use, if any.
    #[getter]
    fn manifest_path(&self) -> Option<PathBuf> {
        self.manifest.clone()
    }

    /// Samples each rank gets per epoch (with a manifest), else `None`.
    #[pyo3(signature = (world_size, remainder = "drop"))]
    fn samples_per_rank(&self, world_size: usize, remainder: &str) -> PyResult<Option<u64>> {
        SlotSpec::new(world_size, 0, 1, 0).map_err(to_py)?;
        let remainder = Remainder::from_str(remainder).map_err(to_py)?;
        Ok(self
            .sample_counts()
            .map(|counts| cut::samples_per_rank(counts.iter().sum(), world_size, remainder)))
    }

    fn __len__(&self) -> usize {
        self.shards.len()
    }

    /// Pickling keeps the resolved shards (with their sample indices and
    /// Parquet footers): the copy plans over exactly these shards, without
    /// listing or reading anything again.
    fn __reduce__<'py>(
        slf: &Bound<'py, Self>,
    ) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyTuple>)> {
        let py = slf.py();
        let this = slf.borrow();
        let manifest = match &this.manifest {
            Some(path) => path.clone().into_pyobject(py)?.into_any(),
            None => py.None().into_bound(py),
        };
        let specs = this.specs.clone().into_pyobject(py)?.into_any();
        let options = this.options.bind(py).clone().into_any();
        let counted = pyo3::types::PyBool::new(py, this.counted)
            .to_owned()
            .into_any();
        let encoded = crate::resolved::encode(&this.shards).map_err(|reason| {
            to_py(crate::Error::Spec {
                spec: this.specs.join(" "),
                reason,
            })
        })?;
        let shards = PyBytes::new(py, &encoded).into_any();
        let args = PyTuple::new(py, [specs, options, manifest, counted, shards])?;
        let rebuild = py
            .import("shardstream._core")?
            .getattr("_rebuild_shard_list")?;
        Ok((rebuild, args))
    }
}

/// Unpickles a [`ShardList`]: `shards` as `ShardList.__reduce__` encoded
/// them, the manifest the original used (if any), whether it was counted,
/// and its specs and options.
#[pyfunction]
pub fn _rebuild_shard_list(
    specs: Vec<String>,
    options: Py<Options>,
    manifest: Option<PathBuf>,
    counted: bool,
    shards: &[u8],
) -> PyResult<ShardList> {
    let shards = crate::resolved::decode(shards).map_err(|reason| {
        to_py(crate::Error::Spec {
            spec: specs.join(" "),
            reason: format!("its pickled shard list {reason}"),
        })
    })?;
    Ok(ShardList {
        shards: Arc::new(shards),
        specs,
        manifest,
        options,
        counted,
    })
}

/// An error when `world_size > 1` and a shard's sample count is unknown.
fn check_counts(shards: &[Shard], world_size: usize) -> crate::Result<()> {
    if world_size > 1 {
        if let Some(uncounted) = crate::count::first_uncounted(shards) {
            return Err(crate::count::counts_needed(uncounted, world_size));
        }
    }
    Ok(())
}

/// The samples of one `(rank, worker)` slot for one epoch, as dicts with
/// `__key__`, `__url__` and one value per field (`bytes` unless decoded),
/// or collated batches of them, or `pyarrow.RecordBatch` objects. Its
/// threads start at the first `next()`.
#[pyclass(module = "shardstream._core")]
pub struct SampleStream {
    inner: Mutex<Stream>,
    epoch: u64,
    batch_size: Option<usize>,
    /// An error met after part of a batch was collected, raised next time.
    pending_error: Mutex<Option<crate::Error>>,
    /// Samples taken from the stream and not yet handed out: kept across
    /// calls, so an exception (a signal, a warning turned error) between
    /// taking and handing out loses none.
    held: Mutex<Vec<Sample>>,
    /// Shards skipped while samples were collected, warned of after the wait.
    skipped: Mutex<Vec<crate::Error>>,
    /// What makes the `bytes` that local shards' long members are handed out
    /// as (in a DataLoader worker), if any: see [`BytesOut::LocalReferences`].
    local_bytes: Option<Py<PyAny>>,
    /// Set while a `next()` runs: a second thread's `next()` is refused.
    busy: AtomicBool,
    /// The process that started the stream's threads (0: not started). A
    /// forked child has none of them: it must not wait on their channel.
    started_in: AtomicU32,
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
    /// the `bytes` of local shards' long members (see `LocalBytes`).
    #[new]
    #[pyo3(signature = (
        shards, *, epoch = 0, world_size = 1, rank = 0, num_workers = 1, worker_id = 0,
        resume = None, counters = None, local_bytes = None,
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
    ) -> PyResult<Self> {
        let options = shards.options.bind(py).get();
        let slot = SlotSpec::new(world_size, rank, num_workers, worker_id).map_err(to_py)?;
        check_counts(&shards.shards, world_size).map_err(to_py)?;
        let resume = resume.map(parse_resume).transpose().map_err(to_py)?;
        let counters =
            counters.map_or_else(|| Arc::new(stats::Counters::new()), |c| c.inner.clone());
        let stream = Stream::new(
            &shards.shards,
            &options.stream,
            epoch,
            slot,
            counters,
            resume,
        )
        .map_err(to_py)?;
        Ok(SampleStream {
            epoch: stream.epoch(),
            inner: Mutex::new(stream),
            batch_size: options.batch_size,
            pending_error: Mutex::new(None),
            held: Mutex::new(Vec::new()),
            skipped: Mutex::new(Vec::new()),
            local_bytes,
            busy: AtomicBool::new(false),
            started_in: AtomicU32::new(0),
        })
    }

    /// The epoch streamed (a resumed stream takes it from the state).
    #[getter]
    fn epoch(&self) -> u64 {
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

    /// The state (JSON) as of the last sample handed out.
    fn state(&self) -> String {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .state()
            .to_json()
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
        let pid = std::process::id();
        match self
            .started_in
            .compare_exchange(0, pid, Ordering::SeqCst, Ordering::SeqCst)
        {
            Ok(_) => {}
            Err(started) if started == pid => {}
            Err(started) => {
                return Err(StreamProcessError::new_err(format!(
                    "this stream was started in process {started}; create a new iterator in this process"
                )))
            }
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
            let collected = py
                .detach(|| {
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.collect(want)))
                })
                .map_err(|panic| panic_to_py(panic.as_ref()))?;
            let skipped =
                std::mem::take(&mut *self.skipped.lock().unwrap_or_else(|e| e.into_inner()));
            for error in skipped {
                warn_skipped(py, &error)?;
            }
            let held = || std::mem::take(&mut *self.held.lock().unwrap_or_else(|e| e.into_inner()));
            match collected {
                Collected::Full => return self.hand_out(py, held()).map(Some),
                Collected::Table(table) => return record_batch_to_py(py, table.batch).map(Some),
                Collected::Pending => py.check_signals()?,
                Collected::End => {
                    let samples = held();
                    if samples.is_empty() {
                        return Ok(None);
                    }
                    return self.hand_out(py, samples).map(Some);
                }
                Collected::Failed(error) => {
                    let samples = held();
                    if samples.is_empty() {
                        return Err(to_py(error));
                    }
                    // The samples are already counted as produced: hand them
                    // out, and raise at the next call.
                    *self.pending_error.lock().unwrap_or_else(|e| e.into_inner()) = Some(error);
                    return self.hand_out(py, samples).map(Some);
                }
            }
        }
    }
}

impl SampleStream {
    /// Waits (GIL released) until `want` samples are held or something
    /// else happens.
    fn collect(&self, want: usize) -> Collected {
        let mut stream = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        if held.len() >= want {
            return Collected::Full;
        }
        loop {
            match stream.poll(POLL_INTERVAL) {
                Ok(Poll::Ready(Event::Sample(sample))) => {
                    held.push(sample);
                    if held.len() >= want {
                        return Collected::Full;
                    }
                }
                Ok(Poll::Ready(Event::Batch(table))) => return Collected::Table(table),
                Ok(Poll::Ready(Event::Skipped(error))) => {
                    self.skipped
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push(error);
                    if held.is_empty() {
                        return Collected::Pending;
                    }
                }
                Ok(Poll::Pending) => return Collected::Pending,
                Ok(Poll::End) => return Collected::End,
                Err(error) => return Collected::Failed(error),
            }
        }
    }

    /// One sample as a dict, or a batch collated (GIL released) as columns.
    fn hand_out<'py>(&self, py: Python<'py>, samples: Vec<Sample>) -> PyResult<Bound<'py, PyAny>> {
        let class = self.local_bytes.as_ref().map(|c| c.bind(py));
        let out = class.map_or(BytesOut::Plain, BytesOut::LocalReferences);
        if self.batch_size.is_none() {
            let Some(sample) = samples.into_iter().next() else {
                return Err(panic_to_py(&"a sample to hand out went missing"));
            };
            return sample_to_dict(py, sample, out).map(Bound::into_any);
        }
        let batch = blocking(py, || Ok(collate(samples)))?;
        batch_to_dict(py, batch, out).map(Bound::into_any)
    }
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

/// A state JSON: one slot's state (exact resume) or a list of every slot's
/// state of a layout (elastic resume).
fn parse_resume(json: &str) -> crate::Result<Resume> {
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

/// Checks that `state` (JSON) is a shardstream state or list of them.
#[pyfunction]
pub fn check_state(state: &str) -> PyResult<()> {
    parse_resume(state).map(|_| ()).map_err(to_py)
}

/// Resolves dataset specs to `(url, size or None)` pairs, in order.
#[pyfunction]
pub fn resolve_shards(py: Python<'_>, specs: Vec<String>) -> PyResult<Vec<(String, Option<u64>)>> {
    let shards = py.detach(|| resolve::resolve(&specs)).map_err(to_py)?;
    Ok(shards.into_iter().map(|s| (s.url, s.size)).collect())
}

/// Validates the layout and plans one epoch of `shards`.
fn plan_slots(
    shards: Vec<plan::ShardInfo>,
    seed: u64,
    epoch: u64,
    (world_size, num_workers): (usize, usize),
    shuffle_shards: bool,
    remainder: Remainder,
) -> PyResult<Vec<Vec<plan::WorkUnit>>> {
    SlotSpec::new(world_size, 0, num_workers, 0).map_err(to_py)?;
    let params = PlanParams {
        seed,
        epoch,
        shuffle_shards,
        world_size,
        num_workers,
        remainder,
    };
    Ok(plan::plan_epoch(&shards, &params).slots)
}

/// The shard indices of every slot (`rank * num_workers + worker`) for one
/// epoch without a manifest (balanced by bytes).
#[pyfunction]
#[pyo3(signature = (sizes, *, seed, epoch, world_size, num_workers, shuffle_shards = true))]
pub fn plan_epoch(
    sizes: Vec<Option<u64>>,
    seed: u64,
    epoch: u64,
    world_size: usize,
    num_workers: usize,
    shuffle_shards: bool,
) -> PyResult<Vec<Vec<usize>>> {
    let shards = sizes
        .into_iter()
        .map(|size| plan::ShardInfo {
            size,
            samples: None,
        })
        .collect();
    let slots = plan_slots(
        shards,
        seed,
        epoch,
        (world_size, num_workers),
        shuffle_shards,
        Remainder::Drop,
    )?;
    Ok(slots
        .into_iter()
        .map(|slot| slot.into_iter().map(|u| u.shard).collect())
        .collect())
}

/// The sample runs `(shard, start, end)` of every slot for one epoch when
/// every shard's sample count is known (equal samples per rank).
#[pyfunction]
#[pyo3(signature = (counts, *, seed, epoch, world_size, num_workers, shuffle_shards = true, remainder = "drop"))]
pub fn plan_samples(
    counts: Vec<u64>,
    seed: u64,
    epoch: u64,
    world_size: usize,
    num_workers: usize,
    shuffle_shards: bool,
    remainder: &str,
) -> PyResult<Vec<Vec<(usize, u64, u64)>>> {
    let remainder = Remainder::from_str(remainder).map_err(to_py)?;
    let shards = counts
        .into_iter()
        .map(|n| plan::ShardInfo {
            size: None,
            samples: Some(n),
        })
        .collect();
    let slots = plan_slots(
        shards,
        seed,
        epoch,
        (world_size, num_workers),
        shuffle_shards,
        remainder,
    )?;
    Ok(slots
        .into_iter()
        .map(|slot| {
            slot.into_iter()
                .map(|u| {
                    let r = u.samples.unwrap_or(0..0);
                    (u.shard, r.start, r.end)
                })
                .collect()
        })
        .collect())
}

/// Runs the `shardstream` command line with `argv` (program name first).
#[pyfunction]
pub fn run_cli(py: Python<'_>, argv: Vec<String>) -> i32 {
    py.detach(|| crate::cli::run(argv))
}
