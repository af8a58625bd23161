//! The image transform (`shardstream.Image`): a JPEG or PNG decoded,
//! cropped, resized and flipped in one pass, to a uint8 array of one fixed
//! shape, `[3, H, W]` or `[H, W, 3]`.
//!
//! The crops follow torchvision's transforms of the same names:
//! `random_resized` is `RandomResizedCrop(size, scale, ratio)` (ten tries
//! at a box of random area and aspect ratio, then the centre fallback),
//! `center` is `Resize(resize)` then `CenterCrop(size)`, `resize` is
//! `Resize((h, w))`; the flip is `RandomHorizontalFlip(p=flip)`. The box is
//! resampled straight to the output size with an antialiased bilinear
//! filter (Pillow's algorithm, as torchvision uses on PIL images and on
//! tensors with `antialias=True`), by fast_image_resize.
//!
//! A JPEG is decoded by libjpeg-turbo ([`super::jpeg`]), and only the
//! part of it the resize reads: the crop box and the filter's margin
//! around it. When the box, scaled down by 1/2, 1/4 or 1/8, still covers
//! the output size, that part is decoded at that scale in the DCT domain,
//! the way PIL's `draft` mode does: most of the decode and resize work of
//! a large image is skipped. JPEGs libjpeg-turbo cannot crop or scale
//! (CMYK, lossless) are decoded whole by libjpeg-turbo as the `rgb8`
//! decoder decodes them; PNGs by the png crate, through the image crate.

use std::fmt;

use fast_image_resize::images::Image as Pixels;
use fast_image_resize::{FilterType, PixelType, ResizeAlg, ResizeOptions, Resizer};
use image::{DynamicImage, ImageError, ImageFormat};
use rand_chacha::ChaCha8Rng;

use super::jpeg::{self, Region};
use super::uniform;
use crate::value::{Array, ArrayData};

/// The largest output side, in pixels.
pub const MAX_SIZE: u32 = 16384;

/// Decoded pixels a source image may have (as the image crate's default
/// limit): larger images are refused before they are decoded, and larger
/// outputs when the transform is built.
const MAX_DECODED_BYTES: u64 = 512 << 20;

/// The most bytes a resize's intermediate may take (one pass over the
/// box's columns at the output's height, or over its rows at the output's
/// width): it grows with the box's long side, so an image of absurd
/// proportions (20,000,000 x 1 pixels, a 100 KB PNG) would need gigabytes.
const MAX_RESIZE_PASS_BYTES: u64 = 2 * MAX_DECODED_BYTES;

const JPEG_MAGIC: &[u8] = b"\xff\xd8\xff";
const PNG_MAGIC: &[u8] = b"\x89PNG\r\n\x1a\n";

/// How the output box is taken from the image.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Crop {
    /// torchvision's `RandomResizedCrop(size, scale, ratio)`.
    RandomResized {
        /// Range of the box's area, as a fraction of the image's.
        scale: (f64, f64),
        /// Range of the box's aspect ratio (width / height).
        ratio: (f64, f64),
    },
    /// `Resize(resize)` (the shorter side to `resize`), then
    /// `CenterCrop(size)` (zero-padded where the image is smaller).
    Center {
        /// The shorter side's length before the crop.
        resize: u32,
    },
    /// `Resize((h, w))`: the whole image, stretched to the output size.
    Resize,
    /// No crop and no resize: the decoded image as it is (its shape
    /// varies, so such samples do not collate into batches).
    Full,
}

/// Where the channels go in the output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// `[3, height, width]` (what torchvision models take).
    Chw,
    /// `[height, width, 3]` (what PIL and numpy images are).
    Hwc,
}

/// The parameters of one image transform, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct ImageSpec {
    /// Output `(height, width)`; `None` only with [`Crop::Full`].
    pub size: Option<(u32, u32)>,
    /// How the box is chosen.
    pub crop: Crop,
    /// Probability of a horizontal flip.
    pub flip: f64,
    /// Channel layout of the output.
    pub layout: Layout,
}

/// A parameter that [`ImageSpec::new`] refuses: its name and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid Image parameter {parameter}: {reason}")]
pub struct InvalidParameter {
    /// The parameter's name, as the Python keyword.
    pub parameter: &'static str,
    /// What is wrong with its value.
    pub reason: String,
}

fn invalid(parameter: &'static str, reason: impl Into<String>) -> InvalidParameter {
    InvalidParameter {
        parameter,
        reason: reason.into(),
    }
}

/// The names `crop=` accepts, in the order errors list them.
pub const CROP_NAMES: [&str; 3] = ["random_resized", "center", "resize"];

impl ImageSpec {
    /// Checks the parameters as `shardstream.Image` takes them (`None` for
    /// one not given) and builds the spec: `scale` and `ratio` only with
    /// `random_resized`, `resize` only with `center`, `size` with every
    /// crop but none. The defaults: `scale` `(0.08, 1.0)`, `ratio`
    /// `(3/4, 4/3)`, `resize` the shorter output side / 0.875 (256 for
    /// 224), `flip` 0, `layout` `"CHW"`.
    pub fn new(
        size: Option<(u32, u32)>,
        crop: Option<&str>,
        scale: Option<(f64, f64)>,
        ratio: Option<(f64, f64)>,
        resize: Option<u32>,
        flip: Option<f64>,
        layout: Option<&str>,
    ) -> Result<ImageSpec, InvalidParameter> {
        if let Some((h, w)) = size {
            if !(1..=MAX_SIZE).contains(&h) || !(1..=MAX_SIZE).contains(&w) {
                return Err(invalid(
                    "size",
                    format!("each side must be from 1 to {MAX_SIZE}, got ({h}, {w})"),
                ));
            }
            if u64::from(h) * u64::from(w) * 3 > MAX_DECODED_BYTES {
                return Err(invalid(
                    "size",
                    format!(
                        "({h}, {w}) is over {} MiB of RGB pixels per image",
                        MAX_DECODED_BYTES >> 20
                    ),
                ));
            }
        }
        let crop_name = crop;
        if scale.is_some() && crop_name != Some("random_resized") {
            return Err(invalid("scale", "only applies to crop=\"random_resized\""));
        }
        if ratio.is_some() && crop_name != Some("random_resized") {
            return Err(invalid("ratio", "only applies to crop=\"random_resized\""));
        }
        if resize.is_some() && crop_name != Some("center") {
            return Err(invalid("resize", "only applies to crop=\"center\""));
        }
        let crop = match crop_name {
            None => Crop::Full,
            Some("random_resized") => {
                let scale = scale.unwrap_or((0.08, 1.0));
                let ratio = ratio.unwrap_or((3.0 / 4.0, 4.0 / 3.0));
                let (lo, hi) = scale;
                if !(lo.is_finite() && hi.is_finite() && 0.0 < lo && lo <= hi && hi <= 1.0) {
                    return Err(invalid(
                        "scale",
                        format!("expected 0 < min <= max <= 1, got ({lo}, {hi})"),
                    ));
                }
                let (lo, hi) = ratio;
                if !(lo.is_finite() && hi.is_finite() && 0.0 < lo && lo <= hi) {
                    return Err(invalid(
                        "ratio",
                        format!("expected finite 0 < min <= max, got ({lo}, {hi})"),
                    ));
                }
                Crop::RandomResized { scale, ratio }
            }
            Some("center") => {
                let shorter = size.map_or(1, |(h, w)| h.min(w));
                let resize = match resize {
                    Some(resize) => resize,
                    None => (f64::from(shorter) / 0.875).floor() as u32,
                };
                if !(1..=MAX_SIZE).contains(&resize) {
                    return Err(invalid(
                        "resize",
                        format!("must be from 1 to {MAX_SIZE}, got {resize}"),
                    ));
                }
                Crop::Center { resize }
            }
            Some("resize") => Crop::Resize,
            Some(other) => {
                return Err(invalid(
                    "crop",
                    format!(
                        "expected None or one of {}, got {other:?}",
                        CROP_NAMES.map(|n| format!("{n:?}")).join(", ")
                    ),
                ))
            }
        };
        match (size, crop) {
            (None, Crop::Full) | (Some(_), _) => {}
            (None, _) => return Err(invalid("size", "is required unless crop=None")),
        }
        if size.is_some() && crop == Crop::Full {
            return Err(invalid(
                "size",
                "needs a crop (crop=None keeps the image's own size)",
            ));
        }
        let flip = flip.unwrap_or(0.0);
        if !(0.0..=1.0).contains(&flip) {
            return Err(invalid(
                "flip",
                format!("expected a probability from 0 to 1, got {flip}"),
            ));
        }
        let layout = match layout.unwrap_or("CHW") {
            "CHW" => Layout::Chw,
            "HWC" => Layout::Hwc,
            other => {
                return Err(invalid(
                    "layout",
                    format!("expected \"CHW\" or \"HWC\", got {other:?}"),
                ))
            }
        };
        Ok(ImageSpec {
            size,
            crop,
            flip,
            layout,
        })
    }

    /// Decodes and transforms one image, drawing the crop box and then the
    /// flip from `rng`.
    pub fn apply(&self, bytes: &[u8], rng: &mut ChaCha8Rng) -> Result<Array, String> {
        let format = sniff(bytes)?;
        let (width, height, partial) = checked_header(bytes, format)?;
        let (plan, flip) = self.draw(width, height, rng);
        let source = decode(bytes, format, partial.as_ref(), &plan)?;
        let resized = plan.resample(&source)?;
        Ok(self.lay_out(&resized, flip))
    }

    /// Whether [`ImageSpec::source_box`] can stand for [`ImageSpec::apply`]:
    /// an output size, and a box that covers the whole output (no zero
    /// padding: a `center` crop's `resize` at least each output side).
    pub fn check_boxes(&self) -> Result<(), InvalidParameter> {
        let Some((out_h, out_w)) = self.size else {
            return Err(invalid(
                "crop",
                "ImageBoxes needs an output size (crop=None keeps each image's own)",
            ));
        };
        if let Crop::Center { resize } = self.crop {
            if resize < out_h.max(out_w) {
                return Err(invalid(
                    "resize",
                    format!(
                        "ImageBoxes needs a center crop inside the resized image (resize \
                         {resize} is below the output side {})",
                        out_h.max(out_w)
                    ),
                ));
            }
        }
        Ok(())
    }

    /// What [`ImageSpec::apply`] would do to one JPEG, from its header
    /// alone and with the same draws from `rng`: the source box `[x, y,
    /// width, height]` (in source pixels) resampled to the output size,
    /// and `1.0` for a horizontal flip (else `0.0`). For a decoder that
    /// crops elsewhere (a GPU). Only JPEGs (what nvJPEG decodes); the spec
    /// passed [`ImageSpec::check_boxes`].
    pub fn source_box(&self, bytes: &[u8], rng: &mut ChaCha8Rng) -> Result<[f32; 5], String> {
        let format = sniff(bytes)?;
        if format != ImageFormat::Jpeg {
            return Err("ImageBoxes takes JPEGs only (a batched GPU decoder reads them)".into());
        }
        let (width, height, _) = checked_header(bytes, format)?;
        let (plan, flip) = self.draw(width, height, rng);
        let Rect { x, y, w, h } = plan.source;
        Ok([
            x as f32,
            y as f32,
            w as f32,
            h as f32,
            f32::from(u8::from(flip)),
        ])
    }

    /// Every random choice for one image of `width` x `height`, in the
    /// order they are drawn from `rng`: its plan (the crop box), then
    /// whether it is flipped.
    fn draw(&self, width: u32, height: u32, rng: &mut ChaCha8Rng) -> (Plan, bool) {
        let plan = self.plan(width, height, rng);
        let flip = self.flip > 0.0 && uniform(rng, 0.0, 1.0) < self.flip;
        (plan, flip)
    }

    /// The source box and output of one image of `width` x `height`.
    fn plan(&self, width: u32, height: u32, rng: &mut ChaCha8Rng) -> Plan {
        let (w, h) = (f64::from(width), f64::from(height));
        let whole = Plan {
            width,
            height,
            source: Rect {
                x: 0.0,
                y: 0.0,
                w,
                h,
            },
            out: (width, height),
            inner: (0, 0, width, height),
        };
        let Some((out_h, out_w)) = self.size else {
            return whole;
        };
        match self.crop {
            Crop::Full => whole,
            Crop::Resize => Plan {
                out: (out_w, out_h),
                inner: (0, 0, out_w, out_h),
                ..whole
            },
            Crop::RandomResized { scale, ratio } => {
                let (x, y, bw, bh) = random_resized_box(width, height, scale, ratio, rng);
                Plan {
                    source: Rect {
                        x: f64::from(x),
                        y: f64::from(y),
                        w: f64::from(bw),
                        h: f64::from(bh),
                    },
                    out: (out_w, out_h),
                    inner: (0, 0, out_w, out_h),
                    ..whole
                }
            }
            Crop::Center { resize } => center_plan(width, height, resize, (out_w, out_h)),
        }
    }

    /// The output array of `pixels` (RGB, row-major), flipped if asked.
    fn lay_out(&self, pixels: &Pixels<'_>, flip: bool) -> Array {
        let (w, h) = (pixels.width() as usize, pixels.height() as usize);
        let rgb = pixels.buffer();
        let data = match self.layout {
            Layout::Hwc if !flip => rgb.to_vec(),
            Layout::Hwc => {
                let mut out = Vec::with_capacity(rgb.len());
                for row in rgb.chunks_exact(w * 3) {
                    for pixel in row.chunks_exact(3).rev() {
                        out.extend_from_slice(pixel);
                    }
                }
                out
            }
            Layout::Chw => {
                let mut out = vec![0u8; rgb.len()];
                let (red, rest) = out.split_at_mut(w * h);
                let (green, blue) = rest.split_at_mut(w * h);
                let rows = rgb
                    .chunks_exact(w * 3)
                    .zip(red.chunks_exact_mut(w))
                    .zip(green.chunks_exact_mut(w))
                    .zip(blue.chunks_exact_mut(w));
                for (((row, red), green), blue) in rows {
                    let planes = red.iter_mut().zip(green.iter_mut()).zip(blue.iter_mut());
                    let pixels = row.chunks_exact(3);
                    let mut put = |(pixel, ((r, g), b)): (&[u8], ((&mut u8, &mut u8), &mut u8))| {
                        (*r, *g, *b) = (pixel[0], pixel[1], pixel[2]);
                    };
                    if flip {
                        pixels.zip(planes.rev()).for_each(&mut put);
                    } else {
                        pixels.zip(planes).for_each(&mut put);
                    }
                }
                out
            }
        };
        let shape = match self.layout {
            Layout::Chw => vec![3, h, w],
            Layout::Hwc => vec![h, w, 3],
        };
        Array::new(shape, ArrayData::U8(data)).expect("the shape matches the pixels")
    }
}

impl fmt::Display for ImageSpec {
    /// The spec as Python would construct it, e.g.
    /// `Image(size=(224, 224), crop="random_resized", scale=(0.08, 1),
    /// ratio=(0.75, 1.3333333333333333), flip=0.5, layout="CHW")`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Image(")?;
        if let Some((h, w)) = self.size {
            write!(f, "size=({h}, {w}), ")?;
        }
        match self.crop {
            Crop::RandomResized { scale, ratio } => write!(
                f,
                "crop=\"random_resized\", scale=({}, {}), ratio=({}, {}), ",
                scale.0, scale.1, ratio.0, ratio.1
            )?,
            Crop::Center { resize } => write!(f, "crop=\"center\", resize={resize}, ")?,
            Crop::Resize => f.write_str("crop=\"resize\", ")?,
            Crop::Full => f.write_str("crop=None, ")?,
        }
        let layout = match self.layout {
            Layout::Chw => "CHW",
            Layout::Hwc => "HWC",
        };
        write!(f, "flip={}, layout=\"{layout}\")", self.flip)
    }
}

/// A box in source pixel coordinates.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Rect {
    x: f64,
    y: f64,
    w: f64,
    h: f64,
}

/// What one image becomes: its `source` box resampled to the `inner`
/// rectangle `(x, y, w, h)` of an output of `out` `(w, h)` pixels (the
/// rest, if any, is zero padding).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Plan {
    width: u32,
    height: u32,
    source: Rect,
    out: (u32, u32),
    inner: (u32, u32, u32, u32),
}

impl Plan {
    /// The scale (1, 1/2, 1/4 or 1/8, as eighths) at which the source box
    /// still covers the inner output rectangle: the smallest such.
    fn dct_eighths(&self) -> u32 {
        let (_, _, inner_w, inner_h) = self.inner;
        [1u32, 2, 4]
            .into_iter()
            .find(|&eighths| {
                let (sw, sh) = scaled_size(self.width, self.height, eighths);
                let box_w = self.source.w * f64::from(sw) / f64::from(self.width);
                let box_h = self.source.h * f64::from(sh) / f64::from(self.height);
                box_w >= f64::from(inner_w) && box_h >= f64::from(inner_h)
            })
            .unwrap_or(8)
    }

    /// The source box in the coordinates of the image decoded at
    /// `(scaled_w, scaled_h)` pixels. Scaling may round a box edge past
    /// the image by a hair: clamped.
    fn scaled_box(&self, (scaled_w, scaled_h): (u32, u32)) -> Rect {
        let (sw, sh) = (f64::from(scaled_w), f64::from(scaled_h));
        let (fx, fy) = (sw / f64::from(self.width), sh / f64::from(self.height));
        let (x, y) = ((self.source.x * fx).min(sw), (self.source.y * fy).min(sh));
        Rect {
            x,
            y,
            w: (self.source.w * fx).min(sw - x),
            h: (self.source.h * fy).min(sh - y),
        }
    }

    /// The part of the image decoded at `scaled` size that the resample
    /// reads: the source box and, around it, the antialiased filter's
    /// support (the box's scale to the output, at least one pixel) and
    /// one pixel for rounding; its left edge moved down to a multiple of
    /// `mcu_width`, as libjpeg-turbo's cropping needs.
    fn region(&self, scaled: (u32, u32), mcu_width: u32) -> Region {
        let rect = self.scaled_box(scaled);
        let (_, _, inner_w, inner_h) = self.inner;
        let margin_x = (rect.w / f64::from(inner_w)).max(1.0).ceil() + 1.0;
        let margin_y = (rect.h / f64::from(inner_h)).max(1.0).ceil() + 1.0;
        let mcu_width = mcu_width.max(1);
        let x0 = (rect.x - margin_x).floor().max(0.0) as u32 / mcu_width * mcu_width;
        let y0 = (rect.y - margin_y).floor().max(0.0) as u32;
        let x1 = ((rect.x + rect.w + margin_x).ceil() as u32).clamp(x0 + 1, scaled.0);
        let y1 = ((rect.y + rect.h + margin_y).ceil() as u32).clamp(y0 + 1, scaled.1);
        Region {
            x: x0,
            y: y0,
            w: x1 - x0,
            h: y1 - y0,
        }
    }

    /// The source box resampled into the output (RGB, row-major).
    fn resample(&self, decoded: &Decoded) -> Result<Pixels<'static>, String> {
        let (out_w, out_h) = self.out;
        let source = &decoded.pixels;
        let (src_w, src_h) = (f64::from(source.width()), f64::from(source.height()));
        let scaled = self.scaled_box(decoded.scaled);
        let (x, y) = (
            (scaled.x - f64::from(decoded.origin.0)).clamp(0.0, src_w),
            (scaled.y - f64::from(decoded.origin.1)).clamp(0.0, src_h),
        );
        let rect = Rect {
            x,
            y,
            w: scaled.w.min(src_w - x),
            h: scaled.h.min(src_h - y),
        };
        let (ix, iy, iw, ih) = self.inner;
        let whole = rect.x == 0.0 && rect.y == 0.0 && rect.w == src_w && rect.h == src_h;
        let mut inner = Pixels::new(iw, ih, PixelType::U8x3);
        if whole && (iw, ih) == (source.width(), source.height()) {
            inner.buffer_mut().copy_from_slice(source.buffer());
        } else {
            let pass =
                (rect.w.ceil() as u64 * u64::from(ih)).max(rect.h.ceil() as u64 * u64::from(iw));
            if pass.saturating_mul(3) > MAX_RESIZE_PASS_BYTES {
                return Err(format!(
                    "image too large to resize: a {}x{} pixel box into {iw}x{ih} pixels would \
                     take over {} MiB (an image of extreme proportions)",
                    rect.w.ceil(),
                    rect.h.ceil(),
                    MAX_RESIZE_PASS_BYTES >> 20
                ));
            }
            let options = ResizeOptions::new()
                .resize_alg(ResizeAlg::Convolution(FilterType::Bilinear))
                .crop(rect.x, rect.y, rect.w, rect.h);
            Resizer::new()
                .resize(source, &mut inner, &options)
                .map_err(|e| format!("cannot resize the image: {e}"))?;
        }
        if (iw, ih) == (out_w, out_h) {
            return Ok(inner);
        }
        let mut out = Pixels::new(out_w, out_h, PixelType::U8x3);
        let (row, inner_row) = (out_w as usize * 3, iw as usize * 3);
        for (y, line) in inner.buffer().chunks_exact(inner_row).enumerate() {
            let at = (iy as usize + y) * row + ix as usize * 3;
            out.buffer_mut()[at..at + inner_row].copy_from_slice(line);
        }
        Ok(out)
    }
}

/// The size of a `width` x `height` JPEG decoded at `eighths`/8 scale
/// (libjpeg's rounding up).
fn scaled_size(width: u32, height: u32, eighths: u32) -> (u32, u32) {
    (
        (width * eighths).div_ceil(8),
        (height * eighths).div_ceil(8),
    )
}

/// torchvision's `RandomResizedCrop.get_params`: up to ten boxes of random
/// area (a `scale` fraction of the image's) and log-uniform aspect ratio,
/// the first that fits; else the whole image cut to the nearest allowed
/// ratio, centred. Returns `(x, y, w, h)`.
pub fn random_resized_box(
    width: u32,
    height: u32,
    scale: (f64, f64),
    ratio: (f64, f64),
    rng: &mut ChaCha8Rng,
) -> (u32, u32, u32, u32) {
    let area = f64::from(width) * f64::from(height);
    let (log_lo, log_hi) = (ratio.0.ln(), ratio.1.ln());
    for _ in 0..10 {
        let target_area = area * uniform(rng, scale.0, scale.1);
        let aspect = uniform(rng, log_lo, log_hi).exp();
        let w = (target_area * aspect).sqrt().round_ties_even();
        let h = (target_area / aspect).sqrt().round_ties_even();
        if 0.0 < w && w <= f64::from(width) && 0.0 < h && h <= f64::from(height) {
            let (w, h) = (w as u32, h as u32);
            let y = crate::plan::order::below(rng, (height - h + 1) as usize) as u32;
            let x = crate::plan::order::below(rng, (width - w + 1) as usize) as u32;
            return (x, y, w, h);
        }
    }
    let in_ratio = f64::from(width) / f64::from(height);
    let (w, h) = if in_ratio < ratio.0 {
        let h = (f64::from(width) / ratio.0).round_ties_even() as u32;
        (width, h.clamp(1, height))
    } else if in_ratio > ratio.1 {
        let w = (f64::from(height) * ratio.1).round_ties_even() as u32;
        (w.clamp(1, width), height)
    } else {
        (width, height)
    };
    ((width - w) / 2, (height - h) / 2, w, h)
}

/// torchvision's `Resize(resize)` then `CenterCrop((out_h, out_w))`, as
/// one resampling of the source box that the crop sees.
fn center_plan(width: u32, height: u32, resize: u32, (out_w, out_h): (u32, u32)) -> Plan {
    // Resize: the shorter side to `resize`, the longer in proportion
    // (truncated, as torchvision does).
    let (rw, rh) = if width <= height {
        let long = (f64::from(resize) * f64::from(height) / f64::from(width)) as u32;
        (resize, long.max(1))
    } else {
        let long = (f64::from(resize) * f64::from(width) / f64::from(height)) as u32;
        (long.max(1), resize)
    };
    // CenterCrop: zero padding where the crop is larger, else an offset
    // of round((resized - crop) / 2).
    let axis = |resized: u32, crop: u32| -> (u32, u32, u32) {
        if crop > resized {
            ((crop - resized) / 2, 0, resized)
        } else {
            let offset = (f64::from(resized - crop) / 2.0).round_ties_even() as u32;
            (0, offset, crop)
        }
    };
    let (pad_x, crop_x, inner_w) = axis(rw, out_w);
    let (pad_y, crop_y, inner_h) = axis(rh, out_h);
    let (kx, ky) = (
        f64::from(width) / f64::from(rw),
        f64::from(height) / f64::from(rh),
    );
    Plan {
        width,
        height,
        source: Rect {
            x: f64::from(crop_x) * kx,
            y: f64::from(crop_y) * ky,
            w: f64::from(inner_w) * kx,
            h: f64::from(inner_h) * ky,
        },
        out: (out_w, out_h),
        inner: (pad_x, pad_y, inner_w, inner_h),
    }
}

/// The format, from the magic bytes; a JPEG cut short is refused.
pub fn sniff(bytes: &[u8]) -> Result<ImageFormat, String> {
    if bytes.starts_with(JPEG_MAGIC) {
        if is_truncated_jpeg(bytes) {
            // libjpeg-turbo, which recovers from a missing end with a
            // warning, would fill the missing part in; PIL refuses such
            // files, and so do we.
            return Err(
                "truncated JPEG image (no end-of-image marker after the last scan)".to_owned(),
            );
        }
        Ok(ImageFormat::Jpeg)
    } else if bytes.starts_with(PNG_MAGIC) {
        Ok(ImageFormat::Png)
    } else {
        Err(format!(
            "not a JPEG or PNG image (starts with {})",
            hex_prefix(bytes)
        ))
    }
}

/// Whether a JPEG has a scan (`FF DA`) but no end-of-image marker
/// (`FF D9`) after its last scan. Inside entropy-coded data every `FF` is
/// followed by `00` or a restart marker, so neither pair can occur there;
/// an embedded thumbnail's scan and end marker come before the main
/// image's scan. Files without any scan are left for the decoder to reject.
/// The last end marker is looked for first: it is nearly always at the very
/// end, so only the bytes after it are searched for a scan.
fn is_truncated_jpeg(bytes: &[u8]) -> bool {
    let has_scan = |bytes: &[u8]| bytes.windows(2).any(|pair| pair == [0xff, 0xda]);
    match bytes.windows(2).rposition(|pair| pair == [0xff, 0xd9]) {
        Some(end) => has_scan(&bytes[end..]),
        None => has_scan(bytes),
    }
}

/// The first bytes in hex, for "not an image" errors.
fn hex_prefix(bytes: &[u8]) -> String {
    if bytes.is_empty() {
        return "nothing: the field is empty".to_owned();
    }
    let hex: Vec<String> = bytes.iter().take(8).map(|b| format!("{b:02x}")).collect();
    hex.join(" ")
}

/// The image's `(width, height)` from its header, checked by
/// [`check_size`], and the header of a JPEG that libjpeg-turbo decodes in
/// part ([`jpeg::Header::partial`]).
fn checked_header(
    bytes: &[u8],
    format: ImageFormat,
) -> Result<(u32, u32, Option<jpeg::Header>), String> {
    let (width, height, partial) = match format {
        ImageFormat::Jpeg => {
            let header = jpeg::header(bytes)?;
            (
                header.width,
                header.height,
                Some(header).filter(|h| h.partial),
            )
        }
        _ => {
            let (width, height) = header_dimensions(bytes, format)?;
            (width, height, None)
        }
    };
    check_size(width, height)?;
    Ok((width, height, partial))
}

/// Refuses an empty image, and one whose RGB pixels would exceed
/// [`MAX_DECODED_BYTES`]: a small file declaring a huge image (a
/// decompression bomb) is an error before any pixel is allocated.
fn check_size(width: u32, height: u32) -> Result<(), String> {
    if width == 0 || height == 0 {
        return Err("the image is empty (0 pixels wide or high)".into());
    }
    if u64::from(width) * u64::from(height) * 3 > MAX_DECODED_BYTES {
        return Err(format!(
            "image too large to decode: {width}x{height} pixels (limit {} MiB of RGB)",
            MAX_DECODED_BYTES >> 20
        ));
    }
    Ok(())
}

/// The image's full-size RGB pixels as `(width, height, pixels)`, after
/// checking from its header that they fit [`MAX_DECODED_BYTES`] (the RGB
/// output, not only the decoder's own buffer: a grayscale image triples).
pub fn decode_rgb(bytes: &[u8], format: ImageFormat) -> Result<(u32, u32, Vec<u8>), String> {
    checked_header(bytes, format)?;
    decode_full(bytes, format)
}

/// A whole JPEG (by libjpeg-turbo) or PNG (by the image crate) decoded
/// into RGB pixels, with its errors worded for users; the caller has
/// checked their size.
fn decode_full(bytes: &[u8], format: ImageFormat) -> Result<(u32, u32, Vec<u8>), String> {
    if format == ImageFormat::Jpeg {
        return jpeg::decode_whole(bytes);
    }
    let name = format_name(format);
    let image = image::load_from_memory_with_format(bytes, format).map_err(|e| match e {
        ImageError::Limits(limit) => format!("{name} image too large to decode: {limit}"),
        ImageError::Unsupported(what) => format!("unsupported {name} image: {what}"),
        other => format!("corrupt {name} image: {other}"),
    })?;
    let (width, height) = (image.width(), image.height());
    let pixels = match image {
        DynamicImage::ImageRgb8(rgb) => rgb.into_raw(),
        other => other.into_rgb8().into_raw(),
    };
    Ok((width, height, pixels))
}

fn format_name(format: ImageFormat) -> &'static str {
    match format {
        ImageFormat::Jpeg => "JPEG",
        _ => "PNG",
    }
}

/// A PNG's `(width, height)` as the image crate's decoder reads them from
/// its header (a JPEG's are libjpeg-turbo's, [`jpeg::header`]).
fn header_dimensions(bytes: &[u8], format: ImageFormat) -> Result<(u32, u32), String> {
    let reader = image::ImageReader::with_format(std::io::Cursor::new(bytes), format);
    reader
        .into_dimensions()
        .map_err(|e| format!("corrupt {} image: {e}", format_name(format)))
}

/// Decoded pixels and where they lie in the image decoded at their scale.
struct Decoded {
    /// RGB, row-major.
    pixels: Pixels<'static>,
    /// The size of the whole image at the scale decoded.
    scaled: (u32, u32),
    /// Where `pixels` start in it.
    origin: (u32, u32),
}

/// The part of the image `plan` reads, at the smallest DCT scale it
/// allows, for a JPEG libjpeg-turbo decodes in part (`partial`, its
/// header); the whole image otherwise.
fn decode(
    bytes: &[u8],
    format: ImageFormat,
    partial: Option<&jpeg::Header>,
    plan: &Plan,
) -> Result<Decoded, String> {
    let as_pixels = |(width, height, rgb): (u32, u32, Vec<u8>)| {
        Pixels::from_vec_u8(width, height, rgb, PixelType::U8x3)
            .map_err(|e| format!("decoder returned a wrong number of pixels: {e}"))
    };
    if let Some(header) = partial {
        let eighths = plan.dct_eighths();
        let scaled = scaled_size(plan.width, plan.height, eighths);
        let region = plan.region(scaled, header.scaled_mcu_width(eighths));
        let pixels = as_pixels(jpeg::decode_region(bytes, eighths, region)?)?;
        return Ok(Decoded {
            pixels,
            scaled,
            origin: (region.x, region.y),
        });
    }
    let pixels = as_pixels(decode_full(bytes, format)?)?;
    Ok(Decoded {
        scaled: (pixels.width(), pixels.height()),
        pixels,
        origin: (0, 0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::augment::SampleContext;
    use image::codecs::png::PngEncoder;
    use image::{ExtendedColorType, ImageEncoder};
    use proptest::prelude::*;

    fn spec(size: u32, crop: Option<&str>) -> ImageSpec {
        ImageSpec::new(Some((size, size)), crop, None, None, None, None, None).unwrap()
    }

    fn rng(index: u64) -> ChaCha8Rng {
        SampleContext {
            seed: 1,
            epoch: 0,
            shard: 0,
            index,
        }
        .rng("jpg")
    }

    /// A smooth test picture: gradients in each channel.
    fn picture(width: u32, height: u32) -> Vec<u8> {
        (0..height)
            .flat_map(|y| {
                (0..width).flat_map(move |x| {
                    [
                        (x * 255 / width.max(2)) as u8,
                        (y * 255 / height.max(2)) as u8,
                        ((x + y) % 256) as u8,
                    ]
                })
            })
            .collect()
    }

    /// The test picture as a PNG or a JPEG (quality 95).
    fn encoded(width: u32, height: u32, as_png: bool) -> Vec<u8> {
        let (mut out, pixels) = (Vec::new(), picture(width, height));
        let color = ExtendedColorType::Rgb8;
        if !as_png {
            return jpeg::encode(&pixels, width, height, false, 95).unwrap();
        }
        PngEncoder::new(&mut out)
            .write_image(&pixels, width, height, color)
            .unwrap();
        out
    }

    fn jpeg(width: u32, height: u32) -> Vec<u8> {
        encoded(width, height, false)
    }

    fn png(width: u32, height: u32) -> Vec<u8> {
        encoded(width, height, true)
    }

    #[test]
    fn source_boxes_make_the_draws_apply_makes() {
        let with_flip =
            |crop| ImageSpec::new(Some((64, 64)), crop, None, None, None, Some(0.5), None).unwrap();
        let bytes = jpeg(200, 150);
        for index in 0..20 {
            let spec = with_flip(Some("random_resized"));
            let (mut boxed, mut applied) = (rng(index), rng(index));
            let found = spec.source_box(&bytes, &mut boxed).unwrap();
            spec.apply(&bytes, &mut applied).unwrap();
            // The same draws, in the same order: the streams stay in step.
            assert_eq!(boxed.next_u64(), applied.next_u64(), "sample {index}");
            let Crop::RandomResized { scale, ratio } = spec.crop else {
                unreachable!("random_resized")
            };
            let (x, y, w, h) = random_resized_box(200, 150, scale, ratio, &mut rng(index));
            assert_eq!(found[..4], [x as f32, y as f32, w as f32, h as f32]);
            assert!(found[4] == 0.0 || found[4] == 1.0);
        }
        let whole = with_flip(Some("resize"))
            .source_box(&bytes, &mut rng(0))
            .unwrap();
        assert_eq!(whole[..4], [0.0, 0.0, 200.0, 150.0]);
        let error = spec(64, Some("resize"))
            .source_box(&png(20, 20), &mut rng(0))
            .unwrap_err();
        assert!(error.contains("JPEGs only"), "{error}");
        assert!(spec(64, Some("center")).check_boxes().is_ok());
        let small = ImageSpec::new(
            Some((64, 64)),
            Some("center"),
            None,
            None,
            Some(48),
            None,
            None,
        );
        assert_eq!(
            small.unwrap().check_boxes().unwrap_err().parameter,
            "resize"
        );
        let full = ImageSpec::new(None, None, None, None, None, None, None).unwrap();
        assert_eq!(full.check_boxes().unwrap_err().parameter, "crop");
    }

    #[test]
    fn shapes_follow_size_and_layout() {
        for bytes in [jpeg(200, 150), png(200, 150)] {
            for crop in [Some("random_resized"), Some("center"), Some("resize")] {
                let chw = spec(64, crop).apply(&bytes, &mut rng(0)).unwrap();
                assert_eq!(chw.shape, vec![3, 64, 64], "{crop:?}");
                let hwc = ImageSpec::new(Some((32, 48)), crop, None, None, None, None, Some("HWC"))
                    .unwrap()
                    .apply(&bytes, &mut rng(0))
                    .unwrap();
                assert_eq!(hwc.shape, vec![32, 48, 3], "{crop:?}");
            }
            let full = ImageSpec::new(None, None, None, None, None, None, Some("HWC"))
                .unwrap()
                .apply(&bytes, &mut rng(0))
                .unwrap();
            assert_eq!(full.shape, vec![150, 200, 3]);
        }
    }

    #[test]
    fn full_png_is_the_decoded_image_and_flip_mirrors_it() {
        let bytes = png(5, 3);
        let hwc = |flip, layout| {
            let spec =
                ImageSpec::new(None, None, None, None, None, Some(flip), Some(layout)).unwrap();
            match spec.apply(&bytes, &mut rng(0)).unwrap().data {
                ArrayData::U8(pixels) => pixels,
                _ => unreachable!(),
            }
        };
        let plain = picture(5, 3);
        assert_eq!(hwc(0.0, "HWC"), plain);
        let mirrored: Vec<u8> = plain
            .chunks(15)
            .flat_map(|row| row.chunks(3).rev().flatten().copied().collect::<Vec<_>>())
            .collect();
        assert_eq!(hwc(1.0, "HWC"), mirrored);
        let planes: Vec<u8> = (0..3)
            .flat_map(|c| mirrored.chunks(3).map(move |p| p[c]))
            .collect();
        assert_eq!(hwc(1.0, "CHW"), planes);
    }

    #[test]
    fn same_stream_same_pixels_other_stream_other_crop() {
        let bytes = jpeg(320, 240);
        let spec = spec(48, Some("random_resized"));
        let a = spec.apply(&bytes, &mut rng(3)).unwrap();
        assert_eq!(a, spec.apply(&bytes, &mut rng(3)).unwrap());
        let others = (4..10).filter(|&i| spec.apply(&bytes, &mut rng(i)).unwrap() != a);
        assert!(others.count() >= 5);
    }

    #[test]
    fn dct_scaling_is_used_only_when_the_box_covers_the_output() {
        // The box of 2000x1600 is 1750x1400: 219x175 at 1/8, 438x350 at 1/4.
        let plan = center_plan(2000, 1600, 256, (224, 224));
        assert_eq!(plan.dct_eighths(), 2);
        let plan = center_plan(500, 375, 256, (224, 224));
        assert_eq!(plan.dct_eighths(), 8);
        let plan = center_plan(1000, 750, 256, (224, 224));
        assert_eq!(plan.dct_eighths(), 4);
        // A scaled decode gives what a full decode gives, closely.
        let bytes = jpeg(1000, 750);
        let spec = spec(224, Some("center"));
        let scaled = spec.apply(&bytes, &mut rng(0)).unwrap();
        let (w, h, full) = decode_rgb(&bytes, ImageFormat::Jpeg).unwrap();
        let full = Decoded {
            pixels: Pixels::from_vec_u8(w, h, full, PixelType::U8x3).unwrap(),
            scaled: (w, h),
            origin: (0, 0),
        };
        let reference = spec.lay_out(&plan.resample(&full).unwrap(), false);
        let (ArrayData::U8(a), ArrayData::U8(b)) = (scaled.data, reference.data) else {
            unreachable!()
        };
        let mean = a
            .iter()
            .zip(&b)
            .map(|(&x, &y)| f64::from(x.abs_diff(y)))
            .sum::<f64>()
            / a.len() as f64;
        assert!(mean < 2.0, "mean difference {mean}");
    }

    /// The whole image decoded by libjpeg-turbo at `eighths`/8 scale.
    fn whole_jpeg(bytes: &[u8], eighths: u32) -> Decoded {
        let header = jpeg::header(bytes).unwrap();
        let scaled = scaled_size(header.width, header.height, eighths);
        let region = Region {
            x: 0,
            y: 0,
            w: scaled.0,
            h: scaled.1,
        };
        let (w, h, rgb) = jpeg::decode_region(bytes, eighths, region).unwrap();
        Decoded {
            pixels: Pixels::from_vec_u8(w, h, rgb, PixelType::U8x3).unwrap(),
            scaled,
            origin: (0, 0),
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]

        /// Decoding only the region the resample reads gives exactly the
        /// output of resampling the whole decode, for random crops of
        /// images decoded at full and at reduced scale.
        #[test]
        fn the_region_decode_gives_the_whole_decode_s_output(
            index in 0u64..1_000_000,
            large in any::<bool>(),
            crop in prop::sample::select(vec!["random_resized", "center", "resize"]),
        ) {
            let (width, height) = if large { (1000, 750) } else { (500, 375) };
            let bytes = jpeg(width, height);
            let spec = spec(if large { 96 } else { 224 }, Some(crop));
            let out = spec.apply(&bytes, &mut rng(index)).unwrap();
            let mut draws = rng(index);
            let plan = spec.plan(width, height, &mut draws);
            let flip = spec.flip > 0.0 && uniform(&mut draws, 0.0, 1.0) < spec.flip;
            let whole = whole_jpeg(&bytes, plan.dct_eighths());
            let reference = spec.lay_out(&plan.resample(&whole).unwrap(), flip);
            prop_assert!(out == reference, "{} {}x{} at {}/8 differs", crop, width, height, plan.dct_eighths());
        }
    }

    #[test]
    fn center_crop_pads_where_the_image_is_smaller() {
        // 100x50 resized to 64 high is 128x64; a 96x80 crop pads 8 rows
        // above and below.
        let plan = center_plan(100, 50, 64, (96, 80));
        assert_eq!(plan.out, (96, 80));
        assert_eq!(plan.inner, (0, 8, 96, 64));
        let out = ImageSpec::new(
            Some((80, 96)),
            Some("center"),
            None,
            None,
            Some(64),
            None,
            Some("HWC"),
        )
        .unwrap()
        .apply(&png(100, 50), &mut rng(0))
        .unwrap();
        let ArrayData::U8(pixels) = out.data else {
            unreachable!()
        };
        assert!(pixels[..8 * 96 * 3].iter().all(|&v| v == 0));
        assert!(pixels[72 * 96 * 3..].iter().all(|&v| v == 0));
    }

    /// Every parameter is checked (tests/python/test_augment.py goes
    /// through each case from Python); the defaults are filled in.
    #[test]
    fn parameters_are_checked_and_defaulted() {
        let size = Some((224, 224));
        let bad = ImageSpec::new(
            size,
            Some("random_resized"),
            None,
            None,
            None,
            Some(2.0),
            None,
        );
        assert_eq!(bad.unwrap_err().parameter, "flip");
        let bad = ImageSpec::new(None, Some("center"), None, None, None, None, None);
        assert_eq!(bad.unwrap_err().parameter, "size");
        let center = ImageSpec::new(size, Some("center"), None, None, None, None, None).unwrap();
        assert_eq!(center.crop, Crop::Center { resize: 256 });
        let random = spec(224, Some("random_resized"));
        let ratio = (3.0 / 4.0, 4.0 / 3.0);
        assert_eq!(
            (random.crop, random.flip, random.layout),
            (
                Crop::RandomResized {
                    scale: (0.08, 1.0),
                    ratio
                },
                0.0,
                Layout::Chw
            )
        );
    }

    #[test]
    fn a_jpeg_is_truncated_when_a_scan_follows_its_last_end_marker() {
        let (soi, sos, eoi) = (&b"\xff\xd8"[..], &b"\xff\xda\x01"[..], &b"\xff\xd9"[..]);
        let file = |parts: &[&[u8]]| parts.concat();
        assert!(!is_truncated_jpeg(&file(&[soi, sos, eoi])));
        assert!(is_truncated_jpeg(&file(&[soi, sos])));
        // A thumbnail's scan and end marker, then the main scan cut short.
        assert!(is_truncated_jpeg(&file(&[soi, sos, eoi, sos])));
        assert!(!is_truncated_jpeg(&file(&[
            soi, sos, eoi, sos, eoi, b"\0\0"
        ])));
        // No scan at all: left for the decoder.
        assert!(!is_truncated_jpeg(&file(&[soi, eoi])));
        assert!(!is_truncated_jpeg(soi));
    }

    #[test]
    fn corrupt_and_odd_inputs_are_errors_not_panics() {
        let bytes = jpeg(64, 48);
        let spec = spec(16, Some("random_resized"));
        assert!(spec
            .apply(b"GIF89a", &mut rng(0))
            .unwrap_err()
            .starts_with("not a JPEG or PNG"));
        assert!(spec
            .apply(&bytes[..bytes.len() - 30], &mut rng(0))
            .unwrap_err()
            .contains("truncated"));
        for end in (0..bytes.len()).step_by(7) {
            let _ = crate::error::guard(|| spec.apply(&bytes[..end], &mut rng(0)));
        }
        for at in (0..bytes.len()).step_by(3) {
            let mut flipped = bytes.clone();
            flipped[at] ^= 0x55;
            let _ = crate::error::guard(|| spec.apply(&flipped, &mut rng(0)));
        }
        // One-pixel images and outputs larger than the image work.
        let tiny = spec.apply(&png(1, 1), &mut rng(0)).unwrap();
        assert_eq!(tiny.shape, vec![3, 16, 16]);
        // A 2,000,000 x 1 gray PNG (6 MB of RGB) resized to 224 x 224: the
        // resize's pass over its columns would take 1.3 GB (20,000,000
        // pixels wide, 13 GB). Refused; 100,000 x 1 is resized.
        let line = |width: u32| {
            let mut out = Vec::new();
            PngEncoder::new(&mut out)
                .write_image(&vec![128; width as usize], width, 1, ExtendedColorType::L8)
                .unwrap();
            out
        };
        let resize = ImageSpec::new(
            Some((224, 224)),
            Some("resize"),
            None,
            None,
            None,
            None,
            None,
        )
        .unwrap();
        let error = resize.apply(&line(2_000_000), &mut rng(0)).unwrap_err();
        assert!(error.contains("too large to resize"), "{error}");
        let fine = resize.apply(&line(100_000), &mut rng(0)).unwrap();
        assert_eq!(fine.shape, vec![3, 224, 224]);
    }

    proptest! {
        /// Every box lies inside the image; one of the ten tries has area
        /// and ratio in range (up to rounding), or it is the fallback.
        #[test]
        fn random_resized_boxes_are_inside_and_in_range(
            width in 1u32..3000, height in 1u32..3000,
            lo in 0.01f64..1.0, span in 0.0f64..1.0,
            rlo in 0.2f64..2.0, rspan in 0.0f64..3.0, index: u64,
        ) {
            let scale = (lo, (lo + span).min(1.0));
            let ratio = (rlo, rlo + rspan);
            let (x, y, w, h) = random_resized_box(width, height, scale, ratio, &mut rng(index));
            prop_assert!(w >= 1 && h >= 1);
            prop_assert!(x + w <= width && y + h <= height);
            let area = f64::from(width) * f64::from(height);
            let fraction = f64::from(w) * f64::from(h) / area;
            // Rounding each side to whole pixels moves area and ratio by
            // at most half a pixel on each side.
            let (wf, hf) = (f64::from(w), f64::from(h));
            let slack = ((wf + 0.5) * (hf + 0.5) - wf * hf).max(wf * hf - (wf - 0.5) * (hf - 0.5)) / area;
            let in_range = fraction >= scale.0 - slack
                && fraction <= scale.1 + slack
                && (wf + 0.5) / (hf - 0.5).max(0.5) >= ratio.0
                && (wf - 0.5) / (hf + 0.5) <= ratio.1;
            let fallback = (x, y) == ((width - w) / 2, (height - h) / 2)
                && (w == width || h == height);
            prop_assert!(in_range || fallback, "box {:?}", (x, y, w, h));
        }
    }
}
