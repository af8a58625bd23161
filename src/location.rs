//! Where a shard's bytes live: a local file or an S3 object, and what
//! identifies one across spellings.

use std::path::{Path, PathBuf};

/// Where a shard's bytes live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    /// A file on local disk.
    Local(PathBuf),
    /// An object in an S3 bucket.
    S3 {
        /// Bucket name.
        bucket: String,
        /// Object key (empty or ending in `/` for a prefix).
        key: String,
    },
}

impl Location {
    /// Parses `s3://bucket/key`, a `file://` URL or a local path.
    pub fn parse(url: &str) -> Location {
        if let Some(rest) = url.strip_prefix("s3://") {
            let (bucket, key) = rest.split_once('/').unwrap_or((rest, ""));
            return Location::S3 {
                bucket: bucket.to_owned(),
                key: key.to_owned(),
            };
        }
        Location::Local(PathBuf::from(url.strip_prefix("file://").unwrap_or(url)))
    }
}

/// What identifies a shard across spellings: an object URL as it is; a
/// local path (or `file://` URL) made absolute and canonical (symbolic
/// links, `.`, `..` and repeated `/` resolved), or, for a file that does
/// not exist, made absolute and normalised.
pub fn identity(url: &str, base: &Path) -> String {
    match Location::parse(url) {
        Location::S3 { .. } => url.to_owned(),
        Location::Local(path) => canonical(&base.join(path)).display().to_string(),
    }
}

/// `path` made canonical (symbolic links, `.`, `..` and repeated `/`
/// resolved), or, when it does not exist, absolute.
pub fn canonical(path: &Path) -> PathBuf {
    std::fs::canonicalize(path)
        .or_else(|_| std::path::absolute(path))
        .unwrap_or_else(|_| path.to_owned())
}
