//! The manifest: for every shard its size, ETag or mtime, sample count and
//! each sample's byte offset and length. `shardstream index` builds it; with
//! it the plan cuts shards at sample boundaries and reads pieces with
//! byte-range reads. For a compressed shard the offsets are in its
//! decompressed tar, which cannot be entered mid-way: its pieces are read
//! from the shard's start. Its JSON form is documented by
//! `schemas/manifest.schema.json`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::compression::Compression;
use crate::error::{Error, Result};
use crate::format::parquet::row_group_rows;
use crate::location::{canonical, identity, Location};
use crate::shard::{RowGroup, SampleIndex, Shard, ShardKind, ShardTokens};

/// The `format` field of every manifest.
pub const MANIFEST_FORMAT: &str = "shardstream.manifest";
/// The manifest version this build reads and writes.
pub const MANIFEST_VERSION: u32 = 1;
/// The file name looked for beside the shards.
pub const MANIFEST_FILE: &str = "manifest.json";

/// A dataset's manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// Always [`MANIFEST_FORMAT`].
    pub format: String,
    /// Always [`MANIFEST_VERSION`].
    pub version: u32,
    /// One entry per shard.
    pub shards: Vec<ShardEntry>,
}

/// What the manifest records of one shard.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardEntry {
    /// Shard URL; a relative path is relative to the manifest's directory.
    pub url: String,
    /// Size in bytes.
    pub size: u64,
    /// The object's ETag, for object stores.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub etag: Option<String>,
    /// Modification time in nanoseconds since the epoch, for local files.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mtime_ns: Option<u64>,
    /// The shard's compression; `None` (absent) for a plain tar.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compression: Option<Compression>,
    /// Number of samples.
    pub samples: u64,
    /// Byte offset of each sample's first header (in the decompressed tar
    /// of a compressed shard).
    pub offsets: Vec<u64>,
    /// Byte length of each sample, headers and padding included.
    pub lengths: Vec<u64>,
    /// Each sample's token count, when `shardstream index --count-tokens`
    /// counted them (what packing across ranks plans with).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<ShardTokens>,
    /// For a Parquet file: the rows of each row group, in order (its
    /// samples are its rows; no offsets or lengths).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub row_groups: Option<Vec<u64>>,
}

impl ShardEntry {
    /// Checks that the entry agrees with itself: one offset and one length
    /// per sample, offsets increasing, spans that do not overlap, end
    /// without overflow and lie within the shard (for a plain tar; a
    /// compressed shard's spans are in its decompressed tar).
    pub fn check(&self) -> std::result::Result<(), String> {
        if let Some(groups) = &self.row_groups {
            let rows = groups.iter().try_fold(0u64, |sum, &n| sum.checked_add(n));
            if rows != Some(self.samples) {
                return Err(format!(
                    "{}: {} samples but row groups of {groups:?} rows",
                    self.url, self.samples
                ));
            }
            if !self.offsets.is_empty() || !self.lengths.is_empty() || self.compression.is_some() {
                return Err(format!(
                    "{}: a Parquet file (row_groups) with sample offsets, lengths or a \
                     compression",
                    self.url
                ));
            }
        } else if self.offsets.len() as u64 != self.samples
            || self.lengths.len() as u64 != self.samples
        {
            return Err(format!(
                "{}: {} samples but {} offsets and {} lengths",
                self.url,
                self.samples,
                self.offsets.len(),
                self.lengths.len()
            ));
        }
        if let Some(tokens) = &self.tokens {
            if tokens.counts.len() as u64 != self.samples {
                return Err(format!(
                    "{}: {} samples but {} token counts",
                    self.url,
                    self.samples,
                    tokens.counts.len()
                ));
            }
        }
        let mut end = 0;
        for (i, (&offset, &length)) in self.offsets.iter().zip(&self.lengths).enumerate() {
            let Some(span_end) = offset.checked_add(length) else {
                return Err(format!(
                    "{}: sample {i} at byte offset {offset} with length {length} ends past 2^64",
                    self.url
                ));
            };
            if length == 0 {
                return Err(format!(
                    "{}: sample {i} at byte offset {offset} has length 0",
                    self.url
                ));
            }
            if offset < end {
                return Err(format!(
                    "{}: sample {i} starts at byte offset {offset}, before the previous sample ends at {end} (offsets must increase and spans must not overlap)",
                    self.url
                ));
            }
            if self.compression.is_none() && span_end > self.size {
                return Err(format!(
                    "{}: sample {i} spans bytes {offset}..{span_end}, past the shard's {} bytes",
                    self.url, self.size
                ));
            }
            end = span_end;
        }
        Ok(())
    }
}

impl Manifest {
    /// A manifest of `shards` entries.
    pub fn new(shards: Vec<ShardEntry>) -> Self {
        Manifest {
            format: MANIFEST_FORMAT.into(),
            version: MANIFEST_VERSION,
            shards,
        }
    }

    /// Parses and checks a manifest; `source` names it in errors.
    pub fn from_json(json: &str, source: &str) -> Result<Self> {
        let invalid = |reason: String| Error::Manifest {
            path: source.to_owned(),
            reason,
        };
        let manifest: Manifest = serde_json::from_str(json).map_err(|e| invalid(e.to_string()))?;
        if manifest.format != MANIFEST_FORMAT || manifest.version != MANIFEST_VERSION {
            return Err(invalid(format!(
                "expected format {MANIFEST_FORMAT:?} version {MANIFEST_VERSION}, got {:?} version {}",
                manifest.format, manifest.version
            )));
        }
        for entry in &manifest.shards {
            entry.check().map_err(invalid)?;
        }
        Ok(manifest)
    }

    /// Reads and checks the manifest at `path`.
    pub fn load(path: &Path) -> Result<Self> {
        Manifest::from_json(&read_text(path)?, &path.display().to_string())
    }

    /// The manifest as JSON text, ending in a newline.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("a manifest serialises") + "\n"
    }

    /// Writes the manifest as JSON to `path`.
    pub fn save(&self, path: &Path) -> Result<()> {
        std::fs::write(path, self.to_json()).map_err(|e| Error::Manifest {
            path: path.display().to_string(),
            reason: e.to_string(),
        })
    }

    /// Whether this manifest (read from `manifest_path`) describes every
    /// Parquet file of `shards` as one (`row_groups`): a manifest found
    /// beside Parquet files that does not (another dataset's, beside
    /// them) is not theirs.
    pub fn describes_parquet(&self, manifest_path: &Path, shards: &[Shard]) -> bool {
        let base = manifest_path.parent().unwrap_or(Path::new(""));
        self.describes_parquet_by(shards, |entry| identity(entry, base))
    }

    /// [`Manifest::describes_parquet`] for a manifest whose entries'
    /// identities `entry_identity` gives (a remote one's are relative to
    /// its folder).
    fn describes_parquet_by(
        &self,
        shards: &[Shard],
        entry_identity: impl Fn(&str) -> String,
    ) -> bool {
        let parquet: std::collections::HashSet<String> = self
            .shards
            .iter()
            .filter(|e| e.row_groups.is_some())
            .map(|e| entry_identity(&e.url))
            .collect();
        shards
            .iter()
            .filter(|s| matches!(s.kind, ShardKind::Parquet(_)))
            .all(|s| parquet.contains(&identity(&s.url, Path::new(""))))
    }

    /// Gives each of `shards` its sample index from this manifest (read
    /// from `manifest_path`), checking each shard against what it records
    /// (size, ETag, a local file's modification time).
    pub fn attach(&self, manifest_path: &Path, shards: &mut [Shard]) -> Result<()> {
        let base = manifest_path.parent().unwrap_or(Path::new(""));
        self.attach_entries(&manifest_path.display().to_string(), shards, |url| {
            identity(url, base)
        })
    }

    /// [`Manifest::attach`] for a manifest read from the remote `url`: its
    /// entries are URLs, or names relative to the manifest's own folder.
    pub fn attach_remote(&self, url: &str, shards: &mut [Shard]) -> Result<()> {
        self.attach_entries(url, shards, remote_entry_identity(url))
    }

    /// Gives each shard its sample index from the entry whose identity
    /// (`entry_identity` of its URL) is the shard's; `name` names the
    /// manifest in errors. The shard must match the entry: its listed ETag
    /// and size, and, for a local file, its modification time (a tar
    /// appended to within its padding keeps its size). A remote object
    /// named outright (not listed: no size yet) takes the entry's size and
    /// ETag, which its reads then check it against.
    fn attach_entries(
        &self,
        name: &str,
        shards: &mut [Shard],
        entry_identity: impl Fn(&str) -> String,
    ) -> Result<()> {
        let manifest_path = name;
        let by_path: HashMap<String, &ShardEntry> = self
            .shards
            .iter()
            .map(|e| (entry_identity(&e.url), e))
            .collect();
        for shard in shards.iter_mut() {
            let entry = by_path
                .get(&identity(&shard.url, Path::new("")))
                .ok_or_else(|| Error::ManifestMismatch {
                    url: shard.url.clone(),
                    reason: format!(
                        "not listed in the manifest {manifest_path}: a shard added after \
                         the dataset was indexed; run `shardstream index` again (or pass \
                         `manifest=False` to read without the manifest)"
                    ),
                })?;
            // What the shard is, and what the manifest says instead.
            let mismatch = |is: String, says: String| Error::ManifestMismatch {
                url: shard.url.clone(),
                reason: format!(
                    "{is}, the manifest {manifest_path} says {says}; the shard changed since \
                     it was indexed: run `shardstream index` again"
                ),
            };
            if let (Some(etag), Some(listed)) = (&entry.etag, &shard.etag) {
                if etag != listed {
                    return Err(mismatch(format!("ETag is {listed}"), etag.clone()));
                }
            }
            let size = match &shard.kind {
                ShardKind::Parquet(group) => Some(group.file_size),
                _ => shard.size,
            };
            if let Some(size) = size {
                if size != entry.size {
                    return Err(mismatch(
                        format!("size is {size} bytes"),
                        format!("{} bytes", entry.size),
                    ));
                }
            }
            match shard.location() {
                Location::Local(path) => {
                    // A tar appended to often keeps its size (records are
                    // padded to 10,240 bytes): its modification time tells.
                    if let (Some(recorded), Some(modified)) = (entry.mtime_ns, mtime_ns(&path)) {
                        if recorded != modified {
                            return Err(mismatch(
                                format!(
                                    "modification time is {modified} ns since the epoch (a \
                                     copy keeps it with `cp -p` or `rsync -t`)"
                                ),
                                recorded.to_string(),
                            ));
                        }
                    }
                    shard.mtime_ns = entry.mtime_ns;
                }
                Location::S3 { .. } | Location::Http(_) => {
                    // Named outright, not listed: the reads check the
                    // object against what the manifest records.
                    shard.size.get_or_insert(entry.size);
                    if shard.etag.is_none() {
                        shard.etag.clone_from(&entry.etag);
                    }
                }
            }
            entry.check().map_err(|reason| Error::Manifest {
                path: manifest_path.to_owned(),
                reason,
            })?;
            if let ShardKind::Parquet(group) = &shard.kind {
                if entry.row_groups.is_none() {
                    return Err(Error::ManifestMismatch {
                        url: shard.url.clone(),
                        reason: format!(
                            "the manifest {manifest_path} describes it as a tar or JSON-lines \
                             shard (no row_groups): index Parquet files with `shardstream index \
                             --format parquet --count-tokens FIELD`"
                        ),
                    });
                }
                let group = parquet_tokens(group, entry).map_err(|says| {
                    mismatch(
                        format!("footer has {} row groups", group.metadata.num_row_groups()),
                        says,
                    )
                })?;
                shard.kind = ShardKind::Parquet(Arc::new(group));
                continue;
            }
            if entry.row_groups.is_some() {
                return Err(mismatch(
                    "it is not a Parquet file".into(),
                    "it is one (row_groups)".into(),
                ));
            }
            let index = SampleIndex::from_parts(
                entry.offsets.clone(),
                entry.lengths.clone(),
                entry.compression,
            )
            .ok_or_else(|| Error::Manifest {
                path: manifest_path.to_owned(),
                reason: format!("{}: not as many lengths as offsets", entry.url),
            })?
            .with_tokens(entry.tokens.clone().map(Arc::new));
            shard.index = Some(Arc::new(index));
        }
        Ok(())
    }
}

/// `group` with its rows' token counts from `entry`, its Parquet file's:
/// the entry's row groups must be the footer's (else what the manifest
/// says instead).
fn parquet_tokens(group: &RowGroup, entry: &ShardEntry) -> std::result::Result<RowGroup, String> {
    let footer: Vec<u64> = (0..group.metadata.num_row_groups())
        .map(|i| row_group_rows(&group.metadata, i))
        .collect();
    match &entry.row_groups {
        None => return Err("no row groups".into()),
        Some(groups) if *groups != footer => {
            return Err(format!(
                "row groups of {groups:?} rows (the footer: {footer:?})"
            ))
        }
        Some(_) => {}
    }
    let tokens = entry.tokens.as_ref().map(|tokens| {
        let rows = group.first_row as usize..(group.first_row + group.rows) as usize;
        Arc::new(ShardTokens {
            field: tokens.field.clone(),
            tokenizer: tokens.tokenizer.clone(),
            counts: tokens.counts[rows].to_vec(),
        })
    });
    Ok(RowGroup {
        metadata: group.metadata.clone(),
        index: group.index,
        span: group.span.clone(),
        rows: group.rows,
        first_row: group.first_row,
        file_size: group.file_size,
        tokens,
    })
}

/// Which manifest a dataset uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ManifestChoice {
    /// The `manifest.json` beside the shards, if there is one.
    Auto,
    /// This manifest file.
    Path(PathBuf),
    /// The manifest at this URL (`s3://`, `gs://`, `http(s)://`, `hf://`).
    Url(String),
    /// None: plan by bytes.
    Off,
}

/// What [`attach`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Attached {
    /// The manifest whose sample indices the shards now carry (its path
    /// or URL), if any.
    pub used: Option<String>,
    /// Why a `manifest.json` beside the shards was not used: it is not a
    /// shardstream manifest (another tool's file of that name). The caller
    /// tells the user (the library itself prints nothing).
    pub ignored: Option<String>,
}

/// Gives `shards` their sample indices from the chosen local manifest. A
/// `manifest.json` found beside the shards is used only when it says it is
/// a shardstream manifest (its `format`); another is passed over, with the
/// reason in [`Attached::ignored`]. A manifest named explicitly must be one.
/// A remote manifest ([`ManifestChoice::Url`]) is read by the caller and
/// given to [`attach_text`].
pub fn attach(shards: &mut [Shard], choice: &ManifestChoice) -> Result<Attached> {
    if shards.iter().any(|s| matches!(s.kind, ShardKind::Raw)) {
        // Raw objects are one sample each (manifests describe tar,
        // JSON-lines and Parquet shards).
        return match choice {
            ManifestChoice::Path(path) => Err(Error::Manifest {
                path: path.display().to_string(),
                reason: "manifests describe tar, JSON-lines and Parquet shards; this dataset has raw objects"
                    .into(),
            }),
            ManifestChoice::Url(url) => Err(Error::Manifest {
                path: url.clone(),
                reason: "manifests describe tar, JSON-lines and Parquet shards; this dataset has raw objects"
                    .into(),
            }),
            ManifestChoice::Off | ManifestChoice::Auto => Ok(Attached::default()),
        };
    }
    let (path, json) = match choice {
        ManifestChoice::Off | ManifestChoice::Url(_) => return Ok(Attached::default()),
        ManifestChoice::Path(path) => (path.clone(), read_text(path)?),
        ManifestChoice::Auto => {
            let Some(path) = find_beside(shards) else {
                return Ok(Attached::default());
            };
            let json = read_text(&path)?;
            if let Err(what) = identify(&json) {
                return Ok(Attached {
                    used: None,
                    ignored: Some(format!(
                        "{} is not a shardstream manifest ({what}); the shards are planned without one",
                        path.display()
                    )),
                });
            }
            (path, json)
        }
    };
    let manifest = Manifest::from_json(&json, &path.display().to_string())?;
    if *choice == ManifestChoice::Auto && !manifest.describes_parquet(&path, shards) {
        // Found beside Parquet files it does not describe: not theirs
        // (their footers give their row counts).
        return Ok(Attached::default());
    }
    manifest.attach(&path, shards)?;
    Ok(Attached {
        used: Some(path.display().to_string()),
        ignored: None,
    })
}

/// Gives `shards` their sample indices from the manifest `json` read from
/// the remote `url`: `explicit` when the user named it (then it must be a
/// shardstream manifest), else it was found beside the shards and another
/// tool's file of that name is passed over, as [`attach`] does.
pub fn attach_text(
    shards: &mut [Shard],
    url: &str,
    json: &str,
    explicit: bool,
) -> Result<Attached> {
    if shards.iter().any(|s| matches!(s.kind, ShardKind::Raw)) {
        if !explicit {
            return Ok(Attached::default());
        }
        return Err(Error::Manifest {
            path: url.to_owned(),
            reason: "manifests describe tar, JSON-lines and Parquet shards; this dataset has raw objects".into(),
        });
    }
    if !explicit {
        if let Err(what) = identify(json) {
            return Ok(Attached {
                used: None,
                ignored: Some(format!(
                    "{url} is not a shardstream manifest ({what}); the shards are planned without one"
                )),
            });
        }
    }
    let manifest = Manifest::from_json(json, url)?;
    if !explicit && !manifest.describes_parquet_by(shards, remote_entry_identity(url)) {
        // Found beside Parquet files it does not describe: not theirs
        // (their footers give their row counts).
        return Ok(Attached::default());
    }
    manifest.attach_remote(url, shards)?;
    Ok(Attached {
        used: Some(url.to_owned()),
        ignored: None,
    })
}

/// The identity of an entry of the manifest at the remote `url`: a
/// relative path is relative to the manifest's folder.
fn remote_entry_identity(url: &str) -> impl Fn(&str) -> String + '_ {
    let folder = &url[..url.rfind('/').map_or(0, |i| i + 1)];
    move |entry| match Location::parse(entry) {
        Location::Local(path) if path.is_relative() => format!("{folder}{entry}"),
        _ => identity(entry, Path::new("")),
    }
}

/// The manifest named `text`: a URL of a remote store, else a local path.
pub fn choice_of(text: &str) -> ManifestChoice {
    let scheme = text.split_once("://").map(|(s, _)| s.to_ascii_lowercase());
    if scheme.is_some_and(|s| REMOTE_SCHEMES.contains(&s.as_str())) {
        ManifestChoice::Url(text.to_owned())
    } else {
        ManifestChoice::Path(PathBuf::from(text))
    }
}

/// The schemes of remote stores, whose manifests are read by URL.
pub const REMOTE_SCHEMES: [&str; 5] = ["s3", "gs", "http", "https", "hf"];

/// The URL of the `manifest.json` beside the remote shards that `urls`
/// (expanded specs) name, when they all lie in one remote folder (a prefix
/// `s3://b/p/`, or keys `s3://b/p/a.tar`, `https://h/p/a.tar`, ...).
pub fn beside_remote(urls: &[String]) -> Option<String> {
    let mut folders = urls.iter().map(|url| {
        let scheme = url.split_once("://")?.0.to_ascii_lowercase();
        if !REMOTE_SCHEMES.contains(&scheme.as_str()) {
            return None;
        }
        let path = &url[..url.find(['?', '#']).unwrap_or(url.len())];
        path.rfind('/').map(|i| path[..=i].to_owned())
    });
    let first = folders.next()??;
    if folders.any(|f| f.as_ref() != Some(&first)) {
        return None;
    }
    Some(format!("{first}{MANIFEST_FILE}"))
}

fn read_text(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|e| Error::Manifest {
        path: path.display().to_string(),
        reason: e.to_string(),
    })
}

/// Whether `json` says it is a shardstream manifest: a JSON object whose
/// `format` is [`MANIFEST_FORMAT`]; `Err` says what it is instead. Text
/// that does not parse but names the format is taken as a damaged
/// manifest of ours, so that its parse error is reported.
fn identify(json: &str) -> std::result::Result<(), String> {
    /// The `format` of a JSON object, skipping the rest unparsed.
    #[derive(Deserialize)]
    struct Probe {
        #[serde(default)]
        format: Option<serde_json::Value>,
    }
    let ours_but_damaged = |e: serde_json::Error| {
        if json.contains(MANIFEST_FORMAT) {
            Ok(())
        } else {
            Err(format!("it is not JSON: {e}"))
        }
    };
    if !json.trim_start().starts_with('{') {
        return match serde_json::from_str::<serde::de::IgnoredAny>(json) {
            Ok(_) => Err("it is not a JSON object".into()),
            Err(e) => ours_but_damaged(e),
        };
    }
    match serde_json::from_str::<Probe>(json) {
        Ok(Probe {
            format: Some(serde_json::Value::String(format)),
        }) if format == MANIFEST_FORMAT => Ok(()),
        Ok(Probe {
            format: Some(other),
        }) => Err(format!("its \"format\" is {other}")),
        Ok(Probe { format: None }) => Err("it has no \"format\" field".into()),
        Err(e) => ours_but_damaged(e),
    }
}

/// The `manifest.json` in the one directory holding every shard, if any.
pub fn find_beside(shards: &[Shard]) -> Option<PathBuf> {
    let mut dirs = shards.iter().map(|s| match s.location() {
        Location::Local(path) => canonical(&path).parent().map(Path::to_owned),
        Location::S3 { .. } | Location::Http(_) => None,
    });
    let first = dirs.next()??;
    if dirs.any(|d| d.as_ref() != Some(&first)) {
        return None;
    }
    let candidate = first.join(MANIFEST_FILE);
    candidate.is_file().then_some(candidate)
}

/// The URL to record for `shard` in a manifest written to `manifest_path`:
/// relative to the manifest's directory when the shard is inside it.
pub fn entry_url(shard: &Shard, manifest_path: &Path) -> String {
    let Location::Local(path) = shard.location() else {
        return shard.url.clone();
    };
    let dir = canonical(manifest_path.parent().unwrap_or(Path::new(".")));
    canonical(&path)
        .strip_prefix(&dir)
        .ok()
        .and_then(|p| p.to_str())
        .map(str::to_owned)
        .unwrap_or_else(|| canonical(&path).display().to_string())
}

/// The modification time of a local file, in nanoseconds since the epoch.
pub fn mtime_ns(path: &Path) -> Option<u64> {
    let modified = std::fs::metadata(path).ok()?.modified().ok()?;
    let since = modified.duration_since(std::time::UNIX_EPOCH).ok()?;
    u64::try_from(since.as_nanos()).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shard of the local file at `path`, as resolving its path gives it.
    fn local_shard(path: &Path) -> Vec<Shard> {
        let size = std::fs::metadata(path).unwrap().len();
        vec![Shard::new(path.display().to_string(), Some(size))]
    }

    fn entry() -> ShardEntry {
        ShardEntry {
            url: "a.tar".into(),
            size: 4096,
            etag: None,
            mtime_ns: None,
            compression: None,
            samples: 2,
            offsets: vec![0, 1024],
            lengths: vec![1024, 2048],
            tokens: None,
            row_groups: None,
        }
    }

    #[test]
    fn a_parquet_entry_has_row_groups_and_no_spans() {
        let parquet = ShardEntry {
            url: "a.parquet".into(),
            samples: 5,
            offsets: vec![],
            lengths: vec![],
            row_groups: Some(vec![2, 3]),
            tokens: Some(ShardTokens {
                field: "text".into(),
                tokenizer: None,
                counts: vec![1, 2, 3, 4, 5],
            }),
            ..entry()
        };
        parquet.check().unwrap();
        let json = serde_json::to_string(&Manifest::new(vec![parquet.clone()])).unwrap();
        assert_eq!(Manifest::from_json(&json, "m").unwrap().shards[0], parquet);
        let short = ShardEntry {
            row_groups: Some(vec![2, 2]),
            ..parquet.clone()
        };
        assert!(short
            .check()
            .unwrap_err()
            .contains("5 samples but row groups of [2, 2]"));
        let spans = ShardEntry {
            offsets: vec![0; 5],
            lengths: vec![1; 5],
            ..parquet
        };
        assert!(spans
            .check()
            .unwrap_err()
            .contains("a Parquet file (row_groups)"));
    }

    #[test]
    fn round_trips_and_checks() {
        let manifest = Manifest::new(vec![entry()]);
        let json = serde_json::to_string(&manifest).unwrap();
        assert_eq!(Manifest::from_json(&json, "m").unwrap(), manifest);
        let mut bad = entry();
        bad.lengths[1] = 4000;
        let json = serde_json::to_string(&Manifest::new(vec![bad])).unwrap();
        let err = Manifest::from_json(&json, "m.json")
            .unwrap_err()
            .to_string();
        assert!(err.contains("m.json") && err.contains("sample 1"), "{err}");
        assert!(Manifest::from_json("{\"format\": 1}", "m").is_err());
    }

    #[test]
    fn token_counts_round_trip_one_per_sample() {
        let counted = ShardEntry {
            tokens: Some(ShardTokens {
                field: "text".into(),
                tokenizer: None,
                counts: vec![7, 0],
            }),
            ..entry()
        };
        let json = Manifest::new(vec![counted.clone()]).to_json();
        assert!(json.contains(r#""tokens":{"field":"text","tokenizer":null,"counts":[7,0]}"#));
        assert_eq!(Manifest::from_json(&json, "m").unwrap().shards[0], counted);
        let plain = Manifest::new(vec![entry()]).to_json();
        assert!(!plain.contains("tokens"), "{plain}");
        let short = json.replace("[7,0]", "[7]");
        let err = Manifest::from_json(&short, "m.json")
            .unwrap_err()
            .to_string();
        assert!(err.contains("a.tar: 2 samples but 1 token counts"), "{err}");
    }

    #[test]
    fn compressed_entries_may_span_past_the_shard_size() {
        let mut gz = entry();
        gz.size = 100;
        assert!(gz.check().is_err(), "a plain tar's samples lie within it");
        gz.compression = Some(Compression::Gzip);
        gz.check().unwrap();
        let json = serde_json::to_string(&Manifest::new(vec![gz.clone()])).unwrap();
        assert!(json.contains("\"compression\":\"gzip\""), "{json}");
        assert_eq!(Manifest::from_json(&json, "m").unwrap().shards[0], gz);
        let plain = serde_json::to_string(&Manifest::new(vec![entry()])).unwrap();
        assert!(!plain.contains("compression"), "{plain}");
        let bogus = json.replace("\"gzip\"", "\"lz4\"");
        assert!(Manifest::from_json(&bogus, "m").is_err());
    }

    #[test]
    fn overflowing_unsorted_or_miscounted_entries_are_refused_naming_the_shard() {
        let gzip = |offsets: Vec<u64>, lengths: Vec<u64>| ShardEntry {
            compression: Some(Compression::Gzip),
            samples: offsets.len() as u64,
            offsets,
            lengths,
            ..entry()
        };
        let cases = [
            (gzip(vec![u64::MAX - 100], vec![512]), "sample 0"),
            (gzip(vec![0, u64::MAX], vec![512, 1]), "sample 1"),
            (
                ShardEntry {
                    offsets: vec![u64::MAX - 10, 0],
                    ..entry()
                },
                "sample 0",
            ),
            (
                ShardEntry {
                    offsets: vec![1024, 0],
                    lengths: vec![10, 10],
                    ..entry()
                },
                "sample 1",
            ),
            (
                ShardEntry {
                    samples: 3,
                    ..entry()
                },
                "3 samples",
            ),
        ];
        for (bad, says) in cases {
            let json = serde_json::to_string(&Manifest::new(vec![bad.clone()])).unwrap();
            let err = Manifest::from_json(&json, "m.json").unwrap_err();
            assert!(matches!(err, Error::Manifest { .. }), "{err}");
            let message = err.to_string();
            assert!(
                message.contains("a.tar") && message.contains(says),
                "{message}"
            );
            // A manifest made in code is checked when it is attached.
            let dir = tempfile::tempdir().unwrap();
            std::fs::write(dir.path().join("a.tar"), vec![0u8; 4096]).unwrap();
            let mut shards = local_shard(&dir.path().join("a.tar"));
            let err = Manifest::new(vec![bad])
                .attach(&dir.path().join(MANIFEST_FILE), &mut shards)
                .unwrap_err();
            assert!(err.to_string().contains("a.tar"), "{err}");
        }
    }

    #[test]
    fn only_a_manifest_that_says_it_is_ours_is_picked_up_beside_the_shards() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.tar"), vec![0u8; 4096]).unwrap();
        let shard = dir.path().join("a.tar").display().to_string();
        let beside = dir.path().join(MANIFEST_FILE);
        let attach_with = |text: &str, choice: &ManifestChoice| {
            std::fs::write(&beside, text).unwrap();
            let mut shards = local_shard(Path::new(&shard));
            attach(&mut shards, choice).map(|a| (a, shards[0].index.is_some()))
        };
        let ours = serde_json::to_string(&Manifest::new(vec![entry()])).unwrap();
        let (attached, indexed) = attach_with(&ours, &ManifestChoice::Auto).unwrap();
        assert_eq!(
            (attached.used, indexed),
            (Some(beside.display().to_string()), true)
        );
        assert_eq!(attached.ignored, None);
        for (foreign, why) in [
            (
                r#"{"format": "other", "shards": []}"#,
                r#"its "format" is "other""#,
            ),
            (r#"{"files": ["a.tar"]}"#, r#"no "format" field"#),
            (r#"{"format": 2}"#, r#"its "format" is 2"#),
            ("[1, 2]", "not a JSON object"),
            ("", "not JSON"),
            ("{", "not JSON"),
        ] {
            let (attached, indexed) = attach_with(foreign, &ManifestChoice::Auto).unwrap();
            let reason = attached.ignored.unwrap();
            assert!(
                reason.contains(&beside.display().to_string()) && reason.contains(why),
                "{reason}"
            );
            assert_eq!((attached.used, indexed), (None, false));
            // Named explicitly, it must be a manifest.
            let err = attach_with(foreign, &ManifestChoice::Path(beside.clone())).unwrap_err();
            assert!(matches!(err, Error::Manifest { .. }), "{err}");
        }
        // Ours, but damaged: an error, not passed over.
        let err = attach_with(&ours[..ours.len() / 2], &ManifestChoice::Auto).unwrap_err();
        assert!(matches!(err, Error::Manifest { .. }), "{err}");
        let wrong_version = ours.replace("\"version\":1", "\"version\":9");
        assert!(attach_with(&wrong_version, &ManifestChoice::Auto).is_err());
    }

    #[test]
    fn attach_checks_a_local_files_modification_time_and_keeps_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.tar");
        std::fs::write(&path, vec![0u8; 4096]).unwrap();
        let manifest_path = dir.path().join(MANIFEST_FILE);
        let modified = mtime_ns(&path).unwrap();
        let recorded = |mtime_ns| {
            Manifest::new(vec![ShardEntry {
                mtime_ns: Some(mtime_ns),
                ..entry()
            }])
        };
        let mut shards = local_shard(&path);
        recorded(modified)
            .attach(&manifest_path, &mut shards)
            .unwrap();
        assert_eq!(shards[0].mtime_ns, Some(modified));
        // Same size, another time: changed since it was indexed.
        let mut shards = local_shard(&path);
        let err = recorded(modified - 1)
            .attach(&manifest_path, &mut shards)
            .unwrap_err();
        assert!(matches!(err, Error::ManifestMismatch { .. }), "{err}");
        let message = err.to_string();
        assert!(
            message.contains("modification time")
                && message.contains(&(modified - 1).to_string())
                && message.contains("shardstream index"),
            "{message}"
        );
    }

    #[test]
    fn attach_gives_remote_objects_named_outright_the_size_and_etag_recorded() {
        let manifest = Manifest::new(vec![ShardEntry {
            url: "https://host/d/a.tar".into(),
            etag: Some("\"e1\"".into()),
            ..entry()
        }]);
        let mut shards = vec![Shard::new("https://host/d/a.tar", None)];
        manifest
            .attach_remote("https://host/d/manifest.json", &mut shards)
            .unwrap();
        assert_eq!(
            (shards[0].size, shards[0].etag.as_deref()),
            (Some(4096), Some("\"e1\""))
        );
        // Listed with another ETag: refused, naming both.
        let mut listed = vec![Shard {
            etag: Some("\"e2\"".into()),
            ..Shard::new("https://host/d/a.tar", Some(4096))
        }];
        let err = manifest
            .attach_remote("https://host/d/manifest.json", &mut listed)
            .unwrap_err()
            .to_string();
        assert!(err.contains("e1") && err.contains("e2"), "{err}");
    }

    #[test]
    fn attach_checks_listing_and_size() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.tar"), vec![0u8; 4096]).unwrap();
        std::fs::write(dir.path().join("b.tar"), vec![0u8; 10]).unwrap();
        let manifest_path = dir.path().join(MANIFEST_FILE);
        let manifest = Manifest::new(vec![entry()]);
        let mut shards = local_shard(&dir.path().join("a.tar"));
        manifest.attach(&manifest_path, &mut shards).unwrap();
        assert_eq!(shards[0].index.as_ref().unwrap().len(), 2);
        let mut other = local_shard(&dir.path().join("b.tar"));
        let err = manifest.attach(&manifest_path, &mut other).unwrap_err();
        assert!(matches!(err, Error::ManifestMismatch { .. }), "{err}");
        std::fs::write(dir.path().join("a.tar"), vec![0u8; 4000]).unwrap();
        let mut resized = local_shard(&dir.path().join("a.tar"));
        let err = manifest
            .attach(&manifest_path, &mut resized)
            .unwrap_err()
            .to_string();
        assert!(err.contains("4000") && err.contains("4096"), "{err}");
    }
}
