//! Device copies in batches. A paged KV transfer is thousands of 16-64 KiB blocks at scattered
//! slots; posted one copy at a time it costs a driver submission each (2-7 us on every GPU
//! measured, `docs/perf/gpu-check.md`), 160-250x below what the device moves as one region.
//! [`batches`] turns the copies into a few tables, each run by one submission: one launch of
//! the gather/scatter kernel (`kvxfer/src/device/kernels/copy_batch.cu`) or one driver batch
//! call (`cuMemcpyBatchAsync`). Pure: the device lane and the staged path hand the tables to
//! their copy engine.
//!
//! What a table promises the engine that runs it: no entry is empty or longer than
//! [`BatchLimits::max_entry_bytes`] (so the kernel's thread blocks share the work evenly), a
//! table has at most [`BatchLimits::max_entries`] entries (the buffer it is uploaded into),
//! and no range wraps the address space. A table's copies run at once, as
//! `cuMemcpyBatchAsync`'s do: where two of them write the same byte (a request that names a
//! destination block twice) it ends with either source's byte, not the last one's. Refusing
//! that would need the destinations sorted: 12-13 ms of the 14-16 ms it took to plan a
//! 327,680-block request (`benches/hot_paths.rs` `copy_tables`; 2.5 ms without), on a path
//! whose target for that request is 10 ms in all.

use std::fmt;

/// One copy: `len` bytes from `src` to `dst` (device addresses, or host memory mapped for the
/// device).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopyRange {
    /// Where the bytes are read.
    pub src: u64,
    /// Where they land.
    pub dst: u64,
    /// How many.
    pub len: u64,
}

/// How large a table may be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchLimits {
    /// Entries in one table at most (the engine's table buffer holds this many).
    pub max_entries: usize,
    /// Bytes one entry moves at most; longer copies are cut.
    pub max_entry_bytes: u64,
}

impl BatchLimits {
    /// What the CUDA engine uses: 64 Ki entries (1.5 MiB of table, one upload), 1 MiB an
    /// entry (a 256-thread block moves it in 256 iterations of 16 bytes).
    pub const DEVICE: BatchLimits = BatchLimits {
        max_entries: 65_536,
        max_entry_bytes: 1 << 20,
    };
}

/// One submission's copies, as arrays (the layout the kernel and `cuMemcpyBatchAsync` read).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CopyBatch {
    /// Source of each entry.
    pub src: Vec<u64>,
    /// Destination of each entry.
    pub dst: Vec<u64>,
    /// Length of each entry.
    pub len: Vec<u64>,
    /// The entries' lengths added up.
    pub bytes: u64,
}

impl CopyBatch {
    /// Entries in the table.
    pub fn entries(&self) -> usize {
        self.len.len()
    }

    /// The entries as ranges, in table order.
    pub fn iter(&self) -> impl Iterator<Item = CopyRange> + '_ {
        (0..self.entries()).map(|k| CopyRange {
            src: self.src[k],
            dst: self.dst[k],
            len: self.len[k],
        })
    }

    fn push(&mut self, c: CopyRange) {
        self.src.push(c.src);
        self.dst.push(c.dst);
        self.len.push(c.len);
        self.bytes += c.len;
    }
}

/// Why copies cannot be batched.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BatchError {
    /// A limit of zero.
    BadLimits(BatchLimits),
    /// Copy `index`'s source or destination range runs past the end of the address space.
    Wraps {
        /// Its position in the input.
        index: usize,
        /// The copy.
        copy: CopyRange,
    },
}

impl fmt::Display for BatchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BatchError::BadLimits(l) => write!(
                f,
                "batch limits of {} entries and {} bytes an entry: both must be above zero",
                l.max_entries, l.max_entry_bytes
            ),
            BatchError::Wraps { index, copy } => write!(
                f,
                "copy {index} ({:#x} -> {:#x}, {} bytes) runs past the end of the address space",
                copy.src, copy.dst, copy.len
            ),
        }
    }
}

impl std::error::Error for BatchError {}

/// Cuts `copies` into tables within `limits`: empty copies are dropped, copies contiguous on
/// both sides with the one before are merged, copies longer than an entry may be are cut, and
/// tables are filled in input order. Refuses copies that wrap the address space.
pub fn batches(
    copies: impl IntoIterator<Item = CopyRange>,
    limits: &BatchLimits,
) -> Result<Vec<CopyBatch>, BatchError> {
    if limits.max_entries == 0 || limits.max_entry_bytes == 0 {
        return Err(BatchError::BadLimits(*limits));
    }
    // Merge first: a run of adjacent blocks is one range.
    let mut merged: Vec<CopyRange> = Vec::new();
    for (index, c) in copies.into_iter().enumerate() {
        if c.len == 0 {
            continue;
        }
        if c.src.checked_add(c.len).is_none() || c.dst.checked_add(c.len).is_none() {
            return Err(BatchError::Wraps { index, copy: c });
        }
        if let Some(last) = merged.last_mut() {
            if last.src + last.len == c.src && last.dst + last.len == c.dst {
                last.len += c.len;
                continue;
            }
        }
        merged.push(c);
    }
    let mut out: Vec<CopyBatch> = Vec::new();
    let mut cur = CopyBatch::default();
    for c in merged {
        let mut done = 0u64;
        while done < c.len {
            if cur.entries() == limits.max_entries {
                out.push(std::mem::take(&mut cur));
            }
            let n = (c.len - done).min(limits.max_entry_bytes);
            cur.push(CopyRange {
                src: c.src + done,
                dst: c.dst + done,
                len: n,
            });
            done += n;
        }
    }
    if cur.entries() > 0 {
        out.push(cur);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn c(src: u64, dst: u64, len: u64) -> CopyRange {
        CopyRange { src, dst, len }
    }

    const L: BatchLimits = BatchLimits {
        max_entries: 3,
        max_entry_bytes: 100,
    };

    #[test]
    fn adjacent_blocks_merge_and_long_ones_are_cut() {
        // Three adjacent blocks of 40 (one range of 120, cut at 100), then a scattered one.
        let b = batches(
            [
                c(0, 1000, 40),
                c(40, 1040, 40),
                c(80, 1080, 40),
                c(500, 2000, 10),
            ],
            &L,
        )
        .unwrap();
        assert_eq!(b.len(), 1);
        assert_eq!(
            b[0].iter().collect::<Vec<_>>(),
            vec![c(0, 1000, 100), c(100, 1100, 20), c(500, 2000, 10)]
        );
        assert_eq!(b[0].bytes, 130);
        // Contiguous at the source only: two entries.
        let b = batches([c(0, 1000, 40), c(40, 3000, 40)], &L).unwrap();
        assert_eq!(b[0].entries(), 2);
    }

    #[test]
    fn tables_fill_in_order_up_to_the_limit() {
        let copies: Vec<_> = (0..7).map(|k| c(k * 1000, k * 1000 + 500, 8)).collect();
        let b = batches(copies.clone(), &L).unwrap();
        assert_eq!(
            b.iter().map(CopyBatch::entries).collect::<Vec<_>>(),
            vec![3, 3, 1]
        );
        assert_eq!(b.iter().flat_map(|t| t.iter()).collect::<Vec<_>>(), copies);
        assert!(batches(Vec::new(), &L).unwrap().is_empty());
        assert!(batches([c(1, 2, 0)], &L).unwrap().is_empty());
    }

    #[test]
    fn refusals_say_which_copy() {
        assert!(matches!(
            batches(
                [c(0, 0, 1)],
                &BatchLimits {
                    max_entries: 0,
                    max_entry_bytes: 1
                }
            ),
            Err(BatchError::BadLimits(_))
        ));
        let e = batches([c(0, 0, 8), c(u64::MAX - 3, 100, 8)], &L).unwrap_err();
        assert_eq!(
            e,
            BatchError::Wraps {
                index: 1,
                copy: c(u64::MAX - 3, 100, 8)
            }
        );
        // A destination written twice is not refused (the table's copies run at once).
        assert!(batches([c(0, 100, 50), c(0, 120, 10)], &L).is_ok());
    }

    /// Copies into distinct destination slots of a small space, in random order, at random
    /// sources (sources may repeat: a block read twice is fine).
    fn scattered() -> impl Strategy<Value = Vec<CopyRange>> {
        (1u64..40, 1usize..60).prop_flat_map(|(block, n)| {
            (
                Just(block),
                Just(Vec::from_iter(0..n as u64)).prop_shuffle(),
                proptest::collection::vec(0u64..64, n),
                proptest::collection::vec(1u64..=block, n),
            )
                .prop_map(|(block, slots, srcs, lens)| {
                    slots
                        .iter()
                        .zip(srcs)
                        .zip(lens)
                        .map(|((&s, src), len)| c(src * block, 10_000 + s * block, len))
                        .collect()
                })
        })
    }

    proptest! {
        // Miri runs each case about a thousand times slower.
        #![proptest_config(ProptestConfig::with_cases(if cfg!(miri) { 6 } else { 256 }))]

        /// Every byte lands where the copies one after another would put it, each written
        /// once, and every table keeps the limits.
        #[test]
        fn batches_move_every_byte_once_within_limits(
            copies in scattered(),
            max_entries in 1usize..8,
            max_entry_bytes in 1u64..50,
        ) {
            let limits = BatchLimits { max_entries, max_entry_bytes };
            let tables = batches(copies.clone(), &limits).unwrap();
            let src_of = |at: u64| at.wrapping_mul(2_654_435_761) >> 7; // a byte's "value"
            let mut serial = std::collections::HashMap::new();
            for k in &copies {
                for i in 0..k.len {
                    serial.insert(k.dst + i, src_of(k.src + i));
                }
            }
            let mut batched = std::collections::HashMap::new();
            let mut total = 0;
            for t in &tables {
                prop_assert!(t.entries() >= 1 && t.entries() <= max_entries);
                prop_assert_eq!(t.bytes, t.len.iter().sum::<u64>());
                total += t.bytes;
                for e in t.iter() {
                    prop_assert!(e.len >= 1 && e.len <= max_entry_bytes);
                    for i in 0..e.len {
                        prop_assert!(batched.insert(e.dst + i, src_of(e.src + i)).is_none());
                    }
                }
            }
            prop_assert_eq!(total, copies.iter().map(|k| k.len).sum::<u64>());
            prop_assert_eq!(batched, serial);
            // Only the last table may be short.
            for t in tables.iter().rev().skip(1) {
                prop_assert_eq!(t.entries(), max_entries);
            }
        }
    }
}
