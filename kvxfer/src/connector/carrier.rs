//! How a connector shell reaches its peers: the one interface between the connector's
//! protocol shell (`producer`, `consumer`) and what carries its messages and blocks. Two
//! carriers implement it: the agent's (`over_agent`: notifications on the connector's
//! queues, transfers over UCX and kvxfer's lanes, across processes and hosts) and the
//! in-process one (`in_process`: a hub of named ends, memcpy on a mover thread).
//!
//! Like quinn's `ConnectionDriver` over `quinn-proto`: the protocol decisions are the pure
//! cores' ([`kvxfer_proto::connector`]), the threads, locks and budget the shell's, and every
//! byte that leaves the shell goes through a [`Carrier`].
#![forbid(unsafe_code)]

use std::fmt::Debug;
use std::net::SocketAddr;
use std::time::Duration;

use kvxfer_proto::error::Result;
use kvxfer_proto::handoff_seal::HandoffKey;
use kvxfer_proto::layout::KvLayout;
use kvxfer_proto::tp::HeadMap;
use kvxfer_proto::wire::connector::{Grant, Handoff};
use kvxfer_proto::wire::notify::Notification;

/// Which side of the connector a carrier serves: it receives that side's control messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Role {
    /// The prefill side: receives `ToProducer` messages.
    Producer,
    /// The decode side: receives `ToConsumer` messages.
    Consumer,
}

/// One layer's blocks to move between this end's cache and a peer's, as the shell planned
/// them: `local_blocks` of `local` pair in order with `remote_blocks` of `remote`, the heads
/// `heads.remote` of the remote cache with `heads.local` of the local one.
#[derive(Debug)]
pub(crate) struct LayerMove<'a> {
    pub(crate) local: &'a KvLayout,
    pub(crate) local_blocks: &'a [u32],
    pub(crate) remote: &'a KvLayout,
    pub(crate) remote_blocks: &'a [u32],
    pub(crate) heads: &'a HeadMap,
    pub(crate) layer: usize,
}

/// What one finished move did.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Moved {
    pub(crate) bytes: u64,
    pub(crate) descs: u64,
    /// Until its last operation was posted.
    pub(crate) post: Duration,
}

/// A move in flight. Dropping it leaves it to complete on its own; [`InFlight::cancel`]
/// returns only once nothing of it touches either cache any more.
pub(crate) trait InFlight: Send {
    /// It has completed (successfully or not); [`InFlight::wait`] will not block.
    fn is_done(&self) -> bool;
    /// Waits for it; what it moved.
    fn wait(self: Box<Self>) -> Result<Moved>;
    /// Stops it and waits until nothing of it runs.
    fn cancel(self: Box<Self>);
}

/// How one end of the connector (a producer or a consumer) sends control messages, receives
/// its own, reaches a producer named by a handoff, and moves one layer's blocks.
pub(crate) trait Carrier: Send + Sync + Debug {
    /// The name peers know this end by (a handoff's `producer`, a message's sender).
    fn name(&self) -> &str;

    /// This end's incarnation (0 where incarnations are not tracked).
    fn epoch(&self) -> u64;

    /// Where a consumer that has not met this end reaches it, put into handoffs.
    fn side_channel(&self) -> Option<SocketAddr>;

    /// The key that seals this end's handoffs and checks the ones it loads: the
    /// deployment's secret's (`None`: no secret, handoffs are not sealed).
    fn handoff_key(&self) -> Option<HandoffKey>;

    /// This end's cache (`layout`) opens to peers only inside grants (`on`), or as before
    /// (`false`, undoing one `true`).
    fn restrict(&self, layout: &KvLayout, on: bool);

    /// `peer` may read (`write`: write) `blocks` of every layer of this end's cache
    /// (`layout`), under `grant`, until [`Carrier::revoke`]; an error (the budget holds no
    /// room for it) opens nothing.
    fn grant(
        &self,
        grant: Grant,
        peer: &str,
        write: bool,
        layout: &KvLayout,
        blocks: &[u32],
    ) -> Result<()>;

    /// Ends what `grant` opened.
    fn revoke(&self, grant: &Grant);

    /// Sends an encoded control message to `to`. `false` only when `to` is known to be gone
    /// (a carrier that cannot tell logs the failure and leaves it to the lease).
    fn send(&self, to: &str, msg: &[u8]) -> bool;

    /// The next control message to this end, waiting up to `wait` for one.
    fn recv(&self, wait: Duration) -> Option<Notification>;

    /// The next control message to this end if one is queued.
    fn try_recv(&self) -> Option<Notification>;

    /// Makes the producer of `h` reachable (meets it through its side channel if need be).
    fn reach(&self, h: &Handoff) -> Result<()>;

    /// The incarnation of `peer` as known now; `None` when it is not known at all.
    fn peer_epoch(&self, peer: &str) -> Option<u64>;

    /// Reads one layer from `producer` into this end's cache, bounded by `within`.
    fn read(
        &self,
        producer: &str,
        m: &LayerMove<'_>,
        within: Duration,
    ) -> Result<Box<dyn InFlight>>;

    /// Writes one layer of this end's cache into `reader`'s; `note` reaches `reader` after
    /// the data has landed.
    fn write(
        &self,
        reader: &str,
        m: &LayerMove<'_>,
        note: &[u8],
        within: Duration,
    ) -> Result<Box<dyn InFlight>>;

    /// Drops what `peer` has queued to write into this end; how many streams were fenced.
    fn fence(&self, peer: &str) -> usize;

    /// The shell has stopped: peers no longer reach this end and no move touches its cache
    /// once this returns. Called once, after the shell's thread has ended.
    fn close(&self);
}
