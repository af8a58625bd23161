//! The sample iterator, shared counters and pure helpers exposed to Python.

use std::ffi::CString;
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyString};

use super::errors::{to_py, ShardSkippedWarning};
use crate::config::{OnError, SlotSpec, StreamOptions};
use crate::pipeline::{Event, Poll, SampleStream as Stream};
use crate::plan::{self, PlanParams};
use crate::spec::{self, Shard};
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

/// The samples of one `(rank, worker)` slot for one epoch, as dicts with
/// `__key__`, `__url__` and one `bytes` value per field.
#[pyclass(module = "shardstream._core")]
pub struct SampleStream {
    inner: Mutex<Stream>,
    units: Vec<usize>,
}

#[pymethods]
impl SampleStream {
    #[new]
    #[pyo3(signature = (
        shards, *, epoch = 0, world_size = 1, rank = 0, num_workers = 1, worker_id = 0,
        seed = None, shuffle_shards = None, shuffle_buffer = None, shuffle_buffer_bytes = None,
        read_ahead_bytes = None, on_error = None, io_timeout = None, counters = None,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        shards: Vec<(String, Option<u64>)>,
        epoch: u64,
        world_size: usize,
        rank: usize,
        num_workers: usize,
        worker_id: usize,
        seed: Option<u64>,
        shuffle_shards: Option<bool>,
        shuffle_buffer: Option<usize>,
        shuffle_buffer_bytes: Option<usize>,
        read_ahead_bytes: Option<usize>,
        on_error: Option<&str>,
        io_timeout: Option<f64>,
        counters: Option<PyRef<'_, Counters>>,
    ) -> PyResult<Self> {
        let mut builder = StreamOptions::builder();
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
        if let Some(v) = read_ahead_bytes {
            builder = builder.with_read_ahead_bytes(v);
        }
        if let Some(v) = on_error {
            builder = builder.with_on_error(OnError::from_str(v).map_err(to_py)?);
        }
        if let Some(v) = io_timeout {
            let timeout = Duration::try_from_secs_f64(v)
                .map_err(|_| PyValueError::new_err(format!("invalid option io_timeout: {v}")))?;
            builder = builder.with_io_timeout(timeout);
        }
        let options = builder.build().map_err(to_py)?;
        let slot = SlotSpec::new(world_size, rank, num_workers, worker_id).map_err(to_py)?;
        let shards: Vec<Shard> = shards
            .into_iter()
            .map(|(url, size)| Shard { url, size })
            .collect();
        let counters =
            counters.map_or_else(|| Arc::new(stats::Counters::new()), |c| c.inner.clone());
        let stream = Stream::start(&shards, &options, epoch, slot, counters).map_err(to_py)?;
        Ok(SampleStream {
            units: stream.units().to_vec(),
            inner: Mutex::new(stream),
        })
    }

    /// Indices (into the shard list) of the shards this stream reads, in order.
    #[getter]
    fn units(&self) -> Vec<usize> {
        self.units.clone()
    }

    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        loop {
            let polled = py.detach(|| {
                let mut stream = self.inner.lock().unwrap_or_else(|e| e.into_inner());
                stream.poll(POLL_INTERVAL)
            });
            match polled.map_err(to_py)? {
                Poll::Ready(Event::Sample(sample)) => {
                    let dict = PyDict::new(py);
                    dict.set_item("__key__", PyString::new(py, &sample.key))?;
                    dict.set_item("__url__", PyString::new(py, &sample.url))?;
                    for (field, value) in &sample.fields {
                        dict.set_item(field, PyBytes::new(py, value))?;
                    }
                    return Ok(Some(dict));
                }
                Poll::Ready(Event::Skipped(error)) => {
                    let message = CString::new(format!("skipped the rest of a bad shard: {error}"))
                        .unwrap_or_else(|_| c"skipped the rest of a bad shard".to_owned());
                    PyErr::warn(
                        py,
                        py.get_type::<ShardSkippedWarning>().as_any(),
                        &message,
                        1,
                    )?;
                }
                Poll::Pending => py.check_signals()?,
                Poll::End => return Ok(None),
            }
        }
    }
}

/// Resolves dataset specs to `(url, size or None)` pairs, in order.
#[pyfunction]
pub fn resolve_shards(py: Python<'_>, specs: Vec<String>) -> PyResult<Vec<(String, Option<u64>)>> {
    let shards = py.detach(|| spec::resolve(&specs)).map_err(to_py)?;
    Ok(shards.into_iter().map(|s| (s.url, s.size)).collect())
}

/// The shard indices of every slot (`rank * num_workers + worker`) for one epoch.
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
    SlotSpec::new(world_size, 0, num_workers, 0).map_err(to_py)?;
    let params = PlanParams {
        seed,
        epoch,
        shuffle_shards,
        world_size,
        num_workers,
    };
    Ok(plan::plan_epoch(&sizes, &params).slots)
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
    dict.set_item("read_ahead_bytes", o.read_ahead_bytes)?;
    dict.set_item("on_error", "raise")?;
    dict.set_item("io_timeout", o.io_timeout.as_secs_f64())?;
    Ok(dict)
}

/// Runs the `shardstream` command line with `argv` (program name first).
#[pyfunction]
pub fn run_cli(py: Python<'_>, argv: Vec<String>) -> i32 {
    py.detach(|| crate::cli::run(argv))
}
