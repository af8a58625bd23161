//! What `shardstream write` turns into samples: a folder of files grouped
//! by name (webdataset's rule: the key is the path up to the first dot of
//! the file name, the field the rest, lower-cased), optionally joined by
//! key with a labels file (CSV with a header, or JSON lines); or the rows
//! of Parquet files, one sample per row, chosen columns as fields.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use arrow_array::cast::AsArray;
use arrow_array::types::{
    Float32Type, Float64Type, Int16Type, Int32Type, Int64Type, Int8Type, UInt16Type, UInt32Type,
    UInt64Type, UInt8Type,
};
use arrow_array::Array;
use arrow_schema::DataType;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::arrow::ProjectionMask;

use super::encode::{python_float_json, python_float_text, FieldValue};
use crate::error::{Error, Result};

/// Rows read from Parquet at a time.
const PARQUET_BATCH_ROWS: usize = 1024;

fn refuse(name: &'static str, reason: String) -> Error {
    Error::Config { name, reason }
}

/// The samples of a folder: for each key (in sorted order) its fields and
/// the files holding them.
#[derive(Debug, Default)]
pub struct Folder {
    /// `(key, [(field, file)])`, sorted by key, fields in file-name order.
    pub samples: Vec<(String, Vec<(String, PathBuf)>)>,
    /// Files whose names have no extension (readers skip such members too).
    pub skipped: Vec<PathBuf>,
}

/// Groups the files under `root` (recursively, in sorted order) into
/// samples by webdataset's rule.
pub fn group_folder(root: &Path) -> Result<Folder> {
    let mut files = Vec::new();
    let mut pending = vec![root.to_owned()];
    while let Some(dir) = pending.pop() {
        let entries = std::fs::read_dir(&dir)
            .map_err(|e| refuse("SRC", format!("cannot list {}: {e}", dir.display())))?;
        for entry in entries {
            let entry =
                entry.map_err(|e| refuse("SRC", format!("cannot list {}: {e}", dir.display())))?;
            let path = entry.path();
            let kind = entry
                .file_type()
                .map_err(|e| refuse("SRC", format!("{}: {e}", path.display())))?;
            if kind.is_dir() {
                pending.push(path);
            } else if kind.is_file() || path.is_file() {
                files.push(path);
            }
        }
    }
    files.sort();
    let mut grouped: BTreeMap<String, Vec<(String, PathBuf)>> = BTreeMap::new();
    let mut folder = Folder::default();
    for path in files {
        let relative = path.strip_prefix(root).unwrap_or(&path);
        let Some(name) = relative.to_str() else {
            return Err(refuse(
                "SRC",
                format!("{}: the file name is not UTF-8", path.display()),
            ));
        };
        let name = name.replace(std::path::MAIN_SEPARATOR, "/");
        let (dir, base) = name
            .rsplit_once('/')
            .map_or(("", name.as_str()), |(d, b)| (d, b));
        match base.split_once('.') {
            Some((stem, extension)) if !stem.is_empty() && !extension.is_empty() => {
                let key = if dir.is_empty() {
                    stem.to_owned()
                } else {
                    format!("{dir}/{stem}")
                };
                grouped
                    .entry(key)
                    .or_default()
                    .push((extension.to_lowercase(), path.clone()));
            }
            _ => folder.skipped.push(path.clone()),
        }
    }
    folder.samples = grouped.into_iter().collect();
    Ok(folder)
}

/// Label fields by key, from a labels file.
#[derive(Debug, Default)]
pub struct Labels {
    /// The fields of each key, in column (or object) order.
    pub by_key: HashMap<String, Vec<(String, FieldValue)>>,
    /// Keys in file order, with the line each came from.
    pub order: Vec<(String, usize)>,
}

/// The column (or JSON member) that holds the key.
const KEY_COLUMNS: [&str; 2] = ["__key__", "key"];

/// Reads a labels file: `.csv` (a header row; a `__key__` or `key`
/// column; every other column a field, its cells as text) or `.jsonl`
/// (one object per line, with `__key__` or `key`; strings as text, numbers
/// and bools as the writer encodes numbers, objects and arrays as JSON;
/// `null` leaves the field out).
pub fn read_labels(path: &Path) -> Result<Labels> {
    let name = path.display().to_string();
    let bad =
        |line: usize, reason: String| refuse("--labels", format!("{name} line {line}: {reason}"));
    let mut labels = Labels::default();
    let mut add = |key: String, line: usize, fields: Vec<(String, FieldValue)>| {
        if labels.by_key.insert(key.clone(), fields).is_some() {
            return Err(bad(line, format!("key {key:?} is labelled twice")));
        }
        labels.order.push((key, line));
        Ok(())
    };
    let extension = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    match extension.to_lowercase().as_str() {
        "csv" => {
            let mut reader = csv::Reader::from_path(path)
                .map_err(|e| refuse("--labels", format!("{name}: {e}")))?;
            let headers: Vec<String> = reader
                .headers()
                .map_err(|e| bad(1, e.to_string()))?
                .iter()
                .map(str::to_owned)
                .collect();
            let Some(key_at) = KEY_COLUMNS
                .iter()
                .find_map(|k| headers.iter().position(|h| h == k))
            else {
                return Err(bad(
                    1,
                    format!(
                        "no \"__key__\" or \"key\" column (columns: {})",
                        headers.join(", ")
                    ),
                ));
            };
            for (row, record) in reader.records().enumerate() {
                let line = row + 2;
                let record = record.map_err(|e| bad(line, e.to_string()))?;
                let key = record.get(key_at).unwrap_or("").to_owned();
                let fields = headers
                    .iter()
                    .zip(record.iter())
                    .enumerate()
                    .filter(|(i, _)| *i != key_at)
                    .map(|(_, (column, cell))| (column.clone(), FieldValue::Text(cell.to_owned())))
                    .collect();
                add(key, line, fields)?;
            }
        }
        "jsonl" | "ndjson" => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| refuse("--labels", format!("{name}: {e}")))?;
            for (i, row) in text.lines().enumerate() {
                let line = i + 1;
                if row.trim().is_empty() {
                    continue;
                }
                let object: serde_json::Map<String, serde_json::Value> = serde_json::from_str(row)
                    .map_err(|e| bad(line, format!("not a JSON object: {e}")))?;
                let Some((key_name, key)) = KEY_COLUMNS
                    .iter()
                    .find_map(|k| object.get(*k).map(|v| (*k, v)))
                else {
                    return Err(bad(line, "no \"__key__\" or \"key\" member".into()));
                };
                let Some(key) = key.as_str().map(str::to_owned) else {
                    return Err(bad(line, format!("the key must be a string, got {key}")));
                };
                let mut fields = Vec::new();
                for (field, value) in object {
                    if field == key_name {
                        continue;
                    }
                    if let Some(value) = json_value(value) {
                        fields.push((field, value));
                    }
                }
                add(key, line, fields)?;
            }
        }
        _ => {
            return Err(refuse(
                "--labels",
                format!("{name}: expected a .csv or .jsonl file"),
            ))
        }
    }
    Ok(labels)
}

/// A JSON label as the writer takes it; `None` for `null`.
fn json_value(value: serde_json::Value) -> Option<FieldValue> {
    use serde_json::Value;
    Some(match value {
        Value::Null => return None,
        Value::String(text) => FieldValue::Text(text),
        Value::Bool(b) => FieldValue::Number {
            kind: "bool".into(),
            text: if b { "True" } else { "False" }.into(),
            json: b.to_string(),
        },
        Value::Number(n) => match n.as_f64().filter(|_| n.is_f64()) {
            Some(x) => float(x),
            None => integer(n.to_string()),
        },
        Value::Array(_) | Value::Object(_) => FieldValue::Json {
            kind: if value.is_array() { "list" } else { "dict" }.into(),
            json: value.to_string(),
        },
    })
}

fn integer(text: String) -> FieldValue {
    FieldValue::Number {
        kind: "int".into(),
        json: text.clone(),
        text,
    }
}

fn float(x: f64) -> FieldValue {
    FieldValue::Number {
        kind: "float".into(),
        text: python_float_text(x),
        json: python_float_json(x),
    }
}

/// The value of row `row` of `array` (`None` for a null), or why the
/// column's type cannot be written.
fn cell(array: &dyn Array, row: usize) -> std::result::Result<Option<FieldValue>, String> {
    if array.is_null(row) {
        return Ok(None);
    }
    let int = |v: String| Ok(Some(integer(v)));
    match array.data_type() {
        DataType::Binary => Ok(Some(FieldValue::Bytes(array.as_binary::<i32>().value(row).to_vec()))),
        DataType::LargeBinary => Ok(Some(FieldValue::Bytes(array.as_binary::<i64>().value(row).to_vec()))),
        DataType::FixedSizeBinary(_) => Ok(Some(FieldValue::Bytes(array.as_fixed_size_binary().value(row).to_vec()))),
        DataType::Utf8 => Ok(Some(FieldValue::Text(array.as_string::<i32>().value(row).to_owned()))),
        DataType::LargeUtf8 => Ok(Some(FieldValue::Text(array.as_string::<i64>().value(row).to_owned()))),
        DataType::Boolean => {
            let b = array.as_boolean().value(row);
            Ok(Some(FieldValue::Number {
                kind: "bool".into(),
                text: if b { "True" } else { "False" }.into(),
                json: b.to_string(),
            }))
        }
        DataType::Int8 => int(array.as_primitive::<Int8Type>().value(row).to_string()),
        DataType::Int16 => int(array.as_primitive::<Int16Type>().value(row).to_string()),
        DataType::Int32 => int(array.as_primitive::<Int32Type>().value(row).to_string()),
        DataType::Int64 => int(array.as_primitive::<Int64Type>().value(row).to_string()),
        DataType::UInt8 => int(array.as_primitive::<UInt8Type>().value(row).to_string()),
        DataType::UInt16 => int(array.as_primitive::<UInt16Type>().value(row).to_string()),
        DataType::UInt32 => int(array.as_primitive::<UInt32Type>().value(row).to_string()),
        DataType::UInt64 => int(array.as_primitive::<UInt64Type>().value(row).to_string()),
        DataType::Float32 => Ok(Some(float(f64::from(array.as_primitive::<Float32Type>().value(row))))),
        DataType::Float64 => Ok(Some(float(array.as_primitive::<Float64Type>().value(row)))),
        other => Err(format!(
            "columns of type {other} cannot be written: binary, string, integer, float and boolean columns can"
        )),
    }
}

/// Calls `each(key, fields)` for every row of the Parquet files `paths`,
/// in order: the key from `key_column` (a string or integer column; a
/// null key is an error), fields `(field, column)` from `columns` (all
/// other columns, named as they are, when `None`). A null cell leaves its
/// field out of that sample.
pub fn parquet_rows(
    paths: &[PathBuf],
    key_column: &str,
    columns: Option<&[(String, String)]>,
    mut each: impl FnMut(String, Vec<(String, FieldValue)>) -> Result<()>,
) -> Result<()> {
    for path in paths {
        let name = path.display().to_string();
        let fail = |e: &dyn std::fmt::Display| refuse("SRC", format!("{name}: {e}"));
        let file = std::fs::File::open(path).map_err(|e| fail(&e))?;
        let builder = ParquetRecordBatchReaderBuilder::try_new(file).map_err(|e| fail(&e))?;
        let schema = builder.schema().clone();
        let position = |column: &str, option: &'static str| {
            schema.index_of(column).map_err(|_| {
                let names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
                refuse(
                    option,
                    format!(
                        "{name} has no column {column:?} (columns: {})",
                        names.join(", ")
                    ),
                )
            })
        };
        let key_at = position(key_column, "--key-column")?;
        let wanted: Vec<(String, usize)> = match columns {
            Some(columns) => columns
                .iter()
                .map(|(field, column)| Ok((field.clone(), position(column, "--columns")?)))
                .collect::<Result<_>>()?,
            None => schema
                .fields()
                .iter()
                .enumerate()
                .filter(|(i, _)| *i != key_at)
                .map(|(i, f)| (f.name().clone(), i))
                .collect(),
        };
        let mut roots: Vec<usize> = wanted.iter().map(|(_, i)| *i).chain([key_at]).collect();
        roots.sort_unstable();
        roots.dedup();
        let mask = ProjectionMask::roots(builder.parquet_schema(), roots.iter().copied());
        let reader = builder
            .with_projection(mask)
            .with_batch_size(PARQUET_BATCH_ROWS)
            .build()
            .map_err(|e| fail(&e))?;
        // Projected batches keep the selected columns in schema order.
        let at = |i: usize| roots.binary_search(&i).expect("projected");
        let mut row_base = 0usize;
        for batch in reader {
            let batch = batch.map_err(|e| fail(&e))?;
            let keys = batch.column(at(key_at));
            for row in 0..batch.num_rows() {
                let key = match cell(keys.as_ref(), row) {
                    Ok(Some(FieldValue::Text(key))) => key,
                    Ok(Some(FieldValue::Number { kind, text, .. })) if kind == "int" => text,
                    Ok(None) => {
                        return Err(refuse(
                            "--key-column",
                            format!("{name} row {}: the key is null", row_base + row),
                        ))
                    }
                    _ => {
                        return Err(refuse(
                            "--key-column",
                            format!(
                            "{name}: the key column {key_column:?} must hold strings or integers"
                        ),
                        ))
                    }
                };
                let mut fields = Vec::with_capacity(wanted.len());
                for (field, i) in &wanted {
                    let column = &schema.fields()[*i];
                    match cell(batch.column(at(*i)).as_ref(), row) {
                        Ok(Some(value)) => fields.push((field.clone(), value)),
                        Ok(None) => {}
                        Err(why) => {
                            return Err(refuse(
                                "--columns",
                                format!("{name} column {:?}: {why}", column.name()),
                            ))
                        }
                    }
                }
                each(key, fields)?;
            }
            row_base += batch.num_rows();
        }
    }
    Ok(())
}

/// Rows in the Parquet files `paths`, from their footers.
pub fn parquet_row_count(paths: &[PathBuf]) -> Result<u64> {
    let mut rows = 0u64;
    for path in paths {
        let file = std::fs::File::open(path)
            .map_err(|e| refuse("SRC", format!("{}: {e}", path.display())))?;
        let builder = ParquetRecordBatchReaderBuilder::try_new(file)
            .map_err(|e| refuse("SRC", format!("{}: {e}", path.display())))?;
        rows += builder.metadata().file_metadata().num_rows().max(0) as u64;
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn folders_group_by_the_first_dot_of_the_file_name() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        std::fs::create_dir(root.join("sub")).unwrap();
        for name in [
            "a.jpg",
            "a.CLS",
            "a.seg.png",
            "b.jpg",
            "README",
            ".hidden",
            "sub/c.txt",
        ] {
            std::fs::write(root.join(name), name).unwrap();
        }
        let folder = group_folder(root).unwrap();
        let shape: Vec<(String, Vec<String>)> = folder
            .samples
            .iter()
            .map(|(k, fields)| (k.clone(), fields.iter().map(|(f, _)| f.clone()).collect()))
            .collect();
        assert_eq!(
            shape,
            [
                (
                    "a".to_owned(),
                    vec!["cls".to_owned(), "jpg".into(), "seg.png".into()]
                ),
                ("b".to_owned(), vec!["jpg".to_owned()]),
                ("sub/c".to_owned(), vec!["txt".to_owned()]),
            ]
        );
        assert_eq!(folder.skipped.len(), 2);
    }

    #[test]
    fn labels_are_read_from_csv_and_json_lines() {
        let dir = tempfile::tempdir().unwrap();
        let csv = dir.path().join("l.csv");
        std::fs::write(&csv, "key,cls,txt\na,1,\"x, y\"\nb,2,z\n").unwrap();
        let labels = read_labels(&csv).unwrap();
        assert_eq!(
            labels.by_key["a"],
            [
                ("cls".to_owned(), FieldValue::Text("1".into())),
                ("txt".to_owned(), FieldValue::Text("x, y".into()))
            ]
        );
        let jsonl = dir.path().join("l.jsonl");
        std::fs::write(
            &jsonl,
            "{\"__key__\": \"a\", \"cls\": 3, \"score\": 0.5, \"no\": null}\n",
        )
        .unwrap();
        let labels = read_labels(&jsonl).unwrap();
        assert_eq!(labels.by_key["a"].len(), 2);
        assert_eq!(labels.by_key["a"][0].1, integer("3".into()));
        std::fs::write(&csv, "key,cls\na,1\na,2\n").unwrap();
        let err = read_labels(&csv).unwrap_err().to_string();
        assert!(err.contains("line 3") && err.contains("twice"), "{err}");
        std::fs::write(&csv, "name,cls\na,1\n").unwrap();
        assert!(read_labels(&csv)
            .unwrap_err()
            .to_string()
            .contains("no \"__key__\""));
    }
}
