//! Where bytes come from. A [`ReadAhead`] reads the units of one slot on
//! its own runtime, running ahead of the parser across shard boundaries
//! within a byte budget, and hands each shard over, in order, as a
//! [`ShardReader`] (a blocking `std::io::Read` with a bounded wait). Local
//! files are read one after another; remote objects (S3, HTTP(S)) as
//! ranged parts of one queue over the budget, up to `max_concurrency` GETs
//! at once, so a slow first byte or a per-connection bandwidth limit is
//! paid in parallel. A new remote source implements
//! [`store::ranged::RangedObject`] and gets a [`Location`] variant.

pub mod cache;
mod fetch;
mod local_reads;
mod queue;
mod remote_reads;

use crate::store::local::SHARE_MIN_BYTES;
use crate::store::ranged::RangedObject;
use crate::store::{self, http, s3};
use remote_reads::RemoteObject;

pub use fetch::FetchUnit;

use fetch::{ChunkSender, ConsumerGone, Fetcher, Piece};

use std::collections::VecDeque;
use std::io::Read;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::Semaphore;

use crate::config::{CacheOptions, StoreOptions};
use crate::error::{Error, Result};
use crate::format::parquet::{self, FooterDecode};
use crate::format::ByteSource;
use crate::location::Location;
use crate::shard::Shard;
use crate::stats::{Counter, Counters};
use ::parquet::file::metadata::ParquetMetaData;

/// Settings of a [`ReadAhead`].
#[derive(Debug, Clone)]
pub struct ReadAheadOptions {
    /// Bytes fetched but not yet parsed, at most.
    pub budget_bytes: usize,
    /// Size of one read.
    pub chunk_bytes: usize,
    /// Size of one mapping of a local file (at most the budget): see
    /// [`store::local::MAP_CHUNK_BYTES`].
    pub map_chunk_bytes: usize,
    /// Longest wait of a [`ShardReader`] for its next bytes.
    pub io_timeout: Duration,
    /// How to reach every store (S3, HTTP(S), GCS, the Hub).
    pub store: StoreOptions,
    /// Where remote shards are cached, if anywhere.
    pub cache: Option<CacheOptions>,
}

/// Runs on the reading thread before it waits for bytes (or a shard) that
/// have not arrived yet.
pub type BeforeWait = Arc<dyn Fn() + Send + Sync>;

/// Reads a slot's shards in order, ahead of the consumer.
pub struct ReadAhead {
    shards: Receiver<ShardReader>,
    /// The units' URLs, in order, and how many readers were handed out.
    urls: Vec<String>,
    handed: AtomicUsize,
    cancelled: Arc<AtomicBool>,
    /// With a cache, the task that dispatches the units; it ends once every
    /// unit's read, and the cache copy written along with it, has ended.
    dispatch: Option<tokio::task::JoinHandle<()>>,
    /// The objects read whole into the cache for a range of them (shared
    /// with the dispatching task).
    read_whole: Arc<std::sync::Mutex<std::collections::HashSet<String>>>,
    runtime: Option<tokio::runtime::Runtime>,
    io_timeout: Duration,
    before_wait: Option<BeforeWait>,
    /// Where the readers count their waits and the bytes they take.
    counters: Arc<Counters>,
}

impl ReadAhead {
    /// Starts reading `units` (in this order) on a new I/O runtime.
    pub fn start(
        units: Vec<FetchUnit>,
        options: ReadAheadOptions,
        counters: Arc<Counters>,
    ) -> Result<Self> {
        options.store.validate()?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .max_blocking_threads(2)
            .thread_name("shardstream-io")
            .enable_all()
            .build()
            .map_err(|e| Error::Stopped(format!("cannot start the I/O runtime: {e}")))?;
        let chunk_bytes = options.chunk_bytes.min(options.budget_bytes).max(1);
        let budget_total = options.budget_bytes.max(chunk_bytes);
        let map_chunk_bytes = options.map_chunk_bytes.min(budget_total).max(1);
        let cancelled = Arc::new(AtomicBool::new(false));
        let (shard_tx, shard_rx) = mpsc::channel();
        let task = Dispatcher {
            fetcher: Fetcher {
                budget: Arc::new(Semaphore::new(budget_total)),
                cancelled: cancelled.clone(),
                chunk_bytes,
                map_chunk_bytes,
                io_timeout: options.io_timeout,
                counters: counters.clone(),
                budget_total,
                store_options: Arc::new(options.store),
            },
            s3: Arc::new(tokio::sync::OnceCell::new()),
            http: Arc::new(std::sync::OnceLock::new()),
            cache: options.cache.and_then(cache::Cache::open).map(Arc::new),
            read_whole: Arc::default(),
        };
        let urls = units.iter().map(|u| u.url.clone()).collect();
        let read_whole = task.read_whole.clone();
        let caches = task.cache.is_some();
        let dispatch = runtime.spawn(task.run(units, shard_tx));
        Ok(ReadAhead {
            shards: shard_rx,
            urls,
            handed: AtomicUsize::new(0),
            cancelled,
            dispatch: caches.then_some(dispatch),
            read_whole,
            runtime: Some(runtime),
            io_timeout: options.io_timeout,
            before_wait: None,
            counters,
        })
    }

    /// When every shard was handed out and an object was read whole into
    /// the cache for a range of it: waits (within the I/O timeout) for the
    /// copy still being written, the rest of the object past the range, so
    /// that it is kept rather than dropped at the epoch's end. Call it before
    /// telling the consumer the stream ended. Never blocks inside a runtime.
    pub fn finish_cache_copies(&mut self) {
        let filling = !self
            .read_whole
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_empty();
        let handed_all = filling && self.handed.load(Ordering::SeqCst) >= self.urls.len();
        if !handed_all || tokio::runtime::Handle::try_current().is_ok() {
            return;
        }
        if let (Some(runtime), Some(dispatch)) = (&self.runtime, self.dispatch.take()) {
            let wait = self.io_timeout;
            // The timer is made inside the runtime, which drives it.
            let _ = runtime.block_on(async move { tokio::time::timeout(wait, dispatch).await });
        }
    }

    /// Has `hook` run before this read-ahead, or a shard reader it hands
    /// out, waits for what has not arrived yet.
    pub fn before_wait(&mut self, hook: BeforeWait) {
        self.before_wait = Some(hook);
    }

    /// The reader of the next unit, `None` after the last one. The fetch
    /// stopping before it handed every unit over is an error.
    pub fn next_shard(&self) -> Result<Option<ShardReader>> {
        let next = wait_for(
            &self.shards,
            self.io_timeout,
            self.before_wait.as_deref(),
            Some(&self.counters),
        );
        match next {
            Ok(mut reader) => {
                self.handed.fetch_add(1, Ordering::SeqCst);
                reader.before_wait = self.before_wait.clone();
                reader.counters = Some(self.counters.clone());
                Ok(Some(reader))
            }
            Err(RecvTimeoutError::Disconnected) => {
                let handed = self.handed.load(Ordering::SeqCst);
                match self.urls.get(handed) {
                    None => Ok(None),
                    Some(url) => Err(Error::Stopped(format!(
                        "the read-ahead stopped after {handed} of {} shards, before {url}",
                        self.urls.len()
                    ))),
                }
            }
            Err(RecvTimeoutError::Timeout) => Err(Error::Stopped(format!(
                "no shard opened within {:?}",
                self.io_timeout
            ))),
        }
    }
}

impl Drop for ReadAhead {
    fn drop(&mut self) {
        self.finish_cache_copies();
        self.cancelled.store(true, Ordering::SeqCst);
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_timeout(Duration::from_secs(2));
        }
    }
}

/// Reads shards into chunks, within a byte budget of its own: hands each
/// unit to its store's reader, with the clients made once and the cache.
#[derive(Clone)]
struct Dispatcher {
    /// The budget and settings every store's reader takes.
    fetcher: Fetcher,
    /// Made at the first S3 unit, in the reading process.
    s3: Arc<tokio::sync::OnceCell<Arc<s3::S3Client>>>,
    /// Made at the first HTTP(S) unit, in the reading process.
    http: Arc<std::sync::OnceLock<std::result::Result<Arc<http::HttpClient>, String>>>,
    /// Where remote shards are cached, if anywhere.
    cache: Option<Arc<cache::Cache>>,
    /// The URLs of the objects this read-ahead read whole into the cache
    /// for a byte range of them (or tried to): their later ranges are read
    /// from the copy, or else by range, never whole again.
    read_whole: Arc<std::sync::Mutex<std::collections::HashSet<String>>>,
}

impl Dispatcher {
    /// Reads `units`, handing their readers over in order. Remote units go
    /// through one [`queue::PartQueue`] as parts issued in plan order over
    /// the whole budget (with `max_concurrency` 1, each is one streaming
    /// GET, one unit at a time). A local unit, or a cached copy, is read
    /// alone: after every unit before it was fetched, and before any unit
    /// after it is begun, so that every read takes the budget in order.
    async fn run(self, units: Vec<FetchUnit>, shard_tx: Sender<ShardReader>) {
        let ahead = self.store_options.transport.max_concurrency.max(1);
        let mut queue = (ahead > 1).then(|| queue::PartQueue::new(&self));
        let mut in_flight = VecDeque::new();
        for mut unit in units {
            if self.cancelled.load(Ordering::SeqCst) {
                return;
            }
            let (chunk_tx, chunk_rx) = mpsc::channel();
            let reader = ShardReader::new(&unit, chunk_rx, self.io_timeout);
            if shard_tx.send(reader).is_err() {
                return;
            }
            let sender = Arc::new(ChunkSender::new(chunk_tx));
            let (url, start) = (unit.url.clone(), unit.range.as_ref().map_or(0, |r| r.start));
            let remote = !matches!(unit.location, Location::Local(_));
            if let Some(queue) = queue.as_mut().filter(|_| remote && self.read_whole(&unit)) {
                // An earlier unit reads the object into the cache: this
                // range is read from the copy, once the units before it are.
                if queue.drain(&self).await.is_err() || !settle_all(&mut in_flight).await {
                    return;
                }
            }
            let hit = match &queue {
                Some(_) if remote => self.cache_hit(&mut unit, &sender).await,
                _ => None,
            };
            let task = match queue.as_mut() {
                Some(queue) if remote && hit.is_none() => {
                    match self.queue_unit(queue, &unit, sender.clone()).await {
                        Ok(task) => task,
                        Err(ConsumerGone) => return,
                    }
                }
                _ => {
                    // Read alone, after every part before it was issued
                    // and fetched, and before any part after it.
                    if let Some(queue) = queue.as_mut() {
                        if queue.drain(&self).await.is_err() {
                            return;
                        }
                    }
                    if !settle_all(&mut in_flight).await {
                        return;
                    }
                    let task = self.spawn_read(unit, sender.clone(), hit);
                    let alone = UnitTask {
                        task,
                        sender,
                        url,
                        start,
                    };
                    if !settle(alone).await {
                        return;
                    }
                    continue;
                }
            };
            in_flight.push_back(UnitTask {
                task,
                sender,
                url,
                start,
            });
            while in_flight.len() > ahead {
                let Some(task) = in_flight.pop_front() else {
                    break;
                };
                if !settle(task).await {
                    return;
                }
            }
        }
        if let Some(queue) = queue.as_mut() {
            if queue.drain(&self).await.is_err() {
                return;
            }
        }
        settle_all(&mut in_flight).await;
    }

    /// Reads `unit` (from its cached copy `hit`, if given) on a task of its own.
    fn spawn_read(
        &self,
        unit: FetchUnit,
        sender: Arc<ChunkSender>,
        hit: Option<cache::Hit>,
    ) -> tokio::task::JoinHandle<Result<(), ConsumerGone>> {
        let fetcher = self.clone();
        tokio::spawn(async move {
            match hit {
                Some(hit) => fetcher.read_hit(&hit, &sender).await,
                None => fetcher.read(&unit, &sender).await,
            }
        })
    }

    /// Issues the parts of the remote unit `unit` on `queue`; gives the task
    /// delivering them. A client that cannot be made is an error of the unit.
    async fn queue_unit(
        &self,
        queue: &mut queue::PartQueue,
        unit: &FetchUnit,
        sender: Arc<ChunkSender>,
    ) -> Result<tokio::task::JoinHandle<Result<(), ConsumerGone>>, ConsumerGone> {
        if matches!(unit.location, Location::Local(_)) {
            return Ok(self.spawn_read(unit.clone(), sender, None));
        }
        match self.remote_object(unit).await {
            Ok(object) => queue.push(self, object, unit, sender).await,
            Err(reason) => {
                let error = client_error(unit, reason);
                Ok(tokio::spawn(async move {
                    let _ = sender.send(Err(error));
                    Ok(())
                }))
            }
        }
    }

    /// The object a remote `unit` is read as, through this process's
    /// client of its store; why the client cannot be made (or, for a local
    /// unit, which callers read as a file, that it is not remote). The one
    /// place a unit's location picks its store.
    async fn remote_object(
        &self,
        unit: &FetchUnit,
    ) -> std::result::Result<Arc<RemoteObject<impl RangedObject, impl RangedObject>>, String> {
        Ok(Arc::new(match &unit.location {
            Location::S3 { bucket, key } => {
                let client = self.s3_client().await;
                RemoteObject::S3(client.object(self.counters.clone(), &unit.url, (bucket, key)))
            }
            Location::Http(_) => {
                let end = unit.range.as_ref().map(|range| range.end);
                let client = self.http_client()?;
                RemoteObject::Http(client.resource(self.counters.clone(), &unit.url, end))
            }
            Location::Local(_) => return Err("a local file is read as a file".to_owned()),
        }))
    }

    /// The S3 client, made at the first S3 unit, in the reading process.
    async fn s3_client(&self) -> Arc<s3::S3Client> {
        self.s3
            .get_or_init(|| async { Arc::new(s3::S3Client::new(&self.store_options).await) })
            .await
            .clone()
    }

    /// The HTTP(S) client, made at the first HTTP(S) unit, in the reading
    /// process; why it cannot be made.
    fn http_client(&self) -> std::result::Result<Arc<http::HttpClient>, String> {
        self.http
            .get_or_init(|| {
                let credentials = crate::store::http_credentials();
                http::HttpClient::new(&self.store_options.transport, credentials).map(Arc::new)
            })
            .clone()
    }

    /// The cached copy of a remote `unit`, if there is one of the object's
    /// identity as this process confirmed it for the dataset; on a miss,
    /// the bytes sent to `chunk_tx` are also written to the cache. A miss
    /// on a byte range holding every sample of an object this read-ahead
    /// did not read whole yet makes `unit` the whole object, of which
    /// `chunk_tx` hands the reader the range only (see
    /// [`Dispatcher::fill_on_miss`]). An object
    /// without a validator (or whose identity cannot be had) is not cached.
    async fn cache_hit(&self, unit: &mut FetchUnit, chunk_tx: &ChunkSender) -> Option<cache::Hit> {
        let cache = self.cache.clone()?;
        let identity = self.identity(&cache, unit).await?;
        let (looked_up, expected) = (unit.clone(), identity.clone());
        // A cached copy is read through the local source.
        let hit = tokio::task::spawn_blocking(move || cache.lookup(&looked_up, &expected))
            .await
            .ok()
            .flatten();
        if hit.is_none() {
            self.fill_on_miss(unit, identity, chunk_tx);
        }
        hit
    }

    /// Whether this read-ahead read (or began to read) `unit`'s object
    /// whole into the cache.
    fn read_whole(&self, unit: &FetchUnit) -> bool {
        let read = self.read_whole.lock().unwrap_or_else(|e| e.into_inner());
        read.contains(&unit.url)
    }

    /// Has the bytes of `unit` (of the object of `identity`), which has no
    /// cached copy, also written to the cache as they are sent to
    /// `chunk_tx`. A byte range that holds every sample of the shard is
    /// read as the whole object, so that the copy is complete (once per
    /// read-ahead and object, when the object is the size the plan knows
    /// and fits the cache), the reader handed the range only; the bytes
    /// outside it (no sample's) pass through the budget as they are
    /// written. A range of some of the samples is not cached: reading the
    /// whole object for it would fetch the other samples' bytes twice in
    /// the epoch (the slot that reads them fetches them too).
    fn fill_on_miss(
        &self,
        unit: &mut FetchUnit,
        identity: cache::Identity,
        chunk_tx: &ChunkSender,
    ) {
        let Some(cache) = self.cache.as_ref() else {
            return;
        };
        let Some(range) = unit.range.clone() else {
            if let Some(fill) = cache.fill(unit, identity) {
                chunk_tx.tee(Box::new(fill));
            }
            return;
        };
        let size = identity.size();
        let planned = unit.size.is_none_or(|planned| planned == size);
        if !unit.all_samples || range.end > size || !planned {
            return;
        }
        let mut read = self.read_whole.lock().unwrap_or_else(|e| e.into_inner());
        if !read.insert(unit.url.clone()) {
            return;
        }
        drop(read);
        let whole = FetchUnit {
            range: None,
            size: Some(size),
            ..unit.clone()
        };
        if let Some(fill) = cache.fill(&whole, identity) {
            chunk_tx.tee(Box::new(fill));
            chunk_tx.window(range);
            *unit = whole;
        }
    }

    /// The identity (size and validator) of a remote `unit`'s object, as a
    /// request of this process found it: a HEAD of an S3 object, a GET of
    /// the first byte of an HTTP(S) resource (GCS and the Hub included),
    /// sent once per object, process and dataset
    /// ([`cache::Cache::confirmed`]), in the I/O path, never when the plan
    /// is made. `None` for an object without a validator, or when the
    /// request fails (the read then says why).
    async fn identity(&self, cache: &cache::Cache, unit: &FetchUnit) -> Option<cache::Identity> {
        if let Some(known) = cache.confirmed(&unit.url) {
            return known;
        }
        self.count(Counter::Requests, 1);
        let found = match &unit.location {
            Location::S3 { bucket, key } => {
                let client = self.s3_client().await;
                let (size, etag) = client.head(&unit.url, bucket, key).await.ok()?;
                cache::Identity::new(size, etag.as_deref(), None)
            }
            Location::Http(url) => {
                let client = self.http_client().ok()?;
                let (size, etag, last_modified) = client.validators(url).await.ok()?;
                cache::Identity::new(size, etag.as_deref(), last_modified.as_deref())
            }
            Location::Local(_) => return None,
        };
        cache.confirm(&unit.url, found.clone());
        found
    }

    /// Reads a cached copy through the descriptor the cache checked it
    /// by (never opened again by name), then tells its reader the unit ended.
    async fn read_hit(&self, hit: &cache::Hit, chunk_tx: &ChunkSender) -> Result<(), ConsumerGone> {
        self.count(Counter::CacheHits, 1);
        match hit.opened() {
            Ok(opened) => {
                local_reads::read_opened(self, &hit.unit, (&hit.path, false), opened, chunk_tx)
                    .await?
            }
            Err(source) => {
                let _ = chunk_tx.send(Err(Error::Read {
                    url: hit.unit.url.clone(),
                    offset: hit.unit.range.as_ref().map_or(0, |r| r.start),
                    source,
                }));
                return Ok(());
            }
        }
        chunk_tx.finish();
        Ok(())
    }

    /// Reads one unit into chunks sent to `chunk_tx`, then tells its
    /// reader the unit ended (unless an error was sent instead).
    async fn read(&self, unit: &FetchUnit, chunk_tx: &ChunkSender) -> Result<(), ConsumerGone> {
        let remote = !matches!(unit.location, Location::Local(_));
        let mut unit = unit.clone();
        if remote {
            if let Some(hit) = self.cache_hit(&mut unit, chunk_tx).await {
                return self.read_hit(&hit, chunk_tx).await;
            }
        }
        let unit = &unit;
        if let Location::Local(path) = &unit.location {
            local_reads::read_file(self, unit, (path, true), chunk_tx).await?;
        } else {
            match self.remote_object(unit).await {
                Ok(object) => remote_reads::read_ranged(self, object, unit, chunk_tx).await?,
                Err(reason) => {
                    let _ = chunk_tx.send(Err(client_error(unit, reason)));
                    return Ok(());
                }
            }
        }
        chunk_tx.finish();
        Ok(())
    }
}

impl std::ops::Deref for Dispatcher {
    type Target = Fetcher;

    fn deref(&self) -> &Fetcher {
        &self.fetcher
    }
}

/// A unit being fetched: its task, and the sending end of its chunks,
/// through which a task that fails is reported to the unit's reader.
struct UnitTask {
    task: tokio::task::JoinHandle<Result<(), ConsumerGone>>,
    sender: Arc<ChunkSender>,
    url: String,
    start: u64,
}

/// Waits for a unit's task; `false` when fetching must stop (the consumer
/// is gone). A task that panicked or was aborted is an error of its unit,
/// naming the byte offset it had reached; the next units are still read.
async fn settle(unit: UnitTask) -> bool {
    match unit.task.await {
        Ok(Ok(())) => true,
        Ok(Err(ConsumerGone)) => false,
        Err(join) => {
            let reason = if join.is_panic() {
                "the fetch task panicked"
            } else {
                "the fetch task was cancelled"
            };
            let _ = unit.sender.send(Err(Error::Read {
                url: unit.url,
                offset: unit.start + unit.sender.sent(),
                source: std::io::Error::other(reason),
            }));
            true
        }
    }
}

/// Waits for every unit in flight, in order; `false` when fetching must stop.
async fn settle_all(in_flight: &mut VecDeque<UnitTask>) -> bool {
    while let Some(task) = in_flight.pop_front() {
        if !settle(task).await {
            return false;
        }
    }
    true
}

/// The error of a remote unit whose client cannot be made.
fn client_error(unit: &FetchUnit, reason: String) -> Error {
    Error::Read {
        url: unit.url.clone(),
        offset: unit.range.as_ref().map_or(0, |r| r.start),
        source: std::io::Error::other(reason),
    }
}

/// Reads the footer of each Parquet file (`files` have known sizes): a
/// probe of its last bytes, then the whole footer when it is longer. The
/// reads run on a runtime that is shut down before returning.
pub fn read_footers(
    files: &[&Shard],
    store_options: &StoreOptions,
) -> Result<Vec<Arc<ParquetMetaData>>> {
    let size = |file: &Shard| file.size.unwrap_or(0);
    let probes = files
        .iter()
        .map(|f| parquet::FOOTER_PROBE.min(size(f)))
        .collect::<Vec<_>>();
    let mut footers = Vec::with_capacity(files.len());
    let mut longer = Vec::new();
    for (i, tail) in read_tails(files, &probes, store_options)?
        .into_iter()
        .enumerate()
    {
        match parquet::decode_footer(&files[i].url, size(files[i]), &tail)? {
            FooterDecode::Metadata(metadata) => footers.push(Some(metadata)),
            FooterDecode::NeedTail(len) => {
                footers.push(None);
                longer.push((i, len));
            }
        }
    }
    if !longer.is_empty() {
        let retry: Vec<&Shard> = longer.iter().map(|&(i, _)| files[i]).collect();
        let lens: Vec<u64> = longer.iter().map(|&(_, len)| len).collect();
        for ((i, _), tail) in longer.iter().zip(read_tails(&retry, &lens, store_options)?) {
            let file = files[*i];
            match parquet::decode_footer(&file.url, size(file), &tail)? {
                FooterDecode::Metadata(metadata) => footers[*i] = Some(metadata),
                FooterDecode::NeedTail(_) => {
                    return Err(file_format_error(
                        file,
                        "the footer length changed between reads",
                    ))
                }
            }
        }
    }
    Ok(footers.into_iter().flatten().collect())
}

fn file_format_error(file: &Shard, reason: &str) -> Error {
    Error::Format {
        url: file.url.clone(),
        offset: file.size.unwrap_or(0),
        compression: None,
        member: None,
        reason: reason.to_owned(),
    }
}

/// The last `lens[i]` bytes of each file, read through a [`ReadAhead`]
/// that is dropped (its runtime shut down) before returning.
fn read_tails(
    files: &[&Shard],
    lens: &[u64],
    store_options: &StoreOptions,
) -> Result<Vec<Vec<u8>>> {
    let units = files
        .iter()
        .zip(lens)
        .map(|(file, &len)| {
            let size = file.size.unwrap_or(0);
            FetchUnit {
                url: file.url.clone(),
                location: file.location(),
                range: Some(size - len.min(size)..size),
                size: file.size,
                etag: file.etag.clone(),
                all_samples: false,
            }
        })
        .collect();
    let defaults = crate::config::StreamOptions::default();
    let read_ahead = ReadAhead::start(
        units,
        ReadAheadOptions {
            budget_bytes: crate::config::READ_AHEAD_BYTES,
            chunk_bytes: defaults.chunk_bytes,
            map_chunk_bytes: store::local::MAP_CHUNK_BYTES,
            io_timeout: defaults.io_timeout,
            store: store_options.clone(),
            cache: None,
        },
        Arc::new(Counters::new()),
    )?;
    let mut tails = Vec::with_capacity(files.len());
    for file in files {
        let mut reader = read_ahead
            .next_shard()?
            .ok_or_else(|| Error::Stopped(format!("{}: the footer read ended early", file.url)))?;
        let mut tail = Vec::new();
        if let Err(error) = reader.read_to_end(&mut tail) {
            let size = file.size.unwrap_or(0);
            let start = size - lens[tails.len()].min(size);
            return Err(reader.take_failure().unwrap_or(Error::Read {
                url: file.url.clone(),
                offset: start + tail.len() as u64,
                source: error,
            }));
        }
        tails.push(tail);
    }
    Ok(tails)
}

/// The next item of `rx`, running `before_wait` first if it has to wait,
/// and waiting at most `timeout`; the time waited is counted in
/// `counters` ([`Counter::StorageWaitNanos`]).
fn wait_for<T>(
    rx: &Receiver<T>,
    timeout: Duration,
    before_wait: Option<&(dyn Fn() + Send + Sync)>,
    counters: Option<&Counters>,
) -> std::result::Result<T, RecvTimeoutError> {
    match rx.try_recv() {
        Ok(item) => Ok(item),
        Err(TryRecvError::Disconnected) => Err(RecvTimeoutError::Disconnected),
        Err(TryRecvError::Empty) => {
            if let Some(hook) = before_wait {
                hook();
            }
            let waiting = std::time::Instant::now();
            let item = rx.recv_timeout(timeout);
            if let Some(counters) = counters {
                counters.add_since(Counter::StorageWaitNanos, waiting);
            }
            item
        }
    }
}

/// The bytes `unit` must deliver, when that is known before reading: the
/// length of the range asked for, or an S3 object's (HTTP resource's)
/// listed size (which the read also checks against the object's own). A whole local file has
/// none here: a pipe or device reports no size of its own.
fn expected_len(unit: &FetchUnit) -> Option<u64> {
    match (&unit.range, &unit.location) {
        (Some(range), _) => Some(range.end.saturating_sub(range.start)),
        (None, Location::S3 { .. } | Location::Http(_)) => unit.size,
        (None, Location::Local(_)) => None,
    }
}

/// A blocking reader of one shard's bytes, fed by the [`ReadAhead`].
pub struct ShardReader {
    url: String,
    chunks: Receiver<Piece>,
    current: Bytes,
    /// When `current` is mapped from a local file, its guard.
    mapped: Option<store::local::Guard>,
    position: usize,
    offset: u64,
    /// Bytes the unit must deliver, when known (the range asked for).
    expected: Option<u64>,
    /// Bytes received so far.
    received: u64,
    /// Whether the unit's end arrived, its byte count checked.
    ended: bool,
    io_timeout: Duration,
    failure: Option<Error>,
    before_wait: Option<BeforeWait>,
    /// Where waits and bytes taken are counted, once the read-ahead
    /// handed the reader out.
    counters: Option<Arc<Counters>>,
}

impl ShardReader {
    fn new(unit: &FetchUnit, chunks: Receiver<Piece>, io_timeout: Duration) -> Self {
        ShardReader {
            url: unit.url.clone(),
            chunks,
            current: Bytes::new(),
            mapped: None,
            position: 0,
            offset: unit.range.as_ref().map_or(0, |r| r.start),
            expected: expected_len(unit),
            received: 0,
            ended: false,
            io_timeout,
            failure: None,
            before_wait: None,
            counters: None,
        }
    }

    /// The shard's URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    fn fail(&mut self, error: Error) -> std::io::Error {
        let message = error.to_string();
        self.failure = Some(error);
        std::io::Error::other(message)
    }
}

impl ByteSource for ShardReader {
    fn take_failure(&mut self) -> Option<Error> {
        self.failure.take()
    }

    fn prefetch(&self, ahead: usize, len: usize) {
        if let Some(unread) = self.current.get(self.position..) {
            crate::format::prefetch_range(unread, ahead, len);
        }
    }

    fn skip(&mut self, max: usize) -> std::io::Result<usize> {
        Ok(self.next_bytes(max)?.len())
    }

    fn read_append(&mut self, out: &mut Vec<u8>, max: usize) -> std::io::Result<usize> {
        let bytes = self.next_bytes(max)?;
        out.extend_from_slice(bytes);
        let read = bytes.len();
        self.check_read(read)?;
        Ok(read)
    }

    /// Hands out `len` bytes of at least [`SHARE_MIN_BYTES`] that lie
    /// within the current chunk, when it is mapped from a local file.
    fn read_shared(&mut self, len: usize) -> std::io::Result<Option<Bytes>> {
        if len < SHARE_MIN_BYTES || !self.fill()? || self.mapped.is_none() {
            return Ok(None);
        }
        if self.current.len() - self.position < len {
            return Ok(None);
        }
        let member = store::local::MappedMember::new(self.current.clone(), self.position, len);
        self.position += len;
        self.offset += len as u64;
        Ok(Some(Bytes::from_owner(member)))
    }
}

impl ShardReader {
    /// At most `max` unread bytes of the current chunk (waiting for the
    /// next chunk if needed), counted as read; empty at the end of the shard.
    fn next_bytes(&mut self, max: usize) -> std::io::Result<&[u8]> {
        if max == 0 || !self.fill()? {
            return Ok(&[]);
        }
        let start = self.position;
        let n = max.min(self.current.len() - start);
        self.position += n;
        self.offset += n as u64;
        Ok(&self.current[start..start + n])
    }

    /// Checks that the `read` bytes just copied out of the current chunk
    /// (those before `position`) came from the file: a mapped chunk of a
    /// file cut short reads as zeros where its pages were lost.
    fn check_read(&mut self, read: usize) -> std::io::Result<()> {
        let Some(guard) = self.mapped else {
            return Ok(());
        };
        let begin = self.current.as_ptr() as usize + self.position - read;
        match guard.check(begin, read) {
            Ok(()) => Ok(()),
            Err(offset) => Err(self.fail(store::local::cut_short(&self.url, offset))),
        }
    }

    /// Waits until the current chunk has unread bytes; `false` at the end
    /// of the shard, once the fetch said it sent every byte of it and as
    /// many arrived as the unit must hold.
    fn fill(&mut self) -> std::io::Result<bool> {
        while self.position == self.current.len() {
            if self.ended {
                return Ok(false);
            }
            let counters = self.counters.as_deref();
            match wait_for(
                &self.chunks,
                self.io_timeout,
                self.before_wait.as_deref(),
                counters,
            ) {
                Ok(Piece::Bytes(chunk)) => {
                    if let Some(counters) = counters {
                        counters.add(Counter::ParsedBytes, chunk.bytes.len() as u64);
                    }
                    self.received += chunk.bytes.len() as u64;
                    self.current = chunk.bytes;
                    self.mapped = chunk.mapped;
                    self.position = 0;
                }
                Ok(Piece::Failed(error)) => return Err(self.fail(error)),
                Ok(Piece::End { bytes }) => {
                    let short =
                        |what: String| std::io::Error::new(std::io::ErrorKind::UnexpectedEof, what);
                    let problem = if bytes != self.received {
                        Some(short(format!(
                            "the fetch sent {bytes} bytes, {} arrived",
                            self.received
                        )))
                    } else {
                        self.expected.filter(|&e| e != bytes).map(|e| {
                            short(format!(
                                "the fetch ended after {bytes} bytes of the {e} asked for"
                            ))
                        })
                    };
                    if let Some(source) = problem {
                        let error = Error::Read {
                            url: self.url.clone(),
                            offset: self.offset,
                            source,
                        };
                        return Err(self.fail(error));
                    }
                    self.ended = true;
                    return Ok(false);
                }
                Err(RecvTimeoutError::Disconnected) => {
                    let error = Error::Read {
                        url: self.url.clone(),
                        offset: self.offset,
                        source: std::io::Error::new(
                            std::io::ErrorKind::UnexpectedEof,
                            "the fetch stopped before the end of the shard",
                        ),
                    };
                    return Err(self.fail(error));
                }
                Err(RecvTimeoutError::Timeout) => {
                    let error = Error::Timeout {
                        url: self.url.clone(),
                        offset: self.offset,
                        after: self.io_timeout,
                    };
                    return Err(self.fail(error));
                }
            }
        }
        Ok(true)
    }
}

impl Read for ShardReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let bytes = self.next_bytes(buf.len())?;
        buf[..bytes.len()].copy_from_slice(bytes);
        let read = bytes.len();
        self.check_read(read)?;
        Ok(read)
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::fetch::Chunk;
    use super::*;
    use crate::store::local::file_origin;

    fn read_ahead(path: &Path, chunk_bytes: usize) -> ReadAhead {
        read_ahead_mapping(path, (chunk_bytes, chunk_bytes), 4 * chunk_bytes)
    }

    /// A read-ahead of the local file `path` in chunks of `chunk_bytes`,
    /// mapped `map_chunk_bytes` at a time, within `budget_bytes`.
    fn read_ahead_mapping(
        path: &Path,
        (chunk_bytes, map_chunk_bytes): (usize, usize),
        budget_bytes: usize,
    ) -> ReadAhead {
        let unit = FetchUnit {
            url: path.display().to_string(),
            location: Location::Local(path.to_owned()),
            range: None,
            size: None,
            etag: None,
            all_samples: false,
        };
        let options = ReadAheadOptions {
            budget_bytes,
            chunk_bytes,
            map_chunk_bytes,
            io_timeout: Duration::from_secs(20),
            store: StoreOptions::default(),
            cache: None,
        };
        ReadAhead::start(vec![unit], options, Arc::new(Counters::new())).unwrap()
    }

    #[test]
    fn a_local_file_is_mapped_in_chunks_of_its_own_size_within_the_budget() {
        let chunk = 64 << 10;
        let bytes = content(16 * chunk);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shard.tar");
        std::fs::write(&path, &bytes).unwrap();
        // A member across a read chunk's end lies within one mapping of
        // four chunks: it is shared.
        let read_ahead = read_ahead_mapping(&path, (chunk, 4 * chunk), 8 * chunk);
        let mut reader = read_ahead.next_shard().unwrap().unwrap();
        let mut head = vec![0; chunk / 2];
        reader.read_exact(&mut head).unwrap();
        let across = reader
            .read_shared(chunk)
            .unwrap()
            .expect("within the mapping");
        assert_eq!(across, bytes[chunk / 2..chunk / 2 + chunk]);
        // One across the mapping's end is not, and nothing is consumed.
        let mut skip = vec![0; 2 * chunk];
        reader.read_exact(&mut skip).unwrap();
        assert!(reader.read_shared(chunk).unwrap().is_none());
        let mut rest = Vec::new();
        reader.read_to_end(&mut rest).unwrap();
        assert_eq!(rest, bytes[chunk / 2 + 3 * chunk..]);
        // A budget below the mapping's size bounds it.
        let read_ahead = read_ahead_mapping(&path, (chunk, 4 * chunk), 2 * chunk);
        let mut reader = read_ahead.next_shard().unwrap().unwrap();
        reader.read_exact(&mut head).unwrap();
        assert!(reader.read_shared(2 * chunk).unwrap().is_none());
        assert!(reader.read_shared(chunk).unwrap().is_some());
    }

    fn unit(range: Option<std::ops::Range<u64>>) -> FetchUnit {
        FetchUnit {
            url: "s3://bucket/shard.tar".into(),
            location: Location::S3 {
                bucket: "bucket".into(),
                key: "shard.tar".into(),
            },
            range,
            size: None,
            etag: None,
            all_samples: false,
        }
    }

    fn chunk(bytes: &[u8]) -> Chunk {
        let budget = Arc::new(Semaphore::new(1 << 20));
        let permit = budget.try_acquire_many_owned(bytes.len() as u32).unwrap();
        Chunk::read(bytes.to_vec(), permit)
    }

    fn reader_of(unit: &FetchUnit) -> (ChunkSender, ShardReader) {
        let (tx, rx) = mpsc::channel();
        let reader = ShardReader::new(unit, rx, Duration::from_secs(10));
        (ChunkSender::new(tx), reader)
    }

    /// Reads to the end; the error the reader holds if that fails.
    fn read_all(reader: &mut ShardReader) -> std::result::Result<Vec<u8>, Error> {
        let mut out = Vec::new();
        match reader.read_to_end(&mut out) {
            Ok(_) => Ok(out),
            Err(_) => Err(reader.take_failure().expect("the reader holds its error")),
        }
    }

    #[test]
    fn a_unit_ends_only_with_its_end_message() {
        let (tx, mut reader) = reader_of(&unit(Some(1000..1010)));
        tx.send(Ok(chunk(b"0123"))).ok().unwrap();
        tx.send(Ok(chunk(b"456789"))).ok().unwrap();
        tx.finish();
        drop(tx);
        assert_eq!(read_all(&mut reader).unwrap(), b"0123456789");
        // Past the end, still the end.
        assert_eq!(reader.read(&mut [0; 4]).unwrap(), 0);
    }

    #[test]
    fn a_closed_channel_without_the_end_is_an_error_naming_the_offset() {
        // A fetch that stops (returns early, panics, is dropped) closes
        // the channel without saying the unit ended: not the end of the shard.
        let (tx, mut reader) = reader_of(&unit(Some(1000..2000)));
        tx.send(Ok(chunk(&[7; 300]))).ok().unwrap();
        drop(tx);
        match read_all(&mut reader) {
            Err(Error::Read {
                url,
                offset,
                source,
            }) => {
                assert_eq!((url.as_str(), offset), ("s3://bucket/shard.tar", 1300));
                assert!(
                    source.to_string().contains("stopped before the end"),
                    "{source}"
                );
            }
            other => panic!("expected a read error, got {other:?}"),
        }
    }

    #[test]
    fn an_end_short_of_the_bytes_asked_for_is_an_error() {
        let (tx, mut reader) = reader_of(&unit(Some(0..100)));
        tx.send(Ok(chunk(&[1; 60]))).ok().unwrap();
        tx.finish();
        match read_all(&mut reader) {
            Err(Error::Read { offset, source, .. }) => {
                assert_eq!(offset, 60);
                assert!(
                    source.to_string().contains("60 bytes of the 100"),
                    "{source}"
                );
            }
            other => panic!("expected a read error, got {other:?}"),
        }
        // An object's listed size is the bytes asked for, too.
        let (tx, mut reader) = reader_of(&FetchUnit {
            size: Some(50),
            ..unit(None)
        });
        tx.send(Ok(chunk(&[1; 40]))).ok().unwrap();
        tx.finish();
        assert!(matches!(
            read_all(&mut reader),
            Err(Error::Read { offset: 40, .. })
        ));
    }

    #[test]
    fn a_fetch_task_that_panics_is_an_error_of_its_shard() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let unit = unit(Some(500..1500));
        let (tx, mut reader) = reader_of(&unit);
        let sender = Arc::new(tx);
        let task_sender = sender.clone();
        let task = runtime.spawn(async move {
            task_sender.send(Ok(chunk(&[3; 100])))?;
            panic!("a bug in a fetch task");
        });
        let unit_task = UnitTask {
            task,
            sender,
            url: unit.url.clone(),
            start: 500,
        };
        assert!(
            runtime.block_on(settle(unit_task)),
            "the next units are still read"
        );
        match read_all(&mut reader) {
            Err(Error::Read { offset, source, .. }) => {
                assert_eq!(offset, 600);
                assert!(source.to_string().contains("panicked"), "{source}");
            }
            other => panic!("expected a read error, got {other:?}"),
        }
    }

    #[test]
    fn a_read_ahead_that_stops_before_its_last_unit_is_an_error() {
        let (shard_tx, shards) = mpsc::channel();
        let (_, first) = reader_of(&unit(None));
        shard_tx.send(first).ok().unwrap();
        drop(shard_tx);
        let read_ahead = ReadAhead {
            shards,
            urls: vec!["s3://bucket/a.tar".into(), "s3://bucket/b.tar".into()],
            handed: AtomicUsize::new(0),
            cancelled: Arc::new(AtomicBool::new(false)),
            dispatch: None,
            read_whole: Arc::default(),
            runtime: None,
            io_timeout: Duration::from_secs(10),
            before_wait: None,
            counters: Arc::default(),
        };
        assert!(read_ahead.next_shard().unwrap().is_some());
        match read_ahead.next_shard() {
            Err(Error::Stopped(reason)) => {
                assert!(
                    reason.contains("after 1 of 2 shards, before s3://bucket/b.tar"),
                    "{reason}"
                )
            }
            Ok(_) => panic!("the read-ahead stopping early is not the end of the units"),
            Err(other) => panic!("unexpected {other}"),
        }
    }

    fn content(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 31 % 251) as u8).collect()
    }

    #[test]
    fn long_members_of_a_mapped_chunk_are_shared_and_the_rest_is_read() {
        let chunk = 128 << 10;
        let bytes = content(2 * chunk + 5000);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shard.tar");
        std::fs::write(&path, &bytes).unwrap();
        let read_ahead = read_ahead(&path, chunk);
        let mut reader = read_ahead.next_shard().unwrap().unwrap();

        assert!(reader.read_shared(1000).unwrap().is_none(), "too short");
        let mut head = vec![0; 1000];
        reader.read_exact(&mut head).unwrap();
        assert_eq!(head, bytes[..1000]);
        let shared = reader
            .read_shared(100_000)
            .unwrap()
            .expect("within the chunk");
        assert_eq!(shared, bytes[1000..101_000]);
        let origin = file_origin(&shared).expect("a view of the mapped file");
        assert_eq!(
            (origin.file.path.as_path(), origin.offset),
            (path.as_path(), 1000)
        );
        let identity = origin.file.identity;
        assert_eq!(identity.size, bytes.len() as u64);
        assert_eq!(file_origin(&shared[10..20]).map(|o| o.offset), Some(1010));
        assert!(file_origin(&head).is_none(), "copied bytes have no origin");
        // Past the end of the chunk: not shared, and nothing is consumed.
        assert!(reader.read_shared(50_000).unwrap().is_none());
        let mut rest = Vec::new();
        reader.read_to_end(&mut rest).unwrap();
        assert_eq!(rest, bytes[101_000..]);
    }

    #[test]
    fn a_pipe_is_read_and_never_shared() {
        let bytes = content(300_000);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pipe.tar");
        let fifo = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
        // SAFETY: creates a named pipe at a path this test owns.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        let writer = {
            let (path, bytes) = (path.clone(), bytes.clone());
            std::thread::spawn(move || std::fs::write(path, bytes).unwrap())
        };
        let read_ahead = read_ahead(&path, 1 << 20);
        let mut reader = read_ahead.next_shard().unwrap().unwrap();
        assert!(reader.read_shared(100_000).unwrap().is_none());
        let mut all = Vec::new();
        reader.read_to_end(&mut all).unwrap();
        assert_eq!(all, bytes);
        writer.join().unwrap();
    }
}
