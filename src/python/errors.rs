//! Python exception classes and the one conversion from [`Error`] to them.

use pyo3::exceptions::{PyException, PyTypeError, PyUserWarning, PyValueError};
use pyo3::prelude::*;
use pyo3::{create_exception, PyErr};

use crate::error::Error;

create_exception!(
    shardstream._core,
    ShardStreamError,
    PyException,
    "Base class of shardstream errors."
);
create_exception!(
    shardstream._core,
    DatasetSpecError,
    ShardStreamError,
    "The dataset spec cannot be parsed or names no shards."
);
create_exception!(
    shardstream._core,
    ShardNotFoundError,
    ShardStreamError,
    "A shard does not exist."
);
create_exception!(
    shardstream._core,
    StorageAuthError,
    ShardStreamError,
    "The storage denied access to a shard."
);
create_exception!(
    shardstream._core,
    ShardReadError,
    ShardStreamError,
    "Reading a shard failed or stalled."
);
create_exception!(
    shardstream._core,
    ObjectChangedError,
    ShardReadError,
    "An object was replaced while it was being read (its ETag changed)."
);
create_exception!(
    shardstream._core,
    ShardFormatError,
    ShardStreamError,
    "A shard is not a valid archive, is truncated or corrupt, or repeats a field within a key."
);
create_exception!(
    shardstream._core,
    FieldDecodeError,
    ShardStreamError,
    "A field's bytes cannot be decoded by the decoder chosen for it."
);
create_exception!(
    shardstream._core,
    ManifestError,
    ShardStreamError,
    "A manifest cannot be read or is inconsistent in itself."
);
create_exception!(
    shardstream._core,
    ManifestMismatchError,
    ManifestError,
    "A shard does not match what the manifest says of it."
);
create_exception!(
    shardstream._core,
    StateMismatchError,
    ShardStreamError,
    "A saved state does not fit this dataset, options or layout."
);
create_exception!(
    shardstream._core,
    StreamProcessError,
    ShardStreamError,
    "An iterator was used in another process than the one that started it (a forked child)."
);
create_exception!(
    shardstream._core,
    TransformError,
    ShardStreamError,
    "The dataset's transform raised on a sample (the original exception is its __cause__)."
);
create_exception!(
    shardstream._core,
    ShardWriteError,
    ShardStreamError,
    "Writing a shard or its manifest failed; the shard was not left behind half-written."
);
create_exception!(
    shardstream._core,
    ShardSkippedWarning,
    PyUserWarning,
    "A bad shard was skipped under on_error=\"warn\"."
);

create_exception!(
    shardstream._core,
    SampleSkippedWarning,
    ShardSkippedWarning,
    "A sample was left out: its transform raised under on_error=\"warn\", or (with pack) it is a document with no tokens that no sequence carries."
);

/// The `ShardStreamError` for a panic caught at the binding boundary: a
/// bug, reported as one, that `except ShardStreamError` (and `except
/// Exception`) catches, unlike pyo3's `PanicException`.
pub fn panic_to_py(panic: &(dyn std::any::Any + Send)) -> PyErr {
    let what = if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown cause".to_owned()
    };
    ShardStreamError::new_err(format!(
        "internal error in shardstream ({what}); please report it with the dataset spec and options"
    ))
}
create_exception!(
    shardstream._core,
    DecodeFieldWarning,
    PyUserWarning,
    "A decode= key names no field of the samples (warned once per dataset and process)."
);
create_exception!(
    shardstream._core,
    ManifestIgnoredWarning,
    PyUserWarning,
    "A manifest.json beside the shards is not a shardstream manifest and was not used."
);

/// The Python exception for `error`; its message names the shard and offset.
pub fn to_py(error: Error) -> PyErr {
    let message = error.to_string();
    match error {
        Error::Config { .. } => PyValueError::new_err(message),
        Error::Spec { .. } => DatasetSpecError::new_err(message),
        Error::NotFound { .. } => ShardNotFoundError::new_err(message),
        Error::AccessDenied { .. } | Error::Credentials { .. } => {
            StorageAuthError::new_err(message)
        }
        Error::Read { .. } | Error::Timeout { .. } => ShardReadError::new_err(message),
        Error::Changed { .. } => ObjectChangedError::new_err(message),
        Error::Format { .. } | Error::Decompress { .. } | Error::DuplicateField { .. } => {
            ShardFormatError::new_err(message)
        }
        Error::Decode { .. } => FieldDecodeError::new_err(message),
        Error::Manifest { .. } => ManifestError::new_err(message),
        Error::ManifestMismatch { .. } => ManifestMismatchError::new_err(message),
        Error::StateMismatch(_) => StateMismatchError::new_err(message),
        Error::Stopped(_) => ShardStreamError::new_err(message),
        Error::InvalidSample {
            wrong_type: true, ..
        } => PyTypeError::new_err(message),
        Error::InvalidSample { .. } => PyValueError::new_err(message),
        Error::Write { .. } => ShardWriteError::new_err(message),
    }
}

/// A `TypeError` saying that `what` (`"option seed"`, `"Image parameter
/// size"`) expected `expected` and naming the value given and its type.
pub(super) fn wrong_type(what: &str, expected: &str, value: &Bound<'_, PyAny>) -> PyErr {
    let shown = value.repr().map_or_else(|_| "?".into(), |r| r.to_string());
    let type_name = value
        .get_type()
        .name()
        .map_or_else(|_| "?".into(), |n| n.to_string());
    PyTypeError::new_err(format!(
        "invalid {what}: expected {expected}, got {shown} ({type_name})"
    ))
}
