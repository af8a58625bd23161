//! Mixtures: how many samples each stream gives one slot, and the order in
//! which a slot takes them. Pure functions of the weights, the samples each
//! stream's own plan gives the slot, and `(seed, epoch, slot, generation)`.
//!
//! A slot's counts depend only on what the streams give that slot; every
//! stream's plan gives worker `w` of each rank the same number of samples
//! (equal runs per rank, cut the same way per worker), so every rank takes
//! the same number of samples from the mixture.

use std::str::FromStr;

use rand_chacha::ChaCha8Rng;
use rand_core::{Rng, SeedableRng};

use super::order;
use crate::error::{Error, Result};

/// The most streams a mixture takes (a slot's order holds one byte per sample).
pub const MAX_STREAMS: usize = 255;

/// The most samples one slot takes from a mixture in one epoch.
pub const MAX_SLOT_SAMPLES: u64 = 1 << 32;

/// Pass `p` (a restart) of a stream in mixture epoch `e` reads the stream's
/// epoch `e + p * PASS_STRIDE`: pass 0 is the stream's epoch `e`.
pub const PASS_STRIDE: u64 = 1 << 32;

/// The most passes over one stream in one epoch under `policy="restart"`.
pub const MAX_PASSES: u64 = 1024;

/// What a mixture does when a stream runs out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// The epoch ends where the first stream (relative to its weight) runs
    /// out: every stream gives `weight * length` samples, the rest of the
    /// other streams' epochs is left unread.
    Stop,
    /// Streams that run out start again with their next epoch order until
    /// the stream that lasts longest (relative to its weight) has given all
    /// its samples: proportions are the weights throughout.
    Restart,
    /// When a stream runs out, the others go on with their weights
    /// renormalised, until every stream has given all its samples.
    Continue,
}

impl FromStr for Policy {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "stop" => Ok(Policy::Stop),
            "restart" => Ok(Policy::Restart),
            "continue" => Ok(Policy::Continue),
            other => Err(Error::Config {
                name: "policy",
                reason: format!("expected \"stop\", \"restart\" or \"continue\", got {other:?}"),
            }),
        }
    }
}

/// Checks mixture weights: one per stream (1 to [`MAX_STREAMS`]), each
/// finite and non-negative, at least one above 0.
pub fn check_weights(weights: &[f64]) -> Result<()> {
    let error = |reason: String| Error::Config {
        name: "weights",
        reason,
    };
    if weights.is_empty() || weights.len() > MAX_STREAMS {
        return Err(error(format!(
            "expected 1 to {MAX_STREAMS} weights, got {}",
            weights.len()
        )));
    }
    if let Some((i, w)) = weights
        .iter()
        .enumerate()
        .find(|(_, w)| !w.is_finite() || **w < 0.0)
    {
        return Err(error(format!(
            "weight {i} is {w}; expected a finite number of at least 0"
        )));
    }
    if !weights.iter().any(|&w| w > 0.0) {
        return Err(error(
            "every weight is 0; at least one must be above 0".into(),
        ));
    }
    Ok(())
}

/// `2^k` for `k` in `-1022..=1023` (a normal `f64`, so exact).
fn pow2(k: i32) -> f64 {
    debug_assert!((-1022..=1023).contains(&k));
    f64::from_bits(((k + 1023) as u64) << 52)
}

/// The weights scaled by the power of two that puts the largest in `[1, 2)`.
///
/// Scaling by a power of two is exact (but for weights more than 2^1022
/// below the largest, which keep only their leading bits, and stay above 0),
/// so every product, quotient and comparison of the mixture gives the same result as with
/// the weights as given, when those do not overflow: weights `c * w` for any
/// power of two `c` give the very same mixture, and sums of weights near
/// `f64::MAX` no longer overflow to infinity. Other factors give the same
/// mixture up to the rounding of `c * w` itself.
fn normalised(weights: &[f64]) -> Vec<f64> {
    let max = weights.iter().copied().fold(0.0, f64::max);
    let bits = max.to_bits();
    let biased = ((bits >> 52) & 0x7ff) as i32;
    // `max` lies in [2^exponent, 2^(exponent + 1)).
    let exponent = if biased == 0 {
        // Subnormal: its highest mantissa bit gives the exponent.
        (63 - (bits & ((1 << 52) - 1)).leading_zeros()) as i32 - 1074
    } else {
        biased - 1023
    };
    weights
        .iter()
        .map(|&given| {
            // By 2^k, k in -1023..=1074, in two steps a normal power of two
            // can take; the last rounds (if anything does), the first is exact.
            let k = -exponent;
            let (first, last) = if k < -1022 {
                (k + 1022, -1022)
            } else if k > 1023 {
                (k - 1023, 1023)
            } else {
                (0, k)
            };
            let w = given * pow2(first) * pow2(last);
            if w == 0.0 && given > 0.0 {
                // A weight above 0 keeps its stream in the mixture.
                f64::from_bits(1)
            } else {
                w
            }
        })
        .collect()
}

/// The stream whose samples last `available / weight` the least
/// (`longest == false`) or the most, among streams of weight above 0
/// (lowest index on ties).
fn limiting(weights: &[f64], available: &[u64], longest: bool) -> Option<usize> {
    let mut best: Option<(usize, f64)> = None;
    for (s, (&w, &a)) in weights.iter().zip(available).enumerate() {
        if w <= 0.0 {
            continue;
        }
        let span = a as f64 / w;
        let better = match best {
            None => true,
            Some((_, b)) if longest => span > b,
            Some((_, b)) => span < b,
        };
        if better {
            best = Some((s, span));
        }
    }
    best.map(|(s, _)| s)
}

/// How many samples each stream gives a slot to which the streams' plans
/// give `available[s]` samples (see [`Policy`]). Streams of weight 0 give
/// none. Under [`Policy::Restart`] a count may exceed what the stream has:
/// the rest comes from its next epoch orders.
pub fn slot_counts(policy: Policy, weights: &[f64], available: &[u64]) -> Result<Vec<u64>> {
    check_weights(weights)?;
    if weights.len() != available.len() {
        return Err(Error::Config {
            name: "weights",
            reason: format!("{} weights for {} streams", weights.len(), available.len()),
        });
    }
    let given = weights;
    let weights = &normalised(weights)[..];
    let scaled = |m: usize| -> Vec<u64> {
        weights
            .iter()
            .enumerate()
            .map(|(s, &w)| {
                if s == m {
                    available[m]
                } else if w <= 0.0 {
                    0
                } else {
                    // A relative nudge of 1e-12 keeps a product that is
                    // an integer in exact arithmetic (6 * 0.7 / 0.3) from
                    // rounding below it; the conversion saturates.
                    let exact = available[m] as f64 * w / weights[m];
                    (exact + exact * 1e-12).floor() as u64
                }
            })
            .collect()
    };
    let counts: Vec<u64> = match policy {
        Policy::Continue => weights
            .iter()
            .zip(available)
            .map(|(&w, &a)| if w > 0.0 { a } else { 0 })
            .collect(),
        Policy::Stop => {
            let m = limiting(weights, available, false).expect("a weight above 0");
            scaled(m)
                .into_iter()
                .zip(available)
                .map(|(n, &a)| n.min(a))
                .collect()
        }
        // At least what the stream has: its span is at most the longest.
        Policy::Restart => scaled(limiting(weights, available, true).expect("a weight above 0"))
            .into_iter()
            .zip(weights.iter().zip(available))
            .map(|(n, (&w, &a))| if w > 0.0 { n.max(a) } else { 0 })
            .collect(),
    };
    let total = counts.iter().try_fold(0u64, |sum, &n| sum.checked_add(n));
    if total.is_none_or(|n| n > MAX_SLOT_SAMPLES) {
        return Err(Error::Config {
            name: "weights",
            reason: format!(
                "with weights {given:?} a slot would take {counts:?} samples of streams that give \
                 it {available:?}, more than {MAX_SLOT_SAMPLES} in one epoch: the weights are too far apart"
            ),
        });
    }
    Ok(counts)
}

/// The random stream of a slot's mixture order.
fn rng_for(seed: u64, epoch: u64, slot: u32, generation: u32) -> ChaCha8Rng {
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&seed.to_le_bytes());
    key[8..16].copy_from_slice(&epoch.to_le_bytes());
    key[16..32].copy_from_slice(b"shardstream/mix1");
    let mut rng = ChaCha8Rng::from_seed(key);
    rng.set_stream((u64::from(generation) << 32) | u64::from(slot));
    rng
}

/// A uniform draw from `[0, 1)` with 53 random bits.
fn unit(rng: &mut ChaCha8Rng) -> f64 {
    (rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// The order in which a slot takes its samples: the stream index of each,
/// stream `s` appearing exactly `counts[s]` times.
///
/// Under [`Policy::Stop`] and [`Policy::Restart`] it is a uniformly random
/// arrangement of that multiset (so every stretch of it holds the streams in
/// about their weights); under [`Policy::Continue`] each sample's stream is
/// drawn with the weights of the streams that have samples left. Randomness
/// comes from ChaCha keyed by `(seed, epoch)` on stream `(generation, slot)`:
/// `generation` counts the resumes that recomputed the order mid-epoch.
pub fn slot_order(
    policy: Policy,
    weights: &[f64],
    counts: &[u64],
    (seed, epoch): (u64, u64),
    slot: u32,
    generation: u32,
) -> Result<Vec<u8>> {
    check_weights(weights)?;
    if weights.len() != counts.len() {
        return Err(Error::Config {
            name: "weights",
            reason: format!("{} weights for {} streams", weights.len(), counts.len()),
        });
    }
    let weights = &normalised(weights)[..];
    let total = counts
        .iter()
        .try_fold(0u64, |sum, &n| sum.checked_add(n))
        .filter(|&n| n <= MAX_SLOT_SAMPLES)
        .ok_or_else(|| Error::Config {
            name: "weights",
            reason: format!(
                "a slot would take {counts:?} samples from the streams, more than {MAX_SLOT_SAMPLES} in one epoch"
            ),
        })? as usize;
    let mut rng = rng_for(seed, epoch, slot, generation);
    let mut out = Vec::with_capacity(total);
    match policy {
        Policy::Stop | Policy::Restart => {
            for (s, &n) in counts.iter().enumerate() {
                out.extend(std::iter::repeat_n(s as u8, n as usize));
            }
            order::shuffle(&mut rng, &mut out);
        }
        Policy::Continue => {
            let mut left: Vec<u64> = counts.to_vec();
            // Streams with samples left but weight 0 come last, in order.
            let weighted = |left: &[u64]| -> f64 {
                weights
                    .iter()
                    .zip(left)
                    .filter(|(_, &n)| n > 0)
                    .map(|(&w, _)| w)
                    .sum()
            };
            let mut sum = weighted(&left);
            while sum > 0.0 {
                let mut target = unit(&mut rng) * sum;
                let mut pick = None;
                for (s, (&w, &n)) in weights.iter().zip(&left).enumerate() {
                    if n == 0 || w <= 0.0 {
                        continue;
                    }
                    pick = Some(s);
                    if target < w {
                        break;
                    }
                    target -= w;
                }
                let s = pick.expect("a stream with samples left");
                out.push(s as u8);
                left[s] -= 1;
                if left[s] == 0 {
                    sum = weighted(&left);
                }
            }
            for (s, &n) in left.iter().enumerate() {
                out.extend(std::iter::repeat_n(s as u8, n as usize));
            }
        }
    }
    Ok(out)
}

/// The stream epoch that pass `pass` over a stream reads in mixture epoch
/// `epoch` (see [`PASS_STRIDE`]).
pub fn pass_epoch(epoch: u64, pass: u64) -> Result<u64> {
    pass.checked_mul(PASS_STRIDE)
        .and_then(|offset| epoch.checked_add(offset))
        .ok_or_else(|| Error::Config {
            name: "epoch",
            reason: format!("pass {pass} of mixture epoch {epoch} is past the last epoch"),
        })
}

/// What one slot's mixture for one epoch is planned from.
#[derive(Debug, Clone, Copy)]
pub struct SlotMixture<'a> {
    /// What the mixture does when a stream runs out.
    pub policy: Policy,
    /// The streams' weights.
    pub weights: &'a [f64],
    /// The mixture's seed and epoch.
    pub key: (u64, u64),
    /// The slot's index in the job (`rank * num_workers + worker_id`).
    pub slot: u32,
    /// How many elastic resumes led to this plan.
    pub generation: u32,
}

/// One slot's mixture for one epoch: the pass over each stream it starts
/// in, the samples of each pass it reads, the samples it takes from each
/// stream, and the order in which it takes them.
#[derive(Debug, Clone, PartialEq)]
pub struct SlotPlan {
    /// The pass over each stream the slot starts in (above 0 after an
    /// elastic resume in a restarted pass).
    pub base: Vec<u64>,
    /// The samples the slot takes from each pass over each stream, from
    /// pass `base[s]` on; under [`Policy::Restart`] the last pass is cut
    /// to the stream's count.
    pub passes: Vec<Vec<u64>>,
    /// What each of those passes gives the slot, before that cut: a
    /// packed stream counts its sequences down from this.
    pub pass_sizes: Vec<Vec<u64>>,
    /// The samples the slot takes from each stream.
    pub counts: Vec<u64>,
    /// The stream of each sample, in the order the slot takes them.
    pub order: Vec<u8>,
}

impl SlotPlan {
    /// The plan of `mixture` for a slot whose pass `base[s]` over stream
    /// `s` gives it `first[s]` samples. Under [`Policy::Restart`] a stream
    /// that runs out is read again: `more(s, pass)` gives the samples of
    /// pass `pass` over stream `s`, asked for until the stream's count is
    /// met, at most [`MAX_PASSES`] passes. A pass that gives the slot no
    /// sample is an error naming `weights`: the stream could not come in
    /// its weight (its samples fewer than the slots of the job), and other
    /// streams would take its place without a word.
    pub fn new(
        mixture: SlotMixture<'_>,
        base: Vec<u64>,
        first: &[u64],
        mut more: impl FnMut(usize, u64) -> Result<u64>,
    ) -> Result<Self> {
        let SlotMixture {
            policy, weights, ..
        } = mixture;
        let counts = slot_counts(policy, weights, first)?;
        let mut passes: Vec<Vec<u64>> = first.iter().map(|&n| vec![n]).collect();
        for (s, stream_passes) in passes.iter_mut().enumerate() {
            let mut read: u64 = stream_passes.iter().sum();
            while read < counts[s] {
                if stream_passes.len() as u64 >= MAX_PASSES {
                    return Err(Error::Config {
                        name: "weights",
                        reason: format!(
                            "stream {s} would be read more than {MAX_PASSES} times in one \
                             epoch under policy='restart'"
                        ),
                    });
                }
                let n = more(s, base[s] + stream_passes.len() as u64)?;
                if n == 0 {
                    return Err(Error::Config {
                        name: "weights",
                        reason: format!(
                            "stream {s} has no sample for slot {} (rank x num_workers + \
                             worker) in a pass, so under policy='restart' it cannot come in \
                             its weight: give it at least one sample per worker of every \
                             rank, use fewer workers, or policy='continue'",
                            mixture.slot
                        ),
                    });
                }
                stream_passes.push(n);
                read += n;
            }
        }
        let pass_sizes = passes.clone();
        if policy == Policy::Restart {
            for (s, stream_passes) in passes.iter_mut().enumerate() {
                let read: u64 = stream_passes.iter().sum();
                if let Some(last) = stream_passes.last_mut() {
                    *last -= read - counts[s];
                }
            }
        }
        let order = slot_order(
            policy,
            weights,
            &counts,
            mixture.key,
            mixture.slot,
            mixture.generation,
        )?;
        Ok(SlotPlan {
            base,
            passes,
            pass_sizes,
            counts,
            order,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const POLICIES: [Policy; 3] = [Policy::Stop, Policy::Restart, Policy::Continue];

    fn tally(order: &[u8], streams: usize) -> Vec<u64> {
        let mut n = vec![0u64; streams];
        for &s in order {
            n[s as usize] += 1;
        }
        n
    }

    proptest! {
        #[test]
        fn orders_hold_each_stream_exactly_its_count(
            weights in prop::collection::vec(0.0f64..10.0, 1..6),
            available in prop::collection::vec(0u64..400, 6),
            policy in 0usize..3,
            seed in any::<u64>(), epoch in 0u64..100, slot in 0u32..16, generation in 0u32..4,
        ) {
            prop_assume!(weights.iter().any(|&w| w > 0.0));
            let policy = POLICIES[policy];
            let available = &available[..weights.len()];
            let counts = slot_counts(policy, &weights, available).unwrap();
            let order = slot_order(policy, &weights, &counts, (seed, epoch), slot, generation).unwrap();
            prop_assert_eq!(tally(&order, weights.len()), counts.clone());
            for (s, (&n, &a)) in counts.iter().zip(available).enumerate() {
                if weights[s] == 0.0 { prop_assert_eq!(n, 0); }
                match policy {
                    Policy::Stop => prop_assert!(n <= a),
                    Policy::Continue => prop_assert!(weights[s] == 0.0 || n == a),
                    Policy::Restart => prop_assert!(weights[s] == 0.0 || n >= a),
                }
            }
            // Determinism: the same inputs, the same order.
            let again = slot_order(policy, &weights, &counts, (seed, epoch), slot, generation).unwrap();
            prop_assert_eq!(&order, &again);
        }

        #[test]
        fn weights_at_any_scale_give_the_same_mixture(
            weights in prop::collection::vec(0.0f64..10.0, 1..6),
            available in prop::collection::vec(0u64..400, 6),
            policy in 0usize..3,
            power in -1000i32..1000,
            factor in -300.0f64..307.0,
            seed in any::<u64>(), slot in 0u32..16,
        ) {
            prop_assume!(weights.iter().any(|&w| w > 0.0));
            let policy = POLICIES[policy];
            let available = &available[..weights.len()];
            let plan = |weights: &[f64]| {
                let counts = slot_counts(policy, weights, available).unwrap();
                let order = slot_order(policy, weights, &counts, (seed, 1), slot, 0).unwrap();
                (counts, order)
            };
            let reference = plan(&weights);
            // A power of two: exactly the same weights relative to each other.
            let scale = pow2(power);
            let scaled: Vec<f64> = weights.iter().map(|&w| w * scale).collect();
            prop_assume!(scaled.iter().zip(&weights).all(|(&s, &w)| (s == 0.0) == (w == 0.0)));
            prop_assume!(scaled.iter().zip(&weights).all(|(&s, &w)| s / scale == w));
            prop_assert_eq!(&plan(&scaled), &reference);
            // Any factor, up to where the largest weight is near f64::MAX:
            // the same up to the rounding of each product (which moves a
            // count or a draw only at an exact tie, never met in practice).
            let scale = 10f64.powf(factor);
            let scaled: Vec<f64> = weights.iter().map(|&w| w * scale).collect();
            prop_assume!(scaled.iter().all(|w| w.is_finite()));
            prop_assume!(scaled.iter().zip(&weights).all(|(&s, &w)| (s == 0.0) == (w == 0.0)));
            prop_assert_eq!(&plan(&scaled), &reference);
        }

        #[test]
        fn stop_and_restart_counts_follow_the_weights(
            weights in prop::collection::vec(0.05f64..10.0, 2..5),
            available in prop::collection::vec(1u64..5000, 5),
            restart in any::<bool>(),
        ) {
            let policy = if restart { Policy::Restart } else { Policy::Stop };
            let available = &available[..weights.len()];
            let counts = slot_counts(policy, &weights, available).unwrap();
            let total: f64 = weights.iter().sum();
            let length: u64 = counts.iter().sum();
            // Each count is weight * length, up to one per stream of rounding.
            for (s, &n) in counts.iter().enumerate() {
                let expected = weights[s] / total * length as f64;
                prop_assert!((n as f64 - expected).abs() <= weights.len() as f64, "{counts:?} {weights:?}");
            }
        }
    }

    /// Over many seeds, the first half of a slot's order holds each stream
    /// within 5 standard deviations of its weight (hypergeometric for
    /// stop/restart, binomial before any stream runs out for continue).
    #[test]
    fn proportions_within_five_sigma_over_many_seeds() {
        let weights = [0.7, 0.2, 0.1];
        let available = [700u64, 400, 300];
        for policy in POLICIES {
            let counts = slot_counts(policy, &weights, &available).unwrap();
            let length: u64 = counts.iter().sum();
            for seed in 0..200u64 {
                let order = slot_order(policy, &weights, &counts, (seed, 1), 3, 0).unwrap();
                let k = match policy {
                    Policy::Continue => 400, // before the first stream can run out
                    _ => length as usize / 2,
                };
                let got = tally(&order[..k], 3);
                for s in 0..3 {
                    let p = match policy {
                        Policy::Continue => weights[s],
                        _ => counts[s] as f64 / length as f64,
                    };
                    let mean = k as f64 * p;
                    let sigma = (k as f64 * p * (1.0 - p)).sqrt();
                    assert!(
                        (got[s] as f64 - mean).abs() <= 5.0 * sigma + 1.0,
                        "{policy:?} seed {seed} stream {s}: {} of {k}, expected {mean}",
                        got[s]
                    );
                }
            }
        }
    }

    #[test]
    fn slots_epochs_and_generations_differ() {
        let counts = [50u64, 50];
        let w = [0.5, 0.5];
        let base = slot_order(Policy::Stop, &w, &counts, (1, 1), 0, 0).unwrap();
        for other in [
            slot_order(Policy::Stop, &w, &counts, (1, 2), 0, 0).unwrap(),
            slot_order(Policy::Stop, &w, &counts, (1, 1), 1, 0).unwrap(),
            slot_order(Policy::Stop, &w, &counts, (1, 1), 0, 1).unwrap(),
            slot_order(Policy::Stop, &w, &counts, (2, 1), 0, 0).unwrap(),
        ] {
            assert_ne!(base, other);
        }
    }

    #[test]
    fn policies_count_as_documented() {
        let w = [0.75, 0.25];
        assert_eq!(
            slot_counts(Policy::Stop, &w, &[30, 100]).unwrap(),
            vec![30, 10]
        );
        assert_eq!(
            slot_counts(Policy::Restart, &w, &[30, 100]).unwrap(),
            vec![300, 100]
        );
        assert_eq!(
            slot_counts(Policy::Continue, &w, &[30, 100]).unwrap(),
            vec![30, 100]
        );
        assert_eq!(
            slot_counts(Policy::Stop, &[0.7, 0.3], &[16, 6]).unwrap(),
            vec![14, 6]
        );
        assert_eq!(
            slot_counts(Policy::Stop, &[1.0, 0.0], &[5, 9]).unwrap(),
            vec![5, 0]
        );
    }

    /// Weights near `f64::MAX` (whose sum overflows) and near the least
    /// positive `f64` give the mixture of the same weights near 1.
    #[test]
    fn weights_that_overflow_or_underflow_give_the_mixture_of_their_ratios() {
        for policy in POLICIES {
            for (weights, ratio) in [
                ([1e308, 1e308], [1.0, 1.0]),
                ([f64::MAX, f64::MAX / 4.0], [4.0, 1.0]),
                ([5e-324, 5e-324], [1.0, 1.0]),
                ([1e-310, 3e-310], [1.0, 3.0]),
            ] {
                let counts = slot_counts(policy, &weights, &[10, 30]).unwrap();
                let expected = slot_counts(policy, &ratio, &[10, 30]).unwrap();
                assert_eq!(counts, expected, "{policy:?} {weights:?}");
                assert_eq!(
                    slot_order(policy, &weights, &counts, (7, 2), 1, 0).unwrap(),
                    slot_order(policy, &ratio, &expected, (7, 2), 1, 0).unwrap(),
                    "{policy:?} {weights:?}"
                );
            }
        }
        assert_eq!(
            slot_counts(Policy::Stop, &[1e308, 1e308], &[10, 30]).unwrap(),
            vec![10, 10]
        );
        // A weight 2^1100 below the largest stays in the mixture.
        let tiny = [1e300, 1e-31];
        assert_eq!(
            slot_counts(Policy::Continue, &tiny, &[10, 30]).unwrap(),
            vec![10, 30]
        );
    }

    #[test]
    fn bad_weights_are_refused() {
        for w in [
            &[][..],
            &[0.0, 0.0][..],
            &[-1.0, 2.0][..],
            &[f64::NAN][..],
            &[f64::INFINITY][..],
        ] {
            assert!(check_weights(w).is_err(), "{w:?}");
        }
        assert!(check_weights(&vec![1.0; MAX_STREAMS + 1]).is_err());
        assert!("shuffle".parse::<Policy>().is_err());
        assert!(slot_counts(Policy::Restart, &[1e-131, 1.0], &[1, 0]).is_err());
    }
}
