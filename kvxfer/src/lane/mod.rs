//! kvxfer's own data lanes, next to UCX. UCX moves one operation per scattered block; these
//! lanes move a whole transfer in a few large steps, which is what KV-shaped transfers
//! (thousands of 16-64 KiB blocks at random slots) need:
//!
//! - `shm`: a peer on the same host maps the target's memfd-backed regions once (at metadata
//!   load, handed over by the target's socket) and copies with plain loads and stores, split over a few copy threads. No syscall per
//!   block, no staging, no bounce buffer.
//! - [`tcp`]: one TCP stream per peer; WRITE is `writev` straight from registered memory into
//!   the socket and `readv` straight into the target's blocks; READ is served by the target
//!   pushing the requested blocks (UCX emulates a TCP get with round trips). The peer must
//!   present the secret from the target's metadata, and every segment is bounds-checked on the
//!   target against its own region table.
//!
//! RDMA stays on UCX (same API, chosen by the agent's transport), and so does device memory on
//! the direct path. Device memory on the staged path takes the TCP lane whatever the
//! transport: each end copies its own device memory through bounded staging chunks
//! ([`crate::staging`]) as the stream passes.
//!
//! **The lane interface**, one trait per side, as pplx-garden's fabric-lib holds a domain and
//! its per-peer handles: a [`LaneKind`](api::LaneKind) is a lane as an agent holds it (started from a
//! [`LaneSetup`](api::LaneSetup), it opens towards each peer it reaches, fences, stops); a [`PeerLane`](api::PeerLane) is the
//! lane towards one peer (whether it carries a transfer, and carrying it; completion flows up
//! through the job's state). The agent keeps the kinds in [`start`]'s order and, per peer,
//! the lanes they opened; a transfer takes the first lane that carries it, else UCX. Adding a
//! lane is a file with both traits and one line in [`start`].

pub(crate) mod api;
pub(crate) mod config;
pub(crate) mod device;
#[cfg(test)]
mod memory;
pub(crate) mod shm;
pub(crate) mod shm_handover;
pub(crate) mod tcp;

use api::{LaneKind, LaneSetup};
use kvxfer_proto::error::Result;

/// The lanes an agent runs, in the order a transfer tries them. Lanes off: none (UCX only).
pub(crate) fn start(setup: &LaneSetup) -> Result<Vec<Box<dyn LaneKind>>> {
    if !setup.config.on {
        return Ok(Vec::new());
    }
    let mut lanes: Vec<Box<dyn LaneKind>> = Vec::new();
    #[cfg(test)]
    lanes.extend(memory::MemoryLane::start(setup));
    lanes.extend(shm::ShmLane::start(setup)?);
    lanes.extend(device::DeviceLane::start(setup)?);
    lanes.push(Box::new(tcp::lane::TcpLane::start(setup)?));
    Ok(lanes)
}

/// The first IPv4 address of the first interface in `devices` (a `UCX_NET_DEVICES` list such
/// as `"eth0"` or `"mlx5_0:1,eth1"`; RDMA names are skipped), or with `None`, of the first
/// interface that is up and not loopback.
pub(crate) fn iface_addr(devices: Option<&str>) -> Option<std::net::IpAddr> {
    let addrs = ipv4_interfaces();
    match devices {
        Some(list) => list.split(',').find_map(|d| {
            let d = d.trim();
            addrs
                .iter()
                .find(|(n, _, _)| n == d)
                .map(|(_, a, _)| std::net::IpAddr::V4(*a))
        }),
        None => addrs
            .iter()
            .find(|(_, _, ok)| *ok)
            .map(|(_, a, _)| std::net::IpAddr::V4(*a)),
    }
}

/// This host's interfaces with an IPv4 address, as "name (address)", for error messages.
pub(crate) fn interface_names() -> Vec<String> {
    ipv4_interfaces()
        .into_iter()
        .map(|(n, a, _)| format!("{n} ({a})"))
        .collect()
}

/// Every interface with an IPv4 address: name, address, whether it is up and not loopback.
fn ipv4_interfaces() -> Vec<(String, std::net::Ipv4Addr, bool)> {
    let mut addrs: Vec<(String, std::net::Ipv4Addr, bool)> = Vec::new();
    let mut ifa: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: ifa is a valid out pointer; freed below with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut ifa) } != 0 {
        return addrs;
    }
    let mut p = ifa;
    while !p.is_null() {
        // SAFETY: p walks the list getifaddrs returned, valid until freeifaddrs.
        let e = unsafe { &*p };
        p = e.ifa_next;
        if e.ifa_addr.is_null() || e.ifa_name.is_null() {
            continue;
        }
        // SAFETY: ifa_addr is non-null and points to a sockaddr of the family it states.
        let fam = unsafe { (*e.ifa_addr).sa_family } as i32;
        if fam != libc::AF_INET {
            continue;
        }
        // SAFETY: family AF_INET means the storage is a sockaddr_in.
        let sin = unsafe { &*(e.ifa_addr as *const libc::sockaddr_in) };
        // SAFETY: ifa_name is a NUL-terminated string owned by the list.
        let name = unsafe { std::ffi::CStr::from_ptr(e.ifa_name) }
            .to_string_lossy()
            .into_owned();
        let up = e.ifa_flags & libc::IFF_UP as u32 != 0;
        let lo = e.ifa_flags & libc::IFF_LOOPBACK as u32 != 0;
        addrs.push((
            name,
            std::net::Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)),
            up && !lo,
        ));
    }
    // SAFETY: ifa came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(ifa) };
    addrs
}

#[cfg(test)]
mod tests {
    #[test]
    fn iface_addr_finds_loopback() {
        assert_eq!(
            super::iface_addr(Some("lo")),
            Some(std::net::Ipv4Addr::LOCALHOST.into())
        );
        assert_eq!(
            super::iface_addr(Some("mlx5_0:1,lo")),
            Some(std::net::Ipv4Addr::LOCALHOST.into())
        );
        assert_eq!(super::iface_addr(Some("kvx-none")), None);
    }
}
