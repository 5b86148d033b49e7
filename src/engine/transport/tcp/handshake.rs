//! Admitting a TCP connection as one of an engine's links: both ends prove that they hold the
//! engine's secret, and say which ranks of which engine they are.
//!
//! The secret (at least 128 random bits, made by one rank and shared through the job's store)
//! never crosses a link. The rank that dials sends a hello: the engine, the world, its rank and
//! the rank it dials, and a fresh nonce. The rank that accepts checks that the hello names this
//! engine, this world, itself and a rank it still waits for, then answers with a nonce of its
//! own and an HMAC-SHA256 over the hello and both nonces. The dialer checks that tag (the
//! answer comes from a holder of the secret, as the rank it dialled) and sends its own tag,
//! under another label, which the acceptor checks. Fresh nonces on both sides keep a recorded
//! handshake from being replayed, and the labels keep one side's tag from serving as the
//! other's. A connection that fails any check is dropped; it never becomes a link.

use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::io::{Read, Write};

use crate::error::{Error, Result};

const HELLO_MAGIC: [u8; 4] = *b"cfcH";
const REPLY_MAGIC: [u8; 4] = *b"cfcR";
/// The handshake's version: bumped whenever its layout changes.
const VERSION: u8 = 1;
const NONCE_LEN: usize = 16;
const TAG_LEN: usize = 32;
/// Bytes of a hello: magic, version (and 3 zero bytes), engine, world, from, to, nonce.
pub(crate) const HELLO_LEN: usize = 4 + 4 + 8 + 4 + 4 + 4 + NONCE_LEN;
/// Bytes of the acceptor's answer: magic, its nonce, its tag.
const REPLY_LEN: usize = 4 + NONCE_LEN + TAG_LEN;
const ACCEPTOR: &[u8] = b"cfc link: acceptor";
const DIALER: &[u8] = b"cfc link: dialer";

/// The smallest and largest secrets an engine takes, in bytes.
pub const SECRET_MIN: usize = 16;
/// See [`SECRET_MIN`].
pub const SECRET_MAX: usize = 64;

/// What a rank proves its links with: the engine's secret, and the engine's number.
#[derive(Clone)]
pub struct Credentials {
    secret: Vec<u8>,
    engine: u64,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // (never the secret)
        f.debug_struct("Credentials")
            .field("engine", &self.engine)
            .finish_non_exhaustive()
    }
}

impl Credentials {
    /// The credentials of engine `engine` (the same number on every rank) with `secret` (the
    /// same random bytes on every rank, [`SECRET_MIN`] to [`SECRET_MAX`] of them).
    ///
    /// # Errors
    /// [`Error::Transport`] for a secret of another length.
    pub fn new(secret: &[u8], engine: u64) -> Result<Credentials> {
        if !(SECRET_MIN..=SECRET_MAX).contains(&secret.len()) {
            return Err(Error::Transport(format!(
                "an engine's secret has {SECRET_MIN} to {SECRET_MAX} bytes, got {}",
                secret.len()
            )));
        }
        Ok(Credentials {
            secret: secret.to_vec(),
            engine,
        })
    }

    fn tag(&self, label: &[u8], hello: &[u8], nonce: &[u8]) -> Hmac<Sha256> {
        // (HMAC takes a key of any length: this cannot fail)
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&self.secret)
            .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
        m.update(label);
        m.update(hello);
        m.update(nonce);
        m
    }
}

/// Fresh random bytes from the operating system.
fn nonce() -> std::result::Result<[u8; NONCE_LEN], String> {
    let mut n = [0u8; NONCE_LEN];
    getrandom::getrandom(&mut n).map_err(|e| format!("no random bytes from the system: {e}"))?;
    Ok(n)
}

/// A dialler's hello, as read by the acceptor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Hello {
    pub engine: u64,
    pub world: u32,
    pub from: u32,
    pub to: u32,
    pub nonce: [u8; NONCE_LEN],
}

impl Hello {
    fn bytes(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[..4].copy_from_slice(&HELLO_MAGIC);
        b[4] = VERSION;
        b[8..16].copy_from_slice(&self.engine.to_le_bytes());
        b[16..20].copy_from_slice(&self.world.to_le_bytes());
        b[20..24].copy_from_slice(&self.from.to_le_bytes());
        b[24..28].copy_from_slice(&self.to.to_le_bytes());
        b[28..].copy_from_slice(&self.nonce);
        b
    }

    /// A hello from the wire; `Err` says what is wrong with it.
    pub(crate) fn parse(b: &[u8; HELLO_LEN]) -> std::result::Result<Hello, String> {
        if b[..4] != HELLO_MAGIC {
            return Err("it is not a cfc link (no hello)".into());
        }
        if b[4] != VERSION || b[5..8] != [0, 0, 0] {
            return Err(format!(
                "a hello of version {} (this cfc speaks {VERSION})",
                b[4]
            ));
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let mut engine = [0u8; 8];
        engine.copy_from_slice(&b[8..16]);
        let mut nonce = [0u8; NONCE_LEN];
        nonce.copy_from_slice(&b[28..]);
        Ok(Hello {
            engine: u64::from_le_bytes(engine),
            world: u32_at(16),
            from: u32_at(20),
            to: u32_at(24),
            nonce,
        })
    }
}

fn io(what: &str) -> impl Fn(std::io::Error) -> String + '_ {
    move |e| format!("{what}: {e}")
}

/// The dialling side over `s`, a connection to rank `to`: proves that this rank (`from` of
/// `world`) holds the secret, and checks that the other end does and is rank `to`.
pub(crate) fn dial_side<S: Read + Write>(
    s: &mut S,
    cred: &Credentials,
    from: usize,
    to: usize,
    world: usize,
) -> std::result::Result<(), String> {
    let hello = Hello {
        engine: cred.engine,
        world: world as u32,
        from: from as u32,
        to: to as u32,
        nonce: nonce()?,
    }
    .bytes();
    s.write_all(&hello).map_err(io("sending the hello"))?;
    let mut reply = [0u8; REPLY_LEN];
    s.read_exact(&mut reply)
        .map_err(io("no answer to the hello"))?;
    if reply[..4] != REPLY_MAGIC {
        return Err("the answer is not a cfc link's".into());
    }
    let (their_nonce, their_tag) = reply[4..].split_at(NONCE_LEN);
    cred.tag(ACCEPTOR, &hello, their_nonce)
        .verify_slice(their_tag)
        .map_err(|_| {
            "the answer does not prove this engine's secret (another engine or job, or a \
             stranger, listens at that address)"
                .to_string()
        })?;
    let proof = cred
        .tag(DIALER, &hello, their_nonce)
        .finalize()
        .into_bytes();
    s.write_all(&proof).map_err(io("sending the proof"))?;
    s.flush().map_err(io("sending the proof"))
}

/// The accepting side over `s`, for rank `rank` of `world`: the rank the dialler proved to be,
/// one for which `wanted` holds. `Err` says why the connection is not a link.
pub(crate) fn accept_side<S: Read + Write>(
    s: &mut S,
    cred: &Credentials,
    rank: usize,
    world: usize,
    wanted: impl Fn(usize) -> bool,
) -> std::result::Result<usize, String> {
    let mut hello = [0u8; HELLO_LEN];
    s.read_exact(&mut hello).map_err(io("no hello"))?;
    let h = Hello::parse(&hello)?;
    if h.engine != cred.engine || h.world as usize != world || h.to as usize != rank {
        return Err(format!(
            "a hello for engine {:#x}, rank {} of {} (this is engine {:#x}, rank {rank} of {world})",
            h.engine, h.to, h.world, cred.engine
        ));
    }
    let from = h.from as usize;
    if from >= world || from == rank || !wanted(from) {
        return Err(format!(
            "a hello from rank {from}, which this rank does not wait for"
        ));
    }
    let mine = nonce()?;
    let mut reply = [0u8; REPLY_LEN];
    reply[..4].copy_from_slice(&REPLY_MAGIC);
    reply[4..4 + NONCE_LEN].copy_from_slice(&mine);
    reply[4 + NONCE_LEN..]
        .copy_from_slice(&cred.tag(ACCEPTOR, &hello, &mine).finalize().into_bytes());
    s.write_all(&reply).map_err(io("answering the hello"))?;
    s.flush().map_err(io("answering the hello"))?;
    let mut proof = [0u8; TAG_LEN];
    s.read_exact(&mut proof).map_err(io("no proof"))?;
    cred.tag(DIALER, &hello, &mine)
        .verify_slice(&proof)
        .map_err(|_| format!("rank {from}'s proof does not hold this engine's secret"))?;
    Ok(from)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    /// Both ends in one thread: a byte pipe each way, run one step at a time.
    struct Pipe {
        input: Cursor<Vec<u8>>,
        output: Vec<u8>,
    }

    impl Read for Pipe {
        fn read(&mut self, b: &mut [u8]) -> std::io::Result<usize> {
            self.input.read(b)
        }
    }

    impl Write for Pipe {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.output.write(b)
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// Runs a handshake between a dialler with `dial` and an acceptor with `accept` over real
    /// sockets; (dialler's result, acceptor's result).
    fn run(
        dial: Credentials,
        accept: Credentials,
        from: usize,
    ) -> (
        std::result::Result<(), String>,
        std::result::Result<usize, String>,
    ) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let at = l.local_addr().unwrap();
        let d = std::thread::spawn(move || {
            let mut s = std::net::TcpStream::connect(at).unwrap();
            s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
                .unwrap();
            dial_side(&mut s, &dial, from, 0, 3)
        });
        let (mut s, _) = l.accept().unwrap();
        s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .unwrap();
        let a = accept_side(&mut s, &accept, 0, 3, |r| r != 2);
        drop(s);
        (d.join().unwrap(), a)
    }

    #[test]
    fn the_job_s_ranks_are_admitted_and_no_one_else() {
        let cred = Credentials::new(&[7; 32], 5).unwrap();
        assert_eq!(run(cred.clone(), cred.clone(), 1), (Ok(()), Ok(1)));
        // another secret: the dialler learns it at the answer, the acceptor at the proof
        let other = Credentials::new(&[8; 32], 5).unwrap();
        let (d, a) = run(other, cred.clone(), 1);
        assert!(d.unwrap_err().contains("does not prove"));
        assert!(a.is_err());
        // another engine, or a rank not waited for: refused before any tag is given
        let (_, a) = run(Credentials::new(&[7; 32], 6).unwrap(), cred.clone(), 1);
        assert!(a.unwrap_err().contains("engine 0x6"));
        let (_, a) = run(cred.clone(), cred, 2);
        assert!(a.unwrap_err().contains("does not wait for"));
    }

    #[test]
    fn a_recorded_proof_is_not_accepted_again() {
        let cred = Credentials::new(&[1; 16], 9).unwrap();
        // Record a dialler's hello and proof against one acceptor's answer...
        let hello = Hello {
            engine: 9,
            world: 2,
            from: 1,
            to: 0,
            nonce: [3; NONCE_LEN],
        }
        .bytes();
        let old_nonce = [4u8; NONCE_LEN];
        let old_proof = cred.tag(DIALER, &hello, &old_nonce).finalize().into_bytes();
        // ...and replay them: the acceptor's fresh nonce makes the old proof worthless.
        let mut wire = hello.to_vec();
        wire.extend_from_slice(&old_proof);
        let mut p = Pipe {
            input: Cursor::new(wire),
            output: Vec::new(),
        };
        let err = accept_side(&mut p, &cred, 0, 2, |_| true).unwrap_err();
        assert!(err.contains("proof does not hold"), "{err}");
        // An acceptor's tag is no dialler's proof (labels differ).
        let mine: [u8; NONCE_LEN] = p.output[4..4 + NONCE_LEN].try_into().unwrap();
        let reflected = cred.tag(ACCEPTOR, &hello, &mine).finalize().into_bytes();
        assert_ne!(
            reflected,
            cred.tag(DIALER, &hello, &mine).finalize().into_bytes()
        );
    }

    #[test]
    fn hellos_are_checked_and_secrets_sized() {
        let mut b = [0u8; HELLO_LEN];
        assert!(Hello::parse(&b).unwrap_err().contains("not a cfc link"));
        b[..4].copy_from_slice(&HELLO_MAGIC);
        b[4] = 99;
        assert!(Hello::parse(&b).unwrap_err().contains("version 99"));
        // the old handshake ("cfcL", a token, a rank) is no hello
        let mut old = [0u8; HELLO_LEN];
        old[..4].copy_from_slice(b"cfcL");
        assert!(Hello::parse(&old).is_err());
        assert!(Credentials::new(&[0; 15], 1).is_err());
        assert!(Credentials::new(&[0; 65], 1).is_err());
        assert!(!format!("{:?}", Credentials::new(&[0xab; 16], 1).unwrap()).contains("171"));
    }
}
