//! The values of dataset options that are more than a number: the error
//! policy, the field decoders, the table output and the HTTP(S) headers.

use crate::decode::Decoder;
use crate::error::{Error, Result};

/// What to do when a shard is missing, unreadable or malformed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnError {
    /// End the stream with the error.
    Raise,
    /// Skip the rest of the bad shard, report a warning and count it.
    Warn,
}

impl std::str::FromStr for OnError {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        [OnError::Raise, OnError::Warn]
            .into_iter()
            .find(|policy| policy.name() == s)
            .ok_or_else(|| Error::Config {
                name: "on_error",
                reason: format!("expected \"raise\" or \"warn\", got {s:?}"),
            })
    }
}

impl OnError {
    /// The policy's name, as the `on_error` option takes it.
    pub fn name(self) -> &'static str {
        match self {
            OnError::Raise => "raise",
            OnError::Warn => "warn",
        }
    }
}

/// Which decoder each field goes through; fields without one stay bytes.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FieldDecoders {
    /// Decoders chosen by field name.
    pub by_field: Vec<(String, Decoder)>,
    /// Fields not named in `by_field` take the default of their extension
    /// ([`crate::decode::default_for`]).
    pub defaults: bool,
}

impl FieldDecoders {
    /// The defaults by extension for every field.
    pub fn defaults() -> Self {
        FieldDecoders {
            by_field: Vec::new(),
            defaults: true,
        }
    }

    /// The decoder of `field`, if any.
    pub fn decoder_for(&self, field: &str) -> Option<Decoder> {
        match self.by_field.iter().find(|(name, _)| name == field) {
            Some((_, decoder)) => Some(decoder.clone()),
            None if self.defaults => crate::decode::default_for(field),
            None => None,
        }
    }

    /// Whether no field is decoded.
    pub fn is_empty(&self) -> bool {
        self.by_field.is_empty() && !self.defaults
    }
}

/// How rows of a table (Parquet) are handed out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TableOutput {
    /// One sample per row.
    #[default]
    Rows,
    /// Arrow record batches as they are decoded, rows in file order.
    Arrow,
}

impl TableOutput {
    /// The output's name, as the `batch_format` option takes it.
    pub fn name(self) -> &'static str {
        match self {
            TableOutput::Rows => "dict",
            TableOutput::Arrow => "arrow",
        }
    }
}

impl std::str::FromStr for TableOutput {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        [TableOutput::Rows, TableOutput::Arrow]
            .into_iter()
            .find(|output| output.name() == s)
            .ok_or_else(|| Error::Config {
                name: "batch_format",
                reason: format!("expected \"dict\" or \"arrow\", got {s:?}"),
            })
    }
}

/// Headers sent with every HTTP(S) request to a shard's own origin (never
/// to another host a redirect leads to). Values may be secrets: they are
/// never shown (`Debug` prints the names only) nor put in an error.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct HttpHeaders(pub Vec<(String, String)>);

impl std::fmt::Debug for HttpHeaders {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map()
            .entries(self.0.iter().map(|(name, _)| (name, "<hidden>")))
            .finish()
    }
}

impl HttpHeaders {
    /// Checks that every name and value can be sent, naming the header
    /// (never its value) that cannot.
    pub fn validate(&self) -> Result<()> {
        for (name, value) in &self.0 {
            let bad = |reason: String| Error::Config {
                name: "http_headers",
                reason,
            };
            let parsed = http::HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| bad(format!("{name:?} is not a valid header name")))?;
            if http::HeaderValue::from_str(value).is_err() {
                return Err(bad(format!(
                    "the value of {name:?} is not a valid header value (visible ASCII only, \
                     no line breaks)"
                )));
            }
            if [
                http::header::RANGE,
                http::header::IF_MATCH,
                http::header::HOST,
            ]
            .contains(&parsed)
            {
                return Err(bad(format!("{name:?} is set by shardstream itself")));
            }
        }
        Ok(())
    }
}
