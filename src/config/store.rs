//! How remote stores are reached: [`StoreOptions`] (S3's region, endpoint,
//! profile) and the [`Transport`] every store reads with (timeouts,
//! retries, part size, concurrency, headers), each checked against the
//! range the code can use.

use std::time::Duration;

use crate::error::{Error, Result};

use super::values::HttpHeaders;

/// How every remote store is read: timeouts, retries, part size and
/// concurrency of S3, HTTP(S), GCS and Hub requests alike, and the headers
/// HTTP(S) requests add. Set through `S3Config` (`S3_OPTIONS`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transport {
    /// Longest wait to connect.
    pub connect_timeout: Duration,
    /// Longest wait for a response's headers.
    pub first_byte_timeout: Duration,
    /// Longest wait for the next bytes of a body.
    pub idle_timeout: Duration,
    /// Attempts per request, the first included.
    pub max_attempts: u32,
    /// Longest time spent retrying one request.
    pub max_retry_time: Duration,
    /// First backoff step; doubles per attempt, up to `backoff_max`.
    pub backoff_base: Duration,
    /// Largest backoff step.
    pub backoff_max: Duration,
    /// The largest ranged GET. Remote objects are read as parts: an
    /// object's first part is at most 256 KiB, each next one twice the one
    /// before, up to this size, or less so that 32 parts fit in the
    /// read-ahead budget.
    pub part_size: usize,
    /// Ranged GETs in flight at once per reading process (per DataLoader
    /// worker), across objects, at most. 1 reads one object at a time, as
    /// one streaming GET.
    pub max_concurrency: usize,
    /// Headers of HTTP(S) requests (not sent to S3).
    pub http_headers: HttpHeaders,
}

impl Transport {
    /// The largest part: the read-ahead budget is taken a part at a time,
    /// in permits counted in `u32`.
    pub const MAX_PART_SIZE: usize = u32::MAX as usize;
    /// The most ranged GETs in flight at once.
    pub const MAX_CONCURRENCY: usize = 256;
    /// The most attempts per request.
    pub const MAX_ATTEMPTS: u32 = 1000;
    /// The longest timeout, retry time or backoff step: a year.
    pub const MAX_DURATION: Duration = Duration::from_secs(365 * 24 * 3600);

    /// Checks every option against the range the code can use, naming the
    /// first one out of range.
    pub fn validate(&self) -> Result<()> {
        let out_of_range = |name: &'static str, reason: String| Err(Error::Config { name, reason });
        if !(1..=Self::MAX_PART_SIZE).contains(&self.part_size) {
            return out_of_range(
                "part_size",
                format!(
                    "must be from 1 to {} bytes (4 GiB - 1), got {}",
                    Self::MAX_PART_SIZE,
                    self.part_size
                ),
            );
        }
        if !(1..=Self::MAX_CONCURRENCY).contains(&self.max_concurrency) {
            return out_of_range(
                "max_concurrency",
                format!(
                    "must be from 1 to {}, got {}",
                    Self::MAX_CONCURRENCY,
                    self.max_concurrency
                ),
            );
        }
        if !(1..=Self::MAX_ATTEMPTS).contains(&self.max_attempts) {
            return out_of_range(
                "max_attempts",
                format!(
                    "must be from 1 to {}, got {}",
                    Self::MAX_ATTEMPTS,
                    self.max_attempts
                ),
            );
        }
        let durations = [
            ("connect_timeout", self.connect_timeout, true),
            ("first_byte_timeout", self.first_byte_timeout, true),
            ("idle_timeout", self.idle_timeout, true),
            ("max_retry_time", self.max_retry_time, false),
            ("backoff_base", self.backoff_base, false),
            ("backoff_max", self.backoff_max, false),
        ];
        for (name, value, positive) in durations {
            if value > Self::MAX_DURATION {
                return out_of_range(
                    name,
                    format!(
                        "must be at most {} seconds (a year), got {} seconds",
                        Self::MAX_DURATION.as_secs(),
                        value.as_secs_f64()
                    ),
                );
            }
            if positive && value.is_zero() {
                return out_of_range(name, "must be more than 0 seconds".into());
            }
        }
        self.http_headers.validate()
    }
}

impl Default for Transport {
    fn default() -> Self {
        Transport {
            connect_timeout: Duration::from_secs(10),
            first_byte_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(30),
            max_attempts: 10,
            max_retry_time: Duration::from_secs(120),
            backoff_base: Duration::from_millis(50),
            backoff_max: Duration::from_secs(5),
            part_size: 8 << 20,
            max_concurrency: 64,
            http_headers: HttpHeaders::default(),
        }
    }
}

/// How remote stores are reached: S3's (or an S3-compatible store's)
/// region, endpoint, addressing, profile and signing, and the [`Transport`]
/// every store reads with. S3 credentials come from the default chain:
/// environment, shared config and credentials files, SSO, web identity,
/// IMDS and ECS roles.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoreOptions {
    /// Region; `None` takes it from the environment or profile (else `us-east-1`).
    pub region: Option<String>,
    /// Endpoint URL of an S3-compatible store; `None` takes `AWS_ENDPOINT_URL` or AWS.
    pub endpoint_url: Option<String>,
    /// Path-style addressing (`endpoint/bucket/key`).
    pub path_style: bool,
    /// Named profile of the shared config files.
    pub profile: Option<String>,
    /// Send unsigned requests (public buckets).
    pub unsigned: bool,
    /// Timeouts, retries, parts and concurrency of every store.
    pub transport: Transport,
}

impl StoreOptions {
    /// Checks every option against the range the code can use, naming the
    /// first one out of range.
    pub fn validate(&self) -> Result<()> {
        self.transport.validate()
    }
}
