//! Descriptor passing for the hand-over tests: frames sent and received with `SCM_RIGHTS`, as
//! the shm and device lanes' sockets do.
#![allow(dead_code, clippy::unwrap_used)]

use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

use kvxfer_proto::wire::shm_fds::{FdFrame, FrameHead, HEADER_LEN};

/// Sends `bytes` with `fds` attached, as the hand-over does.
pub fn send_fds(s: &UnixStream, bytes: &[u8], fds: &[RawFd]) {
    let payload = std::mem::size_of_val(fds);
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(payload as u32) } as usize;
    let mut control = vec![0u8; space];
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut libc::c_void,
        iov_len: bytes.len(),
    };
    // SAFETY: an all-zero msghdr is valid; its pointers are set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: control holds CMSG_SPACE(payload) bytes; msg's buffers live for the call.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(payload as u32) as _;
            std::ptr::copy_nonoverlapping(fds.as_ptr().cast::<u8>(), libc::CMSG_DATA(c), payload);
        }
    }
    // SAFETY: msg's buffers live for the call.
    let n = unsafe { libc::sendmsg(s.as_raw_fd(), &msg, 0) };
    assert_eq!(n as usize, bytes.len());
}

/// One hand-over frame from `s` and the descriptors that came with its first byte.
pub fn recv_frame(s: &mut UnixStream) -> (FdFrame, Vec<OwnedFd>) {
    let mut head = [0u8; HEADER_LEN];
    let mut control = vec![0u8; 4096];
    let mut iov = libc::iovec {
        iov_base: head.as_mut_ptr().cast(),
        iov_len: HEADER_LEN,
    };
    // SAFETY: an all-zero msghdr is valid; its pointers are set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = control.len() as _;
    // SAFETY: msg's buffers live for the call.
    let n = unsafe { libc::recvmsg(s.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    assert!(n > 0, "the hand-over socket closed");
    let mut fds = Vec::new();
    // SAFETY: the kernel filled `control` up to msg_controllen; each SCM_RIGHTS header
    // carries that many descriptors, now ours.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_type == libc::SCM_RIGHTS {
                let k = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / 4;
                let p = libc::CMSG_DATA(c).cast::<RawFd>();
                for i in 0..k {
                    fds.push(OwnedFd::from_raw_fd(p.add(i).read_unaligned()));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    s.read_exact(&mut head[n as usize..]).unwrap();
    let head = FrameHead::decode(head).unwrap();
    let mut body = vec![0u8; head.body_len()];
    s.read_exact(&mut body).unwrap();
    (FdFrame::decode(head, &body).unwrap(), fds)
}
