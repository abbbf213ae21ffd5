//! The in-process connector's data path: an engine's caches as a layout over numbered
//! tensors, and the memcpy of one layer's descriptors from one cache to another, guarded so
//! that no copy touches a cache whose owner has dropped it.

use std::sync::RwLock;

use crate::connector::api::{CacheTensor, KvCaches};
use kvxfer_proto::descriptor::Desc;
use kvxfer_proto::error::{Error, Result};
use kvxfer_proto::layout::KvLayout;
use kvxfer_proto::types::{MemKind, RegionId};

/// An engine's caches: each group's layout names tensor `i` (numbered across groups) as
/// region `i`.
#[derive(Debug)]
pub(super) struct Caches {
    pub(super) layouts: Vec<KvLayout>,
    tensors: Vec<CacheTensor>,
    /// True while the producer or consumer that registered them lives; copies hold the read
    /// side, the owner's drop takes the write side and clears it.
    alive: RwLock<bool>,
}

impl Caches {
    pub(super) fn new(groups: &[KvCaches]) -> Result<Caches> {
        let mut tensors: Vec<CacheTensor> = Vec::new();
        let mut layouts = Vec::with_capacity(groups.len());
        for caches in groups {
            caches.validate()?;
            if let Some(t) = caches.tensors().find(|t| t.kind() != MemKind::Host) {
                return Err(Error::InvalidArgument(format!(
                    "the in-process connector moves host memory only; a tensor is {:?} (use \
                     the agent's connector for device memory)",
                    t.kind()
                )));
            }
            tensors.extend(caches.tensors().copied());
            let mut i = layouts
                .iter()
                .map(|l: &KvLayout| (l.layers.len() * l.tensors_per_layer()) as u32)
                .sum::<u32>();
            layouts.push(caches.layout(|_| {
                i += 1;
                (RegionId(i - 1), 0)
            }));
        }
        Ok(Caches {
            layouts,
            tensors,
            alive: RwLock::new(true),
        })
    }

    /// The owner is going: waits for copies in progress, refuses later ones.
    pub(super) fn retire(&self) {
        *self.alive.write().unwrap_or_else(|e| e.into_inner()) = false;
    }

    fn span(&self, d: &Desc) -> Result<*mut u8> {
        let t = self.tensors.get(d.region.0 as usize).ok_or_else(|| {
            Error::InvalidArgument(format!("descriptor names tensor {}", d.region.0))
        })?;
        if d.offset.saturating_add(d.len) > t.len() as u64 {
            return Err(Error::InvalidArgument(format!(
                "[{}, +{}) is outside tensor {} of {} bytes",
                d.offset,
                d.len,
                d.region.0,
                t.len()
            )));
        }
        // In bounds (checked above), so the offset stays inside the tensor's allocation.
        Ok(t.ptr().wrapping_add(d.offset as usize))
    }
}

/// Copies `src_descs` of `src` into `dst_descs` of `dst` (paired index by index); the bytes
/// copied. Fails, copying nothing, when a side was dropped or the lists do not pair.
pub(super) fn copy(
    src: &Caches,
    src_descs: &[Desc],
    dst: &Caches,
    dst_descs: &[Desc],
) -> Result<u64> {
    if src_descs.len() != dst_descs.len() {
        return Err(Error::InvalidArgument(format!(
            "{} source descriptors for {} destinations",
            src_descs.len(),
            dst_descs.len()
        )));
    }
    let mut pairs = Vec::with_capacity(src_descs.len());
    for (s, d) in src_descs.iter().zip(dst_descs) {
        if s.len != d.len {
            return Err(Error::InvalidArgument(format!(
                "descriptor of {} bytes paired with one of {}",
                s.len, d.len
            )));
        }
        pairs.push((src.span(s)?, dst.span(d)?, s.len as usize));
    }
    let src_alive = src.alive.read().unwrap_or_else(|e| e.into_inner());
    let dst_alive = dst.alive.read().unwrap_or_else(|e| e.into_inner());
    if !*src_alive || !*dst_alive {
        return Err(Error::Handoff {
            request: String::new(),
            why: format!(
                "the {} side's caches were dropped",
                if *src_alive { "consumer" } else { "producer" }
            ),
        });
    }
    let mut bytes = 0u64;
    for (s, d, n) in pairs {
        // SAFETY: both spans lie inside tensors (checked by `span`) that `CacheTensor::new`'s
        // contract keeps valid for reads and writes while their producer or consumer lives,
        // which the two read guards held here ensure (its drop takes the write side first).
        // Source blocks are held by a lease and destination blocks were handed to the load,
        // so no one else writes them; two distinct caches never overlap, and within one
        // cache the source and destination blocks of a load are the engine's distinct blocks.
        unsafe { std::ptr::copy_nonoverlapping(s.cast_const(), d, n) };
        bytes += n as u64;
    }
    Ok(bytes)
}
