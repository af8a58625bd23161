//! JPEG decoding for `shardstream.Image` by libjpeg-turbo (the source
//! bundled in turbojpeg-sys, linked statically), through its TurboJPEG 3
//! API: the header alone, then only a region of the image, optionally at
//! 1/2, 1/4 or 1/8 scale in the DCT domain.
//!
//! Decoding only the crop box (plus the margin the resize filter reads) is
//! what brings `Image` to 0.36x the CPU of PIL + torchvision's
//! RandomResizedCrop on 500x375 JPEGs; zune-jpeg's whole-image decode (the
//! crate's other JPEG decoder until then) gave 0.50x (docs/performance.md, "Which JPEG decoder"). Each decode has a
//! handle of its own (a reused one can keep a previous image's header).
//! The `rgb8` decoder decodes whole images here too: libjpeg-turbo is the
//! one JPEG decoder of the crate.
//!
//! Like PIL, which decodes with libjpeg(-turbo) too, a warning (corrupt
//! data the decoder recovered from, such as extraneous bytes before a
//! marker) does not fail the decode; a JPEG cut short is refused before it
//! gets here (`image::sniff`). Progressive JPEGs with more than
//! [`SCAN_LIMIT`] scans are refused, and so are JPEGs whose decode would
//! take more than [`BUFFER_LIMIT_MIB`] of intermediate buffers, as
//! libjpeg-turbo advises for untrusted input.

use std::ffi::CStr;

use turbojpeg_sys as tj;

/// The most scans a progressive JPEG may have. Encoders write about ten;
/// a crafted file with thousands makes each decode take seconds.
pub const SCAN_LIMIT: i32 = 500;

/// The most MiB of intermediate buffers a decode may take. A progressive
/// (or arithmetic-coded) JPEG keeps every coefficient of the image, two
/// bytes per component and pixel: twice the RGB output of the largest
/// image `Image` decodes (512 MiB), plus 64 MiB for the decoder's other
/// buffers and the blocks' padding, holds any YCbCr or gray image of that
/// size; a CMYK one over about 142 million pixels is refused (it would take
/// 1.1 GB of coefficients before its 4-channel output).
pub const BUFFER_LIMIT_MIB: i32 = 1088;

/// turbojpeg.h's `TJUNSCALED` (a static constant of the header, not a
/// symbol of the library): decode at full size.
const UNSCALED: tj::tjscalingfactor = tj::tjscalingfactor { num: 1, denom: 1 };

/// turbojpeg.h's `TJUNCROPPED`: decode the whole image.
const UNCROPPED: tj::tjregion = tj::tjregion {
    x: 0,
    y: 0,
    w: 0,
    h: 0,
};

/// Width in pixels of an iMCU for each TJSAMP_* chroma subsampling
/// (turbojpeg.h's `tjMCUWidth`, a static array the library does not
/// export): a cropping region's left edge must fall on a multiple of it.
const MCU_WIDTH: [u32; 7] = [8, 16, 16, 8, 8, 32, 8];

/// What the header of a JPEG says, as far as decoding needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Width in pixels.
    pub width: u32,
    /// Height in pixels.
    pub height: u32,
    /// Whether libjpeg-turbo can give this image as RGB at 1/2, 1/4 or
    /// 1/8 scale and cropped: 8-bit lossy, in YCbCr, RGB or gray, with a
    /// chroma subsampling it knows. Others (CMYK, 12-bit, lossless) are
    /// left to the whole-image decoder.
    pub partial: bool,
    /// The iMCU width (unscaled) of the image's chroma subsampling.
    mcu_width: u32,
}

impl Header {
    /// The iMCU width at `eighths`/8 scale: where a cropping region's left
    /// edge may fall.
    pub fn scaled_mcu_width(&self, eighths: u32) -> u32 {
        (self.mcu_width * eighths).div_ceil(8)
    }
}

/// A rectangle of the (scaled) image, in pixels: `x` is a multiple of the
/// scaled iMCU width.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    /// Left edge.
    pub x: u32,
    /// Top edge.
    pub y: u32,
    /// Width.
    pub w: u32,
    /// Height.
    pub h: u32,
}

/// A TurboJPEG decompression handle.
struct Decompressor {
    /// From `tj3Init`, never null; destroyed once, on drop.
    handle: tj::tjhandle,
}

impl Drop for Decompressor {
    fn drop(&mut self) {
        // SAFETY: `handle` came from `tj3Init`, is not null, and is
        // destroyed only here, once.
        unsafe { tj::tj3Destroy(self.handle) }
    }
}

/// Runs `f` with a new handle. A handle is not reused: a datastream of
/// tables only (no frame, as in garbage after the first marker) leaves
/// the header fields of the image a handle read before, which would then
/// be taken for this one's.
fn with_decompressor<T>(
    f: impl FnOnce(&mut Decompressor) -> Result<T, String>,
) -> Result<T, String> {
    f(&mut Decompressor::new()?)
}

impl Decompressor {
    /// A new handle, with the scan and buffer limits set.
    fn new() -> Result<Decompressor, String> {
        // SAFETY: `tj3Init` takes no pointers; a null result is checked.
        let handle = unsafe { tj::tj3Init(tj::TJINIT_TJINIT_DECOMPRESS as libc::c_int) };
        if handle.is_null() {
            return Err("cannot start the JPEG decoder (out of memory)".to_owned());
        }
        let mut decompressor = Decompressor { handle };
        decompressor.set(tj::TJPARAM_TJPARAM_SCANLIMIT, SCAN_LIMIT)?;
        decompressor.set(tj::TJPARAM_TJPARAM_MAXMEMORY, BUFFER_LIMIT_MIB)?;
        Ok(decompressor)
    }

    /// The handle's last error, worded for users: TurboJPEG's message
    /// without the name of the function that raised it (libjpeg-turbo's
    /// "Memory limit exceeded" said as what it means here).
    fn error(&self) -> String {
        // SAFETY: `tj3GetErrorStr` returns a NUL-terminated string owned
        // by the handle (or a thread-local one), valid until the next call
        // on it; it is copied at once.
        let message = unsafe { CStr::from_ptr(tj::tj3GetErrorStr(self.handle)) };
        let message = message.to_string_lossy();
        let message = message.split_once("(): ").map_or(&*message, |(_, m)| m);
        if message.starts_with("Memory limit exceeded") {
            return format!(
                "JPEG image too large to decode: its decode would take over \
                 {BUFFER_LIMIT_MIB} MiB of buffers (a progressive image this large)"
            );
        }
        format!("corrupt JPEG image: {}", message.replace('\n', " "))
    }

    /// `Ok` for a call that returned 0, or that returned -1 for a warning
    /// only (the decoder recovered, as PIL accepts); the error otherwise.
    fn check(&self, rc: libc::c_int) -> Result<(), String> {
        // SAFETY: `handle` is live; no pointers are passed.
        if rc == 0
            || unsafe { tj::tj3GetErrorCode(self.handle) } == tj::TJERR_TJERR_WARNING as libc::c_int
        {
            Ok(())
        } else {
            Err(self.error())
        }
    }

    /// The value of a TJPARAM_* parameter.
    fn get(&self, param: tj::TJPARAM) -> i32 {
        // SAFETY: `handle` is live; no pointers are passed.
        unsafe { tj::tj3Get(self.handle, param as libc::c_int) }
    }

    /// Sets a TJPARAM_* parameter.
    fn set(&mut self, param: tj::TJPARAM, value: i32) -> Result<(), String> {
        // SAFETY: `handle` is live; no pointers are passed.
        let rc = unsafe { tj::tj3Set(self.handle, param as libc::c_int, value) };
        self.check(rc)
    }

    /// Reads the header of `bytes` into the handle.
    fn read_header(&mut self, bytes: &[u8]) -> Result<Header, String> {
        // SAFETY: `handle` is live; the pointer and length describe the
        // live slice `bytes`, which the call only reads.
        let rc =
            unsafe { tj::tj3DecompressHeader(self.handle, bytes.as_ptr(), bytes.len() as u64) };
        self.check(rc)?;
        let dimension = |param| u32::try_from(self.get(param)).ok().filter(|&d| d > 0);
        let (Some(width), Some(height)) = (
            dimension(tj::TJPARAM_TJPARAM_JPEGWIDTH),
            dimension(tj::TJPARAM_TJPARAM_JPEGHEIGHT),
        ) else {
            return Err("corrupt JPEG image: no frame header".to_owned());
        };
        let mcu_width = usize::try_from(self.get(tj::TJPARAM_TJPARAM_SUBSAMP))
            .ok()
            .and_then(|s| MCU_WIDTH.get(s).copied());
        let colorspace = u32::try_from(self.get(tj::TJPARAM_TJPARAM_COLORSPACE));
        let partial = mcu_width.is_some()
            && self.get(tj::TJPARAM_TJPARAM_PRECISION) == 8
            && self.get(tj::TJPARAM_TJPARAM_LOSSLESS) == 0
            && colorspace.is_ok_and(|c| {
                [tj::TJCS_TJCS_YCbCr, tj::TJCS_TJCS_RGB, tj::TJCS_TJCS_GRAY].contains(&c)
            });
        Ok(Header {
            width,
            height,
            partial,
            mcu_width: mcu_width.unwrap_or(8),
        })
    }

    /// Decodes `region` of the image at `eighths`/8 scale into RGB.
    fn decode(
        &mut self,
        bytes: &[u8],
        eighths: u32,
        region: Region,
    ) -> Result<(u32, u32, Vec<u8>), String> {
        let header = self.read_header(bytes)?;
        if !header.partial {
            return Err("unsupported JPEG image for a partial decode".to_owned());
        }
        let (num, denom) = match eighths {
            1 => (1, 8),
            2 => (1, 4),
            4 => (1, 2),
            _ => (1, 1),
        };
        let factor = tj::tjscalingfactor { num, denom };
        // SAFETY: `handle` is live; the factor is passed by value.
        let rc = unsafe { tj::tj3SetScalingFactor(self.handle, factor) };
        self.check(rc)?;
        let int = |v: u32| i32::try_from(v).map_err(|_| "JPEG region too large".to_owned());
        let cropping = tj::tjregion {
            x: int(region.x)?,
            y: int(region.y)?,
            w: int(region.w)?,
            h: int(region.h)?,
        };
        // SAFETY: `handle` is live; the region is passed by value.
        let rc = unsafe { tj::tj3SetCroppingRegion(self.handle, cropping) };
        self.check(rc)?;
        let row = region.w as usize * 3;
        let mut pixels = vec![0u8; row * region.h as usize];
        // SAFETY: `handle` is live; `bytes` is a live slice of the given
        // length, only read; `pixels` is a live, writable buffer of
        // `region.h` rows of `row` bytes (the pitch passed): the RGB size
        // of the scaled region that the cropping region just set (checked
        // by the library against the scaled image) makes the call write.
        let rc = unsafe {
            tj::tj3Decompress8(
                self.handle,
                bytes.as_ptr(),
                bytes.len() as u64,
                pixels.as_mut_ptr(),
                int(region.w * 3)?,
                tj::TJPF_TJPF_RGB,
            )
        };
        self.check(rc)?;
        Ok((region.w, region.h, pixels))
    }

    /// Decodes the whole image into RGB: 8-bit images of any color space
    /// (CMYK and YCCK ones through [`cmyk_to_rgb`], as PIL turns them into
    /// RGB), lossy or lossless.
    fn decode_whole(&mut self, bytes: &[u8]) -> Result<(u32, u32, Vec<u8>), String> {
        let header = self.read_header(bytes)?;
        let precision = self.get(tj::TJPARAM_TJPARAM_PRECISION);
        if precision != 8 {
            return Err(format!(
                "unsupported JPEG image: {precision}-bit samples (8-bit JPEGs are read)"
            ));
        }
        let colorspace = u32::try_from(self.get(tj::TJPARAM_TJPARAM_COLORSPACE));
        let cmyk = colorspace.is_ok_and(|c| [tj::TJCS_TJCS_CMYK, tj::TJCS_TJCS_YCCK].contains(&c));
        // A handle that decoded a region before is set back to the whole
        // image at full scale.
        // SAFETY: `handle` is live; the factor and region are passed by value.
        let rc = unsafe { tj::tj3SetScalingFactor(self.handle, UNSCALED) };
        self.check(rc)?;
        // SAFETY: as above.
        let rc = unsafe { tj::tj3SetCroppingRegion(self.handle, UNCROPPED) };
        self.check(rc)?;
        let (format, channels) = if cmyk {
            (tj::TJPF_TJPF_CMYK, 4)
        } else {
            (tj::TJPF_TJPF_RGB, 3)
        };
        let (width, height) = (header.width, header.height);
        let row = width as usize * channels;
        let pitch = i32::try_from(row).map_err(|_| "JPEG image too wide".to_owned())?;
        let mut pixels = vec![0u8; row * height as usize];
        // SAFETY: `handle` is live; `bytes` is a live slice of the given
        // length, only read; `pixels` is a live, writable buffer of
        // `height` rows of `row` bytes (the pitch passed), the size of the
        // unscaled, uncropped image in `format` that the header read
        // above gives.
        let rc = unsafe {
            tj::tj3Decompress8(
                self.handle,
                bytes.as_ptr(),
                bytes.len() as u64,
                pixels.as_mut_ptr(),
                pitch,
                format as libc::c_int,
            )
        };
        self.check(rc)?;
        if cmyk {
            pixels = cmyk_to_rgb(&pixels);
        }
        Ok((width, height, pixels))
    }
}

/// CMYK pixels as libjpeg gives them from a JPEG (stored inverted, as
/// Adobe's encoders and PIL write them) turned into RGB as PIL turns them:
/// each channel `(255 - k) - c * (255 - k) / 255` of the inverted values,
/// the division rounded as PIL's `MULDIV255`.
fn cmyk_to_rgb(cmyk: &[u8]) -> Vec<u8> {
    let muldiv255 = |a: u32, b: u32| {
        let t = a * b + 128;
        ((t >> 8) + t) >> 8
    };
    let mut rgb = Vec::with_capacity(cmyk.len() / 4 * 3);
    for pixel in cmyk.chunks_exact(4) {
        let [c, m, y, k] = [0, 1, 2, 3].map(|i| 255 - u32::from(pixel[i]));
        let nk = 255 - k;
        for v in [c, m, y] {
            rgb.push((nk - muldiv255(v, nk)) as u8);
        }
    }
    rgb
}

/// The header of the JPEG `bytes`.
pub fn header(bytes: &[u8]) -> Result<Header, String> {
    with_decompressor(|d| d.read_header(bytes))
}

/// The whole JPEG `bytes` as RGB `(width, height, pixels)`: any 8-bit
/// JPEG (CMYK ones turned into RGB as PIL does); the caller has checked
/// from its header that the pixels fit.
pub fn decode_whole(bytes: &[u8]) -> Result<(u32, u32, Vec<u8>), String> {
    with_decompressor(|d| d.decode_whole(bytes))
}

/// `region` of the JPEG `bytes` at `eighths`/8 scale (8, 4, 2 or 1), as
/// RGB `(width, height, pixels)`. `region` lies within the scaled image
/// and its left edge on a multiple of [`Header::scaled_mcu_width`]; the
/// image must be one whose [`Header::partial`] is true.
pub fn decode_region(
    bytes: &[u8],
    eighths: u32,
    region: Region,
) -> Result<(u32, u32, Vec<u8>), String> {
    with_decompressor(|d| d.decode(bytes, eighths, region))
}

/// `pixels` (`width` x `height`, RGB, or gray when `gray`) encoded as a
/// JPEG of `quality` (1 to 100) by libjpeg-turbo, without chroma
/// subsampling (4:4:4): the JPEGs the tests and benchmarks decode.
pub fn encode(
    pixels: &[u8],
    width: u32,
    height: u32,
    gray: bool,
    quality: i32,
) -> Result<Vec<u8>, String> {
    let channels: u32 = if gray { 1 } else { 3 };
    let int = |v: u32| i32::try_from(v).map_err(|_| "image too large to encode".to_owned());
    let (w, h, pitch) = (
        int(width)?,
        int(height)?,
        int(width.saturating_mul(channels))?,
    );
    if width == 0
        || height == 0
        || pixels.len() as u64 != u64::from(width * channels) * u64::from(height)
    {
        return Err(format!(
            "{} bytes are not a {width}x{height} image of {channels} channels",
            pixels.len()
        ));
    }
    let (format, subsampling) = if gray {
        (tj::TJPF_TJPF_GRAY, tj::TJSAMP_TJSAMP_GRAY)
    } else {
        (tj::TJPF_TJPF_RGB, tj::TJSAMP_TJSAMP_444)
    };
    // SAFETY: `tj3Init` takes no pointers; a null result is checked.
    let handle = unsafe { tj::tj3Init(tj::TJINIT_TJINIT_COMPRESS as libc::c_int) };
    if handle.is_null() {
        return Err("cannot start the JPEG encoder (out of memory)".to_owned());
    }
    let (mut out, mut size): (*mut libc::c_uchar, tj::size_t) = (std::ptr::null_mut(), 0);
    // SAFETY: `handle` is live until destroyed below; `pixels` is a live
    // slice of `height` rows of `pitch` bytes (checked above), only read;
    // `out` and `size` receive a buffer the library allocates.
    let rc = unsafe {
        let set = |param: tj::TJPARAM, value: i32| tj::tj3Set(handle, param as libc::c_int, value);
        if set(tj::TJPARAM_TJPARAM_QUALITY, quality) != 0
            || set(tj::TJPARAM_TJPARAM_SUBSAMP, subsampling) != 0
        {
            -1
        } else {
            tj::tj3Compress8(
                handle,
                pixels.as_ptr(),
                w,
                pitch,
                h,
                format as libc::c_int,
                &mut out,
                &mut size,
            )
        }
    };
    let encoded = if rc == 0 && !out.is_null() {
        // SAFETY: on success `out` holds `size` bytes the library wrote.
        Ok(unsafe { std::slice::from_raw_parts(out, size as usize) }.to_vec())
    } else {
        Err(format!("cannot encode the JPEG (quality {quality})"))
    };
    // SAFETY: `out` is null or the library's buffer, freed once; `handle`
    // is live and destroyed once.
    unsafe {
        tj::tj3Free(out.cast());
        tj::tj3Destroy(handle);
    }
    encoded
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Whether a test image is RGB or gray.
    #[derive(Clone, Copy, PartialEq)]
    enum Color {
        Rgb,
        Gray,
    }

    /// A `width` x `height` JPEG of a smooth pattern with edges, 4:4:4.
    fn jpeg(width: u32, height: u32, color: Color) -> Vec<u8> {
        let channels = if color == Color::Gray { 1 } else { 3 };
        let mut pixels = Vec::new();
        for y in 0..height {
            for x in 0..width {
                let v = [
                    (x * 7 + y * 3) % 256,
                    (x * y) % 256,
                    (255 - x % 256 + y) % 256,
                ];
                pixels.extend(v.iter().take(channels).map(|&c| c as u8));
            }
        }
        encode(&pixels, width, height, color == Color::Gray, 90).unwrap()
    }

    fn whole(bytes: &[u8], eighths: u32) -> (u32, u32, Vec<u8>) {
        let h = header(bytes).unwrap();
        let (w, hh) = (
            (h.width * eighths).div_ceil(8),
            (h.height * eighths).div_ceil(8),
        );
        decode_region(
            bytes,
            eighths,
            Region {
                x: 0,
                y: 0,
                w,
                h: hh,
            },
        )
        .unwrap()
    }

    #[test]
    fn the_header_gives_the_size_and_whether_a_partial_decode_is_possible() {
        let h = header(&jpeg(100, 60, Color::Rgb)).unwrap();
        assert_eq!((h.width, h.height, h.partial), (100, 60, true));
        let gray = header(&jpeg(33, 17, Color::Gray)).unwrap();
        assert_eq!((gray.width, gray.height, gray.partial), (33, 17, true));
        assert_eq!(gray.scaled_mcu_width(8), 8);
    }

    #[test]
    fn a_gray_jpeg_comes_out_as_rgb_with_equal_channels() {
        let (w, h, pixels) = whole(&jpeg(33, 17, Color::Gray), 8);
        assert_eq!((w, h, pixels.len()), (33, 17, 33 * 17 * 3));
        assert!(pixels.chunks_exact(3).all(|p| p[0] == p[1] && p[1] == p[2]));
        assert!(pixels.iter().any(|&v| v != pixels[0]));
    }

    #[test]
    fn scaled_decodes_have_the_scaled_size() {
        let bytes = jpeg(101, 67, Color::Rgb);
        for (eighths, size) in [(4, (51, 34)), (2, (26, 17)), (1, (13, 9))] {
            let (w, h, pixels) = whole(&bytes, eighths);
            assert_eq!((w, h), size, "at {eighths}/8");
            assert_eq!(pixels.len(), (w * h * 3) as usize);
        }
    }

    #[test]
    fn garbage_and_bad_regions_are_errors_not_crashes() {
        let err = header(b"\xff\xd8\xff\xe0 not a jpeg").unwrap_err();
        assert!(err.starts_with("corrupt JPEG image: "), "{err}");
        assert!(!err.contains("tj3"), "{err}");
        let bytes = jpeg(64, 48, Color::Rgb);
        let outside = Region {
            x: 0,
            y: 0,
            w: 65,
            h: 48,
        };
        assert!(decode_region(&bytes, 8, outside).is_err());
        let unaligned = Region {
            x: 3,
            y: 0,
            w: 8,
            h: 8,
        };
        let err = decode_region(&bytes, 8, unaligned).unwrap_err();
        assert!(err.contains("not divisible"), "{err}");
        // Decoding still works after errors.
        assert_eq!(whole(&bytes, 8).0, 64);
    }

    /// A JPEG that is garbage after its first marker (tables only, no
    /// frame) does not take the size of the image decoded before it (as it
    /// did through a reused handle): it is an error, for a region and a
    /// whole decode alike.
    #[test]
    fn a_jpeg_without_a_frame_does_not_take_the_previous_images_size() {
        let good = jpeg(40, 24, Color::Rgb);
        let mut garbage = good[..4].to_vec();
        garbage.extend(std::iter::repeat_n(0x5a, 200));
        for _ in 0..2 {
            assert_eq!(header(&good).unwrap().width, 40);
            assert!(header(&garbage).is_err());
            assert_eq!(whole(&good, 8).0, 40);
            assert!(decode_whole(&garbage).is_err());
            let region = Region {
                x: 0,
                y: 0,
                w: 8,
                h: 8,
            };
            assert!(decode_region(&garbage, 8, region).is_err());
        }
    }

    /// A progressive CMYK JPEG of `side` x `side` pixels: its markers
    /// (Adobe's, for CMYK; quantization and DC Huffman tables; the frame;
    /// a first DC scan) and a few bytes of that scan, the rest of the data
    /// missing (which libjpeg-turbo recovers from with a warning).
    fn progressive_cmyk(side: u16) -> Vec<u8> {
        let mut bytes = vec![0xff, 0xd8];
        let mut segment = |marker: u8, body: &[u8]| {
            bytes.extend([0xff, marker]);
            bytes.extend(u16::try_from(body.len() + 2).unwrap().to_be_bytes());
            bytes.extend(body);
        };
        segment(0xee, b"Adobe\x00\x64\x00\x00\x00\x00\x00");
        segment(0xdb, &[&[0u8][..], &[1; 64]].concat());
        let [hi, lo] = side.to_be_bytes();
        let components = (1..=4u8).flat_map(|id| [id, 0x11, 0]);
        segment(
            0xc2,
            &[8, hi, lo, hi, lo, 4]
                .into_iter()
                .chain(components)
                .collect::<Vec<_>>(),
        );
        segment(0xc4, &[&[0x00, 1][..], &[0; 15], &[0]].concat());
        let scan = (1..=4u8).flat_map(|id| [id, 0x00]);
        segment(
            0xda,
            &[4].into_iter()
                .chain(scan)
                .chain([0, 0, 0])
                .collect::<Vec<_>>(),
        );
        bytes.extend([0; 16]);
        bytes.extend([0xff, 0xd9]);
        bytes
    }

    /// A progressive CMYK JPEG of 12,500 x 12,500 pixels (469 MB of RGB,
    /// within `Image`'s limit) would take 1.25 GB of coefficients: it is
    /// refused before they are allocated. The same file at 64 x 64 decodes.
    #[test]
    fn a_progressive_jpeg_whose_buffers_exceed_the_limit_is_refused() {
        let (w, h, pixels) = decode_whole(&progressive_cmyk(64)).unwrap();
        assert_eq!((w, h, pixels.len()), (64, 64, 64 * 64 * 3));
        // Not `unwrap_err`: a decode that passed would print its 469 MB.
        let Err(err) = decode_whole(&progressive_cmyk(12_500)) else {
            panic!("the decode was not refused");
        };
        assert!(err.starts_with("JPEG image too large to decode"), "{err}");
        assert!(err.contains("1088 MiB"), "{err}");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        /// A region decoded alone has exactly the pixels of the same
        /// region of the whole decode, at every scale.
        #[test]
        fn a_region_has_the_pixels_of_the_whole_decode(
            eighths in prop::sample::select(vec![1u32, 2, 4, 8]),
            fx in 0.0f64..1.0, fy in 0.0f64..1.0, fw in 0.0f64..1.0, fh in 0.0f64..1.0,
        ) {
            let bytes = jpeg(160, 120, Color::Rgb);
            let (sw, sh, full) = whole(&bytes, eighths);
            let mcu = header(&bytes).unwrap().scaled_mcu_width(eighths);
            let x = ((fx * f64::from(sw)) as u32).min(sw - 1) / mcu * mcu;
            let y = ((fy * f64::from(sh)) as u32).min(sh - 1);
            let w = 1 + (fw * f64::from(sw - x - 1)) as u32;
            let h = 1 + (fh * f64::from(sh - y - 1)) as u32;
            let (rw, rh, part) = decode_region(&bytes, eighths, Region { x, y, w, h }).unwrap();
            prop_assert_eq!((rw, rh), (w, h));
            for row in 0..h {
                let a = (row * w * 3) as usize;
                let b = (((y + row) * sw + x) * 3) as usize;
                let n = (w * 3) as usize;
                prop_assert!(part[a..a + n] == full[b..b + n],
                    "row {} of region {:?} at {}/8 differs", row, (x, y, w, h), eighths);
            }
        }
    }
}
