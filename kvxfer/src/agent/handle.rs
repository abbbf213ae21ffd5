//! The agent's handle: what a user holds. Its methods are split by concern over the
//! directory (`mod.rs`: creating, registering, meeting peers; `submit.rs`, `paged.rs`:
//! starting transfers); the state its threads share is `state.rs`.
#![forbid(unsafe_code)]

use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use super::state::AgentState;
use crate::listener::Listener;

/// One kvxfer agent: one per worker process (or GPU rank). See the module docs for the order
/// of calls.
///
/// Two agents over TCP: the decode side READs what the prefill side registered.
///
/// ```
/// use kvxfer::{Agent, AgentConfig, Desc, HostBuffer, Transport};
/// # fn main() -> kvxfer::Result<()> {
/// let cfg = |name: &str| AgentConfig::new(name).transport(Transport::Tcp).net_devices("lo");
/// let prefill = Agent::new(cfg("doc-prefill"))?;
/// let decode = Agent::new(cfg("doc-decode"))?;
/// let kv = prefill.register(HostBuffer::new(64 << 10)?)?;
/// kv.write(0, &[7; 4096])?;
/// let cache = decode.register(HostBuffer::new(64 << 10)?)?;
/// let peer = decode.connect(prefill.listen("127.0.0.1:0")?)?;
/// assert_eq!(peer, "doc-prefill");
/// let local = decode.prep_local(&[Desc::new(cache.id(), 8192, 4096)])?;
/// let remote = decode.prep_remote(&peer, &[Desc::new(kv.id(), 0, 4096)])?;
/// let stats = decode.read(&local, &remote).start()?.wait()?;
/// assert_eq!(stats.bytes, 4096);
/// let mut got = [0u8; 4096];
/// cache.read(8192, &mut got)?;
/// assert!(got.iter().all(|&b| b == 7));
/// # Ok(()) }
/// ```
pub struct Agent {
    pub(crate) shared: Arc<AgentState>,
    pub(super) thread: Option<JoinHandle<()>>,
    pub(super) strict: bool,
    pub(super) listeners: Mutex<Vec<Listener>>,
    pub(super) _live: crate::live::Counted,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("name", &self.shared.name)
            .field("ucx", &self.shared.ucx_version)
            .finish()
    }
}
