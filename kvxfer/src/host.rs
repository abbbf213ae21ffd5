//! This process's host identity, and a peer process on the same host watched through a pidfd:
//! what the shm lane and UCX's shared memory use to tell a dead same-host peer at once
//! (neither transport notices one by itself).

use std::os::fd::{AsRawFd, OwnedFd};

use kvxfer_proto::types::HostInfo;

/// This process's host identity, or None where /proc does not tell it.
pub(crate) fn host_info() -> Option<HostInfo> {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let hex: String = boot.trim().chars().filter(|c| *c != '-').collect();
    let boot_id = kvxfer_proto::wire::unhex::<16>(&hex)?;
    let ns = std::fs::read_link("/proc/self/ns/pid").ok()?;
    let ns = ns.to_str()?;
    let pid_ns: u64 = ns.strip_prefix("pid:[")?.strip_suffix(']')?.parse().ok()?;
    Some(HostInfo {
        boot_id,
        pid_ns,
        pid: std::process::id(),
    })
}

/// Whether `peer` runs on this host, in this PID namespace, in another process than this one.
pub(crate) fn same_host_elsewhere(peer: Option<HostInfo>) -> bool {
    match (peer, host_info()) {
        (Some(p), Some(me)) => p.boot_id == me.boot_id && p.pid_ns == me.pid_ns && p.pid != me.pid,
        _ => false,
    }
}

/// Whether `peer` runs on the host `me` describes, in another process: where UCX takes shared
/// memory to it (from another PID namespace of the same boot too).
pub(crate) fn same_boot_elsewhere(me: Option<HostInfo>, peer: Option<HostInfo>) -> bool {
    match (me, peer) {
        (Some(m), Some(p)) => m.boot_id == p.boot_id && (m.pid_ns, m.pid) != (p.pid_ns, p.pid),
        _ => false,
    }
}

/// A peer's process: a pidfd (opened before anything of the peer was used, so it is that
/// process and not a later one with the pid), or the pid alone where the kernel has no
/// pidfds.
#[derive(Debug)]
pub(crate) struct PeerProcess {
    pid: u32,
    pidfd: Option<OwnedFd>,
}

impl PeerProcess {
    pub(crate) fn open(pid: u32) -> PeerProcess {
        use std::os::fd::FromRawFd;
        // SAFETY: pidfd_open takes a pid and flags 0 and returns a new descriptor or -1.
        let raw = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
        let pidfd = (raw >= 0).then(|| {
            // SAFETY: raw is a fresh descriptor that nothing else owns.
            unsafe { OwnedFd::from_raw_fd(raw as i32) }
        });
        PeerProcess { pid, pidfd }
    }

    /// The pid.
    pub(crate) fn pid(&self) -> u32 {
        self.pid
    }

    /// Whether the process has exited: its memory is then read by nobody, and a transfer
    /// into or out of it must not look like a success.
    pub(crate) fn exited(&self) -> bool {
        match &self.pidfd {
            Some(fd) => {
                let mut p = libc::pollfd {
                    fd: fd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: one live pollfd, no wait; a pidfd is readable once its process ends.
                let n = unsafe { libc::poll(&mut p, 1, 0) };
                n > 0 && p.revents & libc::POLLIN != 0
            }
            None => {
                // SAFETY: kill with signal 0 only checks that the process exists.
                let r = unsafe { libc::kill(self.pid as libc::pid_t, 0) };
                r != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn host_info_reads_this_process() {
        let h = super::host_info().expect("Linux /proc");
        assert_eq!(h.pid, std::process::id());
        assert_ne!(h.boot_id, [0; 16]);
        assert_eq!(super::host_info(), Some(h));
        assert!(!super::same_host_elsewhere(Some(h)), "this very process");
    }

    #[test]
    fn another_process_or_namespace_of_this_boot_is_on_this_host() {
        let me = super::host_info().expect("Linux /proc");
        let same = super::same_boot_elsewhere;
        assert!(!same(Some(me), Some(me)), "this very process");
        let other = |f: fn(&mut kvxfer_proto::types::HostInfo)| {
            let mut h = me;
            f(&mut h);
            Some(h)
        };
        assert!(same(Some(me), other(|h| h.pid += 1)));
        assert!(
            same(Some(me), other(|h| h.pid_ns += 1)),
            "a container of this host"
        );
        assert!(
            !same(Some(me), other(|h| h.boot_id[0] ^= 1)),
            "another host"
        );
        assert!(!same(None, Some(me)) && !same(Some(me), None), "unknown");
    }

    #[test]
    fn a_child_that_exits_is_seen_exited() {
        let mut c = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let p = super::PeerProcess::open(c.id());
        assert!(!p.exited());
        c.kill().unwrap();
        c.wait().unwrap();
        assert!(p.exited());
    }
}
