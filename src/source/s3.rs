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

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use aws_sdk_s3::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_s3::operation::get_object::{GetObjectError, GetObjectOutput};
use bytes::Bytes;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::{Chunk, ChunkSender, ConsumerGone, FetchUnit, Fetcher};
use crate::config::S3Options;
use crate::error::Error;
use crate::stats::{Counter, Counters};

/// A client for one stream, made in the process that reads (after fork).
pub struct S3Client {
    client: aws_sdk_s3::Client,
    options: S3Options,
    /// Why credentials could not be used, once a request found out: every
    /// later request fails at once with it, rather than look for them in
    /// every source again.
    credentials_failure: OnceLock<String>,
}

impl S3Client {
    /// Builds a client from `options` and the default credential chain
    /// (environment, shared config and credentials files, SSO, web identity,
    /// IMDS and ECS roles).
    pub async fn new(options: &S3Options) -> Self {
        let mut loader = aws_config::defaults(aws_config::BehaviorVersion::latest())
            .retry_config(aws_config::retry::RetryConfig::disabled())
            .timeout_config(
                aws_config::timeout::TimeoutConfig::builder()
                    .connect_timeout(options.connect_timeout)
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
    pub async fn list(
        &self,
        url: &str,
        bucket: &str,
        prefix: &str,
        keep: fn(&str) -> bool,
    ) -> Result<Vec<(String, u64, Option<String>)>, Error> {
        let mut objects = Vec::new();
        let mut token: Option<String> = None;
        loop {
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
                    let size = object.size().unwrap_or(0).max(0) as u64;
                    objects.push((key.to_owned(), size, object.e_tag().map(str::to_owned)));
                }
            }
            match page.next_continuation_token() {
                Some(next) if page.is_truncated().unwrap_or(false) => token = Some(next.to_owned()),
                _ => break,
            }
        }
        objects.sort();
        Ok(objects)
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
        let size = output.content_length().unwrap_or(0).max(0) as u64;
        Ok((size, output.e_tag().map(str::to_owned)))
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
        let mut retries = Retries::new(&self.options, url, 0);
        loop {
            if let Some(error) = self.known_credentials_failure(url) {
                return Err(error);
            }
            let result = match tokio::time::timeout(self.options.first_byte_timeout, send()).await {
                Ok(result) => result,
                Err(_) => Err(SdkError::timeout_error(format!(
                    "no response within {:?}",
                    self.options.first_byte_timeout
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

/// What a failed request or body means for the read.
enum Failure {
    /// Worth another attempt (throttling, 5xx, timeouts, resets).
    Retry(String),
    /// Final.
    Fatal(Error),
}

/// What to do about credentials: how a user provides them.
const CREDENTIALS_HINT: &str = "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, name a profile \
     of the shared config files (AWS_PROFILE, or S3Config(profile=...)), or read a public \
     bucket with unsigned requests (S3Config(unsigned=True))";

/// Error codes by which a store rejects the credentials themselves (not
/// the rights they carry), with what each means.
const REJECTED_CREDENTIALS: [(&str, &str); 5] = [
    (
        "InvalidAccessKeyId",
        "the store knows no such access key id",
    ),
    (
        "SignatureDoesNotMatch",
        "the secret access key does not match the access key id",
    ),
    ("ExpiredToken", "the session token has expired"),
    ("TokenRefreshRequired", "the session token has expired"),
    ("InvalidToken", "the session token is not valid"),
];

/// The most errors of a source chain looked at.
const MAX_CHAIN: usize = 16;

/// The messages of `error` and its sources, joined by ": " on one line,
/// leaving out a message that the one before already holds (wrappers often
/// repeat their source's). Display messages only, never a `Debug` dump.
fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut next = Some(error);
    for _ in 0..MAX_CHAIN {
        let Some(current) = next else { break };
        let text = current
            .to_string()
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ");
        if !text.is_empty() && !parts.last().is_some_and(|last| last.contains(&text)) {
            parts.push(text);
        }
        next = current.source();
    }
    parts.join(": ")
}

/// The messages of what caused `error` (its sources), or its own message
/// when it has no source: the generic words of a wrapper ("io error",
/// "dispatch failure") left out.
fn cause_chain(error: &(dyn std::error::Error + 'static)) -> String {
    match error.source() {
        Some(source) => error_chain(source),
        None => error_chain(error),
    }
}

/// Why no credentials could be used, when `error` (or one of its sources)
/// is a failure to load them, as a sentence that says where they were
/// looked for and how to provide them.
fn credentials_problem(error: &(dyn std::error::Error + 'static)) -> Option<String> {
    use aws_config::meta::ProviderChainError;
    use aws_credential_types::provider::error::CredentialsError;
    use std::error::Error as _;
    let mut next = Some(error);
    for _ in 0..MAX_CHAIN {
        let current = next?;
        if let Some(credentials) = current.downcast_ref::<CredentialsError>() {
            let tried = credentials
                .source()
                .and_then(|s| s.downcast_ref::<ProviderChainError<CredentialsError>>());
            let reason = match (credentials, tried) {
                (CredentialsError::CredentialsNotLoaded(_), Some(chain)) => {
                    let attempts = chain
                        .attempts()
                        .iter()
                        .map(|a| {
                            format!("{}: {}", source_name(a.name()), attempt_outcome(a.error()))
                        })
                        .collect::<Vec<_>>();
                    format!("none were found (tried {})", attempts.join("; "))
                }
                (CredentialsError::CredentialsNotLoaded(_), None) => {
                    format!("none were found ({})", cause_chain(credentials))
                }
                (CredentialsError::ProviderTimedOut(_), _) => {
                    format!("loading them timed out ({})", error_chain(credentials))
                }
                _ => format!("loading them failed: {}", cause_chain(credentials)),
            };
            return Some(format!("{reason}; {CREDENTIALS_HINT}"));
        }
        let text = current.to_string();
        if text.starts_with("identity resolver timed out") {
            return Some(format!(
                "loading them timed out ({text}); {CREDENTIALS_HINT}"
            ));
        }
        next = current.source();
    }
    None
}

/// Why one source of the credential chain gave none.
fn attempt_outcome(error: &aws_credential_types::provider::error::CredentialsError) -> String {
    use aws_credential_types::provider::error::CredentialsError;
    use std::error::Error as _;
    match (error, error.source()) {
        // Its own message ("the credential provider was not enabled") says nothing more.
        (CredentialsError::CredentialsNotLoaded(_), None) => "none there".into(),
        _ => cause_chain(error),
    }
}

/// A readable name of a provider of the default credential chain.
fn source_name(provider: &str) -> &str {
    match provider {
        "Environment" => "environment variables",
        "Profile" => "shared config and credentials files",
        "WebIdentityToken" => "web identity token",
        "EcsContainer" => "ECS container endpoint",
        "Ec2InstanceMetadata" => "EC2 instance metadata (IMDS)",
        other => other,
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

/// Bounded retries with exponential backoff and full jitter.
struct Retries<'a> {
    options: &'a S3Options,
    attempt: u32,
    started: Instant,
    seed: u64,
}

impl<'a> Retries<'a> {
    fn new(options: &'a S3Options, url: &str, offset: u64) -> Self {
        let seed = url.bytes().fold(offset ^ 0x9e37_79b9_7f4a_7c15, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
        });
        Retries {
            options,
            attempt: 0,
            started: Instant::now(),
            seed,
        }
    }

    /// Waits before the next attempt, or gives the error when out of attempts or time.
    async fn wait(&mut self, url: &str, offset: u64, reason: String) -> Result<(), Error> {
        self.attempt += 1;
        if self.attempt >= self.options.max_attempts
            || self.started.elapsed() >= self.options.max_retry_time
        {
            return Err(Error::Read {
                url: url.to_owned(),
                offset,
                source: std::io::Error::other(format!(
                    "gave up after {} attempts: {reason}",
                    self.attempt
                )),
            });
        }
        let cap = self
            .options
            .backoff_base
            .saturating_mul(1 << self.attempt.min(16))
            .min(self.options.backoff_max);
        // Full jitter: a uniform draw from [0, cap) (splitmix64 of our own seed).
        self.seed = self.seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.seed;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        let fraction = (z >> 11) as f64 / (1u64 << 53) as f64;
        tokio::time::sleep(cap.mul_f64(fraction)).await;
        Ok(())
    }
}

/// One GET from byte `from` to `end` (exclusive; `None`: the object's end).
async fn get(
    s3: &S3Client,
    bucket: &str,
    key: &str,
    from: u64,
    end: Option<u64>,
    etag: Option<&str>,
) -> Result<GetObjectOutput, SdkError<GetObjectError>> {
    let range = match (from, end) {
        (0, None) => None,
        (from, None) => Some(format!("bytes={from}-")),
        (from, Some(end)) => Some(format!("bytes={from}-{}", end.saturating_sub(1))),
    };
    let request = s3
        .client
        .get_object()
        .bucket(bucket)
        .key(key)
        .set_range(range)
        .set_if_match(etag.map(str::to_owned));
    match tokio::time::timeout(s3.options.first_byte_timeout, request.send()).await {
        Ok(result) => result,
        Err(_) => Err(SdkError::timeout_error(format!(
            "no response within {:?}",
            s3.options.first_byte_timeout
        ))),
    }
}

/// What is known of an object being read: its ETag (every request after
/// the first is pinned to it) and its size.
#[derive(Debug, Default, Clone)]
struct Pinned {
    etag: Option<String>,
    size: Option<u64>,
    /// Whether an answer gave `size`; else it is the size the object was
    /// listed with, which the first answer must confirm.
    confirmed: bool,
}

impl Pinned {
    /// Nothing known but the size the object was listed with, if any.
    fn listed(size: Option<u64>) -> Self {
        Pinned {
            size,
            ..Pinned::default()
        }
    }
}

/// Where the body of an answer lies in the object.
#[derive(Debug, PartialEq, Eq)]
struct Served {
    /// The object's size.
    size: u64,
    /// Where the body's bytes end in the object (exclusive).
    body_end: u64,
}

/// `bytes FIRST-LAST/TOTAL` (`TOTAL` may be `*`, unknown).
fn parse_content_range(text: &str) -> Option<(u64, u64, Option<u64>)> {
    let rest = text.trim().strip_prefix("bytes")?.trim_start();
    let (span, total) = rest.split_once('/')?;
    let (first, last) = span.trim().split_once('-')?;
    let total = match total.trim() {
        "*" => None,
        digits => Some(digits.parse().ok()?),
    };
    Some((first.trim().parse().ok()?, last.trim().parse().ok()?, total))
}

/// Checks that an answer to a GET from byte `from` (to `end`, exclusive;
/// `None`: to the object's end) carries exactly those bytes: a partial
/// answer (206) whose Content-Range starts at `from` and ends at `end` (or
/// at the object's end, when it ends first), its Content-Length the same;
/// or, for a GET from the first byte, the whole object (200) with its
/// length. Anything else (a whole object for a resume, a range starting
/// elsewhere) is refused, with the reason.
fn check_response(
    from: u64,
    end: Option<u64>,
    content_range: Option<&str>,
    content_length: Option<i64>,
) -> Result<Served, String> {
    let length = match content_length.map(u64::try_from) {
        Some(Ok(length)) => Some(length),
        Some(Err(_)) => return Err("the answer has a negative Content-Length".into()),
        None => None,
    };
    let Some(text) = content_range else {
        if from > 0 {
            return Err(format!(
                "asked for the bytes from byte offset {from}, the answer holds the whole object \
                 (no Content-Range)"
            ));
        }
        let size = length.ok_or("the answer has neither Content-Range nor Content-Length")?;
        return Ok(Served {
            size,
            body_end: size,
        });
    };
    let (first, last, total) = parse_content_range(text)
        .ok_or_else(|| format!("the answer has an unreadable Content-Range {text:?}"))?;
    let total = total.ok_or_else(|| {
        format!("the answer's Content-Range {text:?} does not give the object's size")
    })?;
    if first != from || last < first || last >= total {
        return Err(format!(
            "asked for the bytes from byte offset {from}, the answer holds bytes {first} to \
             {last} of {total}"
        ));
    }
    let body_end = last + 1;
    let wanted_end = end.unwrap_or(total).min(total);
    if body_end != wanted_end {
        return Err(format!(
            "asked for bytes {from} to {}, the answer holds bytes {first} to {last} of {total}",
            wanted_end.saturating_sub(1)
        ));
    }
    if length.is_some_and(|n| n != body_end - first) {
        return Err(format!(
            "the answer's Content-Length {} does not match its Content-Range {text:?}",
            length.unwrap_or(0)
        ));
    }
    Ok(Served {
        size: total,
        body_end,
    })
}

/// Takes an answer for the read of `url` at `position` (to `end`; with
/// `clamp`, or without `end`, the object may end first) if it carries the
/// bytes asked for and fits what is known of the object; gives where the
/// read stops.
fn accept(
    url: &str,
    position: u64,
    (end, clamp): (Option<u64>, bool),
    output: &GetObjectOutput,
    pinned: &mut Pinned,
) -> Result<u64, Failure> {
    let served = check_response(
        position,
        end,
        output.content_range(),
        output.content_length(),
    )
    .map_err(Failure::Retry)?;
    if let (Some(pinned_etag), Some(etag)) = (&pinned.etag, output.e_tag()) {
        if pinned_etag != etag {
            return Err(Failure::Fatal(Error::Changed {
                url: url.to_owned(),
                offset: position,
            }));
        }
    }
    let invalid = |reason: String| {
        Failure::Fatal(Error::Read {
            url: url.to_owned(),
            offset: position,
            source: std::io::Error::new(std::io::ErrorKind::InvalidData, reason),
        })
    };
    match pinned.size {
        Some(size) if size != served.size && !pinned.confirmed => {
            return Err(invalid(format!(
                "the object is {} bytes, not the {size} bytes it was listed with (it changed \
                 since)",
                served.size
            )))
        }
        Some(size) if size != served.size => {
            return Err(Failure::Retry(format!(
                "the answer gives the object's size as {} bytes, an earlier one as {size}",
                served.size
            )))
        }
        _ => {}
    }
    pinned.size = Some(served.size);
    pinned.confirmed = true;
    if pinned.etag.is_none() {
        pinned.etag = output.e_tag().map(str::to_owned);
    }
    match end {
        None => Ok(served.size),
        Some(end) if end <= served.size => Ok(end),
        Some(_) if clamp => Ok(served.size),
        Some(end) => Err(invalid(format!(
            "bytes up to byte offset {end} were asked for, the object holds {}",
            served.size
        ))),
    }
}

/// Where body bytes go.
enum Target<'a> {
    /// Budgeted chunks of `chunk_bytes`, sent to a shard reader.
    Chunks {
        tx: &'a ChunkSender,
        budget: &'a Arc<Semaphore>,
        chunk_bytes: usize,
        chunk: Vec<u8>,
        permit: Option<OwnedSemaphorePermit>,
    },
    /// One buffer, for a part whose budget is already held.
    Buffer(Vec<u8>),
}

impl Target<'_> {
    async fn push(&mut self, mut bytes: Bytes) -> Result<(), ConsumerGone> {
        match self {
            Target::Buffer(buffer) => {
                buffer.extend_from_slice(&bytes);
                Ok(())
            }
            Target::Chunks {
                tx,
                budget,
                chunk_bytes,
                chunk,
                permit,
            } => {
                while !bytes.is_empty() {
                    if permit.is_none() {
                        let n = u32::try_from(*chunk_bytes).expect("chunk_bytes fits u32");
                        *permit = Some(
                            budget
                                .clone()
                                .acquire_many_owned(n)
                                .await
                                .map_err(|_| ConsumerGone)?,
                        );
                        chunk.reserve_exact(*chunk_bytes);
                    }
                    let take = bytes.len().min(*chunk_bytes - chunk.len());
                    chunk.extend_from_slice(&bytes.split_to(take));
                    if chunk.len() == *chunk_bytes {
                        let held = permit.take().expect("reserved above");
                        tx.send(Ok(Chunk::read(std::mem::take(chunk), held)))?;
                    }
                }
                Ok(())
            }
        }
    }

    /// Sends a partly filled chunk, giving back the budget it does not use.
    fn flush(&mut self) -> Result<(), ConsumerGone> {
        if let Target::Chunks {
            tx,
            chunk_bytes,
            chunk,
            permit,
            ..
        } = self
        {
            if let Some(mut held) = permit.take() {
                if chunk.is_empty() {
                    return Ok(());
                }
                drop(held.split(*chunk_bytes - chunk.len()));
                let partial = Chunk::read(std::mem::take(chunk), held);
                tx.send(Ok(partial))?;
            }
        }
        Ok(())
    }
}

/// One object being read: its client, counters, URL, bucket and key.
struct Object<'a> {
    s3: &'a S3Client,
    counters: &'a Counters,
    url: &'a str,
    bucket: &'a str,
    key: &'a str,
}

/// Streams the bytes `range` (end `u64::MAX`: to the object's end; with
/// `clamp`, to the range's end or the object's, whichever comes first) of
/// an object into `target`, retrying failed requests and resuming a broken
/// body from the last byte received, pinned to the first ETag seen. Every
/// answer is checked to hold exactly the bytes asked for (see
/// [`check_response`]), and the read ends only where the range (or the
/// object) does: an answer that does not fit is retried, then an error.
async fn stream_range(
    object: &Object<'_>,
    range: Range<u64>,
    clamp: bool,
    pinned: &mut Pinned,
    target: &mut Target<'_>,
) -> Result<Result<(), Error>, ConsumerGone> {
    let Object {
        s3,
        counters,
        url,
        bucket,
        key,
    } = *object;
    let mut end = (range.end != u64::MAX).then_some(range.end);
    let mut position = range.start;
    let mut retries = Retries::new(&s3.options, url, range.start);
    loop {
        if end.is_some_and(|e| position >= e) {
            return Ok(Ok(()));
        }
        if let Some(error) = s3.known_credentials_failure(url) {
            return Ok(Err(error));
        }
        counters.add(Counter::Requests, 1);
        let request = get(s3, bucket, key, position, end, pinned.etag.as_deref());
        let answer = match request.await {
            Ok(output) => {
                accept(url, position, (end, clamp), &output, pinned).map(|stop| (stop, output.body))
            }
            Err(error)
                if position == 0
                    && clamp
                    && pinned.size.is_none()
                    && error.code() == Some("InvalidRange") =>
            {
                // A range from the first byte is unsatisfiable only in an
                // empty object.
                pinned.size = Some(0);
                pinned.confirmed = true;
                return Ok(Ok(()));
            }
            Err(error) => Err(s3.classify(url, position, &error)),
        };
        let reason = match answer {
            Ok((stop, mut body)) => {
                end = Some(stop);
                let broke = loop {
                    match tokio::time::timeout(s3.options.idle_timeout, body.next()).await {
                        Ok(Some(Ok(mut bytes))) => {
                            // Past `stop` only when the whole object was
                            // sent for a range from its first byte.
                            let room = stop - position;
                            let cut = bytes.len() as u64 > room;
                            if cut {
                                bytes.truncate(room as usize);
                            }
                            position += bytes.len() as u64;
                            counters.add(Counter::BytesRead, bytes.len() as u64);
                            target.push(bytes).await?;
                            if cut {
                                break None;
                            }
                        }
                        Ok(None) if position < stop => {
                            break Some(format!("the body ended early, at byte offset {position}"))
                        }
                        Ok(None) => break None,
                        Ok(Some(Err(e))) => {
                            break Some(format!("the body broke: {}", error_chain(&e)))
                        }
                        Err(_) => {
                            break Some(format!("no body bytes for {:?}", s3.options.idle_timeout))
                        }
                    }
                };
                let Some(reason) = broke else {
                    return Ok(Ok(()));
                };
                counters.add(Counter::Resumes, 1);
                reason
            }
            Err(Failure::Fatal(error)) => return Ok(Err(error)),
            Err(Failure::Retry(reason)) => reason,
        };
        if let Err(error) = retries.wait(url, position, reason).await {
            return Ok(Err(error));
        }
        counters.add(Counter::Retries, 1);
    }
}

/// Reads the unit's object (or byte range of it) into budgeted chunks sent
/// to `tx`; a range larger than `part_size` goes as parallel ranged GETs,
/// delivered in order.
pub(super) async fn read_object(
    fetcher: &Fetcher,
    s3: &Arc<S3Client>,
    unit: &FetchUnit,
    (bucket, key): (&str, &str),
    tx: &ChunkSender,
) -> Result<(), ConsumerGone> {
    fetcher.count(Counter::ShardsOpened, 1);
    let url = unit.url.as_str();
    let range = unit
        .range
        .clone()
        .unwrap_or(0..unit.size.unwrap_or(u64::MAX));
    let known_len = (range.end != u64::MAX).then(|| range.end - range.start);
    let part = part_bytes(fetcher, &s3.options);
    // A unit of a byte range may give the range's size, not the object's.
    let mut pinned = Pinned::listed(unit.size.filter(|_| unit.range.is_none()));
    if s3.options.max_concurrency > 1 && known_len.is_none_or(|len| len > part) {
        return read_parts(fetcher, s3, (url, bucket, key), range, part, pinned, tx).await;
    }
    let mut target = Target::Chunks {
        tx,
        budget: &fetcher.budget,
        chunk_bytes: fetcher.chunk_bytes,
        chunk: Vec::new(),
        permit: None,
    };
    let object = Object {
        s3,
        counters: &fetcher.counters,
        url,
        bucket,
        key,
    };
    let result = match stream_range(&object, range, false, &mut pinned, &mut target).await {
        Err(ConsumerGone) => return Ok(()),
        Ok(result) => result,
    };
    if target.flush().is_err() {
        return Ok(());
    }
    if let Err(error) = result {
        let _ = tx.send(Err(error));
    }
    Ok(())
}

/// The size of one ranged GET: `part_size`, or less, so that
/// `max_concurrency` parts fit in this unit's share of the read-ahead budget
/// and can be in flight together (with the defaults, 32 MiB shared by 4
/// objects, 2 MiB parts).
fn part_bytes(fetcher: &Fetcher, options: &S3Options) -> u64 {
    let fitting = fetcher.budget_bytes() / options.max_concurrency.max(1);
    options.part_size.min(fitting).max(1) as u64
}

/// The error of a part of `url` (bytes `part`) that ended after `got` bytes.
fn short_part(url: &str, part: &Range<u64>, got: u64) -> Error {
    Error::Read {
        url: url.to_owned(),
        offset: part.start + got,
        source: std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            format!(
                "the part of bytes {} to {} ended after {got} bytes",
                part.start,
                part.end.saturating_sub(1)
            ),
        ),
    }
}

/// A part's fetch task in flight, its budget and its bytes.
type PartTask = (
    tokio::task::JoinHandle<Result<Vec<u8>, Error>>,
    OwnedSemaphorePermit,
    Range<u64>,
);

/// Parallel ranged GETs of `part` bytes, at most `max_concurrency` at once,
/// each holding its share of the read-ahead budget, sent in order. The first
/// part goes alone, to learn the ETag every other part is pinned to and, for
/// a whole object of unknown size, the size. Every part must bring every
/// byte it asked for.
async fn read_parts(
    fetcher: &Fetcher,
    s3: &Arc<S3Client>,
    (url, bucket, key): (&str, &str, &str),
    range: Range<u64>,
    part: u64,
    mut pinned: Pinned,
    tx: &ChunkSender,
) -> Result<(), ConsumerGone> {
    // Of unknown size, the object may end within the first part.
    let clamp = range.end == u64::MAX;
    let first = range.start..range.start.saturating_add(part).min(range.end);
    let Some(permit) = fetcher.reserve((first.end - first.start) as usize).await else {
        return Err(ConsumerGone);
    };
    let mut buffer = Target::Buffer(Vec::new());
    let object = Object {
        s3,
        counters: &fetcher.counters,
        url,
        bucket,
        key,
    };
    let first_result =
        stream_range(&object, first.clone(), clamp, &mut pinned, &mut buffer).await?;
    let end = match (range.end, pinned.size) {
        (u64::MAX, Some(size)) => size,
        (u64::MAX, None) => first.end,
        (end, _) => end,
    };
    match first_result {
        Ok(()) => {
            let Target::Buffer(bytes) = buffer else {
                unreachable!("a buffer target")
            };
            let wanted = first.end.min(end) - first.start;
            if bytes.len() as u64 != wanted {
                let _ = tx.send(Err(short_part(url, &first, bytes.len() as u64)));
                return Ok(());
            }
            let mut permit = permit;
            let unused = (first.end - first.start) as usize - bytes.len();
            if unused > 0 {
                drop(permit.split(unused));
            }
            if !send_part(tx, Ok(bytes), permit) {
                return Ok(());
            }
        }
        Err(error) => {
            let _ = tx.send(Err(error));
            return Ok(());
        }
    }
    let mut parts = (first.end..end)
        .step_by(usize::try_from(part).unwrap_or(usize::MAX))
        .map(|start| start..(start + part).min(end))
        .peekable();
    let mut in_flight: VecDeque<PartTask> = VecDeque::new();
    let stop = |in_flight: VecDeque<PartTask>| {
        for (task, _, _) in in_flight {
            task.abort();
        }
    };
    loop {
        while in_flight.len() < s3.options.max_concurrency {
            let Some(next) = parts.peek().cloned() else {
                break;
            };
            let len = (next.end - next.start) as usize;
            // Wait for budget only with nothing in flight: otherwise the
            // budget may be held by the parts in flight, which are delivered
            // (and their budget freed) only after this loop.
            let permit = if in_flight.is_empty() {
                let Some(permit) = fetcher.reserve(len).await else {
                    return Err(ConsumerGone);
                };
                permit
            } else {
                let Some(permit) = fetcher.try_reserve(len) else {
                    break;
                };
                permit
            };
            parts.next();
            let task = tokio::spawn(fetch_part(
                s3.clone(),
                fetcher.counters.clone(),
                url.to_owned(),
                (bucket.to_owned(), key.to_owned()),
                next.clone(),
                pinned.clone(),
            ));
            in_flight.push_back((task, permit, next));
        }
        let Some((task, permit, next)) = in_flight.pop_front() else {
            return Ok(());
        };
        let result = task.await.unwrap_or_else(|join| {
            let reason = if join.is_panic() {
                "the part's fetch task panicked"
            } else {
                "the part's fetch task was cancelled"
            };
            Err(Error::Read {
                url: url.to_owned(),
                offset: next.start,
                source: std::io::Error::other(reason),
            })
        });
        if !send_part(tx, result, permit) {
            stop(in_flight);
            return Ok(());
        }
    }
}

/// Sends a part (or its error); `false` when reading must stop.
fn send_part(tx: &ChunkSender, part: Result<Vec<u8>, Error>, permit: OwnedSemaphorePermit) -> bool {
    match part {
        Ok(bytes) => tx.send(Ok(Chunk::read(bytes, permit))).is_ok(),
        Err(error) => {
            let _ = tx.send(Err(error));
            false
        }
    }
}

/// One part of a parallel read, into memory: every byte of `range`, or an error.
async fn fetch_part(
    s3: Arc<S3Client>,
    counters: Arc<Counters>,
    url: String,
    (bucket, key): (String, String),
    range: Range<u64>,
    mut pinned: Pinned,
) -> Result<Vec<u8>, Error> {
    let mut buffer = Target::Buffer(Vec::with_capacity((range.end - range.start) as usize));
    let object = Object {
        s3: &s3,
        counters: &counters,
        url: &url,
        bucket: &bucket,
        key: &key,
    };
    match stream_range(&object, range.clone(), false, &mut pinned, &mut buffer).await {
        Ok(Ok(())) => match buffer {
            Target::Buffer(bytes) if bytes.len() as u64 == range.end - range.start => Ok(bytes),
            Target::Buffer(bytes) => Err(short_part(&url, &range, bytes.len() as u64)),
            Target::Chunks { .. } => unreachable!("a part reads into a buffer"),
        },
        Ok(Err(error)) => Err(error),
        Err(ConsumerGone) => Err(Error::Stopped("stream cancelled".into())),
    }
}

#[cfg(test)]
mod tests {
    use aws_credential_types::provider::error::CredentialsError;
    use aws_sdk_s3::config::http::HttpResponse;
    use aws_sdk_s3::error::{ConnectorError, ErrorMetadata};
    use aws_sdk_s3::primitives::SdkBody;

    use super::*;

    const URL: &str = "s3://bucket/shard.tar";

    fn served(size: u64, body_end: u64) -> Result<Served, String> {
        Ok(Served { size, body_end })
    }

    #[test]
    fn a_resume_is_taken_only_as_the_range_asked_for() {
        let range = Some("bytes 1000-4999/5000");
        assert_eq!(
            check_response(1000, None, range, Some(4000)),
            served(5000, 5000)
        );
        assert_eq!(
            check_response(1000, Some(5000), range, None),
            served(5000, 5000)
        );
        // The object ends before the range asked for: the caller decides.
        assert_eq!(
            check_response(1000, Some(9000), range, Some(4000)),
            served(5000, 5000)
        );
        let refused = [
            // The whole object (200) for a resume.
            check_response(1000, None, None, Some(5000)),
            // Bytes from another offset.
            check_response(1000, None, Some("bytes 0-4999/5000"), Some(5000)),
            check_response(1000, None, Some("bytes 1500-4999/5000"), Some(3500)),
            // Fewer bytes than asked for, however consistently told.
            check_response(1000, None, Some("bytes 1000-2999/5000"), Some(2000)),
            check_response(1000, Some(4000), Some("bytes 1000-2999/5000"), Some(2000)),
            // A length that is not the range's.
            check_response(1000, None, range, Some(100)),
            // No size, or no sense.
            check_response(1000, None, Some("bytes 1000-4999/*"), Some(4000)),
            check_response(1000, None, Some("bytes 1000-999/5000"), Some(0)),
            check_response(1000, None, Some("bytes 1000-5000/5000"), Some(4001)),
            check_response(1000, None, Some("1000-4999/5000"), Some(4000)),
            check_response(1000, None, range, Some(-1)),
        ];
        for (i, answer) in refused.iter().enumerate() {
            let reason = answer.as_ref().expect_err(&format!("answer {i} refused"));
            assert!(!reason.contains('{'), "{reason}");
        }
    }

    #[test]
    fn a_read_from_the_first_byte_takes_the_whole_object() {
        assert_eq!(
            check_response(0, None, None, Some(5000)),
            served(5000, 5000)
        );
        // A ranged GET from the first byte answered with the whole object:
        // its first bytes are the ones asked for (the rest is left unread).
        assert_eq!(
            check_response(0, Some(100), None, Some(5000)),
            served(5000, 5000)
        );
        assert!(check_response(0, None, None, None).is_err());
    }

    #[test]
    fn content_ranges_are_parsed() {
        assert_eq!(parse_content_range("bytes 0-9/10"), Some((0, 9, Some(10))));
        assert_eq!(parse_content_range("bytes 5-9/*"), Some((5, 9, None)));
        assert_eq!(parse_content_range("bytes */10"), None);
        assert_eq!(parse_content_range("bytes 5-x/10"), None);
    }

    fn take_answer(
        output: GetObjectOutput,
        pinned: &mut Pinned,
        end: Option<u64>,
    ) -> Result<u64, Failure> {
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
        assert!(matches!(take_answer(whole(), &mut pinned, None), Ok(900)));
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
