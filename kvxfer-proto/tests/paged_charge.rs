//! What a TCP-lane target charges for a paged table ([`table_bytes`]) against what parsing and
//! resolving it allocates, measured with a counting allocator, for the tables an initiator
//! sends and for the shapes a hostile one could choose (many empty lists, one list per entry,
//! one long list): the charge must cover the peak, whatever the shape.
#![allow(clippy::unwrap_used)] // Tests fail loudly on purpose.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use kvxfer_proto::error::Side;
use kvxfer_proto::lane::table_bytes;
use kvxfer_proto::paged::{resolve_paged, Paged};
use kvxfer_proto::types::{MemKind, RegionId, RegionSpan};
use kvxfer_proto::wire::lane::{
    encode_paged, parse_paged, RequestHeader, K_WRITE, MAX_PAGED_TABLE, PAGED_ENTRY_LEN,
};

/// Counts the bytes allocated now and the most at once, as glibc's malloc holds them: each
/// allocation takes its size plus an 8-byte header, rounded up to 16, at least 32.
struct Counting;

fn held(l: Layout) -> usize {
    ((l.size() + 8).div_ceil(16) * 16).max(32)
}

static NOW: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is passed through to the system allocator unchanged; the counters only
// observe the sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let n = NOW.fetch_add(held(l), Ordering::Relaxed) + held(l);
        PEAK.fetch_max(n, Ordering::Relaxed);
        // SAFETY: the caller's layout, passed on.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        NOW.fetch_sub(held(l), Ordering::Relaxed);
        // SAFETY: `p` came from `alloc` with this layout.
        unsafe { System.dealloc(p, l) }
    }
}

#[global_allocator]
static A: Counting = Counting;

/// One test at a time: the counters are the process's.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A raw paged table: `lists` block lists (list `k` has `len(k)` blocks, all block 0), and
/// `entries` entries, entry `e` using list `list(e)`, 4 bytes a block.
fn raw(
    lists: usize,
    len: impl Fn(usize) -> usize,
    entries: usize,
    list: impl Fn(usize) -> usize,
) -> Vec<u8> {
    let lens: Vec<usize> = (0..lists).map(&len).collect();
    let total: u64 = (0..entries).map(|e| 4 * lens[list(e)] as u64).sum();
    let mut b = Vec::new();
    b.extend_from_slice(&total.to_le_bytes());
    b.extend_from_slice(&(lists as u32).to_le_bytes());
    b.extend_from_slice(&(entries as u32).to_le_bytes());
    for &n in &lens {
        b.extend_from_slice(&(n as u32).to_le_bytes());
        b.extend(std::iter::repeat_n(0u8, 4 * n));
    }
    for e in 0..entries {
        b.extend_from_slice(&0u32.to_le_bytes()); // region 0
        b.extend_from_slice(&0u64.to_le_bytes()); // offset
        b.extend_from_slice(&4u64.to_le_bytes()); // block_len
        b.extend_from_slice(&4u64.to_le_bytes()); // stride
        b.extend_from_slice(&(list(e) as u32).to_le_bytes());
    }
    b
}

/// Peak bytes allocated, beyond those held before, while the target holds the raw table and
/// parses it, then holds the parsed entries and resolves them; and the charge.
fn measure(table: Vec<u8>) -> (usize, u64) {
    let spans = [RegionSpan {
        id: RegionId(0),
        base: 1 << 20,
        len: 1 << 30,
        kind: MemKind::Host,
    }];
    let charge = table_bytes(&RequestHeader {
        kind: K_WRITE,
        id: 1,
        nsegs: table.len(),
        notif_len: 0,
        frames: None,
        paged: true,
    });
    // The raw table was charged before it was read: count it from here.
    let base = NOW.load(Ordering::Relaxed) - held(Layout::for_value(&table[..]));
    PEAK.store(NOW.load(Ordering::Relaxed), Ordering::Relaxed);
    let parsed = parse_paged(&table).unwrap();
    drop(table);
    let resolved = resolve_paged(Side::Local, &parsed.entries, &spans).unwrap();
    let peak = PEAK.load(Ordering::Relaxed) - base;
    drop((parsed, resolved));
    (peak, charge)
}

fn check(what: &str, table: Vec<u8>) {
    let len = table.len();
    let (peak, charge) = measure(table);
    eprintln!(
        "{what}: table {len} B, peak {peak} B ({:.2}x), charged {charge} B ({:.2}x)",
        peak as f64 / len as f64,
        charge as f64 / len as f64
    );
    assert!(
        peak as u64 <= charge,
        "{what}: parsing and resolving a {len}-byte paged table peaked at {peak} bytes, \
         over the {charge} charged"
    );
}

#[test]
#[cfg_attr(
    miri,
    ignore = "20 MB tables: far too slow under Miri; parse_paged's own tests run there"
)]
fn the_charge_covers_what_parsing_and_resolving_allocate() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // What an initiator sends: one list of 148 blocks shared by 56 entries (28 layers, K and
    // V), and a long prompt's 2,048 blocks over 128 entries.
    for (blocks, layers) in [(148usize, 56usize), (2048, 128), (1, 1)] {
        let list: Arc<[u32]> = (0..blocks as u32).collect();
        let entries: Vec<Paged> = (0..layers)
            .map(|l| Paged {
                region: RegionId(0),
                offset: l as u64 * 4,
                block_len: 4,
                stride: 4,
                blocks: list.clone(),
            })
            .collect();
        let mut b = Vec::new();
        encode_paged(&entries, &mut b);
        drop(entries);
        check(&format!("{blocks} blocks x {layers} entries"), b);
    }
    // What a hostile initiator may choose, each near the largest table.
    let max = MAX_PAGED_TABLE;
    // Lists no entry uses are refused (a list in memory is several times its wire bytes).
    let unused = raw(1000, |_| 0, 1, |_| 0);
    assert!(parse_paged(&unused).is_err());
    let unused = raw(2, |_| 0, 2, |_| 0);
    assert!(parse_paged(&unused)
        .unwrap_err()
        .contains("used by no entry"));
    let n = (max - 16) / (4 + PAGED_ENTRY_LEN);
    check("one empty list per entry", raw(n, |_| 0, n, |e| e));
    let n = (max - 16) / (4 + 4 + PAGED_ENTRY_LEN);
    check("one single-block list per entry", raw(n, |_| 1, n, |e| e));
    let n = (max - 16) / PAGED_ENTRY_LEN - 1;
    check("entries sharing one list", raw(1, |_| 1, n, |_| 0));
    check("one long list", raw(1, |_| (max - 64) / 4, 1, |_| 0));
}
