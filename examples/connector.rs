//! The connector in its natural order, in one process with two agents: create each agent
//! (no layout needed first: `AgentConfig::compat` is optional, it only keeps apart agents of
//! different deployments), let the **prefill** agent listen (its address goes into every
//! handoff; decode agents connect to it on their first load), wrap each agent in an
//! `AgentConnector`, register the caches as they are, hand a request over.
//!
//! ```text
//! cargo run --example connector
//! ```

use std::sync::Arc;
use std::time::Duration;

use kvxfer::connector::{
    AgentConnector, CacheTensor, ConnectorConfig, KvCaches, KvConnector, LayerTensors,
};
use kvxfer::layout::{KvGeometry, KvOrder, KvPacking};
use kvxfer::{Agent, AgentConfig, HostBuffer, MemKind, Transport};

/// One fused K+V tensor per layer, `blocks` blocks of 16 tokens.
fn caches(mem: &mut [HostBuffer], g: &KvGeometry, blocks: u64) -> KvCaches {
    let layers = mem
        .iter_mut()
        .map(|b| {
            let s = b.as_mut_slice();
            // SAFETY: `mem` outlives the producer and consumer (dropped first in main).
            let k = unsafe { CacheTensor::new(s.as_mut_ptr(), s.len(), MemKind::Host) };
            LayerTensors { k, v: None }
        })
        .collect();
    KvCaches {
        geometry: g.clone(),
        block_tokens: 16,
        num_blocks: blocks,
        packing: KvPacking::Fused,
        order: KvOrder::Nhd,
        layers,
        state: None,
        pad_per_head: 0,
    }
}

fn main() -> kvxfer::Result<()> {
    let g = KvGeometry::preset("qwen3-0.6b")?;
    let block = 2 * g.block_bytes(16) as usize; // K and V of one layer
    let tensor = || HostBuffer::new(16 * block);
    let mut prefill_mem: Vec<HostBuffer> = (0..g.layers)
        .map(|_| tensor())
        .collect::<kvxfer::Result<_>>()?;
    let mut decode_mem: Vec<HostBuffer> = (0..g.layers)
        .map(|_| tensor())
        .collect::<kvxfer::Result<_>>()?;
    for (l, t) in prefill_mem.iter_mut().enumerate() {
        t.as_mut_slice()
            .iter_mut()
            .enumerate()
            .for_each(|(i, x)| *x = (i + l) as u8);
    }
    // 1. The agents, in any order; 2. the prefill one listens.
    let cfg = |n: &str| {
        AgentConfig::new(n)
            .transport(Transport::Tcp)
            .net_devices("lo")
    };
    let prefill = Arc::new(Agent::new(cfg("connector-prefill"))?);
    let decode = Arc::new(Agent::new(cfg("connector-decode"))?);
    let side = prefill.listen("127.0.0.1:0")?;
    // 3. Connectors over them; 4. the caches registered as the engine holds them.
    let ccfg = ConnectorConfig::default();
    let p = AgentConnector::new(prefill, Some(side))
        .producer(&caches(&mut prefill_mem, &g, 16), &ccfg)?;
    let c = AgentConnector::new(decode, None).consumer(&caches(&mut decode_mem, &g, 16), &ccfg)?;
    // 5. A request of 6 blocks, of which the decode side holds the first 2.
    let h = p.publish("req-1", &[0, 1, 2, 3, 4, 5], 96, g.layers as usize)?;
    c.start_load(&h, &[10, 11, 12, 13])?;
    c.wait("req-1", Duration::from_secs(20))?;
    let st = c.next_finished().expect("a finished load");
    let freed = p.wait_freed("req-1", Duration::from_secs(20))?;
    let ok = (0..g.layers as usize).all(|l| {
        (0..4).all(|k| {
            let (src, dst) = ((2 + k) * block, (10 + k) * block);
            prefill_mem[l].as_slice()[src..src + block]
                == decode_mem[l].as_slice()[dst..dst + block]
        })
    });
    println!(
        "req-1: {:.1} MB moved, {:.1} MB skipped (cached prefix), in {:.1} ms; bytes {}; the \
         producer freed blocks {:?} ({:?})",
        st.bytes_moved as f64 / 1e6,
        st.bytes_skipped as f64 / 1e6,
        st.handoff_time.as_secs_f64() * 1e3,
        if ok { "verified" } else { "WRONG" },
        freed.blocks,
        freed.reason
    );
    drop((c, p));
    if !ok {
        std::process::exit(1);
    }
    Ok(())
}
