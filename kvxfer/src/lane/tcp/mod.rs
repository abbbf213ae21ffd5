//! The TCP stream lane: one connection per (initiator, target) pair, zero-copy on both ends.
//! The messages and their codecs are in `kvxfer_proto::wire::lane`.
//!
//! ```text
//! hello    initiator → target  "KVXT" | version u16 | name_len u16 | name | secret [16]
//! welcome  target → initiator  status u8 | msg_len u16 | msg
//! request  initiator → target  kind u8 (1 write, 2 read) | id u64 | nsegs u32 | notif_len u32
//!                              | { region u32 | offset u64 | len u64 }*nsegs
//!                              | write: the data, then the notification
//!                              | read:  the notification
//! reply    target → initiator  kind u8 (3 ack, 4 data) | id u64 | status u8 | msg_len u16 | msg
//!                              | data (read, status 0): the requested bytes in order
//! ```
//!
//! The target checks every segment against its own registered regions and pins them while
//! it reads into them or sends from them (deregistering fails with `Busy` meanwhile). A
//! refused write is drained so that the stream stays in step. Notifications are delivered on
//! the target after the data (write) or after the data left (read).

mod dial;
pub(crate) mod epochs;
mod framed;
pub(crate) mod link;
mod mixed;
pub(crate) mod server;
mod stream;
