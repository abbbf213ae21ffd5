//! One TCP-lane request from the initiator's side, as a state machine with no I/O (the
//! target's side is [`crate::lane::LaneTarget`]): it checks the request's table against the
//! lane's limits, builds the bytes that open it (header and table, and a READ's
//! notification), says what the shell does next, and checks the target's reply against the
//! step it waits on. The shell moves the bytes and the data.
//!
//! ```text
//! WRITE: request | data ->      | notification ->  | <- ACK   | done
//! READ:  request + notification | <- DATA reply    | <- data  | done
//! ```

use crate::compress::planes::Transform;
use crate::lane::{LaneInitiator, ReplyError};
use crate::paged::Paged;
use crate::types::XferOp;
use crate::wire::lane::{
    encode_paged, paged_table_len, ReplyHeader, RequestHeader, Segment, HEADER_LEN, K_ACK, K_DATA,
    K_READ, K_WRITE, MAX_PAGED_TABLE, MAX_SEGS, SEG_LEN,
};

/// Where a request's data goes at the target: a flat list of segments, or a paged table.
#[derive(Clone, Copy, Debug)]
pub enum Table<'a> {
    /// One segment per piece.
    Segments(&'a [Segment]),
    /// Runs of blocks, the target's side of each.
    Paged(&'a [Paged]),
}

impl Table<'_> {
    /// Bytes of the table on the wire, or why the lane cannot take it.
    pub fn wire_len(&self) -> Result<usize, String> {
        match self {
            Table::Segments(s) if s.len() > MAX_SEGS => Err(format!(
                "{} operations in one transfer, the TCP lane takes {MAX_SEGS}",
                s.len()
            )),
            Table::Segments(s) => Ok(s.len() * SEG_LEN),
            Table::Paged(p) => match paged_table_len(p) {
                n if n > MAX_PAGED_TABLE => Err(format!(
                    "a paged table of {n} bytes, the TCP lane takes {MAX_PAGED_TABLE}"
                )),
                n => Ok(n),
            },
        }
    }
}

/// What the shell does next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Send the data (a WRITE's), then [`LaneRequest::advance`].
    SendData,
    /// Send the notification (a WRITE's, after its data), then [`LaneRequest::advance`].
    SendNote,
    /// Read a reply (its header, then its message) and pass it to [`LaneRequest::on_reply`].
    AwaitReply,
    /// Receive the data (a READ's), then [`LaneRequest::advance`].
    ReceiveData,
    /// The request is over.
    Done,
}

const WRITE: &[Step] = &[Step::SendData, Step::SendNote, Step::AwaitReply, Step::Done];
const READ: &[Step] = &[Step::AwaitReply, Step::ReceiveData, Step::Done];

/// One request in flight.
#[derive(Debug)]
pub struct LaneRequest {
    id: u64,
    steps: &'static [Step],
    at: usize,
}

impl LaneRequest {
    /// Request `id` for `op` over `table`, with the notification `note` and the data framed
    /// by `frames` (None: raw): the request and the bytes that open it, or why the lane
    /// cannot carry it.
    pub fn start(
        op: XferOp,
        id: u64,
        table: Table<'_>,
        note: &[u8],
        frames: Option<Transform>,
    ) -> Result<(LaneRequest, Vec<u8>), String> {
        let table_len = table.wire_len()?;
        let read = op == XferOp::Read;
        let mut b = Vec::with_capacity(HEADER_LEN + table_len + if read { note.len() } else { 0 });
        RequestHeader {
            kind: if read { K_READ } else { K_WRITE },
            id,
            nsegs: match table {
                Table::Segments(s) => s.len(),
                Table::Paged(_) => table_len,
            },
            notif_len: note.len(),
            frames,
            paged: matches!(table, Table::Paged(_)),
        }
        .encode(&mut b);
        match table {
            Table::Segments(s) => s.iter().for_each(|x| x.encode(&mut b)),
            Table::Paged(p) => encode_paged(p, &mut b),
        }
        if read {
            b.extend_from_slice(note);
        }
        let steps = if read { READ } else { WRITE };
        Ok((LaneRequest { id, steps, at: 0 }, b))
    }

    /// The step the shell is at.
    pub fn step(&self) -> Step {
        self.steps.get(self.at).copied().unwrap_or(Step::Done)
    }

    /// The shell finished a step that moves bytes ([`Step::SendData`], [`Step::SendNote`],
    /// [`Step::ReceiveData`]).
    pub fn advance(&mut self) {
        if matches!(
            self.step(),
            Step::SendData | Step::SendNote | Step::ReceiveData
        ) {
            self.at += 1;
        }
    }

    /// The reply the shell read at [`Step::AwaitReply`]: the next step, or why the request
    /// failed (the target refused it, or the stream is out of step).
    pub fn on_reply(&mut self, r: &ReplyHeader, msg: &[u8]) -> Result<Step, ReplyError> {
        let kind = if self.steps == READ { K_DATA } else { K_ACK };
        if self.step() != Step::AwaitReply {
            return Err(ReplyError::OutOfStep {
                got: (r.kind, r.id),
                expected: (0, self.id),
            });
        }
        LaneInitiator::reply(r, msg, kind, self.id)?;
        self.at += 1;
        Ok(self.step())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::RegionId;
    use crate::wire::lane::{parse_request_header, K_PAGED};

    fn reply(kind: u8, id: u64, status: u8) -> ReplyHeader {
        ReplyHeader {
            kind,
            id,
            status,
            msg_len: 0,
        }
    }

    #[test]
    fn a_write_sends_data_then_its_note_then_waits_for_its_ack() {
        let segs = [Segment {
            region: 3,
            offset: 64,
            len: 4096,
        }];
        let (mut r, b) =
            LaneRequest::start(XferOp::Write, 9, Table::Segments(&segs), b"hi", None).unwrap();
        let h = parse_request_header(b[..HEADER_LEN].try_into().unwrap()).unwrap();
        assert_eq!((h.kind, h.id, h.nsegs, h.notif_len), (K_WRITE, 9, 1, 2));
        assert_eq!(
            b.len(),
            HEADER_LEN + SEG_LEN,
            "a write's note follows its data"
        );
        assert_eq!(r.step(), Step::SendData);
        // A reply before the data is out of step.
        assert!(r.on_reply(&reply(K_ACK, 9, 0), b"").is_err());
        r.advance();
        assert_eq!(r.step(), Step::SendNote);
        r.advance();
        assert_eq!(r.step(), Step::AwaitReply);
        assert!(matches!(
            r.on_reply(&reply(K_ACK, 8, 0), b""),
            Err(ReplyError::OutOfStep { .. })
        ));
        assert_eq!(r.on_reply(&reply(K_ACK, 9, 0), b""), Ok(Step::Done));
        r.advance();
        assert_eq!(r.step(), Step::Done);
    }

    #[test]
    fn a_read_carries_its_note_and_waits_for_the_data_reply_first() {
        let p = [Paged {
            region: RegionId(1),
            offset: 0,
            block_len: 4096,
            stride: 4096,
            blocks: vec![0, 2, 5].into(),
        }];
        let (mut r, b) = LaneRequest::start(
            XferOp::Read,
            4,
            Table::Paged(&p),
            b"note",
            Some(Transform::Bf16),
        )
        .unwrap();
        assert_ne!(b[0] & K_PAGED, 0);
        let h = parse_request_header(b[..HEADER_LEN].try_into().unwrap()).unwrap();
        assert_eq!((h.kind, h.id, h.paged), (K_READ, 4, true));
        assert_eq!(b.len(), HEADER_LEN + paged_table_len(&p) + 4);
        assert!(b.ends_with(b"note"));
        assert_eq!(r.step(), Step::AwaitReply);
        r.advance();
        assert_eq!(r.step(), Step::AwaitReply, "advance does not skip a reply");
        let e = r
            .on_reply(&reply(K_DATA, 4, 1), b"no such region")
            .unwrap_err();
        assert_eq!(e, ReplyError::Refused("no such region".into()));
        assert_eq!(r.on_reply(&reply(K_DATA, 4, 0), b""), Ok(Step::ReceiveData));
        r.advance();
        assert_eq!(r.step(), Step::Done);
    }

    #[test]
    fn tables_past_the_lanes_limits_are_refused_before_any_byte() {
        let many = vec![
            Segment {
                region: 0,
                offset: 0,
                len: 1,
            };
            MAX_SEGS + 1
        ];
        let e = LaneRequest::start(XferOp::Write, 1, Table::Segments(&many), b"", None);
        assert!(e.unwrap_err().contains("operations"));
    }
}
