//! `shardstream.Image`: the image transform's parameters, checked when it
//! is built, for `decode={"jpg": Image(...)}`.

use std::sync::Arc;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyString, PyTuple};

use super::errors;
use crate::augment::image::{Crop, ImageSpec, Layout};

/// Decode a JPEG or PNG field and crop, resize and flip it to one fixed
/// shape, on the decode threads (see `docs/augment.md`).
#[pyclass(module = "shardstream._core", frozen)]
pub struct Image {
    pub(crate) spec: Arc<ImageSpec>,
}

/// What `Image.__getnewargs_ex__` returns: `(size,)` and the keywords.
type NewArgs<'py> = ((Option<(u32, u32)>,), Bound<'py, PyDict>);

/// A `TypeError` naming the parameter, the expected type and the value.
fn wrong_type(parameter: &str, expected: &str, value: &Bound<'_, PyAny>) -> PyErr {
    errors::wrong_type(&format!("Image parameter {parameter}"), expected, value)
}

fn is_int(value: &Bound<'_, PyAny>) -> bool {
    value.is_instance_of::<PyInt>() && !value.is_instance_of::<PyBool>()
}

/// A non-negative int that fits in `u32` (a larger one is a `ValueError`
/// from the range check of [`ImageSpec::new`]).
fn side(parameter: &str, expected: &str, value: &Bound<'_, PyAny>) -> PyResult<u32> {
    if !is_int(value) {
        return Err(wrong_type(parameter, expected, value));
    }
    let side: i64 = value.extract().map_err(|_| {
        PyValueError::new_err(format!(
            "invalid Image parameter {parameter}: {} is out of range",
            value.repr().map_or_else(|_| "?".into(), |r| r.to_string())
        ))
    })?;
    Ok(side.clamp(0, i64::from(u32::MAX)) as u32)
}

/// `size`: an int (a square) or a `(height, width)` pair of ints.
fn size(value: &Bound<'_, PyAny>) -> PyResult<(u32, u32)> {
    let expected = "an int or a (height, width) tuple of ints";
    if is_int(value) {
        let s = side("size", expected, value)?;
        return Ok((s, s));
    }
    let pair = value
        .cast::<PyTuple>()
        .ok()
        .filter(|t| t.len() == 2)
        .ok_or_else(|| wrong_type("size", expected, value))?;
    Ok((
        side("size", expected, &pair.get_item(0)?)?,
        side("size", expected, &pair.get_item(1)?)?,
    ))
}

/// A number (int or float, not a bool).
fn number(parameter: &str, expected: &str, value: &Bound<'_, PyAny>) -> PyResult<f64> {
    if !(value.is_instance_of::<PyFloat>() || is_int(value)) {
        return Err(wrong_type(parameter, expected, value));
    }
    value.extract()
}

/// `scale` or `ratio`: a `(min, max)` pair of numbers.
fn range(parameter: &str, value: &Bound<'_, PyAny>) -> PyResult<(f64, f64)> {
    let expected = "a (min, max) tuple of numbers";
    let pair = value
        .cast::<PyTuple>()
        .ok()
        .filter(|t| t.len() == 2)
        .ok_or_else(|| wrong_type(parameter, expected, value))?;
    Ok((
        number(parameter, expected, &pair.get_item(0)?)?,
        number(parameter, expected, &pair.get_item(1)?)?,
    ))
}

fn text(parameter: &str, expected: &str, value: &Bound<'_, PyAny>) -> PyResult<String> {
    if !value.is_instance_of::<PyString>() {
        return Err(wrong_type(parameter, expected, value));
    }
    value.extract()
}

#[pymethods]
impl Image {
    /// Checks every parameter (a `TypeError` or `ValueError` naming it).
    #[new]
    #[pyo3(signature = (size=None, *, crop=Some("random_resized".to_owned()), scale=None, ratio=None, resize=None, flip=None, layout=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        size: Option<&Bound<'_, PyAny>>,
        crop: Option<String>,
        scale: Option<&Bound<'_, PyAny>>,
        ratio: Option<&Bound<'_, PyAny>>,
        resize: Option<&Bound<'_, PyAny>>,
        flip: Option<&Bound<'_, PyAny>>,
        layout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let spec = ImageSpec::new(
            size.map(self::size).transpose()?,
            crop.as_deref(),
            scale.map(|v| range("scale", v)).transpose()?,
            ratio.map(|v| range("ratio", v)).transpose()?,
            resize.map(|v| side("resize", "an int", v)).transpose()?,
            flip.map(|v| number("flip", "a number from 0 to 1", v))
                .transpose()?,
            layout
                .map(|v| text("layout", "\"CHW\" or \"HWC\"", v))
                .transpose()?
                .as_deref(),
        )
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(Image {
            spec: Arc::new(spec),
        })
    }

    /// Output `(height, width)`, or `None` with `crop=None`.
    #[getter]
    fn size(&self) -> Option<(u32, u32)> {
        self.spec.size
    }

    /// `"random_resized"`, `"center"`, `"resize"` or `None`.
    #[getter]
    fn crop(&self) -> Option<&'static str> {
        match self.spec.crop {
            Crop::RandomResized { .. } => Some("random_resized"),
            Crop::Center { .. } => Some("center"),
            Crop::Resize => Some("resize"),
            Crop::Full => None,
        }
    }

    /// The area range of `random_resized` boxes, else `None`.
    #[getter]
    fn scale(&self) -> Option<(f64, f64)> {
        match self.spec.crop {
            Crop::RandomResized { scale, .. } => Some(scale),
            _ => None,
        }
    }

    /// The aspect ratio range of `random_resized` boxes, else `None`.
    #[getter]
    fn ratio(&self) -> Option<(f64, f64)> {
        match self.spec.crop {
            Crop::RandomResized { ratio, .. } => Some(ratio),
            _ => None,
        }
    }

    /// The shorter side before a `center` crop, else `None`.
    #[getter]
    fn resize(&self) -> Option<u32> {
        match self.spec.crop {
            Crop::Center { resize } => Some(resize),
            _ => None,
        }
    }

    /// The probability of a horizontal flip.
    #[getter]
    fn flip(&self) -> f64 {
        self.spec.flip
    }

    /// `"CHW"` or `"HWC"`.
    #[getter]
    fn layout(&self) -> &'static str {
        match self.spec.layout {
            Layout::Chw => "CHW",
            Layout::Hwc => "HWC",
        }
    }

    /// Pickling rebuilds it from its parameters.
    fn __getnewargs_ex__<'py>(&self, py: Python<'py>) -> PyResult<NewArgs<'py>> {
        let keywords = PyDict::new(py);
        keywords.set_item("crop", self.crop())?;
        keywords.set_item("scale", self.scale())?;
        keywords.set_item("ratio", self.ratio())?;
        keywords.set_item("resize", self.resize())?;
        keywords.set_item("flip", self.flip())?;
        keywords.set_item("layout", self.layout())?;
        Ok(((self.size(),), keywords))
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other
            .cast::<Image>()
            .is_ok_and(|other| other.get().spec == self.spec)
    }

    fn __repr__(&self) -> String {
        self.spec.to_string()
    }
}

/// Leave a JPEG field as it is and add `<field>_box`: the source box and
/// flip `Image` would draw for it, for a batched decoder elsewhere (see
/// `shardstream.gpu.BatchImageDecoder`).
#[pyclass(module = "shardstream._core", frozen)]
pub struct ImageBoxes {
    pub(crate) spec: Arc<ImageSpec>,
    image: Py<Image>,
}

#[pymethods]
impl ImageBoxes {
    /// The boxes of `image`: a `ValueError` when it has no output size, or
    /// a `center` crop whose `resize` is below an output side.
    #[new]
    fn new(image: &Bound<'_, PyAny>) -> PyResult<Self> {
        let image = image
            .cast::<Image>()
            .map_err(|_| {
                errors::wrong_type("ImageBoxes parameter image", "a shardstream.Image", image)
            })?
            .clone();
        let spec = image.get().spec.clone();
        spec.check_boxes()
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(ImageBoxes {
            spec,
            image: image.unbind(),
        })
    }

    /// The `Image` whose boxes these are.
    #[getter]
    fn image(&self, py: Python<'_>) -> Py<Image> {
        self.image.clone_ref(py)
    }

    /// Pickling rebuilds it from its `Image`.
    fn __getnewargs__(&self, py: Python<'_>) -> (Py<Image>,) {
        (self.image.clone_ref(py),)
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other
            .cast::<ImageBoxes>()
            .is_ok_and(|other| other.get().spec == self.spec)
    }

    fn __repr__(&self) -> String {
        format!("ImageBoxes({})", self.spec)
    }
}
