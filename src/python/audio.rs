//! `shardstream.AudioClip`: the audio clip transform's parameters, checked
//! when it is built, for `decode={"wav": AudioClip(...)}`.

use std::sync::Arc;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};

use super::errors;
use crate::augment::audio::{AudioSpec, Channels, Crop};

/// Decode a WAV or FLAC field to a float32 clip of one fixed shape: mixed
/// to mono or picked channels, resampled, cropped or padded (see
/// `docs/augment.md`). The number of real frames of each clip comes as the
/// field `<field>_frames`.
#[pyclass(module = "shardstream._core", frozen)]
pub struct AudioClip {
    pub(crate) spec: Arc<AudioSpec>,
}

/// A `TypeError` naming the parameter, the expected type and the value.
fn wrong_type(parameter: &str, expected: &str, value: &Bound<'_, PyAny>) -> PyErr {
    errors::wrong_type(&format!("AudioClip parameter {parameter}"), expected, value)
}

/// A `ValueError` naming the parameter.
fn out_of_range(parameter: &str, reason: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(format!("invalid AudioClip parameter {parameter}: {reason}"))
}

/// An int (not a bool) in `0..=max`.
fn int_at_most(parameter: &str, value: &Bound<'_, PyAny>, max: u64) -> PyResult<u64> {
    if !value.is_instance_of::<PyInt>() || value.is_instance_of::<PyBool>() {
        return Err(wrong_type(parameter, "an int", value));
    }
    value
        .extract::<u64>()
        .ok()
        .filter(|n| *n <= max)
        .ok_or_else(|| {
            let shown = value.repr().map_or_else(|_| "?".into(), |r| r.to_string());
            out_of_range(parameter, format!("{shown} is out of range (0 to {max})"))
        })
}

/// A number (int or float, not a bool).
fn number(parameter: &str, value: &Bound<'_, PyAny>) -> PyResult<f64> {
    if !(value.is_instance_of::<PyFloat>()
        || value.is_instance_of::<PyInt>() && !value.is_instance_of::<PyBool>())
    {
        return Err(wrong_type(parameter, "a number", value));
    }
    value.extract()
}

/// `channels`: `"mono"` or a list (or tuple) of channel indices.
fn channels(value: &Bound<'_, PyAny>) -> PyResult<Channels> {
    let expected = "\"mono\" or a list of channel indices";
    if let Ok(text) = value.cast::<PyString>() {
        return match text.to_str()? {
            "mono" => Ok(Channels::Mono),
            _ => Err(out_of_range(
                "channels",
                format!("expected {expected}, got {}", text.repr()?),
            )),
        };
    }
    let items: Vec<Bound<'_, PyAny>> = if let Ok(list) = value.cast::<PyList>() {
        list.iter().collect()
    } else if let Ok(tuple) = value.cast::<PyTuple>() {
        tuple.iter().collect()
    } else {
        return Err(wrong_type("channels", expected, value));
    };
    items
        .iter()
        .map(|item| int_at_most("channels", item, u64::from(u16::MAX)).map(|c| c as u16))
        .collect::<PyResult<_>>()
        .map(Channels::Pick)
}

#[pymethods]
impl AudioClip {
    /// Checks every parameter (a `TypeError` or `ValueError` naming it).
    #[new]
    #[pyo3(signature = (*, sample_rate=None, channels=None, frames=None, seconds=None, crop=None, pad=None))]
    fn new(
        sample_rate: Option<&Bound<'_, PyAny>>,
        channels: Option<&Bound<'_, PyAny>>,
        frames: Option<&Bound<'_, PyAny>>,
        seconds: Option<&Bound<'_, PyAny>>,
        crop: Option<&Bound<'_, PyAny>>,
        pad: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let sample_rate = match sample_rate {
            Some(rate) => int_at_most("sample_rate", rate, u64::from(u32::MAX))? as u32,
            None => 16000,
        };
        let channels = channels.map(self::channels).transpose()?;
        let frames = frames
            .map(|v| int_at_most("frames", v, u64::MAX))
            .transpose()?;
        let seconds = seconds.map(|v| number("seconds", v)).transpose()?;
        let crop = match crop {
            None => Crop::Random,
            Some(value) => {
                let expected = "\"random\", \"start\" or \"center\"";
                let name = value
                    .cast::<PyString>()
                    .map_err(|_| wrong_type("crop", expected, value))?
                    .to_str()?;
                Crop::parse(name).ok_or_else(|| {
                    out_of_range("crop", format!("expected {expected}, got {name:?}"))
                })?
            }
        };
        let pad = pad.map(|v| number("pad", v)).transpose()?.unwrap_or(0.0);
        let spec = AudioSpec::new(
            sample_rate,
            channels.unwrap_or(Channels::Mono),
            frames,
            seconds,
            crop,
            pad as f32,
        )
        .map_err(|e| out_of_range(e.parameter, e.reason))?;
        Ok(AudioClip {
            spec: Arc::new(spec),
        })
    }

    /// The output sample rate.
    #[getter]
    fn sample_rate(&self) -> u32 {
        self.spec.sample_rate()
    }

    /// `"mono"` or the list of channel indices.
    #[getter]
    fn channels<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        match self.spec.channels() {
            Channels::Mono => Ok(PyString::new(py, "mono").into_any()),
            Channels::Pick(list) => Ok(PyList::new(py, list)?.into_any()),
        }
    }

    /// Frames per clip.
    #[getter]
    fn frames(&self) -> usize {
        self.spec.frames()
    }

    /// `"random"`, `"start"` or `"center"`.
    #[getter]
    fn crop(&self) -> &'static str {
        self.spec.crop().name()
    }

    /// The value of padded frames.
    #[getter]
    fn pad(&self) -> f32 {
        self.spec.pad()
    }

    /// The shape of every clip: `(frames,)` or `(channels, frames)`.
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.spec.shape())
    }

    /// Pickling rebuilds it from its parameters.
    fn __getnewargs_ex__<'py>(&self, py: Python<'py>) -> PyResult<((), Bound<'py, PyDict>)> {
        let keywords = PyDict::new(py);
        keywords.set_item("sample_rate", self.sample_rate())?;
        keywords.set_item("channels", self.channels(py)?)?;
        keywords.set_item("frames", self.frames())?;
        keywords.set_item("crop", self.crop())?;
        keywords.set_item("pad", self.pad())?;
        Ok(((), keywords))
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other
            .cast::<AudioClip>()
            .is_ok_and(|other| other.get().spec == self.spec)
    }

    fn __repr__(&self) -> String {
        self.spec.to_string()
    }
}
