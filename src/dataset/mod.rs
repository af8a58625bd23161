//! A dataset before any byte of a shard is read for its samples: its
//! options, checked together ([`DatasetOptions`]), its specs resolved to
//! shards ([`resolve`]), their manifest attached, the sample
//! counts of local tar shards read from their headers ([`count`]), and the
//! resolved list in the compact form a copy of the dataset takes with it
//! ([`shard_list_codec`]). [`resolve_shards`] and [`count_shards`] are the
//! steps a `StreamingDataset` and the command line take alike.

pub mod count;
pub mod options;
pub mod resolve;
pub mod shard_list_codec;

pub use options::{DatasetOptions, DatasetOptionsBuilder};

use crate::config::StoreOptions;
use crate::error::{Error, Result};
use crate::manifest::{Attached, ManifestChoice};
use crate::shard::Shard;
use crate::spec::DatasetFormat;

/// How a dataset's specs are resolved: where shards are read from, what
/// they hold, which manifest describes them, and whether a shard that is
/// missing or malformed is an error (`strict`, `on_error="raise"`) or is
/// skipped (`"warn"`).
#[derive(Debug, Clone, Copy)]
pub struct Resolving<'a> {
    /// The dataset's specs.
    pub specs: &'a [String],
    /// How every store is reached.
    pub store_options: &'a StoreOptions,
    /// What the shards hold.
    pub format: DatasetFormat,
    /// Which manifest describes them.
    pub manifest: &'a ManifestChoice,
    /// Whether a missing or malformed local shard is an error.
    pub strict: bool,
}

/// A dataset's resolved shards, the manifest they carry, and the shards
/// that could not be counted (skipped, not `strict`).
#[derive(Debug)]
pub struct Resolved {
    /// The shards, in listed order.
    pub shards: Vec<Shard>,
    /// The manifest in use, and one passed over (and why).
    pub attached: Attached,
    /// Why each shard that could not be counted was left without a count.
    pub skipped: Vec<Error>,
}

/// Resolves `how.specs` to shards with their manifest; with `count`, counts
/// them too ([`count_shards`]), as a job of several ranks or
/// `count_samples=True` needs.
pub fn resolve_shards(how: &Resolving<'_>, count: bool) -> Result<Resolved> {
    let (mut shards, mut attached) = resolve::resolve_indexed(
        how.specs,
        how.store_options,
        how.format,
        how.manifest,
        how.strict,
    )?;
    let mut skipped = Vec::new();
    if count {
        let (beside, not_counted) = count_shards(how, &mut shards, attached.used.is_some())?;
        if beside.used.is_some() || beside.ignored.is_some() {
            attached = beside;
        }
        skipped = not_counted;
    }
    Ok(Resolved {
        shards,
        attached,
        skipped,
    })
}

/// Gives `shards` (resolved from `how.specs`, with a manifest in use or
/// not) their sample counts: the `manifest.json` beside remote tar,
/// JSON-lines or Parquet shards when `manifest="auto"` found none, then
/// the headers of local tar shards.
/// Returns the manifest attached here, if any, and the shards that could
/// not be counted (not `strict`).
pub fn count_shards(
    how: &Resolving<'_>,
    shards: &mut [Shard],
    manifest_in_use: bool,
) -> Result<(Attached, Vec<Error>)> {
    let attached = if *how.manifest == ManifestChoice::Auto && !manifest_in_use {
        resolve::attach_beside_remote(how.specs, shards, how.store_options)?
    } else {
        Attached::default()
    };
    let skipped = count::count_local_tar(shards, how.strict)?.skipped;
    Ok((attached, skipped))
}
