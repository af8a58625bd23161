//! A dataset's options ([`DatasetOptions`]): its stream's, and those that
//! decide how it is resolved and handed out (the manifest, the format,
//! batches, counting, the cache). Every check across options is made by
//! [`DatasetOptionsBuilder::build`], once, whoever builds them (the Python
//! bindings, the command line); the fields are private, so a
//! `DatasetOptions` has always been checked. Building has no side effect:
//! the cache directory is prepared by whoever uses it.

use std::path::PathBuf;

use crate::config::{CacheOptions, StreamOptions, StreamOptionsBuilder, TableOutput};
use crate::error::{Error, Result};
use crate::manifest::ManifestChoice;
use crate::spec::DatasetFormat;

/// Every option of a dataset, checked.
#[derive(Debug, Clone)]
pub struct DatasetOptions {
    stream: StreamOptions,
    manifest: ManifestChoice,
    format: DatasetFormat,
    batch_size: Option<usize>,
    pack_bytes: bool,
    count_samples: Option<bool>,
    model_parallel_size: usize,
}

impl DatasetOptions {
    /// A builder over `stream` (the options of each slot's stream, set
    /// one by one), the others at their defaults.
    pub fn builder(stream: StreamOptionsBuilder) -> DatasetOptionsBuilder {
        DatasetOptionsBuilder {
            stream,
            manifest: ManifestChoice::Auto,
            format: DatasetFormat::default(),
            batch_size: None,
            pack_bytes: false,
            table_output: TableOutput::default(),
            count_samples: None,
            model_parallel_size: 1,
            cache_dir: None,
            cache_limit_bytes: None,
        }
    }

    /// The options of each slot's stream.
    pub fn stream(&self) -> &StreamOptions {
        &self.stream
    }

    /// Which manifest describes the shards.
    pub fn manifest(&self) -> &ManifestChoice {
        &self.manifest
    }

    /// What the shards hold.
    pub fn format(&self) -> DatasetFormat {
        self.format
    }

    /// Samples per collated batch, when dict batches are handed out.
    pub fn batch_size(&self) -> Option<usize> {
        self.batch_size
    }

    /// Whether each bytes field of a batch is packed into one buffer.
    pub fn pack_bytes(&self) -> bool {
        self.pack_bytes
    }

    /// Whether local tar shards no manifest describes are counted: `None`
    /// when a layout of several ranks needs the counts, else always or never.
    pub fn count_samples(&self) -> Option<bool> {
        self.count_samples
    }

    /// Ranks per model-parallel group (which read the same samples).
    pub fn model_parallel_size(&self) -> usize {
        self.model_parallel_size
    }
}

/// Builder of [`DatasetOptions`]; [`DatasetOptionsBuilder::build`] checks.
#[derive(Debug, Clone)]
pub struct DatasetOptionsBuilder {
    stream: StreamOptionsBuilder,
    manifest: ManifestChoice,
    format: DatasetFormat,
    batch_size: Option<usize>,
    pack_bytes: bool,
    table_output: TableOutput,
    count_samples: Option<bool>,
    model_parallel_size: usize,
    cache_dir: Option<PathBuf>,
    cache_limit_bytes: Option<u64>,
}

impl DatasetOptionsBuilder {
    /// Sets the options of each slot's stream.
    pub fn with_stream(mut self, stream: StreamOptionsBuilder) -> Self {
        self.stream = stream;
        self
    }

    /// Sets which manifest describes the shards.
    pub fn with_manifest(mut self, manifest: ManifestChoice) -> Self {
        self.manifest = manifest;
        self
    }

    /// Sets what the shards hold.
    pub fn with_format(mut self, format: DatasetFormat) -> Self {
        self.format = format;
        self
    }

    /// Sets the samples per batch (`None`: samples one by one).
    pub fn with_batch_size(mut self, batch_size: Option<usize>) -> Self {
        self.batch_size = batch_size;
        self
    }

    /// Packs each bytes field of a batch into one buffer.
    pub fn with_pack_bytes(mut self, pack_bytes: bool) -> Self {
        self.pack_bytes = pack_bytes;
        self
    }

    /// Sets how a table's rows are handed out.
    pub fn with_table_output(mut self, output: TableOutput) -> Self {
        self.table_output = output;
        self
    }

    /// Sets whether local tar shards are counted (`None`: when needed).
    pub fn with_count_samples(mut self, count: Option<bool>) -> Self {
        self.count_samples = count;
        self
    }

    /// Sets the ranks per model-parallel group.
    pub fn with_model_parallel_size(mut self, size: usize) -> Self {
        self.model_parallel_size = size;
        self
    }

    /// Sets the node-local cache directory (`None`: no cache).
    pub fn with_cache_dir(mut self, dir: Option<PathBuf>) -> Self {
        self.cache_dir = dir;
        self
    }

    /// Sets the most bytes the cache keeps (`None`: no limit).
    pub fn with_cache_limit_bytes(mut self, limit: Option<u64>) -> Self {
        self.cache_limit_bytes = limit;
        self
    }

    /// Checks every option, alone and against the others, naming the first
    /// one that is wrong; the options, once they all hold.
    pub fn build(self) -> Result<DatasetOptions> {
        let bad = |name: &'static str, reason: &str| Error::Config {
            name,
            reason: reason.to_owned(),
        };
        if self.batch_size == Some(0) {
            return Err(bad(
                "batch_size",
                "expected None or an int of at least 1, got 0",
            ));
        }
        if self.model_parallel_size == 0 {
            return Err(bad(
                "model_parallel_size",
                "expected an int of at least 1, got 0",
            ));
        }
        if self.cache_limit_bytes == Some(0) {
            return Err(bad(
                "cache_limit_bytes",
                "expected None or an int of at least 1, got 0",
            ));
        }
        if self.cache_limit_bytes.is_some() && self.cache_dir.is_none() {
            return Err(bad(
                "cache_limit_bytes",
                "it limits the cache, and cache_dir is not given",
            ));
        }
        let arrow = self.table_output == TableOutput::Arrow;
        for (format, name) in [(DatasetFormat::Tar, "tar"), (DatasetFormat::Raw, "raw")] {
            if arrow && self.format == format {
                return Err(Error::Config {
                    name: "batch_format",
                    reason: format!("\"arrow\" is for Parquet datasets, and format is \"{name}\""),
                });
            }
        }
        if self.pack_bytes && arrow {
            return Err(bad(
                "pack_bytes",
                "it packs the bytes fields of dict batches, and batch_format is \"arrow\"",
            ));
        }
        if self.pack_bytes && self.batch_size.is_none() {
            return Err(bad(
                "pack_bytes",
                "it packs the bytes fields of the batches batch_size makes, and batch_size is \
                 not given",
            ));
        }
        let mut stream = self.stream.with_table_output(self.table_output);
        match (self.batch_size, arrow) {
            (Some(rows), true) => stream = stream.with_batch_rows(rows),
            (Some(samples), false) => stream = stream.with_output_batch(samples),
            (None, _) => {}
        }
        if let Some(dir) = self.cache_dir {
            stream = stream.with_cache(Some(CacheOptions::new(dir, self.cache_limit_bytes)));
        }
        let mut stream = stream.build()?;
        if stream.pack.is_some() {
            // The queue counts documents, which packing turns into
            // sequences: a batch of sequences is no count of them.
            stream.output_batch = 0;
        }
        // A batch's `cu_seqlens` count its packed tokens in `int32`.
        if let (Some(rows), Some(pack)) = (self.batch_size, &stream.pack) {
            let tokens = rows.saturating_mul(pack.width());
            if tokens > i32::MAX as usize {
                return Err(Error::Config {
                    name: "batch_size",
                    reason: format!(
                        "{rows} packed sequences of {} tokens hold {tokens} tokens, more than \
                         the {} a batch's int32 cu_seqlens can count",
                        pack.width(),
                        i32::MAX
                    ),
                });
            }
        }
        Ok(DatasetOptions {
            stream,
            manifest: self.manifest,
            format: self.format,
            batch_size: self.batch_size.filter(|_| !arrow),
            pack_bytes: self.pack_bytes,
            count_samples: self.count_samples,
            model_parallel_size: self.model_parallel_size,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(builder: DatasetOptionsBuilder) -> (&'static str, String) {
        match builder.build() {
            Err(Error::Config { name, reason }) => (name, reason),
            other => panic!("not refused: {other:?}"),
        }
    }

    /// Every check across options is the builder's, naming the option.
    #[test]
    fn options_that_contradict_each_other_are_refused_by_name() {
        let new = || DatasetOptions::builder(StreamOptions::builder());
        let arrow = || new().with_table_output(TableOutput::Arrow);
        let cases = [
            (new().with_batch_size(Some(0)), "batch_size"),
            (new().with_model_parallel_size(0), "model_parallel_size"),
            (new().with_cache_limit_bytes(Some(0)), "cache_limit_bytes"),
            (new().with_cache_limit_bytes(Some(5)), "cache_limit_bytes"),
            (arrow().with_format(DatasetFormat::Tar), "batch_format"),
            (arrow().with_format(DatasetFormat::Raw), "batch_format"),
            (
                arrow().with_pack_bytes(true).with_batch_size(Some(2)),
                "pack_bytes",
            ),
            (new().with_pack_bytes(true), "pack_bytes"),
        ];
        for (builder, name) in cases {
            let (refused_name, reason) = refused(builder);
            assert_eq!(refused_name, name, "{reason}");
            assert!(!reason.is_empty());
        }
        // The stream's own checks come through the same call.
        let stream = StreamOptions::builder().with_read_ahead_bytes(Some(0));
        assert_eq!(
            refused(DatasetOptions::builder(stream)).0,
            "read_ahead_bytes"
        );
    }

    /// What holds is built, with no side effect: a cache directory is only
    /// named, not made; Arrow batches are rows per batch, not dict batches.
    #[test]
    fn options_that_hold_are_built_without_touching_the_cache_directory() {
        let dir = tempfile::tempdir().unwrap();
        let cache = dir.path().join("not-made");
        let options = DatasetOptions::builder(StreamOptions::builder())
            .with_cache_dir(Some(cache.clone()))
            .with_cache_limit_bytes(Some(1 << 20))
            .with_batch_size(Some(8))
            .with_pack_bytes(true)
            .build()
            .unwrap();
        assert!(!cache.exists());
        let kept = options.stream().cache.as_ref().unwrap();
        assert_eq!((&kept.dir, kept.limit_bytes), (&cache, Some(1 << 20)));
        assert_eq!(
            (options.batch_size(), options.pack_bytes()),
            (Some(8), true)
        );
        // The stream's queue to the consumer may hold a whole batch.
        assert_eq!(options.stream().output_batch, 8);
        let arrow = DatasetOptions::builder(StreamOptions::builder().with_shuffle_buffer(0))
            .with_table_output(TableOutput::Arrow)
            .with_batch_size(Some(64))
            .build()
            .unwrap();
        assert_eq!(arrow.batch_size(), None);
        assert_eq!(arrow.stream().batch_rows, 64);
        assert_eq!(arrow.stream().output_batch, 0);
        // Packed, the queue counts documents, not the batch's sequences.
        let spec = crate::text::pack::PackSpec::new(
            Some("ids".into()),
            8,
            crate::text::pack::PackMode::Concat,
            false,
            0,
        )
        .unwrap();
        let packed = DatasetOptions::builder(StreamOptions::builder().with_pack(Some(spec)))
            .with_batch_size(Some(16))
            .build()
            .unwrap();
        assert_eq!(packed.stream().output_batch, 0);
    }
}
