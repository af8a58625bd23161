//! `Options`: every dataset option, parsed and validated once, when the
//! dataset is constructed. Names, types, defaults and texts are defined once,
//! in [`DATASET_OPTIONS`]; Python passes keywords through.

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString};
use pyo3::IntoPyObjectExt;

use super::errors::{to_py, wrong_type};
use crate::compression::Compression;
use crate::config::{
    DefaultValue, FieldDecoders, HttpHeaders, OnError, OptionDef, StoreOptions, StreamOptions,
    TableOutput, Transport, DATASET_OPTIONS, S3_OPTIONS,
};
use crate::dataset::DatasetOptions;
use crate::decode::Decoder;
use crate::manifest::ManifestChoice;
use crate::plan::Remainder;
use crate::write::WriterOptions;

/// The names of the options of `table`, in documentation order.
fn names(table: &[OptionDef]) -> String {
    table.iter().map(|o| o.name).collect::<Vec<_>>().join(", ")
}

/// Every option of a dataset, validated: build it with keywords (any
/// subset of [`DATASET_OPTIONS`]; the others take their defaults).
#[pyclass(module = "shardstream._core", frozen)]
pub struct Options {
    /// The options, checked ([`DatasetOptions::builder`]).
    pub(crate) dataset: DatasetOptions,
    /// The keywords as given, for pickling.
    given: Py<PyDict>,
}

/// The names of the `ShardWriter` options, in documentation order.
pub const WRITER_OPTION_NAMES: [&str; 4] = ["max_count", "max_bytes", "compression", "s3"];

/// Parses the `ShardWriter` options in `given` (any subset of
/// [`WRITER_OPTION_NAMES`]; the others take [`WriterOptions::default`]'s
/// values). `max_count` and `max_bytes` take `None` for no limit;
/// `compression` is `None` (as the pattern's suffix says), `"gz"` or
/// `"zst"`; `s3` is as for datasets. Ranges are checked when the writer is
/// made, naming the option.
pub(super) fn writer_options(given: Option<&Bound<'_, PyDict>>) -> PyResult<WriterOptions> {
    let mut o = WriterOptions::default();
    let Some(given) = given else {
        return Ok(o);
    };
    for (key, value) in given.iter() {
        let name: String = key.extract()?;
        match name.as_str() {
            "max_count" => o.max_count = optional_integer(&name, &value)?,
            "max_bytes" => o.max_bytes = optional_integer(&name, &value)?,
            "compression" => {
                o.compression = if value.is_none() {
                    None
                } else {
                    match string(&name, &value)?.as_str() {
                        "gz" | "gzip" => Some(Compression::Gzip),
                        "zst" | "zstd" => Some(Compression::Zstd),
                        other => {
                            return Err(PyValueError::new_err(format!(
                                "invalid option compression: expected None, \"gz\" or \"zst\", got {other:?}"
                            )))
                        }
                    }
                }
            }
            "s3" => o.store = s3_options(&value)?,
            other => {
                return Err(PyTypeError::new_err(format!(
                    "unknown option {other:?} (expected one of: {})",
                    WRITER_OPTION_NAMES.join(", ")
                )))
            }
        }
    }
    Ok(o)
}

/// An option's value of the wrong type or out of range.
fn invalid(name: &str, expected: &str, value: &Bound<'_, PyAny>) -> PyErr {
    wrong_type(&format!("option {name}"), expected, value)
}

/// A non-negative integer (not a bool).
fn integer<T: for<'a> FromPyObject<'a, 'a>>(name: &str, value: &Bound<'_, PyAny>) -> PyResult<T> {
    if !value.is_instance_of::<PyInt>() || value.is_instance_of::<PyBool>() {
        return Err(invalid(name, "an int", value));
    }
    value.extract::<T>().map_err(|_| {
        PyValueError::new_err(format!(
            "invalid option {name}: expected a non-negative int in range, got {value}"
        ))
    })
}

/// `None`, or an int as [`integer`] takes it.
fn optional_integer<T: for<'a> FromPyObject<'a, 'a>>(
    name: &str,
    value: &Bound<'_, PyAny>,
) -> PyResult<Option<T>> {
    if value.is_none() {
        return Ok(None);
    }
    integer(name, value).map(Some)
}

/// A bool (not an int).
fn boolean(name: &str, value: &Bound<'_, PyAny>) -> PyResult<bool> {
    if !value.is_instance_of::<PyBool>() {
        return Err(invalid(name, "True or False", value));
    }
    value.extract()
}

/// A str.
fn string(name: &str, value: &Bound<'_, PyAny>) -> PyResult<String> {
    if !value.is_instance_of::<PyString>() {
        return Err(invalid(name, "a str", value));
    }
    value.extract()
}

/// A duration in seconds (an int or float), positive and finite.
fn seconds(name: &str, value: &Bound<'_, PyAny>) -> PyResult<Duration> {
    let is_number = value.is_instance_of::<PyFloat>()
        || (value.is_instance_of::<PyInt>() && !value.is_instance_of::<PyBool>());
    if !is_number {
        return Err(invalid(name, "a number of seconds", value));
    }
    let v: f64 = value.extract()?;
    Duration::try_from_secs_f64(v)
        .ok()
        .filter(|d| !d.is_zero() && *d <= MAX_SECONDS)
        .ok_or_else(|| {
            PyValueError::new_err(format!(
                "invalid option {name}: expected seconds above 0 and at most {} (a year), got {v}",
                MAX_SECONDS.as_secs()
            ))
        })
}

/// The longest duration an option takes: deadlines computed from it never
/// overflow.
const MAX_SECONDS: Duration = Transport::MAX_DURATION;

/// An enum value by its name.
fn choice<T: FromStr<Err = crate::Error>>(name: &str, value: &Bound<'_, PyAny>) -> PyResult<T> {
    T::from_str(&string(name, value)?).map_err(to_py)
}

/// `s3=`: `None`, a `shardstream.S3Config` (anything with `to_dict()`) or a
/// dict of its fields (durations in seconds).
pub(super) fn s3_options(value: &Bound<'_, PyAny>) -> PyResult<StoreOptions> {
    let mut o = StoreOptions::default();
    if value.is_none() {
        return Ok(o);
    }
    let fields = if value.is_instance_of::<PyDict>() {
        value.clone()
    } else if value.hasattr("to_dict")? {
        value.call_method0("to_dict")?
    } else {
        return Err(invalid("s3", "a shardstream.S3Config or a dict", value));
    };
    let fields = fields
        .cast::<PyDict>()
        .map_err(|_| invalid("s3", "a shardstream.S3Config or a dict", value))?;
    for (key, value) in fields.iter() {
        let key: String = key
            .extract()
            .map_err(|_| invalid("s3", "a dict with str keys", &key))?;
        let name = format!("s3.{key}");
        if value.is_none() && matches!(key.as_str(), "region" | "endpoint_url" | "profile") {
            continue;
        }
        match key.as_str() {
            "region" => o.region = Some(string(&name, &value)?),
            "endpoint_url" => o.endpoint_url = Some(string(&name, &value)?),
            "path_style" => o.path_style = boolean(&name, &value)?,
            "profile" => o.profile = Some(string(&name, &value)?),
            "unsigned" => o.unsigned = boolean(&name, &value)?,
            "connect_timeout" => o.transport.connect_timeout = seconds(&name, &value)?,
            "first_byte_timeout" => o.transport.first_byte_timeout = seconds(&name, &value)?,
            "idle_timeout" => o.transport.idle_timeout = seconds(&name, &value)?,
            "max_attempts" => o.transport.max_attempts = integer(&name, &value)?,
            "max_retry_time" => o.transport.max_retry_time = seconds(&name, &value)?,
            "part_size" => o.transport.part_size = integer(&name, &value)?,
            "max_concurrency" => o.transport.max_concurrency = integer(&name, &value)?,
            other => {
                return Err(PyTypeError::new_err(format!(
                    "invalid option s3: unknown field {other:?} (expected one of: {})",
                    names(&S3_OPTIONS)
                )))
            }
        }
    }
    Ok(o)
}

/// The name of `value`'s type, for an error that must not show `value`.
fn type_name(value: &Bound<'_, PyAny>) -> String {
    value
        .get_type()
        .name()
        .map_or_else(|_| "?".into(), |n| n.to_string())
}

/// `http_headers=`: `None` or a dict of header name to value (both str),
/// checked at once; errors name the option, the expected type and the
/// header, never a value (nor anything given in place of the dict, which
/// may hold one).
fn http_headers(value: &Bound<'_, PyAny>) -> PyResult<HttpHeaders> {
    if value.is_none() {
        return Ok(HttpHeaders::default());
    }
    let dict = value.cast::<PyDict>().map_err(|_| {
        PyTypeError::new_err(format!(
            "invalid option http_headers: expected None or a dict of header name to value \
             (both str), e.g. {{\"Authorization\": token}}, got a {} (not shown: it may hold \
             a secret)",
            type_name(value)
        ))
    })?;
    let mut headers = Vec::with_capacity(dict.len());
    for (key, item) in dict.iter() {
        let Ok(key) = key.extract::<String>() else {
            return Err(PyTypeError::new_err(format!(
                "invalid option http_headers: expected a dict of header name to value (both \
                 str), got a key of type {} (not shown: it may hold a secret)",
                type_name(&key)
            )));
        };
        if !item.is_instance_of::<PyString>() {
            return Err(PyTypeError::new_err(format!(
                "invalid option http_headers: expected a dict of header name to value (both \
                 str), got a {} as the value of {key:?} (not shown)",
                type_name(&item)
            )));
        }
        headers.push((key, item.extract::<String>()?));
    }
    let headers = HttpHeaders(headers);
    headers.validate().map_err(to_py)?;
    Ok(headers)
}

/// The repr of option `key`'s `value`: header values are hidden.
fn shown(key: &str, value: &Bound<'_, PyAny>) -> PyResult<String> {
    match value.cast::<PyDict>() {
        Ok(headers) if key == "http_headers" => {
            let names = headers
                .keys()
                .iter()
                .map(|k| Ok(format!("{}: '<hidden>'", k.repr()?)))
                .collect::<PyResult<Vec<_>>>()?;
            Ok(format!("{{{}}}", names.join(", ")))
        }
        _ => Ok(value.repr()?.to_string()),
    }
}

/// The decoder of a transform object (`shardstream.Image`,
/// `shardstream.ImageBoxes`, `shardstream.AudioClip`, `shardstream.Tokenizer`),
/// or `None` for anything else.
fn transform(value: &Bound<'_, PyAny>) -> Option<Decoder> {
    if let Ok(image) = value.cast::<super::image::Image>() {
        return Some(Decoder::Image(image.get().spec.clone()));
    }
    if let Ok(boxes) = value.cast::<super::image::ImageBoxes>() {
        return Some(Decoder::ImageBoxes(boxes.get().spec.clone()));
    }
    if let Ok(clip) = value.cast::<super::audio::AudioClip>() {
        return Some(Decoder::AudioClip(clip.get().spec.clone()));
    }
    if let Ok(tokenizer) = value.cast::<super::tokenizer::Tokenizer>() {
        return Some(Decoder::Tokenizer(tokenizer.get().spec.clone()));
    }
    None
}

/// `decode=`: `True` (defaults by extension), a dict of field name to
/// decoder name or transform object, or `None`/`False` (none).
fn field_decoders(value: &Bound<'_, PyAny>) -> PyResult<FieldDecoders> {
    if value.is_none() {
        return Ok(FieldDecoders::default());
    }
    if value.is_instance_of::<PyBool>() {
        return Ok(if value.extract::<bool>()? {
            FieldDecoders::defaults()
        } else {
            FieldDecoders::default()
        });
    }
    let expected =
        "True, False, None or a dict of field name to decoder name or transform (shardstream.Image, shardstream.ImageBoxes, shardstream.AudioClip, shardstream.Tokenizer)";
    let dict = value
        .cast::<PyDict>()
        .map_err(|_| invalid("decode", expected, value))?;
    let mut by_field = Vec::with_capacity(dict.len());
    for (field, name) in dict.iter() {
        let field = string("decode", &field)?;
        let option = format!("decode[{field:?}]");
        let decoder = match transform(&name) {
            Some(decoder) => decoder,
            None => Decoder::from_str(&string(&option, &name).map_err(|_| {
                invalid(
                    &option,
                    "a decoder name or a transform (shardstream.Image, shardstream.ImageBoxes, shardstream.AudioClip, shardstream.Tokenizer)",
                    &name,
                )
            })?)
            .map_err(|e| PyValueError::new_err(format!("invalid option {option}: {e}")))?,
        };
        by_field.push((field, decoder));
    }
    Ok(FieldDecoders {
        by_field,
        defaults: false,
    })
}

/// `manifest=`: `None`/`True` (the `manifest.json` beside the shards, if
/// it is shardstream's), `False` (none), a path (not an empty one) or a
/// URL of a remote store.
fn manifest_choice(value: &Bound<'_, PyAny>) -> PyResult<ManifestChoice> {
    if value.is_none() {
        return Ok(ManifestChoice::Auto);
    }
    if value.is_instance_of::<PyBool>() {
        return Ok(if value.extract::<bool>()? {
            ManifestChoice::Auto
        } else {
            ManifestChoice::Off
        });
    }
    if let Ok(text) = value.extract::<String>() {
        if let url @ ManifestChoice::Url(_) = crate::manifest::choice_of(&text) {
            return Ok(url);
        }
    }
    let path = value
        .extract::<PathBuf>()
        .map_err(|_| invalid("manifest", "None, True, False, a path or a URL", value))?;
    if path.as_os_str().is_empty() {
        return Err(PyValueError::new_err(
            "invalid option manifest: an empty path; give the manifest's path or URL, None \
             for the manifest.json beside the shards (if there is one), or False for none",
        ));
    }
    Ok(ManifestChoice::Path(path))
}

#[pymethods]
impl Options {
    /// Parses and validates `options` (keywords named in [`DATASET_OPTIONS`]).
    #[new]
    #[pyo3(signature = (**options))]
    fn new(py: Python<'_>, options: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        let given = match options {
            Some(options) => options.copy()?,
            None => PyDict::new(py),
        };
        let options = Options::from_dict(&given)?;
        // Every process that makes the options (each rank, each spawned
        // DataLoader worker, which unpickles them) prepares the cache
        // directory of its node, and one it may not use is refused when the
        // dataset is made; parsing them has no side effect.
        if let Some(cache) = &options.dataset.stream().cache {
            crate::source::cache::prepare(cache).map_err(to_py)?;
        }
        Ok(options)
    }

    /// The value of every option, defaults included, by name.
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let dict = defaults_dict(py, &DATASET_OPTIONS)?;
        for (key, value) in self.given.bind(py).iter() {
            dict.set_item(key, value)?;
        }
        Ok(dict)
    }

    /// The value of option `name` (its default when not given).
    fn __getitem__<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyAny>> {
        let all = self.to_dict(py)?;
        all.get_item(name)?
            .ok_or_else(|| pyo3::exceptions::PyKeyError::new_err(format!("no option {name:?}")))
    }

    /// Whether batches are handed out (`batch_size` with per-sample
    /// output, or Arrow record batches).
    #[getter]
    fn batches(&self) -> bool {
        self.dataset.batch_size().is_some()
            || self.dataset.stream().table_output == TableOutput::Arrow
    }

    /// Pickling keeps the keywords as given.
    fn __getnewargs_ex__<'py>(&self, py: Python<'py>) -> PyResult<((), Bound<'py, PyDict>)> {
        Ok(((), self.given.bind(py).copy()?))
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let given = self.given.bind(py);
        let mut parts = Vec::with_capacity(given.len());
        for (key, value) in given.iter() {
            let key: String = key.extract()?;
            parts.push(format!("{key}={}", shown(&key, &value)?));
        }
        Ok(format!("Options({})", parts.join(", ")))
    }
}

impl Options {
    /// Parses and validates the options in `given` (keyword to value),
    /// with no side effect.
    pub(crate) fn from_dict(given: &Bound<'_, PyDict>) -> PyResult<Self> {
        let mut builder = StreamOptions::builder();
        let mut dataset = DatasetOptions::builder(StreamOptions::builder());
        let mut headers = None;
        for (key, value) in given.iter() {
            let name: String = key.extract()?;
            builder = match name.as_str() {
                "seed" => builder.with_seed(integer(&name, &value)?),
                "shuffle_shards" => builder.with_shuffle_shards(boolean(&name, &value)?),
                "shuffle_buffer" => builder.with_shuffle_buffer(integer(&name, &value)?),
                "shuffle_buffer_bytes" => {
                    builder.with_shuffle_buffer_bytes(integer(&name, &value)?)
                }
                "shuffle_initial" => builder.with_shuffle_initial(integer(&name, &value)?),
                "read_ahead_bytes" => {
                    builder.with_read_ahead_bytes(optional_integer(&name, &value)?)
                }
                "on_error" => builder.with_on_error(choice::<OnError>(&name, &value)?),
                "io_timeout" => builder.with_io_timeout(seconds(&name, &value)?),
                "remainder" => builder.with_remainder(choice::<Remainder>(&name, &value)?),
                "s3" => builder.with_store(s3_options(&value)?),
                "http_headers" => {
                    headers = Some(http_headers(&value)?);
                    builder
                }
                "decode" => builder.with_decode(field_decoders(&value)?),
                "decode_threads" => builder.with_decode_threads(optional_integer(&name, &value)?),
                "columns" => {
                    let columns = if value.is_none() {
                        None
                    } else if value.is_instance_of::<PyString>() {
                        return Err(invalid(&name, "None or a list of column names", &value));
                    } else {
                        Some(
                            value
                                .extract::<Vec<String>>()
                                .map_err(|_| invalid(&name, "None or a list of str", &value))?,
                        )
                    };
                    builder.with_columns(columns)
                }
                "manifest" => {
                    dataset = dataset.with_manifest(manifest_choice(&value)?);
                    builder
                }
                "format" => {
                    dataset = dataset.with_format(choice(&name, &value)?);
                    builder
                }
                "batch_format" => {
                    dataset = dataset.with_table_output(choice(&name, &value)?);
                    builder
                }
                "batch_size" => {
                    let size = if value.is_none() {
                        None
                    } else {
                        Some(integer(&name, &value)?)
                    };
                    dataset = dataset.with_batch_size(size);
                    builder
                }
                "pack_bytes" => {
                    dataset = dataset.with_pack_bytes(boolean(&name, &value)?);
                    builder
                }
                "pack" => {
                    if value.is_none() {
                        builder.with_pack(None)
                    } else {
                        let pack = value
                            .cast::<super::pack::Pack>()
                            .map_err(|_| invalid(&name, "None or a shardstream.Pack", &value))?;
                        builder.with_pack(Some((*pack.get().spec).clone()))
                    }
                }
                // Read by the Python side (DataLoader workers); checked here.
                "local_bytes_by_reference"
                | "raise_malloc_thresholds"
                | "read_next_epoch_early" => {
                    boolean(&name, &value)?;
                    builder
                }
                // Read by the Python side (DataLoader workers); checked here.
                "worker_shared_memory_bytes" => {
                    integer::<u64>(&name, &value)?;
                    builder
                }
                "count_samples" => {
                    let count = if value.is_none() {
                        None
                    } else {
                        Some(boolean(&name, &value)?)
                    };
                    dataset = dataset.with_count_samples(count);
                    builder
                }
                // Called by the Python side, in the process that iterates.
                "transform" => {
                    if !value.is_none() && !value.is_callable() {
                        return Err(invalid(&name, "a callable or None", &value));
                    }
                    builder
                }
                "sample_seed" => builder.with_sample_seed(boolean(&name, &value)?),
                "sample_ids" => builder.with_sample_ids(boolean(&name, &value)?),
                // Ranks per model-parallel group, read by the Python side:
                // consecutive ranks `g * size .. (g + 1) * size` read the
                // same samples, as data-parallel rank `g`.
                "model_parallel_size" => {
                    dataset = dataset.with_model_parallel_size(integer(&name, &value)?);
                    builder
                }
                "cache_dir" => {
                    let dir = if value.is_none() {
                        None
                    } else {
                        Some(
                            value
                                .extract::<PathBuf>()
                                .map_err(|_| invalid(&name, "None or a path", &value))?,
                        )
                    };
                    dataset = dataset.with_cache_dir(dir);
                    builder
                }
                "cache_limit_bytes" => {
                    let limit = if value.is_none() {
                        None
                    } else {
                        Some(integer(&name, &value)?)
                    };
                    dataset = dataset.with_cache_limit_bytes(limit);
                    builder
                }
                other => {
                    return Err(PyTypeError::new_err(format!(
                        "unknown option {other:?} (expected one of: {})",
                        names(&DATASET_OPTIONS)
                    )))
                }
            };
        }
        if let Some(headers) = headers {
            builder = builder.with_http_headers(headers);
        }
        let dataset = dataset.with_stream(builder).build().map_err(to_py)?;
        Ok(Options {
            dataset,
            given: given.clone().unbind(),
        })
    }
}

/// `value` as a Python object.
fn default_value<'py>(py: Python<'py>, value: DefaultValue) -> PyResult<Bound<'py, PyAny>> {
    match value {
        DefaultValue::None => Ok(py.None().into_bound(py)),
        DefaultValue::Bool(v) => v.into_bound_py_any(py),
        DefaultValue::Int(v) => v.into_bound_py_any(py),
        DefaultValue::Seconds(v) => v.into_bound_py_any(py),
        DefaultValue::Str(v) => v.into_bound_py_any(py),
    }
}

/// The default of every option of `table`, by name.
fn defaults_dict<'py>(py: Python<'py>, table: &[OptionDef]) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    for def in table {
        dict.set_item(def.name, default_value(py, (def.default)())?)?;
    }
    Ok(dict)
}

/// The options of `table` as Python sees them: a dict per option.
fn table_list<'py>(py: Python<'py>, table: &[OptionDef]) -> PyResult<Bound<'py, PyList>> {
    let list = PyList::empty(py);
    for def in table {
        let dict = PyDict::new(py);
        dict.set_item("name", def.name)?;
        dict.set_item("type", def.python_type)?;
        dict.set_item("default", default_value(py, (def.default)())?)?;
        dict.set_item("doc", def.doc)?;
        dict.set_item("affects_order", def.order.affects_order())?;
        dict.set_item("order", def.order.name())?;
        list.append(dict)?;
    }
    Ok(list)
}

/// Every dataset option, in documentation order: a dict per option with its
/// `name`, Python `type`, `default`, `doc` (README's text), whether it
/// `affects_order` (which samples come in which order, so that a saved
/// state must match it) and how (`order`: `"holds"`, `"decides"`,
/// `"shards"`, `"layout"` or `"no"`).
#[pyfunction]
pub fn option_table(py: Python<'_>) -> PyResult<Bound<'_, PyList>> {
    table_list(py, &DATASET_OPTIONS)
}

/// Every field of the `s3=` option (`shardstream.S3Config`), as
/// [`option_table`] lists the dataset options (`doc`: the text of
/// docs/sources.md's table).
#[pyfunction]
pub fn s3_option_table(py: Python<'_>) -> PyResult<Bound<'_, PyList>> {
    table_list(py, &S3_OPTIONS)
}

/// The default of every dataset option, by its keyword name.
#[pyfunction]
pub fn default_options(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    defaults_dict(py, &DATASET_OPTIONS)
}

/// The read-ahead budget of each stream of a process among `num_workers`
/// DataLoader workers (0: the main process): `read_ahead_bytes` when given,
/// else what `None` gives there; an invalid `read_ahead_bytes` raises
/// `ValueError` naming the option.
#[pyfunction]
#[pyo3(signature = (read_ahead_bytes, num_workers))]
pub fn read_ahead_budget(read_ahead_bytes: Option<usize>, num_workers: usize) -> PyResult<usize> {
    let options = StreamOptions::builder()
        .with_read_ahead_bytes(read_ahead_bytes)
        .build()
        .map_err(to_py)?;
    Ok(options.read_ahead_budget(num_workers))
}

/// The defaults of the `s3=` options (`shardstream.S3Config` fields).
#[pyfunction]
pub fn default_s3_options(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    defaults_dict(py, &S3_OPTIONS)
}

/// The default of every `ShardWriter` option, by its keyword name.
#[pyfunction]
pub fn default_writer_options(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let o = WriterOptions::default();
    let dict = PyDict::new(py);
    dict.set_item("max_count", o.max_count)?;
    dict.set_item("max_bytes", o.max_bytes)?;
    dict.set_item("compression", py.None())?;
    dict.set_item("s3", py.None())?;
    debug_assert_eq!(dict.len(), WRITER_OPTION_NAMES.len());
    Ok(dict)
}
