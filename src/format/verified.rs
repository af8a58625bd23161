//! Samples handed out only once the bytes they came from passed the
//! stream's own checks (a gzip member's CRC-32, a zstd frame's checksum),
//! within a budget of decoded bytes: shared by the formats that read a
//! stream of samples (tar, JSON lines), as `tar::read_samples_verified`
//! describes.

use std::collections::VecDeque;
use std::ops::ControlFlow;

use super::{ByteSource, Outcome, Sample, ShardRef};
use crate::error::{Error, Result};

/// A sample waiting for the bytes it came from to be verified.
pub(super) struct Held {
    sample: Sample,
    /// The offset the stream's checks must reach first: the end of the
    /// header that ended the sample.
    needs: u64,
}

/// Hands samples to the callback, holding back those whose bytes the
/// stream has not verified yet (see `tar::read_samples_verified`).
pub(super) struct Outbox<'f, F> {
    on_sample: &'f mut F,
    held: VecDeque<Held>,
    /// Where the stream's offsets start in the shard.
    base: u64,
    budget: u64,
    /// Samples handed out before the bytes they came from were verified,
    /// and not verified since.
    unverified: u64,
    /// What the last of those needed verified.
    unverified_needs: u64,
}

impl<'f, F: FnMut(Sample) -> ControlFlow<()>> Outbox<'f, F> {
    pub(super) fn new(shard: &ShardRef, budget: u64, on_sample: &'f mut F) -> Self {
        Outbox {
            on_sample,
            held: VecDeque::new(),
            base: shard.base_offset,
            budget,
            unverified: 0,
            unverified_needs: 0,
        }
    }

    /// Hands `sample` out, or holds it until the stream settled to `needs`
    /// (offsets relative to the read's start); `settled` and `position`
    /// are the stream's at this point.
    pub(super) fn offer(
        &mut self,
        sample: Sample,
        needs: u64,
        settled: u64,
        position: u64,
    ) -> ControlFlow<()> {
        if self.held.is_empty() && settled >= needs {
            return self.hand_out(sample);
        }
        self.held.push_back(Held { sample, needs });
        self.settle(settled, position)
    }

    /// Hands out the held samples the stream has verified, then, oldest
    /// first, those that start more than the budget before `position`.
    #[inline]
    pub(super) fn settle(&mut self, settled: u64, position: u64) -> ControlFlow<()> {
        if self.held.is_empty() {
            return ControlFlow::Continue(());
        }
        self.settle_held(settled, position)
    }

    /// [`Outbox::settle`] when samples are held.
    #[cold]
    fn settle_held(&mut self, settled: u64, position: u64) -> ControlFlow<()> {
        if settled >= self.unverified_needs {
            self.unverified = 0;
        }
        while let Some(front) = self.held.front() {
            let verified = front.needs <= settled;
            let start = front.sample.offset.saturating_sub(self.base);
            if !verified && position.saturating_sub(start) <= self.budget {
                break;
            }
            let Held { sample, needs } = self.held.pop_front().expect("a front sample");
            if !verified {
                self.unverified += 1;
                self.unverified_needs = needs;
            }
            self.hand_out(sample)?;
        }
        ControlFlow::Continue(())
    }

    /// Hands out every held sample: the stream verified all its bytes.
    fn release_all(&mut self) -> ControlFlow<()> {
        while let Some(Held { sample, .. }) = self.held.pop_front() {
            self.hand_out(sample)?;
        }
        ControlFlow::Continue(())
    }

    pub(super) fn hand_out(&mut self, sample: Sample) -> ControlFlow<()> {
        (self.on_sample)(sample)
    }

    /// Ends a read the format failed with `error`. Bad data decoded from a
    /// stream that fails its own checks is the stream's fault, so the
    /// stream is read to its end first: its failure when it has one; else
    /// the samples held (which it verified) are handed out, then `error`
    /// (or [`Outcome::Stopped`] when the consumer had what it wanted).
    pub(super) fn fail<R: ByteSource>(&mut self, reader: &mut R, error: Error) -> Result<Outcome> {
        if let Some(source) = reader.take_failure() {
            return Err(self.unverified_note(source));
        }
        if reader.check_trailer().is_err() {
            if let Some(source) = reader.take_failure() {
                return Err(self.unverified_note(source));
            }
        } else if self.release_all().is_break() {
            return Ok(Outcome::Stopped);
        }
        Err(error)
    }

    /// Ends a read that reached the end of the format's data: checks what
    /// follows in the stream (a compressed stream's trailer), then hands
    /// out every sample held. An error when the stream fails, or when bytes
    /// follow that are not its trailer (`after_end` names them).
    pub(super) fn finish<R: ByteSource>(
        &mut self,
        reader: &mut R,
        after_end: impl FnOnce(std::io::Error) -> Error,
    ) -> Result<ControlFlow<()>> {
        if let Err(error) = reader.check_trailer() {
            if let Some(source) = reader.take_failure() {
                return Err(self.unverified_note(source));
            }
            return Err(after_end(error));
        }
        Ok(self.release_all())
    }

    /// `error` (the stream failed), saying how many samples were handed
    /// out from bytes it had not verified, when some were.
    pub(super) fn unverified_note(&self, mut error: Error) -> Error {
        if self.unverified == 0 {
            return error;
        }
        if let Error::Decompress { reason, .. } = &mut error {
            let n = self.unverified;
            let (budget, samples) = (self.budget, if n == 1 { "sample" } else { "samples" });
            reason.push_str(&format!(
                "; {n} {samples} of this shard had already been handed out before the \
                 checksum covering them could be read (a gzip member or zstd frame larger \
                 than the {budget}-byte verify budget)"
            ));
        }
        error
    }
}
