//! Where one shard's bytes go while it is written: a temporary file beside
//! its final name, renamed into place when the shard is complete, or an S3
//! multipart upload whose parts go up as they fill, up to
//! [`PARTS_IN_FLIGHT`] at once while the next one fills, and which is
//! completed at the shard's end. Either is aborted (the file removed, the
//! parts in flight stopped and the upload aborted) when the shard is not
//! completed, so no half-written shard is left behind.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use aws_sdk_s3::primitives::ByteStream;
use aws_sdk_s3::types::{CompletedMultipartUpload, CompletedPart};
use bytes::Bytes;

use crate::error::{Error, Result};
use crate::store::s3::S3Client;

/// The smallest part S3 takes (all but the last part of an upload).
pub const MIN_PART_BYTES: usize = 5 << 20;
/// The most parts of one multipart upload.
const MAX_PARTS: i32 = 10_000;
/// The most parts of one shard uploading at once. With the part being
/// filled, a shard holds at most `PARTS_IN_FLIGHT + 1` part buffers (of
/// the `s3` option `part_size`, 8 MiB by default: 40 MiB).
const PARTS_IN_FLIGHT: usize = 4;

/// What is known of a shard once it is complete.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    /// Its size in bytes.
    pub size: u64,
    /// Its ETag (S3).
    pub etag: Option<String>,
    /// Its modification time in nanoseconds since the epoch (local).
    pub mtime_ns: Option<u64>,
}

/// An S3 client with the runtime its requests run on.
pub struct S3Target {
    /// The runtime the writer's requests run on.
    pub runtime: Arc<tokio::runtime::Runtime>,
    /// The client (credentials, retries and timeouts of the `s3=` options).
    pub client: Arc<S3Client>,
    /// The process the runtime's threads run in (`std::process::id`).
    pub pid: u32,
}

impl S3Target {
    /// Runs one request to completion.
    fn run<T>(&self, request: impl std::future::Future<Output = T>) -> T {
        self.runtime.block_on(request)
    }

    /// Whether this is the process the runtime was made in: a forked
    /// child has none of its threads, and a request there would wait for
    /// them for ever.
    fn in_its_process(&self) -> bool {
        std::process::id() == self.pid
    }

    /// The error for a request from a forked child.
    fn forked(&self, url: &str, offset: u64) -> Error {
        Error::Write {
            url: url.to_owned(),
            offset,
            reason: forked_reason(self.pid),
        }
    }
}

impl Drop for S3Target {
    /// In a forked child the runtime is leaked, not shut down: shutting it
    /// down would wait for threads that do not exist there.
    fn drop(&mut self) {
        if !self.in_its_process() {
            std::mem::forget(self.runtime.clone());
        }
    }
}

/// One shard being written.
pub enum Sink {
    /// A local file, under a temporary name until it is complete.
    Local(LocalFile),
    /// An S3 object, uploaded as it is written.
    S3(Upload),
}

/// A local shard under its temporary name.
pub struct LocalFile {
    /// The open file; taken when the shard is committed.
    file: Option<BufWriter<File>>,
    temporary: PathBuf,
    path: PathBuf,
    written: u64,
    poisoned: bool,
}

/// The upload of one part, running on the target's runtime.
type PartTask = tokio::task::JoinHandle<Result<CompletedPart>>;

/// An S3 shard: bytes gather into a part; the first full part starts a
/// multipart upload, and each full part goes up on a task of its own while
/// the next fills (at most [`PARTS_IN_FLIGHT`] at once). A shard smaller
/// than one part is a single PUT.
pub struct Upload {
    target: Arc<S3Target>,
    bucket: String,
    key: String,
    url: String,
    part_bytes: usize,
    buffer: Vec<u8>,
    upload_id: Option<String>,
    /// The parts uploaded, in order.
    parts: Vec<CompletedPart>,
    /// The parts uploading, oldest (lowest number) first.
    in_flight: VecDeque<PartTask>,
    /// The number of the next part.
    next_part: i32,
    written: u64,
    /// Whether a part failed (its error went to the writer) or the shard
    /// was abandoned: nothing more is sent.
    failed: bool,
}

/// Creates the temporary file of `path`: hidden, in the same directory (so
/// the rename stays on one file system), with no shard suffix (so datasets
/// never list it), and a name of its own (`.NAME.PID.N.partial`, `N`
/// counting the files this process made), created only where nothing is:
/// two writers of one process (a manifest each, in one directory) never
/// share one, and a file or link already at the name (left by a process
/// of the same id, or planted) is passed over, never written through.
fn create_temporary(path: &Path) -> io::Result<(File, PathBuf)> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut taken = None;
    for _ in 0..TEMPORARY_TRIES {
        let n = TEMPORARIES_MADE.fetch_add(1, Ordering::Relaxed);
        let temporary = path.with_file_name(format!(".{name}.{}.{n}.partial", std::process::id()));
        match File::options()
            .write(true)
            .create_new(true)
            .open(&temporary)
        {
            Ok(file) => return Ok((file, temporary)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => taken = Some(temporary),
            Err(e) => return Err(e),
        }
    }
    Err(io::Error::new(
        io::ErrorKind::AlreadyExists,
        format!(
            "{TEMPORARY_TRIES} temporary names in a row were taken, the last {}",
            taken.map(|t| t.display().to_string()).unwrap_or_default()
        ),
    ))
}

/// Temporary names [`create_temporary`] tries before it gives up.
const TEMPORARY_TRIES: usize = 64;

/// Temporary names this process has tried (the `N` of the next one).
static TEMPORARIES_MADE: AtomicU64 = AtomicU64::new(0);

/// Flushes the directory `dir` itself, so that a rename in it is durable.
fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    })?
    .sync_all()
}

impl Sink {
    /// Starts the local shard `path` (under its temporary name).
    pub fn local(path: &Path) -> Result<Self> {
        let (file, temporary) = create_temporary(path).map_err(|e| Error::Write {
            url: path.display().to_string(),
            offset: 0,
            reason: format!("cannot create its temporary file: {e}"),
        })?;
        Ok(Sink::Local(LocalFile {
            file: Some(BufWriter::with_capacity(1 << 20, file)),
            temporary,
            path: path.to_owned(),
            written: 0,
            poisoned: false,
        }))
    }

    /// Starts the S3 shard `s3://bucket/key`; parts of `part_bytes` (at
    /// least [`MIN_PART_BYTES`]).
    pub fn s3(target: Arc<S3Target>, bucket: &str, key: &str, part_bytes: usize) -> Self {
        Sink::S3(Upload {
            target,
            bucket: bucket.to_owned(),
            key: key.to_owned(),
            url: format!("s3://{bucket}/{key}"),
            part_bytes: part_bytes.max(MIN_PART_BYTES),
            buffer: Vec::new(),
            upload_id: None,
            parts: Vec::new(),
            in_flight: VecDeque::new(),
            next_part: 1,
            written: 0,
            failed: false,
        })
    }

    /// Makes the shard whole: flushed and renamed into place (with the
    /// file and its directory synced), or its upload completed.
    pub fn commit(self) -> Result<Stored> {
        match self {
            Sink::Local(f) => f.commit(),
            Sink::S3(u) => u.commit(),
        }
    }

    /// Refuses every later write, so that dropping the compressor on top
    /// of it (which flushes) sends nothing more; dropping the sink then
    /// removes the temporary file or aborts the upload.
    pub fn poison(&mut self) {
        match self {
            Sink::Local(f) => f.poisoned = true,
            Sink::S3(u) => u.failed = true,
        }
    }
}

impl LocalFile {
    fn commit(mut self) -> Result<Stored> {
        let fail = |what: &str, e: io::Error| Error::Write {
            url: self.path.display().to_string(),
            offset: self.written,
            reason: format!("{what}: {e}"),
        };
        let Some(file) = self.file.take() else {
            return Err(fail("already committed", io::ErrorKind::Other.into()));
        };
        let file = file
            .into_inner()
            .map_err(|e| fail("cannot flush", e.into_error()))?;
        file.sync_all().map_err(|e| fail("cannot sync", e))?;
        drop(file);
        if let Err(e) = std::fs::rename(&self.temporary, &self.path) {
            return Err(fail("cannot rename into place", e));
        }
        // Renamed: nothing for `drop` to remove.
        self.temporary = PathBuf::new();
        sync_dir(self.path.parent().unwrap_or(Path::new(".")))
            .map_err(|e| fail("cannot sync the directory", e))?;
        let size = std::fs::metadata(&self.path)
            .map_err(|e| fail("cannot stat", e))?
            .len();
        Ok(Stored {
            size,
            etag: None,
            mtime_ns: crate::manifest::mtime_ns(&self.path),
        })
    }
}

impl Drop for LocalFile {
    /// A shard not renamed into place is removed.
    fn drop(&mut self) {
        if let Some(file) = self.file.take() {
            // Its buffer is dropped unwritten.
            drop(file.into_parts());
        }
        if !self.temporary.as_os_str().is_empty() {
            let _ = std::fs::remove_file(&self.temporary);
        }
    }
}

impl Write for Sink {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        match self {
            Sink::Local(f) => {
                let file = match (&mut f.file, f.poisoned) {
                    (Some(file), false) => file,
                    _ => return Err(io::Error::other("the shard was abandoned")),
                };
                let n = file.write(bytes)?;
                f.written += n as u64;
                Ok(n)
            }
            Sink::S3(u) => {
                if u.failed {
                    return Err(io::Error::other("the upload failed earlier"));
                }
                let room = u.part_bytes - u.buffer.len();
                let n = bytes.len().min(room);
                u.buffer.extend_from_slice(&bytes[..n]);
                u.written += n as u64;
                if u.buffer.len() == u.part_bytes {
                    // The crate's error travels inside the I/O error, for
                    // the writer to take back out.
                    u.upload_part().map_err(|e| {
                        u.failed = true;
                        io::Error::other(e)
                    })?;
                }
                Ok(n)
            }
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Sink::Local(f) => f.file.as_mut().map_or(Ok(()), |file| file.flush()),
            // Parts go up when full; the rest at commit.
            Sink::S3(_) => Ok(()),
        }
    }
}

/// The writer's form of a failed S3 request: reads and writes share the
/// client's classification; its "read" wording is replaced.
fn upload_error(url: &str, offset: u64, what: &str, error: Error) -> Error {
    match error {
        Error::Read { source, .. } | Error::NotFound { source, .. } => Error::Write {
            url: url.to_owned(),
            offset,
            reason: format!("{what}: {source}"),
        },
        Error::Changed { .. } | Error::Timeout { .. } => Error::Write {
            url: url.to_owned(),
            offset,
            reason: format!("{what}: {error}"),
        },
        other => other,
    }
}

impl Upload {
    /// Starts uploading the buffered bytes as the next part, starting the
    /// multipart upload first if this is the first part. Waits for the
    /// oldest part in flight while [`PARTS_IN_FLIGHT`] are; the error of
    /// any part that has ended in failure is returned here.
    fn upload_part(&mut self) -> Result<()> {
        if !self.target.in_its_process() {
            return Err(self.target.forked(&self.url, self.written));
        }
        self.collect_ended()?;
        while self.in_flight.len() >= PARTS_IN_FLIGHT {
            self.wait_oldest()?;
        }
        let offset = self.written - self.buffer.len() as u64;
        let (client, url) = (self.target.client.clone(), self.url.clone());
        let upload_id = match &self.upload_id {
            Some(id) => id.clone(),
            None => {
                let output = self
                    .target
                    .run(client.send_with_retries(&url, "CreateMultipartUpload", || {
                        client
                            .sdk()
                            .create_multipart_upload()
                            .bucket(&self.bucket)
                            .key(&self.key)
                            .send()
                    }))
                    .map_err(|e| upload_error(&url, offset, "starting the multipart upload", e))?;
                let id = output.upload_id().unwrap_or_default().to_owned();
                if id.is_empty() {
                    return Err(Error::Write {
                        url,
                        offset,
                        reason: "the store started a multipart upload with no upload id".into(),
                    });
                }
                self.upload_id = Some(id.clone());
                id
            }
        };
        let number = self.next_part;
        if number > MAX_PARTS {
            return Err(Error::Write {
                url,
                offset,
                reason: format!(
                    "a shard of more than {MAX_PARTS} parts of {} bytes: set max_bytes lower (or s3 part_size higher)",
                    self.part_bytes
                ),
            });
        }
        let body = Bytes::from(std::mem::take(&mut self.buffer));
        let (bucket, key) = (self.bucket.clone(), self.key.clone());
        let task = self.target.runtime.spawn(async move {
            let output = client
                .send_with_retries(&url, "UploadPart", || {
                    client
                        .sdk()
                        .upload_part()
                        .bucket(&bucket)
                        .key(&key)
                        .upload_id(&upload_id)
                        .part_number(number)
                        .body(ByteStream::from(body.clone()))
                        .send()
                })
                .await
                .map_err(|e| upload_error(&url, offset, &format!("uploading part {number}"), e))?;
            Ok(CompletedPart::builder()
                .set_e_tag(output.e_tag().map(str::to_owned))
                .part_number(number)
                .build())
        });
        self.in_flight.push_back(task);
        self.next_part += 1;
        self.buffer = Vec::with_capacity(self.part_bytes);
        Ok(())
    }

    /// Takes in the parts at the front of the queue that have ended: the
    /// first error among them, if any.
    fn collect_ended(&mut self) -> Result<()> {
        while self
            .in_flight
            .front()
            .is_some_and(|task| task.is_finished())
        {
            self.wait_oldest()?;
        }
        Ok(())
    }

    /// Waits for the oldest part in flight and lists it as uploaded.
    fn wait_oldest(&mut self) -> Result<()> {
        let Some(task) = self.in_flight.pop_front() else {
            return Ok(());
        };
        let part = self.target.run(task).map_err(|e| Error::Write {
            url: self.url.clone(),
            offset: self.written,
            reason: format!("a part's upload stopped: {e}"),
        })??;
        self.parts.push(part);
        Ok(())
    }

    fn commit(mut self) -> Result<Stored> {
        let result = self.finish_upload();
        if result.is_err() {
            let _ = self.abort_upload();
        }
        result
    }

    fn finish_upload(&mut self) -> Result<Stored> {
        if !self.target.in_its_process() {
            return Err(self.target.forked(&self.url, self.written));
        }
        if self.failed {
            return Err(Error::Write {
                url: self.url.clone(),
                offset: self.written,
                reason: "the upload failed earlier".into(),
            });
        }
        let (client, url) = (self.target.client.clone(), self.url.clone());
        let size = self.written;
        let etag = if self.upload_id.is_none() {
            let body = Bytes::from(std::mem::take(&mut self.buffer));
            let output = self
                .target
                .run(client.send_with_retries(&url, "PutObject", || {
                    client
                        .sdk()
                        .put_object()
                        .bucket(&self.bucket)
                        .key(&self.key)
                        .body(ByteStream::from(body.clone()))
                        .send()
                }))
                .map_err(|e| upload_error(&url, 0, "uploading the shard", e))?;
            output.e_tag().map(str::to_owned)
        } else {
            if !self.buffer.is_empty() {
                self.upload_part()?;
            }
            while !self.in_flight.is_empty() {
                self.wait_oldest()?;
            }
            let upload_id = self.upload_id.clone().unwrap_or_default();
            let parts = CompletedMultipartUpload::builder()
                .set_parts(Some(self.parts.clone()))
                .build();
            let output = self
                .target
                .run(
                    client.send_with_retries(&url, "CompleteMultipartUpload", || {
                        client
                            .sdk()
                            .complete_multipart_upload()
                            .bucket(&self.bucket)
                            .key(&self.key)
                            .upload_id(&upload_id)
                            .multipart_upload(parts.clone())
                            .send()
                    }),
                )
                .map_err(|e| upload_error(&url, size, "completing the multipart upload", e))?;
            self.upload_id = None;
            output.e_tag().map(str::to_owned)
        };
        Ok(Stored {
            size,
            etag,
            mtime_ns: None,
        })
    }

    /// Stops the parts in flight (waiting until each has), then aborts the
    /// multipart upload, if one was started, so that no part of it is kept.
    fn abort_upload(&mut self) -> Result<()> {
        if !self.target.in_its_process() {
            // The parts and the upload are the parent's to finish.
            self.in_flight.clear();
            self.upload_id = None;
            return Ok(());
        }
        for task in &self.in_flight {
            task.abort();
        }
        for task in std::mem::take(&mut self.in_flight) {
            let _ = self.target.run(task);
        }
        let Some(upload_id) = self.upload_id.take() else {
            return Ok(());
        };
        let (client, url) = (self.target.client.clone(), self.url.clone());
        self.target
            .run(client.send_with_retries(&url, "AbortMultipartUpload", || {
                client
                    .sdk()
                    .abort_multipart_upload()
                    .bucket(&self.bucket)
                    .key(&self.key)
                    .upload_id(&upload_id)
                    .send()
            }))
            .map(drop)
            .map_err(|e| upload_error(&url, self.written, "aborting the multipart upload", e))
    }
}

impl Drop for Upload {
    /// An upload neither completed nor aborted (a sample refused, a panic
    /// on the way) is aborted, its parts in flight stopped first, so no
    /// pending upload is left.
    fn drop(&mut self) {
        let _ = self.abort_upload();
    }
}

/// Checks, before anything is written, that `bucket` exists and that
/// credentials load and are accepted (HeadBucket). A refusal (403) is let
/// through: a role may write objects without the right to see the bucket.
pub fn check_bucket(target: &S3Target, bucket: &str) -> Result<()> {
    let url = format!("s3://{bucket}/");
    let client = target.client.clone();
    let answer = target.run(client.send_with_retries(&url, "HeadBucket", || {
        client.sdk().head_bucket().bucket(bucket).send()
    }));
    match answer {
        Ok(_) | Err(Error::AccessDenied { .. }) => Ok(()),
        Err(Error::NotFound { .. }) => Err(Error::Config {
            name: "pattern",
            reason: format!("the bucket {bucket:?} does not exist"),
        }),
        Err(other) => Err(upload_error(&url, 0, "checking the bucket", other)),
    }
}

/// Writes a small object whole (the manifest): a local file under a
/// temporary name renamed into place, or one PUT.
pub fn put_whole(
    target: Option<&S3Target>,
    bucket: &str,
    name: &str,
    bytes: Vec<u8>,
) -> Result<()> {
    match target {
        None => {
            let path = Path::new(name);
            let fail = |e: io::Error| Error::Write {
                url: name.to_owned(),
                offset: 0,
                reason: e.to_string(),
            };
            let (mut file, temporary) = create_temporary(path).map_err(fail)?;
            let written = file.write_all(&bytes).and_then(|()| file.sync_all());
            drop(file);
            if let Err(e) = written.and_then(|()| std::fs::rename(&temporary, path)) {
                let _ = std::fs::remove_file(&temporary);
                return Err(fail(e));
            }
            sync_dir(path.parent().unwrap_or(Path::new("."))).map_err(fail)
        }
        Some(target) => {
            let url = format!("s3://{bucket}/{name}");
            if !target.in_its_process() {
                return Err(target.forked(&url, 0));
            }
            let body = Bytes::from(bytes);
            let client = target.client.clone();
            target
                .run(client.send_with_retries(&url, "PutObject", || {
                    client
                        .sdk()
                        .put_object()
                        .bucket(bucket)
                        .key(name)
                        .body(ByteStream::from(body.clone()))
                        .send()
                }))
                .map(drop)
                .map_err(|e| upload_error(&url, 0, "uploading", e))
        }
    }
}

/// Why a forked child may not use a writer made in process `pid`.
pub fn forked_reason(pid: u32) -> String {
    format!(
        "the writer was made in process {pid}, and this process was forked from it: \
         a forked process cannot write with it (make a writer in this process)"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two writers of one process with a manifest each in one directory
    /// took one temporary name: one's rename took the other's file away.
    #[test]
    fn each_temporary_file_has_a_name_of_its_own() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("manifest.json");
        let (_, first) = create_temporary(&path).unwrap();
        let (_, second) = create_temporary(&path).unwrap();
        assert_ne!(first, second);
        assert!(first.exists() && second.exists());
        put_whole(None, "", path.to_str().unwrap(), b"{}".to_vec()).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"{}");
        assert!(
            second.exists(),
            "another writer's temporary file is left alone"
        );
    }

    /// A link planted at the names the next temporary files would take is
    /// never written through: the file it points to outside the directory
    /// keeps its bytes, and the shard is a file of its own.
    #[test]
    fn a_link_at_a_temporary_name_is_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let outside = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(outside.path(), b"precious").unwrap();
        let path = dir.path().join("s-0.tar");
        let next = TEMPORARIES_MADE.load(Ordering::Relaxed);
        for n in next..next + 4 {
            let name = format!(".s-0.tar.{}.{n}.partial", std::process::id());
            std::os::unix::fs::symlink(outside.path(), dir.path().join(name)).unwrap();
        }
        let mut sink = Sink::local(&path).unwrap();
        sink.write_all(b"shard bytes").unwrap();
        sink.commit().unwrap();
        assert_eq!(std::fs::read(outside.path()).unwrap(), b"precious");
        assert!(!path.symlink_metadata().unwrap().file_type().is_symlink());
        assert_eq!(std::fs::read(&path).unwrap(), b"shard bytes");
    }
}
