//! [`Links`] between processes over TCP, and the failure board they carry.
//!
//! Each rank binds a [`Listener`] first, publishes its addresses through whatever the job
//! already shares (torch.distributed's store, in the Python package), then [`TcpLinks::connect`]
//! joins the others: every pair of ranks ([`Topology::Mesh`], for the CPU transport's data), or
//! every rank with rank 0 ([`Topology::Star`], beside NCCL, for failures only: rank 0 passes a
//! failure on to the rest).
//!
//! Messages are framed as a kind byte and a length. A reader thread per peer hands data to the
//! receiver and raises failures on the board: a failure a peer reports, or a connection that
//! closes without the peer's goodbye, which is how a rank whose process died shows, at once and
//! over any interconnect.
//!
//! Addresses: `CFC_LINK_ADDR` (an IP of this host) when set, else the address this host uses
//! to reach `MASTER_ADDR`, the addresses its name resolves to, and the loopback address, tried
//! in that order by the peers.

use super::{closed, Links, BOARD_POLL};
use crate::engine::control::{Control, Failure, Tell};
use crate::error::{Error, Result};
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Which pairs of ranks are linked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Topology {
    /// Every pair: data between any two ranks.
    Mesh,
    /// Every rank with rank 0: failures only (rank 0 passes them on).
    Star,
}

const MAGIC: [u8; 4] = *b"cfcL";
const KIND_DATA: u8 = 0;
const KIND_FAILURE: u8 = 1;
const KIND_BYE: u8 = 2;
/// The largest message a peer may announce (a corrupt length is refused, not allocated).
const MESSAGE_MAX: u64 = 1 << 40;

/// A bound socket, not yet linked: bind it, publish [`Listener::addresses`], then connect.
#[derive(Debug)]
pub struct Listener {
    socket: TcpListener,
}

impl Listener {
    /// Binds a port on `CFC_LINK_ADDR` (when set) or every interface.
    ///
    /// # Errors
    /// [`Error::Transport`] when no port can be bound.
    pub fn bind() -> Result<Listener> {
        let ip: IpAddr = match std::env::var("CFC_LINK_ADDR") {
            Ok(a) => a
                .parse()
                .map_err(|_| Error::Transport(format!("CFC_LINK_ADDR={a} is not an IP address")))?,
            Err(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        };
        let socket = TcpListener::bind(SocketAddr::new(ip, 0))
            .map_err(|e| Error::Transport(format!("cannot bind a TCP port on {ip}: {e}")))?;
        Ok(Listener { socket })
    }

    /// The addresses peers may reach this rank at, best first (see the module docs).
    pub fn addresses(&self) -> Vec<String> {
        let port = self.socket.local_addr().map(|a| a.port()).unwrap_or(0);
        let mut ips: Vec<IpAddr> = Vec::new();
        if let Ok(a) = std::env::var("CFC_LINK_ADDR") {
            if let Ok(ip) = a.parse() {
                ips.push(ip);
            }
        } else {
            if let Ok(master) = std::env::var("MASTER_ADDR") {
                // The source address of a route to the master (no packet is sent).
                let routed = UdpSocket::bind("0.0.0.0:0").ok().and_then(|s| {
                    s.connect((master.as_str(), 9)).ok()?;
                    s.local_addr().ok()
                });
                if let Some(a) = routed {
                    ips.push(a.ip());
                }
            }
            if let Some(host) = hostname() {
                if let Ok(addrs) = (host.as_str(), port).to_socket_addrs() {
                    ips.extend(addrs.map(|a| a.ip()).filter(|ip| ip.is_ipv4()));
                }
            }
            ips.push(IpAddr::V4(Ipv4Addr::LOCALHOST));
        }
        let mut seen = Vec::new();
        for ip in ips {
            if !seen.contains(&ip) && !ip.is_unspecified() {
                seen.push(ip);
            }
        }
        // Loopback last: on one host every address works, across hosts only the others do.
        seen.sort_by_key(|ip| ip.is_loopback());
        seen.into_iter()
            .map(|ip| SocketAddr::new(ip, port).to_string())
            .collect()
    }
}

/// This host's name, from the kernel.
fn hostname() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

/// One peer's link: the writing half (shared with the board's `tell`).
struct Peer {
    writer: Mutex<TcpStream>,
}

impl Peer {
    fn write(&self, kind: u8, payload: &[u8]) -> std::io::Result<()> {
        let mut w = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        let mut head = [0u8; 9];
        head[0] = kind;
        head[1..].copy_from_slice(&(payload.len() as u64).to_le_bytes());
        w.write_all(&head)?;
        w.write_all(payload)?;
        w.flush()
    }
}

enum Message {
    Data(Vec<u8>),
    Bye,
}

/// One rank's links to the others; see the module docs.
pub struct TcpLinks {
    rank: usize,
    world: usize,
    peers: Arc<Vec<Option<Peer>>>,
    inbox: Vec<Option<Receiver<Message>>>,
    gone: Vec<bool>,
    control: Arc<Control>,
    closing: Arc<AtomicBool>,
    timeout: Duration,
}

impl std::fmt::Debug for TcpLinks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpLinks")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .finish()
    }
}

/// The failure frame's payload: the origin rank, its job, then the reason.
fn failure_payload(f: &Failure) -> Vec<u8> {
    let mut p = (f.rank as u64).to_le_bytes().to_vec();
    p.extend_from_slice(&f.at.to_le_bytes());
    p.extend_from_slice(f.reason.as_bytes());
    p
}

/// The failure of a `failure_payload` (at least 16 bytes), from `peer`.
fn parse_failure(payload: &[u8], peer: usize) -> Failure {
    let word = |i: usize| u64::from_le_bytes(payload[i..i + 8].try_into().unwrap_or([0; 8]));
    Failure {
        rank: usize::try_from(word(0)).unwrap_or(peer),
        reason: String::from_utf8_lossy(&payload[16..]).into_owned(),
        at: word(8),
    }
}

fn handshake_bytes(token: u64, rank: usize) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[..4].copy_from_slice(&MAGIC);
    b[4..12].copy_from_slice(&token.to_le_bytes());
    b[12..].copy_from_slice(&(rank as u32).to_le_bytes());
    b
}

/// The rank a handshake names, if it is one of this job's (`token`).
fn read_handshake(s: &mut TcpStream, token: u64) -> Result<usize> {
    let mut b = [0u8; 16];
    s.read_exact(&mut b)
        .map_err(|e| Error::Transport(format!("a link's handshake failed: {e}")))?;
    if b[..4] != MAGIC || b[4..12] != token.to_le_bytes() {
        return Err(Error::Transport(
            "a connection that is not one of this engine's links".into(),
        ));
    }
    Ok(u32::from_le_bytes([b[12], b[13], b[14], b[15]]) as usize)
}

/// Connects to `rank` at the first of its `addresses` that answers, within `deadline`.
fn dial(addresses: &[String], peer: usize, deadline: Instant) -> Result<TcpStream> {
    let mut last = String::from("no address was published");
    while Instant::now() < deadline {
        for a in addresses {
            let Ok(mut addrs) = a.to_socket_addrs() else {
                last = format!("{a} does not resolve");
                continue;
            };
            let Some(addr) = addrs.next() else { continue };
            match TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
                Ok(s) => return Ok(s),
                Err(e) => last = format!("{a}: {e}"),
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Err(Error::Transport(format!(
        "could not reach rank {peer} ({last}); set CFC_LINK_ADDR to an address of each host \
         that the others can reach"
    )))
}

impl TcpLinks {
    /// Links this rank (`rank` of `world`, bound to `listener`) with its peers, whose published
    /// addresses are `addresses[j]` (this rank's own entry is not read), for one engine
    /// (`token`: the same on every rank, unique to the engine). Waits at most `timeout` for
    /// the peers; a later receive waits at most `timeout` too.
    ///
    /// # Errors
    /// [`Error::Transport`] when a peer cannot be reached or answers wrongly.
    pub fn connect(
        listener: Listener,
        rank: usize,
        world: usize,
        addresses: &[Vec<String>],
        token: u64,
        topology: Topology,
        timeout: Duration,
    ) -> Result<TcpLinks> {
        if rank >= world || addresses.len() != world {
            return Err(Error::Transport(format!(
                "rank {rank} of {world} with {} addresses",
                addresses.len()
            )));
        }
        let linked = |a: usize, b: usize| match topology {
            Topology::Mesh => a != b,
            Topology::Star => a != b && (a == 0 || b == 0),
        };
        let deadline = Instant::now() + timeout;
        let mut streams: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
        // Lower ranks are dialled, higher ranks dial in: no two ranks wait on each other.
        for peer in (0..rank).filter(|&p| linked(rank, p)) {
            let mut s = dial(&addresses[peer], peer, deadline)?;
            s.set_read_timeout(Some(timeout))
                .and_then(|_| s.write_all(&handshake_bytes(token, rank)))
                .map_err(|e| Error::Transport(format!("rank {peer}: {e}")))?;
            if read_handshake(&mut s, token)? != peer {
                return Err(Error::Transport(format!(
                    "the address of rank {peer} answered as another rank"
                )));
            }
            streams[peer] = Some(s);
        }
        let mut expected: Vec<usize> = (rank + 1..world).filter(|&p| linked(rank, p)).collect();
        listener
            .socket
            .set_nonblocking(true)
            .map_err(|e| Error::Transport(e.to_string()))?;
        while !expected.is_empty() {
            match listener.socket.accept() {
                Ok((mut s, _)) => {
                    let _ = s.set_nonblocking(false);
                    let _ = s.set_read_timeout(Some(timeout));
                    // A stray connection (a port scan, another job) is dropped, not fatal.
                    let Ok(peer) = read_handshake(&mut s, token) else {
                        continue;
                    };
                    if let Some(at) = expected.iter().position(|&p| p == peer) {
                        s.write_all(&handshake_bytes(token, rank))
                            .map_err(|e| Error::Transport(format!("rank {peer}: {e}")))?;
                        expected.swap_remove(at);
                        streams[peer] = Some(s);
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() > deadline {
                        return Err(Error::Transport(format!(
                            "ranks {expected:?} did not connect within {:.0} s",
                            timeout.as_secs_f64()
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(e) => return Err(Error::Transport(format!("accepting a link: {e}"))),
            }
        }
        let control = Control::new();
        let closing = Arc::new(AtomicBool::new(false));
        let mut readers = Vec::with_capacity(world);
        let mut inbox = Vec::with_capacity(world);
        let mut peers = Vec::with_capacity(world);
        for s in streams {
            match s {
                Some(s) => {
                    let _ = s.set_nodelay(true);
                    let _ = s.set_read_timeout(None);
                    // A peer that stops reading (a stopped process) fails a write after the
                    // timeout instead of blocking this rank, and its board's `tell`, for good.
                    let _ = s.set_write_timeout(Some(timeout));
                    let reader = s
                        .try_clone()
                        .map_err(|e| Error::Transport(format!("a link: {e}")))?;
                    let (tx, rx) = crossbeam_channel::unbounded();
                    readers.push(Some((reader, tx)));
                    inbox.push(Some(rx));
                    peers.push(Some(Peer {
                        writer: Mutex::new(s),
                    }));
                }
                None => {
                    readers.push(None);
                    inbox.push(None);
                    peers.push(None);
                }
            }
        }
        let peers = Arc::new(peers);
        // A failure raised here goes to every linked peer (rank 0 of a star passes it on).
        let tell_peers = peers.clone();
        let tell: Tell = Box::new(move |f: &Failure| {
            let payload = failure_payload(f);
            for p in tell_peers.iter().flatten() {
                let _ = p.write(KIND_FAILURE, &payload);
            }
        });
        control.set_tell(tell);
        for (peer, r) in readers.into_iter().enumerate() {
            if let Some((stream, tx)) = r {
                let ctx = ReaderContext {
                    peer,
                    relay: topology == Topology::Star && rank == 0,
                    peers: peers.clone(),
                    control: control.clone(),
                    closing: closing.clone(),
                };
                std::thread::Builder::new()
                    .name(format!("cfc-link-{peer}"))
                    .spawn(move || ctx.run(stream, tx))
                    .map_err(|e| Error::Transport(format!("cannot start a link thread: {e}")))?;
            }
        }
        Ok(TcpLinks {
            rank,
            world,
            peers,
            inbox,
            gone: vec![false; world],
            control,
            closing,
            timeout,
        })
    }
}

/// What a reader thread needs.
struct ReaderContext {
    peer: usize,
    /// Rank 0 of a star: failures from one peer go on to the others.
    relay: bool,
    peers: Arc<Vec<Option<Peer>>>,
    control: Arc<Control>,
    closing: Arc<AtomicBool>,
}

impl ReaderContext {
    fn run(self, mut s: TcpStream, tx: Sender<Message>) {
        let why = loop {
            let mut head = [0u8; 9];
            if let Err(e) = s.read_exact(&mut head) {
                break format!("its connection closed without a goodbye ({e}): the process ended or the link broke");
            }
            let len = u64::from_le_bytes(head[1..].try_into().unwrap_or([0; 8]));
            if len > MESSAGE_MAX {
                break format!("it sent a message of {len} bytes, past any this engine sends");
            }
            let mut payload = Vec::new();
            if payload.try_reserve_exact(len as usize).is_err() {
                break format!("no memory for its message of {len} bytes");
            }
            payload.resize(len as usize, 0);
            if let Err(e) = s.read_exact(&mut payload) {
                break format!("its connection closed in the middle of a message ({e})");
            }
            match head[0] {
                KIND_DATA => {
                    if tx.send(Message::Data(payload)).is_err() {
                        return; // the links were dropped
                    }
                }
                KIND_FAILURE if payload.len() >= 16 => {
                    self.raise(parse_failure(&payload, self.peer));
                }
                KIND_BYE => {
                    // A goodbye carries the failure the peer knew of, if any: raised here
                    // before the goodbye is seen, so that a rank waiting on this peer reports
                    // that failure (named by the rank where it began) and not the goodbye,
                    // whichever link brought the failure first.
                    if payload.len() >= 16 {
                        self.raise(parse_failure(&payload, self.peer));
                    }
                    let _ = tx.send(Message::Bye);
                    return;
                }
                k => break format!("it sent a message of unknown kind {k}"),
            }
        };
        if !self.closing.load(Ordering::SeqCst) {
            self.raise(Failure {
                rank: self.peer,
                reason: why,
                at: 0,
            });
        }
    }

    fn raise(&self, f: Failure) {
        if self.control.raise(f.clone(), false) && self.relay {
            let payload = failure_payload(&f);
            for (j, p) in self.peers.iter().enumerate() {
                if let (Some(p), true) = (p, j != self.peer) {
                    let _ = p.write(KIND_FAILURE, &payload);
                }
            }
        }
    }
}

impl Links for TcpLinks {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn control(&self) -> &Arc<Control> {
        &self.control
    }

    fn send(&mut self, peer: usize, data: &[u8]) -> Result<()> {
        self.control.check()?;
        let p = self
            .peers
            .get(peer)
            .and_then(|p| p.as_ref())
            .ok_or_else(|| {
                Error::Transport(format!("rank {} has no link to rank {peer}", self.rank))
            })?;
        p.write(KIND_DATA, data)
            .map_err(|e| Error::Transport(format!("sending to rank {peer}: {e}")))
    }

    fn recv(&mut self, peer: usize) -> Result<Vec<u8>> {
        let rx = self
            .inbox
            .get(peer)
            .and_then(|r| r.as_ref())
            .ok_or_else(|| {
                Error::Transport(format!("rank {} has no link to rank {peer}", self.rank))
            })?;
        let t0 = Instant::now();
        loop {
            if self.gone[peer] {
                return Err(closed(&self.control, peer));
            }
            // What arrived before a failure was raised is still taken (see `LocalLinks::recv`).
            match rx.recv_timeout(BOARD_POLL) {
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
                // The reader ended (it raised why on the board): nothing more can come.
                Err(RecvTimeoutError::Disconnected) => {
                    self.control.check()?;
                    return Err(match self.control.failure() {
                        Some(f) => f.error(),
                        None => Error::Transport(format!("the link to rank {peer} closed")),
                    });
                }
            }
        }
    }

    fn close(&mut self) {
        if self.closing.swap(true, Ordering::SeqCst) {
            return;
        }
        // (with the failure this rank knows of: see the reader's KIND_BYE)
        let bye = self
            .control
            .failure()
            .map(|f| failure_payload(&f))
            .unwrap_or_default();
        for p in self.peers.iter().flatten() {
            let _ = p.write(KIND_BYE, &bye);
        }
        for p in self.peers.iter().flatten() {
            let w = p.writer.lock().unwrap_or_else(|e| e.into_inner());
            let _ = w.shutdown(std::net::Shutdown::Write);
        }
    }
}

impl Drop for TcpLinks {
    fn drop(&mut self) {
        self.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::transport::host;

    /// Links for `world` ranks of this process over loopback.
    pub(crate) fn loopback(world: usize, topology: Topology) -> Vec<TcpLinks> {
        let listeners: Vec<Listener> = (0..world).map(|_| Listener::bind().unwrap()).collect();
        let addresses: Vec<Vec<String>> = listeners.iter().map(|l| l.addresses()).collect();
        std::thread::scope(|s| {
            let handles: Vec<_> = listeners
                .into_iter()
                .enumerate()
                .map(|(rank, l)| {
                    let addresses = &addresses;
                    s.spawn(move || {
                        TcpLinks::connect(
                            l,
                            rank,
                            world,
                            addresses,
                            42,
                            topology,
                            Duration::from_secs(20),
                        )
                        .unwrap()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn a_mesh_carries_data_and_a_closed_peer_is_no_failure() {
        let links = loopback(3, Topology::Mesh);
        let out: Vec<Vec<u8>> = std::thread::scope(|s| {
            let hs: Vec<_> = links
                .into_iter()
                .map(|mut l| {
                    s.spawn(move || {
                        let mut all = vec![0u8; 3];
                        let mine = [l.rank() as u8 + 1];
                        host::all_gather(&mut l, &mine, &mut all).unwrap();
                        l.close();
                        all
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(out.iter().all(|a| a == &[1, 2, 3]));
    }

    #[test]
    fn a_star_tells_every_rank_of_a_failure_and_of_a_dead_peer() {
        let links = loopback(3, Topology::Star);
        links[2].control().raise(
            Failure {
                rank: 2,
                reason: "boom".into(),
                at: 0,
            },
            true,
        );
        for l in &links[..2] {
            let t0 = Instant::now();
            while l.control().failure().is_none() && t0.elapsed() < Duration::from_secs(5) {
                std::thread::sleep(Duration::from_millis(1));
            }
            assert_eq!(
                l.control().failure().map(|f| (f.rank, f.reason)),
                Some((2, "boom".into()))
            );
        }
        // A peer that goes away without a goodbye (its process died) is a failure too.
        let mut links = loopback(2, Topology::Star);
        let dead = links.pop().unwrap();
        dead.closing.store(true, Ordering::SeqCst); // no goodbye on drop
        for p in dead.peers.iter().flatten() {
            let _ = p.writer.lock().unwrap().shutdown(std::net::Shutdown::Both);
        }
        let t0 = Instant::now();
        while links[0].control().failure().is_none() && t0.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(links[0].control().failure().map(|f| f.rank), Some(1));
        let err = links[0].recv(1).unwrap_err();
        assert!(matches!(err, Error::PeerFailed { rank: 1, .. }), "{err}");
    }

    /// A peer that closes its engine after a failure it knows of (raised by a third rank, whose
    /// own message may come later) says so in its goodbye: a rank waiting on it reports that
    /// failure, named by the rank where it began, not the goodbye.
    #[test]
    fn a_goodbye_carries_the_failure_its_rank_knew_of() {
        let mut links = loopback(3, Topology::Mesh);
        let failure = Failure {
            rank: 2,
            reason: "boom".into(),
            at: 0,
        };
        links[1].control().raise(failure, false); // (known to rank 1 only)
        links[1].close();
        let err = links[0].recv(1).unwrap_err();
        assert!(
            matches!(&err, Error::PeerFailed { rank: 2, reason } if reason == "boom"),
            "{err}"
        );
        // Without a failure, a goodbye mid-exchange is just that.
        let mut links = loopback(2, Topology::Mesh);
        links[1].close();
        let err = links[0].recv(1).unwrap_err();
        assert!(
            err.to_string().contains("rank 1 closed its engine"),
            "{err}"
        );
    }
}
