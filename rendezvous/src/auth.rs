//! The job key and the cryptography of the rendezvous: HMAC-SHA-256 from RustCrypto's `hmac` and `sha2` crates
//! (tags are checked with the `hmac` crate's constant-time comparison), nonces from the operating system's random
//! source (`getrandom`). Nothing here is hand-written cryptography: this module only decides what is hashed.
//!
//! ## Handshake (protocol version 2)
//!
//! Both sides start by sending their preamble at once (the client: magic and version; rank 0: magic, version and a
//! fresh 32-byte nonce `Ns`). The client then sends its world size, rank, its own fresh nonce `Nc` and the proof
//! `HMAC(K, "client proof" | version | world | rank | Nc | Ns)`. Rank 0 checks that proof before it believes
//! anything the client said, and only then answers with its own proof `HMAC(K, "server proof" | …)` over the same
//! fields. The client checks it before it sends or accepts any payload. Both sides derive the connection's session
//! key `HMAC(K, "session key" | …)`, and every later frame carries `HMAC(session, direction | frame counter | frame)`.
//!
//! - Replaying a captured client handshake fails: rank 0's nonce is new on every connection.
//! - Replaying a captured rank-0 handshake fails: the client's nonce is new on every connection.
//! - A man in the middle cannot change, drop-and-replace, reorder, replay or reflect a later frame: the session key is
//!   per connection, the counter is per direction, and the direction is in the tag.
//! - The client proves itself first, so someone who can merely reach rank 0's port learns nothing that lets them
//!   test guesses of the key offline; only an impostor rank 0 (someone a rank connects to) sees a client proof.
//!   A key from [`JobKey::random`] or 32 random bytes is out of reach of such guessing either way; a short
//!   human-chosen key would not be, which is why the configuration refuses keys shorter than
//!   [`MIN_SECRET_LEN`](crate::config::MIN_SECRET_LEN) bytes.
//!
//! Payloads are authenticated, not encrypted: someone on the path can read what the ranks exchange.

use std::fmt;

use anyccl_core::{Error, Result};
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

use crate::backend_error;

/// Length of a job key, a nonce, a proof and a frame tag (bytes).
pub(crate) const LEN: usize = 32;

type HmacSha256 = Hmac<Sha256>;

const LABEL_JOB_KEY: &[u8] = b"anyccl-rendezvous job key\0";
const LABEL_USER: &[u8] = b"anyccl-rendezvous per-user loopback key\0";
const LABEL_CLIENT_PROOF: &[u8] = b"anyccl-rendezvous v2 client proof\0";
const LABEL_SERVER_PROOF: &[u8] = b"anyccl-rendezvous v2 server proof\0";
const LABEL_SESSION: &[u8] = b"anyccl-rendezvous v2 session key\0";
const LABEL_TO_RANK0: &[u8] = b"anyccl-rendezvous v2 frame to rank 0\0";
const LABEL_FROM_RANK0: &[u8] = b"anyccl-rendezvous v2 frame from rank 0\0";

/// The secret every rank of a job shares; it never goes on the wire (only proofs computed with it do).
///
/// `Debug` prints no part of it.
#[derive(Clone, PartialEq, Eq)]
pub struct JobKey([u8; LEN]);

impl JobKey {
    /// The key for a shared secret (the text of `ANYCCL_RENDEZVOUS_KEY`, a key file's contents): its SHA-256 under a
    /// label of its own.
    pub fn from_secret(secret: &[u8]) -> JobKey {
        JobKey(Sha256::new().chain_update(LABEL_JOB_KEY).chain_update(secret).finalize().into())
    }

    /// A fresh random key from the operating system (for a group whose ranks all get their configuration from
    /// [`Listener::client_config`](crate::Listener::client_config), such as ranks as threads of one process).
    pub fn random() -> Result<JobKey> {
        let mut key = [0u8; LEN];
        fill_random(&mut key)?;
        Ok(JobKey(key))
    }

    /// The key a job uses on a loopback `MASTER_ADDR` when no secret is set: derived from the user's private
    /// secret ([`crate::userkey`], which other users cannot read), the master address text and the port. Every rank
    /// of one user on this host computes the same key; the world size is deliberately not part of it, so a rank
    /// with another world size proves the key and is told at once why the job cannot form.
    pub fn per_user(user_secret: &[u8], master_addr: &str, port: u16) -> JobKey {
        JobKey(
            Sha256::new()
                .chain_update(LABEL_USER)
                .chain_update((user_secret.len() as u64).to_le_bytes())
                .chain_update(user_secret)
                .chain_update(master_addr.as_bytes())
                .chain_update([0u8])
                .chain_update(port.to_le_bytes())
                .finalize()
                .into(),
        )
    }

    /// The key's bytes (what both sides feed to HMAC).
    pub(crate) fn bytes(&self) -> &[u8; LEN] {
        &self.0
    }
}

impl fmt::Debug for JobKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("JobKey(<secret>)")
    }
}

/// Fills `buf` from the operating system's random source.
pub(crate) fn fill_random(buf: &mut [u8]) -> Result<()> {
    getrandom::fill(buf).map_err(|e| backend_error("getrandom", format!("no random numbers from the OS: {e}")))
}

/// A fresh nonce.
pub(crate) fn nonce() -> Result<[u8; LEN]> {
    let mut n = [0u8; LEN];
    fill_random(&mut n)?;
    Ok(n)
}

fn hmac(key: &[u8; LEN]) -> Result<HmacSha256> {
    // HMAC takes a key of any length; this error cannot happen, but is reported rather than unwrapped.
    <HmacSha256 as Mac>::new_from_slice(key).map_err(|e| backend_error("hmac", e.to_string()))
}

/// What a handshake is about: both nonces, the claimed world size and rank, and the protocol version.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Transcript {
    pub version: u32,
    pub world: u64,
    pub rank: u64,
    pub client_nonce: [u8; LEN],
    pub server_nonce: [u8; LEN],
}

impl Transcript {
    fn mac(&self, key: &JobKey, label: &[u8]) -> Result<HmacSha256> {
        let mut m = hmac(key.bytes())?;
        // every field after the label has a fixed length, so the concatenation is unambiguous
        m.update(label);
        m.update(&self.version.to_le_bytes());
        m.update(&self.world.to_le_bytes());
        m.update(&self.rank.to_le_bytes());
        m.update(&self.client_nonce);
        m.update(&self.server_nonce);
        Ok(m)
    }

    /// The client's proof that it holds `key`.
    pub fn client_proof(&self, key: &JobKey) -> Result<[u8; LEN]> {
        Ok(self.mac(key, LABEL_CLIENT_PROOF)?.finalize().into_bytes().into())
    }

    /// Rank 0's proof that it holds `key`.
    pub fn server_proof(&self, key: &JobKey) -> Result<[u8; LEN]> {
        Ok(self.mac(key, LABEL_SERVER_PROOF)?.finalize().into_bytes().into())
    }

    /// Whether `proof` is the client's proof for `key` (constant-time comparison).
    pub fn check_client_proof(&self, key: &JobKey, proof: &[u8]) -> Result<bool> {
        Ok(self.mac(key, LABEL_CLIENT_PROOF)?.verify_slice(proof).is_ok())
    }

    /// Whether `proof` is rank 0's proof for `key` (constant-time comparison).
    pub fn check_server_proof(&self, key: &JobKey, proof: &[u8]) -> Result<bool> {
        Ok(self.mac(key, LABEL_SERVER_PROOF)?.verify_slice(proof).is_ok())
    }

    /// The connection's session: its key, and frame counters at zero.
    pub fn session(&self, key: &JobKey, side: Side) -> Result<Session> {
        let key: [u8; LEN] = self.mac(key, LABEL_SESSION)?.finalize().into_bytes().into();
        Ok(Session { key, side, sent: 0, received: 0 })
    }
}

/// Which end of a connection this is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    /// Rank 0's end.
    Root,
    /// Another rank's end.
    Client,
}

/// The authentication state of one established connection.
pub(crate) struct Session {
    key: [u8; LEN],
    side: Side,
    /// Frames sent so far (the next frame's counter).
    sent: u64,
    /// Frames received so far.
    received: u64,
}

impl fmt::Debug for Session {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Session")
            .field("side", &self.side)
            .field("sent", &self.sent)
            .field("received", &self.received)
            .finish_non_exhaustive()
    }
}

impl Session {
    fn frame_mac(&self, from_root: bool, counter: u64, header: &[u8], payload: &[u8]) -> Result<HmacSha256> {
        let mut m = hmac(&self.key)?;
        m.update(if from_root { LABEL_FROM_RANK0 } else { LABEL_TO_RANK0 });
        m.update(&counter.to_le_bytes());
        m.update(&(header.len() as u64).to_le_bytes());
        m.update(header);
        m.update(payload);
        Ok(m)
    }

    /// The tag of the next frame this side sends (which advances the send counter).
    pub fn seal(&mut self, header: &[u8], payload: &[u8]) -> Result<[u8; LEN]> {
        let counter = self.sent;
        self.sent = counter.checked_add(1).ok_or_else(|| Error::PeerFailure("frame counter exhausted".into()))?;
        Ok(self.frame_mac(self.side == Side::Root, counter, header, payload)?.finalize().into_bytes().into())
    }

    /// Whether `tag` authenticates the next frame from the other side (constant-time comparison); advances the
    /// receive counter only when it does.
    pub fn open(&mut self, header: &[u8], payload: &[u8], tag: &[u8]) -> Result<bool> {
        let counter = self.received;
        let ok = self.frame_mac(self.side == Side::Client, counter, header, payload)?.verify_slice(tag).is_ok();
        if ok {
            self.received =
                counter.checked_add(1).ok_or_else(|| Error::PeerFailure("frame counter exhausted".into()))?;
        }
        Ok(ok)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn transcript() -> Transcript {
        Transcript { version: 2, world: 4, rank: 1, client_nonce: [1; LEN], server_nonce: [2; LEN] }
    }

    #[test]
    fn proofs_bind_every_field_and_the_key() {
        let key = JobKey::from_secret(b"a secret of sixteen+ bytes");
        let t = transcript();
        let proof = t.client_proof(&key).expect("proof");
        assert!(t.check_client_proof(&key, &proof).expect("check"));
        assert!(!t.check_client_proof(&JobKey::from_secret(b"another secret of 16+"), &proof).expect("check"));
        // a client proof is not a server proof (no reflection)
        assert!(!t.check_server_proof(&key, &proof).expect("check"));
        for changed in [
            Transcript { version: 3, ..t },
            Transcript { world: 5, ..t },
            Transcript { rank: 2, ..t },
            Transcript { client_nonce: [9; LEN], ..t },
            Transcript { server_nonce: [9; LEN], ..t },
        ] {
            assert!(!changed.check_client_proof(&key, &proof).expect("check"), "{changed:?}");
        }
        assert!(!t.check_client_proof(&key, &proof[..31]).expect("short proof"));
    }

    #[test]
    fn frames_are_bound_to_direction_counter_and_content() {
        let key = JobKey::from_secret(b"a secret of sixteen+ bytes");
        let t = transcript();
        let mut root = t.session(&key, Side::Root).expect("session");
        let mut client = t.session(&key, Side::Client).expect("session");
        let tag0 = client.seal(b"hdr", b"payload").expect("seal");
        // rank 0 accepts it once, in order
        assert!(root.open(b"hdr", b"payload", &tag0).expect("open"));
        assert!(!root.open(b"hdr", b"payload", &tag0).expect("replay"), "a replayed frame must fail");
        let tag1 = client.seal(b"hdr", b"payload").expect("seal");
        assert!(!root.open(b"hdr", b"payloaD", &tag1).expect("open"), "changed payload");
        assert!(!root.open(b"hdR", b"payload", &tag1).expect("open"), "changed header");
        assert!(root.open(b"hdr", b"payload", &tag1).expect("open"));
        // a frame rank 0 sent cannot be reflected back to it
        let from_root = root.seal(b"hdr", b"x").expect("seal");
        let mut root2 = t.session(&key, Side::Root).expect("session");
        assert!(!root2.open(b"hdr", b"x", &from_root).expect("reflected"));
        // and another connection's session does not accept it
        let mut other = Transcript { client_nonce: [7; LEN], ..t }.session(&key, Side::Client).expect("session");
        assert!(!other.open(b"hdr", b"x", &from_root).expect("other connection"));
        assert!(client.open(b"hdr", b"x", &from_root).expect("the right receiver"));
    }

    #[test]
    fn keys_differ_and_do_not_show() {
        assert_ne!(JobKey::from_secret(b"x"), JobKey::from_secret(b"y"));
        let user = [1u8; 32];
        assert_eq!(JobKey::per_user(&user, "127.0.0.1", 1), JobKey::per_user(&user, "127.0.0.1", 1));
        assert_ne!(JobKey::per_user(&user, "127.0.0.1", 1), JobKey::per_user(&[2u8; 32], "127.0.0.1", 1));
        assert_ne!(JobKey::per_user(&user, "127.0.0.1", 1), JobKey::per_user(&user, "127.0.0.1", 2));
        assert_ne!(JobKey::per_user(&user, "127.0.0.1", 1), JobKey::per_user(&user, "localhost", 1));
        assert_ne!(JobKey::random().expect("random"), JobKey::random().expect("random"));
        assert_eq!(format!("{:?}", JobKey::from_secret(b"x")), "JobKey(<secret>)");
    }
}
