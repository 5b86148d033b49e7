//! [`Links`] between ranks that are threads of one process: crossbeam channels, and a failure
//! board per rank whose failures reach the others' boards at once (each rank's waits still end
//! only for failures at or before its own job). For tests, examples and `cfc-bench`.

use super::{Links, BOARD_POLL};
use crate::engine::control::{Control, Failure};
use crate::error::{Error, Result};
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

enum Message {
    Data(Vec<u8>),
    /// The sender closed its links: no more messages, and no failure.
    Bye,
}

/// One rank's end of a group of threads; see the module docs.
pub struct LocalLinks {
    rank: usize,
    to: Vec<Sender<Message>>,
    from: Vec<Receiver<Message>>,
    /// Peers that said goodbye.
    gone: Vec<bool>,
    control: Arc<Control>,
    timeout: Duration,
}

impl std::fmt::Debug for LocalLinks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalLinks")
            .field("rank", &self.rank)
            .field("world", &self.to.len())
            .finish()
    }
}

impl LocalLinks {
    /// The ends of a group of `world` ranks, one per thread. A receive that waits longer than
    /// `timeout` fails with [`Error::Timeout`].
    pub fn group(world: usize, timeout: Duration) -> Vec<LocalLinks> {
        // channels[a][b]: from rank a to rank b
        let channels: Vec<Vec<_>> = (0..world)
            .map(|_| (0..world).map(|_| crossbeam_channel::unbounded()).collect())
            .collect();
        let controls: Vec<Arc<Control>> = (0..world).map(|_| Control::new()).collect();
        for (rank, c) in controls.iter().enumerate() {
            // (weak: the boards do not keep each other alive)
            let others: Vec<std::sync::Weak<Control>> = controls
                .iter()
                .enumerate()
                .filter(|(j, _)| *j != rank)
                .map(|(_, o)| Arc::downgrade(o))
                .collect();
            c.set_tell(Box::new(move |f: &Failure| {
                for o in others.iter().filter_map(|o| o.upgrade()) {
                    o.raise(f.clone(), false);
                }
            }));
        }
        (0..world)
            .map(|rank| LocalLinks {
                rank,
                to: (0..world).map(|b| channels[rank][b].0.clone()).collect(),
                from: (0..world).map(|a| channels[a][rank].1.clone()).collect(),
                gone: vec![false; world],
                control: controls[rank].clone(),
                timeout,
            })
            .collect()
    }
}

impl Links for LocalLinks {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.to.len()
    }

    fn control(&self) -> &Arc<Control> {
        &self.control
    }

    fn send(&mut self, peer: usize, data: &[u8]) -> Result<()> {
        self.to[peer]
            .send(Message::Data(data.to_vec()))
            .map_err(|_| Error::Transport(format!("rank {peer} is gone")))
    }

    fn recv(&mut self, peer: usize) -> Result<Vec<u8>> {
        let t0 = Instant::now();
        loop {
            if self.gone[peer] {
                return Err(super::closed(&self.control, peer));
            }
            // What arrived before a failure was raised is still taken: the peer's step went
            // through, and the failure belongs to a later one.
            match self.from[peer].recv_timeout(BOARD_POLL) {
                Ok(Message::Data(d)) => return Ok(d),
                Ok(Message::Bye) => self.gone[peer] = true,
                Err(RecvTimeoutError::Timeout) => {
                    self.control.check()?;
                    if t0.elapsed() > self.timeout {
                        return Err(Error::Timeout {
                            peer,
                            seconds: self.timeout.as_secs_f64(),
                        });
                    }
                }
                Err(RecvTimeoutError::Disconnected) => {
                    // The peer's thread let go of its end without closing: it died.
                    let failure = Failure {
                        rank: peer,
                        reason: "its thread ended without closing its engine".into(),
                        at: 0,
                    };
                    // (told on: ranks not linked to it wait on it through others)
                    self.control.raise(failure.clone(), true);
                    self.control.check()?;
                    // (an earlier failure, at a later point, holds the board: nothing more can
                    // come from this peer all the same)
                    return Err(failure.error());
                }
            }
        }
    }

    fn close(&mut self) {
        for (peer, tx) in self.to.iter().enumerate() {
            if peer != self.rank {
                let _ = tx.send(Message::Bye);
            }
        }
    }
}
