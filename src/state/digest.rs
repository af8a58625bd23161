//! Order-independent digests of sample ids: modular hashing in the
//! integers modulo the Mersenne prime 2^61 - 1, with a closed form for a
//! run of samples of one shard.

use std::ops::Range;

use crate::hash::{splitmix64, GOLDEN_GAMMA};

// Digests: sample `i` of shard `s` hashes to `c_s * g_s^i` in the integers
// modulo the prime 2^61 - 1 (`c_s`, `g_s` drawn from `s`), and a digest is
// the sum of the hashes of its ids. The sum does not depend on the order of
// the ids, the sum over a run of samples has a closed form (a geometric
// series), and the next sample of a shard hashes with one multiplication.

/// The Mersenne prime 2^61 - 1.
pub(super) const P: u64 = (1 << 61) - 1;

pub(super) fn mul_mod(a: u64, b: u64) -> u64 {
    let x = u128::from(a) * u128::from(b);
    let folded = ((x & u128::from(P)) + (x >> 61)) as u64;
    let r = (folded & P) + (folded >> 61);
    if r >= P {
        r - P
    } else {
        r
    }
}

pub(super) fn add_mod(a: u64, b: u64) -> u64 {
    let s = a + b;
    if s >= P {
        s - P
    } else {
        s
    }
}

pub(super) fn sub_mod(a: u64, b: u64) -> u64 {
    add_mod(a, P - b)
}

fn pow_mod(mut base: u64, mut exp: u64) -> u64 {
    let mut result = 1;
    while exp > 0 {
        if exp & 1 == 1 {
            result = mul_mod(result, base);
        }
        base = mul_mod(base, base);
        exp >>= 1;
    }
    result
}

/// `(c, g)` of a shard: `c` in `1..P`, `g` in `2..P`.
pub(super) fn shard_key(shard: u64) -> (u64, u64) {
    let c = 1 + splitmix64(shard ^ GOLDEN_GAMMA) % (P - 1);
    let g = 2 + splitmix64(shard ^ 0xd1b5_4a32_d192_ed03) % (P - 2);
    (c, g)
}

/// A sample id's share of a digest.
pub(super) fn id_hash(shard: u64, index: u64) -> u64 {
    let (c, g) = shard_key(shard);
    mul_mod(c, pow_mod(g, index))
}

/// The digest of the samples of `runs` (`(shard, samples)`), as a state's
/// `digest` holds it for the samples a slot handed out.
pub fn runs_digest(runs: &[(usize, Range<u64>)]) -> u64 {
    runs.iter().fold(0, |digest, (shard, samples)| {
        add_mod(digest, range_hash(*shard as u64, samples.clone()))
    })
}

/// The digest of a run of samples of one shard.
pub(super) fn range_hash(shard: u64, samples: Range<u64>) -> u64 {
    if samples.start >= samples.end {
        return 0;
    }
    let (c, g) = shard_key(shard);
    // c g^a (g^n - 1) / (g - 1); g - 1 is in 1..P - 1, so invertible.
    let series = mul_mod(
        sub_mod(pow_mod(g, samples.end - samples.start), 1),
        pow_mod(g - 1, P - 2),
    );
    mul_mod(mul_mod(c, pow_mod(g, samples.start)), series)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::saved::{format_digest, parse_decimal, parse_digest};

    #[test]
    fn digests_do_not_depend_on_order() {
        let a = range_hash(3, 0..10);
        let b = (0..10).rev().fold(0u64, |s, i| add_mod(s, id_hash(3, i)));
        assert_eq!(a, b);
        assert_ne!(id_hash(3, 4), id_hash(4, 3));
        assert_eq!(range_hash(3, 4..4), 0);
        assert_eq!(
            add_mod(range_hash(3, 0..4), range_hash(3, 4..10)),
            range_hash(3, 0..10)
        );
        // A run of any length sums in closed form.
        let huge = range_hash(7, 5..u64::MAX);
        assert_eq!(
            add_mod(huge, id_hash(7, u64::MAX)),
            add_mod(
                range_hash(7, 0..u64::MAX),
                sub_mod(id_hash(7, u64::MAX), range_hash(7, 0..5))
            )
        );
        assert_eq!(parse_digest(&format_digest(a)), Some(a));
        assert_eq!(parse_digest("+0000000000000a"), None);
        assert_eq!(parse_decimal("+5"), None);
        assert_eq!(parse_decimal(&u128::MAX.to_string()), Some(u128::MAX));
        assert_eq!(
            parse_decimal("340282366920938463463374607431768211456"),
            None
        );
    }
}
