//! The epoch table that DataLoader workers read their next epoch from.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::counters::{attach_descriptor, raw_descriptor};
use crate::stats;

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

    /// Sets every entry to `epoch`, and clears `worker_began`.
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

    /// Records that a DataLoader (or DataLoader2, Grain) worker began an
    /// iteration: until `set_all`, the process that made the table does
    /// not know how far the workers got.
    fn mark_worker_began(&self) {
        self.inner.mark_worker_began();
    }

    /// Whether a worker began an iteration since `set_all` last ran.
    fn worker_began(&self) -> bool {
        self.inner.worker_began()
    }

    /// Every entry, in worker id order.
    fn values(&self) -> Vec<u64> {
        self.inner.values()
    }

    /// The descriptor of the table's memory, to hand to a process started
    /// by `spawn` or `forkserver`; `None` where the table can only be
    /// shared with forked processes.
    fn fd(&self) -> Option<i32> {
        raw_descriptor(self.inner.fd())
    }

    /// The table whose memory is the descriptor `fd` (which the table takes
    /// over and closes), as [`EpochTable::fd`] gave it in another process.
    #[staticmethod]
    fn _attach(fd: i32) -> PyResult<Self> {
        let inner = attach_descriptor(fd, "an epoch table", stats::Epochs::attach)?;
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
    /// pickler, see `shardstream.worker_sharing`).
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<(Bound<'py, PyAny>, (Vec<u64>,))> {
        let rebuild = slf.get_type().getattr("_from_values")?;
        Ok((rebuild, (slf.borrow().inner.values(),)))
    }
}
