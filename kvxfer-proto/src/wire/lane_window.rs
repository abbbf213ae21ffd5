//! The TCP lane's shared window between two processes of one host: the blocks' bytes of a
//! sealed lane connection go through a memory file both map, not through the socket, while
//! every control byte stays sealed on the socket. The target makes the file (sealed, of
//! [`WINDOW_BYTES`]) and offers it after its welcome ([`WindowOffer`]): the name of a Unix
//! socket of its process and a one-time ticket, both only in sealed records, so only the
//! initiator whose session proved its key learns them. The initiator takes the file from
//! that socket (the shm lane's hand-over: `SCM_RIGHTS`, `SO_PEERCRED`), checks it, and
//! answers [`ACK_MAPPED`] or [`ACK_DECLINED`]; declined, the data stays on the socket.
//!
//! The file holds two byte rings, one per direction ([`RING_TO_TARGET`],
//! [`RING_TO_INITIATOR`]). Each has a header of four words, on cache lines of their own: the
//! bytes its writer has put in so far (`produced`), a counter the writer bumps after each put
//! (`produced_seq`, what a waiting reader sleeps on), the bytes its reader has taken so far
//! (`consumed`) and the reader's counter (`consumed_seq`), each counter with a flag its
//! sleeper raises ([`PRODUCED_WAIT`], [`CONSUMED_WAIT`]). Counts only grow; the bytes at
//! count `n` lie at `n % RING_BYTES` of the ring's data. Each side keeps its own count and
//! believes the other's only as far as [`readable`] and [`writable`] allow: a peer that
//! writes a count out of step ends the connection and reaches no memory but the window's.

/// The window's header: both rings' counters.
pub const HEADER_BYTES: usize = 4096;
/// One ring's data.
pub const RING_BYTES: usize = 2 << 20;
/// The whole window: the header and two rings.
pub const WINDOW_BYTES: usize = HEADER_BYTES + 2 * RING_BYTES;
/// The ring the initiator writes and the target reads.
pub const RING_TO_TARGET: usize = 0;
/// The ring the target writes and the initiator reads.
pub const RING_TO_INITIATOR: usize = 1;
/// Offset of ring `r`'s header in the window.
pub const fn ring_header(r: usize) -> usize {
    r * 256
}
/// Offsets of a ring's four words from its header: `produced`, `produced_seq`, `consumed`,
/// `consumed_seq` (each on a cache line of its own).
pub const PRODUCED: usize = 0;
/// See [`PRODUCED`].
pub const PRODUCED_SEQ: usize = 64;
/// See [`PRODUCED`].
pub const CONSUMED: usize = 128;
/// See [`PRODUCED`].
pub const CONSUMED_SEQ: usize = 192;
/// Beside each counter, a flag its waiter raises before it sleeps (so that a writer or a
/// reader makes the wake-up call only when someone sleeps): `produced_seq`'s.
pub const PRODUCED_WAIT: usize = 68;
/// `consumed_seq`'s waiting flag.
pub const CONSUMED_WAIT: usize = 196;
/// Offset of ring `r`'s data in the window.
pub const fn ring_data(r: usize) -> usize {
    HEADER_BYTES + r * RING_BYTES
}

/// The initiator mapped the window: the data goes through it from now on.
pub const ACK_MAPPED: u8 = 1;
/// The initiator did not take the window: the data stays on the socket.
pub const ACK_DECLINED: u8 = 0;

/// Bytes of an offer on the wire: kind, socket name, ticket.
pub const OFFER_LEN: usize = 1 + 16 + 32;
const NONE: u8 = 0;
const WINDOW: u8 = 1;

/// What a target answers a hello in window mode, right after its welcome.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WindowOffer {
    /// No window (no budget for it, or no socket to hand it over): the data stays on the
    /// socket, and no answer is expected.
    None,
    /// A window, handed over once, to the first asker presenting `ticket`, by the abstract
    /// Unix socket named `socket` (as an shm lane's: [`super::lane_entries::ShmLaneInfo`]).
    Window {
        /// The socket's random name.
        socket: [u8; 16],
        /// The one-time ticket.
        ticket: [u8; 32],
    },
}

impl WindowOffer {
    /// The offer's bytes.
    pub fn encode(&self) -> [u8; OFFER_LEN] {
        let mut b = [0u8; OFFER_LEN];
        if let WindowOffer::Window { socket, ticket } = self {
            b[0] = WINDOW;
            b[1..17].copy_from_slice(socket);
            b[17..].copy_from_slice(ticket);
        }
        b
    }

    /// The offer from its bytes: a known kind, and nothing but zeros after "none".
    pub fn decode(b: &[u8; OFFER_LEN]) -> Result<WindowOffer, String> {
        match b[0] {
            NONE if b[1..].iter().all(|&x| x == 0) => Ok(WindowOffer::None),
            NONE => Err("a window offer of none with bytes after it".into()),
            WINDOW => {
                let mut socket = [0u8; 16];
                socket.copy_from_slice(&b[1..17]);
                let mut ticket = [0u8; 32];
                ticket.copy_from_slice(&b[17..]);
                Ok(WindowOffer::Window { socket, ticket })
            }
            k => Err(format!("a window offer of kind {k}")),
        }
    }
}

/// The initiator's answer to an offer of a window, checked: [`ACK_MAPPED`] or
/// [`ACK_DECLINED`].
pub fn decode_ack(b: u8) -> Result<bool, String> {
    match b {
        ACK_MAPPED => Ok(true),
        ACK_DECLINED => Ok(false),
        k => Err(format!("a window answer of {k}")),
    }
}

/// Bytes a ring's reader may take now: its writer's `produced` count (as the window shows
/// it), checked against the reader's own `consumed` count and the last `produced` it saw.
pub fn readable(produced: u64, consumed: u64, last_produced: u64) -> Result<u64, String> {
    if produced < last_produced {
        return Err(format!(
            "the window's writer count went back from {last_produced} to {produced}"
        ));
    }
    match produced.checked_sub(consumed) {
        Some(n) if n <= RING_BYTES as u64 => Ok(n),
        _ => Err(format!(
            "the window's writer count {produced} is out of step with {consumed} read"
        )),
    }
}

/// Bytes a ring's writer may put now: its reader's `consumed` count (as the window shows it),
/// checked against the writer's own `produced` count and the last `consumed` it saw.
pub fn writable(consumed: u64, produced: u64, last_consumed: u64) -> Result<u64, String> {
    if consumed < last_consumed || consumed > produced {
        return Err(format!(
            "the window's reader count {consumed} is out of step ({last_consumed} seen, \
             {produced} written)"
        ));
    }
    match (RING_BYTES as u64).checked_sub(produced - consumed) {
        Some(n) => Ok(n),
        None => Err(format!(
            "the window's reader count {consumed} is out of step with {produced} written"
        )),
    }
}

/// The run of ring positions that count `at` and `n` bytes after it cover, up to the ring's
/// end: (offset in the ring's data, bytes), `bytes <= n`.
pub fn run_at(at: u64, n: u64) -> (usize, usize) {
    let off = (at % RING_BYTES as u64) as usize;
    (off, n.min((RING_BYTES - off) as u64) as usize)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn offers_round_trip_and_garbage_is_refused() {
        for o in [
            WindowOffer::None,
            WindowOffer::Window {
                socket: [3; 16],
                ticket: [9; 32],
            },
        ] {
            assert_eq!(WindowOffer::decode(&o.encode()), Ok(o));
        }
        let mut b = [0u8; OFFER_LEN];
        b[0] = 2;
        assert!(WindowOffer::decode(&b).is_err());
        b[0] = 0;
        b[5] = 1;
        assert!(WindowOffer::decode(&b).is_err());
        assert_eq!(decode_ack(1), Ok(true));
        assert_eq!(decode_ack(0), Ok(false));
        assert!(decode_ack(7).is_err());
    }

    #[test]
    fn counts_out_of_step_are_refused() {
        let r = RING_BYTES as u64;
        assert_eq!(readable(10, 4, 8), Ok(6));
        assert!(readable(7, 4, 8).is_err(), "went back");
        assert!(readable(3, 4, 0).is_err(), "fewer written than read");
        assert!(readable(4 + r + 1, 4, 0).is_err(), "more than the ring");
        assert_eq!(readable(4 + r, 4, 0), Ok(r));
        assert_eq!(writable(4, 10, 2), Ok(r - 6));
        assert!(writable(1, 10, 2).is_err(), "went back");
        assert!(writable(11, 10, 2).is_err(), "more read than written");
        assert_eq!(writable(10, 10, 0), Ok(r));
        assert_eq!(run_at(r - 3, 10), (RING_BYTES - 3, 3));
        assert_eq!(run_at(2 * r + 5, 10), (5, 10));
    }

    proptest! {
        /// A writer and a reader that keep to the checks move every byte once, in order,
        /// through a ring of [`RING_BYTES`], however the puts and takes are cut.
        #[test]
        #[cfg_attr(miri, ignore = "millions of single-byte writes take hours under Miri")]
        fn a_checked_ring_moves_every_byte_in_order(
            puts in proptest::collection::vec(1u64..300_000, 1..40),
            takes in proptest::collection::vec(1u64..300_000, 1..40),
        ) {
            let mut ring = vec![0u8; RING_BYTES];
            let total: u64 = puts.iter().sum();
            let (mut produced, mut consumed) = (0u64, 0u64);
            let (mut p, mut t) = (puts.iter().cycle(), takes.iter().cycle());
            let mut out = Vec::new();
            while consumed < total {
                // Put what fits of the next put, in runs.
                let mut n = (*p.next().unwrap()).min(total - produced);
                n = n.min(writable(consumed, produced, 0).unwrap());
                while n > 0 {
                    let (off, k) = run_at(produced, n);
                    for i in 0..k {
                        ring[off + i] = ((produced + i as u64) % 251) as u8;
                    }
                    produced += k as u64;
                    n -= k as u64;
                }
                let mut m = (*t.next().unwrap()).min(readable(produced, consumed, 0).unwrap());
                while m > 0 {
                    let (off, k) = run_at(consumed, m);
                    out.extend_from_slice(&ring[off..off + k]);
                    consumed += k as u64;
                    m -= k as u64;
                }
            }
            prop_assert_eq!(out.len() as u64, total);
            prop_assert!(out.iter().enumerate().all(|(i, &b)| b == (i % 251) as u8));
        }
    }
}
