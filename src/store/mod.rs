//! Where shard bytes are stored, one module per backend: local files
//! ([`local`]), S3 and S3-compatible stores ([`s3`]), HTTP(S) ([`http`]),
//! Google Cloud Storage ([`gcs`]) and the Hugging Face Hub ([`hub`]). Each
//! holds how its URLs are resolved (listings, revisions, sizes and
//! validators), how its requests are authorised, and how an object is read
//! by byte ranges: a remote object is a [`ranged::RangedObject`], the one
//! small trait the read-ahead (`source/`) reads every remote store
//! through. GCS and Hub objects resolve to `https://` URLs read by the
//! HTTP(S) client, which sends each store's credentials to its own
//! endpoint only. Nothing here knows of the read-ahead: `source` depends
//! on this module, never the other way.
//!
//! The operations below are those made once per dataset, at resolve time,
//! outside any read-ahead: on a runtime of their own ([`on_io_runtime`]),
//! shut down before they return.

pub mod gcs;
pub mod http;
pub mod hub;
pub mod local;
pub(crate) mod ranged;
mod runtime;
pub mod s3;
mod tls;

use runtime::on_io_runtime;

use crate::config::StoreOptions;
use crate::error::{Error, Result};
use crate::location::Location;
use crate::shard::Shard;

/// Runs `work` with a fresh S3 client ([`on_io_runtime`]).
fn with_s3_client<T>(
    options: &StoreOptions,
    work: impl AsyncFnOnce(&s3::S3Client) -> Result<T>,
) -> Result<T> {
    options.validate()?;
    on_io_runtime(async {
        let client = s3::S3Client::new(options).await;
        work(&client).await
    })
}

/// The credentials every HTTP(S) client reading shards sends: the Hugging
/// Face token to the Hub, a Google Cloud access token to Cloud Storage,
/// each to its endpoint only.
pub fn http_credentials() -> Vec<Box<dyn http::OriginCredentials>> {
    hub::auth::credentials()
        .into_iter()
        .chain(gcs::auth::credentials())
        .collect()
}

/// Fills in the size and ETag of the S3 and HTTP(S) shards that lack a
/// size (a HEAD of each S3 object, a GET of each resource's first byte).
pub fn describe_remote_objects(options: &StoreOptions, shards: &mut [Shard]) -> Result<()> {
    let unknown = |s: &Shard, http: bool| {
        s.size.is_none()
            && match s.location() {
                Location::S3 { .. } => !http,
                Location::Http(_) => http,
                Location::Local(_) => false,
            }
    };
    if shards.iter().any(|s| unknown(s, false)) {
        with_s3_client(options, async |client| {
            for shard in shards.iter_mut().filter(|s| unknown(s, false)) {
                if let Location::S3 { bucket, key } = shard.location() {
                    let (size, etag) = client.head(&shard.url, &bucket, &key).await?;
                    shard.size = Some(size);
                    shard.etag = etag;
                }
            }
            Ok(())
        })?;
    }
    if shards.iter().any(|s| unknown(s, true)) {
        http::with_http_client(&options.transport, http_credentials(), async |client| {
            for shard in shards.iter_mut().filter(|s| unknown(s, true)) {
                let (size, etag) = client.describe(&shard.url).await?;
                shard.size = Some(size);
                shard.etag = etag;
            }
            Ok(())
        })?;
    }
    Ok(())
}

/// The whole of the small object at `url` (a local path, `s3://`,
/// `http(s)://`, or `gs://` and `hf://` resolved to their download URLs
/// first; a manifest, a tokenizer), at most `limit` bytes, or `None` when
/// it does not exist.
pub fn read_small_object(
    options: &StoreOptions,
    url: &str,
    limit: usize,
) -> Result<Option<Vec<u8>>> {
    let found = if gcs::is_gcs_url(url) {
        gcs::Resolver::new(&options.transport).resolve(url, |_| true)
    } else if hub::is_hub_url(url) {
        hub::Resolver::new(&options.transport).resolve(url, |_| true)
    } else {
        Ok(vec![(url.to_owned(), 0)])
    };
    let download = match found {
        Ok(mut found) if found.len() == 1 => found.remove(0).0,
        Ok(_) | Err(Error::NotFound { .. }) => return Ok(None),
        Err(error) => return Err(error),
    };
    let url = download.as_str();
    let read = match Location::parse(url) {
        Location::S3 { bucket, key } => with_s3_client(options, async |client| {
            client.get_small(url, &bucket, &key, limit).await
        }),
        Location::Http(_) => {
            http::with_http_client(&options.transport, http_credentials(), async |client| {
                client.get_small(url, limit).await.map(|(_, body)| body)
            })
        }
        Location::Local(path) => std::fs::read(&path).map_err(|e| Error::Manifest {
            path: url.to_owned(),
            reason: e.to_string(),
        }),
    };
    match read {
        Ok(bytes) => Ok(Some(bytes)),
        Err(Error::NotFound { .. }) => Ok(None),
        Err(error) => Err(error),
    }
}

/// Writes `bytes` (a manifest) to the object at the `s3://` URL `url`.
pub fn write_small_object(options: &StoreOptions, url: &str, bytes: Vec<u8>) -> Result<()> {
    let Location::S3 { bucket, key } = Location::parse(url) else {
        return Err(Error::Write {
            url: url.to_owned(),
            offset: 0,
            reason: "manifests are written to local paths and s3:// URLs".into(),
        });
    };
    with_s3_client(options, async |client| {
        client.put_small(url, &bucket, &key, bytes).await
    })
}

/// Lists `s3://bucket/prefix/` specs: for each `(position, url, bucket,
/// prefix)`, the objects whose keys `keep` takes, sorted by key, as shards
/// with their sizes and ETags.
pub fn list_s3_prefixes(
    options: &StoreOptions,
    listings: &[(usize, String, String, String)],
    keep: fn(&str) -> bool,
) -> Result<Vec<Vec<Shard>>> {
    with_s3_client(options, async |client| {
        let mut all = Vec::with_capacity(listings.len());
        for (_, url, bucket, prefix) in listings {
            let objects = client.list(url, bucket, prefix, keep).await?;
            if objects.is_empty() {
                // Among other specs, an empty prefix (a typo) would be left
                // out without a word.
                return Err(Error::Spec {
                    spec: url.clone(),
                    reason: format!("no shard under the prefix {prefix:?} of bucket {bucket}"),
                });
            }
            all.push(
                objects
                    .into_iter()
                    .map(|(key, size, etag)| Shard {
                        etag,
                        ..Shard::new(format!("s3://{bucket}/{key}"), Some(size))
                    })
                    .collect(),
            );
        }
        Ok(all)
    })
}
