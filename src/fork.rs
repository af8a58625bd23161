//! The process's one `pthread_atfork` registration. A module whose state a
//! `fork` must not copy half-changed (a lock another thread may hold at the
//! fork, an id of this process) registers its [`ForkHandlers`] here; the
//! handlers run, as `pthread_atfork` orders them, on the forking thread.
//! DataLoader workers are forked from a process whose threads may be
//! streaming at the time.

use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::Once;

/// What a module does around a `fork`: each runs on the forking thread
/// (and must only take or let go of the module's own locks, or store to
/// atomics: nothing that could wait on another thread).
#[derive(Debug)]
pub struct ForkHandlers {
    /// Before the fork, in the parent.
    pub prepare: Option<fn()>,
    /// After the fork, in the parent.
    pub parent: Option<fn()>,
    /// After the fork, in the child.
    pub child: Option<fn()>,
}

/// The most modules that may register handlers.
const SLOTS: usize = 8;

/// The registered handlers, in registration order (null: a free slot).
/// Atomics, not a lock: the handlers are read while the process forks.
static REGISTERED: [AtomicPtr<ForkHandlers>; SLOTS] =
    [const { AtomicPtr::new(std::ptr::null_mut()) }; SLOTS];

/// Registers `handlers`, once each (a second call with the same handlers
/// changes nothing). Handlers registered after a fork began run from the
/// next one.
///
/// # Panics
/// When more than [`SLOTS`] distinct handlers are registered: a fixed
/// number of modules do, so this is a bug, caught by the tests.
pub fn register(handlers: &'static ForkHandlers) {
    static REGISTRATION: Once = Once::new();
    REGISTRATION.call_once(|| {
        // SAFETY: registers `extern "C"` functions that only read
        // `REGISTERED` and call the handlers registered there, which take
        // or release their modules' own locks or store to atomics.
        unsafe {
            libc::pthread_atfork(Some(prepare), Some(parent), Some(child));
        }
    });
    let wanted = std::ptr::from_ref(handlers).cast_mut();
    for slot in &REGISTERED {
        match slot.compare_exchange(
            std::ptr::null_mut(),
            wanted,
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => return,
            Err(held) if held == wanted => return,
            Err(_) => {}
        }
    }
    panic!("more than {SLOTS} modules registered fork handlers");
}

/// The registered handlers, in registration order.
fn registered() -> impl DoubleEndedIterator<Item = &'static ForkHandlers> {
    REGISTERED.iter().filter_map(|slot| {
        // SAFETY: a non-null slot holds a `&'static ForkHandlers`.
        unsafe { slot.load(Ordering::Acquire).as_ref() }
    })
}

/// Before a fork: the `prepare` handlers, last registered first (as
/// `pthread_atfork` runs them).
extern "C" fn prepare() {
    for handlers in registered().rev() {
        if let Some(f) = handlers.prepare {
            f();
        }
    }
}

/// After a fork, in the parent: the `parent` handlers, in registration order.
extern "C" fn parent() {
    for handlers in registered() {
        if let Some(f) = handlers.parent {
            f();
        }
    }
}

/// After a fork, in the child: the `child` handlers, in registration order.
extern "C" fn child() {
    for handlers in registered() {
        if let Some(f) = handlers.child {
            f();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    static PREPARED: AtomicU32 = AtomicU32::new(0);
    static PARENT: AtomicU32 = AtomicU32::new(0);

    static COUNTING: ForkHandlers = ForkHandlers {
        prepare: Some(|| {
            PREPARED.fetch_add(1, Ordering::SeqCst);
        }),
        parent: Some(|| {
            PARENT.fetch_add(1, Ordering::SeqCst);
        }),
        child: Some(|| {
            CHILD.fetch_add(1, Ordering::SeqCst);
        }),
    };

    static CHILD: AtomicU32 = AtomicU32::new(0);

    /// A fork runs each registered hook once, on its side of the fork;
    /// registering the same handlers twice registers them once.
    #[test]
    fn a_fork_runs_each_handler_once_on_its_side() {
        register(&COUNTING);
        register(&COUNTING);
        let (prepared, parent) = (
            PREPARED.load(Ordering::SeqCst),
            PARENT.load(Ordering::SeqCst),
        );
        let child_before = CHILD.load(Ordering::SeqCst);
        // SAFETY: the child only reads an atomic and exits.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            // In the child: its hook ran once (status 7), or not.
            let ran = CHILD.load(Ordering::SeqCst) == child_before + 1;
            // SAFETY: ends the child at once, running nothing of the parent's.
            unsafe { libc::_exit(if ran { 7 } else { 1 }) }
        }
        assert!(pid > 0, "fork failed");
        let mut status = 0;
        // SAFETY: waits for the child just forked.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 7);
        // Other tests of this process may fork too: at least one more each.
        assert!(PREPARED.load(Ordering::SeqCst) > prepared);
        assert!(PARENT.load(Ordering::SeqCst) > parent);
        let count = registered().filter(|h| std::ptr::eq(*h, &COUNTING)).count();
        assert_eq!(count, 1);
    }
}
