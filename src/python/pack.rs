//! `shardstream.Pack`: the `pack` option, checked when it is built.

use std::sync::Arc;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyInt, PyString};

use super::errors;
use crate::text::pack::{PackMode, PackSpec, DEFAULT_WINDOW};

/// Pack each document's token ids into sequences of `seq_len + 1` tokens
/// (`input_ids`, `position_ids`, `cu_seqlens`; see `docs/text.md`).
#[pyclass(module = "shardstream._core", frozen)]
pub struct Pack {
    pub(crate) spec: Arc<PackSpec>,
}

/// An int parameter (not a bool), as `T`.
fn int_param<T: for<'a> FromPyObject<'a, 'a>>(name: &str, value: &Bound<'_, PyAny>) -> PyResult<T> {
    if !value.is_instance_of::<PyInt>() || value.is_instance_of::<PyBool>() {
        return Err(errors::wrong_type(
            &format!("Pack parameter {name}"),
            "an int",
            value,
        ));
    }
    value.extract().map_err(|_| {
        PyValueError::new_err(format!(
            "invalid Pack parameter {name}: {} is out of range",
            value.repr().map_or_else(|_| "?".into(), |r| r.to_string())
        ))
    })
}

#[pymethods]
impl Pack {
    /// Checks every parameter: `seq_len` tokens a step trains on; `mode`
    /// `"concat"` or `"best_fit"` (with `window` open sequences); `field`
    /// the field of token ids (`None`: the one `decode` tokenizes);
    /// `labels` hands out `labels` apart; `pad_id` fills the unused slots.
    #[new]
    #[pyo3(signature = (seq_len, *, mode=None, field=None, window=None, labels=None, pad_id=None))]
    fn new(
        seq_len: &Bound<'_, PyAny>,
        mode: Option<&Bound<'_, PyAny>>,
        field: Option<&Bound<'_, PyAny>>,
        window: Option<&Bound<'_, PyAny>>,
        labels: Option<&Bound<'_, PyAny>>,
        pad_id: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let seq_len = int_param::<usize>("seq_len", seq_len)?;
        let window = window
            .map(|w| int_param::<usize>("window", w))
            .transpose()?;
        let mode = match mode.map(|m| m.cast::<PyString>().map(|s| s.to_string())) {
            None => PackMode::Concat,
            Some(Ok(name)) if name == "concat" => PackMode::Concat,
            Some(Ok(name)) if name == "best_fit" => PackMode::BestFit {
                window: window.unwrap_or(DEFAULT_WINDOW),
            },
            Some(Ok(name)) => {
                return Err(PyValueError::new_err(format!(
                    "invalid Pack parameter mode: {name:?} is not \"concat\" or \"best_fit\""
                )))
            }
            Some(Err(_)) => {
                let given = mode.expect("matched Some");
                return Err(errors::wrong_type(
                    "Pack parameter mode",
                    "\"concat\" or \"best_fit\"",
                    given,
                ));
            }
        };
        if window.is_some() && mode == PackMode::Concat {
            return Err(PyValueError::new_err(
                "invalid Pack parameter window: it is the open sequences of mode=\"best_fit\"",
            ));
        }
        let field = match field.filter(|f| !f.is_none()) {
            None => None,
            Some(value) => Some(
                value
                    .cast::<PyString>()
                    .map_err(|_| {
                        errors::wrong_type("Pack parameter field", "None or a str", value)
                    })?
                    .to_string(),
            ),
        };
        let labels = match labels {
            None => false,
            Some(value) if value.is_instance_of::<PyBool>() => value.extract()?,
            Some(value) => {
                return Err(errors::wrong_type("Pack parameter labels", "a bool", value))
            }
        };
        let pad_id = pad_id
            .map(|p| int_param::<i32>("pad_id", p))
            .transpose()?
            .unwrap_or(0);
        let spec =
            PackSpec::new(field, seq_len, mode, labels, pad_id).map_err(|(name, reason)| {
                PyValueError::new_err(format!("invalid Pack parameter {name}: {reason}"))
            })?;
        Ok(Pack {
            spec: Arc::new(spec),
        })
    }

    /// Tokens a step trains on.
    #[getter]
    fn seq_len(&self) -> usize {
        self.spec.seq_len
    }

    /// `"concat"` or `"best_fit"`.
    #[getter]
    fn mode(&self) -> &'static str {
        self.spec.mode_name()
    }

    /// The field of token ids (`None`: the one `decode` tokenizes).
    #[getter]
    fn field(&self) -> Option<String> {
        self.spec.field.clone()
    }

    /// Open sequences `"best_fit"` keeps (`None` for `"concat"`).
    #[getter]
    fn window(&self) -> Option<usize> {
        match self.spec.mode {
            PackMode::Concat => None,
            PackMode::BestFit { window } => Some(window),
        }
    }

    /// Whether `labels` come apart from `input_ids`.
    #[getter]
    fn labels(&self) -> bool {
        self.spec.labels
    }

    /// The id that fills the unused end of a sequence.
    #[getter]
    fn pad_id(&self) -> i32 {
        self.spec.pad_id
    }

    /// Pickling passes the parameters again.
    fn __getnewargs_ex__<'py>(&self, py: Python<'py>) -> PyResult<((usize,), Bound<'py, PyDict>)> {
        let kwargs = PyDict::new(py);
        kwargs.set_item("mode", self.mode())?;
        kwargs.set_item("field", self.field())?;
        kwargs.set_item("window", self.window())?;
        kwargs.set_item("labels", self.spec.labels)?;
        kwargs.set_item("pad_id", self.spec.pad_id)?;
        Ok(((self.spec.seq_len,), kwargs))
    }

    fn __repr__(&self) -> String {
        self.spec.to_string()
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other
            .cast::<Pack>()
            .is_ok_and(|other| *other.get().spec == *self.spec)
    }
}
