//! The runtime of the requests made once per dataset, at resolve time,
//! outside any read-ahead (listings, sizes, footers, manifests).

use std::future::Future;
use std::time::Duration;

use crate::error::{Error, Result};

/// Runs `work` (which makes its client) on an I/O runtime made for it and
/// shut down before returning, so that no thread outlives the call
/// (DataLoader workers may fork next): how the S3 and HTTP clients are used
/// outside a read-ahead, at resolve time (listing, sizes, footers).
pub(crate) fn on_io_runtime<T>(work: impl Future<Output = Result<T>>) -> Result<T> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::Stopped(format!("cannot start the I/O runtime: {e}")))?;
    let result = runtime.block_on(work);
    runtime.shutdown_timeout(Duration::from_secs(5));
    result
}
