//! Shards at `http://` and `https://` URLs, through hyper's client over
//! rustls: streaming GETs (or parallel ranged GETs for large resources,
//! the read-ahead's part queue) with the retries, backoff and timeouts of S3 reads.
//! A broken body is resumed with a `Range` request pinned to the first
//! answer's validator (`If-Match` with a strong ETag, else
//! `If-Unmodified-Since` with its Last-Modified date), so a resource that
//! changed is an error, never a mix of two versions. A resource with
//! neither is read by one GET (its parts take their bytes from that one
//! body) and never resumed: a body cut short is an error. The first GET of
//! a resource asks for the whole unit unless the last first answer from its
//! origin had a validator (then for the first part, the later parts pinned
//! to it). Every request asks for the resource's own bytes
//! (`Accept-Encoding: identity`); an answer in another content coding is an
//! error. A server that ignores `Range` (a whole `200` to a resume) is read
//! past the bytes already delivered; every answer must carry the bytes its
//! `Content-Length` announces. Redirects are followed (at most
//! [`MAX_REDIRECTS`]); headers from the `http_headers` option go to the
//! shard's own origin only, and the [`OriginCredentials`] the client is
//! given (the Hugging Face token, a Google Cloud Storage access token) to
//! their endpoint's origin only. No header value appears in an error.

mod resource;

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use super::ranged::{check_response, error_chain, Failure, Retries};
use super::runtime::on_io_runtime;
use crate::config::Transport;
use crate::error::Error;

/// The most redirects one request follows.
pub const MAX_REDIRECTS: usize = 10;

/// `scheme://host:port` of a URL, lower-cased, with the default port.
pub(crate) type Origin = (String, String, Option<u16>);

/// The origin of `url`.
pub(crate) fn origin(url: &url::Url) -> Origin {
    (
        url.scheme().to_owned(),
        url.host_str().unwrap_or("").to_ascii_lowercase(),
        url.port_or_known_default(),
    )
}

/// What the `Authorization` header of a request for `url` is, asked of
/// [`OriginCredentials::authorization`]: `None` when `url` takes none, or
/// why the credentials cannot be had (an access-denied error).
pub type AuthorizationFuture<'a> =
    Pin<Box<dyn Future<Output = Result<Option<HeaderValue>, String>> + Send + 'a>>;

/// Credentials the client sends to the origin of one endpoint, as its
/// `Authorization` header, unless the `http_headers` option gives one. They
/// are asked for at each request there, so a provider may refresh a token
/// that expires.
pub trait OriginCredentials: Send + Sync {
    /// The endpoint whose origin takes them.
    fn endpoint(&self) -> &url::Url;
    /// The header for a request for `url`, at the endpoint's origin.
    fn authorization<'a>(&'a self, url: &'a url::Url) -> AuthorizationFuture<'a>;
}

/// A client for one stream's HTTP(S) requests, made in the process that
/// reads (after fork).
pub struct HttpClient {
    client: Client<HttpsConnector<HttpConnector>, Empty<Bytes>>,
    transport: Transport,
    /// The `http_headers` option, parsed.
    headers: Vec<(HeaderName, HeaderValue)>,
    /// The credentials it sends, each to its endpoint's origin.
    credentials: Vec<Box<dyn OriginCredentials>>,
    /// Origins whose last first answer carried a validator (ETag or
    /// Last-Modified): the first GET of a resource there asks for its first
    /// part only; elsewhere for the whole unit, read as one stream.
    pinnable: std::sync::Mutex<std::collections::HashSet<Origin>>,
}

/// An answer to a request: status, headers and body.
struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: Incoming,
}

impl HttpClient {
    /// A client with `transport`'s timeouts, retries and headers, sending
    /// `credentials` to their endpoints. Fails only when no TLS setup can
    /// be made.
    pub fn new(
        transport: &Transport,
        credentials: Vec<Box<dyn OriginCredentials>>,
    ) -> Result<Self, String> {
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_connect_timeout(Some(transport.connect_timeout));
        http.set_nodelay(true);
        let tls = super::tls::connector_builder()?;
        let https = tls
            .https_or_http()
            .enable_http1()
            .enable_http2()
            .wrap_connector(http);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .build(https);
        let mut headers = Vec::with_capacity(transport.http_headers.0.len());
        for (name, value) in &transport.http_headers.0 {
            let name = HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| format!("invalid header name {name:?}"))?;
            let mut value = HeaderValue::from_str(value)
                .map_err(|_| format!("invalid value of header {name}"))?;
            value.set_sensitive(true);
            headers.push((name, value));
        }
        Ok(HttpClient {
            client,
            transport: transport.clone(),
            headers,
            credentials,
            pinnable: std::sync::Mutex::default(),
        })
    }

    /// Sends one request for `url` (at byte `offset`, for errors) with
    /// `extra` headers, following redirects. The `http_headers` go to the
    /// origin of `url` only, each credentials to their endpoint's only.
    async fn send(
        &self,
        method: &Method,
        url: &str,
        offset: u64,
        extra: &[(HeaderName, String)],
    ) -> Result<Answer, Failure> {
        let fatal = |reason: String| {
            Failure::Fatal(Error::Read {
                url: url.to_owned(),
                offset,
                source: std::io::Error::other(reason),
            })
        };
        let first = url::Url::parse(url).map_err(|e| fatal(format!("not a valid URL: {e}")))?;
        let mut current = first.clone();
        for _ in 0..=MAX_REDIRECTS {
            let mut request = Request::builder()
                .method(method.clone())
                .uri(current.as_str())
                .header(
                    header::USER_AGENT,
                    concat!("shardstream/", env!("CARGO_PKG_VERSION")),
                )
                // The resource's own bytes, never a compressed form of them.
                .header(header::ACCEPT_ENCODING, "identity");
            for (name, value) in extra {
                request = request.header(name, value.as_str());
            }
            let mut authorized = false;
            if origin(&current) == origin(&first) {
                for (name, value) in &self.headers {
                    authorized |= name == header::AUTHORIZATION;
                    request = request.header(name, value.clone());
                }
            }
            for credentials in &self.credentials {
                if authorized || origin(&current) != origin(credentials.endpoint()) {
                    continue;
                }
                match credentials.authorization(&current).await {
                    Ok(Some(value)) => {
                        request = request.header(header::AUTHORIZATION, value);
                        authorized = true;
                    }
                    Ok(None) => {}
                    Err(reason) => {
                        return Err(Failure::Fatal(Error::AccessDenied {
                            url: url.to_owned(),
                            source: std::io::Error::new(
                                std::io::ErrorKind::PermissionDenied,
                                reason,
                            ),
                        }))
                    }
                }
            }
            let request = request
                .body(Empty::new())
                .map_err(|e| fatal(format!("the request cannot be made: {e}")))?;
            let timeout = self.transport.first_byte_timeout;
            let response = match tokio::time::timeout(timeout, self.client.request(request)).await {
                Err(_) => return Err(Failure::Retry(format!("no response within {timeout:?}"))),
                Ok(Err(e)) => {
                    return Err(Failure::Retry(format!(
                        "connection failed: {}",
                        error_chain(&e)
                    )))
                }
                Ok(Ok(response)) => response,
            };
            let status = response.status();
            let location = response
                .headers()
                .get(header::LOCATION)
                .and_then(|l| l.to_str().ok());
            match (status.is_redirection(), location) {
                (true, Some(location)) if status != StatusCode::NOT_MODIFIED => {
                    // The target is never named in an error: a CDN's may be signed.
                    current = current
                        .join(location)
                        .map_err(|_| fatal(format!("HTTP {status} to a URL that is not valid")))?;
                    if !matches!(current.scheme(), "http" | "https") {
                        return Err(fatal(format!(
                            "HTTP {status} to a URL that is not http:// or https://"
                        )));
                    }
                }
                _ => {
                    let (parts, body) = response.into_parts();
                    return Ok(Answer {
                        status,
                        headers: parts.headers,
                        body,
                    });
                }
            }
        }
        Err(fatal(format!("more than {MAX_REDIRECTS} redirects")))
    }

    /// The whole body of a small resource (an API answer), at most `limit`
    /// bytes, with its headers: retried like reads; other statuses than
    /// 200 are errors naming `url`.
    pub async fn get_small(&self, url: &str, limit: usize) -> Result<(HeaderMap, Vec<u8>), Error> {
        let mut retries = Retries::new(&self.transport, url, 0);
        loop {
            let reason = match self.send(&Method::GET, url, 0, &[]).await {
                Ok(answer) if answer.status == StatusCode::OK => {
                    if let Some(coding) = coding(&answer.headers) {
                        return Err(coded(url, 0, &coding));
                    }
                    match read_small(answer.body, limit, self.transport.idle_timeout).await {
                        Ok(body) => return Ok((answer.headers, body)),
                        Err(Ok(reason)) => reason,
                        Err(Err(reason)) => {
                            return Err(Error::Read {
                                url: url.to_owned(),
                                offset: 0,
                                source: std::io::Error::other(reason),
                            })
                        }
                    }
                }
                other => retry_reason(url, other)?,
            };
            retries.wait(url, 0, reason).await?;
        }
    }

    /// The size and ETag of a resource (a GET of its first byte).
    pub async fn describe(&self, url: &str) -> Result<(u64, Option<String>), Error> {
        let (size, etag, _) = self.validators(url).await?;
        Ok((size, etag))
    }

    /// The size, ETag and Last-Modified date of a resource (a GET of its
    /// first byte).
    pub async fn validators(
        &self,
        url: &str,
    ) -> Result<(u64, Option<String>, Option<String>), Error> {
        let mut retries = Retries::new(&self.transport, url, 0);
        let range = vec![(header::RANGE, "bytes=0-0".to_owned())];
        loop {
            let reason = match self.send(&Method::GET, url, 0, &range).await {
                Ok(answer) if matches!(answer.status.as_u16(), 200 | 206) => {
                    if let Some(coding) = coding(&answer.headers) {
                        return Err(coded(url, 0, &coding));
                    }
                    let text = |name| answer.headers.get(name).and_then(|v| v.to_str().ok());
                    let length = text(header::CONTENT_LENGTH).and_then(|l| l.parse().ok());
                    match check_response(0, Some(1), text(header::CONTENT_RANGE), length) {
                        Ok(served) => {
                            let etag = text(header::ETAG).map(str::to_owned);
                            let last_modified = text(header::LAST_MODIFIED).map(str::to_owned);
                            return Ok((served.size, etag, last_modified));
                        }
                        Err(reason) => reason,
                    }
                }
                // An empty resource has no first byte.
                Ok(answer)
                    if answer.status == StatusCode::RANGE_NOT_SATISFIABLE
                        && announces_empty(&answer.headers) =>
                {
                    return Ok((0, None, None))
                }
                other => retry_reason(url, other)?,
            };
            retries.wait(url, 0, reason).await?;
        }
    }
}

/// Reads a body of at most `limit` bytes; `Err(Ok(reason))` for a failure
/// worth another attempt, `Err(Err(reason))` for one that is final.
async fn read_small(
    mut body: Incoming,
    limit: usize,
    idle: Duration,
) -> Result<Vec<u8>, Result<String, String>> {
    let mut out = Vec::new();
    loop {
        match tokio::time::timeout(idle, body.frame()).await {
            Err(_) => return Err(Ok(format!("no body bytes for {idle:?}"))),
            Ok(None) => return Ok(out),
            Ok(Some(Err(e))) => return Err(Ok(format!("the body broke: {}", error_chain(&e)))),
            Ok(Some(Ok(frame))) => {
                if let Ok(data) = frame.into_data() {
                    if out.len() + data.len() > limit {
                        return Err(Err(format!("the answer is longer than {limit} bytes")));
                    }
                    out.extend_from_slice(&data);
                }
            }
        }
    }
}

/// Why a small request of `url` is worth another attempt, given an answer
/// that is not the one wanted (or the request's failure); the error when it
/// is not.
fn retry_reason(url: &str, sent: Result<Answer, Failure>) -> Result<String, Error> {
    let failure = match sent {
        Ok(answer) => status_failure(url, 0, answer.status),
        Err(failure) => failure,
    };
    match failure {
        Failure::Retry(reason) => Ok(reason),
        Failure::Fatal(error) => Err(error),
    }
}

/// What an answer's status means for a read of `url` at `offset`.
fn status_failure(url: &str, offset: u64, status: StatusCode) -> Failure {
    let text = match status.canonical_reason() {
        Some(reason) => format!("HTTP {} {reason}", status.as_u16()),
        None => format!("HTTP {}", status.as_u16()),
    };
    let io = |kind: std::io::ErrorKind, text: String| std::io::Error::new(kind, text);
    match status.as_u16() {
        408 | 425 | 429 | 500 | 502 | 503 | 504 => Failure::Retry(text),
        404 | 410 => Failure::Fatal(Error::NotFound {
            url: url.to_owned(),
            source: io(std::io::ErrorKind::NotFound, text),
        }),
        401 | 403 => Failure::Fatal(Error::AccessDenied {
            url: url.to_owned(),
            source: io(std::io::ErrorKind::PermissionDenied, text),
        }),
        412 => Failure::Fatal(Error::Changed {
            url: url.to_owned(),
            offset,
        }),
        416 => Failure::Fatal(Error::Read {
            url: url.to_owned(),
            offset,
            source: io(
                std::io::ErrorKind::UnexpectedEof,
                format!("{text}: the resource holds no bytes from byte offset {offset} (it is shorter than announced)"),
            ),
        }),
        _ => Failure::Fatal(Error::Read {
            url: url.to_owned(),
            offset,
            source: io(std::io::ErrorKind::Other, text),
        }),
    }
}

/// Whether a `416` to a range from the first byte says the resource is
/// empty: its `Content-Range` is `bytes */0`, or absent (as some servers
/// answer for an empty file). `bytes */N` of a larger size is no empty
/// resource, and the `416` an error.
fn announces_empty(headers: &HeaderMap) -> bool {
    match headers.get(header::CONTENT_RANGE) {
        None => true,
        Some(value) => value
            .to_str()
            .ok()
            .and_then(|text| text.trim().strip_prefix("bytes */"))
            .is_some_and(|size| size.trim() == "0"),
    }
}

/// The content coding of an answer, unless it is the identity (its body
/// is then not the resource's own bytes), cut to a few printable characters.
fn coding(headers: &HeaderMap) -> Option<String> {
    let value = headers.get(header::CONTENT_ENCODING)?;
    let text = String::from_utf8_lossy(value.as_bytes());
    let text = text.trim();
    if text.is_empty() || text.eq_ignore_ascii_case("identity") {
        return None;
    }
    let shown: String = text
        .chars()
        .map(|c| {
            if c.is_ascii_graphic() || c == ' ' {
                c
            } else {
                '?'
            }
        })
        .take(40)
        .collect();
    Some(shown)
}

/// The error of an answer of `url` (at `offset`) in the content coding `coding`.
fn coded(url: &str, offset: u64, coding: &str) -> Error {
    Error::Read {
        url: url.to_owned(),
        offset,
        source: std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!(
                "the server answered with Content-Encoding {coding:?} although only the \
                 resource's own bytes were accepted (Accept-Encoding: identity)"
            ),
        ),
    }
}

/// Whether an answer carries a validator (an ETag or a Last-Modified date).
fn has_validator(headers: &HeaderMap) -> bool {
    headers.contains_key(header::ETAG) || headers.contains_key(header::LAST_MODIFIED)
}

/// Whether an ETag is strong (a weak one cannot pin a range).
fn is_strong(etag: &str) -> bool {
    !etag.starts_with("W/")
}

/// Runs `work` with a fresh HTTP client sending `credentials`
/// ([`on_io_runtime`]).
pub fn with_http_client<T>(
    transport: &Transport,
    credentials: Vec<Box<dyn OriginCredentials>>,
    work: impl AsyncFnOnce(&HttpClient) -> Result<T, Error>,
) -> Result<T, Error> {
    transport.validate()?;
    on_io_runtime(async {
        let client = HttpClient::new(transport, credentials).map_err(Error::Stopped)?;
        work(&client).await
    })
}

#[cfg(test)]
mod tests {
    use super::resource::range_headers;
    use super::*;
    use crate::store::ranged::Pinned;

    #[test]
    fn resumes_are_pinned_to_a_strong_etag_else_the_date() {
        let pinned = Pinned {
            etag: Some("\"abc\"".into()),
            last_modified: Some("Tue, 24 Nov 2026 10:00:00 GMT".into()),
            ..Pinned::default()
        };
        let headers = range_headers(100, Some(200), &pinned);
        assert_eq!(
            headers,
            vec![
                (header::RANGE, "bytes=100-199".to_owned()),
                (header::IF_MATCH, "\"abc\"".to_owned())
            ]
        );
        let weak = Pinned {
            etag: Some("W/\"abc\"".into()),
            ..pinned.clone()
        };
        assert_eq!(
            range_headers(5, None, &weak)[1].0,
            header::IF_UNMODIFIED_SINCE
        );
        assert!(range_headers(0, None, &Pinned::default()).is_empty());
    }

    #[test]
    fn only_the_identity_coding_is_the_resources_own_bytes() {
        let coded_as = |value: &str| {
            let mut headers = HeaderMap::new();
            headers.insert(
                header::CONTENT_ENCODING,
                HeaderValue::from_str(value).unwrap(),
            );
            coding(&headers)
        };
        assert_eq!(coding(&HeaderMap::new()), None);
        assert_eq!(coded_as("identity"), None);
        assert_eq!(coded_as(" Identity "), None);
        assert_eq!(coded_as("gzip").as_deref(), Some("gzip"));
        assert_eq!(coded_as("br, gzip").as_deref(), Some("br, gzip"));
        assert_eq!(coded_as(&"x".repeat(100)).map(|c| c.len()), Some(40));
        let error = coded("https://h/x.json", 0, "gzip").to_string();
        assert!(
            error.contains("https://h/x.json") && error.contains("gzip"),
            "{error}"
        );
    }

    #[test]
    fn statuses_are_retried_or_final_by_meaning() {
        let url = "https://h/x.tar";
        for retried in [429, 500, 502, 503, 504, 408] {
            let status = StatusCode::from_u16(retried).unwrap();
            assert!(matches!(status_failure(url, 0, status), Failure::Retry(_)));
        }
        let final_error = |code| match status_failure(url, 7, StatusCode::from_u16(code).unwrap()) {
            Failure::Fatal(error) => error,
            Failure::Retry(reason) => panic!("retried: {reason}"),
        };
        assert!(matches!(final_error(404), Error::NotFound { .. }));
        assert!(matches!(final_error(401), Error::AccessDenied { .. }));
        assert!(matches!(final_error(403), Error::AccessDenied { .. }));
        assert!(matches!(final_error(412), Error::Changed { offset: 7, .. }));
        assert_eq!(
            final_error(404).to_string(),
            "https://h/x.tar: shard not found (HTTP 404 Not Found)"
        );
    }
}
