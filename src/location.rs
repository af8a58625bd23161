//! Where a shard's bytes live: a local file, an S3 object or an HTTP(S)
//! resource, and what identifies one across spellings.

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
    /// A resource at an `http://` or `https://` URL (the URL itself).
    Http(String),
}

/// The path of a URL (what follows its authority), without query or fragment.
pub fn url_path(url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let path = rest.find('/').map_or("", |i| &rest[i..]);
    path.split(['?', '#']).next().unwrap_or("").to_owned()
}

/// Whether `url` is an `http://` or `https://` URL (scheme in any case).
pub fn is_http_url(url: &str) -> bool {
    let lower = |n: usize| url.get(..n).map(str::to_ascii_lowercase);
    lower(7).as_deref() == Some("http://") || lower(8).as_deref() == Some("https://")
}

impl Location {
    /// Parses `s3://bucket/key`, an `http(s)://` URL, a `file://` URL or a
    /// local path.
    pub fn parse(url: &str) -> Location {
        if is_http_url(url) {
            return Location::Http(url.to_owned());
        }
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
        Location::S3 { .. } | Location::Http(_) => url.to_owned(),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http_urls_are_told_and_their_paths_taken() {
        assert!(is_http_url("HTTPS://h/x") && is_http_url("http://h/x"));
        assert!(!is_http_url("httpx://h") && !is_http_url("s3://b/k"));
        assert_eq!(url_path("https://h.example:8080/a/b.tar?x=1#f"), "/a/b.tar");
        assert_eq!(url_path("http://h"), "");
    }
}
