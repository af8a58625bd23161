//! The thread that opens local files for this process. `open` of a pipe
//! with no writer, or of a file on a hung network or FUSE mount, never
//! returns: opens run on one thread per process, so that such an open holds
//! that one thread, and later ones fail at once naming the file that blocks.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How a file opened on the opener thread comes back: the file and its
/// metadata, or the error of `open` (or `fstat`).
pub(super) type Opened = std::io::Result<(File, std::fs::Metadata)>;

/// The thread that opens local files for this process, while it runs.
///
/// `open` of a pipe with no writer, or of a file on a hung network or FUSE
/// mount, never returns, and nothing can cancel it. On a blocking thread
/// of the reading runtime each such attempt would keep that thread, and
/// the runtime it belongs to (its descriptors), alive for good. Opens run
/// on this one thread instead: a blocked open holds it, the runtimes shut
/// down cleanly, and later opens fail at once (see [`request_open`])
/// rather than each leaving a thread behind. A file that opens after its
/// reader has gone is closed. The thread ends after [`OPENER_IDLE`] without
/// work; the next open starts another.
pub(super) static OPENER: Mutex<Option<Opener>> = Mutex::new(None);

/// How long the opener thread waits for work before it ends.
const OPENER_IDLE: Duration = Duration::from_millis(50);

/// The running opener thread, as its clients see it.
pub(super) struct Opener {
    /// The process it runs in: a forked child has none.
    pid: u32,
    /// Where to send it requests.
    requests: std::sync::mpsc::Sender<OpenRequest>,
    /// The path it is opening now, and since when.
    busy: Option<(PathBuf, Instant)>,
    /// Tells this thread from a later one.
    generation: u64,
}

/// One file to open, and where to send the outcome.
struct OpenRequest {
    path: PathBuf,
    reply: tokio::sync::oneshot::Sender<Opened>,
}

/// The opener's lock. Whoever first takes it has registered the local
/// reader's fork handlers, which hold it across `fork`.
fn opener() -> std::sync::MutexGuard<'static, Option<Opener>> {
    OPENER.lock().unwrap_or_else(|e| e.into_inner())
}

/// Hands `path` to the opener thread (starting one if none runs in this
/// process) and gives the receiver of the outcome; refuses, with the
/// reason, when the thread has been blocked in an open for `stuck_after`.
pub(super) fn request_open(
    path: &Path,
    stuck_after: Duration,
) -> Result<tokio::sync::oneshot::Receiver<Opened>, String> {
    let (reply, outcome) = tokio::sync::oneshot::channel();
    let mut request = OpenRequest {
        path: path.to_owned(),
        reply,
    };
    let mut current = opener();
    let pid = std::process::id();
    if let Some(running) = current.as_ref().filter(|o| o.pid == pid) {
        if let Some((blocked, since)) = &running.busy {
            let waited = since.elapsed();
            if waited >= stuck_after {
                return Err(format!(
                    "open timed out: opening {} has not returned for {:.1} s (a pipe with \
                     no writer, or a hung file system); no local shard can be opened in this \
                     process until it does",
                    blocked.display(),
                    waited.as_secs_f64()
                ));
            }
        }
        match running.requests.send(request) {
            Ok(()) => return Ok(outcome),
            // The thread has ended (it cannot while it is listed): start another.
            Err(returned) => request = returned.0,
        }
    }
    static GENERATION: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let generation = GENERATION.fetch_add(1, Ordering::Relaxed);
    let (requests, incoming) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("shardstream-open".into())
        .spawn(move || serve_opens(&incoming, generation))
        .map_err(|e| format!("cannot start a thread to open the file: {e}"))?;
    // The receiver lives until the thread ends, which it does only after
    // taking itself off the list under this lock.
    let _ = requests.send(request);
    *current = Some(Opener {
        pid,
        requests,
        busy: None,
        generation,
    });
    Ok(outcome)
}

/// The opener thread: opens each requested file whose requester still
/// waits, until no request comes for [`OPENER_IDLE`].
fn serve_opens(incoming: &std::sync::mpsc::Receiver<OpenRequest>, generation: u64) {
    let ours = |o: &Option<Opener>| o.as_ref().is_some_and(|o| o.generation == generation);
    loop {
        let request = match incoming.recv_timeout(OPENER_IDLE) {
            Ok(request) => request,
            Err(_) => {
                // Requests are sent under the lock: none arrives after this look.
                let mut current = opener();
                match incoming.try_recv() {
                    Ok(request) => request,
                    Err(_) => {
                        if ours(&current) {
                            *current = None;
                        }
                        return;
                    }
                }
            }
        };
        if request.reply.is_closed() {
            continue;
        }
        let set_busy = |busy: Option<(PathBuf, Instant)>| {
            if let Some(running) = opener().as_mut().filter(|o| o.generation == generation) {
                running.busy = busy;
            }
        };
        set_busy(Some((request.path.clone(), Instant::now())));
        let opened = File::open(&request.path).and_then(|file| {
            let meta = file.metadata()?;
            Ok((file, meta))
        });
        set_busy(None);
        // A requester that has gone drops (closes) the file with the reply.
        let _ = request.reply.send(opened);
    }
}
