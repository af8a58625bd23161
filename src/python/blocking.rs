//! The one way bindings run Rust work: with the GIL released, a panic
//! turned into a `ShardStreamError` (never a `PanicException`), the
//! crate's errors into their Python classes, and, for work that may take
//! long (resolving a dataset: listings, footers, counting), Ctrl-C checked
//! at a bounded interval.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc;
use std::time::Duration;

use pyo3::prelude::*;

use super::errors::{panic_to_py, to_py};

/// How often a long call checks for Python signals (Ctrl-C).
const SIGNAL_INTERVAL: Duration = Duration::from_millis(100);

/// Runs `f` with the GIL released; its error or panic becomes a Python
/// exception.
pub fn blocking<T: Send>(
    py: Python<'_>,
    f: impl FnOnce() -> crate::Result<T> + Send,
) -> PyResult<T> {
    match py.detach(|| catch_unwind(AssertUnwindSafe(f))) {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(error)) => Err(to_py(error)),
        Err(panic) => Err(panic_to_py(panic.as_ref())),
    }
}

/// How long a call interrupted by Ctrl-C waits for the work it asked to
/// stop ([`interruptible_stopping`]) before it raises all the same.
const STOP_GRACE: Duration = Duration::from_secs(10);

/// Runs `f` on a thread of its own and waits for it with the GIL
/// released, checking for Python signals every [`SIGNAL_INTERVAL`]: on
/// Ctrl-C the call raises `KeyboardInterrupt` at once (the thread finishes
/// its I/O in the background and its result is dropped).
pub fn interruptible<T: Send + 'static>(
    py: Python<'_>,
    f: impl FnOnce() -> crate::Result<T> + Send + 'static,
) -> PyResult<T> {
    run_interruptibly(py, f, None)
}

/// As [`interruptible`], but on Ctrl-C it calls `stop` (which asks `f` to
/// stop, and says whether `f` will) and, if `f` will, waits up to
/// [`STOP_GRACE`] for it to return before it raises `KeyboardInterrupt`:
/// what `f` cleans up on its way out (a writer's open shard) is done before
/// the interpreter can exit.
pub fn interruptible_stopping<T: Send + 'static>(
    py: Python<'_>,
    f: impl FnOnce() -> crate::Result<T> + Send + 'static,
    stop: fn() -> bool,
) -> PyResult<T> {
    run_interruptibly(py, f, Some(stop))
}

fn run_interruptibly<T: Send + 'static>(
    py: Python<'_>,
    f: impl FnOnce() -> crate::Result<T> + Send + 'static,
    stop: Option<fn() -> bool>,
) -> PyResult<T> {
    let (tx, rx) = mpsc::sync_channel(1);
    // Waited on with the GIL released, from this thread only.
    let rx = std::sync::Mutex::new(rx);
    let mut thread = Some(
        std::thread::Builder::new()
            .name("shardstream-resolve".into())
            .spawn(move || {
                let _ = tx.send(catch_unwind(AssertUnwindSafe(f)));
            })
            .map_err(|e| {
                to_py(crate::Error::Stopped(format!(
                    "cannot start a thread to resolve the dataset: {e}"
                )))
            })?,
    );
    loop {
        let received = py.detach(|| {
            rx.lock()
                .unwrap_or_else(|e| e.into_inner())
                .recv_timeout(SIGNAL_INTERVAL)
        });
        if received.is_ok() {
            if let Some(thread) = thread.take() {
                // It has sent its result and is ending: no thread outlives
                // the call (DataLoader workers fork from this process).
                let _ = py.detach(|| thread.join());
            }
        }
        match received {
            Ok(Ok(Ok(value))) => return Ok(value),
            Ok(Ok(Err(error))) => return Err(to_py(error)),
            Ok(Err(panic)) => return Err(panic_to_py(panic.as_ref())),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if let Err(interrupt) = py.check_signals() {
                    let stopping = stop.is_some_and(|stop| stop());
                    if let (true, Some(thread)) = (stopping, thread.take()) {
                        let ended = py.detach(|| {
                            rx.lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .recv_timeout(STOP_GRACE)
                        });
                        if ended.is_ok() {
                            let _ = py.detach(|| thread.join());
                        }
                    }
                    return Err(interrupt);
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                return Err(to_py(crate::Error::Stopped(
                    "the thread resolving the dataset ended without a result".into(),
                )))
            }
        }
    }
}
