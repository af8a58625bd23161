//! Dataset spec: shard URLs, brace ranges and directories, resolved to a
//! list of shards with their sizes. A Parquet file becomes one shard per
//! row group, read from its footer here, so the plan can split one large
//! file across ranks and workers.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parquet::file::metadata::ParquetMetaData;

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

/// Whether `name` is a Parquet file's.
pub fn is_parquet_name(name: &str) -> bool {
    name.ends_with(".parquet")
}

/// Whether `name` is a raw object's: anything but folder markers and
/// hidden files.
pub fn is_raw_name(name: &str) -> bool {
    let base = name.rsplit('/').next().unwrap_or(name);
    !base.is_empty() && !base.starts_with('.')
}

fn is_tar_or_parquet_name(name: &str) -> bool {
    is_shard_name(name) || is_parquet_name(name)
}

/// What the shards of a dataset hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DatasetFormat {
    /// Parquet for `*.parquet` names, tar (plain, gzip or zstd) otherwise.
    #[default]
    Auto,
    /// WebDataset tar shards.
    Tar,
    /// Parquet files: one shard per row group, one sample per row.
    Parquet,
    /// Raw objects: one sample per file or object.
    Raw,
}

impl std::str::FromStr for DatasetFormat {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(DatasetFormat::Auto),
            "tar" => Ok(DatasetFormat::Tar),
            "parquet" => Ok(DatasetFormat::Parquet),
            "raw" => Ok(DatasetFormat::Raw),
            other => Err(Error::Config {
                name: "format",
                reason: format!(
                    "expected \"auto\", \"tar\", \"parquet\" or \"raw\", got {other:?}"
                ),
            }),
        }
    }
}

impl DatasetFormat {
    /// Which names a directory or prefix listing takes.
    pub fn listing_filter(self) -> fn(&str) -> bool {
        match self {
            DatasetFormat::Auto => is_tar_or_parquet_name,
            DatasetFormat::Tar => is_shard_name,
            DatasetFormat::Parquet => is_parquet_name,
            DatasetFormat::Raw => is_raw_name,
        }
    }

    /// The kind of a shard named `url`, before a Parquet footer is read.
    fn kind_of(self, url: &str) -> ShardKind {
        match self {
            DatasetFormat::Auto if is_parquet_name(url) => ShardKind::ParquetFile,
            DatasetFormat::Auto | DatasetFormat::Tar => ShardKind::Tar,
            DatasetFormat::Parquet => ShardKind::ParquetFile,
            DatasetFormat::Raw => ShardKind::Raw,
        }
    }
}

/// What a shard holds and how it is read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShardKind {
    /// A tar archive, plain or compressed: many samples grouped by key.
    Tar,
    /// One raw object: one sample.
    Raw,
    /// A Parquet file whose footer has not been read yet.
    ParquetFile,
    /// One row group of a Parquet file.
    Parquet(Arc<RowGroup>),
}

/// One row group of a Parquet file, as its footer describes it.
#[derive(Debug)]
pub struct RowGroup {
    /// The file's footer.
    pub metadata: Arc<ParquetMetaData>,
    /// Row group index in the file.
    pub index: usize,
    /// Bytes of the file holding the row group's column chunks.
    pub span: Range<u64>,
    /// Rows in the row group.
    pub rows: u64,
    /// Index in the file of the row group's first row.
    pub first_row: u64,
}

impl PartialEq for RowGroup {
    fn eq(&self, other: &Self) -> bool {
        (self.index, &self.span, self.rows, self.first_row)
            == (other.index, &other.span, other.rows, other.first_row)
    }
}

impl Eq for RowGroup {}

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
    /// What the shard holds.
    pub kind: ShardKind,
}

impl Shard {
    /// A shard known by URL and maybe size, without a sample index.
    pub fn new(url: impl Into<String>, size: Option<u64>) -> Self {
        Shard {
            url: url.into(),
            size,
            index: None,
            etag: None,
            kind: ShardKind::Tar,
        }
    }

    /// What the plan knows of this shard.
    pub fn info(&self) -> ShardInfo {
        let samples = match &self.kind {
            ShardKind::Raw => Some(1),
            ShardKind::Parquet(group) => Some(group.rows),
            ShardKind::Tar | ShardKind::ParquetFile => self.index.as_ref().map(|i| i.len()),
        };
        ShardInfo {
            size: self.size,
            samples,
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
    /// A resource at an `http://` or `https://` URL (the URL itself).
    Http(String),
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

/// The most URLs one spec may expand to: a typo such as
/// `{0..99999999999}` is an error at once, not an allocation that ends in
/// the OOM killer.
pub const MAX_EXPANSION: u64 = 1_000_000;

/// Expands brace patterns: `{000..127}` (zero-padded to the width of the
/// bounds) and `{a,b,c}`; several groups give their product, left to right.
/// A spec that would expand to more than [`MAX_EXPANSION`] URLs is an error.
pub fn expand_braces(spec: &str) -> Result<Vec<String>> {
    let count = expansion_count(spec)?;
    if count > MAX_EXPANSION {
        return Err(Error::Spec {
            spec: spec.to_owned(),
            reason: format!(
                "expands to {count} URLs, more than the {MAX_EXPANSION} a spec may name \
                 (a typo in a brace range?)"
            ),
        });
    }
    expand_checked(spec)
}

/// How many URLs `spec` expands to (saturating), checking its syntax.
fn expansion_count(spec: &str) -> Result<u64> {
    let mut count: u64 = 1;
    let mut rest = spec;
    while let Some((head, body, tail)) = next_group(spec, rest)? {
        let _ = head;
        let n = if let Some((lo, hi)) = body.split_once("..") {
            let (a, b, _) = range_bounds(lo, hi).ok_or_else(|| Error::Spec {
                spec: spec.to_owned(),
                reason: format!("bad range {{{body}}}"),
            })?;
            (b - a).saturating_add(1)
        } else {
            body.split(',').count() as u64
        };
        count = count.saturating_mul(n);
        rest = tail;
    }
    Ok(count)
}

/// The first brace group of `rest` (a suffix of `spec`): the text before
/// it, its body and the text after it; `None` when there is none.
fn next_group<'a>(spec: &str, rest: &'a str) -> Result<Option<(&'a str, &'a str, &'a str)>> {
    let bad = |reason: &str| Error::Spec {
        spec: spec.to_owned(),
        reason: reason.to_owned(),
    };
    let Some(open) = rest.find('{') else {
        if rest.contains('}') {
            return Err(bad("'}' without '{'"));
        }
        return Ok(None);
    };
    let close = rest[open..]
        .find('}')
        .map(|i| open + i)
        .ok_or_else(|| bad("'{' without '}'"))?;
    let (head, body, tail) = (&rest[..open], &rest[open + 1..close], &rest[close + 1..]);
    if head.contains('}') {
        return Err(bad("'}' without '{'"));
    }
    if body.contains('{') {
        return Err(bad("nested braces are not supported"));
    }
    if !body.contains("..") && !body.contains(',') {
        return Err(bad(&format!("braces need a range or a list: {{{body}}}")));
    }
    Ok(Some((head, body, tail)))
}

/// Expands `spec`, whose size [`expansion_count`] has checked.
fn expand_checked(spec: &str) -> Result<Vec<String>> {
    let Some((head, body, tail)) = next_group(spec, spec)? else {
        return Ok(vec![spec.to_owned()]);
    };
    let alternatives = if let Some((lo, hi)) = body.split_once("..") {
        numeric_range(lo, hi).ok_or_else(|| Error::Spec {
            spec: spec.to_owned(),
            reason: format!("bad range {{{body}}}"),
        })?
    } else {
        body.split(',').map(str::to_owned).collect()
    };
    let tails = expand_checked(tail).map_err(|e| match e {
        Error::Spec { reason, .. } => Error::Spec {
            spec: spec.to_owned(),
            reason,
        },
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

/// The bounds of a numeric range `lo..hi` and the width to pad to.
fn range_bounds(lo: &str, hi: &str) -> Option<(u64, u64, usize)> {
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
    Some((a, b, width))
}

fn numeric_range(lo: &str, hi: &str) -> Option<Vec<String>> {
    let (a, b, width) = range_bounds(lo, hi)?;
    Some((a..=b).map(|n| format!("{n:0width$}")).collect())
}

/// Whether `url` is an `http://` or `https://` URL (scheme in any case).
pub fn is_http_url(url: &str) -> bool {
    let lower = |n: usize| url.get(..n).map(str::to_ascii_lowercase);
    lower(7).as_deref() == Some("http://") || lower(8).as_deref() == Some("https://")
}

/// The URL schemes a spec may use; anything else is refused at once.
pub const SUPPORTED_SCHEMES: &str = "local paths, file://, s3://, http://, https:// and \
     hf://datasets/ (the Hugging Face Hub)";

/// Refuses a URL whose scheme shardstream cannot read (`https://`, `gs://`,
/// `hf://`, webdataset's `pipe:` ...), naming it and the supported ones.
pub fn check_scheme(url: &str) -> Result<()> {
    let scheme = match url.split_once("://") {
        Some((scheme, _))
            if !scheme.is_empty()
                && scheme
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"+.-".contains(&b)) =>
        {
            Some(scheme)
        }
        _ if url.starts_with("pipe:") => Some("pipe"),
        _ => None,
    };
    match scheme {
        None | Some("file") | Some("s3") => Ok(()),
        Some(http) if http.eq_ignore_ascii_case("http") || http.eq_ignore_ascii_case("https") => {
            Ok(())
        }
        Some("hf") => crate::hub::check_url(url).map_err(|reason| Error::Spec {
            spec: url.to_owned(),
            reason,
        }),
        Some(other) => Err(Error::Spec {
            spec: url.to_owned(),
            reason: format!(
                "the scheme {other:?} is not supported (supported: {SUPPORTED_SCHEMES})"
            ),
        }),
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

/// Resolves local specs; see [`resolve_with`].
pub fn resolve(specs: &[String]) -> Result<Vec<Shard>> {
    resolve_with(specs, &S3Options::default())
}

/// Resolves specs of tar shards (and Parquet files by name); see [`resolve_dataset`].
pub fn resolve_with(specs: &[String], s3: &S3Options) -> Result<Vec<Shard>> {
    resolve_dataset(specs, s3, DatasetFormat::Auto)
}

/// Resolves specs (paths, `file://` and `s3://` URLs, brace patterns,
/// directories and `s3://bucket/prefix/` listings) to shards in the order
/// given; a directory or prefix gives its shards ([`SHARD_SUFFIXES`])
/// sorted by name.
/// A shard that does not exist is kept with an unknown size: opening it
/// reports the error, under the stream's error policy. Parquet files are
/// the exception: their footers are read here, and each row group becomes
/// a shard of its own.
pub fn resolve_dataset(
    specs: &[String],
    s3: &S3Options,
    format: DatasetFormat,
) -> Result<Vec<Shard>> {
    let keep = format.listing_filter();
    let mut shards = Vec::new();
    let mut listings = Vec::new();
    let mut hub = crate::hub::Resolver::new(s3);
    for spec in specs {
        check_scheme(spec)?;
        for url in expand_braces(spec)? {
            if crate::hub::is_hub_url(&url) {
                let found = hub.resolve(&url, keep)?;
                shards.extend(
                    found
                        .into_iter()
                        .map(|(url, size)| Shard::new(url, Some(size))),
                );
                continue;
            }
            match Location::parse(&url) {
                Location::S3 { bucket, key } if key.is_empty() || key.ends_with('/') => {
                    listings.push((shards.len(), url, bucket, key));
                }
                Location::S3 { .. } | Location::Http(_) => shards.push(Shard::new(url, None)),
                Location::Local(path) => match std::fs::metadata(&path) {
                    Ok(meta) if meta.is_dir() => {
                        shards.extend(list_directory(&url, &path, keep, format)?)
                    }
                    Ok(meta) => shards.push(Shard::new(url, Some(meta.len()))),
                    Err(_) => shards.push(Shard::new(url, None)),
                },
            }
        }
    }
    if !listings.is_empty() {
        let listed = crate::source::list_s3_prefixes(s3, &listings, keep)?;
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
    let mut seen = std::collections::HashMap::new();
    for shard in &mut shards {
        let id = identity(&shard.url, Path::new(""));
        if let Some(first) = seen.insert(id, shard.url.clone()) {
            let spelled = if first == shard.url {
                String::new()
            } else {
                format!(" (as {:?} and {:?})", first, shard.url)
            };
            return Err(Error::Spec {
                spec: specs.join(" "),
                reason: format!(
                    "shard {:?} is listed twice{spelled}: every sample would come twice",
                    shard.url
                ),
            });
        }
        shard.kind = format.kind_of(&shard.url);
    }
    if shards.iter().any(|s| s.kind == ShardKind::ParquetFile) {
        shards = expand_row_groups(shards, s3)?;
        if shards.is_empty() {
            return Err(Error::Spec {
                spec: specs.join(" "),
                reason: "the Parquet files hold no row groups".into(),
            });
        }
    }
    Ok(shards)
}

/// An error naming the first local shard of `shards` that does not exist
/// (its size could not be read when it was resolved).
pub fn check_local_shards_exist(shards: &[Shard]) -> Result<()> {
    for shard in shards {
        if let (Location::Local(path), None) = (shard.location(), shard.size) {
            if let Err(error) = std::fs::metadata(&path) {
                return Err(Error::from_open(&shard.url, error));
            }
        }
    }
    Ok(())
}

/// Reads the footer of every Parquet file and replaces the file by one
/// shard per row group (a file without rows gives none).
fn expand_row_groups(shards: Vec<Shard>, s3: &S3Options) -> Result<Vec<Shard>> {
    let is_file = |s: &Shard| s.kind == ShardKind::ParquetFile;
    let mut files: Vec<Shard> = shards.iter().filter(|s| is_file(s)).cloned().collect();
    crate::source::describe_remote_objects(s3, &mut files)?;
    for file in &files {
        if file.size.is_none() {
            let missing = std::io::Error::new(std::io::ErrorKind::NotFound, "no such file");
            return Err(Error::from_open(&file.url, missing));
        }
    }
    let footers = crate::source::read_footers(&files.iter().collect::<Vec<_>>(), s3)?;
    let mut files = files.into_iter().zip(footers);
    let mut out = Vec::with_capacity(shards.len());
    for shard in shards {
        if !is_file(&shard) {
            out.push(shard);
            continue;
        }
        let (shard, metadata) = files.next().expect("one footer per Parquet file");
        let mut first_row = 0;
        for index in 0..metadata.num_row_groups() {
            let span = crate::format::parquet::row_group_span(&metadata, index);
            let rows = crate::format::parquet::row_group_rows(&metadata, index);
            out.push(Shard {
                size: Some(span.end - span.start),
                kind: ShardKind::Parquet(Arc::new(RowGroup {
                    metadata: metadata.clone(),
                    index,
                    span,
                    rows,
                    first_row,
                })),
                ..shard.clone()
            });
            first_row += rows;
        }
    }
    Ok(out)
}

/// The files of a directory that `keep` takes, sorted by URL; raw objects
/// are listed from subdirectories too (like an S3 prefix).
fn list_directory(
    url: &str,
    path: &Path,
    keep: fn(&str) -> bool,
    format: DatasetFormat,
) -> Result<Vec<Shard>> {
    let mut shards = Vec::new();
    let mut pending = vec![(url.trim_end_matches('/').to_owned(), path.to_owned())];
    while let Some((dir_url, dir)) = pending.pop() {
        let entries = std::fs::read_dir(&dir).map_err(|e| Error::from_open(&dir_url, e))?;
        for entry in entries {
            let entry = entry.map_err(|e| Error::from_open(&dir_url, e))?;
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            if !keep(name) {
                continue;
            }
            let meta = entry
                .metadata()
                .map_err(|e| Error::from_open(&dir_url, e))?;
            let joined = format!("{dir_url}/{name}");
            if meta.is_file() {
                shards.push(Shard::new(joined, Some(meta.len())));
            } else if meta.is_dir() && format == DatasetFormat::Raw {
                pending.push((joined, entry.path()));
            }
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
    fn huge_expansions_are_refused_before_allocating() {
        for spec in [
            "shard-{0..99999999999}.tar",
            "shard-{0..18446744073709551615}.tar",
            "{0..999}/{0..999}/{0..9}.tar",
        ] {
            let error = expand_braces(spec).unwrap_err().to_string();
            assert!(error.contains("more than the 1000000"), "{error}");
        }
        assert!(matches!(
            expand_braces("{0..18446744073709551616}"),
            Err(Error::Spec { .. })
        ));
        assert_eq!(
            expand_braces("{0..999}/{0..999}.tar").unwrap().len(),
            1_000_000
        );
    }

    #[test]
    fn unsupported_schemes_are_refused() {
        for url in ["gs://bucket/a.tar", "ftp://host/a.tar", "pipe:curl -s x"] {
            let error = resolve(&[url.to_owned()]).unwrap_err().to_string();
            assert!(error.contains("not supported"), "{error}");
            for scheme in ["s3://", "http://", "https://", "hf://datasets/"] {
                assert!(error.contains(scheme), "{error}");
            }
        }
        for ok in [
            "a:b.tar",
            "dir/x://y.tar",
            "s3://b/k.tar",
            "file:///x.tar",
            "https://host/a.tar",
            "HTTP://host/a.tar",
            "hf://datasets/org/name/a.tar",
        ] {
            check_scheme(ok).unwrap();
        }
        // A Hub URL of the wrong form is refused before anything is fetched.
        let error = check_scheme("hf://models/org/name/x")
            .unwrap_err()
            .to_string();
        assert!(error.contains("dataset repositories"), "{error}");
    }

    #[test]
    fn one_shard_spelled_several_ways_is_listed_twice() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.tar");
        std::fs::write(&path, b"xy").unwrap();
        std::os::unix::fs::symlink(&path, dir.path().join("link.tar")).unwrap();
        let plain = path.to_str().unwrap().to_owned();
        let d = dir.path().to_str().unwrap();
        for other in [
            format!("{d}/./a.tar"),
            format!("{d}//a.tar"),
            format!("file://{plain}"),
            format!("{d}/link.tar"),
            format!("{d}/sub/../a.tar"),
        ] {
            if other.contains("sub/") {
                std::fs::create_dir_all(dir.path().join("sub")).unwrap();
            }
            let error = resolve(&[plain.clone(), other.clone()]).unwrap_err();
            assert!(
                error.to_string().contains("listed twice"),
                "{other}: {error}"
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
