//! Handoffs are untrusted input: a handoff travels through the engine's router and its
//! clients, so a consumer believes one only when it carries the producer's seal, an
//! HMAC-SHA256 under a key derived from the deployment's secret over every field a load acts
//! on (producer, its epoch and side channel, request, blocks, layers, heads, mode, grant).
//! The consumer checks the seal before it connects anywhere or reads anything.
//!
//! The seal stops an edit by anyone without the secret (a client, the router); the grant a
//! handoff carries ([`crate::wire::connector::Grant`]) stops a holder of the secret that never
//! saw the handoff: the producer answers a lease call only with the grant of that request,
//! which is 16 random bytes known to the producer and to whoever was given the handoff.

use hmac::Mac;

use crate::layout::LayerBase;
use crate::session::{hmac as mac, hmac_state};
use crate::wire::connector::{Handoff, Mode, SEAL_LEN};

const KEY_LABEL: &[u8] = b"kvxfer handoff seal key v1";
const HANDOFF_DOMAIN: &[u8] = b"kvxfer handoff v1\0";
const BYTES_DOMAIN: &[u8] = b"kvxfer handoff bytes v1\0";

/// Why a handoff's seal was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SealError {
    /// The handoff carries no seal, and a secret is configured.
    #[error("the handoff carries no seal (a consumer with a secret loads only sealed handoffs)")]
    Missing,
    /// The seal does not verify: a field was changed after sealing, or another secret sealed it.
    #[error("the handoff's seal does not verify: it was edited, or sealed under another secret")]
    Mismatch,
}

/// The key that seals and checks handoffs: `HMAC-SHA256(secret, label)`.
#[derive(Clone)]
pub struct HandoffKey([u8; 32]);

impl std::fmt::Debug for HandoffKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HandoffKey(..)")
    }
}

impl HandoffKey {
    /// The key of the deployment whose shared secret is `secret`.
    pub fn new(secret: &[u8]) -> HandoffKey {
        HandoffKey(mac(secret, &[KEY_LABEL]))
    }

    /// Seals `h` (replacing any seal it had).
    pub fn seal(&self, h: &mut Handoff) {
        h.seal = Some(mac(&self.0, &[HANDOFF_DOMAIN, &seal_input(h)]));
    }

    /// Checks `h`'s seal.
    pub fn verify(&self, h: &Handoff) -> Result<(), SealError> {
        let seal = h.seal.ok_or(SealError::Missing)?;
        check(&self.0, &[HANDOFF_DOMAIN, &seal_input(h)], &seal)
    }

    /// The seal of opaque bytes (a handoff an engine's plugin writes in its own format).
    pub fn seal_bytes(&self, b: &[u8]) -> [u8; SEAL_LEN] {
        mac(&self.0, &[BYTES_DOMAIN, b])
    }

    /// Checks [`HandoffKey::seal_bytes`]'s seal of `b`.
    pub fn verify_bytes(&self, b: &[u8], seal: &[u8]) -> Result<(), SealError> {
        check(&self.0, &[BYTES_DOMAIN, b], seal)
    }
}

fn check(key: &[u8], parts: &[&[u8]], seal: &[u8]) -> Result<(), SealError> {
    // `verify_slice` compares in constant time.
    hmac_state(key, parts)
        .verify_slice(seal)
        .map_err(|_| SealError::Mismatch)
}

/// Every field of `h` but the seal, each length-prefixed, so that no two handoffs share an
/// input (JSON's spelling plays no part).
fn seal_input(h: &Handoff) -> Vec<u8> {
    let mut v = Vec::with_capacity(128 + 4 * h.blocks.len() + 28 * h.layers.len());
    let bytes = |v: &mut Vec<u8>, b: &[u8]| {
        v.extend_from_slice(&(b.len() as u64).to_le_bytes());
        v.extend_from_slice(b);
    };
    let num = |v: &mut Vec<u8>, n: u64| v.extend_from_slice(&n.to_le_bytes());
    let group = |v: &mut Vec<u8>, blocks: &[u32], nums: [u64; 3], layers: &[LayerBase]| {
        num(v, blocks.len() as u64);
        for b in blocks {
            v.extend_from_slice(&b.to_le_bytes());
        }
        for n in nums {
            num(v, n);
        }
        num(v, layers.len() as u64);
        for l in layers {
            v.extend_from_slice(&l.k.0 .0.to_le_bytes());
            num(v, l.k.1);
            match l.v {
                Some((r, off)) => {
                    v.push(1);
                    v.extend_from_slice(&r.0.to_le_bytes());
                    num(v, off);
                }
                None => v.push(0),
            }
        }
    };
    bytes(&mut v, h.request.as_bytes());
    bytes(&mut v, h.producer.as_bytes());
    let side = h.side_channel.map(|a| a.to_string()).unwrap_or_default();
    bytes(&mut v, side.as_bytes());
    num(&mut v, h.blocks.len() as u64);
    for b in &h.blocks {
        v.extend_from_slice(&b.to_le_bytes());
    }
    for n in [h.tokens, h.compat, h.kv_heads, h.num_blocks, h.epoch] {
        num(&mut v, n);
    }
    num(&mut v, h.layers.len() as u64);
    for l in &h.layers {
        v.extend_from_slice(&l.k.0 .0.to_le_bytes());
        num(&mut v, l.k.1);
        match l.v {
            Some((r, off)) => {
                v.push(1);
                v.extend_from_slice(&r.0.to_le_bytes());
                num(&mut v, off);
            }
            None => v.push(0),
        }
    }
    v.push(match h.mode {
        Mode::Pull => 0,
        Mode::Push => 1,
    });
    match &h.grant {
        Some(g) => {
            v.push(1);
            v.extend_from_slice(&g.0);
        }
        None => v.push(0),
    }
    // Groups after the first, only where there are some: a one-group handoff's input is the
    // one it always was (every field before is length-prefixed or fixed, so the two never meet).
    if !h.groups.is_empty() {
        num(&mut v, h.groups.len() as u64);
        for g in &h.groups {
            group(
                &mut v,
                &g.blocks,
                [g.compat, g.kv_heads, g.num_blocks],
                &g.layers,
            );
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::LayerBase;
    use crate::types::RegionId;
    use crate::wire::connector::{Grant, GRANT_LEN};

    fn handoff() -> Handoff {
        Handoff {
            request: "req-1".into(),
            producer: "prefill-0".into(),
            side_channel: Some("127.0.0.1:7000".parse().unwrap()),
            blocks: vec![3, 4, 9],
            tokens: 40,
            compat: 0xfeed,
            kv_heads: 8,
            num_blocks: 64,
            layers: vec![
                LayerBase {
                    k: (RegionId(1), 0),
                    v: Some((RegionId(1), 4096)),
                },
                LayerBase {
                    k: (RegionId(2), 0),
                    v: None,
                },
            ],
            mode: Mode::Pull,
            epoch: 77,
            grant: Some(Grant([7; GRANT_LEN])),
            seal: None,
            groups: Vec::new(),
        }
    }

    #[test]
    fn a_sealed_handoff_verifies_and_survives_its_encoding() {
        let key = HandoffKey::new(b"s3cret");
        let mut h = handoff();
        assert_eq!(key.verify(&h), Err(SealError::Missing));
        key.seal(&mut h);
        assert_eq!(key.verify(&h), Ok(()));
        let back = Handoff::decode(&h.encode()).unwrap();
        assert_eq!(back, h);
        assert_eq!(key.verify(&back), Ok(()));
        assert_eq!(
            HandoffKey::new(b"other").verify(&h),
            Err(SealError::Mismatch)
        );
    }

    #[test]
    fn every_edit_of_a_sealed_handoff_is_refused() {
        let key = HandoffKey::new(b"s3cret");
        let mut h = handoff();
        key.seal(&mut h);
        type Edit = fn(&mut Handoff);
        let edits: Vec<(&str, Edit)> = vec![
            ("request", |h| h.request.push('x')),
            ("producer", |h| h.producer = "prefill-1".into()),
            ("side channel", |h| {
                h.side_channel = Some("127.0.0.1:7001".parse().unwrap())
            }),
            ("no side channel", |h| h.side_channel = None),
            ("blocks", |h| h.blocks[1] = 5),
            ("fewer blocks", |h| {
                h.blocks.pop();
            }),
            ("tokens", |h| h.tokens += 1),
            ("compat", |h| h.compat ^= 1),
            ("heads", |h| h.kv_heads = 4),
            ("num_blocks", |h| h.num_blocks = 65),
            ("layer offset", |h| h.layers[0].k.1 = 8),
            ("layer region", |h| h.layers[1].k.0 = RegionId(9)),
            ("layer v", |h| h.layers[1].v = Some((RegionId(2), 0))),
            ("mode", |h| h.mode = Mode::Push),
            ("epoch", |h| h.epoch = 0),
            ("grant", |h| h.grant = Some(Grant([8; GRANT_LEN]))),
            ("no grant", |h| h.grant = None),
            ("a group added", |h| h.groups.push(h.group(0).unwrap())),
        ];
        for (what, edit) in edits {
            let mut e = h.clone();
            edit(&mut e);
            assert_eq!(key.verify(&e), Err(SealError::Mismatch), "{what}");
        }
        let mut cut = h.clone();
        cut.seal = cut.seal.map(|mut s| {
            s[31] ^= 1;
            s
        });
        assert_eq!(key.verify(&cut), Err(SealError::Mismatch));
        // A handoff of two groups: every field of the second is sealed too.
        let mut two = handoff();
        two.groups.push(two.group(0).unwrap());
        key.seal(&mut two);
        assert_eq!(key.verify(&two), Ok(()));
        let back = Handoff::decode(&two.encode()).unwrap();
        assert_eq!(key.verify(&back), Ok(()));
        let group_edits: Vec<(&str, Edit)> = vec![
            ("group blocks", |h| h.groups[0].blocks[0] = 99),
            ("group compat", |h| h.groups[0].compat ^= 1),
            ("group heads", |h| h.groups[0].kv_heads = 1),
            ("group num_blocks", |h| h.groups[0].num_blocks = 1),
            ("group layer", |h| h.groups[0].layers[0].k.1 = 1),
            ("group dropped", |h| h.groups.clear()),
        ];
        for (what, edit) in group_edits {
            let mut e = two.clone();
            edit(&mut e);
            assert_eq!(key.verify(&e), Err(SealError::Mismatch), "{what}");
        }
    }

    #[test]
    fn opaque_bytes_seal_apart_from_handoffs() {
        let key = HandoffKey::new(b"s3cret");
        let s = key.seal_bytes(b"{\"request\":\"r\"}");
        assert_eq!(key.verify_bytes(b"{\"request\":\"r\"}", &s), Ok(()));
        assert_eq!(
            key.verify_bytes(b"{\"request\":\"q\"}", &s),
            Err(SealError::Mismatch)
        );
        assert_eq!(
            key.verify_bytes(b"{\"request\":\"r\"}", &s[..31]),
            Err(SealError::Mismatch)
        );
    }
}
