//! Stream counters shared with DataLoader workers, forked or spawned.

use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::Arc;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::stats;

/// Stream counters shared with DataLoader worker processes forked after
/// their creation and, through their descriptor, with workers started by
/// `spawn` or `forkserver`.
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

    /// The descriptor of the counters' memory, to hand to a process started
    /// by `spawn` or `forkserver`; `None` where the counters can only be
    /// shared with forked processes.
    fn fd(&self) -> Option<i32> {
        raw_descriptor(self.inner.fd())
    }

    /// The counters whose memory is the descriptor `fd` (which they take
    /// over and close), as [`Counters::fd`] gave it in another process.
    #[staticmethod]
    fn _attach(fd: i32) -> PyResult<Self> {
        let inner = attach_descriptor(fd, "stream counters", stats::Counters::attach)?;
        Ok(Counters {
            inner: Arc::new(inner),
        })
    }

    /// Plain pickling gives fresh counters (the DataLoader hands workers
    /// the shared ones through `multiprocessing`'s own pickler, see
    /// `shardstream.worker_sharing`).
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<(Bound<'py, PyAny>, ())> {
        Ok((slf.get_type().into_any(), ()))
    }
}

/// A shared table's descriptor as Python holds it (see `_attach`).
pub(super) fn raw_descriptor(fd: Option<BorrowedFd<'_>>) -> Option<i32> {
    fd.map(|fd| fd.as_raw_fd())
}

/// The shared memory behind descriptor `fd`, which the caller hands over
/// (as a table's `fd()` gave it in another process), mapped by `attach`;
/// `what` names it in the error of a descriptor that is not one.
pub(super) fn attach_descriptor<T>(
    fd: i32,
    what: &str,
    attach: impl FnOnce(OwnedFd) -> std::io::Result<T>,
) -> PyResult<T> {
    if fd < 0 {
        return Err(PyValueError::new_err(format!("invalid descriptor {fd}")));
    }
    // SAFETY: the caller hands the descriptor over (documented above).
    let file = unsafe { OwnedFd::from_raw_fd(fd) };
    attach(file).map_err(|e| PyValueError::new_err(format!("descriptor {fd} is not {what}: {e}")))
}
