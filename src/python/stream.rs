//! The sample iterator, the shard list, shared counters and the pure
//! helpers exposed to Python.

use std::ffi::CString;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString, PyTuple};

use super::convert::{batch_to_dict, record_batch_to_py, sample_to_dict, BytesOut};
use super::errors::{to_py, ShardSkippedWarning};
use crate::collate::collate;
use crate::config::{FieldDecoders, OnError, S3Options, SlotSpec, StreamOptions, TableOutput};
use crate::decode::Decoder;
use crate::format::Sample;
use crate::manifest::{self, ManifestChoice};
use crate::pipeline::{Event, Poll, SampleStream as Stream};
use crate::plan::{self, cut, PlanParams, Remainder};
use crate::spec::{self, DatasetFormat, Shard, ShardKind};
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

/// S3 options from a dict of `shardstream.S3Config` fields (durations in
/// seconds), validated: a value out of range is a `ValueError` naming it.
fn s3_options(config: Option<&Bound<'_, PyDict>>) -> PyResult<S3Options> {
    let mut o = S3Options::default();
    let Some(config) = config else {
        return Ok(o);
    };
    let shown = |value: &Bound<'_, PyAny>| {
        value
            .repr()
            .map_or_else(|_| "an unprintable value".to_owned(), |r| r.to_string())
    };
    let seconds = |value: &Bound<'_, PyAny>, name: &str| {
        let max = S3Options::MAX_DURATION;
        match value.extract::<f64>() {
            Ok(v) if (0.0..=max.as_secs_f64()).contains(&v) => Ok(Duration::from_secs_f64(v)),
            _ => Err(PyValueError::new_err(format!(
                "invalid option {name}: must be a number of seconds from 0 to {} (a year), got {}",
                max.as_secs(),
                shown(value)
            ))),
        }
    };
    let whole = |value: &Bound<'_, PyAny>, name: &str, max: u64| match value.extract::<u64>() {
        Ok(v) if v <= max => Ok(v),
        _ => Err(PyValueError::new_err(format!(
            "invalid option {name}: must be a whole number from 1 to {max}, got {}",
            shown(value)
        ))),
    };
    for (name, value) in config.iter() {
        let name: String = name.extract()?;
        if value.is_none() {
            continue;
        }
        match name.as_str() {
            "region" => o.region = Some(value.extract()?),
            "endpoint_url" => o.endpoint_url = Some(value.extract()?),
            "path_style" => o.path_style = value.extract()?,
            "profile" => o.profile = Some(value.extract()?),
            "unsigned" => o.unsigned = value.extract()?,
            "connect_timeout" => o.connect_timeout = seconds(&value, &name)?,
            "first_byte_timeout" => o.first_byte_timeout = seconds(&value, &name)?,
            "idle_timeout" => o.idle_timeout = seconds(&value, &name)?,
            "max_attempts" => {
                let max = u64::from(S3Options::MAX_ATTEMPTS);
                o.max_attempts = u32::try_from(whole(&value, &name, max)?).unwrap_or(u32::MAX);
            }
            "max_retry_time" => o.max_retry_time = seconds(&value, &name)?,
            "part_size" => {
                let max = S3Options::MAX_PART_SIZE as u64;
                o.part_size = usize::try_from(whole(&value, &name, max)?).unwrap_or(usize::MAX);
            }
            "max_concurrency" => {
                let max = S3Options::MAX_CONCURRENCY as u64;
                o.max_concurrency =
                    usize::try_from(whole(&value, &name, max)?).unwrap_or(usize::MAX);
            }
            other => {
                return Err(PyValueError::new_err(format!(
                    "unknown S3 option {other:?}"
                )))
            }
        }
    }
    o.validate().map_err(to_py)?;
    Ok(o)
}

/// The resolved shards of a dataset, with their sample indices when a
/// manifest is used, and how to reach S3.
#[pyclass(module = "shardstream._core")]
pub struct ShardList {
    shards: Arc<Vec<Shard>>,
    specs: Vec<String>,
    manifest: Option<PathBuf>,
    s3: S3Options,
    s3_config: Option<Py<PyDict>>,
    format: String,
}

#[pymethods]
impl ShardList {
    /// Resolves `specs`; `manifest` is a path, `None` for the
    /// `manifest.json` beside the shards (if any), or `False` for none;
    /// `s3` holds `shardstream.S3Config` fields; `format` is `"auto"`,
    /// `"tar"`, `"parquet"` or `"raw"`.
    #[new]
    #[pyo3(signature = (specs, *, manifest = None, s3 = None, format = "auto"))]
    fn new(
        py: Python<'_>,
        specs: Vec<String>,
        manifest: Option<&Bound<'_, PyAny>>,
        s3: Option<&Bound<'_, PyDict>>,
        format: &str,
    ) -> PyResult<Self> {
        let dataset_format = DatasetFormat::from_str(format).map_err(to_py)?;
        let s3_config = s3.map(|d| d.clone().unbind());
        let s3 = s3_options(s3)?;
        let choice = match manifest {
            None => ManifestChoice::Auto,
            Some(value) if value.is_instance_of::<pyo3::types::PyBool>() => {
                if value.extract::<bool>()? {
                    ManifestChoice::Auto
                } else {
                    ManifestChoice::Off
                }
            }
            Some(value) => ManifestChoice::Path(value.extract::<PathBuf>()?),
        };
        let (shards, manifest) = py
            .detach(|| {
                let mut shards = spec::resolve_dataset(&specs, &s3, dataset_format)?;
                let used = manifest::attach(&mut shards, &choice)?;
                Ok::<_, crate::Error>((shards, used))
            })
            .map_err(to_py)?;
        Ok(ShardList {
            shards: Arc::new(shards),
            specs,
            manifest,
            s3,
            s3_config,
            format: format.to_owned(),
        })
    }

    /// What each shard holds: `"tar"`, `"raw"` or `"parquet"` (one row group).
    #[getter]
    fn kinds(&self) -> Vec<&'static str> {
        self.shards
            .iter()
            .map(|s| match s.kind {
                ShardKind::Tar => "tar",
                ShardKind::Raw => "raw",
                ShardKind::Parquet(_) | ShardKind::ParquetFile => "parquet",
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

    /// Pickling resolves the specs again, with the same manifest.
    fn __reduce__<'py>(
        slf: &Bound<'py, Self>,
    ) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyTuple>)> {
        let py = slf.py();
        let this = slf.borrow();
        let manifest = match &this.manifest {
            Some(path) => path.clone().into_pyobject(py)?.into_any(),
            None => pyo3::types::PyBool::new(py, false).to_owned().into_any(),
        };
        let specs = this.specs.clone().into_pyobject(py)?.into_any();
        let s3 = match &this.s3_config {
            Some(config) => config.bind(py).clone().into_any(),
            None => py.None().into_bound(py),
        };
        let format = PyString::new(py, &this.format).into_any();
        let args = PyTuple::new(py, [specs, manifest, s3, format])?;
        let rebuild = py
            .import("shardstream._core")?
            .getattr("_rebuild_shard_list")?;
        Ok((rebuild, args))
    }
}

/// Unpickles a [`ShardList`].
#[pyfunction]
pub fn _rebuild_shard_list(
    py: Python<'_>,
    specs: Vec<String>,
    manifest: &Bound<'_, PyAny>,
    s3: Option<&Bound<'_, PyDict>>,
    format: &str,
) -> PyResult<ShardList> {
    ShardList::new(py, specs, Some(manifest), s3, format)
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

/// Field decoders from `decode=`: `True` (defaults by extension), a dict
/// of field name to decoder name, or `None`/`False` (none).
fn field_decoders(decode: Option<&Bound<'_, PyAny>>) -> PyResult<FieldDecoders> {
    let Some(decode) = decode else {
        return Ok(FieldDecoders::default());
    };
    if decode.is_instance_of::<pyo3::types::PyBool>() {
        return Ok(if decode.extract::<bool>()? {
            FieldDecoders::defaults()
        } else {
            FieldDecoders::default()
        });
    }
    let dict = decode.cast::<PyDict>().map_err(|_| {
        PyValueError::new_err("decode must be True, False, None or a dict of field to decoder")
    })?;
    let mut by_field = Vec::with_capacity(dict.len());
    for (field, name) in dict.iter() {
        let name: String = name.extract()?;
        let decoder = Decoder::from_str(&name)
            .map_err(|e| PyValueError::new_err(format!("invalid option decode[{field}]: {e}")))?;
        by_field.push((field.extract::<String>()?, decoder));
    }
    Ok(FieldDecoders {
        by_field,
        defaults: false,
    })
}

#[pymethods]
impl SampleStream {
    #[new]
    #[pyo3(signature = (
        shards, *, epoch = 0, world_size = 1, rank = 0, num_workers = 1, worker_id = 0,
        seed = None, shuffle_shards = None, shuffle_buffer = None, shuffle_buffer_bytes = None,
        shuffle_initial = None, read_ahead_bytes = None, on_error = None, io_timeout = None, remainder = None,
        resume = None, counters = None, decode = None, columns = None, batch_format = None,
        batch_size = None, local_bytes = None,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        shards: PyRef<'_, ShardList>,
        epoch: u64,
        world_size: usize,
        rank: usize,
        num_workers: usize,
        worker_id: usize,
        seed: Option<u64>,
        shuffle_shards: Option<bool>,
        shuffle_buffer: Option<usize>,
        shuffle_buffer_bytes: Option<usize>,
        shuffle_initial: Option<usize>,
        read_ahead_bytes: Option<usize>,
        on_error: Option<&str>,
        io_timeout: Option<f64>,
        remainder: Option<&str>,
        resume: Option<&str>,
        counters: Option<PyRef<'_, Counters>>,
        decode: Option<&Bound<'_, PyAny>>,
        columns: Option<Vec<String>>,
        batch_format: Option<&str>,
        batch_size: Option<usize>,
        local_bytes: Option<Py<PyAny>>,
    ) -> PyResult<Self> {
        let table_output = match batch_format.unwrap_or("dict") {
            "dict" => TableOutput::Rows,
            "arrow" => TableOutput::Arrow,
            other => {
                return Err(PyValueError::new_err(format!(
                    "invalid option batch_format: expected \"dict\" or \"arrow\", got {other:?}"
                )))
            }
        };
        if batch_size == Some(0) {
            return Err(PyValueError::new_err(
                "invalid option batch_size: must be at least 1",
            ));
        }
        let mut builder = StreamOptions::builder()
            .with_s3(shards.s3.clone())
            .with_decode(field_decoders(decode)?)
            .with_columns(columns)
            .with_table_output(table_output);
        if let (Some(rows), TableOutput::Arrow) = (batch_size, table_output) {
            builder = builder.with_batch_rows(rows);
        }
        if let Some(v) = seed {
            builder = builder.with_seed(v);
        }
        if let Some(v) = shuffle_shards {
            builder = builder.with_shuffle_shards(v);
        }
        if let Some(v) = shuffle_buffer {
            builder = builder.with_shuffle_buffer(v);
        }
        if let Some(v) = shuffle_buffer_bytes {
            builder = builder.with_shuffle_buffer_bytes(v);
        }
        if let Some(v) = shuffle_initial {
            builder = builder.with_shuffle_initial(v);
        }
        if let Some(v) = read_ahead_bytes {
            builder = builder.with_read_ahead_bytes(v);
        }
        if let Some(v) = on_error {
            builder = builder.with_on_error(OnError::from_str(v).map_err(to_py)?);
        }
        if let Some(v) = remainder {
            builder = builder.with_remainder(Remainder::from_str(v).map_err(to_py)?);
        }
        if let Some(v) = io_timeout {
            let timeout = Duration::try_from_secs_f64(v)
                .map_err(|_| PyValueError::new_err(format!("invalid option io_timeout: {v}")))?;
            builder = builder.with_io_timeout(timeout);
        }
        let options = builder.build().map_err(to_py)?;
        let slot = SlotSpec::new(world_size, rank, num_workers, worker_id).map_err(to_py)?;
        let resume = resume.map(parse_resume).transpose().map_err(to_py)?;
        let counters =
            counters.map_or_else(|| Arc::new(stats::Counters::new()), |c| c.inner.clone());
        let stream =
            Stream::new(&shards.shards, &options, epoch, slot, counters, resume).map_err(to_py)?;
        Ok(SampleStream {
            epoch: stream.epoch(),
            inner: Mutex::new(stream),
            batch_size: batch_size.filter(|_| table_output == TableOutput::Rows),
            pending_error: Mutex::new(None),
            held: Mutex::new(Vec::new()),
            skipped: Mutex::new(Vec::new()),
            local_bytes,
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
    fn __next__<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
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
            let collected = py.detach(|| self.collect(want));
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
            let sample = samples.into_iter().next().expect("one sample");
            return sample_to_dict(py, sample, out).map(Bound::into_any);
        }
        let batch = py.detach(|| collate(samples));
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
    let shards = py.detach(|| spec::resolve(&specs)).map_err(to_py)?;
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

/// The default stream options, by their Python keyword names.
#[pyfunction]
pub fn default_options(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let o = StreamOptions::default();
    let dict = PyDict::new(py);
    dict.set_item("seed", o.seed)?;
    dict.set_item("shuffle_shards", o.shuffle_shards)?;
    dict.set_item("shuffle_buffer", o.shuffle_buffer)?;
    dict.set_item("shuffle_buffer_bytes", o.shuffle_buffer_bytes)?;
    dict.set_item("shuffle_initial", o.shuffle_initial)?;
    dict.set_item("read_ahead_bytes", o.read_ahead_bytes)?;
    dict.set_item("on_error", "raise")?;
    dict.set_item("io_timeout", o.io_timeout.as_secs_f64())?;
    dict.set_item("remainder", "drop")?;
    Ok(dict)
}

/// Runs the `shardstream` command line with `argv` (program name first).
#[pyfunction]
pub fn run_cli(py: Python<'_>, argv: Vec<String>) -> i32 {
    py.detach(|| crate::cli::run(argv))
}
