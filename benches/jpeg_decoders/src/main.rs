//! JPEG decoders for shardstream's `Image` transform: per-image CPU time
//! (this thread's, `CLOCK_THREAD_CPUTIME_ID`) and wall time of zune-jpeg
//! (through the image crate, as shardstream decodes today) and
//! libjpeg-turbo (full, cropped and DCT-scaled decode through the
//! TurboJPEG 3 API), alone and in the decode + RandomResizedCrop(224) +
//! horizontal flip + CHW pipeline.
//!
//! ```text
//! shardstream-bench-jpeg <image dir> <boxes.txt> [passes] [variant-substring ...]
//! ```
//!
//! `boxes.txt` has one line per image (in sorted file-name order),
//! `x y w h flip`, drawn by torchvision's `RandomResizedCrop.get_params`
//! (`make_boxes.py`). Each pass runs every variant over all images, the
//! variants one after the other; a first warm-up pass is not counted. The
//! table on stdout gives, per variant, the median over passes of the mean
//! per image, with the fastest and slowest pass. With `RAW=<file>` the
//! per-pass figures are appended to that CSV file for `summarize.py`.
//! stderr gets which DCT scales the boxes pick and how far each pipeline's
//! output is from today's.

use std::time::Instant;

use fast_image_resize::images::{Image as Pixels, ImageRef};
use fast_image_resize::{FilterType, PixelType, ResizeAlg, ResizeOptions, Resizer};

/// Side of the square output, as `RandomResizedCrop(224)`.
const OUT: u32 = 224;

/// One RandomResizedCrop draw: the box in the full-size image and whether
/// the output is flipped horizontally.
#[derive(Clone, Copy, Debug)]
struct Crop {
    /// Left edge of the box, in pixels.
    x: u32,
    /// Top edge of the box, in pixels.
    y: u32,
    /// Width of the box.
    w: u32,
    /// Height of the box.
    h: u32,
    /// Whether the output is mirrored left to right.
    flip: bool,
}

/// Decoded RGB pixels: `(width, height, pixels)`.
type Rgb = (u32, u32, Vec<u8>);

/// CPU time this thread has used, in nanoseconds.
fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable `timespec` for the duration of the
    // call, and CLOCK_THREAD_CPUTIME_ID is a clock Linux always has.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID) failed");
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Variant `a`, as shardstream's `decode_full`: the image crate 0.25.10,
/// which runs zune-jpeg 0.5.15 (non-strict), then into RGB8.
fn image_crate(bytes: &[u8]) -> Rgb {
    let im = image::load_from_memory_with_format(bytes, image::ImageFormat::Jpeg).unwrap();
    let (w, h) = (im.width(), im.height());
    let px = match im {
        image::DynamicImage::ImageRgb8(rgb) => rgb.into_raw(),
        other => other.into_rgb8().into_raw(),
    };
    (w, h, px)
}

/// Variant `a'`: zune-jpeg 0.5.15 called directly (RGB out, non-strict as
/// the image crate sets it).
fn zune_direct(bytes: &[u8]) -> Rgb {
    use zune_core::bytestream::ZCursor;
    use zune_core::colorspace::ColorSpace;
    use zune_core::options::DecoderOptions;
    let opts = DecoderOptions::default()
        .jpeg_set_out_colorspace(ColorSpace::RGB)
        .set_strict_mode(false);
    let mut d = zune_jpeg::JpegDecoder::new_with_options(ZCursor::new(bytes), opts);
    let px = d.decode().unwrap();
    let (w, h) = d.dimensions().unwrap();
    (w as u32, h as u32, px)
}

#[cfg(any(feature = "turbo", feature = "turbo-nosimd"))]
mod tj {
    //! libjpeg-turbo 3.1.0 (bundled in turbojpeg-sys 1.2.0, static) through
    //! the TurboJPEG 3 API. The safe `turbojpeg::Decompressor` has scaling
    //! but no cropping, so the raw bindings (`turbojpeg::raw`) are called
    //! directly, with one handle reused for every image.

    use super::{Crop, Rgb, OUT};
    use turbojpeg::raw;

    /// No DCT scaling.
    pub const NO_SCALE: &[i32] = &[8];
    /// shardstream's rule: 1/2, 1/4 or 1/8 (or none), in eighths.
    pub const POW2_SCALES: &[i32] = &[1, 2, 4, 8];
    /// Every scale libjpeg-turbo offers below 1: n/8, in eighths.
    pub const ALL_SCALES: &[i32] = &[1, 2, 3, 4, 5, 6, 7, 8];

    /// Width in pixels of an iMCU per TJSAMP_* subsampling (turbojpeg.h's
    /// `tjMCUWidth`, a static array the library does not export).
    const MCU_WIDTH: [i32; 7] = [8, 16, 16, 8, 8, 32, 8];

    /// A TurboJPEG decompression handle and whether the fast flags are on.
    pub struct Tj {
        /// The handle from `tj3Init`, never null.
        handle: raw::tjhandle,
        /// Whether TJPARAM_FASTUPSAMPLE and TJPARAM_FASTDCT are set.
        fast: bool,
    }

    impl Drop for Tj {
        fn drop(&mut self) {
            // SAFETY: `handle` came from `tj3Init`, is not null, and is
            // destroyed only here, once.
            unsafe { raw::tj3Destroy(self.handle) }
        }
    }

    /// A decode's pixels and where the crop box lies in them.
    pub struct Decoded {
        /// The decoded region, RGB.
        pub rgb: Rgb,
        /// Left edge of the box in `rgb`, in (scaled) pixels.
        pub bx: f64,
        /// Top edge of the box in `rgb`.
        pub by: f64,
        /// Width of the box in `rgb`.
        pub bw: f64,
        /// Height of the box in `rgb`.
        pub bh: f64,
        /// The DCT scale used, in eighths (8 = none).
        pub eighths: i32,
        /// The JPEG's full width and height.
        pub jpeg: (u32, u32),
    }

    /// Greatest common divisor, to reduce a scale of eighths to lowest
    /// terms (TurboJPEG accepts only the factors it lists).
    fn gcd(a: i32, b: i32) -> i32 {
        if b == 0 {
            a
        } else {
            gcd(b, a % b)
        }
    }

    /// TJSCALED: `dim` scaled by `eighths`/8, rounded up.
    fn scaled(dim: i32, eighths: i32) -> i32 {
        (dim * eighths + 7) / 8
    }

    impl Tj {
        /// A new decompression handle, fast flags off.
        pub fn new() -> Tj {
            // SAFETY: `tj3Init` takes no pointers; its result is checked
            // for null before use.
            let handle = unsafe { raw::tj3Init(raw::TJINIT_TJINIT_DECOMPRESS as libc::c_int) };
            assert!(!handle.is_null(), "tj3Init failed");
            Tj {
                handle,
                fast: false,
            }
        }

        /// Panics with TurboJPEG's message when `rc` is not 0.
        fn check(&self, rc: libc::c_int) {
            if rc != 0 {
                // SAFETY: `tj3GetErrorStr` returns a NUL-terminated string
                // owned by the handle, valid until the next call on it; it
                // is copied at once.
                let msg = unsafe { std::ffi::CStr::from_ptr(raw::tj3GetErrorStr(self.handle)) };
                panic!("turbojpeg: {}", msg.to_string_lossy());
            }
        }

        /// The value of a TJPARAM_* parameter.
        fn get(&self, param: raw::TJPARAM) -> libc::c_int {
            // SAFETY: `handle` is a live handle; no pointers are passed.
            unsafe { raw::tj3Get(self.handle, param as _) }
        }

        /// Sets a TJPARAM_* parameter.
        fn set(&mut self, param: raw::TJPARAM, value: libc::c_int) {
            // SAFETY: `handle` is a live handle; no pointers are passed.
            let rc = unsafe { raw::tj3Set(self.handle, param as _, value) };
            self.check(rc);
        }

        /// TJPARAM_FASTUPSAMPLE (non-fancy chroma upsampling) and
        /// TJPARAM_FASTDCT (the fast integer IDCT) on or off (libjpeg's
        /// defaults, as PIL decodes: off).
        pub fn set_fast(&mut self, fast: bool) {
            if fast != self.fast {
                self.set(raw::TJPARAM_TJPARAM_FASTUPSAMPLE, fast.into());
                self.set(raw::TJPARAM_TJPARAM_FASTDCT, fast.into());
                self.fast = fast;
            }
        }

        /// The whole image at full size (variant `c`).
        pub fn full(&mut self, bytes: &[u8]) -> Rgb {
            self.decode(bytes, None, NO_SCALE).rgb
        }

        /// Decodes `bytes` to RGB. With `crop`, only the box (plus the
        /// resize filter's margin, the left edge aligned down to the iMCU
        /// width) is decoded. `scales`: the allowed DCT scales in eighths;
        /// the smallest at which the box still covers 224x224 is used.
        pub fn decode(&mut self, bytes: &[u8], crop: Option<Crop>, scales: &[i32]) -> Decoded {
            // SAFETY: `handle` is a live handle and the pointer and length
            // describe the live slice `bytes`, which the call only reads.
            let rc =
                unsafe { raw::tj3DecompressHeader(self.handle, bytes.as_ptr(), bytes.len() as _) };
            self.check(rc);
            let width = self.get(raw::TJPARAM_TJPARAM_JPEGWIDTH);
            let height = self.get(raw::TJPARAM_TJPARAM_JPEGHEIGHT);
            let subsamp = self.get(raw::TJPARAM_TJPARAM_SUBSAMP);
            let c = crop.unwrap_or(Crop {
                x: 0,
                y: 0,
                w: width as u32,
                h: height as u32,
                flip: false,
            });
            // The smallest allowed scale at which the box still covers OUT x OUT.
            let mut eighths = 8;
            for &e in scales {
                let (sw, sh) = (scaled(width, e), scaled(height, e));
                let bw = c.w as f64 * sw as f64 / width as f64;
                let bh = c.h as f64 * sh as f64 / height as f64;
                if bw >= OUT as f64 && bh >= OUT as f64 && e < eighths {
                    eighths = e;
                }
            }
            let g = gcd(eighths, 8);
            let factor = raw::tjscalingfactor {
                num: eighths / g,
                denom: 8 / g,
            };
            // SAFETY: `handle` is a live handle; the factor is passed by value.
            let rc = unsafe { raw::tj3SetScalingFactor(self.handle, factor) };
            self.check(rc);
            let (sw, sh) = (scaled(width, eighths), scaled(height, eighths));
            let (fx, fy) = (sw as f64 / width as f64, sh as f64 / height as f64);
            let (bx, by) = (c.x as f64 * fx, c.y as f64 * fy);
            let bw = (c.w as f64 * fx).min(sw as f64 - bx);
            let bh = (c.h as f64 * fy).min(sh as f64 - by);
            let (rx, ry, rw, rh) = if crop.is_some() {
                let mcu = usize::try_from(subsamp)
                    .ok()
                    .and_then(|s| MCU_WIDTH.get(s))
                    .map(|&w| scaled(w, eighths))
                    .expect("unknown chroma subsampling");
                // The antialiased filter reads up to (box / 224) pixels
                // beyond the box's edges (as Pillow's does): decode a margin.
                let mx = (bw / OUT as f64).ceil() + 1.0;
                let my = (bh / OUT as f64).ceil() + 1.0;
                let x0 = ((bx - mx).floor().max(0.0) as i32) / mcu * mcu;
                let y0 = (by - my).floor().max(0.0) as i32;
                let x1 = ((bx + bw + mx).ceil() as i32).min(sw);
                let y1 = ((by + bh + my).ceil() as i32).min(sh);
                (x0, y0, x1 - x0, y1 - y0)
            } else {
                (0, 0, sw, sh)
            };
            let region = if crop.is_some() {
                raw::tjregion {
                    x: rx,
                    y: ry,
                    w: rw,
                    h: rh,
                }
            } else {
                raw::tjregion {
                    x: 0,
                    y: 0,
                    w: 0,
                    h: 0,
                }
            };
            // SAFETY: `handle` is a live handle; the region is passed by value.
            let rc = unsafe { raw::tj3SetCroppingRegion(self.handle, region) };
            self.check(rc);
            let mut px = vec![0u8; (rw * rh * 3) as usize];
            // SAFETY: `handle` is a live handle; `bytes` is a live slice of
            // the given length, only read; `px` is a live, writable buffer
            // of `rh` rows of `rw * 3` bytes (the pitch passed), the size of
            // the scaled, cropped region in RGB that the call writes.
            let rc = unsafe {
                raw::tj3Decompress8(
                    self.handle,
                    bytes.as_ptr(),
                    bytes.len() as _,
                    px.as_mut_ptr(),
                    rw * 3,
                    raw::TJPF_TJPF_RGB as _,
                )
            };
            self.check(rc);
            Decoded {
                rgb: (rw as u32, rh as u32, px),
                bx: bx - rx as f64,
                by: by - ry as f64,
                bw,
                bh,
                eighths,
                jpeg: (width as u32, height as u32),
            }
        }
    }
}

/// The box `(x, y, w, h)` of `src` resampled to 224x224 (antialiased
/// bilinear, as Pillow and shardstream's `Plan::resample`), then laid out
/// CHW, mirrored when `flip` (shardstream's `Layout::Chw`).
fn resize_chw(src: &Rgb, x: f64, y: f64, w: f64, h: f64, flip: bool) -> Vec<u8> {
    let (sw, sh, px) = src;
    let src = ImageRef::new(*sw, *sh, px, PixelType::U8x3).unwrap();
    let mut dst = Pixels::new(OUT, OUT, PixelType::U8x3);
    let opts = ResizeOptions::new()
        .resize_alg(ResizeAlg::Convolution(FilterType::Bilinear))
        .crop(x, y, w, h);
    Resizer::new().resize(&src, &mut dst, &opts).unwrap();
    let (w, h) = (OUT as usize, OUT as usize);
    let rgb = dst.buffer();
    let mut out = vec![0u8; rgb.len()];
    let (red, rest) = out.split_at_mut(w * h);
    let (green, blue) = rest.split_at_mut(w * h);
    for (yy, row) in rgb.chunks_exact(w * 3).enumerate() {
        for (xx, p) in row.chunks_exact(3).enumerate() {
            let at = yy * w + if flip { w - 1 - xx } else { xx };
            red[at] = p[0];
            green[at] = p[1];
            blue[at] = p[2];
        }
    }
    out
}

/// The pipeline after a full-size decode: the crop's box resized, flipped
/// and laid out.
fn pipeline_full(rgb: Rgb, c: &Crop) -> Vec<u8> {
    resize_chw(&rgb, c.x as f64, c.y as f64, c.w as f64, c.h as f64, c.flip)
}

/// A cheap sum over the output, so that no work can be optimized away.
fn checksum(v: &[u8]) -> u64 {
    v.iter().step_by(61).map(|&b| b as u64).sum::<u64>() + v.len() as u64
}

/// Median, minimum and maximum of `v` (not empty).
fn spread(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[0], v[v.len() - 1])
}

/// A named variant: per image (bytes, crop), a checksum of its output.
type Variant<'a> = (&'static str, Box<dyn Fn(&[u8], &Crop) -> u64 + 'a>);

/// Reads the images and boxes, checks the outputs, times every variant and
/// prints the table.
fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        eprintln!(
            "usage: {} <image dir> <boxes.txt> [passes] [variant-substring ...]",
            args[0]
        );
        std::process::exit(2);
    }
    let dir = &args[1];
    let passes: usize = args
        .get(3)
        .map_or(7, |s| s.parse().expect("passes: a number"));
    let filters = &args[args.len().min(4)..];

    let mut names: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "jpg"))
        .collect();
    names.sort();
    let files: Vec<Vec<u8>> = names.iter().map(|p| std::fs::read(p).unwrap()).collect();
    let crops: Vec<Crop> = std::fs::read_to_string(&args[2])
        .unwrap()
        .lines()
        .map(|l| {
            let v: Vec<u32> = l.split_whitespace().map(|s| s.parse().unwrap()).collect();
            Crop {
                x: v[0],
                y: v[1],
                w: v[2],
                h: v[3],
                flip: v[4] != 0,
            }
        })
        .collect();
    assert_eq!(files.len(), crops.len(), "one box per image");
    assert!(!files.is_empty(), "no .jpg files in {dir}");
    let n = files.len();

    #[cfg(any(feature = "turbo", feature = "turbo-nosimd"))]
    let tj = std::cell::RefCell::new(tj::Tj::new());
    let mut variants: Vec<Variant> = vec![
        (
            "a  image 0.25.10 (zune-jpeg 0.5.15) decode",
            Box::new(|b, _| checksum(&image_crate(b).2)),
        ),
        (
            "a' zune-jpeg 0.5.15 direct decode",
            Box::new(|b, _| checksum(&zune_direct(b).2)),
        ),
        (
            "ea image/zune 0.5.15 decode+RRC224+flip",
            Box::new(|b, c| checksum(&pipeline_full(image_crate(b), c))),
        ),
    ];

    #[cfg(any(feature = "turbo", feature = "turbo-nosimd"))]
    {
        use tj::{ALL_SCALES, NO_SCALE, POW2_SCALES};
        let tj = &tj;
        // The cropped (and maybe scaled) decode, with the fast flags or not.
        let crop_decode = move |b: &[u8], c: &Crop, scales: &[i32], fast: bool| {
            let mut t = tj.borrow_mut();
            t.set_fast(fast);
            t.decode(b, Some(*c), scales)
        };
        // The cropped decode's pipeline: its box resized, flipped, laid out.
        let crop_pipe = move |b: &[u8], c: &Crop, scales: &[i32], fast: bool| {
            let d = crop_decode(b, c, scales, fast);
            resize_chw(&d.rgb, d.bx, d.by, d.bw, d.bh, c.flip)
        };
        // The full decode, fast flags off.
        let full = move |b: &[u8]| {
            let mut t = tj.borrow_mut();
            t.set_fast(false);
            t.full(b)
        };
        variants.extend::<Vec<Variant>>(vec![
            (
                "c  turbojpeg full decode",
                Box::new(move |b, _| checksum(&full(b).2)),
            ),
            (
                "d1 turbojpeg crop decode",
                Box::new(move |b, c| checksum(&crop_decode(b, c, NO_SCALE, false).rgb.2)),
            ),
            (
                "d2 turbojpeg crop+scale{1/2;1/4;1/8} decode",
                Box::new(move |b, c| checksum(&crop_decode(b, c, POW2_SCALES, false).rgb.2)),
            ),
            (
                "d3 turbojpeg crop+scale n/8 decode",
                Box::new(move |b, c| checksum(&crop_decode(b, c, ALL_SCALES, false).rgb.2)),
            ),
            (
                "ec turbojpeg full decode+RRC224+flip",
                Box::new(move |b, c| checksum(&pipeline_full(full(b), c))),
            ),
            (
                "ed1 turbojpeg crop decode+RRC224+flip",
                Box::new(move |b, c| checksum(&crop_pipe(b, c, NO_SCALE, false))),
            ),
            (
                "ed2 turbojpeg crop+scale{1/2..1/8}+RRC224+flip",
                Box::new(move |b, c| checksum(&crop_pipe(b, c, POW2_SCALES, false))),
            ),
            (
                "ed3 turbojpeg crop+scale n/8+RRC224+flip",
                Box::new(move |b, c| checksum(&crop_pipe(b, c, ALL_SCALES, false))),
            ),
            (
                "ed1n turbojpeg crop decode+RRC224+flip, new handle per image",
                Box::new(move |b, c| {
                    let d = tj::Tj::new().decode(b, Some(*c), NO_SCALE);
                    checksum(&resize_chw(&d.rgb, d.bx, d.by, d.bw, d.bh, c.flip))
                }),
            ),
            (
                "ed1f turbojpeg crop FASTUPSAMPLE+FASTDCT+RRC224+flip",
                Box::new(move |b, c| checksum(&crop_pipe(b, c, NO_SCALE, true))),
            ),
        ]);

        // How often each scale is picked for these boxes, and how many
        // pixels the cropped decode produces.
        for scales in [POW2_SCALES, ALL_SCALES] {
            let mut hist = [0usize; 9];
            let (mut area_full, mut area_dec) = (0f64, 0f64);
            for (b, c) in files.iter().zip(&crops) {
                let d = crop_decode(b, c, scales, false);
                hist[d.eighths as usize] += 1;
                area_full += d.jpeg.0 as f64 * d.jpeg.1 as f64;
                area_dec += d.rgb.0 as f64 * d.rgb.1 as f64;
            }
            eprintln!(
                "scales {scales:?}: images per chosen scale (eighths 1..8) {:?}; \
                 decoded pixels {:.1}% of full size",
                &hist[1..],
                100.0 * area_dec / area_full
            );
        }

        // The pipelines' outputs against today's (image/zune 0.5.15): mean
        // absolute difference per sample, the largest, and the share of
        // samples off by more than 16.
        let compare = |name: &str, f: &dyn Fn(&[u8], &Crop) -> Vec<u8>| {
            let (mut sum, mut max, mut cnt, mut big) = (0u64, 0u8, 0u64, 0u64);
            for (b, c) in files.iter().zip(&crops) {
                let want = pipeline_full(image_crate(b), c);
                for (x, y) in want.iter().zip(&f(b, c)) {
                    let d = x.abs_diff(*y);
                    sum += d as u64;
                    max = max.max(d);
                    big += (d > 16) as u64;
                    cnt += 1;
                }
            }
            eprintln!(
                "output vs image/zune 0.5.15 pipeline: {name}: mean |diff| {:.3}, max {max}, \
                 {:.4}% of samples off by > 16",
                sum as f64 / cnt as f64,
                100.0 * big as f64 / cnt as f64
            );
        };
        compare("turbojpeg full", &|b, c| pipeline_full(full(b), c));
        compare("turbojpeg crop", &|b, c| crop_pipe(b, c, NO_SCALE, false));
        compare("turbojpeg crop+scale n/8", &|b, c| {
            crop_pipe(b, c, ALL_SCALES, false)
        });
        compare("turbojpeg crop FASTUPSAMPLE+FASTDCT", &|b, c| {
            crop_pipe(b, c, NO_SCALE, true)
        });
    }
    variants.retain(|(name, _)| filters.is_empty() || filters.iter().any(|f| name.contains(f)));

    let mut times: Vec<Vec<(f64, f64)>> = vec![Vec::new(); variants.len()];
    let mut sink = 0u64;
    for pass in 0..=passes {
        for ((_, f), t) in variants.iter().zip(&mut times) {
            let (c0, w0) = (thread_cpu_ns(), Instant::now());
            for (b, c) in files.iter().zip(&crops) {
                sink = sink.wrapping_add(f(b, c));
            }
            let cpu = (thread_cpu_ns() - c0) as f64 / 1e6 / n as f64;
            let wall = w0.elapsed().as_secs_f64() * 1e3 / n as f64;
            if pass > 0 {
                t.push((cpu, wall));
            }
        }
    }
    if let Ok(raw) = std::env::var("RAW") {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(raw)
            .unwrap();
        for ((name, _), t) in variants.iter().zip(&times) {
            for (cpu, wall) in t {
                writeln!(
                    f,
                    "rust,{dir},{},{cpu:.5},{wall:.5}",
                    name.replace(',', ";")
                )
                .unwrap();
            }
        }
    }
    println!("# {n} images from {dir}, {passes} passes (+1 warm-up), ms per image; sink {sink}");
    println!("| variant | CPU ms median | CPU min-max | wall ms median | wall min-max |");
    println!("|---|---|---|---|---|");
    for ((name, _), t) in variants.iter().zip(&times) {
        let (c, cmin, cmax) = spread(t.iter().map(|p| p.0).collect());
        let (w, wmin, wmax) = spread(t.iter().map(|p| p.1).collect());
        println!("| {name} | {c:.3} | {cmin:.3}-{cmax:.3} | {w:.3} | {wmin:.3}-{wmax:.3} |");
    }
}
