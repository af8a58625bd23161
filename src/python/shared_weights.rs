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
    /// A new table holding `weights` for every epoch.
    #[new]
    fn new(weights: Vec<f64>) -> PyResult<Self> {
        let inner = stats::SharedWeights::new(&weights).map_err(PyValueError::new_err)?;
        Ok(SharedWeights { inner })
    }

    /// The weights epoch `epoch` mixes by, as the last whole write left
    /// them.
    fn get(&self, epoch: u64) -> PyResult<Vec<f64>> {
        self.inner.get(epoch).map_err(ShardStreamError::new_err)
    }

    /// Makes `weights` those of epoch `epoch` and the ones after it (the
    /// epochs before take the weights epoch `epoch - 1` had).
    fn set(&self, weights: Vec<f64>, epoch: u64) -> PyResult<()> {
        self.inner
            .set(&weights, epoch)
            .map_err(PyValueError::new_err)
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

    /// The table's state: the first epoch of the newest weights, the
    /// weights of the epochs before it, and the newest.
    fn _held(&self) -> PyResult<(u64, Vec<f64>, Vec<f64>)> {
        self.inner.held_whole().map_err(ShardStreamError::new_err)
    }

    /// A new, unshared table holding `before` for the epochs before
    /// `from_epoch` and `after` from it on.
    #[staticmethod]
    fn _from_parts(from_epoch: u64, before: Vec<f64>, after: Vec<f64>) -> PyResult<Self> {
        let inner = stats::SharedWeights::new(&before).map_err(PyValueError::new_err)?;
        inner
            .set(&after, from_epoch)
            .map_err(PyValueError::new_err)?;
        Ok(SharedWeights { inner })
    }

    /// Plain pickling gives an unshared copy of the table (the DataLoader
    /// hands workers the shared table through `multiprocessing`'s own
    /// pickler, see `shardstream.worker_sharing`).
    #[allow(clippy::type_complexity)]
    fn __reduce__<'py>(
        slf: &Bound<'py, Self>,
    ) -> PyResult<(Bound<'py, PyAny>, (u64, Vec<f64>, Vec<f64>))> {
        let rebuild = slf.get_type().getattr("_from_parts")?;
        Ok((rebuild, slf.borrow()._held()?))
    }
}
