//! Job-token authentication: HMAC-SHA256 challenge-response, never the token in clear.
//!
//! Every connection of a job that has a token — to the rendezvous store and between
//! ranks — proves knowledge of it both ways: each side sends a fresh random nonce and
//! answers with `HMAC(token, label ‖ transcript ‖ both nonces)`, the label saying which
//! side speaks so one side's answer cannot be replayed as the other's. A process from
//! another job, or a stranger, learns nothing and is refused.

use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::io::Read;

/// Bytes of a nonce.
pub const NONCE_LEN: usize = 16;
/// Bytes of a MAC.
pub const MAC_LEN: usize = 32;

/// A fresh random nonce from the operating system (falling back to a hash of time and
/// process if /dev/urandom cannot be read).
pub fn nonce() -> [u8; NONCE_LEN] {
    let mut b = [0u8; NONCE_LEN];
    let ok = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut b));
    if ok.is_err() {
        use std::hash::{BuildHasher, Hasher};
        for chunk in b.chunks_mut(8) {
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u128(
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos()),
            );
            h.write_u32(std::process::id());
            chunk.copy_from_slice(&h.finish().to_le_bytes()[..chunk.len()]);
        }
    }
    b
}

/// `HMAC-SHA256(token, label ‖ parts…)`.
pub fn mac(token: &[u8], label: &str, parts: &[&[u8]]) -> [u8; MAC_LEN] {
    // HMAC takes keys of any length, so this cannot fail; if it ever did, an all-zero
    // MAC would simply never verify.
    let Ok(mut m) = <Hmac<Sha256> as Mac>::new_from_slice(token) else {
        return [0; MAC_LEN];
    };
    m.update(label.as_bytes());
    for p in parts {
        m.update(&(p.len() as u64).to_le_bytes());
        m.update(p);
    }
    m.finalize().into_bytes().into()
}

/// Whether `got` is the expected MAC, compared in constant time.
pub fn verify(token: &[u8], label: &str, parts: &[&[u8]], got: &[u8]) -> bool {
    let Ok(mut m) = <Hmac<Sha256> as Mac>::new_from_slice(token) else {
        return false;
    };
    m.update(label.as_bytes());
    for p in parts {
        m.update(&(p.len() as u64).to_le_bytes());
        m.update(p);
    }
    m.verify_slice(got).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn macs_bind_token_label_and_parts() {
        let m = mac(b"secret", "a", &[b"x", b"y"]);
        assert!(verify(b"secret", "a", &[b"x", b"y"], &m));
        assert!(!verify(b"other", "a", &[b"x", b"y"], &m), "another token");
        assert!(!verify(b"secret", "b", &[b"x", b"y"], &m), "another label");
        assert!(
            !verify(b"secret", "a", &[b"xy", b""], &m),
            "parts are length-framed"
        );
        assert!(
            !verify(b"secret", "a", &[b"x", b"y"], &m[..31]),
            "truncated"
        );
        assert_ne!(nonce(), nonce());
    }
}
