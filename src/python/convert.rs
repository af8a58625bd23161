//! Samples, values, batches and Arrow record batches into Python objects.

use std::sync::{Arc, Mutex};

use arrow_array::ffi::{FFI_ArrowArray, FFI_ArrowSchema};
use arrow_array::{Array as _, RecordBatch, StructArray};
use numpy::{IntoPyArray, PyArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyCapsule, PyDict, PyList, PyString, PyTuple};
use pyo3::{intern, IntoPyObjectExt};

use crate::collate::{offsets_field, Batch, Column};
use crate::format::{Sample, Value};
use crate::store::local::{file_origin, verify_view, SHARE_MIN_BYTES};
use crate::value::Array;
use crate::with_array_data;

/// How `bytes` values are made.
#[derive(Clone, Copy)]
pub enum BytesOut<'a, 'py> {
    /// As `bytes`.
    Plain,
    /// In a DataLoader worker: members of at least [`SHARE_MIN_BYTES`] as
    /// `bytes` subclasses that cross to the main process without their bytes
    /// going through the worker's pipe.
    Worker {
        /// Views of mapped local shards as what this callable makes of the
        /// bytes, path, offset and file identity: a `bytes` subclass
        /// (`shardstream.local_bytes.LocalBytes`) that pickles as the bytes'
        /// place in their file, read there by the main process.
        local: Option<&'a Bound<'py, PyAny>>,
        /// Every other member (remote, decompressed, cached) as what this
        /// callable makes of the bytes: a `bytes` subclass
        /// (`shardstream.shared_bytes.SharedBytes`) that pickles as its place
        /// in a shared-memory segment the worker writes it to.
        shared: Option<&'a Bound<'py, PyAny>>,
    },
}

/// How many distinct field names a [`NameCache`] keeps (a dataset has a
/// few; one with more makes the rest afresh for each sample).
const MAX_CACHED_FIELDS: usize = 64;

/// The `str` objects that repeat from sample to sample, made once and
/// shared by every dict handed out: the field names (interned, so that
/// `sample["jpg"]` finds them by identity) and the URL of the shard being
/// read.
#[derive(Default)]
pub struct NameCache {
    url: Option<(Arc<str>, Py<PyString>)>,
    fields: Vec<(String, Py<PyString>)>,
}

impl NameCache {
    /// The `str` of a shard's URL: the one made for the previous sample when
    /// it came from the same shard.
    fn url<'py>(&mut self, py: Python<'py>, url: &Arc<str>) -> Bound<'py, PyString> {
        if let Some((cached, object)) = &self.url {
            if Arc::ptr_eq(cached, url) || **cached == **url {
                return object.bind(py).clone();
            }
        }
        let object = PyString::new(py, url);
        self.url = Some((url.clone(), object.clone().unbind()));
        object
    }

    /// The interned `str` of a field name.
    fn field<'py>(&mut self, py: Python<'py>, name: &str) -> Bound<'py, PyString> {
        if let Some((_, object)) = self.fields.iter().find(|(cached, _)| cached == name) {
            return object.bind(py).clone();
        }
        let object = PyString::intern(py, name);
        if self.fields.len() < MAX_CACHED_FIELDS {
            self.fields.push((name.to_owned(), object.clone().unbind()));
        }
        object
    }
}

/// A sample as a dict: `__key__`, `__url__`, then its fields in order. The
/// URL and field names come from `names`.
pub fn sample_to_dict<'py>(
    py: Python<'py>,
    sample: Sample,
    out: BytesOut<'_, 'py>,
    names: &mut NameCache,
) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    dict.set_item(intern!(py, "__key__"), PyString::new(py, &sample.key))?;
    dict.set_item(intern!(py, "__url__"), names.url(py, &sample.url))?;
    for (field, value) in sample.fields {
        dict.set_item(names.field(py, &field), value_to_py(py, value, out)?)?;
    }
    Ok(dict)
}

/// A collated batch as a dict: `__key__` and `__url__` lists, then each
/// field as a numpy array (stacked), a list, or a packed `uint8` array
/// followed by its `<field>_offsets` (`int64`). The URLs and field names
/// come from `names`.
pub fn batch_to_dict<'py>(
    py: Python<'py>,
    batch: Batch,
    out: BytesOut<'_, 'py>,
    names: &mut NameCache,
) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    dict.set_item(intern!(py, "__key__"), PyList::new(py, &batch.keys)?)?;
    let urls = batch.urls.iter().map(|u| names.url(py, u));
    dict.set_item(intern!(py, "__url__"), PyList::new(py, urls)?)?;
    for (field, column) in batch.fields {
        let value = match column {
            Column::Stacked(array) => array_to_py(py, array)?,
            Column::Packed { data, offsets } => {
                let offsets_name = names.field(py, &offsets_field(&field));
                dict.set_item(names.field(py, &field), data.into_pyarray(py))?;
                dict.set_item(offsets_name, offsets.into_pyarray(py))?;
                continue;
            }
            Column::Values(values) => {
                let list = PyList::empty(py);
                for value in values {
                    list.append(value_to_py(py, value, out)?)?;
                }
                list.into_any()
            }
        };
        dict.set_item(names.field(py, &field), value)?;
    }
    Ok(dict)
}

/// A value as the matching Python object (arrays as numpy arrays that own
/// the Rust buffer, without a copy).
pub fn value_to_py<'py>(
    py: Python<'py>,
    value: Value,
    out: BytesOut<'_, 'py>,
) -> PyResult<Bound<'py, PyAny>> {
    match value {
        Value::Null => Ok(py.None().into_bound(py)),
        Value::Bool(v) => v.into_bound_py_any(py),
        Value::Int(v) => v.into_bound_py_any(py),
        Value::UInt(v) => v.into_bound_py_any(py),
        Value::Float(v) => v.into_bound_py_any(py),
        Value::Str(v) => Ok(PyString::new(py, &v).into_any()),
        Value::Bytes(v) => bytes_to_py(py, &v, out),
        Value::List(items) => {
            let list = PyList::empty(py);
            for item in items {
                list.append(value_to_py(py, item, out)?)?;
            }
            Ok(list.into_any())
        }
        Value::Tuple(items) => {
            let items = items
                .into_iter()
                .map(|item| value_to_py(py, item, out))
                .collect::<PyResult<Vec<_>>>()?;
            Ok(PyTuple::new(py, items)?.into_any())
        }
        Value::Map(entries) => {
            let dict = PyDict::new(py);
            for (key, item) in entries {
                dict.set_item(key, value_to_py(py, item, out)?)?;
            }
            Ok(dict.into_any())
        }
        Value::Array(array) => array_to_py(py, array),
    }
}

/// Bytes as `bytes`, or, when they are long enough and `out` says so, as a
/// local reference (see [`BytesOut`]) when they are a view of a mapped local
/// shard whose path is UTF-8, else as shared bytes.
fn bytes_to_py<'py>(
    py: Python<'py>,
    bytes: &[u8],
    out: BytesOut<'_, 'py>,
) -> PyResult<Bound<'py, PyAny>> {
    // Shorter members cost less through the pipe than by reference.
    let long = bytes.len() >= SHARE_MIN_BYTES;
    let (local, shared) = match out {
        BytesOut::Worker { local, shared } if long => (local, shared),
        _ => (None, None),
    };
    let origin = local
        .and_then(|class| Some((class, file_origin(bytes)?)))
        .filter(|(_, origin)| origin.file.by_reference);
    let object = match (origin, shared) {
        (Some((class, origin)), _) if origin.file.path.to_str().is_some() => {
            let id = origin.file.identity;
            class.call1((
                PyBytes::new(py, bytes),
                origin.file.path.to_str(),
                origin.offset,
                id.dev,
                id.ino,
                id.size,
                id.mtime_ns,
            ))?
        }
        (_, Some(class)) => copied_by(py, class, bytes)?,
        _ => PyBytes::new(py, bytes).into_any(),
    };
    // A view of a mapped local shard is checked once copied: pages lost to
    // the file being cut short read as zeros.
    if long {
        verify_view(bytes).map_err(crate::python::errors::to_py)?;
    }
    Ok(object)
}

/// CPython's `PyBUF_READ` (part of the stable ABI; pyo3's limited-API
/// bindings leave the buffer constants out).
const PYBUF_READ: std::os::raw::c_int = 0x100;

/// What `class` (a `bytes` subclass) makes of `bytes`, given a read-only
/// `memoryview` of them (one copy, not two), released before returning.
fn copied_by<'py>(
    py: Python<'py>,
    class: &Bound<'py, PyAny>,
    bytes: &[u8],
) -> PyResult<Bound<'py, PyAny>> {
    let len = pyo3::ffi::Py_ssize_t::try_from(bytes.len())
        .map_err(|_| PyValueError::new_err("a member too long for a memoryview"))?;
    // SAFETY: a read-only view of `bytes`, which outlive it: it is released
    // below, after which any reference to it that `class` kept raises
    // instead of reading.
    let view = unsafe {
        Bound::from_owned_ptr_or_err(
            py,
            pyo3::ffi::PyMemoryView_FromMemory(bytes.as_ptr().cast_mut().cast(), len, PYBUF_READ),
        )?
    };
    let made = class.call1((&view,));
    view.call_method0(pyo3::intern!(py, "release"))?;
    made
}

/// An array as a numpy array of its shape.
fn array_to_py(py: Python<'_>, array: Array) -> PyResult<Bound<'_, PyAny>> {
    let shape = array.shape;
    with_array_data!(array.data, v => {
        let flat = v.into_pyarray(py);
        Ok(flat.reshape(shape)?.into_any())
    })
}

/// One record batch, exported once through the Arrow PyCapsule interface
/// (`__arrow_c_array__`), which `pyarrow.record_batch` imports without a copy.
#[pyclass(module = "shardstream._core")]
pub struct ArrowExport {
    parts: Mutex<Option<(FFI_ArrowSchema, FFI_ArrowArray)>>,
}

#[pymethods]
impl ArrowExport {
    /// The schema and array capsules; the batch can be taken once.
    #[pyo3(signature = (requested_schema = None))]
    fn __arrow_c_array__<'py>(
        &self,
        py: Python<'py>,
        requested_schema: Option<Bound<'py, PyAny>>,
    ) -> PyResult<(Bound<'py, PyCapsule>, Bound<'py, PyCapsule>)> {
        let _ = requested_schema;
        let (schema, array) = self
            .parts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .ok_or_else(|| PyValueError::new_err("the record batch was already exported"))?;
        Ok((
            PyCapsule::new_with_value(py, schema, c"arrow_schema")?,
            PyCapsule::new_with_value(py, array, c"arrow_array")?,
        ))
    }
}

/// A record batch as a `pyarrow.RecordBatch`, handed over zero-copy.
pub fn record_batch_to_py(py: Python<'_>, batch: RecordBatch) -> PyResult<Bound<'_, PyAny>> {
    let data = StructArray::from(batch).into_data();
    let (array, schema) = arrow_array::ffi::to_ffi(&data)
        .map_err(|e| PyValueError::new_err(format!("cannot export the record batch: {e}")))?;
    let export = Bound::new(
        py,
        ArrowExport {
            parts: Mutex::new(Some((schema, array))),
        },
    )?;
    py.import("pyarrow")?
        .getattr("record_batch")?
        .call1((export,))
}
