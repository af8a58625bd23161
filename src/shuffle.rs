//! Bounded shuffle buffer: holds at most `max_items` items and `max_bytes`
//! bytes (a single larger item is held alone), and emits a uniformly chosen
//! held item whenever room is needed. Deterministic given its RNG.

use rand_chacha::ChaCha8Rng;

use crate::plan::order::below;

/// Something with a size in bytes, for the buffer's byte budget.
pub trait ByteSize {
    /// Bytes this item counts against the budget.
    fn byte_size(&self) -> usize;
}

/// A bounded, seeded shuffle buffer.
#[derive(Debug)]
pub struct ShuffleBuffer<T> {
    items: Vec<T>,
    bytes: usize,
    max_items: usize,
    max_bytes: usize,
    rng: ChaCha8Rng,
}

impl<T: ByteSize> ShuffleBuffer<T> {
    /// A buffer of at most `max_items` items (at least 1) and `max_bytes` bytes.
    pub fn new(max_items: usize, max_bytes: usize, rng: ChaCha8Rng) -> Self {
        let max_items = max_items.max(1);
        ShuffleBuffer {
            items: Vec::with_capacity(max_items.min(1 << 16)),
            bytes: 0,
            max_items,
            max_bytes,
            rng,
        }
    }

    /// Adds `item`, first emitting random held items into `out` until it fits.
    pub fn push(&mut self, item: T, mut out: impl FnMut(T)) {
        let size = item.byte_size();
        while !self.items.is_empty()
            && (self.items.len() >= self.max_items || self.bytes + size > self.max_bytes)
        {
            if let Some(evicted) = self.pop_random() {
                out(evicted);
            }
        }
        self.bytes += size;
        self.items.push(item);
    }

    /// Removes and returns a uniformly chosen held item.
    pub fn pop_random(&mut self) -> Option<T> {
        if self.items.is_empty() {
            return None;
        }
        let index = below(&mut self.rng, self.items.len());
        let item = self.items.swap_remove(index);
        self.bytes -= item.byte_size();
        Some(item)
    }

    /// Number of items held.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Whether the buffer holds nothing.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::order::{rng_for, Purpose};
    use proptest::prelude::*;

    #[derive(Debug, Clone, PartialEq)]
    struct Item(u32, usize);

    impl ByteSize for Item {
        fn byte_size(&self) -> usize {
            self.1
        }
    }

    fn run(items: &[Item], max_items: usize, max_bytes: usize, seed: u64) -> (Vec<Item>, bool) {
        let mut buffer = ShuffleBuffer::new(
            max_items,
            max_bytes,
            rng_for(seed, 0, Purpose::ShuffleBuffer { slot: 0 }),
        );
        let mut out = Vec::new();
        let mut within_bounds = true;
        for item in items {
            buffer.push(item.clone(), |x| out.push(x));
            within_bounds &= buffer.len() <= max_items.max(1)
                && (buffer.bytes() <= max_bytes || buffer.len() == 1);
        }
        while let Some(x) = buffer.pop_random() {
            out.push(x);
        }
        (out, within_bounds)
    }

    proptest! {
        #[test]
        fn emits_every_item_once_within_bounds(
            sizes in prop::collection::vec(0usize..500, 0..400),
            max_items in 0usize..64,
            max_bytes in 1usize..4000,
            seed in any::<u64>(),
        ) {
            let items: Vec<Item> = sizes.iter().enumerate().map(|(i, &s)| Item(i as u32, s)).collect();
            let (out, within_bounds) = run(&items, max_items, max_bytes, seed);
            prop_assert!(within_bounds);
            let mut ids: Vec<u32> = out.iter().map(|i| i.0).collect();
            ids.sort_unstable();
            prop_assert_eq!(ids, (0..items.len() as u32).collect::<Vec<_>>());
        }

        #[test]
        fn deterministic_for_a_seed(n in 0u32..300, max_items in 1usize..50, seed in any::<u64>()) {
            let items: Vec<Item> = (0..n).map(|i| Item(i, 1)).collect();
            prop_assert_eq!(run(&items, max_items, 1 << 20, seed), run(&items, max_items, 1 << 20, seed));
        }
    }

    #[test]
    fn shuffles_and_seeds_differ() {
        let items: Vec<Item> = (0..200).map(|i| Item(i, 1)).collect();
        let (a, _) = run(&items, 50, 1 << 20, 1);
        let (b, _) = run(&items, 50, 1 << 20, 2);
        assert_ne!(a, items);
        assert_ne!(a, b);
    }

    #[test]
    fn size_one_keeps_order() {
        let items: Vec<Item> = (0..20).map(|i| Item(i, 1)).collect();
        assert_eq!(run(&items, 1, 1 << 20, 9).0, items);
    }
}
