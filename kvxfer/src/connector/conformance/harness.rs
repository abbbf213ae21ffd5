//! What an implementation provides to the suite, and the helpers every case uses.

use std::time::Duration;

use crate::connector::api::{KvConnector, KvConsumer, KvProducer};
use crate::connector::config::ConnectorConfig;
use crate::telemetry::RequestStats;
use kvxfer_proto::error::Result;
use kvxfer_proto::lifecycle::FreeReason;

use super::cache::{TestCache, HEADS, LAYERS};

/// Every head of the test caches.
pub(super) const ALL: std::ops::Range<u64> = 0..HEADS;
/// Every layer of the test caches.
pub(super) const LAYERS_ALL: std::ops::Range<usize> = 0..LAYERS as usize;

/// The connectors of one case: one per prefill rank, and one per decode rank, each decode
/// rank's able to reach every prefill rank.
#[derive(Debug)]
pub struct Connectors {
    /// Where each producer is made (one per prefill rank; most cases use one).
    pub producers: Vec<Box<dyn KvConnector>>,
    /// Where each consumer is made (a separate worker each, for implementations that have
    /// workers).
    pub consumers: Vec<Box<dyn KvConnector>>,
}

/// What an implementation provides to be tested: fresh connectors for each case.
pub trait Harness {
    /// `producers` producer-side connectors (separate workers, as prefill ranks are) and
    /// `consumers` consumer-side connectors that reach them.
    fn connectors(&self, producers: usize, consumers: usize) -> Result<Connectors>;
}

/// A case's verdict: `Err` with the first violation.
pub type Verdict = std::result::Result<(), String>;

/// Long enough for any wait that should succeed.
pub(super) const T: Duration = Duration::from_secs(20);

pub(super) fn cfg() -> ConnectorConfig {
    ConnectorConfig {
        lease: Duration::from_secs(3),
        heartbeat: Duration::from_millis(50),
        ..ConnectorConfig::default()
    }
}

pub(super) fn ok<T>(r: Result<T>, what: &str) -> std::result::Result<T, String> {
    r.map_err(|e| format!("{what}: {e}"))
}

/// `st` moved `moved` bytes and skipped `skipped` (`what` names the load).
pub(super) fn figures(st: &RequestStats, moved: u64, skipped: u64, what: &str) -> Verdict {
    if st.bytes_moved != moved || st.bytes_skipped != skipped {
        return Err(format!(
            "{what}: moved {} skipped {}, want {moved} and {skipped}",
            st.bytes_moved, st.bytes_skipped
        ));
    }
    Ok(())
}

/// The freed report of `req`, with the reason `want`.
pub(super) fn freed_as(
    p: &dyn KvProducer,
    req: &str,
    want: FreeReason,
    within: Duration,
) -> Verdict {
    let f = ok(
        p.wait_freed(req, within),
        &format!("waiting for {req:?} to be freed"),
    )?;
    if f.reason != want {
        return Err(format!("{req:?} freed as {:?}, not {want:?}", f.reason));
    }
    Ok(())
}

/// The next failed load reported by `c` names exactly `blocks` as invalid.
pub(super) fn failed_naming(c: &dyn KvConsumer, blocks: &[u32]) -> Verdict {
    let fl = c.next_failed().ok_or("the failed load is not reported")?;
    if fl.invalid_blocks != blocks {
        return Err(format!(
            "invalid blocks {:?}, not {blocks:?}",
            fl.invalid_blocks
        ));
    }
    Ok(())
}

/// One producer and its consumers over fresh caches (the producer's filled, the consumers'
/// zeroed). Fields drop in order: connector objects before the caches they name.
pub(super) struct Setup {
    pub(super) producer: Box<dyn KvProducer>,
    pub(super) consumers: Vec<Box<dyn KvConsumer>>,
    pub(super) _connectors: Connectors,
    pub(super) src: TestCache,
    pub(super) dst: Vec<TestCache>,
}

pub(super) fn setup(
    h: &dyn Harness,
    pcfg: ConnectorConfig,
    ccfgs: Vec<(u64, ConnectorConfig)>,
) -> std::result::Result<Setup, String> {
    let src = ok(TestCache::new(HEADS, Some(7)), "producer cache")?;
    let mut dst = Vec::new();
    for (heads, _) in &ccfgs {
        dst.push(ok(TestCache::new(*heads, None), "consumer cache")?);
    }
    let conns = ok(h.connectors(1, ccfgs.len()), "connectors")?;
    if conns.consumers.len() != ccfgs.len() || conns.producers.len() != 1 {
        return Err(format!(
            "asked for 1 and {} connectors, got {} and {}",
            ccfgs.len(),
            conns.producers.len(),
            conns.consumers.len()
        ));
    }
    let producer = ok(conns.producers[0].producer(src.caches(), &pcfg), "producer")?;
    let mut consumers = Vec::new();
    for ((c, d), (_, cc)) in conns.consumers.iter().zip(&dst).zip(&ccfgs) {
        consumers.push(ok(c.consumer(d.caches(), cc), "consumer")?);
    }
    Ok(Setup {
        producer,
        consumers,
        _connectors: conns,
        src,
        dst,
    })
}
