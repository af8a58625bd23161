//! The pipeline thread: reads each planned read's bytes through the
//! format, checks samples against the manifest, decodes them and sends
//! them through the shuffle buffer to the outbox.

use std::collections::HashMap;
use std::ops::ControlFlow;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::decode_pool::DecodePool;
use super::event::{CompressedShards, Event, TableBatch};
use super::outbox::{Message, Outbox};
use super::reads::{read_end, Read, ReadPurpose};
use crate::compression::Compression;
use crate::config::{OnError, TableOutput};
use crate::error::{Error, Result};
use crate::format::{
    blob, compressed::TarStream, lines, parquet, read_append_to_end, tar, ByteSource, Outcome,
    Sample, SampleId, ShardRef,
};
use crate::shard::{RowGroup, SampleIndex, ShardKind};
use crate::shuffle::ShuffleBuffer;
use crate::source::{ReadAhead, ShardReader};
use crate::state::Op;
use crate::stats::{Counter, Counters};

/// The pipeline thread's state.
pub(super) struct Worker {
    pub(super) read_ahead: ReadAhead,
    pub(super) reads: Vec<Read>,
    pub(super) restore: Vec<SampleId>,
    /// Documents a saved packer held: read again and sent first, in this
    /// order, outside the mirror (they were handed out before the save).
    pub(super) replay: Vec<SampleId>,
    pub(super) shuffle: Option<ShuffleBuffer<Sample>>,
    pub(super) on_error: OnError,
    /// Decoded tar bytes over which samples of a compressed shard wait for
    /// its checksum (the read-ahead budget).
    pub(super) verify_bytes: u64,
    pub(super) counters: Arc<Counters>,
    pub(super) outbox: Outbox,
    pub(super) cancelled: Arc<AtomicBool>,
    /// Ops not yet sent to the consumer.
    pub(super) ops: Vec<Op>,
    pub(super) finished: bool,
    pub(super) compressed: CompressedShards,
    /// The field decoders and their threads.
    pub(super) decode: DecodePool,
    /// Accepted samples waiting to be decoded together.
    pub(super) pending: Vec<(usize, Sample)>,
    pub(super) columns: Option<Vec<String>>,
    pub(super) table_output: TableOutput,
    pub(super) batch_rows: usize,
    /// The current read has taken every sample it wanted and reads on
    /// only for the next sample's span check (with a manifest): a format
    /// error met there is the next read's to report.
    pub(super) read_past_end: bool,
}

/// Why a read stopped before its archive ended.
enum Stop {
    /// The consumer is gone.
    Gone,
    /// The read has every sample it wanted.
    Enough,
    /// A sample does not match the manifest or cannot be decoded.
    Failed(Error),
}

impl Worker {
    /// Streams every read, then tells the consumer how it ended.
    pub(super) fn run(mut self) {
        let final_message = if self.finished && self.replay.is_empty() {
            Message::End(Vec::new())
        } else {
            match self.stream() {
                Ok(ControlFlow::Break(())) => return,
                Ok(ControlFlow::Continue(())) => {
                    // The cache copies of this epoch's shards are complete
                    // when the consumer hears of the end.
                    self.read_ahead.finish_cache_copies();
                    Message::End(std::mem::take(&mut self.ops))
                }
                Err(error) => Message::Failed(error),
            }
        };
        self.outbox.finish(final_message);
    }

    fn stream(&mut self) -> Result<ControlFlow<()>> {
        let reads = std::mem::take(&mut self.reads);
        let mut restored: HashMap<SampleId, Sample> = HashMap::new();
        let mut restoring = !self.restore.is_empty() || !self.replay.is_empty();
        for read in &reads {
            if self.cancelled.load(Ordering::SeqCst) {
                return Ok(ControlFlow::Break(()));
            }
            if restoring && matches!(read.purpose, ReadPurpose::Unit { .. }) {
                restoring = false;
                if self.put_back(&mut restored)?.is_break() {
                    return Ok(ControlFlow::Break(()));
                }
            }
            if self.read_one(read, &mut restored)?.is_break() {
                return Ok(ControlFlow::Break(()));
            }
        }
        if restoring && self.put_back(&mut restored)?.is_break() {
            return Ok(ControlFlow::Break(()));
        }
        if let Some(buffer) = &mut self.shuffle {
            while let Some((index, sample)) = buffer.pop_random() {
                let rng_word_pos = buffer.rng_word_pos();
                self.ops.push(Op::Pop {
                    index,
                    rng_word_pos,
                });
                if send_sample(&self.outbox, &mut self.ops, sample).is_break() {
                    return Ok(ControlFlow::Break(()));
                }
            }
        }
        Ok(ControlFlow::Continue(()))
    }

    /// Puts the samples read again back: the shuffle buffer's into the
    /// buffer, then the packer's documents sent, in the saved orders;
    /// `Break` when the consumer is gone.
    fn put_back(&mut self, restored: &mut HashMap<SampleId, Sample>) -> Result<ControlFlow<()>> {
        if !self.restore.is_empty() {
            self.refill_buffer(restored)?;
        }
        for id in std::mem::take(&mut self.replay) {
            let sample = restored.remove(&id).ok_or_else(|| {
                Error::StateMismatch(format!(
                    "state field pack: sample {} of shard {} held by the saved packer is not in the data",
                    id.index, id.shard
                ))
            })?;
            if self
                .outbox
                .send(&mut self.ops, Event::Sample(sample))
                .is_break()
            {
                return Ok(ControlFlow::Break(()));
            }
        }
        Ok(ControlFlow::Continue(()))
    }

    /// Puts the restored samples back into the buffer, in the saved order.
    fn refill_buffer(&mut self, restored: &mut HashMap<SampleId, Sample>) -> Result<()> {
        let mut items = Vec::with_capacity(self.restore.len());
        for id in &self.restore {
            let sample = restored.remove(id).ok_or_else(|| {
                Error::StateMismatch(format!(
                    "state field buffer: sample {} of shard {} held by the saved shuffle buffer is not in the data",
                    id.index, id.shard
                ))
            })?;
            items.push(sample);
        }
        let buffer = self.shuffle.as_mut().ok_or_else(|| {
            Error::StateMismatch("the state holds samples but shuffling is off".into())
        })?;
        buffer.refill(items);
        Ok(())
    }

    fn read_one(
        &mut self,
        read: &Read,
        restored: &mut HashMap<SampleId, Sample>,
    ) -> Result<ControlFlow<()>> {
        let Some(fetch) = &read.fetch else {
            if let ReadPurpose::Unit { position, .. } = read.purpose {
                self.ops.push(Op::UnitDone { unit: position });
            }
            return Ok(ControlFlow::Continue(()));
        };
        let Some(reader) = self.read_ahead.next_shard()? else {
            return Err(Error::Stopped(
                "the source ended before the last shard".into(),
            ));
        };
        let mut shard = ShardRef {
            index: read.shard,
            url: Arc::from(reader.url()),
            base_offset: fetch.range.as_ref().map_or(0, |r| r.start),
            first_index: read.first_index,
            compression: None,
            to_end: fetch.range.is_none(),
        };
        let mut stop = None;
        self.read_past_end = false;
        let result = match &read.kind {
            ShardKind::Tar | ShardKind::Lines => {
                self.read_stream(read, reader, &mut shard, restored, &mut stop)
            }
            ShardKind::Raw => self.read_raw(read, reader, &shard, restored, &mut stop),
            ShardKind::Parquet(group) => match self.table_output {
                TableOutput::Rows => {
                    self.read_rows(read, group, reader, &shard, restored, &mut stop)
                }
                TableOutput::Arrow => self.send_batches(read, group, reader, &shard, &mut stop),
            },
        };
        // Samples taken before the read ended (or failed) are decoded and
        // delivered first; a decode error among them came first.
        if matches!(stop, Some(Stop::Gone)) {
            self.pending.clear();
        } else if let Err(stopped) = self.flush_decoded() {
            stop = Some(stopped);
        }
        let outcome = match (result, stop) {
            (_, Some(Stop::Gone)) => return Ok(ControlFlow::Break(())),
            (_, Some(Stop::Failed(error))) => Err(error),
            (Ok(_), Some(Stop::Enough)) => Ok(()),
            (Ok(Some(samples)), None) => self.check_complete(read, &shard, samples),
            (Ok(None), None) => return Ok(ControlFlow::Break(())),
            // In a sample after this read's last (a compressed shard is
            // read on to the next sample): the read that wants it reports it.
            (Err(error), None) if self.read_past_end && error.is_shard_error() => Ok(()),
            (Err(error), _) => Err(error),
        };
        self.settle(read, outcome)
    }

    /// Streams the samples of a tar or JSON-lines shard (plain or
    /// compressed) into [`Worker::accept`]; `Some(count)` when the shard
    /// ended.
    fn read_stream(
        &mut self,
        read: &Read,
        reader: ShardReader,
        shard: &mut ShardRef,
        restored: &mut HashMap<SampleId, Sample>,
        stop: &mut Option<Stop>,
    ) -> Result<Option<u64>> {
        let mut stream = self.open_stream(read, reader, shard)?;
        let verify = self.verify_bytes;
        let mut each = |sample| self.accept(read, sample, restored, stop);
        let outcome = match read.kind {
            ShardKind::Lines => lines::read_samples(&mut stream, shard, verify, &mut each)?,
            _ => tar::read_samples_verified(&mut stream, shard, verify, &mut each)?,
        };
        Ok(match outcome {
            Outcome::Completed { samples } => Some(samples),
            Outcome::Stopped => None,
        })
    }

    /// Reads a raw object as its one sample.
    fn read_raw(
        &mut self,
        read: &Read,
        mut reader: ShardReader,
        shard: &ShardRef,
        restored: &mut HashMap<SampleId, Sample>,
        stop: &mut Option<Stop>,
    ) -> Result<Option<u64>> {
        let sample = blob::read_object(&mut reader, shard)?;
        let _ = self.accept(read, sample, restored, stop);
        Ok(Some(1))
    }

    /// Decodes a row group and streams its rows as samples.
    fn read_rows(
        &mut self,
        read: &Read,
        group: &RowGroup,
        reader: ShardReader,
        shard: &ShardRef,
        restored: &mut HashMap<SampleId, Sample>,
        stop: &mut Option<Stop>,
    ) -> Result<Option<u64>> {
        let mut rows = 0;
        for batch in self.decode_row_group(group, reader, shard, true)? {
            let batch = batch?;
            let samples = parquet::batch_to_samples(shard, "", &batch, group.first_row, rows)?;
            rows += batch.num_rows() as u64;
            for sample in samples {
                if self.accept(read, sample, restored, stop).is_break() {
                    return Ok(None);
                }
            }
        }
        Ok(Some(rows))
    }

    /// Decodes a row group and sends the rows of the read's range as Arrow
    /// batches (no shuffle buffer: options forbid one with Arrow output).
    fn send_batches(
        &mut self,
        read: &Read,
        group: &RowGroup,
        reader: ShardReader,
        shard: &ShardRef,
        stop: &mut Option<Stop>,
    ) -> Result<Option<u64>> {
        let ReadPurpose::Unit { position, samples } = &read.purpose else {
            return Err(Error::StateMismatch(
                "Arrow batches are not shuffled, yet the state holds buffered rows".into(),
            ));
        };
        let mut rows = 0;
        for batch in self.decode_row_group(group, reader, shard, false)? {
            let batch = batch?;
            let first = rows;
            rows += batch.num_rows() as u64;
            let start = samples.start.clamp(first, rows);
            let end = samples.end.clamp(first, rows);
            if start < end {
                let slice = batch.slice((start - first) as usize, (end - start) as usize);
                for index in start..end {
                    let id = SampleId {
                        shard: read.shard,
                        index,
                    };
                    self.ops.push(Op::Push {
                        unit: *position,
                        id,
                    });
                    self.ops.push(Op::Pop {
                        index: 0,
                        rng_word_pos: 0,
                    });
                }
                let event = Event::Batch(TableBatch {
                    url: shard.url.clone(),
                    first_row: group.first_row + start,
                    batch: slice,
                });
                if self.outbox.send(&mut self.ops, event).is_break() {
                    *stop = Some(Stop::Gone);
                    return Ok(None);
                }
            }
            if rows >= samples.end {
                *stop = Some(Stop::Enough);
                return Ok(None);
            }
        }
        Ok(Some(rows))
    }

    /// The record batches of one row group, read whole from `reader`;
    /// `keyed`: rows become samples, keyed by the file's `__key__` column
    /// when it has one, whatever `columns` selects.
    fn decode_row_group(
        &self,
        group: &RowGroup,
        mut reader: ShardReader,
        shard: &ShardRef,
        keyed: bool,
    ) -> Result<parquet::RowGroupBatches> {
        let mut bytes = Vec::with_capacity((group.span.end - group.span.start) as usize);
        if let Err(source) = read_append_to_end(&mut reader, &mut bytes) {
            return Err(reader.take_failure().unwrap_or(Error::Read {
                url: shard.url.to_string(),
                offset: group.span.start + bytes.len() as u64,
                source,
            }));
        }
        let with_key = match self.columns.as_deref() {
            Some(columns) if keyed => parquet::columns_with_key(&group.metadata, columns),
            _ => None,
        };
        parquet::read_row_group(
            shard,
            &group.metadata,
            group.index,
            with_key.as_deref().or(self.columns.as_deref()),
            group.span.start,
            bytes.into(),
            self.batch_rows,
        )
    }

    /// Takes one sample of a read: checks it against the manifest, keeps it
    /// for a restore, or decodes it and sends it through the shuffle buffer.
    /// `Break` (with `stop` set) ends the read.
    fn accept(
        &mut self,
        read: &Read,
        sample: Sample,
        restored: &mut HashMap<SampleId, Sample>,
        stop: &mut Option<Stop>,
    ) -> ControlFlow<()> {
        let id = sample.id;
        if let Some(index) = &read.index {
            if let Err(error) = check_span(index, &sample) {
                *stop = Some(Stop::Failed(error));
                return ControlFlow::Break(());
            }
        }
        let position = match &read.purpose {
            ReadPurpose::Restore { wanted } => {
                if wanted.contains(&id.index) {
                    match self.decode.decode(sample) {
                        Ok(sample) => {
                            restored.insert(id, sample);
                        }
                        Err(error) => {
                            *stop = Some(Stop::Failed(error));
                            return ControlFlow::Break(());
                        }
                    }
                }
                if id.index + 1 >= read_end(wanted) {
                    *stop = Some(Stop::Enough);
                    return ControlFlow::Break(());
                }
                return ControlFlow::Continue(());
            }
            ReadPurpose::Unit { position, samples } => {
                if id.index < samples.start {
                    return ControlFlow::Continue(());
                }
                if id.index >= samples.end {
                    *stop = Some(Stop::Enough);
                    return ControlFlow::Break(());
                }
                *position
            }
        };
        if self.decode.is_empty() {
            if self.deliver(position, sample).is_break() {
                *stop = Some(Stop::Gone);
                return ControlFlow::Break(());
            }
        } else {
            self.pending.push((position, sample));
            if self.pending.len() >= self.decode.batch_len() {
                if let Err(stopped) = self.flush_decoded() {
                    *stop = Some(stopped);
                    return ControlFlow::Break(());
                }
            }
        }
        // With a manifest the read goes on to the next sample (or the
        // shard's end), whose span check above finds a sample the manifest
        // leaves out after this one: the read's range reaches the next
        // recorded sample, and the shard's end after its last.
        if let ReadPurpose::Unit { samples, .. } = &read.purpose {
            if id.index + 1 >= samples.end {
                if read.index.is_some() {
                    self.read_past_end = true;
                } else {
                    *stop = Some(Stop::Enough);
                    return ControlFlow::Break(());
                }
            }
        }
        ControlFlow::Continue(())
    }

    /// Puts a sample (decoded) through the shuffle buffer, or sends it
    /// when there is none; `Break` when the consumer is gone.
    fn deliver(&mut self, position: usize, sample: Sample) -> ControlFlow<()> {
        let id = sample.id;
        let (outbox, ops) = (&self.outbox, &mut self.ops);
        // Same order as the buffer: evictions first, then the new sample.
        match &mut self.shuffle {
            Some(buffer) => {
                buffer.push(sample, |evicted| {
                    ops.push(Op::Pop {
                        index: evicted.index,
                        rng_word_pos: evicted.rng_word_pos,
                    });
                    send_sample(outbox, ops, evicted.item)
                })?;
                ops.push(Op::Push { unit: position, id });
                ControlFlow::Continue(())
            }
            None => {
                ops.push(Op::Push { unit: position, id });
                ops.push(Op::Pop {
                    index: 0,
                    rng_word_pos: 0,
                });
                send_sample(outbox, ops, sample)
            }
        }
    }

    /// Decodes the pending samples, on several threads when they are
    /// large, and delivers them in their order. The first decode error
    /// stops the delivery there, as if the samples were decoded one by one.
    fn flush_decoded(&mut self) -> Result<(), Stop> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let pending = std::mem::take(&mut self.pending);
        for (position, decoded) in self.decode.decode_all(pending) {
            let sample = decoded.map_err(Stop::Failed)?;
            if self.deliver(position, sample).is_break() {
                return Err(Stop::Gone);
            }
        }
        Ok(())
    }

    /// The tar bytes of a read: a read from the shard's first byte tells
    /// the compression by the magic bytes (and checks it against the
    /// manifest); a ranged read inside a plain shard is taken as it is.
    fn open_stream(
        &self,
        read: &Read,
        reader: ShardReader,
        shard: &mut ShardRef,
    ) -> Result<TarStream<ShardReader>> {
        if shard.base_offset > 0 {
            return Ok(TarStream::plain(reader, &shard.url));
        }
        let stream = TarStream::open(reader, &shard.url)?;
        shard.compression = stream.compression();
        check_compression(read, shard)?;
        if let Some(compression) = shard.compression {
            self.compressed
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(read.shard, compression);
        }
        Ok(stream)
    }

    /// Ends a read: counts a completed shard, or under `on_error="warn"`
    /// skips a bad one with a [`Event::Skipped`]; other errors end the stream.
    fn settle(&mut self, read: &Read, outcome: Result<()>) -> Result<ControlFlow<()>> {
        match outcome {
            Ok(()) => {
                self.counters.add(Counter::ShardsCompleted, 1);
                if let ReadPurpose::Unit { position, .. } = read.purpose {
                    self.ops.push(Op::UnitDone { unit: position });
                }
                Ok(ControlFlow::Continue(()))
            }
            Err(error) if self.on_error == OnError::Warn && error.is_shard_error() => {
                self.counters.add(Counter::ErrorsSkipped, 1);
                if let ReadPurpose::Unit { position, .. } = read.purpose {
                    self.ops.push(Op::UnitSkipped { unit: position });
                }
                Ok(self.outbox.send(&mut self.ops, Event::Skipped(error)))
            }
            Err(error) => Err(error),
        }
    }

    /// After a read with a manifest ended with its archive: did it hold
    /// every sample the manifest promised?
    fn check_complete(&self, read: &Read, shard: &ShardRef, produced: u64) -> Result<()> {
        let Some(index) = &read.index else {
            // Without a manifest a resumed cursor is checked against the
            // shard here: a cursor past its end would silently skip nothing.
            if let (ReadPurpose::Unit { samples, .. }, true) =
                (&read.purpose, read.kind.has_manifest_spans())
            {
                if produced < samples.start {
                    return Err(Error::StateMismatch(format!(
                        "state field cursor.next_sample: {} is past the end of {}, which holds {produced} samples",
                        samples.start, shard.url
                    )));
                }
            }
            return Ok(());
        };
        let end = match &read.purpose {
            ReadPurpose::Unit { samples, .. } => samples.end.min(index.len()),
            ReadPurpose::Restore { wanted } => read_end(wanted),
        };
        let expected = end - read.first_index;
        if produced < expected {
            let held = match read.fetch.as_ref().and_then(|f| f.range.clone()) {
                Some(range) => format!("bytes {}..{} hold", range.start, range.end),
                None => "the shard holds".into(),
            };
            return Err(Error::ManifestMismatch {
                url: shard.url.to_string(),
                reason: format!("{held} {produced} samples, the manifest says {expected}"),
            });
        }
        Ok(())
    }
}

/// With a manifest (or counted spans), each sample must lie where it says:
/// its members start at the recorded offset and end where its recorded
/// length does (a read runs on to the next sample's offset, so a member
/// past the recorded end is found, not cut off).
fn check_span(index: &SampleIndex, sample: &Sample) -> Result<()> {
    let id = sample.id.index;
    let recorded = (id < index.len()).then(|| (index.offset(id), index.length(id)));
    if recorded == Some((sample.offset, sample.length)) {
        return Ok(());
    }
    let says = match recorded {
        Some((offset, length)) => format!("bytes {offset}..{}", offset + length),
        None => "it does not exist".into(),
    };
    Err(Error::ManifestMismatch {
        url: sample.url.to_string(),
        reason: format!(
            "sample {id} ({:?}) spans bytes {}..{} (its members' headers and data), the manifest \
             says {says}; run `shardstream index` again",
            sample.key,
            sample.offset,
            sample.offset + sample.length
        ),
    })
}

/// With a manifest, a read from a shard's first byte must find the
/// compression the manifest records.
fn check_compression(read: &Read, shard: &ShardRef) -> Result<()> {
    let Some(index) = &read.index else {
        return Ok(());
    };
    if index.compression() == shard.compression {
        return Ok(());
    }
    let describe = |c: Option<Compression>| match c {
        Some(c) => format!("a {c} stream"),
        None => "an uncompressed tar".to_owned(),
    };
    Err(Error::ManifestMismatch {
        url: shard.url.to_string(),
        reason: format!(
            "the shard is {}, the manifest says {}",
            describe(shard.compression),
            describe(index.compression())
        ),
    })
}

/// Sends a sample with the ops that lead to it; `Break` when the consumer is gone.
fn send_sample(outbox: &Outbox, ops: &mut Vec<Op>, sample: Sample) -> ControlFlow<()> {
    outbox.send(ops, Event::Sample(sample))
}
