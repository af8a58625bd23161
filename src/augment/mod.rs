//! Per-sample augmentation: field transforms that run where the field
//! decoders run (on the pipeline's decode threads, without the GIL) and
//! end in fixed-shape arrays that collate into batches.
//!
//! A transform draws its random choices (a crop box, a flip) from a
//! ChaCha8 stream of its own for each sample and field, seeded from the
//! sample's identity: the dataset seed, the epoch, the shard's index in
//! the dataset's shard list, the sample's index within its shard and the
//! field name ([`SampleContext::rng`]). Nothing else enters the seed, so a
//! sample is augmented the same way whichever rank or worker reads it, in
//! whatever order, through any shuffle buffer: an exact resume and an
//! elastic resume (another world size or worker count) both give the same
//! pixels for the same sample, and another epoch gives other draws.

pub mod audio;
pub mod image;
pub mod jpeg;

use rand_chacha::ChaCha8Rng;
use rand_core::{Rng, SeedableRng};

use crate::hash::fnv1a;

/// What a transform knows of the sample it transforms: enough to seed its
/// random stream, nothing that depends on the reader.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SampleContext {
    /// The dataset's seed (the `seed` option).
    pub seed: u64,
    /// The epoch being read.
    pub epoch: u64,
    /// Index of the sample's shard in the dataset's shard list.
    pub shard: usize,
    /// Index of the sample within its shard.
    pub index: u64,
}

impl SampleContext {
    /// The random stream of `field` of this sample: a ChaCha8 key of the
    /// seed, epoch, shard index and sample index (8 little-endian bytes
    /// each), on the stream numbered by the field name's 64-bit FNV-1a hash
    /// with the top bit set (the shuffle streams of `plan::order` use keys
    /// with a fixed tag and low stream numbers, so the two never meet).
    pub fn rng(&self, field: &str) -> ChaCha8Rng {
        let mut key = [0u8; 32];
        key[..8].copy_from_slice(&self.seed.to_le_bytes());
        key[8..16].copy_from_slice(&self.epoch.to_le_bytes());
        key[16..24].copy_from_slice(&(self.shard as u64).to_le_bytes());
        key[24..32].copy_from_slice(&self.index.to_le_bytes());
        let mut rng = ChaCha8Rng::from_seed(key);
        rng.set_stream(fnv1a(field.as_bytes()) | 1 << 63);
        rng
    }

    /// The seed handed to Python transforms as the sample's `__seed__`
    /// field (the `sample_seed` option): the first draw of the stream of
    /// the name `__seed__`, top bit cleared, so that it is a non-negative
    /// `int64` in any collated batch.
    pub fn transform_seed(&self) -> i64 {
        (self.rng(TRANSFORM_SEED_FIELD).next_u64() >> 1) as i64
    }
}

/// The field name of the seed handed to Python transforms.
pub const TRANSFORM_SEED_FIELD: &str = "__seed__";

/// A uniform draw from `[low, high)` (53 random bits; `low` when the range
/// is empty).
pub fn uniform(rng: &mut ChaCha8Rng, low: f64, high: f64) -> f64 {
    let unit = (rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64);
    low + (high - low) * unit
}

#[cfg(test)]
mod tests {
    use super::*;

    fn context(shard: usize, index: u64) -> SampleContext {
        SampleContext {
            seed: 7,
            epoch: 1,
            shard,
            index,
        }
    }

    #[test]
    fn every_part_of_the_identity_changes_the_stream() {
        let first = |c: SampleContext, field: &str| c.rng(field).next_u64();
        let base = first(context(2, 3), "jpg");
        assert_eq!(base, first(context(2, 3), "jpg"));
        assert_ne!(base, first(context(2, 4), "jpg"));
        assert_ne!(base, first(context(3, 3), "jpg"));
        assert_ne!(base, first(context(2, 3), "png"));
        let mut other_epoch = context(2, 3);
        other_epoch.epoch = 2;
        assert_ne!(base, first(other_epoch, "jpg"));
        let mut other_seed = context(2, 3);
        other_seed.seed = 8;
        assert_ne!(base, first(other_seed, "jpg"));
    }

    #[test]
    fn transform_seeds_are_the_first_draw_of_their_stream_and_follow_the_identity() {
        let base = context(2, 3).transform_seed();
        // The first draw of the `__seed__` stream, its top bit cleared.
        let draw = context(2, 3).rng(TRANSFORM_SEED_FIELD).next_u64();
        assert_eq!(base, (draw >> 1) as i64);
        assert_eq!(base, context(2, 3).transform_seed());
        assert_ne!(base, context(2, 4).transform_seed());
        assert_ne!(base, context(3, 3).transform_seed());
        let mut other_epoch = context(2, 3);
        other_epoch.epoch = 2;
        assert_ne!(base, other_epoch.transform_seed());
        // Only the sign bit is cleared: seeds fill both halves of the
        // non-negative range, and no two of a thousand samples share one.
        let seeds: Vec<i64> = (0..1000).map(|i| context(0, i).transform_seed()).collect();
        assert!(seeds.iter().any(|&s| s >= 1 << 62));
        assert!(seeds.iter().any(|&s| s < 1 << 62));
        let distinct: std::collections::HashSet<i64> = seeds.iter().copied().collect();
        assert_eq!(distinct.len(), seeds.len());
    }

    #[test]
    fn uniform_stays_in_range() {
        let mut rng = context(0, 0).rng("x");
        for _ in 0..1000 {
            let u = uniform(&mut rng, -2.0, 3.0);
            assert!((-2.0..3.0).contains(&u), "{u}");
        }
        assert_eq!(uniform(&mut rng, 1.5, 1.5), 1.5);
    }
}
