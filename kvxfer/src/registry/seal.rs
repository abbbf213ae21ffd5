//! Metadata at rest in etcd, for agents with a shared secret: sealed with ChaCha20-Poly1305
//! (RustCrypto's maintained crate) under a key derived from the secret, so a reader of etcd
//! without it learns nothing it can use (no worker address, remote key, lane address or lane
//! secret) and cannot plant metadata that a holder of the secret would load. The key's name and
//! the etcd lease the value is written under are bound in as associated data: a sealed value
//! moved to another name does not open, and neither does one written under another lease (an
//! old incarnation's value replayed, or any value put without its owner's lease), since a
//! watcher opens a value with the lease etcd says holds it.
//!
//! `SEALED` (4 bytes) | nonce (12) | ciphertext and tag.

use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{ChaCha20Poly1305, Key, Nonce};
use kvxfer_proto::error::{Error, Result};
use kvxfer_proto::session::hmac;

/// The tag of a sealed value.
pub(super) const SEALED: &[u8; 4] = b"KXSE";
const NONCE: usize = 12;

fn cipher(secret: &[u8]) -> Result<ChaCha20Poly1305> {
    let k = hmac(secret, &[b"kvxfer etcd metadata v2"]);
    Ok(ChaCha20Poly1305::new(Key::from_slice(&k)))
}

/// What a sealed value is bound to: its key and the etcd lease it is written under.
fn bound(key: &str, lease: i64) -> Vec<u8> {
    let mut aad = Vec::with_capacity(key.len() + 9);
    aad.extend_from_slice(&lease.to_be_bytes());
    aad.push(0);
    aad.extend_from_slice(key.as_bytes());
    aad
}

/// `meta` as published under `key` with `lease`: sealed when there is a secret, else as it is.
pub(super) fn seal(secret: Option<&[u8]>, key: &str, lease: i64, meta: &[u8]) -> Result<Vec<u8>> {
    let Some(secret) = secret else {
        return Ok(meta.to_vec());
    };
    let nonce: [u8; NONCE] = crate::random::bytes()?;
    let ct = cipher(secret)?
        .encrypt(
            Nonce::from_slice(&nonce),
            Payload {
                msg: meta,
                aad: &bound(key, lease),
            },
        )
        .map_err(|_| Error::InvalidArgument("sealing metadata failed".into()))?;
    let mut out = Vec::with_capacity(SEALED.len() + NONCE + ct.len());
    out.extend_from_slice(SEALED);
    out.extend_from_slice(&nonce);
    out.extend_from_slice(&ct);
    Ok(out)
}

/// The metadata in a value read from `key`, which etcd holds under `lease` (0: none). A sealed
/// value needs this agent's secret, and an agent with a secret takes sealed values only.
pub(super) fn open(secret: Option<&[u8]>, key: &str, lease: i64, value: &[u8]) -> Result<Vec<u8>> {
    let refuse = |why: &str| Error::Auth {
        peer: format!("etcd key {key}"),
        why: why.to_string(),
    };
    match (secret, value.strip_prefix(SEALED)) {
        (None, None) => Ok(value.to_vec()),
        (None, Some(_)) => Err(refuse(
            "sealed with a shared secret this agent was not given",
        )),
        (Some(_), None) => Err(refuse(
            "published without the shared secret this agent requires (not loaded)",
        )),
        (Some(s), Some(rest)) => {
            if rest.len() < NONCE {
                return Err(refuse("sealed value too short"));
            }
            let (nonce, ct) = rest.split_at(NONCE);
            cipher(s)?
                .decrypt(
                    Nonce::from_slice(nonce),
                    Payload {
                        msg: ct,
                        aad: &bound(key, lease),
                    },
                )
                .map_err(|_| {
                    refuse(
                        "sealed with another shared secret, for another key or lease (an old \
                         incarnation's value replayed, or one put without its owner's lease), \
                         or altered",
                    )
                })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sealed_opens_only_with_the_secret_and_the_name() {
        let meta = b"worker address, rkeys, lane secret".to_vec();
        let v = seal(Some(b"s1"), "/ns/agents/a", 77, &meta).unwrap();
        assert!(v.starts_with(SEALED) && !v.windows(6).any(|w| w == b"worker"));
        assert_eq!(open(Some(b"s1"), "/ns/agents/a", 77, &v).unwrap(), meta);
        for (secret, key, lease) in [
            (Some(&b"s2"[..]), "/ns/agents/a", 77),
            (Some(b"s1"), "/ns/agents/b", 77),
            (Some(b"s1"), "/ns/agents/a", 78),
            (Some(b"s1"), "/ns/agents/a", 0),
            (None, "/ns/agents/a", 77),
        ] {
            assert!(
                matches!(open(secret, key, lease, &v), Err(Error::Auth { .. })),
                "{secret:?} {key} {lease}"
            );
        }
        let mut bad = v.clone();
        let n = bad.len();
        bad[n - 1] ^= 1;
        assert!(open(Some(b"s1"), "/ns/agents/a", 77, &bad).is_err());
        assert!(open(Some(b"s1"), "/ns/agents/a", 77, &meta).is_err());
        assert_eq!(seal(None, "k", 1, &meta).unwrap(), meta);
        assert_eq!(open(None, "k", 2, &meta).unwrap(), meta);
    }
}
