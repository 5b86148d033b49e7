//! The failure board of a group of ranks: the first failure anywhere, told to every rank.
//!
//! Every transport has one. A rank that fails (an error on its comm thread, an exception in its
//! caller, a peer's frame it cannot read) raises it here, and the board tells its peers at once
//! (over a side channel: cfc's TCP links, or shared memory for ranks that are threads of one
//! process). A rank whose process ends without closing its engine is raised by its peers'
//! links when its connection closes. Every wait of the engine (for the GPU, for a peer's
//! bytes) looks at the board between polls, so a failure ends the waits of every rank within
//! milliseconds, where a collective on its own would wait for its timeout (over NVLink, NCCL
//! cannot tell that a peer died).
//!
//! A failure carries the *point* it happened at: the engine's messages that may run
//! collectives (its jobs, and the step ends, agreements, resets and the stop between them) are
//! numbered alike on every rank, since every rank sends the same ones in the same order. A
//! rank's waits end only for a failure at or before the point it is working on: a peer that
//! failed at a later point had finished this one, and so the work this rank waits for will come.
//! A caller's failure (`Engine::fail`) is at the next point, so that the peers finish what this
//! rank has sent and this rank gives up at the next thing it would do, whatever that is.

use crate::error::Error;
use std::sync::{Arc, Mutex};

/// A failure, as every rank learns it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// The rank where it began.
    pub rank: usize,
    /// Its error, in words.
    pub reason: String,
    /// The point it happened at (counted from 1, the same on every rank: see the module
    /// docs), or 0 where that is not known (a process that died): then it ends every wait.
    pub at: u64,
}

impl Failure {
    /// The error a rank reports for it.
    pub fn error(&self) -> Error {
        Error::PeerFailed {
            rank: self.rank,
            reason: self.reason.clone(),
        }
    }
}

/// How a board tells the peers of its rank about a failure raised on it.
pub(crate) type Tell = Box<dyn Fn(&Failure) + Send + Sync>;

/// The failure board of one rank (or, for ranks that are threads of one process, of all).
pub struct Control {
    first: Mutex<Option<Failure>>,
    tell: Mutex<Option<Tell>>,
    /// The point this rank's engine is working on (see the module docs).
    now: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for Control {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Control")
            .field("failure", &self.failure())
            .finish()
    }
}

/// The most bytes of an error message a failure carries to the peers.
pub(crate) const REASON_MAX: usize = 1024;

/// `reason` cut to [`REASON_MAX`] bytes at a character boundary.
pub(crate) fn cut(reason: &str) -> &str {
    let mut at = reason.len().min(REASON_MAX);
    while !reason.is_char_boundary(at) {
        at -= 1;
    }
    &reason[..at]
}

impl Control {
    /// A board that tells no one (yet: see `Control::set_tell`).
    pub fn new() -> Arc<Control> {
        Arc::new(Control {
            first: Mutex::new(None),
            tell: Mutex::new(None),
            now: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// How failures raised on this rank reach its peers.
    pub(crate) fn set_tell(&self, tell: Tell) {
        *self.tell.lock().unwrap_or_else(|e| e.into_inner()) = Some(tell);
    }

    /// Records `failure` unless one was recorded before (the first one wins), and where it is
    /// this rank's own (`tell`), tells the peers. Returns whether it was the first.
    pub fn raise(&self, failure: Failure, tell: bool) -> bool {
        let failure = Failure {
            reason: cut(&failure.reason).to_string(),
            ..failure
        };
        {
            let mut first = self.first.lock().unwrap_or_else(|e| e.into_inner());
            if first.is_some() {
                return false;
            }
            *first = Some(failure.clone());
        }
        tracing::error!(rank = failure.rank, reason = %failure.reason, "cfc engine failure");
        if tell {
            if let Some(t) = self.tell.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
                t(&failure);
            }
        }
        true
    }

    /// The first failure raised, if any.
    pub fn failure(&self) -> Option<Failure> {
        self.first.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Notes the point this rank works on (its waits end for failures at or before it).
    pub(crate) fn set_now(&self, point: u64) {
        self.now.store(point, std::sync::atomic::Ordering::SeqCst);
    }

    /// The first failure, if it ends this rank's waits now: one at or before the point this
    /// rank works on (see the module docs).
    pub fn due(&self) -> Option<Failure> {
        let now = self.now.load(std::sync::atomic::Ordering::SeqCst);
        self.failure().filter(|f| f.at == 0 || f.at <= now)
    }

    /// [`Control::due`] as the error a wait returns.
    pub fn check(&self) -> crate::Result<()> {
        match self.due() {
            Some(f) => Err(f.error()),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn the_first_failure_wins_and_is_told_once() {
        let c = Control::new();
        let told = Arc::new(AtomicUsize::new(0));
        let t = told.clone();
        c.set_tell(Box::new(move |_| {
            t.fetch_add(1, Ordering::SeqCst);
        }));
        assert!(c.check().is_ok());
        assert!(c.raise(
            Failure {
                rank: 2,
                reason: "é".repeat(REASON_MAX),
                at: 5,
            },
            true
        ));
        assert!(!c.raise(
            Failure {
                rank: 0,
                reason: "later".into(),
                at: 0,
            },
            true
        ));
        assert_eq!(told.load(Ordering::SeqCst), 1);
        let f = c.failure().expect("a failure");
        assert_eq!(f.rank, 2);
        assert!(f.reason.len() <= REASON_MAX);
        // A failure at point 5 ends the waits of a rank at point 5 or later, not before.
        c.set_now(4);
        assert!(c.check().is_ok() && c.failure().is_some());
        c.set_now(5);
        assert!(matches!(c.check(), Err(Error::PeerFailed { rank: 2, .. })));
    }
}
