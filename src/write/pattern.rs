//! Shard name patterns: `out/shard-%06d.tar` or
//! `s3://bucket/prefix/shard-%06d.tar`, one printf-style integer
//! conversion in the file name, checked when the writer is made.

use std::path::PathBuf;

use crate::compression::Compression;
use crate::error::{Error, Result};
use crate::manifest::MANIFEST_FILE;

/// Where shards go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Destination {
    /// A local directory.
    Local {
        /// The directory the shards and the manifest go to.
        dir: PathBuf,
    },
    /// An S3 bucket.
    S3 {
        /// The bucket.
        bucket: String,
        /// The key prefix of the shards' "directory" (empty, or ending in `/`).
        dir: String,
    },
}

/// A checked shard name pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardPattern {
    /// Where shards go.
    pub destination: Destination,
    /// The text before the shard number (`%%` already turned into `%`).
    before: String,
    /// The text after it.
    after: String,
    /// Minimum digits.
    width: usize,
    /// Whether short numbers are padded with zeros (else spaces, as printf).
    zero_pad: bool,
    /// How the shards are compressed.
    pub compression: Option<Compression>,
}

fn refuse(reason: String) -> Error {
    Error::Config {
        name: "pattern",
        reason,
    }
}

/// The names a shard with `compression` may end in.
fn suffixes(compression: Option<Compression>) -> &'static [&'static str] {
    match compression {
        None => &[".tar"],
        Some(Compression::Gzip) => &[".tar.gz", ".tgz"],
        Some(Compression::Zstd) => &[".tar.zst"],
    }
}

impl ShardPattern {
    /// Parses `pattern`, with `compression` as asked (`None`: as the
    /// pattern's suffix says).
    pub fn parse(pattern: &str, compression: Option<Compression>) -> Result<Self> {
        let (mut before, mut after, mut directive) = (String::new(), String::new(), None);
        let mut chars = pattern.chars().peekable();
        while let Some(c) = chars.next() {
            let out = if directive.is_some() {
                &mut after
            } else {
                &mut before
            };
            if c != '%' {
                out.push(c);
                continue;
            }
            if chars.peek() == Some(&'%') {
                chars.next();
                out.push('%');
                continue;
            }
            let mut spec = String::new();
            while let Some(d) = chars.peek().filter(|d| d.is_ascii_digit()) {
                spec.push(*d);
                chars.next();
            }
            if chars.next() != Some('d') {
                return Err(refuse(format!(
                    "{pattern:?}: '%' must start %d, %0Nd or %Nd (the shard number), or be written %%"
                )));
            }
            if directive.is_some() {
                return Err(refuse(format!(
                    "{pattern:?} has more than one shard number (%d)"
                )));
            }
            directive = Some(spec);
        }
        let Some(spec) = directive else {
            return Err(refuse(format!(
                "{pattern:?} has no shard number: put %06d (or %d) in the file name, as in \"out/shard-%06d.tar\""
            )));
        };
        if after.contains('/') {
            return Err(refuse(format!(
                "{pattern:?}: the shard number must be in the file name, not in a directory"
            )));
        }
        let zero_pad = spec.starts_with('0');
        let width: usize = if spec.is_empty() {
            0
        } else {
            spec.parse()
                .ok()
                .filter(|w| *w <= 32)
                .ok_or_else(|| refuse(format!("{pattern:?}: the width of %d is above 32")))?
        };
        let detected = [Compression::Gzip, Compression::Zstd]
            .into_iter()
            .find(|c| suffixes(Some(*c)).iter().any(|s| after.ends_with(s)));
        let compression = match (compression, detected) {
            (None, found) => found,
            (Some(asked), _) => Some(asked),
        };
        if !suffixes(compression).iter().any(|s| after.ends_with(s)) {
            let asked = compression.map_or("none".to_owned(), |c| c.to_string());
            return Err(refuse(format!(
                "{pattern:?} must end in {} for compression {asked} (datasets list shards by these suffixes)",
                suffixes(compression).join(" or ")
            )));
        }
        let destination = if let Some(rest) = before.strip_prefix("s3://") {
            let Some((bucket, key)) = rest.split_once('/').filter(|(b, _)| !b.is_empty()) else {
                return Err(refuse(format!(
                    "{pattern:?}: an S3 pattern is s3://bucket/prefix/shard-%06d.tar"
                )));
            };
            let dir = key.rfind('/').map_or("", |i| &key[..=i]).to_owned();
            let bucket = bucket.to_owned();
            before = key.to_owned();
            Destination::S3 { bucket, dir }
        } else {
            if let Some(path) = before.strip_prefix("file://") {
                before = path.to_owned();
            }
            if before.contains("://") {
                return Err(refuse(format!(
                    "{pattern:?}: shards are written to local paths, file:// or s3:// URLs"
                )));
            }
            let dir = match before.rfind('/') {
                Some(0) => PathBuf::from("/"),
                Some(i) => PathBuf::from(&before[..i]),
                None => PathBuf::from("."),
            };
            Destination::Local { dir }
        };
        Ok(ShardPattern {
            destination,
            before,
            after,
            width,
            zero_pad,
            compression,
        })
    }

    /// Shard `number`'s path (local) or key (S3).
    pub fn name(&self, number: u64) -> String {
        let digits = if self.zero_pad {
            format!("{number:0width$}", width = self.width)
        } else {
            format!("{number:width$}", width = self.width)
        };
        format!("{}{digits}{}", self.before, self.after)
    }

    /// Shard `number`'s URL (as datasets name it).
    pub fn url(&self, number: u64) -> String {
        match &self.destination {
            Destination::Local { .. } => self.name(number),
            Destination::S3 { bucket, .. } => format!("s3://{bucket}/{}", self.name(number)),
        }
    }

    /// The manifest's local path or S3 key, beside the shards.
    pub fn manifest_name(&self) -> String {
        match &self.destination {
            Destination::Local { dir } => dir.join(MANIFEST_FILE).display().to_string(),
            Destination::S3 { dir, .. } => format!("{dir}{MANIFEST_FILE}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_name_shards_as_printf_would() {
        let p = ShardPattern::parse("out/shard-%06d.tar", None).unwrap();
        assert_eq!(p.name(12), "out/shard-000012.tar");
        assert_eq!(p.name(1234567), "out/shard-1234567.tar");
        assert_eq!(p.destination, Destination::Local { dir: "out".into() });
        assert_eq!(p.manifest_name(), "out/manifest.json");
        let p = ShardPattern::parse("s3://b/a/b/x-%d-100%%.tar.gz", None).unwrap();
        assert_eq!(p.url(7), "s3://b/a/b/x-7-100%.tar.gz");
        assert_eq!(p.compression, Some(Compression::Gzip));
        assert_eq!(p.manifest_name(), "a/b/manifest.json");
        let p = ShardPattern::parse("s%3d.tar.zst", Some(Compression::Zstd)).unwrap();
        assert_eq!(p.name(5), "s  5.tar.zst");
        assert_eq!(p.manifest_name(), "./manifest.json");
    }

    #[test]
    fn bad_patterns_are_refused_naming_the_option() {
        for (pattern, compression, says) in [
            ("out/shard.tar", None, "no shard number"),
            ("out/%d-%d.tar", None, "more than one"),
            ("out/%s.tar", None, "'%'"),
            ("out-%d/shard.tar", None, "file name"),
            ("out/%d.tar", Some(Compression::Gzip), ".tar.gz or .tgz"),
            ("out/%d.tar.gz", Some(Compression::Zstd), ".tar.zst"),
            ("out/%d.zip", None, ".tar"),
            ("s3://bucket-only-%d.tar", None, "s3://bucket/prefix"),
            ("http://h/%d.tar", None, "local paths"),
        ] {
            let err = ShardPattern::parse(pattern, compression).unwrap_err();
            let text = err.to_string();
            assert!(
                matches!(
                    err,
                    Error::Config {
                        name: "pattern",
                        ..
                    }
                ) && text.contains(says),
                "{pattern}: {text}"
            );
        }
    }
}
