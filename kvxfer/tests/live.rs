//! `kvxfer::live`: what the process holds of kvxfer, counted up as agents are made, memory
//! registered and peers' regions mapped, and back to zero once they are dropped. (Its own
//! test binary: the counts are the process's.)
#![allow(clippy::unwrap_used)]

use kvxfer::live::{live, Live};
use kvxfer::{Agent, AgentConfig, Desc, HostBuffer, Transport};

#[test]
fn counts_rise_with_agents_regions_and_mappings_and_fall_to_zero() {
    assert!(live().is_empty(), "{}", live());
    {
        let a = Agent::new(AgentConfig::new("live-a").transport(Transport::Shm)).unwrap();
        let b = Agent::new(AgentConfig::new("live-b").transport(Transport::Shm)).unwrap();
        let ra = a.register(HostBuffer::new(1 << 20).unwrap()).unwrap();
        let rb = b.register(HostBuffer::new(1 << 20).unwrap()).unwrap();
        let addr = b.listen("127.0.0.1:0").unwrap();
        let peer = a.connect(addr).unwrap();
        // A write maps the peer's region (the shared-memory lane).
        let l = a.prep_local(&[Desc::new(ra.id(), 0, 4096)]).unwrap();
        let r = a
            .prep_remote(&peer, &[Desc::new(rb.id(), 0, 4096)])
            .unwrap();
        a.write(&l, &r).start().unwrap().wait().unwrap();
        let n = live();
        println!("holding: {n}");
        assert_eq!((n.agents, n.regions), (2, 2), "{n}");
        assert!(n.ucx_registrations >= 2 && n.peer_mappings >= 1, "{n}");
        // Deregistering takes a region out at once.
        b.deregister(&rb).unwrap();
        assert_eq!(live().regions, 1, "{}", live());
    }
    assert_eq!(live(), Live::default(), "{}", live());
}
