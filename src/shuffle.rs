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

    /// A buffer holding `items` (in this order), its RNG already advanced.
    pub fn restore(max_items: usize, max_bytes: usize, rng: ChaCha8Rng, items: Vec<T>) -> Self {
        let mut buffer = ShuffleBuffer::new(max_items, max_bytes, rng);
        buffer.bytes = items.iter().map(ByteSize::byte_size).sum();
        buffer.items = items;
        buffer
    }

    /// Whether `size` more bytes need a held item out first.
    pub fn is_full_for(&self, size: usize) -> bool {
        !self.items.is_empty()
            && (self.items.len() >= self.max_items || self.bytes + size > self.max_bytes)
    }

    /// Adds `item`, first emitting random held items (with the index they
    /// were swap-removed from) into `out` until it fits.
    pub fn push(&mut self, item: T, mut out: impl FnMut(usize, T)) {
        while self.is_full_for(item.byte_size()) {
            if let Some((index, evicted)) = self.pop_random() {
                out(index, evicted);
            }
        }
        self.insert(item);
    }

    /// Adds `item` without making room (see [`ShuffleBuffer::is_full_for`]).
    pub fn insert(&mut self, item: T) {
        self.bytes += item.byte_size();
        self.items.push(item);
    }

    /// Removes a uniformly chosen held item (swap-remove) and returns its
    /// index and the item.
    pub fn pop_random(&mut self) -> Option<(usize, T)> {
        if self.items.is_empty() {
            return None;
        }
        let index = below(&mut self.rng, self.items.len());
        let item = self.items.swap_remove(index);
        self.bytes -= item.byte_size();
        Some((index, item))
    }

    /// Gives back the bounds and the RNG, dropping held items.
    pub fn into_parts(self) -> (usize, usize, ChaCha8Rng) {
        (self.max_items, self.max_bytes, self.rng)
    }

    /// The RNG's word position, for resuming.
    pub fn rng_word_pos(&self) -> u128 {
        self.rng.get_word_pos()
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
            buffer.push(item.clone(), |_, x| out.push(x));
            within_bounds &= buffer.len() <= max_items.max(1)
                && (buffer.bytes() <= max_bytes || buffer.len() == 1);
        }
        while let Some((_, x)) = buffer.pop_random() {
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
    fn restored_buffer_continues_identically() {
        let items: Vec<Item> = (0..100).map(|i| Item(i, 1)).collect();
        let rng = rng_for(5, 0, Purpose::ShuffleBuffer { slot: 0 });
        let mut a = ShuffleBuffer::new(10, 1 << 20, rng);
        let mut first = Vec::new();
        for item in &items[..40] {
            a.push(item.clone(), |_, x| first.push(x));
        }
        let mut rng = rng_for(5, 0, Purpose::ShuffleBuffer { slot: 0 });
        rng.set_word_pos(a.rng_word_pos());
        let mut b = ShuffleBuffer::restore(10, 1 << 20, rng, a.items.clone());
        let (mut rest_a, mut rest_b) = (Vec::new(), Vec::new());
        for item in &items[40..] {
            a.push(item.clone(), |_, x| rest_a.push(x));
            b.push(item.clone(), |_, x| rest_b.push(x));
        }
        assert_eq!(rest_a, rest_b);
    }

    #[test]
    fn size_one_keeps_order() {
        let items: Vec<Item> = (0..20).map(|i| Item(i, 1)).collect();
        assert_eq!(run(&items, 1, 1 << 20, 9).0, items);
    }
}
