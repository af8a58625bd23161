//! Objects on S3 (and S3-compatible stores) through `aws-sdk-s3`: one
//! streaming GET per unit (or parallel ranged GETs for large ones), its own
//! retries with exponential backoff and full jitter, a per-chunk idle
//! timeout, and mid-body resume with a Range request pinned to the first
//! ETag (If-Match), so an object replaced during a read is an error, never a
//! mix of two versions. Every answer is checked to hold exactly the bytes
//! asked for (a resume or a part answered with the whole object, or from
//! another offset, is refused), and every object to arrive whole.
//! Credentials that cannot be loaded, or that the store rejects, are final:
//! not retried, said in a sentence that tells how to provide them.

mod auth;
mod object;

use std::sync::OnceLock;

use aws_sdk_s3::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_s3::primitives::ByteStream;

use super::ranged::{cause_chain, error_chain, Failure, Retries};
use crate::config::StoreOptions;
use crate::error::Error;
use auth::{credentials_problem, CREDENTIALS_HINT, REJECTED_CREDENTIALS};

/// The most pages one listing reads (1,000 keys each): past it, an error.
const MAX_LIST_PAGES: usize = 100_000;

/// A client for one stream, made in the process that reads (after fork).
pub struct S3Client {
    client: aws_sdk_s3::Client,
    options: StoreOptions,
    /// Why credentials could not be used, once a request found out: every
    /// later request fails at once with it, rather than look for them in
    /// every source again.
    credentials_failure: OnceLock<String>,
}

impl S3Client {
    /// Builds a client from `options` and the default credential chain
    /// (environment, shared config and credentials files, SSO, web identity,
    /// IMDS and ECS roles).
    pub async fn new(options: &StoreOptions) -> Self {
        let mut loader = aws_config::defaults(aws_config::BehaviorVersion::latest())
            .retry_config(aws_config::retry::RetryConfig::disabled())
            .timeout_config(
                aws_config::timeout::TimeoutConfig::builder()
                    .connect_timeout(options.transport.connect_timeout)
                    .build(),
            );
        if let Some(region) = &options.region {
            loader = loader.region(aws_config::Region::new(region.clone()));
        }
        if let Some(url) = &options.endpoint_url {
            loader = loader.endpoint_url(url.clone());
        }
        if let Some(profile) = &options.profile {
            loader = loader.profile_name(profile.clone());
        }
        if options.unsigned {
            loader = loader.no_credentials();
        }
        let shared = loader.load().await;
        let mut config =
            aws_sdk_s3::config::Builder::from(&shared).force_path_style(options.path_style);
        if shared.region().is_none() {
            config = config.region(aws_config::Region::new("us-east-1"));
        }
        S3Client {
            client: aws_sdk_s3::Client::from_conf(config.build()),
            options: options.clone(),
            credentials_failure: OnceLock::new(),
        }
    }

    /// Lists the objects under `prefix` whose keys `keep` accepts, sorted
    /// by key, with their sizes and ETags (every page of ListObjectsV2).
    /// An answer that cannot be followed to its end (a page marked
    /// truncated without a token to go on, or the other way round; a token
    /// handed out twice; an object without its size; more than
    /// [`MAX_LIST_PAGES`] pages) is an error naming the listing, never a
    /// shorter list.
    pub async fn list(
        &self,
        url: &str,
        bucket: &str,
        prefix: &str,
        keep: fn(&str) -> bool,
    ) -> Result<Vec<(String, u64, Option<String>)>, Error> {
        let what = format!("listing {prefix:?} of bucket {bucket}");
        let failed = |reason: String| Error::Read {
            url: url.to_owned(),
            offset: 0,
            source: std::io::Error::other(format!("{what}: {reason}")),
        };
        let mut objects = Vec::new();
        let mut token: Option<String> = None;
        let mut tokens = std::collections::HashSet::new();
        for _ in 0..MAX_LIST_PAGES {
            let request = self
                .client
                .list_objects_v2()
                .bucket(bucket)
                .prefix(prefix)
                .set_continuation_token(token.take());
            let page = self
                .send_with_retries(url, "listing", || request.clone().send())
                .await?;
            for object in page.contents() {
                if let Some(key) = object.key().filter(|k| keep(k)) {
                    let size = object
                        .size()
                        .and_then(|size| u64::try_from(size).ok())
                        .ok_or_else(|| {
                            failed(format!("the answer gives no size for the object {key:?}"))
                        })?;
                    objects.push((key.to_owned(), size, object.e_tag().map(str::to_owned)));
                }
            }
            let truncated = page.is_truncated().unwrap_or(false);
            match page.next_continuation_token().filter(|t| !t.is_empty()) {
                None if !truncated => {
                    objects.sort();
                    return Ok(objects);
                }
                Some(next) if truncated => {
                    if !tokens.insert(next.to_owned()) {
                        return Err(failed(
                            "the same continuation token was handed out twice".into(),
                        ));
                    }
                    token = Some(next.to_owned());
                }
                Some(_) => {
                    return Err(failed(
                        "a page not marked truncated gives a continuation token".into(),
                    ))
                }
                None => {
                    return Err(failed(
                        "a page marked truncated gives no continuation token".into(),
                    ))
                }
            }
        }
        Err(failed(format!("more than {MAX_LIST_PAGES} pages")))
    }

    /// The size and ETag of one object (HEAD).
    pub async fn head(
        &self,
        url: &str,
        bucket: &str,
        key: &str,
    ) -> Result<(u64, Option<String>), Error> {
        let request = self.client.head_object().bucket(bucket).key(key);
        let output = self
            .send_with_retries(url, "HEAD", || request.clone().send())
            .await?;
        let size = output
            .content_length()
            .and_then(|size| u64::try_from(size).ok())
            .ok_or_else(|| Error::Read {
                url: url.to_owned(),
                offset: 0,
                source: std::io::Error::other("the HEAD answer gives no Content-Length"),
            })?;
        Ok((size, output.e_tag().map(str::to_owned)))
    }

    /// Writes the small object `bytes` (a manifest) in one request.
    pub async fn put_small(
        &self,
        url: &str,
        bucket: &str,
        key: &str,
        bytes: Vec<u8>,
    ) -> Result<(), Error> {
        let body = bytes::Bytes::from(bytes);
        self.send_with_retries(url, "PUT", || {
            self.client
                .put_object()
                .bucket(bucket)
                .key(key)
                .body(ByteStream::from(body.clone()))
                .send()
        })
        .await?;
        Ok(())
    }

    /// The whole of a small object (a manifest), at most `limit` bytes.
    pub async fn get_small(
        &self,
        url: &str,
        bucket: &str,
        key: &str,
        limit: usize,
    ) -> Result<Vec<u8>, Error> {
        let request = self.client.get_object().bucket(bucket).key(key);
        let output = self
            .send_with_retries(url, "GET", || request.clone().send())
            .await?;
        let too_long = || Error::Read {
            url: url.to_owned(),
            offset: 0,
            source: std::io::Error::other(format!("the object is longer than {limit} bytes")),
        };
        if output.content_length().unwrap_or(0) as u64 > limit as u64 {
            return Err(too_long());
        }
        let broken = |offset: usize, reason: String| Error::Read {
            url: url.to_owned(),
            offset: offset as u64,
            source: std::io::Error::other(reason),
        };
        let (mut body, mut out) = (output.body, Vec::new());
        loop {
            // Each piece within the idle timeout, however long the whole.
            match tokio::time::timeout(self.options.transport.idle_timeout, body.next()).await {
                Err(_) => {
                    let idle = self.options.transport.idle_timeout;
                    return Err(broken(out.len(), format!("no body bytes for {idle:?}")));
                }
                Ok(None) => return Ok(out),
                Ok(Some(Err(e))) => return Err(broken(out.len(), error_chain(&e))),
                Ok(Some(Ok(piece))) if out.len() + piece.len() > limit => return Err(too_long()),
                Ok(Some(Ok(piece))) => out.extend_from_slice(&piece),
            }
        }
    }

    /// Classifies a failed request of `url` at `offset`, remembering
    /// credentials that cannot be used.
    fn classify<E>(
        &self,
        url: &str,
        offset: u64,
        error: &SdkError<E, aws_sdk_s3::config::http::HttpResponse>,
    ) -> Failure
    where
        E: ProvideErrorMetadata + std::error::Error + 'static,
    {
        let failure = classify(url, offset, error);
        if let Failure::Fatal(Error::Credentials { reason, .. }) = &failure {
            let _ = self.credentials_failure.set(reason.clone());
        }
        failure
    }

    /// The credentials failure an earlier request met, as an error of `url`.
    fn known_credentials_failure(&self, url: &str) -> Option<Error> {
        self.credentials_failure
            .get()
            .map(|reason| Error::Credentials {
                url: url.to_owned(),
                reason: reason.clone(),
            })
    }

    /// The SDK client, for requests sent through
    /// [`S3Client::send_with_retries`].
    pub(crate) fn sdk(&self) -> &aws_sdk_s3::Client {
        &self.client
    }

    /// Sends a request (a listing, a HEAD, an upload) with the same bounded
    /// retries and first-byte timeout as object reads.
    pub(crate) async fn send_with_retries<T, E, F, Fut>(
        &self,
        url: &str,
        what: &str,
        mut send: F,
    ) -> Result<T, Error>
    where
        E: ProvideErrorMetadata + std::error::Error + 'static,
        F: FnMut() -> Fut,
        Fut: std::future::Future<
            Output = Result<T, SdkError<E, aws_sdk_s3::config::http::HttpResponse>>,
        >,
    {
        let mut retries = Retries::new(&self.options.transport, url, 0);
        loop {
            if let Some(error) = self.known_credentials_failure(url) {
                return Err(error);
            }
            let result =
                match tokio::time::timeout(self.options.transport.first_byte_timeout, send()).await
                {
                    Ok(result) => result,
                    Err(_) => Err(SdkError::timeout_error(format!(
                        "no response within {:?}",
                        self.options.transport.first_byte_timeout
                    ))),
                };
            let reason = match result {
                Ok(output) => return Ok(output),
                Err(error) => match self.classify(url, 0, &error) {
                    Failure::Fatal(error) => return Err(error),
                    Failure::Retry(reason) => format!("{what} failed: {reason}"),
                },
            };
            retries.wait(url, 0, reason).await?;
        }
    }
}

/// Classifies an SDK error of a request for `url` at `offset`.
fn classify<E>(
    url: &str,
    offset: u64,
    error: &SdkError<E, aws_sdk_s3::config::http::HttpResponse>,
) -> Failure
where
    E: ProvideErrorMetadata + std::error::Error + 'static,
{
    let io = |kind: std::io::ErrorKind, text: String| std::io::Error::new(kind, text);
    if let SdkError::ServiceError(service) = error {
        let status = service.raw().status().as_u16();
        let code = error.code().unwrap_or("");
        let mut text = format!("HTTP {status}");
        for part in [code, error.message().unwrap_or("")] {
            if !part.is_empty() {
                text = format!("{text} {part}");
            }
        }
        if let Some((_, meaning)) = REJECTED_CREDENTIALS.iter().find(|(c, _)| *c == code) {
            return Failure::Fatal(Error::Credentials {
                url: url.to_owned(),
                reason: format!("{meaning} ({text}); {CREDENTIALS_HINT}"),
            });
        }
        return match (status, code) {
            (429 | 500 | 502 | 503 | 504, _)
            | (_, "SlowDown" | "InternalError" | "RequestTimeout") => Failure::Retry(text),
            (404, _) | (_, "NoSuchKey" | "NoSuchBucket") => Failure::Fatal(Error::NotFound {
                url: url.to_owned(),
                source: io(std::io::ErrorKind::NotFound, text),
            }),
            (401 | 403, _) => Failure::Fatal(Error::AccessDenied {
                url: url.to_owned(),
                source: io(std::io::ErrorKind::PermissionDenied, text),
            }),
            (412, _) => Failure::Fatal(Error::Changed {
                url: url.to_owned(),
                offset,
            }),
            _ => Failure::Fatal(Error::Read {
                url: url.to_owned(),
                offset,
                source: io(std::io::ErrorKind::Other, text),
            }),
        };
    }
    // Credentials that cannot be loaded will not load on another attempt.
    if let Some(reason) = credentials_problem(error) {
        return Failure::Fatal(Error::Credentials {
            url: url.to_owned(),
            reason,
        });
    }
    match error {
        SdkError::TimeoutError(_) => Failure::Retry("request timed out".into()),
        SdkError::DispatchFailure(e) => {
            let cause = e
                .as_connector_error()
                .map_or_else(|| cause_chain(error), |c| cause_chain(c));
            if e.is_user() {
                Failure::Fatal(Error::Read {
                    url: url.to_owned(),
                    offset,
                    source: io(
                        std::io::ErrorKind::Other,
                        format!("the request cannot be sent: {cause}"),
                    ),
                })
            } else {
                Failure::Retry(format!("connection failed: {cause}"))
            }
        }
        SdkError::ResponseError(_) => {
            Failure::Retry(format!("unreadable response: {}", cause_chain(error)))
        }
        _ => Failure::Fatal(Error::Read {
            url: url.to_owned(),
            offset,
            source: io(
                std::io::ErrorKind::Other,
                format!("the request cannot be made: {}", cause_chain(error)),
            ),
        }),
    }
}

#[cfg(test)]
mod tests {
    use aws_credential_types::provider::error::CredentialsError;
    use aws_sdk_s3::config::http::HttpResponse;
    use aws_sdk_s3::error::{ConnectorError, ErrorMetadata};
    use aws_sdk_s3::primitives::SdkBody;

    use super::object::accept;
    use super::*;
    use crate::store::ranged::Pinned;
    use aws_sdk_s3::operation::get_object::{GetObjectError, GetObjectOutput};

    const URL: &str = "s3://bucket/shard.tar";

    fn take_answer(
        output: GetObjectOutput,
        pinned: &mut Pinned,
        end: Option<u64>,
    ) -> Result<(u64, u64), Failure> {
        accept(URL, 0, (end, false), &output, pinned)
    }

    #[test]
    fn an_object_of_another_size_than_listed_is_an_error() {
        let whole = || {
            GetObjectOutput::builder()
                .content_length(900)
                .e_tag("\"a\"")
                .build()
        };
        let mut pinned = Pinned::listed(Some(1000));
        match take_answer(whole(), &mut pinned, Some(1000)) {
            Err(Failure::Fatal(Error::Read {
                offset: 0, source, ..
            })) => {
                assert!(
                    source.to_string().contains("900 bytes, not the 1000"),
                    "{source}"
                )
            }
            _ => panic!("a listed size that the object does not have is an error"),
        }
        let mut pinned = Pinned::listed(None);
        assert!(matches!(
            take_answer(whole(), &mut pinned, None),
            Ok((900, 900))
        ));
        assert_eq!(
            (pinned.size, pinned.etag.as_deref()),
            (Some(900), Some("\"a\""))
        );
        // Another ETag than the one pinned: the object changed.
        let other = GetObjectOutput::builder()
            .content_length(900)
            .e_tag("\"b\"")
            .build();
        assert!(matches!(
            take_answer(other, &mut pinned, None),
            Err(Failure::Fatal(Error::Changed { .. }))
        ));
    }

    type GetError = SdkError<GetObjectError, HttpResponse>;

    fn service_error(status: u16, code: &str, message: &str) -> GetError {
        let meta = ErrorMetadata::builder().code(code).message(message).build();
        let raw = HttpResponse::new(status.try_into().unwrap(), SdkBody::empty());
        SdkError::service_error(GetObjectError::generic(meta), raw)
    }

    fn fatal(failure: Failure) -> Error {
        match failure {
            Failure::Fatal(error) => error,
            Failure::Retry(reason) => panic!("retried: {reason}"),
        }
    }

    #[test]
    fn credentials_that_cannot_be_loaded_are_final_and_said_in_a_sentence() {
        let missing = CredentialsError::not_loaded("no providers in chain provided credentials");
        let error: GetError =
            SdkError::dispatch_failure(ConnectorError::other(Box::new(missing), None));
        let error = fatal(classify(URL, 0, &error));
        assert!(matches!(error, Error::Credentials { .. }));
        assert!(!error.is_shard_error(), "no policy skips it");
        let message = error.to_string();
        assert!(message.starts_with(URL), "{message}");
        assert!(message.contains("unsigned=True"), "{message}");
        assert!(
            !message.contains('{') && !message.contains("DispatchFailure"),
            "{message}"
        );
    }

    #[test]
    fn credentials_the_store_rejects_are_final() {
        for code in [
            "InvalidAccessKeyId",
            "SignatureDoesNotMatch",
            "ExpiredToken",
        ] {
            let error = fatal(classify(URL, 0, &service_error(403, code, "refused")));
            assert!(matches!(error, Error::Credentials { .. }), "{code}");
            assert!(error
                .to_string()
                .contains(&format!("HTTP 403 {code} refused")));
        }
        let denied = fatal(classify(
            URL,
            0,
            &service_error(403, "AccessDenied", "Access Denied"),
        ));
        assert!(matches!(denied, Error::AccessDenied { .. }));
        assert!(denied.is_shard_error());
        let missing = fatal(classify(URL, 0, &service_error(404, "NoSuchKey", "gone")));
        assert_eq!(
            missing.to_string(),
            format!("{URL}: shard not found (HTTP 404 NoSuchKey gone)")
        );
    }

    #[test]
    fn a_refused_connection_is_retried_and_said_without_a_debug_dump() {
        let refused =
            std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "Connection refused");
        let error: GetError = SdkError::dispatch_failure(ConnectorError::io(Box::new(refused)));
        match classify(URL, 0, &error) {
            Failure::Retry(reason) => assert_eq!(reason, "connection failed: Connection refused"),
            Failure::Fatal(error) => panic!("final: {error}"),
        }
        let slow: GetError = service_error(503, "SlowDown", "Please reduce your request rate.");
        assert!(matches!(classify(URL, 0, &slow), Failure::Retry(_)));
    }

    #[test]
    fn error_chains_leave_out_repeated_messages() {
        let inner = std::io::Error::other("tcp connect error");
        let outer = ConnectorError::io(Box::new(inner));
        assert_eq!(error_chain(&outer), "io error: tcp connect error");
        assert_eq!(cause_chain(&outer), "tcp connect error");
    }
}
