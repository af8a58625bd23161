//! Python bindings: the only module that names pyo3. It converts errors,
//! releases the GIL around every blocking wait, and stays thin.

mod audio;
mod blocking;
pub mod convert;
mod counters;
mod epoch_table;
mod errors;
mod functions;
mod image;
mod ledger;
mod malloc;
mod mix;
mod options;
mod pack;
mod sample_stream;
mod shard_list;
mod shared_weights;
mod tokenizer;
mod writer;

use pyo3::prelude::*;

/// jemalloc for the Rust side of the extension (see Cargo.toml for why).
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// The options of that jemalloc, read once when it starts (its
/// `malloc_conf`, under the prefix tikv-jemalloc-sys builds it with; the
/// `_RJEM_MALLOC_CONF` environment variable still overrides them).
///
/// `oversize_threshold`: jemalloc gives allocations over 8 MiB (its
/// default) to an arena that hands their pages back to the kernel as soon
/// as they are freed, so every collated batch of images (64 x 3x224x224
/// bytes is 9.6 MB) was faulted in page by page anew. Raised to 64 MiB (a
/// batch of 256 such images is 38.5 MB), a freed batch's pages are reused
/// by the next, and go back to the kernel after jemalloc's dirty decay (10
/// s). Measured over 7 epochs of 1,024 `Image(224)` JPEGs in batches of 64
/// at workers 0: 289k minor page faults against 547k, and 7.0 s of CPU
/// against 8.0 s.
#[export_name = "_rjem_malloc_conf"]
static MALLOC_CONF: MallocConf = MallocConf(c"oversize_threshold:67108864".as_ptr());

/// A C string as jemalloc reads `malloc_conf`: one pointer.
#[repr(transparent)]
struct MallocConf(*const std::ffi::c_char);

// SAFETY: the pointer is to a string literal: immutable and 'static.
unsafe impl Sync for MallocConf {}

/// The native core of `shardstream`.
#[pymodule(module = "shardstream")]
mod _core {
    use super::*;

    #[pymodule_export]
    use super::audio::AudioClip;
    #[pymodule_export]
    use super::convert::ArrowExport;
    #[pymodule_export]
    use super::counters::Counters;
    #[pymodule_export]
    use super::epoch_table::EpochTable;
    #[pymodule_export]
    use super::errors::{
        DatasetSpecError, DecodeFieldWarning, FieldDecodeError, ManifestError,
        ManifestIgnoredWarning, ManifestMismatchError, ObjectChangedError, SampleSkippedWarning,
        ShardFormatError, ShardNotFoundError, ShardReadError, ShardSkippedWarning,
        ShardStreamError, ShardWriteError, StateMismatchError, StorageAuthError,
        StreamProcessError, TransformError,
    };
    #[pymodule_export]
    use super::functions::{
        check_layout, check_state, plan_epoch, plan_samples, resolve_shards, run_cli,
    };
    #[pymodule_export]
    use super::image::{Image, ImageBoxes};
    #[pymodule_export]
    use super::ledger::LedgerRecords;
    #[pymodule_export]
    use super::malloc::raise_malloc_thresholds;
    #[pymodule_export]
    use super::mix::{check_mix, check_mix_state, mix_counts, mix_order, MixSlot};
    #[pymodule_export]
    use super::options::{
        default_options, default_s3_options, default_writer_options, option_table,
        read_ahead_budget, s3_option_table, Options,
    };
    #[pymodule_export]
    use super::pack::Pack;
    #[pymodule_export]
    use super::sample_stream::SampleStream;
    #[pymodule_export]
    use super::shard_list::{_rebuild_shard_list, ShardList};
    #[pymodule_export]
    use super::shared_weights::SharedWeights;

    #[pymodule_export]
    use super::tokenizer::Tokenizer;
    #[pymodule_export]
    use super::writer::{write_manifest, ShardWriter};

    #[pymodule_init]
    fn init(m: &Bound<'_, PyModule>) -> PyResult<()> {
        super::mix::add_constants(m)?;
        m.add("__version__", env!("CARGO_PKG_VERSION"))
    }
}

#[cfg(test)]
mod tests {
    // jemalloc's `mallctl`, as tikv-jemalloc-sys exports it.
    extern "C" {
        fn _rjem_mallctl(
            name: *const std::ffi::c_char,
            old: *mut std::ffi::c_void,
            old_len: *mut usize,
            new: *mut std::ffi::c_void,
            new_len: usize,
        ) -> std::ffi::c_int;
    }

    #[test]
    fn jemalloc_runs_with_the_options_of_malloc_conf() {
        let mut threshold: usize = 0;
        let mut len = std::mem::size_of::<usize>();
        // SAFETY: "opt.oversize_threshold" is a size_t option; `threshold`
        // and `len` are a writable size_t and its size; nothing is set.
        let rc = unsafe {
            _rjem_mallctl(
                c"opt.oversize_threshold".as_ptr(),
                (&raw mut threshold).cast(),
                &raw mut len,
                std::ptr::null_mut(),
                0,
            )
        };
        assert_eq!(rc, 0);
        assert_eq!(threshold, 64 << 20);
    }
}
