//! Dataset resolution: specs to shards. Lists directories and S3
//! prefixes, resolves Hugging Face Hub specs ([`crate::store::hub`]) and Google
//! Cloud Storage URLs ([`crate::store::gcs`]), asks S3 (or
//! an HTTP(S) server) the size of objects it has not listed, reads Parquet
//! footers (each row group becomes a shard, so the plan can split one large
//! file across ranks and workers) and attaches the manifest's sample
//! indexes. The only stage before the plan that does I/O.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use crate::config::StoreOptions;
use crate::error::{Error, Result};
use crate::format::parquet;
use crate::location::{identity, Location};
use crate::manifest::{self, Attached, ManifestChoice};
use crate::shard::{RowGroup, Shard, ShardKind};
use crate::source;
use crate::spec::{check_scheme, expand_braces, is_lines_name, is_parquet_name, DatasetFormat};
use crate::store;
use crate::store::gcs;
use crate::store::hub;

/// What a resolved URL holds, before any Parquet footer is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Holds {
    /// A tar shard.
    Tar,
    /// A raw object.
    Raw,
    /// A JSON-lines shard.
    Lines,
    /// A Parquet file: its row groups become the shards.
    ParquetFile,
}

/// What the URL `url` of a dataset in `format` holds.
fn holds(format: DatasetFormat, url: &str) -> Holds {
    match format {
        DatasetFormat::Auto if is_parquet_name(url) => Holds::ParquetFile,
        DatasetFormat::Auto if is_lines_name(url) => Holds::Lines,
        DatasetFormat::Auto | DatasetFormat::Tar => Holds::Tar,
        DatasetFormat::Parquet => Holds::ParquetFile,
        DatasetFormat::Raw => Holds::Raw,
        DatasetFormat::Jsonl => Holds::Lines,
    }
}

/// Resolves `specs` ([`resolve_dataset`]) and attaches their manifest
/// ([`manifest::attach`]). With `strict`, a local shard that does not exist
/// is an error here ([`check_local_shards_exist`]).
pub fn resolve_indexed(
    specs: &[String],
    store_options: &StoreOptions,
    format: DatasetFormat,
    manifest: &ManifestChoice,
    strict: bool,
) -> Result<(Vec<Shard>, Attached)> {
    let mut shards = resolve_dataset(specs, store_options, format)?;
    if strict {
        check_local_shards_exist(&shards)?;
    }
    let attached = match manifest {
        ManifestChoice::Url(url) => {
            let Some(json) = read_remote_manifest(url, store_options)? else {
                return Err(Error::Manifest {
                    path: url.clone(),
                    reason: "not found".into(),
                });
            };
            manifest::attach_text(&mut shards, url, &json, true)?
        }
        ManifestChoice::Auto | ManifestChoice::Path(_) | ManifestChoice::Off => {
            manifest::attach(&mut shards, manifest)?
        }
    };
    Ok((shards, attached))
}

/// Attaches the `manifest.json` beside remote tar, JSON-lines or Parquet
/// shards that `specs` name in one folder, if there is one (and, beside
/// Parquet files, it describes them), to `shards` (which carry no sample
/// indices yet). One request: made only when sample counts are needed (a
/// job of several ranks, `count_samples=True`), so that a dataset read on
/// one rank costs no request before its first shard.
pub fn attach_beside_remote(
    specs: &[String],
    shards: &mut [Shard],
    store_options: &StoreOptions,
) -> Result<Attached> {
    if shards.iter().any(|s| s.index.is_some()) {
        return Ok(Attached::default());
    }
    let Some(url) = remote_beside(specs, shards)? else {
        return Ok(Attached::default());
    };
    match read_remote_manifest(&url, store_options) {
        Ok(Some(json)) => manifest::attach_text(shards, &url, &json, false),
        Ok(None) => Ok(Attached::default()),
        // A store that denies a key it does not hold (S3 without
        // s3:ListBucket answers 403): no manifest was asked for, none is used.
        Err(Error::AccessDenied { .. }) => Ok(Attached {
            used: None,
            ignored: Some(format!(
                "{url} could not be read (access denied); the shards are planned without it"
            )),
        }),
        Err(error) => Err(error),
    }
}

/// The most bytes a remote manifest may have (its sample offsets make it
/// about 20 bytes a sample).
const MANIFEST_LIMIT: usize = 1 << 31;

/// The URL of the `manifest.json` beside `shards`, when they are remote
/// tar, JSON-lines or Parquet shards (no raw objects) that `specs` name in
/// one folder.
fn remote_beside(specs: &[String], shards: &[Shard]) -> Result<Option<String>> {
    if shards.iter().any(|s| matches!(s.kind, ShardKind::Raw)) {
        return Ok(None);
    }
    let mut urls = Vec::new();
    for spec in specs {
        urls.extend(expand_braces(spec)?);
    }
    Ok(manifest::beside_remote(&urls))
}

/// The text of the manifest at the remote `url` (`gs://` and `hf://`
/// resolved to their download URLs first), or `None` when there is none.
fn read_remote_manifest(url: &str, store_options: &StoreOptions) -> Result<Option<String>> {
    let Some(bytes) = store::read_small_object(store_options, url, MANIFEST_LIMIT)? else {
        return Ok(None);
    };
    String::from_utf8(bytes)
        .map(Some)
        .map_err(|_| Error::Manifest {
            path: url.to_owned(),
            reason: "it is not UTF-8 text".into(),
        })
}

/// Resolves local specs; see [`resolve_with`].
pub fn resolve(specs: &[String]) -> Result<Vec<Shard>> {
    resolve_with(specs, &StoreOptions::default())
}

/// Resolves specs of tar shards (and Parquet files by name); see [`resolve_dataset`].
pub fn resolve_with(specs: &[String], store_options: &StoreOptions) -> Result<Vec<Shard>> {
    resolve_dataset(specs, store_options, DatasetFormat::Auto)
}

/// Resolves specs (paths, `file://` and `s3://` URLs, brace patterns,
/// directories and `s3://bucket/prefix/` listings) to shards in the order
/// given; a directory or prefix gives its shards ([`crate::spec::SHARD_SUFFIXES`])
/// sorted by name.
/// A shard that does not exist is kept with an unknown size: opening it
/// reports the error, under the stream's error policy. Parquet files are
/// the exception: their footers are read here, and each row group becomes
/// a shard of its own.
pub fn resolve_dataset(
    specs: &[String],
    store_options: &StoreOptions,
    format: DatasetFormat,
) -> Result<Vec<Shard>> {
    let keep = format.listing_filter();
    let mut shards = Vec::new();
    let mut listings = Vec::new();
    let mut hub = hub::Resolver::new(&store_options.transport);
    let gcs = gcs::Resolver::new(&store_options.transport);
    for spec in specs {
        check_scheme(spec)?;
        for url in expand_braces(spec)? {
            if hub::is_hub_url(&url) || gcs::is_gcs_url(&url) {
                let found = if gcs::is_gcs_url(&url) {
                    gcs.resolve(&url, keep)?
                } else {
                    hub.resolve(&url, keep)?
                };
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
                        let listed = list_directory(&url, &path, keep, format)?;
                        if listed.is_empty() {
                            // Among other specs, it would be left out
                            // without a word.
                            return Err(Error::Spec {
                                spec: url,
                                reason: "no shard in the directory".into(),
                            });
                        }
                        shards.extend(listed)
                    }
                    Ok(meta) => shards.push(Shard::new(url, Some(meta.len()))),
                    Err(_) => shards.push(Shard::new(url, None)),
                },
            }
        }
    }
    if !listings.is_empty() {
        let listed = store::list_s3_prefixes(store_options, &listings, keep)?;
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
    let mut seen = HashMap::new();
    for shard in &shards {
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
    }
    let holds: Vec<Holds> = shards.iter().map(|s| holds(format, &s.url)).collect();
    for (shard, holds) in shards.iter_mut().zip(&holds) {
        match holds {
            Holds::Raw => shard.kind = ShardKind::Raw,
            Holds::Lines => shard.kind = ShardKind::Lines,
            Holds::Tar | Holds::ParquetFile => {}
        }
    }
    if holds.contains(&Holds::ParquetFile) {
        shards = expand_row_groups(shards, &holds, store_options)?;
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
                let glob = shard.url.contains(['*', '?', '[']);
                if glob && error.kind() == std::io::ErrorKind::NotFound {
                    // Taken for a glob, which local specs are not.
                    let hint = format!(
                        "{error}; glob patterns (*, ?, [...]) are expanded for hf:// specs only: \
                         name local shards with a brace range (shard-{{000000..000009}}.tar), \
                         a directory or a list of paths"
                    );
                    let error = std::io::Error::new(error.kind(), hint);
                    return Err(Error::from_open(&shard.url, error));
                }
                return Err(Error::from_open(&shard.url, error));
            }
        }
    }
    Ok(())
}

/// Checks the local files of `shards`, resolved by another process (rank 0
/// of a job, whose node may hold other copies), against what that
/// resolution says of them, with one `stat` each: a file it found must
/// exist here, with its size and the modification time its manifest
/// records (if it records one). The plan reads this node's copies by the
/// sample spans of the resolving node's: a copy that differs would lose,
/// repeat or garble samples.
pub fn check_local_copies(shards: &[Shard]) -> Result<()> {
    for shard in shards {
        // A row group's size is its span's; its file's is what a copy has.
        let size = match &shard.kind {
            ShardKind::Parquet(group) => Some(group.file_size),
            _ => shard.size,
        };
        let (Location::Local(path), Some(size)) = (shard.location(), size) else {
            continue;
        };
        let meta = std::fs::metadata(&path).map_err(|error| {
            let hint = format!(
                "{error}; the dataset was resolved on another node, where it exists: every node \
                 must hold the same files"
            );
            Error::from_open(&shard.url, std::io::Error::new(error.kind(), hint))
        })?;
        let mismatch = |is: String, says: String| Error::ManifestMismatch {
            url: shard.url.clone(),
            reason: format!(
                "here its {is}, the dataset's resolution (made on another node, from its \
                 manifest or counted sample spans) says {says}: every node must hold identical \
                 copies of the shards (copied with their modification times, `cp -p` or \
                 `rsync -t`, when a manifest records them)"
            ),
        };
        if meta.len() != size {
            return Err(mismatch(
                format!("size is {} bytes", meta.len()),
                format!("{size} bytes"),
            ));
        }
        if let Some(recorded) = shard.mtime_ns {
            let modified = manifest::mtime_ns(&path);
            if modified != Some(recorded) {
                let is = modified.map_or("modification time cannot be read".into(), |m| {
                    format!("modification time is {m} ns since the epoch")
                });
                return Err(mismatch(is, recorded.to_string()));
            }
        }
    }
    Ok(())
}

/// Reads the footer of every Parquet file and replaces the file by one
/// shard per row group (a file without rows gives none).
fn expand_row_groups(
    shards: Vec<Shard>,
    holds: &[Holds],
    store_options: &StoreOptions,
) -> Result<Vec<Shard>> {
    let mut files: Vec<Shard> = shards
        .iter()
        .zip(holds)
        .filter(|(_, holds)| **holds == Holds::ParquetFile)
        .map(|(shard, _)| shard.clone())
        .collect();
    store::describe_remote_objects(store_options, &mut files)?;
    for file in &files {
        if file.size.is_none() {
            let missing = std::io::Error::new(std::io::ErrorKind::NotFound, "no such file");
            return Err(Error::from_open(&file.url, missing));
        }
    }
    let footers = source::read_footers(&files.iter().collect::<Vec<_>>(), store_options)?;
    let mut files = files.into_iter().zip(footers);
    let mut out = Vec::with_capacity(shards.len());
    for (shard, holds) in shards.into_iter().zip(holds) {
        if *holds != Holds::ParquetFile {
            out.push(shard);
            continue;
        }
        let (shard, metadata) = files.next().expect("one footer per Parquet file");
        let file_size = shard.size.unwrap_or_default();
        let mut first_row = 0;
        for index in 0..metadata.num_row_groups() {
            let span = parquet::row_group_span(&metadata, index);
            let rows = parquet::row_group_rows(&metadata, index);
            out.push(Shard {
                size: Some(span.end - span.start),
                kind: ShardKind::Parquet(Arc::new(RowGroup {
                    metadata: metadata.clone(),
                    index,
                    span,
                    rows,
                    first_row,
                    file_size,
                    tokens: None,
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
    use std::os::unix::fs::MetadataExt;
    let mut shards = Vec::new();
    let top = std::fs::metadata(path).map_err(|e| Error::from_open(url, e))?;
    let url = url.trim_end_matches('/').to_owned();
    // Directories listed, by identity: a link to one already listed (a
    // cycle, or the same files twice) is refused, never walked again.
    let mut listed = HashMap::from([((top.dev(), top.ino()), url.clone())]);
    let mut pending = vec![(url, path.to_owned())];
    while let Some((dir_url, dir)) = pending.pop() {
        let entries = std::fs::read_dir(&dir).map_err(|e| Error::from_open(&dir_url, e))?;
        for entry in entries {
            let entry = entry.map_err(|e| Error::from_open(&dir_url, e))?;
            let name = entry.file_name();
            let Some(name) = name.to_str() else {
                let lossy = name.to_string_lossy();
                if keep(&lossy) {
                    return Err(Error::Spec {
                        spec: dir_url,
                        reason: format!(
                            "the name of {lossy:?} in it is not UTF-8: a shard's URL is text; \
                             rename the file"
                        ),
                    });
                }
                continue;
            };
            if !keep(name) {
                continue;
            }
            let joined = format!("{dir_url}/{name}");
            // Links are followed (a Hugging Face cache's snapshot holds
            // links to its blobs); one that cannot be followed (dangling, a
            // loop, no permission) is a shard its read reports (as a shard
            // given by name that cannot be opened), not the whole listing.
            let meta = match std::fs::metadata(entry.path()) {
                Ok(meta) => meta,
                Err(_) if entry.file_type().is_ok_and(|t| t.is_symlink()) => {
                    shards.push(Shard::new(joined, None));
                    continue;
                }
                Err(e) => return Err(Error::from_open(&joined, e)),
            };
            if meta.is_file() {
                shards.push(Shard::new(joined, Some(meta.len())));
            } else if meta.is_dir() && format == DatasetFormat::Raw {
                if let Some(first) = listed.insert((meta.dev(), meta.ino()), joined.clone()) {
                    return Err(Error::Spec {
                        spec: joined,
                        reason: format!(
                            "it is the directory {first:?} again (a link): its files would be \
                             listed twice"
                        ),
                    });
                }
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
    fn unsupported_schemes_are_refused() {
        for url in ["az://bucket/a.tar", "ftp://host/a.tar", "pipe:curl -s x"] {
            let error = resolve(&[url.to_owned()]).unwrap_err().to_string();
            assert!(error.contains("not supported"), "{error}");
            for scheme in ["s3://", "http://", "https://", "hf://datasets/", "gs://"] {
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
            "gs://bucket/a.tar",
        ] {
            check_scheme(ok).unwrap();
        }
        // A Hub URL of the wrong form is refused before anything is fetched.
        let error = resolve(&["hf://models/org/name/x".to_owned()])
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
    fn a_directory_lists_the_shards_its_links_point_to() {
        use std::os::unix::ffi::OsStrExt;
        use std::os::unix::fs::symlink;
        let blobs = tempfile::tempdir().unwrap();
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.tar"), b"x").unwrap();
        std::fs::write(blobs.path().join("blob"), b"xyz").unwrap();
        symlink(blobs.path().join("blob"), dir.path().join("b.tar")).unwrap();
        symlink(blobs.path().join("gone"), dir.path().join("c.tar")).unwrap();
        // A link to itself cannot be followed: its read says why.
        symlink(dir.path().join("e.tar"), dir.path().join("e.tar")).unwrap();
        // A name that is not UTF-8 but no shard's is not listed.
        std::fs::write(
            dir.path().join(std::ffi::OsStr::from_bytes(b"\xff.txt")),
            b"",
        )
        .unwrap();
        let url = dir.path().to_str().unwrap().to_owned();
        let shards = resolve(std::slice::from_ref(&url)).unwrap();
        let listed: Vec<_> = shards.iter().map(|s| (s.url.clone(), s.size)).collect();
        assert_eq!(
            listed,
            [
                (format!("{url}/a.tar"), Some(1)),
                (format!("{url}/b.tar"), Some(3)),
                // A dangling link is a missing shard, which its read reports.
                (format!("{url}/c.tar"), None),
                (format!("{url}/e.tar"), None),
            ]
        );
        // A shard's name that is not UTF-8 is refused, not left out.
        std::fs::write(
            dir.path().join(std::ffi::OsStr::from_bytes(b"d\xff.tar")),
            b"",
        )
        .unwrap();
        let error = resolve(std::slice::from_ref(&url)).unwrap_err().to_string();
        assert!(
            error.contains("\"d\u{fffd}.tar\"") && error.contains("not UTF-8"),
            "{error}"
        );
    }

    #[test]
    fn a_directory_without_shards_among_other_specs_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("empty")).unwrap();
        std::fs::write(dir.path().join("a.tar"), b"x").unwrap();
        let d = dir.path().to_str().unwrap();
        let error = resolve(&[format!("{d}/a.tar"), format!("{d}/empty")]).unwrap_err();
        assert!(
            error.to_string().contains("no shard in the directory")
                && error.to_string().contains("empty"),
            "{error}"
        );
    }

    #[test]
    fn a_raw_listing_follows_directory_links_but_never_twice() {
        let dir = tempfile::tempdir().unwrap();
        let other = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        std::fs::write(dir.path().join("sub/a.bin"), b"a").unwrap();
        std::fs::write(other.path().join("b.bin"), b"bb").unwrap();
        std::os::unix::fs::symlink(other.path(), dir.path().join("linked")).unwrap();
        // A hidden file is passed over, its name UTF-8 or not.
        std::fs::write(
            dir.path()
                .join(<std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(b".\xe9.swp")),
            b"",
        )
        .unwrap();
        let url = dir.path().to_str().unwrap().to_owned();
        let raw = |url: &str| {
            resolve_dataset(
                &[url.to_owned()],
                &StoreOptions::default(),
                DatasetFormat::Raw,
            )
        };
        let urls: Vec<_> = raw(&url).unwrap().into_iter().map(|s| s.url).collect();
        assert_eq!(
            urls,
            [format!("{url}/linked/b.bin"), format!("{url}/sub/a.bin")]
        );
        // A link back up (a cycle) or to a directory listed already.
        for target in [dir.path(), &dir.path().join("sub")] {
            let link = dir.path().join("sub/again");
            std::os::unix::fs::symlink(target, &link).unwrap();
            let error = raw(&url).unwrap_err().to_string();
            assert!(
                error.contains("listed twice") && error.contains("again"),
                "{error}"
            );
            std::fs::remove_file(link).unwrap();
        }
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
