//! What an engine's handle ([`super::Engine`]) and its comm thread (`worker.rs`) share: the
//! outcomes of closes and agreements as the thread publishes them ([`Progress`], waited on
//! through [`Shared`]'s condition variable), and the counters of [`Stats`], with what one job
//! sent ([`Sent`]).

use super::{Done, Failure};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// What the engine has done so far (see [`Engine::stats`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Stats {
    /// Jobs compressed.
    pub compressed: u64,
    /// Jobs sent uncompressed.
    pub plain: u64,
    /// Bytes this rank sent (`inside_node + between_nodes`).
    pub bytes_sent: u64,
    /// Bytes this rank sent to ranks of its own node (all of them where no nodes were given).
    pub inside_node: u64,
    /// Bytes this rank sent to ranks of other nodes (for a plain ring collective across nodes,
    /// this rank's share of the ring's bytes out of its node: a `1 / ranks per node` part).
    pub between_nodes: u64,
    /// The part of `bytes_uncompressed` that a ring would send between nodes (counted as for
    /// `between_nodes`).
    pub uncompressed_between_nodes: u64,
    /// Bytes a ring collective of the same jobs would have sent uncompressed.
    pub bytes_uncompressed: u64,
    /// Exchanges in which a frame outgrew its slot (its bytes past the slot then went in a
    /// second exchange).
    pub resends: u64,
    /// The part of `bytes_sent` that is compressed frames themselves, each counted once per
    /// peer it went to: what a sender that knew every frame's size would send. The rest is
    /// `slack_bytes`, the rows' heads (with block exponents), the rounds of their own (a bound's
    /// or block scales' first agreement) and plain jobs.
    pub frame_bytes: u64,
    /// The part of `bytes_sent` that is neither frames nor heads: slot bytes that frames did
    /// not fill (a slot's margin over its frame) and, where frames outgrew their slots in an
    /// all-gather, the padding of every rank's tail to the longest.
    pub slack_bytes: u64,
    /// The largest bound a job was compressed with.
    pub eps: f64,
    /// The largest error left in a residual (what a compressed job did not send).
    pub max_error: f64,
    /// Host seconds the comm thread spent on jobs (not waiting for the next one).
    pub seconds: f64,
}

pub(crate) struct Progress {
    /// Closes and agreements published so far, and the first of them that failed: outcomes
    /// only go from success to failure (a failed engine fails everything after), so every
    /// waiter reads its own from these two, however long ago it was published.
    pub(crate) published: u64,
    pub(crate) first_failed: Option<u64>,
    /// The first failure (of any rank) the engine's thread saw.
    pub(crate) failure: Option<Failure>,
    /// The engine's thread ended abnormally: nothing more is published.
    pub(crate) dead: bool,
    /// The device did not drain after a failure: work queued on the caller's memory may still
    /// run (see [`Engine::settled`]).
    pub(crate) stranded: bool,
    pub(crate) done: Option<Arc<Done>>,
    /// The latest order whose jobs' work is queued (see [`Engine::order`]), and what a
    /// caller's stream waits on for it.
    pub(crate) queued: u64,
    pub(crate) queued_done: Option<Arc<Done>>,
}

impl Progress {
    /// Whether publication `index` (counted from 1, already published) was a success.
    pub(crate) fn succeeded(&self, index: u64) -> bool {
        self.first_failed.is_none_or(|f| index < f)
    }
}

/// What the handle and the comm thread share.
pub(crate) struct Shared {
    progress: Mutex<Progress>,
    cv: Condvar,
    stats: Mutex<Stats>,
}

impl Shared {
    pub(crate) fn new() -> Arc<Shared> {
        Arc::new(Shared {
            progress: Mutex::new(Progress {
                published: 0,
                first_failed: None,
                failure: None,
                dead: false,
                stranded: false,
                done: None,
                queued: 0,
                queued_done: None,
            }),
            cv: Condvar::new(),
            stats: Mutex::new(Stats::default()),
        })
    }

    pub(crate) fn stats(&self) -> std::sync::MutexGuard<'_, Stats> {
        self.stats.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn progress(&self) -> std::sync::MutexGuard<'_, Progress> {
        self.progress.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Lets go of `p` until the comm thread publishes something, or `at_most` has passed.
    pub(crate) fn wait<'a>(
        &self,
        p: std::sync::MutexGuard<'a, Progress>,
        at_most: Duration,
    ) -> std::sync::MutexGuard<'a, Progress> {
        self.cv
            .wait_timeout(p, at_most)
            .unwrap_or_else(|e| e.into_inner())
            .0
    }

    /// The outcome of the next close or agreement (`done`: what the caller's stream waits on).
    pub(crate) fn publish(&self, ok: bool, done: Option<Done>) {
        let mut p = self.progress();
        p.published += 1;
        if !ok && p.first_failed.is_none() {
            p.first_failed = Some(p.published);
        }
        if let Some(d) = done {
            p.done = Some(Arc::new(d));
        }
        self.cv.notify_all();
    }

    /// The jobs before order `at` are queued on the device (see [`Engine::order`]).
    pub(crate) fn note_queued(&self, at: u64, done: Done) {
        let mut p = self.progress();
        p.queued = at;
        p.queued_done = Some(Arc::new(done));
        self.cv.notify_all();
    }

    /// A flush with nothing to close: the last close's outcome stands.
    pub(crate) fn publish_again(&self) {
        let ok = {
            let p = self.progress();
            p.first_failed.is_none()
        };
        self.publish(ok, None);
    }

    /// After the comm thread is gone: every outcome still awaited is a failure.
    pub(crate) fn fail_all_waiters(&self) {
        let mut p = self.progress();
        p.dead = true;
        self.cv.notify_all();
    }

    /// Notes that the device did not drain after a failure (see [`Engine::settled`]).
    pub(crate) fn note_stranded(&self) {
        self.progress().stranded = true;
    }

    /// The failure that ended the engine (the first the comm thread saw).
    pub(crate) fn note_failure(&self, failure: Option<Failure>) {
        let mut p = self.progress();
        if p.failure.is_none() {
            p.failure = failure;
        }
        self.cv.notify_all();
    }

    /// A job done: `sent` bytes went (inside this rank's node, and between nodes), where a ring
    /// collective would have sent `uncompressed` (of which `ring_between` between nodes).
    pub(crate) fn account(
        &self,
        compressed: bool,
        sent: Sent,
        uncompressed: u64,
        ring_between: u64,
        eps: f64,
    ) {
        let mut s = self.stats();
        if compressed {
            s.compressed += 1;
        } else {
            s.plain += 1;
        }
        s.bytes_sent += sent.inside + sent.between;
        s.frame_bytes += sent.frames;
        s.slack_bytes += sent.slack;
        s.inside_node += sent.inside;
        s.between_nodes += sent.between;
        s.bytes_uncompressed += uncompressed;
        s.uncompressed_between_nodes += ring_between;
        s.eps = s.eps.max(eps);
    }

    pub(crate) fn resend(&self) {
        self.stats().resends += 1;
    }

    pub(crate) fn add_seconds(&self, s: f64) {
        self.stats().seconds += s;
    }

    pub(crate) fn set_max_error(&self, m: f64) {
        let mut s = self.stats();
        s.max_error = s.max_error.max(m);
    }
}

/// Bytes a job sent, inside this rank's node and to other nodes; of them, its frames' own
/// bytes and the slack around them (see [`Stats::frame_bytes`], [`Stats::slack_bytes`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Sent {
    pub inside: u64,
    pub between: u64,
    pub frames: u64,
    pub slack: u64,
}
