//! The resolved shard list of a dataset.

use std::collections::HashSet;
use std::ffi::CString;
use std::str::FromStr;
use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};

use super::blocking::interruptible;
use super::errors::{to_py, ManifestIgnoredWarning, ShardSkippedWarning};
use super::options::Options;
use crate::config::OnError;
use crate::dataset::{self, resolve, Resolved, Resolving};
use crate::location::Location;
use crate::manifest::{Attached, Manifest};
use crate::plan::{cut, Remainder, SlotSpec};
use crate::shard::{Shard, ShardKind};

/// The resolved shards of a dataset, with their sample counts (from a
/// manifest, Parquet footers, or the headers of local tar shards), and the
/// options they were resolved with.
#[pyclass(module = "shardstream._core")]
pub struct ShardList {
    pub(super) shards: Arc<Vec<Shard>>,
    specs: Vec<String>,
    manifest: Option<String>,
    pub(super) options: Py<Options>,
    /// Whether the local tar shards were counted from their headers.
    counted: bool,
}

#[pymethods]
impl ShardList {
    /// Resolves `specs` with the dataset's `options` (`manifest`, `format`,
    /// `s3`, `on_error`): lists directories and prefixes, reads Parquet
    /// footers and the manifest, and counts the samples of local tar
    /// shards that no manifest describes when `count_samples=True`. With
    /// `on_error="raise"` a local shard that is missing, or malformed when
    /// counted, is an error here; with `"warn"` one that cannot be counted
    /// is skipped (no samples) with a `ShardSkippedWarning`.
    #[new]
    fn new(py: Python<'_>, specs: Vec<String>, options: Py<Options>) -> PyResult<Self> {
        let o = options.get();
        let strict = o.dataset.stream().on_error == OnError::Raise;
        let (s3, format, choice) = (
            o.dataset.stream().store.clone(),
            o.dataset.format(),
            o.dataset.manifest().clone(),
        );
        let arrow = o.dataset.stream().table_output == crate::config::TableOutput::Arrow;
        let count = o.dataset.count_samples() == Some(true);
        let cache = o.dataset.stream().cache.clone();
        let owned_specs = specs.clone();
        let (shards, attached, skipped) = interruptible(py, move || {
            let how = Resolving {
                specs: &owned_specs,
                store_options: &s3,
                format,
                manifest: &choice,
                strict,
            };
            let Resolved {
                mut shards,
                attached,
                skipped,
            } = dataset::resolve_shards(&how, count)?;
            if let (true, Some(cache)) = (count, &cache) {
                attach_kept_counts(&mut shards, cache);
            }
            if arrow {
                if let Some(shard) = shards
                    .iter()
                    .find(|s| !matches!(s.kind, ShardKind::Parquet(_)))
                {
                    return Err(crate::Error::Config {
                        name: "batch_format",
                        reason: format!(
                            "\"arrow\" hands out Parquet record batches, and {} is not a Parquet file",
                            shard.url
                        ),
                    });
                }
            }
            Ok((shards, attached, skipped))
        })?;
        warn_ignored(py, &attached)?;
        warn_skipped(py, &skipped, 4)?;
        let manifest = attached.used;
        Ok(ShardList {
            shards: Arc::new(shards),
            specs,
            manifest,
            options,
            counted: count,
        })
    }

    /// Counts the samples of the local tar shards that have no counts yet
    /// (unless `count_samples=False`): a job of several ranks needs them.
    /// With `on_error="raise"` a malformed shard is an error here; with
    /// `"warn"` it is skipped (no samples) with a `ShardSkippedWarning`.
    fn count_samples(&mut self, py: Python<'_>) -> PyResult<()> {
        let o = self.options.get();
        if self.counted || o.dataset.count_samples() == Some(false) {
            return Ok(());
        }
        let strict = o.dataset.stream().on_error == OnError::Raise;
        let in_use = self.manifest.is_some();
        let (s3, format, choice) = (
            o.dataset.stream().store.clone(),
            o.dataset.format(),
            o.dataset.manifest().clone(),
        );
        let specs = self.specs.clone();
        let mut shards = (*self.shards).clone();
        let (shards, attached, skipped) = interruptible(py, move || {
            let how = Resolving {
                specs: &specs,
                store_options: &s3,
                format,
                manifest: &choice,
                strict,
            };
            let (attached, skipped) = dataset::count_shards(&how, &mut shards, in_use)?;
            Ok((shards, attached, skipped))
        })?;
        warn_ignored(py, &attached)?;
        warn_skipped(py, &skipped, 2)?;
        if attached.used.is_some() {
            self.manifest = attached.used;
        }
        self.shards = Arc::new(shards);
        self.counted = true;
        Ok(())
    }

    /// A copy of the list with its local tar and JSON-lines shards counted
    /// from their headers (one that cannot be counted is an error), or
    /// `None` when none is left to count (or `count_samples=False`):
    /// what a state saved before the shards were counted is checked
    /// against. Unlike `count_samples()`, nothing remote is read.
    fn counted_locally(&self, py: Python<'_>) -> PyResult<Option<ShardList>> {
        let todo = self.shards.iter().any(dataset::count::countable);
        if !todo || self.options.get().dataset.count_samples() == Some(false) {
            return Ok(None);
        }
        let mut shards = (*self.shards).clone();
        let shards = interruptible(py, move || {
            dataset::count::count_local_tar(&mut shards, true)?;
            Ok(shards)
        })?;
        Ok(Some(ShardList {
            shards: Arc::new(shards),
            specs: self.specs.clone(),
            manifest: self.manifest.clone(),
            options: self.options.clone_ref(py),
            counted: true,
        }))
    }

    /// Positions of the shards that have no sample count after
    /// `count_samples()` (remote shards no manifest describes), when
    /// `count_samples=True` asks for them to be read; else none.
    fn uncounted_remote(&self) -> Vec<usize> {
        if self.options.get().dataset.count_samples() != Some(true) {
            return Vec::new();
        }
        uncounted_remote(&self.shards)
    }

    /// Reads the shards at `positions` through, `jobs` at once, and returns
    /// their manifest (JSON), as `shardstream index` writes it, with the
    /// shards' URLs as listed.
    fn index_shards(&self, py: Python<'_>, positions: Vec<usize>, jobs: usize) -> PyResult<String> {
        if let Some(&bad) = positions.iter().find(|&&p| p >= self.shards.len()) {
            return Err(pyo3::exceptions::PyIndexError::new_err(format!(
                "shard position {bad} is out of range: the dataset has {} shards",
                self.shards.len()
            )));
        }
        let shards = self.shards.clone();
        let s3 = self.options.get().dataset.stream().store.clone();
        interruptible(py, move || {
            let entries = crate::index::index_shards(&shards, &positions, &s3, jobs.max(1))?;
            Ok(Manifest::new(entries).to_json())
        })
    }

    /// Gives the shards that the manifest `json` lists (by URL, as
    /// `index_shards` writes it) their sample indices, checking each one's
    /// size and ETag against it.
    fn attach_counts(&mut self, json: &str) -> PyResult<()> {
        const SOURCE: &str = "the sample counts read at start-up";
        let manifest = Manifest::from_json(json, SOURCE).map_err(to_py)?;
        let listed: HashSet<&str> = manifest.shards.iter().map(|e| e.url.as_str()).collect();
        let mut shards = (*self.shards).clone();
        let positions: Vec<usize> = (0..shards.len())
            .filter(|&i| listed.contains(shards[i].url.as_str()))
            .collect();
        let mut picked: Vec<Shard> = positions.iter().map(|&i| shards[i].clone()).collect();
        manifest.attach_remote("", &mut picked).map_err(to_py)?;
        for (position, shard) in positions.into_iter().zip(picked) {
            shards[position] = shard;
        }
        self.shards = Arc::new(shards);
        Ok(())
    }

    /// Keeps the manifest `json` of the remote shards' sample counts in
    /// `cache_dir`, if one is set, for the next start to attach.
    fn keep_counts(&self, json: &str) {
        let remote = self.shards.iter().filter(|shard| is_remote_stream(shard));
        if !remote.clone().all(keeps_counts) {
            return;
        }
        if let Some(cache) = &self.options.get().dataset.stream().cache {
            crate::source::cache::keep_counts(cache, &remote_stream_urls(&self.shards), json);
        }
    }

    /// Whether the local tar shards were counted from their headers.
    #[getter]
    fn counted(&self) -> bool {
        self.counted
    }

    /// Raises if a local file of the shards (resolved by another process,
    /// maybe on another node) is missing here or differs from what the
    /// resolution says of it (size, and the modification time a manifest
    /// records): one `stat` per local shard, nothing read.
    fn check_local_files(&self, py: Python<'_>) -> PyResult<()> {
        let shards = self.shards.clone();
        interruptible(py, move || resolve::check_local_copies(&shards))
    }

    /// Raises if a job of `world_size` ranks cannot give every rank the
    /// same number of samples (a shard's sample count is unknown), or,
    /// with `pack`, the same number of sequences (a shard's token counts
    /// are not in the manifest, or were counted another way). A stream of
    /// a mixture (`mixture`) plans its sequences on one rank too.
    #[pyo3(signature = (world_size, mixture = false))]
    fn check_equal_length(&self, world_size: usize, mixture: bool) -> PyResult<()> {
        check_counts(&self.shards, world_size).map_err(to_py)?;
        let options = self.options.get().dataset.stream();
        let Some(spec) = &options.pack else {
            return Ok(());
        };
        let tokenizer = options.pack_tokenizer_name();
        let planned = world_size > 1 || mixture;
        crate::text::counts::check_counted(&self.shards, spec, tokenizer, planned).map_err(to_py)
    }

    /// What each shard holds: `"tar"`, `"raw"`, `"jsonl"` or `"parquet"`
    /// (one row group).
    #[getter]
    fn kinds(&self) -> Vec<&'static str> {
        self.shards
            .iter()
            .map(|s| match s.kind {
                ShardKind::Tar => "tar",
                ShardKind::Raw => "raw",
                ShardKind::Lines => "jsonl",
                ShardKind::Parquet(_) => "parquet",
            })
            .collect()
    }

    /// The dataset spec, as given (before listing and expansion).
    #[getter]
    fn specs(&self) -> Vec<String> {
        self.specs.clone()
    }

    /// Shard URLs, in order.
    #[getter]
    fn urls(&self) -> Vec<String> {
        self.shards.iter().map(|s| s.url.clone()).collect()
    }

    /// Shard sizes in bytes (`None` when unknown), in order.
    #[getter]
    fn sizes(&self) -> Vec<Option<u64>> {
        self.shards.iter().map(|s| s.size).collect()
    }

    /// Sample counts per shard from the manifest, or `None` without one.
    #[getter]
    fn sample_counts(&self) -> Option<Vec<u64>> {
        self.shards.iter().map(|s| s.info().samples).collect()
    }

    /// The manifest in use, if any.
    #[getter]
    fn manifest_path(&self) -> Option<String> {
        self.manifest.clone()
    }

    /// Samples each rank gets per epoch (with a manifest), else `None`.
    #[pyo3(signature = (world_size, remainder = "drop"))]
    fn samples_per_rank(&self, world_size: usize, remainder: &str) -> PyResult<Option<u64>> {
        SlotSpec::new(world_size, 0, 1, 0).map_err(to_py)?;
        let remainder = Remainder::from_str(remainder).map_err(to_py)?;
        Ok(self
            .sample_counts()
            .map(|counts| cut::samples_per_rank(counts.iter().sum(), world_size, remainder)))
    }

    fn __len__(&self) -> usize {
        self.shards.len()
    }

    /// Pickling keeps the resolved shards (with their sample indices and
    /// Parquet footers): the copy plans over exactly these shards, without
    /// listing or reading anything again.
    fn __reduce__<'py>(
        slf: &Bound<'py, Self>,
    ) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyTuple>)> {
        let py = slf.py();
        let this = slf.borrow();
        let manifest = match &this.manifest {
            Some(path) => path.clone().into_pyobject(py)?.into_any(),
            None => py.None().into_bound(py),
        };
        let specs = this.specs.clone().into_pyobject(py)?.into_any();
        let options = this.options.bind(py).clone().into_any();
        let counted = pyo3::types::PyBool::new(py, this.counted)
            .to_owned()
            .into_any();
        let encoded = crate::dataset::shard_list_codec::encode(&this.shards).map_err(|reason| {
            to_py(crate::Error::Spec {
                spec: this.specs.join(" "),
                reason,
            })
        })?;
        let shards = PyBytes::new(py, &encoded).into_any();
        let args = PyTuple::new(py, [specs, options, manifest, counted, shards])?;
        let rebuild = py
            .import("shardstream._core")?
            .getattr("_rebuild_shard_list")?;
        Ok((rebuild, args))
    }
}

/// Unpickles a [`ShardList`]: `shards` as `ShardList.__reduce__` encoded
/// them, the manifest the original used (if any), whether it was counted,
/// and its specs and options.
#[pyfunction]
pub fn _rebuild_shard_list(
    specs: Vec<String>,
    options: Py<Options>,
    manifest: Option<String>,
    counted: bool,
    shards: &[u8],
) -> PyResult<ShardList> {
    let shards = crate::dataset::shard_list_codec::decode(shards).map_err(|reason| {
        to_py(crate::Error::Spec {
            spec: specs.join(" "),
            reason: format!("its pickled shard list {reason}"),
        })
    })?;
    Ok(ShardList {
        shards: Arc::new(shards),
        specs,
        manifest,
        options,
        counted,
    })
}

/// Warns that a `manifest.json` beside the shards was passed over (another
/// tool's file), pointing at the line that made the dataset: the frames
/// between are `StreamingDataset.__init__`, `resolve_once` and its
/// resolution callback.
fn warn_ignored(py: Python<'_>, attached: &Attached) -> PyResult<()> {
    if let Some(reason) = &attached.ignored {
        let message = CString::new(format!("{reason} (manifest=False stops looking for one)"))
            .unwrap_or_else(|_| c"a manifest.json beside the shards was not used".to_owned());
        let category = py.get_type::<ManifestIgnoredWarning>();
        PyErr::warn(py, category.as_any(), &message, 4)?;
    }
    Ok(())
}

/// Warns of each local shard that could not be counted and is skipped
/// (`on_error="warn"`), naming it and the offset of the damage; the
/// warning points `stacklevel` frames up.
fn warn_skipped(py: Python<'_>, skipped: &[crate::Error], stacklevel: i32) -> PyResult<()> {
    for error in skipped {
        let message = CString::new(format!(
            "skipped a bad shard, left out of every epoch (its samples could not be counted): \
             {error}"
        ))
        .unwrap_or_else(|_| c"skipped a bad shard whose samples could not be counted".to_owned());
        let category = py.get_type::<ShardSkippedWarning>();
        PyErr::warn(py, category.as_any(), &message, stacklevel)?;
    }
    Ok(())
}

/// An error when `world_size > 1` and a shard's sample count is unknown.
pub(super) fn check_counts(shards: &[Shard], world_size: usize) -> crate::Result<()> {
    if world_size > 1 {
        if let Some(uncounted) = crate::dataset::count::first_uncounted(shards) {
            return Err(crate::dataset::count::counts_needed(uncounted, world_size));
        }
    }
    Ok(())
}

/// Whether `shard` is a tar (or JSON-lines) shard read from a store (not a
/// local file): one whose samples a manifest, or a read through, counts.
fn is_remote_stream(shard: &Shard) -> bool {
    shard.kind.has_manifest_spans() && !matches!(shard.location(), Location::Local(_))
}

/// Whether the counts of `shard` may be kept between starts: a remote
/// shard listed with its size and ETag, which tell a replaced object (a
/// `gs://` or `hf://` shard, or one named outright, is listed without).
fn keeps_counts(shard: &Shard) -> bool {
    is_remote_stream(shard) && shard.size.is_some() && shard.etag.is_some()
}

/// The URLs of the remote shards: what their kept counts are named by.
fn remote_stream_urls(shards: &[Shard]) -> Vec<&str> {
    shards
        .iter()
        .filter(|shard| is_remote_stream(shard))
        .map(|shard| shard.url.as_str())
        .collect()
}

/// Positions of the remote shards without a sample count (local ones are
/// counted from their headers or line breaks, or, compressed, not at all).
fn uncounted_remote(shards: &[Shard]) -> Vec<usize> {
    (0..shards.len())
        .filter(|&i| is_remote_stream(&shards[i]) && shards[i].index.is_none())
        .collect()
}

/// Gives the uncounted remote shards the sample counts kept in the cache
/// by an earlier start, if every one of them is kept there with its size
/// and ETag unchanged; else leaves them to be read.
fn attach_kept_counts(shards: &mut [Shard], cache: &crate::config::CacheOptions) {
    let positions = uncounted_remote(shards);
    if positions.is_empty() || positions.iter().any(|&i| !keeps_counts(&shards[i])) {
        return;
    }
    let Some(text) = crate::source::cache::kept_counts(cache, &remote_stream_urls(shards)) else {
        return;
    };
    let Ok(manifest) = Manifest::from_json(&text, "the sample counts kept in cache_dir") else {
        return;
    };
    let mut picked: Vec<Shard> = positions.iter().map(|&i| shards[i].clone()).collect();
    if manifest.attach_remote("", &mut picked).is_ok() {
        for (position, shard) in positions.into_iter().zip(picked) {
            shards[position] = shard;
        }
    }
}
