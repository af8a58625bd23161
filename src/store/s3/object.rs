//! S3 objects read by byte ranges ([`RangedObject`]): one GET of a range,
//! pinned to the first ETag (If-Match), its answer checked to hold exactly
//! the bytes asked for.

use std::sync::Arc;

use aws_sdk_s3::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_s3::operation::get_object::{GetObjectError, GetObjectOutput};
use aws_sdk_s3::primitives::ByteStream;

use super::S3Client;
use crate::config::Transport;
use crate::error::Error;
use crate::stats::Counters;
use crate::store::ranged::{
    check_response, error_chain, Answer, Body, Failure, NextBytes, Pinned, RangedObject,
};

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
    match tokio::time::timeout(s3.options.transport.first_byte_timeout, request.send()).await {
        Ok(result) => result,
        Err(_) => Err(SdkError::timeout_error(format!(
            "no response within {:?}",
            s3.options.transport.first_byte_timeout
        ))),
    }
}

/// Takes an answer for the read of `url` at `position` (to `end`; with
/// `clamp`, or without `end`, the object may end first) if it carries the
/// bytes asked for and fits what is known of the object; gives where the
/// read stops and where the answer's body ends.
pub(super) fn accept(
    url: &str,
    position: u64,
    (end, clamp): (Option<u64>, bool),
    output: &GetObjectOutput,
    pinned: &mut Pinned,
) -> Result<(u64, u64), Failure> {
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
                "the object is {} bytes, not the {size} bytes it was listed with or that its \
                 manifest records: it changed since (if a manifest describes it, run \
                 `shardstream index` again)",
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
    let stop = match end {
        None => served.size,
        Some(end) if end <= served.size => end,
        Some(_) if clamp => served.size,
        Some(end) => {
            return Err(invalid(format!(
                "bytes up to byte offset {end} were asked for, the object holds {}",
                served.size
            )))
        }
    };
    Ok((stop, served.body_end))
}

/// One object being read: its client, counters, URL, bucket and key.
struct S3Object {
    s3: Arc<S3Client>,
    counters: Arc<Counters>,
    url: String,
    bucket: String,
    key: String,
}

impl Body for ByteStream {
    fn next_bytes(&mut self) -> NextBytes<'_> {
        Box::pin(async move {
            self.next()
                .await
                .map(|result| result.map_err(|e| error_chain(&e)))
        })
    }
}

impl RangedObject for S3Object {
    fn url(&self) -> &str {
        &self.url
    }

    fn transport(&self) -> &Transport {
        &self.s3.options.transport
    }

    fn counters(&self) -> &Counters {
        &self.counters
    }

    /// One GET pinned to the first ETag seen (If-Match), its answer checked
    /// with [`check_response`].
    async fn get(
        &self,
        position: u64,
        end: Option<u64>,
        clamp: bool,
        pinned: &mut Pinned,
    ) -> Result<Option<Answer>, Failure> {
        let S3Object {
            s3,
            url,
            bucket,
            key,
            ..
        } = self;
        if let Some(error) = s3.known_credentials_failure(url) {
            return Err(Failure::Fatal(error));
        }
        match get(s3, bucket, key, position, end, pinned.etag.as_deref()).await {
            Ok(output) => {
                let (stop, body_end) = accept(url, position, (end, clamp), &output, pinned)?;
                Ok(Some(Answer {
                    stop,
                    skip: 0,
                    body_end,
                    body: Box::new(output.body),
                }))
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
                Ok(None)
            }
            Err(error) => Err(s3.classify(url, position, &error)),
        }
    }
}

impl S3Client {
    /// The object `key` of `bucket` (at `url`, for errors), to be read by
    /// ranges, its reads counted in `counters`.
    pub(crate) fn object(
        self: &Arc<Self>,
        counters: Arc<Counters>,
        url: &str,
        (bucket, key): (&str, &str),
    ) -> Arc<impl RangedObject> {
        Arc::new(S3Object {
            s3: self.clone(),
            counters,
            url: url.to_owned(),
            bucket: bucket.to_owned(),
            key: key.to_owned(),
        })
    }
}
