//! `ShardWriter`: sample dicts from Python, their values turned into
//! [`FieldValue`]s (JSON text made by Python's own `json.dumps`, so it is
//! byte for byte what webdataset writes), written by the Rust writer with
//! the GIL released.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{
    PyBool, PyByteArray, PyBytes, PyDict, PyFloat, PyInt, PyList, PyMemoryView, PyString, PyTuple,
};

use std::sync::{Mutex, PoisonError, TryLockError};

use super::blocking::blocking;
use super::errors::to_py;
use super::options::{s3_options, writer_options};
use crate::error::Error;
use crate::manifest::Manifest;
use crate::write::{self, FieldValue};

/// Writes WebDataset shards (see `shardstream.ShardWriter`).
#[pyclass(module = "shardstream._core")]
pub struct ShardWriter {
    /// The writer. Calls from several threads take turns: each waits for
    /// it with the GIL released, so a write is never refused for another
    /// thread's write in progress.
    inner: Mutex<write::ShardWriter>,
    /// The process the writer was made in, checked before the lock is
    /// taken: a forked child may have been forked while another thread
    /// held it.
    pid: u32,
    /// Where the manifest goes, for the errors of a forked child.
    manifest_url: String,
}

impl ShardWriter {
    /// Refuses any use from a process forked from the writer's.
    fn check_process(&self) -> PyResult<()> {
        if std::process::id() == self.pid {
            Ok(())
        } else {
            Err(self.forked_error())
        }
    }

    /// The error of a call from a process forked from the writer's.
    fn forked_error(&self) -> PyErr {
        to_py(Error::Write {
            url: self.manifest_url.clone(),
            offset: 0,
            reason: write::forked_reason(self.pid),
        })
    }

    /// Runs `f` on the writer with the GIL released, once no other
    /// thread's call holds it.
    fn with_writer<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut write::ShardWriter) -> crate::Result<T> + Send,
    ) -> PyResult<T> {
        self.check_process()?;
        let inner = &self.inner;
        blocking(py, move || {
            let mut writer = inner.lock().map_err(|_| {
                Error::Stopped(
                    "the shard writer stopped: a call from another thread failed inside it".into(),
                )
            })?;
            f(&mut writer)
        })
    }

    /// Reads from the writer (a counter or a name). In a forked child the
    /// lock is only tried: a thread of the parent may have held it.
    fn read<T>(&self, f: impl FnOnce(&write::ShardWriter) -> T) -> PyResult<T> {
        let writer = if std::process::id() == self.pid {
            self.inner.lock().unwrap_or_else(PoisonError::into_inner)
        } else {
            match self.inner.try_lock() {
                Ok(writer) => writer,
                Err(TryLockError::Poisoned(e)) => e.into_inner(),
                Err(TryLockError::WouldBlock) => return Err(self.forked_error()),
            }
        };
        Ok(f(&writer))
    }
}

/// `text` as UTF-8; a str holding a lone surrogate (what `os.listdir`
/// gives for a file name that is not UTF-8) has none: a `ValueError`
/// naming `what` (with its repr), and the sample and field where known.
fn utf8<'a>(
    text: &'a Bound<'_, PyString>,
    key: Option<&str>,
    field: Option<&str>,
    what: &str,
) -> PyResult<&'a str> {
    text.to_str().map_err(|_| {
        let shown = text
            .repr()
            .map(|r| r.to_string())
            .unwrap_or_else(|_| "?".into());
        to_py(Error::InvalidSample {
            key: key.map(str::to_owned),
            field: field.map(str::to_owned),
            reason: format!(
                "{what} {shown} is not valid Unicode: it holds a lone surrogate, as os.listdir \
                 gives for a name that is not UTF-8 (write bytes, os.fsencode(name), or \
                 decode the name as it is meant)"
            ),
            wrong_type: false,
        })
    })
}

/// A refused value of field `field` of sample `key`.
fn wrong_type(key: &str, field: &str, reason: String) -> PyErr {
    to_py(Error::InvalidSample {
        key: Some(key.to_owned()),
        field: Some(field.to_owned()),
        reason,
        wrong_type: true,
    })
}

/// `value` of field `field` as the writer takes it.
fn field_value(key: &str, field: &str, value: &Bound<'_, PyAny>) -> PyResult<FieldValue> {
    let py = value.py();
    let type_name = || {
        value
            .get_type()
            .name()
            .map(|n| n.to_string())
            .unwrap_or_else(|_| "?".into())
    };
    let json_dumps = |value: &Bound<'_, PyAny>| -> PyResult<String> {
        py.import("json")?
            .call_method1("dumps", (value,))
            .and_then(|text| text.extract())
            .map_err(|e| wrong_type(key, field, format!("cannot be written as JSON: {e}")))
    };
    if let Ok(bytes) = value.cast::<PyBytes>() {
        return Ok(FieldValue::Bytes(bytes.as_bytes().to_vec()));
    }
    if let Ok(bytes) = value.cast::<PyByteArray>() {
        return Ok(FieldValue::Bytes(bytes.to_vec()));
    }
    if value.is_instance_of::<PyMemoryView>() {
        let bytes = value.call_method0("tobytes")?;
        let bytes = bytes.cast::<PyBytes>()?;
        return Ok(FieldValue::Bytes(bytes.as_bytes().to_vec()));
    }
    if let Ok(text) = value.cast::<PyString>() {
        return Ok(FieldValue::Text(
            utf8(text, Some(key), Some(field), "the str value")?.to_owned(),
        ));
    }
    let is_number = value.is_instance_of::<PyBool>()
        || value.is_instance_of::<PyInt>()
        || value.is_instance_of::<PyFloat>();
    if is_number {
        return Ok(FieldValue::Number {
            kind: type_name(),
            text: value.str()?.to_str()?.to_owned(),
            json: json_dumps(value)?,
        });
    }
    let is_json = value.is_instance_of::<PyDict>()
        || value.is_instance_of::<PyList>()
        || value.is_instance_of::<PyTuple>();
    if is_json {
        return Ok(FieldValue::Json {
            kind: type_name(),
            json: json_dumps(value)?,
        });
    }
    Err(wrong_type(
        key,
        field,
        format!(
            "values of type {} cannot be written: give bytes, str, int, float, bool, dict or list (encode other values to bytes first)",
            type_name()
        ),
    ))
}

#[pymethods]
impl ShardWriter {
    /// A writer of shards named by `pattern`; options are checked here.
    #[new]
    #[pyo3(signature = (pattern, **options))]
    fn new(py: Python<'_>, pattern: String, options: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        let options = writer_options(options)?;
        let inner = blocking(py, move || write::ShardWriter::new(&pattern, options))?;
        Ok(ShardWriter {
            manifest_url: inner.manifest_url(),
            pid: std::process::id(),
            inner: Mutex::new(inner),
        })
    }

    /// Writes one sample: a dict with `__key__` (str) and its fields.
    fn write(&self, py: Python<'_>, sample: &Bound<'_, PyAny>) -> PyResult<()> {
        let Ok(sample) = sample.cast::<PyDict>() else {
            return Err(PyTypeError::new_err(format!(
                "write() takes a dict of field name to value, got {}",
                sample.get_type().name()?
            )));
        };
        let key = match sample.get_item("__key__")? {
            None => {
                return Err(PyValueError::new_err(
                    "the sample has no __key__ (every sample needs a str key)",
                ))
            }
            Some(key) => match key.cast::<PyString>() {
                Ok(key) => utf8(key, None, None, "__key__")?.to_owned(),
                Err(_) => {
                    return Err(PyTypeError::new_err(format!(
                        "__key__ must be a str, got {} ({})",
                        key.repr()?,
                        key.get_type().name()?
                    )))
                }
            },
        };
        let mut fields = Vec::with_capacity(sample.len());
        for (name, value) in sample.iter() {
            let Ok(name) = name.cast::<PyString>() else {
                return Err(to_py(Error::InvalidSample {
                    key: Some(key),
                    field: None,
                    reason: format!("field names must be str, got {}", name.repr()?),
                    wrong_type: true,
                }));
            };
            let name = utf8(name, Some(&key), None, "the field name")?;
            // `__url__` is what the reader adds; it is not data.
            if name == "__key__" || name == "__url__" {
                continue;
            }
            fields.push((name.to_owned(), field_value(&key, name, &value)?));
        }
        self.with_writer(py, move |writer| writer.write(&key, fields))
    }

    /// Completes the open shard and the manifest.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        self.with_writer(py, write::ShardWriter::close)
    }

    /// Abandons the open shard; completed shards and their manifest stay.
    fn abort(&self, py: Python<'_>) -> PyResult<()> {
        self.with_writer(py, |writer| {
            writer.abort();
            Ok(())
        })
    }

    /// Samples written.
    fn __len__(&self) -> PyResult<usize> {
        self.read(|writer| writer.samples() as usize)
    }

    /// Shards completed.
    #[getter]
    fn shards(&self) -> PyResult<usize> {
        self.read(write::ShardWriter::shards)
    }

    /// URLs (or paths) of the completed shards.
    #[getter]
    fn shard_urls(&self) -> PyResult<Vec<String>> {
        self.read(write::ShardWriter::shard_urls)
    }

    /// Where the manifest is written.
    #[getter]
    fn manifest_url(&self) -> String {
        self.manifest_url.clone()
    }

    /// The manifest of the completed shards (JSON), as written beside them.
    #[getter]
    fn manifest_json(&self) -> PyResult<String> {
        self.read(write::ShardWriter::manifest_json)
    }
}

/// Writes a manifest (JSON, checked as a manifest read is) to `url`: a
/// local path, renamed into place, or an `s3://` URL.
#[pyfunction]
#[pyo3(signature = (url, manifest, *, s3 = None))]
pub fn write_manifest(
    py: Python<'_>,
    url: String,
    manifest: &str,
    s3: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    let s3 = match s3 {
        Some(value) => s3_options(value)?,
        None => crate::config::StoreOptions::default(),
    };
    s3.validate().map_err(to_py)?;
    let manifest = Manifest::from_json(manifest, &url).map_err(to_py)?;
    blocking(py, move || write::write_manifest(&url, &manifest, &s3))
}
