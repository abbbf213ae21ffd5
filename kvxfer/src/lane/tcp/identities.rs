//! Who may name itself what on a sealed lane: each loaded peer's name and the static public
//! key its metadata carried (delivered over an authenticated side channel or sealed in etcd).
//! A lane session's hello names its sender; the target accepts that name only from the
//! initiator that proved this key's private half in the handshake, so no holder of the shared
//! secret can read another reader's grant or send under another agent's name.

use std::collections::HashMap;
use std::sync::RwLock;

use kvxfer_proto::session::PUBLIC_KEY_LEN;

/// A static public key.
pub(crate) type Key = [u8; PUBLIC_KEY_LEN];

/// The loaded peers' lane keys, by name, each with how many lanes towards that peer hold it
/// (a peer's metadata loaded again opens a new lane before the old one goes).
#[derive(Default)]
pub(crate) struct Identities {
    keys: RwLock<HashMap<String, (Key, usize)>>,
}

impl Identities {
    /// `peer` was loaded with `key` (a restarted peer's new key replaces the old one).
    pub(crate) fn learn(&self, peer: &str, key: Key) {
        let mut g = self.keys.write().unwrap_or_else(|e| e.into_inner());
        match g.get_mut(peer) {
            Some((k, n)) if *k == key => *n += 1,
            _ => {
                g.insert(peer.to_string(), (key, 1));
            }
        }
    }

    /// A lane towards `peer`'s incarnation with `key` is gone (a newer incarnation keeps its
    /// own key).
    pub(crate) fn forget(&self, peer: &str, key: &Key) {
        let mut g = self.keys.write().unwrap_or_else(|e| e.into_inner());
        if let Some((k, n)) = g.get_mut(peer) {
            if k == key {
                *n -= 1;
                if *n == 0 {
                    g.remove(peer);
                }
            }
        }
    }

    /// Whether a session that proved `key` may name itself `peer`; why not, for the refusal.
    pub(crate) fn check(&self, peer: &str, key: &Key) -> Result<(), String> {
        let g = self.keys.read().unwrap_or_else(|e| e.into_inner());
        match g.get(peer) {
            Some((k, _)) if k == key => Ok(()),
            Some(_) => Err(format!(
                "the hello names {peer:?}, but the handshake proved another agent's key"
            )),
            None => Err(format!(
                "the hello names {peer:?}, which this agent has not loaded (load its \
                 metadata first: a sealed lane serves only known peers)"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_is_taken_only_with_its_key_and_a_restart_replaces_it() {
        let ids = Identities::default();
        assert!(ids.check("dec", &[1; 32]).is_err(), "unknown");
        ids.learn("dec", [1; 32]);
        assert!(ids.check("dec", &[1; 32]).is_ok());
        assert!(ids.check("dec", &[2; 32]).is_err(), "another key");
        ids.learn("dec", [2; 32]);
        ids.forget("dec", &[1; 32]);
        assert!(
            ids.check("dec", &[2; 32]).is_ok(),
            "the old incarnation's leaving"
        );
        // Loaded again: the old lane goes after the new one came.
        ids.learn("dec", [2; 32]);
        ids.forget("dec", &[2; 32]);
        assert!(
            ids.check("dec", &[2; 32]).is_ok(),
            "one lane still holds it"
        );
        ids.forget("dec", &[2; 32]);
        assert!(ids.check("dec", &[2; 32]).is_err());
    }
}
