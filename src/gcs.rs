//! Objects in Google Cloud Storage: `gs://BUCKET/KEY` (one object) and
//! `gs://BUCKET/PREFIX/` (every object under the prefix, listed page by
//! page) are resolved once, in the process that builds the dataset,
//! through the GCS JSON API, with their sizes and generations. Each object
//! becomes an `https://` shard at the API's media download URL pinned to
//! the generation the resolution saw, read by the HTTP source (ranged GETs,
//! retries, resumes), which sends the access token of the Application
//! Default Credentials ([`crate::source::gcs_auth`]) to the GCS endpoint
//! only. So an object overwritten after the resolution is an error, never a
//! mix of two versions. `STORAGE_EMULATOR_HOST` points every request at an
//! emulator.
//!
//! The JSON API over the HTTP source, rather than a GCS crate
//! (`google-cloud-storage`, `object_store`): those bring their own HTTP
//! stack (reqwest, with rustls' `ring` backend) to compile beside the
//! hyper/rustls/aws-lc-rs one already built for S3 and HTTP, and their own
//! retry loops beside the range reader every source shares; the API needed
//! here is two GETs and an OAuth2 token exchange.

use crate::config::S3Options;
use crate::error::{Error, Result};
use crate::source::gcs_auth::{gcs_endpoint, percent_encode, NO_TOKEN};
use crate::source::http::{with_http_client, HttpClient};

/// The most pages of one listing (a bound on a server that never stops
/// handing out a next page).
const MAX_PAGES: usize = 100_000;

/// The most bytes of one API answer.
const MAX_ANSWER_BYTES: usize = 64 << 20;

/// What to do when GCS refuses a request.
const CREDENTIALS_HINT: &str = "the bucket may be private: set GOOGLE_APPLICATION_CREDENTIALS to \
     a service account's key that may read it (or run `gcloud auth application-default login`)";

/// Whether `url` is a Google Cloud Storage URL (`gs://`).
pub fn is_gcs_url(url: &str) -> bool {
    url.starts_with("gs://")
}

/// `gs://BUCKET/PATH`, parsed: bucket and path (a key, a prefix ending in
/// `/`, or empty: the whole bucket); the reason if it is not one.
fn parse(url: &str) -> std::result::Result<(&str, &str), String> {
    let rest = url
        .strip_prefix("gs://")
        .ok_or("expected gs://BUCKET/KEY")?;
    let (bucket, path) = rest.split_once('/').unwrap_or((rest, ""));
    let valid = (3..=222).contains(&bucket.len())
        && bucket
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-_.".contains(&b));
    if !valid {
        return Err(format!(
            "expected gs://BUCKET/KEY or gs://BUCKET/PREFIX/; {bucket:?} is not a bucket name \
             (3 to 222 lower-case letters, digits, '-', '_', '.')"
        ));
    }
    Ok((bucket, path))
}

/// Checks the form of a GCS URL (nothing is fetched): the reason if it is not one.
pub fn check_url(url: &str) -> std::result::Result<(), String> {
    parse(url).map(|_| ())
}

/// An error of an API request, told about the `gs://` URL the user gave.
fn about(url: &str, error: Error, what: &str) -> Error {
    let io = |kind, text: String| std::io::Error::new(kind, text);
    match error {
        Error::NotFound { source, .. } => Error::NotFound {
            url: url.to_owned(),
            source: io(source.kind(), format!("{what}: {source}")),
        },
        Error::AccessDenied { source, .. } => {
            // A refusal of the credentials found (not of the request) needs no hint.
            let text = source.to_string();
            let hint = if text.starts_with(NO_TOKEN) {
                String::new()
            } else {
                format!("; {CREDENTIALS_HINT}")
            };
            Error::AccessDenied {
                url: url.to_owned(),
                source: io(source.kind(), format!("{what}: {text}{hint}")),
            }
        }
        Error::Read { source, .. } => Error::Read {
            url: url.to_owned(),
            offset: 0,
            source: io(source.kind(), format!("{what}: {source}")),
        },
        other => other,
    }
}

/// A listed object: key, size, generation.
type Object = (String, u64, String);

/// An object resource of the API (`name`, `size`, `generation`: the
/// numbers are JSON strings).
fn object(json: &serde_json::Value) -> Option<Object> {
    let text = |name| json.get(name).and_then(|v| v.as_str());
    let generation = text("generation").filter(|g| g.bytes().all(|b| b.is_ascii_digit()))?;
    Some((
        text("name")?.to_owned(),
        text("size")?.parse().ok()?,
        generation.to_owned(),
    ))
}

/// Resolves `gs://` URLs against one endpoint.
pub struct Resolver<'a> {
    options: &'a S3Options,
    endpoint: String,
}

impl<'a> Resolver<'a> {
    /// A resolver with the timeouts and retries of `options`.
    pub fn new(options: &'a S3Options) -> Self {
        Resolver {
            options,
            endpoint: gcs_endpoint(),
        }
    }

    /// The objects `url` names, sorted by key, as `(https URL pinned to the
    /// generation, size)`. A prefix gives the objects `keep` takes; a key
    /// must exist. Nothing found is an error naming `url`.
    pub fn resolve(&self, url: &str, keep: fn(&str) -> bool) -> Result<Vec<(String, u64)>> {
        let (bucket, path) = parse(url).map_err(|reason| Error::Spec {
            spec: url.to_owned(),
            reason,
        })?;
        with_http_client(self.options, async |client| {
            let mut objects = if path.is_empty() || path.ends_with('/') {
                let listed = self.list(client, url, bucket, path).await?;
                let kept: Vec<Object> = listed
                    .into_iter()
                    .filter(|(key, ..)| !key.ends_with('/') && keep(key))
                    .collect();
                if kept.is_empty() {
                    return Err(Error::Spec {
                        spec: url.to_owned(),
                        reason: format!("no shard under the prefix {path:?} of bucket {bucket}"),
                    });
                }
                kept
            } else {
                vec![self.object(client, url, bucket, path).await?]
            };
            objects.sort();
            Ok(objects
                .into_iter()
                .map(|(key, size, generation)| {
                    let media = format!(
                        "{}/download/storage/v1/b/{bucket}/o/{}?alt=media&generation={generation}",
                        self.endpoint,
                        percent_encode(&key)
                    );
                    (media, size)
                })
                .collect())
        })
    }

    /// A JSON answer of the API.
    async fn get_json(
        &self,
        client: &HttpClient,
        url: &str,
        api: &str,
        what: &str,
    ) -> Result<serde_json::Value> {
        let (_, body) = client
            .get_small(api, MAX_ANSWER_BYTES)
            .await
            .map_err(|e| about(url, e, what))?;
        serde_json::from_slice(&body).map_err(|e| Error::Read {
            url: url.to_owned(),
            offset: 0,
            source: std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("{what}: the answer is not JSON: {e}"),
            ),
        })
    }

    /// Whether `bucket` exists (a refusal to say counts as yes).
    async fn bucket_exists(&self, client: &HttpClient, bucket: &str) -> bool {
        let api = format!("{}/storage/v1/b/{bucket}?fields=name", self.endpoint);
        !matches!(
            client.get_small(&api, MAX_ANSWER_BYTES).await,
            Err(Error::NotFound { .. })
        )
    }

    /// The object `key` (`GET /storage/v1/b/BUCKET/o/KEY`).
    async fn object(
        &self,
        client: &HttpClient,
        url: &str,
        bucket: &str,
        key: &str,
    ) -> Result<Object> {
        let api = format!(
            "{}/storage/v1/b/{bucket}/o/{}?fields=name,size,generation",
            self.endpoint,
            percent_encode(key)
        );
        let what = format!("object {key:?} of bucket {bucket}");
        match self.get_json(client, url, &api, &what).await {
            Ok(json) => object(&json).ok_or_else(|| invalid(url, &what)),
            Err(Error::NotFound { .. }) if !self.bucket_exists(client, bucket).await => {
                Err(no_bucket(url, bucket))
            }
            Err(error) => Err(error),
        }
    }

    /// The objects under `prefix` (every page of
    /// `GET /storage/v1/b/BUCKET/o?prefix=PREFIX`).
    async fn list(
        &self,
        client: &HttpClient,
        url: &str,
        bucket: &str,
        prefix: &str,
    ) -> Result<Vec<Object>> {
        let what = format!("listing {prefix:?} of bucket {bucket}");
        let mut objects = Vec::new();
        let mut token: Option<String> = None;
        for _ in 0..MAX_PAGES {
            let mut api = format!(
                "{}/storage/v1/b/{bucket}/o?prefix={}&fields=items(name,size,generation),\
                 nextPageToken",
                self.endpoint,
                percent_encode(prefix)
            );
            if let Some(token) = &token {
                api.push_str(&format!("&pageToken={}", percent_encode(token)));
            }
            let json = match self.get_json(client, url, &api, &what).await {
                Err(Error::NotFound { .. }) => return Err(no_bucket(url, bucket)),
                other => other?,
            };
            if let Some(items) = json.get("items") {
                let items = items.as_array().ok_or_else(|| invalid(url, &what))?;
                for item in items {
                    objects.push(object(item).ok_or_else(|| invalid(url, &what))?);
                }
            }
            match json.get("nextPageToken").and_then(|t| t.as_str()) {
                Some(next) if !next.is_empty() => {
                    if token.as_deref() == Some(next) {
                        return Err(Error::Read {
                            url: url.to_owned(),
                            offset: 0,
                            source: std::io::Error::other(format!(
                                "{what}: the same page was handed out twice"
                            )),
                        });
                    }
                    token = Some(next.to_owned());
                }
                _ => return Ok(objects),
            }
        }
        Err(Error::Read {
            url: url.to_owned(),
            offset: 0,
            source: std::io::Error::other(format!("{what}: more than {MAX_PAGES} pages")),
        })
    }
}

/// The error of a bucket that does not exist.
fn no_bucket(url: &str, bucket: &str) -> Error {
    Error::NotFound {
        url: url.to_owned(),
        source: std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!("the bucket {bucket:?} does not exist"),
        ),
    }
}

/// The error of an API answer that is not what the API gives.
fn invalid(url: &str, what: &str) -> Error {
    Error::Read {
        url: url.to_owned(),
        offset: 0,
        source: std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{what}: the answer is not an object listing of the GCS JSON API"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_parsed_and_bad_buckets_refused() {
        assert_eq!(
            parse("gs://my-bucket/a/b.tar"),
            Ok(("my-bucket", "a/b.tar"))
        );
        assert_eq!(parse("gs://my-bucket"), Ok(("my-bucket", "")));
        assert_eq!(parse("gs://b.x/p/"), Ok(("b.x", "p/")));
        for bad in ["gs://", "gs://Upper/x", "gs://ab/x", "gs://a b/x"] {
            assert!(parse(bad).unwrap_err().contains("bucket name"), "{bad}");
        }
        assert_eq!(percent_encode("a/b c.tar"), "a%2Fb%20c.tar");
    }

    #[test]
    fn object_resources_are_read_with_their_generation() {
        let json = serde_json::json!({"name": "a.tar", "size": "12", "generation": "17"});
        assert_eq!(object(&json), Some(("a.tar".into(), 12, "17".into())));
        let bad = serde_json::json!({"name": "a.tar", "size": 12, "generation": "17"});
        assert_eq!(object(&bad), None);
    }
}
