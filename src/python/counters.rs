//! Stream counters shared with forked DataLoader workers.

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::stats;

/// Stream counters shared with DataLoader worker processes forked after
/// their creation.
#[pyclass(module = "shardstream._core")]
pub struct Counters {
    pub(super) inner: Arc<stats::Counters>,
}

#[pymethods]
impl Counters {
    #[new]
    fn new() -> Self {
        Counters {
            inner: Arc::new(stats::Counters::new()),
        }
    }

    /// The counters as a dict of name to value, with the values derived
    /// from them (`parse_ns`, `read_ahead_bytes`).
    fn snapshot<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let dict = PyDict::new(py);
        for (name, value) in self.inner.snapshot().report() {
            dict.set_item(name, value)?;
        }
        Ok(dict)
    }

    /// Counts one sample skipped under `on_error="warn"` (its transform
    /// raised) in `errors_skipped`.
    fn count_skipped(&self) {
        self.inner.add(stats::Counter::ErrorsSkipped, 1);
    }

    /// Counts `nanos` nanoseconds spent in the Python `transform`.
    fn count_transform(&self, nanos: u64) {
        self.inner.add(stats::Counter::TransformNanos, nanos);
    }

    /// Pickling (spawned workers) gives fresh counters: only forked
    /// processes share them.
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<(Bound<'py, PyAny>, ())> {
        Ok((slf.get_type().into_any(), ()))
    }
}
