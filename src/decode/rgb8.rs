//! The `rgb8` decoder: a JPEG or PNG image into a uint8 [`Array`] of shape
//! `[height, width, 3]`, like `np.asarray(PIL.Image.open(f).convert("RGB"))`.
//!
//! The format is chosen from the magic bytes (`FF D8 FF` for JPEG,
//! `89 50 4E 47 0D 0A 1A 0A` for PNG), not from the field name, and decoded
//! once its header shows that the RGB output fits 512 MiB (so a small file
//! declaring a huge image is refused before anything is allocated). A JPEG
//! is decoded by libjpeg-turbo as PIL decodes it (the same library and
//! defaults: the same pixels; CMYK turned into RGB by PIL's formula; 12-bit
//! JPEGs refused, as PIL refuses them). A PNG is decoded by the image crate
//! and converted with its `into_rgb8`: grayscale is replicated into the
//! three channels and alpha is dropped (not composited), as PIL's
//! `convert("RGB")` does for 8-bit images. 16-bit PNGs are reduced by the
//! image crate's rule, `round(v * 255 / 65535)`, which is not what PIL
//! does with 16-bit modes. EXIF orientation is not applied (PIL does not
//! apply it either unless asked).

use crate::augment::image::{decode_rgb, sniff};
use crate::value::{Array, ArrayData};

/// Decodes a JPEG or PNG image into RGB pixels.
pub(super) fn decode(bytes: &[u8]) -> Result<Array, String> {
    let format = sniff(bytes)?;
    let (width, height, pixels) = decode_rgb(bytes, format)?;
    Array::new(
        vec![height as usize, width as usize, 3],
        ArrayData::U8(pixels),
    )
    .ok_or_else(|| "the image decoder returned a wrong number of pixels".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::Decoder;
    use crate::value::Value;
    use image::codecs::png::PngEncoder;
    use image::{ExtendedColorType, ImageEncoder};

    fn png(pixels: &[u8], width: u32, height: u32, color: ExtendedColorType) -> Vec<u8> {
        let mut out = Vec::new();
        PngEncoder::new(&mut out)
            .write_image(pixels, width, height, color)
            .unwrap();
        out
    }

    fn jpeg(pixels: &[u8], width: u32, height: u32, color: ExtendedColorType) -> Vec<u8> {
        let gray = color == ExtendedColorType::L8;
        crate::augment::jpeg::encode(pixels, width, height, gray, 100).unwrap()
    }

    fn rgb8(bytes: Vec<u8>) -> (Vec<usize>, Vec<u8>) {
        match Decoder::Rgb8.decode(bytes) {
            Ok(Value::Array(Array {
                shape,
                data: ArrayData::U8(pixels),
            })) => (shape, pixels),
            other => panic!("unexpected result {other:?}"),
        }
    }

    fn rgb8_err(bytes: &[u8]) -> String {
        let error = Decoder::Rgb8.decode(bytes.to_vec()).unwrap_err();
        assert_eq!(error.decoder, "rgb8");
        error.reason
    }

    /// A deterministic test pattern, `width * height * channels` bytes.
    fn pattern(width: usize, height: usize, channels: usize) -> Vec<u8> {
        (0..width * height * channels)
            .map(|i| ((i * 37 + i / 7) % 256) as u8)
            .collect()
    }

    #[test]
    fn png_rgb_round_trips_exactly() {
        let (width, height) = (7, 5);
        let pixels = pattern(width, height, 3);
        let (shape, decoded) = rgb8(png(&pixels, 7, 5, ExtendedColorType::Rgb8));
        assert_eq!(shape, vec![height, width, 3]);
        assert_eq!(decoded, pixels);
    }

    #[test]
    fn png_gray_rgba_and_16_bit_are_converted() {
        // Grayscale: each value replicated into R, G and B.
        let gray = [0u8, 50, 100, 150, 200, 255];
        let (shape, decoded) = rgb8(png(&gray, 3, 2, ExtendedColorType::L8));
        assert_eq!(shape, vec![2, 3, 3]);
        let expected: Vec<u8> = gray.iter().flat_map(|&v| [v, v, v]).collect();
        assert_eq!(decoded, expected);

        // RGBA: alpha dropped, colour kept (not composited on black).
        let rgba = [10u8, 20, 30, 0, 40, 50, 60, 128, 70, 80, 90, 255];
        let (shape, decoded) = rgb8(png(&rgba, 1, 3, ExtendedColorType::Rgba8));
        assert_eq!(shape, vec![3, 1, 3]);
        assert_eq!(decoded, vec![10, 20, 30, 40, 50, 60, 70, 80, 90]);

        // Gray + alpha.
        let (_, decoded) = rgb8(png(&[7, 0, 9, 255], 2, 1, ExtendedColorType::La8));
        assert_eq!(decoded, vec![7, 7, 7, 9, 9, 9]);

        // 16-bit RGB: round(v * 255 / 65535), i.e. round(v / 257).
        let wide: [u16; 6] = [0, 65535, 257 * 100, 257 * 100 + 128, 257 * 100 + 129, 1000];
        let bytes: Vec<u8> = wide.iter().flat_map(|v| v.to_ne_bytes()).collect();
        let (shape, decoded) = rgb8(png(&bytes, 2, 1, ExtendedColorType::Rgb16));
        assert_eq!(shape, vec![1, 2, 3]);
        assert_eq!(decoded, vec![0, 255, 100, 100, 101, 4]);
    }

    #[test]
    fn jpeg_decodes_to_close_values() {
        let (width, height) = (16usize, 8usize);
        // Smooth gradients survive JPEG at quality 100 almost exactly.
        let pixels: Vec<u8> = (0..height)
            .flat_map(|y| (0..width).flat_map(move |x| [(x * 16) as u8, (y * 32) as u8, 128]))
            .collect();
        let (shape, decoded) = rgb8(jpeg(&pixels, 16, 8, ExtendedColorType::Rgb8));
        assert_eq!(shape, vec![height, width, 3]);
        let worst = pixels
            .iter()
            .zip(&decoded)
            .map(|(&a, &b)| a.abs_diff(b))
            .max()
            .unwrap();
        assert!(worst <= 8, "max difference {worst}");
        let mean: f64 = pixels
            .iter()
            .zip(&decoded)
            .map(|(&a, &b)| f64::from(a.abs_diff(b)))
            .sum::<f64>()
            / pixels.len() as f64;
        assert!(mean < 2.0, "mean difference {mean}");

        // Grayscale JPEG comes back as three equal channels.
        let gray: Vec<u8> = (0..64).map(|i| (i * 4) as u8).collect();
        let (shape, decoded) = rgb8(jpeg(&gray, 8, 8, ExtendedColorType::L8));
        assert_eq!(shape, vec![8, 8, 3]);
        for (pixel, &expected) in decoded.chunks(3).zip(&gray) {
            assert_eq!(pixel[0], pixel[1]);
            assert_eq!(pixel[1], pixel[2]);
            assert!(
                pixel[0].abs_diff(expected) <= 4,
                "{} vs {expected}",
                pixel[0]
            );
        }
    }

    #[test]
    fn not_an_image() {
        assert_eq!(
            rgb8_err(b"GIF89a\x01\x00\x01\x00"),
            "not a JPEG or PNG image (starts with 47 49 46 38 39 61 01 00)"
        );
        assert_eq!(
            rgb8_err(b""),
            "not a JPEG or PNG image (starts with nothing: the field is empty)"
        );
        assert_eq!(
            rgb8_err(b"\xff\xd8"),
            "not a JPEG or PNG image (starts with ff d8)"
        );
    }

    #[test]
    fn an_image_whose_rgb_output_exceeds_the_limit_is_refused_from_its_header() {
        // A 1x1 grayscale PNG whose header is rewritten to 23000x23000: its
        // 8-bit pixels (529 MB) pass the image crate's 512 MiB limit, but
        // their RGB form (1.5 GiB) must be refused before any decoding.
        let mut bytes = png(&[0], 1, 1, ExtendedColorType::L8);
        // IHDR: length (4), "IHDR" (4), width (4), height (4), ..., CRC.
        bytes[16..20].copy_from_slice(&23000u32.to_be_bytes());
        bytes[20..24].copy_from_slice(&23000u32.to_be_bytes());
        let crc = crc32fast::hash(&bytes[12..29]);
        bytes[29..33].copy_from_slice(&crc.to_be_bytes());
        assert_eq!(
            rgb8_err(&bytes),
            "image too large to decode: 23000x23000 pixels (limit 512 MiB of RGB)"
        );
        // The same header at 100x100 is a corrupt image (its pixel data
        // is missing), not a size error.
        bytes[16..20].copy_from_slice(&100u32.to_be_bytes());
        bytes[20..24].copy_from_slice(&100u32.to_be_bytes());
        let crc = crc32fast::hash(&bytes[12..29]);
        bytes[29..33].copy_from_slice(&crc.to_be_bytes());
        assert!(rgb8_err(&bytes).starts_with("corrupt PNG image"));
    }

    #[test]
    fn corrupt_images_are_errors() {
        let pixels = pattern(9, 6, 3);
        let jpeg = jpeg(&pixels, 9, 6, ExtendedColorType::Rgb8);
        let png = png(&pixels, 9, 6, ExtendedColorType::Rgb8);

        assert!(rgb8_err(&jpeg[..3]).starts_with("corrupt JPEG image"));
        // Cut inside the scan data: a lenient decoder would pad it; PIL
        // refuses it, and so do we.
        assert_eq!(
            rgb8_err(&jpeg[..jpeg.len() - 40]),
            "truncated JPEG image (no end-of-image marker after the last scan)"
        );
        assert!(rgb8_err(&jpeg[..jpeg.len() - 1]).contains("JPEG image"));
        // Bytes after the end-of-image marker are ignored, as PIL does.
        let mut trailing = jpeg.clone();
        trailing.extend_from_slice(b"trailer");
        assert_eq!(rgb8(trailing).0, vec![6, 9, 3]);
        assert!(rgb8_err(&png[..8]).starts_with("corrupt PNG image"));
        assert!(rgb8_err(&png[..png.len() / 2]).starts_with("corrupt PNG image"));

        // A PNG whose pixel data is damaged fails its checksum.
        let mut damaged = png.clone();
        let at = damaged.len() - 20;
        damaged[at] ^= 0xff;
        assert!(rgb8_err(&damaged).starts_with("corrupt PNG image"));

        // JPEG with garbage after the markers: an error, never a panic.
        let mut garbage = jpeg[..4].to_vec();
        garbage.extend(std::iter::repeat_n(0x5a, 200));
        assert!(rgb8_err(&garbage).contains("JPEG image"));

        // Every prefix of both files fails cleanly or decodes; none panics.
        for end in 0..jpeg.len() {
            let _ = Decoder::Rgb8.decode(jpeg[..end].to_vec());
        }
        for end in 0..png.len() {
            let _ = Decoder::Rgb8.decode(png[..end].to_vec());
        }
        // Flipping bytes one at a time never panics either.
        for at in 0..jpeg.len() {
            let mut flipped = jpeg.clone();
            flipped[at] ^= 0x55;
            let _ = Decoder::Rgb8.decode(flipped);
        }
    }
}
