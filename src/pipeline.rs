//! Wires plan -> source -> format -> shuffle for one slot, on a pipeline
//! thread, and hands samples to the consumer through a bounded queue.

use std::ops::ControlFlow;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender};
use std::sync::Arc;
use std::time::Duration;

use crate::config::{OnError, SlotSpec, StreamOptions};
use crate::error::{Error, Result};
use crate::format::{tar, Sample, ShardRef};
use crate::plan::{self, order, PlanParams, Purpose};
use crate::shuffle::ShuffleBuffer;
use crate::source::{ReadAhead, ReadAheadOptions};
use crate::spec::Shard;
use crate::stats::{Counter, Counters};

/// What the stream yields besides samples.
#[derive(Debug)]
pub enum Event {
    /// The next sample.
    Sample(Sample),
    /// A bad shard was skipped under `on_error="warn"`; the rest goes on.
    Skipped(Error),
}

/// The result of waiting a bounded time for the next event.
#[derive(Debug)]
pub enum Poll {
    /// An event arrived.
    Ready(Event),
    /// Nothing arrived within the wait; ask again.
    Pending,
    /// The stream has ended.
    End,
}

enum Message {
    Event(Event),
    Failed(Error),
    End,
}

/// The samples of one slot for one epoch, produced on a background thread.
/// Creating it starts the threads; dropping it stops them.
pub struct SampleStream {
    messages: Receiver<Message>,
    cancelled: Arc<AtomicBool>,
    units: Vec<usize>,
    done: bool,
}

impl SampleStream {
    /// Plans the epoch and starts streaming the units of `slot`.
    pub fn start(
        shards: &[Shard],
        options: &StreamOptions,
        epoch: u64,
        slot: SlotSpec,
        counters: Arc<Counters>,
    ) -> Result<Self> {
        let sizes: Vec<Option<u64>> = shards.iter().map(|s| s.size).collect();
        let params = PlanParams {
            seed: options.seed,
            epoch,
            shuffle_shards: options.shuffle_shards,
            world_size: slot.world_size,
            num_workers: slot.num_workers,
        };
        let units = plan::plan_epoch(&sizes, &params).units_of(&slot).to_vec();
        let unit_shards: Vec<Shard> = units.iter().map(|&i| shards[i].clone()).collect();
        let read_ahead = ReadAhead::start(
            unit_shards,
            ReadAheadOptions {
                budget_bytes: options.read_ahead_bytes,
                chunk_bytes: options.chunk_bytes,
                io_timeout: options.io_timeout,
            },
            counters.clone(),
        )?;
        let (tx, rx) = mpsc::sync_channel(options.output_queue);
        let cancelled = Arc::new(AtomicBool::new(false));
        let worker = Worker {
            read_ahead,
            units: units.clone(),
            shuffle: (options.shuffle_buffer > 0).then(|| {
                let rng = order::rng_for(
                    options.seed,
                    epoch,
                    Purpose::ShuffleBuffer { slot: slot.slot() },
                );
                ShuffleBuffer::new(options.shuffle_buffer, options.shuffle_buffer_bytes, rng)
            }),
            on_error: options.on_error,
            counters,
            tx,
            cancelled: cancelled.clone(),
        };
        std::thread::Builder::new()
            .name("shardstream-pipeline".into())
            .spawn(move || worker.run())
            .map_err(|e| Error::Stopped(format!("cannot start the pipeline thread: {e}")))?;
        Ok(SampleStream {
            messages: rx,
            cancelled,
            units,
            done: false,
        })
    }

    /// The shard indices this stream reads, in order.
    pub fn units(&self) -> &[usize] {
        &self.units
    }

    /// Waits at most `wait` for the next event.
    pub fn poll(&mut self, wait: Duration) -> Result<Poll> {
        if self.done {
            return Ok(Poll::End);
        }
        let message = match self.messages.recv_timeout(wait) {
            Ok(message) => message,
            Err(RecvTimeoutError::Timeout) => return Ok(Poll::Pending),
            Err(RecvTimeoutError::Disconnected) => {
                self.done = true;
                return Err(Error::Stopped(
                    "the pipeline thread ended without finishing".into(),
                ));
            }
        };
        match message {
            Message::Event(event) => Ok(Poll::Ready(event)),
            Message::Failed(error) => {
                self.done = true;
                Err(error)
            }
            Message::End => {
                self.done = true;
                Ok(Poll::End)
            }
        }
    }
}

impl Iterator for SampleStream {
    type Item = Result<Event>;

    /// Blocks until the next event (the pipeline bounds every wait on storage).
    fn next(&mut self) -> Option<Self::Item> {
        loop {
            match self.poll(Duration::from_secs(1)) {
                Ok(Poll::Ready(event)) => return Some(Ok(event)),
                Ok(Poll::Pending) => continue,
                Ok(Poll::End) => return None,
                Err(e) => return Some(Err(e)),
            }
        }
    }
}

impl Drop for SampleStream {
    fn drop(&mut self) {
        self.cancelled.store(true, Ordering::SeqCst);
    }
}

/// The pipeline thread's state.
struct Worker {
    read_ahead: ReadAhead,
    units: Vec<usize>,
    shuffle: Option<ShuffleBuffer<Sample>>,
    on_error: OnError,
    counters: Arc<Counters>,
    tx: SyncSender<Message>,
    cancelled: Arc<AtomicBool>,
}

impl Worker {
    fn run(mut self) {
        let final_message = match self.stream_units() {
            Ok(ControlFlow::Break(())) => return,
            Ok(ControlFlow::Continue(())) => Message::End,
            Err(error) => Message::Failed(error),
        };
        let _ = self.tx.send(final_message);
    }

    fn stream_units(&mut self) -> Result<ControlFlow<()>> {
        for index in 0..self.units.len() {
            if self.cancelled.load(Ordering::SeqCst) {
                return Ok(ControlFlow::Break(()));
            }
            let Some(mut reader) = self.read_ahead.next_shard()? else {
                return Err(Error::Stopped(
                    "the source ended before the last shard".into(),
                ));
            };
            let shard = ShardRef {
                index: self.units[index],
                url: Arc::from(reader.url()),
            };
            let (shuffle, tx, counters) = (&mut self.shuffle, &self.tx, &self.counters);
            let mut gone = false;
            let result = tar::read_samples(&mut reader, &shard, |sample| {
                let mut emit = |sample: Sample| {
                    if gone {
                        return;
                    }
                    if tx.send(Message::Event(Event::Sample(sample))).is_ok() {
                        counters.add(Counter::Samples, 1);
                    } else {
                        gone = true;
                    }
                };
                match shuffle {
                    Some(buffer) => buffer.push(sample, &mut emit),
                    None => emit(sample),
                }
                if gone {
                    ControlFlow::Break(())
                } else {
                    ControlFlow::Continue(())
                }
            });
            match result {
                Ok(tar::Outcome::Stopped) => return Ok(ControlFlow::Break(())),
                Ok(tar::Outcome::Completed { .. }) => {
                    self.counters.add(Counter::ShardsCompleted, 1)
                }
                Err(error) if self.on_error == OnError::Warn && error.is_shard_error() => {
                    self.counters.add(Counter::ErrorsSkipped, 1);
                    if self.tx.send(Message::Event(Event::Skipped(error))).is_err() {
                        return Ok(ControlFlow::Break(()));
                    }
                }
                Err(error) => return Err(error),
            }
        }
        if let Some(buffer) = &mut self.shuffle {
            while let Some(sample) = buffer.pop_random() {
                if self.tx.send(Message::Event(Event::Sample(sample))).is_err() {
                    return Ok(ControlFlow::Break(()));
                }
                self.counters.add(Counter::Samples, 1);
            }
        }
        Ok(ControlFlow::Continue(()))
    }
}
