//! Objects on S3 (and S3-compatible stores) through `aws-sdk-s3`: one
//! streaming GET per unit (or parallel ranged GETs for large ones), its own
//! retries with exponential backoff and full jitter, a per-chunk idle
//! timeout, and mid-body resume with a Range request pinned to the first
//! ETag (If-Match), so an object replaced during a read is an error, never a
//! mix of two versions.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::Instant;

use aws_sdk_s3::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_s3::operation::get_object::{GetObjectError, GetObjectOutput};
use aws_sdk_s3::primitives::ByteStream;
use bytes::Bytes;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::{Chunk, ChunkResult, ConsumerGone, FetchUnit, Fetcher};
use crate::config::S3Options;
use crate::error::Error;
use crate::stats::{Counter, Counters};

/// A client for one stream, made in the process that reads (after fork).
pub struct S3Client {
    client: aws_sdk_s3::Client,
    options: S3Options,
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

    /// Sends a metadata request (listing, HEAD) with the same bounded
    /// retries and first-byte timeout as object reads.
    async fn send_with_retries<T, E, F, Fut>(
        &self,
        url: &str,
        what: &str,
        mut send: F,
    ) -> Result<T, Error>
    where
        E: ProvideErrorMetadata + std::fmt::Debug,
        F: FnMut() -> Fut,
        Fut: std::future::Future<
            Output = Result<T, SdkError<E, aws_sdk_s3::config::http::HttpResponse>>,
        >,
    {
        let mut retries = Retries::new(&self.options, url, 0);
        loop {
            let result = match tokio::time::timeout(self.options.first_byte_timeout, send()).await {
                Ok(result) => result,
                Err(_) => Err(SdkError::timeout_error(format!(
                    "no response within {:?}",
                    self.options.first_byte_timeout
                ))),
            };
            let reason = match result {
                Ok(output) => return Ok(output),
                Err(error) => match classify(url, 0, &error) {
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

/// Classifies an SDK error of a request for `url` at `offset`.
fn classify<E: ProvideErrorMetadata + std::fmt::Debug>(
    url: &str,
    offset: u64,
    error: &SdkError<E, aws_sdk_s3::config::http::HttpResponse>,
) -> Failure {
    let io = |kind: std::io::ErrorKind, text: String| std::io::Error::new(kind, text);
    match error {
        SdkError::TimeoutError(_) => Failure::Retry("request timed out".into()),
        SdkError::DispatchFailure(e) => Failure::Retry(format!("connection failed: {e:?}")),
        SdkError::ResponseError(e) => Failure::Retry(format!("bad response: {e:?}")),
        SdkError::ServiceError(service) => {
            let status = service.raw().status().as_u16();
            let code = error.code().unwrap_or("");
            let text = format!("HTTP {status} {code} {}", error.message().unwrap_or(""))
                .trim()
                .to_owned();
            match (status, code) {
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
            }
        }
        other => Failure::Fatal(Error::Read {
            url: url.to_owned(),
            offset,
            source: io(std::io::ErrorKind::Other, format!("{other:?}")),
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

/// One GET of `range` (end exclusive, `None` for the rest of the object).
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
        (from, Some(end)) => Some(format!("bytes={from}-{}", end - 1)),
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

/// What the first response of an object tells: its ETag (every later
/// request is pinned to it) and, from a ranged GET, its size.
#[derive(Debug, Default, Clone)]
struct Pinned {
    etag: Option<String>,
    size: Option<u64>,
}

/// Where body bytes go.
enum Target<'a> {
    /// Budgeted chunks of `chunk_bytes`, sent to a shard reader.
    Chunks {
        tx: &'a Sender<ChunkResult>,
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
                        let full = Chunk::read(
                            std::mem::take(chunk),
                            permit.take().expect("reserved above"),
                        );
                        tx.send(Ok(full)).map_err(|_| ConsumerGone)?;
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
                tx.send(Ok(partial)).map_err(|_| ConsumerGone)?;
            }
        }
        Ok(())
    }
}

/// Streams the bytes `range` (end `u64::MAX`: to the object's end) of an
/// object into `target`, retrying failed requests and resuming a broken
/// body from the last byte received, pinned to the first ETag seen.
#[allow(clippy::too_many_arguments)]
async fn stream_range(
    s3: &S3Client,
    counters: &Counters,
    url: &str,
    (bucket, key): (&str, &str),
    range: Range<u64>,
    pinned: &mut Pinned,
    target: &mut Target<'_>,
) -> Result<Result<(), Error>, ConsumerGone> {
    let mut end = (range.end != u64::MAX).then_some(range.end);
    let mut position = range.start;
    let mut retries = Retries::new(&s3.options, url, range.start);
    let mut resuming = false;
    loop {
        if end.is_some_and(|e| position >= e) {
            return Ok(Ok(()));
        }
        counters.add(Counter::Requests, 1);
        let request = get(s3, bucket, key, position, end, pinned.etag.as_deref());
        let mut body: ByteStream = match request.await {
            Ok(output) => {
                if pinned.etag.is_none() {
                    pinned.etag = output.e_tag().map(str::to_owned);
                }
                if pinned.size.is_none() {
                    pinned.size = match output.content_range() {
                        Some(range) => range
                            .rsplit_once('/')
                            .and_then(|(_, total)| total.parse().ok()),
                        None if position == 0 && end.is_none() => {
                            output.content_length().map(|n| n.max(0) as u64)
                        }
                        None => None,
                    };
                }
                // A range past the object's end stops at the end.
                if let Some(size) = pinned.size {
                    end = Some(end.map_or(size, |e| e.min(size)));
                }
                output.body
            }
            Err(error) if resuming && end.is_none() && error.code() == Some("InvalidRange") => {
                // The body broke exactly at the object's end.
                return Ok(Ok(()));
            }
            Err(error) => match classify(url, position, &error) {
                Failure::Fatal(error) => return Ok(Err(error)),
                Failure::Retry(reason) => {
                    if let Err(error) = retries.wait(url, position, reason).await {
                        return Ok(Err(error));
                    }
                    counters.add(Counter::Retries, 1);
                    continue;
                }
            },
        };
        let broke = loop {
            match tokio::time::timeout(s3.options.idle_timeout, body.next()).await {
                Ok(Some(Ok(bytes))) => {
                    position += bytes.len() as u64;
                    counters.add(Counter::BytesRead, bytes.len() as u64);
                    target.push(bytes).await?;
                }
                Ok(None) if end.is_some_and(|e| position < e) => {
                    break Some("body ended early".to_owned())
                }
                Ok(None) => return Ok(Ok(())),
                Ok(Some(Err(e))) => break Some(format!("body broke: {e}")),
                Err(_) => break Some(format!("no body bytes for {:?}", s3.options.idle_timeout)),
            }
        };
        if let Some(reason) = broke {
            resuming = true;
            if let Err(error) = retries.wait(url, position, reason).await {
                return Ok(Err(error));
            }
            counters.add(Counter::Retries, 1);
            counters.add(Counter::Resumes, 1);
        }
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
    tx: &Sender<ChunkResult>,
) -> Result<(), ConsumerGone> {
    fetcher.count(Counter::ShardsOpened, 1);
    let url = unit.url.as_str();
    let range = unit
        .range
        .clone()
        .unwrap_or(0..unit.size.unwrap_or(u64::MAX));
    let known_len = (range.end != u64::MAX).then(|| range.end - range.start);
    let part = part_bytes(fetcher, &s3.options);
    if s3.options.max_concurrency > 1 && known_len.is_none_or(|len| len > part) {
        return read_parts(fetcher, s3, url, (bucket, key), range, part, tx).await;
    }
    let mut target = Target::Chunks {
        tx,
        budget: &fetcher.budget,
        chunk_bytes: fetcher.chunk_bytes,
        chunk: Vec::new(),
        permit: None,
    };
    let mut pinned = Pinned::default();
    let result = match stream_range(
        s3,
        &fetcher.counters,
        url,
        (bucket, key),
        range,
        &mut pinned,
        &mut target,
    )
    .await
    {
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

/// Parallel ranged GETs of `part` bytes, at most `max_concurrency` at once,
/// each holding its share of the read-ahead budget, sent in order. The first
/// part goes alone, to learn the ETag every other part is pinned to and, for
/// a whole object of unknown size, the size.
async fn read_parts(
    fetcher: &Fetcher,
    s3: &Arc<S3Client>,
    url: &str,
    (bucket, key): (&str, &str),
    range: Range<u64>,
    part: u64,
    tx: &Sender<ChunkResult>,
) -> Result<(), ConsumerGone> {
    let first = range.start..range.start.saturating_add(part).min(range.end);
    let Some(permit) = fetcher.reserve((first.end - first.start) as usize).await else {
        return Err(ConsumerGone);
    };
    let mut pinned = Pinned::default();
    let mut buffer = Target::Buffer(Vec::new());
    match stream_range(
        s3,
        &fetcher.counters,
        url,
        (bucket, key),
        first.clone(),
        &mut pinned,
        &mut buffer,
    )
    .await?
    {
        Ok(()) => {
            let Target::Buffer(bytes) = buffer else {
                unreachable!("a buffer target")
            };
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
    let end = match (range.end, pinned.size) {
        (u64::MAX, Some(size)) => size,
        (u64::MAX, None) => first.end,
        (end, _) => end,
    };
    let mut parts = (first.end..end)
        .step_by(usize::try_from(part).unwrap_or(usize::MAX))
        .map(|start| start..(start + part).min(end))
        .peekable();
    let mut in_flight = VecDeque::new();
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
                next,
                pinned.clone(),
            ));
            in_flight.push_back((task, permit));
        }
        let Some((task, permit)) = in_flight.pop_front() else {
            return Ok(());
        };
        let result = task
            .await
            .unwrap_or_else(|e| Err(Error::Stopped(format!("part task failed: {e}"))));
        if !send_part(tx, result, permit) {
            return Ok(());
        }
    }
}

/// Sends a part (or its error); `false` when reading must stop.
fn send_part(
    tx: &Sender<ChunkResult>,
    part: Result<Vec<u8>, Error>,
    permit: OwnedSemaphorePermit,
) -> bool {
    match part {
        Ok(bytes) => tx.send(Ok(Chunk::read(bytes, permit))).is_ok(),
        Err(error) => {
            let _ = tx.send(Err(error));
            false
        }
    }
}

/// One part of a parallel read, into memory.
async fn fetch_part(
    s3: Arc<S3Client>,
    counters: Arc<Counters>,
    url: String,
    (bucket, key): (String, String),
    range: Range<u64>,
    mut pinned: Pinned,
) -> Result<Vec<u8>, Error> {
    let mut buffer = Target::Buffer(Vec::with_capacity((range.end - range.start) as usize));
    match stream_range(
        &s3,
        &counters,
        &url,
        (&bucket, &key),
        range,
        &mut pinned,
        &mut buffer,
    )
    .await
    {
        Ok(Ok(())) => match buffer {
            Target::Buffer(bytes) => Ok(bytes),
            Target::Chunks { .. } => unreachable!("a part reads into a buffer"),
        },
        Ok(Err(error)) => Err(error),
        Err(ConsumerGone) => Err(Error::Stopped("stream cancelled".into())),
    }
}
