//! The `audio` decoder: a WAV file into float32 samples and the sample
//! rate, as `soundfile.read(..., dtype="float32", always_2d=True)` or
//! torchaudio (transposed) give them.
//!
//! The result is `Value::Tuple([samples, Value::Int(sample_rate)])`, where
//! `samples` is a float32 [`Array`] of shape `[frames, channels]` (one row
//! per frame, channels interleaved as in the file).
//!
//! Supported encodings, read with `hound`: integer PCM of 8, 16, 24 or 32
//! bits (24-bit samples may sit in 3- or 4-byte containers), and 32-bit
//! IEEE float; both plain and `WAVE_FORMAT_EXTENSIBLE` headers. FLAC
//! streams (told apart by their `fLaC` magic) are read with `claxon`, their
//! integer samples scaled by the same rule.
//!
//! Scaling: an integer sample `x` of `b` bits becomes `x / 2^(b-1)`, so
//! the range is `[-1, 1)`: 16-bit `-32768` is `-1.0` and `32767` is
//! `32767/32768`. 8-bit WAV samples are stored unsigned (128 is silence);
//! hound already shifts them to signed `-128..=127`, so they scale the same
//! way. (For 32-bit PCM the float32 rounding maps the top values, from
//! `2^31 - 64` up, to exactly `1.0`, as libsndfile does.) Float samples are
//! returned unchanged (not clipped).

use std::io::Cursor;

use hound::{SampleFormat, WavReader};
use rand_chacha::ChaCha8Rng;

use crate::augment::audio::{make_clip, AudioSpec};
use crate::value::{Array, ArrayData, Value};

/// The most samples (all channels) a FLAC stream may decode to: 2^27, 512
/// MiB of float32 (50 minutes of 44.1 kHz stereo). A WAV file holds at
/// least a byte per sample, but a FLAC file of silence can declare hours in
/// a few kilobytes.
const MAX_FLAC_SAMPLES: usize = 1 << 27;

/// Decoded audio: float32 samples, channels interleaved.
struct Pcm {
    samples: Vec<f32>,
    channels: usize,
    sample_rate: u32,
}

/// Decodes a WAV or FLAC file.
pub(super) fn decode(bytes: &[u8]) -> Result<Value, String> {
    let pcm = read(bytes)?;
    pcm_value(pcm.samples, pcm.channels, pcm.sample_rate)
}

/// Decodes a WAV or FLAC file into one clip of `spec` (random crops draw
/// from `rng`): the clip and its number of real frames.
pub(super) fn clip(
    bytes: &[u8],
    spec: &AudioSpec,
    rng: &mut ChaCha8Rng,
) -> Result<(Value, i64), String> {
    let pcm = read(bytes)?;
    let clip = make_clip(&pcm.samples, pcm.channels, pcm.sample_rate, spec, rng)?;
    let array = Array::new(spec.shape(), ArrayData::F32(clip.samples))
        .ok_or_else(|| "the clip does not have the shape of its spec".to_owned())?;
    Ok((Value::Array(array), clip.valid_frames as i64))
}

/// The samples of a WAV or FLAC file.
fn read(bytes: &[u8]) -> Result<Pcm, String> {
    if bytes.starts_with(b"fLaC") {
        read_flac(bytes)
    } else {
        read_wav(bytes)
    }
}

/// The samples of a FLAC stream.
fn read_flac(bytes: &[u8]) -> Result<Pcm, String> {
    let mut reader = claxon::FlacReader::new(Cursor::new(bytes)).map_err(describe_flac)?;
    let info = reader.streaminfo();
    let channels = info.channels as usize;
    if channels == 0 || !(1..=32).contains(&info.bits_per_sample) {
        return Err(format!(
            "malformed FLAC: {channels} channels of {} bits",
            info.bits_per_sample
        ));
    }
    let scale = 1.0 / (1u64 << (info.bits_per_sample - 1)) as f32;
    let declared = info
        .samples
        .map(|frames| frames.saturating_mul(channels as u64));
    let capacity = declared.unwrap_or(0).min(MAX_FLAC_SAMPLES as u64) as usize;
    let mut samples: Vec<f32> = Vec::with_capacity(capacity);
    let mut blocks = reader.blocks();
    let mut buffer = Vec::new();
    while let Some(block) = blocks.read_next_or_eof(buffer).map_err(describe_flac)? {
        if block.channels() as usize != channels {
            return Err(format!(
                "malformed FLAC: a frame has {} channels, the stream {channels}",
                block.channels()
            ));
        }
        let frames = block.duration() as usize;
        if samples.len() + frames * channels > MAX_FLAC_SAMPLES {
            return Err(format!(
                "the FLAC stream holds more than {MAX_FLAC_SAMPLES} samples"
            ));
        }
        let planes: Vec<&[i32]> = (0..channels as u32).map(|c| block.channel(c)).collect();
        for frame in 0..frames {
            samples.extend(planes.iter().map(|plane| plane[frame] as f32 * scale));
        }
        buffer = block.into_buffer();
    }
    if let Some(declared) = declared {
        if (samples.len() as u64) < declared {
            return Err(format!(
                "truncated FLAC data: the header declares {declared} samples, only {} are present",
                samples.len()
            ));
        }
    }
    Ok(Pcm {
        samples,
        channels,
        sample_rate: info.sample_rate,
    })
}

/// A claxon error as a reason.
fn describe_flac(error: claxon::Error) -> String {
    match error {
        // Reading from memory, an I/O error can only mean running out of
        // bytes.
        claxon::Error::IoError(_) => "truncated FLAC data".to_owned(),
        claxon::Error::FormatError(reason) => format!("malformed FLAC: {reason}"),
        claxon::Error::Unsupported(what) => format!("unsupported FLAC: {what}"),
    }
}

/// The samples of a WAV file.
fn read_wav(bytes: &[u8]) -> Result<Pcm, String> {
    match bytes.get(..4) {
        Some(b"RIFF") => {}
        Some(b"RF64") => return Err("RF64 WAV files are not supported".to_owned()),
        _ => return Err("not a WAV file (no RIFF header)".to_owned()),
    }
    if bytes.get(8..12) != Some(b"WAVE") {
        return Err("not a WAV file (RIFF but no WAVE tag)".to_owned());
    }
    let unpadded = without_pad_bytes(bytes);
    let riff = unpadded.as_deref().unwrap_or(bytes);
    let mut reader = WavReader::new(Cursor::new(riff)).map_err(describe)?;
    let spec = reader.spec();
    let channels = usize::from(spec.channels);
    let declared = reader.len() as usize;
    if spec.sample_format == SampleFormat::Int
        && spec.bits_per_sample == 16
        && block_align(bytes) == Some(2 * spec.channels)
    {
        // The common case, converted straight from the data chunk (hound's
        // reader stops at its first byte) rather than sample by sample.
        let start = reader.into_inner().position() as usize;
        let data = &riff[start.min(riff.len())..];
        let present = data.len() / 2;
        if present < declared {
            return Err(format!(
                "truncated WAV data: the header declares {declared} samples, only {present} are present"
            ));
        }
        let samples = data[..declared * 2]
            .chunks_exact(2)
            .map(|b| f32::from(i16::from_le_bytes([b[0], b[1]])) * (1.0 / 32768.0))
            .collect();
        return Ok(Pcm {
            samples,
            channels,
            sample_rate: spec.sample_rate,
        });
    }
    // Never trust the header for the allocation: every sample takes at
    // least one byte of the input.
    let mut samples: Vec<f32> = Vec::with_capacity(declared.min(bytes.len()));
    let result = match (spec.sample_format, spec.bits_per_sample) {
        (SampleFormat::Int, bits @ (8 | 16 | 24 | 32)) => {
            let scale = 1.0 / (1u64 << (bits - 1)) as f32;
            reader
                .samples::<i32>()
                .try_for_each(|sample| sample.map(|x| samples.push(x as f32 * scale)))
        }
        (SampleFormat::Float, 32) => reader
            .samples::<f32>()
            .try_for_each(|sample| sample.map(|x| samples.push(x))),
        (SampleFormat::Int, bits) => {
            return Err(format!(
                "unsupported WAV sample format: {bits}-bit integer PCM"
            ))
        }
        (SampleFormat::Float, bits) => {
            return Err(format!("unsupported WAV sample format: {bits}-bit float"))
        }
    };
    if let Err(error) = result {
        return Err(match error {
            // Reading from memory, an I/O error can only mean running out
            // of bytes (hound reports it as `ErrorKind::Other`).
            hound::Error::IoError(_) => format!(
                "truncated WAV data: the header declares {declared} samples, only {} are present",
                samples.len()
            ),
            other => describe(other),
        });
    }
    Ok(Pcm {
        samples,
        channels,
        sample_rate: spec.sample_rate,
    })
}

/// The decoded value: the samples as a `(frames, channels)` array and the rate.
fn pcm_value(samples: Vec<f32>, channels: usize, sample_rate: u32) -> Result<Value, String> {
    let frames = samples.len() / channels;
    let array = Array::new(vec![frames, channels], ArrayData::F32(samples))
        .ok_or_else(|| "sample count is not a multiple of the channel count".to_owned())?;
    Ok(Value::Tuple(vec![
        Value::Array(array),
        Value::Int(i64::from(sample_rate)),
    ]))
}

/// `bytes` without the pad byte that follows each odd-sized chunk before
/// the `data` chunk, when there is such a chunk: RIFF pads a chunk to an
/// even size, and hound's reader does not skip the pad (it read the next
/// chunk one byte early, and refused a valid file). `None` when nothing
/// needs leaving out.
fn without_pad_bytes(bytes: &[u8]) -> Option<Vec<u8>> {
    let mut at = 12usize;
    let mut pads = Vec::new();
    while let Some(header) = bytes.get(at..at.checked_add(8)?) {
        if &header[..4] == b"data" {
            break;
        }
        let size = u32::from_le_bytes(header[4..8].try_into().ok()?) as usize;
        let end = at.checked_add(8)?.checked_add(size)?;
        if size % 2 == 1 && end < bytes.len() {
            pads.push(end);
        }
        at = end.checked_add(size % 2)?;
    }
    if pads.is_empty() {
        return None;
    }
    let mut out = Vec::with_capacity(bytes.len());
    let mut from = 0;
    for pad in pads {
        out.extend_from_slice(&bytes[from..pad]);
        from = pad + 1;
    }
    out.extend_from_slice(&bytes[from..]);
    Some(out)
}

/// The block align (bytes per frame) of the `fmt ` chunk, found by walking
/// the RIFF chunks; `None` if there is none.
fn block_align(bytes: &[u8]) -> Option<u16> {
    let mut at = 12;
    while let Some(header) = bytes.get(at..at + 8) {
        let size = u32::from_le_bytes(header[4..8].try_into().ok()?) as usize;
        if &header[..4] == b"fmt " {
            let field = bytes.get(at + 20..at + 22)?;
            return Some(u16::from_le_bytes([field[0], field[1]]));
        }
        at = at.checked_add(8 + size + size % 2)?;
    }
    None
}

/// A hound error as a reason.
fn describe(error: hound::Error) -> String {
    match error {
        // Reading from memory, an I/O error can only mean running out of
        // bytes (hound reports it as `ErrorKind::Other`).
        hound::Error::IoError(_) => "truncated WAV header".to_owned(),
        hound::Error::FormatError(reason) => format!("malformed WAV: {reason}"),
        hound::Error::Unsupported => {
            "unsupported WAV encoding (only integer PCM and 32-bit float are supported)".to_owned()
        }
        other => format!("unsupported WAV: {other}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::augment::audio::{Channels, Crop};
    use crate::decode::Decoder;
    use hound::{WavSpec, WavWriter};
    use rand_core::SeedableRng;
    use std::sync::Arc;

    fn wav<S: hound::Sample + Copy>(
        channels: u16,
        sample_rate: u32,
        bits: u16,
        format: SampleFormat,
        samples: &[S],
    ) -> Vec<u8> {
        let spec = WavSpec {
            channels,
            sample_rate,
            bits_per_sample: bits,
            sample_format: format,
        };
        let mut cursor = Cursor::new(Vec::new());
        let mut writer = WavWriter::new(&mut cursor, spec).unwrap();
        for &sample in samples {
            writer.write_sample(sample).unwrap();
        }
        writer.finalize().unwrap();
        cursor.into_inner()
    }

    /// The samples, their shape and the sample rate.
    fn audio(bytes: Vec<u8>) -> (Vec<f32>, Vec<usize>, i64) {
        match Decoder::Audio.decode(bytes) {
            Ok(Value::Tuple(items)) => match items.as_slice() {
                [Value::Array(array), Value::Int(rate)] => match &array.data {
                    ArrayData::F32(samples) => (samples.clone(), array.shape.clone(), *rate),
                    other => panic!("not float32: {other:?}"),
                },
                other => panic!("unexpected tuple {other:?}"),
            },
            other => panic!("unexpected result {other:?}"),
        }
    }

    fn audio_err(bytes: &[u8]) -> String {
        let error = Decoder::Audio.decode(bytes.to_vec()).unwrap_err();
        assert_eq!(error.decoder, "audio");
        error.reason
    }

    #[test]
    fn stereo_16_bit() {
        // Frames (L, R): (0, -32768), (16384, 32767), (-1, 1).
        let bytes = wav(
            2,
            44100,
            16,
            SampleFormat::Int,
            &[0i16, -32768, 16384, 32767, -1, 1],
        );
        let (samples, shape, rate) = audio(bytes);
        assert_eq!(rate, 44100);
        assert_eq!(shape, vec![3, 2]);
        assert_eq!(
            samples,
            vec![
                0.0,
                -1.0,
                0.5,
                32767.0 / 32768.0,
                -1.0 / 32768.0,
                1.0 / 32768.0
            ]
        );
    }

    #[test]
    fn unsigned_8_bit() {
        let bytes = wav(1, 8000, 8, SampleFormat::Int, &[-128i8, 0, 64, 127]);
        // 8-bit WAV stores unsigned bytes: silence is 128.
        let data_start = bytes.len() - 4;
        assert_eq!(&bytes[data_start..], &[0, 128, 192, 255]);
        let (samples, shape, rate) = audio(bytes);
        assert_eq!(rate, 8000);
        assert_eq!(shape, vec![4, 1]);
        assert_eq!(samples, vec![-1.0, 0.0, 0.5, 127.0 / 128.0]);
    }

    #[test]
    fn mono_24_bit() {
        let values = [-(1i32 << 23), (1 << 23) - 1, 1 << 22, -3, 0];
        let (samples, shape, rate) = audio(wav(1, 48000, 24, SampleFormat::Int, &values));
        assert_eq!(rate, 48000);
        assert_eq!(shape, vec![5, 1]);
        let expected: Vec<f32> = values
            .iter()
            .map(|&v| (v as f64 / 8388608.0) as f32)
            .collect();
        assert_eq!(samples, expected);
        assert_eq!(samples[0], -1.0);
        assert_eq!(samples[2], 0.5);
    }

    #[test]
    fn stereo_24_bit_in_4_byte_containers() {
        let spec = hound::WavSpecEx {
            spec: WavSpec {
                channels: 2,
                sample_rate: 96000,
                bits_per_sample: 24,
                sample_format: SampleFormat::Int,
            },
            bytes_per_sample: 4,
        };
        let mut cursor = Cursor::new(Vec::new());
        let mut writer = WavWriter::new_with_spec_ex(&mut cursor, spec).unwrap();
        for sample in [1i32 << 22, -(1 << 23), 0, (1 << 21) + (1 << 20)] {
            writer.write_sample(sample).unwrap();
        }
        writer.finalize().unwrap();
        let (samples, shape, rate) = audio(cursor.into_inner());
        assert_eq!((shape, rate), (vec![2, 2], 96000));
        assert_eq!(samples, vec![0.5, -1.0, 0.0, 0.375]);
    }

    #[test]
    fn unknown_chunks_before_the_data_are_skipped() {
        let plain = wav(1, 8000, 16, SampleFormat::Int, &[100i16, -200]);
        // Insert a LIST chunk between the fmt chunk (ends at 36) and data.
        let list = b"LIST\x06\0\0\0INFOab";
        let mut bytes = plain[..36].to_vec();
        bytes.extend_from_slice(list);
        bytes.extend_from_slice(&plain[36..]);
        let riff_len = (bytes.len() - 8) as u32;
        bytes[4..8].copy_from_slice(&riff_len.to_le_bytes());
        let (samples, shape, _) = audio(bytes);
        assert_eq!(shape, vec![2, 1]);
        assert_eq!(samples, vec![100.0 / 32768.0, -200.0 / 32768.0]);
    }

    /// RIFF pads an odd-sized chunk with a byte; hound does not skip it,
    /// and the file was refused as "truncated WAV header". Before the `fmt `
    /// chunk too, and for the sample-by-sample path (24-bit).
    #[test]
    fn odd_sized_chunks_before_the_data_are_skipped_with_their_pad_byte() {
        for (bits, values) in [(16u16, vec![100i32, -200]), (24, vec![1 << 20, -(1 << 21)])] {
            let plain = match bits {
                16 => wav(1, 8000, 16, SampleFormat::Int, &[100i16, -200]),
                _ => wav(1, 8000, 24, SampleFormat::Int, &values),
            };
            let odd = b"LIST\x07\0\0\0INFOabc\0";
            let fmt_end = 20 + u32::from_le_bytes(plain[16..20].try_into().unwrap()) as usize;
            for at in [12, fmt_end] {
                let mut bytes = plain[..at].to_vec();
                bytes.extend_from_slice(odd);
                bytes.extend_from_slice(&plain[at..]);
                let riff_len = (bytes.len() - 8) as u32;
                bytes[4..8].copy_from_slice(&riff_len.to_le_bytes());
                let (samples, shape, rate) = audio(bytes);
                assert_eq!(
                    (shape, rate),
                    (vec![2, 1], 8000),
                    "{bits}-bit, chunk at {at}"
                );
                let scale = (1u64 << (bits - 1)) as f32;
                let expected: Vec<f32> = values.iter().map(|&v| v as f32 / scale).collect();
                assert_eq!(samples, expected, "{bits}-bit, chunk at {at}");
            }
        }
    }

    #[test]
    fn stereo_32_bit_int() {
        let values = [i32::MIN, i32::MAX, 1 << 30, -(1 << 29)];
        let (samples, shape, _) = audio(wav(2, 16000, 32, SampleFormat::Int, &values));
        assert_eq!(shape, vec![2, 2]);
        assert_eq!(samples, vec![-1.0, 1.0, 0.5, -0.25]);
    }

    #[test]
    fn float_32_is_unchanged() {
        let values = [0.0f32, -0.75, 0.123456, 1.5, -2.0, f32::MIN_POSITIVE];
        let (samples, shape, rate) = audio(wav(3, 22050, 32, SampleFormat::Float, &values));
        assert_eq!(rate, 22050);
        assert_eq!(shape, vec![2, 3]);
        assert_eq!(samples, values.to_vec());
    }

    #[test]
    fn empty_data_chunk() {
        let (samples, shape, rate) = audio(wav::<i16>(2, 16000, 16, SampleFormat::Int, &[]));
        assert_eq!((samples.len(), shape, rate), (0, vec![0, 2], 16000));
    }

    #[test]
    fn not_a_wav() {
        assert_eq!(
            Decoder::Audio
                .decode(b"ID3\x04 mp3 data".to_vec())
                .unwrap_err()
                .to_string(),
            "audio: not a WAV file (no RIFF header)"
        );
        assert_eq!(audio_err(b""), "not a WAV file (no RIFF header)");
        assert_eq!(
            audio_err(b"RIFF\x10\0\0\0AVI LIST"),
            "not a WAV file (RIFF but no WAVE tag)"
        );
        assert_eq!(audio_err(b"RIFF"), "not a WAV file (RIFF but no WAVE tag)");
        assert_eq!(
            audio_err(b"RF64\xff\xff\xff\xffWAVE"),
            "RF64 WAV files are not supported"
        );
    }

    #[test]
    fn truncated_files() {
        let bytes = wav(2, 44100, 16, SampleFormat::Int, &[1i16, 2, 3, 4, 5, 6]);
        // Cut inside the data: the header still declares 6 samples.
        assert_eq!(
            audio_err(&bytes[..bytes.len() - 3]),
            "truncated WAV data: the header declares 6 samples, only 4 are present"
        );
        // Cut inside the fmt chunk and right after the RIFF header.
        assert_eq!(audio_err(&bytes[..20]), "truncated WAV header");
        assert_eq!(audio_err(&bytes[..12]), "truncated WAV header");
        // Every prefix fails cleanly, none panics.
        for end in 0..bytes.len() {
            assert!(
                Decoder::Audio.decode(bytes[..end].to_vec()).is_err(),
                "prefix {end}"
            );
        }
    }

    /// `tests/data/stereo_8k_16bit.flac`: 300 frames at 8 kHz, left a
    /// 440 Hz tone `round(20000 sin(2 pi 440 t / 8000))`, right
    /// `(97 t) mod 65536 - 32768` (written with libsndfile).
    const FLAC: &[u8] = include_bytes!("../../tests/data/stereo_8k_16bit.flac");

    #[test]
    fn flac_is_scaled_like_wav() {
        let (samples, shape, rate) = audio(FLAC.to_vec());
        assert_eq!((shape, rate), (vec![300, 2], 8000));
        for t in 0..300 {
            let left =
                (20000.0 * (2.0 * std::f64::consts::PI * 440.0 * t as f64 / 8000.0).sin()) as i16;
            let right = ((97 * t) % 65536 - 32768) as i16;
            assert_eq!(samples[2 * t], f32::from(left) / 32768.0, "left {t}");
            assert_eq!(samples[2 * t + 1], f32::from(right) / 32768.0, "right {t}");
        }
    }

    #[test]
    fn broken_flac_fails_cleanly() {
        for end in 4..FLAC.len() {
            let error = audio_err(&FLAC[..end]);
            assert!(error.contains("FLAC"), "prefix {end}: {error}");
        }
        let mut flipped = FLAC.to_vec();
        let last = flipped.len() - 20;
        flipped[last] ^= 0x55;
        assert!(audio_err(&flipped).contains("FLAC"));
    }

    fn spec(channels: Channels, frames: u64, crop: Crop) -> AudioSpec {
        AudioSpec::new(16000, channels, Some(frames), None, crop, 0.0).unwrap()
    }

    #[test]
    fn clips_of_wav_and_flac() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        // 300 frames at 8 kHz are 600 at 16 kHz.
        let (value, valid) =
            clip(FLAC, &spec(Channels::Mono, 1000, Crop::Random), &mut rng).unwrap();
        assert_eq!(valid, 600);
        let Value::Array(array) = value else {
            panic!("not an array")
        };
        assert_eq!(array.shape, vec![1000]);
        let stereo = spec(Channels::Pick(vec![1, 0]), 100, Crop::Start);
        let (value, valid) = clip(FLAC, &stereo, &mut rng).unwrap();
        assert_eq!(valid, 100);
        let Value::Array(array) = value else {
            panic!("not an array")
        };
        assert_eq!(array.shape, vec![2, 100]);
        let bytes = wav(1, 16000, 16, SampleFormat::Int, &[1000i16; 50]);
        let (value, valid) = clip(
            &bytes,
            &spec(Channels::Pick(vec![0]), 64, Crop::Center),
            &mut rng,
        )
        .unwrap();
        assert_eq!(valid, 50);
        let Value::Array(array) = value else {
            panic!("not an array")
        };
        let ArrayData::F32(samples) = array.data else {
            panic!("not float32")
        };
        assert_eq!(samples[..50], [1000.0 / 32768.0; 50]);
        assert_eq!(samples[50..], [0.0; 14]);
        assert_eq!(
            clip(&bytes, &stereo, &mut rng).unwrap_err(),
            "channel 1 was asked for, the audio has 1 channel"
        );
        assert_eq!(
            clip(b"junk", &stereo, &mut rng).unwrap_err(),
            "not a WAV file (no RIFF header)"
        );
    }

    proptest::proptest! {
        /// Damaged WAV and FLAC files (a few bytes changed, the end cut)
        /// give a clip or an error, never a panic (which the decoder's
        /// guard would report as "decoder panicked").
        #[test]
        fn damaged_files_never_panic(
            flac: bool,
            changes in proptest::collection::vec((0usize..4096, proptest::prelude::any::<u8>()), 1..4),
            keep in 0.5f64..=1.0,
        ) {
            let mut bytes = if flac {
                FLAC.to_vec()
            } else {
                let samples: Vec<i16> = (0..600).map(|i| (i * 37 % 2000 - 1000) as i16).collect();
                wav(2, 44100, 16, SampleFormat::Int, &samples)
            };
            for (at, value) in changes {
                let at = at % bytes.len();
                bytes[at] = value;
            }
            bytes.truncate((bytes.len() as f64 * keep) as usize);
            let spec = Arc::new(spec(Channels::Pick(vec![1, 0]), 100, Crop::Random));
            let context = crate::augment::SampleContext::default();
            match Decoder::AudioClip(spec).decode_field(bytes, &context, "wav") {
                Ok(Value::Tuple(items)) => proptest::prop_assert_eq!(items.len(), 2),
                Ok(other) => proptest::prop_assert!(false, "unexpected {other:?}"),
                Err(error) => proptest::prop_assert!(!error.reason.contains("panicked"), "{error}"),
            }
        }
    }

    #[test]
    fn malformed_headers() {
        let bytes = wav(1, 8000, 16, SampleFormat::Int, &[1i16, 2]);
        // hound writes the fmt chunk at offset 12: tag, channels, rate...
        let mut zero_channels = bytes.clone();
        zero_channels[22..24].copy_from_slice(&0u16.to_le_bytes());
        assert_eq!(
            audio_err(&zero_channels),
            "malformed WAV: file contains zero channels"
        );
        let mut adpcm = bytes.clone();
        adpcm[20..22].copy_from_slice(&2u16.to_le_bytes());
        assert!(audio_err(&adpcm).starts_with("unsupported WAV encoding"));
        let mut twelve_bit = bytes.clone();
        twelve_bit[34..36].copy_from_slice(&12u16.to_le_bytes());
        assert_eq!(
            audio_err(&twelve_bit),
            "malformed WAV: bits per sample is not a multiple of 8"
        );
    }
}
