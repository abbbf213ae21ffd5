//! The process's file descriptors: how many are open and the soft limit (what the peer table
//! keeps a reserve of), and the spare one a listener gives up to shed a connection when the
//! process has run out.

use std::fs::File;
use std::net::TcpListener;

use kvxfer_proto::peer_table::Fds;

/// The descriptors open now and the soft limit; None where either cannot be read (no
/// `/proc`, or no limit).
pub(crate) fn fds() -> Option<Fds> {
    let limit = nofile()?;
    // The directory's own descriptor is counted too: one more than the process held.
    let open = std::fs::read_dir("/proc/self/fd").ok()?.count() as u64;
    Some(Fds { open, limit })
}

/// `RLIMIT_NOFILE`'s soft limit; None when unlimited or unreadable.
pub(crate) fn nofile() -> Option<u64> {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one `rlimit` into `r`, which is live and writable for the call.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) };
    (rc == 0 && r.rlim_cur != libc::RLIM_INFINITY).then_some(r.rlim_cur)
}

/// Whether `e` says the process (or the system) is out of descriptors.
pub(crate) fn exhausted(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE))
}

/// One descriptor held in reserve (`/dev/null`). When `accept` fails for want of
/// descriptors, the waiting connection stays in the backlog and the listener stays readable:
/// an event loop would spin on it and the client would wait for nothing. [`Spare::shed`]
/// closes the spare, accepts that connection and closes it (the client learns at once), and
/// takes the spare again.
#[derive(Debug)]
pub(crate) struct Spare(Option<File>);

impl Spare {
    pub(crate) fn new() -> Spare {
        Spare(File::open("/dev/null").ok())
    }

    /// Sheds one waiting connection of `l`; false when none could be (no spare, or the
    /// descriptor went elsewhere first).
    pub(crate) fn shed(&mut self, l: &TcpListener) -> bool {
        self.0 = None;
        let shed = l.accept().is_ok();
        self.0 = File::open("/dev/null").ok();
        shed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_this_process() {
        let before = fds().unwrap();
        let f = File::open("/dev/null").unwrap();
        let after = fds().unwrap();
        assert_eq!(after.open, before.open + 1);
        assert_eq!(after.limit, before.limit);
        drop(f);
    }

    #[test]
    fn sheds_a_waiting_connection() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let mut spare = Spare::new();
        assert!(spare.0.is_some());
        assert!(spare.shed(&l));
        assert!(spare.0.is_some());
        // The client sees its connection closed.
        let mut b = [0u8; 1];
        assert_eq!(std::io::Read::read(&mut &c, &mut b).unwrap_or(0), 0);
    }
}
