//! Audio clips of a fixed shape: decoded samples mixed to mono or picked
//! by channel, resampled to one rate, and cropped or padded to exactly
//! `frames` frames (the `AudioClip` transform).
//!
//! The steps, for one clip of `L` frames at rate `r_in` going to `r_out`:
//!
//! 1. **Channels**: the mean of all channels (`"mono"`), or the listed
//!    channels in the listed order (an index the file does not have is an
//!    error).
//! 2. **Length after resampling**: `R = ceil(L * r_out / r_in)` (`L` when
//!    the rates are equal).
//! 3. **Crop**: when `R > frames`, a window of `frames` frames starting at
//!    `0` (`Start`), `(R - frames) / 2` (`Center`) or a uniform draw from
//!    `0..=R - frames` on the sample's random stream (`Random`); otherwise
//!    the whole clip. The number of real frames is `min(frames, R)`.
//! 4. **Resampling** with rubato's synchronous FFT resampler: a windowed
//!    sinc low-pass (Blackman-Harris², as many taps as one FFT block of
//!    input, cutoff from `rubato::calculate_cutoff` scaled to the lower of
//!    the two Nyquist frequencies) applied by FFT overlap-add, the
//!    resampler's delay trimmed. Only the blocks around the crop window are
//!    resampled: the window starts on a block boundary with [`MARGIN_BLOCKS`]
//!    blocks of context on either side, so the frames are those of
//!    resampling the whole clip and cropping after (up to float rounding).
//! 5. **Padding**: frames past the real ones are `pad`; real frames always
//!    come first.
//!
//! Everything here is a pure function of the samples, the spec and the
//! random stream (a cached resampler is reset before each clip), so a clip
//! is the same on any thread, worker count or resumed run.

use std::cell::RefCell;

use rand_chacha::ChaCha8Rng;
use rubato::audioadapter_buffers::direct::SequentialSlice;
use rubato::{Fft, FixedSync, Resampler, WindowFunction};

use crate::plan::order::below;

/// The highest sample rate accepted, of a file or asked for (768 kHz, the
/// highest rate audio interfaces offer). It bounds the FFT block, and so
/// the memory, of the resampler for any pair of rates.
pub const MAX_SAMPLE_RATE: u32 = 768_000;

/// The most frames a clip may have (2^26: 70 minutes at 16 kHz).
pub const MAX_FRAMES: u64 = 1 << 26;

/// The most channels a clip may pick.
pub const MAX_CHANNELS: usize = 64;

/// Input frames one FFT block should hold at least: longer blocks mean a
/// longer filter, whose cutoff lies closer to the Nyquist frequency.
const BLOCK_TARGET: usize = 1024;

/// Blocks resampled on either side of a crop window, so that its frames
/// see the same neighbours as in the whole clip. The filter spans one
/// block, and the overlap-add one more.
pub const MARGIN_BLOCKS: usize = 2;

/// Resamplers kept per thread, by rate pair (planning FFTs costs more than
/// a short clip).
const CACHED_RESAMPLERS: usize = 4;

/// Which channels a clip keeps.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Channels {
    /// The mean of all channels; the clip has shape `(frames,)`.
    Mono,
    /// These channels, in this order (repeats allowed); shape `(frames,)`
    /// for one, `(channels, frames)` for several.
    Pick(Vec<u16>),
}

/// Where a clip longer than `frames` is cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Crop {
    /// A uniform draw over every window, from the sample's random stream.
    Random,
    /// The first `frames` frames.
    Start,
    /// The middle `frames` frames (rounded towards the start).
    Center,
}

impl Crop {
    /// The crop's name, as `AudioClip(crop=...)` takes it.
    pub fn name(self) -> &'static str {
        match self {
            Crop::Random => "random",
            Crop::Start => "start",
            Crop::Center => "center",
        }
    }

    /// Parses a crop name (`"random"`, `"start"`, `"center"`).
    pub fn parse(name: &str) -> Option<Crop> {
        [Crop::Random, Crop::Start, Crop::Center]
            .into_iter()
            .find(|crop| crop.name() == name)
    }
}

/// A validated `AudioClip`: every clip it makes has the same shape.
#[derive(Debug, Clone, PartialEq)]
pub struct AudioSpec {
    sample_rate: u32,
    channels: Channels,
    frames: usize,
    crop: Crop,
    pad: f32,
}

/// A parameter of [`AudioSpec::new`] that is out of range.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{parameter}: {reason}")]
pub struct SpecError {
    /// The parameter's name, as `AudioClip` takes it.
    pub parameter: &'static str,
    /// What is wrong with it.
    pub reason: String,
}

fn spec_error(parameter: &'static str, reason: String) -> SpecError {
    SpecError { parameter, reason }
}

impl AudioSpec {
    /// Checks the parameters: `sample_rate` in `1..=MAX_SAMPLE_RATE`; a
    /// non-empty list of at most [`MAX_CHANNELS`] channels; exactly one of
    /// `frames` and `seconds` (`seconds` is rounded to the nearest frame at
    /// `sample_rate`), giving `1..=MAX_FRAMES` frames; a finite `pad`.
    pub fn new(
        sample_rate: u32,
        channels: Channels,
        frames: Option<u64>,
        seconds: Option<f64>,
        crop: Crop,
        pad: f32,
    ) -> Result<Self, SpecError> {
        if sample_rate == 0 || sample_rate > MAX_SAMPLE_RATE {
            return Err(spec_error(
                "sample_rate",
                format!("must be between 1 and {MAX_SAMPLE_RATE} Hz, got {sample_rate}"),
            ));
        }
        if let Channels::Pick(list) = &channels {
            if list.is_empty() {
                return Err(spec_error(
                    "channels",
                    "the list of channel indices is empty".into(),
                ));
            }
            if list.len() > MAX_CHANNELS {
                return Err(spec_error(
                    "channels",
                    format!("at most {MAX_CHANNELS} channels, got {}", list.len()),
                ));
            }
        }
        let frames = match (frames, seconds) {
            (Some(frames), None) => frames,
            (None, Some(seconds)) => {
                if !seconds.is_finite() || seconds <= 0.0 {
                    return Err(spec_error(
                        "seconds",
                        format!("must be a positive number, got {seconds}"),
                    ));
                }
                let frames = (seconds * f64::from(sample_rate)).round();
                if frames < 1.0 {
                    return Err(spec_error(
                        "seconds",
                        format!("{seconds} s is less than one frame at {sample_rate} Hz"),
                    ));
                }
                if frames > MAX_FRAMES as f64 {
                    return Err(spec_error(
                        "seconds",
                        format!("{seconds} s is more than {MAX_FRAMES} frames at {sample_rate} Hz"),
                    ));
                }
                frames as u64
            }
            (Some(_), Some(_)) => {
                return Err(spec_error(
                    "frames",
                    "give frames or seconds, not both".into(),
                ))
            }
            (None, None) => {
                return Err(spec_error(
                    "frames",
                    "give the clip length as frames or seconds".into(),
                ))
            }
        };
        if frames == 0 || frames > MAX_FRAMES {
            return Err(spec_error(
                "frames",
                format!("must be between 1 and {MAX_FRAMES}, got {frames}"),
            ));
        }
        if !pad.is_finite() {
            return Err(spec_error("pad", format!("must be finite, got {pad}")));
        }
        Ok(AudioSpec {
            sample_rate,
            channels,
            frames: frames as usize,
            crop,
            pad,
        })
    }

    /// The output sample rate.
    pub fn sample_rate(&self) -> u32 {
        self.sample_rate
    }

    /// The channels kept.
    pub fn channels(&self) -> &Channels {
        &self.channels
    }

    /// Frames per clip.
    pub fn frames(&self) -> usize {
        self.frames
    }

    /// Where long clips are cut.
    pub fn crop(&self) -> Crop {
        self.crop
    }

    /// The value of padded frames.
    pub fn pad(&self) -> f32 {
        self.pad
    }

    /// The shape of every clip: `[frames]` for one channel,
    /// `[channels, frames]` for several.
    pub fn shape(&self) -> Vec<usize> {
        match &self.channels {
            Channels::Pick(list) if list.len() > 1 => vec![list.len(), self.frames],
            _ => vec![self.frames],
        }
    }
}

impl std::fmt::Display for AudioSpec {
    /// The spec as Python builds it:
    /// `AudioClip(sample_rate=16000, channels="mono", frames=64000, crop="random", pad=0.0)`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let channels = match &self.channels {
            Channels::Mono => "\"mono\"".to_owned(),
            Channels::Pick(list) => format!("{list:?}"),
        };
        write!(
            f,
            "AudioClip(sample_rate={}, channels={channels}, frames={}, crop=\"{}\", pad={:?})",
            self.sample_rate,
            self.frames,
            self.crop.name(),
            self.pad
        )
    }
}

/// One clip: `spec.shape()` float32 samples, channel after channel.
#[derive(Debug, Clone, PartialEq)]
pub struct Clip {
    /// The samples, in C order of [`AudioSpec::shape`].
    pub samples: Vec<f32>,
    /// The number of real (unpadded) frames at the start of each channel:
    /// `min(frames, resampled length)`.
    pub valid_frames: usize,
}

/// Makes one clip from decoded audio: `samples` interleaved, `channels`
/// per frame, at `sample_rate`. Random crops draw from `rng`.
pub fn make_clip(
    samples: &[f32],
    channels: usize,
    sample_rate: u32,
    spec: &AudioSpec,
    rng: &mut ChaCha8Rng,
) -> Result<Clip, String> {
    if channels == 0 {
        return Err("the audio has no channel".into());
    }
    if sample_rate == 0 || sample_rate > MAX_SAMPLE_RATE {
        return Err(format!(
            "unsupported sample rate {sample_rate} Hz (1 to {MAX_SAMPLE_RATE} Hz are)"
        ));
    }
    let planes = select_channels(samples, channels, &spec.channels)?;
    let length = samples.len() / channels;
    let (rate_in, rate_out) = (sample_rate as usize, spec.sample_rate as usize);
    let resampled = resampled_length(length, rate_in, rate_out);
    let valid = spec.frames.min(resampled);
    let start = crop_start(resampled, spec.frames, spec.crop, rng);
    let mut out = vec![spec.pad; planes.len() * spec.frames];
    for (plane, target) in planes.iter().zip(out.chunks_exact_mut(spec.frames)) {
        let target = &mut target[..valid];
        if rate_in == rate_out {
            target.copy_from_slice(&plane[start..start + valid]);
        } else {
            resample_window(plane, rate_in, rate_out, start, target)?;
        }
    }
    Ok(Clip {
        samples: out,
        valid_frames: valid,
    })
}

/// The frames of `length` input frames after resampling: `ceil(length *
/// rate_out / rate_in)`.
pub fn resampled_length(length: usize, rate_in: usize, rate_out: usize) -> usize {
    if rate_in == rate_out {
        return length;
    }
    (length as u128 * rate_out as u128).div_ceil(rate_in as u128) as usize
}

/// Where the clip's window starts among `length` frames.
fn crop_start(length: usize, frames: usize, crop: Crop, rng: &mut ChaCha8Rng) -> usize {
    if length <= frames {
        return 0;
    }
    let slack = length - frames;
    match crop {
        Crop::Start => 0,
        Crop::Center => slack / 2,
        Crop::Random => below(rng, slack + 1),
    }
}

/// The kept channels, each as its own contiguous run of samples.
fn select_channels(
    samples: &[f32],
    channels: usize,
    keep: &Channels,
) -> Result<Vec<Vec<f32>>, String> {
    let frames = samples.chunks_exact(channels);
    match keep {
        Channels::Mono if channels == 1 => Ok(vec![samples.to_vec()]),
        Channels::Mono => {
            let scale = 1.0 / channels as f32;
            Ok(vec![frames
                .map(|frame| frame.iter().sum::<f32>() * scale)
                .collect()])
        }
        Channels::Pick(list) => {
            if let Some(missing) = list.iter().find(|&&c| usize::from(c) >= channels) {
                return Err(format!(
                    "channel {missing} was asked for, the audio has {channels} channel{}",
                    if channels == 1 { "" } else { "s" }
                ));
            }
            Ok(list
                .iter()
                .map(|&c| frames.clone().map(|frame| frame[usize::from(c)]).collect())
                .collect())
        }
    }
}

/// The FFT block of a rate pair: input and output frames per block. The
/// smallest block that maps whole input frames onto whole output frames is
/// `rate / gcd` on each side; it is repeated to hold at least
/// [`BLOCK_TARGET`] input frames.
fn block_sizes(rate_in: usize, rate_out: usize) -> (usize, usize) {
    let gcd = gcd(rate_in, rate_out);
    let (min_in, min_out) = (rate_in / gcd, rate_out / gcd);
    let repeat = BLOCK_TARGET.div_ceil(min_in).max(1);
    (repeat * min_in, repeat * min_out)
}

fn gcd(mut a: usize, mut b: usize) -> usize {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// Writes frames `start..start + target.len()` of `plane` resampled from
/// `rate_in` to `rate_out` into `target`, resampling only the blocks
/// around them.
fn resample_window(
    plane: &[f32],
    rate_in: usize,
    rate_out: usize,
    start: usize,
    target: &mut [f32],
) -> Result<(), String> {
    if target.is_empty() {
        return Ok(());
    }
    let (block_in, block_out) = block_sizes(rate_in, rate_out);
    let first_block = (start / block_out).saturating_sub(MARGIN_BLOCKS);
    let end_block = (start + target.len()).div_ceil(block_out) + MARGIN_BLOCKS;
    let from = first_block * block_in;
    let to = end_block.saturating_mul(block_in).min(plane.len());
    let window = &plane[from..to];
    let input = SequentialSlice::new(window, 1, window.len())
        .map_err(|e| format!("resampling failed: {e}"))?;
    let resampled = with_resampler(rate_in, rate_out, block_in, |resampler| {
        resampler
            .process_all(&input, window.len(), None)
            .map_err(|e| format!("resampling failed: {e}"))
    })??
    .take_data();
    let offset = start - first_block * block_out;
    let got = resampled
        .get(offset..offset + target.len())
        .ok_or_else(|| {
            format!(
                "resampling gave {} frames where {} were expected",
                resampled.len(),
                offset + target.len()
            )
        })?;
    target.copy_from_slice(got);
    Ok(())
}

/// A one-channel resampler and its `(rate_in, rate_out)`.
type CachedResampler = ((usize, usize), Fft<f32>);

thread_local! {
    /// This thread's resamplers, most recently used last.
    static RESAMPLERS: RefCell<Vec<CachedResampler>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` with this thread's one-channel resampler from `rate_in` to
/// `rate_out` (FFT blocks of `block_in` input frames), made on first use.
/// `process_all` resets it first, so what it gives never depends on the
/// clips before.
fn with_resampler<T>(
    rate_in: usize,
    rate_out: usize,
    block_in: usize,
    f: impl FnOnce(&mut Fft<f32>) -> T,
) -> Result<T, String> {
    RESAMPLERS.with(|cache| {
        let mut cache = cache.borrow_mut();
        let key = (rate_in, rate_out);
        let at = match cache.iter().position(|(k, _)| *k == key) {
            Some(at) => at,
            None => {
                // One block per chunk: `FixedSync::Input` with a chunk of
                // `block_in` frames makes blocks of exactly `block_in`.
                let resampler = Fft::<f32>::new_custom(
                    rate_in,
                    rate_out,
                    block_in,
                    1,
                    1,
                    WindowFunction::BlackmanHarris2,
                    FixedSync::Input,
                )
                .map_err(|e| format!("cannot resample {rate_in} Hz to {rate_out} Hz: {e}"))?;
                if cache.len() == CACHED_RESAMPLERS {
                    cache.remove(0);
                }
                cache.push((key, resampler));
                cache.len() - 1
            }
        };
        let entry = cache.remove(at);
        cache.push(entry);
        let last = cache.len() - 1;
        Ok(f(&mut cache[last].1))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rand_core::{Rng, SeedableRng};

    fn rng(seed: u64) -> ChaCha8Rng {
        ChaCha8Rng::seed_from_u64(seed)
    }

    fn spec(rate: u32, channels: Channels, frames: u64, crop: Crop) -> AudioSpec {
        AudioSpec::new(rate, channels, Some(frames), None, crop, 0.0).unwrap()
    }

    fn sine(frequency: f64, rate: f64, frames: usize, amplitude: f64) -> Vec<f32> {
        (0..frames)
            .map(|i| {
                (amplitude * (2.0 * std::f64::consts::PI * frequency * i as f64 / rate).sin())
                    as f32
            })
            .collect()
    }

    /// Amplitude of `frequency` in `x` (a single-bin DFT over whole periods
    /// is exact for a pure tone).
    fn amplitude_at(x: &[f32], frequency: f64, rate: f64) -> f64 {
        let (mut re, mut im) = (0.0, 0.0);
        for (i, &v) in x.iter().enumerate() {
            let phase = 2.0 * std::f64::consts::PI * frequency * i as f64 / rate;
            re += f64::from(v) * phase.cos();
            im += f64::from(v) * phase.sin();
        }
        2.0 * (re * re + im * im).sqrt() / x.len() as f64
    }

    fn rms(x: &[f32]) -> f64 {
        (x.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>() / x.len() as f64).sqrt()
    }

    #[test]
    fn spec_rejects_bad_parameters_by_name() {
        let make = |rate, channels, frames, seconds, pad| {
            AudioSpec::new(rate, channels, frames, seconds, Crop::Random, pad)
                .unwrap_err()
                .parameter
        };
        assert_eq!(make(0, Channels::Mono, Some(1), None, 0.0), "sample_rate");
        assert_eq!(
            make(800_000, Channels::Mono, Some(1), None, 0.0),
            "sample_rate"
        );
        assert_eq!(
            make(16000, Channels::Pick(vec![]), Some(1), None, 0.0),
            "channels"
        );
        assert_eq!(
            make(16000, Channels::Pick(vec![0; 65]), Some(1), None, 0.0),
            "channels"
        );
        assert_eq!(make(16000, Channels::Mono, Some(0), None, 0.0), "frames");
        assert_eq!(
            make(16000, Channels::Mono, Some(MAX_FRAMES + 1), None, 0.0),
            "frames"
        );
        assert_eq!(make(16000, Channels::Mono, None, None, 0.0), "frames");
        assert_eq!(
            make(16000, Channels::Mono, Some(5), Some(1.0), 0.0),
            "frames"
        );
        assert_eq!(
            make(16000, Channels::Mono, None, Some(-1.0), 0.0),
            "seconds"
        );
        assert_eq!(
            make(16000, Channels::Mono, None, Some(f64::NAN), 0.0),
            "seconds"
        );
        assert_eq!(
            make(16000, Channels::Mono, None, Some(1e-6), 0.0),
            "seconds"
        );
        assert_eq!(make(16000, Channels::Mono, None, Some(1e9), 0.0), "seconds");
        assert_eq!(
            make(16000, Channels::Mono, Some(5), None, f32::INFINITY),
            "pad"
        );
        let error = AudioSpec::new(0, Channels::Mono, Some(1), None, Crop::Start, 0.0).unwrap_err();
        assert_eq!(
            error.to_string(),
            "sample_rate: must be between 1 and 768000 Hz, got 0"
        );
        let seconds = AudioSpec::new(16000, Channels::Mono, None, Some(4.0), Crop::Start, 0.0);
        assert_eq!(seconds.unwrap().frames(), 64000);
        assert_eq!(Crop::parse("center"), Some(Crop::Center));
        let picked = AudioSpec::new(
            8000,
            Channels::Pick(vec![1, 0]),
            Some(10),
            None,
            Crop::Center,
            -0.5,
        );
        assert_eq!(
            picked.unwrap().to_string(),
            "AudioClip(sample_rate=8000, channels=[1, 0], frames=10, crop=\"center\", pad=-0.5)"
        );
        assert_eq!(Crop::parse("middle"), None);
    }

    #[test]
    fn shapes_follow_the_channels() {
        assert_eq!(
            spec(8000, Channels::Mono, 10, Crop::Start).shape(),
            vec![10]
        );
        assert_eq!(
            spec(8000, Channels::Pick(vec![1]), 10, Crop::Start).shape(),
            vec![10]
        );
        assert_eq!(
            spec(8000, Channels::Pick(vec![1, 0, 1]), 10, Crop::Start).shape(),
            vec![3, 10]
        );
    }

    #[test]
    fn mono_mix_pick_crop_and_pad_without_resampling() {
        // Stereo frames (i, -2i) for i in 0..6.
        let samples: Vec<f32> = (0..6).flat_map(|i| [i as f32, -2.0 * i as f32]).collect();
        let mono = make_clip(
            &samples,
            2,
            100,
            &spec(100, Channels::Mono, 4, Crop::Start),
            &mut rng(0),
        );
        assert_eq!(
            mono.unwrap(),
            Clip {
                samples: vec![0.0, -0.5, -1.0, -1.5],
                valid_frames: 4
            }
        );
        let center = make_clip(
            &samples,
            2,
            100,
            &spec(100, Channels::Pick(vec![1, 0]), 3, Crop::Center),
            &mut rng(0),
        );
        assert_eq!(
            center.unwrap(),
            Clip {
                samples: vec![-2.0, -4.0, -6.0, 1.0, 2.0, 3.0],
                valid_frames: 3
            }
        );
        let padded = AudioSpec::new(
            100,
            Channels::Pick(vec![0]),
            Some(8),
            None,
            Crop::Random,
            -9.0,
        )
        .unwrap();
        let clip = make_clip(&samples, 2, 100, &padded, &mut rng(0)).unwrap();
        assert_eq!(clip.valid_frames, 6);
        assert_eq!(clip.samples, vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0, -9.0, -9.0]);
        let empty = make_clip(&[], 2, 100, &padded, &mut rng(0)).unwrap();
        assert_eq!((empty.valid_frames, empty.samples), (0, vec![-9.0; 8]));
    }

    #[test]
    fn bad_audio_is_an_error() {
        let s = spec(16000, Channels::Pick(vec![0, 2]), 4, Crop::Start);
        assert_eq!(
            make_clip(&[0.0; 8], 2, 16000, &s, &mut rng(0)).unwrap_err(),
            "channel 2 was asked for, the audio has 2 channels"
        );
        let mono = spec(16000, Channels::Mono, 4, Crop::Start);
        assert!(make_clip(&[0.0; 8], 0, 16000, &mono, &mut rng(0)).is_err());
        assert!(make_clip(&[0.0; 8], 1, 0, &mono, &mut rng(0)).is_err());
        assert!(make_clip(&[0.0; 8], 1, u32::MAX, &mono, &mut rng(0)).is_err());
    }

    #[test]
    fn random_crops_depend_only_on_the_stream() {
        let samples: Vec<f32> = (0..1000).map(|i| i as f32).collect();
        let s = spec(100, Channels::Mono, 10, Crop::Random);
        let a = make_clip(&samples, 1, 100, &s, &mut rng(7)).unwrap();
        let b = make_clip(&samples, 1, 100, &s, &mut rng(7)).unwrap();
        assert_eq!(a, b);
        let starts: std::collections::BTreeSet<u32> = (0..50)
            .map(|seed| {
                make_clip(&samples, 1, 100, &s, &mut rng(seed))
                    .unwrap()
                    .samples[0] as u32
            })
            .collect();
        assert!(starts.len() > 30, "{starts:?}");
    }

    /// A 1 kHz tone keeps its frequency and level through 44.1 -> 16 kHz and
    /// 16 -> 48 kHz; a tone above the new Nyquist frequency is removed.
    #[test]
    fn resampling_keeps_tones_and_removes_aliases() {
        for (rate_in, rate_out) in [(44100u32, 16000u32), (16000, 48000), (48000, 22050)] {
            let input = sine(1000.0, f64::from(rate_in), rate_in as usize * 2, 0.5);
            let s = spec(rate_out, Channels::Mono, u64::from(rate_out), Crop::Center);
            let clip = make_clip(&input, 1, rate_in, &s, &mut rng(0)).unwrap();
            assert_eq!(clip.valid_frames, rate_out as usize);
            let amplitude = amplitude_at(&clip.samples, 1000.0, f64::from(rate_out));
            assert!(
                (amplitude - 0.5).abs() < 0.005,
                "{rate_in}->{rate_out}: {amplitude}"
            );
            // Nothing but the tone: its RMS is that of the sine alone.
            let rms_error = (rms(&clip.samples) - 0.5 / 2f64.sqrt()).abs();
            assert!(
                rms_error < 0.003,
                "{rate_in}->{rate_out}: rms off by {rms_error}"
            );
        }
        // 10 kHz is above 8 kHz, the Nyquist frequency of 16 kHz.
        let input = sine(10000.0, 44100.0, 88200, 0.5);
        let s = spec(16000, Channels::Mono, 16000, Crop::Center);
        let clip = make_clip(&input, 1, 44100, &s, &mut rng(0)).unwrap();
        assert!(
            rms(&clip.samples) < 0.005,
            "alias left: {}",
            rms(&clip.samples)
        );
    }

    /// Resampling the window around a crop gives the frames of resampling
    /// the whole clip and cropping after.
    #[test]
    fn windowed_resampling_matches_the_whole_clip() {
        let noise: Vec<f32> = {
            let mut r = rng(3);
            (0..44100 * 3)
                .map(|_| (r.next_u32() as f32 / u32::MAX as f32) - 0.5)
                .collect()
        };
        let whole = spec(16000, Channels::Mono, 48000, Crop::Start);
        let full = make_clip(&noise, 1, 44100, &whole, &mut rng(0)).unwrap();
        assert_eq!(full.valid_frames, 48000);
        for start in [0usize, 1, 159, 160, 5000, 20001, 47000, 47999] {
            let mut target = vec![0.0; (48000 - start).min(1000)];
            resample_window(&noise, 44100, 16000, start, &mut target).unwrap();
            let worst = target
                .iter()
                .zip(&full.samples[start..])
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            assert!(worst < 1e-5, "start {start}: {worst}");
        }
    }

    proptest! {
        /// For any lengths, rates and crops: the clip has exactly the
        /// spec's shape, `valid_frames = min(frames, resampled length)`,
        /// padding follows the real frames, and the crop lies inside the
        /// clip (a ramp shows where it starts).
        #[test]
        fn crop_and_pad_are_exact(
            length in 0usize..3000,
            frames in 1u64..2000,
            rate_in in prop::sample::select(vec![8000u32, 16000, 22050, 44100]),
            rate_out in prop::sample::select(vec![8000u32, 16000]),
            crop in prop::sample::select(vec![Crop::Random, Crop::Start, Crop::Center]),
            seed: u64,
        ) {
            let ramp: Vec<f32> = (0..length).map(|i| i as f32).collect();
            let s = AudioSpec::new(rate_out, Channels::Mono, Some(frames), None, crop, -1.0).unwrap();
            let clip = make_clip(&ramp, 1, rate_in, &s, &mut rng(seed)).unwrap();
            let resampled = resampled_length(length, rate_in as usize, rate_out as usize);
            prop_assert_eq!(clip.samples.len(), frames as usize);
            prop_assert_eq!(clip.valid_frames, (frames as usize).min(resampled));
            prop_assert!(clip.samples[clip.valid_frames..].iter().all(|&v| v == -1.0));
            if rate_in == rate_out && clip.valid_frames > 0 {
                let first = clip.samples[0] as usize;
                prop_assert!(first + clip.valid_frames <= length);
                if crop == Crop::Start { prop_assert_eq!(first, 0); }
                if crop == Crop::Center { prop_assert_eq!(first, (length - clip.valid_frames) / 2); }
                for (i, &v) in clip.samples[..clip.valid_frames].iter().enumerate() {
                    prop_assert_eq!(v as usize, first + i);
                }
            }
        }
    }
}
