//! Objects in Google Cloud Storage: `gs://BUCKET/KEY` (one object) and
//! `gs://BUCKET/PREFIX/` (every object under the prefix, listed page by
//! page) are resolved once, in the process that builds the dataset,
//! through the GCS JSON API, with their sizes and generations. Each object
//! becomes an `https://` shard at the API's media download URL pinned to
//! the generation the resolution saw, read by the HTTP source (ranged GETs,
//! retries, resumes), which sends the access token of the Application
//! Default Credentials ([`auth`]) to the GCS endpoint
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

pub mod auth;

use super::http::{with_http_client, HttpClient};
use crate::config::Transport;
use crate::error::{Error, Result};
use auth::{gcs_endpoint, percent_encode, NO_TOKEN};

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

/// An object resource of the API (`GET /storage/v1/b/BUCKET/o/KEY`, or an
/// item of a listing), with the fields asked for: the numbers come as
/// JSON strings of decimal digits, as GCS writes 64-bit integers.
#[derive(serde::Deserialize)]
struct ObjectResource {
    /// The object's key.
    name: String,
    /// Its size in bytes.
    #[serde(deserialize_with = "decimal_u64")]
    size: u64,
    /// Its generation (kept as the digits given, for the media URL).
    #[serde(deserialize_with = "decimal")]
    generation: String,
}

impl From<ObjectResource> for Object {
    fn from(resource: ObjectResource) -> Object {
        (resource.name, resource.size, resource.generation)
    }
}

/// A page of an object listing (`GET /storage/v1/b/BUCKET/o?prefix=...`):
/// no `items` when nothing is listed, and a `nextPageToken` while pages
/// remain.
#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct ListPage {
    /// The objects of this page.
    #[serde(default)]
    items: Vec<ObjectResource>,
    /// The token of the next page, if any.
    next_page_token: Option<String>,
}

/// A JSON string of decimal digits (how GCS writes its 64-bit integers).
fn decimal<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> std::result::Result<String, D::Error> {
    deserializer.deserialize_str(Decimal)
}

/// The visitor of [`decimal`]: a JSON number, or a string of anything
/// but digits, is refused as not "a string of decimal digits".
struct Decimal;

impl serde::de::Visitor<'_> for Decimal {
    type Value = String;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a string of decimal digits")
    }

    fn visit_str<E: serde::de::Error>(self, text: &str) -> std::result::Result<String, E> {
        if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
            return Err(E::invalid_value(serde::de::Unexpected::Str(text), &self));
        }
        Ok(text.to_owned())
    }
}

/// A JSON string of decimal digits, as a `u64`.
fn decimal_u64<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> std::result::Result<u64, D::Error> {
    let text = decimal(deserializer)?;
    text.parse().map_err(|_| {
        serde::de::Error::invalid_value(serde::de::Unexpected::Str(&text), &"a 64-bit size")
    })
}

/// Resolves `gs://` URLs against one endpoint.
pub struct Resolver<'a> {
    transport: &'a Transport,
    endpoint: String,
}

impl<'a> Resolver<'a> {
    /// A resolver with the timeouts and retries of `transport`.
    pub fn new(transport: &'a Transport) -> Self {
        Resolver {
            transport,
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
        with_http_client(
            self.transport,
            auth::credentials().into_iter().collect(),
            async |client| {
                let mut objects = if path.is_empty() || path.ends_with('/') {
                    let listed = self.list(client, url, bucket, path).await?;
                    let kept: Vec<Object> = listed
                        .into_iter()
                        .filter(|(key, ..)| !key.ends_with('/') && keep(key))
                        .collect();
                    if kept.is_empty() {
                        return Err(Error::Spec {
                            spec: url.to_owned(),
                            reason: format!(
                                "no shard under the prefix {path:?} of bucket {bucket}"
                            ),
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
            },
        )
    }

    /// A JSON answer of the API, as a `T`: not JSON, or JSON of another
    /// shape, is an error naming `url`.
    async fn get_json<T: serde::de::DeserializeOwned>(
        &self,
        client: &HttpClient,
        url: &str,
        api: &str,
        what: &str,
    ) -> Result<T> {
        let (_, body) = client
            .get_small(api, MAX_ANSWER_BYTES)
            .await
            .map_err(|e| about(url, e, what))?;
        serde_json::from_slice(&body).map_err(|e| {
            let reason = if e.is_data() {
                format!("{what}: the answer is not an object listing of the GCS JSON API: {e}")
            } else {
                format!("{what}: the answer is not JSON: {e}")
            };
            Error::Read {
                url: url.to_owned(),
                offset: 0,
                source: std::io::Error::new(std::io::ErrorKind::InvalidData, reason),
            }
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
        match self
            .get_json::<ObjectResource>(client, url, &api, &what)
            .await
        {
            Ok(resource) => Ok(resource.into()),
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
        let mut tokens = std::collections::HashSet::new();
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
            let page: ListPage = match self.get_json(client, url, &api, &what).await {
                Err(Error::NotFound { .. }) => return Err(no_bucket(url, bucket)),
                other => other?,
            };
            objects.extend(page.items.into_iter().map(Object::from));
            match page.next_page_token {
                Some(next) if !next.is_empty() => {
                    if !tokens.insert(next.clone()) {
                        return Err(Error::Read {
                            url: url.to_owned(),
                            offset: 0,
                            source: std::io::Error::other(format!(
                                "{what}: the same page was handed out twice"
                            )),
                        });
                    }
                    token = Some(next);
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
        let resource: ObjectResource = serde_json::from_str(
            r#"{"kind": "storage#object", "name": "a.tar", "size": "12", "generation": "17",
                "metageneration": "1", "contentType": "application/x-tar"}"#,
        )
        .unwrap();
        assert_eq!(Object::from(resource), ("a.tar".into(), 12, "17".into()));
        for bad in [
            r#"{"name": "a.tar", "size": 12, "generation": "17"}"#,
            r#"{"name": "a.tar", "size": "-1", "generation": "17"}"#,
            r#"{"name": "a.tar", "size": "99999999999999999999", "generation": "17"}"#,
            r#"{"name": "a.tar", "size": "12", "generation": "x7"}"#,
            r#"{"name": "a.tar", "size": "12", "generation": ""}"#,
            r#"{"size": "12", "generation": "17"}"#,
        ] {
            let Err(error) = serde_json::from_str::<ObjectResource>(bad) else {
                panic!("accepted {bad}");
            };
            assert!(error.is_data(), "{bad}: {error}");
        }
        let number = r#"{"name": "a.tar", "size": 12, "generation": "17"}"#;
        let error = serde_json::from_str::<ObjectResource>(number).err();
        assert!(
            error.is_some_and(|e| e.to_string().contains("a string of decimal digits")),
            "{number}"
        );
    }

    #[test]
    fn listing_pages_are_read_with_or_without_items_and_token() {
        let page: ListPage = serde_json::from_str(
            r#"{"kind": "storage#objects", "nextPageToken": "CgVhLnRhcg==",
                "items": [{"name": "p/a.tar", "size": "3", "generation": "5"},
                          {"name": "p/b.tar", "size": "0", "generation": "6"}]}"#,
        )
        .unwrap();
        let objects: Vec<Object> = page.items.into_iter().map(Object::from).collect();
        assert_eq!(
            objects,
            [
                ("p/a.tar".into(), 3, "5".into()),
                ("p/b.tar".into(), 0, "6".into())
            ]
        );
        assert_eq!(page.next_page_token.as_deref(), Some("CgVhLnRhcg=="));
        // The last page has no token; an empty listing has no items either.
        let last: ListPage = serde_json::from_str(r#"{"kind": "storage#objects"}"#).unwrap();
        assert!(last.items.is_empty() && last.next_page_token.is_none());
        let items_not_a_list = serde_json::from_str::<ListPage>(r#"{"items": {"name": "a"}}"#);
        assert!(items_not_a_list.err().is_some_and(|e| e.is_data()));
    }
}
