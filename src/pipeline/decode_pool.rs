//! Decoding of sample fields: one sample at a time, or a batch spread over
//! a pool of threads that lives as long as the stream's pipeline thread.

use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use crate::augment::SampleContext;
use crate::byte_size::ByteSize;
use crate::config::FieldDecoders;
use crate::error::{Error, Result};
use crate::format::{Sample, Value};
use crate::stats::{Counter, Counters};

/// Samples decoded together, at least (see [`DecodePool::batch_len`]).
const DECODE_BATCH: usize = 32;

/// Bytes a batch of pending samples must hold to be decoded on several threads.
const PARALLEL_DECODE_BYTES: usize = 256 << 10;

/// Samples, each with its unit position.
type Batch = Vec<(usize, Sample)>;

/// Decoded samples (or the error of each), each with its unit position.
type Decoded = Vec<(usize, Result<Sample>)>;

/// A part of a batch for a helper thread: its place in the batch, and
/// where to send it decoded.
struct Job {
    part: usize,
    samples: Batch,
    done: Sender<(usize, Decoded)>,
}

/// The field decoders of a stream, with the seed and epoch their random
/// draws are keyed on.
struct Decoding {
    decoders: FieldDecoders,
    seed: u64,
    epoch: u64,
    /// Where the decoding time and bytes are counted.
    counters: Arc<Counters>,
}

/// The field decoders of a stream and the threads that run them. The
/// calling thread decodes a part of every parallel batch itself; helper
/// threads (one fewer than `threads`) start with the first batch large
/// enough to share, and end when the pool is dropped.
pub(super) struct DecodePool {
    decoders: Arc<Decoding>,
    threads: usize,
    jobs: Option<Sender<Job>>,
    helpers: Vec<JoinHandle<()>>,
}

impl DecodePool {
    /// A pool for `decoders` that decodes on up to `threads` threads (the
    /// caller's included), for epoch `epoch` of seed `seed` (the keys of
    /// the transforms' random streams), counting its time and bytes in
    /// `counters`; no thread starts here.
    pub(super) fn new(
        decoders: FieldDecoders,
        threads: usize,
        seed: u64,
        epoch: u64,
        counters: Arc<Counters>,
    ) -> Self {
        DecodePool {
            decoders: Arc::new(Decoding {
                decoders,
                seed,
                epoch,
                counters,
            }),
            threads: threads.max(1),
            jobs: None,
            helpers: Vec::new(),
        }
    }

    /// Samples to gather before decoding them together: enough for each
    /// thread to have several (so uneven samples even out).
    pub(super) fn batch_len(&self) -> usize {
        DECODE_BATCH.max(4 * self.threads)
    }

    /// Whether no field is decoded.
    pub(super) fn is_empty(&self) -> bool {
        self.decoders.decoders.is_empty()
    }

    /// Decodes one sample on the calling thread.
    pub(super) fn decode(&self, sample: Sample) -> Result<Sample> {
        let started = Instant::now();
        let counters = &self.decoders.counters;
        counters.add(Counter::DecodedBytes, sample.byte_size() as u64);
        let decoded = decode_sample(&self.decoders, sample);
        counters.add_since(Counter::DecodeBusyNanos, started);
        counters.add_since(Counter::DecodeNanos, started);
        decoded
    }

    /// Decodes `samples`, keeping their order: spread over the pool when
    /// they hold enough bytes to be worth it. Each result is the one
    /// decoding that sample alone gives.
    pub(super) fn decode_all(&mut self, samples: Batch) -> Decoded {
        let started = Instant::now();
        let decoded = self.decode_spread(samples);
        self.decoders
            .counters
            .add_since(Counter::DecodeNanos, started);
        decoded
    }

    /// [`DecodePool::decode_all`], untimed.
    fn decode_spread(&mut self, mut samples: Batch) -> Decoded {
        let bytes: usize = samples.iter().map(|(_, s)| s.byte_size()).sum();
        let counters = &self.decoders.counters;
        counters.add(Counter::DecodedBytes, bytes as u64);
        let threads = self.threads.min(samples.len());
        if threads <= 1 || bytes < PARALLEL_DECODE_BYTES {
            return decode_part(&self.decoders, samples);
        }
        let per_thread = samples.len().div_ceil(threads);
        let mut parts = Vec::with_capacity(threads);
        while samples.len() > per_thread {
            let rest = samples.split_off(per_thread);
            parts.push(std::mem::replace(&mut samples, rest));
        }
        parts.push(samples);
        let mut parts = parts.into_iter();
        let own = parts.next().expect("at least one part");
        let (done, results) = mpsc::channel();
        let mut decoded: Vec<Option<Decoded>> = vec![None];
        for (part, samples) in parts.enumerate().map(|(i, p)| (i + 1, p)) {
            decoded.push(None);
            let job = Job {
                part,
                samples,
                done: done.clone(),
            };
            if let Err(mpsc::SendError(job)) = self.send(job) {
                decoded[part] = Some(decode_part(&self.decoders, job.samples));
            }
        }
        drop(done);
        decoded[0] = Some(decode_part(&self.decoders, own));
        while decoded.iter().any(Option::is_none) {
            match results.recv() {
                Ok((part, out)) => decoded[part] = Some(out),
                Err(_) => break,
            }
        }
        let lost = || {
            vec![(
                0,
                Err(Error::Stopped(
                    "a decode thread ended before its samples".into(),
                )),
            )]
        };
        // A part a helper never sent back ends the batch there, as an error.
        let mut out = Vec::new();
        for part in decoded {
            match part {
                Some(part) => out.extend(part),
                None => {
                    out.extend(lost());
                    break;
                }
            }
        }
        out
    }

    /// Hands `job` to a helper, starting the helpers first if need be.
    fn send(&mut self, job: Job) -> std::result::Result<(), mpsc::SendError<Job>> {
        if self.jobs.is_none() {
            let (jobs, queue) = mpsc::channel::<Job>();
            let queue = Arc::new(Mutex::new(queue));
            for _ in 1..self.threads {
                let (queue, decoders) = (queue.clone(), self.decoders.clone());
                let started = std::thread::Builder::new()
                    .name("shardstream-decode".into())
                    .spawn(move || help(&queue, &decoders));
                // Without a helper, its share is decoded on the caller.
                if let Ok(handle) = started {
                    self.helpers.push(handle);
                }
            }
            self.jobs = Some(jobs);
        }
        self.jobs.as_ref().expect("started above").send(job)
    }
}

impl Drop for DecodePool {
    fn drop(&mut self) {
        self.jobs = None;
        for helper in self.helpers.drain(..) {
            let _ = helper.join();
        }
    }
}

/// A helper thread: decodes the jobs of `queue` until the pool is dropped.
fn help(queue: &Mutex<Receiver<Job>>, decoders: &Decoding) {
    loop {
        let job = queue.lock().unwrap_or_else(|e| e.into_inner()).recv();
        let Ok(job) = job else { return };
        let _ = job
            .done
            .send((job.part, decode_part(decoders, job.samples)));
    }
}

/// Decodes `samples` one by one, in order, counting the thread's time.
fn decode_part(decoders: &Decoding, samples: Batch) -> Decoded {
    let started = Instant::now();
    let decoded = samples
        .into_iter()
        .map(|(position, sample)| (position, decode_sample(decoders, sample)))
        .collect();
    decoders
        .counters
        .add_since(Counter::DecodeBusyNanos, started);
    decoded
}

/// Runs each field of `sample` through its decoder, if it has one.
fn decode_sample(decoding: &Decoding, mut sample: Sample) -> Result<Sample> {
    let decoders = &decoding.decoders;
    if decoders.is_empty() {
        return Ok(sample);
    }
    let context = SampleContext {
        seed: decoding.seed,
        epoch: decoding.epoch,
        shard: sample.id.shard,
        index: sample.id.index,
    };
    // Fields a decoder adds (`<field>_frames`), with the field and decoder
    // they come from.
    let mut companions = Vec::new();
    for (field, value) in &mut sample.fields {
        let Some(decoder) = decoders.decoder_for(field) else {
            continue;
        };
        // Table columns may already be typed: nulls stay null, a text
        // column goes to a decoder named for it, and the defaults by
        // extension leave other typed values alone.
        let named = decoders.by_field.iter().any(|(name, _)| name == field);
        let bytes = match std::mem::replace(value, Value::Null) {
            Value::Bytes(bytes) => bytes,
            Value::Null => continue,
            Value::Str(text) if named => text.into_bytes().into(),
            other if !named => {
                *value = other;
                continue;
            }
            _ => {
                return Err(Error::Decode {
                    url: sample.url.to_string(),
                    key: sample.key.clone(),
                    field: field.clone(),
                    decoder: decoder.name(),
                    reason: "the value is neither bytes nor text".into(),
                })
            }
        };
        // A view of a mapped local shard is checked after it is decoded:
        // pages lost to the file being cut short read as zeros.
        let view = crate::store::local::MappedView::of(&bytes);
        let decoded = decoder.decode_field(bytes, &context, field);
        if let Some(view) = view {
            view.verify()?;
        }
        let decoded = decoded.map_err(|e| Error::Decode {
            url: sample.url.to_string(),
            key: sample.key.clone(),
            field: field.clone(),
            decoder: decoder.name(),
            reason: e.reason,
        })?;
        *value = match (decoder.companion_field(field), decoded) {
            (Some(name), Value::Tuple(mut items)) if items.len() == 2 => {
                let companion = items.pop().expect("two items");
                companions.push((field.clone(), name, companion, decoder.name()));
                items.pop().expect("two items")
            }
            (_, decoded) => decoded,
        };
    }
    for (field, name, companion, decoder) in companions {
        if sample.fields.iter().any(|(existing, _)| *existing == name) {
            return Err(Error::Decode {
                url: sample.url.to_string(),
                key: sample.key.clone(),
                field,
                decoder,
                reason: format!("the sample already has a field {name:?}, where the clip's real frame count goes"),
            });
        }
        sample.fields.push((name, companion));
    }
    Ok(sample)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::Decoder;
    use crate::format::SampleId;

    fn sample(index: u64, text: &str) -> (usize, Sample) {
        let mut padded = text.as_bytes().to_vec();
        padded.resize(16 << 10, b' ');
        let sample = Sample {
            id: SampleId { shard: 0, index },
            key: index.to_string(),
            url: Arc::from("mem://a.tar"),
            fields: vec![("json".into(), Value::Bytes(padded.into()))],
            offset: 0,
            length: 0,
        };
        (index as usize * 10, sample)
    }

    fn pool(threads: usize) -> DecodePool {
        let decoders = FieldDecoders {
            by_field: vec![("json".into(), Decoder::Json)],
            defaults: false,
        };
        DecodePool::new(decoders, threads, 0, 0, Arc::default())
    }

    /// A batch large enough to share gives, in order, what decoding each
    /// sample alone gives, errors included, on any number of threads and
    /// batch after batch on the same helpers.
    #[test]
    fn parallel_batches_keep_order_and_results() {
        let texts: Vec<String> = (0..40)
            .map(|i| match i % 7 {
                3 => "{not json".to_owned(),
                _ => format!("{{\"n\": {i}}}"),
            })
            .collect();
        let batch = || -> Batch { (0..40u64).map(|i| sample(i, &texts[i as usize])).collect() };
        let alone = pool(1).decode_all(batch());
        let show = |d: &Decoded| -> Vec<String> {
            d.iter()
                .map(|(p, r)| match r {
                    Ok(s) => format!("{p} {:?}", s.fields),
                    Err(e) => format!("{p} {e}"),
                })
                .collect()
        };
        assert_eq!(alone.len(), 40);
        assert!(alone.iter().any(|(_, r)| r.is_err()));
        for threads in [2, 3, 4, 8] {
            let mut pool = pool(threads);
            for _ in 0..3 {
                assert_eq!(show(&pool.decode_all(batch())), show(&alone), "{threads}");
            }
            assert_eq!(pool.helpers.len(), threads - 1);
        }
    }

    /// A batch counts its bytes, the pipeline thread's decoding time and
    /// at least as much time summed over the threads that decoded it.
    #[test]
    fn decoding_is_counted() {
        let counters = Arc::new(Counters::new());
        let decoders = FieldDecoders {
            by_field: vec![("json".into(), Decoder::Json)],
            defaults: false,
        };
        let mut pool = DecodePool::new(decoders, 4, 0, 0, counters.clone());
        let batch: Batch = (0..40u64).map(|i| sample(i, "{}")).collect();
        let bytes: usize = batch.iter().map(|(_, s)| s.byte_size()).sum();
        assert_eq!(pool.decode_all(batch).len(), 40);
        let stats = counters.snapshot();
        assert_eq!(stats.get(Counter::DecodedBytes), bytes as u64);
        assert!(stats.get(Counter::DecodeNanos) > 0);
        assert!(stats.get(Counter::DecodeBusyNanos) > 0);
    }

    /// Small batches are decoded on the caller: no helper starts.
    #[test]
    fn small_batches_start_no_thread() {
        let mut pool = pool(4);
        let out = pool.decode_all(vec![sample(0, "1"), sample(1, "2")]);
        assert_eq!(out.len(), 2);
        assert!(pool.helpers.is_empty() && pool.jobs.is_none());
    }

    /// An `AudioClip` field's real frame count comes as `<field>_frames`
    /// after the other fields; a sample that already has that field fails
    /// with an error naming the clip's field.
    #[test]
    fn audio_clips_add_their_frame_count() {
        use crate::augment::audio::{AudioSpec, Channels, Crop};
        let mut wav = std::io::Cursor::new(Vec::new());
        let spec = hound::WavSpec {
            channels: 1,
            sample_rate: 8000,
            bits_per_sample: 16,
            sample_format: hound::SampleFormat::Int,
        };
        let mut writer = hound::WavWriter::new(&mut wav, spec).unwrap();
        for i in 0..30i16 {
            writer.write_sample(i).unwrap();
        }
        writer.finalize().unwrap();
        let clip = AudioSpec::new(8000, Channels::Mono, Some(50), None, Crop::Random, 0.0);
        let decoders = FieldDecoders {
            by_field: vec![("wav".into(), Decoder::AudioClip(Arc::new(clip.unwrap())))],
            defaults: false,
        };
        let pool = DecodePool::new(decoders, 1, 0, 0, Arc::default());
        let (_, mut sample) = sample(0, "{}");
        sample.fields = vec![
            ("wav".into(), Value::Bytes(wav.into_inner().into())),
            ("txt".into(), Value::Bytes(b"hi".to_vec().into())),
        ];
        let decoded = pool.decode(sample.clone()).unwrap();
        let names: Vec<&str> = decoded.fields.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["wav", "txt", "wav_frames"]);
        assert_eq!(decoded.fields[2].1, Value::Int(30));
        let Value::Array(array) = &decoded.fields[0].1 else {
            panic!("not an array")
        };
        assert_eq!(array.shape, vec![50]);
        sample
            .fields
            .push(("wav_frames".into(), Value::Bytes(b"7".to_vec().into())));
        let error = pool.decode(sample).unwrap_err().to_string();
        assert!(
            error.contains("already has a field \"wav_frames\""),
            "{error}"
        );
        assert!(
            error.contains("wav") && error.contains("mem://a.tar"),
            "{error}"
        );
    }
}
