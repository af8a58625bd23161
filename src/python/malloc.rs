//! glibc's malloc thresholds in the process that reads DataLoader workers'
//! long members back from their shards (`shardstream.local_bytes`).

use pyo3::prelude::*;

/// Sets glibc's mmap threshold to 32 MiB and its trim threshold to 64 MiB:
/// where glibc's own adaptive rule puts them once the process has freed a
/// 32 MiB block (mallopt(3)). Below those, the heap a batch freed is reused
/// by the next batch instead of going back to the kernel and being faulted
/// in again. Process-wide. True if set; false where the C library is not
/// glibc, which has no such thresholds.
#[pyfunction]
pub fn raise_malloc_thresholds() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // glibc's ceiling for its adaptive mmap threshold on 64-bit
        // (DEFAULT_MMAP_THRESHOLD_MAX), and twice that, as its rule sets the
        // trim threshold.
        const MMAP_THRESHOLD: libc::c_int = 32 << 20;
        const TRIM_THRESHOLD: libc::c_int = 2 * MMAP_THRESHOLD;
        // SAFETY: mallopt only changes glibc's tunables, under glibc's own
        // lock; both values are within the ranges it accepts.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}
