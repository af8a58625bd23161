//! `shardstream-bench-s3`: the S3 side of shardstream's benchmarks.
//!
//! The S3 benchmarks need a server on loopback that is fast enough to measure
//! the *client*. `s3s-fs` (a file-system backed S3 server built on `s3s`) is
//! close, but its stock form measures itself instead:
//!
//! 1. its `GetObject` reads the file in 4 KiB chunks, which caps a single GET
//!    at roughly 80 MB/s of CPU-bound chunk shuffling;
//! 2. its binary never sets `TCP_NODELAY` on accepted connections, so small
//!    responses can sit out a 40 ms delayed-ACK stall (Nagle's algorithm);
//! 3. for objects that were not uploaded through it (files put on disk by a
//!    benchmark's setup), every `HeadObject` and `GetObject` computes the MD5
//!    ETag by reading the whole file, even for a 1 KiB range of a large shard.
//!
//! `serve` fixes these without patching s3s-fs: it accepts connections itself
//! (with `TCP_NODELAY`), and wraps [`s3s_fs::FileSystem`] in [`FastFs`], which
//! delegates every operation but `GetObject` and `HeadObject`. `GetObject` is
//! served here with 1 MiB reads, and `HeadObject` results (ETag included) are
//! cached while the file's size and modification time stay the same.
//!
//! There is no `netem` on the benchmark machines, so `proxy` is a TCP proxy
//! that models a remote store: each request/response turn's first response
//! byte is held back until a given time after the request was sent, and each
//! connection's download bandwidth is capped.
//!
//! ```text
//! shardstream-bench-s3 serve --root DIR --addr 127.0.0.1:9000
//! shardstream-bench-s3 proxy --listen 127.0.0.1:9001 --upstream 127.0.0.1:9000 \
//!     --first-byte-ms 20 --mbps 100
//! ```
//!
//! Both print `listening on http://ADDR` on stdout once they accept
//! connections (port 0 picks a free port, and ADDR shows which); `serve`
//! then prints `get BUCKET/KEY OFFSET LENGTH` for each `GetObject`, from
//! which the benchmark counts the bytes each run fetched.

use std::collections::HashMap;
use std::io::{self, SeekFrom, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use clap::{Args, Parser, Subcommand};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto::Builder as ConnBuilder;
use path_absolutize::Absolutize;
use s3s::auth::SimpleAuth;
use s3s::dto::*;
use s3s::service::S3ServiceBuilder;
use s3s::{S3, S3Error, S3Request, S3Response, S3Result, s3_error};
use s3s_fs::FileSystem;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncSeekExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::{Instant, sleep_until, timeout};
use tokio_util::io::ReaderStream;

/// Bytes read from disk per chunk of a `GetObject` body.
const GET_CHUNK: usize = 1 << 20;
/// Largest write the proxy makes to a client in one go.
const PROXY_CHUNK: usize = 64 << 10;
/// How long a proxied connection may sit with no progress in one direction.
const IDLE_TIMEOUT: Duration = Duration::from_secs(120);
/// How long the proxy waits for the upstream to accept a connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How far the proxy's bandwidth pacing may fall behind (timer jitter) before
/// the lost time is forgiven rather than made up with a burst.
const PACING_SLACK: Duration = Duration::from_millis(20);

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Command line.
#[derive(Debug, Parser)]
#[command(
    version,
    about = "Local S3 server and latency proxy for shardstream's benchmarks"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// The two tools.
#[derive(Debug, Subcommand)]
enum Command {
    /// Serve a directory over S3 (each top-level directory is a bucket).
    Serve(ServeArgs),
    /// Forward TCP connections, adding a first-byte delay and a bandwidth cap.
    Proxy(ProxyArgs),
}

/// Arguments of `serve`.
#[derive(Debug, Args)]
struct ServeArgs {
    /// Directory to serve; each top-level directory in it is a bucket.
    #[arg(long)]
    root: PathBuf,
    /// Address to listen on (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:0")]
    addr: SocketAddr,
    /// Access key that SigV4-signed requests must use.
    #[arg(long, default_value = "shardstream")]
    access_key: String,
    /// Secret key that SigV4-signed requests must use.
    #[arg(long, default_value = "shardstream-secret")]
    secret_key: String,
    /// Turn authentication off: unsigned requests (e.g. curl) are served,
    /// and s3s then rejects signed ones with `NotImplemented`.
    #[arg(long)]
    no_auth: bool,
}

/// Arguments of `proxy`.
#[derive(Debug, Args)]
struct ProxyArgs {
    /// Address to listen on (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Address of the server to forward to.
    #[arg(long)]
    upstream: SocketAddr,
    /// Minimum time from a request to the first byte of its response, in ms.
    #[arg(long, default_value_t = 0)]
    first_byte_ms: u64,
    /// Download bandwidth cap per connection, in MB/s (10^6 bytes); 0: none.
    #[arg(long, default_value_t = 0.0)]
    mbps: f64,
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    match Cli::parse().command {
        Command::Serve(args) => serve(args).await,
        Command::Proxy(args) => proxy(args).await,
    }
}

/// Prints the readiness line that scripts wait for.
fn announce(addr: SocketAddr) -> io::Result<()> {
    let mut out = io::stdout().lock();
    writeln!(out, "listening on http://{addr}")?;
    out.flush()
}

/// Prints `get BUCKET/KEY OFFSET LENGTH` for a `GetObject` about to be
/// served, so a benchmark can add up the bytes each run fetched.
fn log_get(bucket: &str, key: &str, offset: u64, length: u64) {
    let mut out = io::stdout().lock();
    // The log is best effort: a closed stdout must not fail the request.
    let _ = writeln!(out, "get {bucket}/{key} {offset} {length}").and_then(|()| out.flush());
}

/// Accepts the next connection, with `TCP_NODELAY` set; transient accept
/// errors (e.g. out of file descriptors) are reported and retried.
async fn accept(listener: &TcpListener) -> TcpStream {
    loop {
        match listener.accept().await {
            Ok((socket, _)) => {
                if let Err(err) = socket.set_nodelay(true) {
                    eprintln!("set_nodelay: {err}");
                }
                return socket;
            }
            Err(err) => {
                eprintln!("accept: {err}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

// ---------------------------------------------------------------------------
// serve

/// Runs the S3 server until the process is killed.
async fn serve(args: ServeArgs) -> Result<(), BoxError> {
    let fs = FastFs::new(&args.root)?;
    let service = {
        let mut builder = S3ServiceBuilder::new(fs);
        if !args.no_auth {
            builder.set_auth(SimpleAuth::from_single(args.access_key, args.secret_key));
        }
        builder.build()
    };

    let listener = TcpListener::bind(args.addr).await?;
    announce(listener.local_addr()?)?;

    let http = ConnBuilder::new(TokioExecutor::new());
    loop {
        let socket = accept(&listener).await;
        let conn = http
            .serve_connection(TokioIo::new(socket), service.clone())
            .into_owned();
        tokio::spawn(async move {
            // A client hanging up mid-response is not the server's problem.
            let _ = conn.await;
        });
    }
}

/// What a cached `HeadObject` answer was computed from.
struct CachedHead {
    len: u64,
    modified: SystemTime,
    output: HeadObjectOutput,
}

/// [`s3s_fs::FileSystem`] with a fast `GetObject` and a cached `HeadObject`.
///
/// Every other operation is delegated unchanged; those that write clear the
/// cache.
struct FastFs {
    inner: FileSystem,
    /// The canonical root, resolved as s3s-fs resolves it.
    root: PathBuf,
    /// `HeadObject` answers by (bucket, key), valid while the file's size and
    /// modification time are the ones recorded.
    heads: Mutex<HashMap<(String, String), CachedHead>>,
}

impl FastFs {
    /// Serves `root`, which must exist.
    fn new(root: &Path) -> Result<Self, BoxError> {
        let root = std::env::current_dir()?.join(root).canonicalize()?;
        let inner = FileSystem::new(&root).map_err(|e| format!("{e:?}"))?;
        Ok(Self {
            inner,
            root,
            heads: Mutex::default(),
        })
    }

    /// The file behind `bucket/key`, resolved as s3s-fs resolves it.
    fn object_path(&self, bucket: &str, key: &str) -> S3Result<PathBuf> {
        Path::new(bucket)
            .join(key)
            .absolutize_virtually(&self.root)
            .map(std::borrow::Cow::into_owned)
            .map_err(|e| s3_error!(e, InvalidArgument, "invalid object key"))
    }

    /// Forgets every cached `HeadObject` answer (after a write), and passes
    /// the write's result through.
    fn invalidate<T>(&self, result: S3Result<T>) -> S3Result<T> {
        self.heads
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
        result
    }

    /// `HeadObject`, answered from the cache when the file is unchanged.
    async fn head(&self, req: S3Request<HeadObjectInput>) -> S3Result<HeadObjectOutput> {
        let id = (req.input.bucket.clone(), req.input.key.clone());
        let stat = match self.object_path(&id.0, &id.1) {
            Ok(path) => tokio::fs::metadata(path).await.ok(),
            Err(_) => None,
        };
        let stamp = stat.and_then(|m| Some((m.len(), m.modified().ok()?)));
        if let Some((len, modified)) = stamp {
            let heads = self.heads.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(hit) = heads.get(&id)
                && hit.len == len
                && hit.modified == modified
            {
                return Ok(hit.output.clone());
            }
        }
        // Missing objects, bad names and such get s3s-fs's own errors.
        let output = self.inner.head_object(req).await?.output;
        if let Some((len, modified)) = stamp {
            let entry = CachedHead {
                len,
                modified,
                output: output.clone(),
            };
            self.heads
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .insert(id, entry);
        }
        Ok(output)
    }
}

#[async_trait::async_trait]
impl S3 for FastFs {
    /// Streams the object (or the requested range of it) with 1 MiB reads.
    async fn get_object(
        &self,
        req: S3Request<GetObjectInput>,
    ) -> S3Result<S3Response<GetObjectOutput>> {
        let bucket = req.input.bucket.clone();
        let key = req.input.key.clone();
        let range = req.input.range;
        let head = self
            .head(req.map_input(|input| HeadObjectInput {
                bucket: input.bucket,
                key: input.key,
                ..Default::default()
            }))
            .await?;

        let path = self.object_path(&bucket, &key)?;
        let mut file = tokio::fs::File::open(&path)
            .await
            .map_err(|e| s3_error!(e, NoSuchKey))?;
        let meta = file.metadata().await.map_err(S3Error::internal_error)?;
        let file_len = meta.len();
        let last_modified = meta.modified().map_err(S3Error::internal_error)?;

        let (span, content_range) = match range {
            None => (0..file_len, None),
            Some(range) => {
                let span = range.check(file_len)?;
                let content_range = format!("bytes {}-{}/{file_len}", span.start, span.end - 1);
                (span, Some(content_range))
            }
        };
        let content_length = span.end - span.start;
        log_get(&bucket, &key, span.start, content_length);
        if span.start > 0 {
            file.seek(SeekFrom::Start(span.start))
                .await
                .map_err(S3Error::internal_error)?;
        }
        let body = ReaderStream::with_capacity(file.take(content_length), GET_CHUNK);

        // Like s3s-fs (and S3), no whole-object checksum for a partial body.
        let whole = content_length == file_len;
        let pick = |c: Option<String>| if whole { c } else { None };
        let output = GetObjectOutput {
            body: Some(StreamingBlob::wrap(body)),
            content_length: Some(i64::try_from(content_length).map_err(S3Error::internal_error)?),
            content_range,
            last_modified: Some(Timestamp::from(last_modified)),
            e_tag: head.e_tag,
            metadata: head.metadata,
            content_type: head.content_type,
            content_encoding: head.content_encoding,
            content_disposition: head.content_disposition,
            content_language: head.content_language,
            cache_control: head.cache_control,
            expires: head.expires,
            website_redirect_location: head.website_redirect_location,
            checksum_crc32: pick(head.checksum_crc32),
            checksum_crc32c: pick(head.checksum_crc32c),
            checksum_crc64nvme: pick(head.checksum_crc64nvme),
            checksum_sha1: pick(head.checksum_sha1),
            checksum_sha256: pick(head.checksum_sha256),
            ..Default::default()
        };
        Ok(S3Response::new(output))
    }

    /// s3s-fs's `HeadObject`, cached while the file is unchanged.
    async fn head_object(
        &self,
        req: S3Request<HeadObjectInput>,
    ) -> S3Result<S3Response<HeadObjectOutput>> {
        Ok(S3Response::new(self.head(req).await?))
    }

    async fn list_buckets(
        &self,
        req: S3Request<ListBucketsInput>,
    ) -> S3Result<S3Response<ListBucketsOutput>> {
        self.inner.list_buckets(req).await
    }

    async fn head_bucket(
        &self,
        req: S3Request<HeadBucketInput>,
    ) -> S3Result<S3Response<HeadBucketOutput>> {
        self.inner.head_bucket(req).await
    }

    async fn get_bucket_location(
        &self,
        req: S3Request<GetBucketLocationInput>,
    ) -> S3Result<S3Response<GetBucketLocationOutput>> {
        self.inner.get_bucket_location(req).await
    }

    async fn create_bucket(
        &self,
        req: S3Request<CreateBucketInput>,
    ) -> S3Result<S3Response<CreateBucketOutput>> {
        self.inner.create_bucket(req).await
    }

    async fn delete_bucket(
        &self,
        req: S3Request<DeleteBucketInput>,
    ) -> S3Result<S3Response<DeleteBucketOutput>> {
        self.invalidate(self.inner.delete_bucket(req).await)
    }

    async fn list_objects(
        &self,
        req: S3Request<ListObjectsInput>,
    ) -> S3Result<S3Response<ListObjectsOutput>> {
        self.inner.list_objects(req).await
    }

    async fn list_objects_v2(
        &self,
        req: S3Request<ListObjectsV2Input>,
    ) -> S3Result<S3Response<ListObjectsV2Output>> {
        self.inner.list_objects_v2(req).await
    }

    async fn put_object(
        &self,
        req: S3Request<PutObjectInput>,
    ) -> S3Result<S3Response<PutObjectOutput>> {
        self.invalidate(self.inner.put_object(req).await)
    }

    async fn copy_object(
        &self,
        req: S3Request<CopyObjectInput>,
    ) -> S3Result<S3Response<CopyObjectOutput>> {
        self.invalidate(self.inner.copy_object(req).await)
    }

    async fn delete_object(
        &self,
        req: S3Request<DeleteObjectInput>,
    ) -> S3Result<S3Response<DeleteObjectOutput>> {
        self.invalidate(self.inner.delete_object(req).await)
    }

    async fn delete_objects(
        &self,
        req: S3Request<DeleteObjectsInput>,
    ) -> S3Result<S3Response<DeleteObjectsOutput>> {
        self.invalidate(self.inner.delete_objects(req).await)
    }

    async fn create_multipart_upload(
        &self,
        req: S3Request<CreateMultipartUploadInput>,
    ) -> S3Result<S3Response<CreateMultipartUploadOutput>> {
        self.inner.create_multipart_upload(req).await
    }

    async fn upload_part(
        &self,
        req: S3Request<UploadPartInput>,
    ) -> S3Result<S3Response<UploadPartOutput>> {
        self.inner.upload_part(req).await
    }

    async fn upload_part_copy(
        &self,
        req: S3Request<UploadPartCopyInput>,
    ) -> S3Result<S3Response<UploadPartCopyOutput>> {
        self.inner.upload_part_copy(req).await
    }

    async fn list_parts(
        &self,
        req: S3Request<ListPartsInput>,
    ) -> S3Result<S3Response<ListPartsOutput>> {
        self.inner.list_parts(req).await
    }

    async fn complete_multipart_upload(
        &self,
        req: S3Request<CompleteMultipartUploadInput>,
    ) -> S3Result<S3Response<CompleteMultipartUploadOutput>> {
        self.invalidate(self.inner.complete_multipart_upload(req).await)
    }

    async fn abort_multipart_upload(
        &self,
        req: S3Request<AbortMultipartUploadInput>,
    ) -> S3Result<S3Response<AbortMultipartUploadOutput>> {
        self.inner.abort_multipart_upload(req).await
    }
}

// ---------------------------------------------------------------------------
// proxy

/// How the proxy shapes the upstream-to-client direction.
#[derive(Debug, Clone, Copy)]
struct Shaping {
    /// Minimum time from a request's last byte to its response's first byte.
    first_byte: Duration,
    /// Bytes per second per connection; `None`: no cap.
    rate: Option<f64>,
}

impl Shaping {
    /// Largest piece written at once: at most [`PROXY_CHUNK`], and at most
    /// about 10 ms worth of bandwidth, so pacing stays smooth when slow.
    fn piece(&self) -> usize {
        match self.rate {
            Some(rate) => ((rate / 100.0) as usize).clamp(1024, PROXY_CHUNK),
            None => PROXY_CHUNK,
        }
    }
}

/// Runs the latency proxy until the process is killed.
async fn proxy(args: ProxyArgs) -> Result<(), BoxError> {
    if !(args.mbps.is_finite() && args.mbps >= 0.0) {
        return Err("--mbps must be a non-negative number".into());
    }
    let shaping = Shaping {
        first_byte: Duration::from_millis(args.first_byte_ms),
        rate: (args.mbps > 0.0).then_some(args.mbps * 1e6),
    };
    let listener = TcpListener::bind(args.listen).await?;
    announce(listener.local_addr()?)?;
    loop {
        let client = accept(&listener).await;
        let upstream = args.upstream;
        tokio::spawn(async move {
            if let Err(err) = proxy_connection(client, upstream, shaping).await
                && !is_hangup(&err)
            {
                eprintln!("proxy connection: {err}");
            }
        });
    }
}

/// Whether an error is just one side going away.
fn is_hangup(err: &io::Error) -> bool {
    matches!(
        err.kind(),
        io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe
            | io::ErrorKind::UnexpectedEof
    )
}

/// When the client last sent request bytes that no response byte has
/// followed yet: the start of the current turn's first-byte delay.
type Turn = Arc<Mutex<Option<Instant>>>;

/// Proxies one client connection to a fresh upstream connection.
async fn proxy_connection(
    client: TcpStream,
    upstream: SocketAddr,
    shaping: Shaping,
) -> io::Result<()> {
    let server = timeout(CONNECT_TIMEOUT, TcpStream::connect(upstream))
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "connecting upstream"))??;
    server.set_nodelay(true)?;
    let (client_rd, client_wr) = client.into_split();
    let (server_rd, server_wr) = server.into_split();
    let turn = Turn::default();

    let requests = forward_requests(client_rd, server_wr, Arc::clone(&turn));
    let responses = forward_responses(server_rd, client_wr, turn, shaping);
    tokio::pin!(requests, responses);
    tokio::select! {
        // The server is done: no answer can follow, so drop the client too.
        done = &mut responses => done,
        // The client is done sending: let the last answers drain.
        done = &mut requests => {
            done?;
            responses.await
        }
    }
}

/// Reads into `buf`, giving up after [`IDLE_TIMEOUT`].
async fn read_bounded<R: AsyncRead + Unpin>(src: &mut R, buf: &mut [u8]) -> io::Result<usize> {
    timeout(IDLE_TIMEOUT, src.read(buf))
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "idle connection"))?
}

/// Writes all of `buf`, giving up after [`IDLE_TIMEOUT`].
async fn write_bounded<W: AsyncWrite + Unpin>(dst: &mut W, buf: &[u8]) -> io::Result<()> {
    timeout(IDLE_TIMEOUT, dst.write_all(buf))
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "peer not reading"))?
}

/// Client to upstream, unshaped; marks the start of each turn.
async fn forward_requests<R, W>(mut src: R, mut dst: W, turn: Turn) -> io::Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut buf = vec![0u8; PROXY_CHUNK];
    loop {
        let n = read_bounded(&mut src, &mut buf).await?;
        if n == 0 {
            // Half-close: the server may still be answering.
            return dst.shutdown().await;
        }
        // Marked before the bytes leave, so no answer can overtake the mark.
        *turn.lock().unwrap_or_else(PoisonError::into_inner) = Some(Instant::now());
        write_bounded(&mut dst, &buf[..n]).await?;
    }
}

/// Upstream to client: holds each turn's first byte back and paces the rest.
async fn forward_responses<R, W>(
    mut src: R,
    mut dst: W,
    turn: Turn,
    shaping: Shaping,
) -> io::Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut buf = vec![0u8; PROXY_CHUNK];
    let piece = shaping.piece();
    // Pacing clock: the earliest time the next piece may be written.
    let mut next = Instant::now();
    loop {
        let n = read_bounded(&mut src, &mut buf).await?;
        if n == 0 {
            return dst.shutdown().await;
        }
        let asked = turn.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(asked) = asked {
            // First bytes of an answer: wait out the first-byte delay, then
            // start pacing afresh.
            sleep_until(asked + shaping.first_byte).await;
            next = Instant::now();
        }
        for chunk in buf[..n].chunks(piece) {
            if let Some(rate) = shaping.rate {
                let now = Instant::now();
                if next > now {
                    sleep_until(next).await;
                } else if now - next > PACING_SLACK {
                    next = now - PACING_SLACK;
                }
                next += Duration::from_secs_f64(chunk.len() as f64 / rate);
            }
            write_bounded(&mut dst, chunk).await?;
        }
    }
}
