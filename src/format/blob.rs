//! Raw objects: the whole body of one file or object is one sample.

use super::{reserve_room, ByteSource, Sample, SampleId, ShardRef, Value, GIVEN_NAMES};
use crate::error::{Error, Result};
use crate::location::Location;

/// Splits an object's URL into `(key, field)`: the key is its path (the
/// object key on S3) with the file name cut at its first dot, the field
/// the lower-cased rest, or `"bytes"` when the name has no dot.
pub fn split_object_url(url: &str) -> (String, String) {
    let path = match Location::parse(url) {
        Location::S3 { key, .. } => key,
        Location::Http(url) => crate::location::url_path(&url),
        Location::Local(path) => path.to_string_lossy().into_owned(),
    };
    let name_start = path.rfind('/').map_or(0, |i| i + 1);
    match path[name_start..].find('.') {
        Some(dot) if dot > 0 => {
            let dot = name_start + dot;
            (path[..dot].to_owned(), path[dot + 1..].to_lowercase())
        }
        _ => (path, "bytes".to_owned()),
    }
}

/// Bytes reserved first for an object's body; it then grows by as much
/// again as it holds.
const FIRST_RESERVE: u64 = 64 << 10;

/// Reads the whole object from `reader` as the one sample of `shard`. The
/// body grows fallibly: an object larger than the memory the process can
/// get is an [`Error::Read`] saying so, not an abort.
/// A name's field that is one shardstream gives each sample (`x.__url__`)
/// is a [`Error::Format`]: the body would replace that name, or be replaced.
pub fn read_object<R: ByteSource>(reader: &mut R, shard: &ShardRef) -> Result<Sample> {
    let (key, field) = split_object_url(&shard.url);
    if GIVEN_NAMES.contains(&field.as_str()) {
        return Err(shard.format_error(
            0,
            None,
            format!("field {field:?} is a name shardstream gives each sample: rename the object"),
        ));
    }
    let mut body = Vec::new();
    if let Err(source) = read_body(reader, &mut body) {
        let failure = (source.kind() != std::io::ErrorKind::OutOfMemory)
            .then(|| reader.take_failure())
            .flatten();
        return Err(failure.unwrap_or(Error::Read {
            url: shard.url.to_string(),
            offset: body.len() as u64,
            source,
        }));
    }
    let length = body.len() as u64;
    Ok(Sample {
        id: SampleId {
            shard: shard.index,
            index: 0,
        },
        key,
        url: shard.url.clone(),
        fields: vec![(field, Value::Bytes(body.into()))],
        offset: 0,
        length,
    })
}

/// Appends the rest of `reader` to `body`, growing it with
/// [`reserve_room`].
fn read_body<R: ByteSource>(reader: &mut R, body: &mut Vec<u8>) -> std::io::Result<()> {
    loop {
        let room = reserve_room(body, u64::MAX, FIRST_RESERVE)?;
        match reader.read_append(body, room) {
            Ok(0) => return Ok(()),
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[test]
    fn splits_key_and_field_like_tar_members() {
        assert_eq!(
            split_object_url("s3://bucket/images/cat/001.JPG"),
            ("images/cat/001".to_owned(), "jpg".to_owned())
        );
        assert_eq!(
            split_object_url("/data/a.b/clip.seg.wav"),
            ("/data/a.b/clip".to_owned(), "seg.wav".to_owned())
        );
        assert_eq!(
            split_object_url("file:///data/README"),
            ("/data/README".to_owned(), "bytes".to_owned())
        );
        assert_eq!(
            split_object_url("s3://b/.hidden"),
            (".hidden".to_owned(), "bytes".to_owned())
        );
    }

    #[test]
    fn reads_the_whole_body_as_one_sample() {
        let shard = ShardRef::whole(3, Arc::from("s3://b/x/7.json"));
        let mut body: &[u8] = b"{\"a\": 1}";
        let sample = read_object(&mut body, &shard).unwrap();
        assert_eq!(sample.id, SampleId { shard: 3, index: 0 });
        assert_eq!(sample.key, "x/7");
        assert_eq!(
            sample.fields,
            vec![("json".to_owned(), b"{\"a\": 1}".to_vec().into())]
        );
        assert_eq!(sample.length, 8);
    }

    #[test]
    fn a_field_named_as_a_given_name_is_an_error() {
        for name in ["x.__url__", "x.__KEY__", "x.__id__", "x.__seed__"] {
            let shard = ShardRef::whole(0, Arc::from(format!("/data/{name}")));
            let error = read_object(&mut &b"body"[..], &shard).unwrap_err();
            assert!(matches!(error, Error::Format { .. }), "{name}: {error}");
            assert!(error.to_string().contains("rename the object"), "{error}");
        }
        // A name merely like one is a field as any other.
        let shard = ShardRef::whole(0, Arc::from("/data/x.__url__.json"));
        assert!(read_object(&mut &b"{}"[..], &shard).is_ok());
    }
}
