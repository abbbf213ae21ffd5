//! References measured in the same run: a memcpy of the same bytes, a plain TCP stream of
//! the same bytes between the same two processes.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Instant;

use kvxfer::{HostBuffer, XferOp};

use crate::control::Ctl;
use crate::peer::{window, TCP_REF_CHUNK};
use crate::report::median;
use crate::BoxErr;

/// Median time of one memcpy of `bytes` between two fresh page-aligned buffers (after one
/// unmeasured copy that faults the pages in).
pub(crate) fn memcpy_ref(bytes: u64, iters: usize) -> Result<f64, BoxErr> {
    let mut a = HostBuffer::new(bytes as usize)?;
    let mut b = HostBuffer::new(bytes as usize)?;
    a.as_mut_slice().fill(7);
    let mut t = Vec::new();
    for i in 0..=iters {
        let t0 = Instant::now();
        b.as_mut_slice().copy_from_slice(a.as_slice());
        std::hint::black_box(b.as_slice()[bytes as usize / 2]);
        if i > 0 {
            t.push(t0.elapsed().as_secs_f64() * 1e3);
        }
    }
    Ok(median(&mut t))
}

/// Median time of a plain TCP stream of `bytes` (1 MiB writes and reads, like `iperf3 -l 1M`)
/// between this process and the peer, in the direction the transfer moves data; one
/// unmeasured round first. `span`: the buffers each side walks, 1 MiB (cache-hot, as iperf3)
/// or the transfer's size (the memory traffic a KV transfer has: every byte read from and
/// written to RAM once).
pub(crate) fn tcp_ref(
    ctl: &mut Ctl,
    ctl_addr: SocketAddr,
    bytes: u64,
    op: XferOp,
    iters: usize,
    span: usize,
) -> Result<f64, BoxErr> {
    let inbound = op == XferOp::Write; // data flows into the peer
    let rounds = iters + 1;
    let port: u16 = ctl
        .cmd(&format!(
            "TCPREF {bytes} {} {rounds} {span}",
            if inbound { "in" } else { "out" }
        ))?
        .parse()?;
    let mut s = TcpStream::connect(SocketAddr::new(ctl_addr.ip(), port))?;
    s.set_nodelay(true)?;
    let mut buf = vec![5u8; span.max(TCP_REF_CHUNK)];
    let mut t = Vec::new();
    for i in 0..rounds {
        let t0 = Instant::now();
        let mut at = 0usize;
        let mut left = bytes;
        if inbound {
            while left > 0 {
                let (w, n) = window(&mut buf, &mut at, left);
                s.write_all(&w[..n])?;
                at += n;
                left -= n as u64;
            }
            let mut ack = [0u8; 1];
            s.read_exact(&mut ack)?;
        } else {
            s.write_all(&[1])?;
            while left > 0 {
                let (w, n) = window(&mut buf, &mut at, left);
                let n = s.read(&mut w[..n])?;
                if n == 0 {
                    return Err("TCP reference: peer closed".into());
                }
                at += n;
                left -= n as u64;
            }
        }
        if i > 0 {
            t.push(t0.elapsed().as_secs_f64() * 1e3);
        }
    }
    Ok(median(&mut t))
}
