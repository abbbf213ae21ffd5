//! The shm and device lanes' hand-over frames as a peer's socket sends them (header, then
//! body; the descriptors beside them are counted by the frame).
#![no_main]
use kvxfer_proto::wire::shm_fds::{
    DeviceHandle, FdFrame, FrameHead, HEADER_LEN, MAX_BATCH, MAX_DEVICE_BATCH,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() < HEADER_LEN {
        return;
    }
    let Ok(head) = FrameHead::decode([data[0], data[1], data[2]]) else {
        return;
    };
    let body = &data[HEADER_LEN..];
    let Ok(frame) = FdFrame::decode(head, body) else {
        return;
    };
    assert!(frame.fds() <= head.max_fds());
    match &frame {
        FdFrame::Batch(e) => assert!(!e.is_empty() && e.len() <= MAX_BATCH),
        FdFrame::Devices(e) => {
            assert!(!e.is_empty() && e.len() <= MAX_DEVICE_BATCH);
            for d in e {
                assert!(d.len > 0 && d.offset + d.len <= d.size);
                let _ = matches!(d.handle, DeviceHandle::File | DeviceHandle::Ipc(_));
            }
            // What decodes encodes to the same bytes.
            assert_eq!(frame.encode(), data);
        }
        _ => {}
    }
});
