//! Dataset spec: shard URLs, brace ranges and directories, resolved to a
//! list of shards with their sizes.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::config::S3Options;
use crate::error::{Error, Result};
use crate::manifest::SampleIndex;
use crate::plan::ShardInfo;

/// Name suffixes of the shard files a directory or prefix spec lists.
pub const SHARD_SUFFIXES: [&str; 4] = [".tar", ".tar.gz", ".tgz", ".tar.zst"];

/// Whether a directory or prefix listing takes the file or object `name`
/// as a shard (by its suffix; compression itself is told by the bytes).
pub fn is_shard_name(name: &str) -> bool {
    SHARD_SUFFIXES.iter().any(|suffix| name.ends_with(suffix))
}

/// One shard of the dataset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shard {
    /// The URL as the user spelled it (after brace expansion); becomes `__url__`.
    pub url: String,
    /// Size in bytes, when known.
    pub size: Option<u64>,
    /// Byte spans of its samples, from a manifest.
    pub index: Option<Arc<SampleIndex>>,
    /// The object's ETag, when a listing gave it.
    pub etag: Option<String>,
}

impl Shard {
    /// A shard known by URL and maybe size, without a sample index.
    pub fn new(url: impl Into<String>, size: Option<u64>) -> Self {
        Shard {
            url: url.into(),
            size,
            index: None,
            etag: None,
        }
    }

    /// What the plan knows of this shard.
    pub fn info(&self) -> ShardInfo {
        ShardInfo {
            size: self.size,
            samples: self.index.as_ref().map(|i| i.len()),
        }
    }

    /// Where the shard's bytes live.
    pub fn location(&self) -> Location {
        Location::parse(&self.url)
    }
}

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

/// Expands brace patterns: `{000..127}` (zero-padded to the width of the
/// bounds) and `{a,b,c}`; several groups give their product, left to right.
pub fn expand_braces(spec: &str) -> Result<Vec<String>> {
    let bad = |reason: &str| Error::Spec {
        spec: spec.to_owned(),
        reason: reason.to_owned(),
    };
    let Some(open) = spec.find('{') else {
        if spec.contains('}') {
            return Err(bad("'}' without '{'"));
        }
        return Ok(vec![spec.to_owned()]);
    };
    let close = spec[open..]
        .find('}')
        .map(|i| open + i)
        .ok_or_else(|| bad("'{' without '}'"))?;
    let (head, body, tail) = (&spec[..open], &spec[open + 1..close], &spec[close + 1..]);
    if head.contains('}') {
        return Err(bad("'}' without '{'"));
    }
    if body.contains('{') {
        return Err(bad("nested braces are not supported"));
    }
    let alternatives = if let Some((lo, hi)) = body.split_once("..") {
        numeric_range(lo, hi).ok_or_else(|| bad(&format!("bad range {{{body}}}")))?
    } else if body.contains(',') {
        body.split(',').map(str::to_owned).collect()
    } else {
        return Err(bad(&format!("braces need a range or a list: {{{body}}}")));
    };
    let tails = expand_braces(tail).map_err(|e| match e {
        Error::Spec { reason, .. } => bad(&reason),
        other => other,
    })?;
    let mut out = Vec::with_capacity(alternatives.len() * tails.len());
    for alternative in &alternatives {
        for t in &tails {
            out.push(format!("{head}{alternative}{t}"));
        }
    }
    Ok(out)
}

fn numeric_range(lo: &str, hi: &str) -> Option<Vec<String>> {
    let all_digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !all_digits(lo) || !all_digits(hi) {
        return None;
    }
    let (a, b): (u64, u64) = (lo.parse().ok()?, hi.parse().ok()?);
    if a > b {
        return None;
    }
    let padded = (lo.len() > 1 && lo.starts_with('0')) || (hi.len() > 1 && hi.starts_with('0'));
    let width = if padded { lo.len().max(hi.len()) } else { 0 };
    Some((a..=b).map(|n| format!("{n:0width$}")).collect())
}

/// Resolves local specs; see [`resolve_with`].
pub fn resolve(specs: &[String]) -> Result<Vec<Shard>> {
    resolve_with(specs, &S3Options::default())
}

/// Resolves specs (paths, `file://` and `s3://` URLs, brace patterns,
/// directories and `s3://bucket/prefix/` listings) to shards in the order
/// given; a directory or prefix gives its shards ([`SHARD_SUFFIXES`])
/// sorted by name.
/// A shard that does not exist is kept with an unknown size: opening it
/// reports the error, under the stream's error policy.
pub fn resolve_with(specs: &[String], s3: &S3Options) -> Result<Vec<Shard>> {
    let mut shards = Vec::new();
    let mut listings = Vec::new();
    for spec in specs {
        for url in expand_braces(spec)? {
            match Location::parse(&url) {
                Location::S3 { bucket, key } if key.is_empty() || key.ends_with('/') => {
                    listings.push((shards.len(), url, bucket, key));
                }
                Location::S3 { .. } => shards.push(Shard::new(url, None)),
                Location::Local(path) => match std::fs::metadata(&path) {
                    Ok(meta) if meta.is_dir() => shards.extend(list_directory(&url, &path)?),
                    Ok(meta) => shards.push(Shard::new(url, Some(meta.len()))),
                    Err(_) => shards.push(Shard::new(url, None)),
                },
            }
        }
    }
    if !listings.is_empty() {
        let listed = crate::source::list_s3_prefixes(s3, &listings)?;
        for ((at, ..), objects) in listings.iter().zip(listed).rev() {
            shards.splice(*at..*at, objects);
        }
    }
    if shards.is_empty() {
        return Err(Error::Spec {
            spec: specs.join(" "),
            reason: "no shards".into(),
        });
    }
    let mut seen = std::collections::HashSet::new();
    for shard in &shards {
        if !seen.insert(shard.url.as_str()) {
            return Err(Error::Spec {
                spec: specs.join(" "),
                reason: format!("shard {:?} is listed twice", shard.url),
            });
        }
    }
    Ok(shards)
}

fn list_directory(url: &str, path: &Path) -> Result<Vec<Shard>> {
    let entries = std::fs::read_dir(path).map_err(|e| Error::from_open(url, e))?;
    let mut shards = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| Error::from_open(url, e))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if !is_shard_name(name) {
            continue;
        }
        let meta = entry.metadata().map_err(|e| Error::from_open(url, e))?;
        if meta.is_file() {
            let joined = format!("{}/{name}", url.trim_end_matches('/'));
            shards.push(Shard::new(joined, Some(meta.len())));
        }
    }
    shards.sort_by(|a, b| a.url.cmp(&b.url));
    Ok(shards)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expands_zero_padded_range() {
        let got = expand_braces("d/shard-{000008..000011}.tar").unwrap();
        assert_eq!(
            got,
            [
                "d/shard-000008.tar",
                "d/shard-000009.tar",
                "d/shard-000010.tar",
                "d/shard-000011.tar"
            ]
        );
    }

    #[test]
    fn expands_several_groups_left_to_right() {
        let got = expand_braces("{a,b}/{1..2}.tar").unwrap();
        assert_eq!(got, ["a/1.tar", "a/2.tar", "b/1.tar", "b/2.tar"]);
    }

    #[test]
    fn unpadded_range_has_no_padding() {
        assert_eq!(expand_braces("{9..10}").unwrap(), ["9", "10"]);
    }

    #[test]
    fn rejects_bad_patterns() {
        for bad in ["{1..", "x}", "{5..1}", "{a..b}", "{x}", "{{1..2}}"] {
            assert!(
                matches!(expand_braces(bad), Err(Error::Spec { .. })),
                "{bad} accepted"
            );
        }
    }

    #[test]
    fn resolves_directory_sorted_and_shards_only() {
        let dir = tempfile::tempdir().unwrap();
        let names = [
            "b.tar",
            "a.tar",
            "notes.txt",
            "c.tar.gz",
            "d.tgz",
            "e.tar.zst",
            "f.gz",
            "g.zst",
            "h.tar.bz2",
        ];
        for name in names {
            std::fs::write(dir.path().join(name), b"x").unwrap();
        }
        let url = dir.path().to_str().unwrap().to_owned();
        let shards = resolve(std::slice::from_ref(&url)).unwrap();
        let urls: Vec<_> = shards.iter().map(|s| s.url.clone()).collect();
        let expected: Vec<_> = ["a.tar", "b.tar", "c.tar.gz", "d.tgz", "e.tar.zst"]
            .iter()
            .map(|name| format!("{url}/{name}"))
            .collect();
        assert_eq!(urls, expected);
        assert_eq!(shards[0].size, Some(1));
    }

    #[test]
    fn file_url_and_duplicates() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.tar");
        std::fs::write(&path, b"xy").unwrap();
        let url = format!("file://{}", path.display());
        assert_eq!(
            resolve(std::slice::from_ref(&url)).unwrap()[0].size,
            Some(2)
        );
        assert!(matches!(
            resolve(&[url.clone(), url]),
            Err(Error::Spec { .. })
        ));
    }
}
