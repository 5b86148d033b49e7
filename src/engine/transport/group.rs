//! [`Links`] among some of the ranks of other links: the node and the rail of a two-level
//! exchange (see `engine/topology.rs`) over the links that join every rank.
//!
//! The views share the links (one comm thread uses them all, one call at a time) and number
//! the group's ranks `0..members.len()`. Messages of the groups and of the whole ride the same
//! pairwise links: each pair of ranks sends and receives them in the same order, because every
//! rank runs one schedule.

use super::Links;
use crate::engine::control::Control;
use crate::error::Result;
use std::sync::{Arc, Mutex, MutexGuard};

/// See the module docs.
pub struct GroupLinks<L: Links> {
    all: Arc<Mutex<L>>,
    /// The group's ranks among all, in group order (the whole: `None`).
    members: Option<Vec<usize>>,
    rank: usize,
    control: Arc<Control>,
}

impl<L: Links> std::fmt::Debug for GroupLinks<L> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupLinks")
            .field("rank", &self.rank)
            .field("members", &self.members)
            .finish()
    }
}

impl<L: Links> GroupLinks<L> {
    /// Every rank of `links`.
    pub fn whole(links: L) -> GroupLinks<L> {
        let rank = links.rank();
        let control = links.control().clone();
        GroupLinks {
            all: Arc::new(Mutex::new(links)),
            members: None,
            rank,
            control,
        }
    }

    /// The ranks `members` (of all, in that order; this rank among them) over the same links.
    ///
    /// # Errors
    /// [`crate::Error::Transport`] (internal) where this rank or a member is out of place.
    pub fn group(&self, members: &[usize]) -> Result<GroupLinks<L>> {
        let all = self.lock();
        let (me, world) = (all.rank(), all.world());
        drop(all);
        let rank = members.iter().position(|&r| r == me);
        match rank {
            Some(rank) if members.iter().all(|&r| r < world) => Ok(GroupLinks {
                all: self.all.clone(),
                members: Some(members.to_vec()),
                rank,
                control: self.control.clone(),
            }),
            _ => Err(crate::Error::Transport(format!(
                "internal: rank {me} is not in the group {members:?} of {world} ranks"
            ))),
        }
    }

    fn lock(&self) -> MutexGuard<'_, L> {
        self.all.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The rank among all of the group's rank `p`.
    fn peer(&self, p: usize) -> Result<usize> {
        match &self.members {
            Some(m) => m.get(p).copied().ok_or_else(|| {
                crate::Error::Transport(format!("internal: no rank {p} in a group of {}", m.len()))
            }),
            None => Ok(p),
        }
    }
}

impl<L: Links> Links for GroupLinks<L> {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        match &self.members {
            Some(m) => m.len(),
            None => self.lock().world(),
        }
    }

    fn control(&self) -> &Arc<Control> {
        &self.control
    }

    fn expect(&mut self, bytes: usize) {
        self.lock().expect(bytes);
    }

    fn send(&mut self, peer: usize, data: &[u8]) -> Result<()> {
        let p = self.peer(peer)?;
        self.lock().send(p, data)
    }

    fn recv(&mut self, peer: usize) -> Result<Vec<u8>> {
        let p = self.peer(peer)?;
        self.lock().recv(p)
    }

    fn close(&mut self) {
        // Only the whole says goodbye: a group closes with the engine, not before it.
        if self.members.is_none() {
            self.lock().close();
        }
    }
}
