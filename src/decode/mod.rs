//! Field decoders: bytes in, typed values out, no I/O.
//!
//! A [`Decoder`] turns the raw bytes of one sample field into a [`Value`].
//! Every decoder is a pure function of the bytes: no I/O, no Python, no
//! global state, and malformed input is reported as a [`DecodeError`]
//! (never a panic). The caller adds the shard URL, sample key and field
//! name to the error.
//!
//! [`default_for`] picks the decoder a field gets when the user does not
//! name one, from the field name's last extension (`"seg.png"` → `png`).

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use bytes::Bytes;

use crate::augment::audio::AudioSpec;
use crate::augment::image::ImageSpec;
use crate::augment::SampleContext;
use crate::json;
use crate::text::tokenizer::TokenizerSpec;
use crate::value::{Array, ArrayData, Value};

mod audio;
mod npy;
mod rgb8;

/// A per-field decoder: a plain decoder, named by [`Decoder::name`] and
/// parsed by [`FromStr`] from that same name, or a transform with
/// parameters (built from its Python object, never from a name).
#[derive(Debug, Clone, PartialEq)]
pub enum Decoder {
    /// `"bytes"`: the bytes unchanged, as [`Value::Bytes`].
    Bytes,
    /// `"str"`: UTF-8 text, as [`Value::Str`] (like Python's
    /// `b.decode("utf-8")`; a byte-order mark is kept).
    Str,
    /// `"int"`: an ASCII decimal integer with surrounding whitespace
    /// trimmed, as [`Value::Int`] (like Python's `int(b.decode().strip())`,
    /// limited to `i64`).
    Int,
    /// `"json"`: a JSON document, as the [`Value`] Python's `json.loads`
    /// would give, type for type: objects are [`Value::Map`] in document
    /// order (a repeated key keeps its first position and last value),
    /// integers are [`Value::Int`] or, beyond `i64`, [`Value::UInt`], other
    /// numbers are correctly rounded [`Value::Float`]s. Where `json.loads`
    /// would succeed but [`Value`] or serde_json cannot follow, this is an
    /// error: integers beyond 64 bits, `NaN`/`Infinity`, numbers beyond
    /// the float range, unpaired surrogate escapes, nesting deeper than 128.
    Json,
    /// `"numpy"`: a `.npy` file (format 1.0, 2.0 or 3.0) of a boolean,
    /// integer or float32/float64 array, as [`Value::Array`] in C order.
    Numpy,
    /// `"audio"`: a WAV file (integer PCM of 8, 16, 24 or 32 bits, or
    /// 32-bit float), as `Value::Tuple([samples, sample_rate])` where
    /// `samples` is a float32 array of shape `[frames, channels]` (what
    /// `soundfile.read(f, dtype="float32", always_2d=True)` gives).
    ///
    /// Scaling: an integer sample `x` of `b` bits becomes `x / 2^(b-1)`,
    /// in `[-1, 1)` (16-bit `-32768` is `-1.0`, `32767` is `32767/32768`).
    /// 8-bit WAV samples are stored unsigned with silence at 128; they are
    /// first shifted to `-128..=127` (hound does this), then scaled the same
    /// way. Float samples are returned unchanged, not clipped.
    Audio,
    /// `"rgb8"`: a JPEG or PNG image (told apart by magic bytes), as a
    /// uint8 array of shape `[height, width, 3]`, like
    /// `np.asarray(PIL.Image.open(f).convert("RGB"))` for 8-bit images:
    /// gray is replicated into the three channels, alpha is dropped. 16-bit
    /// PNGs are reduced by the image crate's rule, `round(v * 255 / 65535)`,
    /// which differs from PIL's handling of 16-bit modes. A JPEG truncated
    /// before its end-of-image marker is an error, as in PIL.
    Rgb8,
    /// `shardstream.Image(...)`: a JPEG or PNG decoded, cropped, resized
    /// and flipped to a uint8 array of one shape (see
    /// [`crate::augment::image`]); its random draws come from the sample's
    /// own stream ([`SampleContext::rng`]).
    Image(Arc<ImageSpec>),
    /// `shardstream.ImageBoxes(Image(...))`: a JPEG left as it is, with
    /// what [`Decoder::Image`] would crop and flip, from the header and
    /// the same draws ([`ImageSpec::source_box`]), for a batched decoder
    /// elsewhere (a GPU). Gives `Value::Tuple([bytes, box])`, `box` a
    /// float32 `[x, y, width, height, flip]`; the decode stage puts the box
    /// in its own field, [`Decoder::companion_field`].
    ImageBoxes(Arc<ImageSpec>),
    /// `shardstream.AudioClip(...)`: a WAV or FLAC file mixed to mono or
    /// picked channels, resampled, cropped and padded to a float32 clip of
    /// one shape (see [`crate::augment::audio`]); a random crop draws from
    /// the sample's own stream ([`SampleContext::rng`]). Gives
    /// `Value::Tuple([clip, Value::Int(real_frames)])`; the decode stage
    /// puts the real frame count in its own field,
    /// [`Decoder::companion_field`].
    AudioClip(Arc<AudioSpec>),
    /// `shardstream.Tokenizer(...)`: UTF-8 text (a text value, or bytes)
    /// to its token ids, an int32 array (see [`crate::text::tokenizer`]).
    Tokenizer(Arc<TokenizerSpec>),
}

impl Decoder {
    /// Every plain decoder, in the order their names are listed in errors.
    pub const ALL: [Decoder; 7] = [
        Decoder::Bytes,
        Decoder::Str,
        Decoder::Int,
        Decoder::Json,
        Decoder::Numpy,
        Decoder::Audio,
        Decoder::Rgb8,
    ];

    /// The decoder's name, as accepted by [`FromStr`] and shown in errors.
    pub fn name(&self) -> &'static str {
        match self {
            Decoder::Bytes => "bytes",
            Decoder::Str => "str",
            Decoder::Int => "int",
            Decoder::Json => "json",
            Decoder::Numpy => "numpy",
            Decoder::Audio => "audio",
            Decoder::Rgb8 => "rgb8",
            Decoder::Image(_) => "Image",
            Decoder::ImageBoxes(_) => "ImageBoxes",
            Decoder::AudioClip(_) => "AudioClip",
            Decoder::Tokenizer(_) => "Tokenizer",
        }
    }

    /// The decoder with its parameters, as the state's fingerprint takes
    /// it: the name of a plain decoder, a transform as Python would build
    /// it (`Image(size=(224, 224), ...)`).
    pub fn describe(&self) -> String {
        match self {
            Decoder::Image(spec) => spec.to_string(),
            Decoder::ImageBoxes(spec) => format!("ImageBoxes({spec})"),
            Decoder::AudioClip(spec) => spec.to_string(),
            Decoder::Tokenizer(spec) => spec.to_string(),
            plain => plain.name().to_owned(),
        }
    }

    /// The field a decoder adds beside `field`, if any: `<field>_frames`,
    /// the real (unpadded) frames of an [`Decoder::AudioClip`], or
    /// `<field>_box` of an [`Decoder::ImageBoxes`], which then gives
    /// `Value::Tuple([value, companion])` for the two fields.
    pub fn companion_field(&self, field: &str) -> Option<String> {
        match self {
            Decoder::AudioClip(_) => Some(format!("{field}_frames")),
            Decoder::ImageBoxes(_) => Some(format!("{field}_box")),
            _ => None,
        }
    }

    /// Decodes one field's bytes as the field of the first sample of the
    /// first shard in epoch 0 of seed 0 (what a transform draws does not
    /// matter, or the caller has no sample): [`Decoder::decode_field`].
    pub fn decode(&self, bytes: impl Into<Bytes>) -> Result<Value, DecodeError> {
        self.decode_field(bytes, &SampleContext::default(), "")
    }

    /// Decodes the bytes of field `field` of the sample `context` names;
    /// a transform draws from that field's stream ([`SampleContext::rng`]).
    ///
    /// Takes ownership so that [`Decoder::Bytes`] keeps the shared bytes
    /// and [`Decoder::Str`] (and `uint8` `.npy` arrays) reuse the buffer
    /// when it is not shared, instead of copying it.
    pub fn decode_field(
        &self,
        bytes: impl Into<Bytes>,
        context: &SampleContext,
        field: &str,
    ) -> Result<Value, DecodeError> {
        let bytes: Bytes = bytes.into();
        let name = self.name();
        let fail = |reason: String| DecodeError {
            decoder: name,
            reason,
        };
        // A panic in a third-party decoder is a decode error, not a dead
        // pipeline thread.
        crate::error::guard(|| match self {
            Decoder::Bytes => Ok(Value::Bytes(bytes)),
            Decoder::Str => decode_str(bytes.into()).map(Value::Str),
            Decoder::Int => decode_int(&bytes).map(Value::Int),
            Decoder::Json => json::decode(&bytes),
            Decoder::Numpy => npy::decode(bytes.into()).map(Value::Array),
            Decoder::Audio => audio::decode(&bytes),
            Decoder::Rgb8 => rgb8::decode(&bytes).map(Value::Array),
            Decoder::Image(spec) => spec
                .apply(&bytes, &mut context.rng(field))
                .map(Value::Array),
            Decoder::ImageBoxes(spec) => {
                spec.source_box(&bytes, &mut context.rng(field))
                    .map(|found| {
                        let source_box = Value::Array(Array {
                            shape: vec![found.len()],
                            data: ArrayData::F32(found.to_vec()),
                        });
                        Value::Tuple(vec![Value::Bytes(bytes), source_box])
                    })
            }
            Decoder::AudioClip(spec) => audio::clip(&bytes, spec, &mut context.rng(field))
                .map(|(clip, frames)| Value::Tuple(vec![clip, Value::Int(frames)])),
            Decoder::Tokenizer(spec) => tokenize(&bytes, spec),
        })
        .map_err(fail)
    }
}

impl fmt::Display for Decoder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Decoder {
    type Err = UnknownDecoder;

    /// Parses a decoder name (exact, lower case: `"bytes"`, `"str"`,
    /// `"int"`, `"json"`, `"numpy"`, `"audio"`, `"rgb8"`).
    fn from_str(name: &str) -> Result<Self, Self::Err> {
        Decoder::ALL
            .into_iter()
            .find(|decoder| decoder.name() == name)
            .ok_or_else(|| UnknownDecoder {
                name: name.to_owned(),
            })
    }
}

/// A decoder name that [`Decoder::from_str`] does not know; its message
/// lists the valid names.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown decoder {name:?} (expected one of: {})", valid_names())]
pub struct UnknownDecoder {
    /// The name that was given.
    pub name: String,
}

fn valid_names() -> String {
    Decoder::ALL.map(|decoder| decoder.name()).join(", ")
}

/// The decoder a field gets by default, from the last dot-separated part
/// of its name, compared case-insensitively:
///
/// | extension              | decoder            |
/// |------------------------|--------------------|
/// | `json`                 | [`Decoder::Json`]  |
/// | `txt`, `text`          | [`Decoder::Str`]   |
/// | `cls`, `cls2`, `index` | [`Decoder::Int`]   |
/// | `npy`                  | [`Decoder::Numpy`] |
/// | `wav`, `flac`          | [`Decoder::Audio`] |
/// | `jpg`, `jpeg`, `png`   | [`Decoder::Rgb8`]  |
///
/// Anything else gives `None`: the field is left as bytes.
pub fn default_for(field: &str) -> Option<Decoder> {
    let extension = field
        .rsplit('.')
        .next()
        .unwrap_or(field)
        .to_ascii_lowercase();
    match extension.as_str() {
        "json" => Some(Decoder::Json),
        "txt" | "text" => Some(Decoder::Str),
        "cls" | "cls2" | "index" => Some(Decoder::Int),
        "npy" => Some(Decoder::Numpy),
        "wav" | "flac" => Some(Decoder::Audio),
        "jpg" | "jpeg" | "png" => Some(Decoder::Rgb8),
        _ => None,
    }
}

/// A field whose bytes the decoder could not decode. Displays as
/// `"<decoder>: <reason>"`, e.g. `"audio: not a WAV file (no RIFF header)"`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{decoder}: {reason}")]
pub struct DecodeError {
    /// Name of the decoder that failed ([`Decoder::name`]).
    pub decoder: &'static str,
    /// What was wrong with the bytes.
    pub reason: String,
}

/// The token ids of UTF-8 text, as an int32 array.
fn tokenize(bytes: &[u8], spec: &TokenizerSpec) -> Result<Value, String> {
    let text = std::str::from_utf8(bytes).map_err(|e| {
        format!(
            "not UTF-8 text (invalid byte at offset {})",
            e.valid_up_to()
        )
    })?;
    let ids = spec.encode(text)?;
    Ok(Value::Array(Array {
        shape: vec![ids.len()],
        data: ArrayData::I32(ids),
    }))
}

/// UTF-8 text; the error names the first offending byte.
fn decode_str(bytes: Vec<u8>) -> Result<String, String> {
    String::from_utf8(bytes).map_err(|e| {
        let at = e.utf8_error().valid_up_to();
        let byte = e.as_bytes()[at];
        format!("invalid UTF-8 at byte {at} (0x{byte:02x})")
    })
}

/// Whitespace as Python's `str.strip()` sees it: Unicode `White_Space`
/// plus the ASCII separators U+001C..U+001F.
fn is_python_whitespace(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Python's `int(b.decode().strip())` for ASCII digits, limited to `i64`:
/// an optional sign, then decimal digits, with single underscores allowed
/// between digits (`"1_000"`), as Python allows.
fn decode_int(bytes: &[u8]) -> Result<i64, String> {
    let text = std::str::from_utf8(bytes).map_err(|e| {
        let at = e.valid_up_to();
        format!("invalid UTF-8 at byte {at} (0x{:02x})", bytes[at])
    })?;
    let trimmed = text.trim_matches(is_python_whitespace);
    let invalid = || format!("not an integer: {:?}", truncate(text, 40));
    let (negative, digits) = match trimmed.as_bytes().first() {
        Some(b'-') => (true, &trimmed[1..]),
        Some(b'+') => (false, &trimmed[1..]),
        _ => (false, trimmed),
    };
    let bytes = digits.as_bytes();
    let well_formed = !bytes.is_empty()
        && bytes.first().is_some_and(u8::is_ascii_digit)
        && bytes.last().is_some_and(u8::is_ascii_digit)
        && bytes.iter().all(|b| b.is_ascii_digit() || *b == b'_')
        && !digits.contains("__");
    if !well_formed {
        return Err(invalid());
    }
    // Accumulate negatively so that i64::MIN parses.
    let mut value: i64 = 0;
    for digit in bytes.iter().filter(|b| b.is_ascii_digit()) {
        let digit = i64::from(digit - b'0');
        value = value
            .checked_mul(10)
            .and_then(|v| v.checked_sub(digit))
            .ok_or_else(|| format!("integer {trimmed} does not fit in 64 bits"))?;
    }
    if negative {
        Ok(value)
    } else {
        value
            .checked_neg()
            .ok_or_else(|| format!("integer {trimmed} does not fit in 64 bits"))
    }
}

/// At most `max` characters of `text`, with `...` when cut.
fn truncate(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((at, _)) => format!("{}...", &text[..at]),
        None => text.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn err(decoder: Decoder, bytes: &[u8]) -> DecodeError {
        decoder
            .decode(bytes.to_vec())
            .expect_err("decoding should fail")
    }

    #[test]
    fn names_round_trip_and_unknown_lists_valid_names() {
        for decoder in Decoder::ALL {
            assert_eq!(decoder.name().parse::<Decoder>(), Ok(decoder.clone()));
            assert_eq!(decoder.to_string(), decoder.name());
        }
        let unknown = "png".parse::<Decoder>().unwrap_err();
        assert_eq!(unknown.name, "png");
        assert_eq!(
            unknown.to_string(),
            "unknown decoder \"png\" (expected one of: bytes, str, int, json, numpy, audio, rgb8)"
        );
        assert!("Json".parse::<Decoder>().is_err());
        assert!("".parse::<Decoder>().is_err());
    }

    #[test]
    fn defaults_follow_the_last_extension() {
        let cases = [
            ("json", Some(Decoder::Json)),
            ("meta.JSON", Some(Decoder::Json)),
            ("txt", Some(Decoder::Str)),
            ("caption.text", Some(Decoder::Str)),
            ("cls", Some(Decoder::Int)),
            ("cls2", Some(Decoder::Int)),
            ("index", Some(Decoder::Int)),
            ("npy", Some(Decoder::Numpy)),
            ("depth.npy", Some(Decoder::Numpy)),
            ("wav", Some(Decoder::Audio)),
            ("flac", Some(Decoder::Audio)),
            ("take.FLAC", Some(Decoder::Audio)),
            ("jpg", Some(Decoder::Rgb8)),
            ("JPEG", Some(Decoder::Rgb8)),
            ("seg.png", Some(Decoder::Rgb8)),
            ("png.txt", Some(Decoder::Str)),
            ("json.gz", None),
            ("id", None),
            ("label", None),
            ("mp4", None),
            ("", None),
            ("jpg.", None),
        ];
        for (field, expected) in cases {
            assert_eq!(default_for(field), expected, "field {field:?}");
        }
    }

    #[test]
    fn bytes_are_unchanged() {
        let bytes = vec![0, 159, 146, 150, 255];
        assert_eq!(
            Decoder::Bytes.decode(bytes.clone()),
            Ok(Value::Bytes(bytes.into()))
        );
    }

    #[test]
    fn str_decodes_utf8_and_reports_the_bad_byte() {
        assert_eq!(
            Decoder::Str.decode("héllo, 世界 🎉".as_bytes().to_vec()),
            Ok(Value::Str("héllo, 世界 🎉".into()))
        );
        assert_eq!(Decoder::Str.decode(vec![]), Ok(Value::Str(String::new())));
        let error = err(Decoder::Str, b"ab\xffcd");
        assert_eq!(error.decoder, "str");
        assert_eq!(error.to_string(), "str: invalid UTF-8 at byte 2 (0xff)");
        // A truncated multi-byte sequence at the end.
        let error = err(Decoder::Str, "abé".as_bytes().split_last().unwrap().1);
        assert_eq!(error.reason, "invalid UTF-8 at byte 2 (0xc3)");
    }

    #[test]
    fn int_accepts_what_python_int_accepts() {
        let cases: [(&[u8], i64); 10] = [
            (b"7", 7),
            (b"  42\n", 42),
            (b"\t-13 \r\n", -13),
            (b"+5", 5),
            (b"007", 7),
            (b"1_000", 1000),
            (b"-0", 0),
            (b"9223372036854775807", i64::MAX),
            (b"-9223372036854775808", i64::MIN),
            ("\u{a0}3\u{2003}".as_bytes(), 3),
        ];
        for (bytes, expected) in cases {
            assert_eq!(
                Decoder::Int.decode(bytes.to_vec()),
                Ok(Value::Int(expected)),
                "input {:?}",
                String::from_utf8_lossy(bytes)
            );
        }
    }

    #[test]
    fn int_rejects_everything_else() {
        let cases: [&[u8]; 16] = [
            b"",
            b"   ",
            b"cat",
            b"1.5",
            b"1e3",
            b"0x10",
            b"- 5",
            b"--5",
            b"+",
            b"1__0",
            b"_1",
            b"1_",
            b"1 2",
            b"\xff1",
            b"9223372036854775808",
            b"-9223372036854775809",
        ];
        for bytes in cases {
            let error = err(Decoder::Int, bytes);
            assert_eq!(error.decoder, "int");
        }
        assert_eq!(
            err(Decoder::Int, b" dog\n").to_string(),
            "int: not an integer: \" dog\\n\""
        );
        assert_eq!(
            err(Decoder::Int, b"99999999999999999999").reason,
            "integer 99999999999999999999 does not fit in 64 bits"
        );
        assert_eq!(
            err(Decoder::Int, b"1\xff").reason,
            "invalid UTF-8 at byte 1 (0xff)"
        );
    }

    proptest! {
        #[test]
        fn int_round_trips(value: i64, before in "[ \t\r\n]{0,3}", after in "[ \t\r\n]{0,3}", plus: bool) {
            let sign = if plus && value >= 0 { "+" } else { "" };
            let text = format!("{before}{sign}{value}{after}");
            prop_assert_eq!(Decoder::Int.decode(text.into_bytes()), Ok(Value::Int(value)));
        }

        #[test]
        fn no_decoder_panics_on_garbage(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            for decoder in Decoder::ALL {
                let _ = decoder.decode(bytes.clone());
            }
            let image = ImageSpec::new(Some((8, 8)), Some("random_resized"), None, None, None, Some(0.5), None);
            let clip = AudioSpec::new(
                8000,
                crate::augment::audio::Channels::Mono,
                Some(64),
                None,
                crate::augment::audio::Crop::Random,
                0.0,
            );
            for decoder in [
                Decoder::Image(Arc::new(image.unwrap())),
                Decoder::AudioClip(Arc::new(clip.unwrap())),
            ] {
                let _ = decoder.decode(bytes.clone());
            }
        }
    }
}
