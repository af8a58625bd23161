//! [`StreamOptionsBuilder`]: stream options set one at a time, every
//! option checked at [`StreamOptionsBuilder::build`].

use std::time::Duration;

use crate::error::{Error, Result};
use crate::plan::Remainder;

use super::store::StoreOptions;
use super::stream::{CacheOptions, StreamOptions, MAX_BUDGET_BYTES, MAX_ITEMS};
use super::values::{FieldDecoders, HttpHeaders, OnError, TableOutput};

impl StreamOptions {
    /// Starts a builder with the defaults.
    pub fn builder() -> StreamOptionsBuilder {
        StreamOptionsBuilder {
            options: StreamOptions::default(),
        }
    }
}

/// Builder for [`StreamOptions`]; [`StreamOptionsBuilder::build`] validates.
#[derive(Debug, Clone)]
pub struct StreamOptionsBuilder {
    options: StreamOptions,
}

impl StreamOptionsBuilder {
    /// Sets the seed.
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.options.seed = seed;
        self
    }

    /// Turns per-epoch shard shuffling on or off.
    pub fn with_shuffle_shards(mut self, on: bool) -> Self {
        self.options.shuffle_shards = on;
        self
    }

    /// Sets the shuffle buffer size in samples (0 disables it).
    pub fn with_shuffle_buffer(mut self, samples: usize) -> Self {
        self.options.shuffle_buffer = samples;
        self
    }

    /// Sets the shuffle buffer's byte budget.
    pub fn with_shuffle_buffer_bytes(mut self, bytes: usize) -> Self {
        self.options.shuffle_buffer_bytes = bytes;
        self
    }

    /// Sets how many samples the shuffle buffer holds before its first
    /// sample leaves (it then grows to `shuffle_buffer`).
    pub fn with_shuffle_initial(mut self, samples: usize) -> Self {
        self.options.shuffle_initial = samples;
        self
    }

    /// Sets the read-ahead byte budget (`None`: set by the number of
    /// processes that read).
    pub fn with_read_ahead_bytes(mut self, bytes: Option<usize>) -> Self {
        self.options.read_ahead_bytes = bytes;
        self
    }

    /// Sets the size of one read.
    pub fn with_chunk_bytes(mut self, bytes: usize) -> Self {
        self.options.chunk_bytes = bytes;
        self
    }

    /// Sets how many samples wait for the consumer.
    pub fn with_output_queue(mut self, samples: usize) -> Self {
        self.options.output_queue = samples;
        self
    }

    /// Sets the samples the consumer takes at a time (see
    /// [`StreamOptions::output_batch`]).
    pub fn with_output_batch(mut self, samples: usize) -> Self {
        self.options.output_batch = samples;
        self
    }

    /// Sets the longest wait for the next bytes of a shard.
    pub fn with_io_timeout(mut self, timeout: Duration) -> Self {
        self.options.io_timeout = timeout;
        self
    }

    /// Sets the error policy.
    pub fn with_on_error(mut self, policy: OnError) -> Self {
        self.options.on_error = policy;
        self
    }

    /// Sets the remainder policy of equal-length epochs.
    pub fn with_remainder(mut self, remainder: Remainder) -> Self {
        self.options.remainder = remainder;
        self
    }

    /// Sets how to reach S3 (keeping the HTTP headers set, unless `s3` has some).
    pub fn with_store(mut self, mut s3: StoreOptions) -> Self {
        if s3.transport.http_headers.0.is_empty() {
            s3.transport.http_headers =
                std::mem::take(&mut self.options.store.transport.http_headers);
        }
        self.options.store = s3;
        self
    }

    /// Sets the headers of HTTP(S) requests.
    pub fn with_http_headers(mut self, headers: HttpHeaders) -> Self {
        self.options.store.transport.http_headers = headers;
        self
    }

    /// Sets the cache of remote shards.
    pub fn with_cache(mut self, cache: Option<CacheOptions>) -> Self {
        self.options.cache = cache;
        self
    }

    /// Sets the field decoders.
    pub fn with_decode(mut self, decode: FieldDecoders) -> Self {
        self.options.decode = decode;
        self
    }

    /// Sets the threads that decode a stream's fields (`None`: as many as
    /// the cores allow, shared among the processes that decode).
    pub fn with_decode_threads(mut self, threads: Option<usize>) -> Self {
        self.options.decode_threads = threads;
        self
    }

    /// Sets the table columns to read.
    pub fn with_columns(mut self, columns: Option<Vec<String>>) -> Self {
        self.options.columns = columns;
        self
    }

    /// Sets how table rows are handed out.
    pub fn with_table_output(mut self, output: TableOutput) -> Self {
        self.options.table_output = output;
        self
    }

    /// Sets the rows per decoded table batch.
    pub fn with_batch_rows(mut self, rows: usize) -> Self {
        self.options.batch_rows = rows;
        self
    }

    /// Turns the per-sample `__seed__` field on or off.
    pub fn with_sample_seed(mut self, on: bool) -> Self {
        self.options.sample_seed = on;
        self
    }

    /// Turns the per-sample `__id__` field on or off.
    pub fn with_sample_ids(mut self, on: bool) -> Self {
        self.options.sample_ids = on;
        self
    }

    /// Packs each document's token ids into fixed-length sequences (`None`:
    /// hands out the documents).
    pub fn with_pack(mut self, pack: Option<crate::text::pack::PackSpec>) -> Self {
        self.options.pack = pack.map(std::sync::Arc::new);
        self
    }

    /// Validates and returns the options.
    pub fn build(self) -> Result<StreamOptions> {
        let o = self.options;
        let positive = |name: &'static str, value: usize| {
            if value == 0 {
                Err(Error::Config {
                    name,
                    reason: "must be at least 1".into(),
                })
            } else {
                Ok(())
            }
        };
        positive("shuffle_buffer_bytes", o.shuffle_buffer_bytes)?;
        positive("shuffle_initial", o.shuffle_initial)?;
        if let Some(bytes) = o.read_ahead_bytes {
            positive("read_ahead_bytes", bytes)?;
        }
        positive("chunk_bytes", o.chunk_bytes)?;
        positive("output_queue", o.output_queue)?;
        positive("batch_rows", o.batch_rows)?;
        if let Some(threads) = o.decode_threads {
            positive("decode_threads", threads)?;
        }
        if o.table_output == TableOutput::Arrow && o.shuffle_buffer > 0 {
            return Err(Error::Config {
                name: "shuffle_buffer",
                reason: "Arrow batches keep their rows in file order: set shuffle_buffer=0 \
                         (row groups are still shuffled with shuffle_shards)"
                    .into(),
            });
        }
        if o.table_output == TableOutput::Arrow && !o.decode.is_empty() {
            return Err(Error::Config {
                name: "decode",
                reason: "field decoders apply to per-row output, not to Arrow batches".into(),
            });
        }
        if o.table_output == TableOutput::Arrow && o.sample_seed {
            return Err(Error::Config {
                name: "sample_seed",
                reason: "it adds a field to each sample, and Arrow batches hand out rows \
                         without per-sample fields: use batch_format=\"dict\""
                    .into(),
            });
        }
        if o.table_output == TableOutput::Arrow && o.sample_ids {
            return Err(Error::Config {
                name: "sample_ids",
                reason: "it adds a field to each sample, and Arrow batches hand out rows \
                         without per-sample fields: use batch_format=\"dict\""
                    .into(),
            });
        }
        o.store.validate()?;
        let o = check_pack(o)?;
        for (name, value) in [
            ("read_ahead_bytes", o.read_ahead_bytes.unwrap_or(0)),
            ("shuffle_buffer_bytes", o.shuffle_buffer_bytes),
        ] {
            if value as u64 > MAX_BUDGET_BYTES {
                return Err(Error::Config {
                    name,
                    reason: format!("must be at most {MAX_BUDGET_BYTES} (1 TiB), got {value}"),
                });
            }
        }
        for (name, value) in [
            ("shuffle_buffer", o.shuffle_buffer),
            ("shuffle_initial", o.shuffle_initial),
            ("output_queue", o.output_queue),
            ("batch_size", o.output_batch),
            ("batch_rows", o.batch_rows),
        ] {
            if value as u64 > MAX_ITEMS {
                return Err(Error::Config {
                    name,
                    reason: format!("must be at most {MAX_ITEMS}, got {value}"),
                });
            }
        }
        if o.chunk_bytes > u32::MAX as usize {
            return Err(Error::Config {
                name: "chunk_bytes",
                reason: format!("must be at most {}", u32::MAX),
            });
        }
        if o.io_timeout.is_zero() {
            return Err(Error::Config {
                name: "io_timeout",
                reason: "must be positive".into(),
            });
        }
        Ok(o)
    }
}

/// With `pack` and no field named, the field that `decode` tokenizes: the
/// one `Tokenizer` among the decoders, or a `Config` error saying what to
/// name. `pack` with Arrow batches is refused (it packs documents), and so
/// is `sample_seed` (a sequence holds pieces of several documents; with
/// `sample_ids` each sequence names the documents it ends), and so is
/// `remainder="pad"`, which would do nothing: packed ranks take equal
/// sequences planned from the token counts, not equal documents.
fn check_pack(mut o: StreamOptions) -> Result<StreamOptions> {
    let Some(spec) = &o.pack else {
        return Ok(o);
    };
    if o.remainder == Remainder::Pad {
        return Err(Error::Config {
            name: "remainder",
            reason: "\"pad\" fills the last rank with documents again, and with pack the ranks \
                     take equal numbers of sequences planned from the token counts, the rest \
                     left out: nothing to pad; leave remainder=\"drop\""
                .into(),
        });
    }
    if o.sample_seed {
        return Err(Error::Config {
            name: "sample_seed",
            reason: "it adds a field to each document, and with pack the stream hands out \
                     sequences holding pieces of several documents"
                .into(),
        });
    }
    if o.table_output == TableOutput::Arrow {
        return Err(Error::Config {
            name: "pack",
            reason: "it packs documents handed out one by one, and Arrow batches hand out rows: \
                     use batch_format=\"dict\""
                .into(),
        });
    }
    if spec.field.is_some() {
        return Ok(o);
    }
    let tokenized: Vec<&str> = o
        .decode
        .by_field
        .iter()
        .filter(|(_, decoder)| matches!(decoder, crate::decode::Decoder::Tokenizer(_)))
        .map(|(field, _)| field.as_str())
        .collect();
    let field = match tokenized[..] {
        [field] => field.to_owned(),
        [] => {
            return Err(Error::Config {
                name: "pack",
                reason:
                    "no field is tokenized: add decode={\"text\": shardstream.Tokenizer(...)}, \
                         or name the field of token ids with Pack(field=...)"
                        .into(),
            })
        }
        _ => {
            return Err(Error::Config {
                name: "pack",
                reason: format!(
                    "several fields are tokenized ({}): name the one to pack with Pack(field=...)",
                    tokenized.join(", ")
                ),
            })
        }
    };
    let mut resolved = (**spec).clone();
    resolved.field = Some(field);
    o.pack = Some(std::sync::Arc::new(resolved));
    Ok(o)
}

#[cfg(test)]
mod tests {
    use super::super::store::Transport;
    use super::*;

    /// The option named by the error of building with `s3`.
    fn refused(s3: StoreOptions) -> &'static str {
        match StreamOptions::builder().with_store(s3.clone()).build() {
            Err(Error::Config { name, reason }) => {
                // The same from the store options alone (listing, HEAD).
                assert!(matches!(s3.validate(), Err(Error::Config { name: n, .. }) if n == name));
                assert!(!reason.is_empty());
                name
            }
            Err(other) => panic!("not a config error: {other}"),
            Ok(_) => panic!("accepted: {s3:?}"),
        }
    }

    #[test]
    fn the_read_ahead_budget_is_the_option_or_set_by_the_processes_that_read() {
        use super::super::stream::{READ_AHEAD_BYTES, READ_AHEAD_BYTES_ALONE};
        let auto = StreamOptions::builder().build().unwrap();
        assert_eq!(auto.read_ahead_bytes, None);
        for (workers, budget) in [
            (0, READ_AHEAD_BYTES_ALONE),
            (1, READ_AHEAD_BYTES_ALONE),
            (2, READ_AHEAD_BYTES),
            (16, READ_AHEAD_BYTES),
        ] {
            assert_eq!(auto.read_ahead_budget(workers), budget, "{workers}");
        }
        let given = StreamOptions::builder()
            .with_read_ahead_bytes(Some(5 << 20))
            .build()
            .unwrap();
        assert_eq!(given.read_ahead_budget(0), 5 << 20);
        assert_eq!(given.read_ahead_budget(8), 5 << 20);
        for refused in [0, (1 << 40) + 1] {
            let built = StreamOptions::builder()
                .with_read_ahead_bytes(Some(refused))
                .build();
            assert!(
                matches!(
                    built,
                    Err(Error::Config {
                        name: "read_ahead_bytes",
                        ..
                    })
                ),
                "{refused}"
            );
        }
    }

    #[test]
    fn s3_options_out_of_the_range_the_code_can_use_are_refused_by_name() {
        let s3 = Transport::default;
        assert!(s3().validate().is_ok());
        let huge = Duration::from_secs(u64::MAX);
        let cases = [
            (
                Transport {
                    part_size: 0,
                    ..s3()
                },
                "part_size",
            ),
            (
                Transport {
                    part_size: 1 << 32,
                    ..s3()
                },
                "part_size",
            ),
            (
                Transport {
                    part_size: usize::MAX,
                    ..s3()
                },
                "part_size",
            ),
            (
                Transport {
                    max_concurrency: 0,
                    ..s3()
                },
                "max_concurrency",
            ),
            (
                Transport {
                    max_concurrency: usize::MAX,
                    ..s3()
                },
                "max_concurrency",
            ),
            (
                Transport {
                    max_attempts: 0,
                    ..s3()
                },
                "max_attempts",
            ),
            (
                Transport {
                    max_attempts: u32::MAX,
                    ..s3()
                },
                "max_attempts",
            ),
            (
                Transport {
                    connect_timeout: Duration::ZERO,
                    ..s3()
                },
                "connect_timeout",
            ),
            (
                Transport {
                    connect_timeout: huge,
                    ..s3()
                },
                "connect_timeout",
            ),
            (
                Transport {
                    first_byte_timeout: huge,
                    ..s3()
                },
                "first_byte_timeout",
            ),
            (
                Transport {
                    idle_timeout: Duration::ZERO,
                    ..s3()
                },
                "idle_timeout",
            ),
            (
                Transport {
                    max_retry_time: huge,
                    ..s3()
                },
                "max_retry_time",
            ),
            (
                Transport {
                    backoff_base: Duration::MAX,
                    ..s3()
                },
                "backoff_base",
            ),
            (
                Transport {
                    backoff_max: Duration::MAX,
                    ..s3()
                },
                "backoff_max",
            ),
        ];
        for (transport, name) in cases {
            let options = StoreOptions {
                transport,
                ..StoreOptions::default()
            };
            assert_eq!(refused(options), name);
        }
        let largest = Transport {
            part_size: Transport::MAX_PART_SIZE,
            max_concurrency: Transport::MAX_CONCURRENCY,
            max_attempts: Transport::MAX_ATTEMPTS,
            idle_timeout: Transport::MAX_DURATION,
            max_retry_time: Duration::ZERO,
            ..s3()
        };
        assert!(largest.validate().is_ok());
    }
}
