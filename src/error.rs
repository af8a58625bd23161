//! Error type of the crate: every variant names the shard URL and, where it
//! applies, the byte offset or tar member.

use std::time::Duration;

use crate::compression::Compression;

/// Result with the crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong while planning or streaming shards.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The dataset spec could not be parsed or expanded.
    #[error("invalid dataset spec {spec:?}: {reason}")]
    Spec {
        /// The spec as given.
        spec: String,
        /// What is wrong with it.
        reason: String,
    },

    /// An option is out of range or inconsistent with another.
    #[error("invalid option {name}: {reason}")]
    Config {
        /// The option's name.
        name: &'static str,
        /// What is wrong with it.
        reason: String,
    },

    /// The shard does not exist.
    #[error("{url}: shard not found ({source})")]
    NotFound {
        /// Shard URL.
        url: String,
        /// The underlying error.
        source: std::io::Error,
    },

    /// The storage refused access to the shard.
    #[error("{url}: access denied ({source})")]
    AccessDenied {
        /// Shard URL.
        url: String,
        /// The underlying error.
        source: std::io::Error,
    },

    /// No usable credentials: none were found, loading them failed, or the
    /// store rejected them (an unknown access key, a secret that does not
    /// match, an expired session token). It is not retried, and no
    /// `on_error` policy skips it: every shard would fail the same way.
    #[error("{url}: no usable AWS credentials: {reason}")]
    Credentials {
        /// Shard URL (or listed prefix) of the request that needed them.
        url: String,
        /// What went wrong, and how to provide credentials.
        reason: String,
    },

    /// Reading the shard failed.
    #[error("{url}: read failed at byte offset {offset}: {source}")]
    Read {
        /// Shard URL.
        url: String,
        /// Byte offset in the shard where reading failed.
        offset: u64,
        /// The underlying error.
        source: std::io::Error,
    },

    /// No bytes arrived within the I/O timeout.
    #[error("{url}: no data for {after:?} at byte offset {offset}")]
    Timeout {
        /// Shard URL.
        url: String,
        /// Byte offset in the shard where the read stalled.
        offset: u64,
        /// How long the reader waited.
        after: Duration,
    },

    /// The object changed (another ETag) while it was being read.
    #[error("{url}: the object changed while it was read (ETag no longer matches at byte offset {offset})")]
    Changed {
        /// Shard URL.
        url: String,
        /// Byte offset where the read was resumed.
        offset: u64,
    },

    /// The shard's bytes are not a valid archive of its format.
    #[error("{url}: {reason} at byte offset {offset}{}{}", decompressed_suffix(.compression), member_suffix(.member))]
    Format {
        /// Shard URL.
        url: String,
        /// Byte offset in the shard where the problem was found (in the
        /// decompressed tar when `compression` is set).
        offset: u64,
        /// The shard's compression, when it is compressed.
        compression: Option<Compression>,
        /// Tar member being read, when known.
        member: Option<String>,
        /// What is wrong.
        reason: String,
    },

    /// A compressed shard's stream is corrupt or ends early.
    #[error("{url}: {reason} at compressed byte offset {compressed_offset} (byte offset {tar_offset} of the decompressed stream)")]
    Decompress {
        /// Shard URL.
        url: String,
        /// The stream's compression.
        compression: Compression,
        /// Offset in the shard's (compressed) bytes up to which the decoder had read.
        compressed_offset: u64,
        /// Tar bytes decoded before the failure.
        tar_offset: u64,
        /// What is wrong.
        reason: String,
    },

    /// A field appears twice within one sample key.
    #[error("{url}: field {field:?} repeated in sample {key:?} (member {member:?} at byte offset {offset}{})", decompressed_suffix(.compression))]
    DuplicateField {
        /// Shard URL.
        url: String,
        /// Sample key.
        key: String,
        /// Repeated field name.
        field: String,
        /// Tar member that repeats it.
        member: String,
        /// Byte offset of that member's header (in the decompressed tar
        /// when `compression` is set).
        offset: u64,
        /// The shard's compression, when it is compressed.
        compression: Option<Compression>,
    },

    /// A field's bytes could not be decoded.
    #[error("{url}: cannot decode field {field:?} of sample {key:?} as {decoder}: {reason}")]
    Decode {
        /// Shard URL.
        url: String,
        /// Sample key.
        key: String,
        /// Field name.
        field: String,
        /// The decoder's name.
        decoder: &'static str,
        /// What is wrong.
        reason: String,
    },

    /// A manifest cannot be read or is inconsistent in itself.
    #[error("invalid manifest {path}: {reason}")]
    Manifest {
        /// Where the manifest came from.
        path: String,
        /// What is wrong with it.
        reason: String,
    },

    /// A shard does not match what the manifest says of it.
    #[error("{url}: does not match the manifest: {reason}")]
    ManifestMismatch {
        /// Shard URL.
        url: String,
        /// What differs.
        reason: String,
    },

    /// A saved stream state does not fit this dataset, options or layout.
    #[error("state does not match: {0}")]
    StateMismatch(String),

    /// The stream was cancelled or its pipeline stopped unexpectedly.
    #[error("stream stopped: {0}")]
    Stopped(String),

    /// A sample given to the shard writer cannot be written as it is (a
    /// missing or repeated key, a field name that would not read back the
    /// same, a value of a type with no encoding for its field).
    #[error("{}{reason}", sample_context(.key, .field))]
    InvalidSample {
        /// The sample's key, when it has one.
        key: Option<String>,
        /// The field at fault, if one is.
        field: Option<String>,
        /// What is wrong.
        reason: String,
        /// Whether a value has the wrong type (rather than a wrong name or key).
        wrong_type: bool,
    },

    /// Writing a shard (or its manifest) failed.
    #[error("{url}: write failed at byte offset {offset}: {reason}")]
    Write {
        /// Shard (or manifest) URL.
        url: String,
        /// Bytes of the shard written before the failure.
        offset: u64,
        /// What went wrong.
        reason: String,
    },
}

fn sample_context(key: &Option<String>, field: &Option<String>) -> String {
    match (key, field) {
        (Some(key), Some(field)) => format!("sample {key:?}, field {field:?}: "),
        (Some(key), None) => format!("sample {key:?}: "),
        (None, Some(field)) => format!("field {field:?}: "),
        (None, None) => String::new(),
    }
}

fn decompressed_suffix(compression: &Option<Compression>) -> String {
    compression
        .map(|c| format!(" of the decompressed {c} stream"))
        .unwrap_or_default()
}

fn member_suffix(member: &Option<String>) -> String {
    member
        .as_deref()
        .map(|m| format!(" (member {m:?})"))
        .unwrap_or_default()
}

impl Error {
    /// The shard URL this error is about, if any.
    pub fn url(&self) -> Option<&str> {
        match self {
            Error::NotFound { url, .. }
            | Error::AccessDenied { url, .. }
            | Error::Credentials { url, .. }
            | Error::Read { url, .. }
            | Error::Timeout { url, .. }
            | Error::Changed { url, .. }
            | Error::Format { url, .. }
            | Error::Decompress { url, .. }
            | Error::DuplicateField { url, .. }
            | Error::Decode { url, .. }
            | Error::Write { url, .. }
            | Error::ManifestMismatch { url, .. } => Some(url),
            Error::Spec { .. }
            | Error::Config { .. }
            | Error::Manifest { .. }
            | Error::StateMismatch(_)
            | Error::InvalidSample { .. }
            | Error::Stopped(_) => None,
        }
    }

    /// Whether the `on_error="warn"` policy may skip the shard and go on.
    pub fn is_shard_error(&self) -> bool {
        self.url().is_some() && !matches!(self, Error::Credentials { .. })
    }

    /// Builds the error for an I/O failure opening `url`, by its kind.
    pub fn from_open(url: &str, source: std::io::Error) -> Self {
        let url = url.to_owned();
        match source.kind() {
            std::io::ErrorKind::NotFound => Error::NotFound { url, source },
            std::io::ErrorKind::PermissionDenied => Error::AccessDenied { url, source },
            _ => Error::Read {
                url,
                offset: 0,
                source,
            },
        }
    }
}

/// Runs a decoding step over untrusted bytes, turning its error, or a
/// panic inside a third-party decoder, into a message.
pub(crate) fn guard<T, E: std::fmt::Display>(
    f: impl FnOnce() -> std::result::Result<T, E>,
) -> std::result::Result<T, String> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => Err(e.to_string()),
        Err(panic) => {
            let message = if let Some(s) = panic.downcast_ref::<&str>() {
                s
            } else if let Some(s) = panic.downcast_ref::<String>() {
                s.as_str()
            } else {
                "unknown panic"
            };
            Err(format!("decoder panicked: {message}"))
        }
    }
}
