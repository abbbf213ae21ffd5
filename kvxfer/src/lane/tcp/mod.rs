//! The TCP stream lane: `writev`/`readv` straight from and into registered blocks, a
//! transfer of 16 MiB or more striped over several connections, READ served by the target
//! pushing the blocks. The wire format (hello with fence epochs, framed requests, paged
//! tables, compressed frames) and its pure protocol cores are in `kvxfer_proto::wire::lane`
//! and `kvxfer_proto::lane`; this directory is the I/O shell: `link` (the initiator's queue
//! and its connections, `dial`), `admission` (a connection at the target's gate until its
//! hello proved the lane secret), `server` (the target: one place where a request is admitted,
//! checked against the registered regions and pinned), `stream`/`framed`/`mixed` (moving the
//! bytes; `window`: through a window shared with a same-host peer), `epochs` (fence counts), `identities` (which static key may name which peer on a
//! sealed lane), `settings` (striping and compression), and `lane` (the lane as the agent
//! holds it).
//!
//! The target checks every segment against its own registered regions and pins them while
//! it reads into them or sends from them (deregistering fails with `Busy` meanwhile). A
//! refused write is drained so that the stream stays in step. Notifications are delivered on
//! the target after the data (write) or after the data left (read).

mod admission;
mod conn;
mod dial;
pub(crate) mod epochs;
mod framed;
pub(crate) mod identities;
pub(crate) mod lane;
pub(crate) mod link;
pub(crate) mod liveness;
mod mixed;
pub(crate) mod server;
pub(crate) mod settings;
mod shares;
mod stream;
mod window;
