//! The transport seam of the engine: how bytes move between the ranks.
//!
//! A `Transport` moves rows of a backend's memory: an all-gather of one row per rank, an
//! exchange of a row with each peer (lengths agreed by both sides), plain all-reduce and
//! reduce-scatter of tensors (the uncompressed fallback), and small host messages (agreement,
//! trial times). Every rank calls the same operations in the same order; the engine's single
//! comm thread sees to that.
//!
//! - [`host::HostTransport`] over [`Links`]: host memory (the CPU backend), between threads of
//!   one process ([`local::LocalLinks`]) or processes ([`tcp::TcpLinks`]).
//! - `nccl::NcclTransport`: device memory over an NCCL communicator, with TCP links beside it
//!   for the failure board only.
//! - `staged::StagedTransport`: device memory over [`Links`], through host memory (ranks that
//!   share one GPU, where NCCL refuses them).
//!
//! Every transport has a failure board ([`Control`]): its waits end with the first failure
//! raised on any rank.

pub mod group;
pub mod host;
pub mod local;
#[cfg(feature = "cuda")]
pub mod nccl;
#[cfg(feature = "cuda")]
pub mod staged;
pub mod tcp;

use crate::engine::backend::Backend;
use crate::engine::control::Control;
use crate::engine::job::{Region, Tensor};
use crate::error::Result;
use std::sync::Arc;

/// Moves bytes between the ranks of a group; see the module docs.
pub(crate) trait Transport<B: Backend>: Send {
    /// This rank, `0..world()`.
    fn rank(&self) -> usize;

    /// Number of ranks.
    fn world(&self) -> usize;

    /// The failure board.
    fn control(&self) -> &Arc<Control>;

    /// Queues on the comm lane: `send` from every rank into `recv` (`world * send.len` bytes),
    /// in rank order.
    ///
    /// # Errors
    /// Transport errors, a failure on the board, the timeout.
    fn all_gather(&mut self, be: &mut B, send: Region, recv: Region) -> Result<()>;

    /// Queues on the comm lane: `sends[j]` to rank `j` and `recvs[j]` from it, for every rank
    /// (empty ones skipped; this rank's own copied). Both sides of each pair give one length.
    ///
    /// # Errors
    /// As [`Transport::all_gather`].
    fn exchange(&mut self, be: &mut B, sends: &[Region], recvs: &[Region]) -> Result<()>;

    /// Queues on the comm lane the uncompressed all-reduce of `data`, in place, the sum
    /// multiplied by `scale`.
    ///
    /// # Errors
    /// As [`Transport::all_gather`].
    fn all_reduce(&mut self, be: &mut B, data: Tensor, scale: f32) -> Result<()>;

    /// Queues on the comm lane the uncompressed reduce-scatter of `data` (one shard per rank,
    /// rank-major) into `out`, the sum multiplied by `scale`.
    ///
    /// # Errors
    /// As [`Transport::all_gather`].
    fn reduce_scatter(&mut self, be: &mut B, data: Tensor, out: Tensor, scale: f32) -> Result<()>;

    /// Every rank's `mine` (small host bytes, any length), in rank order; waits for them.
    ///
    /// # Errors
    /// As [`Transport::all_gather`].
    fn gather(&mut self, be: &mut B, mine: &[u8]) -> Result<Vec<Vec<u8>>>;

    /// Waits until the work before `mark` is done, or fails: a failure on the board, a
    /// transport error, no progress within the timeout.
    ///
    /// # Errors
    /// As above.
    fn wait(&mut self, be: &mut B, mark: &B::Mark) -> Result<()>;

    /// A transport among the ranks `members` (ranks of this one, in the new group's order;
    /// this rank among them), sharing this one's failure board. Every rank calls it at the same
    /// point, each with its own group (the groups partition the ranks; `color` numbers them
    /// alike on every rank).
    ///
    /// # Errors
    /// Transport errors (NCCL's split), a failure on the board, the timeout.
    fn group(&mut self, be: &mut B, members: &[usize], color: usize) -> Result<Self>
    where
        Self: Sized;

    /// Whether [`Transport::group`] can make groups (NCCL before 2.18 cannot).
    fn can_group(&self) -> bool {
        true
    }

    /// Gives up at once: queued work that waits for peers stops (the device can then drain),
    /// and every later call fails. Called once the engine has failed.
    fn abort(&mut self);
}

/// Point-to-point host messages between the ranks of a group, and its failure board.
pub trait Links: Send {
    /// This rank.
    fn rank(&self) -> usize;

    /// Number of ranks.
    fn world(&self) -> usize;

    /// The failure board.
    fn control(&self) -> &Arc<Control>;

    /// Tells the links that this rank's next collective receives messages of up to `bytes`
    /// (called before it sends). Links from other processes admit no longer data message
    /// than the longest so far, nor [`MESSAGE_FLOOR`]: a peer cannot make this rank reserve
    /// more memory than its own exchanges need.
    fn expect(&mut self, bytes: usize) {
        let _ = bytes;
    }

    /// Sends `data` to `peer` (not this rank). Never waits for the peer to receive it.
    ///
    /// # Errors
    /// [`crate::Error::Transport`] when the peer is gone.
    fn send(&mut self, peer: usize, data: &[u8]) -> Result<()>;

    /// The next message from `peer`, waiting at most the timeout and ending at once when a
    /// failure is raised on the board.
    ///
    /// # Errors
    /// [`crate::Error::PeerFailed`], [`crate::Error::Timeout`], [`crate::Error::Transport`].
    fn recv(&mut self, peer: usize) -> Result<Vec<u8>>;

    /// Tells the peers this rank is closing (so that its going away is no failure).
    fn close(&mut self);
}

/// The data message every link admits, whatever its exchanges expect: the largest
/// [`Transport::gather`] (whose peers' lengths are not known ahead) and the engine's own small
/// rounds.
pub const MESSAGE_FLOOR: usize = 1 << 20;

/// How long a blocked receive sleeps before it looks at the failure board again.
pub(crate) const BOARD_POLL: std::time::Duration = std::time::Duration::from_millis(5);

/// The error of a receive from `peer` after its goodbye: the failure on the board if there is
/// one (a peer closes its engine mid-exchange after a failure, which it told), else that the
/// peer closed its engine.
pub(crate) fn closed(control: &Control, peer: usize) -> crate::error::Error {
    match control.failure() {
        Some(f) => f.error(),
        None => crate::error::Error::Transport(format!("rank {peer} closed its engine")),
    }
}
