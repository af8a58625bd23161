//! `shardstream.Tokenizer`: a `tokenizer.json` loaded and checked when it
//! is built, for `decode={"text": Tokenizer(...)}`.

use std::path::PathBuf;
use std::sync::Arc;

use pyo3::exceptions::{PyFileNotFoundError, PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyInt, PyString};

use super::blocking::interruptible;
use super::convert::{value_to_py, BytesOut};
use super::errors;
use crate::config::StoreOptions;
use crate::location::Location;
use crate::store;
use crate::text::tokenizer::{TokenRef, TokenizerSpec};

/// What pickling passes to `Tokenizer.from_str`: the file's text, `bos`,
/// `eos` and `add_special_tokens`.
type RebuildArgs = (String, Option<u32>, Option<u32>, bool);

/// The most bytes a `tokenizer.json` may have.
const TOKENIZER_LIMIT: usize = 1 << 30;

/// Tokenize a text field (a text value, or UTF-8 bytes) to an int32 array
/// of token ids on the decode threads, with a Hugging Face
/// `tokenizer.json` (see `docs/text.md`).
#[pyclass(module = "shardstream._core", frozen)]
pub struct Tokenizer {
    pub(crate) spec: Arc<TokenizerSpec>,
}

/// `bos=` or `eos=`: `None`, a token id or a token's text.
fn token(parameter: &str, value: Option<&Bound<'_, PyAny>>) -> PyResult<Option<TokenRef>> {
    let Some(value) = value.filter(|v| !v.is_none()) else {
        return Ok(None);
    };
    if let Ok(text) = value.cast::<PyString>() {
        return Ok(Some(TokenRef::Text(text.to_str()?.to_owned())));
    }
    if value.is_instance_of::<PyInt>() && !value.is_instance_of::<PyBool>() {
        if let Ok(id) = value.extract::<u32>() {
            return Ok(Some(TokenRef::Id(id)));
        }
        let shown = value.repr()?;
        return Err(PyValueError::new_err(format!(
            "invalid Tokenizer parameter {parameter}: id {shown} is out of range (0 to {})",
            u32::MAX
        )));
    }
    Err(errors::wrong_type(
        &format!("Tokenizer parameter {parameter}"),
        "None, a token id (int) or a token (str)",
        value,
    ))
}

/// `add_special_tokens=`: a bool, `True` when not given.
fn flag(value: Option<&Bound<'_, PyAny>>) -> PyResult<bool> {
    let Some(value) = value else {
        return Ok(true);
    };
    if !value.is_instance_of::<PyBool>() {
        return Err(errors::wrong_type(
            "Tokenizer parameter add_special_tokens",
            "a bool",
            value,
        ));
    }
    value.extract()
}

/// The spec of `json`, or a `ValueError` naming `source` and the parameter.
fn build(
    source: &str,
    json: String,
    bos: Option<&Bound<'_, PyAny>>,
    eos: Option<&Bound<'_, PyAny>>,
    add_special_tokens: Option<&Bound<'_, PyAny>>,
) -> PyResult<Tokenizer> {
    let bos = token("bos", bos)?;
    let eos = token("eos", eos)?;
    let add_special_tokens = flag(add_special_tokens)?;
    let spec = TokenizerSpec::new(json, bos, eos, add_special_tokens).map_err(|e| {
        let reason = e.reason;
        PyValueError::new_err(match e.parameter {
            "json" => format!("invalid tokenizer {source}: {reason}"),
            parameter => format!("invalid Tokenizer parameter {parameter}: {reason}"),
        })
    })?;
    Ok(Tokenizer {
        spec: Arc::new(spec),
    })
}

/// The text of the `tokenizer.json` at `source` (a local path, or a URL
/// read with the environment's credentials).
fn read_source(py: Python<'_>, source: &str) -> PyResult<String> {
    let bytes = match Location::parse(source) {
        Location::Local(path) => std::fs::read(&path).map_err(|e| {
            let message = format!("cannot read tokenizer {source}: {e}");
            match e.kind() {
                std::io::ErrorKind::NotFound => PyFileNotFoundError::new_err(message),
                _ => PyOSError::new_err(message),
            }
        })?,
        _ => {
            let url = source.to_owned();
            interruptible(py, move || {
                store::read_small_object(&StoreOptions::default(), &url, TOKENIZER_LIMIT)
            })?
            .ok_or_else(|| PyFileNotFoundError::new_err(format!("tokenizer not found: {source}")))?
        }
    };
    String::from_utf8(bytes).map_err(|e| {
        PyValueError::new_err(format!(
            "invalid tokenizer {source}: not UTF-8 text (invalid byte at offset {})",
            e.utf8_error().valid_up_to()
        ))
    })
}

#[pymethods]
impl Tokenizer {
    /// Loads `source` (a `tokenizer.json`: a local path, or a `s3://`,
    /// `gs://`, `hf://` or `http(s)://` URL) and checks every parameter.
    #[new]
    #[pyo3(signature = (source, *, bos=None, eos=None, add_special_tokens=None))]
    fn new(
        py: Python<'_>,
        source: &Bound<'_, PyAny>,
        bos: Option<&Bound<'_, PyAny>>,
        eos: Option<&Bound<'_, PyAny>>,
        add_special_tokens: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let source = match source.cast::<PyString>() {
            Ok(text) => text.to_str()?.to_owned(),
            Err(_) => source
                .extract::<PathBuf>()
                .map_err(|_| {
                    errors::wrong_type(
                        "Tokenizer parameter source",
                        "a path or a URL of a tokenizer.json",
                        source,
                    )
                })?
                .to_string_lossy()
                .into_owned(),
        };
        let json = read_source(py, &source)?;
        build(&source, json, bos, eos, add_special_tokens)
    }

    /// A tokenizer from the text of a `tokenizer.json` (what
    /// `tokenizers.Tokenizer.to_str()` gives).
    #[staticmethod]
    #[pyo3(signature = (json, bos=None, eos=None, add_special_tokens=None))]
    fn from_str(
        json: &Bound<'_, PyAny>,
        bos: Option<&Bound<'_, PyAny>>,
        eos: Option<&Bound<'_, PyAny>>,
        add_special_tokens: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let json = json
            .cast::<PyString>()
            .map_err(|_| {
                errors::wrong_type(
                    "Tokenizer parameter json",
                    "the text of a tokenizer.json",
                    json,
                )
            })?
            .to_str()?
            .to_owned();
        build("text", json, bos, eos, add_special_tokens)
    }

    /// The token ids of `text`, as the decode threads give them: an int32
    /// numpy array.
    fn encode<'py>(&self, py: Python<'py>, text: &str) -> PyResult<Bound<'py, PyAny>> {
        let spec = self.spec.clone();
        let text = text.to_owned();
        let ids = py.detach(move || spec.encode(&text)).map_err(|reason| {
            PyValueError::new_err(format!("cannot tokenize the text: {reason}"))
        })?;
        let value = crate::Value::Array(crate::Array {
            shape: vec![ids.len()],
            data: crate::ArrayData::I32(ids),
        });
        value_to_py(py, value, BytesOut::Plain)
    }

    /// The id put before every text, or `None`.
    #[getter]
    fn bos(&self) -> Option<u32> {
        self.spec.bos()
    }

    /// The id put after every text, or `None`.
    #[getter]
    fn eos(&self) -> Option<u32> {
        self.spec.eos()
    }

    /// Whether the tokenizer's own special tokens (its post-processor's)
    /// are added.
    #[getter]
    fn add_special_tokens(&self) -> bool {
        self.spec.add_special_tokens()
    }

    /// Tokens in the vocabulary, added tokens included.
    #[getter]
    fn vocab_size(&self) -> usize {
        self.spec.vocab_size()
    }

    /// The id of `token`, or `None` when it is not in the vocabulary.
    fn token_to_id(&self, token: &str) -> Option<u32> {
        self.spec.token_to_id(token)
    }

    /// The text of the `tokenizer.json`.
    fn to_str(&self) -> &str {
        self.spec.json()
    }

    /// Pickling rebuilds it from the file's text (not its source, which
    /// another process may not reach or may find changed).
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<(Bound<'py, PyAny>, RebuildArgs)> {
        let this = slf.get();
        let rebuild = slf.get_type().getattr("from_str")?;
        Ok((
            rebuild,
            (
                this.spec.json().to_owned(),
                this.spec.bos(),
                this.spec.eos(),
                this.spec.add_special_tokens(),
            ),
        ))
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other
            .cast::<Tokenizer>()
            .is_ok_and(|other| other.get().spec == self.spec)
    }

    fn __repr__(&self) -> String {
        self.spec.to_string()
    }
}
