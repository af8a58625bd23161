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
mod malloc;
mod mix;
mod options;
mod sample_stream;
mod shard_list;
mod writer;

use pyo3::prelude::*;

/// jemalloc for the Rust side of the extension (see Cargo.toml for why).
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

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
    use super::image::Image;
    #[pymodule_export]
    use super::malloc::raise_malloc_thresholds;
    #[pymodule_export]
    use super::mix::{check_mix, mix_counts, mix_order};
    #[pymodule_export]
    use super::options::{
        default_options, default_s3_options, default_writer_options, option_table, s3_option_table,
        Options,
    };
    #[pymodule_export]
    use super::sample_stream::SampleStream;
    #[pymodule_export]
    use super::shard_list::{_rebuild_shard_list, ShardList};

    #[pymodule_export]
    use super::writer::{write_manifest, ShardWriter};

    #[pymodule_init]
    fn init(m: &Bound<'_, PyModule>) -> PyResult<()> {
        m.add("__version__", env!("CARGO_PKG_VERSION"))
    }
}
