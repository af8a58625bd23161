//! The SIGBUS handler, process-wide plumbing of the local reader: it turns
//! a fault in a mapped chunk of a file cut short into a read error naming
//! the shard and offset, where the default action would end the process.
//! Why chunks are mapped at all, with the cost measured, is in the comment
//! above [`Guard`].

use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};
use std::sync::Mutex;

use super::pages::page_size;

// The fault handler.
//
// A mapped file that is cut short (truncated, or rewritten in place by a
// tool that truncates first) loses the pages past its new end from every
// mapping of it, and touching one raises SIGBUS, whose default action ends
// the process. Reading with `pread` instead would cost a copy of every
// byte: over a 300 MB epoch of 60-100 KB members, page cache warm, 95 ms of
// CPU mapped against 200-250 ms read into chunks (and 240-320 ms read into
// anonymous mappings so that members could still be shared); re-measured
// alone by `make bench-micro` (`local_read`, 2026-11-27), a 256 MiB file
// read in 1 MiB chunks with 32 kept alive: 22.5 ms mapped, 32.7 ms read.
// So the chunks stay mapped, and this handler turns the fault into an
// error:
//
// - Every mapped chunk is listed in `SLOTS`, a fixed array that the handler
//   reads without a lock (a sequence count per slot tells it a slot being
//   written).
// - On SIGBUS at an address inside a listed chunk, the handler notes the
//   lowest lost page in the chunk's slot, counts the fault in `FAULTS`, maps
//   a page of zeros over the faulting page (`mmap` with `MAP_FIXED`: a
//   system call, safe in a signal handler) and returns, so the access
//   completes and reads zeros.
// - Every reader of mapped bytes checks, after copying them, that the
//   chunk lost no page at or before its range (`Guard::check`, one atomic
//   load while `FAULTS` is 0) and raises `ShardReadError` naming the shard
//   and offset otherwise: the zeros never reach a sample.
// - Any other SIGBUS (not in a listed chunk, or sent with `kill`) goes to
//   the handler that was installed before this one (Python's
//   `faulthandler`, torch's DataLoader worker handler), which is put back
//   first, or to the default action. The handler is installed again over
//   one installed later (checked before each chunk is mapped), and a chunk
//   is read rather than mapped if it cannot be installed or the list is
//   full.

/// A mapped chunk's entry in [`SLOTS`], with what locates its bytes in the
/// file: what a reader of the chunk checks after copying bytes out of it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Guard {
    /// Its slot in [`SLOTS`].
    pub(super) slot: usize,
    /// The chunk's first address.
    pub(super) start: usize,
    /// The file offset of its first byte.
    pub(super) offset: u64,
}

impl Guard {
    /// `Ok` when the `len` bytes at `begin` (inside the chunk), already
    /// read, came from the file; otherwise the file offset from which they
    /// may not have (pages lost to the file being cut short read as zeros).
    pub(crate) fn check(&self, begin: usize, len: usize) -> Result<(), u64> {
        if len == 0 {
            return Ok(());
        }
        std::sync::atomic::fence(Ordering::SeqCst);
        if FAULTS.load(Ordering::SeqCst) == 0 {
            return Ok(());
        }
        let lost = SLOTS[self.slot].lost.load(Ordering::SeqCst);
        if begin + len <= lost {
            return Ok(());
        }
        Err(self.offset + (begin.max(lost) - self.start) as u64)
    }
}

/// One mapped chunk as the fault handler sees it.
struct Slot {
    /// Odd while the slot is written.
    sequence: AtomicUsize,
    /// The chunk's first address; 0 when the slot is free.
    start: AtomicUsize,
    /// Its end (exclusive).
    end: AtomicUsize,
    /// The first address of the lowest page lost to a fault, or
    /// `usize::MAX` (while the slot is taken).
    lost: AtomicUsize,
}

/// Slots for this many chunks mapped at once (past it, chunks are read).
const SLOT_COUNT: usize = 8192;

static SLOTS: [Slot; SLOT_COUNT] = [const {
    Slot {
        sequence: AtomicUsize::new(0),
        start: AtomicUsize::new(0),
        end: AtomicUsize::new(0),
        // Set to `usize::MAX` when the slot is taken; all zeros until then,
        // so that the array takes no room in the library file.
        lost: AtomicUsize::new(0),
    }
}; SLOT_COUNT];

/// Slots `0..SLOTS_USED` have been used (the handler looks no further).
static SLOTS_USED: AtomicUsize = AtomicUsize::new(0);

/// Free slots below [`SLOTS_USED`]; changed only under the
/// mapped chunks' lock.
static FREE_SLOTS: Mutex<Vec<usize>> = Mutex::new(Vec::new());

/// Faults the handler has turned into pages of zeros in this process.
static FAULTS: AtomicUsize = AtomicUsize::new(0);

/// Whether the handler has turned any fault into zeros in this process:
/// until it has, no mapped byte can have been lost.
pub(super) fn any_fault() -> bool {
    std::sync::atomic::fence(Ordering::SeqCst);
    FAULTS.load(Ordering::SeqCst) != 0
}

/// Writes a slot (under the mapped chunks' lock), so that the handler
/// never takes a half-written slot for a whole one.
fn write_slot(slot: usize, start: usize, end: usize) {
    let entry = &SLOTS[slot];
    let sequence = entry.sequence.load(Ordering::Relaxed);
    entry.sequence.store(sequence + 1, Ordering::Relaxed);
    std::sync::atomic::fence(Ordering::Release);
    entry.start.store(start, Ordering::Relaxed);
    entry.end.store(end, Ordering::Relaxed);
    entry.lost.store(usize::MAX, Ordering::Relaxed);
    entry.sequence.store(sequence + 2, Ordering::Release);
}

/// Lists the `len` bytes mapped at `start` for the handler (the caller
/// holds the mapped chunks' lock); `None` when every slot is taken.
pub(super) fn claim_slot(start: usize, len: usize) -> Option<usize> {
    let mut free = FREE_SLOTS.lock().unwrap_or_else(|e| e.into_inner());
    let slot = match free.pop() {
        Some(slot) => slot,
        None => {
            let used = SLOTS_USED.load(Ordering::Relaxed);
            if used == SLOT_COUNT {
                return None;
            }
            used
        }
    };
    write_slot(slot, start, start + len.next_multiple_of(page_size()));
    SLOTS_USED.fetch_max(slot + 1, Ordering::Release);
    Some(slot)
}

/// Takes a chunk off the handler's list (the caller holds the
/// mapped chunks' lock), before it is unmapped.
pub(super) fn release_slot(slot: usize) {
    write_slot(slot, 0, 0);
    FREE_SLOTS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(slot);
}

/// The listed chunk that holds `address`, read without a lock.
fn slot_holding(address: usize) -> Option<&'static Slot> {
    let used = SLOTS_USED.load(Ordering::Acquire).min(SLOT_COUNT);
    SLOTS[..used].iter().find(|entry| {
        let before = entry.sequence.load(Ordering::Acquire);
        let (start, end) = (
            entry.start.load(Ordering::Relaxed),
            entry.end.load(Ordering::Relaxed),
        );
        std::sync::atomic::fence(Ordering::Acquire);
        let after = entry.sequence.load(Ordering::Relaxed);
        before % 2 == 0 && before == after && start != 0 && (start..end).contains(&address)
    })
}

/// The page size, for the handler (set before it is installed).
static HANDLER_PAGE: AtomicUsize = AtomicUsize::new(0);

/// The SIGBUS action that was in place before the handler: where other
/// faults go. Set before each install; never freed (a handler running on
/// another thread may read it).
static PREVIOUS: AtomicPtr<libc::sigaction> = AtomicPtr::new(std::ptr::null_mut());

/// Set while a SIGBUS that is not ours is passed on: one that comes back
/// to this handler (a previous handler that raises it again) goes to the
/// default action rather than round in a loop.
static PASSING_ON: AtomicBool = AtomicBool::new(false);

/// Installs the handler if it is not the process's SIGBUS action now (the
/// first time, or after another library installed its own over it);
/// `false` if it cannot be installed. The caller holds the lock of the
/// mapped chunks' list, so that installs do not race each other.
pub(super) fn install_handler() -> bool {
    let ours = on_sigbus as *const () as libc::sighandler_t;
    // SAFETY: `sigaction` with a null new action only reads the current one
    // into a zeroed struct of ours.
    let mut current: libc::sigaction = unsafe { std::mem::zeroed() };
    if unsafe { libc::sigaction(libc::SIGBUS, std::ptr::null(), &mut current) } != 0 {
        return false;
    }
    if current.sa_sigaction == ours {
        return true;
    }
    HANDLER_PAGE.store(page_size(), Ordering::SeqCst);
    PREVIOUS.store(Box::into_raw(Box::new(current)), Ordering::SeqCst);
    // SAFETY: a zeroed `sigaction` with an empty mask is valid; the handler
    // is an `extern "C"` function of the signature SA_SIGINFO asks for.
    let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
    action.sa_sigaction = ours;
    action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
    unsafe { libc::sigemptyset(&mut action.sa_mask) };
    let mut replaced: libc::sigaction = unsafe { std::mem::zeroed() };
    if unsafe { libc::sigaction(libc::SIGBUS, &action, &mut replaced) } != 0 {
        return false;
    }
    if replaced.sa_sigaction != current.sa_sigaction {
        // Another action came in between: pass faults on to that one.
        PREVIOUS.store(Box::into_raw(Box::new(replaced)), Ordering::SeqCst);
    }
    PASSING_ON.store(false, Ordering::SeqCst);
    true
}

/// The SIGBUS handler (see the comment above [`Guard`]). Uses only atomics
/// and async-signal-safe system calls.
extern "C" fn on_sigbus(
    signal: libc::c_int,
    info: *mut libc::siginfo_t,
    context: *mut libc::c_void,
) {
    let errno = errno_location();
    // SAFETY: reads the thread's errno, to give it back unchanged.
    let saved = unsafe { errno.map(|e| *e) };
    // SAFETY: the kernel passes a valid `siginfo_t` with SA_SIGINFO; a
    // positive code is a fault of this thread's own, whose address field
    // is the faulting address.
    let fault = unsafe { info.as_ref() }
        .filter(|info| info.si_code > 0)
        .map(|info| unsafe { info.si_addr() } as usize);
    let handled = fault.is_some_and(zero_fill);
    if !handled {
        // SAFETY: passes the handler's own arguments on.
        unsafe { pass_on(signal, info, context) };
    }
    if let (Some(errno), Some(saved)) = (errno, saved) {
        // SAFETY: as above.
        unsafe { *errno = saved };
    }
}

/// When `address` lies in a listed chunk: notes the lost page, maps a
/// page of zeros over it and gives `true`.
fn zero_fill(address: usize) -> bool {
    let Some(entry) = slot_holding(address) else {
        return false;
    };
    let page = HANDLER_PAGE.load(Ordering::SeqCst);
    if page == 0 {
        return false;
    }
    let first = address / page * page;
    // Marked before the zeros can be read: a reader that reads them then
    // sees the mark.
    entry.lost.fetch_min(first, Ordering::SeqCst);
    FAULTS.fetch_add(1, Ordering::SeqCst);
    // SAFETY: replaces one page of a chunk mapping of ours (which stays
    // mapped: the faulting access holds it) with a private anonymous page
    // of zeros, read-only like the mapping.
    let mapped = unsafe {
        libc::mmap(
            first as *mut libc::c_void,
            page,
            libc::PROT_READ,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
            -1,
            0,
        )
    };
    mapped != libc::MAP_FAILED
}

/// Passes a SIGBUS that is not ours to the action installed before the
/// handler, after putting that action back in place; or, the second time
/// round or with no such action, to the default action.
///
/// # Safety
/// Called from the handler, with its arguments.
unsafe fn pass_on(signal: libc::c_int, info: *mut libc::siginfo_t, context: *mut libc::c_void) {
    let previous = PREVIOUS.load(Ordering::SeqCst);
    let sent = unsafe { info.as_ref() }.is_none_or(|info| info.si_code <= 0);
    if PASSING_ON.swap(true, Ordering::SeqCst) || previous.is_null() {
        // SAFETY: a zeroed action is SIG_DFL with an empty mask.
        let mut default: libc::sigaction = unsafe { std::mem::zeroed() };
        default.sa_sigaction = libc::SIG_DFL;
        unsafe { libc::sigaction(signal, &default, std::ptr::null_mut()) };
        if sent {
            // Delivered when the handler returns (SIGBUS is blocked in it).
            unsafe { libc::raise(signal) };
        }
        // A fault happens again when the handler returns, to the default.
        return;
    }
    // SAFETY: `previous` came from `Box::into_raw` and is never freed.
    let previous = unsafe { &*previous };
    unsafe { libc::sigaction(signal, previous, std::ptr::null_mut()) };
    match previous.sa_sigaction {
        libc::SIG_DFL => {
            if sent {
                unsafe { libc::raise(signal) };
            }
        }
        libc::SIG_IGN => {}
        handler if previous.sa_flags & libc::SA_SIGINFO != 0 => {
            // SAFETY: an action installed with SA_SIGINFO has this signature.
            let handler: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                unsafe { std::mem::transmute(handler) };
            handler(signal, info, context);
        }
        handler => {
            // SAFETY: an action installed without SA_SIGINFO has this signature.
            let handler: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(handler) };
            handler(signal);
        }
    }
}

/// The calling thread's `errno`.
fn errno_location() -> Option<*mut libc::c_int> {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    // SAFETY: returns the calling thread's errno address.
    return Some(unsafe { libc::__errno_location() });
    #[cfg(any(target_os = "macos", target_os = "ios", target_os = "freebsd"))]
    // SAFETY: as above.
    return Some(unsafe { libc::__error() });
    #[allow(unreachable_code)]
    None
}

#[cfg(test)]
mod tests {
    use super::super::mapped_chunks;
    use super::*;

    #[test]
    fn the_handler_finds_listed_chunks_only() {
        let page = page_size();
        let _chunks = mapped_chunks();
        let slot = claim_slot(1 << 40, 3 * page + 1).expect("a free slot");
        assert!(std::ptr::eq(slot_holding(1 << 40).unwrap(), &SLOTS[slot]));
        assert!(
            slot_holding((1 << 40) + 4 * page - 1).is_some(),
            "its last page"
        );
        assert!(slot_holding((1 << 40) + 4 * page).is_none());
        assert!(slot_holding((1 << 40) - 1).is_none());
        release_slot(slot);
        assert!(slot_holding(1 << 40).is_none());
    }
}
