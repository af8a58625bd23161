//! A mixture's weights, shared with its DataLoader workers.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::counters::{attach_descriptor, raw_descriptor};
use super::errors::ShardStreamError;
use crate::stats;

/// A mixture's weights (see [`stats::SharedWeights`]): shared with workers
/// forked after its creation, and, through its descriptor, with workers
/// started by `spawn` or `forkserver`, so that `Mix.set_weights` reaches
/// DataLoader workers that persist across epochs.
#[pyclass(module = "shardstream._core")]
pub struct SharedWeights {
    inner: stats::SharedWeights,
}

#[pymethods]
impl SharedWeights {
    /// A new table holding `weights`.
    #[new]
    fn new(weights: Vec<f64>) -> PyResult<Self> {
        let inner = stats::SharedWeights::new(&weights).map_err(PyValueError::new_err)?;
        Ok(SharedWeights { inner })
    }

    /// The weights, as the last whole write left them.
    fn get(&self) -> PyResult<Vec<f64>> {
        self.inner.get().map_err(ShardStreamError::new_err)
    }

    /// Replaces the weights.
    fn set(&self, weights: Vec<f64>) -> PyResult<()> {
        self.inner.set(&weights).map_err(PyValueError::new_err)
    }

    /// The descriptor of the table's memory, to hand to a process started
    /// by `spawn` or `forkserver`; `None` where the table can only be
    /// shared with forked processes.
    fn fd(&self) -> Option<i32> {
        raw_descriptor(self.inner.fd())
    }

    /// The table whose memory is the descriptor `fd` (which the table takes
    /// over and closes), as [`SharedWeights::fd`] gave it in another
    /// process.
    #[staticmethod]
    fn _attach(fd: i32) -> PyResult<Self> {
        let inner = attach_descriptor(fd, "a weights table", stats::SharedWeights::attach)?;
        Ok(SharedWeights { inner })
    }

    /// Plain pickling gives an unshared copy of the weights (the DataLoader
    /// hands workers the shared table through `multiprocessing`'s own
    /// pickler, see `shardstream.worker_sharing`).
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<(Bound<'py, PyAny>, (Vec<f64>,))> {
        Ok((slf.get_type().into_any(), (slf.borrow().get()?,)))
    }
}
