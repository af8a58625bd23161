//! Bounded shuffle buffer: holds at most `max_items` items and `max_bytes`
//! bytes (a single larger item is held alone), and emits a uniformly chosen
//! held item whenever room is needed. It starts emitting once it holds
//! `initial` items and then grows by one item for every item it emits, up to
//! `max_items`, so the first samples leave early instead of after a full fill.
//! Deterministic given its RNG and the number of items emitted so far.

use std::ops::ControlFlow;

use rand_chacha::ChaCha8Rng;

use crate::byte_size::ByteSize;
use crate::plan::order::below;

/// How much a shuffle buffer holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShuffleBounds {
    /// Most items held (at least 1).
    pub max_items: usize,
    /// Most bytes held (a single larger item is held alone).
    pub max_bytes: usize,
    /// Items held before the first is emitted (at least 1, at most `max_items`).
    pub initial: usize,
}

/// An item a buffer let out to make room for a new one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Evicted<T> {
    /// Where the item was held (it was swap-removed from there).
    pub index: usize,
    /// The RNG's word position once the item was chosen, for resuming.
    pub rng_word_pos: u128,
    /// The item.
    pub item: T,
}

/// A bounded, seeded shuffle buffer.
#[derive(Debug)]
pub struct ShuffleBuffer<T> {
    items: Vec<T>,
    bytes: usize,
    bounds: ShuffleBounds,
    emitted: u64,
    rng: ChaCha8Rng,
}

impl<T: ByteSize> ShuffleBuffer<T> {
    /// An empty buffer within `bounds` that has already emitted `emitted`
    /// items (0 at the start of an epoch; a resumed stream's count otherwise).
    pub fn new(bounds: ShuffleBounds, rng: ChaCha8Rng, emitted: u64) -> Self {
        let max_items = bounds.max_items.max(1);
        let bounds = ShuffleBounds {
            max_items,
            max_bytes: bounds.max_bytes,
            initial: bounds.initial.clamp(1, max_items),
        };
        ShuffleBuffer {
            items: Vec::with_capacity(max_items.min(1 << 16)),
            bytes: 0,
            bounds,
            emitted,
            rng,
        }
    }

    /// Replaces the held items with `items` (in this order), for a resume.
    pub fn refill(&mut self, items: Vec<T>) {
        self.bytes = items.iter().map(ByteSize::byte_size).sum();
        self.items = items;
    }

    /// Items the buffer may hold now: `initial` plus one per item emitted,
    /// at most `max_items`.
    pub fn capacity(&self) -> usize {
        let grown = usize::try_from(self.emitted).unwrap_or(usize::MAX);
        self.bounds
            .initial
            .saturating_add(grown)
            .min(self.bounds.max_items)
    }

    /// Whether `size` more bytes need a held item out first.
    fn is_full_for(&self, size: usize) -> bool {
        !self.items.is_empty()
            && (self.items.len() >= self.capacity() || self.bytes + size > self.bounds.max_bytes)
    }

    /// Adds `item`, first letting random held items out into `out` until
    /// it fits. When `out` breaks (its consumer is gone) the push stops
    /// there and `item` is dropped, not held.
    pub fn push(
        &mut self,
        item: T,
        mut out: impl FnMut(Evicted<T>) -> ControlFlow<()>,
    ) -> ControlFlow<()> {
        while self.is_full_for(item.byte_size()) {
            let Some((index, evicted)) = self.pop_random() else {
                break;
            };
            out(Evicted {
                index,
                rng_word_pos: self.rng_word_pos(),
                item: evicted,
            })?;
        }
        self.bytes += item.byte_size();
        self.items.push(item);
        ControlFlow::Continue(())
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
        self.emitted += 1;
        Some((index, item))
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

    fn bounds(max_items: usize, max_bytes: usize, initial: usize) -> ShuffleBounds {
        ShuffleBounds {
            max_items,
            max_bytes,
            initial,
        }
    }

    fn buffer(bounds: ShuffleBounds, seed: u64) -> ShuffleBuffer<Item> {
        ShuffleBuffer::new(
            bounds,
            rng_for(seed, 0, Purpose::ShuffleBuffer { slot: 0 }),
            0,
        )
    }

    fn items(n: u32) -> Vec<Item> {
        (0..n).map(|i| Item(i, 1)).collect()
    }

    /// Pushes every item, then drains; returns the output, whether the
    /// buffer stayed within its bounds after every push, and the number of
    /// items emitted by each push.
    fn run(items: &[Item], bounds: ShuffleBounds, seed: u64) -> (Vec<Item>, bool, Vec<usize>) {
        let mut buffer = buffer(bounds, seed);
        let mut out = Vec::new();
        let mut within_bounds = true;
        let mut emitted_per_push = Vec::new();
        for item in items {
            let before = out.len();
            let _ = buffer.push(item.clone(), |e| {
                out.push(e.item);
                ControlFlow::Continue(())
            });
            emitted_per_push.push(out.len() - before);
            let max_items = bounds.max_items.max(1);
            let allowed = max_items.min(bounds.initial.clamp(1, max_items) + out.len());
            within_bounds &= buffer.len() <= allowed
                && (buffer.bytes() <= bounds.max_bytes || buffer.len() == 1);
        }
        while let Some((_, x)) = buffer.pop_random() {
            out.push(x);
        }
        (out, within_bounds, emitted_per_push)
    }

    /// Each item let out comes with where it was held and the RNG position
    /// after it was chosen, as popping it by hand gives; a push that
    /// `out` breaks holds nothing new.
    #[test]
    fn evictions_match_pops_and_a_break_stops_the_push() {
        let b = bounds(3, 1 << 20, 3);
        let (mut pushed, mut popped) = (buffer(b, 9), buffer(b, 9));
        for item in items(3) {
            let _ = pushed.push(item.clone(), |_| panic!("room was left"));
            let _ = popped.push(item, |_| panic!("room was left"));
        }
        for item in items(20).into_iter().skip(3) {
            let mut seen = Vec::new();
            let flow = pushed.push(item.clone(), |e| {
                seen.push(e);
                ControlFlow::Continue(())
            });
            assert!(flow.is_continue());
            let (index, by_hand) = popped.pop_random().unwrap();
            let expected = Evicted {
                index,
                rng_word_pos: popped.rng_word_pos(),
                item: by_hand,
            };
            assert_eq!(seen, [expected]);
            let _ = popped.push(item, |_| panic!("room was made"));
        }
        let held = pushed.len();
        let flow = pushed.push(Item(99, 1), |_| ControlFlow::Break(()));
        assert!(flow.is_break());
        assert_eq!(pushed.len(), held - 1);
        assert!(pushed.items.iter().all(|item| item.0 != 99));
    }

    proptest! {
        #[test]
        fn emits_every_item_once_within_bounds(
            sizes in prop::collection::vec(0usize..500, 0..400),
            max_items in 0usize..64,
            max_bytes in 1usize..4000,
            initial in 0usize..80,
            seed in any::<u64>(),
        ) {
            let items: Vec<Item> = sizes.iter().enumerate().map(|(i, &s)| Item(i as u32, s)).collect();
            let (out, within_bounds, _) = run(&items, bounds(max_items, max_bytes, initial), seed);
            prop_assert!(within_bounds);
            let mut ids: Vec<u32> = out.iter().map(|i| i.0).collect();
            ids.sort_unstable();
            prop_assert_eq!(ids, (0..items.len() as u32).collect::<Vec<_>>());
        }

        #[test]
        fn deterministic_for_a_seed(
            n in 0u32..300,
            max_items in 1usize..50,
            initial in 1usize..50,
            seed in any::<u64>(),
        ) {
            let b = bounds(max_items, 1 << 20, initial);
            prop_assert_eq!(run(&items(n), b, seed), run(&items(n), b, seed));
        }

        #[test]
        fn holds_initial_items_then_grows_to_the_full_size(
            max_items in 1usize..60,
            initial in 1usize..60,
            seed in any::<u64>(),
        ) {
            let initial = initial.min(max_items);
            let n = 2 * max_items as u32 + 5;
            let mut buffer = buffer(bounds(max_items, 1 << 20, initial), seed);
            let mut emitted = 0;
            for (pushed, item) in items(n).into_iter().enumerate() {
                let before = emitted;
                let _ = buffer.push(item, |_| {
                    emitted += 1;
                    ControlFlow::Continue(())
                });
                // Silent until `initial` items are held, then at most one
                // out per item in.
                prop_assert_eq!(emitted == 0, pushed < initial);
                prop_assert!(emitted - before <= 1);
            }
            prop_assert_eq!(buffer.len(), max_items);
        }

        #[test]
        fn resumed_buffer_continues_identically(
            n in 1u32..300,
            split in 0u32..300,
            max_items in 1usize..40,
            initial in 1usize..40,
            seed in any::<u64>(),
        ) {
            let all = items(n);
            let split = split.min(n) as usize;
            let b = bounds(max_items, 1 << 20, initial);
            let mut a = buffer(b, seed);
            let mut emitted = 0u64;
            for item in &all[..split] {
                let _ = a.push(item.clone(), |_| {
                    emitted += 1;
                    ControlFlow::Continue(())
                });
            }
            let mut rng = rng_for(seed, 0, Purpose::ShuffleBuffer { slot: 0 });
            rng.set_word_pos(a.rng_word_pos());
            let mut resumed = ShuffleBuffer::new(b, rng, emitted);
            resumed.refill(a.items.clone());
            let (mut rest_a, mut rest_b) = (Vec::new(), Vec::new());
            for item in &all[split..] {
                let _ = a.push(item.clone(), |e| {
                    rest_a.push(e.item);
                    ControlFlow::Continue(())
                });
                let _ = resumed.push(item.clone(), |e| {
                    rest_b.push(e.item);
                    ControlFlow::Continue(())
                });
            }
            while let (Some((_, x)), Some((_, y))) = (a.pop_random(), resumed.pop_random()) {
                rest_a.push(x);
                rest_b.push(y);
            }
            prop_assert!(a.is_empty() && resumed.is_empty());
            prop_assert_eq!(rest_a, rest_b);
        }
    }

    #[test]
    fn shuffles_and_seeds_differ() {
        let b = bounds(50, 1 << 20, 50);
        let (a, _, _) = run(&items(200), b, 1);
        let (other, _, _) = run(&items(200), b, 2);
        assert_ne!(a, items(200));
        assert_ne!(a, other);
    }

    #[test]
    fn size_one_keeps_order() {
        assert_eq!(run(&items(20), bounds(1, 1 << 20, 1), 9).0, items(20));
    }
}
