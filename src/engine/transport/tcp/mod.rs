//! [`Links`] between processes over TCP, and the failure board they carry.
//!
//! Each rank binds a [`Listener`] first, publishes its addresses through whatever the job
//! already shares (torch.distributed's store, in the Python package), then [`TcpLinks::connect`]
//! joins the others: every pair of ranks ([`Shape::Mesh`], for the CPU transport's data), or
//! every rank with rank 0 ([`Shape::Star`], beside NCCL, for failures only: rank 0 passes a
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
pub enum Shape {
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
        let ip: IpAddr = match crate::env::link_addr()? {
            Some(a) => a,
            None if reach == Reach::OneHost => IpAddr::V4(Ipv4Addr::LOCALHOST),
            None => {
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
        shape: Shape,
        timeout: Duration,
    ) -> Result<TcpLinks> {
        if rank >= world || addresses.len() != world {
            return Err(Error::Transport(format!(
                "rank {rank} of {world} with {} addresses",
                addresses.len()
            )));
        }
        let linked = |a: usize, b: usize| match shape {
            Shape::Mesh => a != b,
            Shape::Star => a != b && (a == 0 || b == 0),
        };
        let deadline = Instant::now() + timeout;
        let mut streams: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
        // Higher ranks dial in, lower ranks are dialled: the higher ones are admitted by a
        // thread of their own meanwhile, so no two ranks wait on each other.
        let waiting: Vec<bool> = (0..world).map(|p| p > rank && linked(rank, p)).collect();
        let mut unlinked = waiting.iter().filter(|&&w| w).count();
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
            while unlinked > 0 {
                let left = deadline.saturating_duration_since(Instant::now());
                match rx.recv_timeout(left) {
                    Ok((peer, s)) => {
                        streams[peer] = Some(s);
                        unlinked -= 1;
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
                    relay: shape == Shape::Star && rank == 0,
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
pub(crate) mod tests;
