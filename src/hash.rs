//! The hashes the crate keeps stable across builds and platforms (they
//! reach saved states, seeds and retry jitter): 64-bit FNV-1a and the
//! splitmix64 finaliser, in one place.

/// The FNV-1a offset basis.
const FNV_BASIS: u64 = 0xcbf2_9ce4_8422_2325;

/// The FNV-1a prime.
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// The splitmix64 increment (the golden ratio's 64 bits).
pub const GOLDEN_GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// A 64-bit FNV-1a hash, fed in parts.
#[derive(Debug, Clone, Copy)]
pub struct Fnv1a(u64);

impl Default for Fnv1a {
    fn default() -> Self {
        Fnv1a(FNV_BASIS)
    }
}

impl Fnv1a {
    /// A hash from the standard offset basis.
    pub fn new() -> Self {
        Self::default()
    }

    /// A hash from `basis` instead of the standard offset basis.
    pub fn with_basis(basis: u64) -> Self {
        Fnv1a(basis)
    }

    /// Feeds `bytes`.
    pub fn bytes(&mut self, bytes: &[u8]) -> &mut Self {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(FNV_PRIME);
        }
        self
    }

    /// Feeds `value` as its 8 little-endian bytes.
    pub fn u64(&mut self, value: u64) -> &mut Self {
        self.bytes(&value.to_le_bytes())
    }

    /// The hash so far.
    pub fn finish(&self) -> u64 {
        self.0
    }
}

/// The 64-bit FNV-1a hash of `bytes`.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    Fnv1a::new().bytes(bytes).finish()
}

/// The splitmix64 finaliser: a bijective mix of 64 bits.
pub fn splitmix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a_gives_the_published_values() {
        // The FNV-1a 64-bit test vectors of the reference implementation.
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a(b"foobar"), 0x8594_4171_f739_67e8);
        // Fed in parts, the same.
        assert_eq!(
            Fnv1a::new().bytes(b"foo").bytes(b"bar").finish(),
            fnv1a(b"foobar")
        );
        assert_eq!(Fnv1a::new().u64(1).finish(), fnv1a(&1u64.to_le_bytes()));
    }

    #[test]
    fn splitmix64_gives_the_reference_sequence() {
        // splitmix64 seeded with 0: the reference generator's first outputs.
        let mut state = 0u64;
        let mut next = || {
            state = state.wrapping_add(GOLDEN_GAMMA);
            splitmix64(state)
        };
        assert_eq!(next(), 0xe220_a839_7b1d_cdaf);
        assert_eq!(next(), 0x6e78_9e6a_a1b9_65f4);
        assert_eq!(next(), 0x06c4_5d18_8009_454f);
    }
}
