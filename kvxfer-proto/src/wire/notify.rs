//! Notifications on the wire: `u16 name_len | name | payload`, sent after the data of the
//! transfer that carries them has landed. Connector control messages are notifications whose
//! payload starts with one of two 4-byte tags, so that each end routes them to its producer or
//! its consumer instead of the user's queue.

use crate::wire::metadata::MAX_NAME;

/// Largest notification payload.
pub const MAX_NOTIFICATION: usize = 64 * 1024;
/// Bytes of the name-length prefix.
pub const NAME_LEN_BYTES: usize = 2;
/// Largest encoded notification (prefix, longest name, largest payload).
pub const MAX_ENCODED: usize = NAME_LEN_BYTES + MAX_NAME + MAX_NOTIFICATION;
/// Tag of connector control messages addressed to a producer.
pub const TAG_TO_PRODUCER: &[u8; 4] = b"KXCP";
/// Tag of connector control messages addressed to a consumer.
pub const TAG_TO_CONSUMER: &[u8; 4] = b"KXCC";

/// A notification received from a peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Notification {
    /// Sending agent's name.
    pub from: String,
    /// The payload (e.g. a request id).
    pub payload: Vec<u8>,
}

/// Who a notification is for, by its tag.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Recipient {
    /// The user's queue.
    User,
    /// The connector's producer.
    Producer,
    /// The connector's consumer.
    Consumer,
}

impl Notification {
    /// Who this notification is for.
    pub fn recipient(&self) -> Recipient {
        if self.payload.starts_with(TAG_TO_PRODUCER) {
            Recipient::Producer
        } else if self.payload.starts_with(TAG_TO_CONSUMER) {
            Recipient::Consumer
        } else {
            Recipient::User
        }
    }
}

/// Encodes `(from, payload)` for the wire.
pub fn encode(from: &str, payload: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(NAME_LEN_BYTES + from.len() + payload.len());
    v.extend_from_slice(&(from.len() as u16).to_le_bytes());
    v.extend_from_slice(from.as_bytes());
    v.extend_from_slice(payload);
    v
}

/// A payload the caller wants sent must fit [`MAX_NOTIFICATION`].
pub fn check_payload(payload: Option<&[u8]>) -> crate::error::Result<()> {
    match payload {
        Some(n) if n.len() > MAX_NOTIFICATION => {
            Err(crate::error::Error::InvalidArgument(format!(
                "notification of {} bytes, limit {MAX_NOTIFICATION}",
                n.len()
            )))
        }
        _ => Ok(()),
    }
}

/// Decodes a wire notification; `None` for malformed input.
pub fn decode(b: &[u8]) -> Option<Notification> {
    let n = u16::from_le_bytes(b.get(..NAME_LEN_BYTES)?.try_into().ok()?) as usize;
    if n == 0 || n > MAX_NAME {
        return None;
    }
    let from = std::str::from_utf8(b.get(NAME_LEN_BYTES..NAME_LEN_BYTES + n)?)
        .ok()?
        .to_owned();
    let payload = b.get(NAME_LEN_BYTES + n..)?;
    if payload.len() > MAX_NOTIFICATION {
        return None;
    }
    Some(Notification {
        from,
        payload: payload.to_vec(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn roundtrip_and_garbage() {
        let b = encode("decode-1", b"req-42");
        assert_eq!(
            decode(&b),
            Some(Notification {
                from: "decode-1".into(),
                payload: b"req-42".to_vec()
            })
        );
        assert_eq!(decode(&[]), None);
        assert_eq!(decode(&[5, 0, b'a']), None);
        assert_eq!(decode(&[0, 0]), None);
        assert_eq!(decode(&[2, 0, 0xff, 0xfe]), None);
    }

    #[test]
    fn tags_route() {
        let n = |p: &[u8]| Notification {
            from: "a".into(),
            payload: p.to_vec(),
        };
        assert_eq!(n(b"KXCP{}").recipient(), Recipient::Producer);
        assert_eq!(n(b"KXCC{}").recipient(), Recipient::Consumer);
        assert_eq!(n(b"req-1").recipient(), Recipient::User);
    }

    proptest! {
        #[test]
        fn encode_then_decode(name in "[a-z0-9-]{1,255}", payload in proptest::collection::vec(any::<u8>(), 0..4096)) {
            let b = encode(&name, &payload);
            prop_assert!(b.len() <= MAX_ENCODED);
            prop_assert_eq!(decode(&b), Some(Notification { from: name, payload }));
        }

        #[test]
        fn decode_never_panics(b in proptest::collection::vec(any::<u8>(), 0..600)) {
            if let Some(n) = decode(&b) {
                prop_assert_eq!(encode(&n.from, &n.payload), b);
            }
        }
    }
}
