//! The pipeline's end of the channel to the consumer.

use std::mem::ManuallyDrop;
use std::ops::ControlFlow;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Duration;
use std::time::Instant;

use super::event::Event;
use crate::byte_size::ByteSize;
use crate::error::Error;
use crate::state::Op;
use crate::stats::{Counter, Counters};

/// Events per message to the consumer, at most. Larger groups mean fewer
/// wake-ups of the consumer: at 200-byte samples, groups of 64 in a queue of
/// 256 hand out about 15% more samples per second than groups of 16 in a
/// queue of 64 (docs/performance.md, "Delivery groups").
pub(super) const MAX_DELIVERY_GROUP: usize = 64;

/// Bytes of samples per message to the consumer: a group goes out once it
/// holds this much, however few its events, so that a queue of large
/// samples holds a few MiB, not `output_queue` samples.
pub(super) const DELIVERY_GROUP_BYTES: usize = 1 << 20;

/// What the pipeline thread sends the consumer.
pub(super) enum Message {
    /// Events in order, each with the ops that lead to it.
    Events(Vec<Delivery>),
    /// The stream failed.
    Failed(Error),
    /// The stream ended; the ops after its last event (the last units
    /// done, with no sample after them to carry them).
    End(Vec<Op>),
}

/// One event and the state ops that lead to it.
pub(super) struct Delivery {
    pub(super) ops: Vec<Op>,
    pub(super) event: Event,
}

/// How many events wait for the consumer: what [`QueueRoom`] counts.
#[derive(Default)]
struct Queued {
    groups: usize,
    samples: usize,
    /// The consumer is gone.
    closed: bool,
}

/// The room in the queue to the consumer: a group may join it while fewer
/// than `groups` groups wait, or fewer than `batch` samples (so that a
/// whole batch of large samples can wait, however few its groups of
/// [`DELIVERY_GROUP_BYTES`] hold).
struct QueueRoom {
    queued: Mutex<Queued>,
    freed: Condvar,
    groups: usize,
    batch: usize,
}

impl QueueRoom {
    /// Waits for room for a group of `samples`, and takes it: whether the
    /// thread had to wait, `None` once the consumer is gone.
    fn take(&self, samples: usize) -> Option<bool> {
        let mut queued = self.queued.lock().unwrap_or_else(|e| e.into_inner());
        let mut waited = false;
        loop {
            if queued.closed {
                return None;
            }
            if queued.groups < self.groups || queued.samples < self.batch {
                queued.groups += 1;
                queued.samples += samples;
                return Some(waited);
            }
            waited = true;
            queued = self.freed.wait(queued).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Gives back the room of a message the consumer received.
    fn give_back(&self, message: &Message) {
        if let Message::Events(group) = message {
            let mut queued = self.queued.lock().unwrap_or_else(|e| e.into_inner());
            queued.groups = queued.groups.saturating_sub(1);
            queued.samples = queued.samples.saturating_sub(group.len());
            self.freed.notify_one();
        }
    }

    /// The consumer is gone: a thread waiting for room stops waiting.
    fn close(&self) {
        self.queued.lock().unwrap_or_else(|e| e.into_inner()).closed = true;
        self.freed.notify_all();
    }
}

/// The consumer's end of the channel: receiving a group gives its room
/// back, and dropping it tells the pipeline thread the consumer is gone.
pub(super) struct Inbox {
    /// Dropped by hand: not in a forked child (see the `Drop`).
    rx: ManuallyDrop<Receiver<Message>>,
    room: Arc<QueueRoom>,
    /// The process the pipeline thread runs in.
    process: u32,
}

impl Inbox {
    /// The next message, if one waits.
    pub(super) fn try_recv(&self) -> Result<Message, TryRecvError> {
        self.rx.try_recv().inspect(|m| self.room.give_back(m))
    }

    /// The next message, waiting at most `wait`.
    pub(super) fn recv_timeout(&self, wait: Duration) -> Result<Message, RecvTimeoutError> {
        self.rx
            .recv_timeout(wait)
            .inspect(|m| self.room.give_back(m))
    }

    /// The next message, waiting for it.
    #[cfg(test)]
    fn recv(&self) -> Result<Message, mpsc::RecvError> {
        self.rx.recv().inspect(|m| self.room.give_back(m))
    }
}

impl Drop for Inbox {
    fn drop(&mut self) {
        // A forked child has no pipeline thread: its copies of the room's
        // lock and of the channel may have been in that thread's hands at
        // the fork (the channel's drop would wait for a send that never
        // ends there). It leaves them as they are.
        if std::process::id() == self.process {
            self.room.close();
            // SAFETY: `rx` is not used after this, the struct being dropped.
            unsafe { ManuallyDrop::drop(&mut self.rx) };
        }
    }
}

/// The pipeline's end of the channel to the consumer. Events go in groups,
/// so the consumer wakes once per group rather than once per sample: a
/// group is sent when it is full (its events, or [`DELIVERY_GROUP_BYTES`]),
/// and before the pipeline waits for bytes that have not arrived, so
/// nothing ready waits behind storage.
///
/// Every flush runs on the pipeline thread, so it is where the thread's
/// time is counted ([`Counter::PipelineNanos`]), with the time a full
/// queue kept it waiting ([`Counter::OutputWaitNanos`]). A wait before the
/// consumer first asked for an event (a stream started before its
/// iteration: the next epoch's, in a persistent DataLoader worker) is the
/// consumer not there yet, not the consumer being slow: neither it nor the
/// thread's time counts until then.
#[derive(Clone)]
pub(super) struct Outbox(Arc<Mutex<OutboxState>>);

struct OutboxState {
    tx: Sender<Message>,
    room: Arc<QueueRoom>,
    group: Vec<Delivery>,
    group_size: usize,
    /// The bytes of the group's events.
    group_bytes: usize,
    /// A send failed: the consumer is gone.
    gone: bool,
    counters: Arc<Counters>,
    /// When the pipeline thread's time was last counted.
    counted_until: Instant,
    /// Events sent so far, read by the consumer to know how many wait.
    sent: Arc<AtomicU64>,
    /// When the consumer first asked for an event, once it did.
    asked: Arc<OnceLock<Instant>>,
}

impl Outbox {
    /// An outbox of groups of `group_size` events, `queued` events waiting
    /// at most (in whole groups), or more until `batch` wait; and the
    /// consumer's end. `sent` counts the events sent; `asked` is set when
    /// the consumer first asks for an event.
    pub(super) fn new(
        queued: usize,
        group_size: usize,
        batch: usize,
        counters: Arc<Counters>,
        sent: Arc<AtomicU64>,
        asked: Arc<OnceLock<Instant>>,
    ) -> (Self, Inbox) {
        let group_size = group_size.max(1);
        let groups = queued.div_ceil(group_size).max(1);
        // The room bounds the groups that wait (each holds an event, so
        // never more than `max(groups, batch)`); the end never waits. The
        // channel itself is unbounded: it takes no place ahead.
        let (tx, rx) = mpsc::channel();
        let room = Arc::new(QueueRoom {
            queued: Mutex::new(Queued::default()),
            freed: Condvar::new(),
            groups,
            batch,
        });
        let state = OutboxState {
            tx,
            room: room.clone(),
            group: Vec::with_capacity(group_size),
            group_size,
            group_bytes: 0,
            gone: false,
            counters,
            counted_until: Instant::now(),
            sent,
            asked,
        };
        let inbox = Inbox {
            rx: ManuallyDrop::new(rx),
            room,
            process: std::process::id(),
        };
        (Outbox(Arc::new(Mutex::new(state))), inbox)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, OutboxState> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues `event` with the ops gathered so far (taken from `ops`);
    /// `Break` once the consumer is gone.
    pub(super) fn send(&self, ops: &mut Vec<Op>, event: Event) -> ControlFlow<()> {
        let mut state = self.lock();
        if state.gone {
            return ControlFlow::Break(());
        }
        state.group_bytes += event_bytes(&event);
        state.group.push(Delivery {
            ops: std::mem::take(ops),
            event,
        });
        if state.group.len() >= state.group_size || state.group_bytes >= DELIVERY_GROUP_BYTES {
            state.flush()
        } else {
            ControlFlow::Continue(())
        }
    }

    /// Sends the queued events now; `Break` once the consumer is gone.
    pub(super) fn flush(&self) -> ControlFlow<()> {
        self.lock().flush()
    }

    /// Sends the queued events, then `last`.
    pub(super) fn finish(&self, last: Message) {
        let mut state = self.lock();
        if state.flush().is_continue() {
            let _ = state.send_waiting(last);
        }
        state.count_time();
    }
}

/// The bytes an event holds, as far as they count towards a group's.
fn event_bytes(event: &Event) -> usize {
    match event {
        Event::Sample(sample) => sample.byte_size(),
        Event::Batch(batch) => batch.batch.get_array_memory_size(),
        Event::Skipped(_) => 0,
    }
}

impl OutboxState {
    fn flush(&mut self) -> ControlFlow<()> {
        let flushed = self.send_group();
        self.count_time();
        flushed
    }

    fn send_group(&mut self) -> ControlFlow<()> {
        if self.gone {
            return ControlFlow::Break(());
        }
        if self.group.is_empty() {
            return ControlFlow::Continue(());
        }
        let group = std::mem::replace(&mut self.group, Vec::with_capacity(self.group_size));
        self.group_bytes = 0;
        let events = group.len() as u64;
        self.sent.fetch_add(events, Ordering::Relaxed);
        if self.send_waiting(Message::Events(group)).is_err() {
            self.gone = true;
            return ControlFlow::Break(());
        }
        ControlFlow::Continue(())
    }

    /// Sends `message`, a group waiting for room in the queue if it is
    /// full (the wait counted by [`OutboxState::count_output_wait`]);
    /// `Err` once the consumer is gone.
    fn send_waiting(&mut self, message: Message) -> Result<(), ()> {
        if let Message::Events(group) = &message {
            let waiting = Instant::now();
            match self.room.take(group.len()) {
                None => return Err(()),
                Some(true) => self.count_output_wait(waiting),
                Some(false) => {}
            }
        }
        self.tx.send(message).map_err(drop)
    }

    /// Counts a wait for room in the queue from `waiting` to now: from
    /// the consumer's first request on (the whole wait if it asked before;
    /// none if it never asked), the thread's time before the wait counted
    /// and the rest of the wait left out.
    fn count_output_wait(&mut self, waiting: Instant) {
        let now = Instant::now();
        let from = self
            .asked
            .get()
            .map_or(now, |&asked| asked.max(waiting))
            .min(now);
        if from > waiting {
            let worked = waiting.saturating_duration_since(self.counted_until);
            self.counters
                .add(Counter::PipelineNanos, crate::stats::nanos(worked));
            self.counted_until = from;
        }
        let waited = now.saturating_duration_since(from);
        self.counters
            .add(Counter::OutputWaitNanos, crate::stats::nanos(waited));
    }

    /// Counts the pipeline thread's time since the last count.
    fn count_time(&mut self) {
        let now = Instant::now();
        let elapsed = now.saturating_duration_since(self.counted_until);
        self.counters
            .add(Counter::PipelineNanos, crate::stats::nanos(elapsed));
        self.counted_until = now;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::{Sample, SampleId};
    use crate::value::Value;

    fn event(index: u64) -> Event {
        Event::Sample(Sample {
            id: SampleId { shard: 0, index },
            key: index.to_string(),
            url: Arc::from("mem://a.tar"),
            fields: Vec::new(),
            offset: 0,
            length: 0,
        })
    }

    fn indices(message: Message) -> Vec<u64> {
        match message {
            Message::Events(group) => group
                .into_iter()
                .map(|d| match d.event {
                    Event::Sample(s) => s.id.index,
                    _ => panic!("not a sample"),
                })
                .collect(),
            _ => panic!("not events"),
        }
    }

    /// A forked child drops its copy of the consumer's end without
    /// touching the room's lock or the channel, which the pipeline thread
    /// (not in the child) may have held at the fork: here the lock is held
    /// by the parent across the fork, so a child that took it would hang.
    #[test]
    fn a_forked_child_drops_its_inbox_without_taking_what_the_fork_left_held() {
        let (outbox, rx) = Outbox::new(16, 3, 0, Arc::default(), Arc::default(), Arc::default());
        let room = rx.room.clone();
        let held = room.queued.lock().unwrap();
        // SAFETY: the child drops a value and exits at once.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            drop(rx);
            // SAFETY: ends the child at once, running nothing of the parent's.
            unsafe { libc::_exit(7) }
        }
        assert!(pid > 0, "fork failed");
        let mut status = 0;
        let mut waited = 0;
        // SAFETY: polls the child just forked, without blocking.
        while unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) } == 0 && waited < 500 {
            std::thread::sleep(Duration::from_millis(10));
            waited += 1;
        }
        if waited == 500 {
            // SAFETY: the child is ours and hung; it is ended and reaped.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, &mut status, 0);
            }
            panic!("the child hung dropping its inbox");
        }
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 7);
        drop(held);
        // The parent's end still works.
        let mut ops = Vec::new();
        for i in 0..3 {
            assert!(outbox.send(&mut ops, event(i)).is_continue());
        }
        assert_eq!(indices(rx.try_recv().unwrap()), [0, 1, 2]);
    }

    /// Events go out in order, in full groups, the rest on a flush, with
    /// the ops gathered before each.
    #[test]
    fn events_go_in_groups_in_order() {
        let (outbox, rx) = Outbox::new(16, 3, 0, Arc::default(), Arc::default(), Arc::default());
        let mut ops = Vec::new();
        for i in 0..4 {
            ops.push(Op::UnitDone { unit: i as usize });
            assert!(outbox.send(&mut ops, event(i)).is_continue());
            assert!(ops.is_empty());
        }
        assert_eq!(indices(rx.try_recv().unwrap()), [0, 1, 2]);
        assert!(
            rx.try_recv().is_err(),
            "a group went out before it was full"
        );
        outbox.finish(Message::End(Vec::new()));
        assert_eq!(indices(rx.try_recv().unwrap()), [3]);
        assert!(matches!(rx.try_recv().unwrap(), Message::End(_)));
    }

    /// A group goes out once its samples hold `DELIVERY_GROUP_BYTES`,
    /// however few they are.
    #[test]
    fn a_group_of_large_samples_goes_out_at_its_byte_limit() {
        let (outbox, rx) = Outbox::new(256, 64, 0, Arc::default(), Arc::default(), Arc::default());
        let large = |index| {
            let Event::Sample(mut sample) = event(index) else {
                unreachable!()
            };
            let member = vec![0u8; DELIVERY_GROUP_BYTES / 3 + 1];
            sample
                .fields
                .push(("bin".into(), Value::Bytes(member.into())));
            Event::Sample(sample)
        };
        let mut ops = Vec::new();
        for i in 0..5 {
            assert!(outbox.send(&mut ops, large(i)).is_continue());
        }
        assert_eq!(indices(rx.try_recv().unwrap()), [0, 1, 2]);
        assert!(rx.try_recv().is_err(), "a group left before its limit");
        // Small samples fill a group by count.
        for i in 5..70 {
            assert!(outbox.send(&mut ops, event(i)).is_continue());
        }
        assert_eq!(indices(rx.try_recv().unwrap()), (3..67).collect::<Vec<_>>());
        assert!(rx.try_recv().is_err());
    }

    /// A send that finds the queue full waits for the consumer, and that
    /// wait is counted, within the pipeline thread's time.
    #[test]
    fn a_full_queue_counts_the_wait_for_the_consumer() {
        let counters = Arc::new(Counters::new());
        let sent = Arc::new(AtomicU64::new(0));
        let asked = Arc::new(OnceLock::from(Instant::now()));
        let (outbox, rx) = Outbox::new(1, 1, 0, counters.clone(), sent.clone(), asked);
        let mut ops = Vec::new();
        assert!(outbox.send(&mut ops, event(0)).is_continue());
        let consumer = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(50));
            (indices(rx.recv().unwrap()), indices(rx.recv().unwrap()))
        });
        assert!(outbox.send(&mut ops, event(1)).is_continue());
        outbox.finish(Message::End(Vec::new()));
        assert_eq!(consumer.join().unwrap(), (vec![0], vec![1]));
        let stats = counters.snapshot();
        let waited = stats.get(Counter::OutputWaitNanos);
        assert!(waited >= 40_000_000, "{waited} ns");
        assert!(stats.get(Counter::PipelineNanos) >= waited);
        assert_eq!(sent.load(Ordering::Relaxed), 2);
    }

    /// A stream started before its consumer asks (the next epoch's, in a
    /// persistent DataLoader worker) waits on a full queue: that wait is
    /// the consumer not there yet, and counts neither as output wait nor
    /// as the pipeline thread's time; from the first request on it does.
    /// The end has a place of its own: it does not wait.
    #[test]
    fn a_wait_before_the_consumer_asks_is_not_counted() {
        let counters = Arc::new(Counters::new());
        let asked = Arc::new(OnceLock::new());
        let (outbox, rx) = Outbox::new(1, 1, 0, counters.clone(), Arc::default(), asked.clone());
        let mut ops = Vec::new();
        assert!(outbox.send(&mut ops, event(0)).is_continue());
        let consumer = std::thread::spawn(move || {
            let pause = || std::thread::sleep(std::time::Duration::from_millis(200));
            pause();
            asked.get_or_init(Instant::now);
            let first = indices(rx.recv().unwrap());
            pause();
            let second = indices(rx.recv().unwrap());
            pause();
            let third = indices(rx.recv().unwrap());
            assert!(matches!(rx.recv().unwrap(), Message::End(_)));
            (first, second, third)
        });
        // Waits 200 ms for the consumer to ask: none of it counts.
        assert!(outbox.send(&mut ops, event(1)).is_continue());
        let before = counters.snapshot();
        // Waits about 200 ms for the consumer, which asked: counted.
        assert!(outbox.send(&mut ops, event(2)).is_continue());
        let after_send = counters.snapshot().get(Counter::OutputWaitNanos);
        // The end goes in beside the last group, while the consumer pauses.
        let ending = Instant::now();
        outbox.finish(Message::End(Vec::new()));
        let end_wait = ending.elapsed();
        assert_eq!(consumer.join().unwrap(), (vec![0], vec![1], vec![2]));
        assert!(end_wait.as_millis() < 100, "the end waited {end_wait:?}");
        for counter in [Counter::OutputWaitNanos, Counter::PipelineNanos] {
            let counted = before.get(counter);
            assert!(
                counted < 150_000_000,
                "{counter:?}: {counted} ns before the consumer asked"
            );
        }
        assert!(after_send >= 100_000_000, "{after_send} ns");
        let waited = counters.snapshot().get(Counter::OutputWaitNanos);
        assert!(
            waited < after_send + 100_000_000,
            "{waited} ns, {after_send} ns before the end"
        );
    }

    /// With a batch, groups join the queue past its groups until a batch
    /// of samples waits (a group of large samples holds few of them); the
    /// room comes back as the consumer receives.
    #[test]
    fn a_whole_batch_of_large_samples_can_wait() {
        let (outbox, rx) = Outbox::new(4, 1, 5, Arc::default(), Arc::default(), Arc::default());
        let sender = std::thread::spawn(move || {
            let mut ops = Vec::new();
            for i in 0..8 {
                assert!(outbox.send(&mut ops, event(i)).is_continue());
            }
            outbox.finish(Message::End(Vec::new()));
        });
        // Four groups would fill the queue without the batch: five wait.
        let waiting = || rx.room.queued.lock().unwrap().groups;
        let deadline = Instant::now() + std::time::Duration::from_secs(10);
        while waiting() < 5 && Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert_eq!(waiting(), 5, "a batch waits, and no more");
        let mut got = Vec::new();
        loop {
            match rx.recv().unwrap() {
                Message::End(_) => break,
                message => got.extend(indices(message)),
            }
        }
        sender.join().unwrap();
        assert_eq!(got, (0..8).collect::<Vec<_>>());
    }

    /// A thread waiting for room stops when the consumer goes.
    #[test]
    fn a_wait_for_room_ends_when_the_consumer_goes() {
        let (outbox, rx) = Outbox::new(1, 1, 0, Arc::default(), Arc::default(), Arc::default());
        let mut ops = Vec::new();
        assert!(outbox.send(&mut ops, event(0)).is_continue());
        let sender = std::thread::spawn(move || outbox.send(&mut Vec::new(), event(1)));
        std::thread::sleep(std::time::Duration::from_millis(50));
        drop(rx);
        assert!(sender.join().unwrap().is_break());
    }

    /// Once the consumer is gone, every send says so.
    #[test]
    fn a_gone_consumer_breaks_sends() {
        let (outbox, rx) = Outbox::new(1, 1, 0, Arc::default(), Arc::default(), Arc::default());
        drop(rx);
        assert!(outbox.send(&mut Vec::new(), event(0)).is_break());
        assert!(outbox.send(&mut Vec::new(), event(1)).is_break());
        assert!(outbox.flush().is_break());
    }
}
