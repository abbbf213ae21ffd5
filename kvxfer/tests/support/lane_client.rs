//! Speaks the TCP lane's protocol by hand, for tests that send what a real initiator would
//! not: the hello with the target's secret (from its metadata), then requests and their
//! acknowledgements.
#![allow(dead_code, clippy::unwrap_used)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use kvxfer::Agent;
use kvxfer_proto::wire::lane::{
    encode_welcome, Hello, ReplyHeader, K_ACK, REPLY_FIXED_LEN, WELCOME_FIXED_LEN,
};
use kvxfer_proto::wire::metadata::{Metadata, DEFAULT_COMPAT};

/// A connection to `b`'s TCP lane that has said hello and been welcomed.
pub fn connect(b: &Agent) -> TcpStream {
    let meta = Metadata::decode(&b.metadata().unwrap(), DEFAULT_COMPAT).unwrap();
    let lane = meta.tcp_lane().unwrap();
    let mut c = TcpStream::connect(lane.addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    c.write_all(
        &Hello {
            name: "hand",
            secret: lane.secret,
            epoch: 0,
        }
        .encode(),
    )
    .unwrap();
    let mut w = [0u8; WELCOME_FIXED_LEN];
    c.read_exact(&mut w).unwrap();
    assert_eq!(w.to_vec(), encode_welcome(0, 0, ""), "welcome");
    c
}

/// Sends a whole write request (`request`: header, table, data, notification) and reads its
/// acknowledgement: its status and message.
pub fn write(c: &mut TcpStream, id: u64, request: &[u8]) -> (u8, String) {
    c.write_all(request).unwrap();
    let mut h = [0u8; REPLY_FIXED_LEN];
    c.read_exact(&mut h).unwrap();
    let r = ReplyHeader::read(&h);
    let mut msg = vec![0u8; r.msg_len];
    c.read_exact(&mut msg).unwrap();
    assert_eq!((r.kind, r.id), (K_ACK, id));
    (r.status, String::from_utf8_lossy(&msg).into_owned())
}
