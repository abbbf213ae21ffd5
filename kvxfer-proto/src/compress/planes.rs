//! The byte-plane transforms of 16-bit values: a bijection between a chunk and two planes.
//!
//! ```text
//! bf16   s eeeeeee | e mmmmmmm   →  plane A: eeeeeeee          plane B: s mmmmmmm
//! bytes2 hhhhhhhh | llllllll     →  plane A: hhhhhhhh          plane B: llllllll
//! none   the chunk               →  plane A: the chunk         plane B: empty
//! ```
//!
//! Values are little-endian 16-bit words from the chunk's start; an odd chunk's last byte is
//! appended to plane B as it is.

/// How a frame's chunk is split into planes (its wire code in parentheses).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Transform {
    /// No split: one plane, the chunk (0).
    None,
    /// bfloat16: the exponent byte, then sign and mantissa (1).
    Bf16,
    /// Any 16-bit type (fp16, int16): high bytes, then low bytes (2).
    Bytes2,
}

impl Transform {
    /// The transform's wire code.
    pub fn code(self) -> u8 {
        match self {
            Transform::None => 0,
            Transform::Bf16 => 1,
            Transform::Bytes2 => 2,
        }
    }

    /// The transform of a wire code.
    pub fn from_code(c: u8) -> Option<Transform> {
        match c {
            0 => Some(Transform::None),
            1 => Some(Transform::Bf16),
            2 => Some(Transform::Bytes2),
            _ => None,
        }
    }

    /// The sizes of planes A and B for a chunk of `raw` bytes.
    pub fn plane_sizes(self, raw: usize) -> (usize, usize) {
        match self {
            Transform::None => (raw, 0),
            Transform::Bf16 | Transform::Bytes2 => (raw / 2, raw - raw / 2),
        }
    }
}

/// Splits `raw` into `a` and `b` (cleared, then filled to [`Transform::plane_sizes`]).
pub fn split(t: Transform, raw: &[u8], a: &mut Vec<u8>, b: &mut Vec<u8>) {
    let (na, nb) = t.plane_sizes(raw.len());
    // Sized first, then written through zipped iterators: the loops vectorise (pushing
    // byte by byte measured as slow as zstd itself).
    a.clear();
    b.clear();
    a.resize(na, 0);
    b.resize(nb, 0);
    if t == Transform::None {
        a.copy_from_slice(raw);
        return;
    }
    let words = raw.chunks_exact(2);
    let tail = words.remainder();
    let (bw, bt) = b.split_at_mut(na);
    match t {
        Transform::Bf16 => {
            for ((w, x), y) in words.zip(a.iter_mut()).zip(bw.iter_mut()) {
                *x = (w[1] << 1) | (w[0] >> 7);
                *y = (w[1] & 0x80) | (w[0] & 0x7f);
            }
        }
        _ => {
            for ((w, x), y) in words.zip(a.iter_mut()).zip(bw.iter_mut()) {
                *x = w[1];
                *y = w[0];
            }
        }
    }
    bt.copy_from_slice(tail);
}

/// Joins planes `a` and `b` back into `out`, whose length is the chunk's; `None` when the
/// planes' sizes do not match it.
pub fn join(t: Transform, a: &[u8], b: &[u8], out: &mut [u8]) -> Option<()> {
    if t.plane_sizes(out.len()) != (a.len(), b.len()) {
        return None;
    }
    if t == Transform::None {
        out.copy_from_slice(a);
        return Some(());
    }
    let n = a.len();
    let (bw, bt) = b.split_at(n);
    let (ow, ot) = out.split_at_mut(2 * n);
    match t {
        Transform::Bf16 => {
            for ((w, &e), &sm) in ow.chunks_exact_mut(2).zip(a).zip(bw) {
                w[0] = (e << 7) | (sm & 0x7f);
                w[1] = (sm & 0x80) | (e >> 1);
            }
        }
        _ => {
            for ((w, &h), &l) in ow.chunks_exact_mut(2).zip(a).zip(bw) {
                w[0] = l;
                w[1] = h;
            }
        }
    }
    ot.copy_from_slice(bt);
    Some(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn bf16_planes_hold_the_exponent_and_the_sign_and_mantissa() {
        // 1.0 = 0x3f80: exponent 127, mantissa 0; -2.5 = 0xc020: exponent 128, sign, 0x20.
        let raw = [0x80, 0x3f, 0x20, 0xc0];
        let (mut a, mut b) = (Vec::new(), Vec::new());
        split(Transform::Bf16, &raw, &mut a, &mut b);
        assert_eq!(a, [127, 128]);
        assert_eq!(b, [0x00, 0x80 | 0x20]);
    }

    #[test]
    fn mismatched_planes_are_refused() {
        let mut out = [0u8; 5];
        assert_eq!(join(Transform::Bf16, &[1, 2], &[3, 4], &mut out), None);
        assert_eq!(join(Transform::None, &[1], &[], &mut out), None);
    }

    proptest! {
        #[test]
        fn split_then_join_is_the_identity(raw in proptest::collection::vec(any::<u8>(), 0..300),
                                           t in 0u8..3) {
            let t = Transform::from_code(t).unwrap();
            let (mut a, mut b) = (Vec::new(), Vec::new());
            split(t, &raw, &mut a, &mut b);
            prop_assert_eq!((a.len(), b.len()), t.plane_sizes(raw.len()));
            let mut out = vec![0u8; raw.len()];
            prop_assert_eq!(join(t, &a, &b, &mut out), Some(()));
            prop_assert_eq!(out, raw);
        }
    }
}
